"""The runner process: bootstrap, then one engine driven by one task loop.

Threads in a runner, and why each exists:
- main thread: the task loop. It drives the engine (engines are not thread-safe; signal handlers need the main
  thread) and is the only thread that changes the runner's status. While generating it runs the step loop: between
  two steps it ends cancelled sequences, admits waiting requests into free batch slots (continuous batching) and
  takes new tasks off the queue; each step advances every running sequence by one token, and the step's chunks
  leave in one write.
- reader thread: reads the tasks pipe and acknowledges every message as it arrives. Cancellation is acted on here,
  at once (a flag the step loop checks between steps), never queued behind generation.
- heartbeat thread: proves the interpreter still runs (a GIL-holding native hang stops it too).
- follow thread, in ranks above 0 of a multi-rank instance only: the engine's ``follow()``, taking part in rank 0's
  steps from warm-up to close. Whatever it raises ends the runner, as an exception of the task loop would.

Every event is written straight to the events pipe (see ``channel``), so a runner that dies loses nothing it sent.
An unexpected exception is reported as a ``RunnerException`` message before the runner exits with code 1; the
supervisor, not the runner, turns the exit into a cause and fails the in-flight tasks.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import NoReturn, TypedDict, cast

import msgspec

from tether import env
from tether.channel import ProtocolError, SyncReceiver, SyncSender
from tether.engines.base import BatchEngine, Delta, EngineLoadError, RequestError, batched
from tether.engines.registry import create_engine
from tether.errors import InvalidField
from tether.protocol import (
    Cancel,
    CancelAcknowledged,
    Chunk,
    ErrorChunk,
    GenerateParams,
    GenerateTask,
    Heartbeat,
    Idle,
    Loaded,
    Loading,
    LoadTask,
    Ready,
    RunnerArgs,
    RunnerConfig,
    RunnerException,
    RunnerHello,
    RunnerStatus,
    Running,
    Shutdown,
    ShutdownTask,
    ShuttingDown,
    StatusUpdate,
    Task,
    TaskAcknowledged,
    TaskState,
    TaskStatus,
    ToRunner,
    WarmingUp,
    WarmupTask,
    phase_of,
    tag_of,
    task_kind,
)
from tether.runner import faults, lifeline

RECENT_IDS = 10_000  # duplicate ids are refused among this many most recent tasks

# Which task is valid in which status, and what to tell a caller who sends it at the wrong time.
_VALID_IN: dict[type, tuple[type, ...]] = {
    LoadTask: (Idle,),
    WarmupTask: (Loaded,),
    GenerateTask: (Ready, Running),
    ShutdownTask: (Idle, Loading, Loaded, WarmingUp, Ready, Running),
}
_HINT: dict[type, str] = {
    LoadTask: "a runner loads once; start a new runner for another model",
    WarmupTask: "send a load task first",
    GenerateTask: "load and warm up the runner first",
    ShutdownTask: "",
}

_EOF = object()


class _RecentIds:
    """The last ``size`` ids added, for membership tests (a set bounded by forgetting the oldest)."""

    def __init__(self, size: int) -> None:
        self._order: collections.deque[str] = collections.deque()
        self._ids: set[str] = set()
        self._size = size

    def add(self, task_id: str) -> None:
        self._order.append(task_id)
        self._ids.add(task_id)
        if len(self._order) > self._size:
            self._ids.discard(self._order.popleft())

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._ids


class Runner:
    def __init__(self, config: RunnerConfig, sender: SyncSender, tasks_fd: int) -> None:
        self.config = config
        self.sender = sender
        self.tasks_fd = tasks_fd
        self.engine: BatchEngine | None = None
        self.running: dict[str, int] = {}  # generations in the engine's batch -> tokens so far
        self.waiting: collections.deque[GenerateTask] = collections.deque()  # accepted, waiting for a batch slot
        self.status: RunnerStatus = Idle()
        self.tasks: queue.SimpleQueue[Task | object] = queue.SimpleQueue()
        self.cancelled: set[str] = set()
        self._ended = _RecentIds(RECENT_IDS)  # generations that ended: a cancel arriving after the end is not kept
        self.shutdown_requested = threading.Event()
        self._recent = _RecentIds(RECENT_IDS)  # task ids taken: a duplicate is refused
        self._status_lock = threading.Lock()  # the reader thread may end the runner while the main thread reports
        self._final = False  # no status after the last one
        self.current: str | None = None  # the load or warm-up task the main thread is running
        self.cancel_all = False  # set by the reader thread (shutdown, end of channel): the step loop cancels all

    # --- events ---------------------------------------------------------------------------------------------

    def set_status(self, status: RunnerStatus) -> None:
        with self._status_lock:
            if self._final:
                return
            self.status = status
            self.sender.send(StatusUpdate(status))

    def shutdown_now(self, task: ShutdownTask) -> None:
        """Shut down from the reader thread while the main thread is busy loading or warming up: a load can take
        minutes and cannot be interrupted, and there is nothing to finish (no request has been served). The load
        or warm-up task ends cancelled, the shutdown completes, and the process exits at once (the guard then
        takes every helper the engine had started)."""
        with self._status_lock:
            if not isinstance(self.status, Loading | WarmingUp):  # it finished meanwhile: the task loop shuts down
                return
            phase = "loading" if isinstance(self.status, Loading) else "warming up"
            self.task_status(task.task_id, TaskState.RUNNING)
            self.status = ShuttingDown()
            self.sender.send(StatusUpdate(self.status))
            if self.current is not None:
                self.task_status(self.current, TaskState.CANCELLED, f"the runner was shut down while {phase}")
            self.task_status(task.task_id, TaskState.COMPLETE)
            self.status = Shutdown()
            self.sender.send(StatusUpdate(self.status))
            self._final = True  # the main thread's progress reports from here on are dropped
            _hard_exit(0)

    def task_status(self, task_id: str, state: TaskState, error: str | None = None, tokens: int = 0) -> None:
        self.sender.send(TaskStatus(task_id=task_id, state=state, error=error, tokens=tokens))

    # --- threads --------------------------------------------------------------------------------------------

    def _read_tasks(self) -> None:
        """Reader thread: acknowledges each message on arrival; cancels act at once; tasks queue for the main loop.

        The acknowledgements prove the runner still reads its pipe even while a long generation runs; they come
        from this thread because the main loop may be busy for minutes.
        """
        try:
            for message in SyncReceiver[ToRunner](self.tasks_fd, ToRunner):
                if isinstance(message, Cancel):
                    if message.task_id not in self._ended:
                        self.cancelled.add(message.task_id)
                    self.sender.send(CancelAcknowledged(message.task_id))
                    continue
                self.sender.send(TaskAcknowledged(message.task_id))
                if isinstance(message, ShutdownTask):
                    # Stop whatever is generating now so the shutdown is not stuck behind it.
                    self.shutdown_requested.set()
                    self.cancel_everything()
                    if isinstance(self.status, Loading | WarmingUp):
                        self.shutdown_now(message)  # the main thread is inside the engine with nothing to finish
                self.tasks.put(message)
        except ProtocolError as exc:
            # The main loop raises it: reported like any fatal error, not mistaken for a clean goodbye.
            self.tasks.put(exc)
            return
        if lifeline.watchdog_disabled():
            # Asked to outlive the worker (debugging): keep the engine and its state for inspection.
            print(
                f"tether runner {os.getpid()}: the worker closed the channel; staying alive because "
                f"{lifeline.DISABLE_ENV} is set",
                file=sys.stderr,
                flush=True,
            )
            return
        # EOF: the supervisor is gone or closed the channel; there is nobody to serve.
        self.shutdown_requested.set()
        self.cancel_everything()
        self.tasks.put(_EOF)

    def cancel_everything(self) -> None:
        """From the reader thread: every generation ends cancelled at the step loop's next turn."""
        self.cancel_all = True

    def _heartbeat(self, interval: float) -> None:
        seq = 0
        while True:
            time.sleep(interval)
            seq += 1
            rss, anon = _statm()
            self.sender.send(Heartbeat(seq=seq, sent_ns=time.monotonic_ns(), rss=rss, anon=anon))

    # --- task loop ------------------------------------------------------------------------------------------

    def serve(self) -> int:
        threading.Thread(target=self._read_tasks, name="tether-reader", daemon=True).start()
        if self.config.heartbeat_interval > 0:
            threading.Thread(
                target=self._heartbeat,
                args=(self.config.heartbeat_interval,),
                name="tether-heartbeat",
                daemon=True,
            ).start()
        while True:
            busy = bool(self.running or self.waiting)
            items: list[Task | object] = [] if busy else [self.tasks.get()]  # idle: sleep until a task comes
            while True:
                try:
                    items.append(self.tasks.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is _EOF:
                    self.close_engine()
                    return 0
                if isinstance(item, ProtocolError):
                    raise ProtocolError(f"bad frame from the supervisor: {item}")
                task = cast(Task, item)
                if self.shutdown_requested.is_set() and not isinstance(task, ShutdownTask):
                    self.refuse(task, TaskState.CANCELLED, "the runner is shutting down; the task was not started")
                    continue
                if not self.accept(task):
                    continue
                if isinstance(task, ShutdownTask):
                    self.shutdown(task)
                    return 0
                if isinstance(task, GenerateTask):
                    self.enqueue(task)
                else:
                    self.run_task(task)
            if self.running or self.waiting:
                self.step()

    def enqueue(self, task: GenerateTask) -> None:
        """Queue a request for a batch slot: a resumed one (its runner died under it) ahead of the others, in the
        order resumes came: it was admitted before anything waiting here, and its client is already waiting."""
        if _resumed(task):
            at = next((i for i, queued in enumerate(self.waiting) if not _resumed(queued)), len(self.waiting))
            self.waiting.insert(at, task)
        else:
            self.waiting.append(task)

    def accept(self, task: Task) -> bool:
        """Take a task, or refuse it (duplicate id, wrong status) with a clear failed status."""
        tid = task.task_id
        if tid in self._recent:
            self.task_status(tid, TaskState.FAILED, f"duplicate task id {tid!r}: every task needs a fresh id")
            return False
        self._recent.add(tid)
        if not isinstance(self.status, _VALID_IN[type(task)]):
            hint = _HINT[type(task)]
            self.task_status(
                tid,
                TaskState.FAILED,
                f"cannot run a {task_kind(task)} task while the runner is {tag_of(self.status)}"
                + (f": {hint}" if hint else ""),
            )
            return False
        return True

    def refuse(self, task: Task, state: TaskState, why: str) -> None:
        self.task_status(task.task_id, state, why)

    def run_task(self, task: Task) -> None:
        tid = task.task_id
        if isinstance(task, LoadTask):
            self.current = tid
            self.task_status(tid, TaskState.RUNNING)
            self.set_status(Loading(0.0, "starting"))
            try:
                self.engine = batched(create_engine(self.config.spec))
            except InvalidField as exc:  # an engine that cannot be had, or options it refuses: a load error
                raise EngineLoadError(str(exc)) from exc
            self.engine.load(lambda fraction, detail: self.set_status(Loading(min(max(fraction, 0.0), 1.0), detail)))
            self.finish_current(tid, Loaded())
        elif isinstance(task, WarmupTask):
            assert self.engine is not None
            self.current = tid
            self.task_status(tid, TaskState.RUNNING)
            self.set_status(WarmingUp())
            self.engine.warmup()
            self.start_following()
            self.finish_current(tid, Ready())

    def start_following(self) -> None:
        """A rank above 0 takes part in rank 0's steps from now on (``follow``), on a thread of its own."""
        rank = self.config.spec.rank
        follow = getattr(self.engine, "follow", None)
        if rank is None or rank.rank == 0 or not callable(follow):
            return

        def run() -> None:
            try:
                follow()
            except BaseException as exc:
                if self.engine is None or self.shutdown_requested.is_set():
                    return  # closed under it: the runner is shutting down, the ring's end is expected
                self.report_fatal(exc)
                _hard_exit(1)

        threading.Thread(target=run, name="tether-follow", daemon=True).start()

    def finish_current(self, task_id: str, status: RunnerStatus) -> None:
        """End the load or warm-up task: its status and completion go out together, unless a shutdown ended it."""
        with self._status_lock:
            if self._final:
                return
            self.current = None
            self.status = status
            self.sender.send(StatusUpdate(status))
            self.task_status(task_id, TaskState.COMPLETE)

    # --- the step loop ---------------------------------------------------------------------------------------

    def step(self) -> None:
        """One turn: end what was cancelled, fill free slots from the waiting queue, advance the batch one step."""
        engine = self.engine
        assert engine is not None
        out: list[object] = []  # events, sent in one write before the step and one after it
        cancelled = self.cancelled
        if self.cancel_all:
            cancelled.update(self.running)
            cancelled.update(task.task_id for task in self.waiting)
        for tid in [tid for tid in self.running if tid in cancelled]:
            self._end_cancelled(tid, engine.drop(tid), out)
        for task in [task for task in self.waiting if task.task_id in cancelled] if cancelled else ():
            self.waiting.remove(task)
            out.append(TaskStatus(task.task_id, TaskState.CANCELLED, "cancelled before it started"))
            self._ended_task(task.task_id)
        while self.waiting and engine.active() < engine.parallel:
            task = self.waiting.popleft()
            try:
                engine.start(task.task_id, task.params)
            except RequestError as exc:
                out.append(ErrorChunk(task_id=task.task_id, message=str(exc)))
                out.append(TaskStatus(task.task_id, TaskState.FAILED, str(exc)))
                self._ended_task(task.task_id)
                continue
            self.running[task.task_id] = 0
            out.append(TaskStatus(task.task_id, TaskState.RUNNING))
        self._report_batch(out)
        self.sender.send_many(out)  # before the step: a generation's deadlines start when it is known to run
        out = []
        if not self.running:
            if self.waiting:  # never spin: an engine that will not take a sequence into an empty batch is broken
                raise RuntimeError(f"{engine.name} reports {engine.active()} active sequences with none running")
            return
        for tid, result in engine.step():
            if tid not in self.running:
                continue
            if tid in cancelled:  # cancelled while the step ran: nothing after a cancel is emitted
                final = engine.drop(tid) if isinstance(result, Delta) and result.finish_reason is None else None
                self._end_cancelled(tid, final, out)
            elif isinstance(result, RequestError):
                tokens = self.running.pop(tid)
                out.append(ErrorChunk(task_id=tid, message=str(result)))
                out.append(TaskStatus(tid, TaskState.FAILED, str(result), tokens=tokens))
                self._ended_task(tid)
            else:
                tokens = self.running[tid] = self.running[tid] + result.tokens
                out.append(
                    Chunk(
                        task_id=tid,
                        text=result.text,
                        tokens=result.tokens,
                        finish_reason=result.finish_reason,
                        prompt_tokens=result.prompt_tokens,
                        completion_tokens=result.completion_tokens,
                        logprobs=result.logprobs,
                        embedding=result.embedding,
                        cached_tokens=result.cached_tokens,
                        **_speculated(result),
                        dropped_messages=result.dropped_messages,
                        prefilled=result.prefilled,
                        tokenized=result.tokenized,
                        reasoning=result.reasoning,
                        ids=result.ids,
                        draws=result.draws,
                        seed=result.seed,
                    )
                )
                if result.finish_reason is not None:
                    del self.running[tid]
                    state = TaskState.CANCELLED if result.finish_reason == "cancelled" else TaskState.COMPLETE
                    out.append(
                        TaskStatus(tid, state, "cancelled" if state is TaskState.CANCELLED else None, tokens=tokens)
                    )
                    self._ended_task(tid)
        self._report_batch(out)
        self.sender.send_many(out)

    def _end_cancelled(self, tid: str, final: Delta | None, out: list[object]) -> None:
        tokens = self.running.pop(tid)
        if final is None:
            out.append(Chunk(tid, "", 0, "cancelled", 0, tokens))
        else:  # what it drafted and stepped until then counts too (the metrics' tokens per step)
            out.append(Chunk(tid, "", 0, "cancelled", final.prompt_tokens, tokens, **_speculated(final)))
        out.append(TaskStatus(tid, TaskState.CANCELLED, "cancelled", tokens=tokens))
        self._ended_task(tid)

    def _ended_task(self, tid: str) -> None:
        self._ended.add(tid)
        self.cancelled.discard(tid)

    def _report_batch(self, out: list[object]) -> None:
        """The status follows the batch: Running(running, waiting) while anything is, Ready when it empties."""
        status: RunnerStatus = (
            Running(len(self.running), len(self.waiting)) if self.running or self.waiting else Ready()
        )
        if status != self.status:
            with self._status_lock:
                if self._final:
                    return
                self.status = status
                out.append(StatusUpdate(status))

    def shutdown(self, task: ShutdownTask) -> None:
        self.task_status(task.task_id, TaskState.RUNNING)
        out: list[object] = []
        if self.engine is not None:  # what is generating ends cancelled; what waits was never started
            for tid in list(self.running):
                self._end_cancelled(tid, self.engine.drop(tid), out)
        for waiting in self.waiting:
            out.append(TaskStatus(waiting.task_id, TaskState.CANCELLED, "the runner shut down before the task started"))
        self.waiting.clear()
        self.sender.send_many(out)
        self.set_status(ShuttingDown())
        # Tasks queued behind the shutdown get an explicit answer rather than silence.
        while True:
            try:
                item = self.tasks.get_nowait()
            except queue.Empty:
                break
            if item is not _EOF:
                self.refuse(cast(Task, item), TaskState.CANCELLED, "the runner shut down before the task started")
        self.close_engine()
        self.task_status(task.task_id, TaskState.COMPLETE)
        self.set_status(Shutdown())

    def close_engine(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()

    def report_fatal(self, exc: BaseException) -> None:
        """Send the exception that is ending this runner; best effort (memory may be gone)."""
        try:
            tb = "".join(traceback.format_exception(exc))
            self.sender.send(
                RunnerException(
                    exc_type=type(exc).__qualname__,
                    message=str(exc),
                    traceback=tb,
                    phase=phase_of(self.status) or "",
                    memory_error=isinstance(exc, MemoryError),
                    load_error=isinstance(exc, EngineLoadError),
                )
            )
            print(tb, file=sys.stderr, end="", flush=True)
        except BaseException:
            pass


_PAGE = os.sysconf("SC_PAGE_SIZE")


class _Speculated(TypedDict):
    draft_tokens: int
    draft_accepted: int
    prediction_accepted: int
    prediction_rejected: int
    decode_steps: int


def _resumed(task: GenerateTask) -> bool:
    return isinstance(task.params, GenerateParams) and task.params.resume is not None


def _speculated(delta: Delta) -> _Speculated:
    """A delta's drafting and step counts, as its chunk carries them (a cancelled task's last chunk too)."""
    return _Speculated(
        draft_tokens=delta.draft_tokens,
        draft_accepted=delta.draft_accepted,
        prediction_accepted=delta.prediction_accepted,
        prediction_rejected=delta.prediction_rejected,
        decode_steps=delta.decode_steps,
    )


def _statm() -> tuple[int, int]:
    """This process's resident and anonymous bytes (resident minus shared/file-backed), 0s when unreadable."""
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        resident, shared = int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return 0, 0
    return resident * _PAGE, max(resident - shared, 0) * _PAGE


def _hard_exit(code: int) -> NoReturn:
    """Exit without interpreter teardown: native engine threads must not be able to hang the exit."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> NoReturn:
    args = RunnerArgs.parse(sys.argv[1:] if argv is None else argv)
    config = msgspec.json.decode(os.environ.pop(env.RUNNER_CONFIG), type=RunnerConfig)
    # Into the memory cgroup, then orphan protection, while this is the only thread: the guard it forks, and every
    # helper the engine starts later, begin inside the cgroup, out of which none of them can move.
    cgroup = lifeline.join_cgroup(config.cgroup) if config.cgroup is not None else None
    lifeline.install(
        config.worker_pid,
        config.lifeline_fd,
        config.orphan_layers,
        config.orphan_poll_interval,
        own_cgroup=cgroup if config.own_cgroup else None,
    )
    tasks_fd, events_fd = args.tasks_fd, args.events_fd
    os.set_inheritable(tasks_fd, False)  # the runner's own children must never hold its channel open
    os.set_inheritable(events_fd, False)
    faults.events_fd = events_fd
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # "show me your stacks"
    sender = SyncSender(events_fd)
    sender.send(RunnerHello(pid=os.getpid(), pgid=os.getpgrp(), engine=config.spec.engine, model=config.spec.model))
    runner = Runner(config, sender, tasks_fd)
    sender.send(StatusUpdate(runner.status))
    try:
        code = runner.serve()
    except BaseException as exc:
        runner.report_fatal(exc)
        _hard_exit(1)
    _hard_exit(code)
