"""The supervisor against real runner processes (debug engine): lifecycle, routing, losslessness, stop bound."""

from __future__ import annotations

import fcntl
import os
import signal
import time

import anyio
import msgspec
import pytest

from conftest import debug, pid_alive, prompt
from tether.channel import PARTIAL_FRAME_STALL, AsyncReceiver, AsyncSender, EndOfStream
from tether.node.hangs import Deadlines, process_state
from tether.node.settings import SupervisorSettings
from tether.node.spawn import spawn_runner
from tether.node.supervisor import Supervisor
from tether.node.tasks import RunnerUnavailable, TaskFailed
from tether.protocol import (
    CauseKind,
    Chunk,
    EngineSpec,
    Event,
    Failed,
    Fault,
    GenerateParams,
    GenerateTask,
    Idle,
    Loaded,
    Loading,
    LoadTask,
    Ready,
    RunnerArgs,
    RunnerConfig,
    RunnerHello,
    RunnerStatus,
    Running,
    Shutdown,
    ShuttingDown,
    StatusUpdate,
    TaskAcknowledged,
    TaskState,
    TaskStatus,
    WarmingUp,
    WarmupTask,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftover_runners")]


async def test_full_event_order_load_warmup_generate_shutdown() -> None:
    statuses: list[RunnerStatus] = []
    with anyio.fail_after(30):
        async with Supervisor(debug()) as sup:
            sup.add_status_listener(statuses.append)
            load = await sup.submit(LoadTask(task_id="L"))
            load_events = [e async for e in load]
            warm = await sup.submit(WarmupTask(task_id="W"))
            warm_events = [e async for e in warm]
            gen = await sup.generate(prompt(5), task_id="G")
            gen_events = [e async for e in gen]
            runner_pid = sup.pid
        assert sup.stop_report is not None and sup.stop_report.clean
    assert runner_pid is not None and not pid_alive(runner_pid)

    for events, tid in ((load_events, "L"), (warm_events, "W")):
        assert events == [
            TaskAcknowledged(tid),
            TaskStatus(tid, TaskState.RUNNING),
            TaskStatus(tid, TaskState.COMPLETE),
        ]
    assert gen_events[:2] == [TaskAcknowledged("G"), TaskStatus("G", TaskState.RUNNING)]
    chunks = gen_events[2:-1]
    assert len(chunks) == 5 and all(isinstance(c, Chunk) for c in chunks)
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 5  # type: ignore[union-attr]
    assert gen_events[-1] == TaskStatus("G", TaskState.COMPLETE, tokens=5)

    kinds = [type(s) for s in statuses]
    loading = [s for s in statuses if isinstance(s, Loading)]
    assert [p.progress for p in loading] == sorted(p.progress for p in loading) and loading[-1].progress == 1.0
    compact = [k for i, k in enumerate(kinds) if (i == 0 or k is not kinds[i - 1]) and k is not Idle]
    assert compact == [Loading, Loaded, WarmingUp, Ready, Running, Ready, ShuttingDown, Shutdown]


@pytest.mark.parametrize(
    ("fault", "kind", "exit_code", "signal_name"),
    [
        (Fault(kind="exit", code=0, after_tokens=40), CauseKind.UNEXPECTED_EXIT, 0, None),
        (Fault(kind="exit", code=3, after_tokens=40), CauseKind.EXIT_CODE, 3, None),
        (Fault(kind="sigkill", after_tokens=40), CauseKind.SIGNAL, None, "SIGKILL"),
    ],
    ids=["exit0", "exit3", "sigkill"],
)
async def test_every_chunk_sent_before_death_arrives_then_one_terminal_failure(
    fault: Fault, kind: CauseKind, exit_code: int | None, signal_name: str | None
) -> None:
    with anyio.fail_after(30):
        async with Supervisor(debug()) as sup:
            await sup.ready()
            handle = await sup.generate(prompt(1000, fault))
            events = [e async for e in handle]
            await sup.wait_exit(5)
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert len(chunks) == 40, "every chunk the runner wrote before dying must be delivered"
    terminal = [e for e in events if isinstance(e, TaskStatus) and e.state.terminal]
    assert terminal == [events[-1]] and terminal[0].state is TaskState.FAILED
    cause = terminal[0].cause
    assert cause is not None and cause.kind is kind
    assert cause.exit_code == exit_code and cause.signal == signal_name
    assert cause.phase == "generating"
    assert terminal[0].tokens == 40
    assert isinstance(sup.status, Failed) and sup.status.cause == cause


async def test_every_in_flight_and_queued_task_ends_when_the_runner_dies() -> None:
    with anyio.fail_after(30):
        async with Supervisor(debug(token_seconds=0.01)) as sup:
            await sup.ready()
            first = await sup.generate(prompt(500))
            queued = [await sup.generate(prompt(5)) for _ in range(5)]
            async for event in first:
                if isinstance(event, Chunk):
                    break
            os.kill(sup.pid or 0, signal.SIGKILL)
            finals = [await h.wait() for h in [first, *queued]]
            with pytest.raises(RunnerUnavailable, match="killed by SIGKILL"):
                await sup.generate(prompt(5))
    assert [f.state for f in finals] == [TaskState.FAILED] * 6
    assert {f.cause.kind for f in finals if f.cause} == {CauseKind.SIGNAL}
    assert "killed by SIGKILL (Killed)" in finals[0].error  # type: ignore[operator]


async def test_python_exception_arrives_with_its_traceback() -> None:
    with anyio.fail_after(30):
        async with Supervisor(debug()) as sup:
            await sup.ready()
            status = await (await sup.generate(prompt(10, Fault(kind="raise", after_tokens=2)))).wait()
    cause = status.cause
    assert cause is not None and cause.kind is CauseKind.EXCEPTION and cause.exit_code == 1
    assert "RuntimeError" in cause.summary
    assert any("faults.py" in line for line in cause.evidence)
    assert cause.evidence[-1].startswith("RuntimeError")


async def test_task_invalid_for_the_status_fails_clearly_and_runner_lives_on() -> None:
    with anyio.fail_after(30):
        async with Supervisor(debug()) as sup:
            early = await (await sup.generate(prompt(3))).wait()
            early_warmup = await (await sup.submit(WarmupTask(task_id="w0"))).wait()
            await sup.ready()
            second_load = await (await sup.submit(LoadTask(task_id="l2"))).wait()
            text, ok = await (await sup.generate(prompt(3))).text()
    assert early.state is TaskState.FAILED
    assert early.error == ("cannot run a generate task while the runner is idle: load and warm up the runner first")
    assert early_warmup.state is TaskState.FAILED and "send a load task first" in (early_warmup.error or "")
    assert second_load.state is TaskState.FAILED and "loads once" in (second_load.error or "")
    assert ok.state is TaskState.COMPLETE and len(text.split()) == 3


async def test_duplicate_task_id_is_refused_by_the_supervisor() -> None:
    with anyio.fail_after(30):
        async with Supervisor(debug()) as sup:
            await sup.ready()
            await (await sup.generate(prompt(2), task_id="same")).wait()
            with pytest.raises(ValueError, match="duplicate task id 'same'"):
                await sup.generate(prompt(2), task_id="same")


async def test_duplicate_task_id_is_refused_by_the_runner_itself() -> None:
    """Defence in depth: the runner refuses a repeated id even from a misbehaving supervisor."""
    proc = spawn_runner(RunnerConfig(runner_id="raw", spec=debug(), worker_pid=os.getpid(), heartbeat_interval=0))
    sender = AsyncSender(proc.tasks_fd)
    receiver: AsyncReceiver[Event] = AsyncReceiver(proc.events_fd, Event)
    events: list[Event] = []
    try:
        with anyio.fail_after(20):
            await sender.send(LoadTask(task_id="x"))
            await sender.send(GenerateTask(task_id="x", params=prompt(2)))
            while not any(isinstance(e, TaskStatus) and e.error and "duplicate" in e.error for e in events):
                events.extend(await receiver.receive_batch())
            sender.close()  # EOF on its task pipe: the runner shuts down
            try:
                while True:
                    events.extend(await receiver.receive_batch())
            except EndOfStream:
                pass
            status = await proc.wait_exit()
    finally:
        proc.kill_group(signal.SIGKILL)
        if proc.exit_status is None:
            await proc.wait_exit()
        proc.close_fds()
    assert isinstance(events[0], RunnerHello) and events[1] == StatusUpdate(Idle())
    refusals = [e for e in events if isinstance(e, TaskStatus) and e.state is TaskState.FAILED]
    assert refusals == [TaskStatus("x", TaskState.FAILED, "duplicate task id 'x': every task needs a fresh id")]
    assert status.code == 0


async def test_cancel_mid_stream_ends_cancelled_and_unknown_cancel_is_harmless() -> None:
    with anyio.fail_after(30):
        async with Supervisor(debug(token_seconds=0.05)) as sup:
            await sup.ready()
            handle = await sup.generate(prompt(10_000))
            tokens = 0
            answer = None
            async for event in handle:
                if isinstance(event, Chunk):
                    tokens += event.tokens
                    if tokens == 3 and answer is None:
                        answer = await sup.cancel(handle.task_id)
            assert answer is not None and answer.outcome == "requested"
            assert handle.final is not None and handle.final.state is TaskState.CANCELLED
            assert handle.final.tokens == tokens and tokens <= 3 + 1, "a cancel takes effect within one token"
            again = await sup.cancel(handle.task_id)
            assert (again.outcome, again.state, again.detail) == (
                "finished",
                TaskState.CANCELLED,
                "already cancelled: nothing to cancel",
            )
            unknown = await sup.cancel("never-submitted")
            assert unknown.outcome == "unknown" and "no task 'never-submitted'" in unknown.detail
            _text, done = await (await sup.generate(prompt(4))).text()
            assert done.state is TaskState.COMPLETE


@pytest.mark.slow
async def test_stop_is_bounded_for_a_hung_runner_that_ignores_sigterm() -> None:
    spec = debug(Fault(kind="ignore_sigterm", phase="load"))
    with anyio.fail_after(30):
        async with Supervisor(spec, SupervisorSettings(stop_timeout=2.0)) as sup:
            await sup.ready()
            handle = await sup.generate(prompt(100, Fault(kind="hang", after_tokens=1)))
            async for event in handle:
                if isinstance(event, Chunk):
                    break
            pid = sup.pid
            began = time.monotonic()
            report = await sup.stop()
            took = time.monotonic() - began
            final = await handle.wait()
    assert report is not None and report.escalated_to == "SIGKILL" and not report.clean
    assert took <= 2.0 + 0.5, f"stop took {took:.2f} s, bound 2.0 s"
    assert pid is not None and not pid_alive(pid)
    assert final.state is TaskState.CANCELLED and final.cause is not None
    assert final.cause.kind is CauseKind.STOP_ESCALATED


async def test_stop_of_a_healthy_runner_is_clean_and_fast() -> None:
    with anyio.fail_after(30):
        async with Supervisor(debug()) as sup:
            await sup.ready()
            report = await sup.stop()
    assert report is not None and report.clean and report.escalated_to is None and report.seconds < 2
    assert isinstance(sup.status, Shutdown)


async def test_load_failure_is_a_failed_runner_with_the_reason() -> None:
    spec = EngineSpec(engine="debug", options={"load_steps": "many"})
    with anyio.fail_after(30):
        async with Supervisor(spec) as sup:
            with pytest.raises(Exception, match="invalid debug engine option"):
                await sup.load()
            await sup.wait_exit(5)
    cause = sup.status.cause if isinstance(sup.status, Failed) else None
    assert cause is not None and cause.kind is CauseKind.LOAD_ERROR and cause.phase == "loading"
    assert (
        cause.summary.startswith("runner ") and "could not load its model: invalid debug engine option" in cause.summary
    )
    assert cause.evidence == ()


async def test_a_cancelled_caller_still_stops_its_runner_cleanly() -> None:
    """Ctrl-C or a timeout around the supervisor must not abandon the runner or its bookkeeping."""
    sup = Supervisor(debug(token_seconds=0.05))
    with anyio.fail_after(30):
        with anyio.CancelScope() as outer:
            async with sup:
                await sup.ready()
                handle = await sup.generate(prompt(100_000))
                async for event in handle:
                    if isinstance(event, Chunk):
                        outer.cancel()
                        await anyio.sleep(5)  # a checkpoint: the cancellation lands here, not a wait for settling
        assert outer.cancelled_caught
    assert sup.stop_report is not None and sup.stop_report.clean and sup.stop_report.seconds < 2
    assert sup.pid is not None and not pid_alive(sup.pid)
    assert handle.final is None or handle.final.state is TaskState.CANCELLED


def _events_write_end(pid: int) -> int:
    """A write end of a live runner's events pipe, opened through /proc as a stray native write would use it."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = RunnerArgs.from_cmdline(f.read().decode().split("\0")[:-1])
    assert args is not None
    return os.open(f"/proc/{pid}/fd/{args.events_fd}", os.O_WRONLY)


async def test_garbage_on_the_channel_is_a_protocol_error_not_a_hang() -> None:
    """Corrupt the live events pipe of a real runner: the supervisor names the cause and ends the tasks."""
    with anyio.fail_after(30):
        async with Supervisor(debug(token_seconds=0.05)) as sup:
            await sup.ready()
            handle = await sup.generate(prompt(100_000))
            assert sup.pid is not None
            fd = _events_write_end(sup.pid)  # the runner's own write end
            try:
                os.write(fd, (12).to_bytes(4, "little") + b"\xc1" * 12)  # 0xc1 is never valid msgpack
            finally:
                os.close(fd)
            final = await handle.wait()
            await sup.wait_exit(10)
    assert final.state is TaskState.FAILED and final.cause is not None
    assert final.cause.kind is CauseKind.PROTOCOL_ERROR
    assert "is malformed" in final.cause.summary
    assert isinstance(sup.status, Failed) and sup.status.cause.kind is CauseKind.PROTOCOL_ERROR


@pytest.mark.parametrize("mimic", [False, True], ids=["garbage", "garbage that looks like a message"])
@pytest.mark.parametrize("heartbeat_deadline", [1.0, 5.0])
async def test_garbage_with_a_plausible_length_is_a_protocol_error_with_its_bytes_not_a_hang(
    mimic: bool, heartbeat_deadline: float
) -> None:
    """A length prefix the reader would wait for used to swallow every heartbeat behind it, and the runner was then
    reported hung. Garbage that does not begin like a message is refused at once; garbage that does is given away
    by bytes that keep arriving without completing it (or, when the heartbeat deadline comes first, at that
    moment)."""
    size = (1 << 20) if mimic else 4096  # a MiB: more than the runner's traffic fills before the reader sees through it
    body = msgspec.msgpack.encode({"type": "heartbeat"})[:-1] if mimic else b"\x00\x13\x37 not a frame"
    with anyio.fail_after(30):
        async with Supervisor(
            debug(token_seconds=0.02), deadlines=Deadlines(heartbeat=heartbeat_deadline, token_gap=60)
        ) as sup:
            await sup.ready()
            handle = await sup.generate(prompt(100_000))
            async for event in handle:
                if isinstance(event, Chunk):
                    break  # generating: the runner keeps writing after the garbage
            assert sup.pid is not None
            fd = _events_write_end(sup.pid)
            try:
                os.write(fd, size.to_bytes(4, "little") + body)
            finally:
                os.close(fd)
            began = time.monotonic()
            final = await handle.wait()
            took = time.monotonic() - began
            await sup.wait_exit(10)
    assert final.state is TaskState.FAILED and final.cause is not None
    cause = final.cause
    assert cause.kind is CauseKind.PROTOCOL_ERROR, cause.render()
    assert "garbage on the pipe" in cause.summary and "hung" not in cause.summary
    prefix = size.to_bytes(4, "little").hex(" ")
    assert any(line.startswith(f"bytes: {prefix}") for line in cause.evidence), cause.evidence
    assert took < (0.5 if not mimic else min(PARTIAL_FRAME_STALL, heartbeat_deadline) + 1.0), took


@pytest.mark.slow
async def test_the_garbage_fault_writes_garbage_from_inside_the_runner() -> None:
    garbage = Fault(kind="garbage", after_tokens=3, size=1 << 20, mimic=True)
    with anyio.fail_after(30):
        async with Supervisor(debug(token_seconds=0.02)) as sup:
            await sup.ready()
            final = await (await sup.generate(prompt(100_000, garbage))).wait()
            await sup.wait_exit(10)
    assert final.state is TaskState.FAILED and final.cause is not None, final
    assert final.cause.kind is CauseKind.PROTOCOL_ERROR and "garbage on the pipe" in final.cause.summary
    assert final.tokens == 3


def pipe_capacity() -> int:
    """What a new pipe holds on this kernel (its default: 16 pages)."""
    read, write = os.pipe()
    try:
        return fcntl.fcntl(write, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(read)
        os.close(write)


async def test_a_task_write_that_times_out_raises_with_the_hang_as_its_cause() -> None:
    """The send timeout used to raise before the hang's cause existed (it is declared in the background)."""
    with anyio.fail_after(30):
        async with Supervisor(debug(), SupervisorSettings(send_timeout=0.3)) as sup:
            await sup.ready()
            assert sup.pid is not None
            os.kill(sup.pid, signal.SIGSTOP)  # reads nothing more: the pipe fills
            while process_state(sup.pid) != "T":  # stopped, not about to be: it must not read a byte
                await anyio.sleep(0.01)
            # Four times what a pipe holds here: 64 KiB on 4 KiB pages, 1 MiB on 64 KiB pages (aarch64 kernels).
            big = GenerateParams(prompt="w" * 4 * pipe_capacity(), max_tokens=1)
            with pytest.raises(RunnerUnavailable) as raised:
                await sup.generate(big)
            await sup.wait_exit(10)
    cause = raised.value.cause
    assert cause is not None and cause.kind is CauseKind.HANG, raised.value
    assert "a write did not complete in 0.3 s" in cause.summary
    assert sup.cause is not None and sup.cause.kind is CauseKind.HANG


@pytest.mark.slow
async def test_a_task_that_cannot_be_encoded_is_refused_and_leaves_the_runner_serving() -> None:
    """An integer msgpack cannot carry used to be registered, fail on the wire, and get the runner declared hung
    when its acknowledgement never came."""
    with anyio.fail_after(30):
        async with Supervisor(debug(), deadlines=Deadlines(ack=0.5)) as sup:
            await sup.ready()
            with pytest.raises(ValueError, match="cannot encode"):
                await sup.submit(GenerateTask("huge", GenerateParams(prompt="x", seed=1 << 70)))
            with anyio.move_on_after(1.0):  # twice the ack deadline: it must not fire
                await sup.wait_exit(2)
            assert sup.alive
            _text, done = await (await sup.generate(prompt(3))).text()
    assert done.state is TaskState.COMPLETE


@pytest.mark.parametrize("phase", ["loading", "warming up"])
async def test_a_runner_stopped_while_loading_or_warming_up_exits_at_once_and_cleanly(phase: str) -> None:
    """It used to spend half the stop bound (5 s) unable to read the shutdown, then be SIGTERMed."""
    slow = Fault(kind="slow", phase="load" if phase == "loading" else "warmup", seconds=3600)
    spec = debug(slow, helpers=1, helper_kind="setsid")
    with anyio.fail_after(30):
        async with Supervisor(spec, SupervisorSettings(stop_timeout=10)) as sup:
            task = await sup.submit(LoadTask("load"))
            if phase == "warming up":
                assert (await task.wait()).state is TaskState.COMPLETE
                task = await sup.submit(WarmupTask("warmup"))
            await sup.wait_status(lambda s: isinstance(s, Loading | WarmingUp), 10)
            assert sup.pid is not None and sup.cgroup is not None
            members = [int(p) for p in (sup.cgroup / "cgroup.procs").read_text().split()]
            report = await sup.stop()
            final = await task.wait()
    assert report is not None and report.clean and report.escalated_to is None, report
    assert report.seconds < 1.0, report
    assert final.state is TaskState.CANCELLED and final.error == f"the runner was shut down while {phase}"
    assert isinstance(sup.status, Shutdown)
    assert [pid for pid in members if pid_alive(pid)] == []


async def test_a_load_that_outlasts_an_explicit_total_bound_kills_the_runner_with_a_hang_cause() -> None:
    spec = EngineSpec(engine="debug", faults=(Fault(kind="slow", phase="load", seconds=5.0),))
    with anyio.fail_after(30):
        async with Supervisor(spec) as sup:
            began = time.monotonic()
            with pytest.raises(TaskFailed) as failed:
                await sup.load(timeout=0.5)
            took = time.monotonic() - began
    cause = failed.value.status.cause
    assert cause is not None and cause.kind is CauseKind.HANG and cause.phase == "loading"
    assert "did not finish loading within 0.5 s" in cause.summary
    assert took < 0.5 + 1.0


async def test_a_runner_flooding_stderr_is_drained_and_only_a_bounded_tail_is_kept() -> None:
    """A full stderr pipe would block the runner: the supervisor reads it continuously, keeping the last lines."""
    flood = Fault(kind="stderr_flood", after_tokens=2, lines=50_000)
    with anyio.fail_after(30):
        async with Supervisor(debug(), SupervisorSettings(output_lines=100)) as sup:
            await sup.ready()
            text, final = await (await sup.generate(prompt(5, flood))).text()
    tail = sup.output_tail  # complete once the runner is gone: the output pipe is drained before the exit is reported
    assert final.state is TaskState.COMPLETE and len(text.split()) == 5
    assert len(tail) == 100
    assert tail[-1] == "stderr flood line 50000/50000"


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_runner_flooding_stderr_does_not_starve_the_worker_event_loop() -> None:
    """Found by the fault campaign: the output pump read until the pipe was empty (a flooding runner never lets it
    be) and logged each line through ``logging`` (26 µs a line), holding the event loop for the whole flood, so
    another request's task write "timed out" and a healthy runner was declared hung. The loop now stays responsive
    (before: 0.5 s lag per flood; 64 floods of 20,000 lines took 36 s, now about 1.5 s)."""
    flood = Fault(kind="stderr_flood", lines=20_000, after_tokens=2)
    lag = 0.0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal lag
        while not done.is_set():
            began = time.monotonic()
            await anyio.sleep(0.01)
            lag = max(lag, time.monotonic() - began - 0.01)

    with anyio.fail_after(40):
        async with Supervisor(debug(token_seconds=0.0005)) as sup, anyio.create_task_group() as tg:
            await sup.ready()
            tg.start_soon(ticker)
            handles = [await sup.generate(prompt(8, flood)) for _ in range(4)]
            finals = [await h.wait() for h in handles]
            done.set()
    assert all(f.state is TaskState.COMPLETE for f in finals)
    assert lag < 0.2, f"the worker's event loop stalled {lag:.3f} s behind a flooding runner"
