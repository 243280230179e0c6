"""The scheduler's keep-alive and LRU logic on a clock the test steps: in-process, with real debug runners, and no
real time spent waiting for a countdown. (Eviction under a real memory cgroup stays real, in test_scheduler.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest

from tether.clock import SteppedClock
from tether.fleet.catalog import Catalog, Model
from tether.fleet.fleet import Fleet, InstanceConfig
from tether.fleet.scheduler import Decision, Scheduler, SchedulerSettings, Slot
from tether.node.settings import SupervisorSettings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftover_runners")]


def model(name: str, keep_alive: float) -> Model:
    return Model(name, InstanceConfig(id=name, engine="debug"), (), keep_alive, False, "the test")


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[Scheduler, SteppedClock]]:
    clock = SteppedClock()
    catalog = Catalog([model("a", 60.0), model("b", 60.0), model("c", 60.0)])
    async with (
        Fleet(SupervisorSettings(stop_timeout=10)) as fleet,
        Scheduler(fleet, catalog, SchedulerSettings(max_loaded=2, clock=clock)) as scheduler,
    ):
        yield scheduler, clock


async def use(scheduler: Scheduler, model_id: str, keep_alive: float | None = None) -> Slot:
    """One request's lease: load (if needed), then release, which starts the keep-alive countdown; the model's slot."""
    with anyio.fail_after(30):
        async with scheduler.lease(model_id, keep_alive):
            pass
    return scheduler.slots[model_id]


async def decided(scheduler: Scheduler, kind: str, model_id: str, action: Callable[[], Awaitable[None]]) -> Decision:
    """Run ``action``, then wait for the scheduler's next ``kind`` decision about ``model_id`` (the event, not a
    sleep), watched from before the action so that it cannot be missed."""
    seen: list[Decision] = []
    arrived = anyio.Event()

    def watch(decision: Decision) -> None:
        if decision.kind == kind and decision.model == model_id and not seen:
            seen.append(decision)
            arrived.set()

    scheduler.listeners.add(watch)
    await action()
    with anyio.fail_after(10):
        await arrived.wait()
    return seen[0]


async def test_keep_alive_counts_on_the_schedulers_clock_and_unloads_when_it_runs_out(
    scheduler: tuple[Scheduler, SteppedClock],
) -> None:
    sched, clock = scheduler
    slot = await use(sched, "a")
    assert slot.state == "loaded" and slot.expires_in(sched.now()) == 60.0
    assert await clock.next_deadline() == clock.now() + 60.0  # the countdown sleeps on the scheduler's clock
    clock.advance(59.5)
    await anyio.wait_all_tasks_blocked()
    assert slot.state == "loaded" and slot.expires_in(sched.now()) == pytest.approx(0.5)
    await use(sched, "a", 5.0)  # a request's own keep_alive replaces the model's for the next countdown
    assert slot.expires_in(sched.now()) == 5.0

    async def step() -> None:
        await anyio.wait_all_tasks_blocked()  # the countdown has re-read the clock since the request ended
        assert await clock.next_deadline() == pytest.approx(clock.now() + 5.0)
        clock.advance(5.0)  # the countdown's sleep ends: run out

    unload = await decided(sched, "unload", "a", step)
    assert slot.state == "unloaded" and slot.hosted is None
    assert unload.why == "keep_alive" and "idle for 5 s (keep-alive expired)" in unload.reason


async def test_a_lease_held_stops_the_countdown_however_far_the_clock_moves(
    scheduler: tuple[Scheduler, SteppedClock],
) -> None:
    sched, clock = scheduler
    slot = await use(sched, "a")
    async with sched.lease("a"):
        clock.advance(3600)
        await anyio.wait_all_tasks_blocked()
        assert clock.pending == []  # busy: nothing counts down
        assert slot.state == "loaded" and slot.expires_in(sched.now()) is None  # busy: not counting down
    assert slot.expires_in(sched.now()) == 60.0  # released: the countdown starts over from now


async def test_over_max_loaded_the_least_recently_used_by_the_clock_is_evicted(
    scheduler: tuple[Scheduler, SteppedClock],
) -> None:
    sched, clock = scheduler
    await use(sched, "a")
    clock.advance(10)
    await use(sched, "b")
    clock.advance(10)
    await use(sched, "a")  # a is now the more recent: b goes first
    assert sched.slots["b"].last_used == clock.now() - 10 < sched.slots["a"].last_used == clock.now()
    evict = await decided(sched, "evict", "b", lambda: use(sched, "c"))
    assert evict.why == "max_loaded", evict
    assert {s.id for s in sched.slots.values() if s.state == "loaded"} == {"a", "c"}
