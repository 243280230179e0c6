"""Multi-rank instances: N runners, one per rank, that live, fail and restart as one life of their instance.

A ``RankGroup`` is one of the three ``RunnerLife`` implementations (``tether.node.life``): the ``Instance`` drives it
as any life. Its members are lives themselves, local supervisors or remote ones on node agents. The rules an edit
must keep: **fail together**: the first rank to die, hang or run out of memory ends the life with its cause, every
other rank is stopped at once, and their failures (a broken ring, ``peer_lost``, being stopped) are evidence, never
causes; **restart only when all are gone**: ``confirm_gone`` returns only once every rank is confirmed gone (reaped
here, by its agent's word on a node, by Ray's or the fencing deadline's on a lost one), so a replacement never
competes with a predecessor for a port, a device or memory. Every life gets the same ports
(``kernel.ports.RankPorts``), as engines with fixed ports expect. What a user sees: docs/ranks.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec

from tether.clock import MONOTONIC, Clock
from tether.errors import InvalidField
from tether.node.gone import NotGone
from tether.node.hangs import Deadlines
from tether.node.life import LifeTasks, RunnerLife
from tether.node.memory import ProcessMemory
from tether.node.tasks import (
    CancelReply,
    InFlight,
    RunnerUnavailable,
    StopReport,
    TaskFailed,
    TaskHandle,
    deliver,
    new_id,
)
from tether.protocol import (
    Cause,
    CauseKind,
    EngineSpec,
    Idle,
    RankInfo,
    RunnerStatus,
    TaskState,
    TaskStatus,
    Work,
    tag_of,
)

log = logging.getLogger("tether.node.ranks")
MAX_RANKS = 16
CONSEQUENCES = frozenset({CauseKind.PEER_LOST, CauseKind.STOP_ESCALATED})  # what another rank's failure brings


@dataclass(frozen=True)
class Site:
    """Where one rank runs: the host its peers reach it on, and what builds its supervisor there."""

    host: str
    factory: Callable[..., RunnerLife]  # (spec, *, runner_id, deadlines) -> the rank's life
    share: float | None = None  # this rank's share of a split model (its node's free memory when placed)


def _sum(memories: Sequence[ProcessMemory | None]) -> ProcessMemory | None:
    """Every rank's memory together (what stopping the instance frees); None until each rank was measured."""
    if not memories or any(m is None for m in memories):
        return None
    known = [m for m in memories if m is not None]

    def total(name: str) -> Any:
        values = [getattr(m, name) for m in known]
        return None if any(v is None for v in values) else sum(values)

    return ProcessMemory(**{name: total(name) for name in ProcessMemory.__dataclass_fields__})


class RankGroup(LifeTasks):
    """One life of a multi-rank instance: a supervisor per rank (see the module docstring). Use as ``async with``,
    like any life; leaving stops every rank."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        runner_id: str,
        deadlines: Deadlines,
        sites: Sequence[Site],
        ports: Sequence[int],
        stop_timeout: float = 10.0,
        clock: Clock = MONOTONIC,
    ) -> None:
        super().__init__()  # the members own the processes
        if len(sites) != len(ports) or not 2 <= len(sites) <= MAX_RANKS:
            raise ValueError(f"{len(sites)} sites and {len(ports)} ports: a rank group needs 2..{MAX_RANKS} of each")
        world = len(sites)
        peers = tuple(f"{site.host}:{port}" for site, port in zip(sites, ports, strict=True))
        shares = tuple(float(site.share) for site in sites if site.share is not None)
        shares = shares if len(shares) == world else ()
        self.spec = spec
        self.runner_id = runner_id
        self.deadlines = deadlines
        self.stop_timeout = stop_timeout
        self.clock = clock  # what its bounds and the times it records read (its members' own clock: ``tether.clock``)
        self.members: list[RunnerLife] = [
            site.factory(
                msgspec.structs.replace(spec, rank=RankInfo(rank, world, peers, shares)),
                runner_id=f"{runner_id}.rank{rank}",
                deadlines=deadlines,
            )
            for rank, site in enumerate(sites)
        ]
        self.peers = peers
        self.cause: Cause | None = None
        self.stop_report: StopReport | None = None
        self.cgroup: Path | None = None  # one per rank, each its member's
        self.detection_seconds: float | None = None
        self._cancelled: set[str] = set()  # asked to cancel: their CANCELLED is the user's, not the group's end
        self._ended: dict[int, float] = {}  # rank -> when its runner was seen gone
        self._first: int | None = None  # the rank whose end ended the life
        self._stopping = False
        self._entered: contextlib.AsyncExitStack | None = None
        self._decided = anyio.Event()  # the life's cause is known (or it was stopped)

    # --- what the instance shows ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def name(self) -> str:
        model = Path(self.spec.model).name if self.spec.model else "default model"
        return f"runner group {self.runner_id} ({self.spec.engine}: {model}, {self.world_size} ranks)"

    @property
    def pid(self) -> int | None:
        return self.members[0].pid

    @property
    def alive(self) -> bool:
        return self.members[0].pid is not None and not self._exited.is_set() and self._first is None

    @property
    def node(self) -> str | None:
        return self.members[0].node

    @property
    def status(self) -> RunnerStatus:
        return self.members[0].status if self.members[0].pid is not None else Idle()

    @property
    def footprint(self) -> ProcessMemory | None:
        return _sum([m.footprint for m in self.members])

    @property
    def last_heartbeat(self) -> float | None:
        beats = [m.last_heartbeat for m in self.members]
        return None if any(b is None for b in beats) else min(b for b in beats if b is not None)

    @property
    def output_tail(self) -> list[str]:
        return self.members[0].output_tail

    @property
    def output_log(self) -> Path | None:
        return self.members[0].output_log

    def ranks(self) -> list[dict[str, Any]]:
        """Each rank as ``GET /v1/instances`` shows it."""
        return [
            {
                "rank": rank,
                "address": self.peers[rank],
                "node": m.node,
                "pid": m.pid,
                "status": tag_of(m.status) if m.pid is not None else None,
                "alive": m.alive,
                "log": str(m.output_log) if m.output_log else None,
            }
            for rank, m in enumerate(self.members)
        ]

    async def sample_memory(self) -> ProcessMemory | None:
        for m in self.members:
            await m.sample_memory()
        return self.footprint

    async def measure(self) -> ProcessMemory | None:
        """Every rank's own memory together: what the estimate of all ranks is compared with."""
        return _sum([await m.measure() for m in self.members])

    def add_status_listener(self, callback: Callable[[RunnerStatus], None]) -> None:
        self.members[0].add_status_listener(callback)

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every rank (spawn and hello); if one cannot start, stop the others and raise its cause."""
        self._entered = contextlib.AsyncExitStack()
        for rank, member in enumerate(self.members):
            try:
                await self._entered.enter_async_context(member)
            except RunnerUnavailable as exc:
                self._ended[rank] = self.clock.now()
                self._first = rank
                await self._fail_together(rank, fallback=exc.cause)
                assert self.cause is not None
                raise RunnerUnavailable(f"{self.name} could not start: {self.cause.summary}", self.cause) from exc
        for rank, member in enumerate(self.members):
            self._spawn(self._watch_rank, rank, member)

    async def _release(self) -> None:
        try:
            if self._entered is not None:  # each member leaves (shielded itself) in the scope it was entered in
                await self._entered.aclose()  # a cancelled caller's members re-raise the cancellation: fine
        finally:
            self._group.cancel_scope.cancel()  # and this group's own scope leaves the task's stack whatever they raised

    async def _watch_rank(self, rank: int, member: RunnerLife) -> None:
        with anyio.CancelScope(shield=True):
            await member.wait_exit(math.inf)
            self._ended.setdefault(rank, self.clock.now())
            if self._first is None and not self._stopping:
                self._first = rank
                await self._fail_together(rank)

    async def _fail_together(self, first: int, fallback: Cause | None = None) -> None:
        """Rank ``first`` ended the life: stop every other rank (concurrently, each within its bound), then decide
        the cause from what each rank's runner died of, and end every request with it."""
        with anyio.CancelScope(shield=True):
            await self._stop_members()
            self.cause = self._decide(first, fallback)
            self.detection_seconds = self.clock.now() - self._ended.get(first, self.clock.now())
            log.error("%s failed: %s", self.name, self.cause.render())
            self._decided.set()
            await self._drain(self.stop_timeout)  # every relay delivers its request's end with this cause
            self._exited.set()

    async def _stop_members(self) -> None:
        async def one(member: RunnerLife) -> None:
            try:
                await member.stop(self.stop_timeout)
            except Exception:  # one rank's stop going wrong must not spare the others, or the decision
                log.exception("%s: stopping %s failed", self.name, member.name)

        async with anyio.create_task_group() as tg:
            for member in self.members:
                if member.alive:
                    tg.start_soon(one, member)
        with self.clock.move_on_after(1.0):  # each runner's own diagnosis, right after its exit
            for member in self.members:
                if member.pid is not None:
                    await member.wait_exit(math.inf)

    def _decide(self, first: int, fallback: Cause | None) -> Cause:
        """The life's one cause: the earliest rank to end of something that is not another rank's doing."""
        causes = {rank: m.cause for rank, m in enumerate(self.members)}
        if causes[first] is None and fallback is not None:
            causes[first] = fallback
        order = sorted(self._ended, key=lambda r: (self._ended[r], r))
        primary = next(
            (r for r in order if causes[r] is not None and causes[r].kind not in CONSEQUENCES),  # type: ignore[union-attr]
            next((r for r in order if causes[r] is not None), first),
        )
        cause = causes[primary] or Cause(
            kind=CauseKind.UNEXPECTED_EXIT, summary=f"{self.members[primary].name} ended without being asked to"
        )
        others = []
        for rank in range(self.world_size):
            if rank == primary:
                continue
            theirs = causes[rank]
            what = theirs.summary if theirs is not None else "stopped by tether, as its instance failed"
            others.append(f"rank {rank}: {what} (a consequence)")
        node = self.members[primary].node
        where = f" on node {node[:8]}" if node else ""
        return Cause(
            kind=cause.kind,
            summary=f"rank {primary} of {self.world_size}{where} failed: {cause.summary}",
            evidence=(*cause.evidence, "the other ranks:", *others),
            exit_code=cause.exit_code,
            signal=cause.signal,
            phase=cause.phase,
            rank=primary,
        )

    async def stop(self, timeout: float | None = None) -> StopReport | None:
        """Stop rank 0, then every other rank (concurrently), each within ``timeout``; returns once each runner has
        exited."""
        if self._exited.is_set() or self.members[0].pid is None:
            return self.stop_report
        if self._first is not None:  # failing already: that stops them
            with self.clock.move_on_after((self.stop_timeout if timeout is None else timeout) + 2.0):
                await self._exited.wait()
            return self.stop_report
        began = self.clock.now()
        self._stopping = True
        reports: list[StopReport | None] = []

        async def one(member: RunnerLife) -> None:
            reports.append(await member.stop(timeout))

        if self.members[0].alive:  # rank 0 first: it is the client of the others (an engine may talk to them
            await one(self.members[0])  # as it closes, as llama.cpp frees its layers on its RPC peers)
        async with anyio.create_task_group() as tg:
            for member in self.members[1:]:
                if member.alive:
                    tg.start_soon(one, member)
        self._decided.set()
        await self._drain(self.stop_timeout)
        self._exited.set()
        clean = all(r is None or r.clean for r in reports)
        escalated = next((r.escalated_to for r in reports if r is not None and r.escalated_to), None)
        self.stop_report = StopReport(clean=clean, escalated_to=escalated, seconds=self.clock.now() - began)
        return self.stop_report

    async def confirm_gone(self, timeout: float) -> None:
        """Every rank confirmed gone, on every node (each member's own confirmation, concurrently); ``NotGone``
        naming the ranks that are not."""
        failures: list[str] = []

        async def one(rank: int, member: RunnerLife) -> None:
            try:
                await member.confirm_gone(timeout)
            except NotGone as exc:
                failures.append(f"rank {rank}: {exc}")

        async with anyio.create_task_group() as tg:
            for rank, member in enumerate(self.members):
                tg.start_soon(one, rank, member)
        if failures:
            raise NotGone(f"{self.name}: not every rank is gone, so no replacement starts: " + "; ".join(failures))

    # --- tasks ---------------------------------------------------------------------------------------------

    async def ready(self) -> None:
        """Load and warm up every rank at once (a ring forms while they warm up); the first that fails ends all."""
        failed: list[int] = []

        async def one(rank: int, member: RunnerLife) -> None:
            try:
                await member.ready()
            except (TaskFailed, RunnerUnavailable, TimeoutError):
                failed.append(rank)
                self._ended.setdefault(rank, self.clock.now())
                if self._first is None and not self._stopping:
                    self._first = rank
                    self._spawn(self._fail_together, rank)

        async with anyio.create_task_group() as tg:
            for rank, member in enumerate(self.members):
                tg.start_soon(one, rank, member)
        if failed or self._first is not None:
            with self.clock.move_on_after(self.stop_timeout + 2.0):
                await self._decided.wait()
            cause = self.cause or Cause(kind=CauseKind.UNEXPECTED_EXIT, summary=f"{self.name} stopped while loading")
            raise TaskFailed(TaskStatus(new_id("ready"), TaskState.FAILED, error=cause.summary, cause=cause))

    async def generate(self, params: Work, task_id: str | None = None) -> TaskHandle:
        """Rank 0 takes the request; its events are relayed, and a runner death ends it with the group's cause."""
        if not self.alive:
            why = self.cause.summary if self.cause else "the instance is stopping or stopped"
            raise RunnerUnavailable(f"{self.name} cannot take a task: {why}", self.cause)
        tid = task_id or new_id("gen")
        if tid in self._inflight:
            raise ValueError(f"duplicate task id {tid!r}: every task needs a fresh id")
        inner = await self.members[0].generate(params, tid)
        record, handle = self._track(params, tid)
        self._spawn(self._relay, tid, record, inner)
        return handle

    async def _relay(self, tid: str, record: InFlight, inner: TaskHandle) -> None:
        with anyio.CancelScope(shield=True):
            try:
                async for event in inner:
                    if isinstance(event, TaskStatus):
                        if event.state is TaskState.RUNNING:
                            record.started = True
                        elif event.state.terminal:
                            event = await self._final(tid, event)
                    else:
                        record.tokens += getattr(event, "tokens", 0)
                    deliver(record, event)
            finally:
                if inner.final is None:  # rank 0's stream ended without a terminal status: never leave it open
                    deliver(record, await self._final(tid, TaskStatus(tid, TaskState.FAILED, error="ended")))
                record.send.close()
                self._untrack(tid)

    async def _final(self, tid: str, status: TaskStatus) -> TaskStatus:
        """A request's end, as the group tells it: when rank 0 ended it because its runner died or was stopped
        (the life is ending), the group's cause once decided, not rank 0's consequence of it."""
        user_cancel = status.state is TaskState.CANCELLED and tid in self._cancelled
        ending = status.cause is not None or self._first is not None or not self.members[0].alive
        if status.state is TaskState.COMPLETE or user_cancel or not ending or self._stopping:
            return status
        with self.clock.move_on_after(self.stop_timeout + 2.0):
            await self._decided.wait()
        if self._stopping or self.cause is None:
            return status
        return TaskStatus(tid, TaskState.FAILED, error=self.cause.summary, cause=self.cause, tokens=status.tokens)

    async def cancel(self, task_id: str) -> CancelReply:
        if task_id not in self._inflight:
            return CancelReply(task_id, "unknown", f"no task {task_id!r} in flight on {self.name}: nothing to cancel")
        self._cancelled.add(task_id)
        return await self.members[0].cancel(task_id)


def check_ports(ports: Sequence[int], ranks: int) -> InvalidField | None:
    """What is wrong with an instance's pinned rank ports, or None."""
    if len(ports) != ranks:
        return InvalidField("ports", f"ports must name one port per rank: {ranks} ranks, {len(ports)} ports")
    if len(set(ports)) != len(ports):
        return InvalidField("ports", f"ports must be distinct, got {list(ports)}")
    bad = [p for p in ports if not 1024 <= p <= 65535]
    if bad:
        return InvalidField("ports", f"ports must be in [1024, 65535] (unprivileged), got {bad}")
    return None
