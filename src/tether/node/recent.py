"""What ended lately, by id, so a late question about it (a cancel) gets a true answer ("already complete") rather
than "unknown": bounded by count and by age, since the answer matters for seconds and the traffic is unbounded.

Age keeps a worker's memory at its steady state once ``seconds`` of traffic have passed, at any request rate below
``limit / seconds``; the count caps it above that rate.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class Recent(Generic[V]):
    """At most ``limit`` ids, none older than ``seconds`` (by ``clock``), each with a value; oldest dropped first."""

    def __init__(self, limit: int, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.seconds = seconds
        self._clock = clock
        self._items: collections.OrderedDict[str, tuple[V, float]] = collections.OrderedDict()

    def add(self, key: str, value: V) -> None:
        now = self._clock()
        self._items.pop(key, None)
        self._items[key] = (value, now)
        self._forget(now)

    def get(self, key: str) -> V | None:
        self._forget(self._clock())
        found = self._items.get(key)
        return None if found is None else found[0]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __len__(self) -> int:
        self._forget(self._clock())
        return len(self._items)

    def _forget(self, now: float) -> None:
        items = self._items
        while items and (len(items) > self.limit or now - next(iter(items.values()))[1] > self.seconds):
            items.popitem(last=False)
