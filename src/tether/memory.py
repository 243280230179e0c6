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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


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
    pss: int
    uss: int
    anon: int
    file: int
    swap: int
    gpu: int | None = None
    pss_anon: int | None = None  # anonymous memory with copy-on-write pages split among their sharers (Pss_Anon)

    @property
    def footprint(self) -> int:
        """Memory killing this process would free: anonymous (proportional: ``pss_anon`` when the kernel reports it,
        so a forked helper and its parent do not both count their shared copy-on-write pages) + swap + GPU.

        Mapped files are left out (they are page cache: reclaimable, and still cached after the process dies), and
        so is shmem (it lives on while a file or another process holds it). GPU and unified memory are invisible to
        RSS, so they are added from NVML; an unknown ``gpu`` adds 0, so the footprint is then a lower bound.
        Anonymous pages still shared copy-on-write with a forked relative are counted in full; runners are
        exec'd, so they share none.
        """
        anon = self.anon if self.pss_anon is None else self.pss_anon
        return anon + self.swap + (self.gpu or 0)

    @classmethod
    def total(cls, items: Iterable[ProcessMemory]) -> ProcessMemory:
        """The sum of several processes (a runner and its helpers); ``gpu`` is ``None`` only if none is known.

        ``pss`` sums meaningfully across processes; ``rss``/``file`` count shared pages once per process.
        """
        items = list(items)
        gpus = [m.gpu for m in items if m.gpu is not None]
        return cls(
            rss=sum(m.rss for m in items),
            pss=sum(m.pss for m in items),
            uss=sum(m.uss for m in items),
            anon=sum(m.anon for m in items),
            file=sum(m.file for m in items),
            swap=sum(m.swap for m in items),
            gpu=sum(gpus) if gpus else None,
            pss_anon=sum(m.anon if m.pss_anon is None else m.pss_anon for m in items) if items else None,
        )


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

    @classmethod
    def snapshot(cls) -> GpuUsage:
        """Ask NVML which processes hold GPU memory now; unavailable (with the reason) when NVML can't say."""
        try:
            import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
        except ImportError:
            return cls(False, "nvidia-ml-py not installed")
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as e:
            return cls(False, f"NVML: {e}")
        by_pid: dict[int, int | None] = {}
        try:
            for index in range(int(pynvml.nvmlDeviceGetCount())):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
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
        return cls(True, None, MappingProxyType(by_pid))

    def for_pid(self, pid: int) -> int | None:
        """GPU bytes held by ``pid``: ``None`` if unknown, 0 if NVML does not list it."""
        if not self.available:
            return None
        return self.by_pid.get(pid, 0)


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
    kb: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        value = rest.split()
        if len(value) == 2 and value[1] == "kB":
            kb[key] = kb.get(key, 0) + int(value[0])
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
