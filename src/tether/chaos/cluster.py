"""The cluster target: a local Ray cluster (a head without CPUs and 3 nodes, all on this machine) under a
``tether serve --ray`` coordinator, an instance of 2 replicas streaming while a node or the coordinator is struck.

Attacks, mid-stream, on the node of a replica serving a stream: its agent SIGKILLed or SIGSTOPped (within or past
the lease), the node removed from Ray, its raylet SIGKILLed; or the coordinator SIGSTOPped past the lease (its
agents must fence their runners themselves) or SIGKILLed (everything it owned must go). Beside the usual checks,
each trial checks: the struck replica's requests fail ``node_lost`` within ``--lost-after`` + 0.5 s while the other
replica's complete (``_check_outcomes``); no stale replica or runner once recovered (``_check_no_stale``); nothing
left once the instance is deleted. docs/chaos.md, "Targets", says what each means to a user.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import random
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import anyio
import httpx
import psutil

from tether import env
from tether.chaos.campaign import Report, drive
from tether.chaos.plan import Attack, Only, Trial, draw, indices
from tether.chaos.target import Target, fd_links, runner_processes
from tether.chaos.trial import REQUEST_BOUND, Streams, TrialResult, _expect_outcomes, _show
from tether.kernel.pids import alive, live_processes
from tether.protocol import CauseKind

NAME = "cluster"
NODES = 3
MiB = 1 << 20
LOST_AFTER = 1.0
LEASE = 2.5
LOSS_BOUND = LOST_AFTER + 0.5  # seconds from a node's loss to its requests' failure
RECOVERY_BOUND = 90.0  # seconds for 3 live agents and every replica ready again (a fresh Ray node included)
GONE_BOUND = 10.0  # seconds for runners to be gone (a group guard waits up to 5 s for its cgroup)
COORDINATOR_GONE = 30.0  # seconds for a SIGKILLed coordinator's agents and runners to be gone (Ray's own cleanup)
TOKENS = 150  # at 0.02 s a token: 3 s of streaming, longer than any loss takes to be told
# A struck request resumed elsewhere: the loss told, then perhaps a wait for a slot behind a whole stream (parallel 2)
RESUME_BOUND = LOSS_BOUND + TOKENS * 0.02 + 0.5
OPTIONS = {"token_seconds": 0.02, "parallel": 2}
STREAMS = (2, 4)
POLL = 0.02
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * MiB}
# Ray's GCS tells a dead raylet's node from a live one by health checks: 5 missed at 3 s apart by default, so a node
# whose raylet was SIGKILLed (or removed) counted as live for ~15 s, and ``wait_for_nodes`` waited that long for its
# replacement. Checked every 0.5 s, it is dead to Ray within ~3 s. Tether's verdict on a node (its agent's
# heartbeat, ``--lost-after``) does not wait for Ray's, so no bound under test is eased by this.
RAY_SYSTEM_CONFIG: dict[str, Any] = {"health_check_period_ms": 500, "health_check_failure_threshold": 5}
HEAD_ARGS: dict[str, Any] = {
    "num_cpus": 0,
    "object_store_memory": 80 * MiB,
    "include_dashboard": False,
    "_system_config": RAY_SYSTEM_CONFIG,
}

LOST = CauseKind.NODE_LOST
CLUSTER_ATTACKS: tuple[Attack, ...] = (
    Attack("agent_sigkill", LOST, ("generating",), outside_signal="SIGKILL"),
    Attack("agent_sigstop_short", LOST, ("generating",), outside_signal="SIGSTOP"),  # past lost_after, within lease
    Attack("agent_sigstop_long", LOST, ("generating",), outside_signal="SIGSTOP"),  # past the lease: it fences
    Attack("remove_node", LOST, ("generating",)),
    Attack("raylet_sigkill", LOST, ("generating",), outside_signal="SIGKILL"),
    Attack("coordinator_sigstop", None, ("generating",), outside_signal="SIGSTOP"),
    Attack("coordinator_sigkill", None, ("generating",), worker_signal="SIGKILL"),
)
STOPPED_FOR = {"agent_sigstop_short": LOST_AFTER + 0.6, "agent_sigstop_long": LEASE + 1.5}
TOLD_FAST = frozenset({"agent_sigkill", "agent_sigstop_short", "agent_sigstop_long", "remove_node"})


def plan(seed: int, trials: int, only: Only = None) -> list[Trial]:
    pick = functools.partial(draw, attacks=CLUSTER_ATTACKS, target=NAME, streams_choice=STREAMS)
    return [pick(seed, i) for i in indices(trials, only)]


# --------------------------------------------------------------------------------------------------------------
# The Ray cluster and its coordinators
# --------------------------------------------------------------------------------------------------------------


class RayCluster:
    """``ray.cluster_utils.Cluster``: a head with no CPUs (nothing of tether's runs there) and ``NODES`` nodes."""

    def __init__(self, runtime_dir: Path | None = None) -> None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        from ray.cluster_utils import Cluster

        # Where the nodes' agents keep their runners' records (TETHER_RUNTIME_DIR, given to each node as it starts:
        # its agent inherits the raylet's environment), for the campaign to check; None: wherever they would.
        self.runtime_dir = runtime_dir

        made: Any = Cluster(
            initialize_head=True,
            head_node_args=HEAD_ARGS,
            shutdown_at_exit=False,  # made in a worker thread (Ray's hooks need the main one): the campaign stops it
        )
        self.cluster: Any = made
        try:
            self.ensure()
        except BaseException:
            self.cluster.shutdown()
            raise

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def nodes(self) -> list[Any]:
        return list(self.cluster.worker_nodes)

    def node(self, node_id: str) -> Any | None:
        return next((n for n in self.nodes() if n.node_id == node_id), None)

    def ensure(self) -> None:
        """``NODES`` worker nodes again (a removed or broken one replaced)."""
        while len(self.nodes()) < NODES:
            with mock.patch.dict(os.environ, {env.RUNTIME_DIR: str(self.runtime_dir)} if self.runtime_dir else {}):
                self.cluster.add_node(**NODE_ARGS)
        self.cluster.wait_for_nodes()

    def remove(self, node: Any) -> None:
        with contextlib.suppress(Exception):  # a node whose raylet is dead already: its other processes still go
            self.cluster.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        self.cluster.shutdown()


@contextlib.asynccontextmanager
async def ray_cluster(given: RayCluster | None, runtime_dir: Path | None = None) -> AsyncIterator[RayCluster]:
    """``given`` (a cluster someone else started, e.g. the tests' one for several campaigns) with its ``NODES``
    nodes, left running after the block; None: a cluster of this campaign's own (nodes' records in ``runtime_dir``),
    stopped after it."""
    if given is not None:
        await anyio.to_thread.run_sync(given.ensure)
        yield given
        return
    made = await anyio.to_thread.run_sync(RayCluster, runtime_dir)
    try:
        yield made
    finally:
        await anyio.to_thread.run_sync(made.shutdown)


def raylet_pid(node: Any) -> int | None:
    from ray._private import ray_constants

    infos = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET) or []
    return int(infos[0].process.pid) if infos else None


class Coordinator(Target):
    """The coordinator under attack. Its fd count is tether's part only: every fd that is not a socket, tether's two
    listeners (the API's and the agents' heartbeat listener, the cluster's ``address``), and every connection they
    accepted (an agent's heartbeat, a client's request) whoever is at the other end and whether or not it is still
    there. Left out: Ray's, opened and closed as Ray sees fit: the connections the driver opened itself (gRPC
    channels to the GCS, raylets and workers, over TCP and unix sockets: a replaced node churned the count by one
    either way, trial after trial), and those other Ray workers opened to its core worker's own gRPC listener (an
    agent dials it the first time it hands the driver a result: the ranks campaign on the cluster gained one per
    agent first used)."""

    _heartbeat: int | None = None

    def fd_links(self) -> dict[int, str] | None:
        try:
            return tether_fds(self.pid, self.tether_ports())
        except (psutil.Error, OSError, httpx.HTTPError, KeyError, ValueError):
            return super().fd_links()

    def tether_ports(self) -> set[int]:
        """The ports tether listens on: the API's and the heartbeat listener's (read once from the API)."""
        if self._heartbeat is None:
            data = httpx.get(f"{self.url}/v1/instances", timeout=10).json()
            self._heartbeat = int(str(data["cluster"]["address"]).rpartition(":")[2])
        return {int(self.url.rpartition(":")[2]), self._heartbeat}


def tether_fds(pid: int, ports: Collection[int] | None = None) -> dict[int, str] | None:
    """Process ``pid``'s fds but the connections it opened (see ``Coordinator``), each socket named by its ends;
    of the sockets it listens on, those on ``ports`` only (default: all) and what they accepted."""
    links = fd_links(pid)
    if links is None:
        return None
    connections = psutil.Process(pid).net_connections("tcp")
    listening = {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
    if ports is not None:
        listening &= set(ports)
    served = {
        c.fd: f"tcp {c.laddr.ip}:{c.laddr.port} <- {c.raddr.ip if c.raddr else '-'}:{c.raddr.port if c.raddr else '-'} "
        f"{c.status}"
        for c in connections
        if c.laddr.port in listening
    }
    return {fd: served.get(fd, link) for fd, link in links.items() if not link.startswith("socket:") or fd in served}


def coordinator(workdir: Path, address: str) -> Target:
    """``tether serve --ray`` with its own debug instance (``debug``), the loss and lease bounds of this campaign."""
    serve: tuple[str, ...] = ("--ray", address, "--engine", "debug", "--name", "debug")
    serve += ("--lost-after", str(LOST_AFTER), "--lease", str(LEASE))
    return Coordinator(workdir, serve=serve, startup=120.0, stop_timeout=10.0, ready=None)


async def view(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/v1/instances")
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def live_agents(data: dict[str, Any]) -> dict[str, int]:
    """node id -> agent pid, of the live nodes."""
    return {n["node"]: int(n["agent_pid"]) for n in data["cluster"]["nodes"] if n["state"] == "live" and n["agent_pid"]}


def shown_pids(data: dict[str, Any]) -> set[int]:
    """Every runner the API says runs: each replica's of each instance."""
    pids = set()
    for inst in data["data"]:
        for replica in inst.get("replicas") or ():
            if isinstance(replica.get("pid"), int):
                pids.add(replica["pid"])
    return pids


def settled(data: dict[str, Any]) -> bool:
    """3 live agents and every replica of every instance ready."""
    replicas = [r for inst in data["data"] for r in inst.get("replicas") or ()]
    return len(live_agents(data)) == NODES and all(r["state"] == "ready" for r in replicas)


async def wait_view(
    client: httpx.AsyncClient, done: Callable[[dict[str, Any]], bool], bound: float
) -> dict[str, Any] | None:
    with anyio.move_on_after(bound):
        while True:
            with contextlib.suppress(httpx.HTTPError):
                data = await view(client)
                if done(data):
                    return data
            await anyio.sleep(POLL)
    return None


def strays(data: dict[str, Any], agents_ever: set[int]) -> list[str]:
    """What runs on the nodes but the API does not show: runners of the live agents (their children) beyond the
    API's, the API's that do not run, and any runner process of an agent no longer live."""
    live = set(live_agents(data).values())
    shown = shown_pids(data)
    parents = {p.pid: p.ppid for p in live_processes()}
    found = runner_processes(agents_ever | live)
    running = {pid for pid in found if parents.get(pid) in live}
    problems = [f"runner {pid} runs but is not shown" for pid in sorted(running - shown)]
    problems += [f"runner {pid} is shown but does not run" for pid in sorted(shown - running)]
    dead = agents_ever - live
    orphaned = runner_processes(dead) if dead else []
    problems += [f"process {pid} of a gone agent lives on" for pid in orphaned]
    return problems


# --------------------------------------------------------------------------------------------------------------
# One trial
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ClusterFigures:
    detections: list[float] = field(default_factory=list)  # strike -> a struck request's failure, s
    pauses: list[float] = field(default_factory=list)  # a struck request's pause, resumed on another runner, s
    recoveries: list[float] = field(default_factory=list)  # strike -> every replica ready again on 3 nodes, s
    agents: set[int] = field(default_factory=set)  # every agent the shared coordinator had


class TimedStreams(Streams):
    """Streams that also note when each ended (monotonic), by index."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ended: dict[int, float] = {}

    async def timed(self, index: int) -> None:
        await self.one(index=index)
        self.ended[index] = time.monotonic()


def _instance_config(iid: str) -> dict[str, Any]:
    restart = {"initial_backoff": 0.1, "max_backoff": 1.0, "jitter": 0.0, "crash_loop_failures": 100}
    return {"id": iid, "engine": "debug", "replicas": 2, "options": OPTIONS, "restart": restart}


async def _start(client: httpx.AsyncClient, result: TrialResult, iid: str) -> dict[str, Any] | None:
    created = await client.post("/v1/instances", json=_instance_config(iid))
    if created.status_code != 201:
        result.broke("misclassified", f"the instance was refused: {created.status_code} {created.text[:300]}")
        return None
    data = await wait_view(client, settled, RECOVERY_BOUND)
    if data is None:
        result.broke("hung", f"the 2 replicas were not ready within {RECOVERY_BOUND:g} s")
    return data


def _replicas(data: dict[str, Any], iid: str) -> list[dict[str, Any]]:
    return next((list(i.get("replicas") or []) for i in data["data"] if i["id"] == iid), [])


async def run_trial(target: Target, ray: RayCluster, trial: Trial, figures: ClusterFigures) -> TrialResult:
    """A node or coordinator attack on the shared coordinator, then every check."""
    result = TrialResult(trial)
    began = time.monotonic()
    attack = trial.attack
    iid = f"c{trial.index}"
    rng = random.Random(f"{trial.seed}:{trial.index}:{NAME}:moments")
    async with httpx.AsyncClient(base_url=target.url, timeout=httpx.Timeout(REQUEST_BOUND)) as client:
        before = await wait_view(client, settled, RECOVERY_BOUND)
        if before is None:
            result.broke("hung", "the cluster was not settled (3 live agents, replicas ready) before the trial")
            return result
        since = time.time()
        data = await _start(client, result, iid)
        if data is None:
            await client.delete(f"/v1/instances/{iid}")
            return result
        figures.agents |= set(live_agents(data).values())
        seen: set[int] = {r["pid"] for r in _replicas(data, iid) if isinstance(r.get("pid"), int)}
        streams = TimedStreams(client, iid, TOKENS)
        struck: dict[str, Any] = {}

        async def strike() -> None:
            with anyio.move_on_after(REQUEST_BOUND):
                while len(streams.ids) < trial.streams:  # every stream under way on its replica
                    await anyio.sleep(POLL)
            await anyio.sleep(trial.delay)
            now = await view(client)
            replicas = _replicas(now, iid)
            serving = [r for r in replicas if r.get("serving")] or replicas
            victim = rng.choice(serving)
            agents = live_agents(now)
            struck.update(victim=victim, at=time.monotonic(), node=victim["node"], agent=agents.get(victim["node"]))
            await _strike(attack, victim, agents, ray, target)

        async with anyio.create_task_group() as tg:
            tg.start_soon(strike)
            for i in range(trial.streams):
                tg.start_soon(streams.timed, i)
        result.outcomes = list(streams.outcomes)
        if not struck:
            result.broke("hung", "the strike never came (the streams did not all start)")
        else:
            _check_outcomes(result, attack, streams, struck, figures)
        if attack.name in ("remove_node", "raylet_sigkill"):  # a fresh node takes the lost one's place
            node = ray.node(struck.get("node", ""))
            if node is not None:
                await anyio.to_thread.run_sync(ray.remove, node)
            await anyio.to_thread.run_sync(ray.ensure)
        after = await wait_view(client, settled, RECOVERY_BOUND)
        if after is None:
            result.broke("hung", f"3 live agents and every replica ready again: not within {RECOVERY_BOUND:g} s")
        else:
            if struck:
                figures.recoveries.append(time.monotonic() - struck["at"])
            figures.agents |= set(live_agents(after).values())
            seen |= {r["pid"] for r in _replicas(after, iid) if isinstance(r.get("pid"), int)}
            await _check_no_stale(result, client, figures, struck, iid)
            events = [e for e in after["cluster"]["events"] if e["at"] >= since]
            if attack.name == "coordinator_sigstop":
                if not any(e["kind"] == "fenced" for e in events):
                    result.broke("misclassified", f"no agent fenced itself while its coordinator was stopped: {events}")
                if any(e["kind"] == "lost" for e in events):
                    result.broke("misclassified", f"the coordinator's own pause blamed a node: {events}")
        await client.delete(f"/v1/instances/{iid}")
    left = await _gone(sorted(seen), GONE_BOUND)
    if left:
        result.broke("orphans", f"runners of the deleted instance left: {left}")
    result.seconds = time.monotonic() - began
    return result


async def _strike(
    attack: Attack, victim: dict[str, Any], agents: dict[str, int], ray: RayCluster, target: Target
) -> None:
    name = attack.name
    agent = agents.get(victim["node"])
    if name == "agent_sigkill" and agent is not None:
        _kill(agent, signal.SIGKILL)
    elif name in STOPPED_FOR and agent is not None:
        _kill(agent, signal.SIGSTOP)
        try:
            await anyio.sleep(STOPPED_FOR[name])
        finally:
            _kill(agent, signal.SIGCONT)
    elif name == "remove_node":
        node = ray.node(victim["node"])
        if node is not None:
            await anyio.to_thread.run_sync(ray.remove, node)
    elif name == "raylet_sigkill":
        node = ray.node(victim["node"])
        pid = raylet_pid(node) if node is not None else None
        if pid is not None:
            _kill(pid, signal.SIGKILL)
    elif name == "coordinator_sigstop":
        target.signal(signal.SIGSTOP)
        try:
            await anyio.sleep(LEASE + 1.0)
        finally:
            target.signal(signal.SIGCONT)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _check_outcomes(
    result: TrialResult, attack: Attack, streams: TimedStreams, struck: dict[str, Any], figures: ClusterFigures
) -> None:
    outcomes = streams.outcomes
    if attack.expect is None:  # the coordinator's pause: a stream may end failed once its runner was fenced
        _expect_outcomes(result, outcomes, {"complete", "failed", "rejected"}, None)
        return
    expect = attack.expect.value
    _expect_outcomes(result, outcomes, {"complete", "failed"}, expect)
    victim = struck["victim"]
    node = str(victim["node"])
    failed = [o for o in outcomes if o.kind == "failed"]
    resumed = [o for o in outcomes if o.kind == "complete" and o.resumed]  # on the other replica, or the next life
    wanted = int(victim.get("serving") or 0)
    if attack.name != "raylet_sigkill" and len(failed) + len(resumed) != wanted:
        shown = ", ".join(_show(o) for o in outcomes)
        result.broke(
            "misclassified",
            f"{wanted} streams on the struck replica, {len(failed)} failed and {len(resumed)} resumed: {shown}",
        )
    for outcome in resumed:
        figures.pauses.append(outcome.longest_gap)
        if attack.name in TOLD_FAST and outcome.longest_gap > RESUME_BOUND:
            result.broke(
                "hung",
                f"a request on the lost node paused {outcome.longest_gap:.2f} s to resume (bound {RESUME_BOUND} s)",
            )
    for outcome in failed:
        if node[:8] not in outcome.detail:
            result.broke("misclassified", f"a request failed without naming node {node[:8]}: {_show(outcome)}")
        took = streams.ended.get(outcome.index, time.monotonic()) - struck["at"]
        figures.detections.append(took)
        if attack.name in TOLD_FAST and took > LOSS_BOUND:
            result.broke(
                "hung", f"a request on the lost node failed {took:.2f} s after its loss (bound {LOSS_BOUND} s)"
            )


async def _check_no_stale(
    result: TrialResult, client: httpx.AsyncClient, figures: ClusterFigures, struck: dict[str, Any], iid: str
) -> None:
    """Once recovered: what the API shows is what runs on every node, nothing runs for a gone agent, and the struck
    replica's old runner is no longer shown or alive."""
    problems: list[str] = []
    with anyio.move_on_after(GONE_BOUND):
        while True:
            data = await view(client)
            problems = await anyio.to_thread.run_sync(strays, data, set(figures.agents))
            old = (struck.get("victim") or {}).get("pid")
            if isinstance(old, int):
                if old in shown_pids(data):
                    problems.append(f"the struck replica's runner {old} is still shown")
                if alive(old):
                    problems.append(f"the struck replica's runner {old} still lives")
            if not problems:
                return
            await anyio.sleep(0.1)
    for problem in problems:
        result.broke("orphans", f"after recovery: {problem}")


async def _gone(pids: list[int], bound: float) -> list[int]:
    with anyio.move_on_after(bound):
        while any(alive(pid) for pid in pids):
            await anyio.sleep(POLL)
    return [pid for pid in pids if alive(pid)]


async def run_coordinator_kill(ray: RayCluster, trial: Trial, workdir: Path) -> TrialResult:
    """A coordinator of its own, SIGKILLed mid-stream: its streams end (cut or complete) and every agent and
    runner it owned, on every node, is gone within ``COORDINATOR_GONE`` s."""
    result = TrialResult(trial)
    began = time.monotonic()
    iid = f"c{trial.index}"
    with tempfile.TemporaryDirectory(dir=workdir, prefix=f"coordinator-{trial.index}-") as tmp:
        target = await anyio.to_thread.run_sync(coordinator, Path(tmp), ray.address)
        agents: set[int] = set()
        try:
            async with httpx.AsyncClient(base_url=target.url, timeout=httpx.Timeout(REQUEST_BOUND)) as client:
                ready = await wait_view(client, settled, RECOVERY_BOUND)  # its agents joined, its debug instance up
                data = await _start(client, result, iid) if ready is not None else None
                if ready is None:
                    result.broke("hung", f"a new coordinator was not settled within {RECOVERY_BOUND:g} s")
                if data is not None:
                    agents = set(live_agents(data).values())
                    streams = TimedStreams(client, iid, TOKENS)

                    async def strike() -> None:
                        await streams.first.wait()
                        await anyio.sleep(trial.delay)
                        target.signal(signal.SIGKILL)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(strike)
                        for i in range(trial.streams):
                            tg.start_soon(streams.timed, i)
                    result.outcomes = list(streams.outcomes)
                    _expect_outcomes(result, streams.outcomes, {"complete", "cut"}, None)
        finally:
            target.signal(signal.SIGKILL)
            await anyio.to_thread.run_sync(target.wait_exit)
        runners = runner_processes(agents)
        left = await _gone(sorted(agents | set(runners)), COORDINATOR_GONE)
        if left:
            result.broke("orphans", f"the SIGKILLed coordinator's agents or runners outlived it: {left}")
    result.seconds = time.monotonic() - began
    return result


# --------------------------------------------------------------------------------------------------------------
# The campaign
# --------------------------------------------------------------------------------------------------------------


async def run_campaign(
    seed: int,
    trials: int,
    *,
    only: Only = None,
    progress: Callable[[TrialResult], None] | None = None,
    engine: str = "debug",
    ray: RayCluster | None = None,
) -> Report:
    """The cluster campaign ``seed`` (or only its trial ``only``): its coordinators are gone when it returns, and
    its Ray cluster too unless it was given one (``ray``, left running with ``NODES`` nodes)."""
    if engine != "debug":
        raise ValueError(f"the cluster target runs the debug engine only, not {engine!r}")
    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            "the cluster target needs Ray: install tether's ray extra (pip install '.[ray]' in the checkout)"
        )
    report = Report(seed, NAME, {"engine": engine, "nodes": NODES, "lost_after_s": LOST_AFTER, "lease_s": LEASE})
    began = time.monotonic()
    figures = ClusterFigures()
    with tempfile.TemporaryDirectory(prefix="tether-chaos-cluster-") as tmp:
        workdir = Path(tmp)
        async with ray_cluster(ray) as nodes:
            target = await anyio.to_thread.run_sync(coordinator, workdir / "shared", nodes.address)
            try:

                async def run(trial: Trial) -> TrialResult:
                    if trial.attack.worker_signal is not None:
                        return await run_coordinator_kill(nodes, trial, workdir)
                    return await run_trial(target, nodes, trial, figures)

                # the warm-up: an agent SIGKILLed, so the fresh agent's first start is not a trial's
                warm = Trial(seed, -1, CLUSTER_ATTACKS[0], "generating", 2, 1, 0.0, TOKENS, NAME)
                await drive(report, target, warm, plan(seed, trials, only), run, progress)
            finally:
                await anyio.to_thread.run_sync(target.stop)
    detections = sorted(figures.detections)
    recoveries = sorted(figures.recoveries)
    report.extra.update(
        node_loss_p50_s=round(detections[len(detections) // 2], 3) if detections else None,
        node_loss_max_s=round(detections[-1], 3) if detections else None,
        resume_pause_p50_s=round(sorted(figures.pauses)[len(figures.pauses) // 2], 3) if figures.pauses else None,
        resume_pause_max_s=round(max(figures.pauses), 3) if figures.pauses else None,
        recovery_p50_s=round(recoveries[len(recoveries) // 2], 2) if recoveries else None,
        recovery_max_s=round(recoveries[-1], 2) if recoveries else None,
    )
    report.wall_s = time.monotonic() - began
    return report
