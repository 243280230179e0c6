"""Tool calls for any model: the tools described in a system message, the answer constrained to a JSON shape.

The default model's chat template (and many small models') knows nothing of tools, so tether uses one generic
format for every model, as llama.cpp's server does for templates without native tool support: the model answers
with one JSON object, either ``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` or ``{"response": "..."}``,
and grammar-constrained sampling (``GenerateParams.json_schema``) makes that object always parse and every call
name a declared tool with arguments that match its parameter schema. ``tool_choice`` picks the shape: ``auto``
allows both, ``required`` only calls, a named function only calls of it, ``none`` plain text. Earlier turns are
rendered in the same format (an assistant's calls as that JSON, a tool's result as a ``tool_response`` object in a
user turn), so a conversation with tool results reads as one consistent protocol to the model.

Not done: a model's native tool-call format (Hermes ``<tool_call>`` tags, Llama 3's ``<|python_tag|>``): those
models get the generic format too, which they follow under the grammar but were not trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from tether.errors import InvalidField
from tether.fleet.fleet import new_request_id
from tether.protocol import ChatMessage


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """The tools a request may call and how: ``choice`` is "auto", "required" or one tool's name."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True

    def system_prompt(self) -> str:
        specs = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in self.offered()]
        if self.choice == "auto":
            how = (
                'To call tools, answer {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}; '
                'to answer directly, answer {"response": <your answer>}.'
            )
        else:
            how = 'Answer {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}.'
        return f"You can call these tools:\n{json.dumps(specs, ensure_ascii=False)}\nAnswer with one JSON object. {how}"

    def apply(self, messages: list[ChatMessage], json_schema: str | None, field: str) -> str:
        """Put the tools' description first in ``messages``; return the schema the answer must match (``field``: the
        request's own structured-output field, which cannot be combined with tools: the answer has this schema)."""
        if json_schema is not None:
            raise InvalidField(field, f"{field} cannot be combined with tools: their answer has a schema of its own")
        messages.insert(0, ChatMessage(role="system", content=self.system_prompt()))
        return msgspec.json.encode(self.schema()).decode()

    def offered(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    def schema(self) -> dict[str, Any]:
        """The JSON Schema the answer must match."""
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters or {"type": "object"}},
                "required": ["name", "arguments"],
            }
            for t in self.offered()
        ]
        array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        array["minItems"] = 1
        if not self.parallel:
            array["maxItems"] = 1
        call = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"]}
        if self.choice != "auto":
            return call
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
        return {"anyOf": [call, answer]}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def plan(tools: list[Any], choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The ``ToolPlan`` for a request's ``tools``/``tool_choice``/``parallel_tool_calls`` (None: no tools in play).

    ``tools`` are ``FunctionTool`` structs (``openai.FunctionTool``); ``choice`` is "none", "auto", "required" or a
    ``NamedChoice``.
    """
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidField("tool_choice", "tool_choice demands a tool call, but the request has no tools")
        return None
    declared: list[Tool] = []
    for i, tool in enumerate(tools):
        function = tool.function
        if any(t.name == function.name for t in declared):
            raise InvalidField("tools", f"tools[{i}]: tool {function.name!r} is declared twice: name each tool once")
        parameters = function.parameters if function.parameters is not None else {"type": "object", "properties": {}}
        declared.append(Tool(function.name, function.description or "", parameters))
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None
    if not isinstance(choice, str):
        name = choice.function.name
        if not any(t.name == name for t in declared):
            names = ", ".join(t.name for t in declared)
            raise InvalidField("tool_choice", f"tool_choice names {name!r}, which is not among the tools ({names})")
        choice = name
    return ToolPlan(tuple(declared), choice, parallel=True if parallel is None else parallel)


def render_call(name: str, arguments: str) -> dict[str, Any]:
    """One earlier call, as the model wrote it (arguments as an object when they are JSON)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return {"name": name, "arguments": args}


def assistant_turn(calls: list[dict[str, Any]], content: str | None) -> str:
    """An earlier assistant turn that called tools, in the generic format."""
    text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
    return f"{content}\n{text}" if content else text


def tool_result(call_id: str | None, name: str | None, content: str) -> str:
    """A tool's result, as the user turn that carries it."""
    return json.dumps(
        {"tool_response": {"tool_call_id": call_id, "name": name, "content": content}}, ensure_ascii=False
    )


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """The model's answer as (content, calls). Text that is not the generic JSON (the length limit cut it) is
    content, as written."""
    try:
        answer = json.loads(text)
    except ValueError:
        return text, []
    if isinstance(answer, dict) and isinstance(answer.get("tool_calls"), list):
        calls = [
            ToolCall(
                new_request_id("call", "_"),
                str(call.get("name", "")),
                json.dumps(call.get("arguments", {}), ensure_ascii=False),
            )
            for call in answer["tool_calls"]
            if isinstance(call, dict)
        ]
        return None, calls
    if isinstance(answer, dict) and isinstance(answer.get("response"), str):
        return answer["response"], []
    return text, []
