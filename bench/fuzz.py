"""The API fuzzer: schemathesis against a live ``tether serve``, transport abuse, then a check that it still serves.

1. **Schema fuzzing.** Our own ``tether serve --engine debug --name fuzz --n-ctx 4096`` (private runtime and log
   dirs). schemathesis loads ``GET /openapi.json`` and, for every operation, generates ``--examples`` schema-valid
   cases (positive) and as many schema-invalid ones (negative), seeded (``--seed``), without shrinking. Each case is
   sent with a 30 s timeout and its response checked by schemathesis' own checks (status code, content type, headers
   and body against the documented schema, SSE events too; invalid data must get a 4xx, valid data must not),
   except ``positive_data_acceptance`` on ``POST /v1/instances``: whether a config is usable also depends on rules
   JSON Schema cannot state (``max_backoff >= initial_backoff``) and on the machine (the engines installed, the
   model file); those answers are documented 400s. A case that creates an instance deletes it again; one that
   deletes ``fuzz`` puts it back, so every case meets a serving instance.

   Every 5xx is classified: a documented one is a runner-failure 500 carrying a ``cause``, a 503 with code
   ``unavailable`` (with Retry-After when retrying helps), ``/readyz``'s 503 while no model is loaded or a 507
   ``does_not_fit``; any other is ``unexpected_5xx`` (a bug). ``nonconforming`` counts responses that break the schema.
2. **Hosts and Origins.** Every operation again, ``--examples`` positive cases each, sent with a drawn ``Host`` and
   ``Origin``: loopback names at any port, with no Origin or the server's own (must be served); foreign names,
   rebinding's look (Host and Origin both foreign), ``127.0.0.1.nip.io``, addresses (must be 403
   ``host_not_allowed``); a loopback Host with another site's origin, ``null`` or another local port (403
   ``origin_not_allowed``); malformed Hosts (a 403 or the parser's 400). Each class's verdict is known by
   construction; ``header_served_foreign`` counts a foreign request served, ``header_refused_loopback`` a loopback
   one refused, and every refusal must conform to the schema.
3. **Transport abuse**, each while a healthy streaming request (``/v1/completions``, 8 tokens) is sent and timed to
   its first token, which must come within ``FIRST_TOKEN_BOUND_S``: ``slowloris`` (``--idle`` connections that send
   a partial request head, one header line a second), ``half_bodies`` (50 requests declaring 1,000 body bytes and
   sending 10), ``invalid_http`` (50 connections sending bytes that are no HTTP, each must be answered 400 or
   closed), ``oversized_headers`` (10 requests with a 1 MiB header, each answered 4xx or closed) and
   ``never_reading`` (8 streams of 4,000 tokens whose clients read nothing, with a 4 KiB receive buffer).
   Afterwards every abusive connection is closed and the worker's fd count must come back to where it was.
4. **Still serving**: a completion succeeds, ``/readyz`` is 200, the worker is the same process, its stderr holds
   no traceback, and the stop is clean.

The baseline a user would otherwise have is none: no peer server publishes a fuzzing figure. Run:
``.venv/bin/python bench/fuzz.py --examples 200`` (the published figure) or ``--quick``. The last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import hypothesis
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import positive_data_acceptance

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchstats import emit, ms, percentile, private_tether_dirs
from tether.chaos.target import ServeChild
from tether.serve.dialects import ollama, openai, responses
from tether.serve.routes import NDJSON
from tether.serve.statuses import ENGINE_REFUSED

INSTANCE = "fuzz"
SERVE_ARGS = ("--engine", "debug", "--name", INSTANCE, "--n-ctx", "4096", "--stop-timeout", "5")
CALL_TIMEOUT = 30.0
# POST /v1/instances answers once every replica's placement is decided, each loaded in turn (48 replicas of the
# default model: ~50 s), within tether serve's --load-wait (300 s): the fuzzer waits as long.
INSTANCE_TIMEOUT = 330.0
FIRST_TOKEN_BOUND_S = 2.0  # a healthy request's first token, whatever the abuse (idle here: a few ms)
SAMPLE_LIMIT = 8  # failures kept verbatim in the report


@dataclass
class FuzzReport:
    examples: int = 0
    by_mode: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    documented_5xx: Counter[str] = field(default_factory=Counter)
    unexpected_5xx: int = 0
    nonconforming: int = 0
    nonconforming_by_operation: Counter[str] = field(default_factory=Counter)  # every one, beyond the samples
    transport_errors: int = 0
    failures: list[str] = field(default_factory=list)
    operations: int = 0
    no_negative: int = 0  # operations without anything a negative case could break

    def note(self, problem: str) -> None:
        if len(self.failures) < SAMPLE_LIMIT:
            self.failures.append(problem[:600])


def error_of(body: bytes) -> dict[str, Any] | None:
    """An error body's fields: OpenAI's ``{"error": {...}}``, or Ollama's ``{"error": "<message>", ...}``."""
    try:
        whole = json.loads(body)
        error = whole["error"]
    except (ValueError, KeyError, TypeError):
        return None
    found = whole if isinstance(error, str) else error
    return found if isinstance(found, dict) else None


@schemathesis.deserializer(NDJSON)
def ndjson(_ctx: Any, response: Any) -> list[Any]:
    """Ollama's streams: one JSON object a line, checked as the array the schema describes."""
    return [json.loads(line) for line in response.content.decode().splitlines() if line.strip()]


def classify_5xx(status: int, body: bytes) -> str | None:
    """What a 5xx documents (``runner_failure``, ``unavailable``, ``does_not_fit``, ``not_ready``), or None: it is a
    bug. ``not_ready`` is ``/readyz`` between an unload and the next load (a case's ``keep_alive: 0`` unloads the
    model when idle; the next request loads it again)."""
    if status == 503 and _not_ready(body):
        return "not_ready"
    error = error_of(body)
    if error is None:
        return None
    if status == 500 and isinstance(error.get("cause"), dict) and error["cause"].get("kind"):
        return "runner_failure"
    if status == 503 and error.get("code") == "unavailable":
        return "unavailable"
    if status == 507 and error.get("code") == "does_not_fit":
        return "does_not_fit"
    return None


def _not_ready(body: bytes) -> bool:
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    return isinstance(answer, dict) and answer.get("ready") is False and isinstance(answer.get("instances"), dict)


def fuzz(
    schema: Any,
    base_url: str,
    examples: int,
    seed: int,
    *,
    headers: dict[str, str] | None = None,
    keep_instance: dict[str, Any] | None = None,
) -> FuzzReport:
    """Fuzz every operation of ``schema`` (a schemathesis schema) against ``base_url``: ``examples`` positive and as
    many negative cases each. ``keep_instance``: an instance config that must exist for the cases (recreated when a
    case deletes it); instances a case creates are deleted."""
    fuzzer = Fuzzer(base_url, headers or {}, keep_instance)
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            fuzzer.report.operations += 1
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                test = settings(
                    max_examples=examples,
                    deadline=None,
                    database=None,
                    phases=[Phase.explicit, Phase.generate],  # no shrinking: count, do not minimise
                    suppress_health_check=list(HealthCheck),
                )(given(case=operation.as_strategy(generation_mode=mode))(fuzzer.check))
                try:
                    hypothesis.seed(seed)(test)()
                except hypothesis.errors.Unsatisfiable:  # nothing to break: a route without parameters or body
                    fuzzer.report.no_negative += 1
    finally:
        fuzzer.http.close()
    return fuzzer.report


class Fuzzer:
    """Sends each case, classifies and checks its answer, and tidies up after it."""

    def __init__(self, base_url: str, headers: dict[str, str], keep_instance: dict[str, Any] | None) -> None:
        self.base_url = base_url
        self.headers = headers
        self.keep_instance = keep_instance
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=CALL_TIMEOUT)
        self.report = FuzzReport()

    def check(self, case: Any) -> None:
        report = self.report
        label = f"{case.method.upper()} {case.path}"
        mode = case.meta.generation.mode.value if case.meta is not None else "positive"
        report.examples += 1
        report.by_mode[mode] += 1
        try:
            response = case.call(base_url=self.base_url, headers=self.headers, timeout=call_timeout(label))
        except Exception as exc:  # a connection the server dropped, or a timeout: never expected
            report.transport_errors += 1
            report.note(f"{label} ({mode}): {type(exc).__name__}: {exc}")
            return
        status, body = response.status_code, response.content
        report.statuses[status] += 1
        excluded = [positive_data_acceptance] if label == "POST /v1/instances" or beyond_schema(status, body) else []
        if status >= 500:
            kind = classify_5xx(status, body)
            if kind is None:
                report.unexpected_5xx += 1
                report.note(f"{label} ({mode}): unexpected {status}: {body[:300]!r}")
            else:  # judged here (its body must still match the schema): not schemathesis' "any 5xx is a bug"
                report.documented_5xx[kind] += 1
                excluded.append(not_a_server_error)
        try:
            case.validate_response(response, excluded_checks=excluded)
        except (Failure, FailureGroup) as exc:  # schemathesis raises its failures: one, or a group
            report.nonconforming += 1
            report.nonconforming_by_operation[label] += 1
            report.note(f"{label} ({mode}): {exc}")
        self.tidy(label, status, body)

    def tidy(self, label: str, status: int, body: bytes) -> None:
        if label == "POST /v1/instances" and status == 201:
            self.http.delete(f"/v1/instances/{json.loads(body)['id']}")
        keep = self.keep_instance
        if keep is not None and label.startswith("DELETE ") and status == 200 and json.loads(body)["id"] == keep["id"]:
            restored = self.http.post("/v1/instances", json=keep)
            if restored.status_code == 409:  # a catalogued model: DELETE unloaded it, a request loads it again
                reload = {"model": keep["id"], "prompt": "reload", "max_tokens": 1}
                restored = self.http.post("/v1/completions", json=reload, timeout=CALL_TIMEOUT)
                assert restored.status_code == 200, restored.text
            else:
                assert restored.status_code == 201, restored.text
            wait_ready(self.http, keep["id"])


# --------------------------------------------------------------------------------------------------------------
# Hosts and Origins: what a web page (DNS rebinding, another site) sends, against what curl and the SDKs send
# --------------------------------------------------------------------------------------------------------------

# Each drawn case is built in a class whose verdict is known by construction, not computed by the code under test:
# "served" (loopback names, the server's own origin, no Origin), "host" (403 host_not_allowed), "origin" (403
# origin_not_allowed) and "refused" (malformed: a 403 or the HTTP parser's 400).
FOREIGN_NAMES = (
    "evil.example",
    "localhost.evil.example",  # a name that starts like loopback
    "evil-localhost",
    "127.0.0.1.nip.io",  # resolves to 127.0.0.1 through public DNS: the rebinding trick
    "0.0.0.0",
    "10.0.0.1",
    "192.168.1.10",
    "[::]",
    "[fe80::1]",
    "2130706433",  # 127.0.0.1 as one number: browsers normalize it away, so only a non-browser sends it
    "0x7f.0.0.1",
    "xn--lcalhost-9za",
)
MALFORMED_HOSTS = ("localhost.", "localhost:99999", "localhost:abc", "::1", "[::1", "[::1]x", "local host", "", ":80")


@dataclass
class HeaderReport:
    cases: int = 0
    by_class: Counter[str] = field(default_factory=Counter)
    served_foreign: int = 0  # a foreign Host or Origin served: the hole this phase exists to find
    refused_loopback: int = 0  # a loopback request refused: what curl and the SDKs would hit
    nonconforming: int = 0
    failures: list[str] = field(default_factory=list)

    def note(self, problem: str) -> None:
        if len(self.failures) < SAMPLE_LIMIT:
            self.failures.append(problem[:600])


def header_cases(port: int) -> st.SearchStrategy[tuple[str, dict[str, str]]]:
    """(class, headers) pairs: the four classes above, with names, ports and schemes drawn at random."""
    any_port = st.integers(1, 65535)
    octet = st.integers(0, 255)
    loopback_ip = st.builds(lambda a, b, c: f"127.{a}.{b}.{c}", octet, octet, octet)
    loopback_name = st.one_of(
        st.sampled_from(["localhost", "LOCALHOST", "LocalHost", "127.0.0.1", "[::1]", "[::ffff:127.0.0.1]"]),
        loopback_ip,
    )
    with_port = st.one_of(st.just(port), any_port)
    loopback_host = st.one_of(
        st.builds(lambda name, p: f"{name}:{p}", loopback_name, with_port),
        loopback_name,
    )
    label = st.from_regex(r"\A[a-z][a-z0-9-]{0,12}\Z")
    generated = st.builds(lambda parts: ".".join(parts), st.lists(label, min_size=2, max_size=4)).filter(
        lambda name: "localhost" not in name.split(".")
    )
    foreign_name = st.one_of(st.sampled_from(FOREIGN_NAMES), generated)
    foreign_host = st.one_of(foreign_name, st.builds(lambda name, p: f"{name}:{p}", foreign_name, any_port))
    scheme = st.sampled_from(["http", "https"])

    def own(host: str, chosen: str) -> dict[str, str]:
        return {"Host": host, "Origin": f"{chosen}://{host.lower()}"}

    def foreign_origin(host: str, origin: str) -> dict[str, str]:
        return {"Host": host, "Origin": origin}

    other_origin = st.one_of(
        st.just("null"),
        st.builds(lambda sc, name: f"{sc}://{name}", scheme, foreign_name),
        st.builds(lambda sc, name, p: f"{sc}://{name}:{p}", scheme, foreign_name, any_port),
        st.builds(lambda p: f"http://localhost:{p}", any_port.filter(lambda p: p != port)),  # another local app
        st.builds(lambda p: f"http://127.0.0.1:{p}", any_port.filter(lambda p: p != port)),
    )
    return st.one_of(
        st.builds(lambda h: ("served", {"Host": h}), loopback_host),
        st.builds(lambda h, sc: ("served", own(h, sc)), st.builds(lambda n: f"{n}:{port}", loopback_name), scheme),
        st.builds(lambda h: ("host", {"Host": h}), foreign_host),
        st.builds(lambda h: ("host", {"Host": h, "Origin": f"http://{h}"}), foreign_host),  # rebinding's own look
        st.builds(
            lambda h, o: ("origin", foreign_origin(h, o)),
            st.builds(lambda n: f"{n}:{port}", loopback_name),
            other_origin,
        ),
        st.builds(lambda h: ("refused", {"Host": h}), st.sampled_from(MALFORMED_HOSTS)),
    )


def fuzz_headers(
    schema: Any, base_url: str, examples: int, seed: int, *, keep_instance: dict[str, Any] | None = None
) -> HeaderReport:
    """Every operation of ``schema`` with ``examples`` positive cases, each sent with a drawn Host and Origin; the
    answer must be the class's, and conform to the schema (the guard's 403s are documented on every route)."""
    report = HeaderReport()
    port = _address(base_url)[1]
    tidy = Fuzzer(base_url, {}, keep_instance)

    def check(case: Any, drawn: tuple[str, dict[str, str]]) -> None:
        kind, headers = drawn
        label = f"{case.method.upper()} {case.path}"
        report.cases += 1
        report.by_class[kind] += 1
        try:
            response = case.call(base_url=base_url, headers=headers, timeout=call_timeout(label))
        except Exception as exc:
            report.note(f"{label} {headers}: {type(exc).__name__}: {exc}")
            return
        status, body = response.status_code, response.content
        error = error_of(body) if status == 403 else None
        code = error.get("code") if error is not None else None
        guarded = code in ("host_not_allowed", "origin_not_allowed")
        if kind == "served" and guarded:
            report.refused_loopback += 1
            report.note(f"{label} {headers}: refused although loopback: {body[:300]!r}")
        elif kind in ("host", "origin") and code != f"{kind}_not_allowed":
            report.served_foreign += 1
            report.note(f"{label} {headers}: expected 403 {kind}_not_allowed, got {status}: {body[:300]!r}")
        elif kind == "refused" and not (guarded or status == 400):
            report.served_foreign += 1
            report.note(f"{label} {headers}: a malformed Host answered {status}: {body[:300]!r}")
        if guarded:
            try:
                case.validate_response(response)
            except (Failure, FailureGroup) as exc:
                report.nonconforming += 1
                report.note(f"{label} {headers}: the refusal breaks the schema: {exc}")
        tidy.tidy(label, status, body)

    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            test = settings(
                max_examples=examples,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(
                given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE), drawn=header_cases(port))(
                    check
                )
            )
            hypothesis.seed(seed)(test)()
    finally:
        tidy.http.close()
    return report


def call_timeout(label: str) -> float:
    return INSTANCE_TIMEOUT if label == "POST /v1/instances" else CALL_TIMEOUT


def beyond_schema(status: int, body: bytes) -> bool:
    """A 400 for a rule the schema cannot state: one the engine enforces (its context length, the schema features
    its grammar compiles, what the debug engine does not do) or one of a dialect's ``BEYOND_SCHEMA``."""
    error = error_of(body) if status == 400 else None
    if error is None:
        return False
    param = re.sub(r"\[\d+\]", "", error.get("param") or "")  # messages[3].reasoning: messages.reasoning
    beyond = (*openai.BEYOND_SCHEMA, *ollama.BEYOND_SCHEMA, *responses.BEYOND_SCHEMA)
    named = param in beyond or any(param.startswith(f"{rule}.") for rule in beyond)  # chat_template_kwargs.KEY
    return error.get("code") == ENGINE_REFUSED or named


def wait_ready(http: httpx.Client, instance_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = http.get(f"/v1/instances/{instance_id}")
        if response.status_code == 200 and response.json()["ready"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"instance {instance_id} not ready within {timeout} s")


# --------------------------------------------------------------------------------------------------------------
# Transport abuse
# --------------------------------------------------------------------------------------------------------------


async def healthy_first_token(url: str) -> float:
    """Seconds from sending a small streaming completion to its first token (it must also end with [DONE])."""
    body = {"model": INSTANCE, "prompt": "healthy", "max_tokens": 8, "stream": True}
    first: float | None = None
    async with httpx.AsyncClient(base_url=url, timeout=CALL_TIMEOUT) as client:  # made untimed: ~30 ms of TLS setup
        started = time.perf_counter()  # from here: a new connection, the request, the first token
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            done = False
            async for line in response.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - started
                done = done or line == "data: [DONE]"
    assert first is not None and done, "the healthy stream ended without a token or without [DONE]"
    return first


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _open(url: str, rcvbuf: int | None = None) -> anyio.abc.SocketStream:
    host, port = _address(url)
    stream = await anyio.connect_tcp(host, port)
    if rcvbuf is not None:
        stream.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return stream


def _whole_response(data: bytes) -> bool:
    """Whether ``data`` holds a whole HTTP response: its head and the body its Content-Length declares."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return value.strip().isdigit() and len(body) >= int(value.strip())
    return False  # no length: the response ends when the server closes


async def _answer(stream: anyio.abc.SocketStream, timeout: float = 10.0) -> bytes:
    """What the server sends back: one whole response, or all it sent before it closed (or the first 64 KiB); b""
    when it just closed. A whole response ends the wait: a server may keep the connection alive after a 4xx."""
    data = b""
    with anyio.move_on_after(timeout):
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
            while len(data) < 65536 and not _whole_response(data):
                data += await stream.receive()
    return data


async def _answers(streams: list[anyio.abc.SocketStream]) -> list[bytes]:
    """Every stream's answer, read at once (in the streams' order)."""
    answers = [b""] * len(streams)

    async def one(i: int) -> None:
        answers[i] = await _answer(streams[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(streams)):
            tg.start_soon(one, i)
    return answers


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"


async def abuse(url: str, kind: str, idle: int) -> dict[str, Any]:
    """Hold ``kind`` of abuse open while a healthy request is timed; the figures of that abuse."""
    streams: list[anyio.abc.SocketStream] = []
    answers: list[bytes] = []
    figures: dict[str, Any] = {"kind": kind}
    async with anyio.create_task_group() as tg:
        try:
            if kind == "slowloris":
                for _ in range(idle):
                    stream = await _open(url)
                    await stream.send(HEAD)
                    streams.append(stream)

                async def drip() -> None:
                    for i in range(60):
                        for stream in streams:
                            with contextlib.suppress(anyio.BrokenResourceError, OSError):
                                await stream.send(f"X-Drip-{i}: 1\r\n".encode())
                        await anyio.sleep(1)

                tg.start_soon(drip)
                figures["connections"] = idle
            elif kind == "half_bodies":
                for _ in range(50):
                    stream = await _open(url)
                    await stream.send(HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"prompt": ')
                    streams.append(stream)
                figures["connections"] = 50
            elif kind == "invalid_http":
                # the HTTP parser takes "HTTP/9.9" (its 4xx is the route's 404), so it names no route: "/" is one
                junk = [
                    b"\x00\xff\xfe GARBAGE \r\n\r\n",
                    b"GET /nowhere HTTP/9.9\r\n\r\n",
                    b"POST /v1/completions\r\n\r\n",
                ]
                for i in range(50):
                    stream = await _open(url)
                    await stream.send(junk[i % len(junk)] + os.urandom(64))
                    streams.append(stream)
                answers = await _answers(streams)
                figures["connections"] = 50
            elif kind == "oversized_headers":
                for _ in range(10):
                    stream = await _open(url)
                    with contextlib.suppress(anyio.BrokenResourceError, OSError):
                        await stream.send(HEAD + b"X-Huge: " + b"a" * (1 << 20) + b"\r\nContent-Length: 2\r\n\r\n{}")
                    streams.append(stream)
                answers = await _answers(streams)
                figures["requests"] = 10
            elif kind == "never_reading":
                body = json.dumps({"model": INSTANCE, "prompt": "never read", "max_tokens": 4000, "stream": True})
                for _ in range(8):
                    stream = await _open(url, rcvbuf=4096)
                    await stream.send(HEAD + f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
                    streams.append(stream)
                figures["streams"] = 8
            first = await healthy_first_token(url)
            figures["healthy_first_token_ms"] = round(first * 1000, 2)
            figures["within_bound"] = first <= FIRST_TOKEN_BOUND_S
            if answers:
                answered = [a for a in answers if a]
                statuses = Counter(a.split(b" ", 2)[1].decode(errors="replace") for a in answered if a[:5] == b"HTTP/")
                figures["answers"] = dict(statuses)
                figures["closed_without_answer"] = len(answers) - len(answered)
                figures["bad_answers"] = sum(1 for status in statuses.elements() if not status.startswith("4"))
        finally:
            tg.cancel_scope.cancel()
    for stream in streams:  # outside the cancelled scope, where closing can complete
        with contextlib.suppress(OSError, anyio.BrokenResourceError):
            await stream.aclose()
    return figures


async def transport(server: ServeChild, idle: int) -> list[dict[str, Any]]:
    results = []
    for kind in ("slowloris", "half_bodies", "invalid_http", "oversized_headers", "never_reading"):
        before = server.fds()
        figures = await abuse(server.url, kind, idle)
        with anyio.move_on_after(10):  # the server closes its ends as it notices: wait for the count, bounded
            while (server.fds() or 0) > (before or 0):
                await anyio.sleep(0.05)
        figures["fds_before"], figures["fds_after"] = before, server.fds()
        results.append(figures)
        print(f"  {kind:18} {json.dumps({k: v for k, v in figures.items() if k != 'kind'})}", flush=True)
    return results


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fuzz_server() -> Iterator[ServeChild]:
    with private_tether_dirs("tether-fuzz-"):
        server = ServeChild(*SERVE_ARGS)
        try:
            server.wait_for(rf"{INSTANCE} ready \(runner pid", 30)
            yield server
        finally:
            if server.proc.poll() is None:
                server.signal(15)
            try:
                server.proc.wait(15)
            except Exception:
                server.proc.kill()
                server.proc.wait()


def still_serving(server: ServeChild, pid: int) -> list[str]:
    """Why the server is not serving normally after the fuzzing (empty: it is)."""
    problems = []
    with httpx.Client(base_url=server.url, timeout=CALL_TIMEOUT) as http:
        ok = http.post("/v1/completions", json={"model": INSTANCE, "prompt": "after", "max_tokens": 4})
        if ok.status_code != 200:
            problems.append(f"a plain completion answered {ok.status_code}: {ok.text[:200]}")
        ready = http.get("/readyz")
        if ready.status_code != 200:
            problems.append(f"/readyz answered {ready.status_code}: {ready.text[:200]}")
    if server.pid != pid or server.proc.poll() is not None:
        problems.append("the worker is gone")
    lines = server.drain()
    tracebacks = [i for i, line in enumerate(lines) if "Traceback" in line]
    if tracebacks:
        first = "\n".join(lines[tracebacks[0] : tracebacks[0] + 30])
        problems.append(f"{len(tracebacks)} tracebacks on the worker's stderr; the first:\n{first}")
    return problems


def run(examples: int, seed: int, idle: int) -> dict[str, Any]:
    began = time.monotonic()
    with fuzz_server() as server:
        pid = server.pid
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        keep = {"id": INSTANCE, "engine": "debug", "options": {"n_ctx": 4096}}
        report = fuzz(schema, server.url, examples, seed, keep_instance=keep)
        fuzz_s = time.monotonic() - began
        print(
            f"schema fuzzing: {report.examples} examples over {report.operations} operations in {fuzz_s:.0f} s: "
            f"{report.unexpected_5xx} unexpected 5xx, {report.nonconforming} nonconforming, statuses "
            f"{dict(sorted(report.statuses.items()))}"
        )
        for failure in report.failures:
            print(f"  ! {failure}")
        headers = fuzz_headers(schema, server.url, examples, seed, keep_instance=keep)
        print(
            f"Host/Origin fuzzing: {headers.cases} cases {dict(headers.by_class)}: {headers.served_foreign} foreign "
            f"served, {headers.refused_loopback} loopback refused, {headers.nonconforming} nonconforming refusals"
        )
        for failure in headers.failures:
            print(f"  ! {failure}")
        print("transport abuse (healthy request's first token, answers, fds):")
        abuses = anyio.run(transport, server, idle)
        problems = still_serving(server, pid)
        idle_first = [anyio.run(healthy_first_token, server.url) for _ in range(5)]
    abused = [a["healthy_first_token_ms"] for a in abuses]
    return {
        "bench": "fuzz",
        "examples": report.examples,
        "examples_positive": report.by_mode["positive"],
        "examples_negative": report.by_mode["negative"],
        "operations": report.operations,
        "unexpected_5xx": report.unexpected_5xx,
        "documented_5xx": dict(report.documented_5xx),
        "nonconforming": report.nonconforming,
        "transport_errors": report.transport_errors,
        "statuses": {str(k): v for k, v in sorted(report.statuses.items())},
        "failures": report.failures,
        "header_cases": headers.cases,
        "header_cases_by_class": dict(headers.by_class),
        "header_served_foreign": headers.served_foreign,
        "header_refused_loopback": headers.refused_loopback,
        "header_nonconforming": headers.nonconforming,
        "header_failures": headers.failures,
        "seed": seed,
        "fuzz_s": round(fuzz_s, 1),
        "transport": abuses,
        "first_token_bound_ms": FIRST_TOKEN_BOUND_S * 1000,
        "healthy_first_token_max_ms": max(abused),
        "healthy_first_token_idle_p50_ms": ms(percentile(idle_first, 50) * 1000),
        "abuse_within_bound": all(a["within_bound"] for a in abuses),
        "abuse_bad_answers": sum(a.get("bad_answers", 0) for a in abuses),
        "leaked_fds": sum(max(0, (a["fds_after"] or 0) - (a["fds_before"] or 0)) for a in abuses),
        "serving_after": not problems,
        "problems": problems,
        "wall_s": round(time.monotonic() - began, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=200, help="cases per operation and mode (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle", type=int, default=1000, help="slowloris connections (default 1000)")
    parser.add_argument("--quick", action="store_true", help="10 cases per operation and mode, 200 idle connections")
    args = parser.parse_args(argv)
    examples, idle = (10, 200) if args.quick else (args.examples, args.idle)
    result = run(examples, args.seed, idle)
    result["quick"] = args.quick
    clean = (
        result["unexpected_5xx"] == 0
        and result["nonconforming"] == 0
        and result["transport_errors"] == 0
        and result["header_served_foreign"] == 0
        and result["header_refused_loopback"] == 0
        and result["header_nonconforming"] == 0
        and result["abuse_within_bound"]
        and result["abuse_bad_answers"] == 0
        and result["leaked_fds"] == 0
        and result["serving_after"]
    )
    result["clean"] = clean
    emit(result)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
