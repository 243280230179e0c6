"""Ollama's API as its own client sees it: the official ``ollama`` package against a live `tether serve`."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

import tether
from conftest import Server, debug_server, model_missing, wait_until
from tether.protocol import Chunk, GenerateParams
from tether.serve.dialects import ollama as dialect
from tether.serve.dialects.plan import Plan
from tether.serve.statuses import Answer

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leftover_runners")]

HI = [{"role": "user", "content": "hello there"}]


def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60)


@pytest.fixture(scope="module")
def debug() -> Iterator[Server]:
    with debug_server() as server:
        yield server


@pytest.mark.slow
def test_chat_streams_ndjson_pieces_then_one_done_line_with_honest_counts(debug: Server) -> None:
    c = client(debug)
    parts = list(c.chat(model="debug", messages=HI, stream=True, options={"num_predict": 8, "seed": 3}))
    assert parts and all(not p.done for p in parts[:-1]) and parts[-1].done
    last = parts[-1]
    assert last.done_reason == "length" and last.eval_count == 8 and (last.prompt_eval_count or 0) > 0
    total, prompt, generating = last.total_duration, last.prompt_eval_duration, last.eval_duration
    assert total is not None and prompt is not None and generating is not None and last.load_duration == 0
    assert 0 < prompt + generating <= total < 30e9  # nanoseconds, on the request's own timeline
    text = "".join(p.message.content or "" for p in parts)
    whole = c.chat(model="debug", messages=HI, stream=False, options={"num_predict": 8, "seed": 3})
    assert whole.done and whole.message.role == "assistant" and whole.message.content == text and text.strip()
    with httpx.stream("POST", f"{debug.url}/api/chat", json={"messages": HI, "options": {"num_predict": 2}}) as r:
        assert r.headers["content-type"] == "application/x-ndjson"  # Ollama's default is to stream
        lines = [json.loads(line) for line in r.iter_lines()]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])


def test_generate_honours_options_prompt_system_and_raw(debug: Server) -> None:
    c = client(debug)
    answer = c.generate(model="debug", prompt="hello", stream=False, options={"num_predict": 5})
    assert answer.done and answer.done_reason == "length" and answer.eval_count == 5 and answer.response
    assert isinstance(answer.created_at, str) and answer.created_at.endswith("Z")
    system = c.generate(model="debug", prompt="hello", system="be brief", stream=False, options={"num_predict": 5})
    raw = c.generate(model="debug", prompt="hello", raw=True, stream=False, options={"num_predict": 5})
    assert len({answer.response, system.response, raw.response}) == 3  # each changes what the model reads
    streamed = list(c.generate(model="debug", prompt="hello", stream=True, options={"num_predict": 5}))
    assert "".join(p.response or "" for p in streamed) == answer.response
    loaded = c.generate(model="debug")  # no prompt: Ollama's "load the model"
    assert loaded.done and loaded.done_reason == "load"


@pytest.mark.parametrize(
    ("call", "status", "words"),
    [
        ({"options": {"nonsense": 1}}, 400, ["options.nonsense", "unknown field"]),
        ({"options": {"num_thread": 4}}, 400, ["options.num_thread", "n_threads", "POST /v1/instances"]),
        ({"options": {"num_ctx": 0}}, 400, ["options.num_ctx"]),
        ({"options": {"num_predict": -2}}, 400, ["num_predict"]),
        ({"options": {"mirostat": 2}}, 400, ["options.mirostat"]),
        ({"options": {"temperature": 3}}, 400, ["options.temperature must be in [0, 2]"]),
        ({"keep_alive": "soon"}, 400, ["keep_alive must be a number of seconds or a duration"]),
        ({"think": True}, 400, ["think"]),
        ({"images": ["aGk="]}, 400, ["images"]),
        ({"format": {"type": "object"}}, 400, ["structured output"]),  # the debug engine's refusal
    ],
)
def test_refusals_are_ollama_errors_that_name_the_field(
    debug: Server, call: dict[str, Any], status: int, words: list[str]
) -> None:
    request = {"model": "debug", "prompt": "hi", "stream": False, "options": {"num_predict": 2}, **call}
    with pytest.raises(ollama.ResponseError) as raised:
        client(debug).generate(**request)
    assert raised.value.status_code == status
    assert all(word in raised.value.error for word in words), raised.value.error
    response = httpx.post(f"{debug.url}/api/generate", json=request, timeout=30)
    assert isinstance(response.json()["error"], str)  # Ollama's shape, not OpenAI's


def test_logprobs_come_with_each_piece_and_whole(debug: Server) -> None:
    c = client(debug)
    options = {"num_predict": 4}
    parts = list(c.chat(model="debug", messages=HI, stream=True, logprobs=True, top_logprobs=1, options=options))
    streamed = [entry for p in parts for entry in (p.logprobs or [])]
    assert len(streamed) == 4 and all(e.logprob == 0.0 and len(e.top_logprobs or []) == 1 for e in streamed)
    whole = c.generate(model="debug", prompt="hi", logprobs=True, options=options)
    assert [e.token for e in whole.logprobs or []] and "".join(e.token for e in whole.logprobs or []) == whole.response
    assert c.generate(model="debug", prompt="hi", options=options).logprobs is None


def test_keep_alive_durations_are_honoured_as_at_least_that_long(debug: Server) -> None:
    c = client(debug)
    for keep in ("5m", "1h30m", -1, 300, "-1s"):
        assert c.generate(model="debug", prompt="hi", keep_alive=keep, options={"num_predict": 1}).done


def test_list_ps_show_version_and_the_root_probe(debug: Server) -> None:
    c = client(debug)
    listed = c.list().models  # every model a request can name: the debug instance, and the built-in model unloaded
    assert len(listed) == 1 + (model_missing() is None)
    model = listed[0]
    assert model.model == "debug" and model.digest and len(model.digest) == 64 and model.modified_at is not None
    [loaded] = c.ps().models
    assert loaded.model == "debug" and (loaded.size or 0) > 0 and loaded.size_vram == 0
    assert loaded.expires_at is not None and loaded.expires_at.year > 2100  # loaded until it is removed
    shown = c.show("debug")
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.parameters is not None and "temperature" in shown.parameters and shown.modelinfo == {}
    assert c.show("debug:latest").capabilities == shown.capabilities  # the tag Ollama's clients add
    version = httpx.get(f"{debug.url}/api/version")
    assert version.json() == {"version": dialect.OLLAMA_VERSION}  # the Ollama release whose API is spoken
    assert version.headers["X-Tether-Version"] == tether.__version__
    root = httpx.get(f"{debug.url}/")
    assert root.status_code == 200 and "Ollama is running" in root.text


def test_embed_and_the_older_embeddings_route(debug: Server) -> None:
    c = client(debug)
    answer = c.embed(model="debug", input=["alpha", "beta"])
    assert len(answer.embeddings) == 2 and all(len(v) == 64 for v in answer.embeddings)
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-5) for v in answer.embeddings)
    assert answer.embeddings[0] != answer.embeddings[1] and (answer.prompt_eval_count or 0) > 0
    again = c.embed(model="debug", input="alpha")
    assert list(again.embeddings[0]) == list(answer.embeddings[0])  # deterministic
    assert list(c.embeddings(model="debug", prompt="alpha").embedding) == list(answer.embeddings[0])
    assert c.embed(model="debug", input=[]).embeddings == []
    assert list(c.embed(model="debug", input="alpha", truncate=True).embeddings[0]) == list(answer.embeddings[0])
    with pytest.raises(ollama.ResponseError) as raised:
        c.embed(model="debug", input="alpha", dimensions=8)
    assert raised.value.status_code == 400 and "dimensions" in raised.value.error


@pytest.mark.slow
def test_a_runner_killed_mid_stream_reaches_the_client_as_a_response_error_with_the_cause() -> None:
    with debug_server() as server:
        slow = {
            "id": "slow",
            "engine": "debug",
            "options": {"token_seconds": 0.01},
            "restart": {"initial_backoff": 0.05},
            "resume": False,  # the error path; tests/test_resume.py resumes Ollama's streams
        }
        pid = server.add_instance(slow)["runner"]["pid"]
        parts = []
        with pytest.raises(ollama.ResponseError) as raised:
            for part in client(server).chat(model="slow", messages=HI, stream=True, options={"num_predict": 10_000}):
                parts.append(part)
                if len(parts) == 5:
                    os.kill(pid, signal.SIGKILL)
        assert "SIGKILL" in raised.value.error, raised.value.error
        assert len(parts) >= 5 and not any(p.done for p in parts)  # never a done line: not a truncated success
        wait_until(lambda: (i := server.instance("slow"))["ready"] and i["runner"]["pid"] != pid, 30, "a new runner")
        crashy = {"id": "crashy", "engine": "debug", "faults": [{"kind": "segv"}], "restart": {"mode": "never"}}
        server.add_instance(crashy)
        with pytest.raises(ollama.ResponseError) as before:
            client(server).generate(model="crashy", prompt="hi", stream=False, options={"num_predict": 4})
        assert before.value.status_code == 500 and "SIGSEGV" in before.value.error, before.value.error
        with pytest.raises(ollama.ResponseError) as unknown:  # several instances: the name must be one of them
            client(server).generate(model="nope", prompt="hi", options={"num_predict": 1})
        assert unknown.value.status_code == 404 and "'nope'" in unknown.value.error, unknown.value.error


def test_tool_calls_are_answered_in_ollamas_shape() -> None:
    """The shaper alone (the debug engine does no grammar): a generic tool answer becomes ``message.tool_calls``
    with the arguments as an object, which the client's own types accept."""
    plan = dialect.chat_plan(
        dialect.decode(
            dialect.OllamaChatRequest,
            json.dumps(
                {
                    "messages": HI,
                    "stream": False,
                    "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
                }
            ).encode(),
        )
    )
    assert isinstance(plan, Plan) and plan.tools is not None and plan.params.json_schema is not None
    shaper = dialect.OllamaShaper("chat", "m", plan, time.monotonic())
    answer = '{"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]}'
    shaper.feed(Chunk("t", answer, tokens=9, finish_reason="stop", prompt_tokens=3, completion_tokens=9))
    whole = ollama.ChatResponse(**json.loads(shaper.whole("stop", 3, 9)))
    assert whole.message.tool_calls is not None
    [call] = whole.message.tool_calls
    assert call.function.name == "weather" and call.function.arguments == {"city": "Paris"}
    assert whole.done_reason == "stop" and whole.eval_count == 9
    failure = Answer(500, "server_error", "signal", "the model runner failed: killed by SIGKILL")
    assert json.loads(shaper.stream_error(failure)) == {"error": failure.message, "code": "signal"}
    plain = dialect.OllamaShaper("generate", "m", Plan(GenerateParams(prompt="x"), None, True), time.monotonic())
    assert json.loads(plain.feed(Chunk("t", "hi"))) | {"created_at": ""} == {
        "model": "m",
        "created_at": "",
        "response": "hi",
        "done": False,
    }


# --------------------------------------------------------------------------------------------------------------
# The default model
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.timeout(180)
def test_format_json_schema_on_the_default_model_parses_and_validates(model_server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}},
        "required": ["city", "country"],
    }
    c = client(model_server)
    messages = [{"role": "user", "content": "Name the capital of France and its country, as JSON."}]
    answer = c.chat(model="any", messages=messages, format=schema, options={"temperature": 0, "num_predict": 96})
    assert answer.done_reason == "stop", answer
    jsonschema.validate(json.loads(answer.message.content or ""), schema)
    loose = c.generate(model="any", prompt="A JSON object about Paris:", format="json", options={"num_predict": 64})
    if loose.done_reason == "stop":
        assert isinstance(json.loads(loose.response or ""), dict)


@pytest.mark.model
@pytest.mark.timeout(180)
def test_the_default_model_is_described_from_its_gguf_header(model_server: Server) -> None:
    c = client(model_server)
    [model] = c.list().models
    details = model.details
    assert details is not None and details.format == "gguf" and details.family == "llama"
    assert details.quantization_level == "Q4_1" and (details.parameter_size or "").endswith("M")
    assert (model.size or 0) > 50 << 20
    shown = c.show(model.model or "")
    assert shown.capabilities == ["completion", "tools"] and "im_start" in (shown.template or "")
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
    assert "num_ctx" in (shown.parameters or "")
    [loaded] = c.ps().models
    assert (loaded.size or 0) > 0 and loaded.context_length == 2048
    text = "".join(
        p.message.content or "" for p in c.chat(model="x", messages=HI, stream=True, options={"num_predict": 16})
    )
    assert text.strip()
