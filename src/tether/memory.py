"""Process memory as it really is: private/anonymous pages, swap and GPU memory, not just RSS.

RSS misleads both ways for inference processes. A runner that mmaps a multi-GB weight file shows it all in RSS,
though those pages are page cache the kernel can drop and that stays cached after the runner dies; a runner whose
weights live in GPU (or unified) memory shows almost nothing in RSS while pinning tens of GB. So every number here
is shown side by side, and :attr:`ProcessMemory.footprint` combines only the ones that are really the process's own.

Sources: ``/proc/PID/smaps_rollup`` (Linux ≥ 4.14; ``/proc/PID/smaps`` summed on older kernels) and NVML through
``pynvml`` (package ``nvidia-ml-py``), which is optional: without it GPU memory is *unknown* (``None``), never 0.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from tether.process import signal_pinned, wait_pidfds

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_NVML_MISSING: str | None = None  # set once NVML's library is known to be absent: not worth a dlopen per sample

CGROUP_ROOT = Path("/sys/fs/cgroup")
_KILL_ROUNDS = 1000  # listings of a cgroup being emptied: ends a fork race long before it is reached
_UNLIMITED_V1 = 1 << 60  # v1 reports "no limit" as a huge page-aligned number (9223372036854771712)


def read_text(path: Path) -> str | None:
    """A small kernel file's text, or None when it does not exist or cannot be read."""
    try:
        return path.read_text()
    except OSError:
        return None


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

    def reclaimable(self) -> int:
        """File cache the kernel can drop under pressure (inactive file pages), which "usage" counts as used."""
        stat = self.stat()
        return stat.get("total_inactive_file", stat.get("inactive_file", 0))


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory, in bytes.

    ``uss`` is Private_Clean + Private_Dirty: pages mapped by this process alone. It *includes* file pages only this
    process maps (a model file mmapped by one runner is all in ``uss``), which is why :attr:`footprint` does not use
    it. ``file`` is resident file-backed memory: Rss - Anonymous - Pss_Shmem. smaps has no resident-shmem count, so
    shmem shared with other processes is partly counted as ``file`` (exact when no shmem is shared). ``gpu`` is
    ``None`` when unknown (no NVML, or the driver does not report it) and 0 when NVML says the process holds none.
    """

    rss: int
    pss: int | None  # None from the cheap sample (``process_status_memory``): only smaps_rollup knows PSS and USS
    uss: int | None
    anon: int
    file: int
    swap: int
    gpu: int | None = None
    pss_anon: int | None = None  # anonymous memory with copy-on-write pages split among their sharers (Pss_Anon)
    shmem: int = 0  # shared memory (memfd, /dev/shm, SysV), proportional to the sharers (Pss_Shmem)

    @property
    def footprint(self) -> int:
        """Memory killing this process would free: anonymous (proportional: ``pss_anon`` when the kernel reports it,
        so a forked helper and its parent do not both count their shared copy-on-write pages) + its share of shmem
        (all of it when it alone maps it) + swap + GPU.

        Mapped files are left out (they are page cache: reclaimable, and still cached after the process dies), and
        so is shmem (it lives on while a file or another process holds it). GPU and unified memory are invisible to
        RSS, so they are added from NVML; an unknown ``gpu`` adds 0, so the footprint is then a lower bound.
        Anonymous pages still shared copy-on-write with a forked relative are counted in full; runners are
        exec'd, so they share none.
        """
        anon = self.anon if self.pss_anon is None else self.pss_anon
        return anon + self.shmem + self.swap + (self.gpu or 0)

    @classmethod
    def total(cls, items: Iterable[ProcessMemory]) -> ProcessMemory:
        """The sum of several processes (a runner and its helpers); ``gpu`` is ``None`` only if none is known.

        ``pss`` sums meaningfully across processes; ``rss``/``file`` count shared pages once per process.
        """
        items = list(items)
        gpus = [m.gpu for m in items if m.gpu is not None]
        return cls(
            rss=sum(m.rss for m in items),
            pss=_sum_known(m.pss for m in items),
            uss=_sum_known(m.uss for m in items),
            anon=sum(m.anon for m in items),
            file=sum(m.file for m in items),
            swap=sum(m.swap for m in items),
            gpu=sum(gpus) if gpus else None,
            pss_anon=sum(m.anon if m.pss_anon is None else m.pss_anon for m in items) if items else None,
            shmem=sum(m.shmem for m in items),
        )


@dataclass(frozen=True)
class GpuDevice:
    """One GPU's memory as the driver reports it (free is device-wide: it already excludes every process's use)."""

    index: int
    name: str
    total: int
    free: int


@dataclass(frozen=True)
class GpuUsage:
    """Per-pid GPU memory from one NVML snapshot (one NVML session serves every pid of a listing).

    ``by_pid`` maps each pid NVML lists, on any device, to its bytes summed over devices, or ``None`` when the driver
    does not report a figure (e.g. MIG, some Windows/WDDM setups). NVML lists pids of the host's pid namespace:
    inside a container they may not match ``/proc``.
    """

    available: bool
    reason: str | None = None
    by_pid: Mapping[int, int | None] = field(default_factory=lambda: MappingProxyType({}))
    devices: tuple[GpuDevice, ...] = ()

    @classmethod
    def snapshot(cls) -> GpuUsage:
        """Ask NVML which processes hold GPU memory now; unavailable (with the reason) when NVML can't say."""
        global _NVML_MISSING
        if _NVML_MISSING is not None:
            return cls(False, _NVML_MISSING)
        try:
            import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
        except ImportError:
            return cls(False, "nvidia-ml-py not installed")
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as e:
            if "Library Not Found" in str(e):  # no driver on this machine: it will not appear while we run
                _NVML_MISSING = f"NVML: {e}"
            return cls(False, f"NVML: {e}")
        by_pid: dict[int, int | None] = {}
        devices: list[GpuDevice] = []
        try:
            for index in range(int(pynvml.nvmlDeviceGetCount())):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                name = pynvml.nvmlDeviceGetName(handle)
                devices.append(
                    GpuDevice(
                        index, name.decode() if isinstance(name, bytes) else str(name), int(info.total), int(info.free)
                    )
                )
                queries = (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses)
                for query in queries:
                    try:
                        processes = query(handle)
                    except pynvml.NVMLError as e:
                        if e.value == pynvml.NVML_ERROR_NOT_SUPPORTED:  # e.g. graphics on a compute-only GPU
                            continue
                        raise
                    for p in processes:
                        pid, used = int(p.pid), p.usedGpuMemory
                        known = by_pid.get(pid, 0)
                        by_pid[pid] = None if used is None or known is None else known + int(used)
        except (pynvml.NVMLError, OSError) as e:
            return cls(False, f"NVML: {e}")
        finally:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
        return cls(True, None, MappingProxyType(by_pid), tuple(devices))

    def for_pid(self, pid: int) -> int | None:
        """GPU bytes held by ``pid``: ``None`` if unknown, 0 if NVML does not list it."""
        if not self.available:
            return None
        return self.by_pid.get(pid, 0)


def _sum_known(values: Iterable[int | None]) -> int | None:
    """The sum, or None when any part is unknown (a partial sum would read as a real figure)."""
    total = 0
    for value in values:
        if value is None:
            return None
        total += value
    return total


def _kib_fields(text: str) -> dict[str, int]:
    """The ``Key:   123 kB`` lines of a /proc file, in KiB; repeated keys (smaps: one block per mapping) summed."""
    kb: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        value = rest.split()
        if len(value) == 2 and value[1] == "kB":
            kb[key] = kb.get(key, 0) + int(value[0])
    return kb


def process_status_memory(pid: int, gpu: GpuUsage | None = None) -> ProcessMemory | None:
    """The cheap sample, from the kernel's per-process counters in /proc/PID/status (constant time: tens of µs).

    ``process_memory`` reads smaps_rollup, which walks the page tables: about 22 µs per MiB resident here, seconds
    for a runner holding a big model. This one gives RSS, anonymous, file-backed, shmem and swap (so ``footprint``,
    without proportional sharing: a forked helper's copy-on-write pages count in both), but not PSS or USS.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except (ProcessLookupError, FileNotFoundError, PermissionError):
        return None
    kb = {key: value * 1024 for key, value in _kib_fields(text).items()}
    if "VmRSS" not in kb:  # a zombie or a kernel thread: no address space
        return None
    return ProcessMemory(
        rss=kb["VmRSS"],
        pss=None,
        uss=None,
        anon=kb.get("RssAnon", 0),
        file=kb.get("RssFile", 0),
        swap=kb.get("VmSwap", 0),
        gpu=gpu.for_pid(pid) if gpu is not None else None,
        shmem=kb.get("RssShmem", 0),
    )


def process_memory(pid: int, gpu: GpuUsage | None = None) -> ProcessMemory | None:
    """Memory of ``pid`` now, or ``None`` if it is gone, has no address space (zombie, kernel thread) or is not ours
    to read. ``gpu`` is looked up in the given snapshot; without one it is unknown (``None``)."""
    try:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                text = f.read()
        except FileNotFoundError:  # kernel < 4.14, or no such process: the per-mapping file sums to the same
            with open(f"/proc/{pid}/smaps") as f:
                text = f.read()
    except (ProcessLookupError, FileNotFoundError, PermissionError):
        return None
    kb = _kib_fields(text)
    if not kb:  # smaps of a zombie or kernel thread is empty (smaps_rollup says ESRCH)
        return None
    rss, anon = kb.get("Rss", 0), kb.get("Anonymous", 0)
    return ProcessMemory(
        rss=rss * 1024,
        pss=kb.get("Pss", 0) * 1024,
        uss=(kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024,
        anon=anon * 1024,
        file=max(0, rss - anon - kb.get("Pss_Shmem", 0)) * 1024,
        swap=kb.get("Swap", 0) * 1024,
        gpu=gpu.for_pid(pid) if gpu is not None else None,
        pss_anon=kb["Pss_Anon"] * 1024 if "Pss_Anon" in kb else None,  # Linux >= 5.12
        shmem=kb.get("Pss_Shmem", 0) * 1024,
    )


def format_bytes(n: int | None) -> str:
    """``n`` bytes in binary units with about 3 significant digits ("98.2 MiB", "1.50 GiB"); ``None`` is "n/a"."""
    if n is None:
        return "n/a"
    sign, value = ("-" if n < 0 else ""), float(abs(n))
    unit = 0
    while value >= 1023.5 and unit < len(_UNITS) - 1:  # 1023.5 KiB would round to "1024 KiB": say "1.00 MiB"
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{int(value)} B"
    digits = 2 if value < 9.995 else 1 if value < 99.95 else 0
    return f"{sign}{value:.{digits}f} {_UNITS[unit]}"


# --------------------------------------------------------------------------------------------------------------
# Per-runner containment
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# Node memory
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeMemory:
    """What this node (as this worker sees it) can still give a model, and where each number comes from.

    ``available`` = min(host MemAvailable, cgroup limit - (cgroup usage - reclaimable file cache)): in a container
    the host's figure is not ours to spend, and a cgroup's "usage" counts page cache the kernel drops on demand.
    """

    available: int
    source: str  # which bound won, e.g. "cgroup limit (/sys/fs/cgroup/memory/...)" or "host MemAvailable"
    host_total: int
    host_available: int
    cgroup: str | None = None
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    cgroup_reclaimable: int | None = None
    gpus: tuple[GpuDevice, ...] = ()
    gpu_reason: str | None = None  # why there are no GPU figures

    def describe(self) -> list[str]:
        lines = [
            f"available {format_bytes(self.available)} ({self.source})",
            f"host: MemAvailable {format_bytes(self.host_available)} of MemTotal {format_bytes(self.host_total)} "
            "(/proc/meminfo)",
        ]
        if self.cgroup is not None:
            lines.append(
                f"cgroup {self.cgroup}: limit {format_bytes(self.cgroup_limit)}, usage "
                f"{format_bytes(self.cgroup_usage)}, reclaimable file cache {format_bytes(self.cgroup_reclaimable)}"
            )
        lines += [
            f"GPU {g.index} ({g.name}): {format_bytes(g.free)} free of {format_bytes(g.total)} (NVML)"
            for g in self.gpus
        ]
        if not self.gpus:
            lines.append(f"GPU: n/a ({self.gpu_reason or 'no device'})")
        return lines


def _meminfo() -> dict[str, int]:
    out = {}
    for line in (read_text(Path("/proc/meminfo")) or "").splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def node_memory(*, gpu: GpuUsage | None = None, pid: int | None = None) -> NodeMemory:
    """Memory available to this worker now (its own cgroup, or ``pid``'s), with the source of each number."""
    info = _meminfo()
    host_total, host_available = info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    available, source = host_available, "host MemAvailable"
    cgroup = MemoryCgroup.of_pid(os.getpid() if pid is None else pid)
    limit = usage = reclaimable = None
    if cgroup is not None:
        limit, usage, reclaimable = cgroup.effective_limit(), cgroup.usage(), cgroup.reclaimable()
        if limit is not None and usage is not None:
            room = max(limit - (usage - reclaimable), 0)
            if room < available:
                available, source = room, f"cgroup limit ({cgroup.path})"
    gpu = gpu if gpu is not None else GpuUsage.snapshot()
    return NodeMemory(
        available=available,
        source=source,
        host_total=host_total,
        host_available=host_available,
        cgroup=str(cgroup.path) if cgroup is not None else None,
        cgroup_limit=limit,
        cgroup_usage=usage,
        cgroup_reclaimable=reclaimable,
        gpus=gpu.devices,
        gpu_reason=gpu.reason,
    )
