"""tether on a real local Ray cluster (``chaos.cluster.RayCluster``: a head without CPUs and 3 nodes, all on this
machine, shared with the cluster chaos campaigns): placement by true memory, replicas, node loss (agent SIGKILLed,
agent silent, node removed), the coordinator's death and its partition. Runners are the debug engine's; every check
of "gone" is made on /proc.

One coordinator serves the module's tests that need only instances of their own (``shared``: each test starts with
every node's agent live and leaves nothing behind, node faults included, since the coordinator replaces a lost
agent); a test gets a fresh one only when its claim is about the coordinator itself (its death, its partition) or
its options (``--node-memory-limit``)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Document, Server, model_missing, shared_ray, wait_until
from tether.chaos.cluster import RayCluster
from tether.chaos.target import runner_processes
from tether.cluster import wire
from tether.engines import registry
from tether.kernel.pids import live_processes
from tether.node import fit
from tether.protocol import EngineSpec
from tether.runner.lifeline import GUARD_WAIT
from tether.units import format_bytes

pytest.importorskip("ray", reason="the cluster tests need Ray: pip install 'tether[ray]'")

pytestmark = pytest.mark.timeout(180)
NODES = 3
MiB = 1 << 20
MISSING = model_missing()
needs_model = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> RayCluster:
    """The tests' shared Ray cluster (``conftest.shared_ray``): the chaos campaigns run on it too."""
    return shared_ray(tmp_path_factory)


@contextlib.contextmanager
def coordinator(c: RayCluster, *args: str) -> Iterator[Server]:
    """``tether serve --ray`` on the cluster, the debug engine loaded at start; stopped (bounded) after."""
    c.ensure()  # the nodes a test removed put back, so every test starts with ``NODES``
    server = Server("--ray", c.address, "--engine", "debug", "--lost-after", "1", "--lease", "2.5", *args, startup=120)
    try:
        server.wait_ready(60)
        wait_until(lambda: len(live_nodes(server)) == NODES, 30, f"{NODES} node agents live")
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop(40)
        if server.proc.poll() is None:
            server.proc.kill()


@pytest.fixture(scope="module")
def shared_coordinator(cluster: RayCluster) -> Iterator[Server]:
    with coordinator(cluster) as server:
        yield server


@pytest.fixture
def shared(cluster: RayCluster, shared_coordinator: Server) -> Iterator[Server]:
    """The module's coordinator, with ``NODES`` live agents and its own ``debug`` instance ready; every instance a
    test adds is deleted after it, and its runners confirmed gone from /proc."""
    server = shared_coordinator
    cluster.ensure()
    wait_until(lambda: len(live_nodes(server)) == NODES, 60, f"{NODES} node agents live")
    debug_pid(server)  # its own debug instance ready
    yield server
    for inst in view(server)["data"]:
        if inst["id"] != "debug":
            assert server.http.delete(f"/v1/instances/{inst['id']}").status_code == 200
    cluster.ensure()  # a node the test removed comes back, and its agent joins
    wait_until(lambda: len(live_nodes(server)) == NODES, 60, f"{NODES} node agents live after the test")
    agents = {int(n["agent_pid"]) for n in live_nodes(server)}

    def only_debug_left() -> bool:
        debug = server.instance("debug")["runner"] or {}
        return set(runners_of(agents, children=True)) == {debug.get("pid")}

    try:
        wait_until(only_debug_left, 30, "every runner of the test's instances gone")
    except AssertionError as exc:
        left = runners_of(agents, children=True)
        raise AssertionError(f"{exc}: runners {left}, instances {view(server)['data']}") from None


def debug_pid(server: Server) -> int:
    """The pid of the coordinator's own debug runner, once ready: a test that loses a node may have taken it along,
    and it is re-placed like any other."""
    listed = {i["id"] for i in view(server)["data"]}
    if "debug" not in listed:  # failed for good and forgotten: say why, from the scheduler's own account
        why = [d for d in view(server)["scheduler"]["decisions"] if d.get("model") == "debug"][-5:]
        raise AssertionError(f"the coordinator's debug instance is gone (instances: {sorted(listed)}): {why}")
    wait_until(lambda: server.instance("debug")["ready"], 60, "the debug instance ready (re-placed if lost)")
    return int(server.instance("debug")["runner"]["pid"])


def events_since(server: Server, since: float, kind: str | None = None) -> list[dict[str, Any]]:
    """The coordinator's node events from ``since`` (``time.time()``) on: the shared one keeps earlier tests'."""
    events = [e for e in view(server)["cluster"]["events"] if e["at"] >= since]
    return [e for e in events if kind is None or e["kind"] == kind]


def described(server: Server) -> dict[str, Any]:
    """``GET /v1/instances`` validated against the coordinator's own ``/openapi.json``, every object closed: the
    cluster view, replicas on nodes, ranks, and causes of node loss carry no key the schema does not state."""
    document = Document(server.http.get("/openapi.json").json())
    data: dict[str, Any] = document.check(server.http.get("/v1/instances"), "/v1/instances")
    return data


def view(server: Server) -> dict[str, Any]:
    response = server.http.get("/v1/instances")
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def live_nodes(server: Server) -> list[dict[str, Any]]:
    return [n for n in view(server)["cluster"]["nodes"] if n["state"] == "live"]


def agent_pid(server: Server, node: str) -> int:
    return next(int(n["agent_pid"]) for n in live_nodes(server) if n["node"] == node)


def runners_of(agents: set[int], *, children: bool = False) -> list[int]:
    """Live runner processes (from /proc) whose worker is one of ``agents``: with ``children``, only the agents' own
    children (the runners themselves), else their guards (forks with the runner's command line) too."""
    found = runner_processes(agents)
    if not children:
        return found
    parents = {stat.pid: stat.ppid for stat in live_processes()}
    return [pid for pid in found if parents.get(pid) in agents]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def all_ready(server: Server, instance_id: str) -> bool:
    return all(r["state"] == "ready" for r in server.instance(instance_id)["replicas"])


def add(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    response = server.http.post("/v1/instances", json={"engine": "debug", **body})
    assert response.status_code == 201, response.text
    wait_until(lambda: all_ready(server, body["id"]), 60, f"every replica of {body['id']} ready")
    return server.instance(body["id"])


class Streams:
    """Concurrent streamed chat requests to one model, each ending with the time it ended and its last event."""

    def __init__(
        self, server: Server, model: str, n: int, max_tokens: int = 2000, content: str = "go", **extra: Any
    ) -> None:
        self.results: list[tuple[float, int, Any]] = []
        self.first = threading.Semaphore(0)
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}
        self.threads = [threading.Thread(target=self._one, args=(server, body)) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, server: Server, body: dict[str, Any]) -> None:
        last: Any = None
        status = 0
        with (
            httpx.Client(base_url=server.url, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response,
        ):
            status = response.status_code
            if status != 200:
                last = json.loads(response.read())
            else:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if last is None:
                            self.first.release()
                        last = json.loads(line[6:])
        self.results.append((time.monotonic(), status, last))

    def wait_streaming(self, n: int, timeout: float = 20) -> None:
        for _ in range(n):
            assert self.first.acquire(timeout=timeout), "a stream did not start"

    def join(self, timeout: float = 60) -> list[tuple[float, int, Any]]:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a stream did not end"
        return self.results


def error_of(last: Any) -> dict[str, Any]:
    assert isinstance(last, dict) and "error" in last, f"the request did not fail: {last}"
    error: dict[str, Any] = last["error"]
    return error


# --------------------------------------------------------------------------------------------------------------


def test_placement_by_true_memory_and_a_507_with_every_node(cluster: RayCluster) -> None:
    with coordinator(cluster, "--node-memory-limit", "600M") as server:
        nodes = {n["node"]: n for n in live_nodes(server)}
        assert all(n["memory"]["cgroup_limit"] == 600 * MiB for n in nodes.values()), nodes
        big = add(server, {"id": "big", "options": {"hold_bytes": 330 * MiB}})
        first = big["runner"]["node"]
        # PACK would put a second model beside the first if it fitted there: it does not, so it goes elsewhere.
        wait_until(
            lambda: next(n for n in live_nodes(server) if n["node"] == first)["memory"]["available"] < 300 * MiB,
            10,
            "the first node's memory reported taken",
        )
        other = add(server, {"id": "other", "options": {"hold_bytes": 330 * MiB}, "spread": "PACK"})
        assert other["runner"]["node"] != first
        assert "placed on node" in other["fit"]
        refused = server.http.post(
            "/v1/instances", json={"id": "huge", "engine": "debug", "options": {"hold_bytes": 2 << 30}}
        )
        assert refused.status_code == 507, refused.text
        error = refused.json()["error"]
        assert "fits on no node" in error["message"]
        assert {n["node"] for n in error["nodes"]} == set(nodes)
        assert all(not n["fits"] and n["needed"] > 2 << 30 and n["available"] < 600 * MiB for n in error["nodes"])
        assert "huge" not in {i["id"] for i in view(server)["data"]}


def test_replicas_spread_over_nodes_and_requests_balanced(shared: Server) -> None:
    server = shared
    inst = add(server, {"id": "rep", "replicas": 3, "spread": "STRICT_SPREAD", "options": {"token_seconds": 0.02}})
    nodes = [r["node"] for r in inst["replicas"]]
    assert len(set(nodes)) == 3, inst["replicas"]
    streams = Streams(server, "rep", 3, max_tokens=150)
    streams.wait_streaming(3)
    serving = [r["serving"] for r in server.instance("rep")["replicas"]]
    assert serving == [1, 1, 1], serving  # least loaded: one each, not three on the first
    results = streams.join()
    assert all(status == 200 and last["choices"][0]["finish_reason"] == "length" for _, status, last in results)
    four = server.http.post(
        "/v1/instances", json={"id": "four", "engine": "debug", "replicas": 4, "spread": "STRICT_SPREAD"}
    )
    assert four.status_code == 507, four.text
    assert "holds a replica already" in four.json()["error"]["message"]


@pytest.mark.parametrize("how", ["sigkill", "sigstop", "remove_node"])
def test_losing_a_node_resumes_its_requests_on_the_other_replica_and_replaces_its_own(
    cluster: RayCluster, shared: Server, how: str
) -> None:
    """The node's agent SIGKILLed, stopped or its node removed mid-stream: the stream on it resumes on the other
    replica once the loss is told (within lost_after, 1 s) and finishes; the loss is the history's cause, naming the
    node and how it was seen; the lost replica is placed again on a node of its own."""
    server = shared
    since = time.time()
    lose = f"lose-{how}"
    inst = add(server, {"id": lose, "replicas": 2, "options": {"token_seconds": 0.02, "parallel": 2}})
    victim = inst["replicas"][0]
    survivor = inst["replicas"][1]
    agent = agent_pid(server, victim["node"])
    agents = {int(n["agent_pid"]) for n in live_nodes(server)}
    assert victim["pid"] in runners_of({agent})
    # 150 tokens at 0.02 s (3 s): the survivor still streams past the loss (told within lost_after, 1 s, plus a beat
    # of 0.2 s at most), then finishes; so does the victim's, resumed on the survivor
    streams = Streams(server, lose, 2, max_tokens=150, stream_options={"include_usage": True})
    streams.wait_streaming(2)
    began = time.monotonic()
    if how == "sigkill":
        os.kill(agent, signal.SIGKILL)
    elif how == "sigstop":
        os.kill(agent, signal.SIGSTOP)  # silent, not dead: only the heartbeat can tell
    else:
        node = cluster.node(victim["node"])
        assert node is not None, victim
        cluster.remove(node)
    results = streams.join()
    assert all(isinstance(last, dict) and "error" not in last for _, _, last in results), results
    resumed = sorted(last["usage"]["resumed"] for _, _, last in results)
    assert resumed == [0, 1], results  # the victim's request resumed once; the survivor's was not disturbed
    # told within 1.2 s, then its last 3 s at most beside the survivor's own stream (parallel 2)
    assert max(at for at, _, _ in results) - began < 1.2 + 3.0 + 1.0, "the resumed stream did not finish in time"
    wait_until(lambda: bool(server.instance(lose)["history"]), 30, "the loss in the history")
    cause = server.instance(lose)["history"][0]["cause"]
    assert cause["kind"] == "node_lost" and victim["node"][:8] in cause["summary"], cause
    seen = {"sigkill": "connection closed", "sigstop": "silent for", "remove_node": "connection closed"}[how]
    assert seen in cause["summary"], cause
    if how == "sigkill":
        assert "Ray: the agent's worker process died" in cause["summary"], cause  # Ray's account, within 0.3 s
    wait_until(lambda: not alive(victim["pid"]), 10, "the lost node's runner gone")
    # its group guard outlives it by design, for one sweep of the runner's cgroup (lifeline.GUARD_WAIT at most)
    wait_until(lambda: runners_of({agent}) == [], GUARD_WAIT + 1, "the lost runner's group guard gone")
    wait_until(lambda: all_ready(server, lose), 60, "the lost replica re-placed")
    after = server.instance(lose)["replicas"]
    assert after[1]["pid"] == survivor["pid"], "the survivor was disturbed"
    assert after[0]["node"] != survivor["node"], after  # SPREAD: a node of its own again
    assert alive(after[0]["pid"])
    lost = events_since(server, since, "lost")
    assert any(e["node"] == victim["node"] for e in lost), lost
    if how == "remove_node":  # Ray notices a removed node later (~2 s): its account joins the record then
        wait_until(
            lambda: any(e["node"] == victim["node"] for e in events_since(server, since, "ray")),
            30,
            "Ray's own account of the removed node",
        )
    history = server.instance(lose)
    assert any(h["cause"]["kind"] == "node_lost" for h in history["history"]), history["history"]
    now = {int(n["agent_pid"]) for n in live_nodes(server)}
    expected = {r["pid"] for r in after} | {debug_pid(server)}
    assert set(runners_of(agents | now, children=True)) == expected  # what it says runs is what runs, and nothing else
    listing = described(server)
    assert listing["cluster"]["events"] and any(i["history"] for i in listing["data"]), listing


def test_only_its_own_agents_may_speak_on_the_heartbeat_path(shared: Server) -> None:
    """A stranger posing as a live node's agent (its node id, no token) is hung up on; the node stays live."""
    since = time.time()
    server = shared
    host, _, port = view(server)["cluster"]["address"].rpartition(":")
    node = live_nodes(server)[0]["node"]
    hello = wire.frame(wire.Hello(node, os.getpid(), "stranger", "not-the-token"))
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(hello)
        sock.settimeout(10)
        assert sock.recv(1) == b""  # closed on us, no beat sent
    assert len(live_nodes(server)) == NODES
    assert not events_since(server, since, "lost")


def test_a_replica_with_nowhere_to_go_waits_for_a_node_instead_of_failing(shared: Server) -> None:
    """3 STRICT_SPREAD replicas on 3 nodes, one agent SIGKILLed: the replacement finds no node (the others hold a
    replica) until the lost node's fresh agent joins; it retries with its backoff and lands there. Deleting and
    re-adding the instance then works at once: a restart's refusal is not the next creation's."""
    server = shared
    inst = add(server, {"id": "full", "replicas": 3, "spread": "STRICT_SPREAD"})
    victim = inst["replicas"][0]
    os.kill(agent_pid(server, victim["node"]), signal.SIGKILL)

    def replaced() -> bool:
        replicas = server.instance("full")["replicas"]
        return replicas[0]["pid"] not in (None, victim["pid"]) and all(r["state"] == "ready" for r in replicas)

    wait_until(replaced, 60, "the replica placed on the lost node's new agent")
    after = server.instance("full")
    assert after["replicas"][0]["node"] == victim["node"], after["replicas"]  # the only node without one
    refusals = [d for d in view(server)["scheduler"]["decisions"] if d["kind"] == "refuse"]
    assert any(d["model"] == "full.r0" for d in refusals), refusals  # it had nowhere to go for a while
    assert server.http.delete("/v1/instances/full").status_code == 200
    again = server.http.post(
        "/v1/instances", json={"id": "full", "engine": "debug", "replicas": 3, "spread": "STRICT_SPREAD"}
    )
    assert again.status_code == 201, again.text


def test_coordinator_sigkill_leaves_no_agent_and_no_runner(cluster: RayCluster) -> None:
    with coordinator(cluster) as server:
        add(server, {"id": "gone", "replicas": 3, "spread": "STRICT_SPREAD"})
        agents = {int(n["agent_pid"]) for n in live_nodes(server)}
        runners = runners_of(agents)
        assert len(runners_of(agents, children=True)) == 4, (
            runners
        )  # the debug instance loaded at start, and three replicas
        server.proc.kill()
        server.proc.wait(10)
        wait_until(lambda: not any(alive(pid) for pid in agents | set(runners)), 30, "every agent and runner gone")
        assert runners_of(agents) == []


def test_a_partitioned_coordinator_is_fenced_by_its_agents_and_agrees_with_them_after(cluster: RayCluster) -> None:
    with coordinator(cluster) as server:
        inst = add(server, {"id": "part", "replicas": 2})
        old = {r["pid"] for r in inst["replicas"]} | {server.instance("debug")["runner"]["pid"]}
        agents = {int(n["agent_pid"]) for n in live_nodes(server)}
        stopped = time.monotonic()
        os.kill(server.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: not any(alive(pid) for pid in old), 10, "every runner stopped by its own agent")
            fenced_in = time.monotonic() - stopped
            assert all(alive(pid) for pid in agents), "an agent died of its coordinator's pause"
        finally:
            os.kill(server.pid, signal.SIGCONT)
        resumed = time.monotonic()
        # After the lease (counted from the last beat heard, up to one 0.2 s interval before the SIGSTOP), not before
        assert 2.5 - 0.2 - 0.05 <= fenced_in < 2.5 + 10, fenced_in

        def serving() -> list[int]:
            now = server.instance("part")["replicas"] + [server.instance("debug")]
            return [r["pid"] if "pid" in r else (r["runner"] or {}).get("pid") for r in now]

        # Once it has read what its agents sent meanwhile (milliseconds), it no longer shows a stopped runner.
        wait_until(lambda: not set(serving()) & old, 1.0, "the stopped runners no longer shown")
        assert time.monotonic() - resumed < 1.5
        wait_until(lambda: all_ready(server, "part") and server.instance("debug")["ready"], 60, "serving again")
        pids = serving()
        assert all(alive(pid) for pid in pids) and not set(pids) & old, (pids, old)
        assert sorted(runners_of(agents, children=True)) == sorted(pids)  # what it says runs is what runs
        events = view(server)["cluster"]["events"]
        assert any(e["kind"] == "fenced" for e in events), events
        assert not any(e["kind"] == "lost" for e in events), events  # its own pause blamed nobody
        history = server.instance("part")["history"]
        assert any("stopped its runners itself" in h["cause"]["summary"] for h in history), history


RANK_FAULTS = {  # rank 1's fault at its 10th token, in every life (the check after the replacement asks for 4)
    "segv": ({"kind": "segv", "rank": 1, "after_tokens": 10}, "native_crash"),
    "hang_gil": ({"kind": "hang_gil", "rank": 1, "after_tokens": 10}, "hang"),
    "oom": ({"kind": "oom", "rank": 1, "after_tokens": 10}, "out_of_memory"),
}


@pytest.mark.parametrize("how", ["runner", "agent", *RANK_FAULTS])
def test_a_rank_lost_on_its_node_fails_every_rank_and_the_replacement_reuses_the_ports(
    shared: Server, how: str
) -> None:
    """A 2-rank debug ring on 2 of the 3 nodes: rank 1's runner SIGKILLed, the agent hosting it SIGKILLed, or rank 1
    crashing, hanging with the GIL held or running out of memory while generating. The request fails with rank 1's
    cause (naming its node), no rank of that life is left anywhere, and the replacement's ranks (on 2 distinct
    nodes again) listen on the same ports and serve."""
    body: dict[str, Any] = {
        "id": "ring",
        "ranks": 2,
        "options": {"token_seconds": 0.02},
        "deadlines": {"heartbeat": 1.5, "stacks": 0.5},
        "memory_limit": 256 * MiB,
        "resume": False,  # the request fails with the rank's cause (a resumed one: the ranks campaign's trials)
    }
    if how in RANK_FAULTS:
        body["faults"] = [RANK_FAULTS[how][0]]
    server = shared
    if how == "runner":  # more ranks than nodes: refused whole, every node named
        refused = server.http.post("/v1/instances", json={**body, "id": "wide", "engine": "debug", "ranks": 4})
        assert refused.status_code == 507, refused.text
        assert "needs 4 nodes, one per rank, and fits on 3" in refused.json()["error"]["message"], refused.text
        assert len(refused.json()["error"]["nodes"]) == NODES
    add(server, body)
    ranks = server.instance("ring")["ranks"]
    assert len({r["node"] for r in ranks}) == 2, ranks  # one node per rank
    old = [r["pid"] for r in ranks]
    agents = {int(n["agent_pid"]) for n in live_nodes(server)}
    victim = agent_pid(server, ranks[1]["node"])
    streams = Streams(server, "ring", 1)
    streams.wait_streaming(1)
    if how in ("runner", "agent"):
        os.kill(old[1] if how == "runner" else victim, signal.SIGKILL)
    ((_, _, last),) = streams.join()
    error = error_of(last)
    assert f"rank 1 of 2 on node {ranks[1]['node'][:8]} failed" in error["message"], error
    code = {"runner": "signal", "agent": "node_lost"}.get(how) or RANK_FAULTS[how][1]
    assert error["code"] == code, error
    wait_until(lambda: not any(alive(pid) for pid in old), 10, "every rank of the failed life gone")

    def replaced() -> bool:
        now = server.instance("ring")
        return bool(now["ready"]) and not set(old) & {r["pid"] for r in now["ranks"]}

    wait_until(replaced, 60, "a replacement ring ready")
    now = server.instance("ring")
    assert [r["address"].rpartition(":")[2] for r in now["ranks"]] == [
        r["address"].rpartition(":")[2] for r in ranks
    ], "the same ports"
    assert len({r["node"] for r in now["ranks"]}) == 2
    assert now["history"][-1]["cause"]["rank"] == 1
    answer = server.http.post(
        "/v1/chat/completions",
        json={"model": "ring", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert answer.status_code == 200, answer.text
    live = {int(n["agent_pid"]) for n in live_nodes(server)}
    expected = {r["pid"] for r in now["ranks"]} | {debug_pid(server)}
    assert set(runners_of(agents | live, children=True)) == expected, "what it says runs is what runs"
    ring = next(i for i in described(server)["data"] if i["id"] == "ring")
    assert [r["rank"] for r in ring["ranks"]] == [0, 1] and ring["history"][-1]["cause"]["rank"] == 1, ring


# --------------------------------------------------------------------------------------------------------------
# The default model split over nodes (llama.cpp's layers over ggml RPC), placed by each node's free memory
# --------------------------------------------------------------------------------------------------------------

SMALL = {"n_ctx": 1024, "parallel": 2, "n_threads": 1}  # two ranks' threads on this machine's two cores
STORY = "Tell me a long story about a lighthouse keeper and a storm."
FAST = {"initial_backoff": 0.1, "max_backoff": 0.2, "jitter": 0.0}


def ip_of(server: Server, node: str) -> str:
    ip = next(n["ip"] for n in live_nodes(server) if n["node"] == node)
    assert isinstance(ip, str) and ipaddress.ip_address(ip), ip
    return ip


def greedy(server: Server, model: str, max_tokens: int = 100) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": STORY}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    answer = server.http.post("/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    text: str = answer.json()["choices"][0]["message"]["content"]
    return text


def add_model(server: Server, body: dict[str, Any], timeout: float = 90) -> dict[str, Any]:
    response = server.http.post("/v1/instances", json={"engine": "llama.cpp", "options": SMALL, **body}, timeout=60)
    assert response.status_code == 201, response.text
    wait_until(lambda: server.instance(body["id"])["ready"], timeout, f"{body['id']} ready")
    return server.instance(body["id"])


@pytest.mark.model
@needs_model
def test_the_default_model_split_over_two_nodes_writes_the_single_runners_greedy_text(shared: Server) -> None:
    """``ranks: "auto"`` on nodes that each hold the model whole: one runner. ``ranks: 2``: a rank on each of two
    nodes, rank 0 reaching rank 1 on its node's address, and the same greedy text as the single runner's."""
    server = shared
    whole = add_model(server, {"id": "whole", "ranks": "auto"})
    assert whole["ranks"] is None and whole["runner"]["node"], whole  # it fits a node: no split
    assert "placed on node" in whole["fit"], whole["fit"]
    expected = greedy(server, "whole")
    assert len(expected) > 200, expected
    assert server.http.delete("/v1/instances/whole").status_code == 200
    split = add_model(server, {"id": "split", "ranks": 2})
    ranks = split["ranks"]
    assert len({r["node"] for r in ranks}) == 2, ranks  # a node per rank
    port = ranks[1]["address"].rpartition(":")[2]
    assert ranks[1]["address"] == f"{ip_of(server, ranks[1]['node'])}:{port}", ranks  # its node's address
    assert split["fit"].startswith("split over 2 nodes by their free memory: rank 0 on node"), split["fit"]
    assert "rank 1 of 2" in split["fit"], split["fit"]
    assert greedy(server, "split") == expected


@pytest.mark.model
@needs_model
def test_rank_1_of_a_split_model_sigkilled_mid_stream_fails_every_rank_and_the_replacement_serves(
    shared: Server,
) -> None:
    server = shared
    add_model(server, {"id": "split", "ranks": 2, "restart": FAST, "resume": False})
    ranks = server.instance("split")["ranks"]
    old = [r["pid"] for r in ranks]
    agents = {int(n["agent_pid"]) for n in live_nodes(server)}
    streams = Streams(server, "split", 1, max_tokens=400, content=STORY, temperature=0)
    streams.wait_streaming(1, timeout=60)
    os.kill(old[1], signal.SIGKILL)
    killed = time.monotonic()
    ((at, _, last),) = streams.join()
    assert at - killed < 5.0, f"the stream failed {at - killed:.2f} s after rank 1 died"
    error = error_of(last)
    assert f"rank 1 of 2 on node {ranks[1]['node'][:8]} failed" in error["message"], error
    assert error["code"] == "signal" and "SIGKILL" in error["message"], error
    wait_until(lambda: not any(alive(pid) for pid in old), 10, "every rank of the failed life gone")

    def replaced() -> bool:
        now = server.instance("split")
        return bool(now["ready"]) and not set(old) & {r["pid"] for r in now["ranks"] or ()}

    wait_until(replaced, 90, "a replacement split ready")
    now = server.instance("split")
    assert [r["address"].rpartition(":")[2] for r in now["ranks"]] == [
        r["address"].rpartition(":")[2] for r in ranks
    ], "the same ports"
    assert len({r["node"] for r in now["ranks"]}) == 2, now["ranks"]
    assert now["history"][-1]["cause"]["rank"] == 1, now["history"]
    assert len(greedy(server, "split", 16)) > 0
    live = {int(n["agent_pid"]) for n in live_nodes(server)}
    expected = {r["pid"] for r in now["ranks"]} | {debug_pid(server)}
    assert set(runners_of(agents | live, children=True)) == expected, "what it says runs is what runs"


BIG = {"n_ctx": 4096, "parallel": 2, "n_threads": 1, "prompt_cache": False}  # ~576 MiB whole, ~463 MiB for rank 0
HUGE = {"n_ctx": 8192, "parallel": 16, "n_threads": 1, "prompt_cache": False}  # ~1.4 GiB a rank, over 3 nodes


@pytest.mark.model
@needs_model
def test_a_model_no_node_can_hold_serves_split_with_ranks_auto_and_a_507_when_the_cluster_cannot(
    cluster: RayCluster,
) -> None:
    spec = EngineSpec(engine="llama.cpp", options=BIG)
    whole = registry.estimate(spec)
    shares = [registry.estimate(fit.rank_spec(spec, rank, 2)) for rank in range(2)]
    assert whole is not None and all(share is not None for share in shares)
    both = fit.ranks_estimate(spec, 2)
    assert both is not None and both.total > whole.total  # split, it needs more in all, but less on each node
    # Each node a little less than the whole model needs: its agent holds some of it (and one node the debug runner)
    limit = whole.total - 8 * MiB
    with coordinator(cluster, "--node-memory-limit", str(limit)) as server:
        nodes = sorted(live_nodes(server), key=lambda n: -n["memory"]["available"])
        room = [n["memory"]["available"] for n in nodes]
        numbers = f"whole {format_bytes(whole.total)}, ranks {[format_bytes(s.total) for s in shares if s]}, {room}"
        assert max(room) < whole.total, numbers
        assert room[1] >= max(s.total for s in shares if s) + 16 * MiB, f"the window is too narrow: {numbers}"
        inst = add_model(server, {"id": "big", "ranks": "auto", "options": BIG, "restart": FAST}, timeout=120)
        ranks = inst["ranks"]
        assert ranks is not None and len({r["node"] for r in ranks}) == 2, inst
        assert inst["fit"].startswith("split over 2 nodes by their free memory"), inst["fit"]
        assert len(greedy(server, "big", 16)) > 0
        refused = server.http.post(
            "/v1/instances", json={"id": "huge", "engine": "llama.cpp", "ranks": "auto", "options": HUGE}, timeout=60
        )
        assert refused.status_code == 507, refused.text
        error = refused.json()["error"]
        assert "fits on no node of the cluster whole, nor split over 2..3 of them" in error["message"], error
        assert "split over 3 nodes: rank 0 on node" in error["message"], error
        assert {n["node"] for n in error["nodes"]} == {n["node"] for n in nodes}, error
        assert all(not n["fits"] and n["needed"] > n["available"] for n in error["nodes"]), error
        assert "huge" not in {i["id"] for i in view(server)["data"]}
        debug = server.http.post("/v1/instances", json={"id": "ring-auto", "engine": "debug", "ranks": "auto"})
        assert debug.status_code == 400 and "gives every rank a whole copy" in debug.text, debug.text
