"""A runner life on another node, seen from the coordinator: one of the three ``RunnerLife`` implementations.

An ``Instance`` drives every life the same way whether its runner is local or on a node agent: start, ready, serve
until it exits, then let the restart policy decide (and the placer pick a node, possibly another one). This class
relays each call to the life's agent and each generation's events back, batched (``NodeAgent.generate``).

A life ends when its agent says the runner is gone (reaped, group and cgroup empty), or when the coordinator loses
the agent's node: then every request in flight ends at once with the node's cause, and the agent is killed (so its
runners die by their lifeline) before the life counts as over.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec

from tether.cluster import agent
from tether.cluster.link import AgentLink
from tether.cluster.wire import RunnerReport
from tether.node.gone import NotGone
from tether.node.hangs import Deadlines
from tether.node.life import LifeTasks
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
    Chunk,
    EngineSpec,
    ErrorChunk,
    Idle,
    RunnerStatus,
    TaskAcknowledged,
    TaskState,
    TaskStatus,
    Work,
)

log = logging.getLogger("tether.cluster.remote")
T = TypeVar("T")
_batch = msgspec.msgpack.Decoder(list[TaskAcknowledged | TaskStatus | Chunk | ErrorChunk])
CALL_TIMEOUT = 10.0  # a call that is not a load or a generation (cancel, stop) answered within this, or moot


class RemoteSupervisor(LifeTasks):
    """The coordinator's end of one runner life hosted by ``link``'s agent. Use as ``async with``, like a
    local ``Supervisor``; leaving stops the runner and returns once its agent confirms it gone (or its node is lost)."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        runner_id: str,
        deadlines: Deadlines,
        link: AgentLink,
        memory_limit: int | None = None,
        stop_timeout: float = 10.0,
        reap_timeout: float = 10.0,
    ) -> None:
        super().__init__()  # no local process, pipe or cgroup: the agent's supervisor has them
        self.spec = spec
        self.runner_id = runner_id
        self.deadlines = deadlines
        self.link = link
        self.node: str | None = link.node_id
        self.memory_limit = memory_limit
        self.stop_timeout = stop_timeout
        self.reap_timeout = reap_timeout
        self.cause: Cause | None = None
        self.stop_report: StopReport | None = None
        self.cgroup: Path | None = None
        self.footprint: ProcessMemory | None = None
        self.status: RunnerStatus = Idle()
        self.detection_seconds: float | None = None
        self.report: RunnerReport | None = None
        self._pid: int | None = None
        self._launch: Awaitable[bytes] | None = None  # the launch call, once sent: a stop may have to await its answer
        self._lost_at: float | None = None
        self._settled = False  # a loss whose runners are known gone (the agent fenced itself and said so)
        self._not_gone: str | None = None  # the agent's word that the runner outlived its bounds
        self._shields: set[anyio.CancelScope] = set()

    @contextlib.contextmanager
    def _shielded(self) -> Iterator[None]:
        with anyio.CancelScope(shield=True) as scope:
            self._shields.add(scope)
            try:
                yield
            finally:
                self._shields.discard(scope)

    # --- what the coordinator shows ------------------------------------------------------------------------

    @property
    def name(self) -> str:
        model = Path(self.spec.model).name if self.spec.model else "default model"
        return f"runner {self.runner_id} ({self.spec.engine}: {model}) on node {self.link.short}"

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def alive(self) -> bool:
        return self._pid is not None and not self._exited.is_set()

    @property
    def last_heartbeat(self) -> float | None:
        return self.link.last_seen

    @property
    def output_tail(self) -> list[str]:
        return []  # on its node, in the runner's log file (``output_log``)

    @property
    def output_log(self) -> Path | None:
        return Path(self.report.log) if self.report is not None and self.report.log else None

    def reported(self, report: RunnerReport) -> None:
        """Its agent's latest beat about it: status, footprint, cgroup."""
        self.report = report
        self.status = report.status
        self.footprint = report.footprint
        self.cgroup = Path(report.cgroup) if report.cgroup else None

    async def sample_memory(self) -> ProcessMemory | None:
        return self.footprint  # the agent samples it and reports it every beat

    async def measure(self) -> ProcessMemory | None:
        return self.footprint  # its pid is on another machine: the agent's latest report, not a local /proc read

    # --- lifecycle (entered as every life is: a task group, then ``start``) -----------------------------------

    async def _release(self) -> None:
        for scope in list(self._shields):  # confirmed gone (or given up on): the watch and relays may end
            scope.cancel()
        self._group.cancel_scope.cancel()

    async def start(self) -> None:
        """Launch the life on its agent (spawn and hello there); ``RunnerUnavailable`` with the cause if not."""
        self.link.attach(self)
        spec = msgspec.msgpack.encode(self.spec)
        deadlines = msgspec.msgpack.encode(self.deadlines)
        self._launch = self.link.actor.launch.remote(self.runner_id, spec, deadlines, self.memory_limit)
        self._launched(await self._launch_answer(self._launch))

    async def _launch_answer(self, launch: Awaitable[bytes]) -> agent.Launched:
        """The agent's answer to ``launch`` (awaited by start, or by a stop that overtook it)."""
        return msgspec.msgpack.decode(await self._call(launch, "start"), type=agent.Launched)

    def _launched(self, launched: agent.Launched) -> None:
        """The agent's answer to the launch: the runner's pid and its watch, or why it did not start. Read once: a
        start and a stop that overtook it may both await the same answer."""
        if self._pid is not None or self._exited.is_set():
            return
        self._pid = launched.pid
        if launched.error is not None:
            self._exited.set()
            self.link.detach(self)
            cause = launched.cause or Cause(kind=CauseKind.SPAWN_ERROR, summary=f"{self.name}: {launched.error}")
            self.cause = cause
            raise RunnerUnavailable(f"{self.name} could not start: {launched.error}", cause)
        self._spawn(self._watch)

    async def _watch(self) -> None:
        """The life ends when the agent confirms the runner gone; a lost node ends it first (``lose``). Shielded,
        like a supervisor's pumps: a cancelled caller's stop must still hear the agent confirm the runner gone."""
        with self._shielded():
            await self._watch_life()

    async def _watch_life(self) -> None:
        try:
            exited = msgspec.msgpack.decode(await self.link.actor.wait_gone.remote(self.runner_id), type=agent.Exited)
        except Exception as exc:  # the agent died: the link's verdict, with Ray's words, ends this life
            await self._await_loss(exc)
            return
        if exited.not_gone is not None:
            log.error("%s: %s", self.name, exited.not_gone)
            self._not_gone = exited.not_gone
        self.detection_seconds = exited.detected_in
        await self._drain(CALL_TIMEOUT)  # the relays' last batches may trail the agent's answer: all is delivered
        self._end(exited.cause, f"{self.name} ended")

    async def _await_loss(self, exc: BaseException) -> None:
        """Ray said the agent is gone before tether's heartbeat path did: wait (bounded) for the link's cause, which
        names the node and what was seen; without one, end with Ray's own words."""
        with anyio.move_on_after(self.link.lost_after + 1.0):
            await self._exited.wait()
        if not self._exited.is_set():
            summary = f"node {self.link.short}'s agent failed a call: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            self._end(Cause(kind=CauseKind.NODE_LOST, summary=summary, evidence=tuple(str(exc).splitlines()[:12])), "")

    def lose(self, cause: Cause, detected_at: float, *, settled: bool = False) -> None:
        """The coordinator lost this life's node: every request in flight ends now with ``cause``. ``settled``: the
        runner is known gone (its agent fenced itself and said so)."""
        self._lost_at = detected_at
        self._settled = settled
        self._end(cause, "")

    async def confirm_gone(self, timeout: float) -> None:
        """The agent's word that the runner is reaped and its group and cgroup empty (``NotGone`` if it said
        otherwise). For a lost node there is no such word: the runner counts as gone once Ray confirms the agent's
        process dead (its runners die by their lifeline) or, for an agent Ray cannot reach, once a partitioned agent
        must have fenced itself: its lease after its last word, then its bounded stop (``AgentLink.settle``)."""
        if self._not_gone is not None:
            raise NotGone(f"{self.name}: {self._not_gone}")
        if self._lost_at is None or self._settled:
            return
        link = self.link
        with link.clock.move_on_after(max(link.last_seen + link.settle - link.clock.now(), 0.0)):
            await link.died.wait()

    def _end(self, cause: Cause | None, fallback: str) -> None:
        if self._exited.is_set():
            return
        began = self.link.clock.now()
        if cause is None and self.stop_report is None:
            cause = Cause(kind=CauseKind.UNEXPECTED_EXIT, summary=fallback)
        self.cause = cause
        error = cause.summary if cause is not None else f"{self.name} stopped"
        for task_id in list(self._inflight):
            record = self._untrack(task_id)
            assert record is not None
            _fail(record, task_id, error, cause)
        if self._lost_at is not None:
            self.detection_seconds = self.link.clock.now() - self._lost_at
        elif self.detection_seconds is None:
            self.detection_seconds = self.link.clock.now() - began
        self._exited.set()
        self.link.detach(self)

    async def stop(self, timeout: float | None = None) -> StopReport | None:
        """Ask the agent to stop the runner (its supervisor's bounded stop) and wait until it is confirmed gone. A
        stop that overtook its launch (the instance deleted while it was being placed) first awaits the launch's
        answer: the agent starts that runner whether or not anyone still waits for it, and it must not be left."""
        if self._pid is None and self._launch is not None and not self._exited.is_set():
            with anyio.move_on_after(CALL_TIMEOUT), contextlib.suppress(RunnerUnavailable):
                answer = await self._launch_answer(self._launch)
                with contextlib.suppress(RunnerUnavailable):  # it did not start: nothing to stop
                    self._launched(answer)
        if self._pid is None or self._exited.is_set():
            return self.stop_report
        clock = self.link.clock
        began = clock.now()
        bound = (self.stop_timeout if timeout is None else timeout) + self.reap_timeout
        self.stop_report = StopReport(clean=True, escalated_to=None, seconds=0.0)  # a requested stop is no failure
        with anyio.move_on_after(CALL_TIMEOUT), contextlib.suppress(RunnerUnavailable):  # ended meanwhile: stopped
            await self._call(self.link.actor.stop.remote(self.runner_id), "stop")
        with clock.move_on_after(bound):
            await self._exited.wait()
        self.stop_report = StopReport(clean=self._exited.is_set(), escalated_to=None, seconds=clock.now() - began)
        if not self._exited.is_set():
            log.error("%s was not confirmed gone %.1f s after its stop", self.name, bound)
        return self.stop_report

    async def _call(self, ref: Awaitable[T], what: str) -> T:
        """Await a Ray call, unless the life ends first (its node lost): then ``RunnerUnavailable`` with the cause."""
        result: list[T] = []
        failure: list[BaseException] = []

        async def call() -> None:
            try:
                result.append(await ref)
            except Exception as exc:
                failure.append(exc)
            tg.cancel_scope.cancel()

        async def ended() -> None:
            await self._exited.wait()
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            tg.start_soon(ended)
        if result:
            return result[0]
        if failure and not self._exited.is_set():
            await self._await_loss(failure[0])
        why = self.cause.summary if self.cause is not None else "its node agent is gone"
        raise RunnerUnavailable(f"{self.name} cannot {what}: {why}", self.cause)

    # --- tasks ---------------------------------------------------------------------------------------------

    async def ready(self) -> None:
        outcome = msgspec.msgpack.decode(
            await self._call(self.link.actor.ready.remote(self.runner_id), "load"), type=agent.LoadOutcome
        )
        if not outcome.ok:
            status = TaskStatus(new_id("ready"), TaskState.FAILED, error=outcome.error, cause=outcome.cause)
            raise TaskFailed(status)

    async def generate(self, params: Work, task_id: str | None = None) -> TaskHandle:
        if self._exited.is_set() or self._pid is None:
            why = self.cause.summary if self.cause else "the runner is stopping or stopped"
            raise RunnerUnavailable(f"{self.name} cannot take a task: {why}", self.cause)
        record, handle = self._track(params, task_id)
        tid = record.task.task_id
        stream = self.link.actor.generate.remote(self.runner_id, tid, msgspec.msgpack.encode(params))
        self._spawn(self._relay, tid, stream)
        return handle

    async def _relay(self, task_id: str, stream: Any) -> None:
        """Hand a generation's batches to its handle until its terminal status (or its node is lost); shielded,
        so a stop that cancels its caller still delivers everything the runner wrote and the terminal status."""
        with self._shielded():
            await self._relay_events(task_id, stream)

    async def _relay_events(self, task_id: str, stream: Any) -> None:
        ended_by: BaseException | None = None
        try:
            async for ref in stream:
                batch = _batch.decode(await ref)
                record = self._inflight.get(task_id)
                if record is None:
                    return  # ended by a loss: its terminal status is delivered already
                for event in batch:
                    if isinstance(event, Chunk):
                        record.tokens += event.tokens  # what a terminal status of ours reports, as a supervisor's
                    elif isinstance(event, TaskStatus):
                        if event.state is TaskState.RUNNING:
                            record.started = True
                        elif event.state.terminal:
                            self._untrack(task_id)
                    deliver(record, event)
        except Exception as exc:
            ended_by = exc
        finally:
            with anyio.CancelScope(shield=True):
                if task_id in self._inflight and not self._exited.is_set():
                    # Ray ended the stream before a terminal status: the agent died. tether's own verdict (which
                    # names the node and what was seen) is due within lost_after; it ends the task.
                    await self._await_loss(ended_by or RuntimeError("its event stream ended before the task did"))
                record = self._untrack(task_id)
                if record is not None:  # every task ends with exactly one terminal status
                    cause = self.cause or Cause(kind=CauseKind.NODE_LOST, summary=f"{self.name}: its stream ended")
                    _fail(record, task_id, cause.summary, cause)

    async def cancel(self, task_id: str) -> CancelReply:
        if task_id not in self._inflight:
            return CancelReply(task_id, "unknown", f"no task {task_id!r} in flight on {self.name}: nothing to cancel")
        try:
            with anyio.fail_after(CALL_TIMEOUT):
                raw = await self._call(self.link.actor.cancel.remote(self.runner_id, task_id), "cancel")
        except (RunnerUnavailable, TimeoutError):
            return CancelReply(
                task_id, "runner_gone", "the runner's node is gone or silent; the task ends with its cause"
            )
        answer = msgspec.msgpack.decode(raw, type=agent.CancelAnswer)
        outcome: Any = answer.outcome
        return CancelReply(task_id, outcome, answer.detail, answer.state)

    def add_status_listener(self, callback: Callable[[RunnerStatus], None]) -> None:
        return None  # statuses arrive with beats, not as events (nothing in the coordinator listens to them)


def _fail(record: InFlight, task_id: str, error: str, cause: Cause | None) -> None:
    """End a relayed task with its one terminal status (the runner's node is gone or its stream broke)."""
    deliver(record, TaskStatus(task_id, TaskState.FAILED, error=error, cause=cause, tokens=record.tokens))
    record.send.close()
