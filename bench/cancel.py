"""Cancellation benchmark: cancel a streaming generation after K tokens -> its terminal CANCELLED status.

tether (real code, real processes): one ``Supervisor`` per engine, started once (``ready()``: start-up, load and
warmup are not timed) and reused for every trial. A trial submits one generation, consumes its ``TaskHandle`` and,
once it has received K tokens (the sum of the ``Chunk.tokens`` received so far), stamps ``t0 = time.monotonic()``
and awaits ``sup.cancel(task_id)`` (the reply must be ``requested``). It keeps consuming until the terminal
``TaskStatus``. Per trial:

- *latency* = the terminal status received (stamped by the consumer as it gets it) - ``t0``. It covers the cancel's
  trip through the task pipe to the runner's reader thread (which sets the flag the engine checks before every
  token), the rest of the token being computed when the flag was set, the runner's CANCELLED status back through
  the events pipe and the supervisor's routing;
- *tokens after* = tokens in the ``Chunk`` events received after ``t0``, as the consumer sees them: tokens already
  in the pipe or in the handle's buffer at ``t0`` count, and so does a token whose computation was under way when the
  flag was set (llama.cpp checks before each token, not during one; the debug engine also checks after its sleep);
- *runner-side extra* = ``final.tokens`` (the runner's count in the CANCELLED status) - the tokens received before
  ``t0``. It must equal *tokens after* (``extra_mismatch`` counts the trials where it does not: a lost or invented
  token).

K is drawn per trial uniformly from [3, 30] by a seeded ``random.Random`` (``--seed``), once, up front; every engine
and every side below uses the same K for its i-th trial. Every trial must end ``TaskState.CANCELLED``:
``wrong_state`` counts those that did not (a generation that completed, failed, or had no terminal status within
``TRIAL_TIMEOUT``); it must be 0.

Engines: the debug engine (``token_seconds=0.002``, 100,000 ``max_tokens``: it never ends on its own) and the
default model (llama.cpp, SmolLM2-135M, greedy, ``max_tokens=400`` of a story prompt that keeps it talking well
past 100 tokens). ``llama_tokens_per_s`` is its rate in the tether trials: per trial, tokens / seconds from the
first chunk received to the K-th token, the median over the trials (the table's ``tok/s`` column, likewise per side).

baseline (the seed system, in this same run, same engines, same K): the seed checked for cancellation only every
100 tokens. Emulated in-process: the same engine class built with ``create_engine(spec)``, ``load()`` and
``warmup()`` in this process (one object per engine, reused), each generation run in a worker thread
(``anyio.to_thread.run_sync`` with a one-slot limiter: engines are not thread-safe), each delta handed to the event
loop with ``anyio.from_thread.run_sync`` onto a memory stream the consumer reads, and a final ``TaskStatus`` (state
from the last delta's finish reason, ``tokens`` = what the thread produced) after the last one. Cancelling sets a
``threading.Event`` after stamping ``t0``; the engine's ``cancelled`` callback returns it only when the tokens
produced so far are a multiple of 100 (the seed's check), so a cancel after K <= 30 tokens takes effect at token
100. Same stamps, same figures (``seed_*``).

in-process floor (``floor_*``): the same in-process setup, the flag checked before every token: what cancelling costs
with no process boundary, so tether minus floor is what the boundary costs. ``from_thread.run_sync`` blocks the
generating thread until the event loop has taken the delta, so nothing is ever in flight in-process, and the loop
often runs the consumer (which sets the flag) before that thread resumes: the floor then stops before computing
another token.

Trials interleave: the i-th trial of each side runs back to back (tether, seed, floor, the order rotated every trial),
so slow stretches of a noisy machine fall on every side alike; the runner and the in-process engine sit idle while
the other generates. The engines run one after the other (debug, then llama.cpp).

Statistics: p50 and p99 are ``statistics.quantiles(samples, n=100, method="inclusive")`` (linear interpolation
between order statistics): with 30 samples p99 lies 71% of the way from the second largest sample to the largest,
i.e. close to the max, which is also reported. ``ratio`` = ``seed_llama_p99_ms / llama_p99_ms``: how much longer
a user of the seed waited, at worst, for a cancelled generation of the default model to end (``debug_ratio``: the
same on the debug engine). On a shared machine, read the llama.cpp latencies with the ``tok/s`` column: the engine
uses every CPU, so another busy process slows each token many times over (its threads wait for each other at every
step), and a cancel's latency scales with the token time; *tokens after* does not, and is the figure to compare.

Runner records and runner logs go to a private temporary ``TETHER_RUNTIME_DIR`` / ``TETHER_LOG_DIR`` (removed at the
end). Without the default model (``DefaultModelMissing``) or llama-cpp-python, the llama figures are null and
``llama_skipped`` says why.

``--quick`` (for CI): 1 trial per side and engine (``"quick": true``); its figures are only a smoke test.

Run: ``.venv/bin/python bench/cancel.py [--quick]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread

from benchstats import PERCENTILE, emit, fmt, llama_unavailable, ms, percentile, print_rows, private_tether_dirs
from tether.engines.base import Delta, Engine
from tether.engines.registry import create_engine
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.protocol import Chunk, EngineSpec, GenerateParams, TaskState, TaskStatus

TOKEN_SECONDS = 0.002  # debug engine, per token
DEBUG_MAX_TOKENS = 100_000  # the debug generation never ends on its own during a trial
LLAMA_MAX_TOKENS = 400
LLAMA_PROMPT = "Once upon a time, in a land far away, there lived"  # greedy SmolLM2 keeps telling it to 400 tokens
K_RANGE = (3, 30)  # tokens received before the cancel, drawn per trial
SEED_CHECK_EVERY = 100  # the seed system's cancellation check, in tokens
SIDES = ("tether", "seed", "floor")
START_TIMEOUT = 60.0  # runner start, load and warmup (not timed)
STOP_TIMEOUT = 5.0
TRIAL_TIMEOUT = 60.0  # one trial, however slow the machine is
ENGINES: dict[str, tuple[EngineSpec, GenerateParams]] = {
    "debug": (
        EngineSpec(engine="debug", options={"token_seconds": TOKEN_SECONDS}),
        GenerateParams(prompt="cancel benchmark", max_tokens=DEBUG_MAX_TOKENS),
    ),
    "llama": (
        EngineSpec(engine="llama.cpp"),
        GenerateParams(prompt=LLAMA_PROMPT, max_tokens=LLAMA_MAX_TOKENS, temperature=0.0),
    ),
}


@dataclass
class Trial:
    """One cancel after ``k`` tokens; times are ``time.monotonic()`` stamps taken by the consumer."""

    k: int
    state: TaskState | None = None  # the terminal state (None: none within TRIAL_TIMEOUT)
    cancel_outcome: str | None = None  # tether: CancelReply.outcome
    t_first: float | None = None  # the first chunk received
    first_tokens: int = 0  # tokens in that chunk
    t0: float | None = None  # the cancel (stamped right before it)
    t_end: float | None = None  # the terminal status received
    before: int = 0  # tokens received before t0 (>= k)
    after: int = 0  # tokens received after t0
    final_tokens: int | None = None  # the producer's count, from the terminal status

    @property
    def cancelled(self) -> bool:
        return self.state is TaskState.CANCELLED and self.cancel_outcome in (None, "requested")

    @property
    def latency_ms(self) -> float | None:
        if not self.cancelled or self.t0 is None or self.t_end is None:
            return None
        return (self.t_end - self.t0) * 1000.0

    @property
    def extra(self) -> int | None:
        """The producer's tokens after the cancel: what it generated beyond what the consumer had at ``t0``."""
        return None if self.final_tokens is None or self.t0 is None else self.final_tokens - self.before

    @property
    def rate(self) -> tuple[int, float] | None:
        """(tokens, seconds) from the first chunk to the K-th token: the generation rate before the cancel."""
        if self.t_first is None or self.t0 is None or self.t0 <= self.t_first:
            return None
        return self.before - self.first_tokens, self.t0 - self.t_first

    def received(self, tokens: int, now: float) -> bool:
        """Count a chunk's tokens; True when this one reaches K, i.e. it is time to cancel (``t0`` is stamped)."""
        if self.t0 is not None:
            self.after += tokens
            return False
        if self.t_first is None:
            self.t_first, self.first_tokens = now, tokens
        self.before += tokens
        if self.before < self.k:
            return False
        self.t0 = time.monotonic()
        return True

    def ended(self, status: TaskStatus, now: float) -> None:
        self.state, self.t_end, self.final_tokens = status.state, now, status.tokens


# --------------------------------------------------------------------------------------------------------------
# tether side
# --------------------------------------------------------------------------------------------------------------


async def tether_trial(sup: Supervisor, params: GenerateParams, k: int) -> Trial:
    """Consume a generation through the supervisor; cancel it once ``k`` tokens have arrived."""
    trial = Trial(k)
    handle = await sup.generate(params)
    with anyio.move_on_after(TRIAL_TIMEOUT):
        async for event in handle:
            now = time.monotonic()
            if isinstance(event, Chunk):
                if trial.received(event.tokens, now):
                    trial.cancel_outcome = (await sup.cancel(handle.task_id)).outcome
            elif isinstance(event, TaskStatus) and event.state.terminal:
                trial.ended(event, now)
    if handle.final is None:  # timed out: stop it anyway, so the next trial finds the runner free
        await sup.cancel(handle.task_id)
        handle.close()
    return trial


# --------------------------------------------------------------------------------------------------------------
# in-process side: the seed's check every 100 tokens, and the floor (every token)
# --------------------------------------------------------------------------------------------------------------


def load_engine(spec: EngineSpec) -> Engine:
    """Build, load and warm up an engine in this process, as a runner would (runs in a worker thread)."""
    engine = create_engine(spec)
    engine.load(lambda fraction, detail: None)
    engine.warmup()
    return engine


async def inprocess_trial(
    engine: Engine, limiter: anyio.CapacityLimiter, params: GenerateParams, k: int, check_every: int
) -> Trial:
    """Generate in a worker thread, deltas to the event loop; cancel after ``k`` tokens with a flag the engine sees
    only when the tokens produced so far are a multiple of ``check_every`` (100: the seed; 1: the floor)."""
    trial = Trial(k)
    send, receive = anyio.create_memory_object_stream[Delta | TaskStatus](math.inf)
    flag = threading.Event()  # the cancel
    abort = threading.Event()  # the trial gave up (timeout): stop at the next check whatever the count
    produced = 0  # written by the worker thread only

    def cancelled() -> bool:
        return abort.is_set() or (flag.is_set() and produced % check_every == 0)

    def generate() -> None:
        nonlocal produced
        finish = None
        try:
            for delta in engine.generate(params, cancelled):
                produced += delta.tokens
                finish = delta.finish_reason
                anyio.from_thread.run_sync(send.send_nowait, delta)
            state = TaskState.CANCELLED if finish == "cancelled" else TaskState.COMPLETE
        except Exception:
            state = TaskState.FAILED
        status = TaskStatus(task_id="inprocess", state=state, tokens=produced)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):  # the consumer gave up
            anyio.from_thread.run_sync(send.send_nowait, status)

    async def consume() -> None:
        with anyio.move_on_after(TRIAL_TIMEOUT):
            async for event in receive:
                now = time.monotonic()
                if isinstance(event, Delta):
                    if trial.received(event.tokens, now):
                        flag.set()
                else:
                    trial.ended(event, now)
                    break
        abort.set()
        receive.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.to_thread.run_sync(generate, limiter=limiter)  # not abandoned: the thread ends on ``abort``
    return trial


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------


async def run_engine(spec: EngineSpec, params: GenerateParams, ks: Sequence[int]) -> dict[str, list[Trial]]:
    """All trials of one engine: a supervised runner and an in-process engine, the sides interleaved per trial."""
    engine = await anyio.to_thread.run_sync(load_engine, spec)
    limiter = anyio.CapacityLimiter(1)  # one generation at a time on the in-process engine
    trials: dict[str, list[Trial]] = {side: [] for side in SIDES}
    try:
        async with Supervisor(spec, SupervisorSettings(stop_timeout=STOP_TIMEOUT)) as sup:
            with anyio.fail_after(START_TIMEOUT):
                await sup.ready()
            for i, k in enumerate(ks):
                for side in SIDES[i % 3 :] + SIDES[: i % 3]:
                    if side == "tether":
                        trial = await tether_trial(sup, params, k)
                    else:
                        every = SEED_CHECK_EVERY if side == "seed" else 1
                        trial = await inprocess_trial(engine, limiter, params, k, every)
                    trials[side].append(trial)
    finally:
        engine.close()
    return trials


def _samples(trials: Sequence[Trial], get: Callable[[Trial], float | None]) -> list[float]:
    return [v for v in (get(t) for t in trials) if v is not None]


def tokens_per_s(trials: Sequence[Trial]) -> float:
    """The median over the trials of tokens / seconds from the first chunk to the K-th token (nan without any): a
    median, so a trial slowed by another process on the machine does not drag the figure down."""
    rates = [n / s for n, s in (t.rate for t in trials if t.rate is not None) if n > 0]
    return statistics.median(rates) if rates else float("nan")


@dataclass
class Figures:
    """One (engine, side): the trials' summary."""

    latency: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    wrong_state: int = 0
    extra_mismatch: int = 0
    tokens_per_s: float = float("nan")
    n: int = 0

    @classmethod
    def of(cls, trials: Sequence[Trial]) -> Figures:
        done = [t for t in trials if t.cancelled]
        return cls(
            latency=_samples(done, lambda t: t.latency_ms),
            after=[float(t.after) for t in done],
            wrong_state=len(trials) - len(done),
            extra_mismatch=sum(1 for t in done if t.extra != t.after),
            tokens_per_s=tokens_per_s(trials),
            n=len(trials),
        )

    def json(self, prefix: str) -> dict[str, Any]:
        return {
            f"{prefix}_p50_ms": ms(percentile(self.latency, 50)),
            f"{prefix}_p99_ms": ms(percentile(self.latency, 99)),
            f"{prefix}_max_ms": ms(max(self.latency, default=float("nan"))),
            f"{prefix}_tokens_after_p50": ms(percentile(self.after, 50)),
            f"{prefix}_tokens_after_p99": ms(percentile(self.after, 99)),
            f"{prefix}_tokens_after_max": None if not self.after else int(max(self.after)),
        }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 1)


def print_table(figures: dict[tuple[str, str], Figures]) -> None:
    headers = ("engine / side", "n", "p50 ms", "p99 ms", "max ms", "after p50", "after p99", "after max", "tok/s")
    rows = []
    labels = {"tether": "tether (runner process)", "seed": f"seed (check every {SEED_CHECK_EVERY})", "floor": "floor"}
    for (engine, side), f in figures.items():
        rows.append(
            (
                f"{engine}: {labels[side]}",
                str(f.n),
                fmt(percentile(f.latency, 50)),
                fmt(percentile(f.latency, 99)),
                fmt(max(f.latency, default=float("nan"))),
                fmt(percentile(f.after, 50)),
                fmt(percentile(f.after, 99)),
                fmt(max(f.after, default=float("nan"))),
                fmt(f.tokens_per_s),
            )
        )
    print_rows(headers, rows)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    ks = [rng.randint(*K_RANGE) for _ in range(args.trials)]
    skipped = llama_unavailable()
    began = time.monotonic()
    figures: dict[tuple[str, str], Figures] = {}
    for name, (spec, params) in ENGINES.items():
        if name == "llama" and skipped is not None:
            continue
        trials = await run_engine(spec, params, ks)
        for side in SIDES:
            figures[name, side] = Figures.of(trials[side])
    wall_s = time.monotonic() - began

    print(
        f"cancel after K in {list(K_RANGE)} tokens -> terminal CANCELLED status; {args.trials} trials per side and "
        f"engine ({wall_s:.1f} s){' (quick)' if args.quick else ''}"
    )
    print_table(figures)
    print(f"percentiles: {PERCENTILE}; 'after' = tokens the consumer received after the cancel")
    if skipped is not None:
        print(f"llama.cpp skipped: {skipped}")

    empty = Figures()
    result: dict[str, Any] = {"bench": "cancel"}
    for name in ENGINES:
        result.update(figures.get((name, "tether"), empty).json(name))
    for side in ("seed", "floor"):
        for name in ENGINES:
            result.update(figures.get((name, side), empty).json(f"{side}_{name}"))
    result["ratio"] = _ratio(result["seed_llama_p99_ms"], result["llama_p99_ms"])
    result["debug_ratio"] = _ratio(result["seed_debug_p99_ms"], result["debug_p99_ms"])
    wrong = sum(f.wrong_state for f in figures.values())
    mismatch = sum(f.extra_mismatch for f in figures.values())
    llama_rate = figures.get(("llama", "tether"), empty).tokens_per_s
    result.update(
        {
            "wrong_state": wrong,
            "extra_mismatch": mismatch,
            "llama_tokens_per_s": None if llama_rate != llama_rate else round(llama_rate, 1),
            "llama_skipped": skipped,
            "trials": args.trials,
            "k_range": list(K_RANGE),
            "seed_check_every": SEED_CHECK_EVERY,
            "token_seconds": TOKEN_SECONDS,
            "llama_max_tokens": LLAMA_MAX_TOKENS,
            "percentile": PERCENTILE,
            "wall_s": round(wall_s, 1),
            "quick": bool(args.quick),
        }
    )
    print(
        f"seed p99 / tether p99: llama.cpp {result['ratio']}x, debug {result['debug_ratio']}x; "
        f"llama.cpp {result['llama_tokens_per_s']} tokens/s in the runner"
    )
    if wrong or mismatch:
        print(
            f"FAILURE: {wrong} trial(s) did not end CANCELLED (or the cancel was not 'requested'); {mismatch} where "
            "the producer's count after the cancel differs from the tokens received after it"
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30, help="trials per side and engine (default 30)")
    parser.add_argument("--seed", type=int, default=20240601, help="random seed for the K draws")
    parser.add_argument("--quick", action="store_true", help="1 trial per side and engine (CI)")
    args = parser.parse_args(argv)
    if args.quick:
        args.trials = 1
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    with private_tether_dirs("tether-bench-cancel-"):
        result = anyio.run(bench, args)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
