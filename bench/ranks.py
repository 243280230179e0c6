"""Multi-rank instances: how fast a rank's death fails the request and stops every rank, how fast the same-ported
replacement is ready; and the seed's case (the worker SIGKILLed, a new worker starts the same instance on the same
ports) the naive way, where orphaned ranks keep their ports and the new instance crash-loops, against tether.

Everything runs on this machine, on the debug engine's ring mode (``tether.engines.debug``): every token goes round a
TCP ring of the ranks, so a dead rank breaks the others for real and a held port fails a load for real. Ranks are
real runner processes (each with its group guard, a forked child in the runner's process group). Every port is
pinned below the ephemeral range (``RankPorts(base=...)``, free when picked), so no outgoing connection takes one.
Runner records and logs go to a private temporary directory (``benchstats.private_tether_dirs``).

**1. A rank's death** (``--rounds`` rounds, default 20, ``--quick`` 2; in process: a ``Fleet`` in this process is
the worker, for precise timing). One instance, ``ranks: 2``, options ``RING_OPTIONS`` (``token_seconds`` 0.01), its
ports pinned, restart policy ``rank_policy()``: a constant backoff (``initial_backoff`` = ``max_backoff`` =
``BACKOFF`` s, ``factor`` 1, no jitter) and a crash-loop limit the rounds cannot reach, so every round's replacement
waits the same ``BACKOFF`` (it is inside ``replacement_ready``). Per round: every process of each rank's group
(runner and guard) is pinned with a pidfd; a generation (``max_tokens`` 2000: 20 s) streams its first chunk; a
thread blocks in ``poll`` on the pidfds (no polling loop) and stamps each exit; then rank 1's runner gets SIGKILL
from outside (``os.kill``) at ``t0``. From ``t0``:

- ``request_failed``: the request's terminal status, which must be FAILED with a cause of ``rank == 1`` and signal
  SIGKILL (checked every round);
- ``ranks_gone``: the last of the two runners' exits (rank 0 included, which tether stops);
  ``groups_gone``: the last exit of every process of both ranks' groups (the guards too);
- ``rank_fail_all``: the later of ``request_failed`` and ``ranks_gone``: the user has the cause and nothing of the
  failed life runs;
- ``replacement_ready``: the instance Ready again with two new runner pids (backoff, the old ranks confirmed gone,
  spawn, load, the ring formed in warm-up). Checked: the replacement's peers (host:port per rank) equal the old
  ones (``same_ports``), each new runner started after the last old process exited (start time from
  ``/proc/PID/stat`` against the exit stamps, both on CLOCK_BOOTTIME, to a clock tick), and it serves a request.

**2. The seed's case** (``tether serve`` children, ``tether.chaos.target.ServeChild``; ``--engine debug``, so each
also loads its boot instance, deleted once ready). The same ``ring`` instance body every time (``ranks: 2``, the
same pinned ``ports``, no restart override: the default ``RestartPolicy``, 5 failures in 300 s; ``--quick`` uses
``QUICK_BASELINE_RESTART``, 3 failures, backoff 0.1-0.2 s, as tests/test_ranks.py does).

- Baseline, the naive way: orphan protection off (``TETHER_DISABLE_ORPHAN_WATCHDOG=1``) and ``--no-reap``. Worker 1
  serves ``ring``; it gets SIGKILL; its ranks survive (``baseline_orphans``: processes of worker 1's runners alive
  after its death, guards included; ``baseline_orphan_ranks``: rank runners among them; rank 1 is checked to hold
  its port's listening socket on /proc). Worker 2 starts (at ``t1``) and POSTs ``ring`` at once: it never becomes
  ready and crash-loops until the limit. ``baseline_failed_after_ms``: ``t1`` -> state ``failed`` (from POST:
  ``baseline_failed_after_post_ms``), ``baseline_lives``: the lives it burned (its failure history), each cause
  checked to say "Address already in use", its reason "crash loop"; ``baseline_crash_loop`` is true only if all
  that happened. Then worker 2 is stopped and the orphans are SIGKILLed (awaited on pidfds).
- tether (orphan protection on, reaping on, the defaults): a worker serves ``ring``; then ``--worker-rounds``
  times (default 3, ``--quick`` 1): its ring's processes are pinned, the worker gets SIGKILL at ``t0``:
  ``tether_ranks_gone_ms`` = ``t0`` -> the last of them exited (pidfds); ``orphans`` = those still alive on /proc
  after that wait (bounded, ``GONE_BOUND``): must be 0. A new worker starts at ``t1`` and POSTs ``ring`` at once:
  ``tether_new_worker_ready_ms`` = ``t1`` -> ``ring`` ready (median over the rounds; from POST:
  ``tether_post_ready_ms``), its ranks' addresses must be the pinned ports, a chat request to it must answer 200,
  and it must have needed no restart. The new worker is the one killed in the next round.

``baseline_over_tether``: ``baseline_failed_after_ms`` / ``tether_new_worker_ready_ms``: from the same start, the
naive worker reaches a verdict (failed, for good) that many times later than tether's instance serves.

Waits on a ``tether serve`` child's state poll its API every 20 ms (``POLL``): it has no push channel; those figures
are to within that. Statistics: p50/p99 = ``statistics.quantiles(n=100, method="inclusive")``
(``benchstats.percentile``; with 20 samples p99 is close to the max, also reported). ``ok``: every check held and no
error (exit 1 otherwise). At the end every runner of every worker the bench ran (this process included) must be gone
(``leftover_processes``; SIGKILLed if not).

``tether_errors_logged`` (not a check): the error logs of tether itself going wrong in this process (other than
the rank failures caused on purpose, whose logs and tracebacks stay off stderr unless ``--log``); with ``--log`` the
``tether serve`` children run with ``-v`` and their stderr lines matching ``WORKER_TROUBLE`` count too (without
``-v`` a worker logs nothing but its own ``tether:`` lines).

Run: ``.venv/bin/python bench/ranks.py [--quick] [--rounds N] [--worker-rounds N] [--log]``. Progress goes to
stderr; the last line printed on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import msgspec

from benchstats import PERCENTILE, BenchFailed, describe, emit, fmt, ms, percentile, print_rows, private_tether_dirs
from tether import env
from tether.chaos.target import ServeChild, runner_processes
from tether.fleet.fleet import Fleet, InstanceConfig
from tether.kernel.pids import alive, group_members, holds_listener, iter_exits, open_pidfd, proc_stat
from tether.kernel.ports import RankPorts
from tether.node.hangs import Deadlines
from tether.node.instance import Instance, InstanceReady, RestartPolicy
from tether.node.ranks import RankGroup
from tether.node.settings import SupervisorSettings
from tether.protocol import CauseKind, ChatMessage, Chunk, GenerateParams, TaskState

ROUNDS = 20
QUICK_ROUNDS = 2
QUICK_SPLIT_ROUNDS = 1
QUICK_HEARTBEAT = 1.5  # --quick: the frozen rank found sooner (the default 5 s is the published run's)
WORKER_ROUNDS = 3
QUICK_WORKER_ROUNDS = 1
RING_OPTIONS: dict[str, Any] = {"token_seconds": 0.01}
STREAM_TOKENS = 2000  # 20 s at 0.01 s a token: still streaming at the kill
RING_STREAM = GenerateParams(prompt="tell me about rings", max_tokens=STREAM_TOKENS)
RING_AGAIN = GenerateParams(prompt="again", max_tokens=5)
SPLIT_OPTIONS: dict[str, Any] = {"n_ctx": 1024, "parallel": 2, "n_threads": 1}  # 2 runners, each 1 thread, 2 cores
SPLIT_STORY = GenerateParams(
    messages=(ChatMessage("user", "Tell me a long story about a lighthouse keeper and a storm."),),
    max_tokens=200,
    temperature=0.0,
)
QUICK_SPLIT_STORY = msgspec.structs.replace(SPLIT_STORY, max_tokens=32)  # --quick: the speed round's texts, shorter
SPLIT_STREAM = msgspec.structs.replace(SPLIT_STORY, max_tokens=800)  # still streaming at the kill
SPLIT_AGAIN = msgspec.structs.replace(SPLIT_STORY, max_tokens=8)
SPEED_ROUNDS = 5
FROZEN_ROUNDS = 3
BACKOFF = 0.1  # seconds: section 1's constant restart delay
STOP_TIMEOUT = 10.0  # each rank's (and each worker's) stop bound
READY_TIMEOUT = 60.0  # an instance ready (spawn, load, ring) on two busy cores
ROUND_BOUND = 90.0  # one section-1 round, start to end
GONE_BOUND = 15.0  # processes gone after a kill
STARTUP = 60.0  # a tether serve child listening
HTTP_TIMEOUT = 30.0
CRASH_LOOP_BOUND = 180.0  # the baseline's new instance failed for good (default policy: about 7.5 s of backoff)
POLL = 0.02  # seconds between two looks at a tether serve child's API
PORT_BASE = 27000  # + pid % 3000: below the ephemeral range (32768+) with RankPorts' span
QUICK_BASELINE_RESTART: dict[str, Any] = {
    "initial_backoff": 0.1,
    "max_backoff": 0.2,
    "jitter": 0.0,
    "crash_loop_failures": 3,
}
IN_USE = "Address already in use"


def say(message: str) -> None:
    print(f"ranks bench: {message}", file=sys.stderr, flush=True)


class UnexpectedLogs(logging.Handler):
    """Collects tether's error logs other than the failures the bench causes on purpose (a rank's, its group's:
    "<runner> failed: <cause>"), one line each; and, unless ``--log``, keeps every record off stderr, where the
    deliberate failures' tracebacks would bury the table."""

    EXPECTED = frozenset({"tether.node.supervisor", "tether.node.ranks"})

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name in self.EXPECTED and record.msg in DELIBERATE:
            return
        line = record.getMessage().splitlines()[0]
        if record.exc_info and record.exc_info[1] is not None:
            line += f": {describe(record.exc_info[1])}"
        self.lines.append(f"in process: {record.name}: {line}"[:300])


DELIBERATE = frozenset({"%s failed: %s", "%s; asking for its stacks (%s) before killing it"})  # faults caused here
WORKER_TROUBLE = ("ended with an error", "did not stop within", "survived SIGKILL", "Attempted to exit a cancel scope")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def boottime() -> float:
    """CLOCK_BOOTTIME, the clock of a process's start time in /proc/PID/stat."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def free_ports(pool: RankPorts, name: str, n: int) -> list[int]:
    """``n`` ports nothing listens on now, below the ephemeral range."""
    return list(pool.allocate(name, n))


def rank_processes(runner_pids: Iterable[int]) -> set[int]:
    """Each rank's runner and every live process of its group (its guard): the runner leads its own group."""
    found: set[int] = set()
    for pid in runner_pids:
        found.add(pid)
        found.update(group_members(pid))
    return found


# --------------------------------------------------------------------------------------------------------------
# Exits, awaited on pidfds
# --------------------------------------------------------------------------------------------------------------


class ExitWatch:
    """Pins processes with pidfds now, then (``start``) stamps each one's exit from a thread blocked in ``poll`` on
    them: no polling loop, and a pid reused meanwhile can never be mistaken for ours."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.fds: dict[int, int] = {}
        self.unpinned: list[int] = []  # already gone (or no pidfds): nothing to wait for, noted by the caller
        for pid in sorted(set(pids)):
            fd = open_pidfd(pid)
            if fd is None:
                self.unpinned.append(pid)
            else:
                self.fds[fd] = pid
        self.exited: dict[int, float] = {}  # pid -> time.monotonic() at its exit
        self.exited_boot: dict[int, float] = {}  # pid -> CLOCK_BOOTTIME at its exit
        self._thread: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        return sorted(self.fds.values())

    def start(self, bound: float) -> ExitWatch:
        def run() -> None:
            for pid in iter_exits(self.fds, bound):
                self.exited[pid] = time.monotonic()
                self.exited_boot[pid] = boottime()

        self._thread = threading.Thread(target=run, name="exit-watch", daemon=True)
        self._thread.start()
        return self

    def join(self) -> None:
        assert self._thread is not None
        self._thread.join()

    def last(self, pids: Iterable[int] | None = None) -> float | None:
        """When the last of ``pids`` (default: every pinned one) exited; None when one has not."""
        wanted = self.pids if pids is None else list(pids)
        if any(pid not in self.exited for pid in wanted):
            return None
        return max((self.exited[pid] for pid in wanted), default=None)

    def left(self) -> list[int]:
        """Pinned processes that did not exit within the bound (alive on /proc still)."""
        return [pid for pid in self.pids if pid not in self.exited and alive(pid)]

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = {}


def kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def kill_and_await(pids: Iterable[int], bound: float = GONE_BOUND) -> list[int]:
    """SIGKILL ``pids`` (pinned first) and await their exits on pidfds; those still alive after ``bound``."""
    watch = ExitWatch(pids)
    try:
        watch.start(bound)
        kill_all(watch.pids)
        watch.join()
        return watch.left()
    finally:
        watch.close()


# --------------------------------------------------------------------------------------------------------------
# 1. A rank's death, in process
# --------------------------------------------------------------------------------------------------------------


@dataclass
class RankRound:
    """One SIGKILL of rank 1: ms from the kill, and what was checked."""

    request_failed_ms: float | None = None
    ranks_gone_ms: float | None = None
    groups_gone_ms: float | None = None
    replacement_ready_ms: float | None = None
    cause_ok: bool = False
    cause: str = ""
    same_ports: bool = False
    started_after_gone: bool = False
    serves: bool = False
    left: list[int] = field(default_factory=list)  # processes of the failed life alive after GONE_BOUND

    @property
    def fail_all_ms(self) -> float | None:
        if self.request_failed_ms is None or self.ranks_gone_ms is None:
            return None
        return max(self.request_failed_ms, self.ranks_gone_ms)


def rank_policy(rounds: int) -> RestartPolicy:
    """A constant ``BACKOFF`` and a crash-loop limit the rounds cannot reach (see the module docstring)."""
    return RestartPolicy(
        initial_backoff=BACKOFF,
        max_backoff=BACKOFF,
        factor=1.0,
        jitter=0.0,
        crash_loop_failures=rounds + 10,
        crash_loop_window=3600.0,
    )


def group_of(inst: Instance) -> RankGroup:
    sup = inst.supervisor
    if not isinstance(sup, RankGroup) or any(m.pid is None for m in sup.members):
        raise BenchFailed(f"the instance's life is no running rank group: {sup!r}")
    return sup


def member_pids(group: RankGroup) -> list[int]:
    return [m.pid for m in group.members if m.pid is not None]


async def ready_group(inst: Instance, old: set[int], timeout: float) -> RankGroup:
    """Wait for a Ready life whose ranks are all new (none in ``old``)."""

    def fresh(state: Any) -> bool:
        sup = inst.supervisor
        return (
            isinstance(state, InstanceReady)
            and isinstance(sup, RankGroup)
            and all(m.pid is not None and m.pid not in old for m in sup.members)
        )

    await inst.wait_state(fresh, timeout)
    return group_of(inst)


def ring_serves(text: str) -> bool:
    return len(text.split()) == 5


async def rank_round(
    inst: Instance,
    stream: GenerateParams = RING_STREAM,
    again: GenerateParams = RING_AGAIN,
    serves: Callable[[str], bool] = ring_serves,
) -> RankRound:
    out = RankRound()
    group = group_of(inst)
    runners = member_pids(group)
    peers = group.peers
    watch = ExitWatch(rank_processes(runners))
    try:
        if watch.unpinned:
            raise BenchFailed(f"processes of the ranks gone before the kill: {watch.unpinned}")
        handle = await inst.generate(stream)
        async for event in handle:
            if isinstance(event, Chunk):
                break  # streaming
        if handle.final is not None:
            raise BenchFailed(f"the request ended before the kill: {handle.final}")
        watch.start(GONE_BOUND)
        t0 = time.monotonic()
        os.kill(runners[1], signal.SIGKILL)
        final = await handle.wait()
        out.request_failed_ms = (time.monotonic() - t0) * 1000.0
        cause = final.cause
        out.cause = cause.summary if cause is not None else f"no cause ({final.state.value}: {final.error})"
        out.cause_ok = (
            final.state is TaskState.FAILED and cause is not None and cause.rank == 1 and cause.signal == "SIGKILL"
        )
        await anyio.to_thread.run_sync(watch.join)
        out.left = watch.left()
        gone = watch.last(runners)
        out.ranks_gone_ms = None if gone is None else (gone - t0) * 1000.0
        every = watch.last()
        out.groups_gone_ms = None if every is None else (every - t0) * 1000.0
        new = await ready_group(inst, set(runners), READY_TIMEOUT)
        out.replacement_ready_ms = (time.monotonic() - t0) * 1000.0
        out.same_ports = new.peers == peers
        last_exit = max(watch.exited_boot.values(), default=None)
        starts = [s.started_since_boot for pid in member_pids(new) if (s := proc_stat(pid)) is not None]
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
        out.started_after_gone = (
            last_exit is not None and len(starts) == len(runners) and min(starts) >= last_exit - tick
        )
        text, done = await (await inst.generate(again)).text()
        out.serves = done.state is TaskState.COMPLETE and serves(text)
    finally:
        watch.close()
    return out


async def rank_rounds(rounds: int, ports: list[int], errors: list[str]) -> list[RankRound]:
    config = InstanceConfig(
        id="ring",
        engine="debug",
        ranks=2,
        ports=tuple(ports),
        options=RING_OPTIONS,
        restart=rank_policy(rounds),
    )
    async with Fleet(SupervisorSettings(stop_timeout=STOP_TIMEOUT)) as fleet:
        hosted = await fleet.add(config)
        inst = hosted.replicas[0]
        await inst.wait_ready(READY_TIMEOUT)
        say(f"section 1: ring of 2 ranks on ports {ports} ready (runners {member_pids(group_of(inst))})")
        return await kill_rounds(inst, rounds, errors, "ring")


async def kill_rounds(inst: Instance, rounds: int, errors: list[str], label: str, *how: Any) -> list[RankRound]:
    """``rounds`` of ``rank_round(inst, *how)``, each bounded; an error ends them (recorded in ``errors``)."""
    done: list[RankRound] = []
    for i in range(rounds):
        try:
            with anyio.fail_after(ROUND_BOUND):
                r = await rank_round(inst, *how)
        except Exception as exc:
            errors.append(f"{label} rank round {i}: {describe(exc)}")
            say(errors[-1])
            break
        done.append(r)
        say(
            f"{label} round {i}: request failed {fmt(r.request_failed_ms or float('nan'))} ms, ranks gone "
            f"{fmt(r.ranks_gone_ms or float('nan'))} ms (groups {fmt(r.groups_gone_ms or float('nan'))}), "
            f"replacement ready {fmt(r.replacement_ready_ms or float('nan'))} ms; cause ok {r.cause_ok}, "
            f"same ports {r.same_ports}, started after gone {r.started_after_gone}, serves {r.serves}"
        )
        if not r.cause_ok:
            say(f"  cause: {r.cause}")
    return done


# --------------------------------------------------------------------------------------------------------------
# 3. llama.cpp split over 2 ranks (ggml RPC), in process
# --------------------------------------------------------------------------------------------------------------


@dataclass
class SplitSide:
    texts_identical: bool = False
    local_tps: list[float] = field(default_factory=list)
    split_tps: list[float] = field(default_factory=list)
    kills: list[RankRound] = field(default_factory=list)
    frozen_failed_s: list[float] = field(default_factory=list)
    frozen_ok: bool = True  # every frozen round: FAILED with a hang of rank 1, every rank gone, replaced
    frozen_causes: list[str] = field(default_factory=list)


async def decode_rate(inst: Instance, params: GenerateParams) -> tuple[str, float]:
    """The text of one generation and its decode rate (tokens/s from the first chunk to the end)."""
    handle = await inst.generate(params)
    first: float | None = None
    tokens = 0
    parts: list[str] = []
    async for event in handle:
        if isinstance(event, Chunk):
            if first is None:
                first = time.monotonic()
            else:
                tokens += event.tokens
            parts.append(event.text)
    ended = time.monotonic()
    final = handle.final
    if final is None or final.state is not TaskState.COMPLETE or first is None:
        raise BenchFailed(f"a generation did not complete: {final}")
    return "".join(parts), tokens / max(ended - first, 1e-9)


async def frozen_round(inst: Instance) -> tuple[float, bool, str]:
    """SIGSTOP rank 1 mid-stream: seconds to the request's failure, whether it was a hang of rank 1 with every rank
    gone and a replacement ready, and the cause."""
    group = group_of(inst)
    runners = member_pids(group)
    handle = await inst.generate(SPLIT_STREAM)
    async for event in handle:
        if isinstance(event, Chunk):
            break
    t0 = time.monotonic()
    os.kill(runners[1], signal.SIGSTOP)
    final = await handle.wait()
    failed_s = time.monotonic() - t0
    cause = final.cause
    ok = final.state is TaskState.FAILED and cause is not None and cause.kind is CauseKind.HANG and cause.rank == 1
    left = kill_and_await([pid for pid in runners if alive(pid)])
    await ready_group(inst, set(runners), READY_TIMEOUT)
    return failed_s, ok and not left, cause.summary if cause is not None else str(final)


async def split_side(
    rounds: int, frozen: int, speed: int, ports: list[int], errors: list[str], heartbeat: float, story: GenerateParams
) -> SplitSide:
    out = SplitSide()
    config = InstanceConfig(
        id="split",
        engine="llama.cpp",
        ranks=2,
        ports=tuple(ports),
        options=SPLIT_OPTIONS,
        restart=rank_policy(rounds + frozen),
        deadlines=Deadlines(heartbeat=heartbeat),  # a frozen rank is found by its heartbeat deadline (default 5 s)
    )
    async with Fleet(SupervisorSettings(stop_timeout=STOP_TIMEOUT)) as fleet:
        local = await fleet.add(InstanceConfig(id="local", engine="llama.cpp", options=SPLIT_OPTIONS))
        hosted = await fleet.add(config)
        split = hosted.replicas[0]
        await local.replicas[0].wait_ready(READY_TIMEOUT)
        await split.wait_ready(READY_TIMEOUT)
        say(f"section 3: llama.cpp over 2 ranks on ports {ports} ready (runners {member_pids(group_of(split))})")
        texts: dict[str, set[str]] = {"local": set(), "split": set()}
        for i in range(speed):  # alternating, so drift hits both alike
            for name, inst, rates in (("local", local.replicas[0], out.local_tps), ("split", split, out.split_tps)):
                text, rate = await decode_rate(inst, story)
                texts[name].add(text)
                rates.append(rate)
            say(f"speed round {i}: local {out.local_tps[-1]:.1f} tokens/s, split {out.split_tps[-1]:.1f}")
        out.texts_identical = len(texts["local"]) == 1 and texts["local"] == texts["split"]
        await fleet.remove("local")
        out.kills = await kill_rounds(split, rounds, errors, "llama.cpp", SPLIT_STREAM, SPLIT_AGAIN, bool)
        for i in range(frozen):
            try:
                with anyio.fail_after(ROUND_BOUND):
                    failed_s, ok, cause = await frozen_round(split)
            except Exception as exc:
                errors.append(f"llama.cpp frozen round {i}: {describe(exc)}")
                say(errors[-1])
                out.frozen_ok = False
                break
            out.frozen_failed_s.append(failed_s)
            out.frozen_ok = out.frozen_ok and ok
            out.frozen_causes.append(cause)
            say(f"frozen round {i}: request failed {failed_s:.2f} s after rank 1's SIGSTOP; ok {ok}: {cause[:160]}")
    return out


# --------------------------------------------------------------------------------------------------------------
# 2. The seed's case, through tether serve children
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Seen:
    """Every worker the bench ran: their pids (this process's included: section 1's worker), and the servers."""

    pids: set[int] = field(default_factory=lambda: {os.getpid()})
    servers: list[Worker] = field(default_factory=list)
    verbose: bool = False  # ``--log``: the workers log (``tether -v``), so their own errors can be found

    def add(self, worker: Worker) -> Worker:
        self.pids.add(worker.pid)
        self.servers.append(worker)
        return worker


class Worker(ServeChild):
    """A ``tether serve --engine debug`` child with an HTTP client; ``started``: when it was spawned (monotonic)."""

    def __init__(self, *args: str, naive: bool, verbose: bool = False) -> None:
        environ = dict(os.environ)  # the private runtime and log directories included
        if naive:
            environ[env.DISABLE_ORPHAN_WATCHDOG] = "1"
        else:
            environ.pop(env.DISABLE_ORPHAN_WATCHDOG, None)
        self.started = time.monotonic()
        base = ("--engine", "debug", "--name", "boot", "--stop-timeout", str(STOP_TIMEOUT))
        super().__init__(*base, *args, env=environ, startup=STARTUP, verbose=verbose)
        self.http = httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT)
        deadline = time.monotonic() + STARTUP
        while True:  # it prints its address just before it listens
            try:
                self.http.get("/healthz")
                break
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    tail = " | ".join(self.drain()[-5:])
                    raise BenchFailed(f"tether serve pid {self.pid} never answered: {tail}") from None
                time.sleep(POLL)

    def view(self, instance_id: str) -> dict[str, Any]:
        response = self.http.get(f"/v1/instances/{instance_id}")
        if response.status_code != 200:
            raise BenchFailed(f"GET /v1/instances/{instance_id} -> {response.status_code}: {response.text[:300]}")
        data: dict[str, Any] = response.json()
        return data

    def post(self, body: dict[str, Any]) -> float:
        """``POST /v1/instances``; returns when it was sent (monotonic)."""
        sent = time.monotonic()
        response = self.http.post("/v1/instances", json=body)
        if response.status_code != 201:
            raise BenchFailed(f"POST /v1/instances -> {response.status_code}: {response.text[:300]}")
        return sent

    def await_view(self, instance_id: str, until: Callable[[dict[str, Any]], bool], bound: float) -> dict[str, Any]:
        """Look at the instance every ``POLL`` s until ``until(view)`` (bounded); the view, stamped ``seen_at``."""
        deadline = time.monotonic() + bound
        while True:
            view = self.view(instance_id)
            if until(view):
                view["seen_at"] = time.monotonic()
                return view
            if self.proc.poll() is not None:
                raise BenchFailed(f"tether serve exited ({self.proc.returncode}): {' | '.join(self.drain()[-5:])}")
            if time.monotonic() > deadline:
                raise BenchFailed(f"{instance_id} not as awaited within {bound:.0f} s: state {view['state']}")
            time.sleep(POLL)

    def drop_boot(self) -> None:
        """Delete the boot instance once it is ready, so only ``ring``'s runners are this worker's."""
        self.await_view("boot", lambda v: bool(v["ready"]), READY_TIMEOUT)
        response = self.http.delete("/v1/instances/boot", timeout=STOP_TIMEOUT + 30)
        if response.status_code >= 300:
            raise BenchFailed(f"DELETE /v1/instances/boot -> {response.status_code}: {response.text[:300]}")

    def chat(self) -> bool:
        body = {"model": "ring", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        return self.http.post("/v1/chat/completions", json=body).status_code == 200

    def rank_pids(self) -> list[int]:
        ranks = self.view("ring")["ranks"] or []
        return [int(r["pid"]) for r in ranks if r.get("pid")]

    def kill(self) -> None:
        """SIGKILL, then reap it (its own exit is the kernel's teardown)."""
        self.proc.kill()
        self.proc.wait(GONE_BOUND)
        self.http.close()

    def stop(self) -> int:
        """SIGTERM (bounded, then SIGKILL) and SIGKILL any runner of it left: how many were left."""
        _, left = self.stop_and_sweep(STOP_TIMEOUT, GONE_BOUND, POLL)
        self.http.close()
        return left

    def trouble(self) -> list[str]:
        """Its stderr lines so far that say tether itself went wrong (``WORKER_TROUBLE``), not a deliberate fault."""
        return [
            f"worker {self.pid}: {line.strip()}"[:300]
            for line in self.drain()
            if any(t in line for t in WORKER_TROUBLE)
        ]


def ring_body(ports: list[int], restart: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": "ring", "engine": "debug", "ranks": 2, "ports": ports, "options": RING_OPTIONS}
    if restart is not None:
        body["restart"] = restart
    return body


def split_body(ports: list[int], restart: dict[str, Any] | None) -> dict[str, Any]:
    """The llama.cpp side's instance: the default model over 2 ranks (its id is "ring" too: one set of helpers)."""
    return {**ring_body(ports, restart), "engine": "llama.cpp", "options": SPLIT_OPTIONS}


Body = Callable[[list[int], dict[str, Any] | None], dict[str, Any]]


def serving_worker(naive: bool, body: dict[str, Any], seen: Seen) -> tuple[Worker, float, float]:
    """A new worker POSTing ``ring`` at once, ready: (worker, start -> ready ms, POST -> ready ms)."""
    worker = seen.add(Worker(*(("--no-reap",) if naive else ()), naive=naive, verbose=seen.verbose))
    try:
        posted = worker.post(body)
        view = worker.await_view("ring", lambda v: bool(v["ready"]), READY_TIMEOUT)
    except BaseException:
        worker.stop()
        raise
    return worker, (view["seen_at"] - worker.started) * 1000.0, (view["seen_at"] - posted) * 1000.0


@dataclass
class Baseline:
    orphans: int = 0  # processes of worker 1's runners alive after its death (guards included)
    orphan_ranks: int = 0  # of which rank runners
    holds_port: bool = False  # the orphaned rank 1 listens on its port still
    lives: int = 0
    failed_after_ms: float | None = None  # new worker start -> failed
    failed_after_post_ms: float | None = None
    in_use_every_life: bool = False
    crash_loop_reason: bool = False
    reason: str = ""
    never_ready: bool = False
    orphans_left_after_kill: list[int] = field(default_factory=list)

    @property
    def crash_loop(self) -> bool:
        return (
            self.lives > 1
            and self.in_use_every_life
            and self.crash_loop_reason
            and self.never_ready
            and self.failed_after_ms is not None
        )


def baseline(ports: list[int], restart: dict[str, Any] | None, seen: Seen, body_of: Body = ring_body) -> Baseline:
    out = Baseline()
    body = body_of(ports, restart)
    first, _, _ = serving_worker(True, body, seen)
    orphans: list[int] = []
    try:
        ranks = first.rank_pids()
        first.drop_boot()
        first.kill()
        orphans = runner_processes({first.pid})
        out.orphans = len(orphans)
        out.orphan_ranks = sum(1 for pid in ranks if alive(pid))
        out.holds_port = len(ranks) == 2 and holds_listener(ranks[1], ports[1])
        say(
            f"baseline: worker {first.pid} SIGKILLed; {out.orphans} of its processes live on ({out.orphan_ranks} "
            f"ranks); rank 1 holds port {ports[1]}: {out.holds_port}"
        )
        second = seen.add(Worker("--no-reap", naive=True, verbose=seen.verbose))
        try:
            posted = second.post(body)
            ever_ready = False

            def failed(view: dict[str, Any]) -> bool:
                nonlocal ever_ready
                ever_ready = ever_ready or bool(view["ready"])
                return bool(view["state"] == "failed")

            view = second.await_view("ring", failed, CRASH_LOOP_BOUND)
            out.failed_after_ms = (view["seen_at"] - second.started) * 1000.0
            out.failed_after_post_ms = (view["seen_at"] - posted) * 1000.0
            history = view["history"]
            out.lives = len(history)
            out.in_use_every_life = bool(history) and all(IN_USE in h["cause"]["summary"] for h in history)
            out.reason = str((view.get("detail") or {}).get("reason", ""))
            out.crash_loop_reason = "crash loop" in out.reason
            out.never_ready = not ever_ready and view["restarts"] == len(history) - 1
            say(
                f"baseline: worker {second.pid}'s ring failed after {fmt(out.failed_after_ms)} ms ({out.lives} "
                f"lives, 'Address already in use' in each: {out.in_use_every_life}): {out.reason}"
            )
        finally:
            second.stop()
    finally:
        if first.proc.poll() is None:  # a step before its kill failed: the naive worker's runners outlive it
            first.kill()
        out.orphans_left_after_kill = kill_and_await(orphans or runner_processes({first.pid}))
    return out


@dataclass
class TetherSide:
    ranks_gone_ms: list[float] = field(default_factory=list)  # worker SIGKILL -> every ring process exited
    worker_exit_ms: list[float] = field(default_factory=list)  # the worker's own exit (kernel teardown)
    new_worker_ready_ms: list[float] = field(default_factory=list)  # new worker start -> ring ready
    post_ready_ms: list[float] = field(default_factory=list)
    first_ready_ms: float | None = None
    orphans: int = 0  # ring processes alive after their worker's death (and GONE_BOUND)
    processes: int = 0  # ring processes watched at the kills
    rounds: int = 0
    same_ports: bool = True
    chats_ok: bool = True
    no_restarts: bool = True


def tether_side(
    ports: list[int], restart: dict[str, Any] | None, rounds: int, seen: Seen, body_of: Body = ring_body
) -> TetherSide:
    out = TetherSide()
    body = body_of(ports, restart)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    worker, out.first_ready_ms, _ = serving_worker(False, body, seen)
    try:
        for i in range(rounds):
            worker.drop_boot()
            watch = ExitWatch([worker.pid, *rank_processes(worker.rank_pids())])
            try:
                ring = [pid for pid in watch.pids if pid != worker.pid]
                if len(ring) < 2 or watch.unpinned:
                    raise BenchFailed(f"round {i}: ring processes {ring}, gone before the kill: {watch.unpinned}")
                out.processes += len(ring)
                watch.start(GONE_BOUND)
                t0 = time.monotonic()
                worker.kill()
                watch.join()
                left = [pid for pid in ring if alive(pid)]
                out.orphans += len(left)
                kill_all(left)
                gone = watch.last(ring)
                if gone is not None:
                    out.ranks_gone_ms.append((gone - t0) * 1000.0)
                if (w := watch.exited.get(worker.pid)) is not None:
                    out.worker_exit_ms.append((w - t0) * 1000.0)
            finally:
                watch.close()
            worker, ready_ms, post_ms = serving_worker(False, body, seen)
            out.new_worker_ready_ms.append(ready_ms)
            out.post_ready_ms.append(post_ms)
            view = worker.view("ring")
            out.same_ports = out.same_ports and [r["address"] for r in view["ranks"] or []] == addresses
            out.no_restarts = out.no_restarts and view["restarts"] == 0
            out.chats_ok = out.chats_ok and worker.chat()
            out.rounds += 1
            say(
                f"tether round {i}: ring processes gone {fmt(out.ranks_gone_ms[-1] if gone else float('nan'))} ms "
                f"after the worker's SIGKILL ({len(left)} left); new worker {worker.pid}'s ring ready "
                f"{fmt(ready_ms)} ms after its start ({fmt(post_ms)} after the POST)"
            )
    finally:
        worker.stop()
    return out


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 2 rank rounds (llama.cpp: 1), 1 worker round, a frozen rank found at 1.5 s, one speed "
        "round of 32 tokens",
    )
    parser.add_argument("--rounds", type=int, default=None, help=f"rank SIGKILL rounds (default {ROUNDS})")
    parser.add_argument(
        "--log",
        action="store_true",
        help="let the in-process worker log to stderr, and run the tether serve children with -v (their error logs "
        "go into tether_errors_logged; their access logs cost the API polls a little)",
    )
    parser.add_argument(
        "--worker-rounds", type=int, default=None, help=f"tether worker SIGKILL rounds (default {WORKER_ROUNDS})"
    )
    parser.add_argument(
        "--sides",
        default="ring,llamacpp",
        help="which engines to run: ring (the debug ring), llamacpp (the default model over 2 ranks), or both",
    )
    parser.add_argument("--split-rounds", type=int, default=None, help="llama.cpp rank SIGKILL rounds (default 10)")
    args = parser.parse_args(argv)
    sides = set(args.sides.split(","))
    split_rounds = args.split_rounds or (QUICK_SPLIT_ROUNDS if args.quick else 10)
    frozen_rounds = 1 if args.quick else FROZEN_ROUNDS
    speed_rounds = 1 if args.quick else SPEED_ROUNDS
    heartbeat = QUICK_HEARTBEAT if args.quick else Deadlines().heartbeat
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    worker_rounds = args.worker_rounds or (QUICK_WORKER_ROUNDS if args.quick else WORKER_ROUNDS)
    baseline_restart = QUICK_BASELINE_RESTART if args.quick else None
    pool = RankPorts(base=PORT_BASE + os.getpid() % 3000)
    errors: list[str] = []
    seen = Seen(verbose=args.log)
    logs = UnexpectedLogs()
    tether_log = logging.getLogger("tether")
    tether_log.addHandler(logs)
    if args.log:
        tether_log.addHandler(logging.StreamHandler())  # everything, as tether logs it without a bench
    rank_results: list[RankRound] = []
    base = Baseline()
    side = TetherSide()
    leftover: list[int] = []
    began = time.monotonic()
    split = SplitSide()
    split_base = Baseline()
    split_tether = TetherSide()
    with private_tether_dirs("tether-bench-ranks-"):
        if "ring" in sides:
            try:
                rank_results = anyio.run(rank_rounds, rounds, free_ports(pool, "in-process", 2), errors)
            except Exception as exc:
                errors.append(f"section 1: {describe(exc)}")
                say(errors[-1])
            seed_ports = free_ports(pool, "seed", 2)
            say(f"section 2: ring on ports {seed_ports}")
            try:
                base = baseline(seed_ports, baseline_restart, seen)
            except Exception as exc:
                errors.append(f"baseline: {describe(exc)}")
                say(errors[-1])
            try:
                side = tether_side(seed_ports, baseline_restart, worker_rounds, seen)
            except Exception as exc:
                errors.append(f"tether side: {describe(exc)}")
                say(errors[-1])
        if "llamacpp" in sides:
            try:
                split = anyio.run(
                    split_side,
                    split_rounds,
                    frozen_rounds,
                    speed_rounds,
                    free_ports(pool, "split", 2),
                    errors,
                    heartbeat,
                    QUICK_SPLIT_STORY if args.quick else SPLIT_STORY,
                )
            except Exception as exc:
                errors.append(f"section 3: {describe(exc)}")
                say(errors[-1])
            seed_ports = free_ports(pool, "split seed", 2)
            say(f"section 3, the seed's case: the default model over 2 ranks on ports {seed_ports}")
            try:
                split_base = baseline(seed_ports, baseline_restart, seen, split_body)
            except Exception as exc:
                errors.append(f"llama.cpp baseline: {describe(exc)}")
                say(errors[-1])
            try:
                split_tether = tether_side(seed_ports, baseline_restart, worker_rounds, seen, split_body)
            except Exception as exc:
                errors.append(f"llama.cpp tether side: {describe(exc)}")
                say(errors[-1])
        deadline = time.monotonic() + 5.0
        while (leftover := runner_processes(seen.pids)) and time.monotonic() < deadline:
            time.sleep(POLL)
        if leftover:
            say(f"leftover runner processes: {leftover}")
            kill_all(leftover)
    trouble = logs.lines + [line for server in seen.servers for line in server.trouble()]
    for line in trouble:
        say(f"tether logged: {line}")

    request_failed = [x for r in rank_results if (x := r.request_failed_ms) is not None]
    ranks_gone = [x for r in rank_results if (x := r.ranks_gone_ms) is not None]
    groups_gone = [x for r in rank_results if (x := r.groups_gone_ms) is not None]
    fail_all = [x for r in rank_results if (x := r.fail_all_ms) is not None]
    replacement = [x for r in rank_results if (x := r.replacement_ready_ms) is not None]
    same_ports = bool(rank_results) and all(r.same_ports for r in rank_results) and side.same_ports
    tether_ready = median(side.new_worker_ready_ms)
    ring_checks = {
        "every_round_ran": len(rank_results) == rounds,
        "cause_is_rank_1_sigkill": bool(rank_results) and all(r.cause_ok for r in rank_results),
        "every_rank_gone": bool(rank_results) and all(not r.left and r.groups_gone_ms for r in rank_results),
        "replacement_after_every_rank_gone": bool(rank_results) and all(r.started_after_gone for r in rank_results),
        "replacement_same_ports": bool(rank_results) and all(r.same_ports for r in rank_results),
        "replacement_serves": bool(rank_results) and all(r.serves for r in rank_results),
        "baseline_orphans_hold_the_port": base.orphan_ranks == 2 and base.holds_port,
        "baseline_crash_loop": base.crash_loop,
        "baseline_orphans_killed": base.orphans > 0 and not base.orphans_left_after_kill,
        "every_worker_round_ran": side.rounds == worker_rounds,
        "tether_ranks_gone_with_their_worker": side.rounds > 0 and len(side.ranks_gone_ms) == side.rounds,
        "tether_no_orphans": side.rounds > 0 and side.orphans == 0,
        "tether_same_ports": side.rounds > 0 and side.same_ports,
        "tether_new_worker_serves": side.rounds > 0 and side.chats_ok and side.no_restarts,
    }
    kills = split.kills
    split_fail_all = [x for r in kills if (x := r.fail_all_ms) is not None]
    split_replacement = [x for r in kills if (x := r.replacement_ready_ms) is not None]
    split_ratio = median(split.split_tps) / median(split.local_tps) if split.local_tps and split.split_tps else None
    split_checks = {
        "llamacpp_texts_identical": split.texts_identical,
        "llamacpp_every_round_ran": len(kills) == split_rounds,
        "llamacpp_cause_is_rank_1_sigkill": bool(kills) and all(r.cause_ok for r in kills),
        "llamacpp_every_rank_gone": bool(kills) and all(not r.left and r.groups_gone_ms for r in kills),
        "llamacpp_replacement_after_every_rank_gone": bool(kills) and all(r.started_after_gone for r in kills),
        "llamacpp_replacement_same_ports": bool(kills) and all(r.same_ports for r in kills),
        "llamacpp_replacement_serves": bool(kills) and all(r.serves for r in kills),
        "llamacpp_frozen_is_a_hang_of_rank_1": len(split.frozen_failed_s) == frozen_rounds and split.frozen_ok,
        "llamacpp_baseline_crash_loop": split_base.crash_loop,
        "llamacpp_baseline_orphans_killed": split_base.orphans > 0 and not split_base.orphans_left_after_kill,
        "llamacpp_tether_no_orphans": split_tether.rounds == worker_rounds and split_tether.orphans == 0,
        "llamacpp_tether_new_worker_serves": split_tether.rounds > 0
        and split_tether.chats_ok
        and split_tether.no_restarts
        and split_tether.same_ports,
    }
    checks = {
        **(ring_checks if "ring" in sides else {}),
        **(split_checks if "llamacpp" in sides else {}),
        "nothing_left": not leftover,
    }
    result: dict[str, Any] = {
        "bench": "ranks",
        "quick": bool(args.quick),
        "rounds": rounds,
        "worker_rounds": worker_rounds,
        "rank_fail_all_p50_ms": ms(percentile(fail_all, 50)),
        "rank_fail_all_p99_ms": ms(percentile(fail_all, 99)),
        "rank_fail_all_max_ms": ms(max(fail_all, default=float("nan"))),
        "request_failed_p50_ms": ms(percentile(request_failed, 50)),
        "request_failed_p99_ms": ms(percentile(request_failed, 99)),
        "ranks_gone_p50_ms": ms(percentile(ranks_gone, 50)),
        "ranks_gone_p99_ms": ms(percentile(ranks_gone, 99)),
        "groups_gone_p50_ms": ms(percentile(groups_gone, 50)),
        "groups_gone_p99_ms": ms(percentile(groups_gone, 99)),
        "replacement_ready_p50_ms": ms(percentile(replacement, 50)),
        "replacement_ready_p99_ms": ms(percentile(replacement, 99)),
        "replacement_ready_max_ms": ms(max(replacement, default=float("nan"))),
        "replacement_backoff_s": BACKOFF,
        "same_ports": same_ports,
        "baseline_crash_loop": base.crash_loop,
        "baseline_lives": base.lives,
        "baseline_failed_after_ms": ms(base.failed_after_ms if base.failed_after_ms is not None else float("nan")),
        "baseline_failed_after_post_ms": ms(
            base.failed_after_post_ms if base.failed_after_post_ms is not None else float("nan")
        ),
        "baseline_reason": base.reason,
        "baseline_restart": baseline_restart if baseline_restart is not None else "default RestartPolicy",
        "baseline_orphans": base.orphans,
        "baseline_orphan_ranks": base.orphan_ranks,
        "tether_new_worker_ready_ms": ms(tether_ready),
        "tether_new_worker_ready_max_ms": ms(max(side.new_worker_ready_ms, default=float("nan"))),
        "tether_post_ready_ms": ms(median(side.post_ready_ms)),
        "tether_first_worker_ready_ms": ms(side.first_ready_ms if side.first_ready_ms is not None else float("nan")),
        "tether_ranks_gone_ms": ms(median(side.ranks_gone_ms)),
        "tether_ranks_gone_max_ms": ms(max(side.ranks_gone_ms, default=float("nan"))),
        "tether_worker_exit_ms": ms(median(side.worker_exit_ms)),
        "tether_ring_processes_watched": side.processes,
        "baseline_over_tether": (
            round(base.failed_after_ms / tether_ready, 2)
            if base.failed_after_ms is not None and tether_ready == tether_ready and tether_ready > 0
            else None
        ),
        "orphans": side.orphans,
        "llamacpp_texts_identical": split.texts_identical,
        "llamacpp_speed_tokens": (QUICK_SPLIT_STORY if args.quick else SPLIT_STORY).max_tokens,
        "llamacpp_split_tokens_per_s_ratio": round(split_ratio, 3) if split_ratio is not None else None,
        "llamacpp_local_tokens_per_s": round(median(split.local_tps), 1),
        "llamacpp_split_tokens_per_s": round(median(split.split_tps), 1),
        "llamacpp_rounds": len(kills),
        "llamacpp_rank_fail_all_p50_ms": ms(percentile(split_fail_all, 50)),
        "llamacpp_rank_fail_all_p99_ms": ms(percentile(split_fail_all, 99)),
        "llamacpp_request_failed_p50_ms": ms(percentile([x for r in kills if (x := r.request_failed_ms)], 50)),
        "llamacpp_frozen_peer_failed_s": round(median(split.frozen_failed_s), 2),
        "llamacpp_frozen_peer_failed_max_s": round(max(split.frozen_failed_s, default=float("nan")), 2),
        "llamacpp_frozen_heartbeat_deadline_s": heartbeat,
        "llamacpp_replacement_ready_p50_ms": ms(percentile(split_replacement, 50)),
        "llamacpp_replacement_ready_p99_ms": ms(percentile(split_replacement, 99)),
        "llamacpp_baseline_crash_loop": split_base.crash_loop,
        "llamacpp_baseline_lives": split_base.lives,
        "llamacpp_baseline_orphan_ranks": split_base.orphan_ranks,
        "llamacpp_baseline_failed_after_ms": ms(
            split_base.failed_after_ms if split_base.failed_after_ms is not None else float("nan")
        ),
        "llamacpp_tether_ranks_gone_ms": ms(median(split_tether.ranks_gone_ms)),
        "llamacpp_tether_new_worker_ready_ms": ms(median(split_tether.new_worker_ready_ms)),
        "llamacpp_orphans": split_tether.orphans,
        "leftover_processes": len(leftover),
        "tether_errors_logged": trouble,  # not a check: what tether logged going wrong itself (see the report)
        "percentile": PERCENTILE,
        "wall_s": round(time.monotonic() - began, 1),
        "checks": checks,
        "errors": errors,
        "ok": all(checks.values()) and not errors,
    }

    def row(name: str, samples: list[float]) -> list[str]:
        return [
            name,
            str(len(samples)),
            fmt(percentile(samples, 50)),
            fmt(percentile(samples, 99)),
            fmt(max(samples, default=float("nan"))),
        ]

    if "ring" in sides:
        print(
            f"1. SIGKILL of rank 1 of a 2-rank debug ring, mid-stream ({len(rank_results)} rounds; backoff {BACKOFF} s)"
        )
        print_rows(
            ["ms from the kill", "n", "p50", "p99", "max"],
            [
                row("request FAILED (rank 1, SIGKILL)", request_failed),
                row("every rank's runner gone", ranks_gone),
                row("every rank's process group gone", groups_gone),
                row("rank_fail_all (later of the two)", fail_all),
                row("replacement ready (same ports)", replacement),
            ],
        )
        print()
        print(
            f"2. the worker SIGKILLed, a new worker, the same instance and ports ({side.rounds} tether rounds, medians)"
        )
        print_rows(
            ["", "baseline (no orphan protection)", "tether"],
            [
                ["ranks alive after the worker's death", str(base.orphan_ranks), str(side.orphans)],
                ["processes left (guards included)", str(base.orphans), str(side.orphans)],
                ["ranks gone after the worker's SIGKILL, ms", "never", fmt(median(side.ranks_gone_ms))],
                [
                    "new worker's instance",
                    f"failed: crash loop, {base.lives} lives" if base.crash_loop else "not a crash loop",
                    "ready" if side.new_worker_ready_ms else "-",
                ],
                [
                    "  ms from the new worker's start",
                    fmt(base.failed_after_ms if base.failed_after_ms is not None else float("nan")),
                    fmt(tether_ready),
                ],
                [
                    "  ms from its POST",
                    fmt(base.failed_after_post_ms if base.failed_after_post_ms is not None else float("nan")),
                    fmt(median(side.post_ready_ms)),
                ],
            ],
        )
    if "llamacpp" in sides:
        print()
        print(f"3. llama.cpp, the default model over 2 ranks (ggml RPC), {len(kills)} SIGKILL rounds of rank 1")
        print_rows(
            ["", "value"],
            [
                ["greedy text identical to one process", str(split.texts_identical)],
                [
                    "decode tokens/s local / split (medians)",
                    f"{median(split.local_tps):.1f} / {median(split.split_tps):.1f}",
                ],
                [
                    "rank 1 SIGKILL -> failed and every rank gone, p50/p99 ms",
                    f"{fmt(percentile(split_fail_all, 50))} / {fmt(percentile(split_fail_all, 99))}",
                ],
                [
                    "rank 1 SIGSTOP -> request failed, median/max s",
                    f"{median(split.frozen_failed_s):.2f} / {max(split.frozen_failed_s, default=float('nan')):.2f}",
                ],
                ["replacement ready (same ports), p50 ms", fmt(percentile(split_replacement, 50))],
                ["baseline (no orphan protection): crash loop, lives", f"{split_base.crash_loop}, {split_base.lives}"],
                ["tether: ranks alive after the worker's SIGKILL", str(split_tether.orphans)],
            ],
        )
    print(f"percentiles: {PERCENTILE}")
    if trouble:
        print(f"tether logged {len(trouble)} error(s) of its own (tether_errors_logged), e.g. {trouble[0]}")
    failed_checks = [name for name, held in checks.items() if not held]
    if failed_checks or errors:
        print(f"FAILED checks: {', '.join(failed_checks) or '-'}; errors: {errors or '-'}")
    emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
