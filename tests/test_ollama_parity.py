"""Ollama parity where its clients depend on it (issue 34): ``/api/embed``'s ``truncate`` (Open WebUI's RAG), Ollama's
sampling defaults, a chat longer than the context, ``/api/version``, embedding instances marked as such, and a
stopped request (Open WebUI's stop button closes the connection) answered without an error status. The scheduler's
side (a load waiting for a busy model instead of a 503) is in ``test_scheduler.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import msgspec
import ollama
import pytest

import tether
from conftest import Document, Server, debug_server, model_missing, serving, wait_until
from tether.models import default_model_path
from tether.serve.dialects import ollama as dialect

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftover_runners")]

EMBED = "emb"  # the llama.cpp embedding instance (n_ctx 64) beside the chat model
LONG = " ".join(f"word{i}" for i in range(200))  # far more than 64 tokens


def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=90)


@pytest.fixture(scope="module")
def debug() -> Iterator[Server]:
    with debug_server() as server:
        server.add_instance({"id": "short", "engine": "debug", "options": {"n_ctx": 4}})
        server.add_instance({"id": "slow", "engine": "debug", "options": {"token_seconds": 0.02}})
        yield server


@pytest.fixture(scope="module")
def llama() -> Iterator[Server]:
    """The default model (n_ctx 512) and an embedding instance of it with a 64-token context."""
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    with serving("--threads", "1", "--n-ctx", "512") as server:
        server.add_instance(
            {"id": EMBED, "engine": "llama.cpp", "options": {"embedding": True, "n_ctx": 64, "n_threads": 1}}, 90
        )
        yield server


# 1. truncate ---------------------------------------------------------------------------------------------------


def test_embed_truncates_by_default_keeping_the_start_and_refuses_with_truncate_false(debug: Server) -> None:
    c = client(debug)
    cut = c.embed(model="short", input="a b c d e f g")  # the ollama client's default: no truncate field sent
    assert cut.prompt_eval_count == 4
    assert list(c.embed(model="short", input="a b c d", truncate=False).embeddings[0]) == list(cut.embeddings[0])
    assert list(c.embed(model="short", input="a b c d x y", truncate=True).embeddings[0]) == list(cut.embeddings[0])
    assert list(c.embeddings(model="short", prompt="a b c d e f g").embedding) == list(cut.embeddings[0])
    with pytest.raises(ollama.ResponseError) as raised:
        c.embed(model="short", input="a b c d e f g", truncate=False)
    assert raised.value.status_code == 400 and "7 tokens" in raised.value.error and "n_ctx is 4" in raised.value.error


@pytest.mark.model
def test_a_real_embedding_instance_embeds_the_first_n_ctx_tokens_of_a_long_input(llama: Server) -> None:
    c = client(llama)
    one = c.embed(model=EMBED, input=LONG + " the end")  # Open WebUI's RAG: the ollama client, truncate unset
    other = c.embed(model=EMBED, input=LONG + " another ending", truncate=True)
    assert one.prompt_eval_count == 64 and list(one.embeddings[0]) == list(other.embeddings[0])  # the start kept
    short = c.embed(model=EMBED, input="a short input of a few tokens", truncate=True)
    assert (short.prompt_eval_count or 0) < 64 and list(short.embeddings[0]) != list(one.embeddings[0])
    with pytest.raises(ollama.ResponseError) as raised:
        c.embed(model=EMBED, input=LONG, truncate=False)
    error = raised.value.error
    assert raised.value.status_code == 400 and "n_ctx) is 64" in error and "truncate: true" in error, error


# 2. sampling defaults and a chat longer than the context -------------------------------------------------------


def test_options_left_out_take_ollamas_documented_defaults_and_chats_are_fitted() -> None:
    for route, body in (
        (dialect.chat_plan, {"messages": [{"role": "user", "content": "hi"}]}),
        (dialect.generate_plan, {"prompt": "hi"}),
    ):
        struct = dialect.OllamaChatRequest if route is dialect.chat_plan else dialect.OllamaGenerateRequest
        plan = route(dialect.decode(struct, msgspec.json.encode(body)))
        assert plan is not None
        p = plan.params
        assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty) == (0.8, 40, 0.9, 0.0, 1.1)
        assert p.fit_context  # a chat too long keeps its system messages and latest turns
    own = dialect.chat_plan(
        dialect.decode(
            dialect.OllamaChatRequest,
            msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], "options": {"repeat_penalty": 1.0}}),
        )
    )
    assert own is not None and own.params.repeat_penalty == 1.0  # a request's own option wins


def test_show_states_the_defaults_and_a_chat_with_default_options_answers(debug: Server) -> None:
    c = client(debug)
    parameters = c.show("debug").parameters or ""
    for line in ("temperature", "top_k", "top_p", "repeat_penalty"):
        assert line in parameters, parameters
    assert "1.1" in next(line for line in parameters.splitlines() if line.startswith("repeat_penalty"))
    answer = c.chat(model="debug", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 4})
    assert answer.done and answer.message.content


@pytest.mark.cores
@pytest.mark.model
@pytest.mark.timeout(300)  # two prefills of ~500 tokens on a shared CPU
def test_a_chat_longer_than_the_context_keeps_its_system_message_and_latest_turns(llama: Server) -> None:
    turns: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    for i in range(40):  # ~20 tokens a turn: far beyond 512
        turns.append({"role": "user", "content": f"Turn {i}: tell me something about the number {i}, briefly."})
        turns.append({"role": "assistant", "content": f"The number {i} is a number, and that is about it."})
    turns.append({"role": "user", "content": "Say hello."})
    model = default_model_path().stem  # two instances: a placeholder name no longer reaches the chat model
    body = {"model": model, "messages": turns, "stream": False, "options": {"num_predict": 8, "temperature": 0}}
    with httpx.stream("POST", f"{llama.url}/api/chat", json={**body, "stream": True}, timeout=150) as r:
        assert r.status_code == 200, r.read()
        last = json.loads(list(r.iter_lines())[-1])
    assert last["done"] and 0 < last["prompt_eval_count"] < 512, last
    assert last["truncated_messages"] > 0, last  # how many old turns were left out
    options = {"num_predict": 8, "temperature": 0}
    answer = client(llama).chat(model=model, messages=turns, stream=False, options=options)
    assert answer.done and 0 < (answer.prompt_eval_count or 0) < 512  # the ollama client takes it as it is
    # num_ctx is the request's own context: the chat is fitted into it and the answer ends when it is full ...
    small = client(llama).chat(model=model, messages=turns, stream=False, options={**options, "num_ctx": 200})
    assert 0 < (small.prompt_eval_count or 0) < 200 and (small.prompt_eval_count or 0) < answer.prompt_eval_count
    counting = "1, 2, 3, 4, 5, 6, 7, 8,"  # raw: the model counts on until its context is full
    full = client(llama).generate(model=model, prompt=counting, raw=True, options={"num_ctx": 64, "temperature": 0})
    assert full.done_reason == "length" and (full.prompt_eval_count or 0) + (full.eval_count or 0) == 64, full
    # ... and one larger than the instance's (512 here) gets the instance's, as a load with it would have
    large = client(llama).chat(model=model, messages=turns, stream=False, options={**options, "num_ctx": 32768})
    assert large.done and large.prompt_eval_count == answer.prompt_eval_count


# 3. version ----------------------------------------------------------------------------------------------------


def test_version_is_an_ollama_release_and_tethers_own_is_a_header(debug: Server) -> None:
    answer = httpx.get(f"{debug.url}/api/version")
    version = answer.json()["version"]
    assert tuple(int(n) for n in version.split(".")) >= (0, 12, 0), version  # what Open WebUI compares against
    assert answer.headers["X-Tether-Version"] == tether.__version__


# 4. embedding instances are marked -----------------------------------------------------------------------------


@pytest.mark.model
def test_an_embedding_instance_is_marked_embedding_only_everywhere_a_client_lists_models(llama: Server) -> None:
    document = Document(llama.http.get("/openapi.json").json())
    listed = document.check(llama.http.get("/api/tags"), "/api/tags")["models"]
    tags = {m["name"]: m["capabilities"] for m in listed}
    assert tags[EMBED] == ["embedding"], tags  # Open WebUI reads these to keep it out of the chat models
    chat_model = next(name for name in tags if name != EMBED)
    assert "completion" in tags[chat_model], tags
    assert client(llama).show(EMBED).capabilities == ["embedding"]
    models = document.check(llama.http.get("/v1/models"), "/v1/models")
    marked = {m["id"]: m["capabilities"] for m in models["data"]}
    assert marked[EMBED] == ["embedding"] and "completion" in marked[chat_model], marked


def test_tags_carry_capabilities_and_match_the_schema(debug: Server) -> None:
    document = Document(debug.http.get("/openapi.json").json())
    tags = document.check(debug.http.get("/api/tags"), "/api/tags")
    assert all("completion" in m["capabilities"] for m in tags["models"] if m["name"] in ("debug", "short"))
    models = document.check(debug.http.get("/v1/models"), "/v1/models")
    assert all(m["capabilities"] for m in models["data"])
    document.check(debug.http.get("/api/version"), "/api/version")


# 5. a stopped request ------------------------------------------------------------------------------------------


def test_a_client_that_stops_a_stream_ends_it_as_cancelled_and_a_late_cancel_is_no_error(debug: Server) -> None:
    """Open WebUI's stop button cancels its own task, which closes its connection to the backend: that is the
    path. The generation stops (the instance is free), the outcome is ``cancelled`` (no error logged or counted),
    and a cancel of that id afterwards (a stop pressed twice, a proxy's cleanup) is a 200 saying it had ended."""
    body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 500}}
    with httpx.stream("POST", f"{debug.url}/api/chat", json=body, timeout=30) as r:
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        assert not json.loads(next(lines))["done"]
        assert not json.loads(next(lines))["done"]
    wait_until(lambda: debug.instance("slow")["in_flight_requests"] == [], 10, "the stopped request ended")
    late = debug.http.post(f"/v1/requests/{request_id}/cancel")
    assert late.status_code == 200, late.text
    answer = late.json()
    assert answer["cancelled"] is False and answer["outcome"] == "finished" and "cancelled" in answer["detail"]
    metrics = debug.http.get("/metrics").text
    counted = [line for line in metrics.splitlines() if line.startswith("tether_requests_total{") and '"slow"' in line]
    assert any('outcome="cancelled"' in line and line.endswith(" 1.0") for line in counted), counted
    assert not any('outcome="failed"' in line for line in counted), counted
    unknown = debug.http.post("/v1/requests/ollama-chat-nope/cancel")
    assert unknown.status_code == 200 and unknown.json()["cancelled"] is False
    Document(debug.http.get("/openapi.json").json()).check(unknown, "/v1/requests/{request_id}/cancel", "post")
    again = client(debug).chat(model="slow", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 3})
    assert again.done and again.message.content  # the instance serves the next request at once
