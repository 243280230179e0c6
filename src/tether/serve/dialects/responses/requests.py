"""The Responses API's request body and input items, what tether does with each of their fields (``fields``), and the
JSON Schema rules their types cannot state (``SCHEMA_RULES``, for ``/openapi.json``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from tether.protocol import (
    MAX_TOP_LOGPROBS,
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
from tether.serve.dialects.rules import STRUCTURED_FORMAT, TOOL_CHOICE_RULE, structured_beside_tools
from tether.serve.dialects.shapes import Prediction, Tokens

LOGPROBS = "message.output_text.logprobs"  # the logprobs ``include`` value
# the thinking to send back on the next turn, which a stateless client asks for: tether returns it in the reasoning
# item's plain ``content`` (accepted back as it came), so there is nothing to encrypt
ENCRYPTED = "reasoning.encrypted_content"
INCLUDES = (LOGPROBS, ENCRYPTED)
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ITEM_ROLES = ("user", "system", "developer", "assistant")
PART_TYPES = ("input_text", "output_text")  # a message's
REASONING_PART, SUMMARY_PART = "reasoning_text", "summary_text"  # a reasoning item's content and summary
STATELESS = "tether is stateless: it stores no responses or conversations"


class ResponsesInputText(msgspec.Struct, forbid_unknown_fields=True):
    type: Annotated[str, documented(enum=[*PART_TYPES, REASONING_PART, SUMMARY_PART], description="text parts only")]
    text: str
    annotations: list[Any] | None = None  # an earlier answer's output_text sent back: changes nothing
    logprobs: list[Any] | None = None


Text = str | list[ResponsesInputText]


class ResponsesInputItem(msgspec.Struct, forbid_unknown_fields=True):
    """One item of ``input``: a message, an earlier ``function_call``, a ``function_call_output``, or an earlier
    answer's ``reasoning`` (the fields each type takes are in ``SCHEMA_RULES``; a field of another type must be
    absent or null). Every item a response's ``output`` holds comes back as it was returned."""

    type: Annotated[str, documented(enum=list(ITEM_TYPES))] = "message"
    role: Annotated[str, documented(enum=list(ITEM_ROLES))] | None = None
    content: Text | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Text | None = None
    id: str | None = None
    status: Annotated[str, documented(enum=["in_progress", "completed", "incomplete"])] | None = None
    summary: list[ResponsesInputText] | None = None
    encrypted_content: Annotated[
        Any, documented(type="null", description="another server's encrypted reasoning cannot be read here")
    ] = None
    # what the openai SDK's items carry besides (its ``model_dump()`` sends them back as null)
    phase: Literal["commentary", "final_answer"] | None = None
    caller: Annotated[Any, documented(type="null", description="calls are made by the model directly")] = None
    namespace: Annotated[Any, documented(type="null", description="tools have no namespaces here")] = None


class ResponsesTextFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Annotated[str, documented(enum=["text", "json_object", "json_schema"])] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar enforces the schema whether or not strict is set
    description: str | None = None


class ResponsesTextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: ResponsesTextFormat | None = None
    verbosity: Annotated[Any, documented(type="null", description="no verbosity control")] = None


class ResponsesFunctionTool(msgspec.Struct, forbid_unknown_fields=True):
    type: Annotated[str, documented(enum=["function"], description="only function tools")]
    name: Annotated[str, documented(minLength=1, maxLength=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar enforces the parameters' schema either way


class ResponsesNamedChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Annotated[str, documented(enum=["function"])]
    name: str


class ResponsesReasoning(msgspec.Struct, forbid_unknown_fields=True):
    # a reasoning model's thinking on ("minimal" to "high") or off ("none"), where its chat template can say so
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Annotated[Any, documented(type="null", description="no summaries: the thinking itself is returned")] = None
    generate_summary: Annotated[Any, documented(type="null", description="deprecated: no summaries")] = None


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool = True  # OpenAI pads streamed deltas against side channels; nothing to pad here


Stateless = Annotated[Any, documented(type="null", description="stateless: send the whole conversation as input")]
NoPrompt = Annotated[
    Any, documented(type="null", description="no stored prompt templates: send instructions and input")
]
Unsupported = Annotated[Any, documented(type="null", description="not supported here")]


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: str | Annotated[list[ResponsesInputItem], documented(minItems=1)]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: Tokens | None = None
    temperature: Annotated[float, documented(minimum=TEMPERATURE_RANGE[0], maximum=TEMPERATURE_RANGE[1])] = 1.0
    top_p: Annotated[float, documented(exclusiveMinimum=0, maximum=1)] = 1.0
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    text: ResponsesTextConfig | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Annotated[str, documented(enum=["none", "auto", "required"])] | ResponsesNamedChoice | None = None
    parallel_tool_calls: bool | None = None
    include: list[Annotated[str, documented(enum=list(INCLUDES))]] | None = None
    top_logprobs: Annotated[int, documented(minimum=0, maximum=MAX_TOP_LOGPROBS)] | None = None
    metadata: dict[str, str] | None = None
    store: Annotated[bool, documented(enum=[False], description="tether stores no responses")] | None = None
    background: Annotated[bool, documented(enum=[False], description="no background responses")] | None = None
    truncation: Annotated[str, documented(enum=["disabled"], description="an over-long input is a 400")] | None = None
    max_tool_calls: int | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Annotated[str, documented(enum=["in_memory", "24h"])] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    # chat completions' Predicted Outputs (not OpenAI's Responses API): text the answer is expected to largely repeat
    prediction: Prediction | None = None
    # refused whenever set: state tether does not keep, or features it does not have
    previous_response_id: Stateless = None
    conversation: Stateless = None
    prompt: NoPrompt = None
    reasoning: ResponsesReasoning | None = None
    context_management: Unsupported = None
    moderation: Unsupported = None


_STRUCTURED_TEXT = {"type": "object", "required": ["format"], "properties": {"format": STRUCTURED_FORMAT}}


def _item_rule(kind: str, needs: dict[str, Any], takes: dict[str, Any] | None = None) -> dict[str, Any]:
    """An item of type ``kind`` takes ``needs`` (required, typed), may take ``takes`` (typed), and none of the other
    types' fields."""
    takes = takes or {}
    foreign = {"role", "content", "call_id", "name", "arguments", "output", "summary"} - set(needs) - set(takes)
    condition: dict[str, Any] = {"properties": {"type": {"const": kind}}}
    if kind != "message":  # an item without a type is a message
        condition["required"] = ["type"]
    properties = {**needs, **takes, **{name: {"type": "null"} for name in sorted(foreign)}}
    return {"if": condition, "then": {"required": list(needs), "properties": properties}}


def _parts(*kinds: str) -> dict[str, Any]:
    """Text, or a list of parts of ``kinds``."""
    part = {"type": "object", "properties": {"type": {"enum": list(kinds)}}}
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}


_TEXT_SCHEMA = _parts(*PART_TYPES)
BEYOND_SCHEMA = {  # 400s for rules JSON Schema cannot state (the fuzzer accepts them; each says what to do)
    "reasoning.effort": "thinking on or off only where the model's chat template can say so",
}
SCHEMA_RULES: dict[str, dict[str, Any]] = {
    # what one field's type cannot say, for /openapi.json (the plan's checks enforce it, with a message)
    "ResponsesRequest": {"allOf": [TOOL_CHOICE_RULE, {"not": structured_beside_tools("text", _STRUCTURED_TEXT)}]},
    "ResponsesInputItem": {
        "allOf": [
            _item_rule("message", {"role": {"type": "string"}, "content": _TEXT_SCHEMA}),
            _item_rule(
                "function_call",
                {"call_id": {"type": "string"}, "name": {"type": "string"}, "arguments": {"type": "string"}},
            ),
            _item_rule("function_call_output", {"call_id": {"type": "string"}, "output": _TEXT_SCHEMA}),
            _item_rule(
                "reasoning",
                {"summary": {"type": "array", "items": {"properties": {"type": {"const": SUMMARY_PART}}}}},
                {"content": {"anyOf": [_parts(REASONING_PART), {"type": "null"}]}},
            ),
        ]
    },
    "ResponsesTextFormat": {
        "if": {"required": ["type"], "properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["schema"], "properties": {"schema": {"type": "object"}}},
        "else": {"properties": {name: {"type": "null"} for name in ("name", "schema", "strict", "description")}},
    },
}

register(
    "POST /v1/responses",
    ResponsesRequest,
    {
        "input": FieldPolicy(H, "a string, or `message`, `function_call` and `function_call_output` items; text only"),
        "model": FieldPolicy(H, "picks the model (loaded on demand); with one model loaded, any name reaches it"),
        "instructions": FieldPolicy(H, "a system message before the input"),
        "max_output_tokens": FieldPolicy(H, "default 512; the limit ends it `incomplete`"),
        "temperature": FieldPolicy(H, "0 is greedy"),
        "top_p": FieldPolicy(H),
        "stream": FieldPolicy(
            H, "typed server-sent events, `response.created` to `response.completed` (or `incomplete`)"
        ),
        "stream_options": FieldPolicy(M, "`include_obfuscation`: nothing to pad"),
        "text": FieldPolicy(
            H, "`format`: `text`, `json_object`, `json_schema` (grammar-constrained); `verbosity` refused"
        ),
        "tools": FieldPolicy(H, "function tools (the model's own format or generic JSON): `function_call` items"),
        "tool_choice": FieldPolicy(H, "`none`, `auto`, `required`, a named function"),
        "parallel_tool_calls": FieldPolicy(H, "false: at most one call"),
        "include": FieldPolicy(
            L,
            f"`{LOGPROBS}`, and `{ENCRYPTED}`: the thinking is returned in plain `content`, which the next turn "
            "accepts back (nothing is encrypted)",
        ),
        "top_logprobs": FieldPolicy(H, "0 to 20 alternatives per token; logprobs without `include` too"),
        "metadata": FieldPolicy(H, "echoed in the response (stored nowhere)"),
        "store": FieldPolicy(L, "false or absent only: tether stores nothing"),
        "background": FieldPolicy(L, "false or absent only"),
        "truncation": FieldPolicy(L, "`disabled` only: an input over the context is a 400"),
        "max_tool_calls": FieldPolicy(M, "it bounds built-in tools; there are none here"),
        "user": FieldPolicy(M),
        "safety_identifier": FieldPolicy(M),
        "prompt_cache_key": FieldPolicy(M, "prefix reuse is automatic (the `prompt_cache` option)"),
        "prompt_cache_retention": FieldPolicy(M),
        "prompt_cache_options": FieldPolicy(M),
        "service_tier": FieldPolicy(M, "one tier here"),
        "prediction": FieldPolicy(
            E,
            "chat completions' Predicted Outputs, here too: drafted from by speculative decoding; "
            "`usage.output_tokens_details` reports `accepted_prediction_tokens` and `rejected_prediction_tokens`",
        ),
        "previous_response_id": FieldPolicy(R, "stateless: send the whole conversation"),
        "conversation": FieldPolicy(R, "stateless: send the whole conversation"),
        "prompt": FieldPolicy(R, "no stored prompt templates"),
        "reasoning": FieldPolicy(
            L, 'effort only: thinking on or off ("none"), where the model\'s template can; no summaries'
        ),
        "context_management": FieldPolicy(R),
        "moderation": FieldPolicy(R),
    },
)
register(
    "responses input item",
    ResponsesInputItem,
    {
        "type": FieldPolicy(
            L, "`message` (the default), `function_call`, `function_call_output`, `reasoning` only", returned=True
        ),
        "role": FieldPolicy(H, "`user`, `system`, `developer` (as system), `assistant`", returned=True),
        "content": FieldPolicy(
            H,
            "a string or `input_text`/`output_text` parts (their `annotations`, `logprobs`: metadata); a reasoning "
            "item's `reasoning_text` parts: the next assistant turn's thinking, given to the chat template as "
            "`reasoning_content`",
            returned=True,
        ),
        "call_id": FieldPolicy(H, "pairs an output with its call, shown to the model", returned=True),
        "name": FieldPolicy(H, "an earlier call's function", returned=True),
        "arguments": FieldPolicy(H, "an earlier call's arguments", returned=True),
        "output": FieldPolicy(H, "a call's result, shown to the model"),
        "id": FieldPolicy(M, returned=True),
        "status": FieldPolicy(M, returned=True),
        "summary": FieldPolicy(
            H, "a reasoning item's `summary_text` parts: its thinking when it has no `content`", returned=True
        ),
        "encrypted_content": FieldPolicy(
            R, "another server's encrypted thinking cannot be read: tether returns its own in plain `content`"
        ),
        "phase": FieldPolicy(M, "a message's label (commentary or final answer): not shown to the model"),
        "caller": FieldPolicy(L, "null only: the model calls tools directly (the openai SDK sends it back as null)"),
        "namespace": FieldPolicy(L, "null only: tools have no namespaces here (the openai SDK sends it back as null)"),
    },
)

_decoder = msgspec.json.Decoder(ResponsesRequest)


def decode(body: bytes) -> ResponsesRequest:
    return decode_body(_decoder, body)
