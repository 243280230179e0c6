"""Many models on one node: load on demand, keep-alive, and eviction that waits for memory to really come back.

The scheduler serves the catalog (``tether.fleet.catalog``) through the fleet. A request for a catalogued model
holds a *lease* on it for its whole life: the first lease of an unloaded model starts its one load and waits for it,
bounded; a leased model is busy, and only idle models are unloaded or evicted. Each rule is kept by one part of
``tether.fleet.scheduling``: one placement at a time per node, a lock a loaded model's request never takes
(``placement``); eviction of idle models by measured footprint, least recently used first, never more than needed
(``eviction``); memory released means the group reaped and node memory risen (``reclaim``); a load that needs a busy
model gone waits for it, and the model's new requests wait behind that load (``placement``, ``leases``); keep-alive
(``keepalive``). Every decision is a ``Decision`` in one log (``decisions``); every rule about time reads the
settings' ``Clock``. The rules as a user meets them: docs/many-models.md, "The eviction rules".
"""

from __future__ import annotations

import contextlib
import time
from types import TracebackType

import anyio

from tether.engines import registry
from tether.engines.base import MemoryEstimate
from tether.errors import InstanceExists, InvalidField
from tether.fleet.catalog import Catalog
from tether.fleet.fleet import Fleet, Hosted, InstanceConfig
from tether.fleet.scheduling.decisions import Decision
from tether.fleet.scheduling.keepalive import unload_idle
from tether.fleet.scheduling.leases import Leases
from tether.fleet.scheduling.loading import Loader
from tether.fleet.scheduling.names import Names
from tether.fleet.scheduling.placement import Placement
from tether.fleet.scheduling.settings import DEFAULT, SchedulerSettings
from tether.fleet.scheduling.slots import Slot, footprint_of
from tether.fleet.scheduling.state import SchedulerState
from tether.fleet.scheduling.unloading import stop, unload
from tether.node.fit import FitResult
from tether.node.instance import Instance, Placer
from tether.node.memory import NodeMemory

__all__ = ["Decision", "Scheduler", "SchedulerSettings", "Slot", "footprint_of"]


class Scheduler:
    """The catalog served through ``fleet``, whose placer it becomes. Use as ``async with fleet, Scheduler(fleet,
    catalog) as scheduler:`` (it leaves first: its timers and loads end, then the fleet stops every instance).
    ``default``: the model a placeholder name reaches when none is loaded; ``placement``: where a life goes on a
    cluster (``Cluster.place``), None for this node, making room."""

    def __init__(
        self,
        fleet: Fleet,
        catalog: Catalog,
        settings: SchedulerSettings = DEFAULT,
        *,
        default: str | None = None,
        placement: Placer | None = None,
    ) -> None:
        self.fleet = fleet
        self.catalog = catalog
        self.settings = settings
        self.state = SchedulerState(fleet, catalog, settings)
        self.slots = self.state.slots
        self.decisions = self.state.log.decisions
        self.listeners = self.state.log.listeners
        self.started_at = time.time()
        self.naming = Names(self.state, default)
        self.placing = Placement(self.state, placement)
        self.loader = Loader(self.state, self.placing)
        self.leases = Leases(self.state, self.loader)
        fleet.placer = self.placing.place
        fleet.listeners.add(self.placing.watch)  # the lock released first, then a failed model forgotten
        fleet.listeners.add(self.loader.watch)

    async def __aenter__(self) -> Scheduler:
        group = anyio.create_task_group()
        await group.__aenter__()
        self.state.tasks = group
        for slot in self.slots.values():
            if slot.model.pinned:
                self.preload(slot.id, "pinned")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        group = self.state.tasks
        self.state.closed = True
        group.cancel_scope.cancel()  # keep-alive timers and loads in progress; the fleet stops the instances
        await group.__aexit__(None, None, None)
        return None

    # --- settings and what it knows --------------------------------------------------------------------------

    @property
    def max_loaded(self) -> int | None:
        return self.settings.max_loaded

    @property
    def load_wait(self) -> float:
        return self.settings.load_wait

    @property
    def reclaim_timeout(self) -> float:
        return self.settings.reclaim_timeout

    def memory(self) -> NodeMemory:
        """This node's memory now, as the scheduler reads it."""
        return self.settings.memory()

    def now(self) -> float:
        """The scheduler's clock: ``last_used``, keep-alive countdowns and every bound on a wait are read against it."""
        return self.state.now()

    async def estimate(self, slot: Slot) -> MemoryEstimate | None:
        """The model's memory estimate (read once, off the event loop); None when the engine declares none or the
        model file cannot be read."""
        if slot.estimate is None:
            with contextlib.suppress(InvalidField):
                slot.estimate = await anyio.to_thread.run_sync(registry.estimate, slot.model.config.spec())
        return slot.estimate

    # --- names ----------------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every model a request can name: the catalog's, then instances added beside it."""
        return self.naming.names()

    def resolve(self, name: str | None) -> str:
        """The model id a request's ``model`` names (see ``Names.resolve``: one loaded model takes any name)."""
        return self.naming.resolve(name)

    def resolve_exact(self, name: str) -> str:
        """The model id ``name`` names (id, alias, ``:latest``, instance id), without the placeholder rule."""
        return self.naming.resolve_exact(name)

    def loaded(self, model_id: str) -> bool:
        """Whether a request for ``model_id`` would be served without waiting for a load."""
        slot = self.slots.get(model_id)
        return slot is None or slot.state == "loaded"

    # --- leases, loads and unloads ----------------------------------------------------------------------------

    def lease(self, model_id: str, keep_alive: float | None = None) -> contextlib.AbstractAsyncContextManager[Hosted]:
        """The model's instance, loaded, kept from unloading and eviction until the block ends (``Leases.lease``)."""
        return self.leases.lease(model_id, keep_alive)

    def preload(self, model_id: str, reason: str) -> None:
        """Start loading a catalogued model unless it is loaded or loading (a no-op then)."""
        self.loader.preload(model_id, reason)

    async def load_now(self, model_id: str, reason: str) -> Hosted:
        """Load a catalogued model and return once its placement is decided, raising a refusal here, as ``tether
        serve`` wants for its first model."""
        return await self.loader.load_now(model_id, reason)

    async def unload(self, model_id: str, why: str, *, reason: str = "requested") -> bool:
        """Unload an idle catalogued model now (its runner's whole group gone when this returns); False when it is
        not loaded or busy."""
        return await unload_idle(self.state, model_id, why, reason=reason)

    async def remove(self, instance_id: str) -> Hosted:
        """``DELETE /v1/instances/{id}``: stop it now, busy or not (its requests end with the cause); a catalogued
        model is unloaded (a later request loads it again)."""
        hosted = self.fleet.get(instance_id)
        slot = self.slots.get(instance_id)
        if slot is None or slot.hosted is not hosted:
            await stop(self.state, hosted)
            return hosted
        await unload(self.state, slot, hosted, "deleted (DELETE /v1/instances)", "deleted")
        return hosted

    # --- instances ------------------------------------------------------------------------------------------

    async def place(self, instance: Instance) -> FitResult:
        """The ``Placer`` of every instance's every life (``Placement.place``)."""
        return await self.placing.place(instance)

    async def add_instance(self, config: InstanceConfig) -> Hosted:
        """``POST /v1/instances``: start it (evicting idle models if it needs their memory). An engine named by
        module or file path is refused (``EngineImportRefused``) unless ``allow_engine_import``: a request is not
        the operator, and importing is running code."""
        registry.check_import(config.engine, self.settings.allow_engine_import, "in POST /v1/instances")
        model_id = config.default_id()
        if model_id in self.slots:
            raise InstanceExists(
                model_id,
                f"{model_id!r} is a catalogued model ({self.slots[model_id].model.source}): a request naming it loads "
                "it, DELETE /v1/instances/{id} unloads it; choose another id for an instance of your own",
            )
        return await self.loader.start_instance(config)
