"""The worker's memory upkeep (``node/upkeep``): full collections on a clock free the reference cycles requests leave,
with the heap trimmed after; ``TETHER_GC_INTERVAL`` sets the clock, and a value that is no interval stops
``tether serve`` at once with a usage error."""

from __future__ import annotations

import gc
import os
import subprocess
import weakref

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import TETHER
from tether import env
from tether.cli.common import EXIT_USAGE
from tether.fleet.catalog import Catalog
from tether.fleet.fleet import Fleet
from tether.fleet.scheduler import Scheduler
from tether.node.memory import process_status_memory
from tether.node.upkeep import GC_INTERVAL, Upkeep, interval_from_env
from tether.serve.app import create_app

pytestmark = pytest.mark.timeout(30)


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    """Two objects referring to each other, unreachable once this returns: only a collection frees them."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_interval_is_read_from_the_environment_and_a_wrong_one_says_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(env.GC_INTERVAL, raising=False)
    assert interval_from_env() == GC_INTERVAL
    for raw, seconds in (("0", 0.0), (" 2.5 ", 2.5), ("30", 30.0)):
        monkeypatch.setenv(env.GC_INTERVAL, raw)
        assert interval_from_env() == seconds
    for raw in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(env.GC_INTERVAL, raw)
        with pytest.raises(ValueError, match=r"TETHER_GC_INTERVAL=.* is not a number of seconds >= 0.*or 0 to leave"):
            interval_from_env()


def test_a_collection_frees_the_cycles_waiting_and_counts_them() -> None:
    upkeep = Upkeep(interval=60.0)
    was = gc.isenabled()
    gc.disable()  # nothing but the upkeep collects here
    try:
        gone = [_cycle() for _ in range(100)]
        assert all(ref() is not None for ref in gone)
        found = upkeep.collect()
    finally:
        if was:
            gc.enable()
    assert all(ref() is None for ref in gone)
    assert found >= 200
    assert upkeep.collections == 1 and upkeep.collected == found
    assert 0 < upkeep.last_pause_s == upkeep.max_pause_s < 5


def test_the_clock_collects_until_cancelled_and_an_interval_of_0_never_runs() -> None:
    async def main() -> None:
        off = Upkeep(interval=0.0)
        with anyio.fail_after(1):
            await off.run()  # returns at once: CPython's own thresholds only
        assert off.collections == 0
        on = Upkeep(interval=0.01)
        async with anyio.create_task_group() as tg:
            tg.start_soon(on.run)
            with anyio.fail_after(10):
                while on.collections < 3:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert on.collections >= 3

    anyio.run(main)


def test_serve_refuses_a_gc_interval_that_is_not_one_before_it_loads_anything() -> None:
    out = subprocess.run(
        [*TETHER, "serve", "--engine", "debug", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, env.GC_INTERVAL: "often"},
    )
    assert out.returncode == EXIT_USAGE, out.stderr
    assert "TETHER_GC_INTERVAL='often' is not a number of seconds >= 0" in out.stderr, out.stderr


def test_metrics_show_each_collections_pause_and_catch_and_the_workers_own_memory_and_fds() -> None:
    upkeep = Upkeep(interval=60.0)
    app = create_app(Scheduler(Fleet(), Catalog()), upkeep=upkeep)

    async def scrape() -> dict[str, float]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000", timeout=20) as client:
            reply = await client.get("/metrics")
            fds = len(os.listdir("/proc/self/fd"))  # as the scrape saw them (each count includes its own listing)
        assert reply.status_code == 200, reply.text
        found = {s.name: s.value for f in text_string_to_metric_families(reply.text) for s in f.samples if not s.labels}
        return {**found, "fds_now": fds}

    before = anyio.run(scrape)
    assert before["tether_worker_gc_pause_seconds_count"] == 0
    was = gc.isenabled()
    gc.disable()
    try:
        gone = [_cycle() for _ in range(50)]
        found = upkeep.collect()
        upkeep.collect()
    finally:
        if was:
            gc.enable()
    assert all(ref() is None for ref in gone) and found >= 100
    after = anyio.run(scrape)
    assert after["tether_worker_gc_pause_seconds_count"] == 2
    assert 0 < after["tether_worker_gc_pause_seconds_sum"] < 10
    assert after["tether_worker_gc_collected_objects_total"] >= found
    mine = process_status_memory(os.getpid())
    assert mine is not None
    rss = mine.rss
    assert abs(after["process_resident_memory_bytes"] - rss) < max(64 << 20, rss // 4)
    assert after["process_open_fds"] == after["fds_now"]
