"""``GET /openapi.json`` describes every field a response really carries: real answers of a real worker (an
instance with replicas, one with two ranks, one with a failed life in its history and its cause, the node, the
scheduler, models, logs, errors in both shapes) are validated against the served document with every object
closed (``additionalProperties: false``), so a key the schema does not state fails, and so does a stated key of
the wrong type or a required one missing."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator

import jsonschema
import pytest

from conftest import Document, Server, debug_server, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftover_runners")]


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A debug worker with: ``replicated`` (2 replicas), ``ring`` (2 ranks), ``scarred`` (a life lost to SIGKILL)."""
    with debug_server() as server:
        server.add_instance({"id": "replicated", "engine": "debug", "replicas": 2})
        server.add_instance({"id": "ring", "engine": "debug", "ranks": 2, "ports": _free_ports(2)})
        scarred = server.add_instance({"id": "scarred", "engine": "debug", "restart": {"initial_backoff": 0.05}})
        os.kill(scarred["runner"]["pid"], signal.SIGKILL)
        wait_until(lambda: (i := server.instance("scarred"))["ready"] and i["restarts"] == 1, 30, "scarred restarted")
        yield server


@pytest.fixture(scope="module")
def document(server: Server) -> Document:
    return Document(server.http.get("/openapi.json").json())


@pytest.mark.slow
def test_instances_node_and_scheduler_are_all_described(server: Server, document: Document) -> None:
    listing = document.check(server.http.get("/v1/instances"), "/v1/instances")
    by_id = {i["id"]: i for i in listing["data"]}
    assert len(by_id["replicated"]["replicas"]) == 2
    assert [r["rank"] for r in by_id["ring"]["ranks"]] == [0, 1]
    [life] = by_id["scarred"]["history"]
    assert life["cause"]["kind"] == "signal" and life["log"]
    assert listing["node"]["memory"]["available"] > 0 and "models" in listing["scheduler"]
    for instance_id in by_id:
        one = document.check(server.http.get(f"/v1/instances/{instance_id}"), "/v1/instances/{instance_id}")
        assert one["in_flight_requests"] == []
    log = server.http.get("/v1/instances/scarred/log", params={"life": 1})
    assert document.check(log, "/v1/instances/{instance_id}/log")["life"] == 1


def test_models_probes_and_generations_are_described(server: Server, document: Document) -> None:
    models = document.check(server.http.get("/v1/models"), "/v1/models")
    assert {m["id"] for m in models["data"]} >= {"replicated", "ring", "scarred"}
    assert document.check(server.http.get("/v1/models/ring"), "/v1/models/{model_id}")["pinned"] is True
    document.check(server.http.get("/healthz"), "/healthz")
    document.check(server.http.get("/readyz"), "/readyz")
    chat = {"model": "scarred", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True}
    document.check(server.http.post("/v1/chat/completions", json=chat), "/v1/chat/completions", "post")
    text = {"model": "scarred", "prompt": "hi", "max_tokens": 3, "logprobs": 2}
    document.check(server.http.post("/v1/completions", json=text), "/v1/completions", "post")
    response = {"model": "scarred", "input": "hi", "max_output_tokens": 16}
    document.check(server.http.post("/v1/responses", json=response), "/v1/responses", "post")
    embed = {"model": "scarred", "input": ["a", "b"]}
    document.check(server.http.post("/v1/embeddings", json=embed), "/v1/embeddings", "post")
    ollama = {
        "model": "scarred",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "options": {"num_predict": 3},
    }
    document.check(server.http.post("/api/chat", json=ollama), "/api/chat", "post")
    document.check(server.http.get("/api/tags"), "/api/tags")
    document.check(server.http.get("/api/ps"), "/api/ps")
    document.check(server.http.post("/api/show", json={"model": "ring"}), "/api/show", "post")
    cancel = server.http.post("/v1/requests/nobody/cancel")
    assert document.check(cancel, "/v1/requests/{request_id}/cancel", "post")["outcome"] == "unknown"


def test_streamed_chunks_are_described(server: Server, document: Document) -> None:
    chat = {
        "model": "scarred",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = document.schema("/v1/chat/completions", "post", 200, "text/event-stream")
    payload = events["properties"]["data"]["anyOf"][1]["contentSchema"]
    seen = 0
    with server.http.stream("POST", "/v1/chat/completions", json=chat) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                schema = {**payload, "components": events["components"]}
                jsonschema.validate(json.loads(line[6:]), schema, cls=jsonschema.Draft202012Validator)
                seen += 1
    assert seen >= 3


def test_errors_of_both_shapes_are_described(server: Server, document: Document) -> None:
    missing = server.http.get("/v1/models/nope")
    assert document.check(missing, "/v1/models/{model_id}")["error"]["code"] == "model_not_found"
    exists = server.http.post("/v1/instances", json={"id": "ring", "engine": "debug"})
    assert document.check(exists, "/v1/instances", "post")["error"]["code"] == "instance_exists"
    bad = server.http.post("/api/chat", json={"model": "ring", "messages": [{"role": "wizard", "content": "x"}]})
    assert document.check(bad, "/api/chat", "post")["code"] == "invalid_request"
    foreign = server.http.get("/v1/instances", headers={"Origin": "https://evil.example"})
    assert document.check(foreign, "/v1/instances")["error"]["code"] == "origin_not_allowed"


def test_the_check_fails_on_a_key_the_schema_does_not_state(server: Server, document: Document) -> None:
    """The closing is real: an answer with one key more than stated does not validate."""
    answer = server.http.get("/v1/instances/ring").json()
    answer["queue"]["unstated"] = 1
    schema = document.schema("/v1/instances/{instance_id}", "get", 200)
    with pytest.raises(jsonschema.ValidationError, match="unstated"):
        jsonschema.validate(answer, schema, cls=jsonschema.Draft202012Validator)
