"""One table from what went wrong to what the client is told: HTTP status, error type, code, ``param`` and
``Retry-After``, for tether's typed errors and for a generation that did not complete, in every dialect's shape.

Every route answers an error through here (the app's one exception handler, the guard's refusals, the generation
response's failures), so ``/api/chat`` and ``/v1/chat/completions`` can never disagree about what a runner's death
or a full queue is: only the body's shape differs (Ollama's ``{"error": "..."}`` under ``/api/``, OpenAI's
``{"error": {...}}`` elsewhere).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.responses import Response
from msgspec import UNSET

from tether.errors import (
    BodyTooLarge,
    EngineImportRefused,
    InstanceExists,
    InvalidField,
    NotFound,
    TetherError,
)
from tether.fleet.fleet import Unavailable
from tether.node.fit import DoesNotFit
from tether.protocol import TaskState, TaskStatus
from tether.serve.views import ErrorBody, ErrorDetail, OllamaErrorBody, cause_out, encode

Shape = Literal["openai", "ollama"]
ENGINE_REFUSED = "engine_refused"  # a 400 the engine gave (its limits: context length, schema features, ...)
NOSNIFF = {"X-Content-Type-Options": "nosniff"}


# What each error status means, wherever it is answered (the OpenAPI document describes every error answer so).
WHEN = {
    400: "a field is invalid (``param`` names it) or the engine refused the request",
    401: "missing or wrong API key",
    403: "refused before any route: a Host this server does not answer to (``host_not_allowed``: DNS rebinding), a "
    "web page of another origin (``origin_not_allowed``), an engine named by module or file path without "
    "--allow-engine-import (``engine_import_disabled``), a log outside the log directory (``log_outside``)",
    404: "no such instance, model or route",
    409: "the request was cancelled (by the cancel route), or the instance id is taken",
    413: "the body is over --max-body",
    500: "the model runner failed: ``cause`` says why, with evidence",
    503: "the instance cannot take requests now (loading, restarting, queue full, the server stopping): when to retry",
    507: "the model does not fit the memory available (the numbers are in the message)",
}


def shape_of(path: str) -> Shape:
    """Ollama's routes live under ``/api/``; every other route speaks OpenAI's shape."""
    return "ollama" if path.startswith("/api/") else "openai"


@dataclass(frozen=True)
class Answer:
    """An error as the client gets it: ``status`` (before a stream starts), OpenAI-style ``type`` and ``code``, a
    message that says what happened and why, the field at fault (``param``), when a retry can help
    (``retry_after`` seconds), and extra fields (a runner's ``cause`` with its evidence, ``completion_tokens``
    produced before the end, a cluster's per-node ``nodes`` verdicts, the refused ``host`` or ``origin``)."""

    status: int
    type: str
    code: str | None
    message: str
    param: str | None = None
    retry_after: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    outcome: str = "failed"  # a generation's, for the request metrics

    def body(self, shape: Shape) -> bytes:
        if shape == "ollama":
            param = self.param if self.param is not None else UNSET
            return encode(OllamaErrorBody(error=self.message, code=self.code, param=param, **self.extra))
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code, **self.extra)
        return encode(ErrorBody(error=detail))

    def headers(self) -> dict[str, str] | None:
        if self.retry_after is None:
            return None
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def response(self, path: str, headers: dict[str, str] | None = None) -> Response:
        """The whole answer, shaped for the route at ``path``."""
        merged = {**(self.headers() or {}), **(headers or {})} or None
        return Response(self.body(shape_of(path)), self.status, headers=merged, media_type="application/json")


class GenerationFailed(TetherError):
    """A request that did not complete (an embedding's runner failed, say): its ``Answer``, for any dialect."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.message)
        self.answer = answer


def failure_of(final: TaskStatus, request_error: str | None, completion_tokens: int) -> Answer:
    """The answer for a task's terminal status that is not COMPLETE (``request_error``: the engine's refusal)."""
    extra: dict[str, Any] = {"completion_tokens": completion_tokens}
    if final.state is TaskState.CANCELLED:
        message = f"the request was cancelled: {final.error or 'cancelled'}"
        return Answer(409, "cancelled", "cancelled", message, extra=extra, outcome="cancelled")
    if final.cause is not None:  # the runner failed: say why, with the evidence
        extra["cause"] = cause_out(final.cause)
        message = f"the model runner failed: {final.cause.summary}"
        return Answer(500, "server_error", final.cause.kind.value, message, extra=extra)
    message = request_error or final.error or "refused"  # the engine refused it: the prompt, its schema, ...
    return Answer(400, "invalid_request_error", ENGINE_REFUSED, message, extra=extra, outcome="bad_request")


def _unavailable(exc: Unavailable) -> Answer:
    extra = {"cause": cause_out(exc.cause)} if exc.cause is not None else {}
    return Answer(503, "server_error", "unavailable", str(exc), retry_after=exc.retry_after, extra=extra)


def _does_not_fit(exc: DoesNotFit) -> Answer:
    extra = {"nodes": list(exc.result.nodes)} if exc.result.nodes else {}
    return Answer(507, "insufficient_memory", "does_not_fit", str(exc), extra=extra)


# The table: the first entry whose type the error is an instance of answers it (so subclasses come first).
TABLE: tuple[tuple[type[Exception], Callable[[Any], Answer]], ...] = (
    (GenerationFailed, lambda exc: exc.answer),
    (InvalidField, lambda exc: Answer(400, "invalid_request_error", "invalid_request", str(exc), exc.field)),
    (InstanceExists, lambda exc: Answer(409, "invalid_request_error", "instance_exists", str(exc), "id")),
    (DoesNotFit, _does_not_fit),
    (NotFound, lambda exc: Answer(404, "invalid_request_error", "not_found", str(exc))),
    (Unavailable, _unavailable),
    (EngineImportRefused, lambda exc: Answer(403, "permission_error", "engine_import_disabled", str(exc), exc.field)),
    (BodyTooLarge, lambda exc: Answer(413, "invalid_request_error", "request_too_large", str(exc))),
)


def answer_for(exc: Exception) -> Answer | None:
    """What the client is told about ``exc`` (None: not an error the API expects; the app answers it as a 500)."""
    for kind, make in TABLE:
        if isinstance(exc, kind):
            return make(exc)
    return None


def refused(path: str, status: int, message: str, type_: str, code: str, **extra: Any) -> Response:
    """A refusal before any route (the guard's, the body limit's), shaped for the route at ``path``. The body may
    echo a Host or an Origin a page chose: never let a browser sniff it as anything but JSON."""
    param = extra.pop("param", None)
    return Answer(status, type_, code, message, param, extra=extra).response(path, NOSNIFF)


def too_large(path: str, exc: BodyTooLarge) -> Response:
    """The body limit's answer (before any route, or while a route reads its body)."""
    return Answer(413, "invalid_request_error", "request_too_large", str(exc)).response(path, NOSNIFF)
