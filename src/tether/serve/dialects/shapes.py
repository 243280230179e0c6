"""Request shapes several APIs share, and their mapping into the ``conversation``: OpenAI's chat message (vLLM's
``/tokenize`` takes it too), OpenAI's function tool (Ollama's ``tools`` are the same), a token count, OpenAI's
Predicted Outputs' ``prediction`` (chat completions' field, which completions and the Responses API take too).

A shape lives here, not in the dialect that first spoke it, so that no dialect imports another: each one takes
what it shares from here and keeps the rest of its wire to itself.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from tether.errors import InvalidField
from tether.protocol import MAX_TOKENS_LIMIT, documented
from tether.serve.dialects.conversation import ROLES, Call, Tool, Turn, arguments_of, is_role
from tether.serve.dialects.fields import EXTENSION as E
from tether.serve.dialects.fields import HONOURED as H
from tether.serve.dialects.fields import LIMITED as L
from tether.serve.dialects.fields import METADATA as M
from tether.serve.dialects.fields import FieldPolicy, register
from tether.serve.dialects.rules import ASSISTANT_CALLS_RULE, assistant_only

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system instructions; chat templates know "system"

Tokens = Annotated[int, documented(minimum=1, maximum=MAX_TOKENS_LIMIT)]


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Annotated[str, documented(enum=["text"], description="only text parts are supported")]
    text: str | None = None


class FunctionCallIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str = "{}"


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    """A call an earlier assistant turn made (sent back with the conversation); ``index``: its place among a streamed
    answer's calls, which clients that join the stream's deltas keep (metadata)."""

    function: FunctionCallIn
    id: str | None = None
    type: Annotated[str, documented(enum=["function"])] = "function"
    index: int | None = None


NullOnly = Annotated[Any, documented(type="null")]


class MessageIn(msgspec.Struct, forbid_unknown_fields=True):
    """One message. The fields an answer's message carries (``reasoning_content``, and the nulls the openai SDK's
    ``model_dump()`` writes: ``annotations``, ``audio``, ``function_call``) come back with it on the next turn."""

    role: Annotated[str, documented(enum=[*ROLES, *ROLE_ALIASES])]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    annotations: list[Any] | None = None
    audio: NullOnly = None
    function_call: NullOnly = None


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, documented(minLength=1, maxLength=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar enforces the parameters' schema either way


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionDef
    type: Annotated[str, documented(enum=["function"], description="only function tools")] = "function"


class PredictionPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Annotated[str, documented(enum=["text"], description="only text parts are supported")]
    text: str


class Prediction(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's Predicted Outputs: text the answer is expected to largely repeat (a file being edited), which the
    engine drafts from; the parts of a list are joined."""

    type: Annotated[str, documented(enum=["content"], description="static predicted content, the only kind")]
    content: str | list[PredictionPart]


def prediction_text(prediction: Prediction | None, field: str = "prediction") -> str | None:
    """A request's ``prediction`` as the text ``GenerateParams.prediction`` carries (None: none); a refusal names the
    field (``prediction.content[1].type``)."""
    if prediction is None:
        return None
    if prediction.type != "content":
        raise InvalidField(
            f"{field}.type",
            f'{field}.type must be "content" (static predicted content, the only kind), got {prediction.type!r}',
        )
    if isinstance(prediction.content, str):
        return prediction.content
    for j, part in enumerate(prediction.content):
        if part.type != "text":
            raise InvalidField(
                f"{field}.content[{j}].type", f"{field}.content[{j}]: only text parts are supported, got {part.type!r}"
            )
    return "".join(part.text for part in prediction.content)


SCHEMA_RULES: dict[str, dict[str, Any]] = {
    "MessageIn": {"allOf": [ASSISTANT_CALLS_RULE, assistant_only("reasoning_content"), assistant_only("reasoning")]}
}
THINKING = (
    "an earlier turn's thinking, given to the chat template as `reasoning_content` (templates that keep it show it)"
)
register(
    "chat message",
    MessageIn,
    {
        "role": FieldPolicy(H, "`developer` is `system`", returned=True),
        "content": FieldPolicy(H, "a string or text parts", returned=True),
        "name": FieldPolicy(M),
        "tool_calls": FieldPolicy(H, "an earlier assistant turn's calls, shown to the model", returned=True),
        "tool_call_id": FieldPolicy(H, "a tool result's call, shown to the model"),
        "refusal": FieldPolicy(M, "an answer's refusal: tether's answers refuse nothing", returned=True),
        "reasoning_content": FieldPolicy(H, THINKING, returned=True),
        "reasoning": FieldPolicy(E, "vLLM's and OpenRouter's name for `reasoning_content`"),
        "annotations": FieldPolicy(M, "an answer's citations (the openai SDK sends them back): not shown to the model"),
        "audio": FieldPolicy(L, "null only: audio answers are not supported"),
        "function_call": FieldPolicy(
            L, "null only (the openai SDK sends it back): deprecated by OpenAI, send `tool_calls`"
        ),
    },
)


def message_turns(messages: list[MessageIn], field: str = "messages") -> list[Turn]:
    """OpenAI's messages as the conversation: roles checked (``developer`` is ``system``), text parts joined, each
    call's arguments read from their JSON text once; every refusal names the message's field."""
    if not messages:
        raise InvalidField(field, f"{field} must hold at least one message")
    turns = []
    for i, message in enumerate(messages):
        role = ROLE_ALIASES.get(message.role, message.role)
        if not is_role(role):
            raise InvalidField(
                f"{field}[{i}].role",
                f"{field}[{i}].role must be one of {', '.join(repr(r) for r in (*ROLES, *ROLE_ALIASES))}, "
                f"got {message.role!r}",
            )
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise InvalidField(f"{field}[{i}].content", f"{field}[{i}]: only text content parts are supported")
            content = "".join(part.text or "" for part in content)
        if message.tool_calls and role != "assistant":
            raise InvalidField(f"{field}[{i}].tool_calls", f"{field}[{i}]: only assistant turns carry tool_calls")
        for name in ("audio", "function_call"):
            if getattr(message, name) is not None:
                raise InvalidField(
                    f"{field}[{i}].{name}",
                    f"{field}[{i}].{name} must be null or absent (tether's answers carry none): "
                    + ("audio answers are not supported" if name == "audio" else "send the call in tool_calls"),
                )
        calls = tuple(Call(c.function.name, arguments_of(c.function.arguments), c.id) for c in message.tool_calls or ())
        result = role == "tool"  # a tool's result: the call it answers, and the tool's name as the client gives it
        answers, tool = (message.tool_call_id, message.name) if result else (None, None)
        reasoning = thinking_of(message.reasoning_content, message.reasoning, role, f"{field}[{i}]")
        turns.append(Turn(role, content or "", calls, answers=answers, tool=tool, reasoning=reasoning))
    return turns


def thinking_of(
    given: str | None, alias: str | None, role: str, at: str, name: str = "reasoning_content"
) -> str | None:
    """An assistant turn's thinking as a message sends it back (``name``, or vLLM's ``reasoning``): only an
    assistant's, and one text when both are given."""
    if given is not None and alias is not None and given != alias:
        raise InvalidField(
            f"{at}.reasoning",
            f"{at}: {name} and reasoning are two names for the turn's thinking and differ: send one",
        )
    text = given if given is not None else alias
    if text is not None and role != "assistant":
        raise InvalidField(
            f"{at}.{name if given is not None else 'reasoning'}", f"{at}: only assistant turns carry thinking"
        )
    return text


def declared_tools(tools: list[FunctionTool] | None) -> list[Tool]:
    """OpenAI's function tools as the conversation's."""
    return [Tool.declared(t.function.name, t.function.description, t.function.parameters) for t in tools or ()]
