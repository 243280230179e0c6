"""Restart policy: the backoff schedule and its reset, the crash-loop limit, and no overlap between runner lives.

The schedule is pure logic, tested with a seeded rng and explicit times. Everything else runs real runners (debug
engine) that really die, and checks the evidence in /proc at the moment a replacement is created.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import subprocess
import sys
import time

import anyio
import msgspec
import pytest

from conftest import debug, pid_alive, prompt
from tether.kernel.pids import group_members
from tether.node import instance as instance_module
from tether.node.gone import RunnerNotGone, wait_runner_gone
from tether.node.hangs import Deadlines
from tether.node.instance import (
    Backoff,
    Instance,
    InstanceFailed,
    InstanceReady,
    InstanceRestarting,
    InstanceState,
    InstanceStopped,
    RestartPolicy,
)
from tether.node.spawn import ExitStatus, RunnerProcess
from tether.node.supervisor import Supervisor
from tether.node.tasks import RunnerUnavailable
from tether.protocol import CauseKind, EngineSpec, Fault, TaskState

pytestmark = pytest.mark.timeout(60)

FAST = RestartPolicy(initial_backoff=0.01, max_backoff=0.05, jitter=0.0)
CRASH = Fault(kind="sigkill", after_tokens=1)


async def crash(inst: Instance) -> int:
    """Kill the current runner mid-generation; return its pid."""
    sup = inst.supervisor
    assert sup is not None and sup.pid is not None
    final = await (await inst.generate(prompt(10, CRASH))).wait()
    assert final.state is TaskState.FAILED
    return sup.pid


async def ready_after(inst: Instance, old_pid: int | None, timeout: float = 20) -> InstanceReady:
    """Wait for a Ready runner other than ``old_pid`` (right after a crash the old life may still read Ready)."""
    state = await inst.wait_state(lambda s: isinstance(s, InstanceReady) and s.pid != old_pid, timeout)
    assert isinstance(state, InstanceReady)
    return state


# --------------------------------------------------------------------------------------------------------------
# Policy and schedule: pure
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "always"}, "mode must be 'never' or 'on-failure', got 'always'"),
        ({"initial_backoff": 0}, "initial_backoff must be > 0 s, got 0"),
        ({"initial_backoff": math.nan}, "initial_backoff must be a finite number, got nan"),
        ({"max_backoff": 0.1}, r"max_backoff \(0.1 s\) must be >= initial_backoff \(0.5 s\)"),
        ({"factor": 0.5}, "factor must be >= 1"),
        ({"jitter": 1.0}, r"jitter must be a fraction in \[0, 1\), got 1"),
        ({"healthy_after": -1}, "healthy_after must be >= 0 s, got -1"),
        ({"crash_loop_failures": 0}, "crash_loop_failures must be >= 1, got 0"),
        ({"crash_loop_window": 0}, "crash_loop_window must be > 0 s, got 0"),
    ],
)
def test_invalid_policy_values_are_refused_with_what_is_wrong(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"invalid restart policy: {message}"):
        RestartPolicy(**fields)  # type: ignore[arg-type]


def test_a_policy_decoded_from_config_is_validated_too() -> None:
    policy = msgspec.json.decode(b'{"mode": "never", "initial_backoff": 1.5}', type=RestartPolicy)
    assert policy.mode == "never" and policy.initial_backoff == 1.5 and policy.max_backoff == 30.0
    with pytest.raises(msgspec.ValidationError, match="initial_backoff must be > 0 s"):
        msgspec.json.decode(b'{"initial_backoff": -2}', type=RestartPolicy)
    with pytest.raises(msgspec.ValidationError, match="Object contains unknown field `backof`"):
        msgspec.json.decode(b'{"backof": 2}', type=RestartPolicy)


def test_backoff_doubles_from_the_initial_delay_up_to_the_cap() -> None:
    backoff = Backoff(RestartPolicy(jitter=0.0))
    assert [backoff.delay_for(n) for n in range(1, 10)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert backoff.base_delay(100_000) == 30.0, "a long streak must not overflow"
    with pytest.raises(ValueError, match="attempt numbers start at 1"):
        backoff.delay_for(0)


def test_jitter_keeps_each_delay_within_its_bounds_and_never_above_the_cap() -> None:
    policy = RestartPolicy(jitter=0.2)
    backoff = Backoff(policy, random.Random(7))
    for attempt in range(1, 10):
        base = backoff.base_delay(attempt)
        samples = [backoff.delay_for(attempt) for _ in range(300)]
        assert all(base * 0.8 <= d <= min(base * 1.2, 30.0) for d in samples), attempt
        assert max(samples) - min(samples) > base * 0.1, "jitter must actually spread restarts"
    again = [Backoff(policy, random.Random(3)).delay_for(n) for n in range(1, 6)]
    assert again == [Backoff(policy, random.Random(3)).delay_for(n) for n in range(1, 6)], "seeded: reproducible"


def test_a_healthy_period_resets_the_schedule_to_the_initial_delay() -> None:
    backoff = Backoff(RestartPolicy(jitter=0.0))
    assert [backoff.delay_for(backoff.record_failure(t)) for t in (0.0, 1.0, 2.0)] == [0.5, 1.0, 2.0]
    backoff.record_healthy()
    assert backoff.attempt == 0
    assert backoff.delay_for(backoff.record_failure(70.0)) == 0.5
    assert backoff.delay_for(backoff.record_failure(71.0)) == 1.0


def test_crash_loop_is_n_failures_within_the_window_not_spread_out_ones() -> None:
    policy = RestartPolicy(crash_loop_failures=3, crash_loop_window=10.0)
    burst = Backoff(policy)
    burst.record_failure(0.0)
    burst.record_failure(4.0)
    assert not burst.crash_looping(4.0)
    burst.record_failure(9.5)
    assert burst.crash_looping(9.5)

    spread = Backoff(policy)
    for t in (0.0, 6.0, 12.0, 18.0, 24.0, 30.0):  # never three within 10 s
        spread.record_failure(t)
        assert not spread.crash_looping(t), t
    assert spread.failures_in_window(30.0) == 2
    assert spread.failures_in_window(50.0) == 0, "old failures leave the window"

    # The window counts failures, not streaks: a healthy period resets the delay but not the crash-loop count.
    flapping = Backoff(policy)
    flapping.record_failure(0.0)
    flapping.record_failure(1.0)
    flapping.record_healthy()
    assert flapping.record_failure(2.0) == 1 and flapping.crash_looping(2.0)


# --------------------------------------------------------------------------------------------------------------
# Real runners
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        (Fault(kind="sigkill", after_tokens=2), CauseKind.SIGNAL),
        (Fault(kind="exit", code=3, after_tokens=2), CauseKind.EXIT_CODE),
        (Fault(kind="raise", after_tokens=2), CauseKind.EXCEPTION),
    ],
    ids=["sigkill", "exit3", "raise"],
)
@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_a_runner_that_dies_mid_generation_is_replaced_and_serves_again(
    fault: Fault, kind: CauseKind, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tether.node.instance")
    states: list[InstanceState] = []
    with anyio.fail_after(45):
        async with Instance(debug(), FAST, name="replace") as inst:
            inst.add_state_listener(states.append)
            old_pid = (await inst.wait_ready(20)).pid
            final = await (await inst.generate(prompt(10, fault))).wait()
            new = await ready_after(inst, old_pid)
            text, done = await (await inst.generate(prompt(4))).text()
    assert final.state is TaskState.FAILED and final.cause is not None and final.cause.kind is kind
    assert done.state is TaskState.COMPLETE and len(text.split()) == 4, "the replacement serves"
    assert old_pid is not None and inst.pids == [old_pid, new.pid] and new.life == 2
    assert inst.restarts == 1
    assert [(f.cause, f.pid, f.life) for f in inst.history] == [(final.cause, old_pid, 1)]
    restarting = [s for s in states if isinstance(s, InstanceRestarting)]
    assert [(s.life, s.attempt, s.delay, s.cause) for s in restarting] == [(2, 1, 0.01, final.cause)]
    assert isinstance(inst.state, InstanceStopped) and inst.supervisor is None
    assert not any(pid_alive(pid) for pid in inst.pids)
    logged = [r.getMessage() for r in caplog.records if r.name == "tether.node.instance"]
    assert any(f"runner pid {old_pid} (life 1) failed: {final.cause.summary}; restart 1 in 0.01 s" in m for m in logged)


def _hold_memory_in_group(pgid: int, size: int = 1 << 30) -> subprocess.Popen[bytes]:
    """Start a process in group ``pgid`` that holds ``size`` bytes of touched memory, like an engine worker holding
    its share of a model. Once SIGKILLed it is still alive (not yet a zombie) while the kernel frees that memory,
    about 0.1 s per GiB: the window in which a replacement would compete with its predecessor."""
    code = f"import signal; held = b'1' * {size}; print('holding', flush=True); signal.pause()"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, process_group=pgid)


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
@pytest.mark.slow
async def test_a_replacement_is_created_only_after_the_old_runner_and_its_whole_group_are_gone() -> None:
    """Evidence taken at the moment the next supervisor is created: old pid and every old group member are gone.

    The old group holds the runner, its group guard, two forked helpers and a member holding 1 GiB: the
    supervisor's SIGKILL reaches them all at the runner's death, but that member takes a while to die (its memory is
    being freed), so starting the replacement as soon as the runner is reaped would overlap with it.
    """
    members_at_crash: dict[int, list[int]] = {}
    evidence: dict[int, tuple[bool, list[int], list[int]]] = {}  # old pid: (alive, group, live old members)
    holders: list[subprocess.Popen[bytes]] = []

    def factory(spec: EngineSpec, *, runner_id: str, deadlines: Deadlines) -> Supervisor:
        if inst.pids:
            old = inst.pids[-1]
            evidence[old] = (pid_alive(old), group_members(old), [p for p in members_at_crash[old] if pid_alive(p)])
        return Supervisor(spec, runner_id=runner_id, deadlines=deadlines)

    inst = Instance(debug(helpers=2, helper_kind="fork"), FAST, supervisor_factory=factory)
    try:
        with anyio.fail_after(50):
            async with inst:
                pid: int | None = None
                for _ in range(2):
                    pid = (await ready_after(inst, pid)).pid
                    holder = _hold_memory_in_group(pid)
                    holders.append(holder)
                    assert holder.stdout is not None
                    line = await anyio.to_thread.run_sync(holder.stdout.readline, abandon_on_cancel=True)
                    assert line == b"holding\n"
                    members_at_crash[pid] = group_members(pid)
                    await crash(inst)
                await ready_after(inst, pid)
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    old_pids = inst.pids[:2]
    assert len(set(inst.pids)) == 3 and inst.restarts == 2
    for old, holder in zip(old_pids, holders, strict=True):
        assert len(members_at_crash[old]) == 5 and holder.pid in members_at_crash[old], (
            "runner, group guard, two helpers and the memory holder share the group"
        )
    assert evidence == {old: (False, [], []) for old in old_pids}, "the factory ran for each restart, after the end"


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_a_crash_loop_ends_failed_with_every_cause_and_no_further_runner() -> None:
    spec = debug(Fault(kind="exit", phase="load", code=3))
    policy = RestartPolicy(initial_backoff=0.01, max_backoff=0.05, crash_loop_failures=3)
    states: list[InstanceState] = []
    with anyio.fail_after(45):
        async with Instance(spec, policy, name="loop") as inst:
            inst.add_state_listener(states.append)
            failed = await inst.wait_state(lambda s: isinstance(s, InstanceFailed), 30)
            with pytest.raises(RunnerUnavailable, match=r"instance loop failed: .*crash loop: 3 failures within 300 s"):
                await inst.generate(prompt())
            with pytest.raises(RunnerUnavailable, match="crash loop"):
                await inst.wait_ready(1)
    assert isinstance(failed, InstanceFailed)
    assert failed.history == tuple(inst.history) and len(inst.history) == 3
    assert all(f.cause.kind is CauseKind.EXIT_CODE and f.cause.exit_code == 3 for f in inst.history)
    assert all(f.cause.phase == "loading" for f in inst.history)
    assert failed.cause == inst.history[-1].cause
    assert [f.pid for f in inst.history] == inst.pids and len(set(inst.pids)) == 3, "no fourth runner"
    assert inst.restarts == 2
    delays = [s.delay for s in states if isinstance(s, InstanceRestarting)]
    assert len(delays) == 2 and delays[0] == pytest.approx(0.01, rel=0.11) and delays[1] == pytest.approx(0.02, 0.11)
    assert isinstance(inst.state, InstanceFailed), "failed stays failed (with its cause) after the instance stops"


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
@pytest.mark.slow
async def test_an_instance_that_keeps_failing_remembers_its_latest_failures_and_counts_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench/soak.py: 240 failures in 30 minutes, every one (its evidence and stacks) kept in the history and sent
    in each instance answer, so the worker grew ~11 MiB/h. Now the history and the pids hold the latest
    HISTORY_LIMIT (3 here), and ``failures`` counts every failed life by cause."""
    monkeypatch.setattr(instance_module, "HISTORY_LIMIT", 3)
    spec = debug(Fault(kind="exit", phase="load", code=3))
    policy = RestartPolicy(initial_backoff=0.01, max_backoff=0.01, crash_loop_failures=7)
    with anyio.fail_after(45):
        async with Instance(spec, policy, name="many") as inst:
            failed = await inst.wait_state(lambda s: isinstance(s, InstanceFailed), 40)
    assert isinstance(failed, InstanceFailed)
    assert inst.failures == {CauseKind.EXIT_CODE: 7} and inst.restarts == 6
    assert [f.life for f in inst.history] == [5, 6, 7] and len(failed.history) == 3
    assert [f.pid for f in inst.history] == inst.pids  # the same latest three


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_policy_never_fails_after_the_first_failure() -> None:
    with anyio.fail_after(30):
        async with Instance(debug(), RestartPolicy(mode="never")) as inst:
            await inst.wait_ready(20)
            pid = await crash(inst)
            failed = await inst.wait_state(lambda s: isinstance(s, InstanceFailed), 10)
            with pytest.raises(RunnerUnavailable, match=r"killed by SIGKILL.*the restart policy is 'never'"):
                await inst.generate(prompt())
    assert isinstance(failed, InstanceFailed) and failed.reason == "the restart policy is 'never'"
    assert failed.cause.kind is CauseKind.SIGNAL
    assert inst.pids == [pid] and inst.restarts == 0 and len(inst.history) == 1


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_a_model_the_engine_refuses_is_not_retried_unless_the_policy_says_so() -> None:
    spec = EngineSpec(engine="debug", options={"load_steps": "many"})
    with anyio.fail_after(45):
        async with Instance(spec, FAST) as inst:
            failed = await inst.wait_state(lambda s: isinstance(s, InstanceFailed), 20)
        retrying = RestartPolicy(initial_backoff=0.01, jitter=0.0, crash_loop_failures=2, give_up_on=())
        async with Instance(spec, retrying) as retried:
            looped = await retried.wait_state(lambda s: isinstance(s, InstanceFailed), 20)
    assert isinstance(failed, InstanceFailed) and failed.cause.kind is CauseKind.LOAD_ERROR
    assert "invalid debug engine option" in failed.cause.summary
    assert failed.reason.startswith("a restart cannot fix a load_error")
    assert len(inst.pids) == 1
    assert isinstance(looped, InstanceFailed) and looped.reason.startswith("crash loop: 2 failures")
    assert len(retried.pids) == 2


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_during_a_backoff_requests_are_refused_with_the_wait_and_cause_and_stop_is_immediate() -> None:
    policy = RestartPolicy(initial_backoff=30.0, max_backoff=60.0, jitter=0.0)
    with anyio.fail_after(30):
        async with Instance(debug(), policy, name="slow") as inst:
            await inst.wait_ready(20)
            await crash(inst)
            await inst.wait_state(lambda s: isinstance(s, InstanceRestarting), 10)
            with pytest.raises(RunnerUnavailable, match=r"slow is restarting in [23]\d\.\d s .*killed by SIGKILL") as e:
                await inst.generate(prompt())
            assert e.value.cause is not None and e.value.cause.kind is CauseKind.SIGNAL
            began = time.monotonic()
            assert await inst.stop()
            took = time.monotonic() - began
    assert took < 1.0, f"stop waited {took:.2f} s: it must not sit out the backoff"
    assert isinstance(inst.state, InstanceStopped) and len(inst.pids) == 1


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_stopping_a_serving_instance_stops_its_runner_cleanly() -> None:
    with anyio.fail_after(30):
        async with Instance(debug()) as inst:
            sup = await inst.wait_ready(20)
            assert await inst.stop(5)
            with pytest.raises(RunnerUnavailable, match="is stopped"):
                await inst.generate(prompt())
    assert sup.stop_report is not None and sup.stop_report.clean
    assert inst.history == [] and isinstance(inst.state, InstanceStopped)


# --------------------------------------------------------------------------------------------------------------
# The "gone" check itself, on plain process groups
# --------------------------------------------------------------------------------------------------------------


def _dead_leader_with_member() -> tuple[RunnerProcess, subprocess.Popen[bytes]]:
    """A group whose leader is dead and reaped, and one member that is still alive."""
    leader = subprocess.Popen(["sleep", "infinity"], process_group=0)
    member = subprocess.Popen(["sleep", "infinity"], process_group=leader.pid)
    leader.kill()
    leader.wait()
    process = RunnerProcess(popen=leader, tasks_fd=-1, events_fd=-1, output_fd=-1, pidfd=None)
    process.exit_status = ExitStatus.from_wait_status(signal.SIGKILL)
    return process, member


@pytest.mark.anyio
async def test_a_group_left_with_only_zombies_counts_as_gone() -> None:
    process, member = _dead_leader_with_member()
    try:
        member.kill()
        os.waitid(os.P_PID, member.pid, os.WEXITED | os.WNOWAIT)  # dead but not reaped: a zombie in the group
        os.killpg(process.pgid, 0)  # the kernel still counts the group: killpg alone would wait for ever
        with anyio.fail_after(5):
            await wait_runner_gone(process, 2.0, kill=False)
    finally:
        member.kill()
        member.wait()


@pytest.mark.anyio
async def test_a_group_that_keeps_a_live_member_is_reported_then_killed() -> None:
    process, member = _dead_leader_with_member()
    try:
        with anyio.fail_after(10):
            with pytest.raises(RunnerNotGone) as refused:
                await wait_runner_gone(process, 0.3, kill=False)
            assert refused.value.survivors == [member.pid]
            message = str(refused.value)
            assert f"process group {process.pgid} still has live processes ({member.pid}) 0.3 s later" in message
            assert f"ps -o pid,stat,wchan:32,cmd -g {process.pgid}" in message
            await wait_runner_gone(process, 5.0)  # kills the survivor through its pidfd and awaits it
        assert not pid_alive(member.pid)
    finally:
        member.kill()
        member.wait()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_model_that_cannot_fit_the_node_is_refused_before_any_runner_starts() -> None:
    """10 M tokens of context need ~220 GiB of KV cache for the default model: more than this node has."""
    from tether.models import default_model_path

    try:
        default_model_path()
    except Exception as exc:
        pytest.skip(f"the default model is missing: {exc}")
    spec = EngineSpec(engine="llama.cpp", options={"n_ctx": 10_000_000})
    with anyio.fail_after(30):
        async with Instance(spec) as inst:
            failed = await inst.wait_state(lambda s: isinstance(s, InstanceFailed), 20)
    assert isinstance(failed, InstanceFailed)
    assert failed.cause.kind is CauseKind.DOES_NOT_FIT
    assert "at n_ctx 10000000" in failed.cause.summary and "available (" in failed.cause.summary
    assert inst.pids == []  # refused before load: no runner was ever spawned
    assert inst.fit is None
