"""Keep-alive: an idle model is unloaded ``keep_alive`` seconds after its last request ended (the model's default,
or the last request's; 0: as soon as it is idle; ``inf``: never), counted on the scheduler's clock."""

from __future__ import annotations

from tether.fleet.catalog import describe_keep_alive
from tether.fleet.fleet import Hosted
from tether.fleet.scheduling.slots import Slot
from tether.fleet.scheduling.state import SchedulerState
from tether.fleet.scheduling.unloading import unload


async def keep_alive(state: SchedulerState, slot: Slot, hosted: Hosted) -> None:
    """Unload ``slot`` once it has been idle for its keep-alive; runs while this load lasts."""
    while slot.state == "loaded" and slot.hosted is hosted:
        wait = slot.expires_in(state.now())
        activity = slot.activity
        if wait is None:
            await activity.wait()
            continue
        if wait > 0:
            with state.clock.move_on_after(wait):
                await activity.wait()
            continue
        await unload_idle(state, slot.id, expired(slot), reason="keep_alive")
        return


def expired(slot: Slot) -> str:
    """Why keep-alive unloads ``slot``, in words."""
    why = "idle, keep-alive 0" if slot.keep_alive == 0 else f"idle for {describe_keep_alive(slot.keep_alive)}"
    return f"{why} (keep-alive expired)"


async def unload_idle(state: SchedulerState, model_id: str, why: str, *, reason: str = "requested") -> bool:
    """Unload an idle catalogued model now (its runner's whole group gone when this returns); False when it is
    not loaded or busy."""
    slot = state.slots.get(model_id)
    if slot is None or slot.state != "loaded" or slot.hosted is None or not slot.idle:
        return False
    await unload(state, slot, slot.hosted, why, reason)
    return True
