"""Evidence that the kernel's out-of-memory killer took a runner: its memory cgroup's counter and the kernel log.

A SIGKILL alone says nothing about who sent it. The OOM killer leaves two traces: the ``oom_kill`` counter of the
memory cgroup it acted in (v2 ``memory.events``, v1 ``memory.oom_control``), and a kernel log line naming the pid
("Killed process 1234 (python)", "oom-kill:...,pid=1234,..."). The counter needs a baseline taken while the runner
lives (an exited task is moved back to the root cgroup, so its cgroup cannot be read afterwards); the log line needs
/dev/kmsg to be readable (root, or ``kernel.dmesg_restrict=0``) and is matched only after the runner's start, since
pids are reused.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from tether.kernel.cgroups import MemoryCgroup
from tether.kernel.pids import proc_stat

# A hung runner whose own memory cgroup holds this share of its limit beyond the file cache the kernel could drop, or
# is this full and thrashing (``STALL_REFAULTS`` pages dropped and read back while the runner was silent), is
# stalled at its limit: each allocation waits on reclaim, and the OOM killer may come seconds later or never.
AT_LIMIT_SHARE = 0.9
STALL_REFAULTS = 256  # 1 MiB of 4 KiB pages: more than a deadlocked runner's stray threads could read back

_KMSG_OOM = re.compile(r"(Killed process (?P<a>\d+) )|(oom-kill:.*\bpid=(?P<b>\d+)\b)")


def open_kmsg() -> int | None:
    """A non-blocking /dev/kmsg reader positioned at the end of the log (None when not readable).

    Opened when a runner starts, so its death costs reading only what was logged since, not the whole log (which
    can hold thousands of records, e.g. earlier OOM dumps).
    """
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        os.close(fd)
        return None
    return fd


def kernel_oom_lines(fd: int, pid: int, since_boot_s: float, limit: int = 4) -> list[str]:
    """Kernel log lines about the OOM killer taking ``pid``, logged at or after ``since_boot_s``, read without
    blocking (each read returns one record) from the position of ``fd`` (see ``open_kmsg``) to the end."""
    found: list[str] = []
    while True:
        try:
            record = os.read(fd, 8192)
        except BlockingIOError:
            break  # the end of the buffer
        except BrokenPipeError:
            continue  # records were overwritten while reading: carry on from the oldest one left
        except OSError:
            break
        if not record:
            break
        head, _, message = record.decode("utf-8", "replace").partition(";")
        fields = head.split(",")
        if len(fields) < 3 or int(fields[2]) / 1e6 < since_boot_s - 0.01:
            continue
        text = message.splitlines()[0] if message else ""
        match = _KMSG_OOM.search(text)
        if match and (match.group("a") == str(pid) or match.group("b") == str(pid)):
            found.append(text.strip())
    return found[-limit:]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@dataclass
class OomWatch:
    """What the supervisor keeps about one runner so that, should it die by SIGKILL, it can tell an OOM kill.

    ``observe`` is called at hello and on heartbeats: it notes the runner's memory cgroup and, the first time each
    cgroup is seen, its ``oom_kill`` counter, so a later rise can be attributed to this runner's lifetime.
    """

    pid: int
    cgroup: MemoryCgroup | None = None  # given: the cgroup the runner joins at bootstrap; else found on observation
    own: bool = False  # the given cgroup is the runner's alone (every member is its descendant)
    since_boot_s: float = 0.0
    baseline: int | None = None
    shared: bool = True  # the cgroup holds processes outside the runner's group: its counter is weaker evidence
    last_rss: int | None = None
    last_anon: int | None = None
    refaults_at_beat: int | None = None  # the own cgroup's ``MemoryCgroup.refaults`` at the last heartbeat

    def __post_init__(self) -> None:
        stat = proc_stat(self.pid)
        self.since_boot_s = stat.started_since_boot if stat is not None else 0.0
        self._kmsg = open_kmsg()
        self._given = self.cgroup is not None
        if self.cgroup is not None:
            self.baseline = self.cgroup.oom_kills()
            self.shared = not self.own

    def close(self) -> None:
        if self._kmsg is not None:
            os.close(self._kmsg)
            self._kmsg = None

    def observe(self, rss: int | None = None, anon: int | None = None) -> None:
        if rss:
            self.last_rss, self.last_anon = rss, anon
        if self._given:
            if not self.own and self.cgroup is not None and self.pid in self.cgroup.pids():
                self.shared = self._holds_others(self.cgroup)
        else:
            cgroup = MemoryCgroup.of_pid(self.pid)
            if cgroup is not None and cgroup != self.cgroup:
                self.cgroup, self.baseline = cgroup, cgroup.oom_kills()
                self.shared = self._holds_others(cgroup)
        if self.cgroup is not None and not self.shared:
            self.refaults_at_beat = self.cgroup.refaults()

    def _holds_others(self, cgroup: MemoryCgroup) -> bool:
        return any(_pgid(pid) != self.pid for pid in cgroup.pids())

    def at_limit(self) -> LimitStall | None:
        """Whether the runner's own memory cgroup, limited and not shared, is as full as the kernel lets it be now:
        what it holds beyond droppable file cache at ``AT_LIMIT_SHARE`` of its limit or more, or that full counting
        the cache and thrashing since the last heartbeat (a fresh runner's cgroup holds the cache of every module it
        read: the kernel drops it and the runner reads it back). None when not, or without such a cgroup. A full
        enclosing cgroup (the worker's) is shared: a runner deadlocked beside siblings that fill it is not out of
        memory; nor is one deadlocked in a full cgroup of its own that nothing reads back."""
        if self.cgroup is None or self.shared:
            return None
        limit = self.cgroup.limit()
        usage = self.cgroup.usage()
        if limit is None or usage is None:
            return None
        held = usage - self.cgroup.reclaimable()
        refaults = self.cgroup.refaults() - self.refaults_at_beat if self.refaults_at_beat is not None else 0
        thrashing = refaults >= STALL_REFAULTS and usage >= AT_LIMIT_SHARE * limit
        if held < AT_LIMIT_SHARE * limit and not thrashing:
            return None
        return LimitStall(held, limit, str(self.cgroup.path), usage, max(refaults, 0))

    def evidence(self) -> OomEvidence:
        """Gather the evidence now (call after a SIGKILL exit, before the cgroup could be reused)."""
        ev = OomEvidence(
            kernel_lines=[] if self._kmsg is None else kernel_oom_lines(self._kmsg, self.pid, self.since_boot_s),
            last_rss=self.last_rss,
            last_anon=self.last_anon,
        )
        if self.cgroup is not None:
            ev.cgroup = str(self.cgroup.path)
            ev.oom_kills_before = self.baseline
            ev.oom_kills_after = self.cgroup.oom_kills()
            binding = self.cgroup.binding_limit()
            if binding is not None:
                ev.limit, where = binding
                ev.limit_set_on = str(where) if where != self.cgroup.path else None
            ev.peak = self.cgroup.peak()
            ev.shared_cgroup = self.shared
        return ev


@dataclass(frozen=True)
class LimitStall:
    """A memory cgroup found full when its runner went silent (``OomWatch.at_limit``)."""

    held: int  # bytes charged to it that the kernel cannot drop (usage less inactive file cache)
    limit: int  # its limit
    cgroup: str  # its path
    usage: int  # bytes charged to it, file cache included
    refaults: int = 0  # pages it dropped and read back since the runner's last heartbeat


@dataclass
class OomEvidence:
    kernel_lines: list[str] = field(default_factory=list)
    cgroup: str | None = None
    oom_kills_before: int | None = None
    oom_kills_after: int | None = None
    limit: int | None = None  # the limit that binds the cgroup: its own, or an ancestor's (then ``limit_set_on``)
    limit_set_on: str | None = None  # the ancestor cgroup the binding limit is set on; None when it is the cgroup's own
    peak: int | None = None
    shared_cgroup: bool = True
    last_rss: int | None = None
    last_anon: int | None = None

    @property
    def anon_at_kill(self) -> int | None:
        """The runner's anonymous memory when the OOM killer took it, from the kernel's "Killed process" line."""
        for line in self.kernel_lines:
            match = re.search(r"anon-rss:(\d+)kB", line)
            if match:
                return int(match.group(1)) * 1024
        return None

    @property
    def counter_rose(self) -> bool:
        return (
            self.oom_kills_before is not None
            and self.oom_kills_after is not None
            and self.oom_kills_after > self.oom_kills_before
        )

    @property
    def killed_by_oom(self) -> bool:
        """The kernel log names the pid, or the counter of a cgroup holding only this runner's group rose."""
        return bool(self.kernel_lines) or (self.counter_rose and not self.shared_cgroup)

    def lines(self) -> list[str]:
        out = list(self.kernel_lines)
        if self.cgroup is not None:
            out.append(
                f"memory cgroup {self.cgroup}: oom_kill {self.oom_kills_before} -> {self.oom_kills_after}"
                + (" (shared with other processes)" if self.shared_cgroup else "")
            )
        return out
