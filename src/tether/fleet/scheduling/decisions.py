"""The scheduler's one decision log: every load, eviction, wait and refusal, with why and its numbers.

Each ``Decision`` is kept (the last ``DECISIONS``), logged, handed to listeners (``/metrics`` counts them), and served
by ``GET /v1/instances`` and ``tether status``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Literal

import msgspec

from tether.node.listeners import Listeners

log = logging.getLogger("tether.fleet.scheduler")

DECISIONS = 256  # decisions kept for GET /v1/instances and tether status (every one is also logged and counted)

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


class DecisionLog:
    """The last ``DECISIONS`` decisions, and who hears each one as it is made."""

    def __init__(self) -> None:
        self.decisions: deque[Decision] = deque(maxlen=DECISIONS)
        self.listeners: Listeners[Decision] = Listeners("scheduler decision")

    def decide(
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
