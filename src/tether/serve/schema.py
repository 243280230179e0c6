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

from tether.fleet.fleet import InstanceConfig
from tether.serve.dialects import embeddings, ollama, openai, responses

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
    signal: str | None  # its name: "SIGKILL"
    rank: int | None = None  # the rank that failed, in a multi-rank instance


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None
    cause: CauseOut | None = None  # a runner failure: why
    completion_tokens: int | None = None  # a generation that ended early: tokens it produced first
    host: str | None = None  # a 403 host_not_allowed: the Host refused
    origin: str | None = None  # a 403 origin_not_allowed: the Origin refused


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


# The Responses API (``responses``): the ``response`` object and its stream's typed events


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: dict[str, int]  # ``cached_tokens``, ``cache_write_tokens``: not counted here, 0
    output_tokens: int
    output_tokens_details: dict[str, int]  # ``reasoning_tokens``: 0
    total_tokens: int


class OutputText(msgspec.Struct):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]  # always empty
    logprobs: list[LogprobOut]  # with ``include: ["message.output_text.logprobs"]`` or ``top_logprobs``


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str  # what the ``function_call_output`` item that answers it names
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed"]


OutputItem = OutputMessage | OutputFunctionCall


class ResponseFailure(msgspec.Struct):
    """Why a response failed: tether's error code (a runner failure's cause kind), its message and ``cause``."""

    code: str
    message: str
    cause: CauseOut | None = None
    completion_tokens: int | None = None


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class ResponseObject(msgspec.Struct):
    """A ``response`` (``object: "response"``), never stored; it echoes the request's settings."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: ResponseFailure | None
    incomplete_details: IncompleteDetails | None  # the length limit ended it
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None  # null until it ends
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int | None
    truncation: Literal["disabled"]
    store: bool
    background: bool
    previous_response_id: None
    reasoning: None


class ResponseCreated(msgspec.Struct, tag_field="type", tag="response.created"):
    sequence_number: int
    response: ResponseObject


class ResponseInProgress(msgspec.Struct, tag_field="type", tag="response.in_progress"):
    sequence_number: int
    response: ResponseObject


class ResponseCompleted(msgspec.Struct, tag_field="type", tag="response.completed"):
    sequence_number: int
    response: ResponseObject


class ResponseIncomplete(msgspec.Struct, tag_field="type", tag="response.incomplete"):
    """The length limit ended it (``max_output_tokens``)."""

    sequence_number: int
    response: ResponseObject


class ResponseFailed(msgspec.Struct, tag_field="type", tag="response.failed"):
    """The runner failed (or the request was cancelled) mid-stream: ``response.error`` says why; an ``error``
    event follows and ends the stream."""

    sequence_number: int
    response: ResponseObject


class OutputItemAdded(msgspec.Struct, tag_field="type", tag="response.output_item.added"):
    sequence_number: int
    output_index: int
    item: OutputItem


class OutputItemDone(msgspec.Struct, tag_field="type", tag="response.output_item.done"):
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartAdded(msgspec.Struct, tag_field="type", tag="response.content_part.added"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(msgspec.Struct, tag_field="type", tag="response.content_part.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(msgspec.Struct, tag_field="type", tag="response.output_text.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[LogprobOut]


class OutputTextDone(msgspec.Struct, tag_field="type", tag="response.output_text.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[LogprobOut]


class FunctionCallArgumentsDelta(msgspec.Struct, tag_field="type", tag="response.function_call_arguments.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(msgspec.Struct, tag_field="type", tag="response.function_call_arguments.done"):
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseErrorEvent(msgspec.Struct, tag_field="type", tag="error"):
    """The last event of a failed stream; ``error`` is OpenAI's error object (with the cause), which the openai
    client raises as an ``APIError``."""

    sequence_number: int
    code: str
    message: str
    param: None
    error: ErrorDetail


RESPONSE_EVENTS = (
    ResponseCreated,
    ResponseInProgress,
    OutputItemAdded,
    ContentPartAdded,
    OutputTextDelta,
    OutputTextDone,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemDone,
    ResponseCompleted,
    ResponseIncomplete,
    ResponseFailed,
    ResponseErrorEvent,
)


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
    log: str | None = None  # that life's runner log file (``GET /v1/instances/{id}/log?life=N`` reads it)


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
    life: int | None = None  # the current life (None once stopped or failed)
    backoff_remaining: float | None = None  # seconds until a restarting instance's next life starts
    tokens: int = 0  # completion tokens served so far, streams in flight included
    ranks: list[dict[str, Any]] | None = None  # a multi-rank instance's ranks: rank, address, node, pid, status
    in_flight_requests: list[dict[str, Any]] | None = None  # id, replica, tokens (not in POST's answer)


class NodeOut(msgspec.Struct):
    """This machine as tether measures it: the worker, available memory and where the number comes from, GPUs."""

    pid: int
    version: str
    uptime: float
    memory: dict[str, Any]
    gpus: list[dict[str, Any]] | None
    gpu_reason: str | None


class InstanceList(msgspec.Struct):
    object: Literal["list"]
    data: list[Instance]
    node: NodeOut | None = None
    scheduler: dict[str, Any] | None = None
    cluster: dict[str, Any] | None = None


class RunnerLog(msgspec.Struct):
    """The last lines of one life's runner log."""

    id: str
    life: int
    path: str
    lines: list[str]
    truncated: bool


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


# Ollama's API (``ollama``): JSON objects and NDJSON lines; errors are ``{"error": "<message>"}``


class OllamaErrorBody(msgspec.Struct):
    """Ollama's error shape (the ``ollama`` clients raise ``ResponseError`` with ``error``), with tether's ``code``,
    the invalid field (``param``) and a runner failure's ``cause`` beside the message."""

    error: str
    code: str | None
    param: str | None = None
    cause: CauseOut | None = None
    completion_tokens: int | None = None
    host: str | None = None
    origin: str | None = None


class OllamaFunctionOut(msgspec.Struct):
    index: int
    name: str
    arguments: Any  # an object, matching the tool's parameters (grammar-constrained)


class OllamaToolCallOut(msgspec.Struct):
    id: str
    function: OllamaFunctionOut


class OllamaMessageOut(msgspec.Struct):
    role: Literal["assistant"]
    content: str
    tool_calls: list[OllamaToolCallOut] | None = None


# "load" / "unload": a request without a prompt, answered once its model is loaded (or, with keep_alive 0, unloaded)
OllamaDoneReason = Literal["stop", "length", "load", "unload"]


class OllamaChatChunk(msgspec.Struct):
    model: str
    created_at: str  # RFC 3339
    message: OllamaMessageOut
    done: Literal[False]
    logprobs: list[LogprobOut] | None = None


class OllamaChatDone(msgspec.Struct):
    """The last line of a chat stream, or the whole answer; durations in nanoseconds (absent for "load")."""

    model: str
    created_at: str
    message: OllamaMessageOut
    done: Literal[True]
    done_reason: OllamaDoneReason
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[LogprobOut] | None = None


class OllamaGenerateChunk(msgspec.Struct):
    model: str
    created_at: str
    response: str
    done: Literal[False]
    logprobs: list[LogprobOut] | None = None


class OllamaGenerateDone(msgspec.Struct):
    model: str
    created_at: str
    response: str
    done: Literal[True]
    done_reason: OllamaDoneReason
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[LogprobOut] | None = None


class OllamaEmbedOut(msgspec.Struct):
    model: str
    embeddings: list[list[float]]  # unit length, one per input
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingOut(msgspec.Struct):
    embedding: list[float]  # empty for an empty prompt


class OllamaDetails(msgspec.Struct):
    """From the model's GGUF header; empty strings where there is no model file (the debug engine)."""

    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class OllamaTag(msgspec.Struct):
    name: str
    model: str
    modified_at: str
    size: int  # the model file's
    digest: str  # sha256 of the file's path, size and mtime
    details: OllamaDetails


class OllamaTags(msgspec.Struct):
    models: list[OllamaTag]


class OllamaLoaded(msgspec.Struct):
    name: str
    model: str
    modified_at: str
    size: int  # the runner's footprint plus its resident mapped weights
    digest: str
    details: OllamaDetails
    size_vram: int
    expires_at: str  # far future: an instance stays loaded until it is removed
    context_length: int | None = None


class OllamaPs(msgspec.Struct):
    models: list[OllamaLoaded]


class OllamaShow(msgspec.Struct):
    modelfile: str
    parameters: str
    template: str  # the GGUF's chat template (Jinja, not a Go template)
    license: str
    details: OllamaDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaVersion(msgspec.Struct):
    version: str  # tether's


# --------------------------------------------------------------------------------------------------------------
# The document
# --------------------------------------------------------------------------------------------------------------

_BODIES = (
    openai.ChatRequest,
    openai.CompletionRequest,
    embeddings.EmbeddingRequest,
    responses.ResponsesRequest,
    InstanceConfig,
    ollama.OllamaChatRequest,
    ollama.OllamaGenerateRequest,
    ollama.OllamaEmbedRequest,
    ollama.OllamaEmbeddingsRequest,
    ollama.OllamaShowRequest,
)
_ANSWERS = (
    ErrorBody,
    ResponseObject,
    *RESPONSE_EVENTS,
    ChatCompletion,
    Completion,
    ChatCompletionChunk,
    CompletionChunk,
    ModelList,
    EmbeddingList,
    Instance,
    InstanceList,
    NodeOut,
    RunnerLog,
    Deleted,
    CancelOut,
    Health,
    Readiness,
    OllamaErrorBody,
    OllamaChatChunk,
    OllamaChatDone,
    OllamaGenerateChunk,
    OllamaGenerateDone,
    OllamaEmbedOut,
    OllamaEmbeddingOut,
    OllamaTags,
    OllamaPs,
    OllamaShow,
    OllamaVersion,
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
        403: "refused before any route: a Host this server does not answer to (``host_not_allowed``: DNS "
        "rebinding), a web page of another origin (``origin_not_allowed``), an engine named by module or file path "
        "without --allow-engine-import (``engine_import_disabled``), a log outside the log directory "
        "(``log_outside``)",
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


def _response_events() -> dict[str, Any]:
    """One server-sent event of a Responses stream: its ``event`` name and the typed JSON it carries."""
    names = [struct.__struct_config__.tag for struct in RESPONSE_EVENTS]
    payload = {"anyOf": [_ref(struct) for struct in RESPONSE_EVENTS]}
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
    return {"type": "object", "required": ["event", "data"], "properties": {"event": {"enum": names}, "data": data}}


def _not_stored(what: str) -> dict[str, Any]:
    return {
        "summary": f"{what} a stored response: tether stores none (store is false), so always 404",
        "parameters": _id("response_id"),
        "responses": {"404": _json(ErrorBody, "no such response: tether stores no responses")},
    }


def _id(name: str) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


def _ollama_errors(*statuses: int) -> dict[str, Any]:
    """Ollama's routes answer every error in Ollama's shape, the guard's (401, 403, 413) included."""
    answers = _errors(*statuses)
    for status in statuses:
        answers[str(status)]["content"]["application/json"]["schema"] = _ref(OllamaErrorBody)
    return answers


def _ollama_body(request: type) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(request)}}}


def _ollama_generation(request: type, chunk: type, done: type, summary: str) -> dict[str, Any]:
    lines = {"type": "array", "items": {"anyOf": [_ref(chunk), _ref(done), _ref(OllamaErrorBody)]}}
    return {
        "summary": summary,
        "requestBody": _ollama_body(request),
        "responses": {
            "200": {
                "description": f"the {done.__name__} (``stream: false``) or NDJSON lines (the default): pieces, then "
                "a ``done: true`` line with the counts and durations, or an ``error`` line carrying the cause when the "
                "runner fails",
                "content": {"application/json": {"schema": _ref(done)}, ollama.NDJSON: {"schema": lines}},
            },
            **_ollama_errors(400, 404, 409, 413, 500, 503),
        },
    }


def _ollama_paths() -> dict[str, Any]:
    """Ollama's API: what its clients call, served from the same instances."""
    return {
        "/api/chat": {
            "post": _ollama_generation(ollama.OllamaChatRequest, OllamaChatChunk, OllamaChatDone, "Ollama chat"),
        },
        "/api/generate": {
            "post": _ollama_generation(
                ollama.OllamaGenerateRequest, OllamaGenerateChunk, OllamaGenerateDone, "Ollama completion"
            ),
        },
        "/api/embed": {
            "post": {
                "summary": "Ollama embeddings, one unit-length vector per input",
                "requestBody": _ollama_body(ollama.OllamaEmbedRequest),
                "responses": {
                    "200": _json(OllamaEmbedOut, "the vectors"),
                    **_ollama_errors(400, 404, 409, 413, 500, 503),
                },
            }
        },
        "/api/embeddings": {
            "post": {
                "summary": "Ollama's older embeddings route: one prompt, one vector",
                "requestBody": _ollama_body(ollama.OllamaEmbeddingsRequest),
                "responses": {
                    "200": _json(OllamaEmbeddingOut, "the vector"),
                    **_ollama_errors(400, 404, 409, 413, 500, 503),
                },
            }
        },
        "/api/tags": {"get": {"summary": "the instances, as models", "responses": {"200": _json(OllamaTags, "them")}}},
        "/api/ps": {
            "get": {"summary": "the ready instances, as loaded models", "responses": {"200": _json(OllamaPs, "them")}}
        },
        "/api/show": {
            "post": {
                "summary": "one instance's model: its GGUF metadata, chat template and capabilities",
                "requestBody": _ollama_body(ollama.OllamaShowRequest),
                "responses": {"200": _json(OllamaShow, "the model"), **_ollama_errors(400, 404, 413)},
            }
        },
        "/api/version": {"get": {"summary": "tether's version", "responses": {"200": _json(OllamaVersion, "it")}}},
        "/": {
            "get": {
                "summary": "Ollama's probe; a browser (Accept: text/html) gets the dashboard",
                "responses": {
                    "200": {"description": "it runs", "content": {"text/plain": {"schema": {"type": "string"}}}}
                },
            }
        },
    }


def openapi(*, auth: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the API (``auth``: the server wants a bearer key on every route but probes)."""
    _, components = msgspec.json.schema_components(_BODIES + _ANSWERS, ref_template=REF)
    for name, rules in {**openai.SCHEMA_RULES, **responses.SCHEMA_RULES, **ollama.SCHEMA_RULES}.items():
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
        "/v1/responses": {
            "post": {
                "summary": "OpenAI Responses API, stateless (store false; previous_response_id refused)",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref(responses.ResponsesRequest)}},
                },
                "responses": {
                    "200": {
                        "description": "the response object (``stream: false``) or its typed server-sent events, "
                        "from ``response.created`` to ``response.completed`` (``response.incomplete`` when the length "
                        "limit ended it), or ``response.failed`` and an ``error`` event carrying the cause when the "
                        "runner fails",
                        "content": {
                            "application/json": {"schema": _ref(ResponseObject)},
                            SSE: {"schema": _response_events()},
                        },
                    },
                    **_errors(400, 404, 409, 413, 500, 503),
                },
            }
        },
        "/v1/responses/{response_id}": {"get": _not_stored("retrieve"), "delete": _not_stored("delete")},
        "/v1/responses/{response_id}/cancel": {"post": _not_stored("cancel")},
        "/v1/responses/{response_id}/input_items": {"get": _not_stored("list the input items of")},
        "/v1/models/{model_id}": {
            "get": {
                "summary": "one model served (an instance's id)",
                "parameters": _id("model_id"),
                "responses": {"200": _json(Model, "the model"), **_errors(404)},
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
        "/v1/instances/{instance_id}/log": {
            "get": {
                "summary": "the last lines of a life's runner log (the current life unless ``life`` names another)",
                "parameters": [
                    *_id("instance_id"),
                    {"name": "life", "in": "query", "required": False, "schema": {"type": "integer"}},
                    {
                        "name": "lines",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": 2000, "default": 200},
                    },
                ],
                "responses": {"200": _json(RunnerLog, "its lines"), **_errors(400, 404)},
            }
        },
        "/v1/requests/{request_id}/cancel": {
            "post": {
                "summary": "cancel a generation by its id (the response's ``id`` and ``x-request-id``)",
                "parameters": _id("request_id"),
                "responses": {"200": _json(CancelOut, "what the cancel did")},
            }
        },
        **_ollama_paths(),
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
    for path, item in paths.items():  # the guard's answers, before any route: in the route's own shape
        errors = _ollama_errors if path.startswith("/api/") else _errors
        for operation in item.values():
            operation["responses"].update(errors(403))
            if auth and path not in ("/healthz", "/readyz"):
                operation["security"] = [{"bearer": []}]
                operation["responses"].update(errors(401))
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
