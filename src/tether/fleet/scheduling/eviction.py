"""Which idle models go to make room for a load: by count under ``max_loaded``, then by host memory, least recently
used first and never more than needed, and by GPU memory so a model loads with every layer on its GPUs. What
cannot fit even with every idle model gone is refused with every number; what would fit once busy models are idle
waits for them (``MustWait``)."""

from __future__ import annotations

from tether.engines.base import MemoryEstimate
from tether.errors import TetherError
from tether.fleet.fleet import Unavailable
from tether.fleet.scheduling.slots import Slot, footprint_of, gpu_of, host_of
from tether.fleet.scheduling.state import SchedulerState
from tether.node import fit
from tether.node.fit import DoesNotFit, FitResult
from tether.node.instance import Instance, InstanceStarting
from tether.node.memory import NodeMemory
from tether.units import format_bytes

Victims = list[tuple[Slot, str]]  # each model to evict, with why: "max_loaded", "memory" or "gpu_memory"


class MustWait(TetherError):
    """Evicting these busy models once they are idle would make room (``why``: for what): the placement waits."""

    def __init__(self, slots: list[Slot], why: str) -> None:
        super().__init__(why)
        self.slots = slots
        self.why = why


def candidates(state: SchedulerState, instance: Instance) -> list[Slot]:
    """Idle, unpinned, loaded catalogued models other than ``instance``'s, least recently used first."""
    found = [
        s
        for s in state.slots.values()
        if s.state == "loaded" and s.hosted is not None and s.idle and not s.model.pinned and s.id != instance.name
    ]
    return sorted(found, key=lambda s: s.last_used)


def busy(state: SchedulerState, instance: Instance) -> list[Slot]:
    """Busy (or loading, once placed) unpinned catalogued models other than ``instance``'s, least recently used
    first: what a load may wait for, to evict once idle."""
    found = [
        s
        for s in state.slots.values()
        if s.hosted is not None
        and not s.model.pinned
        and s.id != instance.name
        and ((s.state == "loaded" and not s.idle) or s.state == "loading")
    ]
    return sorted(found, key=lambda s: (s.state == "loading", s.last_used))


def busy_text(slots: list[Slot]) -> str:
    """``a busy with 2 requests, b loading``: why each of ``slots`` cannot be evicted now."""
    parts = []
    for slot in slots:
        if slot.state == "loading":
            parts.append(f"{slot.id} loading")
        else:
            flying = slot.hosted.in_flight if slot.hosted is not None else 0
            parts.append(f"{slot.id} busy with {max(slot.holds, flying)} request(s)")
    return ", ".join(parts)


def victims(
    state: SchedulerState,
    instance: Instance,
    estimate: MemoryEstimate | None,
    node: NodeMemory,
    reserved: dict[str, int],
) -> Victims:
    """What must be evicted for ``instance`` to fit (by count under ``max_loaded``, then by memory); raise
    ``DoesNotFit`` with every number when evicting every idle model would not be enough, or ``MustWait`` when
    evicting busy models as well would be (the placement waits for them to be idle).

    Each victim (with why: ``max_loaded`` or ``memory``) frees its measured footprint and what was reserved for it
    to grow into (``reserved``)."""
    idle = candidates(state, instance)
    chosen: Victims = []
    max_loaded = state.settings.max_loaded
    if max_loaded is not None:
        others = [  # placed: not waiting for the lock (that one has no runner yet and would count twice)
            h
            for h in state.fleet.list()
            if h.instance is not instance
            and (h.supervisor is not None or not isinstance(h.instance.state, InstanceStarting))
        ]
        excess = len(others) - max_loaded + 1
        if excess > len(idle):
            waitable = busy(state, instance)
            if excess <= len(idle) + len(waitable):
                why = f"{len(others)} models are loaded (--max-loaded {max_loaded})"
                raise MustWait(waitable[: excess - len(idle)], why)
            loaded = ", ".join(h.id for h in others)
            raise Unavailable(
                f"cannot load {instance.name}: {len(others)} models are loaded (--max-loaded {max_loaded}) "
                f"and too few are idle to unload ({loaded}); retry when one is idle",
                retry_after=1.0,
            )
        chosen = [(slot, "max_loaded") for slot in idle[: max(excess, 0)]]
    if estimate is None:
        return chosen

    def frees(slot: Slot) -> int:
        return (host_of(slot.hosted) if slot.hosted is not None else 0) + reserved.get(slot.id, 0)

    shortfall = estimate.total - (node.available - sum(reserved.values())) - sum(frees(s) for s, _ in chosen)
    for slot in idle[len(chosen) :]:
        if shortfall <= 0:
            break
        chosen.append((slot, "memory"))
        shortfall -= frees(slot)
    if shortfall > 0 and not instance.force:
        waiting = []
        for slot in busy(state, instance):  # would evicting busy ones too make room? then wait for them
            if shortfall <= 0:
                break
            waiting.append(slot)
            shortfall -= frees(slot)
        if waiting and shortfall <= 0:
            raise MustWait(waiting, f"it {estimate.describe()}, {format_bytes(node.available)} available")
        raise DoesNotFit(refusal(state, instance, estimate, node, idle, reserved))
    return chosen


def gpu_victims(state: SchedulerState, instance: Instance, short: int) -> Victims:
    """Idle models holding VRAM (least recently used first) whose eviction gives the GPUs ``short`` bytes, so a
    model loads with every layer on them (as Ollama does); none when evicting all of them would not be enough
    (then the layers that fit go to the GPU, and nothing is evicted for it)."""
    chosen: Victims = []
    for slot in candidates(state, instance):
        if short <= 0:
            break
        held = gpu_of(slot.hosted) if slot.hosted is not None else 0
        if held > 0:
            chosen.append((slot, "gpu_memory"))
            short -= held
    return chosen if short <= 0 else []


def refusal(
    state: SchedulerState,
    instance: Instance,
    estimate: MemoryEstimate,
    node: NodeMemory,
    idle: list[Slot],
    reserved: dict[str, int],
) -> FitResult:
    """Why ``instance`` cannot fit even with every ``idle`` model evicted: every number, and who is busy."""
    evictable = sum(host_of(s.hosted) + reserved.get(s.id, 0) for s in idle if s.hosted is not None)
    others = [h for h in state.fleet.list() if h.instance is not instance and h.id not in {s.id for s in idle}]
    others_text = ", ".join(f"{h.id} {format_bytes(footprint_of(h))}" for h in others) or "none"
    held_back = sum(reserved.values())
    source = node.source
    if held_back:
        source += f", less {format_bytes(held_back)} the loaded models may still grow into"
    source += (
        f", plus {format_bytes(evictable)} that evicting every idle model ({len(idle)}) would free; busy or "
        f"pinned: {others_text}"
    )
    result = fit.check_fit(estimate, node.available - held_back + evictable, source)
    message = f"{result.message}; or retry once a busy model is idle" if others else result.message
    return FitResult(estimate, node.available, node.source, False, False, message)
