"""Generations that outlive their runner: each request's journal, its resume on the next runner, and the request that
kills its runner found and quarantined (docs/resume.md).

Worker side. A ``Resumable`` is the handle the API reads a generation from. It records what every chunk says the
runner produced (token ids, the draw's state), and when the runner dies under it, it waits for the instance's next
life (or another ready replica) and hands the same request to it with a ``Resume``: the engine restores the prompt
and those tokens and goes on from the next one, so the client sees a pause. What cannot resume fails as before, with
the cause and why not.

A request in flight at ``SUSPECT_AT`` deaths is a suspect: suspects resume in groups (``Prover``), half of the group
that died each time, away from each other, until one that kills its runner alone is proven. It fails with its deaths
as the cause, and the same request is refused for ``quarantine`` seconds (``Quarantine``). Deaths during a trial do
not count towards the instance's crash loop, and a proven request's earlier ones are forgiven (``Resumes.role``).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal

import anyio
import msgspec

from tether.clock import Clock
from tether.errors import InvalidField, TetherError
from tether.node.instance import (
    Instance,
    InstanceFailed,
    InstanceReady,
    InstanceRestarting,
    InstanceStopped,
    InstanceStopping,
)
from tether.node.tasks import CancelReply, RunnerUnavailable, TaskEvent, TaskHandle
from tether.protocol import (
    Cause,
    Chunk,
    GenerateParams,
    Resume,
    TaskState,
    TaskStatus,
    Work,
    documented,
)

log = logging.getLogger("tether.fleet.resume")

SUSPECT_AT = 2  # deaths a request was in flight at before it is suspected of causing them
LIVES_KEPT = 256  # (replica, life) pairs remembered for the restart policy's questions
PAUSES_KEPT = 1024  # the latest pauses, for the metrics' quantiles

Role = Literal["trial", "held"]


class ResumePolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an instance does with the requests its runner held when it died: resume them (``enabled``) at most
    ``limit`` times each (a suspect's trials aside: they are bounded by the bisection), and refuse a request proven to
    kill its runner for ``quarantine`` seconds. ``store``: the engine keeps its prompt cache's saved sequences where
    the next runner finds them (``tether.node.stores``), so a resumed request's prompt is restored, not prefilled."""

    enabled: bool = True
    limit: Annotated[int, documented(minimum=0, maximum=64)] = 2
    quarantine: Annotated[float, documented(minimum=0)] = 600.0
    store: bool = True

    def check(self) -> InvalidField | None:
        if isinstance(self.limit, bool) or not 0 <= self.limit <= 64:
            return InvalidField("resume", f"resume.limit must be in [0, 64] resumes a request, got {self.limit}")
        if not math.isfinite(self.quarantine) or self.quarantine < 0:
            return InvalidField("resume", f"resume.quarantine must be >= 0 s, got {self.quarantine}")
        return None


def policy_of(value: bool | ResumePolicy) -> ResumePolicy:
    """The policy a config's ``resume`` field means: ``false`` is today's failing with the cause, ``true`` the
    defaults."""
    if isinstance(value, ResumePolicy):
        return value
    return ResumePolicy(enabled=bool(value))


@dataclass(eq=False)
class Journal:
    """One generation as the worker knows it: its request, what its runners produced, and the deaths it saw."""

    request_id: str
    params: Work
    ids: list[int] = field(default_factory=list)
    draws: int = 0
    seed: int | None = None
    tokens: int = 0  # completion tokens sent to the client, every life's
    tracked: bool = True  # every token came with its id: a resume can restore them
    deaths: list[Cause] = field(default_factory=list)
    lives: list[tuple[str, int]] = field(default_factory=list)  # (replica, life) of each death
    resumed: int = 0  # resumes, trials included
    trials: int = 0  # of those, as a suspect
    last_chunk: float | None = None  # when the last chunk came (the clock's time), for the pause a resume costs
    paused_since: float | None = None  # set at a death: the next chunk ends the pause

    def resume_params(self) -> Work:
        """The request as a new runner takes it: a generation with where it stood (no token yet is a resume too: an
        unseeded draw keeps its seed once one was sent); anything else as it was."""
        params = self.params
        if not isinstance(params, GenerateParams):
            return params
        return msgspec.structs.replace(params, resume=Resume(tuple(self.ids), self.draws, self.seed))


def request_key(params: Work) -> str:
    """A request's identity for the quarantine: its parameters, byte for byte, without the worker's resume."""
    if isinstance(params, GenerateParams) and params.resume is not None:
        params = msgspec.structs.replace(params, resume=None)
    return hashlib.blake2b(msgspec.msgpack.encode(params), digest_size=16).hexdigest()


class Quarantine:
    """Requests proven to kill their runner, refused until their time is up (by the injected clock)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._until: dict[str, tuple[float, str]] = {}

    def add(self, params: Work, seconds: float, why: str) -> None:
        if seconds > 0:
            self._until[request_key(params)] = (self.clock.now() + seconds, why)

    def refusal(self, params: Work) -> tuple[float, str] | None:
        """(seconds left, why) when ``params`` is quarantined, else None."""
        now = self.clock.now()
        for key in [k for k, (until, _) in self._until.items() if until <= now]:
            del self._until[key]
        found = self._until.get(request_key(params))
        return None if found is None else (found[0] - now, found[1])

    def __len__(self) -> int:
        return len(self._until)


class Prover:
    """Suspects resume in trials: a group at a time, the others paused. A group that dies while resumed holds the
    culprit: its first half is tried next, and if that half ends without a death, the other half. A group of one that
    dies alone is proven; then, or when no suspect is left, everyone waiting resumes together. With one culprit among
    ``n`` suspects that is at most ``ceil(log2 n) + 1`` deaths."""

    def __init__(self) -> None:
        self.hot: list[Journal] = []  # a group known to hold the culprit, waiting
        self.cold: list[Journal] = []  # suspects not yet tried
        self.trial: set[Journal] = set()  # resumed now
        self.released: set[Journal] = set()  # may resume as healthy requests (a culprit was found, or none is left)
        self._size = 0  # the trial's members when it began (0: no trial)
        self._died: list[Journal] = []  # its members that died
        self._rest: list[Journal] = []  # the part of a hot group not in the trial: hot again if the trial passes
        self._turn = anyio.Event()

    def died(self, journal: Journal) -> bool:
        """``journal`` died in flight as a suspect; True when that proves it (it died alone in its trial)."""
        if journal in self.trial:
            if self._size == 1:
                self._release_all()
                return True
            self.trial.discard(journal)
            self._died.append(journal)
            self._over()
        elif journal not in self.hot and journal not in self.cold and journal not in self._rest:
            self.cold.append(journal)
        return False

    def ended(self, journal: Journal) -> None:
        """``journal`` ended without a death of its runner (completed, cancelled, failed for another reason)."""
        self.released.discard(journal)
        for group in (self.hot, self.cold, self._rest, self._died):
            if journal in group:
                group.remove(journal)
        if journal in self.trial:
            self.trial.discard(journal)
            self._over()

    def may_go(self, journal: Journal) -> bool:
        return journal in self.trial or journal in self.released

    async def turn(self, journal: Journal) -> None:
        """Wait until ``journal`` is in the trial (or released)."""
        while not self.may_go(journal):
            self._next()
            if self.may_go(journal):
                return
            event = self._turn
            await event.wait()

    def _over(self) -> None:
        """Once every member of the trial is back (dead) or ended: a death puts the culprit among those that died;
        none clears them, and leaves it in the rest of the hot group (if the trial was half of one)."""
        if self.trial or not self._size:
            return
        if self._died:
            self.hot, self.cold = self._died, self._rest + self.cold
        else:
            self.hot = self._rest
        self._size, self._died, self._rest = 0, [], []
        if not self.hot and not self.cold:
            self._release_all()
        else:
            self._next()

    def _next(self) -> None:
        """Between trials: the first half of the hot group, else the first half of the cold."""
        if self._size or not (self.hot or self.cold):
            return
        if self.hot:
            size = max(1, len(self.hot) // 2)
            chosen, self._rest, self.hot = self.hot[:size], self.hot[size:], []
        else:
            size = math.ceil(len(self.cold) / 2)
            chosen, self.cold = self.cold[:size], self.cold[size:]
        self.trial, self._size = set(chosen), len(chosen)
        self._wake()

    def _release_all(self) -> None:
        self.released.update(self.hot, self.cold, self.trial, self._rest, self._died)
        self.hot, self.cold, self.trial, self._rest, self._died, self._size = [], [], set(), [], [], 0
        self._wake()

    def _wake(self) -> None:
        self._turn.set()
        self._turn = anyio.Event()


class Resumes:
    """One instance's resumes: its policy, quarantine and prover, the lives that held requests (which the restart
    policy asks about), and the counts the metrics serve."""

    def __init__(self, instance: str, policy: ResumePolicy, clock: Clock) -> None:
        self.instance = instance
        self.policy = policy
        self.clock = clock
        self.quarantine = Quarantine(clock)
        self.prover = Prover()
        self.resumed: collections.Counter[str] = collections.Counter()  # by the cause kind that forced it
        # by why not: untracked, limit, instance (failed or stopped), backoff (too far), timeout
        self.not_resumed: collections.Counter[str] = collections.Counter()
        self.proven = 0
        self.pauses: collections.deque[float] = collections.deque(maxlen=PAUSES_KEPT)  # last chunk -> next, seconds
        self._lives: dict[tuple[str, int], Role] = {}
        self._resumed_from: collections.Counter[tuple[str, int]] = collections.Counter()  # (replica, life) that died
        self._forgiven: dict[str, Callable[[list[int]], None]] = {}  # replica -> its backoff's forgive

    def pause_quantile(self, q: float) -> float | None:
        """The ``q`` quantile of the latest pauses (nearest rank), None before the first resume."""
        if not self.pauses:
            return None
        ordered = sorted(self.pauses)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    def attach(self, replica: Instance) -> None:
        """Answer ``replica``'s restart policy about its lives, and let a proof forgive the deaths it caused."""
        replica.held = lambda life, name=replica.name: self.role(name, life)
        self._forgiven[replica.name] = replica.forgive

    def role(self, replica: str, life: int) -> Role | None:
        """What the life that just died held: a suspect's trial ("trial": the death is not counted against the
        instance before the trial says whose it is), requests ("held": its first restart is not delayed) or none
        (resume off: nothing waits for the next life)."""
        return self._lives.get((replica, life)) if self.policy.enabled else None

    def count(self, cause: str, died: tuple[str, int]) -> None:
        """A request resumed after ``cause`` killed the life ``died`` (replica, life)."""
        self.resumed[cause] += 1
        self._resumed_from[died] += 1
        while len(self._resumed_from) > LIVES_KEPT:
            del self._resumed_from[next(iter(self._resumed_from))]

    def resumed_from(self, replica: str, life: int) -> int:
        """How many requests the death of ``replica``'s ``life`` resumed (its history shows it)."""
        return self._resumed_from[(replica, life)]

    def hold(self, replica: str, life: int, trial: bool) -> None:
        key = (replica, life)
        if trial or key not in self._lives:
            self._lives[key] = "trial" if trial else "held"
        while len(self._lives) > LIVES_KEPT:
            del self._lives[next(iter(self._lives))]

    def forgive(self, lives: list[tuple[str, int]]) -> None:
        """A proven request's deaths leave the crash-loop count."""
        by_replica: dict[str, list[int]] = {}
        for replica, life in lives:
            by_replica.setdefault(replica, []).append(life)
        for replica, numbers in by_replica.items():
            forgive = self._forgiven.get(replica)
            if forgive is not None:
                forgive(numbers)


Mover = Callable[[Instance, Instance], None]  # (from, to): the fleet's per-replica counts follow a moved request


class Resumable:
    """A generation's handle (``TaskHandle``'s reading side) that survives its runner's death where it can."""

    def __init__(
        self,
        journal: Journal,
        handle: TaskHandle,
        replica: Instance,
        replicas: Callable[[], Instance | None],
        resumes: Resumes,
        moved: Mover,
    ) -> None:
        self.journal = journal
        self.task_id = handle.task_id
        self.kind = handle.kind
        self.replica = replica
        self.final: TaskStatus | None = None
        self._inner = handle
        self._pick = replicas
        self._resumes = resumes
        self._moved = moved
        self._pending: TaskStatus | None = None
        self._cancelled = False
        self._waiting: anyio.CancelScope | None = None  # while it waits to resume: a cancel ends the wait
        self._life = _life_of(replica)
        self._ended = False
        resumes.hold(replica.name, self._life, trial=False)

    # --- the handle -------------------------------------------------------------------------------------------

    def __aiter__(self) -> Resumable:
        return self

    async def __anext__(self) -> TaskEvent:
        while self.final is None:
            if self._pending is not None:
                status, self._pending = self._pending, None
                ended = await self._after_death(status)
                if ended is not None:
                    return self._end(ended)
                continue
            try:
                event = await self._inner.__anext__()
            except StopAsyncIteration:
                break
            seen = self._see(event)
            if seen is not None:
                return seen
        raise StopAsyncIteration

    def close(self) -> None:
        self._inner.close()
        if not self._ended:
            self._ended = True
            self._resumes.prover.ended(self.journal)

    async def cancel(self) -> CancelReply:
        """Cancel it: on its runner, or, while it waits to resume, here (it ends CANCELLED)."""
        self._cancelled = True
        if self._pending is not None or self._waiting is not None:
            if self._waiting is not None:
                self._waiting.cancel()
            return CancelReply(self.task_id, "requested", "cancelled while it waited to resume")
        sup = self.replica.supervisor
        if sup is None:
            return CancelReply(self.task_id, "runner_gone", "the runner is gone; the request ends with its cause")
        return await sup.cancel(self.task_id)

    # --- what the runner says ---------------------------------------------------------------------------------

    def _see(self, event: TaskEvent) -> TaskEvent | None:
        """Record what ``event`` says; the event to hand on (None: a death, kept for ``_after_death``)."""
        journal = self.journal
        if isinstance(event, Chunk):
            if event.tokens:
                if len(event.ids) == event.tokens:
                    journal.ids.extend(event.ids)
                    journal.draws, journal.seed = event.draws, event.seed
                else:
                    journal.tracked = False
                journal.tokens += event.tokens
            if event.tokens or event.text or event.finish_reason is not None:
                now = self._resumes.clock.now()
                if journal.paused_since is not None:
                    self._resumes.pauses.append(now - journal.paused_since)
                    journal.paused_since = None
                journal.last_chunk = now
            if event.finish_reason is not None and journal.resumed:
                return msgspec.structs.replace(event, resumed=journal.resumed)
            return event
        if isinstance(event, TaskStatus) and event.state.terminal:
            if event.state is TaskState.FAILED and event.cause is not None and self._resumes.policy.enabled:
                self._pending = event
                return None
            return self._end(event)
        return event

    def _end(self, status: TaskStatus) -> TaskStatus:
        if status.tokens != self.journal.tokens:
            status = msgspec.structs.replace(status, tokens=self.journal.tokens)
        self.final = status
        self.close()
        return status

    # --- a death ----------------------------------------------------------------------------------------------

    async def _after_death(self, status: TaskStatus) -> TaskStatus | None:
        """Resume after the death ``status`` reports; None once resumed, else the status that ends the request."""
        journal, resumes = self.journal, self._resumes
        cause = status.cause
        assert cause is not None
        if self._cancelled:  # its client asked to cancel it: it ends so, not with a death that no longer matters
            return TaskStatus(self.task_id, TaskState.CANCELLED, "cancelled", tokens=journal.tokens)
        journal.deaths.append(cause)
        journal.lives.append((self.replica.name, self._life))
        journal.paused_since = journal.last_chunk or resumes.clock.now()
        prover = resumes.prover
        suspect = len(journal.deaths) >= SUSPECT_AT and journal not in prover.released
        if suspect and prover.died(journal):
            return self._proven(status)
        why = self._why_not(suspect)
        if why is not None:
            return self._refused(status, *why)
        self._waiting = anyio.CancelScope()
        try:
            with self._waiting, anyio.fail_after(self._wait_bound()):
                replica = await self._ready_replica()
                if suspect:  # chosen once a runner is ready: every suspect of the death is back by then
                    await prover.turn(journal)
                trial = suspect and journal not in prover.released
                while True:
                    tried = replica.state
                    try:
                        await self._resubmit(replica, trial)
                        return None
                    except RunnerUnavailable:  # it died before taking it: once its instance knows, the next life
                        await replica.wait_state(functools.partial(operator.is_not, tried), self._wait_bound())
                        replica = await self._ready_replica()
        except NotResumable as exc:
            return self._refused(status, exc.reason, str(exc))
        except TimeoutError:
            return self._refused(status, "timeout", f"no runner was ready to resume it within {self._wait_bound():g} s")
        finally:
            self._waiting = None
        return TaskStatus(
            self.task_id, TaskState.CANCELLED, "cancelled while it waited to resume", tokens=journal.tokens
        )

    def _why_not(self, suspect: bool) -> tuple[str, str] | None:
        """(reason, why in words) it cannot resume, or None."""
        journal, policy = self.journal, self._resumes.policy
        if not journal.tracked:
            return "untracked", "its engine does not say which tokens it generated (ids), so nothing can continue them"
        if not suspect and journal.resumed - journal.trials >= policy.limit:
            return (
                "limit",
                f"it was resumed {journal.resumed} times already (the instance's resume.limit is {policy.limit})",
            )
        return None

    def _wait_bound(self) -> float:
        """How long a resume may wait for a runner: a load's and a warm-up's deadlines."""
        deadlines = self.replica.deadlines
        return deadlines.load_stall + deadlines.warmup

    async def _ready_replica(self) -> Instance:
        """A runner that can take the request: another ready replica, or the next life of the one it died on. A
        restart further away than a stream may go without a token (``token_gap``), or none at all, is
        ``NotResumable``: the client is told now, not after the backoff."""
        replica = self.replica
        while True:
            other = self._pick()
            if other is not None and (other is not replica or _life_of(other) not in (0, self._life)):
                return other
            state = replica.state
            if isinstance(state, InstanceFailed | InstanceStopped | InstanceStopping):
                raise NotResumable("instance", f"its instance cannot serve: {replica.unavailable_reason()}")
            if isinstance(state, InstanceRestarting):
                wait = state.resume_at - replica.settings.clock.now()
                if wait > replica.deadlines.token_gap:
                    raise NotResumable(
                        "backoff",
                        f"its instance restarts in {wait:.0f} s (its backoff), longer than a stream may go without a "
                        f"token (the token_gap deadline, {replica.deadlines.token_gap:g} s)",
                    )
            await replica.wait_state(functools.partial(operator.is_not, state), self._wait_bound())

    async def _resubmit(self, replica: Instance, trial: bool) -> None:
        """Hand the journal's request to ``replica``'s runner (``RunnerUnavailable`` if it cannot take it)."""
        journal = self.journal
        life = _life_of(replica)
        handle = await replica.generate(journal.resume_params(), self.task_id)
        if replica is not self.replica:
            self._moved(self.replica, replica)
        self.replica, self._life, self._inner = replica, life, handle
        self._resumes.hold(replica.name, life, trial=trial)
        journal.resumed += 1
        journal.trials += trial
        self._resumes.count(journal.deaths[-1].kind.value, journal.lives[-1])
        log.info(
            "request %s resumed on %s (life %d) after %d tokens: %s",
            self.task_id,
            replica.name,
            life,
            len(journal.ids),
            journal.deaths[-1].summary,
        )

    def _refused(self, status: TaskStatus, reason: str, why: str) -> TaskStatus:
        """The death's status, saying why the request could not resume (``reason``: the metrics' label)."""
        self._resumes.not_resumed[reason] += 1
        cause = status.cause
        assert cause is not None
        summary = f"{cause.summary}; not resumed: {why}"
        return msgspec.structs.replace(
            status, error=summary, cause=msgspec.structs.replace(cause, summary=summary), tokens=self.journal.tokens
        )

    def _proven(self, status: TaskStatus) -> TaskStatus:
        """It killed its runner alone: fail it with its deaths, quarantine it, forgive the instance those deaths."""
        journal, resumes = self.journal, self._resumes
        deaths = "; ".join(cause.summary for cause in journal.deaths)
        summary = (
            f"this request's runner died {len(journal.deaths)} times while generating it, the last time with it "
            f"alone: {deaths}. It is refused for {resumes.policy.quarantine:g} s (the instance's resume.quarantine)"
        )
        cause = msgspec.structs.replace(journal.deaths[-1], summary=summary)  # the last death's evidence
        resumes.quarantine.add(journal.params, resumes.policy.quarantine, summary)
        resumes.forgive(journal.lives)
        resumes.proven += 1
        log.error("request %s quarantined: %s", self.task_id, summary)
        return msgspec.structs.replace(status, error=summary, cause=cause, tokens=journal.tokens)


class NotResumable(TetherError):
    """Why a request cannot resume now (the instance failed, or restarts too late): ``reason`` for the metrics."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason


def _life_of(replica: Instance) -> int:
    state = replica.state
    return state.life if isinstance(state, InstanceReady) else 0
