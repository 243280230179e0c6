"""No hanging request: each kind of hang, provoked for real, is detected within its deadline plus a small margin,
with the runner's stacks where it can still answer; cancellation ends a stream within one token; a hung runner never
holds up a healthy one. Each phase's deadline at its default value, on a stepped clock: tests/test_clock.py; here, in
real time, the hangs whose detection is the process's doing (a SIGSTOP, a native hang holding the GIL, a reader
that stops reading)."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable

import anyio
import pytest

from conftest import debug, prompt
from tether.node.hangs import Deadlines, ProgressWatch, process_state, stack_dump
from tether.node.instance import Instance, InstanceReady, InstanceRestarting, RestartPolicy
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.protocol import (
    Cause,
    CauseKind,
    ChatMessage,
    Chunk,
    EngineSpec,
    Failed,
    Fault,
    GenerateParams,
    Loading,
    Ready,
    RunnerStatus,
    Running,
    TaskState,
    TaskStatus,
    WarmingUp,
)

MARGIN = 1.0  # seconds allowed past a deadline (plus the stack wait) on this noisy 2-core machine
STACKS = 1.0
LONG = 3600.0  # deadlines that must not be the one to fire

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftover_runners")]


def deadlines(**overrides: float) -> Deadlines:
    """Every deadline long except the ones a test is about."""
    values = dict(heartbeat=LONG, load_stall=LONG, warmup=LONG, first_token=LONG, token_gap=LONG, ack=LONG)
    values.update(stacks=STACKS)
    values.update(overrides)
    return Deadlines(**values)


class FailedAt:
    """Stamps the moment the supervisor declares its runner failed (a status listener runs in the event loop)."""

    def __init__(self, sup: Supervisor) -> None:
        self.at: float | None = None
        sup.add_status_listener(self._seen)

    def _seen(self, status: RunnerStatus) -> None:
        if isinstance(status, Failed) and self.at is None:
            self.at = time.monotonic()


def assert_hang(cause: Cause | None, phase: str, deadline: str, *, stacks: bool) -> list[str]:
    assert cause is not None and cause.kind is CauseKind.HANG, cause
    assert cause.phase == phase and f"hung in {phase} for " in cause.summary, cause.render()
    assert f"raise the '{deadline}' deadline" in cause.evidence[-1], cause.render()
    dump = stack_dump(list(cause.evidence[:-1]))  # the last line is the hint
    assert bool(dump) is stacks, cause.render()
    return dump


# --------------------------------------------------------------------------------------------------------------
# The bookkeeping: pure arithmetic on event times
# --------------------------------------------------------------------------------------------------------------


def test_load_progress_resets_the_stall_clock_and_there_is_no_total() -> None:
    watch = ProgressWatch(deadlines(load_stall=2.0), heartbeat=False)
    for step in range(10):  # 10 reports a second apart: 9 s of loading, never 2 s without progress
        watch.status(Loading(step / 10), now=float(step))
        assert watch.expired(float(step) + 1.9) is None
    hang = watch.expired(11.0)
    assert hang is not None and (hang.phase, hang.deadline, hang.seconds) == ("load", "load_stall", 2.0)
    watch.status(Ready(), now=11.0)
    assert watch.expired(100.0) is None and watch.next_expiry() == math.inf


def test_a_generation_has_a_first_token_deadline_then_a_gap_deadline() -> None:
    watch = ProgressWatch(deadlines(first_token=5.0, token_gap=1.0), heartbeat=False)
    watch.status(Running(), 0.0)
    watch.generation_started("g", 0.0)
    assert watch.phase == "prefill" and watch.next_expiry() == 5.0
    assert watch.expired(4.9) is None
    watch.token("g", 4.9)
    assert watch.phase == "decode" and watch.next_expiry() == pytest.approx(5.9)
    watch.token("g", 5.5)
    assert watch.expired(6.4) is None
    hang = watch.expired(6.6)
    assert hang is not None and (hang.phase, hang.deadline, hang.task_id) == ("decode", "token_gap", "g")
    watch.ended("g")
    assert watch.expired(100.0) is None


def test_prefill_progress_restarts_every_waiting_first_token_clock_and_a_silent_prefill_still_expires() -> None:
    """A long prompt read 32 tokens a step beside other streams: its prefill, and the prompts queued behind it, are
    slow, not stuck, while steps keep coming (the real engine's case: test_shared_machine.py)."""
    watch = ProgressWatch(deadlines(first_token=4.0), heartbeat=False)
    watch.status(Running(), 0.0)
    watch.generation_started("long", 0.0)
    watch.generation_started("queued", 1.0)
    for step in range(1, 30):  # 29 s of prefill, a step every second
        watch.prefilling("long", float(step))
        assert watch.expired(step + 3.9) is None
    hang = watch.expired(29.0 + 4.0)  # then no step for the deadline: hung in prefill
    assert hang is not None and (hang.phase, hang.deadline) == ("prefill", "first_token")


def test_acknowledgements_and_heartbeats_have_deadlines() -> None:
    watch = ProgressWatch(deadlines(ack=1.0, heartbeat=3.0), heartbeat=True)
    assert watch.next_expiry() == math.inf  # nothing awaited before the hello
    watch.beat(0.0)
    watch.sent("task", "t", 0.0)
    watch.sent("cancel", "c", 0.5)
    watch.acknowledged("task", "t")
    hang = watch.expired(1.6)
    assert hang is not None and hang.deadline == "ack" and "cancel of 'c' was not acknowledged" in hang.detail
    watch.acknowledged("cancel", "c")
    assert watch.expired(2.9) is None
    hang = watch.expired(3.2)
    assert hang is not None and hang.deadline == "heartbeat" and hang.phase == "starting"


def test_a_new_deadline_earlier_than_the_armed_wake_up_rearms_the_watcher() -> None:
    woken: list[float] = []
    watch = ProgressWatch(deadlines(first_token=10.0, token_gap=0.5, warmup=60.0), heartbeat=False)
    watch.on_earlier = lambda: woken.append(watch.next_expiry())
    watch.armed = 20.0
    watch.generation_started("g", 0.0)  # expires at 10 < 20: wake up
    assert len(woken) == 1
    watch.armed = 10.0
    watch.status(WarmingUp(), 0.0)  # expires at 60: later than armed, no wake-up
    watch.token("g", 1.0)  # the first token switches to the 0.5 s gap: earlier, wake up
    assert len(woken) == 2


def test_deadlines_refuse_nonsense_with_the_reason() -> None:
    with pytest.raises(ValueError, match="token_gap must be a positive number of seconds, got -1"):
        Deadlines(token_gap=-1)
    with pytest.raises(ValueError, match=r"heartbeat \(1 s\) must be at least twice the heartbeat interval"):
        Supervisor(debug(), SupervisorSettings(heartbeat_interval=0.75), deadlines=Deadlines(heartbeat=1.0))


def test_process_state_reads_the_kernel_letter() -> None:
    assert process_state(os.getpid()) == "R"
    pid = os.fork()
    if pid == 0:
        signal.pause()
        os._exit(0)
    try:
        os.kill(pid, signal.SIGSTOP)
        _, status = os.waitpid(pid, os.WUNTRACED)  # returns once the child is stopped: the event, not a sleep
        assert os.WIFSTOPPED(status) and process_state(pid) == "T"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert process_state(pid) is None


# --------------------------------------------------------------------------------------------------------------
# Real hangs in real runners
# --------------------------------------------------------------------------------------------------------------


async def _hang_mid_generation(
    sup: Supervisor, fault: Fault | None, after_tokens: int, on_tokens: Callable[[], None] | None = None
) -> tuple[float, float, Cause | None, int]:
    """Stream a generation that hangs after ``after_tokens`` tokens; (last progress, failed at, cause, tokens)."""
    failed = FailedAt(sup)
    await sup.ready()
    params = prompt(10_000, fault) if fault is not None else prompt(10_000)
    handle = await sup.generate(params)
    last = time.monotonic()
    tokens = 0
    async for event in handle:
        if isinstance(event, Chunk):
            last = time.monotonic()
            tokens += event.tokens
            if tokens == after_tokens and on_tokens is not None:
                on_tokens()
                last = time.monotonic()
    assert handle.final is not None and handle.final.state is TaskState.FAILED
    await sup.wait_exit(10)
    assert failed.at is not None
    return last, failed.at, handle.final.cause, tokens


@pytest.mark.slow
async def test_a_native_hang_holding_the_gil_is_caught_by_the_heartbeat_with_its_stacks() -> None:
    """Every Python thread stops, the heartbeat included; faulthandler's C handler still dumps the stacks."""
    beat = 1.0
    with anyio.fail_after(30):
        async with Supervisor(
            debug(token_seconds=0.005), SupervisorSettings(heartbeat_interval=0.25), deadlines=deadlines(heartbeat=beat)
        ) as sup:
            last, failed_at, cause, _ = await _hang_mid_generation(sup, Fault(kind="hang_gil", after_tokens=3), 3)
    dump = assert_hang(cause, "decode", "heartbeat", stacks=True)
    assert "no heartbeat" in cause.summary if cause else False
    assert any("in _hang_gil" in line for line in dump), dump
    # The last beat came up to one interval before the last token.
    assert beat - 0.25 <= failed_at - last <= beat + STACKS + MARGIN


@pytest.mark.slow
async def test_a_sigstopped_runner_is_caught_by_the_heartbeat_and_said_to_be_stopped() -> None:
    beat = 1.0
    with anyio.fail_after(30):
        async with Supervisor(
            debug(token_seconds=0.01), SupervisorSettings(heartbeat_interval=0.25), deadlines=deadlines(heartbeat=beat)
        ) as sup:
            pid = sup.pid
            assert pid is not None
            last, failed_at, cause, _ = await _hang_mid_generation(
                sup, None, 3, on_tokens=lambda: os.kill(pid, signal.SIGSTOP)
            )
    assert_hang(cause, "decode", "heartbeat", stacks=False)
    assert cause is not None and "process state T: stopped by a signal (SIGSTOP or SIGTSTP)" in cause.evidence[0]
    assert beat - 0.25 <= failed_at - last <= beat + MARGIN  # no stack wait: a stopped process cannot answer


@pytest.mark.slow
async def test_a_slow_but_progressing_load_is_not_killed() -> None:
    """Eight steps of 0.4 s: 3.2 s of loading against a 1 s stall deadline, never 1 s without progress."""
    with anyio.fail_after(30):
        async with Supervisor(
            debug(load_steps=8, load_step_seconds=0.4), deadlines=deadlines(load_stall=1.0, heartbeat=2.0)
        ) as sup:
            began = time.monotonic()
            await sup.ready()
            assert time.monotonic() - began >= 3.2
            text, final = await (await sup.generate(prompt(4))).text()
    assert final.state is TaskState.COMPLETE and len(text.split()) == 4
    assert sup.hang is None and sup.cause is None


def stop_runner(pid: int) -> None:
    """SIGSTOP a runner (our child) and return once the kernel has stopped it: a runner that reads nothing."""
    os.kill(pid, signal.SIGSTOP)
    _, status = os.waitpid(pid, os.WUNTRACED)  # reports the stop without reaping; the stop is immediate
    assert os.WIFSTOPPED(status)


@pytest.mark.slow
async def test_a_task_the_runner_does_not_acknowledge_is_a_hang_within_the_ack_deadline() -> None:
    """The reader thread acknowledges on arrival, even behind a long generation (no false alarm); a runner that
    stops reading is caught by the acknowledgement deadline (the heartbeat deadline is set long here)."""
    with anyio.fail_after(30):
        async with Supervisor(debug(token_seconds=0.005), deadlines=deadlines(ack=1.0)) as sup:
            await sup.ready()
            busy = await sup.generate(prompt(400))  # 2 s of tokens: the next one waits in the runner's queue
            queued = await sup.generate(prompt(3))
            assert (await busy.wait()).state is TaskState.COMPLETE
            assert (await queued.wait()).state is TaskState.COMPLETE
            assert sup.pid is not None
            stop_runner(sup.pid)
            began = time.monotonic()
            late = await sup.generate(prompt(3))
            final = await late.wait()
            took = time.monotonic() - began
    assert final.state is TaskState.FAILED
    assert_hang(final.cause, "idle", "ack", stacks=False)
    assert final.cause is not None and f"task {late.task_id!r} was not acknowledged" in final.cause.summary
    assert 1.0 <= took <= 1.0 + MARGIN


@pytest.mark.slow
async def test_a_cancel_the_runner_cannot_receive_makes_it_hung() -> None:
    with anyio.fail_after(30):
        async with Supervisor(debug(token_seconds=0.005), deadlines=deadlines(ack=1.0)) as sup:
            await sup.ready()
            handle = await sup.generate(prompt(10_000))
            tokens = 0
            async for event in handle:
                if isinstance(event, Chunk):
                    tokens += event.tokens
                    if tokens == 3:
                        break
            assert sup.pid is not None
            stop_runner(sup.pid)
            began = time.monotonic()
            reply = await sup.cancel(handle.task_id)
            final = await handle.wait()
            took = time.monotonic() - began
    assert reply.outcome == "requested"
    assert final.state is TaskState.FAILED and final.tokens >= 3
    assert_hang(final.cause, "decode", "ack", stacks=False)
    assert final.cause is not None and f"cancel of {handle.task_id!r} was not acknowledged" in final.cause.summary
    assert 1.0 <= took <= 1.0 + MARGIN


async def test_a_hang_fails_the_life_and_the_restart_policy_brings_a_new_runner() -> None:
    policy = RestartPolicy(initial_backoff=0.01, max_backoff=0.05, jitter=0.0)
    restarting: list[InstanceRestarting] = []
    inst = Instance(debug(token_seconds=0.005), policy, deadlines=deadlines(token_gap=0.5))
    inst.add_state_listener(lambda s: restarting.append(s) if isinstance(s, InstanceRestarting) else None)
    with anyio.fail_after(40):
        async with inst:
            await inst.wait_ready(20)
            first = inst.pids[-1]
            final = await (await inst.generate(prompt(100, Fault(kind="hang", after_tokens=2)))).wait()
            assert final.state is TaskState.FAILED
            state = await inst.wait_state(lambda s: isinstance(s, InstanceReady) and s.pid != first, 20)
            text, done = await (await inst.generate(prompt(3))).text()
    assert isinstance(state, InstanceReady) and state.life == 2
    assert done.state is TaskState.COMPLETE and len(text.split()) == 3
    assert restarting and restarting[0].cause.kind is CauseKind.HANG and restarting[0].cause.phase == "decode"


# --------------------------------------------------------------------------------------------------------------
# Cancellation
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_cancel_mid_stream_ends_cancelled_with_at_most_one_more_token() -> None:
    """Tokens every 50 ms: nothing is in flight in the pipe at the cancel, so one more token is the bound."""
    with anyio.fail_after(30):
        async with Supervisor(debug(token_seconds=0.05), deadlines=deadlines(ack=2.0, token_gap=2.0)) as sup:
            await sup.ready()
            for at in (1, 4, 9):
                handle = await sup.generate(prompt(10_000))
                seen = 0
                seen_at_cancel: int | None = None
                async for event in handle:
                    if isinstance(event, Chunk):
                        seen += event.tokens
                        if seen == at and seen_at_cancel is None:
                            seen_at_cancel = seen
                            assert (await sup.cancel(handle.task_id)).outcome == "requested"
                final = handle.final
                assert final is not None and final.state is TaskState.CANCELLED
                assert seen_at_cancel is not None and final.tokens == seen <= seen_at_cancel + 1
            assert sup.hang is None and sup.cause is None


async def test_cancel_of_a_queued_task_ends_it_before_its_first_token() -> None:
    with anyio.fail_after(30):
        async with Supervisor(debug(token_seconds=0.01)) as sup:
            await sup.ready()
            running = await sup.generate(prompt(50))
            queued = await sup.generate(prompt(50))
            assert (await sup.cancel(queued.task_id)).outcome == "requested"
            text, final = await queued.text()
            assert (await running.wait()).state is TaskState.COMPLETE
    assert final.state is TaskState.CANCELLED and final.tokens == 0 and text == ""


@pytest.mark.timeout(90)
async def test_a_cancel_storm_ends_every_task_once_and_leaves_the_runner_healthy() -> None:
    """300 generations in flight, each cancelled twice concurrently, plus 200 cancels of unknown tasks, while tokens
    stream: every task ends with exactly one terminal status, and the runner serves on."""
    n = 300
    with anyio.fail_after(60):
        async with Supervisor(debug(token_seconds=0.001), deadlines=deadlines(ack=5.0, token_gap=5.0)) as sup:
            await sup.ready()
            handles = [await sup.generate(prompt(10_000)) for _ in range(n)]
            terminals: dict[str, list[TaskState]] = {h.task_id: [] for h in handles}
            replies: list[str] = []

            async def consume(handle_index: int) -> None:
                handle = handles[handle_index]
                async for event in handle:
                    if isinstance(event, TaskStatus) and event.state.terminal:
                        terminals[handle.task_id].append(event.state)

            async def cancel(task_id: str) -> None:
                replies.append((await sup.cancel(task_id)).outcome)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(consume, i)
                for handle in handles:
                    tg.start_soon(cancel, handle.task_id)
                    tg.start_soon(cancel, handle.task_id)
                for i in range(200):
                    tg.start_soon(cancel, f"nobody-{i}")
            text, after = await (await sup.generate(prompt(5))).text()
            assert sup.hang is None and sup.cause is None and sup.alive
    assert all(states == [TaskState.CANCELLED] for states in terminals.values()), terminals
    assert replies.count("unknown") == 200 and len(replies) == 2 * n + 200
    assert set(replies) <= {"requested", "finished", "unknown"}
    assert after.state is TaskState.COMPLETE and len(text.split()) == 5


@pytest.mark.slow
async def test_a_hung_runner_beside_a_healthy_one_never_holds_it_up() -> None:
    """One worker, two runners: while one hangs holding its GIL (detected, stacks taken, killed), the other's tokens
    keep flowing with no gap longer than 0.5 s, and a task sent to the hung one is answered within its bounds."""
    with anyio.fail_after(40):
        async with (
            Supervisor(debug(token_seconds=0.01), runner_id="healthy") as healthy,
            Supervisor(
                debug(token_seconds=0.01), runner_id="hung", deadlines=deadlines(heartbeat=1.0, ack=1.5)
            ) as hung,
        ):
            await healthy.ready()
            await hung.ready()
            gaps: list[float] = []
            hang_final: list[TaskState] = []

            async def stream_healthy(stop: anyio.Event) -> None:
                while not stop.is_set():
                    handle = await healthy.generate(prompt(50))
                    last = time.monotonic()
                    async for event in handle:
                        if isinstance(event, Chunk):
                            now = time.monotonic()
                            gaps.append(now - last)
                            last = now
                    assert handle.final is not None and handle.final.state is TaskState.COMPLETE

            async def hang_the_other(stop: anyio.Event) -> None:
                stuck = await hung.generate(prompt(10_000, Fault(kind="hang_gil", after_tokens=2)))
                extra = await hung.generate(prompt(3))  # sent to a runner that will never read it
                hang_final.append((await stuck.wait()).state)
                hang_final.append((await extra.wait()).state)
                stop.set()

            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream_healthy, stop)
                tg.start_soon(hang_the_other, stop)
            assert healthy.alive and healthy.cause is None
    assert hang_final == [TaskState.FAILED, TaskState.FAILED]
    assert hung.cause is not None and hung.cause.kind is CauseKind.HANG
    assert len(gaps) >= 50 and max(gaps) < 0.5, max(gaps)  # streamed throughout: it stops only once the other failed


@pytest.mark.model
@pytest.mark.timeout(120)
async def test_cancel_on_the_default_model_ends_within_one_token() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: run `make install`")
    from tether.models import DefaultModelMissing, default_model_path

    try:
        default_model_path()
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))
    story = ChatMessage(role="user", content="Write a long story about a lighthouse keeper and her cat.")
    params = GenerateParams(messages=(story,), max_tokens=400)
    with anyio.fail_after(90):
        async with Supervisor(EngineSpec(engine="llama.cpp", options={"n_ctx": 512})) as sup:
            await sup.ready()
            handle = await sup.generate(params)
            seen = 0
            at_cancel = None
            async for event in handle:
                if isinstance(event, Chunk):
                    seen += event.tokens
                    if seen >= 5 and at_cancel is None:
                        at_cancel = seen
                        assert (await sup.cancel(handle.task_id)).outcome == "requested"
    assert handle.final is not None and handle.final.state is TaskState.CANCELLED
    assert at_cancel is not None and handle.final.tokens == seen <= at_cancel + 1
