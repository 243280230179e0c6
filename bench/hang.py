"""Hang-detection benchmark: how long after its deadline a hung runner's request ends, per kind of hang.

tether (real code, real processes, the debug engine at 0.005 s per token): every trial is a fresh ``Supervisor``
(``heartbeat_interval=0.25``; start-up, load and warm-up are not timed) whose deadlines are all 3600 s except the
one the scenario must trip, so that one and only that one can fire:

============== ===================================================== ============== ======== ==================
scenario       the hang (real, see ``tether.runner.faults``)         deadline       phase    last progress (t0)
============== ===================================================== ============== ======== ==================
python_decode  ``Fault("hang", after_tokens=20)``: a Python loop      token_gap 0.5  decode   the 20th Chunk
gil_decode     ``Fault("hang_gil", after_tokens=20)``: native         heartbeat 1.0  decode   the 20th Chunk
               deadlock holding the GIL (the heartbeat stops too)
sigstop        ``os.kill(runner, SIGSTOP)`` on the 20th Chunk         heartbeat 1.0  decode   the SIGSTOP
load_stall     ``EngineSpec(faults=(Fault("hang", phase="load"),))``  load_stall 0.5 load     the last Loading
               and ``await sup.load()`` (must raise ``TaskFailed``)                           status
first_token    ``Fault("slow", after_tokens=0, seconds=30)``          first_token    prefill  the RUNNING status
                                                                      0.5                     of the generation
============== ===================================================== ============== ======== ==================

Per trial the bench records:

- *declared - deadline*: ``(sup.hang.seconds - sup.hang.limit) * 1000``, the supervisor's own measure of how late
  it noticed (its deadline watch sleeps until the next expiry, so this is its timer's wake-up latency);
- *FAILED - deadline*: measured by the bench alone, from its own stamp of the last progress it saw (t0 in the
  table: stamped with ``time.monotonic()`` when the consumer receives the event, when it sends the SIGSTOP, or in a
  status listener for Loading) to the moment the terminal FAILED ``TaskStatus`` reaches the consumer (for
  load_stall: when ``sup.load()`` raises ``TaskFailed``), minus the deadline. This includes asking for the stacks
  (SIGUSR1; the supervisor waits until the dump's last line, the main thread's outermost frame, is out, or else for
  0.1 s of quiet output after it, ``hangs.STACK_QUIET``), the group kill, the reap and the fan-out of the terminal
  status: the whole price of a diagnosed hang;
- *stack collection*: how long ``Supervisor._collect_stacks`` ran (a ``Supervisor`` subclass stamps around a call
  to the original: an observer, not a code path), and whether ``cause.evidence`` holds a faulthandler thread header
  (a line starting with ``Thread 0x`` or ``Current thread 0x``). Stacks are expected in every scenario but sigstop,
  where a stopped process cannot run its handler and the evidence must say "process state T" instead;
- ``wrong_cause`` (must be 0): trials whose terminal status is not FAILED with a ``hang`` cause of the expected
  phase, whose ``sup.hang`` names another deadline or phase, whose sigstop evidence lacks the process state, or
  whose runner produced another number of chunks than the scenario intends (20, or 0 for first_token).

Heartbeat scenarios: the heartbeat deadline runs from the last beat *received*, which precedes the hang by
anything up to one interval (0.25 s), while the bench's t0 is the hang itself (last Chunk, SIGSTOP). So gil_decode
and sigstop can end *before* t0 + deadline (negative figures, down to about -250 ms + the stack collection):
that is what a 1.0 s heartbeat deadline at a 0.25 s interval means, a detection between 0.75 and 1.0 s after the
interpreter stops.

baseline (what a user does without tether's deadlines, in this same run, against the same five hung runners): a
``Supervisor`` with every deadline and the heartbeat deadline at 3600 s, so only the client acts. The client wraps
each receive from the task's handle in ``anyio.move_on_after(deadline)`` (the scenario's deadline: an inactivity
timeout) and gives up when one expires; for load_stall it submits the ``LoadTask`` itself to have a handle. Figure:
give-up time minus the same t0 as the tether side, minus the deadline (the client's timer starts when its task
receives its last event: for load_stall the RUNNING status, which the event loop hands to it a few ms after the
status listener stamped the Loading that followed it; for sigstop the chunks already in the pipe).
After giving up, the bench checks the runner: ``baseline_runner_left_hung`` counts trials where it is still alive
(``/proc`` state not gone or zombie) with no hang declared and no cause: still hung, still holding its memory,
with no stacks and no reason given (``baseline_stacks`` is 0 by construction). Then it leaves the supervisor's block,
whose stop escalates to SIGKILL (after a 1 s stop timeout; a SIGSTOPped runner dies of SIGKILL without SIGCONT).

``ratio`` (a price, not a speed-up): per scenario, the p99 of tether's last progress -> FAILED divided by the p99
of the baseline's last progress -> give-up, both *including* the deadline (``<scenario>_ratio``); ``ratio`` is the
largest of these, i.e. at worst how much later a hung request ends under tether than under a bare client timeout of
the same length (about 1.02 at a 0.5 s deadline: a few ms of stack collection, kill and reap; below 1 for the
heartbeat scenarios, whose clock starts at the last beat). What that buys is in the other fields: the cause, the
stacks and a runner that is gone instead of hung (compare ``wrong_cause``/``stacks_captured`` with
``baseline_runner_left_hung``).

JSON: ``<scenario>_p50_ms``/``_p99_ms`` are tether's FAILED - deadline per scenario (``_declared_p99_ms``: the
supervisor's own measure, ``_baseline_p99_ms``: the client's give-up, ``_ratio``: as above); ``all_declared_*`` and
``all_failed_*`` pool the five scenarios; ``baseline_p50_ms``/``_p99_ms`` pool the baseline's give-ups; ``trials``
is the number of rounds, i.e. trials per scenario and side.

Concurrency (so the run stays short on 2 CPUs): trials run in rounds; a round is one tether and one baseline trial
of every scenario (10 runners) and runs ``--concurrency`` of them at once (default 10, the whole round; 1 runs
every trial alone). A group's runners all start and get ready first, then wait at a gate, and their timed windows
start together, so no runner start-up (the CPU-heavy part) overlaps a timed window. The windows overlap each other:
hung runners are idle (sleeping, blocked or stopped) and the streams before the hang are 20 tokens, so what they
share is this process's event loop and the kills and reaps of the trials that end first; that costs milliseconds
of jitter at most, against deadlines of 500-1000 ms (``--concurrency 1`` measures without it).

Statistics: p50 and p99 are ``statistics.quantiles(samples, n=100, method="inclusive")`` (linear interpolation
between order statistics, as numpy's default): with 15 samples p99 is close to the max, which is also printed.
"All" figures pool the tether trials of every scenario.

tether's own log (an error with the stacks for every hang) is silenced unless ``--log``: the hangs are on purpose.
Runner records and runner logs go to a private temporary ``TETHER_RUNTIME_DIR`` / ``TETHER_LOG_DIR`` (removed at
the end), so the bench leaves nothing in the user's directories.

``--quick`` (for CI): 2 rounds, i.e. 2 trials per scenario and side (``"quick": true``); its figures are only a
smoke test.

Run: ``.venv/bin/python bench/hang.py [--quick]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import msgspec

from benchstats import PERCENTILE, emit, fmt, ms, percentile, print_rows, private_tether_dirs
from tether.node.hangs import Deadlines, process_state
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.node.tasks import TaskEvent, TaskFailed, TaskHandle
from tether.protocol import (
    CauseKind,
    Chunk,
    EngineSpec,
    Fault,
    GenerateParams,
    Loading,
    LoadTask,
    RunnerStatus,
    TaskState,
    TaskStatus,
)

HEARTBEAT_INTERVAL = 0.25  # the runner's beat period (Deadlines.check: heartbeat deadline >= 2 x this)
PROGRESS_DEADLINE = 0.5  # token_gap, first_token, load_stall, in their scenarios
HEARTBEAT_DEADLINE = 1.0  # heartbeat, in its scenarios
LARGE = 3600.0  # every deadline a scenario must not trip
WARMUP_DEADLINE = 60.0  # warm-up is not timed; generous because a whole round of runners starts at once
STACKS_DEADLINE = 1.0
TOKEN_SECONDS = 0.005
HANG_AFTER = 20  # tokens before the hang (and the chunk on which sigstop stops the runner)
MAX_TOKENS = 1_000_000  # generations never finish on their own
SLOW_SECONDS = 30.0  # first_token: the sleep before the first token
START_TIMEOUT = 60.0  # start-up, load and warm-up of a trial's runner (not timed)
WINDOW_SLACK = 15.0  # bound on a timed window beyond its deadline
STOP_TIMEOUT = 1.0  # baseline: shutdown -> SIGTERM -> SIGKILL of a hung runner

BASE = Deadlines(
    heartbeat=LARGE,
    load_stall=LARGE,
    warmup=WARMUP_DEADLINE,
    first_token=LARGE,
    token_gap=LARGE,
    ack=LARGE,
    stacks=STACKS_DEADLINE,
)
STACK_PREFIXES = ("Thread 0x", "Current thread 0x")  # faulthandler's thread headers

Side = Literal["tether", "baseline"]


@dataclass(frozen=True)
class Scenario:
    name: str
    deadline: str  # the Deadlines field that must fire
    phase: str  # the hang phase it must be declared in
    stacks: bool  # whether stacks can be expected
    reference: str  # what the bench stamps as the last progress, in words

    @property
    def limit(self) -> float:
        return HEARTBEAT_DEADLINE if self.deadline == "heartbeat" else PROGRESS_DEADLINE

    @property
    def deadlines(self) -> Deadlines:
        return msgspec.structs.replace(BASE, **{self.deadline: self.limit})

    @property
    def faults(self) -> tuple[Fault, ...]:
        """Per-request faults (load_stall's is in the engine spec instead)."""
        return {
            "python_decode": (Fault(kind="hang", after_tokens=HANG_AFTER),),
            "gil_decode": (Fault(kind="hang_gil", after_tokens=HANG_AFTER),),
            "first_token": (Fault(kind="slow", after_tokens=0, seconds=SLOW_SECONDS),),
        }.get(self.name, ())

    @property
    def spec(self) -> EngineSpec:
        load_faults = (Fault(kind="hang", phase="load"),) if self.name == "load_stall" else ()
        return EngineSpec(engine="debug", options={"token_seconds": TOKEN_SECONDS}, faults=load_faults)

    @property
    def chunks(self) -> int:
        """How many chunks the runner sends before it hangs."""
        return HANG_AFTER if self.name in ("python_decode", "gil_decode", "sigstop") else 0


SCENARIOS = (
    Scenario("python_decode", "token_gap", "decode", True, f"chunk {HANG_AFTER}"),
    Scenario("gil_decode", "heartbeat", "decode", True, f"chunk {HANG_AFTER}"),
    Scenario("sigstop", "heartbeat", "decode", False, "SIGSTOP"),
    Scenario("load_stall", "load_stall", "load", True, "last Loading"),
    Scenario("first_token", "first_token", "prefill", True, "RUNNING status"),
)


@dataclass
class Trial:
    """One hung runner; every ``*_ms`` is None when it did not happen."""

    scenario: Scenario
    side: Side
    end_ms: float | None = None  # t0 -> FAILED (tether) or give-up (baseline), minus the deadline
    declared_ms: float | None = None  # sup.hang.seconds - limit
    stacks_ms: float | None = None  # how long the stack collection ran
    kill_to_failed_ms: float | None = None  # end of the stack collection -> FAILED at the consumer
    stacks: bool = False
    wrong: list[str] = field(default_factory=list)  # why the cause or the run was not as intended
    left_hung: bool = False  # baseline: the runner still alive, no cause, after the client gave up
    error: str | None = None  # the trial could not run

    @property
    def elapsed_ms(self) -> float | None:
        """t0 -> end, deadline included."""
        return None if self.end_ms is None else self.end_ms + self.scenario.limit * 1000.0


class _TimedSupervisor(Supervisor):
    """Stamps when the stack collection runs (it calls the original: an observer, not a code path)."""

    stacks_began: float | None = None
    stacks_ended: float | None = None

    async def _collect_stacks(self) -> tuple[list[str], str | None]:
        self.stacks_began = time.monotonic()
        try:
            return await super()._collect_stacks()
        finally:
            self.stacks_ended = time.monotonic()


class Gate:
    """Opens when all ``n`` trials of a group have arrived: their timed windows start together, after every
    start-up of the group is over."""

    def __init__(self, n: int) -> None:
        self.waiting = n
        self.open = anyio.Event()

    def arrive(self) -> None:
        self.waiting -= 1
        if self.waiting <= 0:
            self.open.set()


# --------------------------------------------------------------------------------------------------------------
# One trial
# --------------------------------------------------------------------------------------------------------------


async def _next(handle: TaskHandle, timeout: float) -> TaskEvent | Literal["timeout"] | None:
    """The handle's next event, None at its end, "timeout" when none came within ``timeout`` (math.inf: no bound)."""
    with anyio.move_on_after(timeout):
        return await anext(handle, None)
    return "timeout"


@dataclass
class _Stamps:
    """What the consumer saw, stamped with ``time.monotonic()`` as it received it."""

    last_chunk: float | None = None
    chunks: int = 0
    running: float | None = None
    sigstop: float | None = None
    loading: float | None = None
    end: float | None = None  # the terminal FAILED status (tether) or the give-up (baseline)
    final: TaskStatus | None = None


async def _consume(sup: Supervisor, handle: TaskHandle, scn: Scenario, side: Side, stamps: _Stamps) -> None:
    """Read the stream until its terminal status (tether) or until the client's inactivity timeout (baseline)."""
    client_timeout = scn.limit if side == "baseline" else math.inf
    while True:
        event = await _next(handle, client_timeout)
        now = time.monotonic()
        if event == "timeout":
            stamps.end = now
            return
        if event is None:
            return
        if isinstance(event, Chunk):
            stamps.last_chunk = now
            stamps.chunks += 1
            if scn.name == "sigstop" and stamps.chunks == HANG_AFTER:
                assert sup.pid is not None
                os.kill(sup.pid, signal.SIGSTOP)
                stamps.sigstop = time.monotonic()
        elif isinstance(event, TaskStatus):
            if event.state is TaskState.RUNNING:
                stamps.running = now
            elif event.state.terminal:
                stamps.final = event
                if event.state is TaskState.FAILED and side == "tether":
                    stamps.end = now
                return


async def _timed(sup: _TimedSupervisor, scn: Scenario, side: Side, trial: Trial) -> None:
    """The timed window: submit the task, let the runner hang, stamp the end; then check the outcome."""
    stamps = _Stamps()

    def on_status(status: RunnerStatus) -> None:
        if isinstance(status, Loading):
            stamps.loading = time.monotonic()

    sup.add_status_listener(on_status)
    with anyio.move_on_after(scn.limit + WINDOW_SLACK):
        if scn.name == "load_stall" and side == "tether":
            try:
                await sup.load()
                trial.wrong.append("load completed")
            except TaskFailed as exc:
                stamps.end = time.monotonic()
                stamps.final = exc.status
        else:
            if scn.name == "load_stall":
                handle = await sup.submit(LoadTask(task_id=f"load-{uuid.uuid4().hex[:12]}"))
            else:
                params = GenerateParams(prompt=f"hang bench {scn.name}", max_tokens=MAX_TOKENS, faults=scn.faults)
                handle = await sup.generate(params)
            try:
                await _consume(sup, handle, scn, side, stamps)
            finally:
                handle.close()

    t0 = {
        "python_decode": stamps.last_chunk,
        "gil_decode": stamps.last_chunk,
        "sigstop": stamps.sigstop,
        "load_stall": stamps.loading,
        "first_token": stamps.running,
    }[scn.name]
    if stamps.chunks != scn.chunks:
        trial.wrong.append(f"{stamps.chunks} chunks, not {scn.chunks}")
    if t0 is None or stamps.end is None:
        trial.error = f"no {scn.reference} stamp" if t0 is None else "no end within the window"
        if stamps.final is not None:
            trial.error += f" (final: {stamps.final.state.value}: {stamps.final.error})"
        return
    trial.end_ms = (stamps.end - t0 - scn.limit) * 1000.0
    if side == "baseline":
        state = process_state(sup.pid) if sup.pid is not None else None
        trial.left_hung = sup.alive and state not in (None, "Z") and sup.hang is None and sup.cause is None
        return
    _check_tether(sup, scn, stamps, trial)


def _check_tether(sup: _TimedSupervisor, scn: Scenario, stamps: _Stamps, trial: Trial) -> None:
    final, hang = stamps.final, sup.hang
    assert stamps.end is not None
    cause = final.cause if final is not None else None
    if final is None or final.state is not TaskState.FAILED or cause is None or cause.kind is not CauseKind.HANG:
        trial.wrong.append(f"terminal status {final!r}")
    elif cause.phase != scn.phase:
        trial.wrong.append(f"cause phase {cause.phase!r}, not {scn.phase!r}")
    if hang is None:
        trial.wrong.append("sup.hang not set")
    else:
        trial.declared_ms = (hang.seconds - hang.limit) * 1000.0
        if (hang.deadline, hang.phase, hang.limit) != (scn.deadline, scn.phase, scn.limit):
            trial.wrong.append(f"hang {hang.deadline}/{hang.phase}/{hang.limit:g}, not {scn.deadline}/{scn.phase}")
    evidence = cause.evidence if cause is not None else ()
    trial.stacks = any(line.startswith(STACK_PREFIXES) for line in evidence)
    if scn.name == "sigstop" and not any("process state T" in line for line in evidence):
        trial.wrong.append("sigstop evidence lacks the process state")
    if sup.stacks_began is not None and sup.stacks_ended is not None:
        trial.stacks_ms = (sup.stacks_ended - sup.stacks_began) * 1000.0
        trial.kill_to_failed_ms = (stamps.end - sup.stacks_ended) * 1000.0


async def run_trial(scn: Scenario, side: Side, gate: Gate) -> Trial:
    """Start and ready a fresh supervisor (not timed), wait at the gate, then run the timed window."""
    trial = Trial(scn, side)
    deadlines = scn.deadlines if side == "tether" else BASE  # baseline: only the client's timeout acts
    sup = _TimedSupervisor(
        scn.spec,
        SupervisorSettings(
            heartbeat_interval=HEARTBEAT_INTERVAL, start_timeout=START_TIMEOUT, stop_timeout=STOP_TIMEOUT
        ),
        deadlines=deadlines,
    )
    arrived = False
    try:
        async with sup:
            if scn.name != "load_stall":  # load_stall's timed part is the load itself
                with anyio.fail_after(START_TIMEOUT):
                    await sup.ready()
            arrived = True
            gate.arrive()
            await gate.open.wait()
            await _timed(sup, scn, side, trial)
    except Exception as exc:  # one broken trial is reported, it does not end the run
        trial.error = f"{type(exc).__name__}: {exc}"
    finally:
        if not arrived:
            gate.arrive()
    return trial


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------


async def run_rounds(rounds: int, concurrency: int) -> list[Trial]:
    trials: list[Trial] = []
    plan: list[tuple[Scenario, Side]] = [(scn, side) for scn in SCENARIOS for side in ("tether", "baseline")]
    for _ in range(rounds):
        for start in range(0, len(plan), concurrency):
            group = plan[start : start + concurrency]
            gate = Gate(len(group))
            results: list[Trial] = []

            async def one(scn: Scenario, side: Side, gate: Gate = gate, results: list[Trial] = results) -> None:
                results.append(await run_trial(scn, side, gate))

            async with anyio.create_task_group() as tg:
                for scn, side in group:
                    tg.start_soon(one, scn, side)
            trials.extend(results)
    return trials


def _samples(trials: Sequence[Trial], get: Callable[[Trial], float | None]) -> list[float]:
    return [v for v in (get(t) for t in trials) if v is not None]


def _p99_ratio(tether: Sequence[Trial], baseline: Sequence[Trial]) -> float | None:
    """p99 of tether's t0 -> FAILED over p99 of the baseline's t0 -> give-up (deadline included in both)."""
    t99 = percentile(_samples(tether, lambda t: t.elapsed_ms), 99)
    b99 = percentile(_samples(baseline, lambda t: t.elapsed_ms), 99)
    return round(t99 / b99, 3) if b99 > 0 and t99 == t99 else None


def report(trials: Sequence[Trial], args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    tether = [t for t in trials if t.side == "tether"]
    baseline = [t for t in trials if t.side == "baseline"]
    headers = ("t0 + deadline -> (ms)", "n", "p50", "p99", "max")
    table: list[tuple[str, ...]] = []

    def row(label: str, samples: list[float]) -> None:
        table.append(
            (
                label,
                str(len(samples)),
                fmt(percentile(samples, 50)),
                fmt(percentile(samples, 99)),
                fmt(max(samples, default=float("nan"))),
            )
        )

    result: dict[str, Any] = {"bench": "hang"}
    ratios: dict[str, float | None] = {}
    counts: list[tuple[str, ...]] = []  # the second table: what each scenario's trials left behind
    for scn in SCENARIOS:
        mine = [t for t in tether if t.scenario is scn]
        base = [t for t in baseline if t.scenario is scn]
        end = _samples(mine, lambda t: t.end_ms)
        declared = _samples(mine, lambda t: t.declared_ms)
        base_end = _samples(base, lambda t: t.end_ms)
        ratios[scn.name] = _p99_ratio(mine, base)
        table.append((f"{scn.name} ({scn.deadline} {scn.limit:g} s; t0: {scn.reference})", "", "", "", ""))
        row("  tether: hang declared (sup.hang)", declared)
        row("  tether: FAILED status (bench)", end)
        row("    of which stack collection", _samples(mine, lambda t: t.stacks_ms))
        row("    of which collection end -> FAILED", _samples(mine, lambda t: t.kill_to_failed_ms))
        row("  baseline: client gives up", base_end)
        counts.append(
            (
                scn.name,
                f"{sum(t.stacks for t in mine)}/{len(mine) if scn.stacks else 0}",
                str(sum(bool(t.wrong) for t in mine)),
                f"{sum(t.left_hung for t in base)}/{len(base)}",
                str(ratios[scn.name]),
            )
        )
        result[f"{scn.name}_p50_ms"] = ms(percentile(end, 50))
        result[f"{scn.name}_p99_ms"] = ms(percentile(end, 99))
        result[f"{scn.name}_declared_p99_ms"] = ms(percentile(declared, 99))
        result[f"{scn.name}_baseline_p99_ms"] = ms(percentile(base_end, 99))
        result[f"{scn.name}_ratio"] = ratios[scn.name]

    all_declared = _samples(tether, lambda t: t.declared_ms)
    all_end = _samples(tether, lambda t: t.end_ms)
    all_stacks = _samples(tether, lambda t: t.stacks_ms)
    base_end = _samples(baseline, lambda t: t.end_ms)
    table.append(("all scenarios", "", "", "", ""))
    row("  tether: hang declared (sup.hang)", all_declared)
    row("  tether: FAILED status (bench)", all_end)
    row("    of which stack collection", all_stacks)
    row("  baseline: client gives up", base_end)

    print(
        f"Hung runner -> request ended, minus the deadline; {args.rounds} round(s) of {len(SCENARIOS)} scenarios x "
        f"(tether, baseline), {args.concurrency} trial(s) at once, {wall_s:.1f} s{' (quick)' if args.quick else ''}"
    )
    print_rows(headers, table)
    print(f"percentiles: {PERCENTILE}")
    print()
    print_rows(("scenario", "stacks", "wrong cause", "baseline runner left hung", "ratio"), counts)
    print()

    known = [r for r in ratios.values() if r is not None]
    stacks_captured = sum(t.stacks for t in tether)
    stacks_expected = sum(1 for t in tether if t.scenario.stacks)
    wrong_cause = sum(bool(t.wrong) for t in tether)
    errors = [t for t in trials if t.error is not None]
    left_hung = sum(t.left_hung for t in baseline)
    result.update(
        {
            "all_declared_p50_ms": ms(percentile(all_declared, 50)),
            "all_declared_p99_ms": ms(percentile(all_declared, 99)),
            "all_failed_p50_ms": ms(percentile(all_end, 50)),
            "all_failed_p99_ms": ms(percentile(all_end, 99)),
            "all_failed_max_ms": ms(max(all_end, default=float("nan"))),
            "stack_collection_p50_ms": ms(percentile(all_stacks, 50)),
            "stack_collection_p99_ms": ms(percentile(all_stacks, 99)),
            "stacks_captured": stacks_captured,
            "stacks_expected": stacks_expected,
            "wrong_cause": wrong_cause,
            "errors": len(errors),
            "baseline_p50_ms": ms(percentile(base_end, 50)),
            "baseline_p99_ms": ms(percentile(base_end, 99)),
            "baseline_runner_left_hung": left_hung,
            "baseline_stacks": 0,
            "baseline_trials": len(baseline),
            "ratio": max(known) if known else None,
            "trials": args.rounds,
            "tether_trials": len(tether),
            "concurrency": args.concurrency,
            "deadlines": {
                "progress_s": PROGRESS_DEADLINE,
                "heartbeat_s": HEARTBEAT_DEADLINE,
                "heartbeat_interval_s": HEARTBEAT_INTERVAL,
                "stacks_s": STACKS_DEADLINE,
                "others_s": LARGE,
            },
            "token_seconds": TOKEN_SECONDS,
            "percentile": PERCENTILE,
            "wall_s": round(wall_s, 1),
            "quick": bool(args.quick),
        }
    )
    print(
        f"ratio (worst scenario, p99 of t0 -> end incl. the deadline, tether / baseline): {result['ratio']}; "
        f"stacks {stacks_captured}/{stacks_expected}; baseline runners left hung {left_hung}/{len(baseline)}"
    )
    for t in trials:
        for why in t.wrong:
            print(f"WRONG ({t.side} {t.scenario.name}): {why}")
    for t in errors:
        print(f"ERROR ({t.side} {t.scenario.name}): {t.error}")
    return result


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    trials = await run_rounds(args.rounds, args.concurrency)
    return report(trials, args, time.monotonic() - began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="trials per scenario and side (default 15)")
    parser.add_argument(
        "--concurrency", type=int, default=2 * len(SCENARIOS), help="trials at once (default 10: a whole round)"
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds (CI)")
    parser.add_argument("--log", action="store_true", help="let tether log each hang, with its stacks, to stderr")
    args = parser.parse_args(argv)
    if not args.log:  # every trial hangs on purpose: its error log (stacks included) would bury the table
        logging.getLogger("tether").addHandler(logging.NullHandler())
    if args.quick:
        args.rounds = 2
    if args.rounds < 1 or args.concurrency < 1:
        parser.error("--rounds and --concurrency must be at least 1")
    with private_tether_dirs("tether-bench-hang-"):
        result = anyio.run(bench, args)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
