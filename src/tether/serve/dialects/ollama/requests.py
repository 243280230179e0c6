"""Ollama's request bodies, what tether does with each of their fields (``fields``), and the JSON Schema rules
their types cannot state (``SCHEMA_RULES``, for ``/openapi.json``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from tether.fleet.catalog import KeepAlive
from tether.protocol import (
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    PENALTY_RANGE,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    documented,
)
from tether.serve.dialects.conversation import ROLES
from tether.serve.dialects.fields import HONOURED as H
from tether.serve.dialects.fields import LIMITED as L
from tether.serve.dialects.fields import METADATA as M
from tether.serve.dialects.fields import REFUSED as R
from tether.serve.dialects.fields import FieldPolicy, register
from tether.serve.dialects.plan import MAX_INPUTS, decode_body
from tether.serve.dialects.rules import ASSISTANT_CALLS_RULE, LOGPROBS_RULE, assistant_only
from tether.serve.dialects.shapes import THINKING, FunctionTool

MAX_STOPS = 16  # Ollama sets no limit; model files carry a few stop strings, a bound keeps a request bounded


PENALTY_WINDOW = 64  # the tokens repeat_penalty looks back over (llama.cpp engine), Ollama's repeat_last_n default


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


class OllamaRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a chat and a generate body share."""

    model: str | None = None
    format: Format | None = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None


class OllamaChatRequest(OllamaRequest, kw_only=True):
    messages: list[OllamaMessage] = msgspec.field(default_factory=list)
    tools: list[FunctionTool] | None = None


class OllamaGenerateRequest(OllamaRequest, kw_only=True):
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
