"""The OpenAPI document served at ``/openapi.json``: every route, its request body and every answer it can give.

Request bodies come from the very structs the API decodes with (``openai.ChatRequest``, ``openai.CompletionRequest``,
``fleet.InstanceConfig``), so the schema cannot drift from the decoder; responses are described by the structs
below, which the handlers' dicts must match. Both halves are checked against a live server by the API fuzzer
(``bench/fuzz.py``, ``tests/test_fuzz.py``): schema-valid bodies must be served, invalid ones refused with a 4xx,
and every response must match what is written here.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tether.serve import embeddings, openai
from tether.serve.fleet import InstanceConfig

REF = "#/components/schemas/{name}"

# --------------------------------------------------------------------------------------------------------------
# Responses (descriptions only: the handlers build these as dicts)
# --------------------------------------------------------------------------------------------------------------


class CauseOut(msgspec.Struct):
    """Why a runner failed, with its evidence (the same object in errors, instances and their history)."""

    kind: str
    summary: str
    evidence: list[str]
    phase: str | None
    exit_code: int | None
    signal: int | None


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None
    cause: CauseOut | None = None  # a runner failure: why
    completion_tokens: int | None = None  # a generation that ended early: tokens it produced first


class ErrorBody(msgspec.Struct):
    """OpenAI's error shape."""

    error: ErrorDetail


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float | None  # null only where the log-probability is -inf
    bytes: list[int]


class LogprobOut(msgspec.Struct):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(msgspec.Struct):
    """``logprobs: true``: each generated token's log-probability under the model, and the ``top_logprobs`` most
    likely tokens at its position."""

    content: list[LogprobOut]
    refusal: None


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions API's logprobs (``logprobs: n``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None]]
    text_offset: list[int]


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ToolCallDelta(msgspec.Struct):
    index: int
    id: str
    type: Literal["function"]
    function: FunctionCallOut


FinishReason = Literal["stop", "length", "tool_calls"]


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None  # null when the answer is tool calls
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class ChatDelta(msgspec.Struct):
    role: Literal["assistant"] | None = None  # in the first chunk
    content: str | None = None  # absent in the chunk that carries the finish reason
    tool_calls: list[ToolCallDelta] | None = None  # a tool answer: every call, whole, in one chunk


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]  # empty in the usage chunk (``stream_options.include_usage``)
    usage: Usage | None = None


class TextChunkChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None


class CompletionChunk(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChunkChoice]
    usage: Usage | None = None


class EmbeddingOut(msgspec.Struct):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # ``encoding_format: base64``: little-endian float32, base64


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    """One unit-length vector per input, in order."""

    object: Literal["list"]
    data: list[EmbeddingOut]
    model: str
    usage: EmbeddingUsage


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[Model]


class Queue(msgspec.Struct):
    """Generations admitted: ``running`` in the runner's batch (at most ``parallel``) plus ``waiting`` for a slot
    (at most ``max_queue``); ``in_flight`` is their sum, ``limit`` its bound (beyond it: 503 with Retry-After)."""

    running: int
    waiting: int
    in_flight: int
    parallel: int
    max_queue: int
    limit: int


class Failure(msgspec.Struct):
    at: float
    life: int
    pid: int | None
    detected_in: float | None
    cause: CauseOut


class Instance(msgspec.Struct):
    """One instance: its state, its runner (pid, memory, log, cgroup) and every failure of its past lives."""

    id: str
    object: Literal["instance"]
    created: int
    engine: str
    model: str | None
    options: dict[str, Any]
    state: str
    detail: dict[str, Any]
    reason: str | None
    ready: bool
    runner: dict[str, Any] | None
    pids: list[int]
    restarts: int
    failures: dict[str, int]  # every failed life by cause kind (``history`` keeps the latest 64)
    queue: Queue
    cause: CauseOut | None
    history: list[Failure]
    fit: str | None
    measured: str | None
    restart: dict[str, Any]
    deadlines: dict[str, Any]


class InstanceList(msgspec.Struct):
    object: Literal["list"]
    data: list[Instance]


class Deleted(msgspec.Struct):
    id: str
    object: Literal["instance"]
    deleted: bool
    state: str


class CancelOut(msgspec.Struct):
    id: str
    outcome: Literal["requested", "finished", "unknown", "runner_gone"]
    detail: str
    state: str | None


class Health(msgspec.Struct):
    status: Literal["ok"]


class Readiness(msgspec.Struct):
    ready: bool
    instances: dict[str, str]


# --------------------------------------------------------------------------------------------------------------
# The document
# --------------------------------------------------------------------------------------------------------------

_BODIES = (openai.ChatRequest, openai.CompletionRequest, embeddings.EmbeddingRequest, InstanceConfig)
_ANSWERS = (
    ErrorBody,
    ChatCompletion,
    Completion,
    ChatCompletionChunk,
    CompletionChunk,
    ModelList,
    EmbeddingList,
    Instance,
    InstanceList,
    Deleted,
    CancelOut,
    Health,
    Readiness,
)
SSE = "text/event-stream"


def _ref(struct: type) -> dict[str, str]:
    return {"$ref": REF.format(name=struct.__name__)}


def _json(struct: type, description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    answer: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": _ref(struct)}}}
    if headers:
        answer["headers"] = headers
    return answer


RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds until the instance can take the request (absent when retrying cannot help)",
        "schema": {"type": "integer", "minimum": 1},
    }
}


def _errors(*statuses: int) -> dict[str, Any]:
    what = {
        400: "a field is invalid (``param`` names it) or the engine refused the request",
        401: "missing or wrong API key",
        404: "no such instance, model or route",
        409: "the request was cancelled (by the cancel route), or the instance id is taken",
        413: "the body is over --max-body",
        500: "the model runner failed: ``cause`` says why, with evidence",
        503: "the instance cannot take requests now (loading, restarting, queue full): when to retry",
        507: "the model does not fit the memory available (the numbers are in the message)",
    }
    answers = {}
    for status in statuses:
        answers[str(status)] = _json(ErrorBody, what[status], RETRY_AFTER if status == 503 else None)
    return answers


def _events(chunk: type) -> dict[str, Any]:
    """One server-sent event of a stream: a chunk, the error that ends a failed stream, or ``[DONE]``."""
    payload = {"anyOf": [_ref(chunk), _ref(ErrorBody)]}
    data = {"anyOf": [{"const": "[DONE]"}, {"contentMediaType": "application/json", "contentSchema": payload}]}
    return {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", **data}}}


def _generation(request: type, whole: type, chunk: type, summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {
                "description": f"the {whole.__name__} (``stream: false``) or its chunks as server-sent events, which "
                "end with ``data: [DONE]``, or with an error event carrying the cause when the runner fails",
                "content": {"application/json": {"schema": _ref(whole)}, SSE: {"schema": _events(chunk)}},
            },
            **_errors(400, 404, 409, 413, 500, 503),
        },
    }


def _id(name: str) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


def openapi(*, auth: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the API (``auth``: the server wants a bearer key on every route but probes)."""
    _, components = msgspec.json.schema_components(_BODIES + _ANSWERS, ref_template=REF)
    for name, rules in openai.SCHEMA_RULES.items():
        components[name].update(rules)
    paths: dict[str, Any] = {
        "/v1/chat/completions": {
            "post": _generation(openai.ChatRequest, ChatCompletion, ChatCompletionChunk, "OpenAI chat completion"),
        },
        "/v1/completions": {
            "post": _generation(
                openai.CompletionRequest, Completion, CompletionChunk, "OpenAI (legacy) text completion"
            ),
        },
        "/v1/embeddings": {
            "post": {
                "summary": "OpenAI embeddings, from an instance started with the llama.cpp option embedding: true",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref(embeddings.EmbeddingRequest)}},
                },
                "responses": {
                    "200": _json(EmbeddingList, "the vectors"),
                    **_errors(400, 404, 409, 413, 500, 503),
                },
            }
        },
        "/v1/models": {
            "get": {"summary": "the models served", "responses": {"200": _json(ModelList, "the instances' ids")}}
        },
        "/v1/instances": {
            "get": {"summary": "every instance", "responses": {"200": _json(InstanceList, "the instances")}},
            "post": {
                "summary": "start an instance (it loads in the background)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(InstanceConfig)}}},
                "responses": {
                    "201": _json(Instance, "created; loading"),
                    **_errors(400, 409, 413, 507),
                },
            },
        },
        "/v1/instances/{instance_id}": {
            "get": {
                "summary": "one instance, its runner's memory sampled now",
                "parameters": _id("instance_id"),
                "responses": {"200": _json(Instance, "the instance"), **_errors(404)},
            },
            "delete": {
                "summary": "stop an instance (its requests end cancelled) and remove it",
                "parameters": _id("instance_id"),
                "responses": {"200": _json(Deleted, "stopped and removed"), **_errors(404)},
            },
        },
        "/v1/requests/{request_id}/cancel": {
            "post": {
                "summary": "cancel a generation by its id (the response's ``id`` and ``x-request-id``)",
                "parameters": _id("request_id"),
                "responses": {"200": _json(CancelOut, "what the cancel did")},
            }
        },
        "/healthz": {"get": {"summary": "liveness", "responses": {"200": _json(Health, "the worker answers")}}},
        "/readyz": {
            "get": {
                "summary": "readiness: 200 when an instance is ready",
                "responses": {
                    "200": _json(Readiness, "an instance is ready"),
                    "503": _json(Readiness, "no instance is ready"),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {"description": "text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "this document",
                "responses": {
                    "200": {
                        "description": "OpenAPI 3.1",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
    }
    if auth:
        for path, item in paths.items():
            if path in ("/healthz", "/readyz"):
                continue
            for operation in item.values():
                operation["security"] = [{"bearer": []}]
                operation["responses"].update(_errors(401))
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "tether", "version": _version(), "description": "A supervised inference worker's API."},
        "paths": paths,
        "components": {"schemas": components},
    }
    if auth:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tether")
    except PackageNotFoundError:
        return "0"
