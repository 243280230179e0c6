"""Load benchmark: 64 and 256 concurrent streaming clients against a debug instance, 8 against the default model.

Debug load, two servers serving the same engine (``tether.engines.debug``, options ``ENGINE_OPTIONS``:
``token_seconds`` 0.001, so a 32-token answer takes ~32 ms of generation) one generation at a time, each admitting
at most ``MAX_QUEUE`` = 128 generations in flight (running + waiting) and answering ``503`` with ``Retry-After: 1``
above that; each started as a subprocess on 127.0.0.1, one at a time (the machine may have two cores):

- tether: ``python -m tether serve --port 0 --engine debug --name warm --stop-timeout 5`` (``ServeChild``), then
  ``POST /v1/instances`` ``{"id": "load", "engine": "debug", "options": ENGINE_OPTIONS, "max_queue": 128}``, ready
  when ``GET /v1/instances/load`` says so; the ``warm`` instance is then deleted (one runner, as the baseline has
  one engine). The runner is a child process behind tether's pipes and supervisor. Stopped with SIGTERM, the exit
  awaited (``STOP_TIMEOUT`` + 10 s, then SIGKILL: ``forced_kills``); then ``leftover_processes`` counts the runners
  still naming this worker (``ServeChild.runners()``, re-read for up to 5 s), which must be 0.
- baseline, what a user would write without tether: ``python bench/load.py --baseline-server PORT``, a FastAPI app
  on uvicorn (the same ASGI server as tether's, same defaults: h11, no access log) that builds the same engine in
  process (``create_engine(EngineSpec("debug", options=...))``, ``load``, ``warmup``, as the runner does) and
  drives it from one engine thread (engines are not thread-safe), fed by a FIFO job queue; each delta goes to the
  request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe`` (the engine never waits for the event loop), and
  the request streams it as SSE. Requests are decoded and chunks encoded with tether's own wire-format functions
  (``tether.serve.dialects.openai``), so both sides spend the same on JSON and what differs is tether's process
  boundary and supervision. Admission: the same ``max_queue`` counted the same way (admitted until the engine thread
  ends it), ``503`` + ``Retry-After: 1`` when full; a client that leaves cancels its generation (the engine checks the
  flag before every token). Ready when ``/readyz`` is 200; stopped with SIGTERM, SIGKILL after 15 s
  (``serve.stop_server``).

Requests: ``POST /v1/chat/completions``, ``stream: true``, ``stream_options: {"include_usage": true}``, ``model``
``load``, a fixed system message and ``serve.PROMPTS[k % 8]``, ``max_tokens`` 32 (``--quick``: 4),
``temperature: 0``. At concurrency ``C`` (64, then 256), ``C`` clients each send ``N = max(1, R // C)`` requests
back to back (a closed loop; ``R`` = ``--requests``, default 256: 4 per client at 64, 1 at 256, the same work at
both); at 256 half the clients find the queue full. A client whose attempt gets ``503`` waits the ``Retry-After``
seconds (at most 30; without the header, 0.1 s doubling to 2 s, and ``rejected_without_retry_after`` counts it)
and sends the request again, until it ends otherwise or ``REQUEST_BOUND`` (120 s, the whole request) passes. One
``httpx.AsyncClient`` per load phase (``C`` + 8 connections), all clients in one anyio task group; each server
gets one untimed 4-token warm-up request first. The clients reuse a keep-alive connection only while it has been
idle under 2 s (``keepalive_expiry``; httpx's default, 5 s, equals uvicorn's default keep-alive timeout, which the
baseline keeps, so a request sent on a connection idle ~5 s can meet the server's close and fail with a transport
error; this benchmark found that race, and tether now keeps idle connections 30 s). An attempt ends:

- *complete*: ``data: [DONE]``; its tokens = ``usage.completion_tokens`` (else the content chunks);
- *failed*: an ``error`` object in the stream, or a non-200 status other than 503 (``code`` kept);
- *lost*: a stream that ends with neither, a transport error, or a request not over within ``REQUEST_BOUND``.

Figures per (round, side, C), stamped with ``time.perf_counter()``: aggregate tokens/s = the completed requests'
tokens / the phase's wall time (first request sent -> last one ended); TTFT = send -> first SSE chunk whose
``choices[0].delta.content`` is non-empty, and e2e = send -> ``[DONE]``, each both for the attempt that completed
(``ttft``, ``e2e``: what the server's queue costs) and for the whole request from its first send, retries and
Retry-After waits included (``request_ttft``, ``request_e2e``: what a user sees); p50, p90, p99 of each
(``statistics.quantiles(n=100, method="inclusive")``, ``benchstats.percentile``). At C=256 the first attempt of
half the requests is refused, so ``request_*`` there measures the 503 + Retry-After protocol as much as the server.

Default model (``tether.models.default_model_path()``, SmolLM2-135M-Instruct), 8 concurrent clients: ``tether serve
--n-ctx 2048 --threads 2 --parallel 8`` (all 8 in one batch) against ``python -m llama_cpp.server`` on the same GGUF,
both started, stopped and read exactly as in ``bench/serve.py`` (its ``running`` and ``stream_one``: greedy, ``seed`` 0,
its stories, ``repeat_penalty`` 1.0 on the baseline), one 4-token warm-up request each, then 8 clients x 2 requests of
``max_tokens`` 64 (``--quick``: x 1 of 4 tokens, both servers on 1 thread); tokens/s, TTFT and e2e p50/p99 as above
(``model_c8_*``); a request error (``serve.stream_one``'s definition) counts in ``model_errors``. Without the default
model or llama-cpp-python this part is null and ``model_skipped`` says why.

Rounds: ``--rounds`` (default 3; ``--quick``: 1). Each round runs both servers of the debug load, one after the
other (start, warm up, C=64, C=256, stop), then both model servers, the order alternating (round 0: baseline
first), so a slow stretch of a noisy machine falls on both sides. Each side's figure is the median over the rounds
of its per-round figures; ``*_ratio`` = tether / baseline of those medians (``tokens_per_s_ratio`` above 1: tether
is faster; ``ttft_p50_ratio``, ``ttft_p99_ratio`` of the whole-request TTFT and ``e2e_p99_ratio`` of its e2e,
below 1: tether answers sooner).
Counts (``lost_requests``, ``rejected_503``, ``rejected_without_retry_after``, ``failed_requests``) are tether's,
summed over every round and concurrency (``baseline_*``: the baseline's); ``ok`` (exit 0) = no tether request lost,
failed or refused without ``Retry-After``, every one completed, no leftover runner, no model-part error.

``--quick`` (for CI): 1 round, ``R`` = 64 (one request per client at both concurrencies), ``max_tokens`` 4; model
8 clients x 1 request of 4 tokens on 1 thread (``"quick": true``); its figures are only a smoke test.

Runner records and logs go to a private ``TETHER_RUNTIME_DIR`` / ``TETHER_LOG_DIR`` (removed at the end). A server
that does not start is an error: null figures, ``error`` says why, exit 1.

Run: ``.venv/bin/python bench/load.py [--quick] [--rounds N] [--requests R]``. The last line printed is one JSON
object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from starlette.requests import Request as HttpRequest  # module level: FastAPI resolves handler annotations here

from benchstats import (
    PERCENTILE,
    closed_loop,
    emit,
    fmt,
    llama_unavailable,
    ms,
    percentile,
    print_rows,
    private_tether_dirs,
)
from serve import (
    PROMPTS,
    QUICK_THREADS,
    THREADS,
    Server,
    ServerFailed,
    Setup,
    chat_body,
    free_port,
    running,
    stop_server,
    stream_one,
    wait_ready,
)
from tether.chaos.target import ServeChild
from tether.models import default_model_path

SIDES = ("baseline", "tether")
CONCURRENCY = (64, 256)
MAX_QUEUE = 128
INSTANCE = "load"
ENGINE_OPTIONS = {"token_seconds": 0.001, "load_steps": 1, "load_step_seconds": 0.0}
MAX_TOKENS = 32
QUICK_MAX_TOKENS = 4  # --quick: the engine's 1 ms a token is most of a phase's wall time
REQUESTS = 256
QUICK_REQUESTS = 64
WARMUP_TOKENS = 4
REQUEST_BOUND = 120.0  # seconds a whole request may take, retries included
MAX_RETRY_AFTER = 30.0  # a Retry-After above this is honoured as this (the whole request stays bounded)
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 5.0  # tether serve --stop-timeout
GONE_BOUND = 5.0  # seconds for a stopped server's runners to be gone
POLL = 0.02
KEEPALIVE_EXPIRY = 2.0  # client side; below uvicorn's 5 s keep-alive timeout (httpx's default, 5 s, races it)
MODEL_CLIENTS = 8
MODEL_PER_CLIENT = 2
MODEL_MAX_TOKENS = 64
QUICK_MODEL_PER_CLIENT = 1
QUICK_MODEL_MAX_TOKENS = 4
PCTS = (50, 90, 99)
METRICS = ("ttft", "e2e", "request_ttft", "request_e2e")


# --------------------------------------------------------------------------------------------------------------
# One attempt, as a client sees it (shared with bench/soak.py)
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Attempt:
    """One HTTP request and how it ended."""

    kind: str  # complete | failed | cancelled | rejected (503) | lost | disconnected (left on purpose) | hung
    sent: float  # perf_counter() just before the request was sent
    ended: float
    status: int | None = None
    code: str | None = None  # the error's code (a failure's cause kind, "cancelled", "unavailable", ...)
    retry_after: float | None = None  # seconds, from a 503's Retry-After header (None: absent or unreadable)
    ttft: float | None = None  # seconds from sent to the first non-empty content chunk
    tokens: int = 0
    request_id: str | None = None
    detail: str = ""

    @property
    def e2e(self) -> float:
        return self.ended - self.sent


def _retry_after(headers: httpx.Headers) -> float | None:
    try:
        value = float(headers["retry-after"])
    except (KeyError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _refused(status: int, body: bytes, headers: httpx.Headers, sent: float) -> Attempt:
    now = time.perf_counter()
    try:
        error = json.loads(body)["error"]
        code, message = error.get("code"), str(error.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        code, message = None, body[:200].decode(errors="replace")
    if status == 503:
        return Attempt("rejected", sent, now, status, code, _retry_after(headers), detail=message)
    kind = "cancelled" if status == 409 and code == "cancelled" else "failed"
    return Attempt(kind, sent, now, status, code, detail=message)


async def attempt(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    *,
    on_start: Callable[[str], Awaitable[None] | None] | None = None,
    disconnect: bool = False,
) -> Attempt:
    """Send one streaming chat completion and read it to its end. ``on_start(request_id)`` is called once the
    stream has begun (a 200 with its ``X-Request-Id``); ``disconnect`` leaves after the first content chunk. The
    caller bounds the time (a request that outlives it is the caller's to classify)."""
    got = Attempt("lost", time.perf_counter(), 0.0, detail="the stream ended with neither [DONE] nor an error event")
    chunks = 0
    usage: int | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return _refused(response.status_code, await response.aread(), response.headers, got.sent)
            got.status = 200
            got.request_id = response.headers.get("x-request-id")
            if on_start is not None and got.request_id is not None:
                started = on_start(got.request_id)
                if started is not None:
                    await started
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    got.kind, got.detail = "complete", ""
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"] or {}
                    got.code = error.get("code")
                    got.kind = "cancelled" if got.code == "cancelled" else "failed"
                    got.detail = str(error.get("message", ""))
                    break
                if event.get("usage") and event["usage"].get("completion_tokens") is not None:
                    usage = int(event["usage"]["completion_tokens"])
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if got.ttft is None:
                            got.ttft = time.perf_counter() - got.sent
                if disconnect and got.ttft is not None:
                    got.kind, got.detail = "disconnected", ""
                    break  # leaving the block closes the connection
    except httpx.TransportError as exc:
        got.kind, got.detail = "lost", f"transport: {type(exc).__name__}: {exc}"
    except json.JSONDecodeError as exc:
        got.kind, got.detail = "lost", f"not JSON in the stream: {exc}"
    got.ended = time.perf_counter()
    got.tokens = usage if got.kind == "complete" and usage is not None else chunks
    return got


def pool(connections: int) -> httpx.Limits:
    """A client's connection pool: ``connections`` at most, none reused once idle for ``KEEPALIVE_EXPIRY`` s."""
    return httpx.Limits(
        max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=KEEPALIVE_EXPIRY
    )


def backoff(rejections: int) -> float:
    """The wait after a 503 without Retry-After: 0.1 s, doubling, at most 2 s."""
    return min(0.1 * 2 ** (rejections - 1), 2.0)


def retry_delay(rejected: Attempt, rejections: int) -> float:
    if rejected.retry_after is not None:
        return min(rejected.retry_after, MAX_RETRY_AFTER)
    return backoff(rejections)


# --------------------------------------------------------------------------------------------------------------
# Servers of the debug load (tether's is shared with bench/soak.py)
# --------------------------------------------------------------------------------------------------------------


class DebugServer(ServeChild):
    """``tether serve --engine debug`` with one instance of the given config (its ``warm`` first instance deleted)
    and a bounded stop that counts the runners left (``leftover``) and whether SIGKILL was needed (``forced``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(  # a child that never listens is killed
            "--engine", "debug", "--name", "warm", "--stop-timeout", str(STOP_TIMEOUT), startup=READY_TIMEOUT
        )
        self.leftover = 0
        self.forced = False
        self.instance_id = str(config["id"])
        try:
            self.wait_for(r"warm ready \(runner pid", READY_TIMEOUT)
            with httpx.Client(base_url=self.url, timeout=10.0) as http:
                created = http.post("/v1/instances", json=config)
                if created.status_code != 201:
                    raise ServerFailed(f"tether refused the instance: {created.status_code} {created.text[:300]}")
                deadline = time.monotonic() + READY_TIMEOUT
                while not http.get(f"/v1/instances/{self.instance_id}").json().get("ready"):
                    if time.monotonic() > deadline:
                        raise ServerFailed(f"instance {self.instance_id} not ready after {READY_TIMEOUT:.0f} s")
                    time.sleep(POLL)
                http.delete("/v1/instances/warm")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.forced, self.leftover = self.stop_and_sweep(STOP_TIMEOUT, GONE_BOUND, POLL)


def load_instance_config(options: dict[str, Any]) -> dict[str, Any]:
    return {"id": INSTANCE, "engine": "debug", "options": options, "max_queue": MAX_QUEUE}


@contextlib.contextmanager
def debug_side(side: str, logdir: Path) -> Iterator[tuple[str, DebugServer | Server]]:
    """The debug load's server of one side: yields (base URL, a holder whose ``leftover``/``forced`` are set after
    the stop)."""
    if side == "tether":
        server = DebugServer(load_instance_config(ENGINE_OPTIONS))
        try:
            yield server.url, server
        finally:
            server.stop()
        return
    port = free_port()
    log = logdir / f"debug-baseline-{port}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--baseline-server", str(port)]
    cmd += ["--options", json.dumps(ENGINE_OPTIONS), "--max-queue", str(MAX_QUEUE)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    baseline = Server("baseline", proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_ready(baseline, "/readyz")
        yield baseline.base_url, baseline
    finally:
        if proc.poll() is None:
            baseline.leftover, baseline.forced = stop_server(baseline)


def baseline_server(port: int, options: dict[str, Any], max_queue: int) -> None:
    """The baseline of the debug load (see the module docstring): the engine in process, one engine thread."""
    import asyncio
    import queue
    import threading
    import uuid

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import Response, StreamingResponse

    from tether.engines.base import Delta
    from tether.engines.registry import create_engine
    from tether.errors import InvalidField
    from tether.protocol import EngineSpec, GenerateParams
    from tether.serve.dialects import openai as wire
    from tether.serve.statuses import Answer

    engine = create_engine(EngineSpec(engine="debug", options=options))
    engine.load(lambda fraction, detail: None)
    engine.warmup()
    end = object()

    @dataclass
    class Job:
        params: GenerateParams
        loop: asyncio.AbstractEventLoop
        events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
        cancel: threading.Event = field(default_factory=threading.Event)

    jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
    in_flight = [0]  # changed on the event loop only

    def finished(job: Job, outcome: object) -> None:
        in_flight[0] -= 1
        job.events.put_nowait(outcome)

    def engine_loop() -> None:
        while True:
            job = jobs.get()
            outcome: object = end
            try:
                for delta in engine.generate(job.params, job.cancel.is_set):
                    job.loop.call_soon_threadsafe(job.events.put_nowait, delta)
            except Exception as exc:
                outcome = exc
            job.loop.call_soon_threadsafe(finished, job, outcome)

    threading.Thread(target=engine_loop, name="engine", daemon=True).start()
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    request_path = "/v1/chat/completions"  # the only route it errs on: OpenAI's shape

    def error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return Answer(status, kind, code, message).response(request_path, headers)

    async def stream(job: Job, shaper: wire.OpenAIShaper, include_usage: bool) -> Any:
        first, finish, prompt_tokens, completion_tokens = True, None, 0, 0
        try:
            while True:
                item = await job.events.get()
                if item is end:
                    break
                if isinstance(item, BaseException):
                    failed = Answer(500, "server_error", "engine_error", f"{type(item).__name__}: {item}")
                    yield shaper.stream_error(failed)
                    return
                delta: Delta = item
                if delta.finish_reason is not None:
                    finish, prompt_tokens, completion_tokens = (
                        delta.finish_reason,
                        delta.prompt_tokens,
                        delta.completion_tokens,
                    )
                if first or delta.text:
                    yield shaper.chunk(delta.text, None, first=first)
                    first = False
            yield shaper.chunk("", "length" if finish == "length" else "stop")
            if include_usage:
                yield shaper.usage_chunk(prompt_tokens, completion_tokens)
            yield wire.DONE
        finally:
            job.cancel.set()  # a client that left stops its generation (a no-op once it ended)

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest) -> Response:
        try:
            body = wire.decode("chat", await request.body())
            assert isinstance(body, wire.ChatRequest)
            params = wire.chat_plan(body).params
        except InvalidField as exc:
            return error(400, str(exc), "invalid_request")
        if not body.stream:
            return error(400, "this baseline serves streams only", "invalid_request")
        if in_flight[0] >= max_queue:
            return error(503, f"busy: {in_flight[0]} requests in flight", "unavailable", {"Retry-After": "1"})
        in_flight[0] += 1
        job = Job(params, asyncio.get_running_loop())
        jobs.put(job)
        request_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        shaper = wire.OpenAIShaper("chat", request_id, INSTANCE)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        headers = {"X-Request-Id": request_id, "Cache-Control": "no-cache"}
        return StreamingResponse(stream(job, shaper, include_usage), media_type="text/event-stream", headers=headers)

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(
            json.dumps({"object": "list", "data": [{"id": INSTANCE, "object": "model"}]}), media_type="application/json"
        )

    @app.get("/readyz")
    async def readyz() -> Response:
        return Response(json.dumps({"ready": True}), media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=port, lifespan="off", access_log=False, log_level="warning")


# --------------------------------------------------------------------------------------------------------------
# Debug load
# --------------------------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """One request: its attempts (every 503 retried after its Retry-After), from the first send to its end."""

    began: float
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def outcome(self) -> str:
        return self.final.kind

    def figure(self, metric: str) -> float | None:
        """Seconds: ``ttft``/``e2e`` of the completed attempt, ``request_*`` from the request's first send."""
        last = self.final
        if last.kind != "complete" or last.ttft is None:
            return None
        offset = last.sent - self.began if metric.startswith("request_") else 0.0
        base = last.ttft if metric.endswith("ttft") else last.e2e
        return offset + base


async def request_with_retries(client: httpx.AsyncClient, body: dict[str, Any]) -> RequestResult:
    result = RequestResult(time.perf_counter())
    try:
        with anyio.fail_after(REQUEST_BOUND):
            rejections = 0
            while True:
                result.attempts.append(tried := await attempt(client, body))
                if tried.kind != "rejected":
                    return result
                rejections += 1
                await anyio.sleep(retry_delay(tried, rejections))
    except TimeoutError:
        now = time.perf_counter()
        result.attempts.append(Attempt("lost", now, now, detail=f"not over within {REQUEST_BOUND:g} s"))
    return result


@dataclass
class Phase:
    """C clients x N requests against one server."""

    side: str
    round: int
    concurrency: int
    requests: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.requests if r.outcome == outcome)

    @property
    def attempts(self) -> int:
        return sum(len(r.attempts) for r in self.requests)

    @property
    def rejected(self) -> int:
        return sum(1 for r in self.requests for a in r.attempts if a.kind == "rejected")

    @property
    def without_retry_after(self) -> int:
        return sum(1 for r in self.requests for a in r.attempts if a.kind == "rejected" and a.retry_after is None)

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(r.final.tokens for r in self.requests if r.outcome == "complete")
        return tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def pct(self, metric: str, p: int) -> float:
        """The ``p``-th percentile of ``metric`` over the completed requests, in ms."""
        values = [v * 1000.0 for r in self.requests if (v := r.figure(metric)) is not None]
        return percentile(values, p)


async def run_phase(url: str, side: str, rnd: int, concurrency: int, per_client: int, max_tokens: int) -> Phase:
    phase = Phase(side, rnd, concurrency)
    limits = pool(concurrency + 8)
    timeout = httpx.Timeout(REQUEST_BOUND, connect=30.0)

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def send(i: int, j: int) -> None:
            body = chat_body(PROMPTS[(i * per_client + j) % len(PROMPTS)], max_tokens, INSTANCE)
            phase.requests.append(await request_with_retries(client, body))

        phase.wall_s = await closed_loop(concurrency, per_client, send)
    return phase


@dataclass
class SideRun:
    side: str
    round: int
    phases: dict[int, Phase]
    leftover: int = 0
    forced: bool = False
    warmup: str = "complete"


async def run_debug_side(side: str, rnd: int, logdir: Path, args: argparse.Namespace) -> SideRun:
    phases: dict[int, Phase] = {}
    with contextlib.ExitStack() as stack:
        url, holder = await anyio.to_thread.run_sync(lambda: stack.enter_context(debug_side(side, logdir)))
        async with httpx.AsyncClient(base_url=url, timeout=REQUEST_BOUND, limits=pool(2)) as client:
            warm = await attempt(client, chat_body(PROMPTS[0], WARMUP_TOKENS, INSTANCE))
        for c in CONCURRENCY:
            phases[c] = await run_phase(url, side, rnd, c, per_client(args.requests, c), args.max_tokens)
        await anyio.to_thread.run_sync(stack.close)
    return SideRun(side, rnd, phases, holder.leftover, holder.forced, warm.kind)


def per_client(requests: int, concurrency: int) -> int:
    return max(1, requests // concurrency)


# --------------------------------------------------------------------------------------------------------------
# Default model, 8 clients
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ModelRequest:
    ttft_ms: float | None
    e2e_ms: float
    tokens: int
    error: str | None


@dataclass
class ModelRun:
    side: str
    round: int
    requests: list[ModelRequest]
    wall_s: float
    leftover: int = 0
    forced: bool = False
    warmup_error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(r.tokens for r in self.requests if r.error is None)
        return tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def pct(self, metric: str, p: int) -> float:
        values = [v for r in self.requests if r.error is None and (v := getattr(r, f"{metric}_ms")) is not None]
        return percentile(values, p)

    @property
    def errors(self) -> int:
        return sum(1 for r in self.requests if r.error is not None) + (1 if self.warmup_error else 0)


async def run_model_side(side: str, rnd: int, model: Path, logdir: Path, args: argparse.Namespace) -> ModelRun:
    requests: list[ModelRequest] = []
    n = args.model_per_client
    with contextlib.ExitStack() as stack:
        setup = Setup(model=model, llama_server=None, threads=QUICK_THREADS if args.quick else THREADS)
        server = await anyio.to_thread.run_sync(lambda: stack.enter_context(running(side, setup, logdir)))
        limits = pool(MODEL_CLIENTS + 2)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_BOUND, limits=limits) as client:
            warm = await stream_one(client, server, 0, WARMUP_TOKENS)

            async def send(i: int, j: int) -> None:
                began = time.perf_counter()
                req = await stream_one(client, server, (i * n + j) % len(PROMPTS), args.model_max_tokens)
                e2e = (time.perf_counter() - began) * 1000.0
                ttft = req.ttft * 1000.0 if req.ttft is not None else None
                requests.append(ModelRequest(ttft, e2e, req.tokens, req.error))

            wall = await closed_loop(MODEL_CLIENTS, n, send)
        await anyio.to_thread.run_sync(stack.close)
    return ModelRun(side, rnd, requests, wall, server.leftover, server.forced, warm.error)


# --------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if v == v]
    return statistics.median(clean) if clean else float("nan")


def ratio(a: float, b: float) -> float | None:
    return None if a != a or b != b or b == 0 else round(a / b, 3)


def rounded(value: float, digits: int = 1) -> float | None:
    return None if value != value else round(value, digits)


def debug_figures(runs: Sequence[SideRun], result: dict[str, Any]) -> None:
    by_side = {side: [r for r in runs if r.side == side] for side in SIDES}
    for c in CONCURRENCY:
        medians: dict[str, dict[str, float]] = {}
        for side in SIDES:
            phases = [r.phases[c] for r in by_side[side]]
            fig = {"tokens_per_s": median([p.tokens_per_s for p in phases])}
            for metric in METRICS:
                for p in PCTS:
                    fig[f"{metric}_p{p}_ms"] = median([ph.pct(metric, p) for ph in phases])
            medians[side] = fig
            result[f"c{c}_{side}_tokens_per_s"] = rounded(fig["tokens_per_s"])
            for name, value in fig.items():
                if name.endswith("_ms"):
                    result[f"c{c}_{side}_{name}"] = ms(value)
            for name, counted in (
                ("requests", lambda ph: len(ph.requests)),
                ("completed", lambda ph: ph.count("complete")),
                ("attempts", lambda ph: ph.attempts),
                ("rejected_503", lambda ph: ph.rejected),
                ("rejected_without_retry_after", lambda ph: ph.without_retry_after),
                ("lost", lambda ph: ph.count("lost")),
                ("failed", lambda ph: ph.count("failed") + ph.count("cancelled")),
            ):
                result[f"c{c}_{side}_{name}"] = sum(counted(ph) for ph in phases)
        t, b = medians["tether"], medians["baseline"]
        result[f"c{c}_tokens_per_s_ratio"] = ratio(t["tokens_per_s"], b["tokens_per_s"])
        result[f"c{c}_ttft_p50_ratio"] = ratio(t["request_ttft_p50_ms"], b["request_ttft_p50_ms"])
        result[f"c{c}_ttft_p99_ratio"] = ratio(t["request_ttft_p99_ms"], b["request_ttft_p99_ms"])
        result[f"c{c}_e2e_p99_ratio"] = ratio(t["request_e2e_p99_ms"], b["request_e2e_p99_ms"])
    for side, prefix in (("tether", ""), ("baseline", "baseline_")):
        phases = [ph for r in by_side[side] for ph in r.phases.values()]
        result[f"{prefix}lost_requests"] = sum(ph.count("lost") for ph in phases)
        result[f"{prefix}rejected_503"] = sum(ph.rejected for ph in phases)
        result[f"{prefix}rejected_without_retry_after"] = sum(ph.without_retry_after for ph in phases)
        result[f"{prefix}failed_requests"] = sum(ph.count("failed") + ph.count("cancelled") for ph in phases)
        result[f"{prefix}requests"] = sum(len(ph.requests) for ph in phases)
        result[f"{prefix}completed"] = sum(ph.count("complete") for ph in phases)
    result["leftover_processes"] = sum(r.leftover for r in by_side["tether"])
    result["forced_kills"] = sum(1 for r in runs if r.forced)
    result["warmup_failures"] = sum(1 for r in by_side["tether"] if r.warmup != "complete")
    result["baseline_warmup_failures"] = sum(1 for r in by_side["baseline"] if r.warmup != "complete")


def model_figures(runs: Sequence[ModelRun], result: dict[str, Any]) -> None:
    by_side = {side: [r for r in runs if r.side == side] for side in SIDES}
    medians: dict[str, dict[str, float]] = {}
    for side in SIDES:
        fig = {"tokens_per_s": median([r.tokens_per_s for r in by_side[side]])}
        for metric in ("ttft", "e2e"):
            for p in (50, 99):
                fig[f"{metric}_p{p}_ms"] = median([r.pct(metric, p) for r in by_side[side]])
        medians[side] = fig
        result[f"model_c8_{side}_tokens_per_s"] = rounded(fig["tokens_per_s"])
        for name, value in fig.items():
            if name.endswith("_ms"):
                result[f"model_c8_{side}_{name}"] = ms(value)
    t, b = medians["tether"], medians["baseline"]
    result["model_c8_tokens_per_s_ratio"] = ratio(t["tokens_per_s"], b["tokens_per_s"])
    result["model_c8_ttft_p50_ratio"] = ratio(t["ttft_p50_ms"], b["ttft_p50_ms"])
    result["model_c8_ttft_p99_ratio"] = ratio(t["ttft_p99_ms"], b["ttft_p99_ms"])
    result["model_errors"] = sum(r.errors for r in by_side["tether"])
    result["model_baseline_errors"] = sum(r.errors for r in by_side["baseline"])
    result["model_leftover_processes"] = sum(r.leftover for r in by_side["tether"])
    result["model_requests_per_side"] = sum(len(r.requests) for r in by_side["tether"])


def print_debug_table(runs: Sequence[SideRun]) -> None:
    headers = ("round", "side", "C", "reqs", "done", "tries", "503", "no RA", "lost", "failed", "tok/s")
    headers += ("TTFT p50", "p99", "req TTFT p50", "p99", "req e2e p50", "p99", "wall s")
    rows = []
    for run in runs:
        for c, ph in run.phases.items():
            rows.append(
                (
                    str(run.round),
                    run.side,
                    str(c),
                    str(len(ph.requests)),
                    str(ph.count("complete")),
                    str(ph.attempts),
                    str(ph.rejected),
                    str(ph.without_retry_after),
                    str(ph.count("lost")),
                    str(ph.count("failed") + ph.count("cancelled")),
                    fmt(ph.tokens_per_s),
                    fmt(ph.pct("ttft", 50)),
                    fmt(ph.pct("ttft", 99)),
                    fmt(ph.pct("request_ttft", 50)),
                    fmt(ph.pct("request_ttft", 99)),
                    fmt(ph.pct("request_e2e", 50)),
                    fmt(ph.pct("request_e2e", 99)),
                    fmt(ph.wall_s),
                )
            )
    print_rows(headers, rows, left=2)


def print_model_table(runs: Sequence[ModelRun]) -> None:
    headers = ("round", "side", "reqs", "errors", "tok/s", "TTFT p50", "p99", "e2e p50", "p99", "wall s")
    rows = [
        (
            str(r.round),
            r.side,
            str(len(r.requests)),
            str(r.errors),
            fmt(r.tokens_per_s),
            fmt(r.pct("ttft", 50)),
            fmt(r.pct("ttft", 99)),
            fmt(r.pct("e2e", 50)),
            fmt(r.pct("e2e", 99)),
            fmt(r.wall_s),
        )
        for r in runs
    ]
    print_rows(headers, rows, left=2)


def problems(result: dict[str, Any], runs: Sequence[SideRun], model_runs: Sequence[ModelRun]) -> list[str]:
    """Every broken promise of tether's side, in words (empty: all is well)."""
    found = []
    for key in (
        "lost_requests",
        "rejected_without_retry_after",
        "failed_requests",
        "leftover_processes",
        "warmup_failures",
    ):
        if result.get(key):
            found.append(f"{key}: {result[key]}")
    if result.get("completed") != result.get("requests"):
        found.append(f"completed {result.get('completed')} of {result.get('requests')} requests")
    for key in ("model_errors", "model_leftover_processes"):
        if result.get(key):
            found.append(f"{key}: {result[key]}")
    for run in model_runs:
        found += [f"  model round {run.round} {run.side}: {r.error}" for r in run.requests if r.error is not None]
        if run.warmup_error:
            found.append(f"  model round {run.round} {run.side} warm-up: {run.warmup_error}")
    return found + unfinished(runs, "tether")


def timeline(req: RequestResult) -> str:
    """Each attempt of a request: its outcome, when it was sent and when it ended, from the first send (s)."""
    return ", ".join(
        f"{a.kind} {a.status or ''} sent {a.sent - req.began:.3f} ended {a.ended - req.began:.3f}" for a in req.attempts
    )


def unfinished(runs: Sequence[SideRun], side: str) -> list[str]:
    """Each request of ``side`` that did not complete, in words (at most 20)."""
    found = []
    for run in runs:
        if run.side != side:
            continue
        for ph in run.phases.values():
            for req in ph.requests:
                if req.outcome != "complete":
                    last = req.final
                    found.append(
                        f"  {side} round {run.round} C={ph.concurrency}: {last.kind} {last.status} {last.code}: "
                        f"{last.detail[:160]} ({last.tokens} tokens; attempts: {timeline(req)})"
                    )
    return found[:20]


def null_result(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "load", "quick": bool(args.quick), "ok": False, "error": None}
    result.update({"lost_requests": None, "rejected_503": None, "rejected_without_retry_after": None})
    result.update({"model_skipped": None, "percentile": PERCENTILE})
    result.update(extra)
    return result


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    debug_runs: list[SideRun] = []
    model_runs: list[ModelRun] = []
    skipped = llama_unavailable()
    with tempfile.TemporaryDirectory(prefix="tether-bench-load-") as tmp:
        for rnd in range(args.rounds):
            order = SIDES if rnd % 2 == 0 else SIDES[::-1]
            for side in order:
                debug_runs.append(await run_debug_side(side, rnd, Path(tmp), args))
            if skipped is None:
                model = default_model_path()
                for side in order:
                    model_runs.append(await run_model_side(side, rnd, model, Path(tmp), args))
    wall_s = time.monotonic() - began

    result = null_result(args, model_skipped=skipped)
    debug_figures(debug_runs, result)
    if model_runs:
        model_figures(model_runs, result)
    print(
        f"load: tether serve vs an in-process FastAPI server, debug engine (token_seconds "
        f"{ENGINE_OPTIONS['token_seconds']:g}, max_tokens {args.max_tokens}, max_queue {MAX_QUEUE}), concurrency "
        f"{list(CONCURRENCY)}, {args.requests} requests per concurrency, {args.rounds} round(s) "
        f"({wall_s:.1f} s){' (quick)' if args.quick else ''}; latencies in ms"
    )
    print_debug_table(debug_runs)
    if model_runs:
        print(
            f"default model, {MODEL_CLIENTS} clients x {args.model_per_client} requests, max_tokens "
            f"{args.model_max_tokens}: tether serve vs llama_cpp.server"
        )
        print_model_table(model_runs)
    else:
        print(f"default model part skipped: {skipped}")
    for c in CONCURRENCY:
        print(
            f"C={c}: tokens/s tether/baseline {result[f'c{c}_tokens_per_s_ratio']}, request TTFT p50 "
            f"{result[f'c{c}_ttft_p50_ratio']}, p99 {result[f'c{c}_ttft_p99_ratio']} (tether/baseline)"
        )
    if model_runs:
        print(
            f"model C=8: tokens/s tether/baseline {result['model_c8_tokens_per_s_ratio']}, TTFT p50 "
            f"{result['model_c8_ttft_p50_ratio']}, p99 {result['model_c8_ttft_p99_ratio']}"
        )
    found = problems(result, debug_runs, [r for r in model_runs if r.side == "tether"])
    result.update(
        {
            "ok": not found,
            "queue_filled": bool(result["c256_tether_rejected_503"]),
            "concurrency": list(CONCURRENCY),
            "max_queue": MAX_QUEUE,
            "requests_per_concurrency": args.requests,
            "requests_per_client": {str(c): per_client(args.requests, c) for c in CONCURRENCY},
            "max_tokens": args.max_tokens,
            "token_seconds": ENGINE_OPTIONS["token_seconds"],
            "model_clients": MODEL_CLIENTS,
            "model_requests_per_client": args.model_per_client,
            "model_max_tokens": args.model_max_tokens,
            "rounds": args.rounds,
            "wall_s": round(wall_s, 1),
        }
    )
    print(
        f"tether: {result['requests']} requests, {result['completed']} completed, {result['rejected_503']} answers "
        f"503 ({result['rejected_without_retry_after']} without Retry-After), {result['lost_requests']} lost, "
        f"{result['failed_requests']} failed; baseline: {result['baseline_lost_requests']} lost, "
        f"{result['baseline_failed_requests']} failed"
    )
    if found:
        print("FAILURE:\n" + "\n".join(found))
    if baseline := unfinished(debug_runs, "baseline"):
        print("baseline requests that did not complete:\n" + "\n".join(baseline))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both sides (default 3)")
    parser.add_argument(
        "--requests", type=int, default=REQUESTS, help=f"R per concurrency, R // C per client (default {REQUESTS})"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help=f"debug load, per request (default {MAX_TOKENS})"
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 round, R=64, 4 tokens; model 8 x 1 x 4 tokens, 1 thread (CI)"
    )
    parser.add_argument("--baseline-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--options", default=json.dumps(ENGINE_OPTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--max-queue", type=int, default=MAX_QUEUE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline_server is not None:
        baseline_server(args.baseline_server, json.loads(args.options), args.max_queue)
        return 0
    args.model_per_client, args.model_max_tokens = MODEL_PER_CLIENT, MODEL_MAX_TOKENS
    if args.quick:
        args.rounds, args.requests, args.max_tokens = 1, QUICK_REQUESTS, QUICK_MAX_TOKENS
        args.model_per_client, args.model_max_tokens = QUICK_MODEL_PER_CLIENT, QUICK_MODEL_MAX_TOKENS
    if args.rounds < 1 or args.requests < 1 or args.max_tokens < 1:
        parser.error("--rounds, --requests and --max-tokens must be at least 1")
    with private_tether_dirs("tether-bench-load-"):
        try:
            result = anyio.run(bench, args)
        except (ServerFailed, AssertionError) as exc:
            tail = getattr(exc, "tail", "")
            print(f"FAILURE: {exc}" + (f"; its log ends with:\n{tail}" if tail else ""))
            emit(null_result(args, error=str(exc).splitlines()[0][:500]))
            return 1
    emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
