"""A hung runner's thread stacks: ask (``SIGUSR1``: faulthandler writes every thread's stack from its C signal
handler) and wait, bounded, for the dump in the runner's output.

Worker side. Even a runner stuck in native code holding the GIL answers; a stopped or dead one cannot, and the
note returned says so instead.
"""

from __future__ import annotations

import signal
import time

import anyio

from tether.node.hangs import (
    STACK_QUIET,
    STACK_SIGNAL_NAME,
    STATE_WORDS,
    process_state,
    stack_dump,
    stack_dump_complete,
)
from tether.node.output import OutputCapture
from tether.node.spawn import RunnerProcess


class StackCollector:
    """Collects one runner's stacks from its output; the output pump calls :meth:`output_arrived` per read."""

    def __init__(self, output: OutputCapture) -> None:
        self.output = output
        self._arrived: anyio.Event | None = None  # set while a collection waits for the dump

    def output_arrived(self) -> None:
        """New output (or the runner's exit): wake a collection waiting for the dump."""
        if self._arrived is not None:
            self._arrived.set()

    async def collect(self, process: RunnerProcess, limit: float, exited: anyio.Event) -> tuple[list[str], str | None]:
        """The runner's thread stacks, waited for at most ``limit`` seconds, and a note when they are missing."""
        state = process_state(process.pid)
        why = f"process state {state}: {STATE_WORDS[state]}" if state in STATE_WORDS else None
        if state in ("T", "t", "Z", None):
            return [], why or "the runner is gone"
        mark = self.output.count
        process.signal(getattr(signal, STACK_SIGNAL_NAME))
        deadline = time.monotonic() + limit
        try:
            while not exited.is_set():
                dump = stack_dump(self.output.since(mark))
                if stack_dump_complete(dump):
                    break
                dumped = bool(dump)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._arrived = anyio.Event()
                with anyio.move_on_after(min(remaining, STACK_QUIET) if dumped else remaining) as scope:
                    await self._arrived.wait()
                if dumped and scope.cancelled_caught:
                    break  # the dump is written in one go: output went quiet after it, so it is complete
        finally:
            self._arrived = None
        stacks = stack_dump(self.output.since(mark))
        if not stacks:
            missing = f"no stacks within {limit:g} s of {STACK_SIGNAL_NAME}"
            why = f"{why}; {missing}" if why else missing
        return stacks, why
