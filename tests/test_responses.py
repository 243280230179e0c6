"""The Responses API (stateless) and ``GET /v1/models/{id}`` on a live server, through the real openai client.

The debug engine proves the shapes (every body and event validated by the openai package's own pydantic models),
the refusals and the failures; the default model proves one real exchange: text, streaming to
``response.completed``, structured output and a function call round trip.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from conftest import Server, debug_server, wait_until
from tether.protocol import Chunk, TokenLogprob, TopLogprob
from tether.serve.dialects import responses

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leftover_runners")]

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


def sse(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """A Responses stream's (event name, data) pairs."""
    name = ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: ") :])


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with debug_server() as server:
        yield server


# --------------------------------------------------------------------------------------------------------------
# Shapes (debug engine: it always ends on the length limit, so its responses are "incomplete")
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_response_has_the_shape_the_openai_models_validate(server: Server) -> None:
    client = server.openai()
    plain = client.responses.create(model="debug", input="tell me", max_output_tokens=6)
    briefed = client.responses.create(
        model="debug",
        instructions="answer in one short line",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "tell me"}]}],
        max_output_tokens=6,
        metadata={"ticket": "42"},
    )
    assert briefed.object == "response" and briefed.id.startswith("resp_")
    assert briefed.status == "incomplete" and briefed.incomplete_details is not None
    assert briefed.incomplete_details.reason == "max_output_tokens"
    message = briefed.output[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and briefed.output_text.strip()
    assert briefed.instructions == "answer in one short line" and briefed.metadata == {"ticket": "42"}
    usage, before = briefed.usage, plain.usage
    assert usage is not None and before is not None
    assert usage.output_tokens == 6 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens > before.input_tokens  # the instructions reached the prompt, as a system message
    raw = server.http.post("/v1/responses", json={"input": "tell me", "max_output_tokens": 3})
    assert raw.status_code == 200, raw.text
    Response.model_validate(raw.json(), strict=False)  # every required field, every type


def test_streamed_events_come_in_order_each_valid_and_the_text_adds_up(server: Server) -> None:
    body = {"model": "debug", "input": "stream it", "max_output_tokens": 5, "stream": True}
    with server.http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = list(sse(response))
    for name, data in events:
        assert name == data["type"], (name, data)
        EVENTS.validate_python(data)
    kinds = [name for name, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 5,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # OpenAI's terminal event when max_output_tokens ends it
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert events[-4][1]["text"] == deltas == final["output"][0]["content"][0]["text"]
    assert final["usage"]["output_tokens"] == 5 and final["incomplete_details"] == {"reason": "max_output_tokens"}

    client = server.openai()  # and the openai client reads the same stream
    kinds = [event.type for event in client.responses.create(model="debug", input="x", stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"


def test_logprobs_come_with_the_text_when_included(server: Server) -> None:
    client = server.openai()
    response = client.responses.create(
        model="debug", input="x", max_output_tokens=4, include=["message.output_text.logprobs"], top_logprobs=1
    )
    part = response.output[0].content[0]
    assert part.type == "output_text" and part.logprobs is not None and len(part.logprobs) == 4
    assert all(p.logprob == 0.0 and len(p.top_logprobs) == 1 for p in part.logprobs)  # the debug engine is certain
    assert "".join(p.token for p in part.logprobs) == part.text


def test_state_tether_does_not_keep_is_refused_naming_the_field(server: Server) -> None:
    client = server.openai()
    for field, value in (
        ("store", True),
        ("previous_response_id", "resp_123"),
        ("conversation", "conv_123"),
        ("background", True),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="debug", input="hi", **{field: value})
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == field, error
        assert "stateless" in error["message"] and "stores no responses" in error["message"], error
    for body, param in (
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning.effort"),  # the debug model does not think
        ({"input": "hi", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"input": "hi", "seed": 1}, "seed"),  # not a Responses field: refused as unknown
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"role": "user", "content": "hi", "output": "x"}]}, "input[0].output"),
    ):
        answer = server.http.post("/v1/responses", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve("resp_123")
    assert "stores no responses" in str(missing.value)
    assert server.http.delete("/v1/responses/resp_123").status_code == 404


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_a_404_naming_the_served(server: Server) -> None:
    client = server.openai()
    model = client.models.retrieve("debug")
    assert model.id == "debug" and model.object == "model" and model.owned_by == "tether"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    error = missing.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found" and "debug" in error["message"], error


def test_a_failure_before_the_first_token_is_an_http_error_even_when_streaming(server: Server) -> None:
    client = server.openai()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    with pytest.raises(openai.BadRequestError) as refused:  # the debug engine cannot follow a schema
        client.responses.create(
            model="debug",
            input="x",
            stream=True,
            text={"format": {"type": "json_schema", "name": "a", "schema": schema}},
        )
    assert isinstance(refused.value.body, dict) and refused.value.body["code"] == "engine_refused"
    server.add_instance(
        {
            "id": "crashy",
            "engine": "debug",
            "faults": [{"kind": "segv", "after_tokens": 0}],
            "restart": {"mode": "never"},
        }
    )
    try:
        with pytest.raises(openai.InternalServerError) as crashed:
            client.responses.create(model="crashy", input="x", stream=True)
        error = crashed.value.body
        assert isinstance(error, dict) and error["code"] == "native_crash" and "SIGSEGV" in error["cause"]["summary"]
    finally:
        assert server.http.delete("/v1/instances/crashy").status_code == 200


def test_a_runner_killed_mid_stream_ends_it_with_response_failed_and_an_error_the_client_raises(
    server: Server,
) -> None:
    server.add_instance(  # the error path (resume off); tests/test_resume.py resumes a Responses stream
        {
            "id": "slow",
            "engine": "debug",
            "options": {"token_seconds": 0.01},
            "restart": {"initial_backoff": 0.05},
            "resume": False,
        }
    )
    try:
        pid = server.instance("slow")["runner"]["pid"]
        client = server.openai()
        stream = client.responses.create(model="slow", input="go on", max_output_tokens=10_000, stream=True)
        seen: list[Any] = []
        with pytest.raises(openai.APIError) as raised:
            for event in stream:
                seen.append(event)
                if event.type == "response.output_text.delta" and len(seen) == 8:
                    os.kill(pid, signal.SIGKILL)
        error = raised.value.body
        assert isinstance(error, dict) and error["code"] == "signal", error
        assert "SIGKILL" in error["cause"]["summary"] and error["completion_tokens"] >= 4, error
        kinds = [event.type for event in seen]
        assert (
            kinds[-1] == "response.failed" and "response.completed" not in kinds and "response.incomplete" not in kinds
        )
        failed = seen[-1].response
        assert failed.status == "failed" and failed.error is not None and failed.error.code == "signal"
        assert "SIGKILL" in failed.error.message and "SIGKILL" in failed.error.cause["summary"]
        wait_until(
            lambda: (i := server.instance("slow"))["ready"] and i["runner"]["pid"] != pid, 30, "a new runner ready"
        )
    finally:
        assert server.http.delete("/v1/instances/slow").status_code == 200


def test_a_tool_answer_becomes_function_call_items_and_events_the_openai_models_validate() -> None:
    """The debug engine cannot follow the tools' grammar, so the shaper is fed the JSON a model writes under it."""
    body = {"input": "weather?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    plan = responses.plan(responses.decode(json.dumps(body).encode()))
    assert plan.tools is not None and plan.params.json_schema is not None
    answer = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    for stream in (False, True):
        shaper = responses.ResponsesShaper("resp_1", "m", dataclasses.replace(plan, stream=stream))
        streamed = shaper.feed(Chunk("t", answer[:20])) + shaper.opening() + shaper.feed(Chunk("t", answer[20:]))
        if not stream:
            whole = Response.model_validate(json.loads(shaper.whole("stop", 30, 12)))
            call = whole.output[0]
            assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
            assert json.loads(call.arguments) == {"city": "Paris"} and whole.status == "completed"
            assert whole.tool_choice.type == "function" and whole.tools[0].name == "get_weather"
            continue
        streamed += shaper.closing("stop", 30, 12)
        events = [
            EVENTS.validate_python(json.loads(line[6:]))
            for line in streamed.decode().splitlines()
            if line[:6] == "data: "
        ]
        assert [e.type for e in events] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert events[-1].response.output[0].arguments == events[4].arguments == '{"city": "Paris"}'


def test_logprobs_stream_with_each_delta() -> None:
    body = {"input": "x", "stream": True, "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    plan = responses.plan(responses.decode(json.dumps(body).encode()))
    shaper = responses.ResponsesShaper("resp_1", "m", plan)
    top = (TopLogprob("Hi", -0.1, b"Hi"),)
    piece = shaper.feed(Chunk("t", "Hi", logprobs=(TokenLogprob("Hi", -0.1, b"Hi", top),)))
    streamed = shaper.opening() + piece + shaper.closing("stop", 3, 1)
    events = [
        EVENTS.validate_python(json.loads(line[6:])) for line in streamed.decode().splitlines() if line[:6] == "data: "
    ]
    delta = next(e for e in events if e.type == "response.output_text.delta")
    assert delta.logprobs[0].token == "Hi" and delta.logprobs[0].top_logprobs[0].logprob == -0.1
    final = Response.model_validate(events[-1].response.model_dump())
    assert final.output[0].content[0].logprobs[0].bytes == list(b"Hi")


# --------------------------------------------------------------------------------------------------------------
# The default model
# --------------------------------------------------------------------------------------------------------------


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.mark.model
@pytest.mark.timeout(300)
def test_the_default_model_answers_streams_to_completed_and_follows_a_schema(model_server: Server) -> None:
    client = model_server.openai()
    model = client.models.list().data[0].id
    assert client.models.retrieve(model).id == model
    answer = client.responses.create(
        model=model,
        instructions="You are a helpful AI assistant.",
        input="What is the capital of France?",
        max_output_tokens=32,
        temperature=0,
    )
    assert "Paris" in answer.output_text and answer.usage is not None and answer.usage.output_tokens > 0
    assert answer.usage.input_tokens > 5

    with client.responses.stream(
        model=model, input="What is the capital of France? Answer in one word.", max_output_tokens=64, temperature=0
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()  # needs response.completed: the model stopped on its own
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "Paris" in final.output_text and final.status == "completed"

    structured = client.responses.create(
        model=model,
        input="Name the capital of France and its country.",
        max_output_tokens=64,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
    )
    data = json.loads(structured.output_text)
    jsonschema.validate(data, CITY)
    assert "Paris" in data["city"]


@pytest.mark.model
@pytest.mark.timeout(300)
def test_the_default_model_calls_a_function_and_reads_its_output(model_server: Server) -> None:
    client = model_server.openai()
    model = client.models.list().data[0].id
    question = {"role": "user", "content": "What is the weather in Paris?"}
    called = client.responses.create(
        model=model, input=[question], tools=[WEATHER], tool_choice="required", max_output_tokens=64, temperature=0
    )
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert called.status == "completed" and called.tools[0].name == "get_weather"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees C and sunny"}
    answered = client.responses.create(
        model=model,
        input=[question, *called.output, result],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=48,
        temperature=0,
    )
    assert [item.type for item in answered.output] == ["message"] and answered.output_text.strip()
    alone = client.responses.create(model=model, input=[question], max_output_tokens=1)
    assert answered.usage is not None and alone.usage is not None
    assert answered.usage.input_tokens > alone.usage.input_tokens + 10  # the call and its output reached the prompt
