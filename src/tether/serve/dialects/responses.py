"""OpenAI's Responses API, stateless: ``POST /v1/responses`` in, a ``response`` object or its typed SSE events out.

tether keeps no state, so the Responses API's server-side memory is refused by name rather than faked:
``store: true``, ``previous_response_id``, ``conversation``, stored ``prompt`` templates and ``background``
responses are 400s saying so, and ``GET``/``DELETE /v1/responses/{id}`` answer 404 (nothing is stored). The rest
maps onto what chat completions already do: ``instructions`` and ``input`` items become the conversation (function
calls and their outputs in the generic tool format, ``tools``), ``text.format`` is grammar-constrained structured
output, function ``tools`` are ``function_call`` output items. Every field is honoured, refused or metadata, as
registered below (the docs' field reference).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import msgspec
from fastapi import Request
from fastapi.responses import Response

from tether.errors import InvalidField
from tether.fleet.fleet import new_request_id
from tether.protocol import (
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    TEMPERATURE_RANGE,
    ChatMessage,
    Chunk,
    GenerateParams,
    documented,
)
from tether.serve import views
from tether.serve.dialects import thinking
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.conversation import (
    Call,
    NamedTool,
    Tool,
    Turn,
    arguments_of,
    is_role,
    latest_calls,
)
from tether.serve.dialects.fields import EXTENSION as E
from tether.serve.dialects.fields import HONOURED as H
from tether.serve.dialects.fields import LIMITED as L
from tether.serve.dialects.fields import METADATA as M
from tether.serve.dialects.fields import REFUSED as R
from tether.serve.dialects.fields import FieldPolicy, register
from tether.serve.dialects.plan import DEFAULT_MAX_TOKENS, Plan, checked, decode_body, schema_text
from tether.serve.dialects.rules import STRUCTURED_FORMAT, TOOL_CHOICE_RULE, structured_beside_tools
from tether.serve.dialects.shapes import ROLE_ALIASES, Prediction, Tokens, prediction_text
from tether.serve.generation import Api, Speculation
from tether.serve.routes import GENERATION_ERRORS, SSE, Route, json_answer, path_parameter, ref
from tether.serve.statuses import Answer

ENDPOINT = "responses"  # the metrics' endpoint label
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

# --------------------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# Requests to plans
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponsesPlan(Plan):
    """A chat plan plus what the ``response`` object echoes of the request (the openai client's model needs it)."""

    echo: dict[str, Any] = field(default_factory=dict)


def _text(value: Text, where: str, kinds: tuple[str, ...] = PART_TYPES) -> str:
    """Text, or ``kinds`` parts joined (a message's input_text/output_text, a reasoning item's reasoning_text)."""
    if isinstance(value, str):
        return value
    for j, part in enumerate(value):
        if part.type not in kinds:
            raise InvalidField(
                f"{where}[{j}].type", f"{where}[{j}]: only text parts ({', '.join(kinds)}) here, got {part.type!r}"
            )
    return "".join(part.text for part in value)


_FIELDS = ("role", "content", "call_id", "name", "arguments", "output", "summary")
_NEEDS = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
    "reasoning": ("summary",),
}
_TAKES = {"reasoning": ("content",)}  # optional fields of a type


def _check_item(item: ResponsesInputItem, at: str) -> None:
    if item.type not in _NEEDS:
        why = "an item reference refers to stored state" if item.type == "item_reference" else ""
        raise InvalidField(
            f"{at}.type",
            f"{at}.type must be one of {', '.join(ITEM_TYPES)}, got {item.type!r}" + (f" ({why})" if why else ""),
        )
    needs = _NEEDS[item.type]
    for name in needs:
        if getattr(item, name) is None:
            raise InvalidField(f"{at}.{name}", f"{at}: a {item.type} item needs {name}")
    for name in _FIELDS:
        if name not in needs and name not in _TAKES.get(item.type, ()) and getattr(item, name) is not None:
            raise InvalidField(f"{at}.{name}", f"{at}: a {item.type} item takes no {name}: remove it")
    if item.role is not None and item.role not in ITEM_ROLES:
        raise InvalidField(f"{at}.role", f"{at}.role must be one of {', '.join(ITEM_ROLES)}, got {item.role!r}")
    for name, why in (("caller", "the model calls tools directly"), ("namespace", "tools have no namespaces here")):
        if getattr(item, name) is not None:
            raise InvalidField(f"{at}.{name}", f"{at}.{name} must be null or absent ({why})")
    if item.encrypted_content is not None:
        raise InvalidField(
            f"{at}.encrypted_content",
            f"{at}.encrypted_content: encrypted reasoning (another server's) cannot be read here; tether returns its "
            "own thinking in the reasoning item's plain content, which it accepts back: send that item as tether "
            "returned it, or leave the item out",
        )


def input_turns(items: str | list[ResponsesInputItem]) -> list[Turn]:
    """``input`` as the conversation: messages as they are (``developer`` is ``system``), each run of function
    calls one assistant turn (after the assistant message it follows, if any), each output a tool result. A
    reasoning item is the thinking of the assistant turn that follows it (its message, or its calls); with none
    after it, a turn of thinking alone."""
    if isinstance(items, str):
        return [Turn("user", items)]
    if not items:
        raise InvalidField("input", "input must be a string or hold at least one item")
    turns: list[Turn] = []
    thought: str | None = None  # a reasoning item's, for the assistant turn that follows it

    def thought_alone() -> None:  # a reasoning item with no assistant turn after it: a turn of thinking alone
        nonlocal thought
        if thought is not None:
            turns.append(Turn("assistant", reasoning=thought))
            thought = None

    for i, item in enumerate(items):
        at = f"input[{i}]"
        _check_item(item, at)
        if item.type == "reasoning":
            text = _reasoning_text(item, at)
            thought = text if thought is None else thought + text
        elif item.type == "message":
            assert item.role is not None and item.content is not None
            role = ROLE_ALIASES.get(item.role, item.role)
            assert is_role(role)  # _check_item allows only ITEM_ROLES
            turn = Turn(role, _text(item.content, f"{at}.content"))
            if role == "assistant" and thought is not None:
                turn, thought = replace(turn, reasoning=thought), None
            thought_alone()
            turns.append(turn)
        elif item.type == "function_call":
            assert item.name is not None and item.arguments is not None
            call = Call(item.name, arguments_of(item.arguments), item.call_id)
            last = turns[-1] if turns else None
            if thought is None and last is not None and last.role == "assistant":
                turns[-1] = replace(last, calls=(*last.calls, call))
            else:
                turns.append(Turn("assistant", calls=(call,), reasoning=thought))
                thought = None
        else:
            assert item.output is not None
            thought_alone()
            turns.append(Turn("tool", _text(item.output, f"{at}.output"), answers=item.call_id))
    thought_alone()
    return turns


def _reasoning_text(item: ResponsesInputItem, at: str) -> str:
    """A reasoning item's thinking: its ``reasoning_text`` content, else its summary's ``summary_text`` parts."""
    if item.content:
        return _text(item.content, f"{at}.content", (REASONING_PART,))
    return _text(item.summary or [], f"{at}.summary", (SUMMARY_PART,))


def text_schema(text: ResponsesTextConfig | None) -> str | None:
    """``text.format`` as the JSON Schema text the grammar enforces (None: free text)."""
    if text is None:
        return None
    if text.verbosity is not None:
        raise InvalidField("text.verbosity", "text.verbosity is not supported by this server: remove it")
    fmt = text.format
    if fmt is None or fmt.type in ("text", "json_object"):
        if fmt is not None:
            for name in ("name", "schema", "strict", "description"):
                if getattr(fmt, name) is not None:
                    raise InvalidField(f"text.format.{name}", f"text.format.{name} belongs to json_schema formats")
        return '{"type": "object"}' if fmt is not None and fmt.type == "json_object" else None
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise InvalidField("text.format.schema", "a json_schema text.format needs schema (a JSON Schema object)")
        return schema_text(fmt.schema, "text.format.schema")
    raise InvalidField("text.format.type", f"text.format.type must be text, json_object or json_schema: {fmt.type!r}")


def _refuse(request: ResponsesRequest) -> None:
    for name in ("previous_response_id", "conversation"):
        if getattr(request, name) is not None:
            raise InvalidField(name, f"{name} is not supported: {STATELESS}. Send the whole conversation as input")
    if request.store:
        raise InvalidField("store", f"store must be false or absent: {STATELESS} (store: false is the only mode)")
    if request.background:
        raise InvalidField("background", f"background must be false or absent: {STATELESS}, so none to poll")
    if request.prompt is not None:
        raise InvalidField("prompt", "prompt (a stored prompt template) is not supported: send instructions and input")
    if request.reasoning is not None:
        for name in ("summary", "generate_summary"):
            if getattr(request.reasoning, name) is not None:
                raise InvalidField(
                    f"reasoning.{name}", f"reasoning.{name} is not supported: the thinking itself is returned, whole"
                )
    for name in ("context_management", "moderation"):
        if getattr(request, name) is not None:
            raise InvalidField(name, f"{name} is not supported by this server: remove it from the request")
    if request.truncation not in (None, "disabled"):
        raise InvalidField(
            "truncation",
            f'truncation must be "disabled" (an input over the context is a 400), got {request.truncation!r}',
        )
    for value in request.include or ():
        if value not in INCLUDES:
            raise InvalidField("include", f"include takes only {' and '.join(map(repr, INCLUDES))} here, got {value!r}")
    tokens = request.max_output_tokens
    if tokens is not None and not 1 <= tokens <= MAX_TOKENS_LIMIT:
        raise InvalidField("max_output_tokens", f"max_output_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {tokens}")


def effort(request: ResponsesRequest) -> str | None:
    return request.reasoning.effort if request.reasoning is not None else None


def uses_tools(request: ResponsesRequest) -> bool:
    """Whether the request declares tools or its input carries earlier calls or their outputs."""
    items = request.input
    calls = ("function_call", "function_call_output")
    return bool(request.tools) or (not isinstance(items, str) and any(i.type in calls for i in items))


def plan(
    request: ResponsesRequest, fmt: toolkit.ToolFormat = toolkit.GENERIC, thinking: bool | None = None
) -> ResponsesPlan:
    """What the request asks for (``fmt``: the model's tool format; ``thinking``: ``GenerateParams.thinking``);
    every refusal names its field."""
    _refuse(request)
    turns = input_turns(request.input)
    messages = toolkit.engine_messages(turns, fmt)
    if request.instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=request.instructions))
    declared = request.tools or []
    for i, tool in enumerate(declared):
        if tool.type != "function":
            raise InvalidField(f"tools[{i}].type", f"tools[{i}]: only function tools are supported, got {tool.type!r}")
        if not 1 <= len(tool.name) <= 64:
            raise InvalidField(f"tools[{i}].name", f"tools[{i}].name must be 1 to 64 characters, got {tool.name!r}")
    choice = request.tool_choice
    if isinstance(choice, ResponsesNamedChoice):
        if choice.type != "function":
            raise InvalidField("tool_choice", f"tool_choice names a {choice.type!r} tool: only functions exist here")
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise InvalidField("tool_choice", f"tool_choice must be none, auto, required or a function, got {choice!r}")
    named = NamedTool(choice.name) if isinstance(choice, ResponsesNamedChoice) else choice
    functions = [Tool.declared(t.name, t.description, t.parameters) for t in declared]
    tools = toolkit.settle(toolkit.plan(functions, named, request.parallel_tool_calls, fmt), latest_calls(turns))
    json_schema = text_schema(request.text)
    syntax = None
    if tools is not None:
        json_schema, syntax = tools.apply(messages, json_schema, "text")
    logprobs = LOGPROBS in (request.include or ()) or request.top_logprobs is not None
    max_tokens = DEFAULT_MAX_TOKENS if request.max_output_tokens is None else request.max_output_tokens
    params = GenerateParams(
        messages=tuple(messages),
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        logprobs=(request.top_logprobs or 0) if logprobs else None,
        json_schema=json_schema,
        tool_syntax=syntax,
        thinking=thinking,
        prediction=prediction_text(request.prediction),
    )
    text_format = {"type": "text"}
    if request.text is not None and request.text.format is not None:
        text_format = {k: v for k, v in msgspec.to_builtins(request.text.format).items() if v is not None}
    echo = {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "text": {"format": text_format},
        "tool_choice": msgspec.to_builtins(request.tool_choice) if request.tool_choice is not None else "auto",
        "tools": [msgspec.to_builtins(t) for t in declared],
        "top_logprobs": request.top_logprobs,
        "truncation": "disabled",
        "store": False,
        "background": False,
        "previous_response_id": None,
        "reasoning": {"effort": effort(request), "summary": None} if request.reasoning is not None else None,
    }
    return ResponsesPlan(checked(params), request.model, request.stream, False, logprobs, tools, echo=echo)


# --------------------------------------------------------------------------------------------------------------
# Reply types: the ``response`` object and its stream's typed events
# --------------------------------------------------------------------------------------------------------------


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: dict[str, int]  # ``cached_tokens`` (from the prompt cache), ``cache_write_tokens`` (0)
    output_tokens: int
    # ``reasoning_tokens``: those that wrote only thinking; ``accepted_prediction_tokens`` and
    # ``rejected_prediction_tokens``: tokens drafted from the request's ``prediction``, kept or thrown away
    output_tokens_details: dict[str, int]
    total_tokens: int
    speculation: views.SpeculationUsage  # tether's: speculative decoding's drafts and steps for this answer


class OutputText(msgspec.Struct):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]  # always empty
    logprobs: list[views.LogprobOut]  # with ``include: ["message.output_text.logprobs"]`` or ``top_logprobs``


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
    status: Literal["in_progress", "completed", "incomplete"]  # incomplete: a limit cut its arguments (streams only)


class ReasoningText(msgspec.Struct):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(msgspec.Struct, tag_field="type", tag="reasoning"):
    """A reasoning model's thinking, before the message it led to."""

    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any]  # always empty: the thinking itself is in ``content``
    content: list[ReasoningText]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class ResponseFailure(msgspec.Struct):
    """Why a response failed: tether's error code (a runner failure's cause kind), its message and ``cause``."""

    code: str
    message: str
    cause: views.CauseOut | None = None
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
    reasoning: dict[str, Any] | None  # the request's ``reasoning`` echoed


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
    logprobs: list[views.LogprobOut]


class ReasoningTextDelta(msgspec.Struct, tag_field="type", tag="response.reasoning_text.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(msgspec.Struct, tag_field="type", tag="response.reasoning_text.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class OutputTextDone(msgspec.Struct, tag_field="type", tag="response.output_text.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[views.LogprobOut]


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
    error: views.ErrorDetail


RESPONSE_EVENTS = (
    ResponseCreated,
    ResponseInProgress,
    OutputItemAdded,
    ContentPartAdded,
    OutputTextDelta,
    OutputTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemDone,
    ResponseCompleted,
    ResponseIncomplete,
    ResponseFailed,
    ResponseErrorEvent,
)


# --------------------------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------------------------

_encode = msgspec.json.Encoder().encode


def new_id(prefix: str) -> str:
    return new_request_id(prefix, "_")


def response_usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    reasoning_tokens: int = 0,
    speculation: Speculation | None = None,
) -> dict[str, Any]:
    drafted = speculation or Speculation()
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": drafted.details(reasoning_tokens),
        "total_tokens": prompt_tokens + completion_tokens,
        "speculation": drafted.usage(),
    }


class ResponsesShaper:
    """One request's ``response`` object, or its typed SSE events (see ``generation.Shaper``).

    Text streams as ``response.output_text.delta`` events as it comes; so does a tool answer, as it is decided
    (``toolkit.AnswerStream``): a direct answer's text as a message's deltas, each call as a ``function_call`` item
    added once its name is known, its arguments as ``response.function_call_arguments.delta`` events, done once
    they are complete (a call a limit cut ends ``incomplete`` in a stream, and is left out of a whole answer,
    as are the calls that repeat an earlier one). A failure mid-stream sends
    ``response.failed`` (its ``error`` with the cause) and then an ``error`` event carrying OpenAI's error object
    under ``error``, which the openai client raises as an ``APIError``: never ``response.completed``.
    """

    media_type = "text/event-stream"
    load_seconds = 0.0  # set by the API: how long the request waited for its model to load

    def __init__(self, response_id: str, model: str, plan: ResponsesPlan) -> None:
        self.id = response_id
        self.model = model
        self.plan = plan
        self.created_at = int(time.time())
        self.message_id = new_id("msg")
        self.reasoning_id = new_id("rs")
        self.text: list[str] = []
        self.reasoning: list[str] = []  # a reasoning model's thinking, kept apart by the runner
        self.reasoning_tokens = 0  # of the completion's tokens, those that wrote only thinking
        self._thinking_at: int | None = None  # the reasoning item's output index, once opened
        self._thinking_done = False
        self._message_at: int | None = None  # a plain answer's message's output index, once opened
        self.logprobs: list[dict[str, Any]] = []
        self._sequence = 0
        self._opened = False
        self.cached_tokens = 0  # from the final chunk
        self.speculation = Speculation()  # from the final chunk
        self.answer = plan.tools.stream() if plan.tools is not None else None
        self._outputs: list[dict[str, Any]] = []  # a tool answer's items, as opened (their index is their place)
        self._calls: dict[int, dict[str, Any]] = {}  # the function_call items, by the call's index

    # --- generation.Shaper ---------------------------------------------------------------------------------------

    def opening(self) -> bytes:
        return self._begin()

    def feed(self, chunk: Chunk) -> bytes:
        self.text.append(chunk.text)
        if chunk.finish_reason is not None:
            self.cached_tokens = chunk.cached_tokens
            self.speculation = Speculation.of(chunk)
        logprobs = [views.chat_logprob(e) for e in chunk.logprobs] if self.plan.logprobs else []
        self.logprobs.extend(logprobs)
        out = self._begin()  # the first chunk is fed before ``opening``: the opening events go first, in sequence
        if chunk.reasoning:
            self.reasoning.append(chunk.reasoning)
            self.reasoning_tokens += chunk.tokens if not chunk.text else 0
            out += self._think(chunk.reasoning)
        if chunk.text and self._thinking_at is not None:
            out += self._thought()
        if self.answer is not None:  # its items are kept streamed or not: a whole answer is made of them too
            out += self._tool_events(self.answer.feed(chunk.text))
            return out if self.plan.stream else b""
        if not self.plan.stream or not (chunk.text or logprobs):
            return out if self.plan.stream else b""
        return out + self._open_message() + self._event(
            "response.output_text.delta", **self._at(self._message_index()), content_index=0, delta=chunk.text,
            logprobs=logprobs,
        )  # fmt: skip

    def closing(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        out = self._begin()
        status = self._status(finish)
        if self._thinking_at is not None:
            out += self._thought("incomplete" if finish == "length" and not "".join(self.text) else "completed")
        if self.answer is None:
            out += self._open_message()
            items = self._items(finish)
            out += self._finish_message(self._message_index(), items[-1])
        else:
            out += self._tool_events(self.answer.finish())
            if not self._outputs and self.answer.content is not None:  # nothing streamed: an empty message
                out += self._tool_events([toolkit.Text("")])
            items = self._tool_items(status)
            for index, item in enumerate(items):
                if item["type"] == "message":
                    out += self._finish_message(index, item)
                elif item["status"] == "incomplete":  # a call the limit cut: its arguments were never done
                    out += self._event("response.output_item.done", output_index=index, item=item)
        event = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(event, response=self._response(status, items, prompt_tokens, completion_tokens))

    def whole(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        status = self._status(finish)
        if self.answer is None:
            items = self._items(finish)
        else:
            self._tool_events(self.answer.finish())
            items = [i for i in self._tool_items(status) if i["type"] == "message" or i["status"] == "completed"]
            if not items and self.answer.content is not None:  # a direct answer that is empty, or cut before it began
                items = [self._message(status, self.answer.content, [])]
            items = [i for i in items if i["type"] != "reasoning"]
            if self.reasoning:
                items.insert(0, self._reasoning_item("completed"))
        return _encode(self._response(status, items, prompt_tokens, completion_tokens))

    def stream_error(self, failure: Answer) -> bytes:
        out = self._begin()
        status = "cancelled" if failure.outcome == "cancelled" else "failed"
        partial = [self._message("incomplete", "".join(self.text))] if self.plan.tools is None else []
        response = self._response(status, partial, None, None)
        response["error"] = {"code": failure.code, "message": failure.message, **failure.extra}
        out += self._event("response.failed", response=response)
        error = {"message": failure.message, "type": failure.type, "param": None, "code": failure.code}
        return out + self._event(
            "error", code=failure.code, message=failure.message, param=None, error={**error, **failure.extra}
        )

    def error_body(self, failure: Answer) -> bytes:
        return failure.body("openai")

    # --- pieces ------------------------------------------------------------------------------------------------

    def _status(self, finish: str) -> str:
        if self.answer is not None:  # a tool answer that closed is complete, whatever stopped the generation
            return "incomplete" if self.answer.finish_reason(finish) == "length" else "completed"
        return "incomplete" if finish == "length" else "completed"

    def _items(self, finish: str) -> list[dict[str, Any]]:
        """The output items of a plain answer: its thinking, if any, then its message."""
        status = "incomplete" if finish == "length" else "completed"
        message = self._message(status, "".join(self.text), self.logprobs)
        if not self.reasoning:
            return [message]
        cut = finish == "length" and not "".join(self.text)  # the limit came inside the thinking
        return [self._reasoning_item("incomplete" if cut else "completed"), message]

    def _reasoning_item(self, status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": "".join(self.reasoning)}] if status != "in_progress" else []
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [], "content": content}

    def _think(self, text: str) -> bytes:
        """More thinking, as ``response.reasoning_text.delta`` (its item opened first, once)."""
        if not self.plan.stream:
            return b""
        out = b""
        if self._thinking_at is None:
            self._thinking_at = len(self._outputs) if self.answer is not None else 0
            item = self._reasoning_item("in_progress")
            if self.answer is not None:
                self._outputs.append(item)
            out += self._event("response.output_item.added", output_index=self._thinking_at, item=item)
        at = self._at(self._thinking_at, self.reasoning_id)
        return out + self._event("response.reasoning_text.delta", **at, content_index=0, delta=text)

    def _thought(self, status: str = "completed") -> bytes:
        """The thinking ended (the answer began, or the generation did): its item done, once."""
        if self._thinking_done or self._thinking_at is None or not self.plan.stream:
            return b""
        self._thinking_done = True
        at = self._at(self._thinking_at, self.reasoning_id)
        item = self._reasoning_item(status)
        if self.answer is not None:
            self._outputs[self._thinking_at] = item
        out = self._event("response.reasoning_text.done", **at, content_index=0, text="".join(self.reasoning))
        return out + self._event("response.output_item.done", output_index=self._thinking_at, item=item)

    def _message_index(self) -> int:
        return self._message_at if self._message_at is not None else (0 if self._thinking_at is None else 1)

    def _open_message(self) -> bytes:
        """A plain answer's message item and its part, opened once (after its thinking's item, if any)."""
        if self._message_at is not None or self.answer is not None or not self.plan.stream:
            return b""
        self._message_at = self._message_index()
        at = self._message_at
        out = self._event("response.output_item.added", output_index=at, item=self._message("in_progress", None))
        return out + self._event(
            "response.content_part.added", **self._at(at), content_index=0, part=self._part("", [])
        )

    def _tool_events(self, events: list[toolkit.Event]) -> bytes:
        """A tool answer's events: its items opened and filled as they are decided (kept for the answer), and the
        stream's events for them."""
        out = b""
        for event in events:
            if isinstance(event, toolkit.Text):
                if not any(item["type"] == "message" for item in self._outputs):
                    index = len(self._outputs)
                    self._outputs.append(self._message("in_progress", None))
                    out += self._event("response.output_item.added", output_index=index, item=self._outputs[index])
                    out += self._event(
                        "response.content_part.added", **self._at(index), content_index=0, part=self._part("", [])
                    )
                    if not event.text:
                        continue
                index = next(i for i, item in enumerate(self._outputs) if item["type"] == "message")
                out += self._event(
                    "response.output_text.delta", **self._at(index), content_index=0, delta=event.text, logprobs=[]
                )
            elif isinstance(event, toolkit.CallOpened):
                item = {
                    "type": "function_call",
                    "id": new_id("fc"),
                    "call_id": event.id,
                    "name": event.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self._calls[event.index] = item
                self._outputs.append(item)
                out += self._event("response.output_item.added", output_index=len(self._outputs) - 1, item=item)
            else:
                item = self._calls[event.index]
                at = self._at(self._outputs.index(item), item["id"])
                if isinstance(event, toolkit.CallArguments):
                    item["arguments"] += event.delta
                    out += self._event("response.function_call_arguments.delta", **at, delta=event.delta)
                else:
                    item.update(arguments=event.call.arguments, status="completed")
                    args = item["arguments"]
                    out += self._event("response.function_call_arguments.done", **at, name=item["name"], arguments=args)
                    out += self._event("response.output_item.done", output_index=at["output_index"], item=item)
        return out

    def _tool_items(self, status: str) -> list[dict[str, Any]]:
        """A tool answer's items as they end: its message with the answer's text, calls the limit cut incomplete."""
        assert self.answer is not None
        items = []
        for item in self._outputs:
            if item["type"] == "message":
                item = self._message(status, self.answer.content or "", [])
            elif item["status"] != "completed":
                item = {**item, "status": "incomplete"}
            items.append(item)
        return items

    def _message(self, status: str, text: str | None, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        content = [] if text is None else [self._part(text, logprobs or [])]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _at(self, index: int, item_id: str | None = None) -> dict[str, Any]:
        return {"item_id": item_id or self.message_id, "output_index": index}

    def _begin(self) -> bytes:
        """``response.created`` and ``response.in_progress``, and for text its message and part (once)."""
        if self._opened:
            return b""
        self._opened = True
        snapshot = self._response("in_progress", [], None, None)
        out = self._event("response.created", response=snapshot)
        return out + self._event("response.in_progress", response=snapshot)

    def _finish_message(self, index: int, item: dict[str, Any]) -> bytes:
        part = item["content"][0]
        at = self._at(index, item["id"])
        out = self._event(
            "response.output_text.done", **at, content_index=0, text=part["text"], logprobs=part["logprobs"]
        )
        out += self._event("response.content_part.done", **at, content_index=0, part=part)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _response(
        self, status: str, output: list[dict[str, Any]], prompt_tokens: int | None, completion_tokens: int | None
    ) -> dict[str, Any]:
        done = status in ("completed", "incomplete")
        usage = None
        if prompt_tokens is not None and completion_tokens is not None:
            usage = response_usage(
                prompt_tokens, completion_tokens, self.cached_tokens, self.reasoning_tokens, self.speculation
            )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if done else None,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.plan.echo,
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(obj) + b"\n\n"


# --------------------------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------------------------

NOT_STORED = (
    "tether stores no responses (every response is store: false), so there is no response {id!r} to {what}; "
    "to stop a generation in flight, POST /v1/requests/{{id}}/cancel with the response's id"
)


def _not_stored(response_id: str, what: str) -> Response:
    message = NOT_STORED.format(id=response_id, what=what)
    return Answer(404, "invalid_request_error", "not_found", message, "response_id").response("/v1/responses")


def _events() -> dict[str, Any]:
    """One server-sent event of a Responses stream: its ``event`` name and the typed JSON it carries."""
    names = [struct.__struct_config__.tag for struct in RESPONSE_EVENTS]
    payload = {"anyOf": [ref(struct) for struct in RESPONSE_EVENTS]}
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
    return {"type": "object", "required": ["event", "data"], "properties": {"event": {"enum": names}, "data": data}}


def routes(api: Api) -> list[Route]:
    """``POST /v1/responses``, and the stored-response routes, which find nothing stored."""

    async def create_response(request: Request) -> Response:
        started = time.monotonic()
        body = decode(await request.body())
        model_id = api.scheduler.resolve(body.model)
        fmt = await toolkit.format_for(api.scheduler, model_id) if uses_tools(body) else toolkit.GENERIC
        think = await thinking.switch(api.scheduler, model_id, thinking.wanted(effort(body)), "reasoning.effort")
        planned = api.planned(model_id, ENDPOINT, lambda: plan(body, fmt, think))
        response_id = new_id("resp")
        shaper = ResponsesShaper(response_id, model_id, planned)
        return await api.respond(model_id, planned, shaper, response_id, ENDPOINT, started)

    async def get_response(response_id: str) -> Response:
        return _not_stored(response_id, "retrieve")

    async def delete_response(response_id: str) -> Response:
        return _not_stored(response_id, "delete")

    async def cancel_response(response_id: str) -> Response:
        return _not_stored(response_id, "cancel")

    async def input_items(response_id: str) -> Response:
        return _not_stored(response_id, "list the input items of")

    answer = {
        "200": {
            "description": "the response object (``stream: false``) or its typed server-sent events, from "
            "``response.created`` to ``response.completed`` (``response.incomplete`` when the length limit ended "
            "it), or ``response.failed`` and an ``error`` event carrying the cause when the runner fails",
            "content": {"application/json": {"schema": ref(ResponseObject)}, SSE: {"schema": _events()}},
        }
    }
    stored = "/v1/responses/{response_id}"
    nothing = {"404": json_answer(views.ErrorBody, "no such response: tether stores no responses")}
    what = "a stored response: tether stores none (store is false), so always 404"
    at = (path_parameter("response_id"),)
    return [
        Route(
            "/v1/responses",
            "POST",
            create_response,
            "OpenAI Responses API, stateless (store false; previous_response_id refused)",
            answer,
            GENERATION_ERRORS,
            ResponsesRequest,
        ),
        Route(stored, "GET", get_response, f"retrieve {what}", nothing, parameters=at),
        Route(stored, "DELETE", delete_response, f"delete {what}", nothing, parameters=at),
        Route(f"{stored}/cancel", "POST", cancel_response, f"cancel {what}", nothing, parameters=at),
        Route(f"{stored}/input_items", "GET", input_items, f"list the input items of {what}", nothing, parameters=at),
    ]
