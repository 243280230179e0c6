"""No orphans: SIGKILL a real worker process and every runner and grandchild goes; survivors are found and reaped.

The drills run in a separate process (``python -m tether.node.drill trial``) that makes itself a child subreaper, so
orphans are reparented to it rather than to init: the case a "has my parent become pid 1?" watchdog misses.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from conftest import pid_alive
from tether.channel import SyncReceiver, SyncSender
from tether.kernel.cgroups import MemoryCgroup
from tether.node import orphans
from tether.node.drill import start_worker, worker_argv
from tether.node.registry import Registry, RegistryError, RunnerRecord, start_time
from tether.node.spawn import RunnerProcess, lifeline_read_fd, start_runner
from tether.node.supervisor import Supervisor
from tether.protocol import (
    EngineSpec,
    Event,
    Fault,
    GenerateParams,
    RunnerConfig,
    RunnerHello,
    ShutdownTask,
    TaskState,
    TaskStatus,
)
from tether.runner import lifeline

TETHER = [sys.executable, "-m", "tether"]
ALL_STATES = "idle,loading,generating"
STUCK_STATES = "loading,generating"  # runners EOF on the task pipe cannot end: only a lifeline layer can


def drill(*args: str, timeout: float = 60) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tether.node.drill", "trial", *args], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def assert_all_gone(result: dict[str, Any]) -> None:
    assert result["survivors"] == [], f"survived the worker's SIGKILL: {result['survivors']} ({result})"
    assert set(result["runner_exit_ms"]) == set(result["runners"])
    assert set(result["group_exit_ms"]) == set(result["runners"])


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait (bounded) on pidfds until ``pids`` exit; return those still alive."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    alive = set(fds.values())
    deadline = time.monotonic() + timeout
    try:
        while alive and (remaining := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(remaining * 1000):
                alive.discard(fds[fd])
                poller.unregister(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return sorted(pid for pid in alive if pid_alive(pid))


def kill_groups(pgids: list[int]) -> None:
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------------------------
# The worker dies: everything goes with it
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("helper_kind", ["exec", "fork"])
def test_sigkilled_worker_takes_idle_loading_and_generating_runners_and_grandchildren(helper_kind: str) -> None:
    result = drill(f"--states={ALL_STATES}", "--helpers=2", f"--helper-kind={helper_kind}")
    assert_all_gone(result)
    assert result["subreaper"] is True
    states = {v: int(k) for k, v in result["runners"].items()}
    # Every runner has its group guard; the loading and generating ones also started two helpers.
    assert len(result["members"][str(states["idle"])]) == 2
    assert len(result["members"][str(states["loading"])]) == 4
    assert len(result["members"][str(states["generating"])]) == 4


@pytest.mark.timeout(90)
def test_without_a_subreaper_orphans_go_to_init_and_still_die() -> None:
    assert_all_gone(drill(f"--states={ALL_STATES}", "--helpers=1", "--no-subreaper"))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("layer", lifeline.LAYERS)
@pytest.mark.slow
def test_each_layer_alone_kills_the_orphan_and_its_group(layer: str) -> None:
    result = drill(
        f"--states={STUCK_STATES}", "--helpers=1", "--helper-kind=fork", f"--layers={layer}", "--poll-interval=0.2"
    )
    assert_all_gone(result)


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_with_no_layer_the_stuck_runners_survive_so_the_layer_tests_can_fail() -> None:
    result = drill(f"--states={STUCK_STATES}", "--layers=", "--timeout=1.5")
    assert sorted(result["survivors"]) == sorted(pid for pids in result["members"].values() for pid in pids)


@pytest.mark.timeout(60)
def test_the_thread_that_asked_for_a_spawn_may_exit_without_killing_the_runner() -> None:
    """pdeathsig follows the forking thread: spawns happen on tether's long-lived spawn thread, not the caller's."""
    holder: list[RunnerProcess] = []

    def short_lived() -> None:
        config = RunnerConfig(runner_id="thread", spec=EngineSpec(engine="debug"), worker_pid=os.getpid())
        holder.append(anyio.run(start_runner, config))

    thread = threading.Thread(target=short_lived)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and holder
    proc = holder[0]
    try:
        events = iter(SyncReceiver[Event](proc.events_fd, Event))
        assert isinstance(next(events), RunnerHello)
        # The asking thread is gone; the runner still serves a shutdown, so the kernel did not kill it.
        SyncSender(proc.tasks_fd).send(ShutdownTask(task_id="bye"))
        assert any(isinstance(e, TaskStatus) and e.state is TaskState.COMPLETE for e in events)
    finally:
        proc.kill_group(signal.SIGKILL)
        os.waitpid(proc.pid, 0)
        proc.close_fds()


# --------------------------------------------------------------------------------------------------------------
# The escape hatch, and finding and reaping what it leaves
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_escape_hatch_warns_in_the_runner_output(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lifeline.DISABLE_ENV, "1")
    with anyio.fail_after(30):
        async with Supervisor(EngineSpec(engine="debug")) as sup:
            await sup.wait_status(lambda s: True, 5)
        assert any(f"WARNING: {lifeline.DISABLE_ENV} is set" in line for line in sup.output_tail)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_escape_hatch_keeps_runners_alive_then_tether_orphans_lists_and_reaps_them(private_runtime_dir: Path) -> None:
    result = drill(
        f"--states={ALL_STATES}",
        "--helpers=1",
        "--disable-watchdog",
        "--timeout=1.5",
        "--keep-survivors",
        "--no-subreaper",
    )
    runners = sorted(int(pid) for pid in result["runners"])
    everyone = sorted(pid for pids in result["members"].values() for pid in pids)
    try:
        assert sorted(result["survivors"]) == everyone  # 1.5 s after the kill: the poll layer would take 0.5 s
        listed = subprocess.run([*TETHER, "orphans", "--json"], capture_output=True, text=True, timeout=30)
        assert listed.returncode == 1, listed.stderr  # orphans found and left
        report = json.loads(listed.stdout)
        mine = {o["pid"]: o for o in report["orphans"] if o["pid"] in runners}
        assert sorted(mine) == runners
        for orphan in mine.values():
            assert orphan["worker_pid"] == result["worker"]
            assert orphan["ppid"] != result["worker"]
            assert orphan["watchdog"] is False
            assert orphan["engine"] == "debug"  # from the registry record
            assert orphan["memory"]["rss"] > 0 and orphan["memory"]["anon"] > 0
            assert {m["role"] for m in orphan["members"]} >= {"runner", "guard"}
        text = subprocess.run([*TETHER, "orphans"], capture_output=True, text=True, timeout=30)
        assert text.returncode == 1 and "tether orphans --reap" in text.stdout
        reaped = subprocess.run([*TETHER, "orphans", "--reap", "--json"], capture_output=True, text=True, timeout=60)
        assert reaped.returncode == 0, reaped.stdout + reaped.stderr
        done = {r["pid"]: r for r in json.loads(reaped.stdout)["reaped"]}
        for pid in runners:
            assert done[pid]["ok"] and done[pid]["killed_with"] == "SIGTERM"
            assert done[pid]["freed"]["anon"] > 0
        assert wait_gone(everyone, 10) == []
        assert list(private_runtime_dir.glob("runner-*.json")) == []  # their records went with them
        again = subprocess.run([*TETHER, "orphans", "--json"], capture_output=True, text=True, timeout=30)
        assert [o for o in json.loads(again.stdout)["orphans"] if o["pid"] in runners] == []
    finally:
        kill_groups(runners)


@pytest.mark.timeout(60)
def test_reap_never_signals_a_process_whose_identity_changed() -> None:
    """The pid-reuse guard inside reap: a member whose start time or command line differs is left alone."""
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        started = start_time(bystander.pid)
        assert started is not None
        for wrong in ({"start_time": started - 100.0}, {"cmdline": ("python", "-m", "tether.runner")}):
            proc = orphans.Proc(
                pid=bystander.pid,
                ppid=os.getpid(),
                pgid=bystander.pid,
                start_time=wrong.get("start_time", started),  # type: ignore[arg-type]
                cmdline=wrong.get("cmdline", ("sleep", "60")),  # type: ignore[arg-type]
            )
            group = orphans.RunnerGroup(
                pgid=bystander.pid,
                worker_pid=1,
                runner_id="x",
                started=started,
                runner=proc,
                members=[proc],
                orphan=True,
                reason="planted",
            )
            result = orphans.reap(group, grace=0.5, kill_wait=0.5)
            assert [pid for pid, _ in result.refused] == [bystander.pid]
            assert bystander.poll() is None  # still running
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.timeout(60)
def test_a_record_naming_a_reused_pid_is_stale_and_its_process_untouched(private_runtime_dir: Path) -> None:
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        Registry().add(
            RunnerRecord(
                pid=bystander.pid,
                start_time=(start_time(bystander.pid) or 0) - 3600,
                pgid=bystander.pid,
                cmdline=[sys.executable, "-m", "tether.runner", "3", "4", "--worker=1", "--id=gone"],
                worker_pid=1,
                worker_start_time=0.0,
                runner_id="gone",
                engine="debug",
                model=None,
            )
        )
        out = subprocess.run([*TETHER, "orphans", "--reap", "--json"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stdout + out.stderr
        report = json.loads(out.stdout)
        assert bystander.pid not in [o["pid"] for o in report["orphans"]]
        stale = [s for s in report["stale_records"] if s["pid"] == bystander.pid]
        assert stale and "another process" in stale[0]["why"]
        assert bystander.poll() is None
        assert list(private_runtime_dir.glob("runner-*.json")) == []  # the stale record is cleaned up
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_helpers_of_a_runner_killed_without_its_guard_are_found_through_the_record() -> None:
    result = drill(
        "--states=loading", "--helpers=2", "--disable-watchdog", "--timeout=1", "--keep-survivors", "--no-subreaper"
    )
    runner = int(next(iter(result["runners"])))
    members = result["members"][str(runner)]
    helpers = [pid for pid in members if pid != runner][1:]  # members are sorted: the guard is forked first
    try:
        guard = min(pid for pid in members if pid != runner)
        os.kill(guard, signal.SIGKILL)
        assert wait_gone([guard], 10) == []
        os.kill(runner, signal.SIGKILL)
        assert wait_gone([runner], 10) == []
        out = subprocess.run([*TETHER, "orphans", "--json"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 1
        (group,) = [o for o in json.loads(out.stdout)["orphans"] if o["pid"] == runner]
        assert group["runner_alive"] is False
        assert sorted(m["pid"] for m in group["members"]) == sorted(helpers)
        assert "is gone but 2 process(es) of its group" in group["reason"]
        reaped = subprocess.run([*TETHER, "orphans", "--reap"], capture_output=True, text=True, timeout=60)
        assert reaped.returncode == 0, reaped.stdout
        assert wait_gone(helpers, 10) == []
    finally:
        kill_groups([runner])


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_starting_worker_reaps_dead_workers_runners_but_not_those_asked_to_live() -> None:
    # Orphans with their watchdog on only exist when every layer failed: simulate that with no layer armed.
    doomed = drill("--states=loading", "--layers=", "--timeout=1", "--keep-survivors", "--no-subreaper")
    kept = drill("--states=loading", "--disable-watchdog", "--timeout=1", "--keep-survivors", "--no-subreaper")
    doomed_pids = [pid for pids in doomed["members"].values() for pid in pids]
    kept_runner = int(next(iter(kept["runners"])))
    try:
        assert len(doomed["survivors"]) == 2 and len(kept["survivors"]) == 2
        skip = subprocess.run(
            [*TETHER, "run", "hi", "--engine", "debug", "--no-reap"], capture_output=True, text=True, timeout=60
        )
        assert skip.returncode == 0 and "reaped" not in skip.stderr
        assert all(pid_alive(pid) for pid in doomed_pids)
        out = subprocess.run([*TETHER, "run", "hi", "--engine", "debug"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        doomed_runner = int(next(iter(doomed["runners"])))
        assert (
            f"reaped orphaned runner {doomed_runner} of dead worker {doomed['worker']} (2 processes): freed"
            in out.stderr
        )
        assert wait_gone(doomed_pids, 10) == []
        assert pid_alive(kept_runner)
    finally:
        kill_groups([int(p) for p in doomed["runners"]] + [kept_runner])


# --------------------------------------------------------------------------------------------------------------
# The registry directory
# --------------------------------------------------------------------------------------------------------------


def test_registry_is_private_and_refuses_a_directory_it_does_not_own(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "tether")
    record = RunnerRecord(
        pid=1,
        start_time=0.0,
        pgid=1,
        cmdline=["x"],
        worker_pid=1,
        worker_start_time=0.0,
        runner_id="r",
        engine="debug",
        model=None,
    )
    path = registry.add(record)
    assert (tmp_path / "tether").stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    assert [f.record for f in registry.records()] == [record]
    path.write_text("{ not json")
    (bad,) = registry.records()
    assert bad.record is None and bad.error
    other = tmp_path / "theirs"
    other.mkdir(mode=0o700)
    os.chown(other, 4242, -1)
    with pytest.raises(RegistryError, match="belongs to uid 4242"):
        Registry(other).ensure()


def _pipe_fds(pid: int, inode: int) -> list[int]:
    """Access modes (0 read, 1 write) of ``pid``'s descriptors on the pipe ``inode``."""
    modes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != f"pipe:[{inode}]":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        except OSError:
            continue
        modes.append(flags & 0o3)
    return modes


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_only_the_worker_holds_the_lifeline_write_end() -> None:
    """Runners (and a forked helper, which inherits everything) hold the lifeline's read end only."""
    spec = EngineSpec(engine="debug", options={"helpers": 1, "helper_kind": "fork"})
    with anyio.fail_after(30):
        async with Supervisor(spec) as a, Supervisor(spec) as b:
            await a.ready()
            await b.ready()
            assert a.pid is not None and b.pid is not None
            inode = os.fstat(lifeline_read_fd()).st_ino
            for runner in (a.pid, b.pid):
                for pid in [runner, *(p.pid for p in psutil.Process(runner).children())]:
                    assert 1 not in _pipe_fds(pid, inode), f"pid {pid} holds the lifeline's write end"
                assert _pipe_fds(runner, inode) == [0]
            assert 1 in _pipe_fds(os.getpid(), inode)


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("helper_kind", ["exec", "fork"])
async def test_a_crashed_runner_takes_its_helpers_along(helper_kind: str) -> None:
    spec = EngineSpec(engine="debug", options={"helpers": 2, "helper_kind": helper_kind})
    with anyio.fail_after(30):
        async with Supervisor(spec) as sup:
            await sup.ready()
            assert sup.pid is not None
            group = [p.pid for p in psutil.Process(sup.pid).children()]
            assert len(group) == 3  # the guard and two helpers
            crash = GenerateParams(prompt="x", max_tokens=5, faults=(Fault(kind="segv", after_tokens=1),))
            final = await (await sup.generate(crash)).wait()
            assert final.state is TaskState.FAILED
        assert wait_gone(group, 10) == []


def _in_cgroup(runner: int) -> tuple[MemoryCgroup, list[int]]:
    """The runner's own cgroup and every process in it."""
    cgroup = MemoryCgroup.of_pid(runner)
    assert cgroup is not None and cgroup.path.name.startswith("tether-"), "the runner has no cgroup of its own"
    return cgroup, sorted(cgroup.pids())


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("own_cgroups")
async def test_a_helper_that_left_the_process_group_still_dies_with_its_crashed_runner() -> None:
    spec = EngineSpec(engine="debug", options={"helpers": 1, "helper_kind": "setsid"})
    with anyio.fail_after(30):
        async with Supervisor(spec) as sup:
            await sup.ready()
            assert sup.pid is not None
            members = _in_cgroup(sup.pid)[1]
            escaped = [p for p in members if os.getpgid(p) != sup.pid]
            assert len(escaped) == 1  # the setsid helper: out of reach of the group kill
            crash = GenerateParams(prompt="x", max_tokens=5, faults=(Fault(kind="segv", after_tokens=1),))
            assert (await (await sup.generate(crash)).wait()).state is TaskState.FAILED
    assert wait_gone(members, 10) == []


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("own_cgroups")
def test_a_helper_that_left_the_process_group_dies_when_the_worker_is_sigkilled() -> None:
    """No supervisor is left to clean up: the runner's guard kills what is in the runner's cgroup."""
    argv = worker_argv(["loading"], helpers=1, helper_kind="setsid", layers=("pdeathsig",))
    worker, report = start_worker(argv)
    runner = int(report["runners"][0]["pid"])  # type: ignore[index]
    members = _in_cgroup(runner)[1]
    try:
        assert any(os.getpgid(p) != runner for p in members)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        assert wait_gone(members, 10) == []
    finally:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------------------------
# Helpers that leave the runner's process group: only its cgroup still holds them
# --------------------------------------------------------------------------------------------------------------

ESCAPING = "setsid,setpgid,double_fork"  # one helper of each way out of the runner's process group


def _left_in_runner_cgroups(worker: int) -> list[int]:
    """Live processes still in the runner cgroups of a dead drill worker (which made them below our cgroup), each
    SIGKILLed here once counted: a leak must fail its test, not the next one."""
    own = MemoryCgroup.of_pid(os.getpid())
    assert own is not None
    left = []
    for path in own.path.glob(f"tether-*-{worker}"):
        pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        left += [pid for pid in pids if pid_alive(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("own_cgroups")
@pytest.mark.parametrize("layers", ["pdeathsig,lifeline,poll", "pdeathsig", "lifeline", "poll"])
@pytest.mark.parametrize("kinds", ["setsid", ESCAPING])
@pytest.mark.slow
def test_helpers_that_left_the_group_die_with_a_sigkilled_worker_whichever_layer_fires(layers: str, kinds: str) -> None:
    """The lifeline and the poll used to kill the runner's group, guard included, before the guard could kill the
    cgroup's members: every helper that had left the group survived, reparented to init."""
    result = drill(
        f"--states={STUCK_STATES}",
        "--helpers=3",
        f"--helper-kind={kinds}",
        f"--layers={layers}",
        "--poll-interval=0.2",
    )
    assert _left_in_runner_cgroups(result["worker"]) == []  # the outside view: nothing alive in any runner cgroup
    assert_all_gone(result)
    for pids in result["members"].values():
        assert len(pids) == 5, result  # the runner, its guard and three helpers, in its cgroup
    everyone = [pid for pids in result["members"].values() for pid in pids]
    assert [pid for pid in everyone if pid_alive(pid)] == []  # and /proc agrees


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("own_cgroups")
@pytest.mark.slow
def test_repeated_worker_sigkills_leave_no_helper_behind_in_any_state() -> None:
    """A race lost one time in several must show: twelve workers, each with an idle, a loading and a generating
    runner, the busy ones with a helper of each escaping kind, SIGKILLed at once after they report."""
    survivors: list[int] = []
    for _ in range(12):
        result = drill(f"--states={ALL_STATES}", "--helpers=3", f"--helper-kind={ESCAPING}")
        survivors += result["survivors"] + _left_in_runner_cgroups(result["worker"])
        assert sum(len(pids) for pids in result["members"].values()) == 2 + 5 + 5
    assert survivors == []


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("own_cgroups")
@pytest.mark.parametrize("record", ["with its record", "without a record"])
def test_helpers_left_in_a_dead_workers_runner_cgroup_are_listed_and_reaped(
    private_runtime_dir: Path, record: str
) -> None:
    """Were a runner and its guard both killed outright, only the runner's cgroup would name the helpers that left
    its group: `tether orphans` finds them there (by the record's cgroup, or by the cgroup's name alone)."""
    result = drill(
        "--states=loading",
        "--helpers=2",
        "--helper-kind=setsid,double_fork",
        "--disable-watchdog",
        "--timeout=1",
        "--keep-survivors",
        "--no-subreaper",
    )
    runner = int(next(iter(result["runners"])))
    cgroup, members = _in_cgroup(runner)
    escaped = [pid for pid in members if os.getpgid(pid) != runner]
    try:
        assert len(escaped) == 2 and len(members) == 4
        (guard,) = [pid for pid in members if pid != runner and pid not in escaped]
        for pid in (guard, runner):  # the guard first, or it would take the helpers along
            os.kill(pid, signal.SIGKILL)
            assert wait_gone([pid], 10) == []
        if record == "without a record":
            for path in private_runtime_dir.glob("runner-*.json"):
                path.unlink()
        out = subprocess.run([*TETHER, "orphans", "--json"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 1, out.stdout + out.stderr
        (group,) = [o for o in json.loads(out.stdout)["orphans"] if o["cgroup"] == str(cgroup.path)]
        assert group["runner_alive"] is False
        assert sorted(m["pid"] for m in group["members"]) == escaped
        if record == "with its record":
            assert group["pid"] == runner and "of its group and cgroup live on" in group["reason"]
        else:
            assert group["pid"] is None and f"its runner cgroup {cgroup.path} still holds 2" in group["reason"]
        text = subprocess.run([*TETHER, "orphans"], capture_output=True, text=True, timeout=30)
        assert text.returncode == 1 and "tether orphans --reap" in text.stdout
        reaped = subprocess.run([*TETHER, "orphans", "--reap", "--json"], capture_output=True, text=True, timeout=60)
        assert reaped.returncode == 0, reaped.stdout + reaped.stderr
        (done,) = [r for r in json.loads(reaped.stdout)["reaped"] if set(r["gone"]) == set(escaped)]
        assert done["ok"] and done["killed_with"] == "SIGTERM"
        assert wait_gone(escaped, 10) == []
        assert not cgroup.path.exists()  # emptied, then removed
    finally:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("own_cgroups")
@pytest.mark.slow
def test_a_starting_worker_reaps_what_a_dead_workers_runner_cgroup_still_holds() -> None:
    result = drill(
        "--states=loading", "--helpers=1", "--helper-kind=setsid", "--layers=", "--timeout=1", "--keep-survivors"
    )
    runner = int(next(iter(result["runners"])))
    cgroup, members = _in_cgroup(runner)
    (helper,) = [pid for pid in members if os.getpgid(pid) != runner]
    try:
        os.killpg(runner, signal.SIGKILL)  # the runner and its guard: what no layer armed leaves to the next worker
        assert wait_gone([runner], 10) == []
        assert pid_alive(helper)
        out = subprocess.run([*TETHER, "run", "hi", "--engine", "debug"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"reaped orphaned runner {runner} of dead worker {result['worker']} (1 process)" in out.stderr
        assert wait_gone([helper], 10) == []
        assert not cgroup.path.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper, signal.SIGKILL)


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("own_cgroups")
@pytest.mark.parametrize("helper_kind", ["setsid", "setpgid", "double_fork"])
async def test_each_escaping_helper_kind_leaves_the_group_but_not_the_cgroup(helper_kind: str) -> None:
    spec = EngineSpec(engine="debug", options={"helpers": 1, "helper_kind": helper_kind})
    with anyio.fail_after(30):
        async with Supervisor(spec) as sup:
            await sup.ready()
            assert sup.pid is not None
            _, members = _in_cgroup(sup.pid)
            (helper,) = [pid for pid in members if os.getpgid(pid) != sup.pid]
            session, parent = os.getsid(helper), psutil.Process(helper).ppid()
            if helper_kind == "setsid":
                assert session == helper and parent == sup.pid
            elif helper_kind == "setpgid":
                assert session == os.getsid(sup.pid) and os.getpgid(helper) == helper and parent == sup.pid
            else:  # a daemon: a session of its own, and not the runner's child any more
                assert session not in (helper, os.getsid(sup.pid)) and parent != sup.pid
    assert wait_gone(members, 10) == []


@pytest.mark.timeout(30)
def test_a_cgroup_named_like_a_runners_that_holds_the_scanner_is_not_a_dead_workers(memory_cgroup: Any) -> None:
    """``tether-test-14929379`` (a test cgroup whose random suffix was all digits) reads as runner "test" of the
    dead worker 14929379: a ``tether run`` started inside it reaped itself with SIGTERM before it printed a word."""
    parent = memory_cgroup(1 << 30)
    lookalike = parent / "tether-lookalike-99999999"  # beyond any pid_max: the "worker" is dead
    lookalike.mkdir()
    try:
        probe = (
            "import os; from tether.node import orphans; "
            "print(sum(str(f.cgroup.path) == os.environ['LOOKALIKE'] for f in orphans.dead_workers_cgroups()))"
        )
        procs = lookalike / "cgroup.procs"
        result = subprocess.run(
            ["sh", "-c", f'echo $$ > {procs} && exec {sys.executable} -c "{probe}"'],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, "LOOKALIKE": str(lookalike)},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "0", "a cgroup holding the scanning process was taken for a dead worker's"
        assert lookalike in [f.cgroup.path for f in orphans.dead_workers_cgroups()]  # from outside it still is
    finally:
        lookalike.rmdir()
