"""OpenAI's wire format: request bodies in, completion objects and SSE chunks out, errors in OpenAI's shape.

Bodies are decoded with msgspec (typed, with the offending field named in the error) into structs that refuse
fields they do not declare, as OpenAI's API does. Every declared field is honoured or refused with a 400 naming
it, or is metadata that changes nothing; each struct registers which (``fields``), and the docs' field reference is made
from that. A request becomes a ``Plan``: the ``GenerateParams`` the runner gets, plus how the answer is shaped
(streaming, usage, logprobs, tool calls).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Annotated, Any, Literal

import anyio
import msgspec
from fastapi import Request
from fastapi.responses import Response
from msgspec import UNSET, UnsetType

from tether.errors import InvalidField, NotFound
from tether.fleet.catalog import KeepAlive, keep_alive_seconds
from tether.fleet.facts import ListedModel, capabilities
from tether.fleet.fleet import new_request_id
from tether.fleet.scheduler import Scheduler
from tether.node.instance import InstanceReady
from tether.protocol import (
    LOGIT_BIAS_RANGE,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    PENALTY_RANGE,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    Chunk,
    GenerateParams,
    TokenLogprob,
    documented,
    tag_of,
)
from tether.serve import views
from tether.serve.dialects import template_args, thinking
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.conversation import NamedTool, latest_calls
from tether.serve.dialects.fields import EXTENSION as E
from tether.serve.dialects.fields import HONOURED as H
from tether.serve.dialects.fields import LIMITED as L
from tether.serve.dialects.fields import METADATA as M
from tether.serve.dialects.fields import REFUSED as R
from tether.serve.dialects.fields import FieldPolicy, register
from tether.serve.dialects.plan import DEFAULT_MAX_TOKENS, Plan, checked, decode_body, schema_text
from tether.serve.dialects.rules import LOGPROBS_RULE, STRUCTURED_FORMAT, TOOL_CHOICE_RULE, structured_beside_tools
from tether.serve.dialects.shapes import (
    FunctionTool,
    MessageIn,
    Prediction,
    Tokens,
    declared_tools,
    message_turns,
    prediction_text,
)
from tether.serve.generation import Api, Speculation
from tether.serve.routes import GENERATION_ERRORS, SSE, Route, json_answer, json_response, path_parameter, ref, sse_of
from tether.serve.statuses import Answer

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_STOPS = 4  # OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions API


Stops = str | Annotated[list[str], documented(maxItems=MAX_STOPS)]
Penalty = Annotated[float, documented(minimum=PENALTY_RANGE[0], maximum=PENALTY_RANGE[1])]
Seed = Annotated[int, documented(minimum=SEED_RANGE[0], maximum=SEED_RANGE[1] - 1)]
Bias = Annotated[
    dict[str, Annotated[float, documented(minimum=LOGIT_BIAS_RANGE[0], maximum=LOGIT_BIAS_RANGE[1])]],
    documented(propertyNames={"pattern": "^[0-9]{1,9}$"}),  # a token id below MAX_TOKENS_LIMIT
]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI pads streamed chunks against side channels; nothing to pad here


class JsonSchema(msgspec.Struct, forbid_unknown_fields=True):
    name: str = "response"
    schema: dict[str, Any] = msgspec.field(default_factory=dict)
    strict: bool | None = None  # the grammar enforces the schema whether or not strict is set
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Annotated[str, documented(enum=["text", "json_object", "json_schema"])] = "text"
    json_schema: JsonSchema | None = None


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedChoice(msgspec.Struct, forbid_unknown_fields=True):
    function: NamedFunction
    type: Annotated[str, documented(enum=["function"])] = "function"


ToolChoiceIn = Annotated[str, documented(enum=["none", "auto", "required"])] | NamedChoice


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    max_tokens: Tokens | None = None
    temperature: Annotated[float, documented(minimum=TEMPERATURE_RANGE[0], maximum=TEMPERATURE_RANGE[1])] = 1.0
    top_p: Annotated[float, documented(exclusiveMinimum=0, maximum=1)] = 1.0
    stop: Stops | None = None
    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Bias | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, documented(enum=[1], description="one choice per request")] = 1
    user: str | None = None
    # llama.cpp's extensions
    top_k: Annotated[int, documented(minimum=0, maximum=MAX_TOKENS_LIMIT)] | None = None
    min_p: Annotated[float, documented(minimum=0, maximum=1)] | None = None
    repeat_penalty: Annotated[float, documented(exclusiveMinimum=0, maximum=10)] | None = None
    # Ollama's, for the catalog's models
    keep_alive: KeepAlive | None = None
    # OpenAI's Predicted Outputs (chat's; completions take it too): text the answer is expected to largely repeat
    prediction: Prediction | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: Annotated[list[MessageIn], documented(minItems=1)]
    max_completion_tokens: Tokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, documented(minimum=0, maximum=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: Annotated[bool, documented(enum=[False], description="tether keeps no completions")] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[Annotated[str, documented(enum=["text"])]] | None = None
    # refused whenever set: what they ask for does not exist here
    audio: Annotated[Any, documented(type="null", description="audio output is not supported")] = None
    # a reasoning model's thinking on ("minimal" to "high") or off ("none"), where its chat template can say so
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's, SGLang's and llama-server's: more variables for the model's chat template ({"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    verbosity: Annotated[Any, documented(type="null", description="not supported")] = None
    web_search_options: Annotated[Any, documented(type="null", description="web search is not supported")] = None
    functions: Annotated[Any, documented(type="null", description="deprecated: send tools")] = None
    function_call: Annotated[Any, documented(type="null", description="deprecated: send tool_choice")] = None


TokenId = Annotated[int, documented(minimum=0, maximum=MAX_TOKENS_LIMIT)]
# One prompt: a string, a list of one string, token ids, or a list of one list of token ids (OpenAI's legacy shapes;
# msgspec takes one array type in a union, so the list's items are any of them and the plan checks the mix).
PromptIn = (
    str | Annotated[list[str | TokenId | Annotated[list[TokenId], documented(minItems=1)]], documented(minItems=1)]
)


_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKENS_LIMIT}
PROMPT_SHAPES = {  # a string, token ids, or a list of one of them
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": _TOKEN_ID, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1}, "minItems": 1, "maxItems": 1},
    ]
}


class CompletionRequest(_Sampling, kw_only=True):
    prompt: PromptIn
    max_tokens: Annotated[int, documented(minimum=0, maximum=MAX_TOKENS_LIMIT)] | None = None  # 0: echo only
    logprobs: Annotated[int, documented(minimum=0, maximum=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False
    suffix: Annotated[str, documented(maxLength=0, description="suffix is not supported")] | None = None
    best_of: Annotated[int, documented(enum=[1], description="one candidate per request")] | None = None


BEYOND_SCHEMA = {  # 400s for rules JSON Schema cannot state (the API fuzzer accepts them; each says what to do)
    "tool_choice": "a named tool_choice must name one of the request's tools",
    "tools": "tool names must be unique",
    "reasoning_effort": "thinking on or off only where the model's chat template can say so",
    "chat_template_kwargs": "a variable the model's chat template reads, named as an identifier, "
    "enable_thinking a boolean agreeing with reasoning_effort",
    "messages.reasoning": "reasoning_content and reasoning, when both are sent, the same text",
}
SCHEMA_RULES: dict[str, dict[str, Any]] = {
    # what one field's type cannot say, for /openapi.json (the plan's checks enforce it, with a message)
    "ChatRequest": {
        "allOf": [
            LOGPROBS_RULE,
            TOOL_CHOICE_RULE,
            {"not": structured_beside_tools("response_format", STRUCTURED_FORMAT)},
        ]
    },
    "CompletionRequest": {
        "allOf": [
            {  # max_tokens 0 is the echoed prompt alone (lm-eval's loglikelihood), so only with echo
                "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
                "then": {"required": ["echo"], "properties": {"echo": {"const": True}}},
            },
            {"properties": {"prompt": PROMPT_SHAPES}},  # one prompt (the type allows any mix in one list)
        ]
    },
    "ResponseFormat": {  # json_schema names its schema (response_schema refuses it otherwise)
        "if": {"required": ["type"], "properties": {"type": {"const": "json_schema"}}},
        "then": {
            "required": ["json_schema"],
            "properties": {
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {"schema": {"minProperties": 1}},
                }
            },
        },
    },
}
_SAMPLING_POLICY = {
    "model": FieldPolicy(H, "picks the model (loaded on demand); with one model loaded, any name reaches it"),
    "max_tokens": FieldPolicy(H, "default 512 for chat, 16 for completions"),
    "temperature": FieldPolicy(H, "0 is greedy"),
    "top_p": FieldPolicy(H),
    "stop": FieldPolicy(H, "up to 4 strings, never emitted, matched across tokens"),
    "seed": FieldPolicy(H, "same seed, same request, same instance: same text"),
    "presence_penalty": FieldPolicy(H, "over the tokens generated so far"),
    "frequency_penalty": FieldPolicy(H, "over the tokens generated so far"),
    "logit_bias": FieldPolicy(H, "token ids of the model's vocabulary; -100 bans, 100 forces"),
    "stream": FieldPolicy(H, "server-sent events"),
    "stream_options": FieldPolicy(H, "`include_usage`; `include_obfuscation` is metadata"),
    "n": FieldPolicy(L, "1 only"),
    "user": FieldPolicy(M),
    "top_k": FieldPolicy(E, "0 keeps every token; default 40 when temperature > 0"),
    "min_p": FieldPolicy(E, "default 0.05 when temperature > 0"),
    "repeat_penalty": FieldPolicy(E, "over the last 64 tokens; default: the instance's option (1.0)"),
    "keep_alive": FieldPolicy(E, "seconds or a duration ('5m') the model stays loaded when idle; 0 unloads, -1 never"),
}
register(
    "POST /v1/chat/completions",
    ChatRequest,
    {
        **_SAMPLING_POLICY,
        "messages": FieldPolicy(
            H, "roles system/developer, user, assistant (with `tool_calls`), tool; text parts only"
        ),
        "max_completion_tokens": FieldPolicy(H, "wins over `max_tokens`"),
        "logprobs": FieldPolicy(H, "the model's log-probabilities (before sampling), with bytes"),
        "top_logprobs": FieldPolicy(H, "0 to 20 alternatives per token; needs `logprobs: true`"),
        "response_format": FieldPolicy(H, "`text`, `json_object`, `json_schema`: grammar-constrained, always parses"),
        "tools": FieldPolicy(H, "function tools: the model's own call format if its template has one, else JSON"),
        "tool_choice": FieldPolicy(H, "`none`, `auto`, `required`, a named function"),
        "parallel_tool_calls": FieldPolicy(H, "false: at most one call"),
        "metadata": FieldPolicy(M),
        "store": FieldPolicy(L, "false or absent only: tether stores nothing"),
        "service_tier": FieldPolicy(M, "one tier here"),
        "prompt_cache_key": FieldPolicy(M, "prefix reuse is automatic (the `prompt_cache` option)"),
        "safety_identifier": FieldPolicy(M),
        "modalities": FieldPolicy(L, '`["text"]` only'),
        "audio": FieldPolicy(R),
        "prediction": FieldPolicy(
            H,
            "Predicted Outputs: `{type: content, content}` (a string or text parts) is drafted from by speculative "
            "decoding; usage reports `accepted_prediction_tokens` and `rejected_prediction_tokens`",
        ),
        "reasoning_effort": FieldPolicy(
            L, 'thinking on or off: "none" turns it off, any other effort on, where the model\'s template can'
        ),
        "chat_template_kwargs": FieldPolicy(
            E,
            "variables for the model's chat template, each one it reads (others are refused, naming those it "
            "reads); `enable_thinking` is the thinking switch and must agree with `reasoning_effort`",
        ),
        "verbosity": FieldPolicy(R),
        "web_search_options": FieldPolicy(R),
        "functions": FieldPolicy(R, "deprecated by OpenAI: send `tools`"),
        "function_call": FieldPolicy(R, "deprecated by OpenAI: send `tool_choice`"),
    },
)
register(
    "POST /v1/completions",
    CompletionRequest,
    {
        **_SAMPLING_POLICY,
        "prompt": FieldPolicy(L, "one prompt: a string or token ids (a list of ints), or a list of one of them"),
        "max_tokens": FieldPolicy(H, "default 16; 0 with `echo`: the prompt's logprobs alone"),
        "logprobs": FieldPolicy(H, "0 to 5 alternatives per token, OpenAI's legacy shape"),
        "echo": FieldPolicy(H, "the prompt leads the text; with `logprobs`, its tokens lead them (the first: null)"),
        "suffix": FieldPolicy(L, "empty only"),
        "best_of": FieldPolicy(L, "1 only"),
        "prediction": FieldPolicy(E, "chat's Predicted Outputs, here too (OpenAI documents it for chat only)"),
    },
)


_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def decode(kind: Literal["chat", "completion"], body: bytes) -> ChatRequest | CompletionRequest:
    if kind == "chat":
        return decode_body(_chat_decoder, body)
    return decode_body(_completion_decoder, body)


# --------------------------------------------------------------------------------------------------------------
# Requests to plans
# --------------------------------------------------------------------------------------------------------------


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOPS:
        raise InvalidField("stop", f"stop takes at most {MAX_STOPS} sequences, got {len(stops)}")
    return tuple(stops)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidField("logit_bias", f"logit_bias keys are token ids (digits, as strings), got {key!r}")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _refuse_set(request: msgspec.Struct, names: tuple[str, ...], why: str) -> None:
    for name in names:
        if getattr(request, name) is not None:
            raise InvalidField(name, f"{name} is not supported by this server ({why}): remove it from the request")


def sampling(request: _Sampling, max_tokens: int | None, default_max: int) -> dict[str, Any]:
    """The ``GenerateParams`` fields chat and text completion requests share."""
    if request.n != 1:
        raise InvalidField("n", f"n must be 1 (one choice per request; send n requests for n answers), got {request.n}")
    return {
        "max_tokens": default_max if max_tokens is None else max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stop": _stops(request.stop),
        "seed": request.seed,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logit_bias": _logit_bias(request.logit_bias),
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repeat_penalty": request.repeat_penalty,
        "prediction": prediction_text(request.prediction),
    }


def response_schema(fmt: ResponseFormat | None) -> str | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}'
    if fmt.type == "json_schema":
        if fmt.json_schema is None or not fmt.json_schema.schema:
            raise InvalidField("response_format.json_schema", "response_format json_schema needs json_schema.schema")
        return schema_text(fmt.json_schema.schema, "response_format.json_schema.schema")
    raise InvalidField(
        "response_format.type", f"response_format.type must be text, json_object or json_schema, got {fmt.type!r}"
    )


def uses_tools(request: ChatRequest) -> bool:
    """Whether the chat declares tools or carries earlier calls or results (its model's tool format matters)."""
    return bool(request.tools) or any(m.tool_calls or m.role == "tool" for m in request.messages)


def chat_plan(request: ChatRequest, fmt: toolkit.ToolFormat = toolkit.GENERIC, thinking: bool | None = None) -> Plan:
    _refuse_set(request, ("audio", "web_search_options", "verbosity"), "text only")
    _refuse_set(request, ("functions", "function_call"), "deprecated by OpenAI: send tools and tool_choice")
    if request.store:
        raise InvalidField("store", "store must be false or absent: this server stores no completions")
    if request.modalities is not None and set(request.modalities) - {"text"}:
        raise InvalidField("modalities", f'modalities must be ["text"] (text output only), got {request.modalities}')
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")
    turns = message_turns(request.messages)
    messages = toolkit.engine_messages(turns, fmt)
    choice = request.tool_choice
    named = NamedTool(choice.function.name) if isinstance(choice, NamedChoice) else choice
    tools = toolkit.plan(declared_tools(request.tools), named, request.parallel_tool_calls, fmt)
    tools = toolkit.settle(tools, latest_calls(turns))
    json_schema = response_schema(request.response_format)
    syntax = None
    if tools is not None:
        json_schema, syntax = tools.apply(messages, json_schema, "response_format")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    _, template_kwargs = thinking_wanted(request)
    params = GenerateParams(
        messages=tuple(messages),
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        json_schema=json_schema,
        tool_syntax=syntax,
        thinking=thinking,
        template_kwargs=template_kwargs,
        **sampling(request, max_tokens, DEFAULT_MAX_TOKENS),
    )
    return Plan(
        checked(params),
        request.model,
        request.stream,
        bool(request.stream_options and request.stream_options.include_usage),
        request.logprobs,
        tools,
        keep_alive_seconds(request.keep_alive),
    )


def thinking_wanted(request: ChatRequest) -> tuple[bool | None, str | None]:
    """Thinking on, off or unsaid (``reasoning_effort``, and ``chat_template_kwargs.enable_thinking``, which must
    agree), and the JSON text of the template's other variables (``template_args.split``)."""
    return template_args.split(request.chat_template_kwargs, thinking.wanted(request.reasoning_effort))


def completion_prompt(prompt: str | list[str | int | list[int]]) -> str | tuple[int, ...]:
    """The one prompt of a completions request: its text, or its token ids (OpenAI's legacy shapes: a string, token
    ids, or a list of one of them). Several prompts in one request (a batch) are refused: send one request each."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(item, int) for item in prompt):
        return tuple(item for item in prompt if isinstance(item, int))
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0] if isinstance(prompt[0], str) else tuple(prompt[0])
    kinds = sorted({"string" if isinstance(i, str) else "token id" if isinstance(i, int) else "list" for i in prompt})
    raise InvalidField(
        "prompt",
        f"prompt must be one prompt: a string, a list of token ids, or a list of one of them; got a list of "
        f"{len(prompt)} items ({', '.join(kinds)}). Send one request per prompt",
    )


def completion_plan(request: CompletionRequest) -> Plan:
    if request.suffix:
        raise InvalidField("suffix", "suffix is not supported by this server")
    if request.best_of not in (None, 1):
        raise InvalidField("best_of", f"best_of must be 1 (one candidate per request), got {request.best_of}")
    prompt = completion_prompt(request.prompt)
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidField("logprobs", f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {request.logprobs}")
    params = GenerateParams(
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_ids=None if isinstance(prompt, str) else prompt,
        echo=request.echo,
        logprobs=request.logprobs,
        **sampling(request, request.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS),
    )
    return Plan(
        checked(params),
        request.model,
        request.stream,
        bool(request.stream_options and request.stream_options.include_usage),
        request.logprobs is not None,
        keep_alive=keep_alive_seconds(request.keep_alive),
    )


def plan(
    body: ChatRequest | CompletionRequest, fmt: toolkit.ToolFormat = toolkit.GENERIC, thinking: bool | None = None
) -> Plan:
    return chat_plan(body, fmt, thinking) if isinstance(body, ChatRequest) else completion_plan(body)


# --------------------------------------------------------------------------------------------------------------
# Reply types: what /openapi.json says of the answers below
# --------------------------------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # of prompt_tokens, those whose KV the prompt cache supplied (not prefilled)


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int  # of completion_tokens, those that wrote only a reasoning model's thinking
    accepted_prediction_tokens: int  # tokens drafted from the request's ``prediction`` that the answer kept
    rejected_prediction_tokens: int  # tokens drafted from it and thrown away (they cost steps, not completion tokens)


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    speculation: views.SpeculationUsage  # tether's: speculative decoding's drafts and steps for this answer


class ChatLogprobs(msgspec.Struct):
    """``logprobs: true``: each generated token's log-probability under the model, and the ``top_logprobs`` most
    likely tokens at its position."""

    content: list[views.LogprobOut]
    refusal: None


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions API's logprobs (``logprobs: n``). With ``echo`` the prompt's tokens come first, and
    the first of them has null for its logprob and its alternatives (nothing precedes it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class FunctionCallDelta(msgspec.Struct):
    name: str | UnsetType = UNSET  # in a call's first delta
    arguments: str = ""  # more of the arguments' JSON text (the deltas joined are the arguments)


class ToolCallDelta(msgspec.Struct):
    """One streamed call's piece, as OpenAI streams it: the first carries its id, type and name, the next more of
    its arguments."""

    index: int
    function: FunctionCallDelta
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET


FinishReason = Literal["stop", "length", "tool_calls"]


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None  # null when the answer is tool calls
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | UnsetType = UNSET  # a reasoning model's thinking (llama-server's and DeepSeek's field)


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
    tool_calls: list[ToolCallDelta] | None = None  # a tool answer: a call's opening, or more of its arguments
    reasoning_content: str | UnsetType = UNSET  # more of a reasoning model's thinking


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


# --------------------------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------------------------

_encode = msgspec.json.Encoder().encode


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    reasoning_tokens: int = 0,
    speculation: Speculation | None = None,
) -> dict[str, Any]:
    drafted = speculation or Speculation()
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": drafted.details(reasoning_tokens),
        "speculation": drafted.usage(),
    }


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Tokens in the legacy completions API's logprobs shape; ``offset``: the text before them (streaming)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {  # an echoed prompt's first token has no logprob (NaN from the runner): null, as vLLM answers
        "tokens": [e.token for e in entries],
        "token_logprobs": [None if math.isnan(e.logprob) else e.logprob for e in entries],
        "top_logprobs": [None if math.isnan(e.logprob) else {t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


class OpenAIShaper:
    """One request's OpenAI chat or completion objects and SSE chunks (see ``generation.Shaper``).

    A tool answer streams as it is decided (``toolkit.AnswerStream``): a direct answer's text as content deltas, each
    call as OpenAI streams one (a first delta with its index, id, type and name, then its arguments' text).
    """

    media_type = "text/event-stream"
    load_seconds = 0.0  # set by the API: how long the request waited for its model to load

    def __init__(
        self, kind: Literal["chat", "completion"], request_id: str, model: str, plan: Plan | None = None
    ) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.plan = plan or Plan(GenerateParams(prompt=""), None)
        self.text: list[str] = []
        self.reasoning: list[str] = []  # a reasoning model's thinking, kept apart by the runner
        self.logprobs: list[TokenLogprob] = []
        self._offset = 0  # streamed text so far (completion logprobs' text_offset)
        self.cached_tokens = 0  # from the final chunk
        self.speculation = Speculation()  # from the final chunk
        self.reasoning_tokens = 0  # of the completion's tokens, those that wrote only thinking
        self.answer = self.plan.tools.stream() if self.plan.tools is not None else None

    # --- generation.Shaper ---------------------------------------------------------------------------------------

    def opening(self) -> bytes:
        return self.chunk("", None, first=True)

    def feed(self, chunk: Chunk) -> bytes:
        self.text.append(chunk.text)
        thought = b""
        if chunk.reasoning:
            self.reasoning.append(chunk.reasoning)
            self.reasoning_tokens += chunk.tokens if not chunk.text else 0
            thought = self._sse(self._chunk_obj({"reasoning_content": chunk.reasoning}))
        if chunk.finish_reason is not None:
            self.cached_tokens = chunk.cached_tokens
            self.speculation = Speculation.of(chunk)
        if self.plan.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if self.answer is not None:
            return thought + self._tool_deltas(self.answer.feed(chunk.text))
        if not (chunk.text or (self.plan.logprobs and chunk.logprobs)):
            return thought  # the finish reason goes in a chunk of its own
        return thought + self.chunk(chunk.text, None, logprobs=list(chunk.logprobs) if self.plan.logprobs else None)

    def closing(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        out = b""
        if self.answer is not None:
            out += self._tool_deltas(self.answer.finish())
        out += self.chunk("", self._finish(finish))
        if self.plan.include_usage:
            out += self.usage_chunk(prompt_tokens, completion_tokens)
        return out + DONE

    def whole(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        content, calls = self._answer()
        reason = self._finish(finish)
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            if calls:
                message["tool_calls"] = [tool_call_json(c) for c in calls]
            logprobs = {"content": [views.chat_logprob(e) for e in self.logprobs], "refusal": None}
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason}
            obj = "chat.completion"
        else:
            logprobs = completion_logprobs(self.logprobs)
            choice = {"index": 0, "text": content or "", "finish_reason": reason}
            obj = "text_completion"
        choice["logprobs"] = logprobs if self.plan.logprobs else None
        return _encode(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": self._usage(prompt_tokens, completion_tokens),
            }
        )

    def stream_error(self, failure: Answer) -> bytes:
        """An SSE event the openai client raises as an ``APIError``: the stream ends with it, never with [DONE]."""
        return b"data: " + failure.body("openai") + b"\n\n"

    def error_body(self, failure: Answer) -> bytes:
        return failure.body("openai")

    # --- pieces ------------------------------------------------------------------------------------------------

    def _answer(self) -> tuple[str | None, list[toolkit.ToolCall]]:
        """The content and the complete calls (a tool answer cut by a limit: what of it was decided, no JSON)."""
        if self.answer is None:
            return "".join(self.text), []
        self.answer.finish()
        return self.answer.content, self.answer.calls

    def _finish(self, finish: str) -> str:
        if self.answer is not None:
            return self.answer.finish_reason(finish)
        return "length" if finish == "length" else "stop"

    def _tool_deltas(self, events: list[toolkit.Event]) -> bytes:
        """A tool answer's events as chat chunks: content deltas, and each call's opening and arguments deltas."""
        out = b""
        for event in events:
            if isinstance(event, toolkit.Text):
                out += self.chunk(event.text, None)
            elif isinstance(event, toolkit.CallOpened):
                function = {"name": event.name, "arguments": ""}
                call = {"index": event.index, "id": event.id, "type": "function", "function": function}
                out += self._sse(self._chunk_obj({"tool_calls": [call]}))
            elif isinstance(event, toolkit.CallArguments):
                call = {"index": event.index, "function": {"arguments": event.delta}}
                out += self._sse(self._chunk_obj({"tool_calls": [call]}))
        return out

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        *,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text or logprobs or not finish_reason else {}
            if first:
                delta["role"] = "assistant"
            chunk = self._chunk_obj(delta, finish_reason)
            if logprobs is not None:
                chunk["choices"][0]["logprobs"] = {
                    "content": [views.chat_logprob(e) for e in logprobs],
                    "refusal": None,
                }
            return self._sse(chunk)
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        if logprobs is not None:
            choice["logprobs"] = completion_logprobs(logprobs, self._offset)
        self._offset += len(text)
        return self._sse(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    def _chunk_obj(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._sse(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self._usage(prompt_tokens, completion_tokens),
            }
        )

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return usage(prompt_tokens, completion_tokens, self.cached_tokens, self.reasoning_tokens, self.speculation)

    @staticmethod
    def _sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + _encode(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def tool_call_json(call: toolkit.ToolCall) -> dict[str, Any]:
    """A call the answer made, in OpenAI's shape: its arguments as the JSON text the model wrote."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


# --------------------------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------------------------


def _generation_answer(whole: type, chunk: type) -> dict[str, Any]:
    events = sse_of({"anyOf": [ref(chunk), ref(views.ErrorBody)]})
    return {
        "200": {
            "description": f"the {whole.__name__} (``stream: false``) or its chunks as server-sent events, which end "
            "with ``data: [DONE]``, or with an error event carrying the cause when the runner fails",
            "content": {"application/json": {"schema": ref(whole)}, SSE: {"schema": events}},
        }
    }


async def model_out(scheduler: Scheduler, model_id: str) -> views.ModelOut:
    """A model as OpenAI lists it, with what tether knows beside: its state, footprint or estimate, keep-alive."""
    fleet = scheduler.fleet
    slot = scheduler.slots.get(model_id)
    hosted = fleet.get(model_id) if slot is None else slot.hosted
    created = int(hosted.created_at if hosted is not None else scheduler.started_at)
    out = views.ModelOut(id=model_id, object="model", created=created, owned_by="tether")
    spec = hosted.instance.spec if slot is None and hosted is not None else None
    if slot is not None:
        spec = slot.model.config.spec()
    if spec is not None:  # ["embedding"] for an embedding instance: not one to offer for chat
        # off the loop: "thinking" is read from the model's template (its GGUF's header, once per file version)
        out.capabilities = await anyio.to_thread.run_sync(capabilities, ListedModel(model_id, spec, created))
    sup = hosted.supervisor if hosted is not None else None
    if sup is not None and sup.alive:
        await sup.sample_memory()
    if slot is not None:
        await scheduler.estimate(slot)
        seen = views.catalog_model_out(slot, scheduler.now())
        for name in seen.__struct_fields__:
            setattr(out, name, getattr(seen, name))
    elif hosted is not None:
        memory = sup.footprint if sup is not None and sup.alive else None
        state = hosted.instance.state
        out.state = "loaded" if isinstance(state, InstanceReady) else tag_of(state)
        out.engine = hosted.instance.spec.engine
        out.model = hosted.config.model
        out.pinned = True  # added through POST /v1/instances: it stays until it is deleted
        out.footprint = memory.footprint if memory is not None else None
    return out


def routes(api: Api) -> list[Route]:
    """Chat and text completions, and the models a request can name."""
    scheduler = api.scheduler

    async def generate(request: Request, kind: Literal["chat", "completion"]) -> Response:
        started = time.monotonic()
        endpoint = "chat" if kind == "chat" else "completions"
        body = decode(kind, await request.body())
        model_id = scheduler.resolve(body.model)
        fmt, think = toolkit.GENERIC, None
        if isinstance(body, ChatRequest):
            if uses_tools(body):
                fmt = await toolkit.format_for(scheduler, model_id)
            want, _ = thinking_wanted(body)
            switch = "reasoning_effort" if body.reasoning_effort is not None else template_args.ENABLE_THINKING
            think = await thinking.switch(scheduler, model_id, want, switch)
            await template_args.check(scheduler, model_id, body.chat_template_kwargs)
        planned = api.planned(model_id, endpoint, lambda: plan(body, fmt, think))
        request_id = new_request_id("chatcmpl" if kind == "chat" else "cmpl")
        shaper = OpenAIShaper(kind, request_id, model_id, planned)
        return await api.respond(model_id, planned, shaper, request_id, endpoint, started)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def models() -> Response:
        data = []
        for name in scheduler.names():
            with contextlib.suppress(NotFound):  # an instance deleted while the list was read
                data.append(await model_out(scheduler, name))
        return json_response(views.ModelList(object="list", data=data))

    async def model(model_id: str) -> Response:
        try:
            return json_response(await model_out(scheduler, scheduler.resolve_exact(model_id)))
        except NotFound:
            served = ", ".join(scheduler.names()) or "none"
            message = f"model {model_id!r} is not served here; models: {served}"
            answer = Answer(404, "invalid_request_error", "model_not_found", message, "model")
            return answer.response("/v1/models")

    return [
        Route(
            "/v1/chat/completions",
            "POST",
            chat_completions,
            "OpenAI chat completion",
            _generation_answer(ChatCompletion, ChatCompletionChunk),
            GENERATION_ERRORS,
            ChatRequest,
        ),
        Route(
            "/v1/completions",
            "POST",
            completions,
            "OpenAI (legacy) text completion",
            _generation_answer(Completion, CompletionChunk),
            GENERATION_ERRORS,
            CompletionRequest,
        ),
        Route(
            "/v1/models",
            "GET",
            models,
            "every model a request can name, loaded or not",
            {"200": json_answer(views.ModelList, "the models")},
        ),
        Route(
            "/v1/models/{model_id}",
            "GET",
            model,
            "one model a request can name",
            {"200": json_answer(views.ModelOut, "the model")},
            (404,),
            parameters=(path_parameter("model_id"),),
        ),
    ]
