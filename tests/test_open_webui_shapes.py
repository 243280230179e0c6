"""Open WebUI's real requests, replayed against tether without Open WebUI (issue 34).

tests/fixtures/open_webui/*.json are requests Open WebUI 0.12.4 sent tether in its default setup, recorded by
``test_open_webui.py`` (``TETHER_RECORD_OPEN_WEBUI=1``): a chat with its 36 built-in tools (a 6.5k-token prompt), the
chat that sends a tool's result back, its title / tags / follow-up tasks, RAG's ``/api/embed``; over Ollama's API and
OpenAI's. Each must get a 200 and a well-formed answer in its dialect. Only the length of the answer is capped (64
tokens, where the recording asks for more or leaves it open) so the replay stays short; every other field is sent as
recorded.

Against ``open_webui_server``, the server Open WebUI itself talked to in ``test_open_webui.py`` (not ``model_server``,
whose n_ctx 2048 is too short for the tools' prompt): where that ran first, the tools' prompt comes from the prompt
cache as a user's next chat's would; alone, it is read cold. Its deadlines are the defaults: a long prompt's prefill
beside other streams (the title task runs while the chat's 6.5k tokens are read, 32 a step) restarts the first-token
clock with every chunk it gets in, so a loaded machine's slow prefill is slow, not a hang (the runner was killed as
"hung in prefill for 120.0 s" before).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Document, Server

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "open_webui"
# The tools' chats first (the prompt read once at most), then what shares its prefix from the prompt cache.
CASES = sorted(FIXTURES.glob("*.json"), key=lambda p: (not p.stem.endswith("_chat_tools"), p.stem))
CAP = 64


@pytest.fixture(scope="module")
def server(open_webui_server: Server) -> Server:
    return open_webui_server


@pytest.fixture(scope="module")
def document(server: Server) -> Document:
    return Document(server.http.get("/openapi.json").json())


def capped(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its answer's length at most CAP tokens; nothing else changed."""
    body = json.loads(json.dumps(body))
    if path == "/api/chat":
        options = body.setdefault("options", {})
        limit = options.get("num_predict", -1)
        options["num_predict"] = CAP if limit < 0 or limit > CAP else limit
    elif path == "/v1/chat/completions":
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        body[key] = min(body.get(key) or CAP, CAP)
    return body


def said(message: dict[str, Any]) -> bool:
    """Whether an answer's message says something: text or a tool call."""
    return bool(message.get("content") or message.get("tool_calls"))


def check_ollama_chat(response: httpx.Response, stream: bool, document: Document) -> None:
    if not stream:
        answer = document.check(response, "/api/chat", "post")
        assert answer["done"] is True and answer["message"]["role"] == "assistant", answer
        assert said(answer["message"]) or answer["done_reason"] == "length", answer
        return
    lines = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    assert lines, "an empty NDJSON stream"
    assert not [line for line in lines if "error" in line], lines[-1]
    assert all(line["done"] is False for line in lines[:-1]) and lines[-1]["done"] is True, lines[-1]
    assert lines[-1]["done_reason"] in ("stop", "length"), lines[-1]
    assert lines[-1]["eval_count"] >= 1 and lines[-1]["prompt_eval_count"] >= 1, lines[-1]
    assert all(line["message"]["role"] == "assistant" for line in lines)
    # A call the length cap cut is not reported (no half call, no grammar JSON as text): only then may it be silent.
    assert any(said(line["message"]) for line in lines) or lines[-1]["done_reason"] == "length", lines[-1]


def check_openai_chat(response: httpx.Response, stream: bool, document: Document) -> None:
    if not stream:
        answer = document.check(response, "/v1/chat/completions", "post")
        choice = answer["choices"][0]
        assert choice["finish_reason"] in ("stop", "length", "tool_calls"), answer
        assert said(choice["message"]) or choice["finish_reason"] == "length", answer
        return
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text[-500:]
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks), chunks[-1]
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    finish = [c["finish_reason"] for c in choices if c["finish_reason"]]
    assert finish in (["stop"], ["length"], ["tool_calls"]), finish
    assert any(said(c["delta"]) for c in choices) or finish == ["length"], "the stream says nothing"


def check_ollama_embed(response: httpx.Response, body: dict[str, Any], document: Document) -> None:
    answer = document.check(response, "/api/embed", "post")
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    assert len(answer["embeddings"]) == len(inputs), answer.keys()
    assert all(len(vector) > 0 for vector in answer["embeddings"])


@pytest.mark.parametrize("case", CASES, ids=[p.stem for p in CASES])
def test_a_request_open_webui_sent_gets_a_well_formed_answer(server: Server, document: Document, case: Path) -> None:
    record = json.loads(case.read_text())
    path = record["path"]
    body = capped(path, record["body"])
    response = server.http.post(path, json=body, timeout=540)
    assert response.status_code == 200, f"{case.name}: {response.status_code} {response.text[:2000]}"
    if path == "/api/chat":
        check_ollama_chat(response, body.get("stream", True), document)
    elif path == "/v1/chat/completions":
        check_openai_chat(response, body.get("stream", False), document)
    elif path == "/api/embed":
        check_ollama_embed(response, body, document)
    else:
        raise AssertionError(f"{case.name}: no check for {path}")
