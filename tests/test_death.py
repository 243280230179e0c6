"""No silent death: every way a runner dies, in every phase, is noticed at once and told as one cause with evidence.

Each case provokes the failure for real (the debug engine's faults, or a signal from outside) while the runner is
loading, idle, or generating with several requests in flight, then checks the cause and its evidence, that every
in-flight task ended with exactly one terminal FAILED event carrying that cause, and how long detection took: an
independent thread in the test watches the runner's pidfd and stamps its exit; the supervisor's Failed status must
follow well under a second later.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from dataclasses import dataclass

import anyio
import pytest

from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.node.tasks import TaskHandle
from tether.protocol import (
    CauseKind,
    EngineSpec,
    Failed,
    Fault,
    GenerateParams,
    GenerateTask,
    Loading,
    LoadTask,
    RunnerStatus,
    Running,
    TaskState,
    TaskStatus,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftover_runners")]

PHASES = ("loading", "idle", "generating")
DETECTION_BOUND_S = 0.5  # "well under a second"


@dataclass(frozen=True)
class Case:
    """How to provoke one failure, and what the cause must say."""

    kind: str
    fault: Fault | None  # None: a signal from outside the runner
    outside_signal: int | None
    expect: CauseKind
    signal_name: str | None = None
    exit_code: int | None = None
    evidence: str | None = None  # a substring some evidence line (or the summary) must contain


CASES = {
    "exception": Case("exception", Fault(kind="raise"), None, CauseKind.EXCEPTION, evidence="RuntimeError"),
    "exit3": Case("exit3", Fault(kind="exit", code=3), None, CauseKind.EXIT_CODE, exit_code=3),
    "exit0": Case("exit0", Fault(kind="exit", code=0), None, CauseKind.UNEXPECTED_EXIT, exit_code=0),
    "segv": Case("segv", Fault(kind="segv"), None, CauseKind.NATIVE_CRASH, "SIGSEGV", evidence="Fatal Python error"),
    "abort": Case("abort", Fault(kind="abort"), None, CauseKind.NATIVE_CRASH, "SIGABRT", evidence="Fatal Python error"),
    "sigkill": Case("sigkill", None, signal.SIGKILL, CauseKind.SIGNAL, "SIGKILL"),
    "memory_error": Case(
        "memory_error", Fault(kind="memory_error"), None, CauseKind.OUT_OF_MEMORY, evidence="MemoryError"
    ),
    "oom": Case("oom", Fault(kind="oom"), None, CauseKind.OUT_OF_MEMORY, "SIGKILL", evidence="out-of-memory killer"),
}
# An exception needs engine code to be running; an idle runner runs none (see the debug engine's "idle" phase).
NOT_IN_IDLE = {"exception", "memory_error"}


def _params() -> list[object]:
    out: list[object] = []
    for name in CASES:
        for phase in PHASES:
            marks = (
                [pytest.mark.skip(reason="exceptions need engine code running")]
                if (phase == "idle" and name in NOT_IN_IDLE)
                else []
            )
            out.append(pytest.param(name, phase, id=f"{name}-{phase}", marks=marks))
    return out


class ExitWatch:
    """Stamps the runner's exit from its own pidfd, independently of the supervisor."""

    def __init__(self, pid: int) -> None:
        self.fd = os.pidfd_open(pid)
        self.exited_at: float | None = None
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        select.select([self.fd], [], [])
        self.exited_at = time.monotonic()

    def close(self) -> None:
        self._thread.join(timeout=5)
        os.close(self.fd)


async def _collect(handle: TaskHandle, finals: list[TaskStatus]) -> None:
    terminals = [e async for e in handle if isinstance(e, TaskStatus) and e.state.terminal]
    assert len(terminals) == 1, f"task {handle.task_id}: {len(terminals)} terminal events"
    finals.append(terminals[0])


def _spec(case: Case, phase: str) -> EngineSpec:
    options: dict[str, object] = {}
    faults: tuple[Fault, ...] = ()
    if phase == "loading":
        if case.fault is None:
            options = {"load_steps": 1, "load_step_seconds": 60}  # stays loading until the signal
        else:
            faults = (Fault(kind=case.fault.kind, phase="load", code=case.fault.code),)
    elif phase == "idle" and case.fault is not None:
        faults = (Fault(kind=case.fault.kind, phase="idle", code=case.fault.code, seconds=0.2),)
    elif phase == "generating":
        options = {"token_seconds": 0.01}
    return EngineSpec(engine="debug", options=options, faults=faults)


@pytest.mark.parametrize(("name", "phase"), _params())
async def test_every_death_in_every_phase_is_one_cause_with_evidence(
    name: str, phase: str, request: pytest.FixtureRequest
) -> None:
    case = CASES[name]
    cgroup = request.getfixturevalue("memory_cgroup")(128 << 20) if name == "oom" else None
    failed_at: list[float] = []

    def on_status(status: RunnerStatus) -> None:
        if isinstance(status, Failed) and not failed_at:
            failed_at.append(time.monotonic())

    finals: list[TaskStatus] = []
    with anyio.fail_after(45):
        async with (
            Supervisor(_spec(case, phase), SupervisorSettings(stop_timeout=2), cgroup=cgroup) as sup,
            anyio.create_task_group() as tg,
        ):
            assert sup.pid is not None
            sup.add_status_listener(on_status)
            watch = ExitWatch(sup.pid)
            submitted = 0
            if phase == "loading":
                # The load task, and two requests queued behind it (sent, not yet acknowledged by the runner).
                for task in (LoadTask("load-1"), GenerateTask("gen-1", GenerateParams(prompt="a", max_tokens=5))):
                    tg.start_soon(_collect, await sup.submit(task), finals)
                    submitted += 1
                tg.start_soon(_collect, await sup.submit(GenerateTask("gen-2", GenerateParams(prompt="b"))), finals)
                submitted += 1
                if case.outside_signal is not None:
                    await sup.wait_status(lambda s: isinstance(s, Loading), 10)
                    os.kill(sup.pid, case.outside_signal)
            else:
                await sup.ready()
                if phase == "idle" and case.outside_signal is not None:
                    os.kill(sup.pid, case.outside_signal)
                elif phase == "generating":
                    first = GenerateParams(prompt="x", max_tokens=1000, faults=_request_faults(case))
                    handles = [await sup.generate(first)]
                    handles += [await sup.generate(GenerateParams(prompt=f"q{i}", max_tokens=5)) for i in range(3)]
                    for handle in handles:
                        tg.start_soon(_collect, handle, finals)
                    submitted = len(handles)
                    if case.outside_signal is not None:
                        await sup.wait_status(lambda s: isinstance(s, Running), 10)
                        os.kill(sup.pid, case.outside_signal)
            await sup.wait_status(lambda s: isinstance(s, Failed), 30)
        watch.close()

    cause = sup.cause
    assert cause is not None
    assert cause.kind is case.expect, cause.render()
    assert cause.phase == phase, cause.render()
    if case.signal_name is not None:
        assert cause.signal == case.signal_name, cause.render()
    if case.exit_code is not None:
        assert cause.exit_code == case.exit_code, cause.render()
    if case.evidence is not None:
        assert any(case.evidence in line for line in (cause.summary, *cause.evidence)), cause.render()
    if name == "oom":
        assert "cgroup limit 128 MiB" in cause.summary, cause.render()
    # Every in-flight task: exactly one terminal event, FAILED, carrying the runner's cause.
    assert len(finals) == submitted
    for final in finals:
        assert final.state is TaskState.FAILED, final
        assert final.cause == cause, final
    # Detection: the Failed status followed the exit (seen through our own pidfd) well under a second later.
    assert watch.exited_at is not None and failed_at
    assert failed_at[0] - watch.exited_at < DETECTION_BOUND_S, (failed_at[0] - watch.exited_at, cause.render())


def _request_faults(case: Case) -> tuple[Fault, ...]:
    if case.fault is None:
        return ()
    return (Fault(kind=case.fault.kind, phase="generate", after_tokens=2, code=case.fault.code),)
