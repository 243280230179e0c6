"""The route table's entry, and the pieces of OpenAPI a route describes its answers with.

Each route module (``admin``, every dialect, ``dashboard``) returns its ``Route``s; ``app`` registers exactly those
with FastAPI, and ``schema`` writes exactly those into ``/openapi.json``, so a route cannot be served undocumented
or documented unserved. A route states its success answers; its error answers come from ``statuses`` (by the
statuses it lists, in its path's shape), and the guard's (401, 403, 413) are added to every route by ``schema``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi.responses import Response

REF = "#/components/schemas/{name}"
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
GENERATION_ERRORS = (400, 404, 409, 413, 500, 503)  # what admitting and running a generation can answer
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, kw_only=True)
class Route:
    """One HTTP route: what serves it and what ``/openapi.json`` says of it. Built by keyword: its path, summary,
    answers, errors and body are strings, dicts and tuples that positions would let swap unseen."""

    path: str
    method: str  # GET, POST, DELETE (a GET also answers HEAD when ``head``)
    endpoint: Callable[..., Awaitable[Response]]
    summary: str
    answers: dict[str, Any]  # status -> OpenAPI response object: the successes (and documented non-errors)
    errors: tuple[int, ...] = ()  # the error statuses it can answer (``statuses.WHEN`` describes each)
    body: type | None = None  # the struct its JSON body decodes into
    parameters: tuple[dict[str, Any], ...] = ()
    head: bool = False
    documented: bool = True  # False: served, kept out of the document (the dashboard's assets)
    notes: dict[str, Any] = field(default_factory=dict)  # more of the OpenAPI operation object


def ref(struct: type) -> dict[str, str]:
    return {"$ref": REF.format(name=struct.__name__)}


def json_answer(struct: type, description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON response whose body is ``struct``."""
    answer: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": ref(struct)}}}
    if headers:
        answer["headers"] = headers
    return answer


def text_answer(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}


def path_parameter(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def sse_of(payload: dict[str, Any], done: bool = True) -> dict[str, Any]:
    """One server-sent event whose data is JSON matching ``payload`` (or ``[DONE]``, when the stream ends so)."""
    data: dict[str, Any] = {"contentMediaType": "application/json", "contentSchema": payload}
    if done:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    return {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", **data}}}


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A view struct (``tether.serve.views``) as a JSON response."""
    return Response(_encode(obj), status_code=status, media_type="application/json", headers=headers)
