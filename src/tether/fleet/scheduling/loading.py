"""Loading catalogued models: one load for any number of requests, placed (``placement``) and awaited until the
runner is ready; a failed load tells its waiters why, and a loaded model whose instance failed for good is
forgotten (it holds nothing), so the next request loads it afresh."""

from __future__ import annotations

import functools

import anyio

from tether.errors import TetherError
from tether.fleet.catalog import describe_keep_alive
from tether.fleet.fleet import Hosted, InstanceConfig, Unavailable, replica_names
from tether.fleet.scheduling.keepalive import keep_alive
from tether.fleet.scheduling.placement import Placement
from tether.fleet.scheduling.slots import Slot, footprint_of
from tether.fleet.scheduling.state import SchedulerState
from tether.node.instance import Instance, InstanceFailed, InstanceState, InstanceStopped
from tether.node.tasks import RunnerUnavailable
from tether.units import format_bytes

# A load is bounded by its runner's own deadlines (load progress, warmup: ``tether.node.hangs``), however long the
# requests that started it wait (``load_wait``); this backstop bounds a runner that keeps reporting progress.
LOAD_BACKSTOP = 3600.0


class Loader:
    """Starts instances (waiting for their placement's verdict) and loads catalogued models."""

    def __init__(self, state: SchedulerState, placement: Placement) -> None:
        self.state = state
        self.placement = placement

    def preload(self, model_id: str, reason: str) -> None:
        """Start loading a catalogued model unless it is loaded or loading (a no-op then)."""
        slot = self.state.slots[model_id]
        if slot.state != "unloaded":
            return
        tasks = self.state.tasks
        self._begin(slot, reason)
        tasks.start_soon(self._load, slot, None)

    async def load_now(self, model_id: str, reason: str) -> Hosted:
        """Load a catalogued model and return once its placement is decided (the runner then loads in the
        background): a refusal (``DoesNotFit``, ``InvalidField``, ``Unavailable``) is raised here."""
        slot = self.state.slots[model_id]
        assert slot.state == "unloaded"
        tasks = self.state.tasks
        began = self._begin(slot, reason)
        try:
            hosted = await self.start_instance(slot.model.config)
        except BaseException as exc:
            self._load_failed(slot, exc, began)
            raise
        slot.hosted = hosted
        tasks.start_soon(self._load, slot, hosted)
        return hosted

    async def start_instance(self, config: InstanceConfig) -> Hosted:
        """Add an instance to the fleet and wait (bounded) until its placement is decided. A refusal is raised here
        and the instance removed: ``DoesNotFit`` (507), ``Unavailable`` (503), ``InvalidField`` (400)."""
        state, placement = self.state, self.placement
        names = replica_names(config)
        placed = [placement.awaited.setdefault(name, anyio.Event()) for name in names]
        hosted = await state.fleet.add(config)
        with state.clock.move_on_after(state.settings.load_wait):
            for event in placed:  # replicas are placed one after another: all or nothing, as at creation
                await event.wait()
                if any(name in placement.refused for name in names):
                    break
        for name in names:  # undecided yet: a later refusal fails the instance's placement, not a later creation
            if placement.awaited.get(name) in placed:
                del placement.awaited[name]
        refusals = [placement.refused.pop(name) for name in names if name in placement.refused]
        if refusals:
            await state.fleet.remove(hosted.id)
            raise refusals[0]
        return hosted

    def watch(self, hosted: Hosted) -> None:
        """A catalogued model whose instance failed for good is forgotten (its runner is gone: it holds nothing),
        so the next request loads it afresh."""
        state = self.state

        def on_state(inst: Instance, _: InstanceState) -> None:
            slot = state.slots.get(hosted.id)
            whole = hosted.instance.state  # the best replica's: one failed replica of several leaves it loaded
            if (
                slot is not None
                and not state.closed
                and slot.hosted is hosted
                and slot.state == "loaded"
                and isinstance(whole, InstanceFailed | InstanceStopped)
            ):
                slot.hosted = None
                slot.state = "unloaded"
                slot.unwant()
                why = whole.cause.summary if isinstance(whole, InstanceFailed) else "stopped"
                state.log.decide("unload", slot.id, f"{slot.id} is gone: {why}", why="failed")
                state.tasks.start_soon(state.fleet.remove, hosted.id)
                state.poke(slot)

        for replica in hosted.replicas:
            replica.add_state_listener(functools.partial(on_state, replica))

    def _begin(self, slot: Slot, reason: str) -> float:
        slot.state = "loading"
        slot.load_error = None
        slot.load_ended = anyio.Event()
        self.state.log.decide("load", slot.id, f"loading {slot.id} ({reason})")
        return self.state.now()

    async def _load(self, slot: Slot, hosted: Hosted | None) -> None:
        """Load ``slot`` (its instance placed already when ``hosted`` is given) until its runner is ready. A load
        that was overtaken (deleted while loading, and another load begun since) leaves the slot to the new one."""
        state = self.state
        began = state.now()
        mine = slot.load_ended
        try:
            if hosted is None:
                hosted = slot.hosted = await self.start_instance(slot.model.config)
            try:
                await hosted.instance.wait_ready(LOAD_BACKSTOP)
            except (RunnerUnavailable, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    why = hosted.instance.unavailable_reason()
                    raise Unavailable(
                        f"model {slot.id} did not load within {LOAD_BACKSTOP:g} s: {why}", retry_after=None
                    ) from None
                raise Unavailable(
                    f"model {slot.id} could not be loaded: {exc}", retry_after=None, cause=exc.cause
                ) from None
        except BaseException as exc:
            if hosted is not None and hosted is slot.hosted:
                with anyio.CancelScope(shield=True):
                    await state.fleet.remove(hosted.id)
            if slot.load_ended is mine:
                self._load_failed(slot, exc, began)
            if not isinstance(exc, Exception):
                raise
        else:
            if slot.load_ended is not mine or slot.hosted is not hosted:  # deleted while it loaded
                return
            slot.state = "loaded"
            slot.loads += 1
            slot.load_seconds = state.now() - began
            slot.last_used = state.now()
            if hosted.supervisor is not None:
                await hosted.supervisor.sample_memory()
            memory = footprint_of(hosted)
            state.log.decide(
                "loaded",
                slot.id,
                f"{slot.id} loaded in {slot.load_seconds:.2f} s, holding {format_bytes(memory)}; keep-alive "
                f"{'pinned' if slot.model.pinned else describe_keep_alive(slot.keep_alive)}",
                seconds=slot.load_seconds,
                bytes=memory,
            )
            state.tasks.start_soon(keep_alive, state, slot, hosted)
            slot.load_ended.set()
            state.notify()

    def _load_failed(self, slot: Slot, exc: BaseException, began: float) -> None:
        """A load that did not end ready: its waiters get why (a tether error as it is, anything else wrapped)."""
        slot.load_error = (
            exc
            if isinstance(exc, TetherError)
            else Unavailable(f"model {slot.id} could not be loaded: {type(exc).__name__}: {exc}", retry_after=None)
        )
        slot.hosted = None
        slot.state = "unloaded"
        slot.unwant()
        self.state.log.decide("load_failed", slot.id, str(slot.load_error), seconds=self.state.now() - began)
        slot.load_ended.set()
        self.state.notify()
