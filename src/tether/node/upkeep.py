"""The memory upkeep of the long-lived processes that host runners (the worker, and each node agent of a cluster): a
full garbage collection on a clock, then glibc's free heap handed back.

Why: each request leaves reference cycles in the web server's objects (uvicorn's per-connection events, FastAPI's
and Starlette's exit stacks, an exception's traceback when a client leaves), which only a full collection frees.
CPython runs one only when the objects that survived earlier collections have grown by a quarter, and a worker
holds hundreds of thousands of long-lived objects (its imports, the app, the catalog): the cycles of thousands of
requests waited, spread over pymalloc's arenas, and each wave left some arenas resident for good (the 30-minute
soak's RSS climbed 9.5 MiB/h; ``bench/soak.py`` found the garbage with ``TETHER_TRACEMALLOC``). So the worker
freezes what it built before serving (``gc.freeze``: never traversed again, so a full collection walks only what
requests made, a few ms) and collects every ``TETHER_GC_INTERVAL`` seconds, then asks glibc (``malloc_trim``) to
return what it holds free. The interval is a trade: a shorter one keeps less garbage waiting, and each collection
pauses the event loop (a few ms; one over ``SLOW_PAUSE_S`` is reported).
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from tether import env

GC_INTERVAL = 5.0  # seconds between full collections (TETHER_GC_INTERVAL; 0: CPython's own thresholds only)
SLOW_PAUSE_S = 0.25  # a collection longer than this is reported on stderr: the interval is too long or garbage huge


def interval_from_env() -> float:
    """``TETHER_GC_INTERVAL`` in seconds (0 turns the upkeep off), ``GC_INTERVAL`` when unset; a value that is not a
    number >= 0 is an error that says so (``tether serve`` refuses to start with it)."""
    raw = os.environ.get(env.GC_INTERVAL, "").strip()
    if not raw:
        return GC_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"{env.GC_INTERVAL}={raw!r} is not a number of seconds >= 0: set it to the seconds between the worker's "
            f"full garbage collections (default {GC_INTERVAL:g}), or 0 to leave collections to CPython"
        )
    return value


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


@dataclass
class Upkeep:
    """Full collections every ``interval`` seconds (see the module's docstring), with what they found and cost."""

    interval: float = GC_INTERVAL
    collections: int = 0
    collected: int = 0  # unreachable objects found, over every collection
    last_pause_s: float = 0.0
    max_pause_s: float = 0.0
    # Told (pause in seconds, objects found) after each collection: /metrics observes them.
    listeners: list[Callable[[float, int], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._trim = _malloc_trim()

    def freeze(self) -> None:
        """Move every object alive now out of the collector's sight: call it once, when the worker is built."""
        gc.collect()
        gc.freeze()

    def collect(self) -> int:
        """One full collection and a heap trim; the unreachable objects it found."""
        began = time.perf_counter()
        found = gc.collect()
        if self._trim is not None:
            self._trim(0)
        pause = time.perf_counter() - began
        self.collections += 1
        self.collected += found
        self.last_pause_s = pause
        self.max_pause_s = max(self.max_pause_s, pause)
        for listener in self.listeners:
            listener(pause, found)
        if pause > SLOW_PAUSE_S:
            print(
                f"tether: a full garbage collection held the worker {pause * 1000:.0f} ms ({found} objects freed); "
                f"set {env.GC_INTERVAL} lower to collect less at a time",
                file=sys.stderr,
                flush=True,
            )
        return found

    async def run(self) -> None:
        """Collect every ``interval`` seconds until cancelled (at once if the interval is 0: nothing to do)."""
        if self.interval <= 0:
            return
        while True:
            await anyio.sleep(self.interval)
            self.collect()
