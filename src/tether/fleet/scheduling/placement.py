"""One placement at a time per node: every runner life of every instance (a load, a restart, an instance added
through ``POST /v1/instances``) is placed under one lock, held from the fit check until the runner is ready or
gone, so two loads never both count the same free memory. Placing evicts what must go (``eviction``, ``reclaim``)
and runs the fit check (``tether.node.fit.judge``); when only busy models' eviction would make room, it waits for
them to be idle (the lock released meanwhile), bounded by ``load_wait``."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import anyio

from tether.engines import registry
from tether.engines.base import MemoryEstimate
from tether.errors import InvalidField, TetherError
from tether.fleet.fleet import Hosted, Unavailable
from tether.fleet.scheduling import eviction
from tether.fleet.scheduling.eviction import MustWait
from tether.fleet.scheduling.reclaim import evict
from tether.fleet.scheduling.slots import Slot, reserved
from tether.fleet.scheduling.state import SchedulerState
from tether.node import fit
from tether.node.fit import DoesNotFit, FitResult
from tether.node.instance import Instance, InstanceStarting, InstanceState, Placer
from tether.node.memory import NodeMemory
from tether.units import format_bytes

log = logging.getLogger(__name__)


class Placement:
    """The ``Placer`` of every instance's every life on this node (or, on a cluster, ``elsewhere``'s, under the same
    lock): the lock, the verdicts that instance creations await, and making room."""

    def __init__(self, state: SchedulerState, elsewhere: Placer | None = None) -> None:
        self.state = state
        self.elsewhere = elsewhere  # where a life goes on a cluster (``Cluster.place``); None: here, making room
        self.awaited: dict[str, anyio.Event] = {}  # instance id -> set once the placement awaited is decided
        self.refused: dict[str, TetherError] = {}  # instance id -> why its placement was refused
        self._lock = anyio.Semaphore(1)  # one placement (fit check to ready) at a time on this node
        self._holder: Instance | None = None  # the instance whose placement holds it

    async def place(self, instance: Instance) -> FitResult:
        """Under the node's placement lock, evict what must go and check the fit. The lock stays held until the life
        is ready or gone (``watch``). When only evicting busy models would make room, wait (without the lock,
        bounded by ``load_wait``) for them to be idle, then again."""
        state = self.state
        deadline = state.now() + state.settings.load_wait
        wanted: list[Slot] = []  # the busy models this placement waits for
        try:
            while True:
                try:
                    return await self._place_once(instance)
                except MustWait as wait:
                    await self._wait_idle(instance, wait, deadline, wanted)
        except BaseException as exc:
            if isinstance(exc, DoesNotFit | Unavailable | InvalidField):
                if instance.name in self.awaited:  # a creation awaits this verdict; a restart's is its own
                    self.refused[instance.name] = exc
                state.log.decide("refuse", instance.name, str(exc))
            if isinstance(exc, Unavailable):  # the instance fails its placement as "does not fit", saying why
                raise DoesNotFit(FitResult(None, None, "scheduler", False, False, str(exc))) from exc
            raise
        finally:
            for slot in wanted:
                slot.unwant(instance.name)
            waiting = state.slots.get(instance.name)
            if waiting is not None:
                waiting.waiting = None
            awaited = self.awaited.pop(instance.name, None)
            if awaited is not None:
                awaited.set()

    def watch(self, hosted: Hosted) -> None:
        """Every instance of the fleet: its placement lock released when its life leaves Starting."""

        def on_state(inst: Instance, state: InstanceState) -> None:
            if self._holder is inst and not isinstance(state, InstanceStarting):
                self._holder = None
                self._lock.release()

        for replica in hosted.replicas:
            replica.add_state_listener(functools.partial(on_state, replica))

    async def _place_once(self, instance: Instance) -> FitResult:
        """One try under the placement lock, kept when it succeeds (released by ``watch``), released otherwise."""
        await self._lock.acquire()
        self._holder = instance
        try:
            if self.elsewhere is not None:
                return await self.elsewhere(instance)
            return await self._make_room(instance)
        except BaseException:
            self._holder = None
            self._lock.release()
            raise

    async def _wait_idle(self, instance: Instance, wait: MustWait, deadline: float, wanted: list[Slot]) -> None:
        """Wait, bounded by ``deadline``, until a model may have become idle (an event, not a poll); mark the busy
        models ``wait`` names as wanted (their new requests wait behind this load) and release the others."""
        state = self.state
        load_wait = state.settings.load_wait
        changed = state.changed  # taken before any await: no wake-up between the verdict and the wait is missed
        for slot in wanted:
            if slot not in wait.slots:
                slot.unwant(instance.name)
        ids = ", ".join(s.id for s in wait.slots)
        busy = eviction.busy_text(wait.slots)
        if [s.id for s in wanted] != [s.id for s in wait.slots]:  # a new verdict: say what was chosen
            state.log.decide(
                "wait_idle",
                instance.name,
                f"{instance.name} waits for {ids} to be idle to evict it ({wait.why}; {busy}); "
                f"new requests for {ids} wait behind this load, at most {load_wait:g} s (--load-wait)",
            )
        wanted[:] = wait.slots
        for slot in wanted:
            slot.want(instance.name)
        waiting = state.slots.get(instance.name)
        if waiting is not None:
            waiting.waiting = f"it waits for {ids} to be idle ({wait.why}; {busy})"
        left = deadline - state.now()
        if left <= 0:
            raise Unavailable(
                f"cannot load {instance.name}: {wait.why}, and {ids} stayed busy for {load_wait:g} s (--load-wait;"
                f" {busy}); retry when it is idle, or raise --max-loaded or --load-wait",
                retry_after=1.0,
            )
        with state.clock.move_on_after(left):
            await changed.wait()

    async def _make_room(self, instance: Instance) -> FitResult:
        """``_fit_here``; when it does not fit while other instances' runners are being stopped (a keep-alive
        unload, a DELETE, one that ignores its stop until the stop bound kills it), wait for them to be gone, bounded
        by ``reclaim_timeout``, and check again: their memory is on its way back, and "does not fit" would be a
        refusal for memory a moment away."""
        state = self.state
        began = state.now()
        deadline = began + state.settings.reclaim_timeout
        while True:
            stopping = {name: gone for name, gone in state.stopping.items() if name != instance.name}
            try:
                return await self._fit_here(instance)
            except DoesNotFit as refusal:
                if not stopping or state.now() >= deadline:
                    raise
                ids = ", ".join(stopping)
                log.info("%s waits for %s to be stopped before it is refused: %s", instance.name, ids, refusal)
                with state.clock.move_on_after(deadline - state.now()):
                    for gone in stopping.values():
                        await gone.wait()
                waited = state.now() - began
                still = [name for name in stopping if name in state.stopping]
                state.log.decide(
                    "reclaimed",
                    instance.name,
                    f"{instance.name} did not fit while {ids} were being stopped: checked again "
                    + (f"once they were gone, {waited * 1000:.0f} ms after" if not still else f"after {waited:g} s")
                    + f" (at most {state.settings.reclaim_timeout:g} s: --reclaim-timeout)",
                    seconds=waited,
                )

    async def _fit_here(self, instance: Instance) -> FitResult:
        """Evict what ``instance`` needs gone (idle models, by count, host memory and GPU memory), wait for their
        memory back, then the fit check on what is available now, less the room loaded models may still grow into."""
        state = self.state
        spec = instance.spec
        estimate = await self._estimate(instance)
        await self._dead_released(instance)
        for candidate in eviction.candidates(state, instance):  # what each would free, measured now
            sup = candidate.hosted.supervisor if candidate.hosted is not None else None
            if sup is not None:
                await sup.sample_memory()
        credit, note = fit.adopted(spec)  # its own saved prompts: in use on the node, and in its estimate again

        def credited(node: NodeMemory) -> NodeMemory:
            return dataclasses.replace(node, available=node.available + credit, source=node.source + note)

        measured = await anyio.to_thread.run_sync(state.settings.memory)
        node = credited(measured)
        held = {h.id: reserved(h) for h in state.fleet.list() if h.instance is not instance}
        host, gpu_victims = estimate, []
        if estimate is not None and instance.ranks == 1:  # what the host holds once the GPUs hold their layers
            short, offloaded = fit.gpu_shortfall(spec, estimate, node)
            gpu_victims = eviction.gpu_victims(state, instance, short) if short > 0 else []
            if offloaded is not None and (short <= 0 or gpu_victims):
                host = offloaded
            elif offloaded is not None:  # no room to make there: the layers that fit now
                host = fit.size(spec, estimate, node).estimate
        victims = eviction.victims(state, instance, host, node, held)
        chosen = {slot.id for slot, _ in victims}
        victims += [(slot, why) for slot, why in gpu_victims if slot.id not in chosen]
        evicted = {slot.id for slot, _ in victims}
        held_back = sum(room for model_id, room in held.items() if model_id not in evicted)  # the staying ones'
        if victims:
            need = host.total + held_back if host is not None else 0
            needs = host.describe() if host is not None else "needs a slot (no estimate)"
            node = credited(await evict(state, instance.name, victims, need - credit, needs, measured))
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

    async def _dead_released(self, instance: Instance) -> None:
        """Await this node's runners that died a moment ago until their memory is freed, bounded by
        ``reclaim_timeout``: a process is reported exited before its memory leaves while anything else holds its
        address space, and the fit check must not count what is on its way out."""
        state = self.state
        dying = [
            h.supervisor
            for h in state.fleet.list()
            if h.instance is not instance and h.supervisor is not None and not h.supervisor.alive
        ]
        with state.clock.move_on_after(state.settings.reclaim_timeout):
            for sup in dying:
                if sup.node is None:  # another node's memory is not this check's
                    await sup.wait_released(math.inf)

    async def _estimate(self, instance: Instance) -> MemoryEstimate | None:
        """What ``instance``'s life needs (a catalogued model's estimate read once), every rank's on this node."""
        slot = self.state.slots.get(instance.name)
        if slot is not None and slot.estimate is not None:
            estimate: MemoryEstimate | None = slot.estimate
        else:
            estimate = await anyio.to_thread.run_sync(registry.estimate, instance.spec)
            if slot is not None:
                slot.estimate = estimate
        if estimate is not None and instance.ranks > 1:  # every rank of a multi-rank instance, on this node
            estimate = await anyio.to_thread.run_sync(fit.ranks_estimate, instance.spec, instance.ranks)
        return estimate
