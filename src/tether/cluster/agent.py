"""A node agent: the Ray actor on each node that hosts that node's runners (node side).

Each runner life runs under a ``Supervisor`` exactly as in ``tether serve`` on one machine: spawned from the spawn
thread (pdeathsig), lifeline pipe, process group and memory cgroup, OOM evidence, hang deadlines, registry. A runner
therefore dies with its agent by the same lifeline that ties it to a single-node worker: SIGKILL the agent's process
(or remove its node) and its runners go within milliseconds.

The coordinator drives lives through Ray calls (``launch``, ``ready``, ``generate``, ``cancel``, ``stop``,
``wait_gone``) and owns the restart policy, so a replacement may be placed on another node. The agent confirms a
runner gone only once it is reaped and its process group and cgroup are empty (``wait_gone``), so a replacement never
starts beside its predecessor.

Fencing: the agent beats to its coordinator over tether's own connection (``tether.cluster.wire``). Silence longer
than ``lease`` seconds makes it stop every runner itself (a partitioned node must not keep a stale copy holding
memory); a closed connection means the coordinator is gone, and the agent stops its runners and exits.

Values cross Ray as msgpack bytes of tether's own structs: no pickling of tether objects, one encoder per direction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.abc import SocketStream

from tether.clock import MONOTONIC, Clock
from tether.cluster import wire
from tether.engines import registry
from tether.errors import TetherError
from tether.kernel.cgroups import MemoryCgroup, create_child_cgroup
from tether.node import fit
from tether.node.gone import RunnerNotGone, wait_runner_gone
from tether.node.hangs import Deadlines
from tether.node.memory import NodeMemory, node_memory
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.node.tasks import RunnerUnavailable, TaskFailed, TaskHandle
from tether.node.upkeep import GC_INTERVAL, Upkeep, interval_from_env
from tether.protocol import Cause, CauseKind, Chunk, EngineSpec, TaskState, TaskStatus, Work, phase_of

log = logging.getLogger("tether.cluster.agent")
RELAY_INTERVAL = 0.025  # seconds: a generation's Ray items after its first token, at most one per interval


class AgentSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How an agent talks to its coordinator and what it may use of its node."""

    coordinator: str  # host:port of the coordinator's heartbeat listener
    node_id: str
    token: str  # proves to the coordinator's listener that this connection is its agent's
    interval: float = 0.2  # seconds between beats, each way
    lease: float = 3.0  # seconds without the coordinator before the agent stops its runners itself
    memory_limit: int | None = None  # bytes tether may use on this node (a memory cgroup the agent joins)
    stop_timeout: float = 10.0
    reap_timeout: float = 10.0


class Verdict(msgspec.Struct, frozen=True):
    """The fit check on one node, as the coordinator compares nodes by it."""

    node_id: str
    fits: bool
    needed: int | None
    available: int
    source: str
    message: str
    gpu_layers: int = 0  # the layers this node's GPUs would hold (its fit check placed them): placement prefers more


class Launched(msgspec.Struct, frozen=True):
    pid: int | None = None
    error: str | None = None
    cause: Cause | None = None


class Exited(msgspec.Struct, frozen=True):
    """A runner life that is over: its cause, and whether its process group and cgroup are confirmed empty."""

    pid: int | None
    cause: Cause | None
    detected_in: float | None
    gone: bool
    not_gone: str | None = None


class LoadOutcome(msgspec.Struct, frozen=True):
    """A load-and-warm-up (or other call) that did not complete: why, and the runner's cause when it has one."""

    ok: bool
    error: str | None = None
    cause: Cause | None = None


class CancelAnswer(msgspec.Struct, frozen=True):
    outcome: str
    detail: str
    state: TaskState | None = None


_events = msgspec.msgpack.Encoder()


@dataclass
class _Life:
    """One runner life hosted here."""

    runner_id: str
    sup: Supervisor
    started: anyio.Event = field(default_factory=anyio.Event)
    stop: anyio.Event = field(default_factory=anyio.Event)
    gone: anyio.Event = field(default_factory=anyio.Event)
    start_error: Cause | None = None
    imposed: Cause | None = None  # the cause the agent itself gave (fenced)
    not_gone: str | None = None
    cancelled: set[str] = field(default_factory=set)  # tasks the coordinator asked to cancel (a user's cancel)


class NodeAgent:
    """The agent's state and calls. The coordinator wraps this class with ``ray.remote`` (so this module does not
    import Ray) and pins one per node."""

    def __init__(self, settings: bytes, clock: Clock = MONOTONIC) -> None:
        self.settings = msgspec.msgpack.decode(settings, type=AgentSettings)
        self.clock = clock  # the lease's (a test steps a ``SteppedClock``)
        self.supervision = SupervisorSettings(
            stop_timeout=self.settings.stop_timeout, reap_timeout=self.settings.reap_timeout, clock=clock
        )
        self._lives: dict[str, _Life] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cgroup: MemoryCgroup | None = None
        self._parent_cgroup: MemoryCgroup | None = None
        self.fenced: str | None = None  # why, while fenced
        self._heard = clock.now()
        self._seq = 0

    # --- start -------------------------------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Join the node's memory cap (if any), connect to the coordinator and start beating."""
        limit = self.settings.memory_limit
        if limit is not None:
            self._join_cgroup(limit)
        stream = await self._connect()
        self._spawn(self._beat(stream))
        self._start_upkeep()
        return {"pid": os.getpid(), "node_id": self.settings.node_id, "host": socket.gethostname(), "ip": _node_ip()}

    def _start_upkeep(self) -> None:
        """The worker's clocked collections here too (``node/upkeep``): an agent relays every generation of its
        node's runners, and lives as long as the coordinator."""
        try:
            interval = interval_from_env()
        except ValueError as exc:
            log.warning("%s; collecting every %g s", exc, GC_INTERVAL)
            interval = GC_INTERVAL
        upkeep = Upkeep(interval)
        if upkeep.interval > 0:
            upkeep.freeze()  # Ray's and tether's start-up: collections walk only what the calls make
            self._spawn(upkeep.run())

    def _join_cgroup(self, limit: int) -> None:
        self._parent_cgroup = MemoryCgroup.of_pid(os.getpid())
        if self._parent_cgroup is not None:
            sweep_agent_cgroups(self._parent_cgroup.path)  # what SIGKILLed agents before this one could not remove
        name = f"tether-agent-n{self.settings.node_id[:8]}.p{os.getpid()}"  # not a runner cgroup's name: no sweep
        cgroup, why = create_child_cgroup(name, limit)
        if cgroup is None:
            raise TetherError(f"cannot cap tether's memory on node {self.settings.node_id[:8]}: {why}")
        (cgroup.path / "cgroup.procs").write_text(str(os.getpid()))
        self._cgroup = cgroup

    async def _connect(self) -> SocketStream:
        host, _, port = self.settings.coordinator.rpartition(":")
        with anyio.fail_after(10):
            stream = await anyio.connect_tcp(host, int(port))
        await stream.send(
            wire.frame(wire.Hello(self.settings.node_id, os.getpid(), socket.gethostname(), self.settings.token))
        )
        return stream

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- heartbeats and fencing ------------------------------------------------------------------------------------

    async def _beat(self, stream: SocketStream) -> None:
        """Beat every ``interval``; fence after ``lease`` of silence; on a closed connection fence and exit."""
        reader = wire.Reader(stream)
        s = self.settings
        gone = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, ValueError)

        async def receive() -> BaseException:
            try:
                while True:
                    message = await reader.receive()
                    if isinstance(message, wire.Beat):
                        self._heard = self.clock.now()
                        if self.fenced is not None:
                            log.warning("node agent %s: coordinator back; serving again", s.node_id[:8])
                            self.fenced = None
            except gone as exc:
                return exc

        async def send() -> None:
            with contextlib.suppress(*gone):  # a broken connection is the receiver's to report
                while True:
                    silent = self.clock.now() - self._heard
                    if silent > s.lease and self.fenced is None:
                        why = f"its coordinator was silent for {silent:.1f} s (lease {s.lease:g} s)"
                        await self._fence(why, stream)
                    memory = await anyio.to_thread.run_sync(node_memory)  # reads kernel files: off the loop
                    # a coordinator that stopped reading must not stop the watch
                    with self.clock.move_on_after(s.interval):
                        await stream.send(wire.frame(self._report(memory)))
                    await self.clock.sleep(s.interval)  # fenced too: the coordinator, back, must not find us silent

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            ended = await receive()
            tg.cancel_scope.cancel()
        why = f"its coordinator's connection closed ({type(ended).__name__}): the coordinator is gone"
        await self._fence(why, None)
        await self.close()
        log.error("node agent %s: %s; exiting", s.node_id[:8], why)
        os._exit(0)  # an agent with no coordinator has nobody to serve; Ray would kill it as its owner died

    def _report(self, memory: NodeMemory) -> wire.Beat:
        self._seq += 1
        node = wire.NodeReport(memory.available, memory.source, memory.host_total, memory.cgroup_limit)
        runners = []
        for life in self._lives.values():
            sup = life.sup
            runners.append(
                wire.RunnerReport(
                    runner_id=life.runner_id,
                    pid=sup.pid,
                    status=sup.status,
                    footprint=sup.footprint,
                    cgroup=str(sup.cgroup) if sup.cgroup is not None else None,
                    log=str(sup.output_log) if sup.output_log is not None else None,
                )
            )
        return wire.Beat(self._seq, node, tuple(runners), fenced=self.fenced is not None)

    async def _fence(self, why: str, stream: SocketStream | None) -> None:
        """Stop every runner (concurrently, each within its stop bound) because the coordinator is gone or silent."""
        self.fenced = why
        log.error(
            "node agent %s fences itself: %s; stopping %d runners", self.settings.node_id[:8], why, len(self._lives)
        )
        cause = Cause(
            kind=CauseKind.NODE_LOST,
            summary=f"node {self.settings.node_id[:8]}'s agent stopped its runners itself: {why}",
        )
        lives = await self._stop_all(cause)
        if stream is not None:
            fenced = wire.Fenced(why, tuple(life.runner_id for life in lives))
            with contextlib.suppress(OSError, anyio.BrokenResourceError), anyio.move_on_after(self.settings.interval):
                await stream.send(wire.frame(fenced))

    async def _stop_all(self, cause: Cause | None = None) -> list[_Life]:
        """Stop every runner life (concurrently, each within its stop bound) and wait until each is confirmed gone;
        ``cause`` is what their lives end with (a fence's), else their own."""
        lives = list(self._lives.values())
        for life in lives:
            life.imposed = cause or life.imposed
            life.stop.set()
        with anyio.move_on_after(self.settings.stop_timeout + self.settings.reap_timeout):
            for life in lives:
                await life.gone.wait()
        return lives

    async def close(self) -> None:
        """Stop every runner and leave the node's memory cgroup (removing it)."""
        await self._stop_all()
        if self._cgroup is not None and self._parent_cgroup is not None:
            with contextlib.suppress(OSError):
                (self._parent_cgroup.path / "cgroup.procs").write_text(str(os.getpid()))
                self._cgroup.path.rmdir()

    # --- calls -------------------------------------------------------------------------------------------------

    async def assess(self, spec: bytes, force: bool) -> bytes:
        """The fit check of ``spec`` here: its estimate against this node's memory now."""
        decoded = msgspec.msgpack.decode(spec, type=EngineSpec)
        memory = await anyio.to_thread.run_sync(node_memory)  # once, off the loop: the verdict and its numbers
        try:
            result = await anyio.to_thread.run_sync(lambda: fit.assess(decoded, override=force, node=memory))
        except TetherError as exc:
            verdict = Verdict(self.settings.node_id, False, None, memory.available, memory.source, str(exc))
        else:
            verdict = Verdict(
                self.settings.node_id,
                result.ok,
                result.needed,
                memory.available,
                result.source,
                result.message,
                result.gpu_layers,
            )
        return msgspec.msgpack.encode(verdict)

    async def launch(self, runner_id: str, spec: bytes, deadlines: bytes, memory_limit: int | None) -> bytes:
        """Spawn a runner life and wait for its hello (or its failure to start)."""
        if self.fenced is not None:
            return msgspec.msgpack.encode(Launched(error=f"node agent is fenced: {self.fenced}"))
        decoded = await anyio.to_thread.run_sync(_place_gpus, msgspec.msgpack.decode(spec, type=EngineSpec))
        sup = Supervisor(
            decoded,
            self.supervision,
            runner_id=runner_id,
            deadlines=msgspec.msgpack.decode(deadlines, type=Deadlines),
            memory_limit=memory_limit,
        )
        life = _Life(runner_id, sup)
        self._lives[runner_id] = life
        self._spawn(self._host(life))
        await life.started.wait()
        if life.start_error is not None:
            return msgspec.msgpack.encode(Launched(sup.pid, life.start_error.summary, life.start_error))
        return msgspec.msgpack.encode(Launched(sup.pid))

    async def _host(self, life: _Life) -> None:
        sup = life.sup
        try:
            async with sup:
                life.started.set()
                async with anyio.create_task_group() as tg:

                    async def exited() -> None:
                        await sup.wait_exit(math.inf)
                        tg.cancel_scope.cancel()

                    tg.start_soon(exited)
                    await life.stop.wait()
                    tg.cancel_scope.cancel()
        except RunnerUnavailable as exc:
            life.start_error = exc.cause or Cause(kind=CauseKind.SPAWN_ERROR, summary=str(exc))
        except Exception as exc:
            log.exception("runner %s could not be hosted", life.runner_id)
            life.start_error = Cause(kind=CauseKind.SPAWN_ERROR, summary=f"{sup.name} could not start: {exc}")
        finally:
            life.started.set()
            if sup.process is not None:
                try:
                    with anyio.CancelScope(shield=True):
                        await wait_runner_gone(sup.process, self.settings.reap_timeout)
                except RunnerNotGone as exc:
                    life.not_gone = str(exc)
            life.gone.set()

    def _life(self, runner_id: str) -> _Life:
        life = self._lives.get(runner_id)
        if life is None:
            raise TetherError(f"no runner {runner_id!r} on node {self.settings.node_id[:8]}")
        return life

    async def ready(self, runner_id: str) -> bytes:
        """Load and warm up; the outcome says why not."""
        sup = self._life(runner_id).sup
        try:
            await sup.ready()
        except (TaskFailed, RunnerUnavailable) as exc:
            cause = exc.status.cause if isinstance(exc, TaskFailed) else exc.cause
            return msgspec.msgpack.encode(LoadOutcome(False, str(exc), cause or sup.cause))
        return msgspec.msgpack.encode(LoadOutcome(True))

    async def generate(self, runner_id: str, task_id: str, params: bytes) -> Any:
        """Stream a generation's events as batches (msgpack lists): whatever arrived since the last batch. After
        the first token, items go at most every ``RELAY_INTERVAL`` (the end at once): each Ray item costs this
        process a thread-pool hop and a wake-up (py-spy: ~20% of a core for one 70 tokens/s stream, on the cores
        llama.cpp decodes on), so two tokens an item halve it, for at most 25 ms more per token."""
        life = self._lives.get(runner_id)
        if life is None:
            status = TaskStatus(task_id, TaskState.FAILED, error=f"no runner {runner_id!r} here")
            yield _events.encode([status])
            return
        try:
            handle: TaskHandle = await life.sup.generate(msgspec.msgpack.decode(params, type=Work), task_id)
        except RunnerUnavailable as exc:
            yield _events.encode([TaskStatus(task_id, TaskState.FAILED, error=str(exc), cause=exc.cause)])
            return
        streaming = False  # its first token has gone: from then on, at most an item per RELAY_INTERVAL
        last = 0.0
        try:
            async for event in handle:
                batch = [event, *handle.ready_now()]
                wait = last + RELAY_INTERVAL - time.monotonic()
                if streaming and handle.final is None and wait > 0:
                    await anyio.sleep(wait)
                    batch += handle.ready_now()
                batch = [_imposed_end(life, e) for e in batch]
                streaming = streaming or any(isinstance(e, Chunk) for e in batch)
                yield _events.encode(batch)
                last = time.monotonic()
        finally:
            handle.close()

    async def cancel(self, runner_id: str, task_id: str) -> bytes:
        life = self._lives.get(runner_id)
        if life is None:
            return msgspec.msgpack.encode(CancelAnswer("runner_gone", f"no runner {runner_id!r} here"))
        life.cancelled.add(task_id)
        reply = await life.sup.cancel(task_id)
        return msgspec.msgpack.encode(CancelAnswer(reply.outcome, reply.detail, reply.state))

    async def stop(self, runner_id: str) -> None:
        life = self._lives.get(runner_id)
        if life is not None:
            life.stop.set()

    async def wait_gone(self, runner_id: str) -> bytes:
        """Return once the runner life is over and its group and cgroup are empty: its cause, for the restart policy."""
        life = self._life(runner_id)
        await life.gone.wait()
        self._lives.pop(runner_id, None)
        sup = life.sup
        cause = life.imposed or sup.cause or life.start_error
        if cause is None and sup.stop_report is None:
            cause = Cause(kind=CauseKind.UNEXPECTED_EXIT, summary=f"{sup.name} ended", phase=phase_of(sup.status))
        exited = Exited(sup.pid, cause, sup.detection_seconds, life.not_gone is None, life.not_gone)
        return msgspec.msgpack.encode(exited)

    async def hold(self) -> None:
        """Never returns: the coordinator holds this call open to hear Ray's account of this process's death."""
        await anyio.sleep_forever()

    async def runners(self) -> list[int]:
        """The pids of the runners alive here (tests and ``tether status`` check them against ``ps``)."""
        return [life.sup.pid for life in self._lives.values() if life.sup.pid is not None and life.sup.alive]


def _imposed_end(life: _Life, event: Any) -> Any:
    """A task this agent's own stop ended (it fenced itself) fails with the fence's cause: the runner's stop reports
    it cancelled, but nobody asked for that, so the client must not be told it was cancelled."""
    if (
        isinstance(event, TaskStatus)
        and event.state is TaskState.CANCELLED
        and life.imposed is not None
        and event.task_id not in life.cancelled
    ):
        return TaskStatus(
            event.task_id, TaskState.FAILED, error=life.imposed.summary, cause=life.imposed, tokens=event.tokens
        )
    return event


def _node_ip() -> str | None:
    """This node's address as Ray knows it (where its ranks listen and their peers reach them), None outside Ray."""
    try:
        import ray

        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    except Exception:
        return None
    return ip


def sweep_agent_cgroups(parent: Path) -> int:
    """Remove the empty memory cgroups that gone agents left in ``parent`` (a SIGKILLed agent cannot remove its
    own); agents make theirs below their own cgroup, so their successors on the node find them there."""
    removed = 0
    for path in parent.glob("tether-agent-n*.p*"):
        pid = path.name.rpartition(".p")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                path.rmdir()
                removed += 1
    return removed


def _place_gpus(spec: EngineSpec) -> EngineSpec:
    """``spec`` with its GPU layers placed on this node's GPUs (n_gpu_layers "auto": what NVML's free VRAM here
    holds, ``fit.size``): the coordinator chose the node by its verdict, which counted them; the layers are
    this node's to place. A rank's layers are the ranks' (``layer_split``); a spec without an estimate runs as is."""
    if spec.rank is not None:
        return spec
    try:
        estimate = registry.estimate(spec)
    except TetherError:
        return spec  # the launch reports what is wrong with it
    if estimate is None:
        return spec
    return fit.size(spec, estimate, node_memory()).spec
