"""The old runner is gone: reaped, and no live process left in its process group.

A replacement life may start only once this holds, or it would compete with its predecessor (or the predecessor's
helpers) for memory, devices, ports and files: the seed's crash loop. Shared by the supervisor (``confirm_gone``),
the restart loop, the scheduler's unload and the node agent.
"""

from __future__ import annotations

import contextlib
import os
import signal

import anyio

from tether.errors import TetherError
from tether.kernel.pids import group_members, signal_pinned
from tether.node.spawn import ExitStatus, RunnerProcess


class NotGone(TetherError):
    """A runner life that ended is not confirmed gone within its bound: a replacement must not start."""


class RunnerNotGone(NotGone):
    """A dead runner's process group still has live members after the bound: a replacement must not start."""

    def __init__(self, pid: int, pgid: int, survivors: list[int], timeout: float) -> None:
        what = ", ".join(map(str, survivors))
        super().__init__(
            f"runner pid {pid} is gone but its process group {pgid} still has live processes ({what}) "
            f"{timeout:g} s later, despite SIGKILL: they are likely stuck in the kernel (uninterruptible I/O, a GPU "
            f"driver call). Not starting a replacement that would compete for what they hold; inspect them with "
            f"'ps -o pid,stat,wchan:32,cmd -g {pgid}'"
        )
        self.pid = pid
        self.pgid = pgid
        self.survivors = survivors


def _reaped(process: RunnerProcess) -> bool:
    """Whether the runner has been waited for; reaps it here if its supervisor gave up on it (it survived SIGKILL
    for the supervisor's whole stop bound) and it has died since."""
    if process.exit_status is not None:
        return True
    try:
        pid, status = os.waitpid(process.pid, os.WNOHANG)
    except ChildProcessError:
        return True  # reaped by someone else
    if pid == 0:
        return False
    process.exit_status = ExitStatus.from_wait_status(status)
    process.popen.returncode = process.exit_status.returncode
    return True


async def _kill_and_await(pids: list[int], pgid: int) -> None:
    """SIGKILL each process still in ``pgid`` through a pidfd (no pid-reuse race) and await its exit."""
    fds: list[int] = []
    try:
        for pid in pids:  # gone already, or no pidfds (the fallback below polls): nothing to await
            fd = signal_pinned(pid, signal.SIGKILL, lambda p: os.getpgid(p) == pgid)
            if fd is not None:
                fds.append(fd)
        for fd in fds:
            await anyio.wait_readable(fd)
        if not fds:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            await anyio.sleep(0.005)  # no pidfd to await (vanished, or unsupported): recheck shortly
    finally:
        for fd in fds:
            os.close(fd)


async def wait_runner_gone(process: RunnerProcess, timeout: float, *, kill: bool = True) -> None:
    """Return once ``process`` is reaped and its process group holds no live process; raise ``RunnerNotGone``
    after ``timeout`` s. With ``kill`` (the default) survivors in the group are SIGKILLed: they belong to a runner
    that is already dead. Waits on pidfds, not by polling (except where pidfds are missing)."""
    pid, pgid = process.pid, process.pgid
    survivors: list[int] = []
    with anyio.move_on_after(timeout):
        while True:
            survivors = group_members(pgid)
            if not _reaped(process) and pid not in survivors:
                survivors.append(pid)  # an unreaped zombie of ours: its pid is still held
            if not survivors:
                return
            if kill:
                await _kill_and_await(survivors, pgid)
            else:
                await anyio.sleep(0.01)
    raise RunnerNotGone(pid, pgid, survivors, timeout)
