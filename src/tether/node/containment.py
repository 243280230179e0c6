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
from tether.units import format_bytes

log = logging.getLogger("tether.node.containment")

FREED_RESIDUE = 1 << 20  # anonymous memory a dead group may still show (per-CPU counters flush in batches)


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
    """Remove a dead runner's cgroup once its last members (SIGKILLed at the exit) have left it, awaited on their
    pidfds, and their memory with them, within ``bound`` seconds. A process is reported exited before its memory
    is freed when anything else holds its address space (a ``/proc/PID/smaps`` reader, a monitoring agent): the
    memory leaves when that reader lets go, and a model placed before then would be measured against it. A
    leftover (a process stuck in the kernel) is logged and swept later."""
    with anyio.move_on_after(bound):
        while True:
            await _members_gone(cgroup)
            pause = 0.001
            while cgroup.anonymous() > FREED_RESIDUE:  # no event says so: short, growing pauses, bounded
                await anyio.sleep(pause)
                pause = min(pause * 2, 0.02)
            if remove_cgroup(cgroup):
                return True
            await anyio.sleep(0.005)  # a member forked as the last one left: the next round has it
    log.warning(
        "%s: could not remove its cgroup %s within %g s: still in use by %s, %s of anonymous memory left",
        name,
        cgroup.path,
        bound,
        cgroup.pids(),
        format_bytes(cgroup.anonymous()),
    )
    return False


async def _members_gone(cgroup: MemoryCgroup) -> None:
    """SIGKILL what is left in ``cgroup`` (anything forked since the exit) and await each exit on its pidfd."""
    while cgroup.pids():
        kill_cgroup_members(cgroup)
        leaving = [fd for fd in (open_pidfd(pid) for pid in cgroup.pids()) if fd is not None]
        try:
            for fd in leaving:
                await anyio.wait_readable(fd)
        finally:
            for fd in leaving:
                os.close(fd)
        if not leaving:
            await anyio.sleep(0.005)  # no pidfds here, or gone between the listing and the pin


def group_memory(pgid: int, cgroup: MemoryCgroup | None, with_gpu: bool) -> tuple[ProcessMemory | None, bool]:
    """(total memory of a runner's processes, whether NVML is usable), from the cheap per-process counters: a
    periodic sample must not cost a page-table walk of a big model (``process_memory`` does that, on demand)."""
    pids = (cgroup.pids() if cgroup else []) or group_members(pgid)
    gpu = GpuUsage.snapshot() if with_gpu else None
    samples = [m for m in (process_status_memory(pid, gpu) for pid in pids) if m is not None]
    return (ProcessMemory.total(samples) if samples else None), bool(gpu and gpu.available)
