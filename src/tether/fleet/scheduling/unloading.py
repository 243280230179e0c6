"""Stopping a model's runner: its whole process group (and every rank's) gone before this returns, and the slot
unloading meanwhile, so a request that arrives waits for the unload, then loads it afresh."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import anyio

from tether.fleet.fleet import Hosted
from tether.fleet.scheduling.slots import Slot, footprint_of
from tether.fleet.scheduling.state import SchedulerState


@contextlib.contextmanager
def unloading(slot: Slot) -> Iterator[None]:
    """``slot`` is unloading for the block, and unloaded after it, however it ends (its waiters then load afresh)."""
    slot.state = "unloading"
    slot.unload_ended = anyio.Event()
    try:
        yield
    finally:
        slot.hosted = None
        slot.state = "unloaded"
        slot.unload_ended.set()


async def stop(state: SchedulerState, hosted: Hosted) -> float:
    """Stop ``hosted`` and return once its runner is reaped and its process group empty (seconds taken). Meanwhile
    it is in ``state.stopping``: its memory is on its way back, which a placement that finds too little awaits."""
    began = state.now()
    sup = hosted.supervisor
    gone = state.stopping[hosted.id] = anyio.Event()
    try:
        with anyio.CancelScope(shield=True):
            await state.fleet.remove(hosted.id)
            if sup is not None:  # every runner of it (each rank's, on every node) reaped and its group empty
                await sup.confirm_gone(state.settings.reclaim_timeout)
    finally:
        if state.stopping.get(hosted.id) is gone:
            del state.stopping[hosted.id]
        gone.set()
    return state.now() - began


async def unload(state: SchedulerState, slot: Slot, hosted: Hosted, why: str, reason: str) -> None:
    """Unload ``slot`` (its runner ``hosted``) now, busy or not, and say why (``reason``: the decision's label)."""
    memory = footprint_of(hosted)
    with unloading(slot):
        slot.unwant()
        seconds = await stop(state, hosted)
        state.log.decide("unload", slot.id, f"unloaded {slot.id}: {why}", seconds=seconds, bytes=memory, why=reason)
    state.notify()
