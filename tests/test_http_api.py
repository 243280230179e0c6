"""`tether serve` as users run it: a live server process, the real `openai` client, httpx for the rest."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import TETHER, Server, debug_server, model_missing, pid_alive, wait_until
from tether.kernel.cgroups import MemoryCgroup
from tether.kernel.pids import live_processes

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leftover_runners")]


QUESTION: Any = [
    {"role": "system", "content": "You are a helpful AI assistant."},  # as `tether run` sends (see cli.DEFAULT_SYSTEM)
    {"role": "user", "content": "What is the capital of France?"},
]


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any] | str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload if payload == "[DONE]" else json.loads(payload)


def metric(server: Server, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent)."""
    text = server.http.get("/metrics").text
    for line in text.splitlines():
        named = line.startswith(name + "{") or line.startswith(name + " ")
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --------------------------------------------------------------------------------------------------------------
# The default model through the openai client
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.timeout(180)
def test_chat_streaming_on_the_default_model_says_paris(model_server: Server) -> None:
    client = model_server.openai()
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "Paris" in text
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.model
@pytest.mark.timeout(180)
def test_chat_and_completions_without_streaming_on_the_default_model(model_server: Server) -> None:
    client = model_server.openai()
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, seed=1, temperature=0)
    assert chat.object == "chat.completion" and "Paris" in (chat.choices[0].message.content or "")
    assert chat.usage is not None and chat.usage.completion_tokens > 0
    again = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, seed=1, temperature=0)
    assert again.choices[0].message.content == chat.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    # the prompt cache had all of the prompt but its last token (whose logits make the first token)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1, again.usage
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert completion.object == "text_completion" and completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens <= 8
    pieces = list(
        client.completions.create(model=model, prompt="One, two, three,", max_tokens=8, temperature=0, stream=True)
    )
    assert pieces and "".join(p.choices[0].text for p in pieces).strip()


# --------------------------------------------------------------------------------------------------------------
# Failures, recovery, cancellation, back-pressure
# --------------------------------------------------------------------------------------------------------------


def _admin_debug_instance(server: Server, instance_id: str, **config: Any) -> dict[str, Any]:
    return server.add_instance({"id": instance_id, "engine": "debug", **config})


@pytest.mark.slow
def test_a_runner_killed_mid_stream_ends_the_stream_with_its_cause_and_the_instance_recovers() -> None:
    """With ``resume: false``, today's promise alone: the stream ends at once with the cause (docs/resume.md)."""
    with debug_server() as server:
        _admin_debug_instance(
            server, "slow", options={"token_seconds": 0.01}, restart={"initial_backoff": 0.05}, resume=False
        )
        client = server.openai()
        pid = server.instance("slow")["runner"]["pid"]
        stream = client.chat.completions.create(
            model="slow", messages=[{"role": "user", "content": "go on"}], max_tokens=10_000, stream=True
        )
        received = 0
        with pytest.raises(openai.APIError) as raised:
            for _chunk in stream:
                received += 1
                if received == 5:
                    os.kill(pid, signal.SIGKILL)
        error = raised.value.body
        assert isinstance(error, dict), error
        assert error["code"] == "signal" and "SIGKILL" in error["cause"]["summary"], error
        assert error["completion_tokens"] >= 4
        wait_until(
            lambda: (i := server.instance("slow"))["ready"] and i["runner"]["pid"] != pid, 30, "a new runner ready"
        )
        after = server.instance("slow")
        assert after["restarts"] == 1 and after["runner"]["pid"] != pid
        assert after["history"][0]["cause"]["kind"] == "signal" and after["history"][0]["detected_in"] is not None
        answer = client.chat.completions.create(
            model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.choices[0].finish_reason == "length"
        assert metric(server, "tether_runner_failures_total", instance="slow", cause="signal") == 1
        assert metric(server, "tether_instance_restarts_total", instance="slow") == 1
        assert metric(server, "tether_failure_detection_seconds_count", cause="signal") == 1
        status = subprocess.run(
            [*TETHER, "status", "--url", server.url], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        assert re.search(r"^slow\s+ready\s+\d+\s+debug", status, re.M), status
        assert "killed by SIGKILL" in status, status


@pytest.mark.slow
def test_a_native_crash_before_the_first_token_is_a_500_with_the_cause_and_its_stack() -> None:
    with debug_server() as server:
        crash = [{"kind": "segv", "after_tokens": 0}]
        _admin_debug_instance(server, "crashy", faults=crash, restart={"mode": "never"})
        response = server.http.post(
            "/v1/chat/completions", json={"model": "crashy", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["code"] == "native_crash" and "SIGSEGV" in error["message"]
        assert any("Segmentation fault" in line for line in error["cause"]["evidence"]), error
        # The 500 can be out before the instance has taken in its runner's death (then a request meets a 503 that
        # names the crash): wait for the state the second request is about.
        wait_until(lambda: server.instance("crashy")["state"] == "failed", 10, "instance crashy failed")
        again = server.http.post(
            "/v1/chat/completions", json={"model": "crashy", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert again.status_code == 503 and "failed" in again.json()["error"]["message"]
        assert "Retry-After" not in again.headers  # restart policy 'never': retrying cannot help


@pytest.mark.slow
def test_a_client_that_disconnects_cancels_its_generation() -> None:
    with debug_server() as server:
        _admin_debug_instance(server, "slow", options={"token_seconds": 0.01})
        body = {"model": "slow", "messages": [{"role": "user", "content": "go"}], "max_tokens": 100_000, "stream": True}
        with server.http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            for n, _ in enumerate(sse_events(response)):
                if n == 3:
                    break  # leaving the block closes the connection
        wait_until(
            lambda: metric(server, "tether_requests_total", instance="slow", outcome="cancelled") == 1,
            10,
            "the generation cancelled",
        )
        assert server.instance("slow")["queue"]["in_flight"] == 0
        gone = server.http.post(f"/v1/requests/{request_id}/cancel").json()
        assert gone["outcome"] == "finished"
        # Not still generating 100,000 tokens: the runner is free for the next request at once.
        began = time.monotonic()
        quick = server.http.post(
            "/v1/completions", json={"model": "slow", "prompt": "hi", "max_tokens": 3}, timeout=10
        ).json()
        assert quick["choices"][0]["finish_reason"] == "length" and time.monotonic() - began < 5


@pytest.mark.slow
def test_a_request_can_be_cancelled_by_id() -> None:
    with debug_server() as server:
        _admin_debug_instance(server, "slow", options={"token_seconds": 0.01})
        body = {"model": "slow", "prompt": "go", "max_tokens": 100_000, "stream": True}
        with server.http.stream("POST", "/v1/completions", json=body) as response:
            request_id = response.headers["x-request-id"]
            events = sse_events(response)
            next(events)
            reply = server.http.post(f"/v1/requests/{request_id}/cancel").json()
            assert reply["outcome"] == "requested", reply
            rest = list(events)
        assert rest and isinstance(rest[-1], dict) and rest[-1]["error"]["type"] == "cancelled", rest[-3:]
        assert "[DONE]" not in rest
        unknown = server.http.post("/v1/requests/nope/cancel").json()
        assert unknown["outcome"] == "unknown" and "nothing to cancel" in unknown["detail"]


@pytest.mark.slow
def test_a_full_queue_answers_503_with_retry_after_and_waiting_requests_share_a_failure() -> None:
    with debug_server() as server:
        _admin_debug_instance(server, "q", options={"token_seconds": 0.01}, max_queue=1, restart={"mode": "never"})
        body = {"model": "q", "prompt": "go", "max_tokens": 100_000, "stream": True}
        waited: list[httpx.Response] = []

        def wait_in_queue() -> None:  # a non-streaming request answers only at its end: it needs a thread
            with httpx.Client(base_url=server.url, timeout=30) as client:
                waited.append(client.post("/v1/completions", json={**body, "stream": False}))

        with server.http.stream("POST", "/v1/completions", json=body) as first:
            events = sse_events(first)
            next(events)  # the first is generating
            waiter = threading.Thread(target=wait_in_queue)
            waiter.start()
            wait_until(lambda: server.instance("q")["queue"]["waiting"] == 1, 10, "one running, one waiting")
            queue = server.instance("q")["queue"]
            assert queue == {"running": 1, "waiting": 1, "in_flight": 2, "parallel": 1, "max_queue": 1, "limit": 2}
            full = server.http.post("/v1/completions", json=body)
            assert full.status_code == 503 and full.headers["Retry-After"] == "1", full.text
            assert "1 requests generating (parallel 1) and 1 waiting (max_queue 1)" in full.json()["error"]["message"]
            os.kill(server.instance("q")["runner"]["pid"], signal.SIGKILL)
            last = list(events)[-1]
            assert isinstance(last, dict) and last["error"]["code"] == "signal"
            waiter.join(30)
        assert waited and waited[0].status_code == 500, waited
        assert waited[0].json()["error"]["code"] == "signal", waited[0].text
        assert metric(server, "tether_requests_total", instance="q", outcome="rejected") == 1


@pytest.mark.slow
def test_parallel_streams_run_together_and_the_api_metrics_and_status_show_running_and_waiting() -> None:
    with debug_server() as server:
        _admin_debug_instance(server, "b", options={"token_seconds": 0.01, "parallel": 2}, max_queue=1)
        body = {"model": "b", "prompt": "go", "max_tokens": 100_000, "stream": True}
        waited: list[httpx.Response] = []

        def wait_for_a_slot() -> None:  # answers only once a slot frees and it has run: it needs a thread
            with httpx.Client(base_url=server.url, timeout=30) as client:
                waited.append(client.post("/v1/completions", json={**body, "max_tokens": 5, "stream": False}))

        waiter = threading.Thread(target=wait_for_a_slot)
        with contextlib.ExitStack() as stack:
            streams = [stack.enter_context(server.http.stream("POST", "/v1/completions", json=body)) for _ in range(2)]
            events = [sse_events(stream) for stream in streams]  # (kept: a dropped iterator closes its response)
            for e in events:
                next(e)  # both are generating, side by side
            waiter.start()
            wait_until(lambda: server.instance("b")["queue"]["waiting"] == 1, 10, "two running, one waiting")
            queue = server.instance("b")["queue"]
            assert queue == {"running": 2, "waiting": 1, "in_flight": 3, "parallel": 2, "max_queue": 1, "limit": 3}
            assert metric(server, "tether_generations_running", instance="b") == 2
            assert metric(server, "tether_generations_waiting", instance="b") == 1
            assert metric(server, "tether_batch_occupancy", instance="b") == 1.0
            assert metric(server, "tether_batch_slots", instance="b") == 2
            status = subprocess.run(
                [*TETHER, "status", "--url", server.url], capture_output=True, text=True, timeout=30, check=True
            )
            lines = status.stdout.splitlines()
            header = next(line for line in lines if line.startswith("INSTANCE"))  # below the node's line
            row = next(r for r in lines if r.startswith("b "))
            assert "RUNNING" in header and "WAITING" in header and " 2/2 " in row and " 1/1 " in row, status.stdout
            full = server.http.post("/v1/completions", json=body)
            assert full.status_code == 503 and "2 requests generating (parallel 2)" in full.json()["error"]["message"]
        waiter.join(30)  # the streams closed: their clients left, their slots freed, the waiting one ran
        assert waited and waited[0].status_code == 200 and waited[0].json()["usage"]["completion_tokens"] == 5


# --------------------------------------------------------------------------------------------------------------
# Validation, security, admin, operations
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "temperature": 5},
            "temperature",
            "temperature must be in [0, 2]",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
            "max_tokens",
            "max_tokens must be in [1, 2147483647]",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", "n must be 1"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages", "Expected `array`, got `str`"),
        ("/v1/chat/completions", {"model": "debug"}, None, "missing required field `messages`"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens", "Expected `int | null`"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "prompt must be one prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "0 only with echo"),
    ],
)
def test_bad_parameters_are_a_400_naming_the_field(
    path: str, body: dict[str, Any], param: str | None, message: str, debug_shared: Server
) -> None:
    response = debug_shared.http.post(path, json={"model": "debug", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error
    if param is not None:
        assert error["param"] == param, error


@pytest.fixture(scope="module")
def debug_shared() -> Iterator[Server]:
    with debug_server() as server:
        yield server


def test_malformed_json_and_oversized_bodies_are_refused(debug_shared: Server) -> None:
    broken = debug_shared.http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    huge = debug_shared.http.post("/v1/completions", json={"prompt": "x" * (5 << 20)})
    assert huge.status_code == 413 and "exceeds the limit of 4194304 bytes" in huge.json()["error"]["message"]
    ok = debug_shared.http.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2})
    assert ok.status_code == 200


CHAT = b'"model": "debug", "messages": [{"role": "user", "content": "hi"}]'
DEEP = 1_000  # levels: past the interpreter's recursion limit, where msgspec raised RecursionError (a 500)


def _chat(extra: bytes) -> bytes:
    return b"{" + CHAT + b", " + extra + b"}"


def _any_json(value: bytes) -> bytes:
    """A chat body with ``value`` where any JSON is allowed (a JSON Schema: unknown fields are refused)."""
    return _chat(b'"response_format": {"type": "json_schema", "json_schema": {"schema": {"x": ' + value + b"}}}")


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "/v1/chat/completions",
            _any_json(b"[" * DEEP + b"]" * DEEP),
            None,
            "nests arrays or objects too deeply",
        ),
        ("/v1/chat/completions", _any_json(b'{"a": ' * DEEP + b"1" + b"}" * DEEP), None, "too deeply"),
        (
            "/v1/instances",
            b'{"id": "deep", "engine": "debug", "options": {"a": ' + b"[" * DEEP + b"]" * DEEP + b"}}",
            None,
            "too deeply",
        ),
        ("/v1/chat/completions", _chat(b'"max_tokens": ' + b"9" * 400), "max_tokens", "max_tokens must be in"),
        ("/v1/chat/completions", _chat(b'"seed": ' + b"9" * 30), "seed", "seed must be a 64-bit integer"),
        ("/v1/chat/completions", _chat(b'"temperature": 1e400'), "temperature", "Number out of range"),
        ("/v1/chat/completions", _chat(b'"temperature": NaN'), None, "not valid JSON"),
        ("/v1/chat/completions", _chat(b'"top_p": -Infinity'), None, "not valid JSON"),
        ("/v1/completions", b'{"model": "debug", "prompt": "a lone \\ud800 surrogate"}', None, "not valid JSON"),
        ("/v1/completions", b'{"model": "debug", "prompt": "invalid \xff\xfe utf-8"}', None, "not valid JSON"),
        ("/v1/completions", b'{"model": "debug", "prompt": "x", "stop": ["\\udfff"]}', None, "not valid JSON"),
        (
            "/v1/instances",
            b'{"id": "m", "engine": "debug", "memory_limit": ' + b"9" * 30 + b"}",
            "memory_limit",
            "memory_limit must be at least 16 MiB",
        ),
        ("/v1/instances", b'{"id": "q", "engine": "debug", "max_queue": ' + b"9" * 30 + b"}", "max_queue", "in [1, "),
        ("/v1/instances", b"[" * DEEP + b"]" * DEEP, None, "Expected `object`, got `array`"),
    ],
    ids=lambda value: value if isinstance(value, str) and len(value) < 40 else None,
)
def test_hostile_bodies_are_a_400_and_the_connection_serves_on(
    path: str, body: bytes, param: str | None, message: str, debug_shared: Server
) -> None:
    """Each used to reach a 500 (RecursionError, OverflowError deep in the channel: the latter also left the task
    unacknowledged, so the runner was declared hung and killed). Now: a 400 in OpenAI's shape, no traceback, the
    same keep-alive connection answers the next request, and no runner died for it."""
    pid = debug_shared.instance("debug")["runner"]["pid"]
    host, port = debug_shared.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 400, error
        assert response.getheader("connection") != "close"
        assert error["type"] == "invalid_request_error" and message in error["message"], error
        assert error["param"] == param, error
        sock = connection.sock
        ok = json.dumps({"model": "debug", "prompt": "still serving", "max_tokens": 2})
        connection.request("POST", "/v1/completions", body=ok, headers={"Content-Type": "application/json"})
        again = connection.getresponse()
        assert again.status == 200, again.read()
        again.read()
        assert connection.sock is sock  # the very same connection
    finally:
        connection.close()
    assert debug_shared.instance("debug")["runner"]["pid"] == pid  # no runner paid for it
    assert not [line for line in debug_shared.drain() if "Traceback" in line]


def test_a_chat_message_with_a_role_no_template_knows_is_refused_naming_it(debug_shared: Server) -> None:
    base = {"model": "debug", "messages": [{"role": "user", "content": "hi"}]}
    for role in ("wizard", "function"):  # "tool" is a tool's result (test_openai_features.py)
        messages = [{"role": "system", "content": "be brief"}, {"role": role, "content": "hi"}]
        response = debug_shared.http.post("/v1/chat/completions", json={**base, "messages": messages})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages[1].role" and repr(role) in error["message"], error
    developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    answered = debug_shared.http.post("/v1/chat/completions", json={**base, "messages": developer, "max_tokens": 2})
    assert answered.status_code == 200, answered.text  # OpenAI's newer name for system


def test_an_unknown_engine_is_refused_up_front_listing_the_engines(debug_shared: Server) -> None:
    response = debug_shared.http.post("/v1/instances", json={"id": "nope", "engine": "nope"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "engine" and "'llama.cpp', 'debug'" in error["message"], error
    assert debug_shared.http.get("/v1/instances/nope").status_code == 404  # nothing was started


@pytest.mark.slow
def test_without_a_model_among_several_the_request_is_told_model_is_required() -> None:
    with debug_server() as server:
        _admin_debug_instance(server, "second")
        response = server.http.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and "'model' is required" in error["message"], error
        assert "models: debug, " in error["message"] and ", second" in error["message"]  # catalog, then instances


@pytest.mark.slow
def test_the_api_key_is_required_everywhere_but_the_probes() -> None:
    with debug_server(api_key="s3cret") as server:
        bare = httpx.Client(base_url=server.url, timeout=10)
        for path in ("/v1/models", "/metrics", "/v1/instances"):
            assert bare.get(path).status_code == 401
            assert bare.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        denied = bare.post("/v1/completions", json={"prompt": "hi"})
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert bare.get("/healthz").status_code == 200 and bare.get("/readyz").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        answer = server.openai().completions.create(model="debug", prompt="hi", max_tokens=2)
        assert answer.choices[0].text
        bare.close()


@pytest.mark.slow
def test_admin_api_refuses_what_does_not_fit_with_the_numbers_and_deletes_cleanly() -> None:
    with debug_server() as server:
        missing = model_missing()
        if missing is None:
            huge = server.http.post("/v1/instances", json={"id": "huge", "options": {"n_ctx": 50_000_000}})
            assert huge.status_code == 507, huge.text
            message = huge.json()["error"]["message"]
            assert re.search(r"does not fit: needs ~[\d.]+ (G|T)iB .* available", message), message
        bad = server.http.post("/v1/instances", json={"id": "x", "engine": "debug", "max_queue": 0})
        assert bad.status_code == 400 and "max_queue must be in [1, " in bad.json()["error"]["message"]
        assert bad.json()["error"]["param"] == "max_queue"
        nameless = server.http.post("/v1/instances", json={"model": "."})  # its stem, "", is no id
        assert nameless.status_code == 400 and nameless.json()["error"]["param"] == "id", nameless.text
        typo = server.http.post("/v1/instances", json={"id": "x", "engien": "debug"})
        assert typo.status_code == 400 and "unknown field 'engien'" in typo.json()["error"]["message"]
        taken = server.http.post("/v1/instances", json={"id": "debug", "engine": "debug"})
        assert taken.status_code == 409
        second = _admin_debug_instance(server, "second")
        pid = second["runner"]["pid"]
        listed = server.http.get("/v1/instances").json()["data"]
        assert {i["id"] for i in listed} == {"debug", "second"}
        memory = second["runner"]["memory"]
        assert 0 < memory["footprint"] < memory["rss"] and second["state"] == "ready"
        unknown_model = server.http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        assert unknown_model.status_code == 404 and ", second" in unknown_model.json()["error"]["message"]
        deleted = server.http.delete("/v1/instances/second")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert not pid_alive(pid)
        assert server.http.get("/v1/instances/second").status_code == 404
        assert server.http.delete("/v1/instances/debug").status_code == 200
        ready = server.http.get("/readyz")
        assert ready.status_code == 503 and ready.json() == {"ready": False, "instances": {}}


@pytest.mark.slow
def test_an_instance_memory_limit_is_its_runners_cgroup_limit() -> None:
    with debug_server() as server:
        limited = _admin_debug_instance(server, "small", memory_limit=256 << 20)
        pid = limited["runner"]["pid"]
        with open(f"/proc/{pid}/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
        memory = [path for _, controllers, path in lines if "memory" in controllers.split(",")]
        limit_file = f"/sys/fs/cgroup/memory{memory[0]}/memory.limit_in_bytes" if memory else ""
        if not memory or not os.path.exists(limit_file):
            pytest.skip("no cgroup v1 memory hierarchy: runners get no memory cgroup of their own here")
        with open(limit_file) as f:
            assert int(f.read()) == 256 << 20


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_a_signal_stops_the_server_and_leaves_no_process_behind(sig: signal.Signals) -> None:
    server = Server("--engine", "debug", "--stop-timeout", "5")
    try:
        pid = server.wait_ready()
        body = {"model": "debug", "prompt": "go", "max_tokens": 10_000_000, "stream": True}
        with server.http.stream("POST", "/v1/completions", json=body) as response:
            next(sse_events(response))  # a generation in flight when the signal comes
            began = time.monotonic()
            server.proc.send_signal(sig)
            code = server.proc.wait(15)
            took = time.monotonic() - began
    finally:
        server.proc.kill()
    assert code == 0, "\n".join(server.seen)
    assert took < 5 + 3
    assert not pid_alive(pid)
    assert not [p for p in live_processes() if p.ppid == server.proc.pid], "children left behind"


def _add_helpers_instance(server: Server, instance_id: str = "helpers") -> dict[str, Any]:
    """A debug instance whose engine starts a helper of each kind that leaves the runner's process group."""
    return _admin_debug_instance(
        server, instance_id, options={"helpers": 3, "helper_kind": "setsid,setpgid,double_fork"}
    )


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("own_cgroups")
@pytest.mark.slow
@pytest.mark.serial  # dead workers' cgroups, left on purpose: another test's starting worker would sweep them
def test_a_sigkilled_server_takes_every_helper_along_even_those_that_left_the_group() -> None:
    """The acceptance drill: helpers that called setsid (or setpgid, or daemonized) stayed alive after the worker's
    SIGKILL; now every process in every runner's cgroup goes, and the next worker's start removes the cgroups."""
    from test_orphans import wait_gone  # the same pidfd wait the orphan drills use

    cgroups: list[str] = []
    for _ in range(5):
        server = Server("--engine", "debug", "--no-reap")  # leave the cgroups for the last check
        try:
            server.wait_ready()
            inst = _add_helpers_instance(server)
            path = inst["runner"]["cgroup"]
            assert path is not None
            cgroups.append(path)
            members = MemoryCgroup.at(Path(path)).pids()
            assert len(members) == 5  # the runner, its guard and three helpers
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(10)
            assert wait_gone(members, 10) == [], f"survived the worker's SIGKILL: {members}"
        finally:
            server.proc.kill()
            server.http.close()
    assert all(os.path.exists(path) for path in cgroups)  # a SIGKILLed worker cannot remove them...
    again = Server("--engine", "debug")  # ...the next one does, as it starts
    try:
        again.wait_ready()
        assert [path for path in cgroups if os.path.exists(path)] == []
    finally:
        assert again.stop() == 0


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("own_cgroups")
@pytest.mark.slow
def test_a_clean_stop_leaves_no_runner_cgroup_behind() -> None:
    """The cgroup removal used to be a background task that the stopping worker cancelled, about one stop in four."""
    left: list[str] = []
    for _ in range(6):
        server = Server("--engine", "debug", "--stop-timeout", "5")
        try:
            server.wait_ready()
            paths = [_add_helpers_instance(server)["runner"]["cgroup"], server.instance("debug")["runner"]["cgroup"]]
            assert all(paths)
        finally:
            code = server.stop()
        assert code == 0, "\n".join(server.seen)
        left += [path for path in paths if os.path.exists(path)]
    assert left == []


@pytest.mark.slow
def test_the_status_json_has_the_node_live_tokens_the_requests_in_flight_and_each_lifes_log() -> None:
    """What the dashboard and `tether status` read: this machine's memory with its source, tokens served counting the
    streams in flight, the requests being served (cancellable by id), and the runner log of the current and a failed
    life."""
    with debug_server() as server:
        _admin_debug_instance(  # (resume off: the killed stream ends then, not 2,000 tokens later)
            server, "slow", options={"token_seconds": 0.02}, restart={"initial_backoff": 0.05}, resume=False
        )
        body = server.http.get("/v1/instances").json()
        node = body["node"]
        assert node["pid"] == server.proc.pid and node["memory"]["available"] > 0 and node["memory"]["source"]
        before = next(inst for inst in body["data"] if inst["id"] == "slow")
        assert before["tokens"] == 0 and before["life"] == 1 and before["in_flight_requests"] == []
        chat = {"model": "slow", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000, "stream": True}
        with (
            httpx.Client(base_url=server.url, timeout=30) as client,
            client.stream("POST", "/v1/chat/completions", json=chat) as response,
        ):
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            request_id = json.loads(first[6:])["id"]

            def streaming() -> bool:
                inst = server.instance("slow")
                return inst["tokens"] >= 5 and [r["id"] for r in inst["in_flight_requests"]] == [request_id]

            wait_until(streaming, 10, "tokens counted while the stream is in flight, and the request listed")
            current = server.http.get("/v1/instances/slow/log").json()
            assert current["life"] == 1 and current["path"].endswith(".log") and isinstance(current["lines"], list)
            pid = server.instance("slow")["runner"]["pid"]
            os.kill(pid, signal.SIGKILL)
            for _ in lines:
                pass
        wait_until(lambda: server.instance("slow")["history"], 10, "the failed life recorded")
        failed = server.instance("slow")["history"][-1]
        assert failed["life"] == 1 and failed["log"] == current["path"]
        log = server.http.get("/v1/instances/slow/log", params={"life": 1, "lines": 5}).json()
        assert log["life"] == 1 and len(log["lines"]) <= 5
        missing = server.http.get("/v1/instances/slow/log", params={"life": 99})
        assert missing.status_code == 404 and "lives with a log are" in missing.json()["error"]["message"]
        bad = server.http.get("/v1/instances/slow/log", params={"lines": "many"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lines"
        shown = subprocess.run(
            [*TETHER, "status", "--url", server.url], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        assert f"(pid {server.proc.pid}, up " in shown and "available (" in shown, shown
