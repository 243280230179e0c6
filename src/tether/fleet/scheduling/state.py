"""What every part of the scheduler shares: the slots, the fleet, the settings and clock, the decision log, the task
group its timers and loads run in, and the wake-up of placements waiting for a model to be idle."""

from __future__ import annotations

import anyio
from anyio.abc import TaskGroup

from tether.fleet.catalog import Catalog
from tether.fleet.fleet import Fleet
from tether.fleet.scheduling.decisions import DecisionLog
from tether.fleet.scheduling.settings import SchedulerSettings
from tether.fleet.scheduling.slots import Slot


class SchedulerState:
    """The scheduler's shared state (one per ``Scheduler``)."""

    def __init__(self, fleet: Fleet, catalog: Catalog, settings: SchedulerSettings) -> None:
        self.fleet = fleet
        self.catalog = catalog
        self.settings = settings
        self.clock = settings.clock
        self.log = DecisionLog()
        self.slots = {model.id: Slot(model, model.keep_alive, last_used=self.clock.now()) for model in catalog}
        self.closed = False  # the scheduler is leaving: a failed instance is no longer forgotten and reloaded
        self.changed = anyio.Event()  # set (and replaced) when a model may have become idle or loaded
        self.stopping: dict[str, anyio.Event] = {}  # instance id -> set once its runners are gone (``stop``)
        self._tg: TaskGroup | None = None

    @property
    def tasks(self) -> TaskGroup:
        """Where keep-alive timers and loads run (the scheduler's ``async with``)."""
        assert self._tg is not None, "use 'async with Scheduler(...)'"
        return self._tg

    @tasks.setter
    def tasks(self, group: TaskGroup) -> None:
        self._tg = group

    def now(self) -> float:
        return self.clock.now()

    def poke(self, slot: Slot) -> None:
        """``slot``'s activity changed (a lease began or ended, a load or unload ended): wake its keep-alive timer
        and every placement waiting for a model to be idle."""
        slot.poke()
        self.notify()

    def notify(self) -> None:
        """Wake every placement waiting for a model to be idle: it looks again."""
        self.changed.set()
        self.changed = anyio.Event()
