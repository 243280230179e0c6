"""Serving benchmark: ``tether serve`` against llama-cpp-python's own OpenAI server, same GGUF, same load.

Both servers serve the built-in default model (``tether.models.default_model_path()``, SmolLM2-135M-Instruct) on
127.0.0.1, each started as a subprocess on a free port, one at a time (never both: the machine may have two cores):

- tether: ``python -m tether serve --port P --n-ctx 2048 --threads 2`` (no ``--model``: the default model, the
  same file). Ready when ``GET /readyz`` returns 200 (503 while loading). Stopped with SIGTERM, the exit awaited
  (bounded; SIGKILL after it, counted in ``forced_kills``). Before the stop the bench snapshots the server's
  descendants (psutil); after it (and a 2 s grace for exits under way), ``leftover_processes`` counts those still
  running plus any process whose command line names ``tether.runner`` and either ``--worker=<server pid>`` or the
  server as its parent. It must be 0 (promise 6); the bench kills what it counted.
- baseline: ``python -m llama_cpp.server --model PATH --n_ctx 2048 --n_threads 2 --n_threads_batch 2 --n_batch 512
  --seed 0 --interrupt_requests false --port P --host 127.0.0.1``. Ready when ``GET /v1/models`` returns 200.
  Stopped with SIGTERM, then SIGKILL after the bound. ``--interrupt_requests false`` is required for a fair
  concurrent load: by default llama_cpp.server ends a streaming response early (it sends ``[DONE]`` after the
  current token) as soon as another request is waiting for the model, so at concurrency 4 most streams would be
  cut short. Everything else is the server as shipped (``verbose`` included).

Server output goes to a log file in a temporary directory (its tail is in the error when a server fails to start).

Sampling is identical: greedy (``temperature: 0``), ``max_tokens`` 128 (``--quick``: 32), ``seed: 0``, and
``repeat_penalty: 1.0`` in the baseline's request body (llama_cpp.server accepts it as an extra field; its default
is 1.1, tether's engine uses 1.0; at temperature 0 the penalty still changes which token is the argmax). Other
sampling fields are left at their defaults: greedy sampling makes them irrelevant. ``outputs_identical`` checks
it: every prompt's completion text must be the same on both sides in every round and at every concurrency (a
check, reported, not a figure; a prefix reused from the KV cache of a different previous request can, rarely,
change the float rounding and so a greedy choice).

Requests: ``POST /v1/chat/completions`` with ``stream: true``, ``stream_options: {"include_usage": true}``, a
fixed system message and one of ``PROMPTS`` (stories: answers longer than ``max_tokens``), ``model`` = the first id
of the server's ``GET /v1/models``. At concurrency ``C``, ``C`` clients each send ``N = max(1, R // C)`` requests
back to back (a closed loop; ``R`` = ``--requests``, default 8, so every concurrency sends the same work when ``C``
divides ``R``), request ``j`` of client ``i`` with prompt ``PROMPTS[(i * N + j) % len(PROMPTS)]``: the same
prompts in the same order on both sides.
One ``httpx.AsyncClient`` per load phase, all clients in one anyio task group. Each server gets one untimed warm-up
request first (``PROMPTS[0]``, 16 tokens). Per request, stamped with ``time.perf_counter()``:

- *TTFT* = from just before the request is sent to the first SSE line ``data: {...}`` whose
  ``choices[0].delta.content`` is non-empty (role-only and empty chunks do not count);
- *output tokens* = ``usage.completion_tokens`` when the server sends a usage chunk, else the number of content
  chunks (llama_cpp.server sends no usage in streams; it sends one chunk per token, except where it holds back
  a partial UTF-8 character or a possible stop-string prefix). ``tokens_source`` says which each side used;
- an *error* = a status other than 200, an ``error`` object in the stream, a stream that ends without
  ``data: [DONE]``, no content at all, or an exception (timeout: 120 s per request). ``errors`` must be 0.

Per (round, side, concurrency): aggregate output tokens/s = the requests' output tokens / the wall time of the load
phase (first request sent -> last stream ended), and the p50 of the requests' TTFTs. Both servers serialise
generation (one model, one request at a time), so at concurrency 4 TTFT is mostly queueing behind the other
clients' requests: it measures throughput as much as latency.

Rounds: ``--rounds`` (default 3; ``--quick``: 1). Each round runs both servers, one after the other (start, warm
up, concurrency 1, then 4, stop), the order alternating (round 0: baseline first, round 1: tether first, ...), so
a slow stretch of a noisy machine falls on both sides. Each side's figure is the median over the rounds of its
per-round figures. Then, per concurrency C:

- ``tokens_per_s_ratio_cC`` = tether tokens/s / baseline tokens/s (medians over the rounds);
- ``ttft_added_ms_cC`` = tether p50 TTFT - baseline p50 TTFT (medians over the rounds).

Headlines: ``tokens_per_s_ratio`` = the minimum over the concurrencies (the target must hold at every load);
``ttft_added_ms`` = the figure at the lowest concurrency, 1 by default (no queueing: what the server adds to one
request's first token). ``meets_target`` = ``tokens_per_s_ratio >= target_ratio`` (0.98).

Reading the figures: on a shared two-core machine another program's burst can halve one phase's rate (llama.cpp's
threads wait for each other at every step, so a stolen core costs far more than its share); the per-round table
shows such a phase, and the median over the rounds drops it. Observed on such a machine: llama_cpp.server's
aggregate rate at concurrency 4 stays well below its rate at concurrency 1 and its rate varies from phase to phase
far more than tether's, with the machine otherwise idle (it then uses about 1.2 of the 2 cores instead of 1.9); so
the C=4 ratio says how each server copes with queued requests, not what tether's layers cost, and the headline
minimum is normally the C=1 ratio.

Statistics: p50 = ``statistics.quantiles(samples, n=100, method="inclusive")`` (``benchstats.percentile``).
Runner records and runner logs go to a private temporary ``TETHER_RUNTIME_DIR`` / ``TETHER_LOG_DIR`` (removed at
the end). Without the default model (``DefaultModelMissing``) the figures are null and ``skipped`` says why (exit
0). A server that does not start is an error: null figures, ``error`` says why, exit 1.

``--quick`` (for CI): 1 round, concurrency 1 and 4, ``R`` = 4 (4 requests at C=1, 1 per client at C=4),
``max_tokens`` 32 (``"quick": true``); its figures are only a smoke test.

Run: ``.venv/bin/python bench/serve.py [--quick]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil

from benchstats import PERCENTILE, fmt, ms, percentile, print_rows, private_tether_dirs
from tether.models import DefaultModelMissing, default_model_path

SIDES = ("baseline", "tether")
CONCURRENCY = (1, 4)
TARGET_RATIO = 0.98
N_CTX = 2048
THREADS = 2
N_BATCH = 512
SEED = 0
MAX_TOKENS = 128
QUICK_MAX_TOKENS = 32
WARMUP_TOKENS = 16
SYSTEM = "You are a helpful AI assistant."
PROMPTS = (
    "Write a story about a lighthouse keeper who finds a message in a bottle.",
    "Write a story about a robot that learns to bake bread.",
    "Write a story about two friends lost in a forest at night.",
    "Write a story about a dragon who is afraid of fire.",
    "Write a story about a girl who builds a boat to cross the ocean.",
    "Write a story about a cat who becomes the mayor of a small town.",
    "Write a story about an old clock that starts running backwards.",
    "Write a story about a farmer who finds a door in the middle of his field.",
)
READY_TIMEOUT = 120.0  # start-up and model load
STOP_TIMEOUT = 15.0  # SIGTERM -> exit, then SIGKILL
REQUEST_TIMEOUT = 120.0
POLL_INTERVAL = 0.1


class ServerFailed(RuntimeError):
    """A server did not start (or did not list a model); ``tail`` is the end of its log."""

    def __init__(self, message: str, tail: str = "") -> None:
        super().__init__(message)
        self.tail = tail


# --------------------------------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A port nobody listens on right now (the kernel's pick; a tiny race with other programs, harmless here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(side: str, model: Path, port: int) -> tuple[list[str], str]:
    """The command line and the readiness path of one side (see the module docstring for why each flag)."""
    if side == "tether":
        cmd = [sys.executable, "-m", "tether", "serve", "--port", str(port), "--n-ctx", str(N_CTX)]
        return [*cmd, "--threads", str(THREADS)], "/readyz"
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", str(N_CTX)]
    cmd += ["--n_threads", str(THREADS), "--n_threads_batch", str(THREADS), "--n_batch", str(N_BATCH)]
    cmd += ["--seed", str(SEED), "--interrupt_requests", "false", "--port", str(port), "--host", "127.0.0.1"]
    return cmd, "/v1/models"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Server:
    """One running server subprocess."""

    side: str
    proc: subprocess.Popen[bytes]
    base_url: str
    log: Path
    model_id: str = ""
    load_s: float = 0.0  # start -> ready
    leftover: int = 0  # set by stop_server
    forced: bool = False  # SIGKILL was needed


def wait_ready(server: Server, ready_path: str) -> None:
    """Poll the readiness path until 200 (bounded); then read the served model id."""
    began = time.monotonic()
    deadline = began + READY_TIMEOUT
    with httpx.Client(base_url=server.base_url, timeout=5.0) as client:
        while True:
            if server.proc.poll() is not None:
                raise ServerFailed(
                    f"{server.side} server exited with status {server.proc.returncode} before it was ready",
                    log_tail(server.log),
                )
            with contextlib.suppress(httpx.TransportError):
                if client.get(ready_path).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise ServerFailed(
                    f"{server.side} server not ready after {READY_TIMEOUT:.0f} s ({ready_path} never returned 200)",
                    log_tail(server.log),
                )
            time.sleep(POLL_INTERVAL)
        server.load_s = time.monotonic() - began
        response = client.get("/v1/models")
        models = (response.json().get("data") or []) if response.status_code == 200 else []
        if not models:
            raise ServerFailed(f"{server.side} server lists no model: GET /v1/models -> {response.status_code}")
        server.model_id = str(models[0]["id"])


def _alive(proc: psutil.Process) -> bool:
    """Still running (the same process: psutil checks its start time) and not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_server(server: Server) -> tuple[int, bool]:
    """SIGTERM, wait (bounded), SIGKILL if needed; returns (leftover processes, whether SIGKILL was needed).

    Leftovers: the server's descendants snapshotted before the stop that still run after it, plus any process
    whose command line names ``tether.runner`` and this server (``--worker=PID``, or as its parent)."""
    try:
        before = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.Error:
        before = []
    forced = False
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        forced = True
        server.proc.kill()
        server.proc.wait(STOP_TIMEOUT)
    # bounded grace for children that are exiting on their own right now (a lifeline EOF, a group kill in flight)
    deadline = time.monotonic() + 2.0
    alive = [p for p in before if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    pids = {p.pid for p in alive}
    for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        ours = proc.info["ppid"] == server.proc.pid or f"--worker={server.proc.pid}" in cmdline
        if ours and any("tether.runner" in arg for arg in cmdline):
            pids.add(proc.info["pid"])
    for pid in pids:  # leave nothing behind ourselves, whatever the figure says
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    return len(pids), forced


@contextlib.contextmanager
def running(side: str, model: Path, logdir: Path) -> Iterator[Server]:
    """Start one server, wait until it is ready, yield it, stop it (always)."""
    port = free_port()
    cmd, ready_path = server_command(side, model, port)
    log = logdir / f"{side}-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    server = Server(side, proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_ready(server, ready_path)
        yield server
    finally:
        if proc.poll() is None:
            server.leftover, server.forced = stop_server(server)


# --------------------------------------------------------------------------------------------------------------
# Client load
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Request:
    """One streamed chat completion, as the client saw it."""

    prompt: int
    ttft: float | None = None  # seconds
    chunks: int = 0  # SSE chunks with non-empty content
    usage_tokens: int | None = None  # usage.completion_tokens, when the server sent it
    text: str = ""
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks


def request_body(server: Server, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": server.model_id,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if server.side == "baseline":
        body["repeat_penalty"] = 1.0  # llama_cpp.server defaults to 1.1; tether's engine uses 1.0
    return body


async def stream_one(client: httpx.AsyncClient, server: Server, index: int, max_tokens: int) -> Request:
    """Send one streaming chat completion and read it to ``[DONE]``, stamping the first content chunk."""
    req = Request(index)
    body = request_body(server, PROMPTS[index], max_tokens)
    parts: list[str] = []
    done = False
    began = time.perf_counter()
    try:
        with anyio.fail_after(REQUEST_TIMEOUT):
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    req.error = f"HTTP {response.status_code}: {response.text[:200]}"
                    return req
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, ": ping" comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        req.error = f"error in stream: {json.dumps(chunk['error'])[:200]}"
                        return req
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        req.usage_tokens = int(usage["completion_tokens"])
                    for choice in chunk.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            if req.ttft is None:
                                req.ttft = time.perf_counter() - began
                            req.chunks += 1
                            parts.append(content)
    except TimeoutError:
        req.error = f"no end of stream within {REQUEST_TIMEOUT:.0f} s"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        req.error = f"{type(exc).__name__}: {exc}"
    req.text = "".join(parts)
    if req.error is None and not done:
        req.error = "stream ended without data: [DONE]"
    elif req.error is None and req.chunks == 0:
        req.error = "no content"
    return req


@dataclass
class Load:
    """One load phase: C clients x N requests against one server."""

    concurrency: int
    requests: list[Request] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests if r.error is None)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def ttft_p50_ms(self) -> float:
        return percentile([r.ttft * 1000.0 for r in self.requests if r.ttft is not None], 50)

    @property
    def errors(self) -> int:
        return sum(1 for r in self.requests if r.error is not None)


async def run_load(server: Server, concurrency: int, per_client: int, max_tokens: int) -> Load:
    """A closed loop: each of ``concurrency`` clients sends ``per_client`` requests back to back."""
    load = Load(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)

    async def client_loop(client: httpx.AsyncClient, i: int) -> None:
        for j in range(per_client):
            load.requests.append(await stream_one(client, server, (i * per_client + j) % len(PROMPTS), max_tokens))

    async with httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT, limits=limits) as client:
        began = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(concurrency):
                tg.start_soon(client_loop, client, i)
        load.wall_s = time.perf_counter() - began
    return load


def per_client(requests: int, concurrency: int) -> int:
    """N: each client's share of the ``requests`` sent at this concurrency (at least one)."""
    return max(1, requests // concurrency)


@dataclass
class Run:
    """One server's share of one round."""

    side: str
    round: int
    loads: dict[int, Load]
    load_s: float
    leftover: int = 0
    forced: bool = False
    warmup_error: str | None = None


async def run_side(side: str, rnd: int, model: Path, logdir: Path, args: argparse.Namespace) -> Run:
    with running(side, model, logdir) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT) as client:
            warm = await stream_one(client, server, 0, WARMUP_TOKENS)
        loads = {}
        for c in args.concurrency:
            loads[c] = await run_load(server, c, per_client(args.requests, c), args.max_tokens)
    return Run(side, rnd, loads, server.load_s, server.leftover, server.forced, warm.error)


# --------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if v == v]
    return statistics.median(clean) if clean else float("nan")


def side_figures(runs: Sequence[Run], c: int) -> tuple[float, float]:
    """(tokens/s, p50 TTFT ms) of one side at concurrency ``c``: medians over the rounds."""
    return median([r.loads[c].tokens_per_s for r in runs]), median([r.loads[c].ttft_p50_ms for r in runs])


def rounded(value: float, digits: int = 1) -> float | None:
    return None if value != value else round(value, digits)


def outputs_identical(runs: Sequence[Run]) -> tuple[bool, int]:
    """Whether every prompt got the same completion text everywhere; and how many prompts did not."""
    by_prompt: dict[int, set[str]] = {}
    for run in runs:
        for load in run.loads.values():
            for req in load.requests:
                if req.error is None:
                    by_prompt.setdefault(req.prompt, set()).add(req.text)
    differing = sum(1 for seen in by_prompt.values() if len(seen) > 1)
    return differing == 0, differing


def print_table(runs: Sequence[Run]) -> None:
    headers = ("round", "side", "C", "reqs", "errors", "chunks", "tokens", "wall s", "tok/s", "TTFT p50 ms", "load s")
    rows = []
    for run in runs:
        for c, load in run.loads.items():
            rows.append(
                (
                    str(run.round),
                    run.side,
                    str(c),
                    str(len(load.requests)),
                    str(load.errors),
                    str(sum(q.chunks for q in load.requests)),
                    str(load.tokens),
                    fmt(load.wall_s),
                    fmt(load.tokens_per_s),
                    fmt(load.ttft_p50_ms),
                    fmt(run.load_s),
                )
            )
    print_rows(headers, rows, left=2)


def null_result(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "serve", "tokens_per_s_ratio": None, "ttft_added_ms": None}
    result.update({"target_ratio": TARGET_RATIO, "meets_target": False, "quick": bool(args.quick)})
    result.update({"percentile": PERCENTILE, "skipped": None, "error": None})
    result.update(extra)
    return result


async def bench(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    began = time.monotonic()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="tether-bench-serve-") as tmp:
        for rnd in range(args.rounds):
            order = SIDES if rnd % 2 == 0 else SIDES[::-1]
            for side in order:
                runs.append(await run_side(side, rnd, model, Path(tmp), args))
    wall_s = time.monotonic() - began

    print(
        f"tether serve vs llama_cpp.server on {model.name}: {args.rounds} round(s), concurrency "
        f"{list(args.concurrency)}, {args.requests} request(s) per concurrency, max_tokens {args.max_tokens} "
        f"({wall_s:.1f} s){' (quick)' if args.quick else ''}"
    )
    print_table(runs)

    by_side = {side: [r for r in runs if r.side == side] for side in SIDES}
    result = null_result(args)
    ratios: dict[int, float] = {}
    added: dict[int, float] = {}
    for c in args.concurrency:
        t_rate, t_ttft = side_figures(by_side["tether"], c)
        b_rate, b_ttft = side_figures(by_side["baseline"], c)
        ratios[c] = t_rate / b_rate if b_rate > 0 else float("nan")
        added[c] = t_ttft - b_ttft
        result[f"tether_tokens_per_s_c{c}"] = rounded(t_rate)
        result[f"baseline_tokens_per_s_c{c}"] = rounded(b_rate)
        result[f"tether_ttft_p50_ms_c{c}"] = ms(t_ttft)
        result[f"baseline_ttft_p50_ms_c{c}"] = ms(b_ttft)
        result[f"tokens_per_s_ratio_c{c}"] = rounded(ratios[c], 3)
        result[f"ttft_added_ms_c{c}"] = ms(added[c])
    headline_ratio = min(ratios.values()) if all(v == v for v in ratios.values()) else float("nan")
    first = min(args.concurrency)
    result["tokens_per_s_ratio"] = rounded(headline_ratio, 3)
    result["ttft_added_ms"] = ms(added[first])
    result["meets_target"] = bool(headline_ratio == headline_ratio and headline_ratio >= TARGET_RATIO)
    identical, differing = outputs_identical(runs)
    errors = sum(load.errors for r in runs for load in r.loads.values()) + sum(1 for r in runs if r.warmup_error)
    leftover = sum(r.leftover for r in by_side["tether"])
    sources = {
        side: sorted({"usage" if q.usage_tokens is not None else "chunks" for r in rs for q in _requests(r)})
        for side, rs in by_side.items()
    }
    result.update(
        {
            "headline": f"tokens_per_s_ratio: min over concurrency {list(args.concurrency)}; "
            f"ttft_added_ms: concurrency {first}",
            "errors": errors,
            "leftover_processes": leftover,
            "forced_kills": sum(1 for r in runs if r.forced),
            "outputs_identical": identical,
            "prompts_with_differing_outputs": differing,
            "tokens_source": {side: "+".join(s) for side, s in sources.items()},
            "tether_load_s": rounded(median([r.load_s for r in by_side["tether"]]), 2),
            "baseline_load_s": rounded(median([r.load_s for r in by_side["baseline"]]), 2),
            "concurrency": list(args.concurrency),
            "rounds": args.rounds,
            "requests_per_concurrency": args.requests,
            "requests_per_client": {str(c): per_client(args.requests, c) for c in args.concurrency},
            "requests_per_side": sum(len(load.requests) for r in by_side["tether"] for load in r.loads.values()),
            "max_tokens": args.max_tokens,
            "model": model.name,
            "threads": THREADS,
            "n_ctx": N_CTX,
            "wall_s": round(wall_s, 1),
        }
    )
    print(f"percentiles: {PERCENTILE}; per side: the median over the rounds")
    for c in args.concurrency:
        print(
            f"C={c}: tokens/s tether/baseline = {result[f'tokens_per_s_ratio_c{c}']}, "
            f"TTFT p50 added = {result[f'ttft_added_ms_c{c}']} ms"
        )
    print(
        f"headline: tokens/s ratio {result['tokens_per_s_ratio']} (target {TARGET_RATIO}: "
        f"{'met' if result['meets_target'] else 'NOT met'}), TTFT added {result['ttft_added_ms']} ms at C={first}; "
        f"outputs identical: {identical}"
    )
    if errors or leftover:
        print(f"FAILURE: {errors} request error(s), {leftover} leftover process(es) after tether serve stopped")
        for r in runs:
            for load in r.loads.values():
                for q in load.requests:
                    if q.error:
                        print(f"  round {r.round} {r.side} C={load.concurrency} prompt {q.prompt}: {q.error}")
    return result


def _requests(run: Run) -> Iterator[Request]:
    for load in run.loads.values():
        yield from (q for q in load.requests if q.error is None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both servers (default 3)")
    parser.add_argument(
        "--requests", type=int, default=8, help="R: requests per concurrency C, R // C per client (default 8)"
    )
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"per request (default {MAX_TOKENS})")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=list(CONCURRENCY), help="client counts (default 1 4)"
    )
    parser.add_argument("--quick", action="store_true", help="1 round, R=4, 32 tokens (CI)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.max_tokens = 1, 4, QUICK_MAX_TOKENS
    if args.rounds < 1 or args.requests < 1 or args.max_tokens < 1 or min(args.concurrency) < 1:
        parser.error("--rounds, --requests, --max-tokens and --concurrency must be at least 1")
    args.concurrency = tuple(args.concurrency)
    try:
        model = default_model_path()
    except DefaultModelMissing as exc:
        print(f"skipped: {exc}")
        print(json.dumps(null_result(args, skipped=str(exc))))
        return 0
    with private_tether_dirs("tether-bench-serve-"):
        try:
            result = anyio.run(bench, args, model)
        except ServerFailed as exc:
            print(f"FAILURE: {exc}; its log ends with:\n{exc.tail}")
            last = " | ".join(line.strip() for line in exc.tail.splitlines()[-3:] if line.strip())
            print(json.dumps(null_result(args, error=f"{exc}; log: {last}" if last else str(exc))))
            return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
