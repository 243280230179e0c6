"""Orphan drills: kill a real worker process with SIGKILL and time how fast its runners and their groups go.

Shared by the tests and ``bench/orphan_exit.py`` so both exercise exactly the same thing:

- ``python -m tether.node.drill worker ...`` is a real worker: one ``Supervisor`` per requested runner state (idle,
  loading, generating) on the debug engine, optionally with helper processes. When every runner is in its state it
  prints one JSON line (its pid and its runners' pids) and waits to be killed.
- ``run_trial`` (or ``python -m tether.node.drill trial ...``, which prints the result as JSON) starts that worker,
  snapshots every process each runner started (its process group and its own cgroup, which also holds the helpers
  that left the group), SIGKILLs the worker and waits (bounded) on each process's pidfd.
  By default the drill process is a child subreaper (``PR_SET_CHILD_SUBREAPER``): orphans are reparented to it rather
  than to init, the case where "is my parent pid 1?" watchdogs never fire, and it can reap what it observes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field

import anyio

from tether.engines.debug import HELPER_KINDS
from tether.env import DISABLE_ORPHAN_WATCHDOG
from tether.kernel.cgroups import RUNNER_CGROUP_PREFIX, MemoryCgroup
from tether.kernel.pids import group_members, iter_exits, open_pidfd
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.protocol import EngineSpec, Fault, GenerateParams, Loading, LoadTask, RunnerStatus, Running
from tether.runner import lifeline

STATES = ("idle", "loading", "generating")
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux >= 3.4); False where unsupported."""
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


# --------------------------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------------------------


def _loading(status: RunnerStatus) -> bool:
    return isinstance(status, Loading)


def _loading_with_helpers(status: RunnerStatus) -> bool:
    return isinstance(status, Loading) and status.detail.startswith("started")


async def _worker(args: argparse.Namespace) -> None:
    layers = tuple(args.layers.split(",")) if args.layers else ()
    settings = SupervisorSettings(orphan_layers=layers, orphan_poll_interval=args.poll_interval, stop_timeout=2)
    async with AsyncExitStack() as stack:
        runners: list[tuple[str, Supervisor]] = []
        for state in args.states.split(","):
            options: dict[str, object] = {"helpers": args.helpers, "helper_kind": args.helper_kind}
            if state == "loading":
                options |= {"load_steps": 1, "load_step_seconds": 3600}
            sup = Supervisor(EngineSpec(engine="debug", options=options), settings)
            await stack.enter_async_context(sup)
            runners.append((state, sup))
        for state, sup in runners:
            if state == "loading":
                await sup.submit(LoadTask(task_id=f"load-{sup.runner_id}"))
                await sup.wait_status(_loading_with_helpers if args.helpers else _loading, 30)
            elif state == "generating":
                await sup.ready()
                stuck = Fault(kind="slow", seconds=3600)  # generating, and staying so
                await sup.generate(GenerateParams(prompt="drill", max_tokens=4, faults=(stuck,)))
                await sup.wait_status(lambda s: isinstance(s, Running), 30)
        report = {"worker": os.getpid(), "runners": [{"state": st, "pid": sup.pid} for st, sup in runners]}
        print(json.dumps(report), flush=True)
        await anyio.sleep_forever()


# --------------------------------------------------------------------------------------------------------------
# The drill
# --------------------------------------------------------------------------------------------------------------


@dataclass
class DrillResult:
    """Milliseconds from the worker's SIGKILL to each exit; ``survivors`` are still alive at the deadline."""

    worker: int
    runners: dict[int, str]  # runner pid -> state
    members: dict[int, list[int]]  # runner pid -> every process it started (``runner_processes``), itself included
    runner_exit_ms: dict[int, float] = field(default_factory=dict)
    group_exit_ms: dict[int, float] = field(default_factory=dict)  # when the group's last process exited
    survivors: list[int] = field(default_factory=list)
    subreaper: bool = False
    worker_exit_ms: float | None = None  # the worker's own exit: the kernel tears it down before any layer fires

    def kill_survivors(self) -> None:
        """Clean up after a drill that left processes alive on purpose (the escape hatch)."""
        for pgid in self.members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        for pid in self.survivors:  # those that left the group (seconds ago: their pids cannot have been reused)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for pid in self.survivors:
            with contextlib.suppress(ChildProcessError, ProcessLookupError):
                os.waitpid(pid, 0)


def runner_processes(runner: int) -> list[int]:
    """Every live process a runner started: its process group, and its own memory cgroup when it has one (which
    also holds the helpers that left the group)."""
    pids = set(group_members(runner))
    cgroup = MemoryCgroup.of_pid(runner)
    if (
        cgroup is not None
        and cgroup.path.name.startswith(RUNNER_CGROUP_PREFIX)
        and cgroup != MemoryCgroup.of_pid(os.getpid())
    ):
        pids.update(cgroup.pids())
    return sorted(pids)


def worker_argv(
    states: Sequence[str] = ("idle",),
    *,
    helpers: int = 0,
    helper_kind: str = "exec",
    layers: Sequence[str] = lifeline.LAYERS,
    poll_interval: float = lifeline.DEFAULT_POLL_INTERVAL,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tether.node.drill",
        "worker",
        f"--states={','.join(states)}",
        f"--helpers={helpers}",
        f"--helper-kind={helper_kind}",
        f"--layers={','.join(layers)}",
        f"--poll-interval={poll_interval}",
    ]


def start_worker(
    argv: list[str], *, disable_watchdog: bool = False, timeout: float = 30.0
) -> tuple[subprocess.Popen[bytes], dict[str, object]]:
    """Start a drill worker and return it with its report, once all its runners are in their states."""
    env = dict(os.environ)
    env.pop(DISABLE_ORPHAN_WATCHDOG, None)
    if disable_watchdog:
        env[DISABLE_ORPHAN_WATCHDOG] = "1"
    worker = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    assert worker.stdout is not None
    ready, _, _ = select.select([worker.stdout], [], [], timeout)
    line = worker.stdout.readline() if ready else b""
    if not line:
        worker.kill()
        worker.wait()
        raise RuntimeError(f"drill worker {worker.pid} did not report its runners within {timeout:.0f} s")
    return worker, json.loads(line)


def run_trial(
    states: Sequence[str] = ("idle",),
    *,
    helpers: int = 0,
    helper_kind: str = "exec",
    layers: Sequence[str] = lifeline.LAYERS,
    poll_interval: float = lifeline.DEFAULT_POLL_INTERVAL,
    disable_watchdog: bool = False,
    subreaper: bool = True,
    kill_delay: float = 0.0,
    timeout: float = 10.0,
) -> DrillResult:
    """One drill: start a worker, SIGKILL it, and time the exit of every process of every runner's group.

    ``kill_delay`` waits that long before the kill: benchmarks draw it at random to sample the poll layer's phase.
    """
    is_subreaper = become_subreaper() if subreaper else False
    argv = worker_argv(states, helpers=helpers, helper_kind=helper_kind, layers=layers, poll_interval=poll_interval)
    worker, report = start_worker(argv, disable_watchdog=disable_watchdog)
    runners = {int(r["pid"]): str(r["state"]) for r in report["runners"]}  # type: ignore[attr-defined]
    members = {pid: runner_processes(pid) for pid in runners}
    result = DrillResult(worker=worker.pid, runners=runners, members=members, subreaper=is_subreaper)
    pidfds: dict[int, int] = {}
    for pid in [worker.pid, *(p for pids in members.values() for p in pids)]:
        fd = open_pidfd(pid)
        if fd is not None:
            pidfds[fd] = pid
    if kill_delay > 0:
        time.sleep(kill_delay)
    began = time.monotonic()
    os.kill(worker.pid, signal.SIGKILL)
    exited: dict[int, float] = {}
    try:
        for pid in iter_exits(pidfds, timeout):
            exited[pid] = (time.monotonic() - began) * 1000
    finally:
        for fd in pidfds:
            os.close(fd)
        worker.wait()
    for runner, pids in members.items():
        if runner in exited:
            result.runner_exit_ms[runner] = exited[runner]
        if all(pid in exited for pid in pids):
            result.group_exit_ms[runner] = max(exited[pid] for pid in pids)
    result.worker_exit_ms = exited.pop(worker.pid, None)
    result.survivors = sorted(pid for pid in pidfds.values() if pid not in exited and pid != worker.pid)
    for pid in exited:  # under the subreaper the exited processes are our zombies now
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.node.drill", description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("worker", "trial"))
    parser.add_argument("--states", default="idle")
    parser.add_argument("--helpers", type=int, default=0)
    parser.add_argument("--helper-kind", default="exec", help=f"one of {', '.join(HELPER_KINDS)} or a comma list")
    parser.add_argument("--layers", default=",".join(lifeline.LAYERS), help="comma-separated; empty for none")
    parser.add_argument("--poll-interval", type=float, default=lifeline.DEFAULT_POLL_INTERVAL)
    parser.add_argument("--disable-watchdog", action="store_true", help=f"set {DISABLE_ORPHAN_WATCHDOG}=1 (trial)")
    parser.add_argument("--no-subreaper", action="store_true", help="let orphans go to init (trial)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for every exit (trial)")
    parser.add_argument("--keep-survivors", action="store_true", help="leave survivors alive (trial)")
    args = parser.parse_args(argv)
    if args.mode == "worker":
        anyio.run(_worker, args)
        return 0
    result = run_trial(
        args.states.split(","),
        helpers=args.helpers,
        helper_kind=args.helper_kind,
        layers=tuple(filter(None, args.layers.split(","))),
        poll_interval=args.poll_interval,
        disable_watchdog=args.disable_watchdog,
        subreaper=not args.no_subreaper,
        timeout=args.timeout,
    )
    if not args.keep_survivors:
        result.kill_survivors()
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
