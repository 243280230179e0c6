"""Ollama's API beside OpenAI's: the routes Open WebUI, Continue and the ``ollama`` clients call, on the same fleet.

``/api/chat`` and ``/api/generate`` become the same ``Plan`` an OpenAI request does and are answered through
``Api.respond``, so every promise holds here too (one outcome per request, the status decided by the first token,
a runner failure mid-stream ends the stream with an ``{"error": ...}`` line carrying the cause, never with a
``done: true`` line); only the bytes are Ollama's (NDJSON, one object a line, streaming by default). Errors are
Ollama's shape, ``{"error": "<message>"}``, with tether's ``code``, ``param`` and ``cause`` beside the message.

Every field is honoured or refused, as on the OpenAI side (``fields``). The choices Ollama's semantics force:

* Absent sampling options take Ollama's documented defaults (its Modelfile reference: temperature 0.8, top_k 40,
  top_p 0.9, min_p 0, repeat_penalty 1.1 over the last 64 tokens, ``num_predict`` -1: until the model stops or its
  context is full): a client that sends none (Open WebUI, the ``ollama`` client) gets what Ollama would give it,
  not a penalty-free sampler that rambles. ``seed: -1`` is Ollama's "random".
* A chat longer than the instance's context keeps its system messages and its latest turns, as Ollama does
  (``GenerateParams.fit_context``); the final object says how many turns were left out (``truncated_messages``, an
  extra field Ollama's clients ignore) and the server logs it; ``prompt_eval_count`` is the prompt really read.
* ``num_ctx`` is the request's own context: its chat is fitted into ``num_ctx`` tokens and its answer ends when they
  are full, as with Ollama; one larger than the instance's ``n_ctx`` gets the instance's (Ollama would reload the
  model with a larger context; tether serves the instance started ahead, whose context ``/api/show`` and
  ``/api/ps`` report). Other load-time options (``num_gpu``, ``num_thread``, ...) are refused, naming the instance
  option to set instead (``POST /v1/instances``).
* ``/api/embed``'s ``truncate`` (default true, as Ollama's) keeps the first ``n_ctx`` tokens of an input too long
  for the instance's context; false refuses it (400, with the numbers). ``/api/embeddings`` (no such field) cuts too.
* ``keep_alive`` is the scheduler's (``tether.fleet.scheduler``): how long the model stays loaded once idle, 0 to
  unload it after this request, negative for ever; an empty prompt with ``keep_alive: 0`` is ``ollama stop``.
* A request without a prompt (or messages) is Ollama's "load the model": the model is loaded (waiting for it) and
  the answer is ``done_reason: "load"``; with ``keep_alive: 0`` it is unloaded instead (``done_reason: "unload"``).
* Durations are measured on the request's timeline (nanoseconds): ``total_duration`` from arrival to the answer,
  ``load_duration`` waiting for the model to load (0 when it was loaded), ``prompt_eval_duration`` from then to the
  first token (queue wait included), ``eval_duration`` from the first token to the last.
* ``/api/tags`` and ``/api/show`` describe every model a request can name (loaded or not), with its
  ``capabilities`` (an embedding instance's are ``["embedding"]``: clients do not offer it for chat), ``/api/ps``
  the loaded ones (``expires_at``: when keep-alive unloads them), from their GGUF headers: the ``digest`` is the
  sha256 of the file's path, size and mtime (hashing gigabytes per listing would be too slow), and ``/api/ps``'s
  ``size`` is the runner's footprint plus the weights it maps that are resident.

``/api/version`` answers ``OLLAMA_VERSION`` (clients compare it with the Ollama release they need) and tether's own
version in the ``X-Tether-Version`` header.

Not served: Ollama's model management (pull, push, create, copy, delete, blobs): instances are tether's
(``/v1/instances``).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import anyio
import msgspec
from fastapi import Request
from fastapi.responses import Response
from msgspec import UNSET, UnsetType

import tether
from tether.errors import InvalidField
from tether.fleet.catalog import KeepAlive, keep_alive_seconds
from tether.fleet.facts import ListedModel, ModelFacts, capabilities, facts, listed, options_of
from tether.fleet.fleet import Hosted, Unavailable, new_request_id
from tether.node.instance import InstanceReady
from tether.protocol import (
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    PENALTY_RANGE,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    ChatMessage,
    Chunk,
    EmbedParams,
    GenerateParams,
    TokenLogprob,
    documented,
)
from tether.serve import views
from tether.serve.dialects import thinking
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.conversation import ROLES, Call, Turn, is_role, latest_calls
from tether.serve.dialects.fields import HONOURED as H
from tether.serve.dialects.fields import LIMITED as L
from tether.serve.dialects.fields import METADATA as M
from tether.serve.dialects.fields import REFUSED as R
from tether.serve.dialects.fields import FieldPolicy, register
from tether.serve.dialects.plan import MAX_INPUTS, Plan, decode_body, embedding_tasks, schema_text
from tether.serve.dialects.rules import ASSISTANT_CALLS_RULE, LOGPROBS_RULE, assistant_only
from tether.serve.dialects.shapes import THINKING, FunctionTool, declared_tools, thinking_of
from tether.serve.generation import Api
from tether.serve.routes import GENERATION_ERRORS, NDJSON, Route, json_answer, json_response, ref
from tether.serve.statuses import Answer

log = logging.getLogger("tether.api")

MAX_STOPS = 16  # Ollama sets no limit; model files carry a few stop strings, a bound keeps a request bounded
DEFAULTS: dict[str, float | int] = {  # Ollama's documented defaults (docs/modelfile.md, api/types.go)
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repeat_penalty": 1.1,
    "num_predict": -1,
}
# What /api/version answers: Open WebUI and the ollama clients compare it against the Ollama release a feature needs
# (Open WebUI warns below its minimum); tether speaks the API of this release (its fields, its NDJSON, its errors).
# tether's own version is in the X-Tether-Version header.
OLLAMA_VERSION = "0.12.6"
TETHER_VERSION = "X-Tether-Version"
PENALTY_WINDOW = 64  # the tokens repeat_penalty looks back over (llama.cpp engine), Ollama's repeat_last_n default
FOREVER = "9999-12-31T23:59:59Z"  # expires_at of a model that stays loaded (pinned, busy, keep-alive forever)
# Go's time.ParseDuration syntax ("5m", "1h30m", "-1s"), or a number of seconds as text

# --------------------------------------------------------------------------------------------------------------
# Request bodies
# --------------------------------------------------------------------------------------------------------------

Refused = Annotated[Any, documented(type="null")]
Empty = Annotated[list[Any], documented(maxItems=0, description="not supported: empty only")]
Format = Annotated[str, documented(enum=["", "json"])] | dict[str, Any]
# a reasoning model's thinking on or off, where its chat template can say so; gpt-oss's levels count as on
Think = bool | Literal["low", "medium", "high"]
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
    num_ctx: Annotated[int, documented(minimum=1, maximum=MAX_TOKENS_LIMIT)] | None = None
    # load-time options: the instance's
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
    index: int | None = None  # Open WebUI sends each call back with its index in the turn: metadata here


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
    tools: list[FunctionTool] | None = None


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
    input: str | Annotated[list[str], documented(maxItems=MAX_INPUTS)]
    model: str | None = None
    truncate: bool | None = None  # None: true, as Ollama's default
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


BEYOND_SCHEMA = {  # 400s for rules JSON Schema cannot state (the fuzzer accepts them; each says what to do)
    "think": "thinking on or off only where the model's chat template can say so",
}
SCHEMA_RULES: dict[str, dict[str, Any]] = {
    "OllamaChatRequest": {
        "allOf": [
            LOGPROBS_RULE,
            {  # tools answer through a grammar of their own: no format beside them
                "if": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
                "then": {"properties": {"format": {"enum": [None, ""]}}},
            },
        ]
    },
    "OllamaGenerateRequest": {
        "allOf": [
            LOGPROBS_RULE,
            {  # a raw prompt is sent as written: no system prompt to put around it
                "if": {"required": ["raw"], "properties": {"raw": {"const": True}}},
                "then": {"properties": {"system": {"anyOf": [{"type": "null"}, {"maxLength": 0}]}}},
            },
        ]
    },
    "OllamaMessage": {"allOf": [ASSISTANT_CALLS_RULE, assistant_only("thinking")]},
}

_GENERATION_POLICY = {
    "model": FieldPolicy(
        H, "picks the model, loaded on demand (a `:latest` tag is dropped); one loaded: any name works"
    ),
    "format": FieldPolicy(H, '`"json"` or a JSON Schema: grammar-constrained, always parses'),
    "options": FieldPolicy(H, "see Ollama options"),
    "stream": FieldPolicy(H, "default true: NDJSON, one object a line; a failure ends it with an `error` line"),
    "keep_alive": FieldPolicy(
        H, "how long the model stays loaded once idle; 0: unload after this request; -1: forever"
    ),
    "think": FieldPolicy(L, "on or off where the model's template can (a level counts as on)"),
    "logprobs": FieldPolicy(H, "the model's log-probabilities (before sampling), with bytes"),
    "top_logprobs": FieldPolicy(H, "0 to 20 alternatives per token; needs `logprobs: true`"),
}
register(
    "POST /api/chat",
    OllamaChatRequest,
    {
        **_GENERATION_POLICY,
        "messages": FieldPolicy(H, "roles system, user, assistant (with `tool_calls`), tool; none: load"),
        "tools": FieldPolicy(H, "function tools: the model's own call format if its template has one, else JSON"),
    },
)
register(
    "POST /api/generate",
    OllamaGenerateRequest,
    {
        **_GENERATION_POLICY,
        "prompt": FieldPolicy(H, "rendered with the model's chat template as a user turn; none: load"),
        "system": FieldPolicy(H, "a system turn before the prompt"),
        "raw": FieldPolicy(H, "true: the prompt as written, no template"),
        "suffix": FieldPolicy(L, "empty only"),
        "template": FieldPolicy(L, "empty only: the model's own chat template"),
        "context": FieldPolicy(L, "empty only (Ollama's deprecated token state; send the conversation)"),
        "images": FieldPolicy(L, "empty only: text models"),
        "width": FieldPolicy(R, "image generation"),
        "height": FieldPolicy(R, "image generation"),
        "steps": FieldPolicy(R, "image generation"),
    },
)
_LOAD_TIME_POLICY = FieldPolicy(R, "a load-time option: the instance's (POST /v1/instances)")
register(
    "Ollama options",
    OllamaOptions,
    {
        "num_predict": FieldPolicy(H, "-1 (default): until the model stops or its context is full; -2 is refused"),
        "temperature": FieldPolicy(H, "default 0.8; 0 is greedy"),
        "top_p": FieldPolicy(H, "default 0.9"),
        "top_k": FieldPolicy(H, "default 40; 0 keeps every token"),
        "min_p": FieldPolicy(H, "default 0"),
        "seed": FieldPolicy(H, "-1: random"),
        "stop": FieldPolicy(H, "up to 16 strings, never emitted"),
        "repeat_penalty": FieldPolicy(H, "default 1.1, over the last 64 tokens"),
        "presence_penalty": FieldPolicy(H, "over the tokens generated so far"),
        "frequency_penalty": FieldPolicy(H, "over the tokens generated so far"),
        "repeat_last_n": FieldPolicy(L, "64 only: the window the penalty looks back over"),
        "typical_p": FieldPolicy(L, "1.0 (off) only"),
        "tfs_z": FieldPolicy(L, "1.0 (off) only"),
        "mirostat": FieldPolicy(L, "0 (off) only"),
        "mirostat_tau": FieldPolicy(M, "mirostat's: with mirostat 0 it changes nothing, as in Ollama"),
        "mirostat_eta": FieldPolicy(M, "mirostat's: with mirostat 0 it changes nothing, as in Ollama"),
        "penalize_newline": FieldPolicy(L, "false only"),
        "num_keep": FieldPolicy(R, "no context shifting: a generation ends when its context is full"),
        "num_ctx": FieldPolicy(H, "the request's context (prompt and answer), at most the instance's n_ctx"),
        **{name: _LOAD_TIME_POLICY for name in LOAD_TIME},
    },
)
register(
    "Ollama chat message",
    OllamaMessage,
    {
        "role": FieldPolicy(H, returned=True),
        "content": FieldPolicy(H, returned=True),
        "images": FieldPolicy(L, "empty only: text models"),
        "tool_calls": FieldPolicy(H, "an earlier assistant turn's calls, shown to the model", returned=True),
        "tool_name": FieldPolicy(H, "the tool a result comes from, shown to the model"),
        "tool_call_id": FieldPolicy(H, "the call a result answers, shown to the model"),
        "thinking": FieldPolicy(H, THINKING, returned=True),
    },
)
_EMBED_POLICY = {
    "model": FieldPolicy(H, "an instance started for embeddings (llama.cpp option `embedding: true`)"),
    "options": FieldPolicy(L, "empty only: sampling options do not apply, load-time ones are the instance's"),
    "keep_alive": _GENERATION_POLICY["keep_alive"],
}
register(
    "POST /api/embed",
    OllamaEmbedRequest,
    {
        **_EMBED_POLICY,
        "input": FieldPolicy(H, "a string or a list of strings; unit-length vectors"),
        "truncate": FieldPolicy(H, "true (default): an input too long keeps its first n_ctx tokens; false: a 400"),
        "dimensions": FieldPolicy(R, "the vector has the model's size"),
    },
)
register(
    "POST /api/embeddings",
    OllamaEmbeddingsRequest,
    {
        **_EMBED_POLICY,
        "prompt": FieldPolicy(H, "one string; a unit-length vector (Ollama's is not normalised); cut to n_ctx tokens"),
    },
)
register(
    "POST /api/show",
    OllamaShowRequest,
    {
        "model": FieldPolicy(H, "the instance"),
        "name": FieldPolicy(H, "Ollama's older name for `model`"),
        "verbose": FieldPolicy(L, "false only: the tokenizer's arrays are not read"),
    },
)

_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decode(struct: type[Any], body: bytes) -> Any:
    decoder = _decoders.get(struct)
    if decoder is None:
        decoder = _decoders[struct] = msgspec.json.Decoder(struct)
    return decode_body(decoder, body)


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
        "repeat_penalty": DEFAULTS["repeat_penalty"] if o.repeat_penalty is None else o.repeat_penalty,
        "presence_penalty": o.presence_penalty or 0.0,
        "frequency_penalty": o.frequency_penalty or 0.0,
        "context": o.num_ctx,
    }


def format_schema(fmt: str | dict[str, Any] | None) -> str | None:
    """``format`` as ``GenerateParams.json_schema``: "json" is any JSON object, an object is a JSON Schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json" or fmt == {}:
        return '{"type": "object"}'
    if isinstance(fmt, str):
        raise InvalidField("format", f'format must be "json" or a JSON Schema object, got {fmt!r}')
    return schema_text(fmt, "format")


def _common(body: _Generation) -> dict[str, Any]:
    """What chat and generate requests share: checks, then the sampling and logprobs fields."""
    keep_alive_seconds(body.keep_alive)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")
    return {"logprobs": (body.top_logprobs or 0) if body.logprobs else None, **sampling(body.options)}


_OPTION_OF = {
    "max_tokens": "num_predict",
    **{name: name for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty")},
    **{name: name for name in ("presence_penalty", "frequency_penalty")},
    "context": "num_ctx",
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


def chat_turns(messages: list[OllamaMessage]) -> list[Turn]:
    """Ollama's messages as the conversation: a call's arguments stay the object Ollama sends, and ``thinking`` is
    the turn's reasoning. Every message's role and images are checked before any message's calls."""
    turns = []
    for i, message in enumerate(messages):
        role = message.role
        if not is_role(role):
            raise InvalidField(
                f"messages[{i}].role",
                f"messages[{i}].role must be one of {', '.join(map(repr, ROLES))}, got {message.role!r}",
            )
        _empty(message.images, f"messages[{i}].images", "text models only")
        calls = tuple(Call(c.function.name, c.function.arguments, c.id) for c in message.tool_calls or ())
        result = role == "tool"  # a tool's result: the call it answers, and the tool's name as the client gives it
        answers, tool = (message.tool_call_id, message.tool_name) if result else (None, None)
        reasoning = thinking_of(message.thinking, None, role, f"messages[{i}]", "thinking")
        turns.append(Turn(role, message.content, calls, answers=answers, tool=tool, reasoning=reasoning))
    for i, turn in enumerate(turns):
        if turn.calls and turn.role != "assistant":
            raise InvalidField(f"messages[{i}].tool_calls", f"messages[{i}]: only assistant turns carry tool_calls")
    return turns


def uses_tools(body: OllamaChatRequest) -> bool:
    """Whether the chat declares tools or carries earlier calls or results (its model's tool format matters)."""
    return bool(body.tools) or any(m.tool_calls or m.role == "tool" for m in body.messages or ())


def wants_thinking(body: _Generation) -> bool | None:
    """``think`` as on, off or unsaid (a level, gpt-oss's way, is on: a template turns thinking on or off)."""
    return body.think if body.think is None or isinstance(body.think, bool) else True


def chat_plan(
    body: OllamaChatRequest, fmt: toolkit.ToolFormat = toolkit.GENERIC, thinking: bool | None = None
) -> Plan | None:
    """The chat's plan (``fmt``: the model's tool format; ``thinking``: ``GenerateParams.thinking``); None for a
    request without messages (Ollama's "load the model")."""
    common = _common(body)
    json_schema = format_schema(body.format)
    tools = toolkit.plan(declared_tools(body.tools), None, None, fmt)
    if not body.messages:
        checked(GenerateParams(prompt="", **common))  # a load request's options are checked too
        if tools is not None:
            tools.apply([], json_schema, "format")  # and tools beside a format are refused there too
        return None
    turns = chat_turns(body.messages)
    messages = toolkit.engine_messages(turns, fmt)
    tools = toolkit.settle(tools, latest_calls(turns))
    syntax = None
    if tools is not None:
        json_schema, syntax = tools.apply(messages, json_schema, "format")
    params = GenerateParams(
        messages=tuple(messages),
        json_schema=json_schema,
        tool_syntax=syntax,
        fit_context=True,
        thinking=thinking,
        **common,
    )
    keep = keep_alive_seconds(body.keep_alive)
    return Plan(checked(params), body.model, body.stream, False, body.logprobs, tools, keep)


def generate_plan(body: OllamaGenerateRequest, thinking: bool | None = None, templated: bool = True) -> Plan | None:
    """The generation's plan; None for a request without a prompt (Ollama's "load the model"). ``templated``: the
    model has a chat template; without one the prompt is read as written (Ollama's template is then
    ``{{ .Prompt }}``), after the system prompt and a blank line when one is given."""
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
    if body.raw or not templated:
        prompt = f"{body.system}\n\n{body.prompt}" if body.system and not body.raw else body.prompt
        params = GenerateParams(prompt=prompt, json_schema=json_schema, **common)
    else:
        turns = [ChatMessage(role="system", content=body.system)] if body.system else []
        turns.append(ChatMessage(role="user", content=body.prompt))
        params = GenerateParams(
            messages=tuple(turns), json_schema=json_schema, fit_context=True, thinking=thinking, **common
        )
    keep = keep_alive_seconds(body.keep_alive)
    return Plan(checked(params), body.model, body.stream, False, body.logprobs, keep_alive=keep)


def embed_texts(body: OllamaEmbedRequest) -> list[str]:
    """The inputs to embed: an empty string is none, as in Ollama (which answers it with no vectors)."""
    if isinstance(body.input, str):
        return [body.input] if body.input else []
    return body.input


def embed_inputs(texts: list[str], body: OllamaEmbedRequest | OllamaEmbeddingsRequest) -> list[EmbedParams]:
    keep_alive_seconds(body.keep_alive)
    if body.options:
        name = next(iter(body.options))
        raise InvalidField(
            f"options.{name}",
            f"options.{name}: no option applies to an embedding (sampling ones do nothing, load-time ones are the "
            "instance's, set when it is started with POST /v1/instances): remove it",
        )
    cut = True  # Ollama's default: an input too long keeps its first n_ctx tokens
    if isinstance(body, OllamaEmbedRequest):
        if body.dimensions is not None:
            raise InvalidField("dimensions", "dimensions is not supported: the vector has the model's size")
        cut = body.truncate is not False
    return embedding_tasks(texts, fit_context=cut)


def show_model(body: OllamaShowRequest) -> str | None:
    """The model ``/api/show`` asks about (``name`` is Ollama's older field for it)."""
    if body.verbose:
        raise InvalidField("verbose", "verbose is not supported: the tokenizer's arrays are not read (omit it)")
    return body.model if body.model is not None else body.name


# --------------------------------------------------------------------------------------------------------------
# Reply types: JSON objects and NDJSON lines (errors: ``views.OllamaErrorBody``)
# --------------------------------------------------------------------------------------------------------------


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
    thinking: str | UnsetType = UNSET  # a reasoning model's thinking (kept apart from content whether or not asked)


# "load" / "unload": a request without a prompt, answered once its model is loaded (or, with keep_alive 0, unloaded)
OllamaDoneReason = Literal["stop", "length", "load", "unload"]


class OllamaChatChunk(msgspec.Struct):
    model: str
    created_at: str  # RFC 3339
    message: OllamaMessageOut
    done: Literal[False]
    logprobs: list[views.LogprobOut] | None = None


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
    logprobs: list[views.LogprobOut] | None = None
    truncated_messages: int | UnsetType = UNSET  # the chat's oldest turns left out to fit the context (when any)


class OllamaGenerateChunk(msgspec.Struct):
    model: str
    created_at: str
    response: str
    done: Literal[False]
    thinking: str | UnsetType = UNSET
    logprobs: list[views.LogprobOut] | None = None


class OllamaGenerateDone(msgspec.Struct):
    model: str
    created_at: str
    response: str
    done: Literal[True]
    done_reason: OllamaDoneReason
    thinking: str | UnsetType = UNSET
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[views.LogprobOut] | None = None
    truncated_messages: int | UnsetType = UNSET  # the chat's oldest turns left out to fit the context (when any)


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
    capabilities: list[str]  # Ollama's names: "completion", "tools", "embedding" (an embedding instance: that alone)


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
    context_length: int | UnsetType = UNSET  # the model's n_ctx, when it sets one


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
    version: str  # the Ollama release whose API tether speaks (tether's own: the X-Tether-Version header)


# --------------------------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------------------------

_encode = msgspec.json.Encoder().encode


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


class OllamaShaper:
    """One request's NDJSON lines or whole object, in Ollama's chat or generate shape (see ``generation.Shaper``).

    A tool answer streams as it is decided (``toolkit.AnswerStream``): a direct answer's text as content pieces,
    each call whole in a line of its own once its arguments are complete (as Ollama sends them).
    """

    media_type = NDJSON
    load_seconds = 0.0  # set by the API: how long the request waited for its model to load

    def __init__(
        self, kind: Literal["chat", "generate"], model: str, plan: Plan, started: float, request_id: str = ""
    ) -> None:
        self.kind = kind
        self.model = model
        self.plan = plan
        self.started = started
        self.request_id = request_id
        self.dropped = 0  # the chat's turns left out to fit the context (the final chunk says)
        self.text: list[str] = []
        self.thinking: list[str] = []  # a reasoning model's, kept apart by the runner
        self.logprobs: list[TokenLogprob] = []
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.answer = plan.tools.stream() if plan.tools is not None else None

    def opening(self) -> bytes:
        return b""

    def feed(self, chunk: Chunk) -> bytes:
        self.dropped = chunk.dropped_messages or self.dropped
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.text.append(chunk.text)
        logprobs = list(chunk.logprobs) if self.plan.logprobs else []
        self.logprobs.extend(logprobs)
        thought = b""
        if chunk.reasoning:
            self.thinking.append(chunk.reasoning)
            thought = self._line(self._object("", thinking=chunk.reasoning))
        if self.answer is not None:
            return thought + self._tool_lines(self.answer.feed(chunk.text))
        if not (chunk.text or logprobs):
            return thought
        return thought + self._line(self._object(chunk.text, logprobs=logprobs))

    def closing(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        out = b""
        if self.answer is not None:
            out += self._tool_lines(self.answer.finish())
        return out + self._line(self._object("", self._stats(finish, prompt_tokens, completion_tokens)))

    def whole(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        content: str | None = "".join(self.text)
        calls: list[toolkit.ToolCall] = []
        if self.answer is not None:  # a tool answer cut by a limit: what of it was decided, no JSON
            self.answer.finish()
            content, calls = self.answer.content, self.answer.calls
        stats = self._stats(finish, prompt_tokens, completion_tokens)
        thought = "".join(self.thinking)
        return _encode(self._object(content or "", stats, calls=calls, logprobs=self.logprobs, thinking=thought))

    def stream_error(self, failure: Answer) -> bytes:
        """The line that ends a failed stream: the ``ollama`` clients raise ``ResponseError`` with its message."""
        return self.error_body(failure) + b"\n"

    def error_body(self, failure: Answer) -> bytes:
        return failure.body("ollama")

    def _tool_lines(self, events: list[toolkit.Event]) -> bytes:
        """A tool answer's events as lines: its text as content pieces, each call once complete."""
        out = b""
        for event in events:
            if isinstance(event, toolkit.Text):
                out += self._line(self._object(event.text))
            elif isinstance(event, toolkit.CallClosed):
                message = {"role": "assistant", "content": "", "tool_calls": [tool_call_json(event.index, event.call)]}
                out += self._line({**self._object(""), "message": message})
        return out

    def _stats(self, finish: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        end = time.monotonic()
        first = self.first_at if self.first_at is not None else end
        last = self.last_at if self.last_at is not None else end
        fitted: dict[str, Any] = {}
        if self.dropped > 0:  # Ollama drops them silently; here the client and the log are told
            fitted["truncated_messages"] = self.dropped
            log.info(
                "request %s: the chat was longer than %s's context: its %d oldest turn(s) were left out (system "
                "messages and the latest turns kept, %d prompt tokens read)",
                self.request_id or "?",
                self.model,
                self.dropped,
                prompt_tokens,
            )
        return {
            "done_reason": "length" if finish == "length" else "stop",
            "total_duration": ns(end - self.started),
            "load_duration": ns(self.load_seconds),  # waiting for the model's load (0 when it was loaded)
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": ns(max(first - self.started - self.load_seconds, 0.0)),
            "eval_count": completion_tokens,
            "eval_duration": ns(last - first),
            **fitted,
        }

    def _object(
        self,
        text: str,
        stats: dict[str, Any] | None = None,
        *,
        calls: list[toolkit.ToolCall] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        thinking: str = "",
    ) -> dict[str, Any]:
        obj: dict[str, Any] = {"model": self.model, "created_at": rfc3339(time.time())}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [tool_call_json(i, c) for i, c in enumerate(calls)]
            obj["message"] = message
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = stats is not None
        if stats is not None:
            obj.update(stats)
        if logprobs and self.plan.logprobs:
            obj["logprobs"] = [views.chat_logprob(e) for e in logprobs]
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


def parameters_text(item: ListedModel) -> str:
    """Ollama's ``parameters``: the defaults a request without options gets here."""
    options = options_of(item)
    values: dict[str, Any] = {**DEFAULTS}
    if isinstance(options.get("n_ctx"), int):
        values["num_ctx"] = options["n_ctx"]
    return "\n".join(f"{name:<30} {value}" for name, value in values.items())


def details_of(f: ModelFacts) -> OllamaDetails:
    return msgspec.convert(f.details, OllamaDetails)


def tag_out(item: ListedModel, f: ModelFacts) -> OllamaTag:
    return OllamaTag(
        name=item.id,
        model=item.id,
        modified_at=rfc3339(f.modified_at),
        size=f.size,
        digest=f.digest,
        details=details_of(f),
        capabilities=capabilities(item),
    )


async def loaded_out(hosted: Hosted, f: ModelFacts, expires_in: float | None) -> OllamaLoaded:
    """A loaded model: its memory sampled now (the footprint, plus the mapped weights that are resident), and when
    keep-alive unloads it (``expires_in`` seconds from now; None: not counting down)."""
    size, vram = f.size, 0
    sup = hosted.supervisor
    if sup is not None and sup.alive:
        memory = await sup.sample_memory()
        if memory is not None:
            size, vram = memory.footprint + memory.file, memory.gpu or 0
    item = ListedModel.of(hosted)
    n_ctx = options_of(item).get("n_ctx")
    return OllamaLoaded(
        name=item.id,
        model=item.id,
        modified_at=rfc3339(f.modified_at),
        size=size,
        digest=f.digest,
        details=details_of(f),
        size_vram=vram,
        expires_at=FOREVER if expires_in is None else rfc3339(time.time() + expires_in),
        context_length=n_ctx if isinstance(n_ctx, int) else UNSET,
    )


# --------------------------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------------------------


def _generation_answer(chunk: type, done: type) -> dict[str, Any]:
    lines = {"type": "array", "items": {"anyOf": [ref(chunk), ref(done), ref(views.OllamaErrorBody)]}}
    return {
        "200": {
            "description": f"the {done.__name__} (``stream: false``) or NDJSON lines (the default): pieces, then a "
            "``done: true`` line with the counts and durations, or an ``error`` line carrying the cause when the "
            "runner fails",
            "content": {"application/json": {"schema": ref(done)}, NDJSON: {"schema": lines}},
        }
    }


def routes(api: Api) -> list[Route]:
    """Ollama's routes, answering through ``api``; their errors take Ollama's shape by their path (``statuses``)."""
    fleet, scheduler = api.fleet, api.scheduler

    async def generation(request: Request, kind: Literal["chat", "generate"]) -> Response:
        started = time.monotonic()
        endpoint = f"ollama_{kind}"
        struct = OllamaChatRequest if kind == "chat" else OllamaGenerateRequest
        body = decode(struct, await request.body())
        model_id = scheduler.resolve(body.model)
        think = await thinking.switch(scheduler, model_id, wants_thinking(body), "think")
        if isinstance(body, OllamaChatRequest):
            fmt = await toolkit.format_for(scheduler, model_id) if uses_tools(body) else toolkit.GENERIC
            make: Callable[[], Plan | None] = functools.partial(chat_plan, body, fmt, think)
        else:
            templated = body.raw or await toolkit.template_of(scheduler, model_id) != ""
            make = functools.partial(generate_plan, body, think, templated)
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
            return json_response(answer)
        request_id = new_request_id(f"ollama-{kind}")
        shaper = OllamaShaper(kind, model_id, plan, started, request_id)
        return await api.respond(model_id, plan, shaper, request_id, endpoint, started)

    async def chat(request: Request) -> Response:
        return await generation(request, "chat")

    async def generate(request: Request) -> Response:
        return await generation(request, "generate")

    async def embed(request: Request) -> Response:
        started = time.monotonic()
        body = decode(OllamaEmbedRequest, await request.body())
        model_id = scheduler.resolve(body.model)
        inputs = api.planned(model_id, "ollama_embed", lambda: embed_inputs(embed_texts(body), body))
        keep = keep_alive_seconds(body.keep_alive)
        embed_id = new_request_id("ollama-embed")
        chunks = await api.embed(model_id, inputs, embed_id, "ollama_embed", keep) if inputs else []
        return json_response(
            OllamaEmbedOut(
                model=model_id,
                embeddings=[list(c.embedding or ()) for c in chunks],
                total_duration=ns(time.monotonic() - started),
                load_duration=0,
                prompt_eval_count=sum(c.prompt_tokens for c in chunks),
            )
        )

    async def embeddings_(request: Request) -> Response:
        body = decode(OllamaEmbeddingsRequest, await request.body())
        model_id = scheduler.resolve(body.model)
        inputs = api.planned(model_id, "ollama_embeddings", lambda: embed_inputs([body.prompt or ""], body))
        if not body.prompt:  # Ollama answers an empty prompt with an empty vector (it loads the model)
            return json_response(OllamaEmbeddingOut(embedding=[]))
        keep = keep_alive_seconds(body.keep_alive)
        chunks = await api.embed(model_id, inputs, new_request_id("ollama-embd"), "ollama_embeddings", keep)
        return json_response(OllamaEmbeddingOut(embedding=list(chunks[0].embedding or ())))

    async def tags() -> Response:
        models = []
        for item in listed(scheduler):
            models.append(tag_out(item, await anyio.to_thread.run_sync(facts, item)))
        return json_response(OllamaTags(models=models))

    async def ps() -> Response:
        models = []
        now = scheduler.now()
        for hosted in fleet.list():
            if isinstance(hosted.instance.state, InstanceReady):
                slot = scheduler.slots.get(hosted.id)
                expires = slot.expires_in(now) if slot is not None else None
                f = await anyio.to_thread.run_sync(facts, ListedModel.of(hosted))
                models.append(await loaded_out(hosted, f, expires))
        return json_response(OllamaPs(models=models))

    async def show(request: Request) -> Response:
        model_id = scheduler.resolve(show_model(decode(OllamaShowRequest, await request.body())))
        item = next(i for i in listed(scheduler) if i.id == model_id)
        f = await anyio.to_thread.run_sync(facts, item)
        return json_response(
            OllamaShow(
                modelfile="",
                parameters=parameters_text(item),
                template=f.template,
                license=f.license,
                details=details_of(f),
                model_info=f.model_info,
                capabilities=capabilities(item),
                modified_at=rfc3339(f.modified_at),
            )
        )

    async def version() -> Response:
        return json_response(OllamaVersion(version=OLLAMA_VERSION), headers={TETHER_VERSION: tether.__version__})

    errors = GENERATION_ERRORS
    return [
        Route(
            "/api/chat",
            "POST",
            chat,
            "Ollama chat",
            _generation_answer(OllamaChatChunk, OllamaChatDone),
            errors,
            OllamaChatRequest,
        ),
        Route(
            "/api/generate",
            "POST",
            generate,
            "Ollama completion",
            _generation_answer(OllamaGenerateChunk, OllamaGenerateDone),
            errors,
            OllamaGenerateRequest,
        ),
        Route(
            "/api/embed",
            "POST",
            embed,
            "Ollama embeddings, one unit-length vector per input",
            {"200": json_answer(OllamaEmbedOut, "the vectors")},
            errors,
            OllamaEmbedRequest,
        ),
        Route(
            "/api/embeddings",
            "POST",
            embeddings_,
            "Ollama's older embeddings route: one prompt, one vector",
            {"200": json_answer(OllamaEmbeddingOut, "the vector")},
            errors,
            OllamaEmbeddingsRequest,
        ),
        Route(
            "/api/tags",
            "GET",
            tags,
            "every model, as Ollama lists them",
            {"200": json_answer(OllamaTags, "them")},
        ),
        Route("/api/ps", "GET", ps, "the loaded models", {"200": json_answer(OllamaPs, "them")}),
        Route(
            "/api/show",
            "POST",
            show,
            "one model: its GGUF metadata, chat template and capabilities",
            {"200": json_answer(OllamaShow, "the model")},
            (400, 404, 413),
            OllamaShowRequest,
        ),
        Route(
            "/api/version",
            "GET",
            version,
            "the Ollama release whose API tether speaks (tether's own version: the X-Tether-Version header)",
            {"200": json_answer(OllamaVersion, "it")},
        ),
    ]
