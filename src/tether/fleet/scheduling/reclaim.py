"""Evicting models and waiting for their memory to really come back: each runner's whole group gone, then node
memory risen by what they held (or the new model fits) and the GPUs' free memory risen by their VRAM, bounded by
``reclaim_timeout`` on the scheduler's clock. Memory not back in time is a refusal that says so, with numbers."""

from __future__ import annotations

import contextlib
import functools

import anyio

from tether.fleet.fleet import Hosted, Unavailable
from tether.fleet.scheduling.eviction import Victims
from tether.fleet.scheduling.slots import footprint_of, gpu_of, host_of
from tether.fleet.scheduling.state import SchedulerState
from tether.fleet.scheduling.unloading import stop, unloading
from tether.node.gone import NotGone
from tether.node.memory import NodeMemory
from tether.units import format_bytes

RECLAIMED_SHARE = 0.9  # of an evicted runner's footprint, node memory must rise by at least this much


async def evict(
    state: SchedulerState, for_id: str, victims: Victims, need: int, needs: str, before: NodeMemory
) -> NodeMemory:
    """Evict ``victims`` (concurrently), await each runner's whole group gone, then node memory risen by what
    they held (or ``need`` bytes available), bounded by ``reclaim_timeout``. Returns node memory after."""
    expected = vram = 0
    began = state.now()
    timeout = state.settings.reclaim_timeout
    with contextlib.ExitStack() as unloads:
        stopping: list[Hosted] = []
        for slot, why in victims:
            assert slot.hosted is not None
            memory = footprint_of(slot.hosted)
            expected += host_of(slot.hosted)  # what the host gets back; the VRAM goes back to the GPUs
            vram += gpu_of(slot.hosted)
            stopping.append(slot.hosted)
            unloads.enter_context(unloading(slot))
            slot.unwant()  # its requests waiting behind this load go on: to wait for the unload, then load it
            state.log.decide(
                "evict",
                slot.id,
                f"evicting {slot.id} (idle, least recently used; frees ~{format_bytes(memory)}) for {for_id}: it "
                f"{needs}, {format_bytes(before.available)} available ({before.source})",
                bytes=memory,
                why=why,
            )
        try:
            async with anyio.create_task_group() as tg:
                for hosted in stopping:
                    tg.start_soon(stop, state, hosted)
        except BaseExceptionGroup as group:
            first = group.exceptions[0]
            if isinstance(first, NotGone):
                raise Unavailable(str(first), retry_after=None) from None
            raise
    reaped = state.now() - began
    target = before.available + int(expected * RECLAIMED_SHARE)
    node = await reclaimed(state, target, need, before, vram)
    waited = state.now() - began
    risen = node.available - before.available
    ids = ", ".join(slot.id for slot, _ in victims)
    gpu_back = sum(g.free for g in node.gpus) - sum(g.free for g in before.gpus)
    if vram and gpu_back < vram * RECLAIMED_SHARE:
        message = (
            f"evicted {ids} for {for_id} (runner groups gone in {reaped * 1000:.0f} ms), but the GPUs' free memory "
            f"rose by {format_bytes(gpu_back)} of the {format_bytes(vram)} they held within "
            f"{timeout:g} s (--reclaim-timeout, NVML): a process still holds it (nvidia-smi lists who)"
        )
        state.log.decide("wait_memory", for_id, message, seconds=waited, bytes=gpu_back)
        raise Unavailable(message, retry_after=timeout)
    if node.available < target and node.available < need:
        message = (
            f"evicted {ids} for {for_id} (runner groups gone in {reaped * 1000:.0f} ms), but node memory rose by "
            f"{format_bytes(risen)} of the {format_bytes(expected)} they held within {timeout:g} s "
            f"(--reclaim-timeout): {format_bytes(node.available)} available ({node.source}), "
            f"{format_bytes(need)} needed. Something else holds it: check the node's other processes"
        )
        state.log.decide("wait_memory", for_id, message, seconds=waited, bytes=risen)
        raise Unavailable(message, retry_after=timeout)
    state.log.decide(
        "reclaimed",
        for_id,
        f"memory back for {for_id}: +{format_bytes(risen)} (expected {format_bytes(expected)})"
        + (f", GPU +{format_bytes(gpu_back)} (expected {format_bytes(vram)})" if vram else "")
        + f" {waited * 1000:.0f} ms after evicting {ids} (groups gone in {reaped * 1000:.0f} ms)",
        seconds=waited,
        bytes=max(risen, 0),
    )
    return node


async def reclaimed(state: SchedulerState, target: int, need: int, before: NodeMemory, vram: int = 0) -> NodeMemory:
    """Node memory once it reaches ``target`` (or ``need``) and the GPUs' free memory has risen by most of
    ``vram`` (what the evicted runners held there: a driver frees it after the process is gone, not with it),
    or as it is after ``reclaim_timeout``."""
    settings = state.settings
    read = functools.partial(anyio.to_thread.run_sync, settings.memory)
    deadline = state.now() + settings.reclaim_timeout
    pause = 0.001
    if settings.reclaim_poll is not None:  # the baseline: a ticker, first check one period after the unload
        await state.clock.sleep(settings.reclaim_poll)
    node = await read()
    gpu_target = sum(g.free for g in before.gpus) + int(vram * RECLAIMED_SHARE)

    def short(node: NodeMemory) -> bool:
        host = node.available < target and node.available < need
        return host or (vram > 0 and sum(g.free for g in node.gpus) < gpu_target)

    while short(node) and state.now() < deadline:
        # The groups are reaped, so their anonymous memory is freed already; what lags is accounting (per-CPU
        # charge caches) or a driver giving back device memory: short, growing pauses, bounded (the last one ends
        # at the deadline, not past it).
        step = settings.reclaim_poll if settings.reclaim_poll is not None else pause
        await state.clock.sleep(min(step, deadline - state.now()))
        pause = min(pause * 2, 0.05)
        node = await read()
    return node
