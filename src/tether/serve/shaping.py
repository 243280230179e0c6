"""What an API dialect makes of one generation: the contract between the generation response and each wire format.

``app.GenerationResponse`` owns the promises (exactly one outcome per request; the status waits for the first
token; a failure mid-stream ends the stream with an error that carries the cause, never with a success marker; a
client that leaves cancels). A ``Shaper`` owns only the bytes: OpenAI's chat and completion objects and SSE chunks
(``openai``), the Responses API's events (``responses``), Ollama's NDJSON (``ollama``). Every dialect gets every
chunk, so logprobs, tool calls and usage are the dialect's to render, and the way a failure is told is shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tether.protocol import Cause, Chunk, TaskState, TaskStatus


def cause_json(cause: Cause) -> dict[str, Any]:
    return {
        "kind": cause.kind.value,
        "summary": cause.summary,
        "evidence": list(cause.evidence),
        "phase": cause.phase,
        "exit_code": cause.exit_code,
        "signal": cause.signal,
        "rank": cause.rank,
    }


ENGINE_REFUSED = "engine_refused"  # a 400 the engine gave (its limits: context length, schema features, ...)


@dataclass(frozen=True)
class Failure:
    """A generation that did not complete, told the same way in every dialect: its HTTP status (before a stream
    starts), OpenAI-style error type and code, a message that says what happened and why, and extra fields (the
    runner's ``cause`` with its evidence; ``completion_tokens`` produced before the end)."""

    status: int
    type: str
    code: str
    message: str
    extra: dict[str, Any] = field(default_factory=dict)
    outcome: str = "failed"  # for the request metrics


def failure_of(final: TaskStatus, request_error: str | None, completion_tokens: int) -> Failure:
    """The ``Failure`` for a task's terminal status that is not COMPLETE (``request_error``: the engine's refusal)."""
    extra: dict[str, Any] = {"completion_tokens": completion_tokens}
    if final.state is TaskState.CANCELLED:
        message = f"the request was cancelled: {final.error or 'cancelled'}"
        return Failure(409, "cancelled", "cancelled", message, extra, "cancelled")
    if final.cause is not None:  # the runner failed: say why, with the evidence
        extra["cause"] = cause_json(final.cause)
        message = f"the model runner failed: {final.cause.summary}"
        return Failure(500, "server_error", final.cause.kind.value, message, extra, "failed")
    message = request_error or final.error or "refused"  # the engine refused it: the prompt, its schema, ...
    return Failure(400, "invalid_request_error", ENGINE_REFUSED, message, extra, "bad_request")


class Shaper(Protocol):
    """One request's response in one dialect. ``feed`` sees every chunk in order (streamed or not: the shaper keeps
    what its whole answer needs) and returns the bytes to stream now; ``opening`` is sent once the status is
    decided (the first chunk, or the end); ``closing`` ends a complete stream, ``whole`` is a complete non-streamed
    body; ``stream_error`` ends a failed stream and ``error_body`` is a failed request's body."""

    media_type: str  # of a stream
    load_seconds: float  # how long the request waited for its model to load (the API sets it)

    def opening(self) -> bytes: ...

    def feed(self, chunk: Chunk) -> bytes: ...

    def closing(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes: ...

    def whole(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes: ...

    def stream_error(self, failure: Failure) -> bytes: ...

    def error_body(self, failure: Failure) -> bytes: ...
