"""One clock for every rule about time: heartbeat and phase deadlines, stop grace, restart backoff, crash-loop
windows, an agent's lease, a coordinator's loss detection.

Code that enforces such a rule reads the time, sleeps and bounds its waits through a ``Clock`` it was given, never
``time.monotonic()`` or ``anyio.sleep`` directly. In production that is ``MONOTONIC`` (``time.monotonic`` and
anyio's own sleeps and cancel scopes, nothing in between). A test gives it a ``SteppedClock`` instead, whose time
moves only when the test steps it, so "declared hung 30 s into a silence" is proven in milliseconds with real
processes on the other side of the pipes (trio's ``MockClock`` does this for a whole event loop; this one covers
only what tether's rules read, so asyncio, Ray and uvicorn keep their real time).

Durations that are reported rather than enforced (how long a load took, a stop's ``seconds``) read the same clock,
so a stepped test sees the stepped figures it caused. The few places that read ``time.monotonic`` directly (the
runner side, the kernel primitives, the campaign, real durations reported over HTTP), each with its reason, are
``MONOTONIC_ALLOWED`` in ``tests/test_layout.py``, which fails on any other.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import anyio
import anyio.lowlevel


class Clock(Protocol):
    """What a rule about time needs: the time, sleeping, and waits bounded by it."""

    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    async def sleep_until(self, deadline: float) -> None: ...

    def move_on_after(self, seconds: float) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """A cancel scope that ends its block quietly ``seconds`` from now (``cancelled_caught`` says it did)."""
        ...

    def fail_after(self, seconds: float) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """As ``move_on_after``, but raises ``TimeoutError`` when the time is up."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` (asyncio's loop time on Linux) and anyio's own timeouts."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)

    async def sleep_until(self, deadline: float) -> None:
        await anyio.sleep(max(deadline - time.monotonic(), 0.0))

    def move_on_after(self, seconds: float) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        return anyio.move_on_after(seconds)

    def fail_after(self, seconds: float) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        return anyio.fail_after(seconds)


MONOTONIC: Clock = MonotonicClock()


class SteppedClock:
    """A clock whose time moves only when ``advance`` (or ``jump``) moves it: for tests of rules about time.

    Sleepers and scopes wait on timers; stepping the clock fires every timer that has come due, in deadline order.
    ``next_deadline`` waits until something sleeps on the clock, so a test steps only once the code under test is
    really waiting (no real sleep to let it get there). Single event loop only: step it from that loop's thread.
    """

    def __init__(self, start: float = 1_000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._armed: anyio.Event | None = None
        self._run_out = False

    def now(self) -> float:
        return self._now

    # --- stepping (the test's side) -----------------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move time forward and fire what came due (a sleeper wakes at its next checkpoint)."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock does not go back ({seconds:g} s)")
        self._now += seconds
        while self._timers and self._timers[0][0] <= self._now:
            _, ident, fire = heapq.heappop(self._timers)
            if ident in self._live:
                self._live.discard(ident)
                fire()

    def run_out(self) -> None:
        """From now on every wait on this clock ends at once, as if all the time in the world had passed.

        For unwinding a test that failed midway: the code's own cleanup (a supervisor's stop sequence, say) is
        bounded on this clock, and would otherwise wait for a step that never comes.
        """
        self._run_out = True
        due, self._timers = self._timers, []
        for _, ident, fire in sorted(due):
            if ident in self._live:
                self._live.discard(ident)
                fire()

    @contextlib.contextmanager
    def runs_out_on_error(self) -> Iterator[None]:
        """Around a test's body, inside the blocks that clean up: on any exception, ``run_out`` before they do."""
        try:
            yield
        except BaseException:
            self.run_out()
            raise

    @property
    def pending(self) -> list[float]:
        """The deadlines something waits for now, earliest first."""
        return sorted(at for at, ident, _ in self._timers if ident in self._live)

    async def next_deadline(self, after: float | None = None) -> float:
        """The earliest deadline something waits for (later than ``after``, if given), once there is one."""
        while True:
            due = [at for at in self.pending if after is None or at > after]
            if due:
                return due[0]
            self._armed = anyio.Event()
            await self._armed.wait()

    async def jump(self, after: float | None = None) -> float:
        """Advance to the next deadline anything waits for (see ``next_deadline``) and return the new time."""
        deadline = await self.next_deadline(after)
        self.advance(max(deadline - self._now, 0.0))
        return self._now

    # --- waiting (the code's side) -------------------------------------------------------------------------------

    def _at(self, deadline: float, fire: Callable[[], None]) -> int | None:
        if self._run_out:
            fire()
            return None
        ident = next(self._ids)
        self._live.add(ident)
        heapq.heappush(self._timers, (deadline, ident, fire))
        if self._armed is not None:
            self._armed.set()
            self._armed = None
        return ident

    async def sleep(self, seconds: float) -> None:
        await self.sleep_until(self._now + seconds)

    async def sleep_until(self, deadline: float) -> None:
        if deadline <= self._now:
            await anyio.lowlevel.checkpoint()
            return
        woken = anyio.Event()
        ident = self._at(deadline, woken.set)
        try:
            await woken.wait()
        finally:
            if ident is not None:
                self._live.discard(ident)

    @contextlib.contextmanager
    def move_on_after(self, seconds: float) -> Iterator[anyio.CancelScope]:
        with anyio.CancelScope() as scope:
            if seconds <= 0:
                scope.cancel()
                yield scope
                return
            ident = self._at(self._now + seconds, scope.cancel) if math.isfinite(seconds) else None
            try:
                yield scope
            finally:
                if ident is not None:
                    self._live.discard(ident)

    @contextlib.contextmanager
    def fail_after(self, seconds: float) -> Iterator[anyio.CancelScope]:
        with self.move_on_after(seconds) as scope:
            yield scope
        if scope.cancelled_caught:
            raise TimeoutError
