"""Tool answers stream as they are decided and never leak their JSON (issue 34).

The parser (``tools.AnswerStream``) and the three shapers alone first: any chunking of an answer gives the same
text and calls, a cut answer reports only what was decided, repeats and calls beyond the bound are dropped. Then
the default model behind a live server, through the clients people use: the openai SDK's stream, Ollama's client,
and a pydantic-ai agent's streamed tool round trip.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import jsonschema
import msgspec
import ollama
import pydantic
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from conftest import Server
from tether.protocol import Chunk
from tether.serve.dialects import ollama as ollama_dialect
from tether.serve.dialects import openai as openai_dialect
from tether.serve.dialects import responses
from tether.serve.dialects import tools as toolkit

ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD_PARAMETERS}}
CALLS = (
    '{"tool_calls": [{"name": "add", "arguments": {"a": 17, "b": 25}}, '
    '{"name": "add", "arguments": {"a":17,"b":25}}, '  # the same call again (spaced otherwise): dropped
    '{"name": "add", "arguments": {"a": 17, "b": 2}}, '  # starts as a repeat, then differs: reported
    '{"name": "add", "arguments": {"a": 17, "b": 25}}]}'  # the first call a third time: dropped
)
RESPONSE = '{"response": "17 + 25 = 42, \\"exactly\\"\\n\\u00e9t\\u00e9 \\ud83d\\ude00 {\\"tool_calls\\": []}"}'
DECODED = '17 + 25 = 42, "exactly"\nété 😀 {"tool_calls": []}'
LEAKS = ('{"response"', '{"tool_calls"', '"arguments"')
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


def read(text: str, pieces: list[int], max_calls: int = toolkit.MAX_PARALLEL_CALLS) -> tuple[Any, list[Any]]:
    """``text`` fed in pieces cut at ``pieces``; the stream (finished) and every event it told."""
    stream = toolkit.AnswerStream(max_calls)
    events: list[Any] = []
    for start, end in zip([0, *pieces], [*pieces, len(text)], strict=True):
        events += stream.feed(text[start:end])
    return stream, events + stream.finish()


def told(events: list[Any]) -> tuple[str, dict[int, dict[str, Any]]]:
    """What a client assembles from the events: the text, and each call's name, id and arguments."""
    text, calls = "", {}
    for event in events:
        if isinstance(event, toolkit.Text):
            text += event.text
        elif isinstance(event, toolkit.CallOpened):
            assert event.index not in calls and event.index == len(calls)
            calls[event.index] = {"name": event.name, "id": event.id, "arguments": "", "closed": False}
        elif isinstance(event, toolkit.CallArguments):
            assert not calls[event.index]["closed"]
            calls[event.index]["arguments"] += event.delta
        else:
            assert event.call.arguments == calls[event.index]["arguments"] and event.call.id == calls[event.index]["id"]
            calls[event.index]["closed"] = True
    return text, calls


# --------------------------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------------------------


def test_every_chunking_of_an_answer_tells_the_same_text_and_calls() -> None:
    for answer in (RESPONSE, CALLS):
        splits = [[i] for i in range(1, len(answer))] + [list(range(1, len(answer)))]  # each cut, and per character
        for pieces in splits:
            stream, events = read(answer, pieces)
            text, calls = told(events)
            assert stream.complete and stream.broken is None
            if answer is RESPONSE:
                assert text == stream.content == DECODED and not calls and stream.finish_reason("stop") == "stop"
                continue
            assert stream.content is None and not text and stream.finish_reason("length") == "tool_calls"
            assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
                ("add", {"a": 17, "b": 25}),
                ("add", {"a": 17, "b": 2}),
            ]
            assert all(c["closed"] for c in calls.values())
            assert [c.arguments for c in stream.calls] == ['{"a": 17, "b": 25}', '{"a": 17, "b": 2}']


def test_a_cut_answer_reports_only_what_was_decided_and_no_json() -> None:
    for answer in (RESPONSE, CALLS):
        for end in range(len(answer)):  # the answer cut after every character
            stream, events = read(answer[:end], [end // 2] if end else [])
            text, calls = told(events)
            content = stream.content
            assert not any(leak in (content or "") for leak in LEAKS[1:]) or answer is RESPONSE
            assert not (content or "").startswith("{"), content
            assert stream.finish_reason("length") == "length"
            if answer is RESPONSE:
                assert content is not None and DECODED.startswith(content) and text == content
                continue
            assert content in (None, "") and not text
            assert all(c.arguments in ('{"a": 17, "b": 25}', '{"a": 17, "b": 2}') for c in stream.calls)
            for call in calls.values():  # a call streamed before the cut: arguments that start the real ones
                assert call["arguments"] in CALLS and (call["closed"] or not call["arguments"].endswith("}}"))


def test_parallel_false_is_one_call_in_the_grammar_and_the_parser() -> None:
    bounded, default = chat_plan(False, parallel=False), chat_plan(False)
    assert bounded.tools is not None and default.tools is not None
    for plan, bound in ((bounded, 1), (default, toolkit.MAX_PARALLEL_CALLS)):
        schema = json.loads(plan.params.json_schema or "")
        assert schema["anyOf"][0]["properties"]["tool_calls"]["maxItems"] == bound
    stream = bounded.tools.stream()
    _, calls = told(stream.feed(CALLS.replace('"b": 2}', '"b": 3}')) + stream.finish())
    assert len(calls) == 1 and len(stream.calls) == 1
    distinct = '{"tool_calls": ' + json.dumps([{"name": "add", "arguments": {"a": i, "b": 1}} for i in range(12)]) + "}"
    assert [json.loads(c.arguments)["a"] for c in toolkit.parse(distinct)[1]] == list(range(toolkit.MAX_PARALLEL_CALLS))


def test_a_repeat_is_held_back_until_it_differs_and_never_reported_when_it_does_not() -> None:
    stream = toolkit.AnswerStream()
    first = '{"tool_calls": [{"name": "add", "arguments": {"a": 17, "b": 25}}, {"name": "add", "arguments": {"a": 17'
    opened = [e for e in stream.feed(first) if isinstance(e, toolkit.CallOpened)]
    assert [e.index for e in opened] == [0]  # the second call is, so far, the first one again: held back
    events = stream.feed(', "b": 2')  # "2" may still become "25"
    assert not any(isinstance(e, toolkit.CallOpened) for e in events)
    events = stream.feed("6")  # now it differs: opened, with everything held so far
    assert [type(e) for e in events] == [toolkit.CallOpened, toolkit.CallArguments]
    assert events[1].delta == '{"a": 17, "b": 26'
    events = stream.feed("}}, " + '{"name": "add", "arguments": {"a": 17, "b": 25}}]}')  # a repeat of the first
    assert [type(e) for e in events] == [toolkit.CallArguments, toolkit.CallClosed]
    assert stream.complete and [c.arguments for c in stream.calls] == ['{"a": 17, "b": 25}', '{"a": 17, "b": 26}']


def test_text_that_is_not_the_json_is_the_answer_and_broken_json_stops_without_leaking() -> None:
    assert toolkit.parse("  plain words") == ("  plain words", [])
    stream, events = read('{"response": "fine so far"} trailing', [5])
    assert stream.content == "fine so far" and stream.complete and stream.broken is not None
    stream, events = read('{"response": "half', [3])
    assert stream.content == "half" and told(events)[0] == "half" and not stream.complete


# --------------------------------------------------------------------------------------------------------------
# The shapers
# --------------------------------------------------------------------------------------------------------------


def chat_plan(stream: bool, choice: str = "auto", parallel: bool | None = None) -> Any:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "17 + 25?"}], "tools": [ADD], "stream": stream}
    body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return openai_dialect.chat_plan(openai_dialect.decode("chat", json.dumps(body).encode()))  # type: ignore[arg-type]


def fed(shaper: Any, answer: str, size: int = 3) -> bytes:
    """``answer`` fed as the runner would, a few characters a chunk; the bytes a stream sends (opening included)."""
    out = b""
    for i in range(0, len(answer), size):
        piece = shaper.feed(Chunk("t", answer[i : i + size]))
        out += (shaper.opening() if i == 0 else b"") + piece
    return out


def sse_objects(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: {")]


def chat_chunks(data: bytes) -> list[ChatCompletionChunk]:
    """A chat stream's chunks, each as the served schema states it (the dialect's) and as the openai SDK reads it."""
    objects = sse_objects(data)
    for obj in objects:
        msgspec.convert(obj, openai_dialect.ChatCompletionChunk)
    return [ChatCompletionChunk.model_validate(o) for o in objects]


def test_the_chat_shaper_streams_text_and_calls_as_openai_does_and_a_cut_leaks_nothing() -> None:
    shaper = openai_dialect.OpenAIShaper("chat", "chatcmpl-1", "m", chat_plan(True))
    chunks = chat_chunks(fed(shaper, CALLS) + shaper.closing("stop", 9, 40))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id or "", "name": "", "arguments": ""})
            assert call.id is None or call.id == entry["id"]
            entry["name"] += (call.function.name if call.function else None) or ""
            entry["arguments"] += (call.function.arguments if call.function else None) or ""
    assert (
        sum(1 for d in deltas if d.tool_calls and d.tool_calls[0].function and d.tool_calls[0].function.arguments) > 2
    )
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("add", {"a": 17, "b": 25}),
        ("add", {"a": 17, "b": 2}),
    ]
    assert (
        all(c["id"].startswith("call_") for c in calls.values()) and chunks[-1].choices[0].finish_reason == "tool_calls"
    )

    shaper = openai_dialect.OpenAIShaper("chat", "chatcmpl-2", "m", chat_plan(True))
    chunks = chat_chunks(fed(shaper, RESPONSE) + shaper.closing("stop", 9, 40))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 5 and "".join(texts) == DECODED and chunks[-1].choices[0].finish_reason == "stop"

    for answer, content in ((RESPONSE[:30], '17 + 25 = 42, "'), (CALLS[:60], None)):  # cut by the limit
        for stream in (False, True):
            shaper = openai_dialect.OpenAIShaper("chat", "chatcmpl-3", "m", chat_plan(stream))
            streamed = fed(shaper, answer)
            if stream:
                objects = sse_objects(streamed + shaper.closing("length", 9, 10))
                text = "".join(o["choices"][0]["delta"].get("content") or "" for o in objects if o["choices"])
                assert text == (content or "") and objects[-1]["choices"][0]["finish_reason"] == "length"
                continue
            whole = ChatCompletion.model_validate_json(shaper.whole("length", 9, 10))
            message = whole.choices[0].message
            assert whole.choices[0].finish_reason == "length" and message.content == content and not message.tool_calls


def test_ollama_streams_text_in_pieces_and_each_call_whole() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "17 + 25?"}], "tools": [ADD]}
    plan = ollama_dialect.chat_plan(ollama_dialect.decode(ollama_dialect.OllamaChatRequest, json.dumps(body).encode()))
    assert plan is not None
    shaper = ollama_dialect.OllamaShaper("chat", "m", plan, time.monotonic())
    lines = [
        ollama.ChatResponse(**json.loads(line))
        for line in (fed(shaper, CALLS) + shaper.closing("stop", 9, 40)).splitlines()
    ]
    calls = [call for line in lines for call in line.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("add", {"a": 17, "b": 25}),
        ("add", {"a": 17, "b": 2}),
    ]
    assert all(len(line.message.tool_calls or []) <= 1 for line in lines) and lines[-1].done
    shaper = ollama_dialect.OllamaShaper("chat", "m", plan, time.monotonic())
    lines = [
        ollama.ChatResponse(**json.loads(line))
        for line in (fed(shaper, RESPONSE) + shaper.closing("stop", 9, 40)).splitlines()
    ]
    assert len(lines) > 5 and "".join(line.message.content or "" for line in lines) == DECODED
    shaper = ollama_dialect.OllamaShaper("chat", "m", plan, time.monotonic())
    fed(shaper, CALLS[:40])  # cut inside the first call's arguments
    whole = ollama.ChatResponse(**json.loads(shaper.whole("length", 9, 10)))
    assert whole.done_reason == "length" and whole.message.content == "" and not whole.message.tool_calls


def test_the_responses_shaper_streams_argument_deltas_and_ends_a_cut_call_incomplete() -> None:
    body = {"input": "17 + 25?", "tools": [{"type": "function", "name": "add", "parameters": ADD_PARAMETERS}]}
    plan = responses.plan(responses.decode(json.dumps(body).encode()))
    shaper = responses.ResponsesShaper("resp_1", "m", dataclasses.replace(plan, stream=True))
    events = [EVENTS.validate_python(o) for o in sse_objects(fed(shaper, CALLS) + shaper.closing("stop", 9, 40))]
    kinds = [e.type for e in events]
    assert kinds.count("response.function_call_arguments.delta") > 4 and kinds[-1] == "response.completed"
    assert [json.loads(i.arguments) for i in events[-1].response.output] == [{"a": 17, "b": 25}, {"a": 17, "b": 2}]
    shaper = responses.ResponsesShaper("resp_2", "m", dataclasses.replace(plan, stream=True))
    events = [EVENTS.validate_python(o) for o in sse_objects(fed(shaper, RESPONSE) + shaper.closing("stop", 9, 40))]
    assert [e.type for e in events][-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == DECODED
    cut = CALLS[:60]
    shaper = responses.ResponsesShaper("resp_3", "m", dataclasses.replace(plan, stream=True))
    events = [EVENTS.validate_python(o) for o in sse_objects(fed(shaper, cut) + shaper.closing("length", 9, 10))]
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"
    shaper = responses.ResponsesShaper("resp_4", "m", plan)
    fed(shaper, cut)
    whole = Response.model_validate_json(shaper.whole("length", 9, 10))
    assert whole.status == "incomplete" and whole.output == []


# --------------------------------------------------------------------------------------------------------------
# The default model, through real clients
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.timeout(300)
def test_a_streamed_tool_call_comes_in_pieces_that_join_into_valid_arguments(model_server: Server) -> None:
    client = model_server.openai()
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "What is 17 + 25?"}],
            tools=[ADD],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=64,
            temperature=0,
            stream=True,
        )
    )
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first = pieces[0]
    assert first.id and first.type == "function" and first.function and first.function.name == "add"
    arguments = "".join(p.function.arguments or "" for p in pieces if p.function)
    assert sum(1 for p in pieces if p.function and p.function.arguments) > 1, pieces  # streamed, not one lump
    assert {p.index for p in pieces} == {0}  # parallel_tool_calls false: one call
    jsonschema.validate(json.loads(arguments), ADD_PARAMETERS)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.model
@pytest.mark.timeout(300)
def test_a_tool_answer_cut_by_max_tokens_leaks_no_json(model_server: Server) -> None:
    client = model_server.openai()
    asks = [("required", "What is 17 + 25?", 10), ("auto", "What is 17 + 25?", 16), ("auto", "Write a poem.", 12)]
    for choice, question, limit in asks:
        request: dict[str, Any] = {
            "model": "m",
            "messages": [{"role": "user", "content": question}],
            "tools": [ADD],
            "tool_choice": choice,
            "max_tokens": limit,
            "temperature": 0,
        }
        whole = client.chat.completions.create(**request)
        assert whole.choices[0].finish_reason == "length", whole
        content = whole.choices[0].message.content or ""
        assert not any(leak in content for leak in LEAKS) and not content.startswith("{"), content
        assert not whole.choices[0].message.tool_calls  # a call whose arguments were cut is not a call
        chunks = list(client.chat.completions.create(**request, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert not any(leak in text for leak in LEAKS) and not text.startswith("{"), text
    answer = ollama.Client(host=model_server.url).chat(
        model="m",
        messages=[{"role": "user", "content": "What is 17 + 25?"}],
        tools=[ADD],
        options={"num_predict": 10, "temperature": 0},
        stream=False,
    )
    assert answer.done_reason == "length" and not answer.message.tool_calls
    assert not any(leak in answer.message.content for leak in LEAKS), answer.message.content


@pytest.mark.model
@pytest.mark.timeout(300)
def test_a_pydantic_ai_agent_streams_a_tool_round_trip(model_server: Server) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import PartDeltaEvent, ToolCallPartDelta
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import RunContext

    @dataclasses.dataclass
    class AddFirst(AbstractCapability[None]):
        """The first step must call ``add`` (the tiny model would rather answer), the next answers in words."""

        def get_model_settings(self) -> Any:
            def settings(ctx: RunContext[None]) -> ModelSettings:
                return {"tool_choice": ["add"] if ctx.run_step <= 1 else "none"}

            return settings

    provider = OpenAIProvider(base_url=f"{model_server.url}/v1", api_key="none")
    agent = Agent(
        OpenAIChatModel("m", provider=provider),
        capabilities=[AddFirst()],
        model_settings={"temperature": 0, "max_tokens": 32},
    )
    added: list[tuple[int, int]] = []

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two integers."""
        added.append((a, b))
        return a + b

    async def run() -> tuple[list[Any], Any]:
        events = []
        async with agent.run_stream_events("What is 17 + 25?") as stream:
            async for event in stream:
                events.append(event)
        return events, events[-1].result

    events, result = asyncio.run(asyncio.wait_for(run(), 240))
    deltas = [e for e in events if isinstance(e, PartDeltaEvent) and isinstance(e.delta, ToolCallPartDelta)]
    assert len(deltas) > 1  # the call's arguments arrived in pieces, as they were generated
    assert len(added) == 1 and all(isinstance(n, int) for n in added[0])
    assert isinstance(result.output, str)
    replies = [m for m in result.all_messages() if m.kind == "response"]
    assert len(replies) == 2 and replies[0].parts[0].tool_name == "add"


def test_an_agent_loop_that_repeats_a_call_or_goes_round_too_often_must_answer_in_text() -> None:
    """Open WebUI's default chat with the 135M model called the same tool 11 times until the context was full: once
    a call repeats (same name, same arguments, whatever their spacing) or MAX_ROUNDS calls were made since the last
    user message, an ``auto`` plan's answer is text (its schema the response branch alone); a plan that demands a
    call is left as it is."""
    add = toolkit.Tool("add", "adds", {"type": "object", "properties": {"a": {"type": "integer"}}})
    auto = toolkit.ToolPlan((add,), "auto")
    assert toolkit.settle(auto, []) is auto
    assert toolkit.settle(auto, [("add", '{"a": 1}'), ("add", '{"a": 2}')]) is auto
    settled = toolkit.settle(auto, [("add", '{"a": 1}'), ("add", '{ "a" : 1 }')])
    assert settled is not None and settled.choice == toolkit.ANSWER
    assert settled.schema() == {
        "type": "object",
        "properties": {"response": {"type": "string", "minLength": 1}},
        "required": ["response"],
    }
    assert '"add"' in settled.system_prompt() and "answer directly" in settled.system_prompt()
    many = [("add", json.dumps({"a": i})) for i in range(toolkit.MAX_ROUNDS)]
    assert toolkit.settle(auto, many).choice == toolkit.ANSWER  # type: ignore[union-attr]
    required = toolkit.ToolPlan((add,), "required")
    assert toolkit.settle(required, [("add", "{}"), ("add", "{}")]) is required
    assert toolkit.settle(None, [("add", "{}")]) is None
    # The Responses API's agent loops too: its function_call items since the last user message count.
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'}
    output = {"type": "function_call_output", "call_id": "c1", "output": "1"}
    body = {
        "model": "m",
        "input": [{"type": "message", "role": "user", "content": "add"}, call, output, call, output],
        "tools": [{"type": "function", "name": "add", "parameters": add.parameters}],
    }
    looping = responses.plan(msgspec.json.decode(json.dumps(body), type=responses.ResponsesRequest))
    assert looping.tools is not None and looping.tools.choice == toolkit.ANSWER
    body["input"] = body["input"][:3]  # type: ignore[index]
    once = responses.plan(msgspec.json.decode(json.dumps(body), type=responses.ResponsesRequest))
    assert once.tools is not None and once.tools.choice == "auto"
