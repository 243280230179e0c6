"""A model whose chat template defines its own tool calls gets them (issue 34), on the real engine.

The default model's template knows no tools, so the tests write a copy of its GGUF whose template is Hermes-style
(``fixtures/templates/hermes.jinja``, with llama.cpp's own ``gguf`` library) and serve that: the template renders
the tools and the earlier calls and results, the grammar holds the answer to ``<tool_call>`` blocks or text, and
every route reports the calls in its own shape, streamed, with nothing of the markup leaking.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Server, gguf_with_template, model_missing, serving
from test_tool_formats import HERMES_TEMPLATE, ROUND_TRIP, WEATHER
from tether.engines import create_engine
from tether.engines.gguf import read_gguf
from tether.models import default_model_path
from tether.protocol import EngineSpec
from tether.serve.dialects import openai as openai_dialect
from tether.serve.dialects import tools as toolkit

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]
MARKUP = ("<tool_call>", "</tool_call>", '"arguments"')


@pytest.fixture(scope="module")
def hermes_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's GGUF with the Hermes-style template in place of its own (every tensor as it was)."""
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    return gguf_with_template(tmp_path_factory.mktemp("hermes") / "hermes-smollm2.gguf", HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def hermes(hermes_gguf: Path) -> Iterator[Server]:
    with serving("--model", str(hermes_gguf), "--name", "hermes", "--threads", "1", "--n-ctx", "2048") as server:
        yield server


def chat(server: Server, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    body = {"model": "hermes", "messages": messages, "tools": [WEATHER], "temperature": 0, **fields}
    response = server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_the_template_renders_the_tools_calls_and_results_its_own_way(hermes_gguf: Path) -> None:
    """What the model reads: the tools inside <tools>, the earlier call as a <tool_call> block, the result as a
    <tool_response>, and none of the generic format's system prompt or JSON wrappers."""
    engine: Any = create_engine(EngineSpec(engine="llama.cpp", model=str(hermes_gguf), options={"n_ctx": 1024}))
    engine.load(lambda fraction, what: None)
    try:
        body = json.dumps({"model": "m", "messages": ROUND_TRIP, "tools": [WEATHER]}).encode()
        request = openai_dialect.decode("chat", body)
        assert isinstance(request, openai_dialect.ChatRequest)
        plan = openai_dialect.chat_plan(request, toolkit.detect(HERMES_TEMPLATE))
        tokens, _ = engine._render_chat(plan.params)
        prompt = engine._detokenize(tokens)
    finally:
        engine.close()
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<|im_end|>" in prompt
    assert "You can call these tools" not in prompt and '"tool_response":' not in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_required_calls_stream_in_openai_shape_from_the_native_syntax(hermes: Server) -> None:
    stream = hermes.openai().chat.completions.create(
        model="hermes",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        temperature=0,
        max_tokens=120,  # the model writes the call twice (67 tokens): the repeat is dropped, never reported
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    deltas, finish, content = 0, None, ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            deltas += 1
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and not content
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert all(isinstance(json.loads(c["arguments"])["city"], str) for c in calls.values())
    assert deltas > 2  # the arguments came in pieces as they were decided, not in one chunk at the end


def test_a_cut_native_call_ends_length_with_no_markup(hermes: Server) -> None:
    answer = chat(hermes, [{"role": "user", "content": "Weather in Paris?"}], tool_choice="required", max_tokens=8)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert not choice["message"].get("tool_calls") and not choice["message"]["content"]


def test_after_a_repeated_call_the_answer_is_text_without_markup(hermes: Server) -> None:
    repeated = [*ROUND_TRIP, ROUND_TRIP[1], ROUND_TRIP[2]]
    answer = chat(hermes, repeated, max_tokens=24)
    choice = answer["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and not choice["message"].get("tool_calls")
    assert choice["message"]["content"] and not any(m in choice["message"]["content"] for m in MARKUP[:2])


def test_ollama_and_responses_report_native_calls_in_their_shapes(hermes: Server) -> None:
    body = {
        "model": "hermes",
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [WEATHER],
        "stream": False,
        "options": {"temperature": 0, "num_predict": 40},
    }
    answer = hermes.http.post("/api/chat", json=body).json()
    message = answer["message"]
    assert not any(m in message.get("content", "") for m in MARKUP[:2]), message
    for call in message.get("tool_calls") or ():
        assert call["function"]["name"] == "get_weather" and isinstance(call["function"]["arguments"], dict)

    responses = {
        "model": "hermes",
        "input": "Weather in Rome?",
        "tools": [{"type": "function", **WEATHER["function"]}],
        "tool_choice": "required",
        "max_output_tokens": 60,
        "temperature": 0,
    }
    out = hermes.http.post("/v1/responses", json=responses, timeout=httpx.Timeout(120)).json()
    calls = [item for item in out["output"] if item["type"] == "function_call"]
    assert calls and all(c["name"] == "get_weather" and json.loads(c["arguments"])["city"] for c in calls), out


def test_a_model_without_tools_in_its_template_keeps_the_generic_format(model_server: Server) -> None:
    template = read_gguf(default_model_path()).metadata["tokenizer.chat_template"]
    assert isinstance(template, str) and toolkit.detect(template) is toolkit.GENERIC  # plain ChatML
    body = {
        "model": model_server.openai().models.list().data[0].id,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 60,
    }
    answer = model_server.http.post("/v1/chat/completions", json=body).json()
    calls = answer["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather", answer
