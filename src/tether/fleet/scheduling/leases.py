"""A request's lease on its model: the model loaded (now, if it is not: waiting at most ``load_wait``) and kept
from unloading and eviction until the request ends; the last lease to end starts the keep-alive countdown."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from tether.fleet.fleet import Hosted, Unavailable
from tether.fleet.scheduling.eviction import busy_text
from tether.fleet.scheduling.loading import Loader
from tether.fleet.scheduling.slots import Slot
from tether.fleet.scheduling.state import SchedulerState


class Leases:
    """Requests' holds on catalogued models (an instance added beside the catalog stays until it is deleted)."""

    def __init__(self, state: SchedulerState, loader: Loader) -> None:
        self.state = state
        self.loader = loader

    @contextlib.asynccontextmanager
    async def lease(self, model_id: str, keep_alive: float | None = None) -> AsyncIterator[Hosted]:
        """The model's instance, loaded, kept from unloading and eviction until the block ends. ``keep_alive``
        (seconds; None: the model's own) is how long it stays loaded once this request is done, as Ollama's
        per-request keep_alive: the last request to end sets the countdown. A request for a model that a waiting
        load will evict once it is idle waits behind that load (it would keep the model busy for ever otherwise),
        then loads it again."""
        state = self.state
        slot = state.slots.get(model_id)
        if slot is None:  # an instance added through POST /v1/instances: it stays until it is deleted
            yield state.fleet.get(model_id)
            return
        began = state.now()
        await self._behind_waiting_load(slot, began)
        slot.holds += 1
        state.poke(slot)
        try:
            yield await self._ready_instance(slot, began)
        finally:
            slot.holds -= 1
            slot.last_used = state.now()
            slot.keep_alive = slot.model.keep_alive if keep_alive is None else keep_alive
            state.poke(slot)

    async def _behind_waiting_load(self, slot: Slot, began: float) -> None:
        """Wait (bounded by ``load_wait`` from ``began``) while a load waits for ``slot`` to be idle to evict it."""
        state = self.state
        with state.clock.move_on_after(state.settings.load_wait - (state.now() - began)):
            while slot.wanted_by is not None and slot.state in ("loaded", "loading"):
                await slot.released.wait()
        if slot.wanted_by is not None and slot.state in ("loaded", "loading"):
            raise Unavailable(
                f"model {slot.id} is to be unloaded for {slot.wanted_by} (which waits for it to be idle: "
                f"{busy_text([slot])}), and {state.now() - began:.0f} s passed (the longest a request "
                "waits for a load, --load-wait); retry later, or raise --max-loaded",
                retry_after=max(slot.load_seconds or 5.0, 1.0),
            )

    async def _ready_instance(self, slot: Slot, began: float) -> Hosted:
        state = self.state
        with state.clock.move_on_after(state.settings.load_wait - (state.now() - began)):
            while True:
                if slot.state == "loaded" and slot.hosted is not None:
                    return slot.hosted
                if slot.state == "unloading":
                    await slot.unload_ended.wait()
                elif slot.state == "loading":
                    waiting_for = slot.load_ended
                    await waiting_for.wait()
                    if slot.load_error is not None:  # reset when a load starts, set only when it fails
                        raise slot.load_error
                else:
                    self.loader.preload(slot.id, "requested")
        waited = state.now() - began
        waiting = f": {slot.waiting}" if slot.state == "loading" and slot.waiting else ""
        raise Unavailable(
            f"model {slot.id} is still {slot.state} after {waited:.0f} s (the longest a request waits for a load, "
            f"--load-wait){waiting}; retry later, or raise --load-wait",
            retry_after=max(slot.load_seconds or 5.0, 1.0),
        )
