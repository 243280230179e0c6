"""The neutral conversation every dialect maps into, and how ``tools.engine_messages`` renders it for the engine:
arguments stay data from the client to the engine message, call ids default, tool results are named after the
call they answer, the generic and native formats, reasoning carried. Fast: no model, no server."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from tether.engines.llamacpp.tools import template_messages
from tether.protocol import ChatMessage, MessageCall
from tether.serve.dialects import ollama, openai, responses, shapes
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.conversation import Call, NamedTool, Tool, Turn, arguments_of, latest_calls

pytestmark = pytest.mark.timeout(30)

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
# The order of its keys and the spelling of its numbers are the client's: what the engine gets must keep them.
ARGUMENTS = {"b": 1.5, "a": 2, "nested": {"z": [1, 2.25], "y": "é"}}

# A round of tool calling with every case: a call without an id, one with, results answering each (one naming
# another tool than the call it answers), and a result answering no call of the conversation.
ROUND = [
    Turn("user", "add things"),
    Turn("assistant", calls=(Call("add", {"a": 1}), Call("mul", {"a": 2}, "given"))),
    Turn("tool", "1", answers="call_1_0"),
    Turn("tool", "2", answers="given", tool="not-the-call"),
    Turn("tool", "3", answers="elsewhere", tool="own"),
    Turn("tool", "4", answers="nowhere"),
]


def ollama_chat(messages: list[dict[str, Any]], **fields: Any) -> ollama.OllamaChatRequest:
    body = {"model": "m", "messages": messages, "tools": [ADD], **fields}
    return msgspec.json.decode(json.dumps(body), type=ollama.OllamaChatRequest)


OLLAMA_ROUND = [
    {"role": "user", "content": "add"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": ARGUMENTS}}]},
    {"role": "tool", "content": "3.5", "tool_name": "add"},
]


def test_ollama_arguments_reach_the_engine_message_as_data_never_parsed_from_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ollama sends a call's arguments as an object: the turn holds that very object, and no JSON text is read on
    the way to the engine message (formerly dict -> JSON text -> parsed back -> JSON text again)."""
    body = ollama_chat(OLLAMA_ROUND)
    decoded = body.messages[1].tool_calls[0].function.arguments  # type: ignore[index]
    turns = ollama.chat_turns(body.messages)
    assert turns[1].calls == (Call("add", ARGUMENTS),)
    assert turns[1].calls[0].arguments is decoded

    def no_parsing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"JSON text parsed on the way to the engine: {args!r}")

    monkeypatch.setattr(json, "loads", no_parsing)
    native = ollama.chat_plan(body, toolkit.HERMES)
    generic = ollama.chat_plan(body, toolkit.GENERIC)
    monkeypatch.undo()
    assert native is not None and generic is not None
    written = json.dumps(ARGUMENTS, ensure_ascii=False)
    assistant = (native.params.messages or ())[1]
    assert assistant.tool_calls == (MessageCall("call_1_0", "add", written),)
    assert list(json.loads(assistant.tool_calls[0].arguments)) == ["b", "a", "nested"]  # the client's key order
    generic_assistant = (generic.params.messages or ())[2]  # after the tools' system prompt
    assert generic_assistant.content == f'{{"tool_calls": [{{"name": "add", "arguments": {written}}}]}}'


def test_openai_text_arguments_are_read_once_where_they_arrive() -> None:
    """OpenAI sends a call's arguments as JSON text: the turn holds the value it spells; text that is not JSON is
    carried as the client wrote it, and a template reads it as that string, as before."""
    assert arguments_of('{"city":  "Paris"}') == {"city": "Paris"}
    assert arguments_of("not json") == "not json"
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}},
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "not json"}},
    ]
    messages = [{"role": "developer", "content": "sys"}, {"role": "assistant", "tool_calls": calls}]
    turns = shapes.message_turns(msgspec.convert(messages, list[shapes.MessageIn]))
    assert turns == [
        Turn("system", "sys"),
        Turn("assistant", calls=(Call("add", {"a": 1}, "c1"), Call("add", "not json", "c2"))),
    ]
    native = toolkit.engine_messages(turns, toolkit.HERMES)
    assert [c.arguments for c in native[1].tool_calls] == ['{"a": 1}', '"not json"']
    assert [c["function"]["arguments"] for c in template_messages(native)[1]["tool_calls"]] == [{"a": 1}, "not json"]
    generic = toolkit.engine_messages(turns)
    assert json.loads(generic[1].content)["tool_calls"][1]["arguments"] == "not json"


def test_call_ids_default_and_results_are_named_after_the_call_they_answer() -> None:
    native = toolkit.engine_messages(ROUND, toolkit.HERMES)
    assert [m.role for m in native] == ["user", "assistant", "tool", "tool", "tool", "tool"]
    assert native[1].tool_calls == (MessageCall("call_1_0", "add", '{"a": 1}'), MessageCall("given", "mul", '{"a": 2}'))
    # (tool_call_id, name): the call's name wins over the client's; without a call, the client's name, or none
    assert [(m.tool_call_id, m.name) for m in native[2:]] == [
        ("call_1_0", "add"),
        ("given", "mul"),
        ("elsewhere", "own"),
        ("nowhere", None),
    ]
    mistral = toolkit.engine_messages(ROUND, toolkit.MISTRAL)
    short = mistral[1].tool_calls[0].id
    assert len(short) == 9 and short.isalnum() and mistral[2].tool_call_id == short


def test_the_generic_format_writes_calls_and_results_as_text_in_turns_every_template_knows() -> None:
    generic = toolkit.engine_messages(ROUND, toolkit.GENERIC)
    assert [m.role for m in generic] == ["user", "assistant", "user", "user", "user", "user"]
    assert all(not m.tool_calls and m.tool_call_id is None and m.name is None for m in generic)
    assert json.loads(generic[1].content) == {
        "tool_calls": [{"name": "add", "arguments": {"a": 1}}, {"name": "mul", "arguments": {"a": 2}}]
    }
    results = [json.loads(m.content)["tool_response"] for m in generic[2:]]
    assert results == [
        {"tool_call_id": "call_1_0", "name": "add", "content": "1"},
        {"tool_call_id": "given", "name": "mul", "content": "2"},
        {"tool_call_id": "elsewhere", "name": "own", "content": "3"},
        {"tool_call_id": "nowhere", "name": None, "content": "4"},
    ]
    # an assistant's text before its calls comes first, on a line of its own
    said = toolkit.engine_messages([Turn("assistant", "let me add", (Call("add", {"a": 1}),))])
    assert said == [ChatMessage("assistant", 'let me add\n{"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}')]


def test_reasoning_is_carried_on_the_turn_to_the_template_and_nothing_else_changes() -> None:
    thinking = [{**OLLAMA_ROUND[0]}, {**OLLAMA_ROUND[1], "thinking": "2 + 1.5"}, OLLAMA_ROUND[2]]
    body, plain = ollama_chat(thinking), ollama_chat(OLLAMA_ROUND)
    assert ollama.chat_turns(body.messages)[1].reasoning == "2 + 1.5"
    for fmt in (toolkit.GENERIC, toolkit.HERMES):
        with_thinking, without = ollama.chat_plan(body, fmt), ollama.chat_plan(plain, fmt)
        assert with_thinking is not None and without is not None
        shown = [m.reasoning for m in with_thinking.params.messages]
        assert shown.count("2 + 1.5") == 1 and shown.count(None) == len(shown) - 1, shown
        unshown = [msgspec.structs.replace(m, reasoning=None) for m in with_thinking.params.messages]
        assert unshown == list(without.params.messages)
    rendered = template_messages(with_thinking.params.messages)
    assert [m.get("reasoning_content") for m in rendered if m["role"] == "assistant"] == ["2 + 1.5"]


def test_every_dialect_maps_its_own_spelling_into_the_same_turns() -> None:
    """The same round trip in the Responses API's items and in OpenAI's messages is the same conversation."""
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'}
    items = [
        {"type": "message", "role": "developer", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "add"}]},
        {"type": "message", "role": "assistant", "content": "adding"},
        call,
        {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
    ]
    request = msgspec.convert({"input": items}, responses.ResponsesRequest)
    expected = [
        Turn("system", "sys"),
        Turn("user", "add"),
        Turn("assistant", "adding", (Call("add", {"a": 1}, "c1"), Call("add", {"a": 1}, "c2"))),
        Turn("tool", "1", answers="c1"),
    ]
    assert responses.input_turns(request.input) == expected
    messages = [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "add"}]},
        {
            "role": "assistant",
            "content": "adding",
            "tool_calls": [
                {"id": c, "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
                for c in ("c1", "c2")
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]
    chat = msgspec.convert({"messages": messages}, openai.ChatRequest)
    assert shapes.message_turns(chat.messages) == expected


def test_an_agent_loops_calls_are_those_since_its_last_user_turn() -> None:
    turns = [*ROUND, Turn("user", "again"), Turn("assistant", calls=(Call("add", {"a": 3}),))]
    assert latest_calls(ROUND) == [("add", {"a": 1}), ("mul", {"a": 2})]
    assert latest_calls(turns) == [("add", {"a": 3})]
    assert latest_calls([Turn("user", "hi")]) == []
    # the same call again, whatever its spacing or key order, or as data beside text: the answer must be text now
    plan = toolkit.ToolPlan((Tool.declared("add", None, None),), "auto")
    settled = toolkit.settle(plan, [("add", {"a": 1, "b": 2}), ("add", '{"b": 2, "a": 1}')])
    assert settled is not None and settled.choice == toolkit.ANSWER


def test_declared_tools_and_a_named_choice_plan_as_before() -> None:
    declared = Tool.declared("add", None, None)
    assert declared == Tool("add", "", {"type": "object", "properties": {}})
    plan = toolkit.plan([declared], NamedTool("add"), None)
    assert plan is not None and plan.choice == "add" and plan.parallel
    with pytest.raises(Exception, match="tool_choice names 'mul', which is not among the tools"):
        toolkit.plan([declared], NamedTool("mul"), None)
    with pytest.raises(Exception, match="tools\\[1\\]: tool 'add' is declared twice"):
        toolkit.plan([declared, declared], None, None)
    with pytest.raises(Exception, match="tool_choice demands a tool call, but the request has no tools"):
        toolkit.plan([], "required", None)
    assert toolkit.plan([declared], "none", None) is None
