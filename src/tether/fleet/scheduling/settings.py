"""The scheduler's settings in one value (``tether serve``'s ``--max-loaded``, ``--load-wait``, ``--reclaim-*``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tether.clock import MONOTONIC, Clock
from tether.node.memory import NodeMemory, node_memory


@dataclass(frozen=True)
class SchedulerSettings:
    """How many models stay loaded, how long a request waits for a load, how eviction waits for memory, and the
    clock every one of those rules reads."""

    max_loaded: int | None = None  # loaded models at most (None: as many as memory holds)
    load_wait: float = 300.0  # how long a request waits for its model's load (and a load for busy models to idle)
    reclaim_timeout: float = 10.0  # how long an eviction waits for the memory back
    # None: check node memory as soon as the evicted group is reaped. A number: sleep that long between checks,
    # starting with a sleep, as Ollama does after an unload (bench/swap.py's baseline).
    reclaim_poll: float | None = None
    memory: Callable[[], NodeMemory] = node_memory  # this node's memory now (a test gives its own)
    # Whether POST /v1/instances may name an engine by module or file path (tether serve --allow-engine-import)
    allow_engine_import: bool = False
    # What every rule about time reads: keep-alive countdowns, LRU order, the load and reclaim bounds, and the
    # durations the decisions report (a test steps a ``SteppedClock``)
    clock: Clock = MONOTONIC


DEFAULT = SchedulerSettings()
