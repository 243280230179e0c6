"""Resume benchmark: what a runner's death costs a stream (promise 10, docs/resume.md).

Each case, side by side in one run, on one ``tether serve`` child per case group (``.venv/bin/tether serve --port 0
--engine debug --name idle --max-queue 512 --stop-timeout 5`` on 127.0.0.1, its ``idle`` instance deleted once
ready; private ``TETHER_RUNTIME_DIR`` / ``TETHER_LOG_DIR``, removed at the end). Each side gets an instance of its
own, added with ``POST /v1/instances`` ``{"id", "engine", "options", "max_queue": 512, "resume", "restart"}``,
ready when ``GET /v1/instances/{id}`` says so, and deleted after the side:

- **solo** (the same engine and options): every stream's request asked alone, one after the other, non-streamed
  (its *solo* text; its ``usage.prompt_tokens`` is the case's ``prompt_tokens``, the median over the streams), on an
  instance of its own deleted before the sides run: asked on tether's own instance, each answer would wait in its
  store of saved prompts, and the resume would restore it instead of reading the stream again.
- **tether** (``"resume": true``, the default restart policy): N concurrent streaming chats (``POST
  /v1/chat/completions``, ``stream: true``, ``temperature: 0``, ``stream_options.include_usage``, distinct prompts;
  one ``httpx.AsyncClient`` with N + 8 connections, every stream a task of one anyio task group in this process).
  Once every stream has received at least ``K`` = 5 content chunks (a chunk whose ``choices[0].delta.content`` is
  non-empty, stamped ``time.monotonic()`` as the client parses it), the instance's runner (``GET
  /v1/instances/{id}`` -> ``runner.pid``, read before the streams start) is sent SIGKILL (``t_kill`` stamped just
  before). Per stream:

  - *pause* = the longest gap between two consecutive content chunks that ends after ``t_kill``: the stall the death
    caused. It is not simply "the first chunk after the kill minus the last one before it": chunks the runner had
    sent before it died can still arrive a few ms after ``t_kill``, and the stall comes after them;
  - *completed*: the stream ended with a ``finish_reason`` and no ``error`` object; *equal_solo*: its text equals
    its solo text, character for character (both counts are reported, never filtered: on the debug engine and on a
    ``deterministic`` llama.cpp instance each must be N; ``mismatches`` names every stream that fell short: case,
    stream, whether it completed, its error, the first differing character and the text around it on both sides);
  - ``resumed``: the sum over the streams of their final ``usage.resumed`` (each should be 1: N in all).

  ``chunk_gap_p50_s`` = the median gap between consecutive content chunks before ``t_kill``, over every stream: the
  pace a pause is a stall of. ``after_ready_p50_s`` / ``_max_s`` = per stream, the arrival of the chunk that ended
  its pause minus the instance's ready time (``t_kill`` + ``restart_s``, below): what a resume costs beyond the new
  runner's start (the request handed over, the prompt and the tokens so far re-prefilled, the next token).

- **baseline** (``"resume": false``, restart ``{"initial_backoff": 0.05}``; tether's resume restarts at once for the
  first failure of a streak anyway), and a client that does what users of llama-server, Ollama or vLLM do when a
  server's engine dies under them: the stream ends in an error, and the client sends the whole request again until
  the server answers. The same prompts, the same ``K``, the same kill. A stream's first attempt that ends without a
  finish reason is retried at once; a retry answered ``503`` (the instance restarting), or failing otherwise, is sent
  again after a short bounded backoff (0.05 s doubling, at most 0.5 s: shorter than the ``Retry-After`` tether
  sends, so the baseline is not made to wait on tether's say-so), for at most ``RETRY_BOUND`` s. Per stream,
  *recovery* = the time from the last content chunk of the first attempt until the retried stream has again
  delivered as many characters as the first attempt had: the point where the user is back where they were.
  ``baseline_lost_without_retry`` counts the first attempts that did not complete (N: a client that does not retry
  loses every answer); ``baseline_completed`` and ``baseline_equal_solo`` are the retried answers' (compared with
  solo texts, same engine and options). Every side's instance is warmed first by one untimed 2-token request whose
  prompt is no stream's.

- ``restart_s`` (each side; the baseline's is ``baseline_restart_s``): from ``t_kill`` until ``GET
  /v1/instances/{id}`` (polled every 20 ms from a client of its own) says ``ready`` with a runner pid other than the
  killed one: the new runner's spawn, load and warm-up. A resumed stream's pause should be about that plus its
  re-prefill (below) and the next token: compare ``pause_p50_s`` with ``restart_s`` + 1 s.

``ratio_p50`` = ``baseline_recovery_p50_s / pause_p50_s``. Percentiles: ``statistics.quantiles(n=100,
method="inclusive")`` (``benchstats.percentile``): with 8 samples p99 is close to the max, with 1 it is that sample.

Cases:

1. debug engine (``engine: "debug"``, options ``token_seconds`` 0.01, ``parallel`` N), ``max_tokens`` 60, N in 1,
   8, 64, 200. Its text is a function of the prompt alone, so a resumed stream must equal solo. At 200 streams the
   two CPUs are shared by this client, the server and the runner: pauses then include the wait for a core.
2. the default model (SmolLM2-135M-Instruct) on llama.cpp, options ``n_threads`` 2 (``--quick``: 1; ``--threads``
   sets it; ``llama_threads`` in the JSON), ``parallel`` N, ``n_ctx`` 512, ``deterministic`` (the batch-invariant
   build, ``tether build deterministic``: where it is missing the case runs without it, ``deterministic`` is false
   in the JSON and ``deterministic_missing`` says why; equality with solo is then not promised and mismatches are
   reported as they are), ``max_tokens`` 48, N in 1 and 8 (``--big``: also 200 with ``parallel`` 200 and ``n_ctx``
   256; long). Prompts ask for stories about distinct subjects.
3. context length: the default model, one stream, prompts of about 100, 1,000 and 3,000 tokens (a list of numbered
   facts to summarize; ``prompt_tokens`` is what the server counted), ``n_ctx`` 4096, ``parallel`` 1, ``max_tokens``
   32, otherwise as in 2; a fresh set of instances per prompt length. A resume restores the prompt from the store of
   saved prompts that outlived the dead runner (``resume.store``: the prompt cache saves a prompt of 32 tokens or
   more to a tmpfs directory the worker owns as soon as it is prefilled) and prefills only the tokens generated so
   far. A third side, between tether's and the baseline's, runs the same streams on an instance with
   ``"resume": {"store": false}``: its pause re-prefills the whole prompt (``nostore_pause_p50_s`` /
   ``_p99_s``, ``nostore_completed``, ``nostore_equal_solo``; ``store_saves_p50_s`` = its pause p50 minus tether's).
   The baseline re-prefills the prompt too, then regenerates what was lost.
4. Gemma 3 270M (Q4_K_M, the base model, sliding-window attention; ``tether pull gemma3-270m``, else skipped and
   ``gemma_skipped`` says why): 8 streams of prompts of about 2,000 tokens (distinct from their first line on, so no
   prompt shares another's cells), ``POST /v1/completions`` (it has no chat template), options ``n_threads`` as in
   2, ``parallel`` 8, ``n_ctx`` 2304, ``max_tokens`` 32, with the same three sides as in 3. It is not
   ``deterministic``: a stream's text may part from its solo text (the batch it ran in changes the arithmetic, with
   or without a death), so equality is counted but not required; the baseline's retried answers show the same.

Headline keys: ``debug_200_*`` (case 1, N = 200; null in ``--quick``) and ``smollm2_8_*`` (case 2, N = 8; null in
``--quick`` or without the model): ``pause_p50_s``, ``pause_p99_s``, ``baseline_recovery_p50_s``,
``baseline_recovery_p99_s``, ``ratio_p50``, ``restart_s``; ``gemma_8_*`` (case 4): ``pause_p50_s``, ``pause_p99_s``,
``nostore_pause_p50_s``, ``nostore_pause_p99_s``, ``store_saves_p50_s``, ``prompt_tokens``. ``ok`` = every tether
stream completed, each equal to solo where the engine promises it (the debug engine, ``deterministic``), and no case
failed to run (``errors`` lists those that did; exit 1 then). Without the default model or
llama-cpp-python, cases 2 and 3 are skipped and ``llama_skipped`` says why.

All of it shares the machine's CPUs: the client (this process), the server and the runners. llama.cpp's threads wait
for each other at every step, so on 2 cores a second busy process slows its load, warm-up and first decode many
times over: read the SmolLM2 rows with ``restart_s`` and ``chunk_gap_p50_s`` beside them.

``--quick`` (for CI, ``"quick": true``): case 1 with N = 8 alone (the suite resumes the real model in its own tests);
its figures are only a smoke test.

Run: ``.venv/bin/python bench/resume.py [--quick] [--big] [--threads N] [--groups debug,smollm2,context,gemma]``.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from benchstats import (
    PERCENTILE,
    ROOT,
    BenchFailed,
    describe,
    emit,
    fmt,
    llama_unavailable,
    percentile,
    print_rows,
    private_tether_dirs,
)
from tether.chaos.target import ServeChild
from tether.engines.llamacpp import invariant

K = 5  # content chunks every stream has received before the kill
MAX_QUEUE = 512
POLL = 0.02  # s between two GET /v1/instances/{id} while the instance restarts
STOP_TIMEOUT = 5.0
STARTUP = 60.0  # the server's start
READY_BOUND = 180.0  # an instance's first runner ready (llama.cpp with 200 sequences included)
GATE_BOUND = 120.0  # every stream at K chunks; past it the runner is killed anyway (``gate_timed_out``)
RESTART_BOUND = 120.0  # the instance ready again after the kill
SIDE_BOUND = 300.0  # one side's streams, retries included
RETRY_BOUND = 180.0  # a baseline stream's retries, from its first failure
BACKOFF = (0.05, 0.5)  # the baseline client's retry delay: first, longest (doubling)
REQUEST_TIMEOUT = httpx.Timeout(120.0, connect=10.0)
MISMATCHES_KEPT = 20

DEBUG_OPTIONS = {"token_seconds": 0.01}
DEBUG_MAX_TOKENS = 60
DEBUG_STREAMS = (1, 8, 64, 200)
LLAMA_MAX_TOKENS = 48
LLAMA_STREAMS = (1, 8)
LLAMA_BIG = 200  # --big: parallel 200, n_ctx 256
LLAMA_THREADS = 2  # --quick: 1
CONTEXT_TOKENS = (100, 1000, 3000)  # about: the server's count is reported
CONTEXT_MAX_TOKENS = 32
CONTEXT_N_CTX = 4096
GEMMA_STREAMS = 8
GEMMA_TOKENS = 2000  # about: the server's count is reported
GEMMA_N_CTX = 2304  # per sequence
FACT_TOKENS = 20.3  # about how many tokens one fact of ``facts_prompt`` takes (SmolLM2's tokenizer)
TEMPLATE_TOKENS = 35  # about what SmolLM2's chat template adds (its default system message)

SUBJECTS = ("a cat", "a ship", "a dragon", "a baker", "a robot", "an owl", "a river", "a clock", "a fox", "a garden")
PLACES = (
    "a lighthouse", "the desert", "a small town", "the moon", "a forest", "a castle", "the sea", "a library",
    "a train", "the mountains", "a market", "an island", "a city", "a farm", "a cave", "a tower", "a bridge",
    "a village", "a school", "the sky",
)  # fmt: skip
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "grey")
ANIMALS = ("horse", "rabbit", "eagle", "turtle", "wolf", "salmon", "beetle", "goat", "heron", "badger", "moth")


# --------------------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One measurement: an engine and its options, N streams of these prompts, both sides."""

    group: str  # "debug", "smollm2", "context": the server it runs on
    engine: str
    streams: int
    options: dict[str, Any]
    max_tokens: int
    prompts: tuple[str, ...]
    label: str
    model: str | None = None  # a GGUF path (None: the engine's default)
    completions: bool = False  # POST /v1/completions with a prompt (a base model has no chat template)
    store: bool = False  # also a side whose instance keeps no store of saved prompts (``resume.store`` false)

    @property
    def path(self) -> str:
        return "/v1/completions" if self.completions else "/v1/chat/completions"

    def body(self, model: str, i: int, stream: bool = True) -> dict[str, Any]:
        asked = (
            {"prompt": self.prompts[i]}
            if self.completions
            else {"messages": [{"role": "user", "content": self.prompts[i]}]}
        )
        body: dict[str, Any] = {
            "model": model,
            **asked,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def story_prompt(i: int) -> str:
    return f"Tell me a long story about {SUBJECTS[i % len(SUBJECTS)]} in {PLACES[i // len(SUBJECTS) % len(PLACES)]}."


def facts_prompt(tokens: int) -> str:
    """About ``tokens`` tokens of a chat: numbered facts to summarize."""
    facts = max(1, round((tokens - TEMPLATE_TOKENS - 10) / FACT_TOKENS))
    lines = [
        f"Fact {j + 1}: the {COLOURS[j % len(COLOURS)]} {ANIMALS[j % len(ANIMALS)]} crossed bridge {3 * j + 7} "
        f"on day {j % 31 + 1}."
        for j in range(facts)
    ]
    return "Summarize these facts in a few sentences.\n" + "\n".join(lines)


def cases(
    args: argparse.Namespace, llama: bool, deterministic: bool, threads: int, gemma: str | None = None
) -> list[Case]:
    found = []
    for n in (8,) if args.quick else DEBUG_STREAMS:
        prompts = tuple(f"stream {i} of the resume benchmark" for i in range(n))
        options = {**DEBUG_OPTIONS, "parallel": n}
        found.append(Case("debug", "debug", n, options, DEBUG_MAX_TOKENS, prompts, f"debug N={n}"))
    if not llama or args.quick:  # (the suite resumes the real model in tests/test_resume.py)
        return found
    extra = {"deterministic": True} if deterministic else {}
    for n in (1,) if args.quick else (*LLAMA_STREAMS, *((LLAMA_BIG,) if args.big else ())):
        options = {"n_threads": threads, "parallel": n, "n_ctx": 256 if n == LLAMA_BIG else 512, **extra}
        prompts = tuple(story_prompt(i) for i in range(n))
        found.append(Case("smollm2", "llama.cpp", n, options, LLAMA_MAX_TOKENS, prompts, f"SmolLM2 N={n}"))
    if args.quick:
        return found
    for tokens in CONTEXT_TOKENS:
        options = {"n_threads": threads, "parallel": 1, "n_ctx": CONTEXT_N_CTX, **extra}
        prompts = (facts_prompt(tokens),)
        label = f"SmolLM2 ~{tokens} tok"
        found.append(Case("context", "llama.cpp", 1, options, CONTEXT_MAX_TOKENS, prompts, label, store=True))
    if gemma is not None:
        options = {"n_threads": threads, "parallel": GEMMA_STREAMS, "n_ctx": GEMMA_N_CTX}
        prompts = tuple(f"Notebook {i}.\n" + facts_prompt(GEMMA_TOKENS) + "\nSummary:" for i in range(GEMMA_STREAMS))
        label = f"Gemma 3 N={GEMMA_STREAMS} ~{GEMMA_TOKENS} tok"
        found.append(
            Case("gemma", "llama.cpp", GEMMA_STREAMS, options, CONTEXT_MAX_TOKENS, prompts, label, gemma, True, True)
        )
    return found


# --------------------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------------------


def tether_program() -> tuple[str, ...]:
    script = ROOT / ".venv" / "bin" / "tether"
    return (str(script),) if script.exists() else (sys.executable, "-m", "tether")


@contextlib.contextmanager
def serving() -> Iterator[ServeChild]:
    """A ``tether serve`` child (``--engine debug --name idle``, its idle instance deleted once ready), stopped and
    swept after the block, however it ends; a reaper stops it should this process die first."""
    argv = ("--engine", "debug", "--name", "idle", "--max-queue", str(MAX_QUEUE), "--stop-timeout", str(STOP_TIMEOUT))
    server = ServeChild(*argv, startup=STARTUP, reaper=True, program=tether_program())
    try:
        server.wait_for(r"idle ready \(runner pid", STARTUP)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            http.delete("/v1/instances/idle")
        yield server
    finally:
        server.stop_and_sweep(STOP_TIMEOUT)


async def add_instance(admin: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    created = await admin.post("/v1/instances", json=body)
    if created.status_code != 201:
        raise BenchFailed(f"tether refused instance {body['id']}: {created.status_code} {created.text[:400]}")
    deadline = time.monotonic() + READY_BOUND
    while True:
        got = (await admin.get(f"/v1/instances/{body['id']}")).json()
        if got.get("ready") and got.get("runner"):
            return dict(got)
        if got.get("state") in ("failed", "stopped") or time.monotonic() > deadline:
            raise BenchFailed(f"instance {body['id']} not ready ({got.get('state')}): {json.dumps(got)[:600]}")
        await anyio.sleep(POLL)


async def delete_instance(admin: httpx.AsyncClient, instance_id: str) -> None:
    await admin.delete(f"/v1/instances/{instance_id}")
    deadline = time.monotonic() + 30
    while (await admin.get(f"/v1/instances/{instance_id}")).status_code != 404 and time.monotonic() < deadline:
        await anyio.sleep(POLL)


# --------------------------------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Attempt:
    """One request sent: its content chunks' arrival times (``time.monotonic()``) and how it ended."""

    status: int = 0
    text: str = ""
    arrivals: list[float] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    ended: float | None = None

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.error is None and self.finish is not None


@dataclass
class StreamRun:
    """One stream of a side: its attempts (tether: one), and the baseline's recovery stamps."""

    index: int
    attempts: list[Attempt] = field(default_factory=list)
    recovered: float | None = None  # baseline: the retry has as many characters as the first attempt had
    rejected: int = 0  # baseline: retries answered 503

    @property
    def first(self) -> Attempt:
        return self.attempts[0]

    @property
    def last(self) -> Attempt:
        return self.attempts[-1]


async def read(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], att: Attempt, on_chunk: Callable[[], None]
) -> None:
    """Send ``body`` to ``path`` and read its SSE stream into ``att``; ``on_chunk`` after each content chunk."""
    try:
        async with client.stream("POST", path, json=body) as response:
            att.status = response.status_code
            if response.status_code != 200:
                att.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    att.error = json.dumps(event["error"])[:400]
                    continue
                att.usage = event.get("usage") or att.usage
                for choice in event.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        att.text += piece
                        att.arrivals.append(time.monotonic())
                        on_chunk()
                    att.finish = choice.get("finish_reason") or att.finish
    except httpx.HTTPError as exc:
        att.error = describe(exc)
    finally:
        att.ended = time.monotonic()


class Gate:
    """Set once every stream has received ``K`` content chunks or ended."""

    def __init__(self, n: int) -> None:
        self.left = set(range(n))
        self.event = anyio.Event()
        if not self.left:
            self.event.set()

    def mark(self, i: int) -> None:
        if i in self.left:
            self.left.discard(i)
            if not self.left:
                self.event.set()


@dataclass
class Side:
    """One side of a case, as run."""

    streams: list[StreamRun]
    t_kill: float | None = None
    killed_pid: int | None = None
    restart_s: float | None = None
    gate_timed_out: bool = False
    timed_out: bool = False  # SIDE_BOUND passed with streams still open


async def kill_and_watch(admin: httpx.AsyncClient, instance_id: str, pid: int, gate: Gate, side: Side) -> None:
    """Once ``gate`` opens, SIGKILL the runner, then poll until the instance is ready with another pid."""
    with anyio.move_on_after(GATE_BOUND):
        await gate.event.wait()
    side.gate_timed_out = not gate.event.is_set()
    side.t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    side.killed_pid = pid
    while time.monotonic() - side.t_kill < RESTART_BOUND:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            got = (await admin.get(f"/v1/instances/{instance_id}")).json()
            new = (got.get("runner") or {}).get("pid")
            if got.get("ready") and new is not None and new != pid:
                side.restart_s = time.monotonic() - side.t_kill
                return
        await anyio.sleep(POLL)


def stream_client(n: int, url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    return httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, limits=limits)


async def run_side(url: str, admin: httpx.AsyncClient, case: Case, instance_id: str, pid: int, retry: bool) -> Side:
    """N streams, the kill once all have K chunks; ``retry``: the baseline client (retries a failed stream whole)."""
    side = Side([StreamRun(i) for i in range(case.streams)])
    gate = Gate(case.streams)

    async def one(run: StreamRun) -> None:
        body = case.body(instance_id, run.index)
        first = Attempt()
        run.attempts.append(first)

        def reached() -> None:
            if len(first.arrivals) >= K:
                gate.mark(run.index)

        await read(client, case.path, body, first, reached)
        gate.mark(run.index)
        if not retry or first.complete:
            return
        target = max(len(first.text), 1)
        delay, began = BACKOFF[0], time.monotonic()
        while time.monotonic() - began < RETRY_BOUND:
            att = Attempt()
            run.attempts.append(att)

            def caught_up(att: Attempt = att) -> None:
                if run.recovered is None and len(att.text) >= target:
                    run.recovered = att.arrivals[-1]

            await read(client, case.path, body, att, caught_up)
            if att.complete:
                return
            if att.status == 503:
                run.rejected += 1
            if att.status in (0, 200) or att.status >= 500:  # failed again, or not ready yet: wait a little
                await anyio.sleep(delay)
                delay = min(delay * 2, BACKOFF[1])
            else:
                return  # a refusal retrying cannot fix

    async with stream_client(case.streams, url) as client:
        with anyio.move_on_after(SIDE_BOUND) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_and_watch, admin, instance_id, pid, gate, side)
                for run in side.streams:
                    tg.start_soon(one, run)
        side.timed_out = scope.cancelled_caught
    return side


@dataclass
class Solo:
    text: str
    prompt_tokens: int | None


async def solo_texts(admin: httpx.AsyncClient, case: Case, instance_id: str) -> list[Solo]:
    """Each stream's request alone, one after the other, non-streamed."""
    found = []
    for i in range(case.streams):
        answer = await admin.post(case.path, json=case.body(instance_id, i, stream=False), timeout=300)
        if answer.status_code != 200:
            raise BenchFailed(f"{case.label}: solo request {i} refused: {answer.status_code} {answer.text[:300]}")
        data = answer.json()
        choice = data["choices"][0]
        text = choice["text"] if case.completions else choice["message"]["content"]
        found.append(Solo(str(text), (data.get("usage") or {}).get("prompt_tokens")))
    return found


# --------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------


def pause_of(att: Attempt, t_kill: float) -> tuple[float, float] | None:
    """The longest gap between consecutive content chunks that ends after the kill, and the arrival that ends it
    (None: no chunk after the kill)."""
    gaps = [(b - a, b) for a, b in zip(att.arrivals, att.arrivals[1:], strict=False) if b > t_kill]
    return max(gaps) if gaps else None


def first_difference(a: str, b: str) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's length when one is a prefix), None if equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def mismatch(case: Case, side: str, run: StreamRun, solo: str) -> dict[str, Any]:
    att = run.last
    at = first_difference(att.text, solo)
    lo = max(0, (at or 0) - 20)
    return {
        "case": case.label,
        "side": side,
        "stream": run.index,
        "completed": att.complete,
        "finish": att.finish,
        "error": att.error,
        "resumed": (att.usage or {}).get("resumed"),
        "first_difference": at,
        "chars": [len(att.text), len(solo)],
        "got": None if at is None else att.text[lo : at + 30],
        "solo": None if at is None else solo[lo : at + 30],
    }


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or value != value else round(value, digits)


def figures(case: Case, solos: Sequence[Solo], tether: Side, baseline: Side, deterministic: bool) -> dict[str, Any]:
    t_kill = tether.t_kill or float("inf")
    done_before = [r for r in tether.streams if r.first.ended is not None and r.first.ended < t_kill]
    stalls = [p for p in (pause_of(r.first, t_kill) for r in tether.streams) if p is not None]
    pauses = [gap for gap, _ in stalls]
    ready_at = t_kill + tether.restart_s if tether.restart_s is not None else None
    after_ready = [end - ready_at for _, end in stalls] if ready_at is not None else []
    gaps = [
        b - a
        for r in tether.streams
        for a, b in zip(r.first.arrivals, r.first.arrivals[1:], strict=False)
        if b < t_kill
    ]
    completed = sum(1 for r in tether.streams if r.first.complete)
    equal = sum(1 for r, s in zip(tether.streams, solos, strict=True) if r.first.complete and r.first.text == s.text)
    bad = [
        mismatch(case, "tether", r, s.text)
        for r, s in zip(tether.streams, solos, strict=True)
        if not (r.first.complete and r.first.text == s.text)
    ]
    b_kill = baseline.t_kill or float("inf")
    recoveries = [
        r.recovered - r.first.arrivals[-1] for r in baseline.streams if r.recovered is not None and r.first.arrivals
    ]
    b_done = sum(1 for r in baseline.streams if r.last.complete)
    b_equal = sum(1 for r, s in zip(baseline.streams, solos, strict=True) if r.last.complete and r.last.text == s.text)
    bad += [
        mismatch(case, "baseline", r, s.text)
        for r, s in zip(baseline.streams, solos, strict=True)
        if r.last.complete and r.last.text != s.text  # a retried answer that differs (an unfinished one is counted)
    ]
    tokens = [s.prompt_tokens for s in solos if s.prompt_tokens is not None]
    pause_p50 = percentile(pauses, 50)
    recovery_p50 = percentile(recoveries, 50)
    llama = case.engine != "debug"
    return {
        "case": case.label,
        "engine": case.engine,
        "streams": case.streams,
        "prompt_tokens": int(statistics.median(tokens)) if tokens else None,
        "max_tokens": case.max_tokens,
        "options": case.options,
        "deterministic": bool(case.options.get("deterministic")) if llama else None,
        "pause_p50_s": rounded(pause_p50),
        "pause_p99_s": rounded(percentile(pauses, 99)),
        "pause_max_s": rounded(max(pauses, default=float("nan"))),
        "pauses": len(pauses),
        "after_ready_p50_s": rounded(percentile(after_ready, 50)),
        "after_ready_max_s": rounded(max(after_ready, default=float("nan"))),
        "chunk_gap_p50_s": rounded(percentile(gaps, 50), 4),
        "completed": completed,
        "equal_solo": equal,
        "resumed": sum(int((r.first.usage or {}).get("resumed") or 0) for r in tether.streams),
        "finished_before_kill": len(done_before),
        "gate_timed_out": tether.gate_timed_out or baseline.gate_timed_out,
        "timed_out": tether.timed_out or baseline.timed_out,
        "restart_s": rounded(tether.restart_s),
        "baseline_recovery_p50_s": rounded(recovery_p50),
        "baseline_recovery_p99_s": rounded(percentile(recoveries, 99)),
        "baseline_recovery_max_s": rounded(max(recoveries, default=float("nan"))),
        "baseline_lost_without_retry": sum(1 for r in baseline.streams if not r.first.complete),
        "baseline_finished_before_kill": sum(
            1 for r in baseline.streams if r.first.ended is not None and r.first.ended < b_kill
        ),
        "baseline_completed": b_done,
        "baseline_equal_solo": b_equal,
        "baseline_attempts": sum(len(r.attempts) for r in baseline.streams),
        "baseline_rejected_503": sum(r.rejected for r in baseline.streams),
        "baseline_restart_s": rounded(baseline.restart_s),
        "ratio_p50": rounded(recovery_p50 / pause_p50, 2) if pauses and recoveries and pause_p50 > 0 else None,
        "mismatches": bad[:MISMATCHES_KEPT],
        "mismatch_count": len(bad),
    }


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------


async def run_case(url: str, case: Case, number: int, deterministic: bool) -> dict[str, Any]:
    """Every side of one case on the server at ``url``: the solo texts, tether (resume), then (``case.store``) tether
    without its store of saved prompts, then the baseline."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as admin:
        common = {"engine": case.engine, "options": case.options, "max_queue": MAX_QUEUE}
        if case.model is not None:
            common["model"] = case.model
        tether_id, baseline_id, solo_id = f"c{number}-resume", f"c{number}-baseline", f"c{number}-solo"
        await add_instance(admin, {"id": solo_id, **common, "resume": False})
        try:
            solos = await solo_texts(admin, case, solo_id)
        finally:
            await delete_instance(admin, solo_id)
        tether = await warmed_side(url, admin, case, {"id": tether_id, **common, "resume": True})
        bare: Side | None = None
        if case.store:
            body = {"id": f"c{number}-nostore", **common, "resume": {"store": False}}
            bare = await warmed_side(url, admin, case, body)
        restart = {"initial_backoff": 0.05}
        body = {"id": baseline_id, **common, "resume": False, "restart": restart}
        baseline = await warmed_side(url, admin, case, body, retry=True)
    row = figures(case, solos, tether, baseline, deterministic)
    row.update(store_figures(case, solos, tether, bare))
    return row


async def warmed_side(
    url: str, admin: httpx.AsyncClient, case: Case, body: dict[str, Any], retry: bool = False
) -> Side:
    """One side on an instance of its own (``body``), warmed first by one untimed 2-token request (a prompt no stream
    has: nothing it leaves in a prompt cache serves a stream), deleted after."""
    instance_id = body["id"]
    inst = await add_instance(admin, body)
    try:
        warm = {**case.body(instance_id, 0, stream=False), "max_tokens": 2}
        warm.update({"prompt": "Hello"} if case.completions else {"messages": [{"role": "user", "content": "Hello"}]})
        await admin.post(case.path, json=warm, timeout=300)
        return await run_side(url, admin, case, instance_id, int(inst["runner"]["pid"]), retry=retry)
    finally:
        await delete_instance(admin, instance_id)


def stalls(side: Side) -> list[float]:
    """Each stream's pause on ``side`` (those with a chunk after the kill)."""
    t_kill = side.t_kill or float("inf")
    return [found[0] for found in (pause_of(r.first, t_kill) for r in side.streams) if found is not None]


def store_figures(case: Case, solos: Sequence[Solo], tether: Side, bare: Side | None) -> dict[str, Any]:
    """The side without a store beside tether's: its pauses (the re-prefill the store saves), its completions."""
    if bare is None:
        return {"nostore_pause_p50_s": None, "nostore_pause_p99_s": None, "store_saves_p50_s": None}
    pauses, mine = stalls(bare), stalls(tether)
    p50, bare_p50 = percentile(mine, 50), percentile(pauses, 50)
    return {
        "nostore_pause_p50_s": rounded(bare_p50),
        "nostore_pause_p99_s": rounded(percentile(pauses, 99)),
        "nostore_restart_s": rounded(bare.restart_s),
        "nostore_completed": sum(1 for r in bare.streams if r.first.complete),
        "nostore_equal_solo": sum(
            1 for r, s in zip(bare.streams, solos, strict=True) if r.first.complete and r.first.text == s.text
        ),
        "store_saves_p50_s": rounded(bare_p50 - p50) if pauses and mine else None,
    }


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    headers = (
        "case",
        "prompt",
        "pause p50",
        "pause p99",
        "pause max",
        "restart",
        "after ready",
        "gap p50",
        "done",
        "=solo",
        "resumed",
        "base p50",
        "base p99",
        "base/tether",
        "lost w/o retry",
        "base =solo",
        "no store p50",
        "no store p99",
    )

    def s(value: Any) -> str:
        return "-" if value is None else fmt(float(value))

    table = [
        (
            r["case"],
            str(r["prompt_tokens"]),
            s(r["pause_p50_s"]),
            s(r["pause_p99_s"]),
            s(r["pause_max_s"]),
            s(r["restart_s"]),
            s(r["after_ready_p50_s"]),
            "-" if r["chunk_gap_p50_s"] is None else f"{r['chunk_gap_p50_s']:.3f}",
            f"{r['completed']}/{r['streams']}",
            f"{r['equal_solo']}/{r['streams']}",
            str(r["resumed"]),
            s(r["baseline_recovery_p50_s"]),
            s(r["baseline_recovery_p99_s"]),
            s(r["ratio_p50"]),
            f"{r['baseline_lost_without_retry']}/{r['streams']}",
            f"{r['baseline_equal_solo']}/{r['streams']}",
            s(r.get("nostore_pause_p50_s")),
            s(r.get("nostore_pause_p99_s")),
        )
        for r in rows
    ]
    print_rows(headers, table)


def headline(rows: Sequence[dict[str, Any]], engine: str, streams: int, group_label: str) -> dict[str, Any]:
    row = next((r for r in rows if r["engine"] == engine and r["streams"] == streams and r["case"] == group_label), {})
    keys = ("pause_p50_s", "pause_p99_s", "baseline_recovery_p50_s", "baseline_recovery_p99_s", "ratio_p50")
    return {key: row.get(key) for key in (*keys, "restart_s")}


def gemma_model() -> tuple[str | None, str | None]:
    """Gemma 3 270M's GGUF where ``tether pull gemma3-270m`` put it, or None and why not."""
    from tether.models import PACKAGED, pulled_path

    path = pulled_path(PACKAGED["gemma3-270m"])
    if not path.exists():
        return None, f"{path} is missing: tether pull gemma3-270m"
    return str(path), None


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    skipped = llama_unavailable()
    missing = invariant.missing() if skipped is None else None
    deterministic = skipped is None and missing is None
    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    threads = args.threads or (1 if args.quick else LLAMA_THREADS)
    gemma, gemma_skipped = gemma_model() if skipped is None and not args.quick else (None, "not in this run")
    todo = cases(args, skipped is None, deterministic, threads, gemma)
    for group in ("debug", "smollm2", "context", "gemma"):
        if args.groups and group not in args.groups.split(","):
            continue
        mine = [(i, c) for i, c in enumerate(todo) if c.group == group]
        if not mine:
            continue
        try:
            with serving() as server:
                for number, case in mine:
                    try:
                        rows.append(await run_case(server.url, case, number, deterministic))
                    except Exception as exc:
                        errors.append(f"{case.label}: {describe(exc)}")
                    print(f"  {case.label}: done ({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
        except Exception as exc:
            errors.append(f"{group} server: {describe(exc)}")
    wall_s = time.monotonic() - began

    print(
        f"a runner SIGKILLed once every stream had {K} content chunks: tether resumes each stream (pause), the "
        f"baseline's client retries it whole (recovery); seconds ({wall_s:.0f} s){' (quick)' if args.quick else ''}"
    )
    print_table(rows)
    print(
        "pause: longest gap between content chunks ending after the kill; restart: kill -> instance ready with a new "
        "pid; after ready: instance ready -> the chunk that ended the pause (p50); gap p50: between chunks before "
        "the kill; base: the baseline client's recovery (last chunk before the failure -> as many characters again); "
        f"percentiles: {PERCENTILE}"
    )
    if skipped is not None:
        print(f"SmolLM2 cases skipped: {skipped}")
    elif missing is not None:
        print(f"SmolLM2 cases ran WITHOUT the deterministic build: {missing}")
    mismatches = [m for r in rows for m in r["mismatches"]]
    for m in mismatches:
        print(f"MISMATCH: {json.dumps(m)}")
    for e in errors:
        print(f"ERROR: {e}")

    # equal to solo is promised where the text is a function of the request alone: the debug engine, deterministic
    complete = all(
        r["completed"] == r["streams"] and (r["equal_solo"] == r["streams"] or r["deterministic"] is False)
        for r in rows
    )
    result: dict[str, Any] = {"bench": "resume", "quick": bool(args.quick), "big": bool(args.big)}
    for name, value in headline(rows, "debug", 200, "debug N=200").items():
        result[f"debug_200_{name}"] = value
    for name, value in headline(rows, "llama.cpp", 8, "SmolLM2 N=8").items():
        result[f"smollm2_8_{name}"] = value
    gemma_row = next((r for r in rows if r["case"].startswith("Gemma")), {})
    for name in ("pause_p50_s", "pause_p99_s", "nostore_pause_p50_s", "nostore_pause_p99_s", "store_saves_p50_s"):
        result[f"gemma_8_{name}"] = gemma_row.get(name)
    result["gemma_8_prompt_tokens"] = gemma_row.get("prompt_tokens")
    result["gemma_skipped"] = gemma_skipped
    result.update(
        {
            "ok": complete and not errors and bool(rows),
            "all_completed": all(r["completed"] == r["streams"] for r in rows),
            "all_equal_solo": all(r["equal_solo"] == r["streams"] for r in rows),
            "mismatch_count": sum(r["mismatch_count"] for r in rows),
            "errors": errors,
            "deterministic": deterministic,
            "deterministic_missing": missing,
            "llama_skipped": skipped,
            "k": K,
            "llama_threads": threads,
            "baseline_backoff_s": list(BACKOFF),
            "percentile": PERCENTILE,
            "wall_s": round(wall_s, 1),
            "cases": rows,
        }
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="debug N=8 alone (CI)")
    parser.add_argument("--big", action="store_true", help="also SmolLM2 with 200 streams (long)")
    parser.add_argument("--groups", help="only these case groups, comma-separated: debug, smollm2, context, gemma")
    parser.add_argument("--threads", type=int, help=f"llama.cpp threads (default {LLAMA_THREADS}; --quick: 1)")
    args = parser.parse_args(argv)
    with private_tether_dirs("tether-bench-resume-"):
        result = anyio.run(bench, args)
    emit(result)
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
