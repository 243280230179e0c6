"""Runner processes: spawn, exit fd, wait status, process-group kill.

Spawning uses ``subprocess`` (fork+exec in C, safe from a threaded async process) to start a fresh interpreter
running ``python -m tether.runner``: nothing of the worker's state, threads or locks leaks into the runner. The
runner gets exactly two pipe ends (tasks in, events out) via ``pass_fds``; every other descriptor of the worker is
closed in the child, so no runner holds another runner's channel open. Each runner leads its own process group,
so its engine's helper processes can be killed with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import anyio
import msgspec

from tether.protocol import RunnerConfig

CONFIG_ENV = "TETHER_RUNNER_CONFIG"


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


def _open_pidfd(pid: int) -> int | None:
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def spawn_runner(config: RunnerConfig, *, env: dict[str, str] | None = None) -> RunnerProcess:
    """Start a runner process. Call from a thread that lives as long as the worker (PR_SET_PDEATHSIG follows it)."""
    tasks_r, tasks_w = os.pipe()
    events_r, events_w = os.pipe()
    output_r, output_w = os.pipe()
    child_env = dict(os.environ if env is None else env)
    child_env[CONFIG_ENV] = msgspec.json.encode(config).decode()
    child_env["PYTHONUNBUFFERED"] = "1"
    argv = [sys.executable, "-m", "tether.runner", str(tasks_r), str(events_w)]
    try:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output_w,
            stderr=output_w,
            pass_fds=(tasks_r, events_w),
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
        popen=popen, tasks_fd=tasks_w, events_fd=events_r, output_fd=output_r, pidfd=_open_pidfd(popen.pid)
    )
