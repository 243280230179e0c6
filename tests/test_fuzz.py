"""The API fuzzer against a live server: the schema tells the truth, nothing answers an unexpected 5xx, abuse of the
transport does not delay a healthy request, and the fuzzer itself fails when something is wrong."""

from __future__ import annotations

import copy
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import schemathesis
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from tether.chaos.target import ServeChild

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import fuzz as fuzzer

pytestmark = pytest.mark.fuzz  # schemathesis and transport abuse against a live worker

EXAMPLES = 12  # per operation and mode: ~100 cases, a few seconds


@pytest.fixture(scope="module")
def server() -> Iterator[ServeChild]:
    with fuzzer.fuzz_server() as child:
        yield child


@pytest.fixture(scope="module")
def document(server: ServeChild) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/openapi.json", timeout=10)
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


def test_the_schema_describes_every_route_with_its_bodies(server: ServeChild, document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.1")
    paths = document["paths"]
    assert set(paths) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/responses/{response_id}/input_items",
        "/v1/instances",
        "/v1/instances/{instance_id}",
        "/v1/instances/{instance_id}/log",
        "/v1/requests/{request_id}/cancel",
        "/api/chat",
        "/api/generate",
        "/api/embed",
        "/api/embeddings",
        "/api/tags",
        "/api/ps",
        "/api/show",
        "/api/version",
        "/",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
    }
    schemas = document["components"]["schemas"]
    chat = paths["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatRequest")
    assert set(chat["responses"]) >= {"200", "400", "500", "503"}
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    assert schemas["ChatRequest"]["properties"]["temperature"]["maximum"] == 2.0  # the checks' own bound
    assert "messages" in schemas["ChatRequest"]["required"]
    assert schemas["InstanceConfig"]["additionalProperties"] is False  # unknown instance fields are refused


def test_the_fuzzer_finds_no_unexpected_5xx_and_no_schema_lie(server: ServeChild) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    keep = {"id": fuzzer.INSTANCE, "engine": "debug", "options": {"n_ctx": 4096}}
    report = fuzzer.fuzz(schema, server.url, EXAMPLES, seed=7, keep_instance=keep)
    assert report.operations == 31 and report.examples >= 50, report
    assert report.by_mode["negative"] > 0
    assert report.unexpected_5xx == 0, report.failures
    assert report.nonconforming == 0, report.failures
    assert report.transport_errors == 0, report.failures
    assert fuzzer.still_serving(server, server.pid) == []


def test_foreign_hosts_and_origins_are_refused_on_every_route_and_loopback_is_served(server: ServeChild) -> None:
    """Every operation with drawn Hosts and Origins (DNS rebinding's, other sites', malformed ones): each refused
    with the guard's documented 403, and every loopback request served."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    keep = {"id": fuzzer.INSTANCE, "engine": "debug", "options": {"n_ctx": 4096}}
    report = fuzzer.fuzz_headers(schema, server.url, EXAMPLES, seed=11, keep_instance=keep)
    assert report.cases >= 31 * EXAMPLES // 2, report
    assert set(report.by_class) == {"served", "host", "origin", "refused"}, report.by_class
    assert report.served_foreign == 0, report.failures
    assert report.refused_loopback == 0, report.failures
    assert report.nonconforming == 0, report.failures
    assert fuzzer.still_serving(server, server.pid) == []


def test_readyz_while_no_model_is_loaded_is_a_documented_503(server: ServeChild, document: dict[str, Any]) -> None:
    """A case's ``keep_alive: 0`` unloads the fuzz model when idle (found by make test: /readyz answered its
    documented 503 in between, counted as a bug); the next request loads it again."""
    unloaded = httpx.post(f"{server.url}/api/generate", json={"model": fuzzer.INSTANCE, "keep_alive": 0}, timeout=30)
    assert unloaded.status_code == 200 and unloaded.json()["done_reason"] == "unload", unloaded.text
    only = copy.deepcopy(document)
    only["paths"] = {"/readyz": document["paths"]["/readyz"]}
    report = fuzzer.fuzz(schemathesis.openapi.from_dict(only), server.url, 3, seed=0)
    assert report.documented_5xx["not_ready"] > 0, report
    assert report.unexpected_5xx == 0 and report.nonconforming == 0, report.failures
    assert fuzzer.still_serving(server, server.pid) == []  # a completion loads it again


def test_transport_abuse_does_not_delay_a_healthy_request(server: ServeChild) -> None:
    abuses = anyio.run(fuzzer.transport, server, 200)
    assert [a["kind"] for a in abuses] == [
        "slowloris",
        "half_bodies",
        "invalid_http",
        "oversized_headers",
        "never_reading",
    ]
    for abuse in abuses:
        assert abuse["within_bound"], abuse  # first token within FIRST_TOKEN_BOUND_S
        assert abuse.get("bad_answers", 0) == 0, abuse  # garbage and huge headers: a 4xx or a close, never a 5xx
        assert abuse["fds_after"] <= abuse["fds_before"], abuse  # every abusive connection let go
    assert fuzzer.still_serving(server, server.pid) == []


def test_a_client_that_leaves_mid_body_leaves_no_traceback() -> None:
    """Found by the fuzzer's half-sent bodies: ``ClientDisconnect`` from ``request.body()`` went unhandled, and
    uvicorn logged "Exception in ASGI application" with a traceback for every such client."""
    server = ServeChild("--engine", "debug", "--name", "debug", verbose=True)
    try:
        server.wait_for(r"debug ready \(runner pid", 30)
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(fuzzer.HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"prompt": ')
                assert http.get("/healthz").status_code == 200
            server.wait_for(r"the client closed the connection before its body arrived", 10)
            ok = http.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
            assert ok.status_code == 200
        lines = server.drain()
        assert not [line for line in lines if "Traceback" in line or "Exception in ASGI" in line], lines
    finally:
        server.signal(15)
        server.proc.wait(15)


# --------------------------------------------------------------------------------------------------------------
# The fuzzer can fail: a server with a real bug, and a schema that lies about ours
# --------------------------------------------------------------------------------------------------------------


class Divide(BaseModel):
    n: int


def _buggy_app() -> FastAPI:
    app = FastAPI()

    @app.post("/divide")
    def divide(body: Divide) -> dict[str, float]:
        return {"result": 1 / body.n}  # n = 0: ZeroDivisionError, a 500

    return app


@pytest.fixture
def buggy_server() -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_buggy_app(), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    with anyio.from_thread.start_blocking_portal() as portal:
        portal.call(_wait_listening, url)
    yield url
    server.should_exit = True
    thread.join(10)


async def _wait_listening(url: str) -> None:
    with anyio.fail_after(10):
        while True:
            try:
                async with httpx.AsyncClient() as client:
                    await client.get(f"{url}/openapi.json")
                return
            except httpx.TransportError:
                await anyio.sleep(0.02)


def test_the_fuzzer_counts_a_real_5xx(buggy_server: str) -> None:
    schema = schemathesis.openapi.from_url(f"{buggy_server}/openapi.json")
    report = fuzzer.fuzz(schema, buggy_server, 50, seed=0)
    assert report.unexpected_5xx > 0, report
    assert any("ZeroDivisionError" in f or "unexpected 500" in f for f in report.failures), report.failures


def test_the_header_fuzzer_finds_a_server_that_answers_any_host(buggy_server: str) -> None:
    """A server without the guard (tether's main before issue 30 was one) serves rebinding's Host and other
    sites' Origins: the header phase counts them."""
    schema = schemathesis.openapi.from_url(f"{buggy_server}/openapi.json")
    report = fuzzer.fuzz_headers(schema, buggy_server, 40, seed=0)
    assert report.served_foreign > 0, report
    assert any("expected 403 host_not_allowed" in f for f in report.failures), report.failures


def test_the_fuzzer_catches_a_schema_that_lies(server: ServeChild, document: dict[str, Any]) -> None:
    """Two lies, each caught: a domain wider than the server's check (valid data refused: ``n`` above 1), and a
    response field documented with the wrong type. (A wider ``temperature`` bound was the first lie; among the
    completion body's many fields, 40 cases no longer reliably draw a temperature above 2.)"""
    lying = copy.deepcopy(document)
    lying["components"]["schemas"]["CompletionRequest"]["properties"]["n"] = {"type": "integer", "enum": [1, 2, 3]}
    lying["components"]["schemas"]["Health"]["properties"]["status"] = {"type": "integer"}
    # only the two lying operations: the claim is that each lie is caught, and fuzzing the other 30 proves nothing here
    lying["paths"] = {path: lying["paths"][path] for path in ("/healthz", "/v1/completions")}
    schema = schemathesis.openapi.from_dict(lying)
    report = fuzzer.fuzz(schema, server.url, 40, seed=3)
    failures = "\n".join(report.failures)
    assert report.nonconforming >= 2, failures
    assert set(report.nonconforming_by_operation) >= {"GET /healthz", "POST /v1/completions"}, failures
    assert report.unexpected_5xx == 0, failures
