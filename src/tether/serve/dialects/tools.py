"""Tool calls for any model: the tools described to the model, its answer held by a grammar to text or calls.

A model whose chat template defines tool calls (``detect``: Hermes/Qwen, Mistral, Llama 3) gets them in its own
syntax, its template given the tools; any other gets one generic format, as llama.cpp's server does: the tools in a
system message, the answer one JSON object, ``{"tool_calls": [...]}`` or ``{"response": "..."}``. Either way the
grammar (``ToolPlan``, by ``tool_choice``) makes every call name a declared tool with arguments matching its schema,
and a turn text or calls; earlier turns are rendered in the same format (``engine_messages``). The answer is read as
it is generated (``AnswerStream``, ``NativeStream``) so the dialects stream each call as it comes. The rules an edit
must keep: its JSON or tags never reach a client as text, even when a limit cuts it, and the calls are bounded
(``MAX_PARALLEL_CALLS``), a repeat dropped. What a client sees: docs/clients.md, "Tools".
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from tether.errors import InvalidField
from tether.fleet.facts import facts, listed
from tether.fleet.fleet import new_request_id
from tether.fleet.scheduler import Scheduler
from tether.protocol import ChatMessage, MessageCall, ToolSyntax, call_lead
from tether.serve.dialects.conversation import NamedTool, Tool, ToolChoice, Turn

log = logging.getLogger("tether.api")
# The most calls one answer may make when parallel calls are allowed: the grammar's maxItems. Small models repeat a
# call until the token limit when the list is unbounded; 8 leaves room for real fan-out (weather in several cities)
# and repeats are dropped anyway (``AnswerStream``). ``parallel_tool_calls: false`` makes it 1.
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls (see ``protocol.ToolSyntax`` for the pieces); ``generic`` for the JSON answer
    this module describes in a system message."""

    name: str
    open: str = ""
    before: str = ""
    after: str = ""
    separator: str = ""
    close: str = ""
    arguments_key: str = "arguments"  # the key of a call's arguments object in its JSON
    max_calls: int = MAX_PARALLEL_CALLS  # the format's own bound on calls in one turn
    short_ids: bool = False  # the template demands 9-character alphanumeric call ids (Mistral's)

    @property
    def native(self) -> bool:
        return self.name != "generic"

    @property
    def lead(self) -> str:
        """What an answer of calls starts with (``ToolSyntax.lead``)."""
        return call_lead(self.open, self.before)


GENERIC = ToolFormat("generic")
HERMES = ToolFormat("hermes", before="<tool_call>\n", after="\n</tool_call>", separator="\n")
MISTRAL = ToolFormat("mistral", open="[TOOL_CALLS][", separator=", ", close="]", short_ids=True)
LLAMA3 = ToolFormat("llama3", arguments_key="parameters", max_calls=1)


@functools.lru_cache(maxsize=32)
def detect(template: str) -> ToolFormat:
    """The tool format a chat template (Jinja text) defines: Hermes/Qwen's ``<tool_call>`` tags, Mistral's
    ``[TOOL_CALLS]`` JSON list (not its newer ``[TOOL_CALLS]name[ARGS]`` form), Llama 3.1+'s JSON with
    ``parameters``; the generic format for a template that renders no tools."""
    if "tools" not in template:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return GENERIC if "[ARGS]" in template else MISTRAL
    if "<|start_header_id|>" in template and '"parameters"' in template:
        return LLAMA3
    return GENERIC


async def template_of(scheduler: Scheduler, model_id: str) -> str | None:
    """``model_id``'s chat template (its ``chat_template`` option's, else its model file's; "" when it has none),
    read off the event loop (once per file version: ``facts`` caches it); None for a model this process cannot
    list or read (a plugin's, one on another node only), whose runner follows what the request says."""
    item = next((i for i in listed(scheduler) if i.id == model_id), None)
    if item is None:
        return None
    found = await anyio.to_thread.run_sync(facts, item)
    return found.template if found.path is not None else None


async def format_for(scheduler: Scheduler, model_id: str) -> ToolFormat:
    """The tool format of ``model_id``'s chat template (the generic one where it cannot be read)."""
    return detect(await template_of(scheduler, model_id) or "")


@dataclass(frozen=True)
class ToolPlan:
    """The tools a request may call and how: ``choice`` is "auto", "required" or one tool's name."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True
    format: ToolFormat = GENERIC

    def system_prompt(self) -> str:
        specs = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in self.offered()]
        if self.choice == "auto":
            how = (
                'To call tools, answer {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}; '
                'to answer directly, answer {"response": <your answer>}.'
            )
        elif self.choice == ANSWER:
            how = 'The tools have answered above: answer directly, {"response": <your answer>}.'
        else:
            how = 'Answer {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}.'
        return f"You can call these tools:\n{json.dumps(specs, ensure_ascii=False)}\nAnswer with one JSON object. {how}"

    def apply(
        self, messages: list[ChatMessage], json_schema: str | None, field: str
    ) -> tuple[str | None, ToolSyntax | None]:
        """What the generation needs for these tools: in the generic format, the tools' description put first in
        ``messages`` and the schema the answer must match; in a native one, the syntax the engine renders and holds
        the answer to. ``field``: the request's own structured-output field, which cannot be combined with tools
        (their answer has a shape of its own)."""
        if json_schema is not None:
            raise InvalidField(field, f"{field} cannot be combined with tools: their answer has a schema of its own")
        if self.format.native:
            return None, self.syntax()
        messages.insert(0, ChatMessage(role="system", content=self.system_prompt()))
        return msgspec.json.encode(self.schema()).decode(), None

    def syntax(self) -> ToolSyntax:
        """The answer's shape in the model's own format: text, calls of the offered tools, or either."""
        fmt = self.format
        described = self.tools if self.choice in ("auto", "required", ANSWER) else self.offered()
        return ToolSyntax(
            tools=json.dumps([_template_tool(t) for t in described], ensure_ascii=False),
            call_schema=msgspec.json.encode(self._calls_schema()).decode(),
            open=fmt.open,
            before=fmt.before,
            after=fmt.after,
            separator=fmt.separator,
            close=fmt.close,
            max_calls=0 if self.choice == ANSWER else self.max_calls,
            text=self.choice in ("auto", ANSWER),
        )

    @property
    def max_calls(self) -> int:
        """The most calls one answer makes (the grammar's bound, and the parser's)."""
        return min(MAX_PARALLEL_CALLS if self.parallel else 1, self.format.max_calls)

    def stream(self) -> AnswerStream | NativeStream:
        """A parser for one answer under this plan."""
        if self.format.native:
            return NativeStream(self.format, self.max_calls)
        return AnswerStream(self.max_calls)

    def offered(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required", ANSWER):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    def _call_schemas(self) -> list[dict[str, Any]]:
        key = self.format.arguments_key
        return [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, key: t.parameters or {"type": "object"}},
                "required": ["name", key],
            }
            for t in self.offered()
        ]

    def _calls_schema(self) -> dict[str, Any]:
        """One call of any offered tool."""
        calls = self._call_schemas()
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def schema(self) -> dict[str, Any]:
        """The JSON Schema the answer must match (the generic format)."""
        calls = self._call_schemas()
        # minLength: a sampled turn of the 135M model answered {"response": ""} about 1 time in 50 with Open WebUI's
        # tools (a silent message in its page); a model that has nothing to call still says something.
        text = {"type": "string", "minLength": 1}
        answer = {"type": "object", "properties": {"response": text}, "required": ["response"]}
        if self.choice == ANSWER:
            return answer
        array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        array["minItems"] = 1
        array["maxItems"] = self.max_calls
        call = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"]}
        if self.choice != "auto":
            return call
        return {"anyOf": [call, answer]}


ANSWER = "answer"  # a plan's choice once an agent loop has gone round enough: a text answer, no more calls
MAX_ROUNDS = 8
"""Calls an agent loop may make for one user message before the model must answer in text (see ``settle``)."""


def settle(plan: ToolPlan | None, calls: Sequence[tuple[str, Any]]) -> ToolPlan | None:
    """``plan`` for a conversation whose turns since its last user message made ``calls`` (name, arguments:
    ``conversation.latest_calls``): with ``auto``, once a call was repeated with the same arguments, or
    :data:`MAX_ROUNDS` calls were made, the answer must be text. A small model otherwise calls the same tool again
    and again, each result growing the prompt, until the context is full (Open WebUI's default chat did: 11
    identical calls, then a 400 at 8,217 tokens)."""
    if plan is None or plan.choice != "auto" or not calls:
        return plan
    seen = {(name, _canonical(arguments)) for name, arguments in calls}
    if len(seen) < len(calls) or len(calls) >= MAX_ROUNDS:
        return ToolPlan(plan.tools, ANSWER, plan.parallel, plan.format)
    return plan


def _canonical(arguments: Any) -> str:
    """Arguments in one spelling, whatever their spacing or key order: data as it is, a string as the JSON value it
    spells (``settle`` takes JSON text too), or as itself when it spells none."""
    if isinstance(arguments, str):
        text = arguments
        try:
            arguments = json.loads(text)
        except ValueError:
            return text
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class ToolCall:
    """A call the answer made, read from the generated text: its arguments are that JSON text as the model wrote it
    (streamed as it came), which each dialect writes in its shape."""

    id: str
    name: str
    arguments: str


def plan(
    tools: Sequence[Tool], choice: ToolChoice | None, parallel: bool | None, fmt: ToolFormat = GENERIC
) -> ToolPlan | None:
    """The ``ToolPlan`` for a request's declared ``tools``, its tool ``choice`` (None: not given, which is "auto")
    and ``parallel`` calls (None: allowed), in the model's tool format ``fmt``; None: no tools in play."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidField("tool_choice", "tool_choice demands a tool call, but the request has no tools")
        return None
    for i, tool in enumerate(tools):
        if any(t.name == tool.name for t in tools[:i]):
            raise InvalidField("tools", f"tools[{i}]: tool {tool.name!r} is declared twice: name each tool once")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None
    if isinstance(choice, NamedTool):
        if not any(t.name == choice.name for t in tools):
            names = ", ".join(t.name for t in tools)
            raise InvalidField(
                "tool_choice", f"tool_choice names {choice.name!r}, which is not among the tools ({names})"
            )
        choice = choice.name
    return ToolPlan(tuple(tools), choice, parallel=True if parallel is None else parallel, format=fmt)


def engine_messages(turns: Sequence[Turn], fmt: ToolFormat = GENERIC) -> list[ChatMessage]:
    """The conversation as the engine renders it, earlier calls and tool results in the model's tool format ``fmt``:
    a call without an id gets ``call_<turn>_<call>``, and a tool result is named after the call it answers (the
    name the client gave when no earlier call has its id)."""
    out = []
    names: dict[str, str] = {}  # call id -> function name, for the results that answer them
    for i, turn in enumerate(turns):
        calls = [(call.id or f"call_{i}_{j}", call.name, call.arguments) for j, call in enumerate(turn.calls)]
        names.update((made, name) for made, name, _ in calls)
        name = names.get(turn.answers or "", turn.tool) if turn.role == "tool" else None
        out.append(_message(turn, calls, name, fmt))
    return out


def _message(turn: Turn, calls: list[tuple[str, str, Any]], name: str | None, fmt: ToolFormat) -> ChatMessage:
    """One turn for the engine: an assistant's ``calls`` (id, name, arguments) and a tool's result (a call of
    ``name``) as the model's template writes them in a native format, or in the generic format's text (a result is
    then a user turn: templates without tools have no tool role). Arguments become JSON text here, once."""
    text = turn.text
    if fmt.native:
        short = _short_id if fmt.short_ids else str
        answers = turn.answers if turn.role == "tool" else None
        return ChatMessage(
            role=turn.role,
            content=text,
            tool_calls=tuple(MessageCall(short(i), n, _json(a)) for i, n, a in calls),
            tool_call_id=short(answers) if answers is not None else None,
            name=name,
            reasoning=turn.reasoning,
        )
    if calls:
        written = _json({"tool_calls": [{"name": n, "arguments": a} for _, n, a in calls]})
        text = f"{text}\n{written}" if text else written
    if turn.role == "tool":
        result = {"tool_call_id": turn.answers, "name": name, "content": text}
        return ChatMessage(role="user", content=_json({"tool_response": result}))
    return ChatMessage(role=turn.role, content=text, reasoning=turn.reasoning)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _short_id(call_id: str) -> str:
    """A call id as Mistral's templates demand one (9 alphanumeric characters), the same for the same id."""
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _template_tool(tool: Tool) -> dict[str, Any]:
    """A tool as a chat template receives it (OpenAI's shape, which Hugging Face's templates read)."""
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


# --------------------------------------------------------------------------------------------------------------
# The answer, read as it is generated
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """Decoded characters of the answer's ``response`` string (or of an answer that is not the generic JSON)."""

    text: str


@dataclass(frozen=True)
class CallOpened:
    """A call is reported: its name is known and it is not (yet) a repeat of an earlier one."""

    index: int  # among the calls reported (a dropped repeat takes no index)
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of an opened call's arguments, as JSON text (the deltas joined are the whole arguments)."""

    index: int
    delta: str


@dataclass(frozen=True)
class CallClosed:
    """An opened call's arguments are complete."""

    index: int
    call: ToolCall


Event = Text | CallOpened | CallArguments | CallClosed

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERAL = frozenset("0123456789+-.eEtruefalsn")
_SPACE = frozenset(" \t\n\r")
_REPLACEMENT = "\ufffd"  # for a lone surrogate escape: not encodable as UTF-8


class _Frame:
    """An open object or array of the answer."""

    __slots__ = ("expect", "index", "key", "kind", "path")

    def __init__(self, kind: str, path: tuple[str | int, ...]) -> None:
        self.kind = kind  # "{" or "["
        self.path = path
        self.key: str | None = None
        self.index = 0
        self.expect = "first"  # first (a key/value or the end), key, colon, value, next (a comma or the end)


@dataclass
class _Call:
    """One call in the model's list, as far as it has been read."""

    name: str | None = None
    raw: list[str] = field(default_factory=list)  # the arguments' JSON text
    compact: list[str] = field(default_factory=list)  # the same without the whitespace between tokens
    index: int | None = None  # once reported
    id: str = ""
    sent: int = 0  # pieces of ``raw`` already reported
    complete: bool = False


class AnswerStream:
    """The generic JSON answer, parsed as its text arrives (``feed``), told as events a dialect streams.

    ``{"response": "..."}`` becomes the string's decoded characters (``Text``), a few at a time, never its JSON;
    ``{"tool_calls": [...]}`` becomes each call: ``CallOpened`` once its name is known, its arguments' text as it
    comes (``CallArguments``), ``CallClosed`` once they are complete. A call identical to an earlier one (same
    name, same arguments up to the spaces between their tokens: the grammar fixes the keys' order) is dropped,
    and a call beyond the plan's bound is ignored: while a call could still turn out to repeat an earlier one (its
    name and arguments so far are the start of one), it is held back, and reported only once it differs.
    When a limit cuts the answer, nothing of the JSON leaks: the content is the decoded part of the response
    string, a call is complete only if its object closed (``calls``), and a call held back is never reported. Text
    that does not start as JSON at all is content as written.
    """

    def __init__(self, max_calls: int = MAX_PARALLEL_CALLS, arguments_key: str = "arguments") -> None:
        self.max_calls = max_calls
        self.arguments_key = arguments_key  # a call's arguments object (Llama 3 writes "parameters")
        self.branch: str | None = None  # "response", "tool_calls", or "text" (not the generic JSON)
        self.complete = False  # the answer's JSON closed
        self.broken: str | None = None  # why the text stopped parsing (the grammar should make this impossible)
        self.calls: list[ToolCall] = []  # the complete calls reported
        self._content: list[str] = []
        self._events: list[Event] = []
        self._stack: list[_Frame] = []
        self._started = False
        self._string: list[str] | None = None  # the decoded string being read
        self._string_path: tuple[str | int, ...] = ()
        self._key = False  # the string is an object's key
        self._escape: str | None = None  # "" after a backslash, "u..." inside a \u escape
        self._high: int | None = None  # a high surrogate waiting for its low half
        self._literal: list[str] | None = None  # a number, true, false or null being read
        self._literal_path: tuple[str | int, ...] = ()
        self._call: _Call | None = None  # the call being read
        self._capture = 0  # > 0: depth of the arguments value being captured (characters go to the call)
        self._reported: list[_Call] = []
        self._pending_space = ""  # whitespace before the answer's first character

    # --- what the dialects read -----------------------------------------------------------------------------

    @property
    def content(self) -> str | None:
        """The answer's text: the response string (decoded, as far as it went); None for an answer of calls."""
        if self.branch == "tool_calls":
            return None
        return "".join(self._content)

    def feed(self, text: str) -> list[Event]:
        """Read more of the answer; the events it decides."""
        for i, c in enumerate(text):
            if self.broken is not None:
                break
            if self.branch == "text":  # the rest is text as written
                self._content.append(text[i:])
                self._text(text[i:])
                break
            self._char(c)
        self._advance()
        return self._drain()

    def finish(self) -> list[Event]:
        """The answer ended (complete, or cut by a limit): the events still owed. A call held back is dropped."""
        if self.branch is None and not self._started and self._pending_space:
            self.branch = "text"  # only whitespace: it is the text
            self._content.append(self._pending_space)
            self._text(self._pending_space)
        self._advance()
        return self._drain()

    def finish_reason(self, finish: str) -> str:
        """OpenAI's finish reason for this answer, given the generation's ("length" or "stop")."""
        if finish == "length" and not self.complete:
            return "length"
        return "tool_calls" if self.calls else "stop"

    # --- the characters ------------------------------------------------------------------------------------

    def _char(self, c: str) -> None:
        if not self._started:
            if c in _SPACE:
                self._pending_space += c
                return
            if c != "{":
                self.branch = "text"  # not the generic JSON (no grammar held it): the text is the answer
                self._content.append(self._pending_space + c)
                self._text(self._pending_space + c)
                return
            self._started = True
        if self._string is not None:
            self._raw(c, compact=True)
            self._string_char(c)
            return
        if self._literal is not None:
            if c in _LITERAL:
                self._raw(c, compact=True)
                self._literal.append(c)
                return
            self._end_literal()
        if c in _SPACE:
            self._raw(c, compact=False)
            return
        frame = self._stack[-1] if self._stack else None
        expect = frame.expect if frame is not None else ("done" if self.complete else "value")
        if frame is not None and c == "}]"[frame.kind == "["] and expect in ("first", "next"):
            self._raw(c, compact=True)
            self._stack.pop()
            self._value_end(frame.path)
        elif expect == "value" or (frame is not None and frame.kind == "[" and expect == "first"):
            self._value_start(c, self._child_path())
        elif expect in ("first", "key") and c == '"':
            self._raw(c, compact=True)
            self._string, self._key = [], True
        elif expect == "colon" and c == ":":
            self._raw(c, compact=True)
            assert frame is not None
            frame.expect = "value"
        elif expect == "next" and c == ",":
            self._raw(c, compact=True)
            assert frame is not None
            if frame.kind == "[":
                frame.index += 1
                frame.expect = "value"
            else:
                frame.expect = "key"
        else:
            self._break(f"unexpected {c!r} where the answer's JSON expects {expect}")

    def _child_path(self) -> tuple[str | int, ...]:
        if not self._stack:
            return ()
        frame = self._stack[-1]
        slot: str | int = frame.index if frame.kind == "[" else (frame.key or "")
        return (*frame.path, slot)

    def _value_start(self, c: str, path: tuple[str | int, ...]) -> None:
        if len(path) == 1 and self.branch is None and path[0] in ("response", "tool_calls"):
            self.branch = str(path[0])
        if self.branch == "tool_calls" and len(path) >= 2 and path[0] == "tool_calls" and isinstance(path[1], int):
            if len(path) == 2 and c == "{":
                self._call = _Call()
            elif len(path) == 3 and path[2] == self.arguments_key and self._call is not None:
                self._capture = len(self._stack) + 1  # the stack's depth once this value has ended, plus one
        self._raw(c, compact=True)
        if c in "{[":
            self._stack.append(_Frame(c, path))
        elif c == '"':
            self._string, self._key, self._string_path = [], False, path
        elif c in _LITERAL:
            self._literal, self._literal_path = [c], path
        else:
            self._break(f"unexpected {c!r} where the answer's JSON expects a value")

    def _value_end(self, path: tuple[str | int, ...]) -> None:
        if self._capture and len(self._stack) + 1 == self._capture:
            self._capture = 0
        if not self._stack:
            self.complete = True
        else:
            self._stack[-1].expect = "next"
        call = self._call
        if call is not None and len(path) == 2 and path[0] == "tool_calls":
            call.complete = True
            self._advance()
            self._call = None

    def _string_char(self, c: str) -> None:
        assert self._string is not None
        escape = self._escape
        if escape is None:
            if c == "\\":
                self._escape = ""
            elif c == '"':
                self._end_string()
            else:
                self._decoded(c)
        elif escape == "":
            if c == "u":
                self._escape = "u"
            elif c in _ESCAPES:
                self._escape = None
                self._decoded(_ESCAPES[c])
            else:
                self._break(f"unknown escape \\{c} in a string")
        else:
            self._escape = escape + c
            if len(self._escape) == 5:
                self._escape = None
                try:
                    code = int(escape[1:] + c, 16)
                except ValueError:
                    self._break(f"bad \\u escape {escape + c!r}")
                    return
                self._code(code)

    def _code(self, code: int) -> None:
        if 0xD800 <= code < 0xDC00:  # a high surrogate: its low half follows as the next escape
            if self._high is not None:
                self._decoded(_REPLACEMENT)
            self._high = code
        elif 0xDC00 <= code < 0xE000 and self._high is not None:
            high, self._high = self._high, None
            self._decoded(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
        else:
            self._decoded(_REPLACEMENT if 0xD800 <= code < 0xE000 else chr(code))

    def _decoded(self, text: str) -> None:
        """A string's next decoded characters (a high surrogate left waiting is a U+FFFD before them)."""
        assert self._string is not None
        if self._high is not None:
            self._high = None
            text = _REPLACEMENT + text
        self._string.append(text)
        if not self._key and self._string_path == ("response",):
            self._content.append(text)
            self._text(text)

    def _end_string(self) -> None:
        assert self._string is not None
        if self._high is not None:
            self._decoded("")
        value, self._string = "".join(self._string), None
        frame = self._stack[-1] if self._stack else None
        if self._key:
            assert frame is not None
            frame.key, frame.expect = value, "colon"
            return
        path = self._string_path
        if self._call is not None and len(path) == 3 and path[0] == "tool_calls" and path[2] == "name":
            self._call.name = value
        self._value_end(path)

    def _end_literal(self) -> None:
        assert self._literal is not None
        text, self._literal = "".join(self._literal), None
        try:
            json.loads(text)
        except ValueError:
            self._break(f"{text!r} is not a JSON value")
            return
        self._value_end(self._literal_path)

    def _raw(self, c: str, compact: bool) -> None:
        if self._capture and self._call is not None:
            self._call.raw.append(c)
            if compact:
                self._call.compact.append(c)

    def _break(self, why: str) -> None:
        """Stop reading: what follows is not the generic JSON, and none of it is reported (it would leak)."""
        self.broken = why
        log.warning("a tool answer stopped parsing: %s; the rest of it is not reported", why)

    def _text(self, text: str) -> None:
        if self._events and isinstance(self._events[-1], Text):
            self._events[-1] = Text(self._events[-1].text + text)
        else:
            self._events.append(Text(text))

    # --- the calls -----------------------------------------------------------------------------------------

    def _advance(self) -> None:
        """Report what the call being read allows now: open it once it cannot be a repeat, send its arguments,
        close it when complete (a complete repeat, or a call beyond the bound, is dropped)."""
        call = self._call
        if call is None or call.name is None:
            return
        if call.index is None:
            if len(self._reported) >= self.max_calls or self._repeats(call):
                if call.complete:
                    self._call = None  # dropped
                return
            call.index, call.id = len(self._reported), new_request_id("call", "_")
            self._reported.append(call)
            self._events.append(CallOpened(call.index, call.id, call.name))
        if len(call.raw) > call.sent:
            delta = "".join(call.raw[call.sent :])
            call.sent = len(call.raw)
            last = self._events[-1] if self._events else None
            if isinstance(last, CallArguments) and last.index == call.index:
                self._events[-1] = CallArguments(call.index, last.delta + delta)
            else:
                self._events.append(CallArguments(call.index, delta))
        if call.complete:
            done = ToolCall(call.id, call.name, "".join(call.raw) or "{}")
            self.calls.append(done)
            self._events.append(CallClosed(call.index, done))

    def _repeats(self, call: _Call) -> bool:
        """Whether ``call`` is, or may still become, identical to a call reported before it."""
        compact = "".join(call.compact)
        for earlier in self._reported:
            if earlier.name != call.name:
                continue
            before = "".join(earlier.compact)
            if before == compact if call.complete else before.startswith(compact):
                return True
        return False

    def _drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events


class NativeStream:
    """An answer in a native tool format (``ToolFormat``), parsed as its text arrives, told as ``AnswerStream``'s
    events: a text answer (one that does not start with the format's lead) as ``Text`` as written; calls as the
    generic parser reads them (bound, repeats dropped, arguments streamed), fed each call's JSON object as one
    item of a ``{"tool_calls": [...]}`` list. The format's tags, separators and brackets between calls (the
    grammar puts them there) are skipped."""

    def __init__(self, fmt: ToolFormat, max_calls: int) -> None:
        self.lead = fmt.lead
        self.branch: str | None = None  # "text" or "tool_calls" once decided
        self._inner = AnswerStream(max_calls, fmt.arguments_key)
        self._head = ""  # the answer's start, until it decides the branch
        self._text: list[str] = []
        self._events: list[Event] = []
        self._depth = 0  # of the call object being read (0: between calls)
        self._in_string = False
        self._escape = False
        self._items = 0  # call objects begun
        self._json: list[str] = []  # the generic list's text for the inner parser, fed once per ``feed``

    @property
    def content(self) -> str | None:
        if self.branch == "tool_calls":
            return None
        return "".join(self._text) if self.branch == "text" else self._head

    @property
    def calls(self) -> list[ToolCall]:
        return self._inner.calls

    @property
    def complete(self) -> bool:
        return self._inner.complete

    def feed(self, text: str) -> list[Event]:
        for i, c in enumerate(text):
            if self.branch == "text":
                self._say(text[i:])
                break
            if self.branch is None:
                self._decide(c)
            else:
                self._call_char(c)
        self._flush()
        return self._drain()

    def finish(self) -> list[Event]:
        if self.branch is None and self._head:
            self.branch = "text"  # a start of the lead and no more (a limit cut it): text as written
            self._say(self._head)
        if self.branch == "tool_calls" and self._depth == 0 and self._items:
            self._json.append("]}")  # every call object closed: the list is complete
        if self.branch == "tool_calls":
            self._flush()
            self._events += self._inner.finish()
        return self._drain()

    def finish_reason(self, finish: str) -> str:
        if self.branch == "tool_calls":
            return self._inner.finish_reason(finish)
        return "length" if finish == "length" else "stop"

    def _decide(self, c: str) -> None:
        self._head += c
        start = self._head.lstrip()
        if not start or (self.lead.startswith(start) and start != self.lead):
            return
        if start == self.lead:
            self.branch = "tool_calls"
            self._json.append('{"tool_calls": [')
            if self.lead == "{":  # a bare call: the lead is its object's first character
                self._call_char("{")
            return
        self.branch = "text"
        self._say(self._head)

    def _call_char(self, c: str) -> None:
        if self._depth == 0:
            if c != "{":
                return  # a tag, a separator, a bracket of the list: the format's, not the call's
            if self._items:
                self._json.append(",")
            self._items += 1
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
        elif c == '"':
            self._in_string = True
        elif c == "{":
            self._depth += 1
        elif c == "}":
            self._depth -= 1
        self._json.append(c)

    def _flush(self) -> None:
        if self._json:
            self._events += self._inner.feed("".join(self._json))
            self._json = []

    def _say(self, text: str) -> None:
        self._text.append(text)
        if self._events and isinstance(self._events[-1], Text):
            self._events[-1] = Text(self._events[-1].text + text)
        else:
            self._events.append(Text(text))

    def _drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def parse(
    text: str, max_calls: int = MAX_PARALLEL_CALLS, fmt: ToolFormat = GENERIC
) -> tuple[str | None, list[ToolCall]]:
    """A whole answer as (content, complete calls), read as ``AnswerStream`` (or ``NativeStream``) reads it."""
    stream: AnswerStream | NativeStream = NativeStream(fmt, max_calls) if fmt.native else AnswerStream(max_calls)
    stream.feed(text)
    stream.finish()
    return stream.content, stream.calls
