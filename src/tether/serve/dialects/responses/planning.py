"""A Responses request to its plan: ``instructions`` and ``input`` items as the conversation, ``text.format`` and
``tools`` as the grammar, what the ``response`` object echoes; the server-side state it asks for refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from tether.errors import InvalidField
from tether.protocol import (
    MAX_TOKENS_LIMIT,
    ChatMessage,
    GenerateParams,
)
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
from tether.serve.dialects.plan import DEFAULT_MAX_TOKENS, Plan, checked, schema_text
from tether.serve.dialects.responses.requests import (
    INCLUDES,
    ITEM_ROLES,
    ITEM_TYPES,
    LOGPROBS,
    PART_TYPES,
    REASONING_PART,
    STATELESS,
    SUMMARY_PART,
    ResponsesInputItem,
    ResponsesNamedChoice,
    ResponsesRequest,
    ResponsesTextConfig,
    Text,
)
from tether.serve.dialects.shapes import ROLE_ALIASES, prediction_text


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


def sampling(request: ResponsesRequest) -> dict[str, Any]:
    """The ``GenerateParams`` fields that say how the answer is drawn (as each dialect's ``sampling`` does)."""
    return {
        "max_tokens": DEFAULT_MAX_TOKENS if request.max_output_tokens is None else request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "prediction": prediction_text(request.prediction),
    }


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
    params = GenerateParams(
        messages=tuple(messages),
        logprobs=(request.top_logprobs or 0) if logprobs else None,
        json_schema=json_schema,
        tool_syntax=syntax,
        thinking=thinking,
        **sampling(request),
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
    return ResponsesPlan(
        checked(params), model=request.model, stream=request.stream, logprobs=logprobs, tools=tools, echo=echo
    )
