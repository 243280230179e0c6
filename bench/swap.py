"""Swap benchmark: the first token of a request whose model must evict another, tether against Ollama's poll.

Two figures: the swap time (a request for a model that is not loaded and must evict the other one) with tether's
wait for memory against Ollama's way of waiting for it; and what a loaded model's requests pay while another model
loads beside it.

Models: two copies of the default GGUF (``tether.models.default_model_path()``, SmolLM2-135M-Instruct), ``smol-a`` and
``smol-b`` (``shutil.copy``: distinct files, so each has page cache of its own), served by ``tether serve`` from a
catalog (``--catalog``) with the same llama.cpp options (``OPTIONS``: n_ctx 2048, n_threads 2 (``--quick``: 1), parallel
8, the engine's default), ``--keep-alive 10m`` (nothing unloads on a timer during the run). The worker starts with a
model-free debug instance (``--engine debug --name boot``: ``tether serve`` always loads one model at start), which is
unloaded (``DELETE /v1/instances/boot``) before anything is measured, so only the two copies compete for the memory.
Without the default model (``DefaultModelMissing``), or with ``--engine debug``, the two are debug-engine models holding
``DEBUG_HOLD`` bytes of real anonymous memory each (``hold_bytes``, with a slow load: ``DEBUG_OPTIONS``), and the JSON
says ``"engine": "debug"``.

Each server is a child (``tether.chaos.target.ServeChild``) on a free port, one at a time (the machine may have two
cores), with a private runtime and log directory; requests are ``POST /v1/chat/completions``, ``stream: true``,
greedy, a fixed system message and ``serve.PROMPTS`` in turn. TTFT = from just before the request is sent to the
first SSE chunk whose ``choices[0].delta.content`` is non-empty (``time.perf_counter()``).

**1. Swap time.** The worker runs in a cgroup v1 memory cgroup of its own (``/sys/fs/cgroup/memory/
tether-bench-swap-<hex>x``, a fresh one per server, removed after it; the worker moves itself in before it execs,
so its runners, in cgroups below it, are limited too) whose limit fits one model but not two, by the scheduler's
own numbers (it evicts when a model's *estimate* exceeds what the cgroup has room for) and physically. The limit
comes from a first, calibration server in a cgroup without a limit: with ``smol-a`` loaded (and warmed up) the bench
reads the cgroup's used memory ``U`` (``memory.usage_in_bytes`` - ``total_inactive_file``: what the worker's
``node_memory`` counts as used), ``smol-b``'s estimate ``E`` and ``smol-a``'s footprint ``F`` (``GET /v1/models``).
Once the loaded model is gone the other must fit: ``limit >= U - F + E``; with one loaded, the other must fit neither
by its estimate (``limit < U + E``) nor physically, its footprint on top of what is used (``limit < U + F``). The
bench sets the limit midway between ``U + E - F`` and ``U + min(E, F)``, ``(2F - E) / 2`` of margin either way (for
the default model, E = 702 MiB against F = 418 MiB at parallel 8: 67 MiB). Were the estimate twice the footprint or
more, no limit would keep two models out physically; it would then be ``U + E - F/2``, by the estimate only, and
``cgroup_limit_physical`` false. The scheduler also holds back what a loaded model may still grow into by its
estimate: that only deepens the shortfall while one is loaded, and leaves with the evicted one. (The weights are
mmapped page cache of files this bench wrote, charged to the bench's cgroup, not the worker's; ``F`` is the
anonymous memory: KV cache, compute buffers, the interpreter.)

Swap mode on each server, after an untimed warm-up (``smol-a`` loaded by a request, then one untimed swap to ``smol-b``;
``--quick``: no untimed swap): requests alternate between ``smol-a`` and ``smol-b`` (``SWAP_TOKENS`` tokens each), so
every one needs an eviction of the other; its TTFT is the *swap time*: eviction, memory back, load, prefill, first
token. Two modes, the same server command but one flag:

- tether: after an eviction, node memory is checked as soon as the evicted runner's process group is reaped (then
  at short, growing pauses while it lags);
- baseline: ``--reclaim-poll 0.25``: Ollama's pattern (after an unload it polls free memory every 250 ms), the first
  check 250 ms after the unload.

Rounds: ``--rounds`` (default 2; ``--quick``: 1), each starting one server per mode, the order alternating (round
0: baseline first), so a slow stretch of the machine falls on both; ``--swaps`` timed swaps per mode in all
(default 8, ``--quick`` 1), split over the rounds. Per mode: p50 and p90 of the swap times;
``ratio = baseline_swap_ttft_p50_ms / swap_ttft_p50_ms`` (above 1: tether swaps sooner). From the scheduler's
decisions (``GET /v1/instances`` ``scheduler.decisions``, those stamped while the swap's request was open), p50 per
mode: the reclaim time (``reclaimed.seconds``: from the eviction to memory seen back, the runner's stop and reap
included; ``reclaim_p50_ms``) and the ready time (``loaded.seconds``: from the load's start to its runner ready,
the eviction included; ``swap_ready_p50_s``).

Checks (``ok``; exit 1 when one fails): every swap evicted exactly the other model and nothing else
(``wrong_evictions``), no ``load_failed``/``refuse``/``wait_memory`` decision and no model gone by failure
(``instance_failures``), the cgroup's OOM-kill count (``memory.oom_control`` ``oom_kill``) stayed 0
(``oom_kills``), every request answered (``errors``), no runner left after a stop (``leftover_processes``). Where no
memory cgroup can be made (no writable v1 hierarchy), the swaps evict by count instead (``--max-loaded 1``, both
modes), ``cgroup_limit_bytes`` is null and ``eviction_by`` says ``max_loaded``.

**2. A loaded model while another loads.** On the calibration server (no limit: room for both), ``smol-a`` loaded and
``smol-b`` loaded once then unloaded (``DELETE /v1/instances/smol-b``: its file is cached, as in a swap). ``--loads``
rounds (default 6, ``--quick`` 1), each: ``IDLE_REQUESTS`` (6, ``--quick`` 2) requests for ``smol-a`` back to back with
nothing loading (*idle*), then ``smol-b`` unloaded, one request for it sent (a background task: it loads ``smol-b``)
and, until it is answered, requests for ``smol-a`` back to back; those sent after ``smol-b``'s request whose first token
came before ``smol-b``'s runner was ready (its ``loaded`` decision) are *during* the load. Requests of ``LOADED_TOKENS``
tokens. ``loaded_model_added_gap_ms`` = median TTFT during - median TTFT idle (what a load beside it adds to a loaded
model's first token: it never waits for the load, but the two share the CPUs);
``loaded_*_itl_p50_ms``/``_p99_ms``: the gaps between its content chunks, pooled, idle and during. ``load_s``: the
median of ``smol-b``'s load time as the scheduler measured it (``GET /v1/models`` ``load_seconds``: its request to
its runner ready); ``load_first_token_s``: its request to its first token (its first prefill shares the CPUs with
``smol-a``'s requests too).

Statistics: p50/p90/p99 = ``statistics.quantiles(n=100, method="inclusive")`` (``benchstats.percentile``).
``--quick`` (for CI): 1 round, 1 swap per mode (no warm-up swap), 1 load after 2 idle requests (``"quick": true``):
a smoke test, about 15 s on two cores.

Run: ``.venv/bin/python bench/swap.py [--quick] [--rounds N] [--swaps N] [--loads N] [--engine debug]``. The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from benchstats import PERCENTILE, BenchFailed, emit, fmt, ms, percentile, print_rows, private_tether_dirs
from serve import PROMPTS, QUICK_THREADS, SYSTEM, Request, read_stream
from tether.chaos.target import ServeChild
from tether.kernel.cgroups import MemoryCgroup
from tether.models import DefaultModelMissing, default_model_path

MODES = ("baseline", "tether")
LABELS = {"baseline": "baseline (--reclaim-poll 0.25)", "tether": "tether"}
BASELINE_POLL = 0.25  # Ollama: after an unload, free memory is polled every 250 ms
MODELS = ("smol-a", "smol-b")
OPTIONS: dict[str, Any] = {"n_ctx": 2048, "n_threads": 2, "parallel": 8}
DEBUG_HOLD = 192 << 20
DEBUG_OPTIONS: dict[str, Any] = {"hold_bytes": DEBUG_HOLD, "load_step_seconds": 0.1, "token_seconds": 0.01}
SWAPS = 8
QUICK_SWAPS = 1  # each mode's p50 and p90 from 1, with no warm-up swap before it: the plumbing, not a figure
ROUNDS = 2
LOADS = 6
QUICK_LOADS = 1
SWAP_TOKENS = 8
LOADED_TOKENS = 8
IDLE_REQUESTS = 6
QUICK_IDLE_REQUESTS = 2
WARMUP_TOKENS = 4
KEEP_ALIVE = "10m"
STOP_TIMEOUT = 10.0  # tether serve --stop-timeout
READY_TIMEOUT = 120.0
REQUEST_TIMEOUT = 120.0
GONE_BOUND = 5.0  # seconds for a stopped server's runners (and its cgroup's members) to be gone
POLL = 0.02
CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
FAILURE_KINDS = ("load_failed", "refuse", "wait_memory")


# --------------------------------------------------------------------------------------------------------------
# Models, catalog, cgroups
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    engine: str  # "llama.cpp" or "debug"
    model_name: str  # the GGUF copied, or "debug"
    catalog: Path


def write_catalog(tmp: Path, engine: str = "auto", quick: bool = False) -> Setup:
    """The two models (copies of the default GGUF, or debug models holding memory: ``engine`` "debug", or "auto"
    without the default model) in a catalog file in ``tmp``."""
    source: Path | None = None
    if engine != "debug":
        try:
            source = default_model_path()
        except DefaultModelMissing as exc:
            print(f"the default model is missing ({exc}): debug-engine models holding {DEBUG_HOLD >> 20} MiB each")
    lines = [f'keep_alive = "{KEEP_ALIVE}"', ""]
    for model_id in MODELS:
        lines.append("[[models]]")
        lines.append(f'id = "{model_id}"')
        if source is not None:
            (tmp / "models").mkdir(exist_ok=True)
            copy = tmp / "models" / f"{model_id}.gguf"
            shutil.copy(source, copy)
            lines.append(f'model = "models/{copy.name}"')
            options = {**OPTIONS, "n_threads": QUICK_THREADS} if quick else OPTIONS
        else:
            lines.append('engine = "debug"')
            options = DEBUG_OPTIONS
        lines.append("options = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items()) + " }")
        lines.append("")
    path = tmp / "catalog.toml"
    path.write_text("\n".join(lines))
    if source is None:
        return Setup("debug", "debug", path)
    return Setup("llama.cpp", source.name, path)


def make_cgroup(limit: int | None) -> tuple[Path | None, str | None]:
    """A fresh v1 memory cgroup with ``limit`` (swap included where accounted), or (None, why not)."""
    if not (CGROUP_V1_MEMORY / "memory.limit_in_bytes").exists():
        return None, f"no cgroup v1 memory hierarchy at {CGROUP_V1_MEMORY}"
    path = CGROUP_V1_MEMORY / f"tether-bench-swap-{uuid.uuid4().hex[:8]}x"  # never tether-<runner>-<worker pid>
    try:
        path.mkdir()
    except OSError as exc:
        return None, f"cannot create {path}: {exc.strerror or exc}"
    if limit is not None:
        try:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # with swap, the worker would swap instead of meeting the limit
                memsw.write_text(str(limit))
        except OSError as exc:
            remove_cgroup(path)
            return None, f"cannot set a memory limit on {path}: {exc.strerror or exc}"
    return path, None


def remove_cgroup(path: Path) -> bool:
    """Remove the cgroup, children first (a runner cgroup its worker could not remove), retrying (bounded) while
    the last members leave; False when it is still there."""
    deadline = time.monotonic() + GONE_BOUND
    while path.exists():
        for child in sorted((c for c in path.glob("**/*") if c.is_dir()), key=lambda c: len(c.parts), reverse=True):
            with contextlib.suppress(OSError):
                child.rmdir()
        try:
            path.rmdir()
        except FileNotFoundError:
            break
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL)
    return True


def cgroup_used(path: Path) -> int:
    """What the worker's ``node_memory`` counts as used in the cgroup: usage - inactive file cache."""
    cgroup = MemoryCgroup.at(path)
    return (cgroup.usage() or 0) - cgroup.reclaimable()


# --------------------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------------------


class SwapServer(ServeChild):
    """``tether serve --catalog`` with the two models (neither loaded: the boot instance is unloaded), in the memory
    cgroup when given; a bounded stop that counts the runners left (``leftover``)."""

    def __init__(self, setup: Setup, extra: Sequence[str], cgroup: Path | None) -> None:
        args = ["--engine", "debug", "--name", "boot", "--catalog", str(setup.catalog)]
        args += [f"--keep-alive={KEEP_ALIVE}", "--stop-timeout", str(STOP_TIMEOUT), *extra]
        super().__init__(*args, startup=READY_TIMEOUT, cgroup=cgroup)  # a child that never listens is killed
        self.leftover = 0
        self.forced = False
        self.http = httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT)
        try:
            self.wait_for(r"boot ready \(runner pid", READY_TIMEOUT)
            self.unload("boot")
        except BaseException:
            self.stop()
            raise

    def models(self) -> dict[str, dict[str, Any]]:
        response = self.http.get("/v1/models")
        if response.status_code != 200:
            raise BenchFailed(f"GET /v1/models -> {response.status_code}: {response.text[:300]}")
        return {str(m["id"]): m for m in response.json()["data"]}

    def decisions(self) -> list[dict[str, Any]]:
        response = self.http.get("/v1/instances")
        if response.status_code != 200:
            raise BenchFailed(f"GET /v1/instances -> {response.status_code}: {response.text[:300]}")
        found: list[dict[str, Any]] = response.json()["scheduler"]["decisions"]
        return found

    def unload(self, model_id: str) -> None:
        """Unload a loaded model (``DELETE /v1/instances/<id>``: it returns once the runner is gone)."""
        response = self.http.delete(f"/v1/instances/{model_id}")
        if response.status_code >= 300:
            raise BenchFailed(f"DELETE /v1/instances/{model_id} -> {response.status_code}: {response.text[:300]}")
        state = self.models()[model_id]["state"]
        if state != "unloaded":
            raise BenchFailed(f"{model_id} is {state} after DELETE /v1/instances/{model_id}")

    def stop(self) -> None:
        self.http.close()
        self.forced, self.leftover = self.stop_and_sweep(STOP_TIMEOUT, GONE_BOUND, POLL)


@contextlib.contextmanager
def serving(setup: Setup, extra: Sequence[str], limit: int | None, use_cgroup: bool) -> Iterator[Served]:
    """A server in a fresh cgroup (with ``limit``) when ``use_cgroup`` and one can be made; stopped and its cgroup
    removed after the block."""
    path, why = make_cgroup(limit) if use_cgroup else (None, None)
    served = Served(None, path, why)
    try:
        served.server = SwapServer(setup, extra, path)
        yield served
    finally:
        if served.server is not None:
            served.server.stop()
        if path is not None:
            served.oom_kills = MemoryCgroup.at(path).oom_kills()
            served.peak = MemoryCgroup.at(path).peak()
            if not remove_cgroup(path):
                print(f"warning: could not remove the cgroup {path} (members still leaving)")


@dataclass
class Served:
    server: SwapServer | None
    cgroup: Path | None
    cgroup_missing: str | None  # why there is no cgroup, when one was wanted
    oom_kills: int | None = None  # read after the stop
    peak: int | None = None

    @property
    def srv(self) -> SwapServer:
        assert self.server is not None
        return self.server


# --------------------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Sent:
    """One streamed request: what came back (``serve.Request``), when it was sent and when its first token came."""

    model: str
    req: Request
    sent: float  # perf_counter()
    first: float | None  # perf_counter() of the first content chunk

    @property
    def ttft_ms(self) -> float:
        return self.req.ttft * 1000.0 if self.req.ttft is not None else float("nan")


async def stream(client: httpx.AsyncClient, model: str, index: int, max_tokens: int) -> Sent:
    """One streaming chat completion for ``model``, read to ``[DONE]``, every content chunk stamped."""
    req = Request(index % len(PROMPTS))
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[req.prompt]}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "stream": True,
    }
    began = await read_stream(client, body, req)
    return Sent(model, req, began, req.stamps[0] if req.stamps else None)


async def answered(client: httpx.AsyncClient, model: str, index: int, max_tokens: int) -> Sent:
    """A request that must succeed (warm-ups, loads the bench needs): ``BenchFailed`` otherwise."""
    sent = await stream(client, model, index, max_tokens)
    if sent.req.error is not None:
        raise BenchFailed(f"a request for {model} failed: {sent.req.error}")
    return sent


def client_for(server: SwapServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT)


# --------------------------------------------------------------------------------------------------------------
# 1. Swaps
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Swap:
    mode: str
    round: int
    index: int
    model: str
    ttft_ms: float
    error: str | None
    evicted: list[str]
    failures: list[str]  # decisions that say something failed (kind: reason)
    reclaim_ms: float  # the "reclaimed" decision's seconds: eviction to memory seen back (nan when absent)
    load_s: float  # the "loaded" decision's seconds: the load's start to ready, its eviction included

    @property
    def evicted_other(self) -> bool:
        other = MODELS[1] if self.model == MODELS[0] else MODELS[0]
        return self.evicted == [other]


@dataclass
class ModeRun:
    mode: str
    round: int
    swaps: list[Swap] = field(default_factory=list)
    oom_kills: int | None = None
    peak: int | None = None
    leftover: int = 0
    forced: bool = False


def window(decisions: list[dict[str, Any]], began: float, ended: float) -> list[dict[str, Any]]:
    """The decisions stamped while a request was open (``time.time()`` of this machine, as the server's)."""
    return [d for d in decisions if began - 0.001 <= float(d["at"]) <= ended + 0.001]


def failures_in(decisions: list[dict[str, Any]]) -> list[str]:
    return [
        f"{d['kind']} {d['model']}: {d['reason']}"
        for d in decisions
        if d["kind"] in FAILURE_KINDS or (d["kind"] == "unload" and d.get("why") == "failed")
    ]


async def run_mode(
    mode: str, rnd: int, swaps: int, setup: Setup, limit: int | None, use_cgroup: bool, first: int, warm_swap: bool
) -> ModeRun:
    """One server of one mode: warm up (load smol-a, then one untimed swap to smol-b unless not ``warm_swap``), then
    ``swaps`` timed swaps, each to the model not loaded."""
    extra = ["--reclaim-poll", str(BASELINE_POLL)] if mode == "baseline" else []
    if limit is None:
        extra += ["--max-loaded", "1"]
    run = ModeRun(mode, rnd)
    with serving(setup, extra, limit, use_cgroup and limit is not None) as served:
        server = served.srv
        async with client_for(server) as client:
            await answered(client, MODELS[0], 0, WARMUP_TOKENS)
            if warm_swap:
                await answered(client, MODELS[1], 1, WARMUP_TOKENS)  # the untimed warm-up swap
            for i in range(swaps):
                model = MODELS[(i + (0 if warm_swap else 1)) % 2]
                began = time.time()
                sent = await stream(client, model, first + i, SWAP_TOKENS)
                decided = window(server.decisions(), began, time.time())
                reclaims = [d for d in decided if d["kind"] == "reclaimed" and d["seconds"]]
                reclaimed = [float(d["seconds"]) for d in reclaims]
                loaded = [float(d["seconds"]) for d in decided if d["kind"] == "loaded" and d["model"] == model]
                swap = Swap(
                    mode,
                    rnd,
                    i,
                    model,
                    sent.ttft_ms,
                    sent.req.error,
                    [str(d["model"]) for d in decided if d["kind"] == "evict"],
                    failures_in(decided),
                    reclaimed[0] * 1000.0 if reclaimed else float("nan"),
                    loaded[0] if loaded else float("nan"),
                )
                run.swaps.append(swap)
                print(
                    f"round {rnd} {LABELS[mode]}: swap {i} to {model}: TTFT {fmt(swap.ttft_ms)} ms, evicted "
                    f"{','.join(swap.evicted) or 'nothing'}, reclaim {fmt(swap.reclaim_ms)} ms, ready "
                    f"{fmt(swap.load_s)} s{'; ERROR ' + swap.error if swap.error else ''}"
                    + "".join(f"\n  {d['kind']} {d['model']}: {d['reason']}" for d in reclaims[:1] if i == 0),
                    flush=True,
                )
    assert served.server is not None
    run.oom_kills, run.peak = served.oom_kills, served.peak
    run.leftover, run.forced = served.server.leftover, served.server.forced
    return run


# --------------------------------------------------------------------------------------------------------------
# Calibration and 2. a loaded model while another loads
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Calibration:
    used: int  # the cgroup's used memory (usage - inactive file) with smol-a loaded
    estimate: int  # smol-b's estimate
    footprint: int  # smol-a's footprint
    cgroup_missing: str | None

    @property
    def lower(self) -> int:
        """The least limit at which the other model fits once the loaded one is gone (by its estimate)."""
        return self.used + self.estimate - self.footprint

    @property
    def upper(self) -> int:
        """The limit below which, with one model loaded, the other fits neither by its estimate nor physically (its
        footprint, what it holds once loaded, on top of what is used)."""
        return self.used + min(self.estimate, self.footprint)

    @property
    def physical(self) -> bool:
        """Whether a limit can keep two models out physically too (estimate < 2 x footprint)."""
        return self.lower < self.upper

    @property
    def limit(self) -> int:
        if self.physical:
            return (self.lower + self.upper) // 2
        return self.used + self.estimate - self.footprint // 2  # by the estimate only: two would fit physically

    @property
    def rule(self) -> str:
        if self.physical:
            return (
                "midway between used + estimate - footprint (the other fits once the loaded one is gone) and used + "
                "min(estimate, footprint) (with one loaded, the other fits neither by estimate nor physically)"
            )
        return "used + estimate - footprint / 2 (by the estimate only: two models would fit physically)"


@dataclass
class LoadRound:
    idle: list[Sent]
    during: list[Sent]
    load_s: float  # GET /v1/models load_seconds of smol-b after this load
    load_first_token_s: float


def loaded_at(decisions: list[dict[str, Any]], model: str, since: float) -> float:
    """When ``model``'s runner was ready (its "loaded" decision, ``time.time()``) after ``since``."""
    found = [float(d["at"]) for d in decisions if d["kind"] == "loaded" and d["model"] == model and d["at"] >= since]
    if not found:
        raise BenchFailed(f"no 'loaded' decision for {model} after its request")
    return found[0]


async def calibrate_and_measure_loads(
    setup: Setup, loads: int, idle_requests: int
) -> tuple[Calibration, list[LoadRound]]:
    """The calibration server (a cgroup without a limit): the limit's numbers with smol-a loaded, then part 2."""
    with serving(setup, [], None, True) as served:
        server = served.srv
        a, b = MODELS
        async with client_for(server) as client:
            await answered(client, a, 0, WARMUP_TOKENS)
            await answered(client, a, 1, WARMUP_TOKENS)
            models = server.models()
            estimate, footprint = models[b].get("estimate"), models[a].get("footprint")
            if not estimate or not footprint:
                raise BenchFailed(
                    f"GET /v1/models has no estimate of {b} ({estimate}) or footprint of {a} ({footprint})"
                )
            used = cgroup_used(served.cgroup) if served.cgroup is not None else 0
            calibration = Calibration(used, int(estimate), int(footprint), served.cgroup_missing)
            if served.cgroup is not None:
                print(
                    f"calibration: {a} loaded: cgroup used {used >> 20} MiB, {b}'s estimate {int(estimate) >> 20} MiB, "
                    f"{a}'s footprint {int(footprint) >> 20} MiB -> limit {calibration.limit >> 20} MiB: "
                    f"{calibration.rule}",
                    flush=True,
                )
            await answered(client, b, 2, WARMUP_TOKENS)  # loaded once: its file cached, as in a swap
            rounds = []
            index = 0
            clock = time.time() - time.perf_counter()  # perf_counter() + clock = the decisions' time.time()
            for k in range(loads):
                idle = []
                for _ in range(idle_requests):
                    idle.append(await stream(client, a, index, LOADED_TOKENS))
                    index += 1
                if server.models()[b]["state"] == "loaded":
                    server.unload(b)
                during: list[Sent] = []
                loading: list[Sent] = []

                async def load_b() -> None:
                    loading.append(await stream(client, b, 3, 1))  # noqa: B023 (awaited in this iteration)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(load_b)
                    await anyio.sleep(0)  # its request sent first
                    while not loading:
                        during.append(await stream(client, a, index, LOADED_TOKENS))
                        index += 1
                got = loading[0]
                if got.req.error is not None or got.first is None:
                    raise BenchFailed(f"the load of {b} failed: {got.req.error}")
                ready = loaded_at(server.decisions(), b, got.sent + clock)
                counted = [s for s in during if s.sent >= got.sent and s.first is not None and s.first < ready - clock]
                load_s = float(server.models()[b].get("load_seconds") or "nan")
                rounds.append(LoadRound(idle, counted, load_s, got.first - got.sent))
                print(
                    f"load {k}: {b} loaded in {fmt(load_s)} s (first token {fmt(got.first - got.sent)} s); {a}: "
                    f"{len(counted)} request(s) during it ({len(during) - len(counted)} outside), idle TTFT p50 "
                    f"{fmt(percentile([s.ttft_ms for s in idle], 50))} ms, during "
                    f"{fmt(percentile([s.ttft_ms for s in counted], 50))} ms",
                    flush=True,
                )
    return calibration, rounds


# --------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------


def clean(values: Sequence[float]) -> list[float]:
    return [v for v in values if v == v]


def p(values: Sequence[float], pct: int) -> float:
    return percentile(clean(values), pct)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def rounded(value: float, digits: int) -> float | None:
    return None if value != value else round(value, digits)


def gaps_ms(sents: Sequence[Sent]) -> list[float]:
    return [g * 1000.0 for s in sents if s.req.error is None for g in s.req.gaps]


def print_swaps(runs: Sequence[ModeRun]) -> None:
    headers = ["round", "mode", "swap", "to", "evicted", "TTFT ms", "reclaim ms", "ready s", "error"]
    rows = [
        (
            str(s.round),
            LABELS[s.mode],
            str(s.index),
            s.model,
            ",".join(s.evicted) or "-",
            fmt(s.ttft_ms),
            fmt(s.reclaim_ms),
            fmt(s.load_s),
            s.error or "-",
        )
        for run in runs
        for s in run.swaps
    ]
    print_rows(headers, rows, left=2)


def null_result(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "swap", "quick": bool(args.quick)}
    for key in ("swap_ttft_p50_ms", "baseline_swap_ttft_p50_ms", "ratio", "loaded_model_added_gap_ms", "load_s"):
        result[key] = None
    result.update({"ok": False, "percentile": PERCENTILE, "error": None})
    result.update(extra)
    return result


async def bench(args: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    began = time.monotonic()
    calibration, load_rounds = await calibrate_and_measure_loads(setup, args.loads, args.idle_requests)
    limit = calibration.limit if calibration.cgroup_missing is None else None
    if limit is None:
        print(f"no memory cgroup ({calibration.cgroup_missing}): the swaps evict by count (--max-loaded 1)")
    runs: list[ModeRun] = []
    per_round = [args.swaps // args.rounds + (1 if r < args.swaps % args.rounds else 0) for r in range(args.rounds)]
    for rnd in range(args.rounds):
        order = MODES if rnd % 2 == 0 else MODES[::-1]
        for mode in order:
            first = sum(per_round[:rnd])
            runs.append(await run_mode(mode, rnd, per_round[rnd], setup, limit, True, first, not args.quick))
    wall_s = time.monotonic() - began

    print(
        f"tether serve: swaps between {MODELS[0]} and {MODELS[1]} ({setup.engine}, {setup.model_name}), "
        f"{args.swaps} per mode over {args.rounds} round(s), cgroup limit "
        f"{'none (--max-loaded 1)' if limit is None else f'{limit >> 20} MiB'} ({wall_s:.1f} s)"
        f"{' (quick)' if args.quick else ''}"
    )
    print_swaps(runs)
    by_mode = {mode: [s for r in runs if r.mode == mode for s in r.swaps] for mode in MODES}
    figures: dict[str, dict[str, float]] = {}
    for mode, swaps in by_mode.items():
        ok_ttfts = [s.ttft_ms for s in swaps if s.error is None]
        figures[mode] = {
            "p50": p(ok_ttfts, 50),
            "p90": p(ok_ttfts, 90),
            "reclaim": p([s.reclaim_ms for s in swaps], 50),
            "load": p([s.load_s for s in swaps], 50),
        }
    rows = [
        (
            LABELS[mode],
            str(len(by_mode[mode])),
            fmt(f["p50"]),
            fmt(f["p90"]),
            fmt(f["reclaim"]),
            fmt(f["load"]),
        )
        for mode, f in figures.items()
    ]
    print_rows(["mode", "swaps", "swap TTFT p50 ms", "p90 ms", "reclaim p50 ms", "ready p50 s"], rows)

    idle = [s for r in load_rounds for s in r.idle if s.req.error is None]
    during = [s for r in load_rounds for s in r.during if s.req.error is None]
    idle_ttft, during_ttft = p([s.ttft_ms for s in idle], 50), p([s.ttft_ms for s in during], 50)
    idle_gaps, during_gaps = gaps_ms(idle), gaps_ms(during)
    load_s = p([r.load_s for r in load_rounds], 50)
    load_first = p([r.load_first_token_s for r in load_rounds], 50)
    print(f"{MODELS[0]} loaded, {MODELS[1]} loading beside it ({len(load_rounds)} load(s)):")
    print_rows(
        ["phase", "requests", "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p99 ms"],
        [
            (
                name,
                str(len(sents)),
                fmt(p([s.ttft_ms for s in sents], 50)),
                fmt(p([s.ttft_ms for s in sents], 90)),
                fmt(percentile(g, 50)),
                fmt(percentile(g, 99)),
            )
            for name, sents, g in (("idle", idle, idle_gaps), ("during a load", during, during_gaps))
        ],
    )
    added = during_ttft - idle_ttft

    swaps = [s for r in runs for s in r.swaps]
    errors = sum(1 for s in swaps if s.error) + sum(
        1 for r in load_rounds for s in [*r.idle, *r.during] if s.req.error is not None
    )
    wrong = sum(1 for s in swaps if not s.evicted_other)
    failures = [f for s in swaps for f in s.failures]
    ooms = [r.oom_kills for r in runs if r.oom_kills is not None]
    leftover = sum(r.leftover for r in runs)
    oom_total = sum(ooms) if ooms else None
    ok = errors == 0 and wrong == 0 and not failures and not oom_total and leftover == 0 and bool(during)
    t, b = figures["tether"], figures["baseline"]
    result = null_result(args)
    result.update(
        {
            "engine": setup.engine,
            "model": setup.model_name,
            "swap_ttft_p50_ms": ms(t["p50"]),
            "baseline_swap_ttft_p50_ms": ms(b["p50"]),
            "ratio": rounded(ratio(b["p50"], t["p50"]), 3),
            "swap_ttft_p90_ms": ms(t["p90"]),
            "baseline_swap_ttft_p90_ms": ms(b["p90"]),
            "swap_saved_ms": ms(b["p50"] - t["p50"]),
            "reclaim_p50_ms": ms(t["reclaim"]),
            "baseline_reclaim_p50_ms": ms(b["reclaim"]),
            "swap_ready_p50_s": rounded(t["load"], 3),
            "baseline_swap_ready_p50_s": rounded(b["load"], 3),
            "swaps_per_mode": args.swaps,
            "rounds": args.rounds,
            "swap_tokens": SWAP_TOKENS,
            "baseline_reclaim_poll_s": BASELINE_POLL,
            "eviction_by": "memory" if limit is not None else "max_loaded",
            "cgroup_limit_bytes": limit,
            "cgroup_limit_rule": calibration.rule
            if limit is not None
            else f"no memory cgroup: {calibration.cgroup_missing}",
            "cgroup_limit_physical": calibration.physical if limit is not None else None,
            "cgroup_limit_margin_bytes": (calibration.upper - calibration.lower) // 2 if limit is not None else None,
            "two_models_used_bytes": calibration.used + calibration.footprint if limit is not None else None,
            "calibration_used_bytes": calibration.used if limit is not None else None,
            "model_estimate_bytes": calibration.estimate,
            "model_footprint_bytes": calibration.footprint,
            "cgroup_peak_bytes": max((r.peak for r in runs if r.peak is not None), default=None),
            "loaded_model_added_gap_ms": ms(added),
            "loaded_idle_ttft_p50_ms": ms(idle_ttft),
            "loaded_during_load_ttft_p50_ms": ms(during_ttft),
            "loaded_during_load_ttft_p90_ms": ms(p([s.ttft_ms for s in during], 90)),
            "loaded_idle_itl_p50_ms": ms(percentile(idle_gaps, 50)),
            "loaded_during_load_itl_p50_ms": ms(percentile(during_gaps, 50)),
            "loaded_idle_itl_p99_ms": ms(percentile(idle_gaps, 99)),
            "loaded_during_load_itl_p99_ms": ms(percentile(during_gaps, 99)),
            "loaded_idle_requests": len(idle),
            "loaded_during_load_requests": len(during),
            "loaded_tokens": LOADED_TOKENS,
            "loads": len(load_rounds),
            "load_s": rounded(load_s, 3),
            "load_first_token_s": rounded(load_first, 3),
            "wrong_evictions": wrong,
            "instance_failures": len(failures),
            "oom_kills": oom_total,
            "errors": errors,
            "leftover_processes": leftover,
            "forced_kills": sum(1 for r in runs if r.forced),
            "ok": ok,
            "wall_s": round(wall_s, 1),
        }
    )
    print(f"percentiles: {PERCENTILE}")
    print(
        f"swap TTFT p50: tether {result['swap_ttft_p50_ms']} ms, baseline {result['baseline_swap_ttft_p50_ms']} ms "
        f"(ratio {result['ratio']}; reclaim p50 {result['reclaim_p50_ms']} vs {result['baseline_reclaim_p50_ms']} "
        f"ms); a loaded model's TTFT while another loads: +{result['loaded_model_added_gap_ms']} ms "
        f"(load {result['load_s']} s)"
    )
    if not ok:
        print(
            f"FAILURE: {errors} request error(s), {wrong} swap(s) that did not evict exactly the other model, "
            f"{len(failures)} failure decision(s), {oom_total} OOM kill(s), {leftover} leftover runner(s)"
            + ("" if during else ", no request fell within a load")
        )
        for s in swaps:
            if s.error or not s.evicted_other or s.failures:
                print(f"  {LABELS[s.mode]} swap {s.index} to {s.model}: {s.error}; evicted {s.evicted}; {s.failures}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"servers per mode (default {ROUNDS})")
    parser.add_argument("--swaps", type=int, default=SWAPS, help=f"timed swaps per mode in all (default {SWAPS})")
    parser.add_argument("--loads", type=int, default=LOADS, help=f"loads beside a loaded model (default {LOADS})")
    parser.add_argument(
        "--engine",
        choices=("auto", "debug"),
        default="auto",
        help="auto: copies of the default model (debug-engine models without it); debug: debug-engine models",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"1 round, {QUICK_SWAPS} swap per mode and no warm-up swap, {QUICK_LOADS} load (CI)",
    )
    args = parser.parse_args(argv)
    args.idle_requests = IDLE_REQUESTS
    if args.quick:
        args.rounds, args.swaps, args.loads, args.idle_requests = 1, QUICK_SWAPS, QUICK_LOADS, QUICK_IDLE_REQUESTS
    if args.rounds < 1 or args.swaps < args.rounds or args.loads < 1:
        parser.error("--rounds and --loads must be at least 1, and --swaps at least --rounds")
    with tempfile.TemporaryDirectory(prefix="tether-bench-swap-") as tmp, private_tether_dirs("tether-bench-swap-"):
        setup = write_catalog(Path(tmp), args.engine, args.quick)
        try:
            result = anyio.run(bench, args, setup)
        except (BenchFailed, AssertionError) as exc:
            print(f"FAILURE: {exc}")
            emit(null_result(args, engine=setup.engine, error=str(exc).splitlines()[0]))
            return 1
    emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
