"""Model instances and their restart policy.

An ``Instance`` is one model instance served by a sequence of runner *lives*, one ``RunnerLife`` at a time
(``tether.node.life``: a local supervisor, a rank group or a remote life). When a life fails, the ``RestartPolicy``
decides: stay failed, or start a replacement after a backoff; a crash loop ends the restarts with the last cause and
the history of causes. A replacement starts only after the old runner is reaped *and* its process group holds no
live process, so it never competes with its predecessor (or its helpers) for memory, devices, ports or files; and
placement (does the model fit) is awaited before every life, by the fit check or a ``Placer`` (the scheduler).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import random
import re
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Annotated, Literal, Protocol

import anyio
import msgspec
from anyio.abc import TaskGroup

from tether.errors import InvalidField, TetherError
from tether.node import fit
from tether.node.fit import DoesNotFit, FitResult, MeasuredFit
from tether.node.gone import NotGone
from tether.node.hangs import Deadlines
from tether.node.life import RunnerLife
from tether.node.listeners import Listeners
from tether.node.output import DEFAULT_BACKUPS
from tether.node.settings import DEFAULT, SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.node.tasks import RunnerUnavailable, TaskFailed, TaskHandle
from tether.protocol import Cause, CauseKind, EngineSpec, Work, documented, phase_of

log = logging.getLogger("tether.node.instance")
# Failed lives (and runner pids) an instance remembers, with their evidence and their runner log files (a life that
# falls out of the history takes its log with it: a runner killed every 5 s for a week left 120,000 files, none of
# them readable through the API); ``failures`` counts them all. 64 lives: the last five minutes of a fast crash loop.
HISTORY_LIMIT = 64

LOG_BACKUPS_LIMIT = max(DEFAULT_BACKUPS, 16)  # rotated backups looked for beside a forgotten life's log

RestartMode = Literal["never", "on-failure"]

# --------------------------------------------------------------------------------------------------------------
# Policy and backoff (pure: no I/O, no clock of their own)
# --------------------------------------------------------------------------------------------------------------


class RestartPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When and how fast to replace a failed runner.

    ``jitter`` is a fraction: each delay is scaled by a uniform factor in ``[1 - jitter, 1 + jitter]`` so instances
    that failed together do not restart in lockstep, and is never longer than ``max_backoff``. ``healthy_after``
    seconds of Ready reset the backoff to ``initial_backoff`` (a crash a day never leaves an instance on the longest
    backoff for ever). The crash-loop limit counts failures in a sliding window only (a healthy period does not clear
    it): ``crash_loop_failures`` failures within ``crash_loop_window`` seconds and the instance stays failed.
    ``give_up_on`` lists causes a restart cannot fix (a model or options the engine refuses): they fail the instance
    at once instead of burning the crash-loop budget.
    """

    mode: RestartMode = "on-failure"
    initial_backoff: Annotated[float, documented(exclusiveMinimum=0)] = 0.5
    max_backoff: Annotated[float, documented(exclusiveMinimum=0, description=">= initial_backoff")] = 30.0
    factor: Annotated[float, documented(minimum=1)] = 2.0
    jitter: Annotated[float, documented(minimum=0, exclusiveMaximum=1)] = 0.1
    healthy_after: Annotated[float, documented(minimum=0)] = 60.0
    crash_loop_failures: Annotated[int, documented(minimum=1)] = 5
    crash_loop_window: Annotated[float, documented(exclusiveMinimum=0)] = 300.0
    give_up_on: tuple[CauseKind, ...] = (CauseKind.LOAD_ERROR,)

    def __post_init__(self) -> None:
        problem = self.check()
        if problem is not None:
            raise InvalidField("restart", f"invalid restart policy: {problem}")

    def check(self) -> str | None:
        """Return why this policy is invalid, or None."""
        if self.mode not in ("never", "on-failure"):
            return f"mode must be 'never' or 'on-failure', got {self.mode!r}"
        for name in ("initial_backoff", "max_backoff", "factor", "jitter", "healthy_after", "crash_loop_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                return f"{name} must be a finite number, got {value!r}"
        if self.initial_backoff <= 0:
            return f"initial_backoff must be > 0 s, got {self.initial_backoff:g}"
        if self.max_backoff < self.initial_backoff:
            return f"max_backoff ({self.max_backoff:g} s) must be >= initial_backoff ({self.initial_backoff:g} s)"
        if self.factor < 1:
            return f"factor must be >= 1 (a backoff never shrinks between failures), got {self.factor:g}"
        if not 0 <= self.jitter < 1:
            return f"jitter must be a fraction in [0, 1), got {self.jitter:g}"
        if self.healthy_after < 0:
            return f"healthy_after must be >= 0 s, got {self.healthy_after:g}"
        if isinstance(self.crash_loop_failures, bool) or not isinstance(self.crash_loop_failures, int):
            return f"crash_loop_failures must be an integer, got {self.crash_loop_failures!r}"
        if self.crash_loop_failures < 1:
            return f"crash_loop_failures must be >= 1, got {self.crash_loop_failures}"
        if self.crash_loop_window <= 0:
            return f"crash_loop_window must be > 0 s, got {self.crash_loop_window:g}"
        return None


def remove_logs(paths: Iterable[str | None]) -> None:
    """Delete runner log files (and their rotated ``.1`` ... backups) of lives no longer remembered; a file already
    gone, or on another node, is no error."""
    for path in paths:
        if not path:
            continue
        base = Path(path)
        for candidate in (base, *(base.with_name(f"{base.name}.{i}") for i in range(1, LOG_BACKUPS_LIMIT + 1))):
            try:
                candidate.unlink()
            except FileNotFoundError:
                if candidate is not base:
                    break  # backups are numbered without gaps
            except OSError as exc:
                log.warning("cannot remove the runner log %s of a forgotten life: %s", candidate, exc)


class Backoff:
    """The restart schedule of one instance: consecutive failures, their delays, and the crash-loop window.

    Pure logic: callers pass the time (``now``, any monotonic clock) and may inject the random source, so the
    schedule is testable without waiting.
    """

    def __init__(self, policy: RestartPolicy, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.rng = rng if rng is not None else random.Random()
        self.attempt = 0  # consecutive failures since the last healthy period
        # (time, life) of the failures within the crash-loop window; no more than the limit matter (``crash_looping``).
        self._failures: collections.deque[tuple[float, int]] = collections.deque(maxlen=policy.crash_loop_failures)

    def base_delay(self, attempt: int) -> float:
        """The delay before restart number ``attempt`` (1-based) of a streak, without jitter, capped."""
        if attempt < 1:
            raise ValueError(f"attempt numbers start at 1, got {attempt}")
        p = self.policy
        try:
            delay = p.initial_backoff * p.factor ** (attempt - 1)
        except OverflowError:
            return p.max_backoff
        return min(delay, p.max_backoff)

    def delay_for(self, attempt: int) -> float:
        """``base_delay`` with jitter applied (consumes one draw of ``rng``); never above ``max_backoff``."""
        spread = self.policy.jitter
        factor = 1.0 + self.rng.uniform(-spread, spread) if spread else 1.0
        return min(self.base_delay(attempt) * factor, self.policy.max_backoff)

    def record_failure(self, now: float, life: int = 0) -> int:
        """Count a failure at ``now`` (of ``life``); return its attempt number within the current streak (1 after a
        reset)."""
        self.attempt += 1
        self._failures.append((now, life))
        self._prune(now)
        return self.attempt

    def forgive(self, lives: Iterable[int]) -> int:
        """Forget the failures of ``lives`` (a request proven to have caused them): they leave the crash-loop window
        and the streak. Returns how many were forgotten."""
        gone = set(lives)
        kept = [(at, life) for at, life in self._failures if life not in gone]
        forgotten = len(self._failures) - len(kept)
        self._failures.clear()
        self._failures.extend(kept)
        self.attempt = max(self.attempt - forgotten, 0)
        return forgotten

    def record_healthy(self) -> None:
        """A life stayed healthy long enough: the next failure starts from ``initial_backoff`` again."""
        self.attempt = 0

    def failures_in_window(self, now: float) -> int:
        self._prune(now)
        return len(self._failures)

    def crash_looping(self, now: float) -> bool:
        """True when ``crash_loop_failures`` failures happened within the last ``crash_loop_window`` seconds."""
        return self.failures_in_window(now) >= self.policy.crash_loop_failures

    def _prune(self, now: float) -> None:
        horizon = now - self.policy.crash_loop_window
        while self._failures and self._failures[0][0] <= horizon:
            self._failures.popleft()


# --------------------------------------------------------------------------------------------------------------
# Instance state (structs, so the API can serve them as JSON as they are)
# --------------------------------------------------------------------------------------------------------------


class Failure(msgspec.Struct, frozen=True):
    """One runner life that failed: when (wall clock, ``time.time()``), why, which life and which pid, and how long
    the supervisor took to end every task with the cause (from the exit, or from the hang's deadline)."""

    at: float
    cause: Cause
    life: int
    pid: int | None
    detected_in: float | None = None
    log: str | None = None  # the life's runner log file (on its node, for a remote runner)


class InstanceStarting(msgspec.Struct, tag="starting", frozen=True):
    """Spawning runner life ``life`` (1 for the first) and loading and warming up its model."""

    life: int


class InstanceReady(msgspec.Struct, tag="ready", frozen=True):
    """Serving. ``healthy`` once it has been Ready for ``healthy_after`` seconds (the backoff was reset)."""

    life: int
    pid: int
    healthy: bool = False


class InstanceRestarting(msgspec.Struct, tag="restarting", frozen=True):
    """Life ``life - 1`` failed with ``cause``; life ``life`` starts after ``delay`` s (around ``resume_at``, on the
    instance's clock) once the old runner's process group is gone."""

    life: int
    attempt: int
    delay: float
    resume_at: float
    cause: Cause


class InstanceFailed(msgspec.Struct, tag="failed", frozen=True):
    """No more restarts: ``reason`` says why (policy, crash loop, ...), ``cause`` is the last life's."""

    cause: Cause
    reason: str
    history: tuple[Failure, ...]


class InstanceStopping(msgspec.Struct, tag="stopping", frozen=True):
    pass


class InstanceStopped(msgspec.Struct, tag="stopped", frozen=True):
    pass


InstanceState = (
    InstanceStarting | InstanceReady | InstanceRestarting | InstanceFailed | InstanceStopping | InstanceStopped
)


class Placer(Protocol):
    """Decides where (whether) a life of ``instance`` may start: returns the fit verdict, raises ``DoesNotFit``."""

    async def __call__(self, instance: Instance) -> FitResult: ...


class LifeFactory(Protocol):
    """Builds one runner life (``Supervisor`` itself is one such factory)."""

    def __call__(self, spec: EngineSpec, *, runner_id: str, deadlines: Deadlines) -> RunnerLife: ...


# --------------------------------------------------------------------------------------------------------------
# Instance
# --------------------------------------------------------------------------------------------------------------


class Instance:
    """One model instance: a sequence of runner lives under a ``RestartPolicy``, one supervisor at a time.

    Use as ``async with Instance(spec, policy) as inst:``; the first life starts at once (``wait_ready`` waits for
    it), and leaving the block stops the current runner within ``stop_timeout``.
    """

    def __init__(
        self,
        spec: EngineSpec,
        policy: RestartPolicy | None = None,
        *,
        name: str | None = None,
        supervisor_factory: LifeFactory | None = None,
        settings: SupervisorSettings = DEFAULT,
        rng: random.Random | None = None,
        force: bool = False,
        deadlines: Deadlines | None = None,
        admitted: FitResult | None = None,
        placer: Placer | None = None,
        ranks: int = 1,
        auto_ranks: bool = False,
    ) -> None:
        self.spec = spec
        # the options as asked: each life's placement sizes those its engine sizes for every life again ("auto" GPU
        # layers from the VRAM free then)
        self._asked = spec.options
        self.ranks = ranks  # runners per life (a multi-rank instance's group, ``node.ranks``), placed together
        # ``ranks: "auto"`` on a cluster: each placement chooses the ranks of the next life (one runner when a node
        # holds the model whole, else the fewest nodes that hold it split) and sets ``ranks`` to them
        self.auto_ranks = auto_ranks
        self._placer = placer
        self.deadlines = deadlines if deadlines is not None else Deadlines()  # per phase, for every life's runner
        self.force = force  # load even when the fit check says the model does not fit
        self.fit: FitResult | None = admitted  # the last placement decision, with its numbers
        self._admitted = admitted  # the caller ran the fit check for the first life already (Fleet.add does)
        self.measured: MeasuredFit | None = None  # the last loaded runner's memory beside the estimate
        self.policy = policy if policy is not None else RestartPolicy()
        # The default name goes into runner ids, cgroup and log file names: an engine named by its file path
        # ("/srv/engines/echo.py:Echo") must not put slashes there.
        engine = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.engine.rpartition("/")[2])[-40:]
        self.name = name or f"{engine}-{uuid.uuid4().hex[:6]}"
        self.backoff = Backoff(self.policy, rng)
        self.settings = settings
        self.state: InstanceState = InstanceStarting(life=1)
        # The last HISTORY_LIMIT failed lives and runner pids, oldest first: an instance that fails every few
        # seconds for months must not grow (bench/soak.py found 240 failures, their evidence, in every answer).
        self.history: list[Failure] = []
        self.pids: list[int] = []
        self.failures: collections.Counter[CauseKind] = collections.Counter()  # every failed life, by cause kind
        self.restarts = 0  # replacement lives started
        self.supervisor: RunnerLife | None = None  # the current life, from spawn until its exit
        self._factory = supervisor_factory or functools.partial(Supervisor, settings=settings)
        self._clock = settings.clock  # the backoff, the crash-loop window and healthy_after read it
        self._life = 0
        self._listeners: Listeners[InstanceState] = Listeners("instance state")
        self._changed = anyio.Event()
        self._done = anyio.Event()
        self._run_scope = anyio.CancelScope()
        self._tg: TaskGroup | None = None
        # What a life held when it died, as the worker's resumes know it (``tether.fleet.resume``): "trial" (a
        # suspect's trial: the death is not counted until the trial says whose it was; the restart is not delayed),
        # "held" (requests that wait to resume: the first restart of a streak is not delayed) or None.
        self.held: Callable[[int], Literal["trial", "held"] | None] | None = None

    def forgive(self, lives: Iterable[int]) -> None:
        """Deaths of ``lives`` were a request's doing, proven (``tether.fleet.resume``): the crash loop forgets them."""
        if self.backoff.forgive(lives):
            log.info("instance %s: deaths of lives %s forgiven: a request proven to cause them", self.name, lives)

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def __aenter__(self) -> Instance:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        with anyio.CancelScope(shield=True):
            await self.stop()
        assert self._tg is not None
        if not self._done.is_set():  # a runner that outlives every bound: do not hang the caller with it
            self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        return None

    async def stop(self, timeout: float | None = None) -> bool:
        """Stop restarting and stop the current runner (its supervisor's stop: shutdown, SIGTERM, SIGKILL).

        Returns False (and logs) when that took longer than ``timeout`` (default ``stop_timeout``).
        """
        if self._tg is None or self._done.is_set():
            return True
        if not isinstance(self.state, InstanceFailed | InstanceStopped):
            self._set_state(InstanceStopping())
        self._run_scope.cancel()
        bound = self.settings.stop_timeout if timeout is None else timeout
        with self._clock.move_on_after(bound):
            await self._done.wait()
        if not self._done.is_set():
            log.error("instance %s did not stop within %g s", self.name, bound)
            return False
        return True

    # --- serving --------------------------------------------------------------------------------------------

    async def generate(self, params: Work, task_id: str | None = None) -> TaskHandle:
        """Hand a generation to the current runner; ``RunnerUnavailable`` says why there is none (starting,
        restarting in N s after a cause, failed with its cause, stopped)."""
        sup = self.supervisor
        if isinstance(self.state, InstanceReady) and sup is not None:
            return await sup.generate(params, task_id)
        raise RunnerUnavailable(self.unavailable_reason(), self._last_cause())

    def unavailable_reason(self) -> str:
        """Why this instance cannot serve now, in words."""
        state = self.state
        if isinstance(state, InstanceStarting):
            return f"instance {self.name} is starting its runner (life {state.life})"
        if isinstance(state, InstanceRestarting):
            wait = max(state.resume_at - self._clock.now(), 0.0)
            return (
                f"instance {self.name} is restarting in {wait:.1f} s (restart {state.life - 1}, failure "
                f"{state.attempt} in a row) after: {state.cause.summary}"
            )
        if isinstance(state, InstanceFailed):
            return f"instance {self.name} failed: {state.cause.summary}; {state.reason}"
        if isinstance(state, InstanceReady):
            return f"instance {self.name} is ready"
        return f"instance {self.name} is stopped"

    async def wait_ready(self, timeout: float) -> RunnerLife:
        """Wait (bounded) until a runner is Ready and return its supervisor; raise ``RunnerUnavailable`` if the
        instance failed or stopped instead."""
        state = await self.wait_state(
            lambda s: isinstance(s, InstanceReady | InstanceFailed | InstanceStopping | InstanceStopped), timeout
        )
        if isinstance(state, InstanceReady) and self.supervisor is not None:
            return self.supervisor
        raise RunnerUnavailable(self.unavailable_reason(), self._last_cause())

    async def wait_state(self, predicate: Callable[[InstanceState], bool], timeout: float) -> InstanceState:
        """Wait until ``predicate(state)`` holds; ``TimeoutError`` after ``timeout`` s. States that come and go
        between two checks can be missed: use ``add_state_listener`` to see every transition."""
        with anyio.fail_after(timeout):
            while not predicate(self.state):
                await self._changed.wait()
        return self.state

    def add_state_listener(self, callback: Callable[[InstanceState], None]) -> None:
        """Call ``callback`` synchronously on every state change."""
        self._listeners.add(callback)

    # --- the restart loop -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            with self._run_scope:
                await self._serve()
        finally:
            self.supervisor = None
            if not isinstance(self.state, InstanceFailed):
                self._set_state(InstanceStopped())
            self._done.set()

    async def _serve(self) -> None:
        while True:
            self._life += 1
            life = self._life
            self._set_state(InstanceStarting(life=life))
            try:
                await self._place()
            except (DoesNotFit, InvalidField) as exc:  # it does not fit, or its model or engine cannot be had
                refused = Cause(kind=CauseKind.DOES_NOT_FIT, summary=str(exc))
                if life == 1 or isinstance(exc, InvalidField):
                    self._fail(refused, "not placed: fix the cause or force")
                    return
                # A replacement with nowhere to go now (its node lost, a new agent not there yet; memory another
                # model holds) is a failed attempt like a crash: the backoff and the crash-loop limit apply.
                sup = None
                cause = refused
            else:
                if life > 1:
                    self.restarts += 1
                try:
                    sup = self._factory(self.spec, runner_id=f"{self.name}-{life}", deadlines=self.deadlines)
                except TetherError as exc:  # its life cannot be built (no free ports for its ranks, a lost placement)
                    sup = None
                    cause = Cause(kind=CauseKind.SPAWN_ERROR, summary=f"{self.name}: life {life} not started: {exc}")
                else:
                    cause = await self._live(sup, life)
            pid = sup.pid if sup is not None else None
            detected = sup.detection_seconds if sup is not None else None
            logged = str(sup.output_log) if sup is not None and sup.output_log is not None else None
            self.history.append(Failure(time.time(), cause, life, pid, detected, logged))
            forgotten = self.history[:-HISTORY_LIMIT]
            del self.history[:-HISTORY_LIMIT]
            remove_logs(f.log for f in forgotten)
            self.failures[cause.kind] += 1
            now = self._clock.now()
            held = self.held(life) if self.held is not None else None
            # a trial's death is not counted before the trial says whose it was (a proven request's never is)
            attempt = max(self.backoff.attempt, 1) if held == "trial" else self.backoff.record_failure(now, life)
            reason = self._give_up_reason(cause, now)
            if reason is not None:
                self._fail(cause, reason)
                return
            waiting = held == "trial" or (held == "held" and attempt == 1)
            delay = 0.0 if waiting else self.backoff.delay_for(attempt)
            self._set_state(
                InstanceRestarting(life=life + 1, attempt=attempt, delay=delay, resume_at=now + delay, cause=cause)
            )
            log.warning(
                "instance %s: runner pid %s (life %d) failed: %s; restart %d in %.2f s (failure %d in a row)",
                self.name,
                pid,
                life,
                cause.summary,
                life,
                delay,
                attempt,
            )
            await self._clock.sleep(delay)
            if sup is not None:
                try:
                    await sup.confirm_gone(self.settings.reap_timeout)
                except NotGone as exc:
                    self._fail(cause, str(exc))
                    return

    async def _place(self) -> None:
        """Does this life fit the node's memory? Refuse with the numbers (``DoesNotFit``) unless ``force``.

        Awaited after the previous life's process group is gone, so what it measures no longer includes the
        predecessor. GPU layers the placement chose ("auto") are chosen again, from the VRAM free now.
        """
        if self._admitted is not None:  # the first life, checked by the caller a moment ago
            self.fit, self._admitted = self._admitted, None
        else:
            again = fit.each_life(self.spec)  # the engine was resolved by the first life's placement
            options = {k: v for k, v in self.spec.options.items() if k not in again}
            asked = {k: v for k, v in self._asked.items() if k in again}
            self.spec = msgspec.structs.replace(self.spec, options={**options, **asked})
            if self._placer is not None:
                self.fit = await self._placer(self)
            else:
                self.fit = await anyio.to_thread.run_sync(
                    functools.partial(fit.admit, self.spec, override=self.force, ranks=self.ranks, sized=True)
                )
        if self.fit.spec is not None:  # the check sized what the engine left to it (n_ctx "auto")
            self.spec = self.fit.spec
        log.info("instance %s: %s", self.name, self.fit.message)

    async def _live(self, sup: RunnerLife, life: int) -> Cause:
        """Run one life to its end: start, load and warm up, serve until the runner dies. Returns the cause."""
        fallback: Cause | None = None
        try:
            async with sup:
                self._record_pid(sup)
                self.supervisor = sup
                try:
                    await sup.ready()
                except (TaskFailed, RunnerUnavailable, TimeoutError) as exc:
                    fallback = _cause_of(sup, exc)
                    with contextlib.suppress(TimeoutError):  # a failed load or warmup ends the runner
                        await sup.wait_exit(sup.stop_timeout)
                else:
                    await self._record_measured(sup)
                    await self._serve_life(sup, life)
        except RunnerUnavailable as exc:  # it never said hello: spawn error, died or hung while starting
            self._record_pid(sup)
            fallback = exc.cause or Cause(kind=CauseKind.SPAWN_ERROR, summary=str(exc))
        finally:
            self.supervisor = None
        return sup.cause or fallback or Cause(kind=CauseKind.UNEXPECTED_EXIT, summary=f"{sup.name} ended")

    async def _serve_life(self, sup: RunnerLife, life: int) -> None:
        """Ready until the runner exits; ``healthy_after`` seconds of it reset the backoff."""
        assert sup.pid is not None
        self._set_state(InstanceReady(life=life, pid=sup.pid))
        with self._clock.move_on_after(self.policy.healthy_after):
            await sup.wait_exit(math.inf)
        if sup.alive:
            self.backoff.record_healthy()
            log.info(
                "instance %s: runner pid %d healthy for %g s: backoff reset",
                self.name,
                sup.pid,
                self.policy.healthy_after,
            )
            self._set_state(InstanceReady(life=life, pid=sup.pid, healthy=True))
            await sup.wait_exit(math.inf)

    async def _record_measured(self, sup: RunnerLife) -> None:
        """After load: the runner's real memory beside the estimate it was admitted on (logged, and kept)."""
        if self.fit is None or self.fit.estimate is None or sup.pid is None:
            return
        memory = await sup.measure()
        if memory is not None:
            self.measured = fit.record_measured(self.fit.estimate, memory)
            log.info("instance %s: %s", self.name, self.measured.describe())

    def _give_up_reason(self, cause: Cause, now: float) -> str | None:
        p = self.policy
        if p.mode == "never":
            return "the restart policy is 'never'"
        if cause.kind in p.give_up_on:
            return f"a restart cannot fix a {cause.kind.value} (fix the engine spec, then start the instance again)"
        if self.backoff.crash_looping(now):
            n = self.backoff.failures_in_window(now)
            return (
                f"crash loop: {n} failures within {p.crash_loop_window:g} s (limit {p.crash_loop_failures}); "
                "no more restarts: fix the cause, then start the instance again"
            )
        return None

    def _fail(self, cause: Cause, reason: str) -> None:
        self._set_state(InstanceFailed(cause=cause, reason=reason, history=tuple(self.history)))
        log.error("instance %s failed: %s; %s", self.name, cause.summary, reason)

    def _record_pid(self, sup: RunnerLife) -> None:
        pid = sup.pid
        if pid is not None and (not self.pids or self.pids[-1] != pid):
            self.pids.append(pid)
            del self.pids[:-HISTORY_LIMIT]

    @property
    def cause(self) -> Cause | None:
        """Why this instance cannot serve now, while it is restarting or failed; None otherwise."""
        state = self.state
        return state.cause if isinstance(state, InstanceRestarting | InstanceFailed) else None

    def _last_cause(self) -> Cause | None:
        return self.history[-1].cause if self.history else None

    def _set_state(self, state: InstanceState) -> None:
        self.state = state
        self._listeners(state)  # a listener that fails is logged: it must not break the restart loop
        self._changed.set()
        self._changed = anyio.Event()


def _cause_of(sup: RunnerLife, exc: TaskFailed | RunnerUnavailable | TimeoutError) -> Cause:
    """The cause of a load or warmup that did not complete, for when the supervisor has none (the runner did not
    die of it, or survived the kill that should have ended it)."""
    if isinstance(exc, TaskFailed) and exc.status.cause is not None:
        return exc.status.cause
    if isinstance(exc, RunnerUnavailable) and exc.cause is not None:
        return exc.cause
    if isinstance(exc, TimeoutError):
        return Cause(
            kind=CauseKind.HANG,
            summary=f"{sup.name} did not get ready in time and did not end when killed",
            phase=phase_of(sup.status),
        )
    return Cause(
        kind=CauseKind.ENGINE_ERROR, summary=f"{sup.name} could not get ready: {exc}", phase=phase_of(sup.status)
    )
