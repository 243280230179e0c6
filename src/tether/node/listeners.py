"""Listeners told of every change, synchronously and in order (a supervisor's status, an instance's state, a
fleet's new instances): one that raises is logged and never stops the others or the code that changed state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("tether.listeners")


class Listeners(Generic[T]):
    def __init__(self, what: str) -> None:
        self.what = what  # for the log line of a listener that fails: "status", "instance state", ...
        self._callbacks: list[Callable[[T], None]] = []

    def add(self, callback: Callable[[T], None]) -> None:
        self._callbacks.append(callback)

    def __call__(self, value: T) -> None:
        for callback in self._callbacks:
            try:
                callback(value)
            except Exception:
                log.exception("%s listener %r failed", self.what, callback)
