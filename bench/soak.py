"""Soak benchmark: steady streaming load on a debug instance with a fault every few seconds for M minutes.

The server: ``tether serve --engine debug`` (``load.DebugServer``: private runtime and log directories, a bounded
stop) with one instance, ``soak``: the debug engine (``token_seconds`` 0.002, so a 32-token answer takes ~64 ms),
``max_queue`` 64, restart ``on-failure`` with a 0.05 s initial backoff doubling to at most 0.5 s, no jitter and a
crash-loop limit it never reaches (100,000 failures), and tight hang deadlines (``tether.chaos.trial.DEADLINES``:
heartbeat 1.5 s, token gap 1.5 s, ...) so a stopped runner is found within seconds.

Load: ``CLIENTS`` = 8 closed-loop streaming clients (``POST /v1/chat/completions``, ``max_tokens`` 32, ``stream:
true``, one ``httpx.AsyncClient``; a connection idle 2 s is not reused, as in ``bench/load.py``), each sending its
next request as soon as the last one ended, after the ``Retry-After`` seconds of a ``503``. Every
``--fault-interval`` seconds (default 5) one fault, in turn: ``SIGKILL``, ``SIGSEGV``, ``SIGABRT``, ``SIGSTOP`` sent
to the instance's current runner (``runner.pid`` of ``GET /v1/instances/soak``, read once it is ready), a client
that disconnects after its first token (a ninth stream), and a cancel storm (``POST /v1/requests/<id>/cancel`` twice
for every request streaming at that moment, ids from their ``X-Request-Id``, sent once a stream's first token is
out), then twice for every request that starts streaming within the next second. After a signal the benchmark
re-reads the instance every 50 ms until it is ready with a new runner: ``recovery_ms`` (signal sent -> ready again,
the restart backoff included). The next fault waits for that (so faults never overlap); the fault schedule is
otherwise fixed (fault k at k x the interval).

Every request must end, within ``HUNG_BOUND`` (20 s), with an outcome its fault allows: complete (``data:
[DONE]``); failed with the cause code the last runner fault implies (``FAULTS``: SIGKILL -> ``signal``, SIGSEGV and
SIGABRT -> ``native_crash``, SIGSTOP -> ``hang``); cancelled, for a request the cancel storm named; ``503`` with
``Retry-After`` (the instance restarting); disconnected (the ninth stream, by design). Otherwise it counts as
``lost`` (a stream that ends with neither ``[DONE]`` nor an error event, a transport error), ``hung`` (no end
within the bound), ``misclassified`` (any other failure or code) or ``rejected_without_retry_after``; each must be
0. ``restarts`` (the instance's count at the end) must equal the runner faults made, the instance must be ready at
the end, and after SIGTERM the server must exit 0 with no runner left (``ServeChild.runners()``, re-read for 5 s:
``leftover_runners``).

Resources: every ``SAMPLE_INTERVAL`` (2 s) the worker's (the ``tether serve`` process) RSS (``VmRSS``, MiB) and open
fds (``/proc/PID/fd``; the benchmark holds at most 11 connections to it: 8 clients, the disconnecting stream, one
admin connection, one for snapshots), and the runner processes alive (``max_runner_processes``: a runner and its
lifeline guard are 2). Slopes by least squares (``statistics.linear_regression``) over the samples after the first
window (warm-up), in MiB/hour and fds/hour; ``rss_start_mib``/``fds_start`` are the first of those samples,
``*_end`` the last (``*_initial``: the very first, before the clients connected). Flat means ~0; a short run
extrapolates a few MiB of allocator warm-up to a steep hourly figure (the published figure is ``--target batch
--minutes 120``).

Windows: ``window_s`` = min(300 s, M/3), so at least three windows; an outcome belongs to the window in which it
ended (those ending after the last window, while the load drains, to the last). Per window: outcomes, faults, and
p50/p99 of the completed requests' end-to-end latency (send -> ``[DONE]``; ``statistics.quantiles(n=100,
method="inclusive")``, ``benchstats.percentile``). The control: ``p99_ratio_last_first`` (p99 of the last window /
p99 of the first) should be ~1, like the slopes ~0.

Allocations (``--tracemalloc``, on by default, off with ``--quick``): the worker starts with
``TETHER_TRACEMALLOC=1`` (it traces its allocations 12 frames deep and serves ``POST /v1/debug/tracemalloc``, behind
the guard like every admin route) and the benchmark asks it for a snapshot at the end of every window but the last,
and once more after the load drained: the first is the baseline, each later answer lists the tracebacks that grew
most since it. A forked copy of the worker takes each (the worker pays only the fork): it reads glibc malloc's heap
(``mallinfo2``) and pymalloc's arenas as they were at the fork, collects the cycles the worker's collector had not
reached yet (garbage, not growth: counted, and placed by where they were allocated), then snapshots what is
reachable. The worker itself counts its event-loop tasks by where each waits (a task that never ends keeps all it
references). In the JSON: ``top_growth`` (the last answer's top ``TOP_SITES`` sites, short: KiB, blocks, the
allocating line and the first line of tether's own code on the way), ``traced_mib_growth`` (reachable MiB at the end
less at the baseline), ``garbage_sites`` (the snapshot with the most garbage: where it was allocated),
``task_sites``; per window ``rss_mib_end``/``rss_mib_max`` (the worker's RSS at the window's last sample, its
highest) and, at its snapshot, ``tasks``, ``traced_mib_end``, ``garbage_objects``, ``traced_mib_with_garbage``,
``malloc_in_use_mib``, ``malloc_free_mib``, ``pymalloc_mib`` (arenas) and ``pymalloc_in_blocks_mib``. Tracing costs
the worker CPU and ~20 MiB of RSS (its tables grow with every new traceback): ``--no-tracemalloc`` gives the bare
RSS figures.

Garbage collection: the worker runs a full collection every ``TETHER_GC_INTERVAL`` seconds (``node/upkeep``, 5 s
by default); ``--gc-interval S`` sets it for the run (``0``: CPython's own thresholds only, the worker before it had
that upkeep: the A/B). ``rss_slope_second_half_mib_per_h`` is the slope over the run's second half only: bounded
stores that fill during the first (the 64 failed lives kept with their stacks, one per 30 s on the batch target)
weigh on the whole-run slope, not on that one. The ended-request ids are kept 5 minutes: full within the warm-up.

Targets (``--target``): ``debug`` (the default: all of the above); ``batch``: the default model
(``tether.models.default_model_path()``) on llama.cpp with ``parallel`` 8 (one batch holds every client's stream),
``n_ctx`` 2048 per sequence, 2 threads (``--quick``: 1), the same restart policy, the engine's default hang deadlines,
and the faults a real engine can take: ``SIGKILL``, ``disconnect``, ``cancel_storm`` (SIGSEGV, SIGABRT and SIGSTOP
rehearse the debug engine's crash and hang paths), one every ``BATCH_FAULT_INTERVAL`` (10 s; ``--quick``: 3 s for 12 s)
so the model serves between its reloads; requests may take ``BATCH_HUNG_BOUND`` (60 s) and a reload
``BATCH_STATE_BOUND`` (60 s). The published run: ``--target batch --minutes 120``.

Baseline: none. No server a user would pick instead survives these faults: llama_cpp.server runs its model in its
own process, so killing the process that generates kills the server, and every client with it (a supervisor such
as systemd would restart it, after every connection was cut).

Run: ``.venv/bin/python bench/soak.py [--target debug|batch] [--minutes M] [--fault-interval S] [--quick]
[--no-tracemalloc] [--gc-interval S]`` (default 30 min, 5 s (batch: 10 s);
``--quick``: 0.4 min, a fault every 3.5 s, so each kind once, and the debug engine's ``token_seconds`` 0.01;
batch: 0.2 min, a fault every 3 s, 1 thread). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.abc import TaskGroup

from benchstats import PERCENTILE, emit, fmt, llama_unavailable, ms, percentile, print_rows, private_tether_dirs
from load import Attempt, DebugServer, ServerFailed, attempt, pool, retry_delay, rounded
from serve import PROMPTS, chat_body
from tether.chaos.trial import DEADLINES
from tether.env import GC_INTERVAL
from tether.models import default_model_path
from tether.node.upkeep import GC_INTERVAL as DEFAULT_GC_INTERVAL
from tether.node.upkeep import interval_from_env
from tether.serve.tracing import TRACE_TIMEOUT, TRACEMALLOC

INSTANCE = "soak"
CLIENTS = 8
MAX_TOKENS = 32
OPTIONS = {"token_seconds": 0.002, "load_steps": 1, "load_step_seconds": 0.0}
RESTART = {
    "mode": "on-failure",
    "initial_backoff": 0.05,
    "max_backoff": 0.5,
    "jitter": 0.0,
    "crash_loop_failures": 100_000,
}
MAX_QUEUE = 64
FAULT_INTERVAL = 5.0
FAULTS: dict[str, str | None] = {  # fault -> the cause code its failed requests carry (None: not a runner fault)
    "SIGKILL": "signal",
    "SIGSEGV": "native_crash",
    "SIGABRT": "native_crash",
    "SIGSTOP": "hang",
    "disconnect": None,
    "cancel_storm": None,
}
HUNG_BOUND = 20.0  # seconds any request may take, whatever the fault
STATE_BOUND = 20.0  # seconds for the instance to be ready again after a fault


@dataclass(frozen=True)
class Target:
    """What the soak runs: the instance's config, the faults made in turn, and the bounds that fit its engine."""

    name: str
    config: dict[str, Any]
    faults: tuple[str, ...]
    hung_bound: float
    state_bound: float


def debug_target(token_seconds: float = OPTIONS["token_seconds"]) -> Target:
    config = {
        "id": INSTANCE,
        "engine": "debug",
        "options": {**OPTIONS, "token_seconds": token_seconds},
        "restart": RESTART,
        "deadlines": DEADLINES,
        "max_queue": MAX_QUEUE,
    }
    return Target("debug", config, tuple(FAULTS), HUNG_BOUND, STATE_BOUND)


BATCH_PARALLEL = 8  # one batch holds every client's stream
BATCH_N_CTX = 2048  # per sequence, as bench/serve.py and bench/load.py
BATCH_THREADS = 2
BATCH_QUICK_THREADS = 1  # --quick: the model decodes the whole run, on one core instead of two
BATCH_FAULTS = ("SIGKILL", "disconnect", "cancel_storm")  # SIGSEGV/SIGABRT/SIGSTOP are the debug engine's rehearsal
# A SIGKILL every 3 faults: at 5 s the model would spend most of the run reloading (a reload took ~2-10 s on the
# shared 2-core machine); at 10 s it serves between them.
BATCH_FAULT_INTERVAL = 10.0
BATCH_QUICK_FAULT_INTERVAL = 3.0  # each kind once in BATCH_QUICK_MINUTES
BATCH_QUICK_MINUTES = 0.2  # 12 s: faults at 3, 6 and 9 s, then 3 s of serving after the last
BATCH_HUNG_BOUND = 60.0  # 8 streams of 32 tokens on 2 shared cores, behind a reload: seconds, not tens
BATCH_STATE_BOUND = 60.0  # a reload of the model after a SIGKILL (~1 s alone, more beside the load)


def batch_target(threads: int = BATCH_THREADS) -> Target:
    """The default model on llama.cpp, ``parallel`` 8 (its default deadlines: no SIGSTOP here to find)."""
    config = {
        "id": INSTANCE,
        "engine": "llama.cpp",
        "model": str(default_model_path()),
        "options": {"n_ctx": BATCH_N_CTX, "n_threads": threads, "parallel": BATCH_PARALLEL},
        "restart": RESTART,
        "max_queue": MAX_QUEUE,
    }
    return Target("batch", config, BATCH_FAULTS, BATCH_HUNG_BOUND, BATCH_STATE_BOUND)


SAMPLE_INTERVAL = 2.0
MAX_WINDOW = 300.0
QUICK_MINUTES = 0.4  # 24 s: 12 samples, 3 windows
QUICK_FAULT_INTERVAL = 3.5  # 6 faults in 24 s: each kind once
QUICK_TOKEN_SECONDS = 0.01  # --quick: the debug engine at a fifth of the token rate (the load's CPU), every path kept
POLL = 0.05
TRACE_TOP = 40  # growth entries each snapshot answers
TOP_SITES = 12  # and the report lists
TOP_TASK_SITES = 6  # places the worker's tasks wait, most first
PYMALLOC_ARENA = 1 << 20  # bytes per pymalloc arena (CPython 3.10+ on 64-bit Linux)
STORM_SECONDS = 1.0  # a cancel storm cancels every request that starts streaming within this
BASELINE = (
    "none: no server a user would pick instead survives these faults (llama_cpp.server generates in its own "
    "process: killing it kills the server and cuts every client)"
)


@dataclass
class Fault:
    kind: str
    at: float  # perf_counter() when it was made
    pid: int | None = None
    recovered_s: float | None = None  # signal -> ready again with a new runner
    targets: int = 0  # cancel storm: the requests it cancelled
    replies: Counter[str] = field(default_factory=Counter)  # cancel storm: the outcomes its cancels were told
    detail: str = ""

    @property
    def expected(self) -> str | None:
        return FAULTS[self.kind]


@dataclass
class Sample:
    t: float  # seconds since the start
    rss_mib: float | None
    fds: int | None
    runners: int


@dataclass
class Ended:
    """One request and what the benchmark made of it ("" = an outcome its fault allows)."""

    attempt: Attempt
    client: int  # -1: the disconnect fault's stream
    verdict: str = ""


class Soak:
    """The run: its load, its faults and its samples, and every request's end."""

    def __init__(self, server: DebugServer, duration: float, interval: float, target: Target | None = None) -> None:
        self.server = server
        self.target = target if target is not None else debug_target()
        self.hung_bound = self.target.hung_bound
        self.state_bound = self.target.state_bound
        self.duration = duration
        self.interval = interval
        self.began = time.perf_counter()
        self.ended: list[Ended] = []
        self.faults: list[Fault] = []
        self.samples: list[Sample] = []
        self.active: dict[str, int] = {}  # request id -> client, while it streams
        self.cancelled: set[str] = set()  # request ids a cancel storm named
        self.storm: Fault | None = None  # the cancel storm blowing now
        self.stopping = False
        self.tracing = False  # the worker traces its allocations: snapshot it at the end of every window
        self.window_s = duration
        self.traces: list[dict[str, Any]] = []  # the worker's answers to POST /v1/debug/tracemalloc, in order
        self._load: httpx.AsyncClient | None = None
        self._admin: httpx.AsyncClient | None = None
        self._tracer: httpx.AsyncClient | None = None  # its own connection: a snapshot takes seconds
        self._tg: TaskGroup | None = None

    @property
    def load(self) -> httpx.AsyncClient:
        assert self._load is not None
        return self._load

    @property
    def admin(self) -> httpx.AsyncClient:
        assert self._admin is not None
        return self._admin

    @property
    def tg(self) -> TaskGroup:
        assert self._tg is not None
        return self._tg

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    # --- load ---------------------------------------------------------------------------------------------------

    async def one(self, i: int, k: int, *, disconnect: bool = False) -> Attempt:
        """Request ``k`` of client ``i``, bounded by the target's ``hung_bound``."""
        body = chat_body(PROMPTS[(i + k) % len(PROMPTS)], MAX_TOKENS, INSTANCE)
        ids: list[str] = []

        def started(request_id: str) -> None:
            ids.append(request_id)
            self.active[request_id] = i
            if self.storm is not None and time.perf_counter() < self.storm.at + STORM_SECONDS:
                self.tg.start_soon(self.cancel, self.storm, request_id)

        sent = time.perf_counter()
        try:
            with anyio.fail_after(self.hung_bound):
                got = await attempt(self.load, body, on_start=started, disconnect=disconnect)
        except TimeoutError:
            got = Attempt("hung", sent, time.perf_counter(), detail=f"no end within {self.hung_bound:g} s")
            got.request_id = ids[0] if ids else None
        for request_id in ids:
            self.active.pop(request_id, None)
        self.ended.append(Ended(got, i))
        return got

    async def client_loop(self, i: int) -> None:
        k = rejections = 0
        while not self.stopping:
            got = await self.one(i, k)
            k += 1
            if got.kind == "rejected":
                rejections += 1
                await anyio.sleep(retry_delay(got, rejections))
            else:
                rejections = 0

    # --- faults -------------------------------------------------------------------------------------------------

    async def instance(self) -> dict[str, Any] | None:
        response = await self.admin.get(f"/v1/instances/{INSTANCE}")
        return response.json() if response.status_code == 200 else None

    async def ready_runner(self, other_than: int | None = None) -> int | None:
        """The pid of the instance's runner once it is ready (and not ``other_than``); None after the bound."""
        with anyio.move_on_after(self.state_bound):
            while True:
                inst = await self.instance()
                pid = ((inst or {}).get("runner") or {}).get("pid")
                if inst is not None and inst["ready"] and isinstance(pid, int) and pid != other_than:
                    return pid
                await anyio.sleep(POLL)
        return None

    async def cancel(self, storm: Fault, request_id: str) -> None:
        """Cancel a request twice (the duplicate must be harmless), counting the replies' outcomes."""
        self.cancelled.add(request_id)
        storm.targets += 1
        for _ in range(2):
            reply = await self.admin.post(f"/v1/requests/{request_id}/cancel")
            storm.replies[str(reply.json().get("outcome")) if reply.status_code == 200 else str(reply.status_code)] += 1

    async def strike(self, kind: str) -> Fault:
        fault = Fault(kind, time.perf_counter())
        if kind == "disconnect":
            self.tg.start_soon(functools.partial(self.one, -1, len(self.faults), disconnect=True))
            return fault
        if kind == "cancel_storm":  # what streams now, and every request that starts streaming in the next second
            self.storm = fault
            for request_id in list(self.active):
                self.tg.start_soon(self.cancel, fault, request_id)
            return fault
        fault.pid = await self.ready_runner()
        fault.at = time.perf_counter()
        if fault.pid is None:
            fault.detail = f"the instance was not ready within {self.state_bound:g} s: no signal sent"
            return fault
        with contextlib.suppress(ProcessLookupError):
            os.kill(fault.pid, getattr(signal, kind))
        if await self.ready_runner(other_than=fault.pid) is not None:
            fault.recovered_s = time.perf_counter() - fault.at
        else:
            fault.detail = f"not ready again with a new runner within {self.state_bound:g} s"
        return fault

    async def fault_loop(self) -> None:
        kinds = list(self.target.faults)
        k = 1
        while (when := k * self.interval) < self.duration:
            await anyio.sleep(max(0.0, when - self.elapsed()))
            self.faults.append(await self.strike(kinds[(k - 1) % len(kinds)]))
            k += 1

    # --- resources ----------------------------------------------------------------------------------------------

    async def sample_loop(self) -> None:
        k = 0
        while True:
            rss = self.server.rss()
            runners = await anyio.to_thread.run_sync(self.server.runners)
            self.samples.append(
                Sample(self.elapsed(), rss / (1 << 20) if rss is not None else None, self.server.fds(), len(runners))
            )
            k += 1
            await anyio.sleep(max(0.0, k * SAMPLE_INTERVAL - self.elapsed()))

    async def snapshot(self, rebase: bool) -> None:
        """The worker's traced allocations now (``rebase``: the baseline later snapshots are compared with)."""
        at = self.elapsed()
        assert self._tracer is not None
        reply = await self._tracer.post("/v1/debug/tracemalloc", params={"top": TRACE_TOP, "rebase": int(rebase)})
        got: dict[str, Any] = reply.json() if reply.status_code == 200 else {"error": reply.text[:300]}
        self.traces.append({"t": at, "took_s": self.elapsed() - at, **got})  # the answer's took_s: the fork's

    async def trace_loop(self) -> None:
        """A snapshot at the end of every window but the last (the first: the baseline, after the warm-up); the
        last is taken once the load has drained (``run``)."""
        w = 1
        while (when := w * self.window_s) < self.duration - 1.0:
            await anyio.sleep(max(0.0, when - self.elapsed()))
            await self.snapshot(rebase=w == 1)
            w += 1

    async def run(self) -> dict[str, Any] | None:
        """The load, the faults and the sampling for ``duration`` s, then the load drains; the instance at the end
        (None when it is not ready again within the target's ``state_bound``)."""
        limits = pool(CLIENTS + 4)
        timeout = httpx.Timeout(self.hung_bound)
        async with (
            httpx.AsyncClient(base_url=self.server.url, timeout=timeout, limits=limits) as self._load,
            # one admin connection: the worker's fd count must not move with how many cancels run at once
            httpx.AsyncClient(base_url=self.server.url, timeout=timeout, limits=pool(1)) as self._admin,
            httpx.AsyncClient(base_url=self.server.url, timeout=TRACE_TIMEOUT + 10.0, limits=pool(1)) as self._tracer,
        ):
            self.began = time.perf_counter()
            async with anyio.create_task_group() as outer:
                outer.start_soon(self.sample_loop)
                if self.tracing:
                    outer.start_soon(self.trace_loop)
                async with anyio.create_task_group() as self._tg:
                    for i in range(CLIENTS):
                        self.tg.start_soon(self.client_loop, i)
                    self.tg.start_soon(self.fault_loop)
                    await anyio.sleep(self.duration)
                    self.stopping = True  # the clients end their current request, then stop
                outer.cancel_scope.cancel()
            if self.tracing:
                await self.snapshot(rebase=not self.traces)
            final = await self.ready_runner()
            return await self.instance() if final is not None else None


# --------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------


def describe_error(exc: BaseException) -> str:
    """An exception in words; a group's members named, not just counted."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe_error(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def judge(soak: Soak) -> None:
    """Set each request's verdict: "" when its fault allows its outcome, else the problem in words."""
    runner_faults = sorted((f for f in soak.faults if f.expected is not None and f.pid is not None), key=lambda f: f.at)
    for e in soak.ended:
        a = e.attempt
        if a.kind in ("complete", "disconnected"):
            continue
        if a.kind == "rejected":
            if a.retry_after is None:
                e.verdict = "rejected_without_retry_after"
            continue
        if a.kind == "cancelled":
            if a.request_id not in soak.cancelled:
                e.verdict = "misclassified"
            continue
        if a.kind == "failed":
            last = [f for f in runner_faults if f.at <= a.ended]
            if not last or last[-1].expected != a.code:
                e.verdict = "misclassified"
            continue
        e.verdict = a.kind if a.kind in ("lost", "hung") else "misclassified"


def slope_per_hour(samples: list[Sample], attr: str, since: float) -> float | None:
    points = [(s.t / 3600.0, float(v)) for s in samples if s.t >= since and (v := getattr(s, attr)) is not None]
    if len(points) < 3:
        return None
    xs, ys = zip(*points, strict=True)
    if len(set(xs)) < 2:
        return None
    return round(float(statistics.linear_regression(xs, ys).slope), 2)


def windows(soak: Soak, window_s: float) -> list[dict[str, Any]]:
    n = max(1, round(soak.duration / window_s))
    out = []
    for w in range(n):
        lo, hi = w * window_s, (w + 1) * window_s

        def inside(t: float, w: int = w, lo: float = lo, hi: float = hi) -> bool:
            return lo <= t < hi or (w == n - 1 and t >= hi)

        ended = [e for e in soak.ended if inside(e.attempt.ended - soak.began)]
        rss = [x.rss_mib for x in soak.samples if inside(x.t) and x.rss_mib is not None]
        snap = soak.traces[w] if w < len(soak.traces) else {}  # one at each window's end (the last: after the drain)
        e2e = [e.attempt.e2e * 1000.0 for e in ended if e.attempt.kind == "complete"]
        out.append(
            {
                "from_s": round(lo, 1),
                "to_s": round(hi, 1),
                "requests": len(ended),
                "completed": len(e2e),
                "outcomes": dict(sorted(Counter(e.attempt.kind for e in ended).items())),
                "problems": sum(1 for e in ended if e.verdict),
                "faults": dict(Counter(f.kind for f in soak.faults if inside(f.at - soak.began))),
                "p50_ms": ms(percentile(e2e, 50)),
                "p99_ms": ms(percentile(e2e, 99)),
                "rss_mib_end": rounded(rss[-1], 1) if rss else None,  # the worker's RSS at the window's last sample
                "rss_mib_max": rounded(max(rss), 1) if rss else None,
                **allocator_figures(snap),
            }
        )
    return out


def allocator_figures(snap: dict[str, Any]) -> dict[str, Any]:
    """A snapshot's memory figures in MiB: traced (tracemalloc), glibc malloc's in use and free (held, not in use),
    pymalloc's arenas (``None`` where the answer has none)."""

    def mib(value: Any) -> float | None:
        return round(value / (1 << 20), 2) if isinstance(value, int) else None

    malloc, pymalloc = snap.get("malloc") or {}, snap.get("pymalloc") or {}
    arenas = pymalloc.get("arenas_allocated_current")
    return {
        "tasks": snap.get("tasks"),  # the worker's event-loop tasks at the snapshot
        "traced_mib_end": mib(snap.get("traced_bytes")),  # reachable: the copy collected the garbage first
        "garbage_objects": snap.get("gc_unreachable"),  # cycles the worker's collector had not reached yet
        "traced_mib_with_garbage": mib(snap.get("traced_bytes_with_garbage")),
        "malloc_in_use_mib": mib(malloc.get("in_use_bytes")),
        "malloc_free_mib": mib(malloc.get("free_bytes")),
        "pymalloc_mib": mib(arenas * PYMALLOC_ARENA) if isinstance(arenas, int) else None,
        "pymalloc_in_blocks_mib": mib(pymalloc.get("bytes_in_allocated_blocks")),
    }


def short_frame(frame: str) -> str:
    """``.../site-packages/anyio/_core/x.py:12`` -> ``anyio/_core/x.py:12``, ``.../src/tether/a.py:3`` ->
    ``tether/a.py:3``, ``/usr/lib/python3.11/asyncio/x.py:5`` -> ``asyncio/x.py:5``."""
    for marker in ("/site-packages/", "/src/"):
        if marker in frame:
            return frame.rsplit(marker, 1)[1]
    _, sep, tail = frame.partition("/lib/python3")
    return tail.partition("/")[2] if sep else frame


def growth_sites(traces: list[dict[str, Any]], top: int, key: str = "growth") -> list[dict[str, Any]]:
    """The last snapshot's growth since the baseline (the first window's end), short: KiB, blocks, the allocating
    line, and the innermost line of tether's own code on the way (``via``) when that is another. ``key="garbage"``:
    the cycles the worker's collector had not reached yet, by where they were allocated (the snapshot with most)."""
    if key == "garbage":
        last = max(traces, key=lambda t: t.get("gc_unreachable") or 0, default=None)
    else:
        last = next((t for t in reversed(traces) if t.get(key)), None)
    out = []
    for g in (last or {}).get(key, [])[:top]:
        frames = [short_frame(f) for f in g["traceback"]]
        via = next((f for f in frames if f.startswith("tether/")), None)
        out.append(
            {
                "kib": round(g["size_diff"] / 1024, 1),
                "blocks": g["count_diff"],
                "site": frames[0] if frames else "?",
                **({"via": via} if via and via != frames[0] else {}),
            }
        )
    return out


def task_sites(traces: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """Where the worker's tasks wait at the last snapshot, most first (short frames, innermost first)."""
    last = next((t for t in reversed(traces) if t.get("task_sites")), None)
    return [
        {"tasks": site["tasks"], "stack": [short_frame(f) for f in site["stack"][:3]]}
        for site in (last or {}).get("task_sites", [])[:top]
    ]


def traced_growth(traces: list[dict[str, Any]]) -> float | None:
    """MiB tracemalloc counts more at the last snapshot than at the baseline."""
    sized = [t["traced_bytes"] for t in traces if "traced_bytes" in t]
    return round((sized[-1] - sized[0]) / (1 << 20), 2) if len(sized) >= 2 else None


def figures(soak: Soak, final: dict[str, Any] | None, args: argparse.Namespace, window_s: float) -> dict[str, Any]:
    judge(soak)
    verdicts = Counter(e.verdict for e in soak.ended if e.verdict)
    outcomes = Counter(e.attempt.kind for e in soak.ended)
    wins = windows(soak, window_s)
    samples = soak.samples
    warm = [s for s in samples if s.t >= window_s] or samples
    runner_faults = [f for f in soak.faults if f.expected is not None]
    struck = [f for f in runner_faults if f.pid is not None]
    recovery = {
        kind: [f.recovered_s * 1000.0 for f in struck if f.kind == kind and f.recovered_s is not None]
        for kind in soak.target.faults
        if FAULTS[kind] is not None
    }
    all_recovery = [v for values in recovery.values() for v in values]
    e2e = [e.attempt.e2e * 1000.0 for e in soak.ended if e.attempt.kind == "complete"]
    first, last = wins[0]["p99_ms"], wins[-1]["p99_ms"]
    rss = [s.rss_mib for s in samples if s.rss_mib is not None]
    fds = [s.fds for s in samples if s.fds is not None]
    warm_rss = [s.rss_mib for s in warm if s.rss_mib is not None]
    warm_fds = [s.fds for s in warm if s.fds is not None]
    return {
        "bench": "soak",
        "target": soak.target.name,
        "engine": soak.target.config["engine"],
        "model": Path(soak.target.config["model"]).name if soak.target.config.get("model") else None,
        "parallel": soak.target.config["options"].get("parallel", 1),
        "token_seconds": soak.target.config["options"].get("token_seconds"),  # the debug engine's; null on batch
        "threads": soak.target.config["options"].get("n_threads"),  # the batch target's; null on debug
        "quick": bool(args.quick),
        "ok": False,  # set by the caller
        "minutes": args.minutes,
        "window_s": round(window_s, 1),
        "fault_interval_s": soak.interval,
        "clients": CLIENTS,
        "requests": len(soak.ended),
        "completed": outcomes["complete"],
        "outcomes": dict(sorted(outcomes.items())),
        "faults": dict(Counter(f.kind for f in soak.faults)),
        "faults_total": len(soak.faults),
        "runner_faults": len(struck),
        "faults_not_made": sum(1 for f in runner_faults if f.pid is None),
        "restarts": final.get("restarts") if final is not None else None,
        "final_state": final.get("state") if final is not None else None,
        "cancel_storm_targets": sum(f.targets for f in soak.faults if f.kind == "cancel_storm"),
        "cancel_replies": dict(sum((f.replies for f in soak.faults), Counter[str]())),
        "lost_requests": verdicts["lost"],
        "hung": verdicts["hung"],
        "misclassified": verdicts["misclassified"],
        "rejected_503": outcomes["rejected"],
        "rejected_without_retry_after": verdicts["rejected_without_retry_after"],
        "p50_ms": ms(percentile(e2e, 50)),
        "p99_ms": ms(percentile(e2e, 99)),
        "p99_ms_first_window": first,
        "p99_ms_last_window": last,
        "p99_ratio_last_first": round(last / first, 3) if first and last else None,
        "recovery_ms_p50": ms(percentile(all_recovery, 50)),
        "recovery_ms_p99": ms(percentile(all_recovery, 99)),
        "recovery_ms_p50_by_fault": {k: ms(percentile(v, 50)) for k, v in recovery.items()},
        "rss_slope_mib_per_h": slope_per_hour(samples, "rss_mib", window_s),
        "fd_slope_per_h": slope_per_hour(samples, "fds", window_s),
        "rss_slope_second_half_mib_per_h": slope_per_hour(samples, "rss_mib", soak.duration / 2),
        "gc_interval_s": args.gc_interval,
        "rss_initial_mib": rounded(rss[0], 1) if rss else None,
        "rss_start_mib": rounded(warm_rss[0], 1) if warm_rss else None,
        "rss_end_mib": rounded(warm_rss[-1], 1) if warm_rss else None,
        "fds_initial": fds[0] if fds else None,
        "fds_start": warm_fds[0] if warm_fds else None,
        "fds_end": warm_fds[-1] if warm_fds else None,
        "samples": len(samples),
        "max_runner_processes": max((s.runners for s in samples), default=None),
        "tracemalloc": soak.tracing,
        "traced_mib_growth": traced_growth(soak.traces),
        "top_growth": growth_sites(soak.traces, TOP_SITES),
        "garbage_sites": growth_sites(soak.traces, TOP_TASK_SITES, "garbage"),
        "task_sites": task_sites(soak.traces, TOP_TASK_SITES),
        "snapshot_s_max": round(max((t["took_s"] for t in soak.traces), default=0.0), 2) if soak.traces else None,
        "windows": wins,
        "baseline": BASELINE,
        "percentile": PERCENTILE,
    }


def problems(result: dict[str, Any], soak: Soak) -> list[str]:
    found = [f"the run broke off: {result['error']}"] if result.get("error") else []
    for key in ("lost_requests", "hung", "misclassified", "rejected_without_retry_after", "faults_not_made"):
        if result[key]:
            found.append(f"{key}: {result[key]}")
    if result["restarts"] != result["runner_faults"]:
        found.append(f"{result['restarts']} restarts after {result['runner_faults']} runner faults")
    if result["final_state"] != "ready":
        found.append(f"the instance ended {result['final_state']}, not ready")
    if result.get("leftover_runners"):
        found.append(f"{result['leftover_runners']} runner(s) left after the server stopped")
    if result.get("server_exit") != 0:
        found.append(
            f"the server exited with {result.get('server_exit')} on SIGTERM (forced: {result.get('forced_kill')})"
        )
    found += [
        f"fault {f.kind} at {f.at - soak.began:.1f} s: {f.detail}" for f in soak.faults if f.pid is None and f.expected
    ]
    for e in soak.ended:
        if e.verdict:
            a = e.attempt
            found.append(
                f"  {e.verdict}: client {e.client} at {a.ended - soak.began:.1f} s: {a.kind} {a.status} {a.code}: "
                f"{a.detail[:160]}"
            )
    return found[:40]


def print_tables(result: dict[str, Any], soak: Soak) -> None:
    kinds = ("complete", "failed", "cancelled", "rejected", "disconnected", "lost", "hung")
    headers = ("window s", "reqs", *kinds, "problems", "faults", "p50 ms", "p99 ms")
    rows = []
    for w in result["windows"]:
        rows.append(
            (
                f"{w['from_s']:g}-{w['to_s']:g}",
                str(w["requests"]),
                *(str(w["outcomes"].get(k, 0)) for k in kinds),
                str(w["problems"]),
                " ".join(f"{k}:{n}" for k, n in w["faults"].items()) or "-",
                fmt(w["p50_ms"] if w["p50_ms"] is not None else float("nan")),
                fmt(w["p99_ms"] if w["p99_ms"] is not None else float("nan")),
            )
        )
    print_rows(headers, rows)
    frows = []
    for kind in soak.target.faults:
        code = FAULTS[kind]
        made = [f for f in soak.faults if f.kind == kind]
        rec = [f.recovered_s * 1000.0 for f in made if f.recovered_s is not None]
        failed = sum(
            1 for e in soak.ended if e.attempt.kind == "failed" and code is not None and e.attempt.code == code
        )
        replies = sum((f.replies for f in made), Counter[str]())
        told = ", ".join(f"{n} {outcome}" for outcome, n in sorted(replies.items()))
        extra = f"{sum(f.targets for f in made)} requests cancelled; replies: {told}" if kind == "cancel_storm" else ""
        frows.append(
            (
                kind,
                str(len(made)),
                code or "-",
                str(failed) if code else "-",
                fmt(percentile(rec, 50)),
                fmt(percentile(rec, 99)),
                extra,
            )
        )
    print_rows(("fault", "made", "cause code", "requests failed with it", "recovery p50 ms", "p99", ""), frows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long (default 30, the published figure)")
    parser.add_argument(
        "--fault-interval",
        type=float,
        default=None,
        help=f"seconds between faults (debug {FAULT_INTERVAL:g}, batch {BATCH_FAULT_INTERVAL:g})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="0.4 min (batch: 0.2), a fault every 3.5 s (batch: 3 s), debug tokens of 0.01 s, batch on 1 thread (CI)",
    )
    parser.add_argument(
        "--target",
        choices=("debug", "batch"),
        default="debug",
        help="debug: the debug engine, every fault (default); batch: the default model on llama.cpp, parallel 8",
    )
    parser.add_argument(
        "--tracemalloc",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"the worker traces its allocations ({TRACEMALLOC}=1), snapshot at every window's end (default: on, "
        "off with --quick: each snapshot takes seconds of a core)",
    )
    parser.add_argument(
        "--gc-interval",
        type=float,
        default=None,
        help=f"seconds between the worker's full garbage collections ({GC_INTERVAL}; default: the worker's own, "
        f"{DEFAULT_GC_INTERVAL:g}; 0: CPython's thresholds only, as before the worker's upkeep)",
    )
    args = parser.parse_args(argv)
    if args.gc_interval is not None and args.gc_interval < 0:
        parser.error("--gc-interval must be >= 0")
    if args.quick:
        batch = args.target == "batch"
        args.minutes = BATCH_QUICK_MINUTES if batch else QUICK_MINUTES
        args.fault_interval = BATCH_QUICK_FAULT_INTERVAL if batch else QUICK_FAULT_INTERVAL
    if args.tracemalloc is None:
        args.tracemalloc = not args.quick
    if args.fault_interval is None:
        args.fault_interval = BATCH_FAULT_INTERVAL if args.target == "batch" else FAULT_INTERVAL
    if args.minutes <= 0 or args.fault_interval <= 0:
        parser.error("--minutes and --fault-interval must be positive")
    duration = args.minutes * 60.0
    window_s = min(MAX_WINDOW, duration / 3)
    head = {"bench": "soak", "target": args.target, "quick": bool(args.quick), "ok": False}
    if args.target == "batch" and (skipped := llama_unavailable()) is not None:
        print(f"FAILURE: --target batch needs the default model on llama.cpp: {skipped}")
        emit({**head, "error": skipped[:500]})
        return 1
    if args.target == "batch":
        target = batch_target(BATCH_QUICK_THREADS) if args.quick else batch_target()
    else:
        target = debug_target(QUICK_TOKEN_SECONDS) if args.quick else debug_target()
    began = time.monotonic()
    if args.tracemalloc:
        os.environ[TRACEMALLOC] = "1"  # the worker reads it; its runners do not
    if args.gc_interval is not None:
        os.environ[GC_INTERVAL] = f"{args.gc_interval:g}"
    args.gc_interval = interval_from_env()
    with private_tether_dirs("tether-bench-soak-"):
        try:
            server = DebugServer(target.config)
        except (ServerFailed, AssertionError) as exc:
            print(f"FAILURE: {exc}")
            emit({**head, "error": str(exc)[:500]})
            return 1
        soak = Soak(server, duration, args.fault_interval, target)
        soak.tracing, soak.window_s = args.tracemalloc, window_s
        final: dict[str, Any] | None = None
        error = None
        try:
            final = anyio.run(soak.run)
        except Exception as exc:  # the API itself failed (an admin call, a reply that is no JSON): say so, in JSON
            error = describe_error(exc)
        finally:
            server.stop()
    result = figures(soak, final, args, window_s)
    result.update(
        {
            "error": error,
            "leftover_runners": server.leftover,
            "server_exit": server.proc.returncode,
            "forced_kill": server.forced,
            "wall_s": round(time.monotonic() - began, 1),
        }
    )
    found = problems(result, soak)
    result["ok"] = not found
    print(
        f"soak: {args.minutes:g} min, {CLIENTS} streaming clients, a fault every {args.fault_interval:g} s "
        f"({', '.join(target.faults)}) on the {target.name} target, windows of {window_s:g} s"
        f"{' (quick)' if args.quick else ''}"
    )
    print_tables(result, soak)
    print(
        f"{result['requests']} requests ({result['completed']} completed), {result['faults_total']} faults, "
        f"{result['restarts']} restarts; lost {result['lost_requests']}, hung {result['hung']}, misclassified "
        f"{result['misclassified']}; worker RSS {result['rss_start_mib']} -> {result['rss_end_mib']} MiB (slope "
        f"{result['rss_slope_mib_per_h']} MiB/h), fds {result['fds_start']} -> {result['fds_end']} (slope "
        f"{result['fd_slope_per_h']}/h); p99 first/last window {result['p99_ms_first_window']} / "
        f"{result['p99_ms_last_window']} ms; leftover runners {result['leftover_runners']}"
    )
    if found:
        print("FAILURE:\n" + "\n".join(found))
    emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
