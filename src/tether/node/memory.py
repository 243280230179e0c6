"""Process memory as it really is: private/anonymous pages, swap and GPU memory, not just RSS.

RSS misleads both ways for inference processes. A runner that mmaps a multi-GB weight file shows it all in RSS,
though those pages are page cache the kernel can drop and that stays cached after the runner dies; a runner whose
weights live in GPU (or unified) memory shows almost nothing in RSS while pinning tens of GB. So every number here
is shown side by side, and :attr:`ProcessMemory.footprint` combines only the ones that are really the process's own.

Sources: ``/proc/PID/smaps_rollup`` (Linux ≥ 4.14; ``/proc/PID/smaps`` summed on older kernels), ``/proc/meminfo``,
the worker's memory cgroup (``tether.kernel.cgroups``) and NVML (``tether.node.nvml``): without NVML GPU memory is
*unknown* (``None``), never 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tether.kernel.cgroups import MemoryCgroup, read_text
from tether.node.nvml import GpuDevice, GpuUsage
from tether.units import format_bytes


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
