"""GPU memory through NVML (package ``nvidia-ml-py``, imported lazily): per device, and per process.

Optional by design: without the package or a driver every GPU figure is *unknown* (``None``, with the reason),
never 0, so a runner holding tens of GB of GPU memory is never reported as holding nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

_NVML_MISSING: str | None = None  # set once NVML's library is known to be absent: not worth a dlopen per sample


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
