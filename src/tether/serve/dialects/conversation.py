"""The conversation every dialect maps its request into: turns, the calls they made, the tools on offer.

Each API spells a chat its own way (OpenAI's messages, Ollama's, the Responses API's input items, vLLM's tokenize
messages); each dialect maps its own spelling into these types and nothing else, and ``tools.engine_messages``
renders them for the engine in the model's tool format. A call's arguments are data here (Ollama sends an object,
OpenAI JSON text, parsed once where it arrives), so the JSON text an engine message carries is written once, where
it is needed, and never read back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard, get_args

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = get_args(Role)


def is_role(name: str) -> TypeGuard[Role]:
    return name in ROLES


@dataclass(frozen=True)
class Call:
    """A tool call an assistant turn made, as a client sends it back: ``id`` None when the client gave none (the
    engine's view numbers it), ``arguments`` the parsed JSON value, or the client's text when it was not JSON."""

    name: str
    arguments: Any
    id: str | None = None


@dataclass(frozen=True)
class Turn:
    """One turn. ``calls``: an assistant's; ``answers`` (the call's id) and ``tool`` (the function's name, when the
    client names it): a tool result's. ``reasoning``: an assistant's thinking as a client sends it back, given to the
    template as ``reasoning_content`` (Qwen3's keep the thinking of the turns since the last user message; most drop
    it)."""

    role: Role
    text: str = ""
    calls: tuple[Call, ...] = ()
    answers: str | None = None
    tool: str | None = None
    reasoning: str | None = None


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its parameters are a JSON Schema object."""

    name: str
    description: str
    parameters: dict[str, Any]

    @classmethod
    def declared(cls, name: str, description: str | None, parameters: dict[str, Any] | None) -> Tool:
        """A tool as a client declares one: no description is an empty one, no parameters an object without any."""
        empty = {"type": "object", "properties": {}}
        return cls(name, description or "", parameters if parameters is not None else empty)


@dataclass(frozen=True)
class NamedTool:
    """A tool choice that names one tool: the answer must call it."""

    name: str


# "none", "auto" or "required" (the request's own text: its dialect's schema states the values), or one tool
ToolChoice = str | NamedTool


def arguments_of(text: str) -> Any:
    """A call's arguments a client sent as text: the JSON value it holds, or the text itself when it is not JSON
    (a template then writes it as a string)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def latest_calls(turns: Sequence[Turn]) -> list[tuple[str, Any]]:
    """(name, arguments) of each call made since the last user turn: an agent loop's calls for its user's latest
    message (``tools.settle`` bounds them)."""
    last_user = max((i for i, turn in enumerate(turns) if turn.role == "user"), default=-1)
    return [(call.name, call.arguments) for turn in turns[last_user + 1 :] for call in turn.calls]
