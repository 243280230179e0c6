"""How many threads a llama.cpp step uses on a machine it may share: all it was given while they get their cores,
one while something else holds them (runner side, driven by the batch's step thread).

ggml's threads meet at a barrier after each of a step's operations: when another process takes a core, the threads
that arrived spin (libgomp spins for milliseconds) waiting for the preempted one, and a step takes many times
longer. OpenMP's passive wait avoids that but costs an idle machine too much. So the governor watches the sign of
contention, its threads' run delay while a step runs (``run_delay_ns``: time runnable but not running), steps down to
one thread past ``CONTENDED`` of the step time in ``PATIENCE`` windows in a row, and tries all again after a back-off
(``BACKOFF``). Changing the thread count between steps is free and changes no result (a row's arithmetic does not
depend on how many threads share it). Where ``schedstat`` cannot be read, it does nothing. The figures:
docs/serving.md, "A shared machine does not collapse the decode".
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

WINDOW = 0.25
"""Seconds of stepping between two looks at the threads' run delay."""

GAP = 0.05
"""Seconds between two decodes that start a new window (what happened between them is not the steps')."""

CONTENDED = 0.3
"""Run delay per thread over step time above which the step's threads are fighting for cores (beside a busy-looping
process per core it was 50-60%; beside the HTTP worker and a benchmark's client alone, about 10-20%)."""

PATIENCE = 2
"""Contended windows in a row before stepping down: one window's spike (a burst of the worker's own work) is not
another process holding a core."""

BACKOFF = (5.0, 80.0)
"""Seconds on one thread before trying all again: the first back-off, and the longest it doubles to."""


def run_delay_ns() -> int | None:
    """The summed run delay (ns runnable but waiting for a CPU) of this process's threads; None when unreadable."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total


class ThreadGovernor:
    """Chooses each step's thread count (see the module docstring); ``after(seconds)`` follows every decode."""

    def __init__(self, lib: Any, ctx: Any, n_threads: int, *, adaptive: bool = True) -> None:
        self.lib = lib
        self.ctx = ctx
        self.most = n_threads
        self.current = n_threads
        self.enabled = adaptive and n_threads > 1 and run_delay_ns() is not None
        self._stepped = 0.0  # seconds of decode since the window began
        self._delay = 0  # the threads' run delay when it began
        self._last = 0.0  # monotonic end of the last decode
        self._backoff = BACKOFF[0]
        self._retry_at = 0.0  # monotonic time to try all threads again (while on one)
        self._contended = 0  # contended windows in a row
        self.switches = 0  # for tests and the log

    def before(self) -> None:
        """Before a decode: a window begins at the first decode after a look, or after a pause between decodes
        (idle between requests, the runner's own work), so only the steps' own time is weighed."""
        if not self.enabled:
            return
        if self._stepped == 0.0 or time.monotonic() - self._last > GAP:
            self._delay, self._stepped = run_delay_ns() or 0, 0.0

    def after(self, seconds: float) -> None:
        """Account one decode of ``seconds``; every :data:`WINDOW` of decoding, look and maybe switch."""
        if not self.enabled:
            return
        self._last = time.monotonic()
        self._stepped += seconds
        if self._stepped < WINDOW:
            return
        delay = run_delay_ns()
        if delay is None:
            self.enabled = False
            return
        share = (delay - self._delay) / 1e9 / (self._stepped * self.current)
        self._delay, self._stepped = delay, 0.0
        now = time.monotonic()
        self._contended = self._contended + 1 if share > CONTENDED else 0
        if self.current > 1 and self._contended >= PATIENCE:
            self._set(1)
            self._retry_at = now + self._backoff
            log.info(
                "threads waited %.0f%% of the step time for a CPU (another process holds cores): 1 thread for %.0f s",
                share * 100,
                self._backoff,
            )
            self._backoff = min(self._backoff * 2, BACKOFF[1])
        elif self.current == 1 and now >= self._retry_at:
            self._set(self.most)
        elif self.current > 1 and share < CONTENDED / 2:
            self._backoff = BACKOFF[0]  # all threads ran uncontended for a window: the next back-off starts short

    def _set(self, n: int) -> None:
        self.lib.llama_set_n_threads(self.ctx, n, n)
        self.current = n
        self.switches += 1
