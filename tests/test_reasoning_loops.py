"""Reasoning models in the loops people run (issue 59): an agent loop that sends every reply back as it came, the
thinking switched by ``chat_template_kwargs``, and a structured answer (a JSON schema, tool calls) after the thinking.

The default model's GGUF is served with reasoning templates written for these tests (``fixtures/templates``): a
Qwen3-style one with Hermes tool calls whose model opens its own thinking block and whose history keeps the thinking
of the turns since the last user message (``think-tools.jinja``), an R1-style one whose prompt opens the block
(``think.jinja``), and a Llama 3-style one with bare JSON calls (``think-llama3.jinja``). SmolLM2 was not trained to
think, so what it thinks is poor; what is proven is what tether does with it: the thinking apart, the grammar after
it, every reply accepted back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from conftest import Server, model_missing, serving
from test_tool_formats import WEATHER

pytestmark = [pytest.mark.model, pytest.mark.timeout(240)]

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "templates"
QWEN, R1, LLAMA3 = "qwen-style", "r1-style", "llama3-style"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinkers() -> Iterator[Server]:
    """One server, three reasoning templates over the default model's weights."""
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    template = str(TEMPLATES / "think-tools.jinja")
    with serving("--threads", "1", "--n-ctx", "2048", "--chat-template", template, "--name", QWEN) as server:
        for name, file in ((R1, "think.jinja"), (LLAMA3, "think-llama3.jinja")):
            options = {"chat_template": str(TEMPLATES / file), "n_ctx": 1024, "parallel": 2, "n_threads": 1}
            server.add_instance({"id": name, "options": options}, 90)
        yield server


def thought(message: Any) -> str:
    return str(getattr(message, "reasoning_content", None) or "")


def test_an_openai_agent_loop_sends_each_reply_back_as_it_came(thinkers: Server) -> None:
    """The openai SDK's idiom: the returned message object appended to the history, then the next call (which sends
    it ``exclude_unset``, reasoning_content included). The first turn must call a tool (an agent's first step)."""
    client = thinkers.openai()
    messages: list[Any] = [{"role": "system", "content": "Use the tools."}, *ASK]
    seen = []
    for turn in range(3):
        reply = client.chat.completions.create(
            model=QWEN, messages=messages, tools=[WEATHER], tool_choice="required" if turn == 0 else "auto",
            temperature=0, max_tokens=64,
        )  # fmt: skip
        message = reply.choices[0].message
        seen.append((thought(message), message.tool_calls))
        messages.append(message)
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"weather": "sunny, 21 C"}'})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "And in Berlin?"})
    first_thought, first_calls = seen[0]
    assert first_thought and first_calls, seen  # it thought, then called
    call = first_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments), call
    # the openai SDK's model_dump() of the same message (every field, the nulls too) is accepted as well
    dumped = [*messages[:2], reply.choices[0].message.model_dump(), {"role": "user", "content": "Go on."}]
    again = client.chat.completions.create(model=QWEN, messages=dumped, temperature=0, max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length")


def test_a_stateless_responses_loop_replays_its_output(thinkers: Server) -> None:
    """OpenAI's documented stateless loop: the next input is the previous input plus ``response.output``
    (reasoning items, messages, function calls as the SDK returned them) plus the calls' outputs."""
    client = thinkers.openai()
    tool = {"type": "function", **WEATHER["function"]}
    items: list[Any] = list(ASK)
    kinds = []
    for turn in range(3):
        response = client.responses.create(
            model=QWEN, input=items, tools=[tool], tool_choice="required" if turn == 0 else "auto",
            temperature=0, max_output_tokens=64,
        )  # fmt: skip
        kinds.append([item.type for item in response.output])
        items += response.output
        calls = [item for item in response.output if item.type == "function_call"]
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
        if not calls:
            items.append({"role": "user", "content": "And in Berlin?"})
    assert kinds[0][0] == "reasoning" and "function_call" in kinds[0], kinds
    assert all(k and k[0] == "reasoning" for k in kinds), kinds  # each turn thought first


def test_chat_template_kwargs_switch_the_thinking_and_are_checked(thinkers: Server) -> None:
    client = thinkers.openai()

    def ask(**fields: Any) -> Any:
        return client.chat.completions.create(model=R1, messages=ASK, temperature=0, max_tokens=24, **fields)

    off = ask(extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert off.content and not thought(off), off
    on = ask(extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
    assert thought(on), on
    for kwargs, fields, why in (
        ({"enable_thinking": False}, {"reasoning_effort": "high"}, "contradict"),
        ({"enable_thinking": "no"}, {}, "true or false"),
        ({"colour": "red"}, {}, "reads no variable 'colour', so it would change nothing; the variables it reads: "),
        ({"messages": []}, {}, "set from the request itself"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(extra_body={"chat_template_kwargs": kwargs}, **fields)
        error = refused.value.body
        assert isinstance(error, dict) and error["param"].startswith("chat_template_kwargs."), error
        assert why in error["message"], error


@pytest.mark.parametrize("model", [QWEN, R1])
def test_a_json_schema_answer_follows_the_thinking(thinkers: Server, model: str) -> None:
    """Free text while the thinking block is open (opened by the template, or by the runner where the template
    leaves it to the model), then the schema's grammar: the thinking apart, the answer valid."""
    client = thinkers.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    question = [{"role": "user", "content": "Name the capital of France and its population."}]
    whole = client.chat.completions.create(
        model=model, messages=question, response_format=fmt, temperature=0, max_tokens=64
    ).choices[0]
    assert thought(whole.message) and "<think>" not in thought(whole.message), whole
    jsonschema.validate(json.loads(whole.message.content or ""), CITY)
    assert whole.finish_reason == "stop", whole
    order, pieces = [], {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(
        model=model, messages=question, response_format=fmt, temperature=0, max_tokens=64, stream=True
    ):
        for choice in chunk.choices:
            for kind, text in (("reasoning", thought(choice.delta)), ("content", choice.delta.content or "")):
                if text:
                    pieces[kind] += text
                    order.append(kind)
    assert order and order == sorted(order, key=lambda kind: kind == "content"), order  # thinking, then the answer
    assert pieces == {"reasoning": thought(whole.message), "content": whole.message.content}


@pytest.mark.parametrize("model", [QWEN, LLAMA3])
def test_a_required_tool_call_follows_the_thinking_in_the_models_own_format(thinkers: Server, model: str) -> None:
    client = thinkers.openai()
    streamed: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=96, stream=True
    ):
        for choice in chunk.choices:
            if thought(choice.delta):
                streamed.append("reasoning")
            for call in choice.delta.tool_calls or ():
                streamed.append("call")
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += (call.function and call.function.name) or ""
                entry["arguments"] += (call.function and call.function.arguments) or ""
            assert not choice.delta.content, choice.delta  # no markup leaks as text
    assert streamed and streamed[0] == "reasoning" and "call" in streamed, streamed
    assert streamed.index("call") > len(streamed) - streamed[::-1].index("reasoning") - 1  # every call after it
    first = calls[0]
    assert first["name"] == "get_weather", calls
    jsonschema.validate(json.loads(first["arguments"]), WEATHER["function"]["parameters"])  # type: ignore[arg-type]


def test_ollama_sends_its_thinking_back(thinkers: Server) -> None:
    """The ollama client's loop: the returned message (thinking and tool calls) appended as it came."""
    import ollama

    client = ollama.Client(host=thinkers.url)
    options = {"temperature": 0, "num_predict": 48}
    first = client.chat(model=QWEN, messages=ASK, tools=[WEATHER], think=True, options=options)
    assert first.message.thinking, first.message
    history = [*ASK, first.message]
    calls = first.message.tool_calls or ()
    history += [{"role": "tool", "content": "sunny", "tool_name": c.function.name} for c in calls]
    history.append({"role": "user", "content": "And in Berlin?"})
    second = client.chat(model=QWEN, messages=history, tools=[WEATHER], think=True, options=options)
    assert second.done, second
