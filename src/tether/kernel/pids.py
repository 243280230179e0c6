"""Linux process handles both sides use: pidfds (pin, check, signal, wait) and /proc/PID/stat.

One place for each job, because each is safety-critical: a pid is only a number, and once its process has exited
it may name anyone's process. So nothing is signalled through a bare pid: it is pinned with a pidfd first, then
its identity is checked, then it is signalled through the pidfd (``signal_pinned``).
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path


def open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (a handle that cannot come to mean another process), or None when gone or unsupported."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def pin(pid: int, refuse: Callable[[int], str | None]) -> tuple[int | None, str | None]:
    """Pin ``pid`` with a pidfd, then check it is the process we mean: ``(pidfd, None)`` (the caller closes it),
    ``(None, why)`` when ``refuse(pid)`` says it is someone else, ``(None, None)`` when it is gone or pidfds are
    missing (a bare pid could be anyone's by now, so nothing may be signalled through it).

    The pidfd is opened *before* the identity check (group, cgroup, start time): from then on the pid cannot be
    reused, so a process that replaced ours under the same pid is never hit by what the caller sends next.
    """
    fd = open_pidfd(pid)
    if fd is None:
        return None, None
    try:
        why = refuse(pid)
    except (ProcessLookupError, FileNotFoundError):  # exited during the check: gone
        os.close(fd)
        return None, None
    if why is not None:
        os.close(fd)
        return None, why
    return fd, None


def signal_pinned(pid: int, sig: int, belongs: Callable[[int], bool]) -> int | None:
    """Signal ``pid`` only if it is still the process we mean (``belongs``, checked after it is pinned, see
    :func:`pin`); return its pidfd (the caller closes it), or None when gone, not ours, or pidfds are missing."""
    fd, _ = pin(pid, lambda p: None if belongs(p) else "not ours")
    if fd is None:
        return None
    try:
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:  # exited between the check and the signal: it counts as gone
        os.close(fd)
        return None
    return fd


def iter_exits(pidfds: Mapping[int, int], timeout: float | None, *, any_exit: bool = False) -> Iterator[int]:
    """Yield the pids behind ``pidfds`` (fd -> pid) as they exit, until all have (or ``timeout`` s pass; None:
    no bound). With ``any_exit``, stop after the first poll that sees one exit."""
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    left = len(pidfds)
    deadline = None if timeout is None else time.monotonic() + timeout
    while left:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return
        ready = poller.poll(None if remaining is None else remaining * 1000)
        for fd, _ in ready:
            poller.unregister(fd)
            left -= 1
            yield pidfds[fd]
        if any_exit and ready:
            return


def wait_pidfds(pidfds: Mapping[int, int], timeout: float | None, *, any_exit: bool = False) -> set[int]:
    """Wait (bounded by ``timeout`` s unless None) until the processes behind ``pidfds`` (fd -> pid) exit; return
    the pids that did. With ``any_exit``, return as soon as at least one has exited (or the timeout passes)."""
    return set(iter_exits(pidfds, timeout, any_exit=any_exit))


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    """The few fields of /proc/PID/stat tether needs."""

    pid: int
    state: str  # "Z" for a zombie
    ppid: int
    pgid: int
    start_ticks: int = 0  # start time in clock ticks since boot (CLOCK_BOOTTIME, the kernel log's clock)

    @property
    def started_since_boot(self) -> float:
        """When it started, in seconds since boot."""
        return self.start_ticks / _CLOCK_TICKS

    @property
    def started_at(self) -> float:
        """When it started, in seconds since the epoch, to a clock tick (psutil's figure is only within 1 s: it
        takes the boot time from /proc/stat, in whole seconds)."""
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + self.started_since_boot


def proc_stat(pid: int) -> ProcStat | None:
    """One process's /proc/PID/stat fields, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces and parentheses: the fields follow its last ")".
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return ProcStat(pid, fields[0], int(fields[1]), int(fields[2]), int(fields[19]))


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a zombie holds nothing but its pid)."""
    stat = proc_stat(pid)
    return stat is not None and stat.state not in ("Z", "X")


def live_processes() -> list[ProcStat]:
    """Every process that exists and is not a zombie, from /proc (cheap enough to call per check)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) is not None and stat.state not in ("Z", "X"):
            found.append(stat)
    return found


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group. Zombies do not count: they hold nothing but a pid, and one reparented to
    an init that is slow to reap must not look like a survivor."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []  # the common case: no process at all, zombie or not
    except PermissionError:
        pass
    return sorted(p.pid for p in live_processes() if p.pgid == pgid)


def listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on TCP ``port`` (IPv4 and IPv6), from /proc/net/tcp{,6}."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(fields[9])
    return inodes


def holds_listener(pid: int, port: int, inodes: set[str] | None = None) -> bool:
    """Whether ``pid`` has a socket listening on TCP ``port`` among its open descriptors."""
    inodes = listening_inodes(port) if inodes is None else inodes
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def port_holders(port: int) -> list[int]:
    """The processes (that this process may inspect) listening on TCP ``port``: who holds a port a bind was refused."""
    inodes = listening_inodes(port)
    return [p.pid for p in live_processes() if holds_listener(p.pid, port, inodes)] if inodes else []


def cmdline(pid: int) -> list[str] | None:
    """A process's arguments (from /proc/PID/cmdline), or None when it is gone or unreadable."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    # Every argument ends with a NUL, the last one too: without dropping it, split() yields a trailing "".
    return raw.decode(errors="replace").removesuffix("\0").split("\0") if raw else []
