"""Runner processes: spawn, exit fd, wait status, process-group kill.

Spawning uses ``subprocess`` (fork+exec in C, safe from a threaded async process) to start a fresh interpreter
running ``python -m tether.runner``: nothing of the worker's state, threads or locks leaks into the runner. The
runner gets exactly three descriptors (tasks in, events out, the lifeline's read end) via ``pass_fds``; every other
descriptor of the worker is closed in the child, so no runner holds another runner's channel or the lifeline's write
end. Each runner leads its own process group, so its engine's helper processes can be killed with it.

All spawns happen on one long-lived daemon thread: ``PR_SET_PDEATHSIG`` fires when the thread that forked the
child exits, so spawning from a pool thread (which exits when idle) would kill healthy runners.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import msgspec

from tether.env import RUNNER_CONFIG
from tether.kernel.pids import open_pidfd
from tether.protocol import RunnerArgs, RunnerConfig

T = TypeVar("T")


@dataclass(frozen=True)
class ExitStatus:
    """A decoded wait status: exactly one of ``code`` or ``signal`` is set."""

    code: int | None
    signal: int | None
    core_dumped: bool = False

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        if os.WIFSIGNALED(status):
            return cls(code=None, signal=os.WTERMSIG(status), core_dumped=os.WCOREDUMP(status))
        return cls(code=os.WEXITSTATUS(status), signal=None)

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    @property
    def signal_description(self) -> str | None:
        return signal.strsignal(self.signal) if self.signal is not None else None

    def describe(self) -> str:
        if self.signal is not None:
            core = ", core dumped" if self.core_dumped else ""
            return f"killed by {self.signal_name} ({self.signal_description}{core})"
        return f"exited with code {self.code}"

    @property
    def returncode(self) -> int:
        """subprocess's convention: negative signal number, else the exit code."""
        return -self.signal if self.signal is not None else (self.code or 0)


@dataclass
class RunnerProcess:
    """A spawned runner: its pid/group, the worker's ends of its pipes, and a way to await its exit."""

    popen: subprocess.Popen[bytes]
    tasks_fd: int  # worker writes tasks here
    events_fd: int  # worker reads events here
    output_fd: int  # runner's stdout+stderr, read line by line by the supervisor
    pidfd: int | None
    started_at: float = field(default_factory=time.monotonic)
    exit_status: ExitStatus | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        return self.popen.pid  # process_group=0: the runner leads a group named after its pid

    async def wait_exit(self) -> ExitStatus:
        """Await the exit without polling (pidfd readable in the event loop), then reap it for its status.

        The group is killed between the exit and the reap: while the runner is an unreaped zombie its pid (and so
        its group id) cannot be reused, so this kill reaches only the runner's own leftovers.
        """
        if self.exit_status is not None:
            return self.exit_status
        if self.pidfd is not None:
            await anyio.wait_readable(self.pidfd)
        else:  # no pidfd (not Linux >= 5.3): one thread per runner life, never per message
            await anyio.to_thread.run_sync(_wait_for_exit_without_reaping, self.pid, abandon_on_cancel=True)
        self.kill_group(signal.SIGKILL)
        _, status = os.waitpid(self.pid, 0)
        self.exit_status = ExitStatus.from_wait_status(status)
        self.popen.returncode = self.exit_status.returncode  # keep subprocess from reaping or warning later
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        return self.exit_status

    def kill_group(self, sig: int) -> None:
        """Signal the runner's whole process group; a group that is already gone is fine."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def signal(self, sig: int) -> None:
        if self.exit_status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def close_fds(self) -> None:
        for fd in (self.tasks_fd, self.events_fd, self.output_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _wait_for_exit_without_reaping(pid: int) -> None:
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


class _SpawnThread:
    """One daemon thread that performs every spawn, so every runner's parent thread lives as long as the worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future[object]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the spawn thread and return its result (or raise its exception)."""
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="tether-spawner", daemon=True)
                self._thread.start()
            self._queue.put((fn, future))
        return future.result()  # type: ignore[return-value]

    def _serve(self) -> None:
        while True:
            fn, future = self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

    def forget(self) -> None:
        """After fork: the thread did not survive into the child; the next spawn starts a new one."""
        self._lock = threading.Lock()
        self._queue = queue.SimpleQueue()
        self._thread = None


class _Lifeline:
    """The worker's end of the lifeline: one pipe per worker process, created on first use.

    Every runner gets the read end; only this process holds the write end, which is non-inheritable and closed in
    forked children, so it closes exactly when the worker process dies, however it dies.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: tuple[int, int] | None = None

    def read_fd(self) -> int:
        with self._lock:
            if self._fds is None:
                self._fds = os.pipe()  # both ends non-inheritable; pass_fds hands the read end to each runner
            return self._fds[0]

    def forget(self) -> None:
        """In a forked child: drop the parent's write end, or its runners would stay alive as long as we do."""
        self._lock = threading.Lock()
        if self._fds is not None:
            for fd in self._fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds = None


_SPAWNER = _SpawnThread()
_LIFELINE = _Lifeline()


def _after_fork_in_child() -> None:
    _SPAWNER.forget()
    _LIFELINE.forget()


os.register_at_fork(after_in_child=_after_fork_in_child)


def lifeline_read_fd() -> int:
    """The read end of this worker's lifeline, as every runner gets it (created on first use)."""
    return _LIFELINE.read_fd()


async def start_runner(config: RunnerConfig, *, env: dict[str, str] | None = None) -> RunnerProcess:
    """Spawn a runner on the long-lived spawn thread, with the worker's lifeline, without blocking the loop.

    Not abandoned on cancellation: a spawn that completes is always handed back, so no runner goes untracked.
    """
    config = msgspec.structs.replace(config, lifeline_fd=_LIFELINE.read_fd())
    return await anyio.to_thread.run_sync(_SPAWNER.call, functools.partial(spawn_runner, config, env=env))


def spawn_runner(config: RunnerConfig, *, env: dict[str, str] | None = None) -> RunnerProcess:
    """Start a runner process on the calling thread, which must live as long as the worker (``start_runner`` does).

    ``config.lifeline_fd``, when set, is passed to the runner as is.
    """
    tasks_r, tasks_w = os.pipe()
    events_r, events_w = os.pipe()
    output_r, output_w = os.pipe()
    child_env = dict(os.environ if env is None else env)
    child_env[RUNNER_CONFIG] = msgspec.json.encode(config).decode()
    child_env["PYTHONUNBUFFERED"] = "1"
    argv = RunnerArgs(tasks_r, events_w, config.worker_pid, config.runner_id).argv()
    passed = (tasks_r, events_w) if config.lifeline_fd is None else (tasks_r, events_w, config.lifeline_fd)
    try:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output_w,
            stderr=output_w,
            pass_fds=passed,
            close_fds=True,
            process_group=0,
            env=child_env,
        )
    except BaseException:
        for fd in (tasks_r, tasks_w, events_r, events_w, output_r, output_w):
            os.close(fd)
        raise
    # The worker must not hold the runner's ends: EOF on events/output then means the runner is gone.
    for fd in (tasks_r, events_w, output_w):
        os.close(fd)
    return RunnerProcess(
        popen=popen, tasks_fd=tasks_w, events_fd=events_r, output_fd=output_r, pidfd=open_pidfd(popen.pid)
    )
