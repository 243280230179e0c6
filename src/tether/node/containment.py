"""Containment of one runner: its own memory cgroup (made before it starts, removed once empty) and the cheap
periodic sample of its whole group's memory.

Worker side. The cgroup holds the runner, its guard and every helper its engine starts, those that leave the
process group included; the runner joins it itself before it forks anything (``tether.runner.lifeline``).
"""

from __future__ import annotations

import logging
import os

import anyio

from tether.kernel.cgroups import (
    MemoryCgroup,
    create_child_cgroup,
    kill_cgroup_members,
    remove_cgroup,
    runner_cgroup_name,
)
from tether.kernel.pids import group_members, open_pidfd
from tether.node.memory import ProcessMemory, process_status_memory
from tether.node.nvml import GpuUsage

log = logging.getLogger("tether.node.containment")


def make_own_cgroup(name: str, runner_id: str, memory_limit: int | None) -> MemoryCgroup | None:
    """A memory cgroup for the runner ``name`` alone (with ``memory_limit``), or None (logged with why not)."""
    cgroup, why = create_child_cgroup(runner_cgroup_name(runner_id), memory_limit)
    if cgroup is None:
        log.info(
            "%s: no cgroup of its own (%s); its process group still contains it, but not a helper that leaves the "
            "group (setsid, setpgid, a double fork)",
            name,
            why,
        )
    return cgroup


async def remove_when_empty(cgroup: MemoryCgroup, bound: float, name: str) -> bool:
    """Remove a dead runner's cgroup once its last members (SIGKILLed at the exit) have left it: awaited on their
    pidfds, within ``bound`` seconds. A leftover (a process stuck in the kernel) is logged and swept later."""
    with anyio.move_on_after(bound):
        while not remove_cgroup(cgroup):
            kill_cgroup_members(cgroup)  # anything forked since the exit
            leaving = [fd for fd in (open_pidfd(pid) for pid in cgroup.pids()) if fd is not None]
            try:
                for fd in leaving:
                    await anyio.wait_readable(fd)
            finally:
                for fd in leaving:
                    os.close(fd)
            if not leaving:
                await anyio.sleep(0.005)  # no pidfds here, or gone between the listing and the pin
        return True
    log.warning(
        "%s: could not remove its cgroup %s within %g s: still in use by %s", name, cgroup.path, bound, cgroup.pids()
    )
    return False


def group_memory(pgid: int, cgroup: MemoryCgroup | None, with_gpu: bool) -> tuple[ProcessMemory | None, bool]:
    """(total memory of a runner's processes, whether NVML is usable), from the cheap per-process counters: a
    periodic sample must not cost a page-table walk of a big model (``process_memory`` does that, on demand)."""
    pids = (cgroup.pids() if cgroup else []) or group_members(pgid)
    gpu = GpuUsage.snapshot() if with_gpu else None
    samples = [m for m in (process_status_memory(pid, gpu) for pid in pids) if m is not None]
    return (ProcessMemory.total(samples) if samples else None), bool(gpu and gpu.available)
