"""Ollama's API beside OpenAI's: the routes Open WebUI, Continue and the ``ollama`` clients call, on the same fleet.

``/api/chat`` and ``/api/generate`` become the same ``Plan`` an OpenAI request does and are answered through
``Api.respond``, so every promise holds here too (one outcome per request, the status decided by the first token,
a runner failure mid-stream ends the stream with an ``{"error": ...}`` line carrying the cause, never with a
``done: true`` line); only the bytes are Ollama's (NDJSON, one object a line, streaming by default). Errors are
Ollama's shape, ``{"error": "<message>"}``, with tether's ``code``, ``param`` and ``cause`` beside the message.

Every field is honoured or refused, as on the OpenAI side (``fields``). The choices Ollama's semantics force:

* Absent sampling options take Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9, min_p 0, ``num_predict``
  -1: until the model stops or its context is full), except ``repeat_penalty``, which stays the instance's option
  (1.0: Ollama's 1.1 derails small models). ``seed: -1`` is Ollama's "random".
* Load-time options (``num_ctx``, ``num_gpu``, ``num_thread``, ...) are refused, naming the instance option to set
  instead: Ollama loads a model per request's options, tether serves instances started ahead (``POST
  /v1/instances``). ``keep_alive`` is the scheduler's (``tether.fleet.scheduler``): how long the model stays
  loaded once idle, 0 to unload it after this request, negative for ever; an empty prompt with ``keep_alive: 0`` is
  ``ollama stop``.
* A request without a prompt (or messages) is Ollama's "load the model": the model is loaded (waiting for it) and
  the answer is ``done_reason: "load"``; with ``keep_alive: 0`` it is unloaded instead (``done_reason: "unload"``).
* Durations are measured on the request's timeline (nanoseconds): ``total_duration`` from arrival to the answer,
  ``load_duration`` waiting for the model to load (0 when it was loaded), ``prompt_eval_duration`` from then to the
  first token (queue wait included), ``eval_duration`` from the first token to the last.
* ``/api/tags`` and ``/api/show`` describe every model a request can name (loaded or not), ``/api/ps`` the loaded
  ones (``expires_at``: when keep-alive unloads them), from their GGUF headers: the ``digest`` is the sha256 of the
  file's path, size and mtime (hashing gigabytes per listing would be too slow), and ``/api/ps``'s ``size`` is the
  runner's footprint plus the weights it maps that are resident.

Not served: Ollama's model management (pull, push, create, copy, delete, blobs): instances are tether's
(``/v1/instances``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tether.engines import registry
from tether.engines.gguf import GgufArray, GgufError, read_gguf
from tether.errors import DoesNotFit, InvalidField, NotFound, Unavailable, UnknownEngine
from tether.fleet.catalog import KeepAlive, keep_alive_seconds
from tether.fleet.fleet import Hosted, new_request_id
from tether.fleet.scheduler import Scheduler
from tether.models import DefaultModelMissing, default_model_path
from tether.node.instance import InstanceReady
from tether.protocol import (
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    PENALTY_RANGE,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    ChatMessage,
    Chunk,
    EngineSpec,
    GenerateParams,
    TokenLogprob,
    documented,
)
from tether.serve.dialects import embeddings, openai
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.fields import HONOURED as H
from tether.serve.dialects.fields import LIMITED as L
from tether.serve.dialects.fields import METADATA as M
from tether.serve.dialects.fields import REFUSED as R
from tether.serve.dialects.fields import Policy, register
from tether.serve.shaping import Failure, cause_json

if TYPE_CHECKING:
    from tether.serve.app import Api

NDJSON = "application/x-ndjson"
MAX_STOPS = 16  # Ollama sets no limit; model files carry a few stop strings, a bound keeps a request bounded
DEFAULTS: dict[str, float | int] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "num_predict": -1}
PENALTY_WINDOW = 64  # the tokens repeat_penalty looks back over (llama.cpp engine), Ollama's repeat_last_n default
FOREVER = "9999-12-31T23:59:59Z"  # expires_at of a model that stays loaded (pinned, busy, keep-alive forever)
# Go's time.ParseDuration syntax ("5m", "1h30m", "-1s"), or a number of seconds as text

# --------------------------------------------------------------------------------------------------------------
# Request bodies
# --------------------------------------------------------------------------------------------------------------

Refused = Annotated[Any, documented(type="null")]
Empty = Annotated[list[Any], documented(maxItems=0, description="not supported: empty only")]
Format = Annotated[str, documented(enum=["", "json"])] | dict[str, Any]
Think = Annotated[bool | str, documented(enum=[False], description="no thinking mode: false only")]
TopLogprobs = Annotated[int, documented(minimum=0, maximum=MAX_TOP_LOGPROBS)]
Unit = Annotated[float, documented(enum=[1.0], description="the neutral value only")]


class OllamaOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request's ``options``; an unknown one is a 400 naming it. The load-time ones are the instance's."""

    num_predict: Annotated[int, documented(minimum=-1, maximum=MAX_TOKENS_LIMIT, **{"not": {"const": 0}})] | None = None
    temperature: Annotated[float, documented(minimum=TEMPERATURE_RANGE[0], maximum=TEMPERATURE_RANGE[1])] | None = None
    top_p: Annotated[float, documented(exclusiveMinimum=0, maximum=1)] | None = None
    top_k: Annotated[int, documented(minimum=0, maximum=MAX_TOKENS_LIMIT)] | None = None
    min_p: Annotated[float, documented(minimum=0, maximum=1)] | None = None
    seed: Annotated[int, documented(minimum=SEED_RANGE[0], maximum=SEED_RANGE[1] - 1)] | None = None
    stop: str | Annotated[list[str], documented(maxItems=MAX_STOPS)] | None = None
    repeat_penalty: Annotated[float, documented(exclusiveMinimum=0, maximum=10)] | None = None
    presence_penalty: Annotated[float, documented(minimum=PENALTY_RANGE[0], maximum=PENALTY_RANGE[1])] | None = None
    frequency_penalty: Annotated[float, documented(minimum=PENALTY_RANGE[0], maximum=PENALTY_RANGE[1])] | None = None
    repeat_last_n: Annotated[int, documented(enum=[PENALTY_WINDOW])] | None = None
    typical_p: Unit | None = None
    tfs_z: Unit | None = None
    mirostat: Annotated[int, documented(enum=[0], description="mirostat is not implemented: 0 only")] | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: Annotated[bool, documented(enum=[False])] | None = None
    num_keep: Refused = None
    # load-time options: the instance's
    num_ctx: Refused = None
    num_batch: Refused = None
    num_gpu: Refused = None
    main_gpu: Refused = None
    num_thread: Refused = None
    use_mmap: Refused = None
    use_mlock: Refused = None
    numa: Refused = None
    low_vram: Refused = None
    vocab_only: Refused = None
    f16_kv: Refused = None
    logits_all: Refused = None
    embedding_only: Refused = None


LOAD_TIME = {  # option -> the instance option (llama.cpp engine) that sets it, when there is one
    "num_ctx": "n_ctx",
    "num_batch": "n_batch",
    "num_gpu": "n_gpu_layers",
    "num_thread": "n_threads",
    "embedding_only": "embedding",
    "main_gpu": None,
    "use_mmap": None,
    "use_mlock": None,
    "numa": None,
    "low_vram": None,
    "vocab_only": None,
    "f16_kv": None,
    "logits_all": None,
}


class OllamaFunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    index: int | None = None


class OllamaToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    function: OllamaFunctionCall
    id: str | None = None
    type: Annotated[str, documented(enum=["function"])] = "function"


ROLES = ("system", "user", "assistant", "tool")


class OllamaMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Annotated[str, documented(enum=list(ROLES))]
    content: str = ""
    images: Empty | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None


class _Generation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    format: Format | None = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None


class OllamaChatRequest(_Generation, kw_only=True):
    messages: list[OllamaMessage] = msgspec.field(default_factory=list)
    tools: list[openai.FunctionTool] | None = None


class OllamaGenerateRequest(_Generation, kw_only=True):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    suffix: Annotated[str, documented(maxLength=0, description="fill-in-the-middle is not supported")] | None = None
    template: Annotated[str, documented(maxLength=0, description="the model's own chat template only")] | None = None
    context: Empty | None = None
    images: Empty | None = None
    width: Refused = None
    height: Refused = None
    steps: Refused = None


EmbedOptions = Annotated[dict[str, Any], documented(maxProperties=0, description="none apply to an embedding")]


class OllamaEmbedRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: str | Annotated[list[str], documented(maxItems=embeddings.MAX_INPUTS)]
    model: str | None = None
    truncate: Annotated[bool, documented(enum=[False], description="an input too long is a 400, never cut")] | None = (
        None
    )
    dimensions: Refused = None
    options: EmbedOptions | None = None
    keep_alive: KeepAlive | None = None


class OllamaEmbeddingsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    options: EmbedOptions | None = None
    keep_alive: KeepAlive | None = None


class OllamaShowRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    name: str | None = None  # Ollama's older name for model
    verbose: Annotated[bool, documented(enum=[False], description="large arrays are not read")] | None = None


BEYOND_SCHEMA: dict[str, str] = {}  # 400s for rules JSON Schema cannot state (the fuzzer accepts them): none now
SCHEMA_RULES: dict[str, dict[str, Any]] = {
    "OllamaChatRequest": {
        "allOf": [
            openai.LOGPROBS_RULE,
            {  # tools answer through a grammar of their own: no format beside them
                "if": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
                "then": {"properties": {"format": {"enum": [None, ""]}}},
            },
        ]
    },
    "OllamaGenerateRequest": {
        "allOf": [
            openai.LOGPROBS_RULE,
            {  # a raw prompt is sent as written: no system prompt to put around it
                "if": {"required": ["raw"], "properties": {"raw": {"const": True}}},
                "then": {"properties": {"system": {"anyOf": [{"type": "null"}, {"maxLength": 0}]}}},
            },
        ]
    },
    "OllamaMessage": openai.ASSISTANT_CALLS_RULE,
}

_GENERATION_POLICY = {
    "model": Policy(H, "picks the model, loaded on demand (a `:latest` tag is dropped); one loaded: any name works"),
    "format": Policy(H, '`"json"` or a JSON Schema: grammar-constrained, always parses'),
    "options": Policy(H, "see Ollama options"),
    "stream": Policy(H, "default true: NDJSON, one object a line; a failure ends it with an `error` line"),
    "keep_alive": Policy(H, "how long the model stays loaded once idle; 0: unload after this request; -1: forever"),
    "think": Policy(L, "false only: no thinking mode"),
    "logprobs": Policy(H, "the model's log-probabilities (before sampling), with bytes"),
    "top_logprobs": Policy(H, "0 to 20 alternatives per token; needs `logprobs: true`"),
}
register(
    "POST /api/chat",
    OllamaChatRequest,
    {
        **_GENERATION_POLICY,
        "messages": Policy(H, "roles system, user, assistant (with `tool_calls`), tool; none: load"),
        "tools": Policy(H, "function tools, through a grammar-constrained JSON answer"),
    },
)
register(
    "POST /api/generate",
    OllamaGenerateRequest,
    {
        **_GENERATION_POLICY,
        "prompt": Policy(H, "rendered with the model's chat template as a user turn; none: load"),
        "system": Policy(H, "a system turn before the prompt"),
        "raw": Policy(H, "true: the prompt as written, no template"),
        "suffix": Policy(L, "empty only"),
        "template": Policy(L, "empty only: the model's own chat template"),
        "context": Policy(L, "empty only (Ollama's deprecated token state; send the conversation)"),
        "images": Policy(L, "empty only: text models"),
        "width": Policy(R, "image generation"),
        "height": Policy(R, "image generation"),
        "steps": Policy(R, "image generation"),
    },
)
_LOAD_TIME_POLICY = Policy(R, "a load-time option: the instance's (POST /v1/instances)")
register(
    "Ollama options",
    OllamaOptions,
    {
        "num_predict": Policy(H, "-1 (default): until the model stops or its context is full; -2 is refused"),
        "temperature": Policy(H, "default 0.8; 0 is greedy"),
        "top_p": Policy(H, "default 0.9"),
        "top_k": Policy(H, "default 40; 0 keeps every token"),
        "min_p": Policy(H, "default 0"),
        "seed": Policy(H, "-1: random"),
        "stop": Policy(H, "up to 16 strings, never emitted"),
        "repeat_penalty": Policy(H, "default: the instance's option (1.0)"),
        "presence_penalty": Policy(H, "over the tokens generated so far"),
        "frequency_penalty": Policy(H, "over the tokens generated so far"),
        "repeat_last_n": Policy(L, "64 only: the window the penalty looks back over"),
        "typical_p": Policy(L, "1.0 (off) only"),
        "tfs_z": Policy(L, "1.0 (off) only"),
        "mirostat": Policy(L, "0 (off) only"),
        "mirostat_tau": Policy(M, "mirostat's: with mirostat 0 it changes nothing, as in Ollama"),
        "mirostat_eta": Policy(M, "mirostat's: with mirostat 0 it changes nothing, as in Ollama"),
        "penalize_newline": Policy(L, "false only"),
        "num_keep": Policy(R, "no context shifting: a generation ends when its context is full"),
        **{name: _LOAD_TIME_POLICY for name in LOAD_TIME},
    },
)
register(
    "Ollama chat message",
    OllamaMessage,
    {
        "role": Policy(H),
        "content": Policy(H),
        "images": Policy(L, "empty only: text models"),
        "tool_calls": Policy(H, "an earlier assistant turn's calls, shown to the model"),
        "tool_name": Policy(H, "the tool a result comes from, shown to the model"),
        "tool_call_id": Policy(H, "the call a result answers, shown to the model"),
        "thinking": Policy(M, "an earlier turn's reasoning is not shown to the model (chat templates drop it)"),
    },
)
_EMBED_POLICY = {
    "model": Policy(H, "an instance started for embeddings (llama.cpp option `embedding: true`)"),
    "options": Policy(L, "empty only: sampling options do not apply, load-time ones are the instance's"),
    "keep_alive": _GENERATION_POLICY["keep_alive"],
}
register(
    "POST /api/embed",
    OllamaEmbedRequest,
    {
        **_EMBED_POLICY,
        "input": Policy(H, "a string or a list of strings; unit-length vectors"),
        "truncate": Policy(L, "false only: an input longer than the context is a 400, never cut"),
        "dimensions": Policy(R, "the vector has the model's size"),
    },
)
register(
    "POST /api/embeddings",
    OllamaEmbeddingsRequest,
    {**_EMBED_POLICY, "prompt": Policy(H, "one string; a unit-length vector (Ollama's is not normalised)")},
)
register(
    "POST /api/show",
    OllamaShowRequest,
    {
        "model": Policy(H, "the instance"),
        "name": Policy(H, "Ollama's older name for `model`"),
        "verbose": Policy(L, "false only: the tokenizer's arrays are not read"),
    },
)

_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decode(struct: type[Any], body: bytes) -> Any:
    decoder = _decoders.get(struct)
    if decoder is None:
        decoder = _decoders[struct] = msgspec.json.Decoder(struct)
    return openai.decode_body(decoder, body)


# --------------------------------------------------------------------------------------------------------------
# Requests to plans
# --------------------------------------------------------------------------------------------------------------


def sampling(options: OllamaOptions | None) -> dict[str, Any]:
    """The ``GenerateParams`` fields ``options`` set, Ollama's defaults for the rest; a refused option is a 400."""
    o = options or OllamaOptions()
    for name, instance_option in LOAD_TIME.items():
        if getattr(o, name) is not None:
            how = f"the option {instance_option!r}" if instance_option else "the instance's options"
            raise InvalidField(
                f"options.{name}",
                f"options.{name} is a load-time option: Ollama loads a model per request's options, tether serves "
                f"instances started ahead, so it is an instance's option, set with {how} when the instance is "
                "started (POST /v1/instances); remove it from the request",
            )
    if o.num_keep is not None:
        raise InvalidField(
            "options.num_keep",
            "options.num_keep is not supported: there is no context shifting here (a generation ends with "
            "done_reason 'length' when its context is full); remove it",
        )
    limited: list[tuple[str, Any, Any, str]] = [
        ("repeat_last_n", o.repeat_last_n, PENALTY_WINDOW, "repeat_penalty looks back over the last 64 tokens"),
        ("typical_p", o.typical_p, 1.0, "typical sampling is not implemented: use top_p, top_k or min_p"),
        ("tfs_z", o.tfs_z, 1.0, "tail-free sampling is not implemented: use top_p, top_k or min_p"),
        ("mirostat", o.mirostat, 0, "mirostat sampling is not implemented: use top_p, top_k or min_p"),
        ("penalize_newline", o.penalize_newline, False, "newlines are never penalised here"),
    ]
    for name, value, only, why in limited:
        if value is not None and value != only:
            raise InvalidField(f"options.{name}", f"options.{name} must be {json.dumps(only)} or absent ({why})")
    predict = o.num_predict if o.num_predict is not None else -1
    if predict == -2:
        raise InvalidField(
            "options.num_predict",
            "options.num_predict -2 (fill the context) is not supported: send -1 (until the model stops or the "
            "context is full) or a number of tokens",
        )
    if predict == 0 or predict < -1:
        raise InvalidField(
            "options.num_predict", f"options.num_predict must be -1 or a number of tokens >= 1, got {predict}"
        )
    stops = [o.stop] if isinstance(o.stop, str) else list(o.stop or ())
    if len(stops) > MAX_STOPS:
        raise InvalidField("options.stop", f"options.stop takes at most {MAX_STOPS} strings, got {len(stops)}")
    return {
        # -1: the context bounds the generation (it ends "length" when full); the largest count the wire carries
        "max_tokens": MAX_TOKENS_LIMIT if predict == -1 else predict,
        "temperature": DEFAULTS["temperature"] if o.temperature is None else o.temperature,
        "top_p": DEFAULTS["top_p"] if o.top_p is None else o.top_p,
        "top_k": DEFAULTS["top_k"] if o.top_k is None else o.top_k,
        "min_p": DEFAULTS["min_p"] if o.min_p is None else o.min_p,
        "seed": None if o.seed == -1 else o.seed,
        "stop": tuple(stops),
        "repeat_penalty": o.repeat_penalty,
        "presence_penalty": o.presence_penalty or 0.0,
        "frequency_penalty": o.frequency_penalty or 0.0,
    }


def format_schema(fmt: str | dict[str, Any] | None) -> str | None:
    """``format`` as ``GenerateParams.json_schema``: "json" is any JSON object, an object is a JSON Schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json" or fmt == {}:
        return '{"type": "object"}'
    if isinstance(fmt, str):
        raise InvalidField("format", f'format must be "json" or a JSON Schema object, got {fmt!r}')
    return openai.schema_text(fmt, "format")


def _common(body: _Generation) -> dict[str, Any]:
    """What chat and generate requests share: checks, then the sampling and logprobs fields."""
    keep_alive_seconds(body.keep_alive)
    if body.think not in (None, False):
        raise InvalidField("think", "think is not supported: there is no thinking mode here (send false or omit it)")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")
    return {"logprobs": (body.top_logprobs or 0) if body.logprobs else None, **sampling(body.options)}


_OPTION_OF = {
    "max_tokens": "num_predict",
    **{name: name for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty")},
    **{name: name for name in ("presence_penalty", "frequency_penalty")},
}


def checked(params: GenerateParams) -> GenerateParams:
    """``params``, or the 400 for what is wrong with them, naming the option a request sets it with."""
    problem = params.check()
    if problem is None:
        return params
    option = _OPTION_OF.get(problem.field or "")
    if option is None:
        raise problem
    raise InvalidField(f"options.{option}", problem.why.replace(problem.field or "", f"options.{option}", 1))


def _empty(value: list[Any] | None, field: str, why: str) -> None:
    if value:
        raise InvalidField(field, f"{field} is not supported ({why}): remove it")


def chat_messages(messages: list[OllamaMessage]) -> list[ChatMessage]:
    """Ollama's messages as OpenAI's, rendered the one way every dialect renders a conversation."""
    converted = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidField(
                f"messages[{i}].role",
                f"messages[{i}].role must be one of {', '.join(map(repr, ROLES))}, got {message.role!r}",
            )
        _empty(message.images, f"messages[{i}].images", "text models only")
        calls = None
        if message.tool_calls:
            calls = [
                openai.ToolCallIn(
                    openai.FunctionCallIn(c.function.name, json.dumps(c.function.arguments, ensure_ascii=False)),
                    id=c.id,
                )
                for c in message.tool_calls
            ]
        converted.append(
            openai.MessageIn(
                role=message.role,
                content=message.content,
                name=message.tool_name,
                tool_calls=calls,
                tool_call_id=message.tool_call_id,
            )
        )
    return openai.chat_messages(converted)


def chat_plan(body: OllamaChatRequest) -> openai.Plan | None:
    """The chat's plan; None for a request without messages (Ollama's "load the model")."""
    common = _common(body)
    json_schema = format_schema(body.format)
    tools = toolkit.plan(body.tools or [], None, None)
    if not body.messages:
        checked(GenerateParams(prompt="", **common))  # a load request's options are checked too
        if tools is not None:
            tools.apply([], json_schema, "format")  # and tools beside a format are refused there too
        return None
    messages = chat_messages(body.messages)
    if tools is not None:
        json_schema = tools.apply(messages, json_schema, "format")
    params = GenerateParams(messages=tuple(messages), json_schema=json_schema, **common)
    keep = keep_alive_seconds(body.keep_alive)
    return openai.Plan(checked(params), body.model, body.stream, False, body.logprobs, tools, keep)


def generate_plan(body: OllamaGenerateRequest) -> openai.Plan | None:
    """The generation's plan; None for a request without a prompt (Ollama's "load the model")."""
    common = _common(body)
    json_schema = format_schema(body.format)
    if body.suffix:
        raise InvalidField("suffix", "suffix (fill-in-the-middle) is not supported: remove it")
    if body.template:
        raise InvalidField("template", "template is not supported: the model's own chat template renders the prompt")
    _empty(body.context, "context", "Ollama's deprecated token state: send the conversation to /api/chat")
    _empty(body.images, "images", "text models only")
    for name in ("width", "height", "steps"):
        if getattr(body, name) is not None:
            raise InvalidField(name, f"{name} is not supported (image generation): remove it")
    if body.raw and body.system:
        raise InvalidField("system", "raw sends the prompt as written: a system prompt cannot go with it")
    if not body.prompt:
        checked(GenerateParams(prompt="", **common))  # a load request's options are checked too
        return None
    if body.raw:
        params = GenerateParams(prompt=body.prompt, json_schema=json_schema, **common)
    else:
        turns = [ChatMessage(role="system", content=body.system)] if body.system else []
        turns.append(ChatMessage(role="user", content=body.prompt))
        params = GenerateParams(messages=tuple(turns), json_schema=json_schema, **common)
    keep = keep_alive_seconds(body.keep_alive)
    return openai.Plan(checked(params), body.model, body.stream, False, body.logprobs, keep_alive=keep)


def embed_texts(body: OllamaEmbedRequest) -> list[str]:
    """The inputs to embed: an empty string is none, as in Ollama (which answers it with no vectors)."""
    if isinstance(body.input, str):
        return [body.input] if body.input else []
    return body.input


def embed_inputs(texts: list[str], body: OllamaEmbedRequest | OllamaEmbeddingsRequest) -> list[GenerateParams]:
    keep_alive_seconds(body.keep_alive)
    if body.options:
        name = next(iter(body.options))
        raise InvalidField(
            f"options.{name}",
            f"options.{name}: no option applies to an embedding (sampling ones do nothing, load-time ones are the "
            "instance's, set when it is started with POST /v1/instances): remove it",
        )
    if isinstance(body, OllamaEmbedRequest):
        if body.truncate:
            raise InvalidField(
                "truncate", "truncate is not supported: an input longer than the context is refused, never cut"
            )
        if body.dimensions is not None:
            raise InvalidField("dimensions", "dimensions is not supported: the vector has the model's size")
    return embeddings.tasks(texts)


def show_model(body: OllamaShowRequest) -> str | None:
    """The model ``/api/show`` asks about (``name`` is Ollama's older field for it)."""
    if body.verbose:
        raise InvalidField("verbose", "verbose is not supported: the tokenizer's arrays are not read (omit it)")
    return body.model if body.model is not None else body.name


# --------------------------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------------------------

_encode = msgspec.json.Encoder().encode


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def error_body(message: str, code: str | None = None, **extra: Any) -> bytes:
    """Ollama's error shape, ``{"error": "<message>"}``, with tether's ``code`` (and ``param``, ``cause``) beside."""
    return _encode({"error": message, "code": code, **extra})


class Shaper:
    """One request's NDJSON lines or whole object, in Ollama's chat or generate shape (see ``shaping.Shaper``)."""

    media_type = NDJSON
    load_seconds = 0.0  # set by the API: how long the request waited for its model to load

    def __init__(self, kind: Literal["chat", "generate"], model: str, plan: openai.Plan, started: float) -> None:
        self.kind = kind
        self.model = model
        self.plan = plan
        self.started = started
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.first_at: float | None = None
        self.last_at: float | None = None

    def opening(self) -> bytes:
        return b""

    def feed(self, chunk: Chunk) -> bytes:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.text.append(chunk.text)
        logprobs = list(chunk.logprobs) if self.plan.logprobs else []
        self.logprobs.extend(logprobs)
        if self.plan.tools is not None or not (chunk.text or logprobs):
            return b""  # a tool answer is parsed whole, at the end
        return self._line(self._object(chunk.text, logprobs=logprobs))

    def closing(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        out = b""
        if self.plan.tools is not None:
            content, calls = toolkit.parse("".join(self.text))
            if calls or content:
                out += self._line(self._object(content or "", calls=calls))
        return out + self._line(self._object("", self._stats(finish, prompt_tokens, completion_tokens)))

    def whole(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        text = "".join(self.text)
        content, calls = toolkit.parse(text) if self.plan.tools is not None else (text, [])
        stats = self._stats(finish, prompt_tokens, completion_tokens)
        return _encode(self._object(content or "", stats, calls=calls, logprobs=self.logprobs))

    def stream_error(self, failure: Failure) -> bytes:
        """The line that ends a failed stream: the ``ollama`` clients raise ``ResponseError`` with its message."""
        return self.error_body(failure) + b"\n"

    def error_body(self, failure: Failure) -> bytes:
        return error_body(failure.message, failure.code, **failure.extra)

    def _stats(self, finish: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        end = time.monotonic()
        first = self.first_at if self.first_at is not None else end
        last = self.last_at if self.last_at is not None else end
        return {
            "done_reason": "length" if finish == "length" else "stop",
            "total_duration": ns(end - self.started),
            "load_duration": ns(self.load_seconds),  # waiting for the model's load (0 when it was loaded)
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": ns(max(first - self.started - self.load_seconds, 0.0)),
            "eval_count": completion_tokens,
            "eval_duration": ns(last - first),
        }

    def _object(
        self,
        text: str,
        stats: dict[str, Any] | None = None,
        *,
        calls: list[toolkit.ToolCall] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        obj: dict[str, Any] = {"model": self.model, "created_at": rfc3339(time.time())}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [tool_call_json(i, c) for i, c in enumerate(calls)]
            obj["message"] = message
        else:
            obj["response"] = text
        obj["done"] = stats is not None
        if stats is not None:
            obj.update(stats)
        if logprobs and self.plan.logprobs:
            obj["logprobs"] = [openai.chat_logprob(e) for e in logprobs]
        return obj

    @staticmethod
    def _line(obj: dict[str, Any]) -> bytes:
        return _encode(obj) + b"\n"


def tool_call_json(index: int, call: toolkit.ToolCall) -> dict[str, Any]:
    """A call in Ollama's shape: the arguments as an object, not as JSON text."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


def loaded(kind: Literal["chat", "generate"], model: str) -> dict[str, Any]:
    """Ollama's answer to a request without a prompt: the model is loaded (here: it is ready)."""
    obj: dict[str, Any] = {"model": model, "created_at": rfc3339(time.time())}
    if kind == "chat":
        obj["message"] = {"role": "assistant", "content": ""}
    else:
        obj["response"] = ""
    return {**obj, "done": True, "done_reason": "load"}


# --------------------------------------------------------------------------------------------------------------
# Models: the instances, described from their GGUF headers
# --------------------------------------------------------------------------------------------------------------

FILE_TYPES = {  # llama.cpp's llama_ftype: general.file_type -> the quantization's name
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}


NO_DETAILS: dict[str, Any] = {
    "parent_model": "",
    "format": "",
    "family": "",
    "families": None,
    "parameter_size": "",
    "quantization_level": "",
}


@dataclass(frozen=True)
class ModelFacts:
    """What Ollama's model listings say of a model, as far as the instance's model file tells it."""

    path: str | None
    size: int
    modified_at: float
    digest: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    template: str
    license: str


def human_number(n: int) -> str:
    """A parameter count as Ollama writes one: 8.0B, 134.52M, 7B."""
    for scale, unit, places in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 0)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == math.floor(value) else f"{value:.{places}f}{unit}"
    return str(n)


@dataclass(frozen=True)
class Listed:
    """A model as Ollama's listings describe it, loaded or not: its id, its engine spec, when it was created."""

    id: str
    spec: EngineSpec
    created_at: float

    @classmethod
    def of(cls, hosted: Hosted) -> Listed:
        return cls(hosted.id, hosted.instance.spec, hosted.created_at)


def model_path(item: Listed) -> Path | None:
    spec = item.spec
    if spec.model is not None:
        return Path(spec.model)
    if spec.engine == "llama.cpp":
        try:
            return default_model_path()
        except DefaultModelMissing:
            return None
    return None


@functools.lru_cache(maxsize=64)
def _gguf_facts(path: str, size: int, mtime_ns: int) -> ModelFacts:
    """The facts of one model file (cached by path, size and mtime: a changed file is read again)."""
    digest = hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()
    details = {**NO_DETAILS, "format": "gguf"}
    try:
        gguf = read_gguf(path)
    except GgufError:  # not a GGUF (a plugin engine's own format): its size and digest are all there is to say
        return ModelFacts(path, size, mtime_ns / 1e9, digest, NO_DETAILS, {}, "", "")
    meta = gguf.metadata
    arch = gguf.architecture or ""
    parameters = sum(math.prod(t.shape) for t in gguf.tensors)
    file_type = meta.get("general.file_type")
    quantization = FILE_TYPES.get(file_type, "") if isinstance(file_type, int) else ""
    if not quantization:  # the commonest quantized tensor type speaks for the file
        types = [t.type_name for t in gguf.tensors if t.type_name not in ("F32", "F16")]
        quantization = max(set(types), key=types.count) if types else ""
    details.update(
        family=arch,
        families=[arch] if arch else None,
        parameter_size=human_number(parameters),
        quantization_level=quantization,
    )
    info: dict[str, Any] = {"general.parameter_count": parameters}
    for key, value in meta.items():
        if key == "tokenizer.chat_template" or isinstance(value, GgufArray):
            continue  # the template has a field of its own; large arrays (the vocabulary) are not read
        info[key] = list(value) if isinstance(value, tuple) else value
    template = meta.get("tokenizer.chat_template")
    license_ = meta.get("general.license")
    return ModelFacts(
        path,
        size,
        mtime_ns / 1e9,
        digest,
        details,
        info,
        template if isinstance(template, str) else "",
        license_ if isinstance(license_, str) else "",
    )


def facts(item: Listed) -> ModelFacts:
    """The facts of ``item``'s model (reads its GGUF header, ~0.1 s, once per file version: call off the loop)."""
    path = model_path(item)
    try:
        stat = path.stat() if path is not None else None
    except OSError:
        stat = None
    if path is None or stat is None:  # an engine without a model file (the debug engine), or a file gone
        digest = hashlib.sha256(f"{item.spec.engine}\0{item.id}\0{item.created_at}".encode())
        details = {**NO_DETAILS, "family": item.spec.engine}
        return ModelFacts(None, 0, item.created_at, digest.hexdigest(), details, {}, "", "")
    return _gguf_facts(str(path), stat.st_size, stat.st_mtime_ns)


def options_of(item: Listed) -> dict[str, Any]:
    """The model's engine options in effect: its own over the engine's declared defaults."""
    spec = item.spec
    try:
        defaults = dict(registry.resolve(spec.engine).options)
    except UnknownEngine:  # a plugin that no longer imports: its own options are all there is to say
        defaults = {}
    return {**defaults, **spec.options}


def capabilities(item: Listed) -> list[str]:
    if item.spec.engine == "debug":
        return ["completion", "tools", "embedding"]  # it does both: embeddings are hashes of the text
    if options_of(item).get("embedding"):
        return ["embedding"]
    return ["completion", "tools"]  # tools in the generic format, for any model


def parameters_text(item: Listed) -> str:
    """Ollama's ``parameters``: the defaults a request without options gets here."""
    options = options_of(item)
    values: dict[str, Any] = {**DEFAULTS}
    if options.get("repeat_penalty") is not None:
        values["repeat_penalty"] = options["repeat_penalty"]
    if isinstance(options.get("n_ctx"), int):
        values["num_ctx"] = options["n_ctx"]
    return "\n".join(f"{name:<30} {value}" for name, value in values.items())


def tag_json(item: Listed, f: ModelFacts) -> dict[str, Any]:
    return {
        "name": item.id,
        "model": item.id,
        "modified_at": rfc3339(f.modified_at),
        "size": f.size,
        "digest": f.digest,
        "details": f.details,
    }


async def ps_json(hosted: Hosted, f: ModelFacts, expires_in: float | None) -> dict[str, Any]:
    """A loaded model: its memory sampled now (the footprint, plus the mapped weights that are resident), and when
    keep-alive unloads it (``expires_in`` seconds from now; None: not counting down)."""
    size, vram = f.size, 0
    sup = hosted.supervisor
    if sup is not None and sup.alive:
        memory = await sup.sample_memory()
        if memory is not None:
            size, vram = memory.footprint + memory.file, memory.gpu or 0
    expires = FOREVER if expires_in is None else rfc3339(time.time() + expires_in)
    item = Listed.of(hosted)
    entry = {**tag_json(item, f), "size": size, "size_vram": vram, "expires_at": expires}
    n_ctx = options_of(item).get("n_ctx")
    if isinstance(n_ctx, int):
        entry["context_length"] = n_ctx
    return entry


def listed(scheduler: Scheduler) -> list[Listed]:
    """Every model a request can name, loaded or not: the catalog's, then instances added beside it."""
    items = []
    for model_id in scheduler.names():
        slot = scheduler.slots.get(model_id)
        if slot is not None:
            created = slot.hosted.created_at if slot.hosted is not None else scheduler.started_at
            items.append(Listed(model_id, slot.model.config.spec(), created))
        else:
            items.append(Listed.of(scheduler.fleet.get(model_id)))
    return items


# --------------------------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------------------------

Handler = Callable[[Request], Awaitable[Response]]


def _json(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None, media_type: str | None = None
) -> Response:
    return Response(_encode(obj), status_code=status, media_type=media_type or "application/json", headers=headers)


def _error(
    status: int, message: str, code: str | None, headers: dict[str, str] | None = None, **extra: Any
) -> Response:
    return Response(error_body(message, code, **extra), status, headers=headers, media_type="application/json")


def routes(app: FastAPI, api: Api) -> None:
    """Add Ollama's routes to ``app``, answering through ``api``."""
    from tether.serve.app import GenerationFailed  # app calls this once it is whole: no import cycle

    fleet, scheduler = api.fleet, api.scheduler

    def ollama_errors(handler: Handler) -> Handler:
        """Errors in Ollama's shape (the app's handlers answer in OpenAI's)."""

        @functools.wraps(handler)
        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except InvalidField as exc:
                return _error(400, str(exc), "invalid_request", param=exc.field)
            except NotFound as exc:
                return _error(404, str(exc), "not_found")
            except DoesNotFit as exc:
                return _error(507, str(exc), "does_not_fit")
            except Unavailable as exc:
                headers = None
                if exc.retry_after is not None:
                    headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
                extra = {"cause": cause_json(exc.cause)} if exc.cause is not None else {}
                return _error(503, str(exc), "unavailable", headers, **extra)
            except GenerationFailed as exc:
                f = exc.failure
                return _error(f.status, f.message, f.code, **f.extra)

        return answer

    async def generation(request: Request, kind: Literal["chat", "generate"]) -> Response:
        started = time.monotonic()
        endpoint = f"ollama_{kind}"
        struct = OllamaChatRequest if kind == "chat" else OllamaGenerateRequest
        body = decode(struct, await request.body())
        model_id = scheduler.resolve(body.model)
        make = functools.partial(chat_plan if kind == "chat" else generate_plan, body)
        plan = api.planned(model_id, endpoint, make)
        if plan is None:  # Ollama's "load the model" (or, with keep_alive 0, "unload it": ollama stop)
            keep = keep_alive_seconds(body.keep_alive)
            if keep == 0:
                await scheduler.unload(model_id, "keep_alive 0 with nothing to generate (ollama stop)")
                answer = {**loaded(kind, model_id), "done_reason": "unload"}
            else:
                async with scheduler.lease(model_id, keep) as hosted:
                    if not isinstance(hosted.instance.state, InstanceReady):
                        inst = hosted.instance
                        raise Unavailable(inst.unavailable_reason(), retry_after=hosted.retry_after(), cause=inst.cause)
                answer = loaded(kind, model_id)
            if body.stream:
                return Response(_encode(answer) + b"\n", media_type=NDJSON)
            return _json(answer)
        request_id = new_request_id(f"ollama-{kind}")
        shaper = Shaper(kind, model_id, plan, started)
        return await api.respond(model_id, plan, shaper, request_id, endpoint, started)

    @app.post("/api/chat")
    @ollama_errors
    async def chat(request: Request) -> Response:
        return await generation(request, "chat")

    @app.post("/api/generate")
    @ollama_errors
    async def generate(request: Request) -> Response:
        return await generation(request, "generate")

    @app.post("/api/embed")
    @ollama_errors
    async def embed(request: Request) -> Response:
        started = time.monotonic()
        body = decode(OllamaEmbedRequest, await request.body())
        model_id = scheduler.resolve(body.model)
        inputs = api.planned(model_id, "ollama_embed", lambda: embed_inputs(embed_texts(body), body))
        keep = keep_alive_seconds(body.keep_alive)
        embed_id = new_request_id("ollama-embed")
        chunks = await api.embed(model_id, inputs, embed_id, "ollama_embed", keep) if inputs else []
        return _json(
            {
                "model": model_id,
                "embeddings": [list(c.embedding or ()) for c in chunks],
                "total_duration": ns(time.monotonic() - started),
                "load_duration": 0,
                "prompt_eval_count": sum(c.prompt_tokens for c in chunks),
            }
        )

    @app.post("/api/embeddings")
    @ollama_errors
    async def embeddings_(request: Request) -> Response:
        body = decode(OllamaEmbeddingsRequest, await request.body())
        model_id = scheduler.resolve(body.model)
        inputs = api.planned(model_id, "ollama_embeddings", lambda: embed_inputs([body.prompt or ""], body))
        if not body.prompt:  # Ollama answers an empty prompt with an empty vector (it loads the model)
            return _json({"embedding": []})
        keep = keep_alive_seconds(body.keep_alive)
        chunks = await api.embed(model_id, inputs, new_request_id("ollama-embd"), "ollama_embeddings", keep)
        return _json({"embedding": list(chunks[0].embedding or ())})

    @app.get("/api/tags")
    @ollama_errors
    async def tags(request: Request) -> Response:
        models = []
        for item in listed(scheduler):
            models.append(tag_json(item, await anyio.to_thread.run_sync(facts, item)))
        return _json({"models": models})

    @app.get("/api/ps")
    @ollama_errors
    async def ps(request: Request) -> Response:
        models = []
        now = time.monotonic()
        for hosted in fleet.list():
            if isinstance(hosted.instance.state, InstanceReady):
                slot = scheduler.slots.get(hosted.id)
                expires = slot.expires_in(now) if slot is not None else None
                f = await anyio.to_thread.run_sync(facts, Listed.of(hosted))
                models.append(await ps_json(hosted, f, expires))
        return _json({"models": models})

    @app.post("/api/show")
    @ollama_errors
    async def show(request: Request) -> Response:
        model_id = scheduler.resolve(show_model(decode(OllamaShowRequest, await request.body())))
        item = next(i for i in listed(scheduler) if i.id == model_id)
        f = await anyio.to_thread.run_sync(facts, item)
        return _json(
            {
                "modelfile": "",
                "parameters": parameters_text(item),
                "template": f.template,
                "license": f.license,
                "details": f.details,
                "model_info": f.model_info,
                "capabilities": capabilities(item),
                "modified_at": rfc3339(f.modified_at),
            }
        )

    @app.get("/api/version")
    @ollama_errors
    async def version(request: Request) -> Response:
        import tether

        return _json({"version": tether.__version__})
