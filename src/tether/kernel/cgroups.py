"""Memory cgroups (v1 and v2): find one, read its limits and counters, create one per runner, empty and remove it.

Both sides use this: the worker creates a runner's cgroup and samples it; the runner joins it before it forks
anything, and its group guard empties it when the runner dies (which catches the helpers that left the process
group). Emptying pins each member with a pidfd and checks it is still a member before it is signalled.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from tether.kernel.pids import signal_pinned, wait_pidfds
from tether.units import format_bytes

CGROUP_ROOT = Path("/sys/fs/cgroup")
_KILL_ROUNDS = 1000  # listings of a cgroup being emptied: ends a fork race long before it is reached
_UNLIMITED_V1 = 1 << 60  # v1 reports "no limit" as a huge page-aligned number (9223372036854771712)


def read_text(path: Path) -> str | None:
    """A small kernel file's text, or None when it does not exist or cannot be read."""
    try:
        return path.read_text()
    except OSError:
        return None


REFAULT_KEYS = ("workingset_refault_file", "workingset_refault_anon")  # memory.stat's thrashing counters


@dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup directory (v1 or v2)."""

    path: Path
    version: int

    @classmethod
    def at(cls, path: Path) -> MemoryCgroup:
        """The cgroup at ``path`` (v1 below the memory controller's mount, else v2)."""
        return cls(path, 1 if CGROUP_ROOT / "memory" in path.parents else 2)

    @classmethod
    def of_pid(cls, pid: int) -> MemoryCgroup | None:
        """The memory cgroup ``pid`` is in now; None when gone or when there is no memory controller."""
        text = read_text(Path(f"/proc/{pid}/cgroup"))
        if text is None:
            return None
        unified: str | None = None
        for line in text.splitlines():
            _, controllers, rel = line.split(":", 2)
            if "memory" in controllers.split(","):
                return cls(CGROUP_ROOT / "memory" / rel.lstrip("/"), 1)
            if controllers == "":
                unified = rel
        if unified is not None and (CGROUP_ROOT / "cgroup.controllers").exists():
            return cls(CGROUP_ROOT / unified.lstrip("/"), 2)
        return None

    def pids(self) -> list[int]:
        """The processes in this cgroup now (none when it is gone)."""
        return [int(p) for p in (read_text(self.path / "cgroup.procs") or "").split()]

    def oom_kills(self) -> int | None:
        """How many processes the OOM killer has killed in this cgroup (None where the kernel does not say)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        text = read_text(self.path / name)
        if text is None:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    def limit(self) -> int | None:
        """The memory limit in bytes; None when unlimited or unreadable."""
        text = read_text(self.path / ("memory.max" if self.version == 2 else "memory.limit_in_bytes"))
        if text is None or text.strip() == "max":
            return None
        value = int(text)
        return None if value >= _UNLIMITED_V1 else value

    def peak(self) -> int | None:
        """The highest usage recorded for this cgroup (v2 ``memory.peak`` needs Linux >= 5.19)."""
        text = read_text(self.path / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"))
        return int(text) if text is not None and text.strip().isdigit() else None

    def usage(self) -> int | None:
        text = read_text(self.path / ("memory.current" if self.version == 2 else "memory.usage_in_bytes"))
        return int(text) if text is not None and text.strip().isdigit() else None

    def stat(self) -> dict[str, int]:
        text = read_text(self.path / "memory.stat") or ""
        return {k: int(v) for k, _, v in (line.partition(" ") for line in text.splitlines()) if v.isdigit()}

    def effective_limit(self) -> int | None:
        """The tightest limit over this cgroup and its ancestors (a parent's limit binds its children too)."""
        binding = self.binding_limit()
        return binding[0] if binding is not None else None

    def binding_limit(self) -> tuple[int, Path] | None:
        """(the tightest limit over this cgroup and its ancestors, the cgroup it is set on); None when unlimited.

        A limit set on an ancestor (the worker's cgroup, a container's) binds this cgroup as tightly as its own, and
        an out-of-memory kill it causes is counted here: a cause must name that limit and where it is set.
        """
        root = CGROUP_ROOT / "memory" if self.version == 1 else CGROUP_ROOT
        best: tuple[int, Path] | None = None
        path = self.path
        while path == root or root in path.parents:
            limit = MemoryCgroup(path, self.version).limit()
            if limit is not None and (best is None or limit < best[0]):
                best = (limit, path)
            if path == root:
                break
            path = path.parent
        return best

    def refaults(self) -> int:
        """Pages the kernel dropped from this cgroup to make room under its limit and then had to read back
        (``workingset_refault_file`` + ``_anon`` in memory.stat, v1 and v2): what rises while it thrashes at its
        limit, and stays flat while it deadlocks or merely sits full. 0 where the kernel does not say."""
        stat = self.stat()
        return sum(stat.get(f"total_{key}", stat.get(key, 0)) for key in REFAULT_KEYS)

    def anonymous(self) -> int:
        """Its processes' anonymous memory (``total_rss`` on v1, ``anon`` on v2): what a dead process still holds
        while the kernel tears its address space down."""
        stat = self.stat()
        return stat.get("total_rss", stat.get("anon", 0))

    def reclaimable(self) -> int:
        """File cache the kernel can drop under pressure (inactive file pages), which "usage" counts as used."""
        stat = self.stat()
        return stat.get("total_inactive_file", stat.get("inactive_file", 0))


def create_child_cgroup(name: str, memory_limit: int | None = None) -> tuple[MemoryCgroup | None, str | None]:
    """A new memory cgroup below this process's own, with an optional limit: (cgroup, None) or (None, why not).

    Below our own cgroup, so whatever limits the worker also limits its runners. On cgroup v2 the memory controller
    must be delegated to our cgroup's children (``cgroup.subtree_control``); without it there is no containment.
    """
    parent = MemoryCgroup.of_pid(os.getpid())
    if parent is None:
        return None, "no memory cgroup controller is mounted"
    if parent.version == 2 and "memory" not in (read_text(parent.path / "cgroup.subtree_control") or "").split():
        return None, f"the memory controller is not delegated below {parent.path} (cgroup.subtree_control)"
    path = parent.path / name
    try:
        path.mkdir()
    except OSError as exc:
        return None, f"cannot create {path}: {exc.strerror or exc}"
    cgroup = MemoryCgroup(path, parent.version)
    if memory_limit is not None:
        try:
            if parent.version == 2:
                (path / "memory.max").write_text(str(memory_limit))
                with contextlib.suppress(OSError):  # no swap accounting: the limit alone still binds
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(memory_limit))
                with contextlib.suppress(OSError):  # memsw exists only with swap accounting
                    (path / "memory.memsw.limit_in_bytes").write_text(str(memory_limit))
        except OSError as exc:
            remove_cgroup(cgroup)
            return None, f"cannot set a {format_bytes(memory_limit)} limit on {path}: {exc.strerror or exc}"
    return cgroup, None


RUNNER_CGROUP_PREFIX = "tether-"


def runner_cgroup_name(runner_id: str) -> str:
    """``tether-<runner id>-<worker pid>``: the worker pid lets a later sweep tell a dead worker's leftovers."""
    return f"{RUNNER_CGROUP_PREFIX}{runner_id}-{os.getpid()}"


_RUNNER_CGROUP = re.compile(rf"^{RUNNER_CGROUP_PREFIX}(?P<runner>.+)-(?P<worker>\d+)$")
_WALK_DEPTH = 16


@dataclass(frozen=True)
class RunnerCgroup:
    """A runner's own cgroup, found by its name (``runner_cgroup_name``) anywhere in the memory hierarchy."""

    cgroup: MemoryCgroup
    runner_id: str
    worker_pid: int
    created: float  # seconds since the epoch (the directory's change time: set when it was made)


def runner_cgroups() -> list[RunnerCgroup]:
    """Every runner cgroup of the memory hierarchy this process sees, live workers' included (``orphans`` tells the
    dead workers' apart). Workers make them below their own cgroup, which a later worker may not share."""
    own = MemoryCgroup.of_pid(os.getpid())
    if own is None:
        return []
    root = CGROUP_ROOT / "memory" if own.version == 1 else CGROUP_ROOT
    found: list[RunnerCgroup] = []
    level = [root]
    for _ in range(_WALK_DEPTH):
        below: list[Path] = []
        for path in level:
            try:
                entries = [e for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for entry in entries:
                match = _RUNNER_CGROUP.match(entry.name)
                if match is None:
                    below.append(Path(entry.path))
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    found.append(
                        RunnerCgroup(
                            MemoryCgroup(Path(entry.path), own.version),
                            match["runner"],
                            int(match["worker"]),
                            min(st.st_ctime, st.st_mtime),
                        )
                    )
        if not below:
            break
        level = below
    return found


def kill_cgroup_members(cgroup: MemoryCgroup, *, spare: Collection[int] = (), wait: float = 0.0) -> int:
    """SIGKILL every process in ``cgroup`` but ``spare``, again while new ones appear (a fork racing the kill).

    For a runner's own cgroup: it catches what a process-group kill misses (a helper that called ``setsid`` or
    ``setpgid``, or daemonized with a double fork). Each process is pinned with a pidfd and checked to still be a
    member before it is signalled, so a pid reused elsewhere is never hit. With ``wait`` > 0 it then waits (on the
    pidfds, at most ``wait`` seconds) for every one to exit, listing the cgroup again after each exit: a child
    forked just before its parent was killed joins the cgroup a moment later and is caught then, so when this
    returns (within the bound) nobody but ``spare`` is left. Returns how many were signalled.
    """
    tried = set(spare)  # the spared, and every pid already signalled (or found gone) that has not exited since
    pinned: dict[int, int] = {}  # pidfd -> pid: signalled, not yet seen to exit
    killed = 0
    deadline = time.monotonic() + wait

    def member(pid: int) -> bool:
        return MemoryCgroup.of_pid(pid) == cgroup

    try:
        for _ in range(_KILL_ROUNDS):
            new = [pid for pid in cgroup.pids() if pid not in tried]
            for pid in new:
                tried.add(pid)
                fd = signal_pinned(pid, signal.SIGKILL, member)
                if fd is not None:
                    pinned[fd] = pid
                    killed += 1
            if new:
                continue  # list again at once: what they forked meanwhile
            remaining = deadline - time.monotonic()
            if not pinned or remaining <= 0:
                break
            exited = wait_pidfds(pinned, remaining, any_exit=True)
            for fd in [fd for fd, pid in pinned.items() if pid in exited]:
                tried.discard(pinned.pop(fd))  # gone: should its pid come back in the cgroup, it is someone new
                os.close(fd)
    finally:
        for fd in pinned:
            os.close(fd)
    return killed


def remove_cgroup(cgroup: MemoryCgroup) -> bool:
    """Remove an (empty) cgroup; False while processes are still leaving it."""
    try:
        cgroup.path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
