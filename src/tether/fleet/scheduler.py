"""Many models on one node: load on demand, keep-alive, and eviction that waits for memory to really come back.

The scheduler serves the catalog (``tether.fleet.catalog``) through the fleet. A request for a catalogued model
holds a *lease* on it for its whole life: the first lease of an unloaded model starts its load (one load for any
number of concurrent requests) and waits for it, bounded; a leased model is busy, and only idle models are unloaded
(their keep-alive expired) or evicted. Its rules:

- **One placement at a time per node.** Every runner life of every instance (a load, a restart, an instance added
  through ``POST /v1/instances``) is placed under one lock, held from the fit check until the runner is ready or
  gone, so two loads never both count the same free memory. A request for a loaded model never takes the lock: it
  never waits behind another model's load.
- **Eviction by memory, least recently used first, never more than needed.** When the estimate of the model to load
  exceeds what the node has available (``tether.node.memory.node_memory``: cgroup-aware), idle unpinned models are
  evicted in LRU order until their measured footprints cover the shortfall (``--max-loaded`` also evicts by
  count). What cannot fit even with every idle model evicted is refused at once (507) with the numbers: needed,
  available, what eviction would free, what is busy. A loaded model keeps the room its estimate promised it (it
  was admitted on it, and grows into it as its KV cache fills): a load counts node memory less that room.
- **Memory released means released.** An evicted runner's stop is awaited until its whole process group (and
  cgroup) is gone, then node memory must have risen by what it held (or the new model fits) within
  ``reclaim_timeout``; a runner that died on its own holds nothing, so its memory is counted free at once (its
  supervisor saw the exit), with no timer.
- **A load that needs a busy model gone waits its turn**, as Ollama queues it: when only evicting a busy model
  (by ``--max-loaded`` or by memory) would make room, the load waits (the placement lock released meanwhile) for
  that model to be idle, woken by an event (a lease ending, a load ending), bounded by ``load_wait``; then it
  evicts and loads. The busy model's requests in flight finish; requests for it that arrive while a load waits
  for it wait behind that load (then load it again in their turn), so neither side starves. When ``load_wait``
  passes, the load is refused (503) naming the busy models, their requests in flight and the limit.
- **Keep-alive.** An idle model is unloaded ``keep_alive`` seconds after its last request ended (the model's
  default, or the last request's ``keep_alive``; 0: as soon as it is idle; ``inf``: never). A request that arrives
  while its model unloads waits for the unload, then loads it afresh: it is never lost.

Every decision (load, loaded, evict and why, wait for memory, reclaimed, unload, refuse) is a ``Decision``: kept
(the last ``DECISIONS``), logged, served by ``GET /v1/instances`` and ``tether status``, and counted in ``/metrics``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

import anyio
import msgspec
from anyio.abc import TaskGroup

from tether.clock import MONOTONIC, Clock
from tether.engines import registry
from tether.engines.base import MemoryEstimate
from tether.errors import InstanceExists, InvalidField, ModelRequired, NotFound, TetherError
from tether.fleet.catalog import Catalog, Model, describe_keep_alive
from tether.fleet.fleet import Fleet, Hosted, InstanceConfig, Unavailable, replica_names
from tether.kernel.cgroups import MemoryCgroup
from tether.node import fit
from tether.node.fit import DoesNotFit, FitResult
from tether.node.gone import NotGone
from tether.node.instance import (
    Instance,
    InstanceFailed,
    InstanceStarting,
    InstanceState,
    InstanceStopped,
    Placer,
)
from tether.node.listeners import Listeners
from tether.node.memory import NodeMemory, node_memory
from tether.node.tasks import RunnerUnavailable
from tether.units import format_bytes

log = logging.getLogger("tether.fleet.scheduler")

DECISIONS = 256  # decisions kept for GET /v1/instances and tether status (every one is also logged and counted)
# A load is bounded by its runner's own deadlines (load progress, warmup: ``tether.node.hangs``), however long the
# requests that started it wait (``load_wait``); this backstop bounds a runner that keeps reporting progress.
LOAD_BACKSTOP = 3600.0
RECLAIMED_SHARE = 0.9  # of an evicted runner's footprint, node memory must rise by at least this much

ModelState = Literal["unloaded", "loading", "loaded", "unloading"]
DecisionKind = Literal[
    "load", "loaded", "load_failed", "wait_idle", "evict", "wait_memory", "reclaimed", "unload", "refuse"
]


class Decision(msgspec.Struct, frozen=True):
    """One scheduler decision: what, for which model, why (in words, with the numbers), and the numbers themselves."""

    at: float  # time.time()
    kind: DecisionKind
    model: str
    reason: str
    seconds: float | None = None  # how long it took (a load, a wait for memory)
    bytes: int | None = None  # what it concerned (an evicted model's footprint, memory reclaimed)
    why: str | None = None  # a short label: an eviction's or unload's reason (memory, max_loaded, keep_alive, ...)


@dataclass
class Slot:
    """A catalogued model's scheduling state."""

    model: Model
    keep_alive: float
    state: ModelState = "unloaded"
    hosted: Hosted | None = None
    holds: int = 0  # leases: requests using it or waiting for its load
    last_used: float = 0.0  # on the scheduler's clock (``Scheduler.now``): LRU order and keep-alive count from it
    loads: int = 0
    load_seconds: float | None = None  # the last load's, request to ready
    load_error: BaseException | None = None  # why the last load failed (its waiters raise it)
    estimate: MemoryEstimate | None = None  # cached: the spec never changes
    _loaded: anyio.Event = field(default_factory=anyio.Event)  # set when a load ends, either way
    _unloaded: anyio.Event = field(default_factory=anyio.Event)  # set when an unload ends
    _activity: anyio.Event = field(default_factory=anyio.Event)
    waiting: str | None = None  # what its load waits for (other models to be idle), while it does
    wanted_by: str | None = None  # a load waiting for this model to be idle to evict it: new requests wait behind it
    _released: anyio.Event = field(default_factory=anyio.Event)  # set when ``wanted_by`` is cleared

    @property
    def id(self) -> str:
        return self.model.id

    @property
    def idle(self) -> bool:
        return self.holds == 0 and (self.hosted is None or self.hosted.in_flight == 0)

    def expires_in(self, now: float) -> float | None:
        """Seconds until keep-alive unloads it (None: not counting down: busy, pinned, forever, or not loaded)."""
        if self.state != "loaded" or not self.idle or self.model.pinned or math.isinf(self.keep_alive):
            return None
        return max(self.last_used + self.keep_alive - now, 0.0)

    def poke(self) -> None:
        self._activity.set()
        self._activity = anyio.Event()

    def want(self, by: str) -> None:
        """A load (``by``) waits for this model to be idle, to evict it: requests arriving now wait behind it."""
        if self.wanted_by is None:
            self.wanted_by = by
            self._released = anyio.Event()

    def unwant(self, by: str | None = None) -> None:
        """The load waiting for this model is over (``by``: only if it was that one's): its requests go on."""
        if self.wanted_by is not None and (by is None or self.wanted_by == by):
            self.wanted_by = None
            self._released.set()


class _MustWait(TetherError):
    """Internal to placement: evicting these busy models once they are idle would make room (``why``: for what)."""

    def __init__(self, slots: list[Slot], why: str) -> None:
        super().__init__(why)
        self.slots = slots
        self.why = why


@contextlib.contextmanager
def _unloading(slot: Slot) -> Iterator[None]:
    """``slot`` is unloading for the block, and unloaded after it, however it ends (its waiters then load afresh)."""
    slot.state = "unloading"
    slot._unloaded = anyio.Event()
    try:
        yield
    finally:
        slot.hosted = None
        slot.state = "unloaded"
        slot._unloaded.set()


def _reserved(hosted: Hosted) -> int:
    """What a loaded runner may still grow into: its estimate (without headroom) beyond what it holds now (its own
    cgroup's usage, or its resident memory where more: weights cached before it started are resident but charged to
    whoever read them first). A model admitted on an estimate keeps that room: the next load cannot take memory this
    one will need once its context fills."""
    inst, sup = hosted.instance, hosted.supervisor
    if inst.fit is None or inst.fit.estimate is None or sup is None or not sup.alive:
        return 0
    usage = MemoryCgroup.at(sup.cgroup).usage() if sup.cgroup is not None else None
    resident = sup.footprint.rss if sup.footprint is not None else 0  # mapped weights included, whoever was charged
    return max(0, inst.fit.estimate.expected - max(usage or 0, resident))


def footprint_of(hosted: Hosted) -> int:
    """What stopping ``hosted``'s runner frees: its group's last measured footprint; 0 without a live runner."""
    sup = hosted.supervisor
    if sup is None or not sup.alive or sup.footprint is None:
        return 0
    return sup.footprint.footprint


def gpu_of(hosted: Hosted) -> int:
    """The GPU memory (NVML) in ``hosted``'s footprint: what stopping it gives back to the GPUs, not to the host."""
    sup = hosted.supervisor
    if sup is None or not sup.alive or sup.footprint is None:
        return 0
    return sup.footprint.gpu or 0


def host_of(hosted: Hosted) -> int:
    """What stopping ``hosted``'s runner gives back to the host's memory (its footprint less its VRAM)."""
    return footprint_of(hosted) - gpu_of(hosted)


class Scheduler:
    """The catalog served through ``fleet``, whose placer it becomes. Use as ``async with fleet, Scheduler(fleet,
    catalog) as scheduler:`` (it leaves first: its timers and loads end, then the fleet stops every instance)."""

    def __init__(
        self,
        fleet: Fleet,
        catalog: Catalog,
        *,
        max_loaded: int | None = None,
        load_wait: float = 300.0,
        reclaim_timeout: float = 10.0,
        reclaim_poll: float | None = None,
        memory: Callable[[], NodeMemory] = node_memory,
        default: str | None = None,
        placement: Placer | None = None,
        allow_engine_import: bool = False,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.fleet = fleet
        # What every rule about time reads: keep-alive countdowns, LRU order, the load and reclaim bounds, and the
        # durations the decisions report (a test steps a ``SteppedClock``)
        self._clock = clock
        # Whether POST /v1/instances may name an engine by module or file path (tether serve --allow-engine-import)
        self.allow_engine_import = allow_engine_import
        # Where a life goes on a cluster (``Cluster.place``: the node where it fits); None: this node, making room
        self.placement = placement
        self.default = default  # the model a placeholder name reaches when none is loaded (tether serve's first)
        self.catalog = catalog
        self.max_loaded = max_loaded
        self.load_wait = load_wait  # how long a request waits for its model's load
        self.reclaim_timeout = reclaim_timeout
        # None: check node memory as soon as the evicted group is reaped. A number: sleep that long between checks,
        # starting with a sleep, as Ollama does after an unload (bench/swap.py's baseline).
        self.reclaim_poll = reclaim_poll
        self.memory = memory
        self.slots = {model.id: Slot(model, model.keep_alive, last_used=clock.now()) for model in catalog}
        self.started_at = time.time()
        self.decisions: deque[Decision] = deque(maxlen=DECISIONS)
        self.listeners: Listeners[Decision] = Listeners("scheduler decision")
        self._placing = anyio.Semaphore(1)  # one placement (fit check to ready) at a time on this node
        self._holder: Instance | None = None  # the instance whose placement holds it
        self._placed: dict[str, anyio.Event] = {}  # instance id -> set once the placement awaited is decided
        self._refused: dict[str, TetherError] = {}  # instance id -> why its placement was refused
        self._tg: TaskGroup | None = None
        self._closed = False
        self._changed = anyio.Event()  # set (and replaced) when a model may have become idle or loaded
        fleet.placer = self.place
        fleet.listeners.add(self._watch)

    async def __aenter__(self) -> Scheduler:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        for slot in self.slots.values():
            if slot.model.pinned:
                self.preload(slot.id, "pinned")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        self._closed = True
        self._tg.cancel_scope.cancel()  # keep-alive timers and loads in progress; the fleet stops the instances
        await self._tg.__aexit__(None, None, None)
        return None

    def now(self) -> float:
        """The scheduler's clock: ``last_used``, keep-alive countdowns and every bound on a wait are read against it."""
        return self._clock.now()

    # --- names ----------------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every model a request can name: the catalog's, then instances added beside it."""
        return [*self.slots, *(h.id for h in self.fleet.list() if h.id not in self.slots)]

    def _named(self, name: str) -> str | None:
        """The model id ``name`` names (catalogued id or alias, instance id; ``name:latest`` finds ``name``)."""
        model = self.catalog.find(name)
        if model is not None:
            return model.id
        hosted_ids = {h.id for h in self.fleet.list()}
        return next((c for c in (name, name.removesuffix(":latest")) if c in hosted_ids), None)

    def resolve(self, name: str | None) -> str:
        """The model id a request's ``model`` names: a catalogued model (by id or alias; ``name:latest`` finds
        ``name``) or an instance. With exactly one model loaded, any other name (or none) reaches it, as with
        llama.cpp's and llama-cpp-python's servers, whose clients often send a placeholder; with none loaded, the
        default model (``tether serve``'s first) does."""
        named = self._named(name) if name is not None else None
        if named is not None:
            return named
        hosted_ids = [h.id for h in self.fleet.list()]
        if len(hosted_ids) == 1:
            return hosted_ids[0]
        if not hosted_ids and self.default is not None:
            return self.default
        served = ", ".join(self.names()) or "none"
        if name is None and self.names():
            raise ModelRequired(f"'model' is required when more than one model is served; models: {served}")
        raise NotFound(f"model {name!r} is not served here; models: {served}")

    def resolve_exact(self, name: str) -> str:
        """The model id ``name`` names (id, alias, ``:latest``, instance id), without the placeholder rule."""
        named = self._named(name)
        if named is None:
            raise NotFound(f"model {name!r} is not served here; models: {', '.join(self.names()) or 'none'}")
        return named

    async def remove(self, instance_id: str) -> Hosted:
        """``DELETE /v1/instances/{id}``: stop it now, busy or not (its requests end with the cause); a catalogued
        model is unloaded (a later request loads it again)."""
        hosted = self.fleet.get(instance_id)
        slot = self.slots.get(instance_id)
        if slot is None or slot.hosted is not hosted:
            await self._stop(hosted)
            return hosted
        await self._unload(slot, hosted, "deleted (DELETE /v1/instances)", "deleted")
        return hosted

    def loaded(self, model_id: str) -> bool:
        """Whether a request for ``model_id`` would be served without waiting for a load."""
        slot = self.slots.get(model_id)
        return slot is None or slot.state == "loaded"

    # --- leases ---------------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, model_id: str, keep_alive: float | None = None) -> AsyncIterator[Hosted]:
        """The model's instance, loaded (a catalogued model is loaded now if it is not, waiting at most
        ``load_wait``), kept from unloading and eviction until the block ends. ``keep_alive`` (seconds; None: the
        model's own) is how long it stays loaded once this request is done, as Ollama's per-request keep_alive:
        the last request to end sets the countdown. A request for a model that a waiting load will evict once it is
        idle waits behind that load (it would keep the model busy for ever otherwise), then loads it again."""
        slot = self.slots.get(model_id)
        if slot is None:  # an instance added through POST /v1/instances: it stays until it is deleted
            yield self.fleet.get(model_id)
            return
        began = self.now()
        await self._behind_waiting_load(slot, began)
        slot.holds += 1
        self._poke(slot)
        try:
            yield await self._ready_instance(slot, began)
        finally:
            slot.holds -= 1
            slot.last_used = self.now()
            slot.keep_alive = slot.model.keep_alive if keep_alive is None else keep_alive
            self._poke(slot)

    async def _behind_waiting_load(self, slot: Slot, began: float) -> None:
        """Wait (bounded by ``load_wait`` from ``began``) while a load waits for ``slot`` to be idle to evict it."""
        with self._clock.move_on_after(self.load_wait - (self.now() - began)):
            while slot.wanted_by is not None and slot.state in ("loaded", "loading"):
                await slot._released.wait()
        if slot.wanted_by is not None and slot.state in ("loaded", "loading"):
            raise Unavailable(
                f"model {slot.id} is to be unloaded for {slot.wanted_by} (which waits for it to be idle: "
                f"{self._busy_text([slot])}), and {self.now() - began:.0f} s passed (the longest a request "
                "waits for a load, --load-wait); retry later, or raise --max-loaded",
                retry_after=max(slot.load_seconds or 5.0, 1.0),
            )

    async def _ready_instance(self, slot: Slot, began: float) -> Hosted:
        with self._clock.move_on_after(self.load_wait - (self.now() - began)):
            while True:
                if slot.state == "loaded" and slot.hosted is not None:
                    return slot.hosted
                if slot.state == "unloading":
                    await slot._unloaded.wait()
                elif slot.state == "loading":
                    waiting_for = slot._loaded
                    await waiting_for.wait()
                    if slot.load_error is not None:  # reset when a load starts, set only when it fails
                        raise slot.load_error
                else:
                    self.preload(slot.id, "requested")
        waited = self.now() - began
        waiting = f": {slot.waiting}" if slot.state == "loading" and slot.waiting else ""
        raise Unavailable(
            f"model {slot.id} is still {slot.state} after {waited:.0f} s (the longest a request waits for a load, "
            f"--load-wait){waiting}; retry later, or raise --load-wait",
            retry_after=max(slot.load_seconds or 5.0, 1.0),
        )

    def preload(self, model_id: str, reason: str) -> None:
        """Start loading a catalogued model unless it is loaded or loading (a no-op then)."""
        slot = self.slots[model_id]
        if slot.state != "unloaded":
            return
        assert self._tg is not None, "use 'async with Scheduler(...)'"
        self._begin(slot, reason)
        self._tg.start_soon(self._load, slot, None)

    async def load_now(self, model_id: str, reason: str) -> Hosted:
        """Load a catalogued model and return once its placement is decided (the runner then loads in the
        background): a refusal (``DoesNotFit``, ``InvalidField``, ``Unavailable``) is raised here, as ``tether
        serve`` wants for its first model."""
        slot = self.slots[model_id]
        assert self._tg is not None and slot.state == "unloaded"
        began = self._begin(slot, reason)
        try:
            hosted = await self._start_instance(slot.model.config)
        except BaseException as exc:
            self._load_failed(slot, exc, began)
            raise
        slot.hosted = hosted
        self._tg.start_soon(self._load, slot, hosted)
        return hosted

    def _begin(self, slot: Slot, reason: str) -> float:
        slot.state = "loading"
        slot.load_error = None
        slot._loaded = anyio.Event()
        self._decide("load", slot.id, f"loading {slot.id} ({reason})")
        return self.now()

    async def _load(self, slot: Slot, hosted: Hosted | None) -> None:
        """Load ``slot`` (its instance placed already when ``hosted`` is given) until its runner is ready. A load
        that was overtaken (deleted while loading, and another load begun since) leaves the slot to the new one."""
        began = self.now()
        mine = slot._loaded
        try:
            if hosted is None:
                hosted = slot.hosted = await self._start_instance(slot.model.config)
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
                    await self.fleet.remove(hosted.id)
            if slot._loaded is mine:
                self._load_failed(slot, exc, began)
            if not isinstance(exc, Exception):
                raise
        else:
            if slot._loaded is not mine or slot.hosted is not hosted:  # deleted while it loaded
                return
            slot.state = "loaded"
            slot.loads += 1
            slot.load_seconds = self.now() - began
            slot.last_used = self.now()
            if hosted.supervisor is not None:
                await hosted.supervisor.sample_memory()
            memory = footprint_of(hosted)
            self._decide(
                "loaded",
                slot.id,
                f"{slot.id} loaded in {slot.load_seconds:.2f} s, holding {format_bytes(memory)}; keep-alive "
                f"{'pinned' if slot.model.pinned else describe_keep_alive(slot.keep_alive)}",
                seconds=slot.load_seconds,
                bytes=memory,
            )
            assert self._tg is not None
            self._tg.start_soon(self._keep_alive, slot, hosted)
            slot._loaded.set()
            self._notify()

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
        self._decide("load_failed", slot.id, str(slot.load_error), seconds=self.now() - began)
        slot._loaded.set()
        self._notify()

    # --- keep-alive and unloading ---------------------------------------------------------------------------

    async def _keep_alive(self, slot: Slot, hosted: Hosted) -> None:
        """Unload ``slot`` once it has been idle for its keep-alive; runs while this load lasts."""
        while slot.state == "loaded" and slot.hosted is hosted:
            wait = slot.expires_in(self.now())
            activity = slot._activity
            if wait is None:
                await activity.wait()
                continue
            if wait > 0:
                with self._clock.move_on_after(wait):
                    await activity.wait()
                continue
            why = "idle, keep-alive 0" if slot.keep_alive == 0 else f"idle for {describe_keep_alive(slot.keep_alive)}"
            await self.unload(slot.id, f"{why} (keep-alive expired)", reason="keep_alive")
            return

    async def unload(self, model_id: str, why: str, *, reason: str = "requested") -> bool:
        """Unload an idle catalogued model now (its runner's whole group gone when this returns); False when it is
        not loaded or busy."""
        slot = self.slots.get(model_id)
        if slot is None or slot.state != "loaded" or slot.hosted is None or not slot.idle:
            return False
        await self._unload(slot, slot.hosted, why, reason)
        return True

    async def _unload(self, slot: Slot, hosted: Hosted, why: str, reason: str) -> None:
        memory = footprint_of(hosted)
        with _unloading(slot):
            slot.unwant()
            seconds = await self._stop(hosted)
            self._decide("unload", slot.id, f"unloaded {slot.id}: {why}", seconds=seconds, bytes=memory, why=reason)
        self._notify()

    async def _stop(self, hosted: Hosted) -> float:
        """Stop ``hosted`` and return once its runner is reaped and its process group empty (seconds taken)."""
        began = self.now()
        sup = hosted.supervisor
        with anyio.CancelScope(shield=True):
            await self.fleet.remove(hosted.id)
            if sup is not None:  # every runner of it (each rank's, on every node) reaped and its group empty
                await sup.confirm_gone(self.reclaim_timeout)
        return self.now() - began

    def _watch(self, hosted: Hosted) -> None:
        """Every instance of the fleet: its placement lock released when its life leaves Starting, and a catalogued
        model whose instance failed for good is forgotten (its runner is gone: it holds nothing), so the next
        request loads it afresh."""

        def on_state(inst: Instance, state: InstanceState) -> None:
            if self._holder is inst and not isinstance(state, InstanceStarting):
                self._holder = None
                self._placing.release()
            slot = self.slots.get(hosted.id)
            whole = hosted.instance.state  # the best replica's: one failed replica of several leaves it loaded
            if (
                slot is not None
                and not self._closed
                and slot.hosted is hosted
                and slot.state == "loaded"
                and isinstance(whole, InstanceFailed | InstanceStopped)
            ):
                slot.hosted = None
                slot.state = "unloaded"
                slot.unwant()
                why = whole.cause.summary if isinstance(whole, InstanceFailed) else "stopped"
                self._decide("unload", slot.id, f"{slot.id} is gone: {why}", why="failed")
                assert self._tg is not None
                self._tg.start_soon(self.fleet.remove, hosted.id)
                self._poke(slot)

        for replica in hosted.replicas:
            replica.add_state_listener(functools.partial(on_state, replica))

    # --- placement ------------------------------------------------------------------------------------------

    async def place(self, instance: Instance) -> FitResult:
        """The ``Placer`` of every instance's every life: under the node's placement lock, evict what must go and
        check the fit. The lock stays held until the life is ready or gone (``_watch``). When only evicting busy
        models would make room, wait (without the lock, bounded by ``load_wait``) for them to be idle, then again."""
        deadline = self.now() + self.load_wait
        wanted: list[Slot] = []  # the busy models this placement waits for
        try:
            while True:
                try:
                    return await self._place_once(instance)
                except _MustWait as wait:
                    await self._wait_idle(instance, wait, deadline, wanted)
        except BaseException as exc:
            if isinstance(exc, DoesNotFit | Unavailable | InvalidField):
                if instance.name in self._placed:  # a creation awaits this verdict; a restart's is its own
                    self._refused[instance.name] = exc
                self._decide("refuse", instance.name, str(exc))
            if isinstance(exc, Unavailable):  # the instance fails its placement as "does not fit", saying why
                raise DoesNotFit(FitResult(None, None, "scheduler", False, False, str(exc))) from exc
            raise
        finally:
            for slot in wanted:
                slot.unwant(instance.name)
            waiting = self.slots.get(instance.name)
            if waiting is not None:
                waiting.waiting = None
            awaited = self._placed.pop(instance.name, None)
            if awaited is not None:
                awaited.set()

    async def _place_once(self, instance: Instance) -> FitResult:
        """One try under the placement lock, kept when it succeeds (released by ``_watch``), released otherwise."""
        await self._placing.acquire()
        self._holder = instance
        try:
            if self.placement is not None:
                return await self.placement(instance)
            return await self._make_room(instance)
        except BaseException:
            self._holder = None
            self._placing.release()
            raise

    async def _wait_idle(self, instance: Instance, wait: _MustWait, deadline: float, wanted: list[Slot]) -> None:
        """Wait, bounded by ``deadline``, until a model may have become idle (an event, not a poll); mark the busy
        models ``wait`` names as wanted (their new requests wait behind this load) and release the others."""
        changed = self._changed  # taken before any await: no wake-up between the verdict and the wait is missed
        for slot in wanted:
            if slot not in wait.slots:
                slot.unwant(instance.name)
        ids = ", ".join(s.id for s in wait.slots)
        if [s.id for s in wanted] != [s.id for s in wait.slots]:  # a new verdict: say what was chosen
            self._decide(
                "wait_idle",
                instance.name,
                f"{instance.name} waits for {ids} to be idle to evict it ({wait.why}; {self._busy_text(wait.slots)}); "
                f"new requests for {ids} wait behind this load, at most {self.load_wait:g} s (--load-wait)",
            )
        wanted[:] = wait.slots
        for slot in wanted:
            slot.want(instance.name)
        waiting = self.slots.get(instance.name)
        if waiting is not None:
            waiting.waiting = f"it waits for {ids} to be idle ({wait.why}; {self._busy_text(wait.slots)})"
        left = deadline - self.now()
        if left <= 0:
            raise Unavailable(
                f"cannot load {instance.name}: {wait.why}, and {ids} stayed busy for {self.load_wait:g} s (--load-wait;"
                f" {self._busy_text(wait.slots)}); retry when it is idle, or raise --max-loaded or --load-wait",
                retry_after=1.0,
            )
        with self._clock.move_on_after(left):
            await changed.wait()

    def _busy_text(self, slots: list[Slot]) -> str:
        """``a busy with 2 requests, b loading``: why each of ``slots`` cannot be evicted now."""
        parts = []
        for slot in slots:
            if slot.state == "loading":
                parts.append(f"{slot.id} loading")
            else:
                flying = slot.hosted.in_flight if slot.hosted is not None else 0
                parts.append(f"{slot.id} busy with {max(slot.holds, flying)} request(s)")
        return ", ".join(parts)

    def _poke(self, slot: Slot) -> None:
        """``slot``'s activity changed (a lease began or ended, a load or unload ended): wake its keep-alive timer
        and every placement waiting for a model to be idle."""
        slot.poke()
        self._notify()

    def _notify(self) -> None:
        """Wake every placement waiting for a model to be idle: it looks again."""
        self._changed.set()
        self._changed = anyio.Event()

    async def add_instance(self, config: InstanceConfig) -> Hosted:
        """``POST /v1/instances``: start it (evicting idle models if it needs their memory). An engine named by
        module or file path is refused (``EngineImportRefused``) unless ``allow_engine_import``: a request is not
        the operator, and importing is running code."""
        registry.check_import(config.engine, self.allow_engine_import, "in POST /v1/instances")
        model_id = config.default_id()
        if model_id in self.slots:
            raise InstanceExists(
                model_id,
                f"{model_id!r} is a catalogued model ({self.slots[model_id].model.source}): a request naming it loads "
                "it, DELETE /v1/instances/{id} unloads it; choose another id for an instance of your own",
            )
        return await self._start_instance(config)

    async def _start_instance(self, config: InstanceConfig) -> Hosted:
        """Add an instance to the fleet and wait (bounded) until its placement is decided. A refusal is raised here
        and the instance removed: ``DoesNotFit`` (507), ``Unavailable`` (503), ``InvalidField`` (400)."""
        names = replica_names(config)
        placed = [self._placed.setdefault(name, anyio.Event()) for name in names]
        hosted = await self.fleet.add(config)
        with self._clock.move_on_after(self.load_wait):
            for event in placed:  # replicas are placed one after another: all or nothing, as at creation
                await event.wait()
                if any(name in self._refused for name in names):
                    break
        for name in names:  # undecided yet: a later refusal fails the instance's placement, not a later creation
            if self._placed.get(name) in placed:
                del self._placed[name]
        refusals = [self._refused.pop(name) for name in names if name in self._refused]
        if refusals:
            await self.fleet.remove(hosted.id)
            raise refusals[0]
        return hosted

    async def _make_room(self, instance: Instance) -> FitResult:
        spec = instance.spec
        slot = self.slots.get(instance.name)
        if slot is not None and slot.estimate is not None:
            estimate: MemoryEstimate | None = slot.estimate
        else:
            estimate = await anyio.to_thread.run_sync(registry.estimate, spec)
            if slot is not None:
                slot.estimate = estimate
        if estimate is not None and instance.ranks > 1:  # every rank of a multi-rank instance, on this node
            estimate = await anyio.to_thread.run_sync(fit.ranks_estimate, spec, instance.ranks)
        for candidate in self._candidates(instance):  # what each would free, measured now
            sup = candidate.hosted.supervisor if candidate.hosted is not None else None
            if sup is not None:
                await sup.sample_memory()
        node = await anyio.to_thread.run_sync(self.memory)
        reserved = {h.id: _reserved(h) for h in self.fleet.list() if h.instance is not instance}
        host, gpu_victims = estimate, []
        if estimate is not None and instance.ranks == 1:  # what the host holds once the GPUs hold their layers
            short, offloaded = fit.gpu_shortfall(spec, estimate, node)
            gpu_victims = self._gpu_victims(instance, short) if short > 0 else []
            if offloaded is not None and (short <= 0 or gpu_victims):
                host = offloaded
            elif offloaded is not None:  # no room to make there: the layers that fit now
                host = fit.size(spec, estimate, node).estimate
        victims = self._victims(instance, host, node, reserved)
        chosen = {slot.id for slot, _ in victims}
        victims += [(slot, why) for slot, why in gpu_victims if slot.id not in chosen]
        evicted = {slot.id for slot, _ in victims}
        held_back = sum(room for model_id, room in reserved.items() if model_id not in evicted)  # the staying ones'
        if victims:
            need = host.total + held_back if host is not None else 0
            needs = host.describe() if host is not None else "needs a slot (no estimate)"
            node = await self._evict(instance.name, victims, need, needs, node)
        if estimate is None:
            engine = registry.canonical(spec.engine)
            return FitResult(None, None, "none", True, False, f"no memory estimate for engine {engine!r}: admitted")
        source = node.source
        if held_back:
            source += f"; less {format_bytes(held_back)} the loaded models may still grow into, by their estimates"
        available = node.available - held_back
        if instance.ranks > 1:
            return fit.check_fit(estimate, available, source, override=instance.force)
        return fit.judge(spec, estimate, node, available, source, override=instance.force)

    def _candidates(self, instance: Instance) -> list[Slot]:
        """Idle, unpinned, loaded catalogued models other than ``instance``'s, least recently used first."""
        found = [
            s
            for s in self.slots.values()
            if s.state == "loaded" and s.hosted is not None and s.idle and not s.model.pinned and s.id != instance.name
        ]
        return sorted(found, key=lambda s: s.last_used)

    def _busy(self, instance: Instance) -> list[Slot]:
        """Busy (or loading, once placed) unpinned catalogued models other than ``instance``'s, least recently used
        first: what a load may wait for, to evict once idle."""
        found = [
            s
            for s in self.slots.values()
            if s.hosted is not None
            and not s.model.pinned
            and s.id != instance.name
            and ((s.state == "loaded" and not s.idle) or s.state == "loading")
        ]
        return sorted(found, key=lambda s: (s.state == "loading", s.last_used))

    def _victims(
        self, instance: Instance, estimate: MemoryEstimate | None, node: NodeMemory, reserved: dict[str, int]
    ) -> list[tuple[Slot, str]]:
        """What must be evicted for ``instance`` to fit (by count under ``max_loaded``, then by memory); raise
        ``DoesNotFit`` with every number when evicting every idle model would not be enough, or ``_MustWait`` when
        evicting busy models as well would be (the placement waits for them to be idle).

        Each victim (with why: ``max_loaded`` or ``memory``) frees its measured footprint and what was reserved for it
        to grow into (``reserved``)."""
        candidates = self._candidates(instance)
        victims: list[tuple[Slot, str]] = []
        if self.max_loaded is not None:
            others = [  # placed: not waiting for the lock (that one has no runner yet and would count twice)
                h
                for h in self.fleet.list()
                if h.instance is not instance
                and (h.supervisor is not None or not isinstance(h.instance.state, InstanceStarting))
            ]
            excess = len(others) - self.max_loaded + 1
            if excess > len(candidates):
                waitable = self._busy(instance)
                if excess <= len(candidates) + len(waitable):
                    why = f"{len(others)} models are loaded (--max-loaded {self.max_loaded})"
                    raise _MustWait(waitable[: excess - len(candidates)], why)
                busy = ", ".join(h.id for h in others)
                raise Unavailable(
                    f"cannot load {instance.name}: {len(others)} models are loaded (--max-loaded {self.max_loaded}) "
                    f"and too few are idle to unload ({busy}); retry when one is idle",
                    retry_after=1.0,
                )
            victims = [(slot, "max_loaded") for slot in candidates[: max(excess, 0)]]
        if estimate is None:
            return victims

        def frees(slot: Slot) -> int:
            return (host_of(slot.hosted) if slot.hosted is not None else 0) + reserved.get(slot.id, 0)

        shortfall = estimate.total - (node.available - sum(reserved.values())) - sum(frees(s) for s, _ in victims)
        for slot in candidates[len(victims) :]:
            if shortfall <= 0:
                break
            victims.append((slot, "memory"))
            shortfall -= frees(slot)
        if shortfall > 0 and not instance.force:
            waiting = []
            for slot in self._busy(instance):  # would evicting busy ones too make room? then wait for them
                if shortfall <= 0:
                    break
                waiting.append(slot)
                shortfall -= frees(slot)
            if waiting and shortfall <= 0:
                raise _MustWait(waiting, f"it {estimate.describe()}, {format_bytes(node.available)} available")
            raise DoesNotFit(self._refusal(instance, estimate, node, candidates, reserved))
        return victims

    def _gpu_victims(self, instance: Instance, short: int) -> list[tuple[Slot, str]]:
        """Idle models holding VRAM (least recently used first) whose eviction gives the GPUs ``short`` bytes, so a
        model loads with every layer on them (as Ollama does); none when evicting all of them would not be enough
        (then the layers that fit go to the GPU, and nothing is evicted for it)."""
        chosen: list[tuple[Slot, str]] = []
        for slot in self._candidates(instance):
            if short <= 0:
                break
            held = gpu_of(slot.hosted) if slot.hosted is not None else 0
            if held > 0:
                chosen.append((slot, "gpu_memory"))
                short -= held
        return chosen if short <= 0 else []

    def _refusal(
        self,
        instance: Instance,
        estimate: MemoryEstimate,
        node: NodeMemory,
        candidates: list[Slot],
        reserved: dict[str, int],
    ) -> FitResult:
        evictable = sum(host_of(s.hosted) + reserved.get(s.id, 0) for s in candidates if s.hosted is not None)
        busy = [h for h in self.fleet.list() if h.instance is not instance and h.id not in {s.id for s in candidates}]
        busy_text = ", ".join(f"{h.id} {format_bytes(footprint_of(h))}" for h in busy) or "none"
        held_back = sum(reserved.values())
        source = node.source
        if held_back:
            source += f", less {format_bytes(held_back)} the loaded models may still grow into"
        source += (
            f", plus {format_bytes(evictable)} that evicting every idle model ({len(candidates)}) would free; busy or "
            f"pinned: {busy_text}"
        )
        result = fit.check_fit(estimate, node.available - held_back + evictable, source)
        message = f"{result.message}; or retry once a busy model is idle" if busy else result.message
        return FitResult(estimate, node.available, node.source, False, False, message)

    async def _evict(
        self, for_id: str, victims: list[tuple[Slot, str]], need: int, needs: str, before: NodeMemory
    ) -> NodeMemory:
        """Evict ``victims`` (concurrently), await each runner's whole group gone, then node memory risen by what
        they held (or ``need`` bytes available), bounded by ``reclaim_timeout``. Returns node memory after."""
        expected = vram = 0
        began = self.now()
        with contextlib.ExitStack() as unloading:
            stopping: list[Hosted] = []
            for slot, why in victims:
                assert slot.hosted is not None
                memory = footprint_of(slot.hosted)
                expected += host_of(slot.hosted)  # what the host gets back; the VRAM goes back to the GPUs
                vram += gpu_of(slot.hosted)
                stopping.append(slot.hosted)
                unloading.enter_context(_unloading(slot))
                slot.unwant()  # its requests waiting behind this load go on: to wait for the unload, then load it
                self._decide(
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
                        tg.start_soon(self._stop, hosted)
            except BaseExceptionGroup as group:
                first = group.exceptions[0]
                if isinstance(first, NotGone):
                    raise Unavailable(str(first), retry_after=None) from None
                raise
        reaped = self.now() - began
        target = before.available + int(expected * RECLAIMED_SHARE)
        node = await self._reclaimed(target, need, before, vram)
        waited = self.now() - began
        risen = node.available - before.available
        ids = ", ".join(slot.id for slot, _ in victims)
        gpu_back = sum(g.free for g in node.gpus) - sum(g.free for g in before.gpus)
        if vram and gpu_back < vram * RECLAIMED_SHARE:
            message = (
                f"evicted {ids} for {for_id} (runner groups gone in {reaped * 1000:.0f} ms), but the GPUs' free memory "
                f"rose by {format_bytes(gpu_back)} of the {format_bytes(vram)} they held within "
                f"{self.reclaim_timeout:g} s (--reclaim-timeout, NVML): a process still holds it (nvidia-smi lists "
                "who)"
            )
            self._decide("wait_memory", for_id, message, seconds=waited, bytes=gpu_back)
            raise Unavailable(message, retry_after=self.reclaim_timeout)
        if node.available < target and node.available < need:
            message = (
                f"evicted {ids} for {for_id} (runner groups gone in {reaped * 1000:.0f} ms), but node memory rose by "
                f"{format_bytes(risen)} of the {format_bytes(expected)} they held within {self.reclaim_timeout:g} s "
                f"(--reclaim-timeout): {format_bytes(node.available)} available ({node.source}), "
                f"{format_bytes(need)} needed. Something else holds it: check the node's other processes"
            )
            self._decide("wait_memory", for_id, message, seconds=waited, bytes=risen)
            raise Unavailable(message, retry_after=self.reclaim_timeout)
        self._decide(
            "reclaimed",
            for_id,
            f"memory back for {for_id}: +{format_bytes(risen)} (expected {format_bytes(expected)})"
            + (f", GPU +{format_bytes(gpu_back)} (expected {format_bytes(vram)})" if vram else "")
            + f" {waited * 1000:.0f} ms after evicting {ids} (groups gone in {reaped * 1000:.0f} ms)",
            seconds=waited,
            bytes=max(risen, 0),
        )
        return node

    async def _reclaimed(self, target: int, need: int, before: NodeMemory, vram: int = 0) -> NodeMemory:
        """Node memory once it reaches ``target`` (or ``need``) and the GPUs' free memory has risen by most of
        ``vram`` (what the evicted runners held there: a driver frees it after the process is gone, not with it),
        or as it is after ``reclaim_timeout``."""
        read = functools.partial(anyio.to_thread.run_sync, self.memory)
        deadline = self.now() + self.reclaim_timeout
        pause = 0.001
        if self.reclaim_poll is not None:  # the baseline: a ticker, first check one period after the unload
            await self._clock.sleep(self.reclaim_poll)
        node = await read()
        gpu_target = sum(g.free for g in before.gpus) + int(vram * RECLAIMED_SHARE)

        def short(node: NodeMemory) -> bool:
            host = node.available < target and node.available < need
            return host or (vram > 0 and sum(g.free for g in node.gpus) < gpu_target)

        while short(node) and self.now() < deadline:
            # The groups are reaped, so their anonymous memory is freed already; what lags is accounting (per-CPU
            # charge caches) or a driver giving back device memory: short, growing pauses, bounded (the last one ends
            # at the deadline, not past it).
            step = self.reclaim_poll if self.reclaim_poll is not None else pause
            await self._clock.sleep(min(step, deadline - self.now()))
            pause = min(pause * 2, 0.05)
            node = await read()
        return node

    # --- what it knows ----------------------------------------------------------------------------------------

    def _decide(
        self,
        kind: DecisionKind,
        model: str,
        reason: str,
        *,
        seconds: float | None = None,
        bytes: int | None = None,
        why: str | None = None,
    ) -> None:
        decision = Decision(time.time(), kind, model, reason, seconds, bytes, why)
        self.decisions.append(decision)
        log.info("%s %s: %s", kind, model, reason)
        self.listeners(decision)

    async def estimate(self, slot: Slot) -> MemoryEstimate | None:
        """The model's memory estimate (read once, off the event loop); None when the engine declares none or the
        model file cannot be read."""
        if slot.estimate is None:
            with contextlib.suppress(InvalidField):
                slot.estimate = await anyio.to_thread.run_sync(registry.estimate, slot.model.config.spec())
        return slot.estimate


def describe(decision: Decision) -> str:
    """One line for a decision: ``12:00:01 evict smol: evicting smol (...)``."""
    return (
        f"{time.strftime('%H:%M:%S', time.localtime(decision.at))} {decision.kind} {decision.model}: {decision.reason}"
    )
