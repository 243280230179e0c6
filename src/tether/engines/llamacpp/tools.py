"""Tools in a model's native format, the runner's half: the chat as the template reads it, and the grammar of a
``ToolSyntax`` answer.

The serving side decides the syntax from the model's chat template (``serve/dialects/tools``); here the template
gets the tools and the earlier calls and results as Hugging Face's templates expect them (OpenAI's shapes, each
call's arguments an object), and the answer is held by a GBNF grammar to either text that does not start as a call
does, or calls written in the model's syntax, each one's JSON matching its tool's parameter schema.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from tether.protocol import ChatMessage, ToolSyntax

ROOT = "tether-answer"  # the grammar's start rule (the JSON Schema converter's own rules include "root": a call)


def template_messages(messages: tuple[ChatMessage, ...] | list[ChatMessage]) -> list[dict[str, Any]]:
    """The chat as a Jinja chat template reads it: role and content, an assistant's ``tool_calls`` (OpenAI's shape,
    arguments as an object where they are JSON, as Hugging Face templates write them with ``tojson``) and its
    thinking as ``reasoning_content`` (the name Qwen3's and DeepSeek's templates read), a tool result's
    ``tool_call_id`` and ``name``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            turn["name"] = m.name
        if m.reasoning is not None:
            turn["reasoning_content"] = m.reasoning
        out.append(turn)
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def tool_grammar(syntax: ToolSyntax, call_grammar: str, owed: bool = False) -> str:
    """The GBNF of an answer under ``syntax`` (start rule :data:`ROOT`), given ``call_grammar``: the GBNF of one
    call's JSON Schema, whose start rule is ``root``. ``owed``: the answer follows the model's thinking, so it is
    not empty (a text answer has a character besides whitespace)."""
    return _wrap(
        call_grammar, syntax.open, syntax.before, syntax.after, syntax.separator, syntax.close, syntax.max_calls,
        syntax.text, syntax.lead, owed,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _wrap(
    call: str,
    open_: str,
    before: str,
    after: str,
    separator: str,
    close: str,
    max_calls: int,
    text: bool,
    lead: str,
    owed: bool,
) -> str:
    rules = [call.rstrip("\n")]
    answers = []
    if max_calls > 0:
        rules.append(f"{ROOT}-call ::= {_seq(before, 'root', after)}")
        more = f" ({_seq(separator, ROOT + '-call')}){{0,{max_calls - 1}}}" if max_calls > 1 else ""
        rules.append(f"{ROOT}-calls ::= {_seq(open_, ROOT + '-call')}{more} {_seq(close)}".rstrip())
        answers.append(f"{ROOT}-calls")
    if text or max_calls == 0:
        rules.append(f"{ROOT}-text ::= {_not_starting_with(lead, owed)}")
        answers.append(f"{ROOT}-text")
    # a few newlines or spaces may lead either (a model writes some after its thinking): never a call in the text
    rules.append(f"{ROOT} ::= {LEADING_SPACE} ( {' | '.join(answers)} )")
    return "\n".join(rules) + "\n"


LEADING_SPACE = "[ \\t\\n]{0,8}"


def _not_starting_with(lead: str, nonempty: bool = False) -> str:
    """A GBNF alternative of every text that does not start with ``lead`` once its leading whitespace is left out
    (the empty text included unless ``nonempty``): its first character is neither whitespace nor the lead's, or it
    leaves the lead at some character ``i`` (``lead[:i]``, then any other character, then anything), or ends inside
    it."""
    alternatives = []
    for i, c in enumerate(lead):
        start = f"{_literal(lead[:i])} " if i else ""
        other = f"{_char(c)}\\x20\\x09\\x0A\\x0D" if i == 0 else _char(c)
        alternatives.append(f"{start}[^{other}] .*")
        if i:
            alternatives.append(_literal(lead[:i]))
    return "( " + " | ".join(alternatives) + (" )" if nonempty else " )?")


def _seq(*parts: str) -> str:
    """Literal texts and rule names (``root``, ``tether-answer-*``) in a row; empty texts are left out."""
    return " ".join(p if p == "root" or p.startswith(ROOT) else _literal(p) for p in parts if p)


def _literal(text: str) -> str:
    return '"' + "".join(_char(c) if not c.isalnum() else c for c in text) + '"'


def _char(c: str) -> str:
    """One character escaped for a GBNF literal or character class (every non-alphanumeric one, to be safe)."""
    code = ord(c)
    if c.isascii() and c.isalnum():
        return c
    if code < 0x100:
        return f"\\x{code:02X}"
    if code < 0x10000:
        return f"\\u{code:04X}"
    return f"\\U{code:08X}"
