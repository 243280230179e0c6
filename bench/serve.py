"""Serving benchmark: ``tether serve`` against llama-cpp-python's OpenAI server and llama.cpp's own C++
``llama-server``, same GGUF, same load.

All three serve the built-in default model (``tether.models.default_model_path()``, SmolLM2-135M-Instruct) on
127.0.0.1, each started as a subprocess on a free port, one at a time (never two at once: the machine may have two
cores), with 2 threads, greedy sampling and a context of 2048 tokens per sequence:

- tether: ``python -m tether serve --port P --n-ctx 2048 --threads 2 --parallel 8`` (no ``--model``: the default
  model, the same file; ``--parallel 8`` is ``PARALLEL``, as many sequences as llama-server's slots). Ready when
  ``GET /readyz`` returns 200 (503 while loading). Stopped with SIGTERM, the exit awaited (bounded; SIGKILL after
  it, counted in ``forced_kills``). Before the stop the bench snapshots the server's descendants (psutil); after it
  (and a 2 s grace for exits under way), ``leftover_processes`` counts those still running plus any process whose
  command line names ``tether.runner`` and either ``--worker=<server pid>`` or the server as its parent. It must be
  0 (promise 6); the bench kills what it counted.
- baseline (``llama_cpp.server`` in the table): ``python -m llama_cpp.server --model PATH --n_ctx 2048 --n_threads 2
  --n_threads_batch 2 --n_batch 512 --seed 0 --interrupt_requests false --port P --host 127.0.0.1``. Ready when
  ``GET /v1/models`` returns 200. Stopped with SIGTERM, then SIGKILL after the bound. ``--interrupt_requests
  false`` is required for a fair concurrent load: by default llama_cpp.server ends a streaming response early (it
  sends ``[DONE]`` after the current token) as soon as another request is waiting for the model, so at concurrency
  4 most streams would be cut short. Everything else is the server as shipped (``verbose`` included). It serves one
  request at a time.
- llama-server (``llama_server`` in the JSON keys): llama.cpp's C++ server, built from the llama.cpp vendored in the
  llama-cpp-python 0.3.36 sdist (the same kernels as ``llama_cpp``; ``bench/llama_server.py`` finds or builds it in
  ``~/.cache/tether-bench``): ``llama-server -m PATH --host 127.0.0.1 --port P -t 2 -tb 2 -c 16384 -np 8 -b 512 -fa
  off --seed 0 --temp 0 --no-webui --cache-reuse 256``. ``-np 8`` gives it 8 slots decoded together (continuous
  batching, its default) and ``-c`` is the total context, ``PARALLEL * 2048``: with an explicit ``-np`` the KV cache
  is not unified, so each slot gets 2048 tokens, the others' per-sequence context. ``-fa off``: its default is
  ``auto``, which turns flash attention on for this CPU, while ``llama_cpp`` (tether's engine, llama_cpp.server)
  builds its contexts without it; with it on, the greedy texts drift from the others' after some tokens (observed on 5
  of the 8 prompts at 32 tokens) and the comparison would be of attention kernels, not servers. ``--no-webui``:
  nothing but the API. It is built without curl, so it cannot download anything; the model is a local path. Its prompt
  cache stays at its default (``cache_prompt`` on: a slot keeps its last prompt's KV and a new request reuses the
  common prefix; idle slots are saved to the RAM prompt cache, ``--cache-ram`` 8192 MiB). Ready when ``GET /health``
  returns 200 (503 while it loads). Stopped with SIGTERM, then SIGKILL after the bound.

  Where it comes from: ``--quick`` never builds; it uses the cached binary when ``llama_server.find()`` finds one
  (it exists and ``--version`` runs), else the side is skipped. A full run builds it when missing (about 10 min on
  two cores, output to ``~/.cache/tether-bench/llama-server-build.log``) unless ``--no-build``. When it cannot be
  found, built or started, ``llama_server_skipped`` says why, its figures are null and the rest runs as before.

Server output goes to a log file in a temporary directory (its tail is in the error when a server fails to start).

Sampling is identical: greedy (``temperature: 0``), ``max_tokens`` 128 (``--quick``: 32), ``seed: 0``, and
``repeat_penalty: 1.0`` in the request body of both llama.cpp servers (llama_cpp.server accepts it as an extra field
and defaults to 1.1; llama-server's chat endpoint accepts it and defaults to 1.0; tether's engine uses 1.0; at
temperature 0 the penalty still changes which token is the argmax). Other sampling fields are left at their
defaults: greedy sampling makes them irrelevant. ``outputs_identical`` checks tether against llama_cpp.server:
every prompt's completion text must be the same on both sides in every round and at every concurrency;
``llama_server_outputs_identical`` checks tether against llama-server the same way (checks, reported, not
figures, and never a failure: a prefix reused from the KV cache of a different previous request, or a batch of
several sequences, can change the float rounding and so, rarely, a greedy choice; and llama-server renders the
chat template with its own Jinja engine).

Requests: ``POST /v1/chat/completions`` with ``stream: true``, ``stream_options: {"include_usage": true}``, a
fixed system message and one of ``PROMPTS`` (stories: answers longer than ``max_tokens``), ``model`` = the first id
of the server's ``GET /v1/models``. At concurrency ``C``, ``C`` clients each send ``N = max(1, R // C)`` requests
back to back (a closed loop; ``R`` = ``--requests``, default 16, so every concurrency sends the same work when ``C``
divides ``R``), request ``j`` of client ``i`` with prompt ``PROMPTS[(i * N + j) % len(PROMPTS)]``: the same
prompts in the same order on every side. ``R`` is 16 rather than 8 so that at C=8 each client sends two requests,
not one: with one, the phase is a single wave of 8 simultaneous arrivals, its TTFT p99 is the maximum of 8 samples
and no request arrives while the server is already generating for the others (what a batching server's admission
between steps is for). 16 doubles the run time: one round of the three servers takes about 5 min on two cores
(llama_cpp.server's C=4 and C=8 phases, one request at a time, are 2 of them), the default 3 rounds about 15 min.
One ``httpx.AsyncClient`` per load phase, all clients in one anyio task group. Each server gets one untimed warm-up
request first (``PROMPTS[0]``, 16 tokens). Per request, stamped with ``time.perf_counter()``:

- *TTFT* = from just before the request is sent to the first SSE line ``data: {...}`` whose
  ``choices[0].delta.content`` is non-empty (role-only and empty chunks do not count);
- *inter-token gaps* = the times between successive content chunks of the stream (one chunk is one token on all
  three servers, except where a server holds back a partial UTF-8 character or a possible stop-string prefix);
- *output tokens* = ``usage.completion_tokens`` when the server sends a usage chunk, else the number of content
  chunks (llama_cpp.server sends no usage in streams). ``tokens_source`` says which each side used;
- an *error* = a status other than 200, an ``error`` object in the stream, a stream that ends without
  ``data: [DONE]``, no content at all, or an exception (timeout: 120 s per request). ``errors`` (all sides) must be
  0; ``errors_by_side`` splits it.

Per (round, side, concurrency): aggregate output tokens/s = the requests' output tokens / the wall time of the load
phase (first request sent -> last stream ended); the p50 and p99 of the requests' TTFTs; the p99 of the
inter-token gaps, pooled over the phase's requests (``itl``). llama_cpp.server serialises generation (one request at
a time), so its TTFT at C>1 is mostly queueing behind the other clients' requests while its gaps stay those of one
stream; a batching server (llama-server, tether with ``--parallel``) starts the queued requests between steps, so
its TTFT stays short and its gaps grow with the batch. TTFT at C>1 measures throughput as much as latency.

Rounds: ``--rounds`` (default 3; ``--quick``: 1). Each round runs every side, one after the other (start, warm
up, concurrency 1, 4, 8, stop), the order rotating (round 0: baseline, tether, llama-server; round 1: tether,
llama-server, baseline; ...; with llama-server skipped: baseline and tether alternating), so a slow stretch of a
noisy machine falls on every side. Each side's figure is the median over the rounds of its per-round figures. Then,
per concurrency C:

- ``tokens_per_s_ratio_cC`` = tether tokens/s / baseline tokens/s (medians over the rounds);
- ``ttft_added_ms_cC`` = tether p50 TTFT - baseline p50 TTFT (medians over the rounds);
- ``tokens_per_s_ratio_vs_llama_server_cC`` = tether tokens/s / llama-server tokens/s (null when skipped);
- per side (``baseline``, ``tether``, ``llama_server``): ``SIDE_tokens_per_s_cC``, ``SIDE_ttft_p50_ms_cC``,
  ``SIDE_ttft_p99_ms_cC``, ``SIDE_itl_p99_ms_cC``.

Headlines: ``tokens_per_s_ratio`` = the minimum over the concurrencies of the ratio to llama_cpp.server (the target
must hold at every load); ``ttft_added_ms`` = the figure at the lowest concurrency, 1 by default (no queueing: what
the server adds to one request's first token). ``meets_target`` = ``tokens_per_s_ratio >= target_ratio`` (0.98).
Against the C++ server: ``tokens_per_s_ratio_vs_llama_server_c1``/``_c4``/``_c8``, ``ttft_p50_ms_c8`` (tether)
beside ``llama_server_ttft_p50_ms_c8``: how close tether gets to llama.cpp's own batching server.

Reading the figures: on a shared two-core machine another program's burst can halve one phase's rate (llama.cpp's
threads wait for each other at every step, so a stolen core costs far more than its share); the per-round table
shows such a phase, and the median over the rounds drops it. Observed on such a machine: llama_cpp.server's
aggregate rate at concurrency 4 stays well below its rate at concurrency 1 and its rate varies from phase to phase
far more than tether's, with the machine otherwise idle (it then uses about 1.2 of the 2 cores instead of 1.9); so
the C>1 ratios to it say how each server copes with queued requests, not what tether's layers cost, and the
headline minimum is normally the C=1 ratio.

Statistics: p50/p99 = ``statistics.quantiles(samples, n=100, method="inclusive")`` (``benchstats.percentile``).
Runner records and runner logs go to a private temporary ``TETHER_RUNTIME_DIR`` / ``TETHER_LOG_DIR`` (removed at
the end). Without the default model (``DefaultModelMissing``) the figures are null and ``skipped`` says why (exit
0). A tether or llama_cpp.server that does not start is an error: null figures, ``error`` says why, exit 1 (a
llama-server that does not start only skips its side).

``--quick`` (for CI): 1 round, concurrency 1 and 8, ``R`` = 4 (4 requests at C=1, 1 per client at C=8),
``max_tokens`` 32 (``"quick": true``); its figures are only a smoke test. llama-server runs in it only when
already built; it starts in under a second and its three phases take a few seconds, so the whole quick run,
three servers, takes about 25-35 s on two cores (CI allows 190 s). Without a cached binary the quick run skips it.

**Workloads** (``--workloads``, default all three; tether and llama-server run each, llama_cpp.server only
``distinct``). Each runs at every concurrency in turn, on a server that has served the workloads before it (so
caches are warm, as in a deployment):

- ``distinct``: the requests above (a short system message, one of ``PROMPTS``; ``max_tokens`` 128);
- ``shared_prefix``: ``LONG_SYSTEM`` (a deployed assistant's instructions, ~580 tokens with the chat template)
  then one of ``QUESTIONS``, ``max_tokens`` 64; each concurrency asks its own 16 questions (the same ``R``
  requests as ``distinct``), so only the system prompt repeats;
- ``multi_turn``: ``CONVERSATIONS`` (24) conversations of ``TURNS`` (6) turns each, ``max_tokens`` 48, every turn
  resending the whole history (the server's own earlier answers) plus a follow-up; client ``i`` of ``C`` holds the
  conversations ``k % C == i`` and sends turn 1 of each, then turn 2 of each, ...: more conversations than slots,
  interleaved, so a conversation's cells are overwritten (or saved to RAM) between its turns. Each concurrency has
  its own 24 topics.

Keys per workload ``W`` and concurrency ``N``: ``tokens_per_s_ratio_vs_llama_server_W_cN``, ``tokens_per_s_W_cN``,
``llama_server_tokens_per_s_W_cN``, ``ttft_p50_ms_W_cN`` (tether), ``llama_server_ttft_p50_ms_W_cN``; at the highest
concurrency ``itl_p99_ms_W_cN`` and ``llama_server_itl_p99_ms_W_cN``; ``prefix_hit_tokens_share_W`` (and
``llama_server_prefix_hit_tokens_share_W``): the prompt tokens the server's cache supplied over all prompt tokens,
from ``usage.prompt_tokens_details.cached_tokens`` (llama-server: that, or ``timings.cache_n``).
``distinct_prompts_differing_across_phases`` (and ``llama_server_...``): how many of ``distinct``'s prompts got
more than one greedy text from the same server across its phases (other cache states, other neighbours): what
prefix reuse costs in exactness, measured the same way on both. ``llama-server`` runs with its best settings for
these: ``cache_prompt`` on (its default), ``--cache-reuse 256`` (reuse by KV shifting too), its default RAM cache.

``--variants logprobs json_schema`` (default ``json_schema``; ``--quick``: none): after each batching server's load
phases (tether, llama-server), the highest concurrency again with that option in every request (``logprobs: true,
top_logprobs: 5``; ``response_format`` ``json_schema`` with ``STORY``, the stories as a JSON object whose story has at
least ``STORY_MIN_CHARS`` characters, so that a structured answer runs to ``max_tokens`` as a plain one does and the
ratio is the grammar's cost per token, not a shorter answer's larger share of prefill);
``SIDE_tokens_per_s_VARIANT_cC``, ``SIDE_VARIANT_vs_plain_cC`` (its rate over the same side's plain rate: the option's
cost) and ``tokens_per_s_ratio_vs_llama_server_VARIANT_cC``; ``json_schema_over_plain`` (tether) and
``llama_server_json_schema_over_plain``: that ratio for json_schema. The plain phases are unchanged by it.

Sides: tether and llama-server by default (``--sides`` adds llama_cpp.server, whose keys are the ``baseline_`` and
``tokens_per_s_ratio_cC`` ones); ``--quick`` runs all three.

Another model: ``--model NAME|FILE`` (a pulled model's name, or a GGUF file; ``--chat-template NAME`` for one
without a template, as Gemma 3 270M's base model), for tether and llama-server. ``--deterministic``: tether serves
with ``--deterministic`` (``bench/deterministic_cost.py`` runs it with and without, alternating, and compares).
``--conversations``/``--turns``: a shorter ``multi_turn``.

Run: ``.venv/bin/python bench/serve.py [--quick] [--no-build] [--rounds N] [--workloads ...] [--variants ...]``.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil

import llama_server
from benchstats import PERCENTILE, closed_loop, emit, fmt, ms, percentile, print_rows, private_tether_dirs
from tether.errors import InvalidModel
from tether.models import default_model_path, named_or_file

SIDES = ("baseline", "tether", "llama_server")
LABELS = {"baseline": "llama_cpp.server", "tether": "tether", "llama_server": "llama-server"}
CONCURRENCY = (1, 4, 8)
QUICK_CONCURRENCY = (1, 8)  # --quick: one client and a batch of them, the two paths
PARALLEL = 8  # llama-server's slots, and tether's --parallel when it has one
TARGET_RATIO = 0.98
N_CTX = 2048  # per sequence
THREADS = 2
N_BATCH = 512
SEED = 0
MAX_TOKENS = 128
QUICK_MAX_TOKENS = 32
REQUESTS = 16
QUICK_REQUESTS = 4
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
STORY_MIN_CHARS = 800  # ~180 tokens of story: a json_schema answer is as long as a plain one (max_tokens 128)
WORKLOADS = ("distinct", "shared_prefix", "multi_turn")
# shared_prefix: one long system prompt (~600 tokens) before every request's own question, as a deployed assistant's
_RULES = (
    "greet the visitor by name when they give one",
    "answer in plain English, in at most three short paragraphs",
    "mention the exhibit that fits the question, with its room number",
    "never invent opening hours, prices or dates you were not given",
    "say so when you do not know, and suggest asking at the front desk",
    "keep a friendly tone, with no jokes about the sea's dangers",
    "point families with children to the interactive rooms on the ground floor",
    "remind visitors that photographs without flash are welcome everywhere",
    "describe every ship model with its name, its year and its home port",
    "explain nautical words the first time you use them",
    "suggest the guided tour, which starts every hour in the main hall",
    "recommend the cafe on the roof terrace when someone asks about food",
)
_ROOMS = (
    "the lighthouse room, with a working lens from 1887",
    "the hall of anchors, forty anchors from twelve centuries",
    "the navigation room, with compasses, sextants and star charts",
    "the sail loft, where sails are still sewn by hand on Saturdays",
    "the knot bench, where visitors learn six knots in ten minutes",
    "the map gallery, with the first charts of the northern coast",
    "the whale room, with the skeleton of a fin whale found in 1921",
    "the storm theatre, a film about the great storm of the old harbor",
    "the harbor model, the whole port in 1900 at one to two hundred",
    "the shipyard, where a fishing boat is being built the old way",
)
LONG_SYSTEM = (
    "You are Harbor, the visitor assistant of the Northern Maritime Museum. Follow these rules. "
    + " ".join(f"Rule {i + 1}: {rule}." for i, rule in enumerate(_RULES))
    + " The museum's rooms are: "
    + "; ".join(f"room {i + 1}, {room}" for i, room in enumerate(_ROOMS))
    + ". "
    + " ".join(
        f"About room {i + 1}: it is on floor {i % 3}, it takes about {10 + 5 * (i % 4)} minutes to see, it has "
        f"benches, and its guide explains {room.split(',')[0]} every half hour."
        for i, room in enumerate(_ROOMS[:4])
    )
)
_SUBJECTS = (
    "lighthouses",
    "anchors",
    "compasses",
    "sails",
    "knots",
    "sea charts",
    "whales",
    "storms",
    "harbors",
    "fishing boats",
    "tides",
    "sextants",
    "ship bells",
    "figureheads",
    "rope making",
    "steam ships",
)
QUESTIONS = tuple(  # shared_prefix's own questions: 48, so each concurrency asks 16 the others do not
    f"{opening} {subject}?"
    for opening in ("What can I learn here about", "Which room should I visit for", "Tell me one fact about")
    for subject in _SUBJECTS
)
CONVERSATIONS = 24  # multi_turn: more conversations than slots, interleaved, each turn resending its history
TURNS = 6
QUICK_CONVERSATIONS, QUICK_TURNS = 8, 2
_CITIES = (
    "Lisbon",
    "Oslo",
    "Genoa",
    "Bergen",
    "Valparaiso",
    "Hamburg",
    "Marseille",
    "Halifax",
    "Cadiz",
    "Gdansk",
    "Dubrovnik",
    "Porto",
    "Antwerp",
    "Naples",
    "Tallinn",
    "Cork",
)
_ASPECTS = ("history", "food", "harbor", "architecture", "weather")
TOPICS = tuple(f"the {aspect} of {city}" for aspect in _ASPECTS for city in _CITIES)  # 24 per concurrency
FOLLOW_UPS = (
    "Tell me about {topic}.",
    "Why is that so?",
    "Give me one example.",
    "How has it changed over time?",
    "What should a visitor see first?",
    "Summarise our conversation in one sentence.",
)
WORKLOAD_MAX_TOKENS = {"shared_prefix": 64, "multi_turn": 48}  # distinct: --max-tokens
READY_TIMEOUT = 120.0  # start-up and model load
STOP_TIMEOUT = 15.0  # SIGTERM -> exit, then SIGKILL
REQUEST_TIMEOUT = 120.0
POLL_INTERVAL = 0.1


class ServerFailed(RuntimeError):
    """A server did not start (or did not list a model); ``tail`` is the end of its log."""

    def __init__(self, message: str, tail: str = "") -> None:
        super().__init__(message)
        self.tail = tail

    def one_line(self) -> str:
        last = " | ".join(line.strip() for line in self.tail.splitlines()[-3:] if line.strip())
        return f"{self}; log: {last}" if last else str(self)


# --------------------------------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """What the sides' command lines depend on, found once before the rounds."""

    model: Path
    llama_server: Path | None  # the binary, None when that side is skipped
    threads: int | None = THREADS  # None: each server's own default thread count (--cpu-hog)
    tether_args: tuple[str, ...] = ()  # --model, --chat-template, --deterministic: added to tether's command
    chat_template: str | None = None  # llama-server's --chat-template (a built-in name), with --chat-template


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """``count`` processes that busy-loop at normal priority until the block ends (killed and reaped then)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    if hogs:
        print(f"cpu hog: {count} busy-looping process(es) beside the servers", flush=True)
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def free_port() -> int:
    """A port nobody listens on right now (the kernel's pick; a tiny race with other programs, harmless here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(side: str, setup: Setup, port: int) -> tuple[list[str], str]:
    """The command line and the readiness path of one side (see the module docstring for why each flag)."""
    if side == "tether":
        cmd = [sys.executable, "-m", "tether", "serve", "--port", str(port), "--n-ctx", str(N_CTX)]
        cmd += ["--threads", str(setup.threads)] if setup.threads else []
        cmd += ["--parallel", str(PARALLEL), *setup.tether_args]
        return cmd, "/readyz"
    if side == "llama_server":
        assert setup.llama_server is not None
        cmd = [str(setup.llama_server), "-m", str(setup.model), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-t", str(setup.threads), "-tb", str(setup.threads)] if setup.threads else []
        cmd += ["-c", str(PARALLEL * N_CTX), "-np", str(PARALLEL)]
        cmd += [
            "-b",
            str(N_BATCH),
            "-fa",
            "off",
            "--seed",
            str(SEED),
            "--temp",
            "0",
            "--no-webui",
            "--cache-reuse",
            "256",
        ]
        cmd += ["--chat-template", setup.chat_template] if setup.chat_template else []
        return cmd, "/health"
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(setup.model), "--n_ctx", str(N_CTX)]
    if setup.threads:
        cmd += ["--n_threads", str(setup.threads), "--n_threads_batch", str(setup.threads)]
    cmd += ["--n_batch", str(N_BATCH)]
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
    label = LABELS[server.side]
    with httpx.Client(base_url=server.base_url, timeout=5.0) as client:
        while True:
            if server.proc.poll() is not None:
                raise ServerFailed(
                    f"{label} exited with status {server.proc.returncode} before it was ready",
                    log_tail(server.log),
                )
            with contextlib.suppress(httpx.TransportError):
                if client.get(ready_path).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise ServerFailed(
                    f"{label} not ready after {READY_TIMEOUT:.0f} s ({ready_path} never returned 200)",
                    log_tail(server.log),
                )
            time.sleep(POLL_INTERVAL)
        server.load_s = time.monotonic() - began
        response = client.get("/v1/models")
        models = (response.json().get("data") or []) if response.status_code == 200 else []
        if not models:
            raise ServerFailed(f"{label} lists no model: GET /v1/models -> {response.status_code}")
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
def running(side: str, setup: Setup, logdir: Path) -> Iterator[Server]:
    """Start one server, wait until it is ready, yield it, stop it (always)."""
    port = free_port()
    cmd, ready_path = server_command(side, setup, port)
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
    stamps: list[float] = field(default_factory=list)  # perf_counter() of each content chunk
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # of them, those the server's prompt cache had (usage or llama-server timings)

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def gaps(self) -> list[float]:
        """Seconds between successive content chunks."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


STORY = {  # the json_schema variant's schema: the stories as JSON, long enough to run to max_tokens as plain ones do
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "story": {"type": "string", "minLength": STORY_MIN_CHARS},
    },
    "required": ["title", "story"],
}
VARIANTS: dict[str, dict[str, Any]] = {  # request fields per variant: the cost of each option on tokens/s
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}}},
}
VARIANT_SIDES = ("tether", "llama_server")  # the batching servers (llama_cpp.server serves one at a time)


def chat_body(prompt: str, max_tokens: int, model: str) -> dict[str, Any]:
    """A greedy, seeded, streamed chat completion with usage: the request every bench here times."""
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def request_body(
    server: Server, prompt: str, max_tokens: int, variant: str = "plain", system: str = SYSTEM
) -> dict[str, Any]:
    body = chat_body(prompt, max_tokens, server.model_id)
    body["messages"][0]["content"] = system
    if server.side in ("baseline", "llama_server"):
        body["repeat_penalty"] = 1.0  # llama_cpp.server defaults to 1.1; tether's engine uses 1.0
    return body | VARIANTS[variant]


async def stream_one(
    client: httpx.AsyncClient, server: Server, index: int, max_tokens: int, variant: str = "plain"
) -> Request:
    """Send one streaming chat completion and read it to ``[DONE]``, stamping every content chunk."""
    req = Request(index)
    await read_stream(client, request_body(server, PROMPTS[index], max_tokens, variant), req)
    return req


async def read_stream(client: httpx.AsyncClient, body: dict[str, Any], req: Request) -> float:
    """POST ``body`` (a streaming chat completion) and read it to ``[DONE]`` into ``req``: every content chunk
    stamped, the text, the usage, or the error. Returns when it was sent (``time.perf_counter()``)."""
    parts: list[str] = []
    done = False
    began = time.perf_counter()
    try:
        with anyio.fail_after(REQUEST_TIMEOUT):
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    req.error = f"HTTP {response.status_code}: {response.text[:300]}"
                    return began
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, ": ping" comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        req.error = f"error in stream: {json.dumps(chunk['error'])[:300]}"
                        return began
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        req.usage_tokens = int(usage["completion_tokens"])
                    if usage:
                        read_prompt_usage(usage, chunk.get("timings"), req)
                    for choice in chunk.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            now = time.perf_counter()
                            if req.ttft is None:
                                req.ttft = now - began
                            req.stamps.append(now)
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
    return began


def read_prompt_usage(usage: dict[str, Any], timings: dict[str, Any] | None, req: Request) -> None:
    """The prompt's tokens and how many the server's cache had: OpenAI's ``prompt_tokens_details.cached_tokens``
    (tether; llama-server too where it reports it), else llama-server's ``timings.cache_n``."""
    if usage.get("prompt_tokens") is not None:
        req.prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        req.cached_tokens = int(details["cached_tokens"])
    elif timings and timings.get("cache_n") is not None:
        req.cached_tokens = int(timings["cache_n"])


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

    def ttft_ms(self, pct: int) -> float:
        return percentile([r.ttft * 1000.0 for r in self.requests if r.ttft is not None], pct)

    def itl_ms(self, pct: int) -> float:
        """A percentile of the gaps between content chunks, pooled over the phase's requests."""
        return percentile([g * 1000.0 for r in self.requests if r.error is None for g in r.gaps], pct)

    @property
    def errors(self) -> int:
        return sum(1 for r in self.requests if r.error is not None)

    @property
    def prompt_counts(self) -> tuple[int, int]:
        """(cached, all) prompt tokens over the requests that reported both."""
        reported = [r for r in self.requests if r.prompt_tokens is not None and r.cached_tokens is not None]
        return sum(r.cached_tokens or 0 for r in reported), sum(r.prompt_tokens or 0 for r in reported)


def phase_client(server: Server, concurrency: int) -> httpx.AsyncClient:
    """One load phase's client: a keep-alive connection for every concurrent client."""
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    return httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT, limits=limits)


async def closed_loop_load(
    server: Server, concurrency: int, per_client: int, body_of: Callable[[int, int], tuple[int, dict[str, Any]]]
) -> Load:
    """A closed loop: each of ``concurrency`` clients sends ``per_client`` requests back to back; ``body_of(i, j)``
    is request ``j`` of client ``i``: its prompt's index and its body."""
    load = Load(concurrency)
    async with phase_client(server, concurrency) as client:

        async def send(i: int, j: int) -> None:
            index, body = body_of(i, j)
            req = Request(index)
            await read_stream(client, body, req)
            load.requests.append(req)

        load.wall_s = await closed_loop(concurrency, per_client, send)
    return load


async def run_load(server: Server, concurrency: int, per_client: int, max_tokens: int, variant: str = "plain") -> Load:
    """``distinct`` (and its variants): ``PROMPTS`` in turn, in a closed loop."""

    def body_of(i: int, j: int) -> tuple[int, dict[str, Any]]:
        index = (i * per_client + j) % len(PROMPTS)
        return index, request_body(server, PROMPTS[index], max_tokens, variant)

    return await closed_loop_load(server, concurrency, per_client, body_of)


async def run_shared_prefix(server: Server, concurrency: int, phase: int, args: argparse.Namespace) -> Load:
    """``shared_prefix``: ``LONG_SYSTEM`` + a question of this phase's own 16, in a closed loop."""
    n = per_client(args.requests, concurrency)
    per_phase = len(QUESTIONS) // len(CONCURRENCY)

    def body_of(i: int, j: int) -> tuple[int, dict[str, Any]]:
        index = (phase % len(CONCURRENCY)) * per_phase + (i * n + j) % per_phase
        tokens = args.workload_tokens["shared_prefix"]
        return index, request_body(server, QUESTIONS[index], tokens, system=LONG_SYSTEM)

    return await closed_loop_load(server, concurrency, n, body_of)


async def run_multi_turn(server: Server, concurrency: int, phase: int, args: argparse.Namespace) -> Load:
    """``multi_turn``: ``args.conversations`` conversations of ``args.turns`` turns, each turn the whole history
    (the server's own earlier answers included) and a follow-up. Client ``i`` holds the conversations ``k`` with
    ``k % C == i`` and sends turn 1 of each, then turn 2 of each, ...: between two turns of a conversation the
    others run, so with more conversations than slots its cells have been overwritten (or saved) meanwhile."""
    load = Load(concurrency)
    topics = TOPICS[(phase % len(CONCURRENCY)) * args.conversations :][: args.conversations]
    histories: list[list[dict[str, str]]] = [[{"role": "system", "content": SYSTEM}] for _ in topics]

    async def client_loop(client: httpx.AsyncClient, i: int) -> None:
        mine = [k for k in range(len(topics)) if k % concurrency == i]
        for turn in range(args.turns):
            for k in mine:
                question = FOLLOW_UPS[turn % len(FOLLOW_UPS)].format(topic=topics[k])
                histories[k].append({"role": "user", "content": question})
                body = request_body(server, "", args.workload_tokens["multi_turn"])
                body["messages"] = list(histories[k])
                req = Request(k * args.turns + turn)
                await read_stream(client, body, req)
                histories[k].append({"role": "assistant", "content": req.text})
                load.requests.append(req)

    async with phase_client(server, concurrency) as client:
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
    variants: dict[str, Load] = field(default_factory=dict)  # at the highest concurrency, one per --variants
    workloads: dict[str, dict[int, Load]] = field(default_factory=dict)  # shared_prefix, multi_turn: per C

    def workload(self, name: str) -> dict[int, Load]:
        """The load phases of a workload, per concurrency (``distinct``'s are ``loads``)."""
        return self.loads if name == "distinct" else self.workloads.get(name, {})


async def run_side(side: str, rnd: int, setup: Setup, logdir: Path, args: argparse.Namespace) -> Run:
    """One server's round: start, warm up, each concurrency in turn, stop (a progress line per phase)."""
    with running(side, setup, logdir) as server:
        print(f"round {rnd} {LABELS[side]}: ready in {server.load_s:.2f} s", flush=True)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT) as client:
            warm = await stream_one(client, server, 0, WARMUP_TOKENS)
        loads: dict[int, Load] = {}
        workloads: dict[str, dict[int, Load]] = {}
        for name in args.workloads if side in VARIANT_SIDES else ("distinct",):
            phases = loads if name == "distinct" else workloads.setdefault(name, {})
            for phase, c in enumerate(args.concurrency):
                if name == "distinct":
                    load = await run_load(server, c, per_client(args.requests, c), args.max_tokens)
                elif name == "shared_prefix":
                    load = await run_shared_prefix(server, c, phase, args)
                else:
                    load = await run_multi_turn(server, c, phase, args)
                phases[c] = load
                cached, prompt = load.prompt_counts
                print(
                    f"round {rnd} {LABELS[side]}: {name} C={c} {len(load.requests)} request(s), {load.errors} "
                    f"error(s), {fmt(load.tokens_per_s)} tokens/s, TTFT p50 {fmt(load.ttft_ms(50))} ms, "
                    f"prompt tokens cached {cached}/{prompt}",
                    flush=True,
                )
        variants = {}
        top = max(args.concurrency)
        for variant in args.variants if side in VARIANT_SIDES else ():
            variants[variant] = load = await run_load(
                server, top, per_client(args.requests, top), args.max_tokens, variant
            )
            print(
                f"round {rnd} {LABELS[side]}: {variant} C={top} {load.errors} error(s), "
                f"{fmt(load.tokens_per_s)} tokens/s",
                flush=True,
            )
    return Run(side, rnd, loads, server.load_s, server.leftover, server.forced, warm.error, variants, workloads)


def round_order(sides: Sequence[str], rnd: int) -> list[str]:
    """The sides rotated by the round: each side leads in turn (two sides alternate)."""
    k = rnd % len(sides)
    return [*sides[k:], *sides[:k]]


# --------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if v == v]
    return statistics.median(clean) if clean else float("nan")


@dataclass(frozen=True)
class Figures:
    """One side at one concurrency: medians over the rounds (nan without runs)."""

    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p99_ms: float


def side_figures(runs: Sequence[Run], c: int, workload: str = "distinct") -> Figures:
    loads = [r.workload(workload)[c] for r in runs if c in r.workload(workload)]
    return Figures(
        median([load.tokens_per_s for load in loads]),
        median([load.ttft_ms(50) for load in loads]),
        median([load.ttft_ms(99) for load in loads]),
        median([load.itl_ms(99) for load in loads]),
    )


def rounded(value: float, digits: int = 1) -> float | None:
    return None if value != value else round(value, digits)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


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


def all_loads(run: Run) -> Iterator[tuple[str, Load]]:
    """Every load phase of a run, with its workload's name (a variant's is its variant's)."""
    for name in WORKLOADS:
        for load in run.workload(name).values():
            yield name, load
    for variant, load in run.variants.items():
        yield variant, load


def print_table(runs: Sequence[Run]) -> None:
    headers = ["round", "side", "workload", "C", "reqs", "errors", "chunks", "tokens", "wall s", "tok/s"]
    headers += ["TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms", "cached", "load s"]
    rows = []
    for run in runs:
        for name, load in all_loads(run):
            cached, prompt = load.prompt_counts
            rows.append(
                (
                    str(run.round),
                    LABELS[run.side],
                    name,
                    str(load.concurrency),
                    str(len(load.requests)),
                    str(load.errors),
                    str(sum(q.chunks for q in load.requests)),
                    str(load.tokens),
                    fmt(load.wall_s),
                    fmt(load.tokens_per_s),
                    fmt(load.ttft_ms(50)),
                    fmt(load.ttft_ms(99)),
                    fmt(load.itl_ms(99)),
                    f"{cached}/{prompt}",
                    fmt(run.load_s),
                )
            )
    print_rows(headers, rows, left=2)


def null_result(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "serve", "tokens_per_s_ratio": None, "ttft_added_ms": None}
    result.update({"target_ratio": TARGET_RATIO, "meets_target": False, "quick": bool(args.quick)})
    result.update({"percentile": PERCENTILE, "skipped": None, "error": None, "llama_server_skipped": None})
    result.update(extra)
    return result


def locate_llama_server(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """The llama-server binary, or None and why: the cached one; else built, unless --quick or --no-build."""
    binary = llama_server.find()
    if binary is not None:
        return binary, None
    if args.quick or args.no_build:
        why = "--quick never builds" if args.quick else "--no-build was given"
        return None, (
            f"llama-server is not built ({llama_server.binary_path()} is missing or does not run) and {why}: "
            "build it with `.venv/bin/python bench/llama_server.py --build` (about 10 min on two cores) "
            "or a full run of bench/serve.py"
        )
    log = llama_server.default_log()
    print(f"building llama-server from llama.cpp (about 10 min on two cores); log: {log}", flush=True)
    try:
        binary = llama_server.build(log)
    except llama_server.BuildFailed as exc:
        print(f"llama-server skipped: {exc}")
        return None, f"llama-server could not be built: {str(exc).splitlines()[0]}"
    print(f"built {binary}")
    return binary, None


async def bench(args: argparse.Namespace, setup: Setup, llama_skipped: str | None) -> dict[str, Any]:
    began = time.monotonic()
    runs: list[Run] = []
    sides = [side for side in SIDES if side != "llama_server" or setup.llama_server is not None]
    sides = [side for side in sides if side in args.sides]
    with tempfile.TemporaryDirectory(prefix="tether-bench-serve-") as tmp:
        for rnd in range(args.rounds):
            for side in round_order(sides, rnd):
                try:
                    runs.append(await run_side(side, rnd, setup, Path(tmp), args))
                except ServerFailed as exc:
                    if side != "llama_server":
                        raise
                    print(f"llama-server skipped: {exc}; its log ends with:\n{exc.tail}")
                    llama_skipped = f"llama-server did not start: {exc.one_line()}"
                    sides.remove(side)  # not in the later rounds; its earlier runs are dropped
                    runs = [r for r in runs if r.side != side]
    wall_s = time.monotonic() - began

    present = " and llama-server" if "llama_server" in sides else f" (llama-server skipped: {llama_skipped})"
    print(
        f"tether serve vs llama_cpp.server{present} on {setup.model.name}: {args.rounds} round(s), concurrency "
        f"{list(args.concurrency)}, {args.requests} request(s) per concurrency, max_tokens {args.max_tokens}, "
        f"tether --parallel {PARALLEL} "
        f"({wall_s:.1f} s){' (quick)' if args.quick else ''}"
    )
    print_table(runs)

    by_side = {side: [r for r in runs if r.side == side] for side in SIDES}
    result = null_result(args, llama_server_skipped=llama_skipped)
    ratios: dict[int, float] = {}
    added: dict[int, float] = {}
    for c in args.concurrency:
        figs = {side: side_figures(by_side[side], c) for side in SIDES}
        t, b, ls = figs["tether"], figs["baseline"], figs["llama_server"]
        ratios[c] = ratio(t.tokens_per_s, b.tokens_per_s)
        added[c] = t.ttft_p50_ms - b.ttft_p50_ms
        for side, f in figs.items():
            result[f"{side}_tokens_per_s_c{c}"] = rounded(f.tokens_per_s)
            result[f"{side}_ttft_p50_ms_c{c}"] = ms(f.ttft_p50_ms)
            result[f"{side}_ttft_p99_ms_c{c}"] = ms(f.ttft_p99_ms)
            result[f"{side}_itl_p99_ms_c{c}"] = ms(f.itl_p99_ms)
        result[f"tokens_per_s_ratio_c{c}"] = rounded(ratios[c], 3)
        result[f"ttft_added_ms_c{c}"] = ms(added[c])
        result[f"tokens_per_s_ratio_vs_llama_server_c{c}"] = rounded(ratio(t.tokens_per_s, ls.tokens_per_s), 3)
    result["ttft_p50_ms_c8"] = result.get("tether_ttft_p50_ms_c8")
    result.setdefault("llama_server_ttft_p50_ms_c8", None)
    headline_ratio = min(ratios.values()) if all(v == v for v in ratios.values()) else float("nan")
    first = min(args.concurrency)
    result["tokens_per_s_ratio"] = rounded(headline_ratio, 3)
    result["ttft_added_ms"] = ms(added[first])
    result["meets_target"] = bool(headline_ratio == headline_ratio and headline_ratio >= TARGET_RATIO)
    identical, differing = outputs_identical(by_side["baseline"] + by_side["tether"])
    ls_identical: bool | None = None
    ls_differing: int | None = None
    if by_side["llama_server"]:
        ls_identical, ls_differing = outputs_identical(by_side["llama_server"] + by_side["tether"])
    top = max(args.concurrency)
    for variant in args.variants:
        for side in VARIANT_SIDES:
            rates = [r.variants[variant].tokens_per_s for r in by_side[side] if variant in r.variants]
            plain = result.get(f"{side}_tokens_per_s_c{top}")
            rate = median(rates) if rates else float("nan")
            result[f"{side}_tokens_per_s_{variant}_c{top}"] = rounded(rate)
            result[f"{side}_{variant}_vs_plain_c{top}"] = rounded(ratio(rate, plain or float("nan")), 3)
        result[f"tokens_per_s_ratio_vs_llama_server_{variant}_c{top}"] = rounded(
            ratio(
                result[f"tether_tokens_per_s_{variant}_c{top}"] or float("nan"),
                result[f"llama_server_tokens_per_s_{variant}_c{top}"] or float("nan"),
            ),
            3,
        )
    add_workload_figures(result, by_side, args)
    errors_by_side = {
        side: sum(load.errors for r in rs for _, load in all_loads(r)) + sum(1 for r in rs if r.warmup_error)
        for side, rs in by_side.items()
    }
    errors = sum(errors_by_side.values())
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
            "errors_by_side": errors_by_side,
            "leftover_processes": leftover,
            "forced_kills": sum(1 for r in runs if r.forced),
            "outputs_identical": identical,
            "prompts_with_differing_outputs": differing,
            "llama_server_outputs_identical": ls_identical,
            "llama_server_prompts_with_differing_outputs": ls_differing,
            "tokens_source": {side: "+".join(s) for side, s in sources.items() if s},
            "tether_load_s": rounded(median([r.load_s for r in by_side["tether"]]), 2),
            "baseline_load_s": rounded(median([r.load_s for r in by_side["baseline"]]), 2),
            "llama_server_load_s": rounded(median([r.load_s for r in by_side["llama_server"]]), 2),
            "llama_server_version": llama_server.version(setup.llama_server) if setup.llama_server else None,
            "tether_parallel": PARALLEL,
            "llama_server_parallel": PARALLEL,
            "concurrency": list(args.concurrency),
            "rounds": args.rounds,
            "requests_per_concurrency": args.requests,
            "requests_per_client": {str(c): per_client(args.requests, c) for c in args.concurrency},
            "requests_per_side": sum(len(load.requests) for r in by_side["tether"] for load in r.loads.values()),
            "max_tokens": args.max_tokens,
            "model": setup.model.name,
            "deterministic": args.deterministic,
            "threads": setup.threads,
            "cpu_hog": args.cpu_hog,
            "n_ctx": N_CTX,
            "wall_s": round(wall_s, 1),
        }
    )
    print(f"percentiles: {PERCENTILE}; per side: the median over the rounds")
    for c in args.concurrency:
        vs_cpp = (
            f"; tokens/s tether/llama-server = {result[f'tokens_per_s_ratio_vs_llama_server_c{c}']}, "
            f"TTFT p50 tether {result[f'tether_ttft_p50_ms_c{c}']} ms vs llama-server "
            f"{result[f'llama_server_ttft_p50_ms_c{c}']} ms"
            if by_side["llama_server"]
            else ""
        )
        print(
            f"C={c}: tokens/s tether/llama_cpp.server = {result[f'tokens_per_s_ratio_c{c}']}, "
            f"TTFT p50 added = {result[f'ttft_added_ms_c{c}']} ms{vs_cpp}"
        )
    print(
        f"headline: tokens/s ratio {result['tokens_per_s_ratio']} (target {TARGET_RATIO}: "
        f"{'met' if result['meets_target'] else 'NOT met'}), TTFT added {result['ttft_added_ms']} ms at C={first}; "
        f"outputs identical: {identical} (llama_cpp.server), {ls_identical} (llama-server)"
    )
    if errors or leftover:
        print(f"FAILURE: {errors} request error(s), {leftover} leftover process(es) after tether serve stopped")
        for r in runs:
            if r.warmup_error:
                print(f"  round {r.round} {LABELS[r.side]} warm-up: {r.warmup_error}")
            for load in r.loads.values():
                for q in load.requests:
                    if q.error:
                        print(f"  round {r.round} {LABELS[r.side]} C={load.concurrency} prompt {q.prompt}: {q.error}")
    return result


def _requests(run: Run) -> Iterator[Request]:
    for _, load in all_loads(run):
        yield from (q for q in load.requests if q.error is None)


def add_workload_figures(result: dict[str, Any], by_side: dict[str, list[Run]], args: argparse.Namespace) -> None:
    """The per-workload keys against llama-server (see the module docstring), and how often a greedy text
    differed between a side's own phases of ``distinct`` (the same prompts, other cache states and neighbours)."""
    top = max(args.concurrency)
    for name in args.workloads:
        for c in args.concurrency:
            t = side_figures(by_side["tether"], c, name)
            ls = side_figures(by_side["llama_server"], c, name)
            result[f"tokens_per_s_ratio_vs_llama_server_{name}_c{c}"] = rounded(
                ratio(t.tokens_per_s, ls.tokens_per_s), 3
            )
            result[f"tokens_per_s_{name}_c{c}"] = rounded(t.tokens_per_s)
            result[f"llama_server_tokens_per_s_{name}_c{c}"] = rounded(ls.tokens_per_s)
            result[f"ttft_p50_ms_{name}_c{c}"] = ms(t.ttft_p50_ms)
            result[f"llama_server_ttft_p50_ms_{name}_c{c}"] = ms(ls.ttft_p50_ms)
            if c == top:
                result[f"itl_p99_ms_{name}_c{c}"] = ms(t.itl_p99_ms)
                result[f"llama_server_itl_p99_ms_{name}_c{c}"] = ms(ls.itl_p99_ms)
        for side, prefix in (("tether", ""), ("llama_server", "llama_server_")):
            counts = [load.prompt_counts for r in by_side[side] for load in r.workload(name).values()]
            cached, prompt = sum(c for c, _ in counts), sum(p for _, p in counts)
            result[f"{prefix}prefix_hit_tokens_share_{name}"] = rounded(cached / prompt, 3) if prompt else None
    for side, prefix in (("tether", ""), ("llama_server", "llama_server_")):
        differing = outputs_identical(by_side[side])[1] if by_side[side] else None
        result[f"{prefix}distinct_prompts_differing_across_phases"] = differing
    if "json_schema" in args.variants:
        result["json_schema_over_plain"] = result.get(f"tether_json_schema_vs_plain_c{top}")
        result["llama_server_json_schema_over_plain"] = result.get(f"llama_server_json_schema_vs_plain_c{top}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every server (default 3)")
    parser.add_argument(
        "--requests",
        type=int,
        default=REQUESTS,
        help=f"R: requests per concurrency C, R // C per client (default {REQUESTS})",
    )
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"per request (default {MAX_TOKENS})")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=None, help="client counts (default 1 4 8; --quick: 1 8)"
    )
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=SIDES,
        default=None,
        help="servers to run (default tether and llama-server; --quick: all three; a side left out has null figures)",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        choices=[v for v in VARIANTS if v != "plain"],
        default=None,
        help="after the load phases, the highest concurrency again with each option on (tether and llama-server): "
        "logprobs (top 5), json_schema (the stories as JSON); default json_schema (--quick: none)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="tether's and llama-server's workloads (default all; llama_cpp.server runs distinct only)",
    )
    parser.add_argument(
        "--no-build", action="store_true", help="do not build llama-server when it is missing (skip that side)"
    )
    parser.add_argument(
        "--cpu-hog",
        action="store_true",
        help="a busy-looping process per core beside the servers for the whole run, and every server at its own "
        "default thread count (a shared machine: what a user gets without tuning)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"1 round, R={QUICK_REQUESTS}, {QUICK_MAX_TOKENS} tokens, no build (CI)"
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME|FILE",
        help="a pulled model's name (tether pull --list) or a GGUF file (default: the built-in model)",
    )
    parser.add_argument(
        "--chat-template", default=None, metavar="NAME", help="a built-in chat template, for a GGUF without one"
    )
    parser.add_argument("--deterministic", action="store_true", help="tether serves with --deterministic")
    parser.add_argument(
        "--conversations",
        dest="conversations_flag",
        type=int,
        default=None,
        help=f"multi_turn's conversations (default {CONVERSATIONS}; --quick: {QUICK_CONVERSATIONS})",
    )
    parser.add_argument(
        "--turns",
        dest="turns_flag",
        type=int,
        default=None,
        help=f"multi_turn's turns (default {TURNS}; --quick: {QUICK_TURNS})",
    )
    args = parser.parse_args(argv)
    args.conversations, args.turns = CONVERSATIONS, TURNS
    args.workload_tokens = dict(WORKLOAD_MAX_TOKENS)
    if args.quick:
        args.rounds, args.requests, args.max_tokens = 1, QUICK_REQUESTS, QUICK_MAX_TOKENS
        args.conversations, args.turns = QUICK_CONVERSATIONS, QUICK_TURNS
        args.workload_tokens = dict.fromkeys(WORKLOAD_MAX_TOKENS, QUICK_MAX_TOKENS // 2)
    args.conversations = args.conversations_flag or args.conversations
    args.turns = args.turns_flag or args.turns
    if args.sides is None:
        args.sides = list(SIDES) if args.quick else ["tether", "llama_server"]
    if args.variants is None:
        args.variants = [] if args.quick else ["json_schema"]
    if args.concurrency is None:
        args.concurrency = list(QUICK_CONCURRENCY if args.quick else CONCURRENCY)
    if args.rounds < 1 or args.requests < 1 or args.max_tokens < 1 or min(args.concurrency) < 1:
        parser.error("--rounds, --requests, --max-tokens and --concurrency must be at least 1")
    args.concurrency = tuple(args.concurrency)
    try:
        model = default_model_path() if args.model is None else named_or_file(args.model)
    except InvalidModel as exc:
        print(f"skipped: {exc}")
        emit(null_result(args, skipped=str(exc)))
        return 0
    binary, llama_skipped = locate_llama_server(args)
    tether_args = ("--model", str(model)) if args.model else ()
    tether_args += ("--deterministic",) if args.deterministic else ()
    tether_args += ("--chat-template", args.chat_template) if args.chat_template else ()
    setup = Setup(model, binary, None if args.cpu_hog else THREADS, tether_args, args.chat_template)
    with private_tether_dirs("tether-bench-serve-"), cpu_hogs((os.cpu_count() or 1) if args.cpu_hog else 0):
        try:
            result = anyio.run(bench, args, setup, llama_skipped)
        except ServerFailed as exc:
            print(f"FAILURE: {exc}; its log ends with:\n{exc.tail}")
            emit(null_result(args, error=exc.one_line(), llama_server_skipped=llama_skipped))
            return 1
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
