"""Cluster benchmark: how fast ``tether serve --ray`` fails the requests of a node it loses, against how fast Ray
itself learns of the same loss; and what serving through a node agent costs a stream, against ``tether serve`` on
one machine.

Everything runs on this machine: a local Ray cluster (``ray.cluster_utils.Cluster``: a head with ``num_cpus=0``,
which hosts no agent, and ``NODES`` = 3 nodes with ``num_cpus=1``, object stores of 80 MiB, no dashboard,
``RAY_USAGE_STATS_ENABLED=0``); the servers are ``tether serve`` children (``tether.chaos.target.ServeChild``) on free
ports, one at a time (two cores), runner records and logs in a private temporary directory (the Ray nodes, started
by this process, hand it on to the agents and their runners). Every time is ``time.monotonic()`` (CLOCK_MONOTONIC:
one clock for the bench and the coordinator, whose ``GET /v1/instances`` gives per node ``lost_at``, tether's
verdict, and ``ray_notified_at``, when Ray failed the call the coordinator holds open on the agent actor: Ray's own
notification of its death).

**1. Streaming through the cluster vs locally** (first, on a fresh cluster). The default model (llama.cpp,
SmolLM2-135M, the engine's defaults) served by ``tether serve`` (local: the runner is the server's child) and by
``tether serve --ray ADDR`` (cluster: one runner under a node agent, tokens relayed through Ray), never both at
once; the Ray cluster runs (idle) beside both. ``--stream-rounds`` rounds (default 2, ``--quick`` 1), each starting
both servers in turn (round 0: local first, round 1: cluster first), each server: one untimed warm-up request (16
tokens, a message of its own), then ``--requests`` (default 5, ``--quick`` 3) sequential streamed chat requests
(``serve.read_stream``: a system message and ``serve.PROMPTS`` in turn, ``max_tokens`` 128, ``temperature`` 0,
``seed`` 0). Per request: TTFT (request sent -> first content chunk, ``perf_counter``) and tokens/s = (output tokens
- 1) / (last content chunk - first content chunk): the decode rate, TTFT apart. ``local_tokens_per_s``,
``cluster_tokens_per_s``, ``local_ttft_p50_ms``, ``cluster_ttft_p50_ms``: medians over every request of the side;
``stream_ratio`` = cluster / local tokens/s; ``added_ttft_ms`` = cluster - local median TTFT. Skipped (null,
``stream_skipped`` says why) without the default model or llama-cpp-python.

**2. Node loss by SIGKILL** (``--rounds`` rounds, default 5, ``--quick`` 2). One coordinator, ``tether serve --ray
ADDR --engine debug --lost-after 1`` (its boot instance removed), and an instance of 3 replicas, ``--spread``
(default ``STRICT_SPREAD``: one per node), debug engine (``token_seconds`` 0.01, ``parallel`` 2, ``max_queue`` 64; a
crash-loop limit high enough that the rounds cannot trip it). Per round: ``STREAMS`` = 6 concurrent streamed
requests (``max_tokens`` 500: still streaming at the kill; least loaded routing puts two on each replica); once
every one has its first content chunk, the agent process of node ``round % 3`` of those with a replica, by node
id (``cluster.nodes[].agent_pid``, checked to be a ``NodeAgent`` on /proc) gets SIGKILL at ``t0``. For every request
whose stream ends with an error event of code ``node_lost``: ms from ``t0`` to the client reading that event
(``node_loss_p50_ms``/``_p99_ms``, pooled over the rounds). Ray: ``(ray_notified_at - t0)`` of that node's lost agent
(``ray_node_loss_p50_ms``/``_p99_ms``, one per round; when the node's entry is already replaced by a fresh agent,
from the ``ray`` event's lag after tether's verdict). tether's verdict ``(lost_at - t0)``
(``tether_verdict_p50_ms``): on a closed connection the coordinator waits up to 0.3 s for Ray's account of the
death before it fails the requests (and only then kills the actor), so when Ray answers within that wait the
requests fail just after Ray's notification, and that notification is Ray's own. ``replace_p50_ms``: ``t0`` -> every
replica that was on the node ready again with a new runner pid (the node gets a fresh agent within the
coordinator's rescan, 2 s; with ``SPREAD`` the replica goes to another node at once, after its restart backoff).
``runners_gone_p50_ms``: ``t0`` -> no process on /proc whose command line is a runner of the killed agent
(``RunnerArgs``). Checks: the failed requests are exactly those the node's replicas were serving at ``t0`` (their
``serving`` counts), the node's id and "connection closed" in the message; every other request completes.

A replica whose restart finds no node to go to fails for good (``does_not_fit``: "not placed"), even when the
cause is transient; with ``STRICT_SPREAD`` and as many replicas as nodes that is every loss (the other nodes hold a
replica, the lost node's fresh agent is not up yet). The round then records ``replace_failed`` (no replace time;
``replace_failures``, ``replace_failure``: the cause) and the bench re-creates the instance (DELETE, then POST once
every node has a live agent) for the next round. The scheduler keeps that restart's refusal and hands it to the
next POST of the same instance id, whatever the nodes say by then; the bench then POSTs once more
(``stale_refusals`` counts them).

**3. A silent node** (one round). On the same coordinator, after the rounds: the same 6 streams, then every process
of one node is stopped (SIGSTOP, at ``t0``): its raylet and the other processes Ray started for it
(``Node.all_processes``), every descendant of them (the node's workers, the agent, its runners and their guards),
the agent and its runners by name; the scan repeats until it finds nothing new. tether: ``silent_node_loss_ms``,
median ms from ``t0`` to a ``node_lost`` error at the client (the message must say "silent for"): ``--lost-after``
counted from the last beat heard, which came up to one heartbeat interval (0.2 s) before ``t0``, so 800-1300 ms.
Ray: this process (``ray.init(address=...)``, a driver on the head) polls ``ray.nodes()`` every 100 ms until the node
is ``Alive: False``, within 120 s: ``ray_silent_node_loss_ms``, the GCS health check (defaults: a check every 3 s,
each timing out after 10 s against a stopped raylet, dead after 5 failures in a row: up to about 65 s).
``ray_silent_actor_notified_ms``: ``ray_notified_at`` of the silent agent; it follows the coordinator's own
``ray.kill`` of the agent at its verdict, so it is no detection by Ray. Then the stopped processes get SIGKILL and
the node is removed from the ``Cluster``.

**4. Orphans.** After each server's stop (SIGTERM, bounded, then SIGKILL), its runners and node agents must be
gone within 20 s (``leftover_after_stops``: those still there, then SIGKILLed). At the end, once every server is
stopped and the Ray cluster shut down: ``orphans`` = live processes whose command line parses as a tether runner
whose worker is one of the servers or agents seen during the run, plus live processes whose command line names
``NodeAgent`` (started during the run, or seen as an agent). Must be 0.

Statistics: p50/p99 = ``statistics.quantiles(n=100, method="inclusive")`` (``benchstats.percentile``). ``ok``: every
check held, nothing failed, no orphan (exit 1 otherwise). ``--quick``: 2 loss rounds, 1 streaming round of 3
requests per side (a smoke run: about 2 minutes on two cores, one of them waiting for Ray's health check).

Run: ``.venv/bin/python bench/cluster.py [--quick] [--rounds N] [--requests N] [--stream-rounds N] [--spread
SPREAD]``. Progress goes to stderr; the last line printed on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import psutil

from benchstats import (
    PERCENTILE,
    BenchFailed,
    describe,
    emit,
    fmt,
    llama_unavailable,
    ms,
    percentile,
    print_rows,
    private_tether_dirs,
)
from serve import PROMPTS, Request, chat_body, read_stream
from tether.chaos.target import ServeChild, runner_processes
from tether.kernel.pids import alive, cmdline, live_processes

NODES = 3
MiB = 1 << 20
OBJECT_STORE = 80 * MiB
ROUNDS = 5
QUICK_ROUNDS = 2
STREAMS = 6
LOSS_MAX_TOKENS = 500  # 5 s at 0.01 s a token: still streaming at the kill
DEBUG_OPTIONS: dict[str, Any] = {"token_seconds": 0.01, "parallel": 2}
INSTANCE = "d"
MAX_QUEUE = 64
LOST_AFTER = 1.0
STREAM_ROUNDS = 2
QUICK_STREAM_ROUNDS = 1
REQUESTS = 5
QUICK_REQUESTS = 3
STREAM_MAX_TOKENS = 128
WARMUP_TOKENS = 16
READY_TIMEOUT = 120.0  # a server's start (Ray connection, agents, the model)
STOP_TIMEOUT = 10.0  # tether serve --stop-timeout
HTTP_TIMEOUT = 30.0
STREAM_TIMEOUT = 60.0  # one node-loss stream, start to end
STREAMING_BOUND = 30.0  # every stream has its first token
RAY_NOTIFY_BOUND = 10.0  # Ray's notification of a SIGKILLed agent
REPLACE_BOUND = 90.0  # the lost replica ready again
GONE_BOUND = 20.0  # runners and agents gone after a kill or a stop
RAY_DEAD_BOUND = 120.0  # ray.nodes() says a silent node is dead
RAY_POLL = 0.1
POLL = 0.05


def say(message: str) -> None:
    print(f"cluster bench: {message}", file=sys.stderr, flush=True)


def since_ms(start: float, end: float | None) -> float | None:
    return None if end is None else (end - start) * 1000.0


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --------------------------------------------------------------------------------------------------------------
# Processes, from /proc
# --------------------------------------------------------------------------------------------------------------


def is_agent(pid: int) -> bool:
    argv = cmdline(pid)
    return argv is not None and alive(pid) and "NodeAgent" in " ".join(argv)


def agent_processes(since: float, known: set[int]) -> list[int]:
    """Live processes whose command line names ``NodeAgent``: seen as agents, or started after ``since`` (wall)."""
    found = []
    for stat in live_processes():
        if stat.pid == os.getpid() or not is_agent(stat.pid):
            continue
        try:
            started = psutil.Process(stat.pid).create_time()
        except psutil.Error:
            continue
        if stat.pid in known or started >= since:
            found.append(stat.pid)
    return found


def descendants(pids: set[int]) -> set[int]:
    found: set[int] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
    return found


def kill_all(pids: set[int] | list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def wait_gone(pids: Callable[[], list[int]], bound: float) -> tuple[float | None, list[int]]:
    """Wait (bounded) until ``pids()`` is empty: (when, monotonic; or None) and those left."""
    deadline = time.monotonic() + bound
    while left := pids():
        if time.monotonic() > deadline:
            return None, left
        time.sleep(POLL)
    return time.monotonic(), []


@dataclass
class Tracker:
    """What the run started: every server and agent pid seen (the workers of its runners), and when it began."""

    since: float = field(default_factory=time.time)
    workers: set[int] = field(default_factory=set)
    leftover_after_stops: list[int] = field(default_factory=list)
    coordinator: Server | None = None  # the node-loss rounds' server, once started

    def note_agents(self, nodes: list[dict[str, Any]]) -> None:
        self.workers.update(int(n["agent_pid"]) for n in nodes if n.get("agent_pid"))


# --------------------------------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------------------------------


class Server(ServeChild):
    """A ``tether serve`` child with an HTTP client; ``coordinator`` when it runs with ``--ray``."""

    def __init__(self, tracker: Tracker, *args: str) -> None:
        super().__init__(*args, "--stop-timeout", str(STOP_TIMEOUT), startup=READY_TIMEOUT)
        self.tracker = tracker
        self.coordinator = "--ray" in args
        tracker.workers.add(self.pid)
        self.http = httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT)
        self.refused_restart = False  # a replica's restart was refused placement (see ``add``)
        self.stale_refusals = 0

    def get(self, path: str) -> dict[str, Any]:
        response = self.http.get(path)
        if response.status_code != 200:
            raise BenchFailed(f"GET {path} -> {response.status_code}: {response.text[:300]}")
        data: dict[str, Any] = response.json()
        return data

    def nodes(self) -> list[dict[str, Any]]:
        nodes: list[dict[str, Any]] = self.get("/v1/instances")["cluster"]["nodes"]
        self.tracker.note_agents(nodes)
        return nodes

    def live_nodes(self) -> list[dict[str, Any]]:
        return [n for n in self.nodes() if n["state"] == "live" and n["agent_pid"]]

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.TransportError):  # it prints its address just before it listens
                if self.http.get("/readyz").status_code == 200:
                    return
            if self.proc.poll() is not None:
                raise BenchFailed(f"tether serve exited ({self.proc.returncode}): {' | '.join(self.drain()[-5:])}")
            if time.monotonic() > deadline:
                raise BenchFailed(f"tether serve not ready within {timeout:.0f} s: {' | '.join(self.drain()[-5:])}")
            time.sleep(POLL)

    def wait_nodes(self, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(live := self.live_nodes()) < count:
            if time.monotonic() > deadline:
                raise BenchFailed(f"{len(live)} node agents live, not {count}, within {timeout:.0f} s")
            time.sleep(POLL)
        return live

    def model(self) -> str:
        return str(self.get("/v1/models")["data"][0]["id"])

    def delete(self, instance_id: str) -> None:
        response = self.http.delete(f"/v1/instances/{instance_id}", timeout=STOP_TIMEOUT + 30)
        if response.status_code >= 300:
            raise BenchFailed(f"DELETE /v1/instances/{instance_id} -> {response.status_code}: {response.text[:300]}")

    def add(self, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        response = self.http.post("/v1/instances", json=body)
        if response.status_code == 507 and self.refused_restart:
            # A restart's refusal outlives its instance: the scheduler hands it to the next POST of the same id
            # (once), whatever the nodes say now. Counted (``stale_refusals``); the second POST is judged afresh.
            self.stale_refusals += 1
            say(f"POST /v1/instances refused with a stale refusal: {response.json()['error']['message'][:200]}")
            response = self.http.post("/v1/instances", json=body)
        self.refused_restart = False
        if response.status_code != 201:
            raise BenchFailed(f"POST /v1/instances -> {response.status_code}: {response.text[:300]}")
        deadline = time.monotonic() + timeout
        while True:
            inst = self.get(f"/v1/instances/{body['id']}")
            if all(r["state"] == "ready" for r in inst["replicas"]):
                return inst
            if time.monotonic() > deadline:
                raise BenchFailed(f"{body['id']}: not every replica ready within {timeout:.0f} s: {inst['replicas']}")
            time.sleep(POLL)

    def stop(self, cluster_nodes: list[Any]) -> int:
        """SIGTERM (bounded, then SIGKILL); then wait for its runners and node agents to be gone (SIGKILL those
        left after ``GONE_BOUND``): how many were left."""
        agents: set[int] = set()
        if self.coordinator and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                agents = {int(n["agent_pid"]) for n in self.nodes() if n.get("agent_pid")}
        agents |= self.tracker.workers - {self.pid}
        forced, left = self.stop_and_sweep(STOP_TIMEOUT, GONE_BOUND, POLL)
        if forced:
            say(f"server pid {self.pid} needed SIGKILL to stop")
        raylets = {p.process.pid for n in cluster_nodes for infos in n.all_processes.values() for p in infos}

        def remaining() -> list[int]:
            ours = descendants(raylets) | agents  # an agent is a NodeAgent on /proc: a reused pid never is
            return sorted({p for p in ours if is_agent(p)} | set(runner_processes(agents)))

        _, stragglers = wait_gone(remaining, GONE_BOUND)
        kill_all(stragglers)
        if stragglers:
            say(f"after stopping server pid {self.pid}: {len(stragglers)} agents or runners left: {stragglers}")
        self.http.close()
        self.tracker.leftover_after_stops.append(left + len(stragglers))
        return left + len(stragglers)


@contextlib.contextmanager
def serving(tracker: Tracker, cluster: Any, *args: str) -> Iterator[Server]:
    server = Server(tracker, *args)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop(list(cluster.worker_nodes) + ([cluster.head_node] if cluster.head_node else []))


# --------------------------------------------------------------------------------------------------------------
# 1. Streaming through the cluster vs locally
# --------------------------------------------------------------------------------------------------------------


WARMUP_PROMPT = "Say hello."  # none of PROMPTS: no timed request finds its whole prompt cached by the warm-up


def chat(model: str, prompt: int | None, max_tokens: int) -> dict[str, Any]:
    return chat_body(WARMUP_PROMPT if prompt is None else PROMPTS[prompt], max_tokens, model)


def decode_rate(req: Request) -> float | None:
    """(output tokens - 1) / (last content chunk - first): tokens per second once the first token is out."""
    if req.error is not None or len(req.stamps) < 2 or req.stamps[-1] <= req.stamps[0]:
        return None
    return (req.tokens - 1) / (req.stamps[-1] - req.stamps[0])


async def stream_block(url: str, model: str, count: int, offset: int) -> list[Request]:
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT) as client:
        warm = Request(prompt=0)
        await read_stream(client, chat(model, None, WARMUP_TOKENS), warm)
        if warm.error is not None:
            raise BenchFailed(f"the warm-up request failed: {warm.error}")
        done = []
        for j in range(count):
            req = Request(prompt=(offset + j) % len(PROMPTS))
            await read_stream(client, chat(model, req.prompt, STREAM_MAX_TOKENS), req)
            done.append(req)
    return done


@dataclass
class StreamResult:
    requests: dict[str, list[Request]] = field(default_factory=lambda: {"local": [], "cluster": []})
    runner_node: str | None = None

    def rates(self, side: str) -> list[float]:
        return [r for req in self.requests[side] if (r := decode_rate(req)) is not None]

    def ttfts_ms(self, side: str) -> list[float]:
        return [req.ttft * 1000.0 for req in self.requests[side] if req.error is None and req.ttft is not None]

    def errors(self) -> list[str]:
        return [f"{side}: {req.error}" for side, reqs in self.requests.items() for req in reqs if req.error]


def streaming(tracker: Tracker, cluster: Any, rounds: int, count: int) -> StreamResult:
    result = StreamResult()
    for r in range(rounds):
        for side in ("local", "cluster") if r % 2 == 0 else ("cluster", "local"):
            args = ("--ray", cluster.address, "--lost-after", str(LOST_AFTER)) if side == "cluster" else ()
            say(f"streaming round {r}: {side} server starting")
            began = time.monotonic()
            with serving(tracker, cluster, *args) as server:
                if side == "cluster":
                    nodes = server.live_nodes()
                    runner = next(iter(server.get("/v1/instances")["data"]))["runner"] or {}
                    result.runner_node = runner.get("node")
                    say(f"  coordinator with {len(nodes)} agents; the runner on node {str(result.runner_node)[:8]}")
                say(f"  ready after {time.monotonic() - began:.1f} s")
                reqs = anyio.run(stream_block, server.url, server.model(), count, r * count)
                result.requests[side].extend(reqs)
                rates = [f"{x:.1f}" for req in reqs if (x := decode_rate(req)) is not None]
                ttfts = [f"{req.ttft * 1000:.0f}" for req in reqs if req.ttft is not None]
                say(f"  {side}: tokens/s {', '.join(rates)}; TTFT ms {', '.join(ttfts)}")
    return result


# --------------------------------------------------------------------------------------------------------------
# Streams that a node loss may end
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Stream:
    """One streamed request to the debug instance, as the client saw it (``time.monotonic()``)."""

    first: float | None = None  # first content chunk
    ended: float | None = None  # the error event, [DONE] or the failure
    code: str | None = None  # the error event's code
    message: str = ""
    finish: str | None = None
    problem: str | None = None  # an HTTP status or exception


async def run_stream(client: httpx.AsyncClient, stream: Stream, max_tokens: int) -> None:
    body = {
        "model": INSTANCE,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    try:
        with anyio.fail_after(STREAM_TIMEOUT):
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    stream.problem = f"HTTP {response.status_code}: {response.text[:200]}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        stream.ended = time.monotonic()
                        stream.code = chunk["error"].get("code")
                        stream.message = str(chunk["error"].get("message"))
                        return
                    for choice in chunk.get("choices") or []:
                        if (choice.get("delta") or {}).get("content") and stream.first is None:
                            stream.first = time.monotonic()
                        if choice.get("finish_reason"):
                            stream.finish = choice["finish_reason"]
    except TimeoutError:
        stream.problem = f"no end of stream within {STREAM_TIMEOUT:.0f} s"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        stream.problem = f"{type(exc).__name__}: {exc}"
    finally:
        if stream.ended is None:
            stream.ended = time.monotonic()


async def aget(client: httpx.AsyncClient, path: str) -> dict[str, Any]:
    response = await client.get(path)
    if response.status_code != 200:
        raise BenchFailed(f"GET {path} -> {response.status_code}: {response.text[:300]}")
    data: dict[str, Any] = response.json()
    return data


async def await_until(check: Callable[[], Awaitable[bool]], bound: float, what: str) -> None:
    deadline = time.monotonic() + bound
    while not await check():
        if time.monotonic() > deadline:
            raise BenchFailed(f"{what}: not within {bound:.0f} s")
        await anyio.sleep(POLL)


async def start_streams(client: httpx.AsyncClient, tg: Any, count: int) -> list[Stream]:
    """``count`` streams started in ``tg``; returns once each has its first content chunk."""
    streams = [Stream() for _ in range(count)]
    for s in streams:
        tg.start_soon(run_stream, client, s, LOSS_MAX_TOKENS)

    async def streaming() -> bool:
        return all(s.first is not None or s.problem is not None or s.code is not None for s in streams)

    await await_until(streaming, STREAMING_BOUND, f"{count} streams streaming")
    bad = [s.problem or s.message for s in streams if s.first is None]
    if bad:
        raise BenchFailed(f"streams ended before their first token: {bad[:3]}")
    return streams


@dataclass
class Victim:
    """The node to lose: its agent and the replicas it hosts (name -> runner pid)."""

    node: str
    agent: int
    replicas: dict[str, int]


async def pick_victim(client: httpx.AsyncClient, index: int, tracker: Tracker) -> Victim:
    """Node ``index % nodes`` of those hosting a replica, by node id (the rounds go round the nodes), checked on
    /proc."""
    inst = await aget(client, f"/v1/instances/{INSTANCE}")
    if any(r["node"] is None for r in inst["replicas"]):
        raise BenchFailed(f"a replica is on no node: {inst['replicas']}")
    hosts = sorted({str(r["node"]) for r in inst["replicas"]})
    node = hosts[index % len(hosts)]
    replicas = {r["name"]: int(r["pid"]) for r in inst["replicas"] if r["node"] == node and r["pid"]}
    nodes = (await aget(client, "/v1/instances"))["cluster"]["nodes"]
    tracker.note_agents(nodes)
    agent = next((int(n["agent_pid"]) for n in nodes if n["node"] == node and n["state"] == "live"), 0)
    if not agent or not is_agent(agent):
        raise BenchFailed(f"node {node[:8]}: no live NodeAgent process (agent pid {agent})")
    mine = runner_processes({agent})
    if not replicas or any(pid not in mine for pid in replicas.values()):
        raise BenchFailed(f"node {node[:8]}: replicas {replicas} are not all runners of agent {agent} ({mine})")
    return Victim(node, agent, replicas)


async def serving_count(client: httpx.AsyncClient, replicas: dict[str, int]) -> int:
    inst = await aget(client, f"/v1/instances/{INSTANCE}")
    return sum(int(r["serving"]) for r in inst["replicas"] if r["name"] in replicas)


@dataclass
class NodeWatch:
    """What the coordinator says of the lost agent: tether's verdict, Ray's notification, the cause."""

    lost_at: float | None = None
    ray_at: float | None = None
    ray_source: str | None = None  # "ray_notified_at", or "event" (the node's entry already had a fresh agent)
    cause: str | None = None


RAY_LAG = re.compile(r"Ray reported it (\d+(?:\.\d+)?) s after tether did")


async def watch_node(client: httpx.AsyncClient, victim: Victim, bound: float, wall0: float, out: NodeWatch) -> None:
    """Poll ``GET /v1/instances`` until the lost agent's ``ray_notified_at`` (or Ray's event) is known, or the bound."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        view = (await aget(client, "/v1/instances"))["cluster"]
        entry = next((n for n in view["nodes"] if n["agent_pid"] == victim.agent), None)
        if entry is not None:
            out.lost_at = entry["lost_at"] if entry["lost_at"] is not None else out.lost_at
            out.cause = entry["cause"] or out.cause
            if entry["ray_notified_at"] is not None:
                out.ray_at, out.ray_source = float(entry["ray_notified_at"]), "ray_notified_at"
                if out.lost_at is not None:  # both known (Ray's may come first: the verdict waits for its words)
                    return
        elif out.lost_at is not None:
            for event in view["events"]:
                ours = event["node"] == victim.node and event["kind"] == "ray" and event["at"] >= wall0
                if ours and (m := RAY_LAG.search(event["why"])):
                    out.ray_at, out.ray_source = out.lost_at + float(m[1]), "event"
                    return
        await anyio.sleep(POLL)


# --------------------------------------------------------------------------------------------------------------
# 2. Node loss by SIGKILL
# --------------------------------------------------------------------------------------------------------------


@dataclass
class LossRound:
    index: int
    node: str
    agent: int
    expected: int = 0  # requests the victim replica served at the kill
    failed_ms: list[float] = field(default_factory=list)
    completed: int = 0
    unexpected: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    watch: NodeWatch = field(default_factory=NodeWatch)
    killed: float = 0.0
    replaced_at: float | None = None
    runners_gone_at: float | None = None
    runners_left: list[int] = field(default_factory=list)
    replace_failed: str | None = None  # a lost replica failed instead of being re-placed: why

    @property
    def ray_ms(self) -> float | None:
        return since_ms(self.killed, self.watch.ray_at)

    @property
    def verdict_ms(self) -> float | None:
        return since_ms(self.killed, self.watch.lost_at)

    @property
    def replace_ms(self) -> float | None:
        return since_ms(self.killed, self.replaced_at)

    @property
    def runners_gone_ms(self) -> float | None:
        return since_ms(self.killed, self.runners_gone_at)


def judge(streams: list[Stream], t0: float, node: str, seen: str) -> tuple[list[float], int, list[str], list[str]]:
    """(ms to each node_lost error, requests completed, what else happened, the node_lost messages)."""
    failed, unexpected, messages = [], [], []
    completed = 0
    for s in streams:
        if s.code == "node_lost" and s.ended is not None:
            failed.append((s.ended - t0) * 1000.0)
            messages.append(s.message)
            if node[:8] not in s.message or seen not in s.message:
                unexpected.append(f"node_lost without {node[:8]!r} and {seen!r}: {s.message[:200]}")
        elif s.code is not None:
            unexpected.append(f"error {s.code}: {s.message[:200]}")
        elif s.problem is not None:
            unexpected.append(s.problem)
        elif s.finish == "length":
            completed += 1
        else:
            unexpected.append(f"ended with finish_reason {s.finish}")
    return failed, completed, unexpected, messages


async def loss_round(url: str, index: int, tracker: Tracker) -> LossRound:
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT) as client:
        victim = await pick_victim(client, index, tracker)
        out = LossRound(index, victim.node, victim.agent)
        last: list[dict[str, Any]] = []

        async def replaced() -> bool:
            inst = await aget(client, f"/v1/instances/{INSTANCE}")
            last[:] = inst["replicas"]
            lost = [r for r in inst["replicas"] if r["name"] in victim.replicas]
            failed = [r for r in lost if r["state"] == "failed"]
            if failed:  # it will not come back by itself: the round says so, and the bench re-creates the instance
                cause = failed[0]["cause"] or {}
                out.replace_failed = f"{failed[0]['name']} failed ({cause.get('kind')}): {cause.get('summary')}"
                return True
            fresh = all(r["pid"] not in (None, victim.replicas[r["name"]]) for r in lost)
            return fresh and all(r["state"] == "ready" for r in inst["replicas"])

        async def watch_replace() -> None:
            try:
                await await_until(replaced, REPLACE_BOUND, f"replicas {', '.join(victim.replicas)} re-placed")
            except BenchFailed as exc:
                states = "; ".join(f"{r['name']} {r['state']} on {str(r['node'])[:8]}: {r['cause']}" for r in last)
                raise BenchFailed(f"{exc}: {states}"[:1500]) from None
            if out.replace_failed is None:
                out.replaced_at = time.monotonic()

        async def watch_runners() -> None:
            deadline = time.monotonic() + GONE_BOUND
            agents = {victim.agent}
            while (left := await anyio.to_thread.run_sync(runner_processes, agents)) and time.monotonic() < deadline:
                await anyio.sleep(POLL)
            out.runners_left = left
            if not left:
                out.runners_gone_at = time.monotonic()

        async with anyio.create_task_group() as tg:
            streams = await start_streams(client, tg, STREAMS)
            out.expected = await serving_count(client, victim.replicas)
            wall0 = time.time()
            out.killed = time.monotonic()
            os.kill(victim.agent, signal.SIGKILL)
            tg.start_soon(watch_node, client, victim, RAY_NOTIFY_BOUND, wall0, out.watch)
            tg.start_soon(watch_runners)
            tg.start_soon(watch_replace)
        out.failed_ms, out.completed, out.unexpected, out.messages = judge(
            streams, out.killed, victim.node, "connection closed"
        )
        kill_all(out.runners_left)
        return out


# --------------------------------------------------------------------------------------------------------------
# 3. A silent node
# --------------------------------------------------------------------------------------------------------------


@dataclass
class SilentRound:
    node: str
    agent: int
    processes: int = 0
    expected: int = 0
    failed_ms: list[float] = field(default_factory=list)
    completed: int = 0
    unexpected: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    watch: NodeWatch = field(default_factory=NodeWatch)
    silenced: float = 0.0
    ray_dead_at: float | None = None

    @property
    def ray_ms(self) -> float | None:
        return since_ms(self.silenced, self.ray_dead_at)


def node_processes(ray_node: Any, agent: int) -> set[int]:
    """Every process of one Ray node: what Ray started for it, their descendants, the agent and its runners."""
    roots = {info.process.pid for infos in ray_node.all_processes.values() for info in infos}
    roots = {pid for pid in roots if alive(pid)} | {agent} | set(runner_processes({agent}))
    return roots | descendants(roots)


def silence(ray_node: Any, agent: int, stopped: set[int]) -> None:
    """SIGSTOP every process of the node; scan again until nothing new turns up (bounded)."""
    for _ in range(5):
        new = {pid for pid in node_processes(ray_node, agent) if alive(pid)} - stopped - {os.getpid()}
        if not new:
            return
        kill_all(new, signal.SIGSTOP)
        stopped.update(new)


def ray_node_dead(ray: Any, node_id: str, bound: float) -> float | None:
    """Poll ``ray.nodes()`` every ``RAY_POLL`` s until ``node_id`` is not alive: when (monotonic), or None."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if any(n["NodeID"] == node_id and not n["Alive"] for n in ray.nodes()):
                return time.monotonic()
        time.sleep(RAY_POLL)
    return None


async def silent_round(url: str, cluster: Any, ray: Any, tracker: Tracker, stopped: set[int]) -> SilentRound:
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT) as client:
        victim = await pick_victim(client, 0, tracker)
        ray_node = next((n for n in cluster.worker_nodes if n.node_id == victim.node), None)
        if ray_node is None:
            raise BenchFailed(f"node {victim.node[:8]} is not one of the Cluster's worker nodes")
        out = SilentRound(victim.node, victim.agent)

        async def ray_verdict() -> None:
            out.ray_dead_at = await anyio.to_thread.run_sync(ray_node_dead, ray, victim.node, RAY_DEAD_BOUND)

        async with anyio.create_task_group() as tg:
            streams = await start_streams(client, tg, STREAMS)
            out.expected = await serving_count(client, victim.replicas)
            wall0 = time.time()
            out.silenced = time.monotonic()
            silence(ray_node, victim.agent, stopped)
            out.processes = len(stopped)
            tg.start_soon(ray_verdict)
            # tether's verdict, then (after Ray's verdict on the node) Ray's account of the agent's death
            tg.start_soon(watch_node, client, victim, RAY_DEAD_BOUND + RAY_NOTIFY_BOUND, wall0, out.watch)
        out.failed_ms, out.completed, out.unexpected, out.messages = judge(
            streams, out.silenced, victim.node, "silent for"
        )
        return out


def unsilence(cluster: Any, node_id: str | None, stopped: set[int]) -> None:
    """SIGKILL every stopped process (and any child they left), then remove the node from the Cluster."""
    kill_all(stopped | descendants(stopped))
    wait_gone(lambda: [p for p in stopped if alive(p)], GONE_BOUND)
    ray_node = next((n for n in cluster.worker_nodes if n.node_id == node_id), None)
    if ray_node is not None:
        try:
            cluster.remove_node(ray_node, allow_graceful=False)
        except Exception as exc:
            say(f"removing node {str(node_id)[:8]} from the Cluster: {describe(exc)}")


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------


def start_cluster(cluster_class: Any) -> Any:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    began = time.monotonic()
    cluster = cluster_class(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "object_store_memory": OBJECT_STORE, "include_dashboard": False},
    )
    try:
        for _ in range(NODES):
            cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
        cluster.wait_for_nodes()
    except BaseException:
        with contextlib.suppress(Exception):
            cluster.shutdown()
        raise
    say(f"Ray cluster at {cluster.address}: a head without CPUs and {NODES} nodes, in {time.monotonic() - began:.1f} s")
    return cluster


def coordinator_for_losses(tracker: Tracker, cluster: Any) -> contextlib.AbstractContextManager[Server]:
    args = ("--ray", cluster.address, "--engine", "debug", "--name", "boot", "--lost-after", str(LOST_AFTER))
    return serving(tracker, cluster, *args)


def create_instance(server: Server, cluster: Any, spread: str) -> None:
    """The debug instance, ``NODES`` replicas with ``spread``, once every node has a live agent."""
    server.wait_nodes(len(cluster.worker_nodes))
    body = {
        "id": INSTANCE,
        "engine": "debug",
        "options": DEBUG_OPTIONS,
        "replicas": NODES,
        "spread": spread,
        "max_queue": MAX_QUEUE,
        "restart": {"crash_loop_failures": 100},
    }
    inst = server.add(body)
    nodes = ", ".join(str(r["node"])[:8] for r in inst["replicas"])
    say(f"instance {INSTANCE}: {NODES} replicas ({spread}) on nodes {nodes}")


def run_losses(
    tracker: Tracker, cluster: Any, ray: Any, rounds: int, spread: str, errors: list[str]
) -> tuple[list[LossRound], SilentRound | None]:
    losses: list[LossRound] = []
    silent: SilentRound | None = None
    with coordinator_for_losses(tracker, cluster) as server:
        tracker.coordinator = server
        server.wait_nodes(len(cluster.worker_nodes))
        server.delete("boot")
        create_instance(server, cluster, spread)
        for i in range(rounds):
            if losses and losses[-1].replace_failed is not None:
                try:  # tether will not re-place it: start the next round from a whole instance again
                    server.refused_restart = True
                    server.delete(INSTANCE)
                    create_instance(server, cluster, spread)
                except Exception as exc:
                    errors.append(f"re-creating {INSTANCE} after round {i - 1}: {describe(exc)}")
                    say(errors[-1])
                    say_tail(server)
                    break
            try:
                loss = anyio.run(loss_round, server.url, i, tracker)
            except Exception as exc:
                errors.append(f"SIGKILL round {i}: {describe(exc)}")
                say(errors[-1])
                say_tail(server)
                break
            losses.append(loss)
            failed = ", ".join(f"{x:.0f}" for x in sorted(loss.failed_ms))
            say(
                f"SIGKILL round {i}: agent {loss.agent} on node {loss.node[:8]}: {len(loss.failed_ms)}/{loss.expected} "
                f"failed after {failed} ms; tether's verdict {fmt(loss.verdict_ms or float('nan'))} ms, Ray's "
                f"notification {fmt(loss.ray_ms or float('nan'))} ms ({loss.watch.ray_source}); runners gone "
                f"{fmt(loss.runners_gone_ms or float('nan'))} ms; re-placed {fmt(loss.replace_ms or float('nan'))} ms"
            )
            for problem in loss.unexpected:
                say(f"  unexpected: {problem}")
            if loss.replace_failed is not None:
                say(f"  not re-placed: {loss.replace_failed}")
        if losses and losses[-1].replace_failed is not None:
            with contextlib.suppress(Exception):
                server.refused_restart = True
                server.delete(INSTANCE)
                create_instance(server, cluster, spread)
        # Ray's driver prints the GCS's errors (the node marked dead) on stdout: the JSON line's, so to stderr here.
        with contextlib.redirect_stdout(sys.stderr):
            silent = silent_node(server, tracker, cluster, ray, errors)
    return losses, silent


def silent_node(server: Server, tracker: Tracker, cluster: Any, ray: Any, errors: list[str]) -> SilentRound | None:
    """Section 3 on ``server``: this process joins the cluster as a driver for it; every stopped process is
    SIGKILLed and the node removed after, whatever happened."""
    silent: SilentRound | None = None
    stopped: set[int] = set()
    node_id: str | None = None
    try:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        victim_node = server.get(f"/v1/instances/{INSTANCE}")["replicas"][0]["node"]
        if victim_node is None:
            raise BenchFailed(f"replica {INSTANCE}.r0 is on no node")
        node_id = victim_node
        say(f"silent node {str(victim_node)[:8]}: SIGSTOP of every process of the node")
        silent = anyio.run(silent_round, server.url, cluster, ray, tracker, stopped)
        say(
            f"silent node: {silent.processes} processes stopped; {len(silent.failed_ms)}/{silent.expected} failed "
            f"after {', '.join(f'{x:.0f}' for x in sorted(silent.failed_ms))} ms; Ray's health check: "
            f"{fmt(silent.ray_ms or float('nan'))} ms"
        )
        for problem in silent.unexpected:
            say(f"  unexpected: {problem}")
    except Exception as exc:
        errors.append(f"silent node: {describe(exc)}")
        say(errors[-1])
        say_tail(server)
    finally:
        unsilence(cluster, node_id, stopped)
        with contextlib.suppress(Exception):
            ray.shutdown()
    return silent


def say_tail(server: Server, lines: int = 25) -> None:
    """The coordinator's last lines of stderr (its own, not Ray's), for a failure's report."""
    for line in [x for x in server.drain() if x.startswith("tether")][-lines:]:
        say(f"  | {line[:400]}")


def final_orphans(tracker: Tracker) -> list[int]:
    return sorted(set(runner_processes(tracker.workers)) | set(agent_processes(tracker.since, tracker.workers)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 loss rounds, 3 streamed requests a side")
    parser.add_argument("--rounds", type=int, default=None, help=f"SIGKILL rounds (default {ROUNDS})")
    parser.add_argument("--requests", type=int, default=None, help=f"streamed requests per side and round ({REQUESTS})")
    parser.add_argument("--stream-rounds", type=int, default=None, help=f"streaming rounds (default {STREAM_ROUNDS})")
    parser.add_argument(
        "--spread",
        choices=("STRICT_SPREAD", "SPREAD"),
        default="STRICT_SPREAD",
        help="the replicas' spread in the node-loss rounds (default STRICT_SPREAD: one per node)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    count = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    stream_rounds = args.stream_rounds or (QUICK_STREAM_ROUNDS if args.quick else STREAM_ROUNDS)

    result: dict[str, Any] = {
        "bench": "cluster",
        "quick": args.quick,
        "rounds": rounds,
        "spread": args.spread,
        "percentile": PERCENTILE,
    }
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError as exc:
        result.update(skipped=f"Ray is not installed ({exc}): pip install 'tether[ray]'", ok=True)
        emit(result)
        return 0

    tracker = Tracker()
    errors: list[str] = []
    losses: list[LossRound] = []
    silent: SilentRound | None = None
    streams = StreamResult()
    stream_skipped = llama_unavailable()
    orphans: list[int] = []
    with private_tether_dirs("tether-bench-cluster-"):
        cluster = None
        try:
            cluster = start_cluster(Cluster)
            if stream_skipped is None:
                try:
                    streams = streaming(tracker, cluster, stream_rounds, count)
                except Exception as exc:
                    errors.append(f"streaming: {describe(exc)}")
                    say(errors[-1])
            else:
                say(f"streaming skipped: {stream_skipped}")
            try:
                losses, silent = run_losses(tracker, cluster, ray, rounds, args.spread, errors)
            except Exception as exc:
                errors.append(f"node loss: {describe(exc)}")
                say(errors[-1])
        except Exception as exc:
            errors.append(f"the Ray cluster: {describe(exc)}")
            say(errors[-1])
        finally:
            with contextlib.suppress(Exception):
                ray.shutdown()
            if cluster is not None:
                try:
                    cluster.shutdown()
                except Exception as exc:
                    say(f"Cluster.shutdown: {describe(exc)}")
            _, orphans = wait_gone(lambda: final_orphans(tracker), 5.0)
            if orphans:
                say(f"orphans: {[(pid, ' '.join(cmdline(pid) or [])[:120]) for pid in orphans]}")
                kill_all(orphans)

    failed_ms = [x for loss in losses for x in loss.failed_ms]
    ray_ms = [x for loss in losses if (x := loss.ray_ms) is not None]
    verdict_ms = [x for loss in losses if (x := loss.verdict_ms) is not None]
    replace_ms = [x for loss in losses if (x := loss.replace_ms) is not None]
    gone_ms = [x for loss in losses if (x := loss.runners_gone_ms) is not None]
    local_rate, cluster_rate = median(streams.rates("local")), median(streams.rates("cluster"))
    local_ttft, cluster_ttft = median(streams.ttfts_ms("local")), median(streams.ttfts_ms("cluster"))
    replace_failed = [loss.replace_failed for loss in losses if loss.replace_failed is not None]
    measured = bool(streams.rates("local")) and bool(streams.rates("cluster"))
    silent_actor_ms = since_ms(silent.silenced, silent.watch.ray_at) if silent is not None else None
    checks = {
        "every_round_ran": len(losses) == rounds,
        "failed_are_the_victims_requests": all(
            loss.expected > 0 and len(loss.failed_ms) == loss.expected and loss.completed == STREAMS - loss.expected
            for loss in losses
        ),
        "no_unexpected_outcome": not any(loss.unexpected for loss in losses) and not (silent and silent.unexpected),
        "ray_notified_every_kill": len(ray_ms) == len(losses),
        "killed_agents_runners_gone": all(not loss.runners_left and loss.runners_gone_at for loss in losses),
        "every_replica_replaced": len(replace_ms) == len(losses) and not replace_failed,
        "silent_node_failed_its_requests": silent is not None
        and silent.expected > 0
        and len(silent.failed_ms) == silent.expected,
        "ray_saw_the_silent_node_dead": silent is not None and silent.ray_dead_at is not None,
        "streams_answered": not streams.errors(),
        "nothing_left_after_stops": not any(tracker.leftover_after_stops),
        "no_orphans": not orphans,
    }
    if stream_skipped is None:
        checks["streams_measured"] = measured
    result.update(
        node_loss_p50_ms=ms(percentile(failed_ms, 50)),
        node_loss_p99_ms=ms(percentile(failed_ms, 99)),
        ray_node_loss_p50_ms=ms(percentile(ray_ms, 50)),
        ray_node_loss_p99_ms=ms(percentile(ray_ms, 99)),
        tether_verdict_p50_ms=ms(percentile(verdict_ms, 50)),
        replace_p50_ms=ms(percentile(replace_ms, 50)),
        replace_max_ms=ms(max(replace_ms)) if replace_ms else None,
        replace_failures=len(replace_failed),
        stale_refusals=tracker.coordinator.stale_refusals if tracker.coordinator is not None else None,
        replace_failure=replace_failed[0] if replace_failed else None,
        runners_gone_p50_ms=ms(percentile(gone_ms, 50)),
        node_loss_samples=len(failed_ms),
        node_loss_ms=[round(x, 1) for x in failed_ms],
        ray_node_loss_ms=[round(x, 1) for x in ray_ms],
        ray_sources=[loss.watch.ray_source for loss in losses],
        silent_node_loss_ms=ms(median(silent.failed_ms)) if silent else None,
        silent_node_loss_max_ms=ms(max(silent.failed_ms)) if silent and silent.failed_ms else None,
        silent_failed=len(silent.failed_ms) if silent else None,
        silent_processes_stopped=silent.processes if silent else None,
        ray_silent_node_loss_ms=ms(silent.ray_ms) if silent and silent.ray_ms is not None else None,
        ray_silent_actor_notified_ms=ms(silent_actor_ms) if silent_actor_ms is not None else None,
        lost_after_s=LOST_AFTER,
        stream_ratio=round(cluster_rate / local_rate, 4) if measured else None,
        added_ttft_ms=ms(cluster_ttft - local_ttft),
        local_tokens_per_s=ms(local_rate),
        cluster_tokens_per_s=ms(cluster_rate),
        local_ttft_p50_ms=ms(local_ttft),
        cluster_ttft_p50_ms=ms(cluster_ttft),
        stream_requests=len(streams.requests["local"]),
        stream_skipped=stream_skipped,
        orphans=len(orphans),
        leftover_after_stops=tracker.leftover_after_stops,
        checks=checks,
        errors=errors + streams.errors(),
        ok=all(checks.values()) and not errors,
    )

    rows = [
        ["tether: SIGKILLed node's requests failed", fmt(percentile(failed_ms, 50)), fmt(percentile(failed_ms, 99))],
        ["Ray: the agent's death notified", fmt(percentile(ray_ms, 50)), fmt(percentile(ray_ms, 99))],
        ["tether: replica re-placed", fmt(percentile(replace_ms, 50)), fmt(percentile(replace_ms, 99))],
    ]
    if silent is not None:
        rows.append(["tether: silent node's requests failed", fmt(median(silent.failed_ms)), "-"])
        rows.append(["Ray: silent node dead (health check)", fmt(silent.ray_ms or float("nan")), "-"])
    print_rows(["ms", "p50", "p99"], rows)
    print()
    print_rows(
        ["stream", "tokens/s", "TTFT p50 ms"],
        [["local", fmt(local_rate), fmt(local_ttft)], ["cluster", fmt(cluster_rate), fmt(cluster_ttft)]],
    )
    emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
