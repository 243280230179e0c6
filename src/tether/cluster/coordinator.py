"""The coordinator side of a Ray cluster: Ray itself, one node agent per node, tether's heartbeats, node loss and
placement by true memory.

One ``NodeAgent`` actor per Ray node that has CPUs, pinned to it and *owned* by this process, never detached: Ray
kills owned actors when their owner dies. Nodes that join later, or whose agent was lost while Ray still lists them,
get a fresh agent within ``rescan`` seconds. Node loss is told by tether's own heartbeats (``tether.cluster.wire``),
never by Ray's health check alone: an agent silent for ``lost_after`` seconds, or whose connection closes, is lost at
once, with a cause naming the node and what was seen, and every request and runner life on it ends with that cause
(``_lose``). Placement asks every agent for the fit check on its own node (``place``), never Ray's placement groups,
which reserve logical resources only. What each failure costs, and its bound: docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import Any, Literal

import anyio
import msgspec
from anyio.abc import SocketStream, TaskGroup

from tether.clock import MONOTONIC, Clock
from tether.cluster import agent, placement, wire
from tether.cluster.link import AgentLink
from tether.cluster.remote import RemoteSupervisor
from tether.engines import registry
from tether.engines.base import MemoryEstimate
from tether.errors import TetherError
from tether.node import fit
from tether.node.fit import DoesNotFit, FitResult
from tether.node.hangs import Deadlines
from tether.node.instance import Instance, InstanceFailed, InstanceStopped
from tether.node.life import RunnerLife
from tether.node.listeners import Listeners
from tether.node.ranks import MAX_RANKS, Site
from tether.protocol import Cause, CauseKind, EngineSpec
from tether.units import format_bytes

log = logging.getLogger("tether.cluster.coordinator")
Spread = Literal["SPREAD", "STRICT_SPREAD", "PACK"]
EventKind = Literal["joined", "lost", "fenced", "ray"]
# Lost agents whose death Ray confirmed stay in the cluster's view (and in ``links``), the latest GONE_NODES of them:
# a node removed from Ray comes back, if ever, under a new id, so without a bound every removed node's agent (its Ray
# actor handle, its record) would be kept for the coordinator's whole life, and listed by every GET /v1/instances.
GONE_NODES = 16
RAY_WORDS_WAIT = 0.3  # how long a closed connection waits for Ray's account of the death before failing requests
ASSESS_TIMEOUT = 10.0
_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, ValueError)


class RayUnavailable(TetherError):
    """Ray is not installed, or the cluster cannot be reached or started."""


class ClusterSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``tether serve --ray``'s options."""

    address: str | None = None  # an existing cluster ("auto", "host:6379", "ray://..."); None: start a local head
    interval: float = 0.2  # heartbeat period, each way
    lost_after: float = 1.0  # silence after which an agent is lost
    lease: float = 3.0  # silence after which an agent stops its runners itself
    node_memory_limit: int | None = None  # bytes tether may use on each node (a memory cgroup per agent)
    object_store_memory: int = 80 << 20  # a local head's object store (tokens are small: batches of deltas)
    rescan: float = 2.0  # seconds between looks for nodes without an agent
    stop_timeout: float = 10.0

    def check(self) -> str | None:
        if not 0 < self.interval < self.lost_after:
            return (
                f"the heartbeat interval ({self.interval:g} s) must be > 0 and below lost_after ({self.lost_after:g} s)"
            )
        if self.lease <= self.lost_after:
            return (
                f"the lease ({self.lease:g} s) must be longer than lost_after ({self.lost_after:g} s): an agent must "
                "not fence itself before its coordinator would have declared it lost"
            )
        return None


class NodeEvent(msgspec.Struct, frozen=True):
    """A node's agent joined or was lost (kept for ``GET /v1/instances`` and logged)."""

    at: float
    node: str
    kind: EventKind
    why: str


def _ray_words(lines: list[str]) -> str:
    """The gist of Ray's account of an actor's death: why it is dead and the worker's exit, without the advice."""
    text = " ".join(lines)
    match = re.search(r"Worker exit type: (\S+) Worker exit detail: ([^.]*\.)", text)
    if match:
        return f"the agent's worker process died (exit type {match[1]}: {match[2]})"
    why = next((line for line in lines if "dead because" in line or "died" in line), lines[-1])
    return why[:300]


def _rank_estimate(spec: EngineSpec, rank: int, world: int, shares: tuple[float, ...]) -> MemoryEstimate | None:
    """What rank ``rank`` of ``world`` needs with ``shares`` of the model (the engine's estimate of its share)."""
    return registry.estimate(fit.rank_spec(spec, rank, world, shares))


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(
            "tether serve --ray needs Ray: install tether's ray extra (ray==2.60.0; pip install '.[ray]' in the "
            "checkout), on this machine and every node"
        ) from exc
    return ray


class Cluster:
    """Ray, the agents and their heartbeats. Use as ``async with Cluster(settings) as cluster:`` around the fleet
    (``Fleet(cluster=cluster)``, ``Scheduler(..., placement=cluster.place)``); leaving stops the agents."""

    def __init__(self, settings: ClusterSettings, clock: Clock = MONOTONIC) -> None:
        problem = settings.check()
        if problem is not None:
            raise TetherError(f"invalid cluster settings: {problem}")
        self.settings = settings
        self.clock = clock  # heartbeats and loss detection read it (a test steps a ``SteppedClock``)
        self.links: dict[str, AgentLink] = {}  # node id -> its current agent
        self.events: list[NodeEvent] = []
        self.listeners: Listeners[NodeEvent] = Listeners("cluster event")
        self.placed: dict[str, str] = {}  # instance name -> the node its current life is placed on
        self.placed_ranks: dict[str, list[str]] = {}  # a multi-rank instance's name -> each rank's node, in order
        self.placed_shares: dict[str, tuple[float, ...]] = {}  # a split model's name -> each rank's share, in order
        self._groups: dict[str, tuple[list[Instance], Spread]] = {}  # instance name -> its replicas, their spread
        self._ray: Any = None
        self._address: str = ""
        self._token = secrets.token_hex(16)
        self._tg: TaskGroup | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def __aenter__(self) -> Cluster:
        self._ray = _import_ray()
        await anyio.to_thread.run_sync(self._init_ray)
        host = self._ray.util.get_node_ip_address()
        listener = await anyio.create_tcp_listener(local_host=host, local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        self._address = f"{host}:{port}"
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(listener.serve, self._accept)
        try:
            await self._rescan()
            if not self.links:
                raise RayUnavailable("the Ray cluster has no node with CPUs for a node agent (num_cpus > 0)")
        except BaseException as exc:  # nothing started here may outlive the failure: agents, listener, Ray
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._tg.start_soon(self._monitor)
        self._tg.start_soon(self._rescan_periodically)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:  # each live agent leaves (and removes) its memory cgroup
                for link in self.links.values():
                    if link.live:
                        tg.start_soon(self._close_agent, link)
            await anyio.to_thread.run_sync(self._shutdown)
        return None

    async def _close_agent(self, link: AgentLink) -> None:
        with contextlib.suppress(Exception), anyio.move_on_after(self.settings.stop_timeout):
            await link.actor.close.remote()

    def _init_ray(self) -> None:
        ray = self._ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if ray.is_initialized():
            return
        if self.settings.address is None:
            # Ray's own cleanup of what a dead worker started; tether never relies on it (runners keep their lifeline).
            os.environ.setdefault("RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper", "true")
            ray.init(
                include_dashboard=False,
                object_store_memory=self.settings.object_store_memory,
                log_to_driver=False,
                configure_logging=False,
            )
        else:
            try:
                ray.init(address=self.settings.address, log_to_driver=False, configure_logging=False)
            except Exception as exc:
                raise RayUnavailable(
                    f"cannot connect to the Ray cluster at {self.settings.address}: {exc}; is it running "
                    "('ray status'), and is this machine's Ray the same version (2.60.0)?"
                ) from exc

    def _shutdown(self) -> None:
        for link in list(self.links.values()):
            with contextlib.suppress(Exception):
                self._ray.kill(link.actor, no_restart=True)
        with contextlib.suppress(Exception):
            self._ray.shutdown()

    # --- agents --------------------------------------------------------------------------------------------

    def _nodes_without_agent(self) -> list[str]:
        alive = [n for n in self._ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
        return [n["NodeID"] for n in alive if not (n["NodeID"] in self.links and self.links[n["NodeID"]].lost is None)]

    async def _rescan(self) -> None:
        missing = await anyio.to_thread.run_sync(self._nodes_without_agent)
        if missing:
            async with anyio.create_task_group() as tg:
                for node_id in missing:
                    tg.start_soon(self._start_agent, node_id)

    async def _rescan_periodically(self) -> None:
        while True:
            await anyio.sleep(self.settings.rescan)
            try:
                await self._rescan()
            except Exception:
                log.exception("looking for nodes without an agent failed")

    async def _start_agent(self, node_id: str) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        s = self.settings
        settings = agent.AgentSettings(
            coordinator=self._address,
            node_id=node_id,
            token=self._token,
            interval=s.interval,
            lease=s.lease,
            memory_limit=s.node_memory_limit,
            stop_timeout=s.stop_timeout,
        )
        actor_class = self._ray.remote(num_cpus=0, max_restarts=0, max_concurrency=10_000)(agent.NodeAgent)
        actor = actor_class.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            name=None,
        ).remote(msgspec.msgpack.encode(settings))
        link = AgentLink(
            node_id,
            actor,
            s.lost_after,
            settle=s.lease + s.stop_timeout + settings.reap_timeout,
            clock=self.clock,
        )
        self.links[node_id] = link
        try:
            with anyio.fail_after(60):
                info = await actor.start.remote()
                await link.connected.wait()
        except Exception as exc:
            log.error("node %s: its agent did not start: %s", node_id[:8], exc)
            self.links.pop(node_id, None)
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)
            return
        link.pid, link.host, link.ip = info["pid"], info["host"], info.get("ip")
        link.last_seen = self.clock.now()
        assert self._tg is not None
        self._tg.start_soon(self._watch_actor, link)
        self._event(link.node_id, "joined", f"agent pid {link.pid} on {link.host}")

    async def _watch_actor(self, link: AgentLink) -> None:
        """Hold one call open on the agent: when its process dies, Ray fails it with its account of the death."""
        try:
            await link.actor.hold.remote()
        except Exception as exc:
            link.death[:] = [line.strip() for line in str(exc).splitlines() if line.strip()]
        link.died_at = self.clock.now()
        link.died.set()
        if link.lost is not None and link.lost_at is not None and link.death:
            # Ray's account came after tether's verdict (a removed node: ~2 s): the record gets it, with the lag.
            lag = self.clock.now() - link.lost_at
            self._event(link.node_id, "ray", f"Ray reported it {lag:.2f} s after tether did: {_ray_words(link.death)}")
        self._forget_gone()

    def _forget_gone(self) -> None:
        """Drop all but the latest ``GONE_NODES`` agents both lost (tether's verdict) and dead (Ray's word): nothing
        waits on them any more (a life on a lost node ends with the verdict; a replacement waits for Ray's word)."""
        gone = [link for link in self.links.values() if link.lost is not None and link.died.is_set()]
        gone.sort(key=lambda link: link.lost_at or 0.0)
        for link in gone[: max(0, len(gone) - GONE_NODES)]:
            if self.links.get(link.node_id) is link:
                del self.links[link.node_id]

    # --- heartbeats ----------------------------------------------------------------------------------------

    async def _accept(self, stream: SocketStream) -> None:
        reader = wire.Reader(stream)
        try:
            with anyio.fail_after(10):
                hello = await reader.receive()
        except (TimeoutError, *_GONE):
            await stream.aclose()
            return
        ok = isinstance(hello, wire.Hello) and secrets.compare_digest(hello.token, self._token)
        link = self.links.get(hello.node_id) if ok and isinstance(hello, wire.Hello) else None
        if link is None or link.lost is not None or link.connected.is_set():  # a stranger, or a second connection
            await stream.aclose()
            return
        link.stream = stream
        link.last_seen = self.clock.now()
        link.connected.set()
        ended: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._send_beats, link, stream)
                try:
                    while True:
                        self._received(link, await reader.receive())
                except _GONE as exc:
                    ended = exc
                tg.cancel_scope.cancel()
            if link.lost is None:
                await self._lose(link, f"its heartbeat connection closed ({type(ended).__name__})", ask_ray=True)
        finally:
            with anyio.CancelScope(shield=True):  # the accepted socket is this handler's: a lost agent's must close
                await stream.aclose()

    async def _send_beats(self, link: AgentLink, stream: SocketStream) -> None:
        seq = 0
        with contextlib.suppress(*_GONE):  # a broken connection is the receiver's to report
            while link.lost is None:
                seq += 1
                with self.clock.move_on_after(self.settings.interval):
                    await stream.send(wire.frame(wire.Beat(seq)))
                await self.clock.sleep(self.settings.interval)

    def _received(self, link: AgentLink, message: wire.Message) -> None:
        link.last_seen = self.clock.now()
        if isinstance(message, wire.Beat):
            link.report = message.node
            if link.fenced and not message.fenced:
                self._event(link.node_id, "joined", "its agent serves again after fencing itself")
            link.fenced = message.fenced
            by_id = {sup.runner_id: sup for sup in link.supervisors}
            for runner in message.runners:
                sup = by_id.get(runner.runner_id)
                if sup is not None:
                    sup.reported(runner)
        elif isinstance(message, wire.Fenced):
            link.fenced = True
            self._event(link.node_id, "fenced", f"its agent stopped {len(message.stopped)} runners: {message.reason}")
            # Read before anything else this process says after its pause: those lives are over, whatever the
            # agent's answers to their calls (still on their way) will add.
            cause = Cause(
                kind=CauseKind.NODE_LOST,
                summary=f"node {link.short}'s agent stopped its runners itself: {message.reason}",
            )
            stopped = set(message.stopped)
            for sup in list(link.supervisors):
                if sup.runner_id in stopped:
                    sup.lose(cause, self.clock.now(), settled=True)

    async def _monitor(self) -> None:
        """Declare silent agents lost; a gap in this loop itself (this process was paused) blames nobody."""
        tick = self.settings.interval / 4
        last = self.clock.now()
        while True:
            await self.clock.sleep(tick)
            now = self.clock.now()
            paused = now - last > self.settings.lost_after / 2
            last = now
            for link in list(self.links.values()):
                if link.lost is not None or not link.connected.is_set():
                    continue
                if paused:
                    link.last_seen = max(link.last_seen, now)  # what arrived meanwhile is read before we judge
                    continue
                silent = now - link.last_seen
                if silent > self.settings.lost_after:
                    why = f"its heartbeat was silent for {silent:.2f} s (lost after {self.settings.lost_after:g} s)"
                    await self._lose(link, why, ask_ray=False)

    async def _lose(self, link: AgentLink, what: str, *, ask_ray: bool) -> None:
        """Lose ``link``'s node: fail everything on it with a cause that names it (the connection closed and Ray's
        words on the actor's death, or the silence and its length), end its runner lives, and kill its agent so its
        runners die by their lifeline (a partitioned agent fences itself after its lease instead); each instance's
        restart policy then places a replacement elsewhere."""
        if link.lost is not None:
            return
        detected = self.clock.now()
        link.lost = Cause(kind=CauseKind.NODE_LOST, summary=f"node {link.short} lost: {what}")  # no new placements
        if ask_ray:
            with anyio.move_on_after(RAY_WORDS_WAIT):
                await link.died.wait()
        summary = f"node {link.short} (agent pid {link.pid} on {link.host}) lost: {what}"
        if link.death:
            summary += f"; Ray: {_ray_words(link.death)}"
        evidence = list(link.death[:12])
        if link.report is not None:
            evidence.append(
                f"last report {self.clock.now() - link.last_seen:.2f} s before: {format_bytes(link.report.available)} "
                f"available ({link.report.source})"
            )
        cause = Cause(kind=CauseKind.NODE_LOST, summary=summary, evidence=tuple(evidence))
        link.lost = cause
        link.lost_at = detected
        for sup in list(link.supervisors):
            sup.lose(cause, detected)
        self._event(link.node_id, "lost", summary)
        with contextlib.suppress(Exception):  # a live but silent agent dies now; its runners by their lifeline
            self._ray.kill(link.actor, no_restart=True)
        self._forget_gone()

    def _event(self, node_id: str, kind: EventKind, why: str) -> None:
        event = NodeEvent(time.time(), node_id, kind, why)
        self.events.append(event)
        del self.events[:-256]
        (log.error if kind == "lost" else log.warning)("node %s %s: %s", node_id[:8], kind, why)
        self.listeners(event)

    # --- placement -----------------------------------------------------------------------------------------

    def join(self, instances: list[Instance], spread: Spread) -> None:
        """The replicas of one hosted instance, so each is placed knowing where the others are."""
        for inst in instances:
            self._groups[inst.name] = (instances, spread)

    def forget(self, instances: list[Instance]) -> None:
        for inst in instances:
            self._groups.pop(inst.name, None)
            self.placed.pop(inst.name, None)
            self.placed_ranks.pop(inst.name, None)
            self.placed_shares.pop(inst.name, None)

    def runners(self, memory_limit: int | None) -> Callable[..., RunnerLife]:
        """The supervisor factory of an instance: each life on the node its placement chose."""
        return partial(self._supervisor, memory_limit=memory_limit)

    def _supervisor(
        self, spec: EngineSpec, *, runner_id: str, deadlines: Deadlines, memory_limit: int | None
    ) -> RunnerLife:
        node_id = self.placed.get(runner_id.rpartition("-")[0])  # runner ids are "<instance>-<life>"
        link = self.links.get(node_id) if node_id is not None else None
        if link is None:
            raise TetherError(f"{runner_id} was not placed on any node")
        return RemoteSupervisor(
            spec,
            runner_id=runner_id,
            deadlines=deadlines,
            link=link,
            memory_limit=memory_limit,
            stop_timeout=self.settings.stop_timeout,
        )

    async def place(self, instance: Instance) -> FitResult:
        """Pick the node for ``instance``'s next life, or each rank's; ``DoesNotFit`` with every node's numbers when
        it fits nowhere.

        Every live agent runs the fit check on its own node; the instance goes where it fits, by its replicas'
        ``spread`` (SPREAD prefers nodes without a replica, STRICT_SPREAD never puts two on one node, PACK prefers
        nodes that have one), then the node whose GPUs hold the most layers, then the most memory free (SPREAD) or
        the least that fits (PACK). Ranks of an engine that gives each a whole copy (the debug ring) need nodes that
        each fit the whole model; an engine that splits the model (``splits_model``) needs none that does: its ranks
        go to the nodes with the most memory available, each rank's share of the layers by that memory
        (``tether.cluster.placement``), and each chosen agent checks its own share. ``ranks: "auto"``: one runner
        where a node holds the model whole, else the fewest nodes whose shares all fit."""
        self.placed.pop(instance.name, None)
        self.placed_ranks.pop(instance.name, None)
        self.placed_shares.pop(instance.name, None)
        replicas, spread = self._groups.get(instance.name, ([instance], "SPREAD"))
        links = [link for link in self.links.values() if link.live and not link.fenced]
        verdicts = await self._assess([(link, instance.spec) for link in links], instance.force)
        if instance.auto_ranks or (instance.ranks > 1 and registry.splits_model(instance.spec.engine)):
            split = await self._place_split(instance, verdicts, links)
            if split is not None:
                return split
        siblings = {
            self.placed[other.name]
            for other in replicas
            if other is not instance
            and other.name in self.placed
            and not isinstance(other.state, InstanceFailed | InstanceStopped)
        }
        fitting = [v for v in verdicts.values() if v.fits]
        if instance.ranks > 1:
            return self._place_ranks(instance, verdicts, links, fitting)
        fitting = placement.whole_order(fitting, siblings, spread)
        if not fitting:
            raise DoesNotFit(self._refusal(instance, verdicts, links, siblings, spread))
        chosen = fitting[0]
        self.placed[instance.name] = chosen.node_id
        message = f"placed on node {chosen.node_id[:8]}: {chosen.message}"
        return FitResult(None, chosen.available, f"node {chosen.node_id[:8]}: {chosen.source}", True, False, message)

    async def _assess(self, jobs: list[tuple[AgentLink, EngineSpec]], force: bool) -> dict[str, agent.Verdict]:
        """Each job's fit check on its node, concurrently: node id -> verdict (none for a node that did not answer
        within ``ASSESS_TIMEOUT``)."""
        verdicts: dict[str, agent.Verdict] = {}

        async def assess(link: AgentLink, spec: bytes) -> None:
            with contextlib.suppress(Exception), anyio.move_on_after(ASSESS_TIMEOUT):
                raw = await link.actor.assess.remote(spec, force)
                verdicts[link.node_id] = msgspec.msgpack.decode(raw, type=agent.Verdict)

        async with anyio.create_task_group() as tg:
            for link, spec in jobs:
                tg.start_soon(assess, link, msgspec.msgpack.encode(spec))
        return verdicts

    async def _place_split(
        self, instance: Instance, verdicts: dict[str, agent.Verdict], links: list[AgentLink]
    ) -> FitResult | None:
        """The ranks of an engine that divides the model among them (``tether.cluster.placement``): ``world``
        nodes, the most memory available first, each rank's share of the layers its node's available memory, and
        each chosen agent's fit check of its own share. ``ranks: "auto"``: None (an ordinary single-runner life)
        when a node holds the model whole, else the fewest nodes whose shares all fit."""
        spec = instance.spec
        if instance.auto_ranks and any(v.fits for v in verdicts.values()):
            instance.ranks = 1
            return None
        by_id = {link.node_id: link for link in links}
        offers = [placement.Offer(v.node_id, v.available, v.source) for v in verdicts.values() if v.node_id in by_id]
        if instance.auto_ranks:
            worlds = list(range(2, min(MAX_RANKS, len(offers)) + 1))
        elif len(offers) >= instance.ranks:
            worlds = [instance.ranks]
        else:
            worlds = []
        estimate = partial(_rank_estimate, spec)
        tried: list[tuple[placement.Split, dict[str, agent.Verdict]]] = []
        for world in worlds:
            split = await anyio.to_thread.run_sync(placement.split_over, offers, world, estimate)  # reads a header
            if instance.auto_ranks and not split.fits:  # by the estimate here: no agent need be asked
                tried.append((split, {}))
                continue
            jobs = [(by_id[r.node.node_id], fit.rank_spec(spec, r.rank, world, split.shares)) for r in split.ranks]
            confirmed = await self._assess(jobs, instance.force)
            tried.append((split, confirmed))
            if all(node in confirmed and confirmed[node].fits for node in split.nodes):
                return self._placed_split(instance, split, confirmed)
        raise DoesNotFit(self._split_refusal(instance, verdicts, links, tried))

    def _placed_split(
        self, instance: Instance, split: placement.Split, confirmed: dict[str, agent.Verdict]
    ) -> FitResult:
        self.placed_ranks[instance.name] = list(split.nodes)
        self.placed_shares[instance.name] = split.shares
        self.placed[instance.name] = split.nodes[0]
        instance.ranks = split.world
        total = sum(split.shares)
        where = ", ".join(
            f"rank {r.rank} on node {r.node.node_id[:8]} ({share / total:.0%} of the model: "
            f"{confirmed[r.node.node_id].message})"
            for r, share in zip(split.ranks, split.shares, strict=True)
        )
        least = min(split.ranks, key=lambda r: r.node.available).node
        message = f"split over {split.world} nodes by their free memory: {where}"
        return FitResult(None, least.available, f"node {least.node_id[:8]}: {least.source}", True, False, message)

    def _place_ranks(
        self,
        instance: Instance,
        verdicts: dict[str, agent.Verdict],
        links: list[AgentLink],
        fitting: list[agent.Verdict],
    ) -> FitResult:
        """Each rank (a whole copy of the model) on a node of its own (STRICT_SPREAD), the most memory free first."""
        fitting.sort(key=lambda v: -v.available)
        if len(fitting) < instance.ranks:
            raise DoesNotFit(self._refusal(instance, verdicts, links, set(), "STRICT_SPREAD"))
        chosen = fitting[: instance.ranks]
        self.placed_ranks[instance.name] = [v.node_id for v in chosen]
        self.placed[instance.name] = chosen[0].node_id
        where = ", ".join(f"rank {rank} on node {v.node_id[:8]}" for rank, v in enumerate(chosen))
        least = min(chosen, key=lambda v: v.available)
        return FitResult(None, least.available, f"node {least.node_id[:8]}: {least.source}", True, False, where)

    def world(self, instance: str) -> int:
        """The ranks of ``instance``'s next life, as placed (1: a single runner)."""
        return len(self.placed_ranks.get(instance) or ()) or 1

    def sites(self, instance: str, memory_limit: int | None) -> list[Site]:
        """Where each rank of ``instance``'s next life runs, as placed: its node's address, its agent and (for a
        split model) its share."""
        nodes = self.placed_ranks.get(instance)
        links = [self.links.get(node_id) for node_id in nodes or ()]
        if not nodes or any(link is None for link in links):
            raise TetherError(f"the ranks of {instance} were not placed on live nodes")
        shares = self.placed_shares.get(instance) or (None,) * len(nodes)
        return [
            Site(
                link.ip or link.host or "127.0.0.1",
                partial(
                    RemoteSupervisor, link=link, memory_limit=memory_limit, stop_timeout=self.settings.stop_timeout
                ),
                share,
            )
            for link, share in zip(links, shares, strict=True)
            if link is not None
        ]

    def _split_refusal(
        self,
        instance: Instance,
        verdicts: dict[str, agent.Verdict],
        links: list[AgentLink],
        tried: list[tuple[placement.Split, dict[str, agent.Verdict]]],
    ) -> FitResult:
        """Why a split model was not placed: every node's numbers, whole and in each split tried."""
        last = dict(tried[-1][1]) if tried else {}
        nodes = []
        whole = []
        for link in links:
            verdict = last.get(link.node_id) or verdicts.get(link.node_id)
            if verdict is None:
                whole.append(f"node {link.short}: no answer to the fit check within {ASSESS_TIMEOUT:g} s")
                continue
            if link.node_id in verdicts:
                whole.append(f"node {link.short}: {verdicts[link.node_id].message}")
            nodes.append(
                {
                    "node": verdict.node_id,
                    "fits": verdict.fits,
                    "needed": verdict.needed,
                    "available": verdict.available,
                    "source": verdict.source,
                }
            )
        splits = []
        for split, confirmed in tried:
            ranks = [
                f"rank {r.rank} on node {r.node.node_id[:8]}: {confirmed[r.node.node_id].message}"
                if r.node.node_id in confirmed
                else r.describe()
                for r in split.ranks
            ]
            splits.append(f"over {split.world} nodes: {'; '.join(ranks)}")
        lost = [link.short for link in self.links.values() if not link.live or link.fenced]
        room = sum(v.available for v in verdicts.values())
        if instance.auto_ranks:
            most = min(MAX_RANKS, len(verdicts))
            head = (
                f"{instance.name} fits on no node of the cluster whole, nor split over "
                + (f"2..{most} of them" if most >= 2 else "several (a split needs 2 nodes or more)")
                + f" by their free memory ({format_bytes(room)} available on {len(verdicts)} nodes together)"
            )
            advice = "free memory on the nodes, add nodes, or lower n_ctx or parallel"
        else:
            head = (
                f"{instance.name} needs {instance.ranks} nodes, one per rank holding its share of the model, and "
                f"{len(verdicts)} answered"
            )
            advice = (
                "free memory on the chosen nodes, add nodes, ask for more ranks (smaller shares), or use ranks "
                "'auto' to let placement choose"
            )
        parts = [f"whole: {'; '.join(whole)}" if whole else "no live node agent"]
        parts += [f"split {text}" for text in splits]
        if lost:
            parts.append(f"not asked (lost or fenced): {', '.join(lost)}")
        message = f"{head}: {' | '.join(parts)}: {advice}"
        best = max((v.available for v in verdicts.values()), default=None)
        return FitResult(None, best, "cluster", False, False, message, nodes=tuple(nodes))

    def _refusal(
        self,
        instance: Instance,
        verdicts: dict[str, agent.Verdict],
        links: list[AgentLink],
        siblings: set[str],
        spread: Spread,
    ) -> FitResult:
        parts = []
        nodes = []
        for link in links:
            verdict = verdicts.get(link.node_id)
            if verdict is None:
                parts.append(f"node {link.short}: no answer to the fit check within {ASSESS_TIMEOUT:g} s")
                continue
            taken = spread == "STRICT_SPREAD" and verdict.node_id in siblings
            why = "holds a replica already (STRICT_SPREAD)" if taken and verdict.fits else verdict.message
            parts.append(f"node {link.short}: {why}")
            nodes.append(
                {
                    "node": verdict.node_id,
                    "fits": verdict.fits and not taken,
                    "needed": verdict.needed,
                    "available": verdict.available,
                    "source": verdict.source,
                }
            )
        lost = [link.short for link in self.links.values() if not link.live or link.fenced]
        if lost:
            parts.append(f"not asked (lost or fenced): {', '.join(lost)}")
        if not links:
            parts.append("no live node agent")
        fits = sum(1 for v in verdicts.values() if v.fits)
        message = (
            f"{instance.name} fits on no node of the cluster: "
            if instance.ranks == 1
            else f"{instance.name} needs {instance.ranks} nodes, one per rank, and fits on {fits}: "
        ) + "; ".join(parts)
        best = max((v.available for v in verdicts.values()), default=None)
        return FitResult(None, best, "cluster", False, False, message, nodes=tuple(nodes))

    def view(self) -> dict[str, Any]:
        return {
            "address": self._address,
            "nodes": [link.view() for link in self.links.values()],
            "events": [msgspec.to_builtins(e) for e in self.events[-64:]],
            "lost_after": self.settings.lost_after,
            "lease": self.settings.lease,
        }
