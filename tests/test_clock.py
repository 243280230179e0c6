"""Every rule about time, proven at its real default values on a clock the test steps.

The runners are real debug runners (real processes, pipes and signals); only the clock their rules read is stepped:
"hung after 120 s without a first token" takes milliseconds. A runner whose interpreter runs keeps proving it with
real heartbeats, so a test steps a live runner's time a little at a time, each step only once a beat has arrived at
the new time (``step_beating``); a stopped runner's time jumps. One real-time test per promise stays where the
process is the point (tests/test_hangs.py: a real SIGSTOP found by a real heartbeat; test_every_task_ends.py: a
real stop bound).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import msgspec
import pytest

from conftest import debug, pid_alive, prompt
from tether import env
from tether.clock import MONOTONIC, SteppedClock
from tether.cluster import wire
from tether.cluster.agent import AgentSettings, NodeAgent
from tether.cluster.coordinator import Cluster, ClusterSettings
from tether.cluster.link import AgentLink
from tether.engines import registry
from tether.fleet.catalog import DEFAULT_KEEP_ALIVE, Catalog, Model
from tether.fleet.fleet import Fleet, InstanceConfig
from tether.fleet.scheduler import Decision, Scheduler, SchedulerSettings
from tether.node.hangs import Deadlines, stack_dump
from tether.node.instance import Instance, InstanceFailed, InstanceReady, InstanceRestarting, RestartPolicy
from tether.node.memory import NodeMemory
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.node.tasks import TaskFailed, TaskHandle
from tether.protocol import Cause, CauseKind, Chunk, EngineSpec, Fault, Loading, Running, TaskState, WarmingUp

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftover_runners")]

BEAT = 0.01  # the runners' real heartbeat interval here: a stepped second costs a hundredth of one
REAL = 20.0  # the bound on any real wait in these tests


def stepped(clock: SteppedClock, **changes: object) -> SupervisorSettings:
    return SupervisorSettings(clock=clock, heartbeat_interval=BEAT, memory_interval=0, **changes)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def supervised(spec: EngineSpec, clock: SteppedClock) -> AsyncIterator[Supervisor]:
    """A supervisor on ``clock``; a failing test runs the clock out first, so its stop bounds expire at once."""
    async with Supervisor(spec, stepped(clock)) as sup:
        with clock.runs_out_on_error():
            yield sup


@contextlib.asynccontextmanager
async def instance(spec: EngineSpec, policy: RestartPolicy, clock: SteppedClock) -> AsyncIterator[Instance]:
    async with Instance(spec, policy, settings=stepped(clock)) as inst:
        with clock.runs_out_on_error():
            yield inst


async def step_beating(sup: Supervisor, clock: SteppedClock, seconds: float, step: float = 2.0) -> None:
    """Move ``sup``'s time on by ``seconds``, ``step`` at a time, each step only once a real heartbeat has arrived at
    the new time: the runner's interpreter runs all along (its heartbeat deadline never expires), whatever it is
    stuck on."""
    left = seconds
    while left > 1e-9:
        dt = min(step, left)
        clock.advance(dt)
        left -= dt
        with anyio.fail_after(REAL):
            while (sup.last_heartbeat or -math.inf) < clock.now() and sup.alive:
                await anyio.sleep(BEAT / 2)  # polls for the beat (an event in another process), bounded


async def first_chunk(handle: TaskHandle) -> None:
    async for event in handle:
        if isinstance(event, Chunk):
            return


def hang_of(cause: Cause | None, phase: str, deadline: str) -> Cause:
    assert cause is not None and cause.kind is CauseKind.HANG, cause
    assert cause.phase == phase and f"raise the '{deadline}' deadline" in cause.evidence[-1], cause.render()
    return cause


# --------------------------------------------------------------------------------------------------------------
# The clock itself
# --------------------------------------------------------------------------------------------------------------


async def test_a_stepped_sleeper_wakes_when_its_time_comes_and_not_before() -> None:
    clock = SteppedClock()
    woke: list[float] = []

    async def sleeper() -> None:
        await clock.sleep(5)
        woke.append(clock.now())

    async with anyio.create_task_group() as tg:
        tg.start_soon(sleeper)
        assert await clock.next_deadline() == 1005.0
        clock.advance(4.999)
        await anyio.wait_all_tasks_blocked()
        assert woke == []
        clock.advance(0.001)
    assert woke == [1005.0] and clock.pending == []
    with pytest.raises(ValueError, match="does not go back"):
        clock.advance(-1)


async def test_stepped_scopes_end_their_blocks_at_their_deadline_and_forget_their_timers() -> None:
    clock = SteppedClock()
    never = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def bounded() -> None:
            with clock.move_on_after(2) as scope:
                await never.wait()
            assert scope.cancelled_caught
            with pytest.raises(TimeoutError), clock.fail_after(3):
                await never.wait()
            with clock.move_on_after(math.inf):
                await clock.sleep(1)  # an infinite bound arms no timer: only the sleep's

        tg.start_soon(bounded)
        assert await clock.jump() == 1002.0
        assert await clock.jump() == 1005.0
        assert await clock.next_deadline(after=1005.0) == 1006.0
        await clock.jump()
    assert clock.pending == []


async def beats_routed(sup: Supervisor) -> None:
    """Wait until a stopped runner's last beats are read and routed: its events pipe is empty (it gets no more) and
    the pump is blocked again. Tasks all blocked is not enough: the pump waits on the pipe while it holds bytes the
    event loop has not polled yet, and a beat read later would be stamped with a time the test has moved on."""
    assert sup.process is not None
    poller = select.poll()
    poller.register(sup.process.events_fd, select.POLLIN)
    with anyio.fail_after(REAL):
        while poller.poll(0):
            await anyio.sleep(BEAT / 2)  # polls the pipe (bytes from another process), bounded
    await anyio.wait_all_tasks_blocked()


def test_the_real_clock_is_monotonic_time() -> None:
    import time

    before = time.monotonic()
    assert before <= MONOTONIC.now() <= time.monotonic()


# --------------------------------------------------------------------------------------------------------------
# The supervisor: deadlines and the stop sequence, at their defaults
# --------------------------------------------------------------------------------------------------------------


async def test_a_stopped_runner_is_hung_at_the_heartbeat_deadline_exactly() -> None:
    """Default heartbeat deadline 5 s: nothing at 4.999 s of silence, the hang at 5 s."""
    clock = SteppedClock()
    with anyio.fail_after(REAL):
        async with supervised(debug(token_seconds=0.01), clock) as sup:
            await sup.ready()
            handle = await sup.generate(prompt(10_000))
            await first_chunk(handle)
            assert sup.pid is not None
            os.kill(sup.pid, signal.SIGSTOP)
            _, status = os.waitpid(sup.pid, os.WUNTRACED)  # the kernel stopped it: no beat arrives after this
            assert os.WIFSTOPPED(status)
            await beats_routed(sup)  # those sent before the stop, stamped with today's time
            silent_since = sup.last_heartbeat
            assert silent_since is not None
            clock.advance(silent_since + 4.999 - clock.now())
            await anyio.wait_all_tasks_blocked()
            assert sup.hang is None and sup.alive and sup.last_heartbeat == silent_since
            clock.advance(0.001)
            final = await handle.wait()
    assert sup.hang is not None and sup.hang.deadline == "heartbeat"
    assert sup.hang.limit == Deadlines().heartbeat == 5.0 and sup.hang.seconds == pytest.approx(5.0)
    cause = hang_of(final.cause, "decode", "heartbeat")
    assert "process state T" in cause.evidence[0]


@pytest.mark.parametrize(
    ("fault", "deadline", "phase", "limit"),
    [
        (Fault(kind="hang", after_tokens=3), "token_gap", "decode", 30.0),
        (Fault(kind="slow", after_tokens=0, seconds=3600.0), "first_token", "prefill", 120.0),
    ],
)
async def test_a_live_generation_that_stops_progressing_is_hung_at_its_deadline(
    fault: Fault, deadline: str, phase: str, limit: float
) -> None:
    """The runner beats all along (its interpreter runs); only the generation is stuck, so only its phase's
    deadline may fire, at its default, with the runner's real stacks."""
    clock = SteppedClock()
    with anyio.fail_after(REAL):
        async with supervised(debug(token_seconds=0.001), clock) as sup:
            await sup.ready()
            handle = await sup.generate(prompt(10_000, fault))
            if deadline == "token_gap":
                tokens = 0
                async for event in handle:  # the last token before the hang: the gap starts there
                    tokens += event.tokens if isinstance(event, Chunk) else 0
                    if tokens == 3:
                        break
            else:
                await sup.wait_status(lambda s: isinstance(s, Running), REAL)
            await step_beating(sup, clock, limit - 0.5)
            assert sup.hang is None and sup.alive, sup.hang
            await step_beating(sup, clock, 0.5)
            final = await handle.wait()
    assert sup.hang is not None and sup.hang.deadline == deadline
    assert sup.hang.limit == getattr(Deadlines(), deadline) == limit
    assert sup.hang.seconds == pytest.approx(limit, abs=0.01)
    assert final.state is TaskState.FAILED
    dump = stack_dump(list(hang_of(final.cause, phase, deadline).evidence))  # a live runner answers with stacks
    assert any(f"in _{fault.kind}" in line for line in dump), dump  # the main thread, caught in the act


@pytest.mark.parametrize(("phase", "deadline", "limit"), [("load", "load_stall", 120.0), ("warmup", "warmup", 300.0)])
async def test_a_load_or_warmup_that_never_ends_is_hung_at_its_default_deadline(
    phase: str, deadline: str, limit: float
) -> None:
    clock = SteppedClock()
    failure: list[TaskFailed] = []
    with anyio.fail_after(REAL):
        async with (
            Supervisor(debug(Fault(kind="hang", phase=phase)), stepped(clock)) as sup,
            anyio.create_task_group() as tg,
        ):

            async def get_ready() -> None:
                try:
                    await sup.ready()
                except TaskFailed as exc:
                    failure.append(exc)

            tg.start_soon(get_ready)
            await sup.wait_status(lambda s: isinstance(s, Loading if phase == "load" else WarmingUp), REAL)
            await step_beating(sup, clock, limit - 1.0, step=4.0)
            assert sup.hang is None and sup.alive
            await step_beating(sup, clock, 1.0)
    assert sup.hang is not None and sup.hang.deadline == deadline and sup.hang.limit == limit
    dump = stack_dump(list(hang_of(failure[0].status.cause, phase, deadline).evidence))
    assert any("in _hang" in line for line in dump) and any(f"in {phase}" in line for line in dump), dump


async def test_stop_escalates_at_half_and_eight_tenths_of_its_bound_for_a_runner_that_ignores_both() -> None:
    """Default stop bound 10 s: the shutdown task gets 5 s, SIGTERM 3 s more, then SIGKILL; the report says 8 s."""
    clock = SteppedClock()
    with anyio.fail_after(REAL):
        async with supervised(debug(Fault(kind="ignore_sigterm", phase="load")), clock) as sup:
            await sup.ready()
            handle = await sup.generate(prompt(100, Fault(kind="hang", after_tokens=1)))
            await first_chunk(handle)
            pid = sup.pid
            assert pid is not None
            began = clock.now()
            async with anyio.create_task_group() as tg:
                tg.start_soon(sup.stop)
                await anyio.wait_all_tasks_blocked()
                assert set(clock.pending) == {began + 5.0}  # the shutdown task's share
                clock.advance(5.0)
                await anyio.wait_all_tasks_blocked()
                assert clock.pending == [began + 8.0]  # SIGTERM sent: its share
                assert pid_alive(pid)  # it ignores SIGTERM
                clock.advance(3.0)
            final = await handle.wait()
    report = sup.stop_report
    assert report is not None and report.escalated_to == "SIGKILL" and report.seconds == 8.0
    assert not pid_alive(pid)
    assert final.state is TaskState.CANCELLED and final.cause is not None
    assert final.cause.kind is CauseKind.STOP_ESCALATED


# --------------------------------------------------------------------------------------------------------------
# The instance: backoff, the crash-loop window, healthy_after
# --------------------------------------------------------------------------------------------------------------

CRASH = Fault(kind="sigkill", after_tokens=1)


async def crash(inst: Instance) -> None:
    final = await (await inst.generate(prompt(10, CRASH))).wait()
    assert final.state is TaskState.FAILED


async def restarting(inst: Instance) -> InstanceRestarting:
    state = await inst.wait_state(lambda s: isinstance(s, InstanceRestarting | InstanceFailed), REAL)
    assert isinstance(state, InstanceRestarting), state
    return state


async def test_the_backoff_waits_its_delay_on_the_clock_then_doubles_and_resets_after_healthy_after() -> None:
    clock = SteppedClock()
    policy = RestartPolicy(initial_backoff=2.0, max_backoff=8.0, factor=2.0, jitter=0.0, healthy_after=60.0)
    with anyio.fail_after(REAL):
        async with instance(debug(token_seconds=0.001), policy, clock) as inst:
            first = await inst.wait_ready(REAL)
            await crash(inst)
            state = await restarting(inst)
            assert state.delay == 2.0 and state.resume_at == clock.now() + 2.0
            assert await clock.next_deadline() == state.resume_at  # no new runner until the clock says so
            assert inst.supervisor is None
            clock.advance(2.0)
            second = await inst.wait_ready(REAL)
            assert second is not first
            await crash(inst)
            assert (await restarting(inst)).delay == 4.0  # a second failure in a row: doubled
            clock.advance(4.0)
            third = await inst.wait_ready(REAL)
            assert isinstance(third, Supervisor)
            await step_beating(third, clock, 59.0, step=4.0)
            assert isinstance(inst.state, InstanceReady) and not inst.state.healthy
            await step_beating(third, clock, 1.0)
            await inst.wait_state(lambda s: isinstance(s, InstanceReady) and s.healthy, REAL)
            await crash(inst)
            assert (await restarting(inst)).delay == 2.0  # healthy for healthy_after: the schedule starts over


async def test_a_crash_loop_is_failures_within_the_window_and_the_same_failures_spread_out_are_not() -> None:
    clock = SteppedClock()
    policy = RestartPolicy(initial_backoff=1.0, jitter=0.0, crash_loop_failures=3, crash_loop_window=60.0)
    with anyio.fail_after(REAL):
        async with instance(debug(token_seconds=0.001), policy, clock) as spread:
            for _ in range(3):  # 3 failures, each 61 s of serving after the last: never 3 within 60 s
                sup = await spread.wait_ready(REAL)
                assert isinstance(sup, Supervisor)
                await step_beating(sup, clock, 61.0, step=4.0)
                await crash(spread)
                await clock.jump(after=(await restarting(spread)).resume_at - 1e-9)  # its backoff
            await spread.wait_ready(REAL)
            assert spread.restarts == 3
        async with instance(debug(token_seconds=0.001), policy, clock) as looping:
            for attempt in range(3):
                await looping.wait_ready(REAL)
                await crash(looping)
                if attempt < 2:
                    await clock.jump(after=(await restarting(looping)).resume_at - 1e-9)
            state = await looping.wait_state(lambda s: isinstance(s, InstanceFailed), REAL)
    assert isinstance(state, InstanceFailed) and "crash loop: 3 failures within 60 s" in state.reason


# --------------------------------------------------------------------------------------------------------------
# The cluster: an agent's lease, a coordinator's loss detection (no Ray: the rules live on tether's own sockets)
# --------------------------------------------------------------------------------------------------------------


async def test_an_agent_fences_itself_when_its_coordinator_is_silent_for_its_lease_and_not_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real agent on a real TCP connection to a coordinator that goes silent: fenced after 3 s (the default
    lease), not at 2.9 s, and it tells the coordinator why."""
    monkeypatch.setenv(env.GC_INTERVAL, "0")  # no upkeep: it would freeze this test process's collector
    clock = SteppedClock()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    settings = AgentSettings(coordinator=f"127.0.0.1:{port}", node_id="n" * 32, token="t")
    agent = NodeAgent(msgspec.msgpack.encode(settings), clock)
    async with listener:
        with anyio.fail_after(REAL):
            async with anyio.create_task_group() as tg:
                accepted: list[anyio.abc.SocketStream] = []
                connected = anyio.Event()

                async def accept(stream: anyio.abc.SocketStream) -> None:
                    accepted.append(stream)
                    connected.set()
                    await anyio.sleep_forever()

                tg.start_soon(listener.serve, accept)
                await agent.start()
                await connected.wait()
                reader = wire.Reader(accepted[0])
                assert isinstance(await reader.receive(), wire.Hello)
                await accepted[0].send(wire.frame(wire.Beat(1)))  # heard at the stepped "now"
                for _ in range(14):  # the agent's beats, 0.2 s apart, to 2.8 s; the coordinator says nothing
                    await clock.jump()
                    await anyio.wait_all_tasks_blocked()
                assert agent.fenced is None and clock.now() == pytest.approx(1002.8)
                clock.advance(0.3)  # its next look, at 3.1 s of silence
                message = await reader.receive()
                while isinstance(message, wire.Beat):
                    message = await reader.receive()
                assert isinstance(message, wire.Fenced)
                assert agent.fenced is not None and "silent for 3.1 s (lease 3 s)" in agent.fenced
                for task in list(agent._tasks):  # stopped first: an agent whose link closes exits its process
                    task.cancel()
                tg.cancel_scope.cancel()


async def test_the_coordinator_loses_a_silent_agent_after_lost_after_but_blames_nobody_for_its_own_pause() -> None:
    clock = SteppedClock()
    cluster = Cluster(ClusterSettings(), clock)  # no Ray: only the heartbeat watch runs
    settings = cluster.settings
    link = AgentLink("a" * 32, actor=None, lost_after=settings.lost_after, clock=clock)
    link.connected.set()
    cluster.links[link.node_id] = link
    with anyio.fail_after(REAL):
        async with anyio.create_task_group() as tg:
            tg.start_soon(cluster._monitor)
            await clock.next_deadline()
            clock.advance(2.0)  # one gap of 2 s in the watch itself: this process was paused, not the agent
            await anyio.wait_all_tasks_blocked()
            assert link.lost is None and link.last_seen == clock.now()
            tick = settings.interval / 4
            for _ in range(round(settings.lost_after / tick) - 1):  # silent for up to lost_after less a tick
                await clock.jump()
                await anyio.wait_all_tasks_blocked()
                assert link.lost is None, link.lost
            for _ in range(2):  # past it
                await clock.jump()
                await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert link.lost is not None and link.lost.kind is CauseKind.NODE_LOST
    assert f"lost after {settings.lost_after:g} s" in link.lost.summary
    assert link.lost_at == clock.now()


# --------------------------------------------------------------------------------------------------------------
# The scheduler's rules at their defaults
# --------------------------------------------------------------------------------------------------------------


def catalogued(name: str, keep_alive: float = DEFAULT_KEEP_ALIVE) -> Model:
    return Model(name, InstanceConfig(id=name, engine="debug"), (), keep_alive, False, "the test")


async def scheduler_decision(scheduler: Scheduler, kind: str, model_id: str, clock: SteppedClock) -> Decision:
    """Step ``clock`` from one deadline to the next (each once something waits for it) until the scheduler decides
    ``kind`` about ``model_id``."""
    seen: list[Decision] = []
    arrived = anyio.Event()

    def watch(decision: Decision) -> None:
        if decision.kind == kind and decision.model == model_id and not seen:
            seen.append(decision)
            arrived.set()

    async def step() -> None:
        while True:
            await clock.jump()

    scheduler.listeners.add(watch)
    with anyio.fail_after(REAL):
        async with anyio.create_task_group() as tg:
            tg.start_soon(step)
            await arrived.wait()
            tg.cancel_scope.cancel()
    return seen[0]


async def test_an_idle_model_is_unloaded_at_the_default_keep_alive_and_not_before() -> None:
    clock = SteppedClock()
    async with (
        Fleet(SupervisorSettings(stop_timeout=10)) as fleet,
        Scheduler(fleet, Catalog([catalogued("a")]), SchedulerSettings(clock=clock)) as scheduler,
    ):
        with anyio.fail_after(REAL):
            async with scheduler.lease("a"):
                pass
        released = clock.now()
        assert await clock.next_deadline() == released + DEFAULT_KEEP_ALIVE  # nothing else counts down
        clock.advance(DEFAULT_KEEP_ALIVE - 0.001)
        await anyio.wait_all_tasks_blocked()
        assert scheduler.slots["a"].state == "loaded"
        unload = await scheduler_decision(scheduler, "unload", "a", clock)
        assert unload.why == "keep_alive" and clock.now() - released == pytest.approx(DEFAULT_KEEP_ALIVE)
        assert scheduler.slots["a"].state == "unloaded"


async def test_an_eviction_waits_for_the_memory_back_for_the_default_reclaim_timeout_then_refuses() -> None:
    """The evicted runner's group is gone (for real), but node memory never rises: the load waits, on the clock,
    for exactly the default ``reclaim_timeout``, then refuses with the numbers (``wait_memory``)."""
    clock = SteppedClock()
    default = SchedulerSettings().reclaim_timeout
    needs = registry.estimate(catalogued("b").config.spec())
    assert needs is not None
    room = [needs.total * 4]  # both fit; then only one, and memory never comes back

    def memory() -> NodeMemory:
        return NodeMemory(room[0], "the test", 2 * needs.total * 4, room[0])

    # load_wait inf: no other bound counts down on the clock, so each step is the reclaim wait's own
    settings = SchedulerSettings(load_wait=math.inf, memory=memory, clock=clock)
    catalog = Catalog([catalogued("a", math.inf), catalogued("b", math.inf)])
    async with (
        Fleet(SupervisorSettings(stop_timeout=10)) as fleet,
        Scheduler(fleet, catalog, settings) as scheduler,
    ):
        with anyio.fail_after(REAL):
            async with scheduler.lease("a"):
                pass
        room[0] = needs.total - 1
        refused: list[BaseException] = []

        async def load_b() -> None:
            try:
                async with scheduler.lease("b"):
                    pass
            except Exception as exc:
                refused.append(exc)

        began = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(load_b)
            evicting = clock.now()
            waited = await scheduler_decision(scheduler, "wait_memory", "b", clock)
        real = anyio.current_time() - began
    assert waited.seconds == pytest.approx(default) and clock.now() - evicting == pytest.approx(default)
    assert f"within {default:g} s (--reclaim-timeout)" in waited.reason, waited.reason
    assert refused and f"within {default:g} s" in str(refused[0]), refused
    assert real < default / 2, f"{real:.2f} s of real time for a {default:g} s wait"
