"""The fault campaign: a short one keeps every promise, a trial replays alone, and the checks can fail.

The campaign attacks `tether serve` children it starts itself, through HTTP, signals and /proc (see
``tether.chaos``); these tests run it for real.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from conftest import TETHER
from tether.chaos.plan import BY_NAME, Attack, Trial, draw, plan
from tether.chaos.target import ServeChild, Target
from tether.chaos.trial import TrialResult, _check_gone, run_on
from tether.protocol import CauseKind

pytestmark = pytest.mark.slow  # campaigns of real faults on real workers: seconds each

BENCH = Path(__file__).resolve().parent.parent / "bench"
COUNTERS = ("hung", "orphans", "misclassified", "lost_requests", "leaked_fds", "failed_trials", "other_problems")


@pytest.mark.timeout(240)
def test_a_short_campaign_keeps_every_promise() -> None:
    """24 trials of seed 976 through the benchmark entry: the fewest that draw every attack (no seed below 3000 draws
    all 18 in fewer), each in some phase."""
    assert {t.attack.name for t in plan(976, 24)} == set(BY_NAME)
    out = subprocess.run(
        [sys.executable, str(BENCH / "chaos.py"), "--trials", "24", "--seed", "976"],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "chaos" and summary["trials"] == 24 and summary["seed"] == 976
    assert {k: summary[k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0), out.stderr[-3000:]
    assert summary["requests"] > 24


@pytest.mark.timeout(60)
def test_a_trial_replays_alone_by_its_seed_and_index() -> None:
    assert plan(3, 50)[17] == draw(3, 17) == plan(3, 1, only=17)[0]  # drawn alone, the same trial
    out = subprocess.run(
        [*TETHER, "chaos", "--seed", "3", "--only", "17", "--json"], capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["trials"] == 1 and summary["failed_trials"] == 0


@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_the_checks_fail_when_an_invariant_breaks(tmp_path: Path) -> None:
    """Deliberately wrong expectations must be caught: a segfault claimed to be an exit code, an exit claimed to be
    a signal are misclassified, and a process left by a trial is an orphan."""
    target = await anyio.to_thread.run_sync(Target, tmp_path)
    try:
        segv = BY_NAME["segv"]
        wrong = Attack("segv-called-exit", CauseKind.EXIT_CODE, segv.phases, engine_fault=segv.engine_fault)
        result = await run_on(target, Trial(1, 1, wrong, "generating", 8, 3, 0.0, 16))
        assert result.misclassified >= 1 and any("not exit_code" in p for p in result.problems), result.problems
        assert result.orphans == 0 and result.hung == 0

        exit3 = BY_NAME["exit3"]
        claimed = Attack("exit-called-signal", CauseKind.SIGNAL, ("idle",), engine_fault=exit3.engine_fault)
        result = await run_on(target, Trial(1, 2, claimed, "idle", 1, 3, 0.0, 16))
        assert any("failed with exit_code, not signal" in p for p in result.problems), result.problems

        # A process left behind by a trial is found and counted as an orphan.
        leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            check = TrialResult(Trial(1, 3, BY_NAME["sigkill"], "idle", 1, 1, 0.0, 8))
            await anyio.to_thread.run_sync(lambda: _check_gone(check, target, "t3", [leftover.pid], bound=0.2))
            assert check.orphans == 1 and str(leftover.pid) in check.problems[0]
        finally:
            leftover.kill()
            leftover.wait()
    finally:
        await anyio.to_thread.run_sync(target.stop)


@pytest.mark.timeout(60)
def test_a_target_finds_its_runners_in_proc(tmp_path: Path) -> None:
    """``runners()`` names the server's live runner (the worker trials' orphan check and the benchmarks' leftover
    counts rest on it: a /proc command line ends with a NUL, which once made it find none), and none after a stop."""
    target = Target(tmp_path)
    try:
        pid = int(target.wait_for(r"warm ready \(runner pid (\d+)", 5).group(1))
        assert pid in target.runners(), (pid, target.runners())
    finally:
        assert target.stop() == 0
    deadline = time.monotonic() + 5
    while target.runners() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert target.runners() == []


@pytest.mark.timeout(30)
def test_a_server_that_exits_before_it_listens_is_reported_at_once_not_after_the_whole_startup_wait() -> None:
    """A refused start (here a bad ``--port``) ends ``ServeChild`` as soon as the server's stderr closes, with its
    exit code and what it printed; the harness waited its whole ``startup`` before."""
    began = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        ServeChild("--engine", "debug", "--port", "not-a-port", startup=600)
    assert time.monotonic() - began < 20, time.monotonic() - began
    assert "exited with code 2 before printing a line matching" in str(failed.value), failed.value
    assert "not-a-port" in str(failed.value), failed.value
