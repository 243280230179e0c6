"""One supervisor per runner: spawn, route events, watch for death, cancel, stop.

Its tasks (``_pump_events``, ``_pump_output``, ``_watch``, ``_watch_deadlines``) are owned by one task group, so
nothing outlives the supervisor, and every wait has a bound: start, sends, acknowledgements, every phase, and stop
(shutdown -> grace -> SIGTERM -> grace -> SIGKILL). Nothing here waits on another runner: each supervisor's tasks
are its own. This module is the lifecycle and the task table's routing; the handles a caller holds are in
``tasks``, the stack collection of a hung runner in ``stacks``, its cgroup and memory sampling in ``containment``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import select
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from tether.channel import AsyncReceiver, AsyncSender, EndOfStream, ProtocolError
from tether.errors import InvalidField
from tether.kernel.cgroups import (
    MemoryCgroup,
    kill_cgroup_members,
    remove_cgroup,
)
from tether.node.containment import group_memory, make_own_cgroup, remove_when_empty
from tether.node.diagnosis import Evidence, diagnose, stall_cause
from tether.node.gone import wait_runner_gone
from tether.node.hangs import (
    STACK_SIGNAL_NAME,
    Deadlines,
    Hang,
    ProgressWatch,
    process_state,
)
from tether.node.life import LifeTasks
from tether.node.listeners import Listeners
from tether.node.memory import ProcessMemory, process_memory
from tether.node.oom import LimitStall, OomWatch
from tether.node.output import OutputCapture, default_log_dir
from tether.node.recent import Recent
from tether.node.registry import Registry, record_for
from tether.node.settings import DEFAULT, SupervisorSettings
from tether.node.spawn import ExitStatus, RunnerProcess, start_runner
from tether.node.stacks import StackCollector
from tether.node.tasks import (
    CancelReply,
    InFlight,
    RunnerUnavailable,
    StopReport,
    TaskEvent,
    TaskFailed,
    TaskHandle,
    deliver,
    new_id,
)
from tether.protocol import (
    Cancel,
    CancelAcknowledged,
    Cause,
    CauseKind,
    Chunk,
    EngineSpec,
    ErrorChunk,
    Event,
    Failed,
    GenerateTask,
    Heartbeat,
    Idle,
    LoadTask,
    RunnerConfig,
    RunnerException,
    RunnerHello,
    RunnerStatus,
    Shutdown,
    ShutdownTask,
    StatusUpdate,
    Task,
    TaskAcknowledged,
    TaskState,
    TaskStatus,
    WarmupTask,
    Work,
    phase_of,
    task_kind,
)
from tether.runner import lifeline

log = logging.getLogger("tether.node.supervisor")


# Task ids this life finished, so a duplicate submit is refused and a late cancel answers "finished": the last
# RECENT_SECONDS of one life's traffic, at most RECENT_FINISHED (~150 bytes each, 1.5 MB when full), gone with it.
RECENT_FINISHED = 10_000
RECENT_SECONDS = 300.0
OUTPUT_READS_PER_WAKE = 4  # 64 KiB reads of runner output per event-loop turn (see _read_output)
OUTPUT_DRAIN_READS = 64  # after the exit: all a pipe can hold, bounded should a surviving helper keep writing


class Supervisor(LifeTasks):
    """Supervise one runner process hosting one engine.

    Use as ``async with Supervisor(spec) as sup:``; leaving the block stops the runner within ``stop_timeout``.
    One of the three ``RunnerLife`` implementations (``tether.node.life``): the one with a process of its own.
    """

    def __init__(
        self,
        spec: EngineSpec,
        settings: SupervisorSettings = DEFAULT,
        *,
        runner_id: str | None = None,
        deadlines: Deadlines | None = None,
        memory_limit: int | None = None,
        registry: Registry | None = None,
        cgroup: Path | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.settings = settings
        self.clock = settings.clock
        self.node: str | None = None  # the node it runs on when that is not this machine (a cluster's)
        self.runner_id = runner_id or uuid.uuid4().hex[:8]
        self.stop_timeout = settings.stop_timeout  # ``RunnerLife``'s
        self.deadlines = deadlines if deadlines is not None else Deadlines()
        problem = self.deadlines.check(settings.heartbeat_interval)
        if problem is not None:
            raise InvalidField("deadlines", f"invalid deadlines: {problem}")
        self._progress = ProgressWatch(self.deadlines, heartbeat=settings.heartbeat_interval > 0)
        self._progress.on_earlier = self._rearm_deadlines
        self._rearm = anyio.Event()
        self.hang: Hang | None = None  # the deadline that expired, once one did
        # Failure detection latency: from the exit seen (or the hang's deadline) to every task ended with the cause.
        self.detection_seconds: float | None = None
        self._detect_from: float | None = None
        self.env = dict(settings.env) if settings.env is not None else None
        self.orphan_layers = lifeline.check_layers(settings.orphan_layers)
        self.registry = registry if registry is not None else Registry()
        # The runner's memory cgroup: an existing one (``cgroup``), else its own child cgroup when ``contain`` and the
        # machine allows (an OOM then kills only this runner, certainly attributed, and usage is exact).
        self.cgroup = cgroup
        self.contain = settings.contain and cgroup is None
        self.memory_limit = memory_limit
        self.footprint: ProcessMemory | None = None  # the runner's whole group, sampled every ``memory_interval`` s
        self._own_cgroup: MemoryCgroup | None = None
        self._gpu = True  # False once NVML said it is unavailable: do not ask again on every sample
        self._oom: OomWatch | None = None
        self.status: RunnerStatus = Idle()
        self.hello: RunnerHello | None = None
        self.exception: RunnerException | None = None
        self.cause: Cause | None = None
        self.stop_report: StopReport | None = None
        self.process: RunnerProcess | None = None
        self._output = OutputCapture(
            self.runner_id,
            tail_lines=settings.output_lines,
            log_dir=settings.log_dir if settings.log_dir is not None else default_log_dir(),
            max_bytes=settings.log_max_bytes,
            backups=settings.log_backups,
        )
        self._stacks = StackCollector(self._output)
        self._finished: Recent[TaskState] = Recent(RECENT_FINISHED, RECENT_SECONDS)
        self._listeners: Listeners[RunnerStatus] = Listeners("status")
        self._changed = anyio.Event()
        self._events_done = anyio.Event()
        self._output_done = anyio.Event()
        # The pumps and the watcher are shielded: when the caller is cancelled (Ctrl-C, a timeout), they must keep
        # routing and watching until the runner is really gone; ``stop`` bounds how long that takes.
        self._events_scope = anyio.CancelScope(shield=True)
        self._output_scope = anyio.CancelScope(shield=True)
        self._stop_requested = False
        self._forced_cause: Cause | None = None
        self._escalated_to: str | None = None
        self._sender: AsyncSender | None = None
        self._receiver: AsyncReceiver[Event] | None = None

    # --- naming ---------------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        model = Path(self.spec.model).name if self.spec.model else "default model"
        return f"runner {self.runner_id} ({self.spec.engine}: {model})"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def alive(self) -> bool:
        return self.process is not None and not self._exited.is_set()

    @property
    def last_heartbeat(self) -> float | None:
        """When the runner last proved its interpreter runs (a heartbeat, or its hello), on ``clock``."""
        return self._progress.last_beat

    @property
    def output_tail(self) -> list[str]:
        return list(self._output.lines)

    @property
    def output_log(self) -> Path | None:
        """The file the runner's output is written to (rotated at ``log_max_bytes``), if it could be opened."""
        return self._output.path

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def _release(self) -> None:
        if not self._exited.is_set():  # unkillable (e.g. stuck in the kernel): do not hang the caller with it
            self._group.cancel_scope.cancel()
        # else the runner is gone and the pumps finish draining its last output and events on their own

    async def start(self) -> None:
        """Spawn the runner and wait (bounded) for its hello."""
        assert self._tg is not None, "use 'async with Supervisor(...)'"
        if self.contain:
            self._own_cgroup = make_own_cgroup(self.name, self.runner_id, self.memory_limit)
            if self._own_cgroup is not None:
                self.cgroup = self._own_cgroup.path
        config = RunnerConfig(
            runner_id=self.runner_id,
            spec=self.spec,
            worker_pid=os.getpid(),
            heartbeat_interval=self.settings.heartbeat_interval,
            orphan_layers=self.orphan_layers,
            orphan_poll_interval=self.settings.orphan_poll_interval,
            cgroup=str(self.cgroup) if self.cgroup is not None else None,  # joined before the runner forks anything
            own_cgroup=self._own_cgroup is not None,
        )
        try:
            self.process = await start_runner(config, env=self.env)
        except OSError as exc:
            self.cause = Cause(
                kind=CauseKind.SPAWN_ERROR,
                summary=f"{self.name} could not be started: {exc}",
            )
            self._set_status(Failed(self.cause))
            self._exited.set()
            if self._own_cgroup is not None:
                remove_cgroup(self._own_cgroup)
            raise RunnerUnavailable(self.cause.summary, self.cause) from exc
        try:
            cgroup = MemoryCgroup.at(self.cgroup) if self.cgroup is not None else None
            self._oom = OomWatch(self.process.pid, cgroup, own=self._own_cgroup is not None)
            self._sender = AsyncSender(self.process.tasks_fd)
            self._receiver = AsyncReceiver(self.process.events_fd, Event)
        except BaseException:  # nothing watches the runner yet: take it down here
            self.process.kill_group(signal.SIGKILL)
            os.waitpid(self.process.pid, 0)
            self.process.close_fds()
            if self._oom is not None:
                self._oom.close()
            if self._own_cgroup is not None:  # best effort: a leftover is swept once this worker is gone
                remove_cgroup(self._own_cgroup)
            self._exited.set()
            raise
        log.info("%s started, pid %d", self.name, self.process.pid)
        self._register(self.process)
        self._spawn(self._pump_events)
        self._spawn(self._pump_output)
        self._spawn(self._watch)
        self._spawn(self._watch_deadlines)
        if self.settings.memory_interval > 0:
            self._spawn(self._sample_memory_periodically)
        try:
            await self._wait_until(lambda: self.hello is not None or self._exited.is_set(), self.settings.start_timeout)
        except TimeoutError:
            self._force_kill(
                CauseKind.HANG, f"{self.name} did not report in within {self.settings.start_timeout:.1f} s of starting"
            )
            with self.clock.move_on_after(self.stop_timeout):
                await self._exited.wait()
        if self.hello is None:
            raise RunnerUnavailable(f"{self.name} failed to start", self.cause)

    def _register(self, process: RunnerProcess) -> None:
        """Record the runner so that, should this worker die hard, ``tether orphans`` can still find it."""
        environ = os.environ if self.env is None else self.env
        watchdog = not lifeline.watchdog_disabled(environ)
        if not watchdog:
            log.warning("%s: %s is set: it will outlive this worker should it die", self.name, lifeline.DISABLE_ENV)
        try:
            self.registry.add(
                record_for(
                    process.pid,
                    list(process.popen.args),  # type: ignore[arg-type]
                    os.getpid(),
                    self.runner_id,
                    self.spec.engine,
                    self.spec.model,
                    watchdog,
                    self._own_cgroup.path if self._own_cgroup is not None else None,
                )
            )
        except OSError as exc:  # the runner is still protected by its lifeline; only later discovery is weaker
            log.warning("%s: could not write its runner record in %s: %s", self.name, self.registry.path, exc)

    async def sample_memory(self) -> ProcessMemory | None:
        """Measure the runner's whole group now (runner, guard, engine helpers): ``footprint`` and the parts."""
        if self.process is None or self._exited.is_set():
            return self.footprint
        pgid, cgroup, with_gpu = self.process.pgid, self._own_cgroup, self._gpu
        if cgroup is not None and not with_gpu:
            # The common case is a few constant-time reads (tens of µs each): cheaper in the loop than a thread hop,
            # whose GIL hand-offs cost the event loop milliseconds while it streams tokens.
            memory, gpu_ok = group_memory(pgid, cgroup, with_gpu)
        else:  # NVML calls, or a /proc scan to list the group: milliseconds, kept off the event loop
            memory, gpu_ok = await anyio.to_thread.run_sync(group_memory, pgid, cgroup, with_gpu)
        self._gpu = gpu_ok
        if memory is not None:
            self.footprint = memory
        return self.footprint

    async def _sample_memory_periodically(self) -> None:
        while not self._exited.is_set():
            with self.clock.move_on_after(self.settings.memory_interval):
                await self._exited.wait()
            if not self._exited.is_set():
                await self.sample_memory()

    async def stop(self, timeout: float | None = None) -> StopReport | None:
        """Stop the runner within ``timeout`` (default ``stop_timeout``): shutdown, then SIGTERM, then SIGKILL."""
        if self.process is None or self._exited.is_set():
            return self.stop_report
        self._stop_requested = True
        self._rearm_deadlines()  # stopping has its own bounds: the deadline watch ends
        bound = self.stop_timeout if timeout is None else timeout
        began = self.clock.now()
        with self.clock.move_on_after(bound * 0.5):
            with contextlib.suppress(BrokenPipeError, RunnerUnavailable):  # already going: wait for the exit
                await self._send(ShutdownTask(task_id=f"shutdown-{self.runner_id}"))
            await self._exited.wait()
        for sig, share in ((signal.SIGTERM, 0.8), (signal.SIGKILL, 1.0)):
            if self._exited.is_set():
                break
            self._escalated_to = sig.name
            log.warning("%s did not shut down in time; sending %s to its process group", self.name, sig.name)
            self.process.kill_group(sig)
            with self.clock.move_on_after(max(began + bound * share - self.clock.now(), 0.05)):
                await self._exited.wait()
        seconds = self.clock.now() - began
        if not self._exited.is_set():
            log.error("%s (pid %d) survived SIGKILL for %.1f s", self.name, self.process.pid, seconds)
        self.stop_report = StopReport(
            clean=self._escalated_to is None and isinstance(self.status, Shutdown),
            escalated_to=self._escalated_to,
            seconds=seconds,
        )
        return self.stop_report

    # --- tasks ----------------------------------------------------------------------------------------------

    async def submit(self, task: Task) -> TaskHandle:
        """Send a task; its events (ending with one terminal TaskStatus) arrive on the returned handle."""
        if self.process is None or self._exited.is_set() or self._stop_requested:
            why = self.cause.summary if self.cause else "the runner is stopping or stopped"
            raise RunnerUnavailable(f"{self.name} cannot take a task: {why}", self.cause)
        tid = task.task_id
        if tid in self._inflight or tid in self._finished:
            raise ValueError(f"duplicate task id {tid!r}: every task needs a fresh id")
        assert self._sender is not None
        frame = self._sender.frame(task)  # ValueError before anything is tracked: a task that cannot travel is no task
        send, receive = anyio.create_memory_object_stream[TaskEvent](math.inf)
        self._inflight[tid] = InFlight(task=task, send=send)
        handle = TaskHandle(tid, task_kind(task), receive)
        self._progress.sent("task", tid, self.clock.now())  # before the write: the ack may beat our next line
        with contextlib.suppress(BrokenPipeError):  # the runner is dying: the watcher ends the task with the cause
            await self._send(frame)
        return handle

    async def generate(self, params: Work, task_id: str | None = None) -> TaskHandle:
        return await self.submit(GenerateTask(task_id=task_id or new_id("gen"), params=params))

    async def cancel(self, task_id: str) -> CancelReply:
        """Ask the runner to cancel a task; returns at once with what happened (``CancelReply``).

        The runner's reader thread sets the task's flag and acknowledges; the engine stops before its next token and
        the task ends with a CANCELLED status carrying the tokens produced so far. A cancel not acknowledged within
        the ``ack`` deadline means a runner that stopped reading: it is declared hung. Cancelling a finished or
        unknown task changes nothing and says so.
        """
        if task_id in self._inflight:
            self._progress.sent("cancel", task_id, self.clock.now())
            try:
                await self._send(Cancel(task_id))
            except (BrokenPipeError, RunnerUnavailable):
                return CancelReply(task_id, "runner_gone", "the runner is gone or stuck; the task ends with its cause")
            return CancelReply(task_id, "requested", "cancel requested: the task ends cancelled within one token")
        state = self._finished.get(task_id)
        if state is not None:
            return CancelReply(task_id, "finished", f"already {state.value}: nothing to cancel", state)
        return CancelReply(task_id, "unknown", f"no task {task_id!r} on {self.name}: nothing to cancel")

    async def load(self, timeout: float | None = None) -> None:
        """Load the model (progress arrives as Loading statuses). A load that stops progressing for the
        ``load_stall`` deadline is declared hung; ``timeout`` adds a bound on the whole load."""
        await self._run_to_completion(LoadTask(task_id=new_id("load")), timeout, "loading")

    async def warmup(self, timeout: float | None = None) -> None:
        """Warm up (bounded by the ``warmup`` deadline; ``timeout`` may bound it further)."""
        await self._run_to_completion(WarmupTask(task_id=new_id("warmup")), timeout, "warming up")

    async def ready(self) -> None:
        """Load then warm up: the runner is Ready afterwards, or TaskFailed says why not."""
        await self.load()
        await self.warmup()

    async def _run_to_completion(self, task: Task, timeout: float | None, phase: str) -> None:
        handle = await self.submit(task)
        with self.clock.move_on_after(math.inf if timeout is None else timeout):
            await handle.wait()
        if handle.final is None:
            self._force_kill(CauseKind.HANG, f"{self.name} did not finish {phase} within {timeout or 0:g} s")
            with self.clock.fail_after(self.stop_timeout):  # the kill ends the task with that cause
                await handle.wait()
        assert handle.final is not None
        if handle.final.state is not TaskState.COMPLETE:
            raise TaskFailed(handle.final)

    def add_status_listener(self, callback: Callable[[RunnerStatus], None]) -> None:
        self._listeners.add(callback)

    async def wait_status(self, predicate: Callable[[RunnerStatus], bool], timeout: float) -> RunnerStatus:
        """Wait for a status; ``timeout`` is the caller's patience in real seconds, whatever clock rules this runner."""
        with anyio.fail_after(timeout):
            while not predicate(self.status):
                await self._changed.wait()
        return self.status

    async def measure(self) -> ProcessMemory | None:
        """The runner process's own memory now (smaps_rollup, off the loop): what the fit check's estimate is
        compared with after load. None when it is gone."""
        pid = self.pid
        return None if pid is None else await anyio.to_thread.run_sync(process_memory, pid)

    async def confirm_gone(self, timeout: float) -> None:
        """Return once the runner is reaped and its process group empty (survivors SIGKILLed); ``RunnerNotGone``
        after ``timeout`` s. A replacement life starts only after this."""
        if self.process is not None:
            await wait_runner_gone(self.process, timeout)

    # --- internals ------------------------------------------------------------------------------------------

    async def _send(self, message: Any) -> None:
        """Send a message (or a frame made of one), bounded by ``send_timeout``: past it the runner is hung."""
        assert self._sender is not None
        frame = message if isinstance(message, bytes) else self._sender.frame(message)
        with self.clock.move_on_after(self.settings.send_timeout) as scope:
            await self._sender.send_frame(frame)
        if scope.cancelled_caught:
            # A runner that has not read its task pipe for this long is stuck; a half-written frame is moot.
            hang = Hang(
                self._progress.phase,
                self.settings.send_timeout,
                "send",
                self.settings.send_timeout,
                f"it stopped reading its task pipe (a write did not complete in {self.settings.send_timeout:g} s)",
            )
            self._spawn(self._declare_hung, hang)  # stacks, then the kill: the cause is made now, without them
            cause = self._forced_cause or self._hang_cause(hang)
            raise RunnerUnavailable(f"{self.name} is not reading tasks: {cause.summary}", cause)

    def _protocol_error(self, exc: ProtocolError) -> None:
        self._force_kill(
            CauseKind.PROTOCOL_ERROR,
            f"{self.name} sent an invalid frame on its events pipe: {exc}",
            (*exc.evidence, *self.output_tail[-5:]),
        )

    def _force_kill(
        self, kind: CauseKind, summary: str, evidence: tuple[str, ...] = (), phase: str | None = None
    ) -> None:
        if self._forced_cause is None:
            self._forced_cause = Cause(
                kind=kind, summary=summary, evidence=evidence, phase=phase or phase_of(self.status)
            )
        if self.process is not None:
            self.process.kill_group(signal.SIGKILL)

    # --- hangs ----------------------------------------------------------------------------------------------

    def _rearm_deadlines(self) -> None:
        self._rearm.set()

    async def _watch_deadlines(self) -> None:
        """Sleep until the next deadline (``hangs``; woken early when an earlier one appears); declare the first that
        expires: ask the runner for its stacks, kill its group, and so fail everything in flight as hung."""
        progress = self._progress
        rechecks = 0
        while not (self._exited.is_set() or self._stop_requested or self._forced_cause is not None):
            now = self.clock.now()
            hang = progress.expired(now)
            if hang is not None:
                if rechecks < 10 and self._events_pending():
                    rechecks += 1  # progress may be sitting in the pipe, unread: let the pump route it first
                    await anyio.sleep(0)
                    continue
                await self._declare_hung(hang)
                return
            rechecks = 0
            progress.armed = progress.next_expiry()
            self._rearm = anyio.Event()
            with self.clock.move_on_after(max(progress.armed - now, 0.0)):
                await self._rearm.wait()
            progress.armed = math.inf

    def _events_pending(self) -> bool:
        """Whether the events pipe holds unread bytes (poll with no wait)."""
        if self.process is None:
            return False
        poller = select.poll()
        poller.register(self.process.events_fd, select.POLLIN)
        try:
            return bool(poller.poll(0))
        except OSError:
            return False

    async def _declare_hung(self, hang: Hang) -> None:
        """Ask the hung runner for its stacks, then kill its group: everything in flight fails with the hang."""
        if self.hang is not None or self._exited.is_set() or self._stop_requested or self._forced_cause is not None:
            return
        if self._receiver is not None and self._receiver.garbage_suspected():
            self._detect_from = self.clock.now()
            self._protocol_error(self._receiver.stalled())  # the silence is garbage swallowing its messages
            return
        hang = dataclasses.replace(hang, phase=self._phase_words(hang.phase) or hang.phase)
        self.hang = hang
        self._detect_from = self.clock.now() - max(hang.seconds - hang.limit, 0.0)  # when the deadline expired
        summary = hang.summary(self.name)
        stall = self._memory_stall()  # its memory as it went silent
        log.error("%s; asking for its stacks (%s) before killing it", summary, STACK_SIGNAL_NAME)
        assert self.process is not None
        # On real time, whatever the clock: the wait is for a live process to write its dump (bounded at ``stacks``).
        stacks, note = await self._stacks.collect(self.process, self.deadlines.stacks, self._exited)
        cause = self._hang_cause(hang, ((note,) if note else ()) + tuple(stacks), stall)
        self._force_kill(cause.kind, cause.summary, cause.evidence, cause.phase)

    def _phase_words(self, phase: str | None) -> str | None:
        """A rank above 0 of a multi-rank instance reads as ready (it takes no requests) while it takes part in every
        step of rank 0's: its causes say that, not "idle"."""
        rank = self.spec.rank
        if phase == "idle" and rank is not None and rank.rank > 0:
            return f"following rank 0's steps (rank {rank.rank} of {rank.world_size})"
        return phase

    def _memory_stall(self) -> LimitStall | None:
        """The runner's own memory cgroup full as it went silent (``OomWatch.at_limit``), the runner not stopped (a
        stopped process is not waiting on reclaim): the memory stall its hang really is."""
        stall = self._oom.at_limit() if self._oom is not None else None
        if stall is None or self.process is None:
            return None
        return None if process_state(self.process.pid) in ("T", "t") else stall

    def _hang_cause(self, hang: Hang, evidence: tuple[str, ...] = (), stall: LimitStall | None = None) -> Cause:
        """The hang, or, when its memory cgroup was full as it went silent, the memory stall it really was."""
        if stall is not None:
            return stall_cause(self.name, hang.phase, hang.seconds, hang.detail, stall, evidence)
        return Cause(
            kind=CauseKind.HANG, summary=hang.summary(self.name), evidence=(*evidence, hang.hint()), phase=hang.phase
        )

    def _set_status(self, status: RunnerStatus) -> None:
        self.status = status
        self._listeners(status)  # a listener that fails is logged: it must not break routing
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_until(self, predicate: Callable[[], bool], timeout: float) -> None:
        with self.clock.fail_after(timeout):
            while not predicate():
                await self._changed.wait()

    def _dispatch(self, event: Event, now: float) -> None:
        if isinstance(event, Chunk | TaskAcknowledged | TaskStatus | ErrorChunk):
            record = self._inflight.get(event.task_id)
            if record is None:
                log.debug("%s: event for a task it does not track: %r", self.name, event)
                return
            if isinstance(event, Chunk) and event.is_progress:
                self._progress.prefilling(event.task_id, now)
            elif isinstance(event, Chunk):
                record.tokens += event.tokens
                self._progress.token(event.task_id, now)
            elif isinstance(event, TaskAcknowledged):
                self._progress.acknowledged("task", event.task_id)
            elif (
                isinstance(event, TaskStatus)
                and event.state is TaskState.RUNNING
                and isinstance(record.task, GenerateTask)
            ):
                record.started = True
                self._progress.generation_started(event.task_id, now)
            deliver(record, event)
            if isinstance(event, TaskStatus) and event.state.terminal:
                self._finish(event.task_id, event.state)
        elif isinstance(event, Heartbeat):
            self._progress.beat(now)
            if self._oom is not None:
                self._oom.observe(event.rss, event.anon)
        elif isinstance(event, CancelAcknowledged):
            self._progress.acknowledged("cancel", event.task_id)
        elif isinstance(event, StatusUpdate):
            if not isinstance(event.status, Failed):  # only the supervisor may declare a runner failed
                self._progress.status(event.status, now)
                self._set_status(event.status)
        elif isinstance(event, RunnerException):
            self.exception = event
        elif isinstance(event, RunnerHello):
            self.hello = event
            self._progress.beat(now)
            if self.cgroup is not None and MemoryCgroup.of_pid(event.pid) != MemoryCgroup.at(self.cgroup):
                log.warning("%s is not in its memory cgroup %s (see its output for why)", self.name, self.cgroup)
            if self._oom is not None:
                self._oom.observe()
            self._notify()

    def _finish(self, task_id: str, state: TaskState) -> None:
        record = self._inflight.pop(task_id)
        self._progress.ended(task_id)
        record.send.close()
        self._finished.add(task_id, state)

    async def _pump_events(self) -> None:
        """Read the events pipe in the event loop and route each event to its task's stream."""
        assert self._receiver is not None
        try:
            with self._events_scope:
                while True:
                    batch = await self._receiver.receive_batch()
                    now = self.clock.now()
                    for event in batch:
                        self._dispatch(event, now)
        except EndOfStream:
            pass
        except ProtocolError as exc:
            self._protocol_error(exc)
        finally:
            self._events_done.set()

    async def _pump_output(self) -> None:
        """Read the runner's stdout/stderr into ``OutputCapture``: a bounded per-life tail of lines (the evidence
        causes quote), the log, and size-bounded rotating files."""
        assert self.process is not None
        fd = self.process.output_fd
        os.set_blocking(fd, False)
        try:
            with self._output_scope:
                while True:
                    await anyio.wait_readable(fd)
                    if not self._read_output(fd):
                        break
        finally:
            self._output_done.set()

    def _read_output(self, fd: int, reads: int = OUTPUT_READS_PER_WAKE) -> bool:
        """Read what is available into the output capture, at most ``reads`` chunks; False at EOF.

        Bounded: a runner that writes as fast as this reads (a stderr flood) never leaves the pipe empty, and an
        unbounded loop here would hold the event loop for the whole flood, starving every other instance, the
        HTTP server and the deadlines (the fault campaign found it: task writes "timed out" behind it).
        """
        for _ in range(reads):
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return True
            if not data:
                return False
            self._output.feed(data)
            self._stacks.output_arrived()  # a stack dump may be awaited
        return True  # more may be waiting: the caller waits for readability again, which yields to other tasks

    async def _watch(self) -> None:
        """Await the runner's exit fd; then stop the pumps, drain what the dead runner left in its pipes (nothing is
        lost), turn the evidence into one cause and end every in-flight task with a terminal event."""
        assert self.process is not None
        with anyio.CancelScope(shield=True):
            exit_status = await self.process.wait_exit()
            if self._detect_from is None:  # a death: detection runs from the moment the exit was seen
                self._detect_from = self.clock.now()
            if self._own_cgroup is not None:  # what the group kill missed: helpers that left the group (setsid)
                kill_cgroup_members(self._own_cgroup)
            try:
                await self._finalize(exit_status)
                if self.cause is not None:
                    self.detection_seconds = self.clock.now() - self._detect_from
            finally:
                self._exited.set()
                self._notify()
                self._rearm_deadlines()
                self._stacks.output_arrived()
                if self._own_cgroup is not None:  # still shielded: a stopping worker must not leave it behind
                    await remove_when_empty(self._own_cgroup, self.stop_timeout, self.name)

    async def _finalize(self, exit_status: ExitStatus) -> None:
        """After the exit: drain, diagnose, end every in-flight task, release the pipes."""
        assert self.process is not None and self._receiver is not None
        proc = self.process
        # The pumps only ever wait between whole reads, so cancelling them loses nothing; what they had not read
        # yet is still in the pipes and is drained here, before anyone is told the runner is gone.
        self._events_scope.cancel()
        self._output_scope.cancel()
        await self._events_done.wait()
        await self._output_done.wait()
        try:
            now = self.clock.now()
            for event in self._receiver.drain_nowait():
                self._dispatch(event, now)
        except ProtocolError as exc:
            self._protocol_error(exc)
        self._read_output(proc.output_fd, OUTPUT_DRAIN_READS)  # what a pipe holds (64 KiB by default) and more
        self._output.flush()  # a forked helper may still hold the pipe open: do not wait for its EOF
        phase = self._phase_words(phase_of(self.status))
        clean_stop = self._stop_requested and exit_status.code == 0 and isinstance(self.status, Shutdown)
        escalated_stop = self._stop_requested and self._escalated_to is not None
        if clean_stop or escalated_stop:
            stopped: Cause | None = None
            if escalated_stop:
                stopped = Cause(
                    kind=CauseKind.STOP_ESCALATED,
                    summary=f"{self.name} did not shut down in time and was stopped with {self._escalated_to}",
                    exit_code=exit_status.code,
                    signal=exit_status.signal_name,
                    phase=phase,
                )
            self._end_tasks(TaskState.CANCELLED, "the runner was stopped before the task finished", stopped)
            if not isinstance(self.status, Shutdown):
                self._set_status(Shutdown())
            log.info("%s stopped (%s)", self.name, exit_status.describe())
        else:
            killed = exit_status.signal == signal.SIGKILL and self._forced_cause is None
            cause = self._forced_cause or diagnose(
                Evidence(
                    exit=exit_status,
                    exception=self.exception,
                    output_tail=self.output_tail,
                    phase=phase,
                    runner=self.name,
                    oom=self._oom.evidence() if killed and self._oom is not None else None,
                )
            )
            self.cause = cause
            self._end_tasks(TaskState.FAILED, cause.summary, cause)
            self._set_status(Failed(cause))
            log.error("%s failed: %s", self.name, cause.render())
        assert self._sender is not None
        self._sender.close()
        self._receiver.close()
        os.close(proc.output_fd)
        self._output.close()
        self.registry.remove(proc.pid)  # reaped and its group killed (``wait_exit``): nothing left to find
        if self._oom is not None:
            self._oom.close()

    def _end_tasks(self, state: TaskState, error: str, cause: Cause | None) -> None:
        for task_id in list(self._inflight):
            record = self._inflight[task_id]
            deliver(record, TaskStatus(task_id, state, error=error, cause=cause, tokens=record.tokens))
            self._finish(task_id, state)
