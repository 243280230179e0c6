"""The task table's parts a caller holds: a task's handle (its events, ending with exactly one terminal status), what
a cancel did, how a stop ended, and the errors of a runner that cannot take tasks.

Worker side. The supervisor owns the table; a handle is the caller's end of one task's event stream.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import Literal

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from tether.errors import TetherError
from tether.protocol import Cause, Chunk, ErrorChunk, Task, TaskAcknowledged, TaskState, TaskStatus

TaskEvent = TaskAcknowledged | TaskStatus | Chunk | ErrorChunk


class RunnerUnavailable(TetherError):
    """The runner cannot take tasks (not started, stopping, or gone); ``cause`` says why when it failed."""

    def __init__(self, message: str, cause: Cause | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class TaskFailed(TetherError):
    """A task awaited through a convenience method (load, warmup) did not complete."""

    def __init__(self, status: TaskStatus) -> None:
        detail = status.cause.render() if status.cause else (status.error or status.state.value)
        super().__init__(f"task {status.task_id} {status.state.value}: {detail}")
        self.status = status


@dataclass
class InFlight:
    task: Task
    send: MemoryObjectSendStream[TaskEvent]
    tokens: int = 0
    started: bool = False  # the runner said RUNNING: a generation in its batch, no longer waiting for a slot


class TaskHandle:
    """The events of one submitted task, ending with exactly one terminal ``TaskStatus``.

    Iterating may stop and resume (``break``, then ``wait()``): the handle, not the loop, owns the stream.
    """

    def __init__(self, task_id: str, kind: str, receive: MemoryObjectReceiveStream[TaskEvent]) -> None:
        self.task_id = task_id
        self.kind = kind
        self._receive = receive
        self.final: TaskStatus | None = None

    def __aiter__(self) -> TaskHandle:
        return self

    async def __anext__(self) -> TaskEvent:
        if self.final is not None:
            raise StopAsyncIteration
        try:
            event = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None
        if isinstance(event, TaskStatus) and event.state.terminal:
            self.final = event
            self._receive.close()
        return event

    def ready_now(self) -> list[TaskEvent]:
        """The events already delivered, without waiting (up to the terminal status): how a relay batches them."""
        events: list[TaskEvent] = []
        while self.final is None:
            try:
                event = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if isinstance(event, TaskStatus) and event.state.terminal:
                self.final = event
                self._receive.close()
            events.append(event)
        return events

    async def wait(self) -> TaskStatus:
        """Consume the remaining events and return the terminal status."""
        async for _ in self:
            pass
        assert self.final is not None, "a task stream ended without a terminal status"
        return self.final

    async def text(self) -> tuple[str, TaskStatus]:
        """Consume a generation: the text of its remaining chunks and its terminal status."""
        parts = [event.text async for event in self if isinstance(event, Chunk)]
        assert self.final is not None
        return "".join(parts), self.final

    def close(self) -> None:
        """Stop receiving this task's events (they are dropped); the task itself runs on unless cancelled."""
        self._receive.close()


@dataclass(frozen=True)
class CancelReply:
    """What a cancel did: ``requested`` (the task ends CANCELLED within one token), ``finished`` (it had already
    ended, in ``state``), ``unknown`` (no such task) or ``runner_gone`` (the task ends with the runner's cause)."""

    task_id: str
    outcome: Literal["requested", "finished", "unknown", "runner_gone"]
    detail: str
    state: TaskState | None = None


@dataclass
class StopReport:
    """How a requested stop ended: cleanly, or by escalation (and after how long)."""

    clean: bool
    escalated_to: str | None
    seconds: float


def deliver(record: InFlight, event: TaskEvent) -> None:
    """Hand an event to its task's stream; a consumer that closed its handle must not break routing."""
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        record.send.send_nowait(event)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
