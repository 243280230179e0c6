"""A catalogued model's scheduling state (``Slot``), and what its runner holds: the memory stopping it frees and the
room its estimate keeps for it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import anyio

from tether.engines.base import MemoryEstimate
from tether.fleet.catalog import Model
from tether.fleet.fleet import Hosted
from tether.kernel.cgroups import MemoryCgroup

ModelState = Literal["unloaded", "loading", "loaded", "unloading"]


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
    load_ended: anyio.Event = field(default_factory=anyio.Event)  # set when a load ends, either way
    unload_ended: anyio.Event = field(default_factory=anyio.Event)  # set when an unload ends
    activity: anyio.Event = field(default_factory=anyio.Event)  # set (and replaced) when a lease begins or ends
    waiting: str | None = None  # what its load waits for (other models to be idle), while it does
    wanted_by: str | None = None  # a load waiting for this model to be idle to evict it: new requests wait behind it
    released: anyio.Event = field(default_factory=anyio.Event)  # set when ``wanted_by`` is cleared

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
        self.activity.set()
        self.activity = anyio.Event()

    def want(self, by: str) -> None:
        """A load (``by``) waits for this model to be idle, to evict it: requests arriving now wait behind it."""
        if self.wanted_by is None:
            self.wanted_by = by
            self.released = anyio.Event()

    def unwant(self, by: str | None = None) -> None:
        """The load waiting for this model is over (``by``: only if it was that one's): its requests go on."""
        if self.wanted_by is not None and (by is None or self.wanted_by == by):
            self.wanted_by = None
            self.released.set()


def reserved(hosted: Hosted) -> int:
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
    """What stopping ``hosted`` gives back to the host's memory: its runner's footprint less its VRAM, and its
    store (saved prompts that outlive the runner, removed with the instance)."""
    return footprint_of(hosted) - gpu_of(hosted) + hosted.store_bytes()
