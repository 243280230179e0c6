"""OpenAI's chat and text completion request bodies, what tether does with each of their fields (``fields``), and
the JSON Schema rules their types cannot state (``SCHEMA_RULES``, for ``/openapi.json``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from tether.fleet.catalog import KeepAlive
from tether.protocol import (
    LOGIT_BIAS_RANGE,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    PENALTY_RANGE,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    documented,
)
from tether.serve.dialects.fields import EXTENSION as E
from tether.serve.dialects.fields import HONOURED as H
from tether.serve.dialects.fields import LIMITED as L
from tether.serve.dialects.fields import METADATA as M
from tether.serve.dialects.fields import REFUSED as R
from tether.serve.dialects.fields import FieldPolicy, register
from tether.serve.dialects.plan import decode_body
from tether.serve.dialects.rules import LOGPROBS_RULE, STRUCTURED_FORMAT, TOOL_CHOICE_RULE, structured_beside_tools
from tether.serve.dialects.shapes import (
    FunctionTool,
    MessageIn,
    Prediction,
    Tokens,
)

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


class OpenAIRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a chat and a text completion body share."""

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


class ChatRequest(OpenAIRequest, kw_only=True):
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


class CompletionRequest(OpenAIRequest, kw_only=True):
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
