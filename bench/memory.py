"""Memory-sampling benchmark: what one footprint sample and one node sample cost, and what the sampler costs a runner.

Sample cost (the caller's wall time per call, ``time.perf_counter_ns`` around each call, ``--samples`` calls each,
default 2000; the calls run in the event loop in batches of 100 with a checkpoint between batches, so the
supervisor keeps draining heartbeats):

- ``process_status_memory(pid)`` (the footprint sample: /proc/PID/status, the kernel's per-process counters,
  constant time) and ``process_memory(pid)`` (the detailed one, with PSS/USS: /proc/PID/smaps_rollup, for which the
  kernel walks the process's page tables, so its cost grows with resident memory: the table shows it per MiB) of a
  live, idle llama.cpp runner of the default model (``Supervisor(EngineSpec())``, after ``ready()``) and of an idle
  debug-engine runner, without NVML;
- ``await sup.sample_memory()``: one whole-group sample of the llama.cpp runner as the periodic sampler takes it
  (list the group from the runner's cgroup, or from /proc, then ``process_status_memory`` of each member),
  in the event loop when the runner has a cgroup of its own and NVML is absent (a worker thread otherwise). The
  first call (which asks NVML once) is not timed;
- ``node_memory()``: /proc/meminfo, this worker's memory cgroup and an NVML snapshot; and ``node_memory(gpu=...)``
  with an already-taken snapshot, to show what the NVML attempt itself costs. Where NVML is absent (no
  ``nvidia-ml-py``, or no driver library) the JSON says why in ``gpu``; the GPU figures are then unknown, not 0.

Sampler overhead: tokens/s of a runner generating with the supervisor's periodic sampler off
(``memory_interval=0``), on at an aggressive interval (0.05 s, 40x as often as the default, so that any overhead
shows) and on at the supervisor's default interval (2 s). Each run is a fresh ``Supervisor`` (start, load and
warmup are not timed; the sampler exists only in its own runs, so an idle sampler never competes with another
configuration's run) that generates one completion; its figure is (tokens after the first chunk) / (last chunk -
first chunk), tokens counted from the ``Chunk`` events' ``tokens``, stamped as the event loop receives them. Runs
go in ``--pairs`` rounds (default 5) of one run per configuration, the order rotated every round (off, fast,
default; fast, default, off; ...) so slow drift of the machine falls on every configuration alike. The figures are
the medians over the rounds, and ``ratio`` = median with sampling / median without (target >= 0.99; also given: the
median of the per-round ratios, which is less sensitive to a slow stretch of the machine).

- llama.cpp, the default model, greedy, ``--max-tokens`` (default 256) of a story prompt that keeps it talking,
  ``n_threads`` at its default (all usable CPUs, at most 8): the runner's threads and the supervisor's sampler
  share the same CPUs;
- the debug engine with ``token_seconds=0`` (``--debug-tokens`` tokens, default 200,000): the runner does nothing but
  write chunks, the supervisor's event loop does nothing but read them, so any time the sampler takes from the
  event loop shows. Reported separately (``debug_*``). ``sampler_busy_fraction``: the time spent inside samples over
  the generation time (median over the runs): the cost itself, free of the run-to-run noise of tokens/s.

Samples the sampler took during each generation are counted (a ``Supervisor`` subclass times ``sample_memory``
and calls the original: an observer, not a code path); the table shows them per run. So does the CPU every *other*
process of the machine used during each run (``/proc/stat`` busy time minus this bench's process and the runner's
group, in cores; ``others_cores_max`` in the JSON) and the hypervisor's steal time: the runner's threads use every
CPU, so on a shared machine another busy process slows a run by far more than its own share (llama.cpp threads wait
for each other at every step), and those columns say which runs to distrust.

Statistics: p50 and p99 are ``statistics.quantiles(samples, n=100, method="inclusive")`` (linear interpolation
between order statistics). On a shared machine a run can be slowed by whatever else runs there: read the per-run
table before trusting a ratio.

Runner records and runner logs go to a private temporary ``TETHER_RUNTIME_DIR`` / ``TETHER_LOG_DIR`` (removed at
the end), so the bench leaves nothing in the user's directories.

``--quick`` (for CI): 20 samples (a detailed sample of the llama.cpp runner takes ~30 ms), one round of 16
llama.cpp tokens and 2,000 debug tokens (``"quick": true``); its figures are only a smoke test.

Run: ``.venv/bin/python bench/memory.py [--quick]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from benchstats import PERCENTILE, emit, fmt, ms, percentile, print_rows, private_tether_dirs
from tether.kernel.pids import group_members
from tether.node.memory import ProcessMemory, node_memory, process_memory, process_status_memory
from tether.node.nvml import GpuUsage
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.protocol import Chunk, EngineSpec, GenerateParams, TaskState, TaskStatus

DEFAULT_INTERVAL_S = SupervisorSettings().memory_interval
AGGRESSIVE_INTERVAL_S = 0.05
TARGET_RATIO = 0.99
PROMPT = "Once upon a time, in a land far away, there lived"  # raw completion: SmolLM2 keeps telling the story
BATCH = 100  # timed calls between two event-loop checkpoints
STOP_TIMEOUT = 5.0
GENERATE_TIMEOUT = 300.0  # one generation, however slow the machine is
MIB = 1 << 20
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
LLAMA = EngineSpec(engine="llama.cpp")
DEBUG = EngineSpec(engine="debug", options={"token_seconds": 0})


class TimedSupervisor(Supervisor):
    """Records when each ``sample_memory`` call ran (it calls the original: an observer, not a change)."""

    def __init__(self, spec: EngineSpec, settings: SupervisorSettings, **kwargs: Any) -> None:
        super().__init__(spec, settings, **kwargs)
        self.samples: list[tuple[float, float]] = []

    async def sample_memory(self) -> ProcessMemory | None:
        began = time.perf_counter()
        try:
            return await super().sample_memory()
        finally:
            self.samples.append((began, time.perf_counter()))


# --------------------------------------------------------------------------------------------------------------
# Sample cost
# --------------------------------------------------------------------------------------------------------------


async def time_calls(call: Callable[[], object], n: int) -> list[float]:
    """µs per call of ``call()``, ``n`` times, in batches with an event-loop checkpoint between them."""
    out: list[float] = []
    clock = time.perf_counter_ns
    while len(out) < n:
        for _ in range(min(BATCH, n - len(out))):
            began = clock()
            call()
            out.append((clock() - began) / 1000.0)
        await anyio.sleep(0)
    return out


async def time_group_samples(sup: Supervisor, n: int) -> list[float]:
    out: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(n):
        began = clock()
        await sup.sample_memory()
        out.append((clock() - began) / 1000.0)
    return out


@dataclass
class Costs:
    llama_us: list[float] = field(default_factory=list)  # the footprint sample (status counters)
    llama_detailed_us: list[float] = field(default_factory=list)  # smaps_rollup
    debug_us: list[float] = field(default_factory=list)
    group_us: list[float] = field(default_factory=list)
    node_us: list[float] = field(default_factory=list)
    node_no_nvml_us: list[float] = field(default_factory=list)
    llama: ProcessMemory | None = None  # the llama.cpp runner alone
    llama_group: ProcessMemory | None = None  # its whole group (sup.footprint)
    debug: ProcessMemory | None = None
    gpu: GpuUsage | None = None


async def measure_costs(n: int) -> Costs:
    costs = Costs()
    async with Supervisor(LLAMA, SupervisorSettings(memory_interval=0, stop_timeout=STOP_TIMEOUT)) as sup:
        await sup.ready()
        pid = sup.pid
        assert pid is not None
        costs.llama = process_memory(pid)
        costs.llama_us = await time_calls(lambda: process_status_memory(pid), n)
        costs.llama_detailed_us = await time_calls(lambda: process_memory(pid), n)
        await sup.sample_memory()  # the first one asks NVML once; later ones remember its answer
        costs.group_us = await time_group_samples(sup, n)
        costs.llama_group = sup.footprint
    async with Supervisor(DEBUG, SupervisorSettings(memory_interval=0, stop_timeout=STOP_TIMEOUT)) as sup:
        await sup.ready()
        pid = sup.pid
        assert pid is not None
        costs.debug = process_memory(pid)
        costs.debug_us = await time_calls(lambda: process_status_memory(pid), n)
    costs.gpu = GpuUsage.snapshot()
    gpu = costs.gpu
    costs.node_us = await time_calls(node_memory, n)
    costs.node_no_nvml_us = await time_calls(lambda: node_memory(gpu=gpu), n)
    return costs


# --------------------------------------------------------------------------------------------------------------
# Sampler overhead
# --------------------------------------------------------------------------------------------------------------


def _machine_cpu() -> tuple[int, int]:
    """(busy, steal) clock ticks of all CPUs since boot, from /proc/stat (busy: user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _process_cpu(pids: Sequence[int]) -> int:
    """utime + stime clock ticks of ``pids`` (those that still exist)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


@dataclass
class Run:
    engine: str
    interval: float  # 0: sampler off
    round: int
    tokens: int = 0  # all tokens of the completion
    seconds: float = float("nan")  # first chunk -> last chunk
    rate: float = float("nan")  # tokens after the first chunk / seconds
    samples: int = 0  # sampler samples that began during the generation
    sample_us: list[float] = field(default_factory=list)  # their durations
    others_cores: float = float("nan")  # CPU used by every other process on the machine, in cores, during the run
    steal_cores: float = float("nan")  # CPU the hypervisor took from this VM, in cores, during the run


async def generation_run(spec: EngineSpec, interval: float, params: GenerateParams, index: int) -> Run:
    run = Run(spec.engine, interval, index)
    async with TimedSupervisor(spec, SupervisorSettings(memory_interval=interval, stop_timeout=STOP_TIMEOUT)) as sup:
        await sup.ready()
        assert sup.process is not None
        ours = [os.getpid(), *group_members(sup.process.pgid)]
        began, (busy0, steal0), ours0 = time.perf_counter(), _machine_cpu(), _process_cpu(ours)
        handle = await sup.generate(params)
        first = last = None
        first_tokens = 0
        final: TaskStatus | None = None
        with anyio.fail_after(GENERATE_TIMEOUT):
            async for event in handle:
                if isinstance(event, Chunk):
                    now = time.perf_counter()
                    if first is None:
                        first, first_tokens = now, event.tokens
                    last = now
                    run.tokens += event.tokens
                elif isinstance(event, TaskStatus) and event.state.terminal:
                    final = event
        (busy1, steal1), ours1, wall = _machine_cpu(), _process_cpu(ours), time.perf_counter() - began
        run.others_cores = max(0, (busy1 - busy0) - (ours1 - ours0)) * TICK_S / wall
        run.steal_cores = (steal1 - steal0) * TICK_S / wall
        if final is None or final.state is not TaskState.COMPLETE:
            raise RuntimeError(f"{spec.engine} generation did not complete: {final}")
    if first is not None and last is not None and last > first:
        run.seconds = last - first
        run.rate = (run.tokens - first_tokens) / run.seconds
        during = [(b, e) for b, e in sup.samples if first <= b <= last]
        run.samples = len(during)
        run.sample_us = [(e - b) * 1e6 for b, e in during]
    return run


async def overhead(spec: EngineSpec, params: GenerateParams, rounds: int) -> list[Run]:
    configs = [0.0, AGGRESSIVE_INTERVAL_S, DEFAULT_INTERVAL_S]
    runs = []
    for r in range(rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for interval in order:
            runs.append(await generation_run(spec, interval, params, r))
    return runs


@dataclass
class Overhead:
    off: float
    fast: float
    default: float
    ratio: float
    ratio_default: float
    pair_ratio: float  # median of the per-round ratios (fast / off)
    fast_samples: float  # median samples per generation at the aggressive interval
    fast_busy: float  # median share of the generation's wall time spent inside samples, aggressive interval
    default_busy: float  # the same at the default interval


def summarize(runs: Sequence[Run]) -> Overhead:
    def rates(interval: float) -> list[float]:
        return [r.rate for r in runs if r.interval == interval and r.rate == r.rate]

    def med(values: Sequence[float]) -> float:
        return statistics.median(values) if values else float("nan")

    def busy(interval: float) -> list[float]:
        """Time inside samples / generation time: what the sampler costs, measured without the run-to-run noise
        of tokens/s (the samples run in the event loop, so this is time the loop was not streaming tokens)."""
        return [sum(r.sample_us) / (r.seconds * 1e6) for r in runs if r.interval == interval and r.seconds > 0]

    off, fast, default = (med(rates(i)) for i in (0.0, AGGRESSIVE_INTERVAL_S, DEFAULT_INTERVAL_S))
    by_round: dict[int, dict[float, float]] = {}
    for r in runs:
        by_round.setdefault(r.round, {})[r.interval] = r.rate
    pairs = [v[AGGRESSIVE_INTERVAL_S] / v[0.0] for v in by_round.values() if v.get(0.0) and AGGRESSIVE_INTERVAL_S in v]
    return Overhead(
        off=off,
        fast=fast,
        default=default,
        ratio=fast / off if off > 0 else float("nan"),
        ratio_default=default / off if off > 0 else float("nan"),
        pair_ratio=med(pairs),
        fast_samples=med([float(r.samples) for r in runs if r.interval == AGGRESSIVE_INTERVAL_S]),
        fast_busy=med(busy(AGGRESSIVE_INTERVAL_S)),
        default_busy=med(busy(DEFAULT_INTERVAL_S)),
    )


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------


def _mib(n: int | None) -> float:
    return float("nan") if n is None else n / MIB


def _interval_label(interval: float) -> str:
    return "off" if interval == 0 else f"every {interval:g} s"


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    costs = await measure_costs(args.samples)
    costs_s = time.monotonic() - began
    began = time.monotonic()
    llama_runs = await overhead(LLAMA, GenerateParams(prompt=PROMPT, max_tokens=args.max_tokens), args.pairs)
    llama_s = time.monotonic() - began
    began = time.monotonic()
    debug_runs = await overhead(DEBUG, GenerateParams(prompt=PROMPT, max_tokens=args.debug_tokens), args.pairs)
    debug_s = time.monotonic() - began
    llama, debug = summarize(llama_runs), summarize(debug_runs)
    gpu = costs.gpu.reason if costs.gpu is not None and not costs.gpu.available else "available"

    rss = _mib(costs.llama.rss if costs.llama else None)
    debug_rss = _mib(costs.debug.rss if costs.debug else None)
    print(
        f"Sample cost, {args.samples} calls each ({costs_s:.1f} s){' (quick)' if args.quick else ''}; "
        f"llama.cpp runner RSS {fmt(rss)} MiB, debug runner RSS {fmt(debug_rss)} MiB; GPU: {gpu}"
    )
    cost_rows = [
        ("process_status_memory(pid), llama.cpp runner", costs.llama_us),
        ("process_memory(pid) (smaps), llama.cpp runner", costs.llama_detailed_us),
        ("process_status_memory(pid), debug runner", costs.debug_us),
        ("await sup.sample_memory(), llama.cpp group", costs.group_us),
        ("node_memory()", costs.node_us),
        ("node_memory(gpu=snapshot): no NVML attempt", costs.node_no_nvml_us),
    ]
    print_rows(
        ("one sample (µs)", "n", "p50", "p99", "max", "µs/MiB RSS"),
        [
            (
                label,
                str(len(s)),
                fmt(percentile(s, 50)),
                fmt(percentile(s, 99)),
                fmt(max(s, default=float("nan"))),
                fmt(percentile(s, 50) / rss) if "llama" in label and "pid" in label else "",
            )
            for label, s in cost_rows
        ],
    )
    print(f"percentiles: {PERCENTILE}")
    print()
    print(
        f"Sampler overhead: {args.pairs} round(s) of off / every {AGGRESSIVE_INTERVAL_S:g} s / every "
        f"{DEFAULT_INTERVAL_S:g} s (default); llama.cpp {args.max_tokens} tokens ({llama_s:.1f} s), debug "
        f"token_seconds=0 {args.debug_tokens} tokens ({debug_s:.1f} s)"
    )
    print_rows(
        ("engine", "round", "sampler", "tokens", "s", "tokens/s", "samples", "sample p50 µs", "others", "steal"),
        [
            (
                r.engine,
                str(r.round),
                _interval_label(r.interval),
                str(r.tokens),
                f"{r.seconds:.3f}",
                fmt(r.rate),
                str(r.samples),
                fmt(percentile(r.sample_us, 50)),
                fmt(r.others_cores),
                fmt(r.steal_cores),
            )
            for r in llama_runs + debug_runs
        ],
    )
    print(
        "samples: the sampler's samples during the generation (and their p50 duration); others: CPU cores used by "
        "every other process of the machine meanwhile; steal: cores the hypervisor took"
    )
    print()
    print_rows(
        ("median tokens/s", "off", f"every {AGGRESSIVE_INTERVAL_S:g} s", "ratio", "per-round", "default", "ratio"),
        [
            (
                name,
                fmt(o.off),
                fmt(o.fast),
                f"{o.ratio:.3f}",
                f"{o.pair_ratio:.3f}",
                fmt(o.default),
                f"{o.ratio_default:.3f}",
            )
            for name, o in (("llama.cpp", llama), ("debug, token_seconds=0", debug))
        ],
    )

    def r3(x: float) -> float | None:
        return None if x != x else round(x, 3)

    meets = bool(llama.ratio >= TARGET_RATIO)  # nan compares False
    result: dict[str, Any] = {
        "bench": "memory",
        "footprint_sample_p50_us": ms(percentile(costs.llama_us, 50)),
        "footprint_sample_p99_us": ms(percentile(costs.llama_us, 99)),
        "detailed_sample_p50_us": ms(percentile(costs.llama_detailed_us, 50)),
        "detailed_sample_p99_us": ms(percentile(costs.llama_detailed_us, 99)),
        "debug_footprint_sample_p50_us": ms(percentile(costs.debug_us, 50)),
        "debug_footprint_sample_p99_us": ms(percentile(costs.debug_us, 99)),
        "group_sample_p50_us": ms(percentile(costs.group_us, 50)),
        "group_sample_p99_us": ms(percentile(costs.group_us, 99)),
        "node_sample_p50_us": ms(percentile(costs.node_us, 50)),
        "node_sample_p99_us": ms(percentile(costs.node_us, 99)),
        "node_sample_without_nvml_p50_us": ms(percentile(costs.node_no_nvml_us, 50)),
        "tokens_per_s_without_sampling": ms(llama.off),
        "tokens_per_s_with_sampling": ms(llama.fast),
        "tokens_per_s_default_interval": ms(llama.default),
        "ratio": r3(llama.ratio),
        "ratio_per_round_median": r3(llama.pair_ratio),
        "ratio_default_interval": r3(llama.ratio_default),
        "sampling_interval_s": AGGRESSIVE_INTERVAL_S,
        "sampler_busy_fraction": round(llama.fast_busy, 5),
        "sampler_busy_fraction_default_interval": round(llama.default_busy, 6),
        "default_interval_s": DEFAULT_INTERVAL_S,
        "samples_per_generation": llama.fast_samples,
        "debug_tokens_per_s_without_sampling": ms(debug.off),
        "debug_tokens_per_s_with_sampling": ms(debug.fast),
        "debug_ratio": r3(debug.ratio),
        "debug_ratio_per_round_median": r3(debug.pair_ratio),
        "debug_ratio_default_interval": r3(debug.ratio_default),
        "others_cores_max": r3(max((r.others_cores for r in llama_runs + debug_runs), default=float("nan"))),
        "target_ratio": TARGET_RATIO,
        "meets_target": meets,
        "runner_rss_mib": ms(rss),
        "runner_footprint_mib": ms(_mib(costs.llama_group.footprint if costs.llama_group else None)),
        "debug_runner_rss_mib": ms(debug_rss),
        "gpu": gpu,
        "samples": args.samples,
        "rounds": args.pairs,
        "max_tokens": args.max_tokens,
        "debug_tokens": args.debug_tokens,
        "percentile": PERCENTILE,
        "costs_wall_s": round(costs_s, 1),
        "llama_wall_s": round(llama_s, 1),
        "debug_wall_s": round(debug_s, 1),
        "quick": bool(args.quick),
    }
    print(
        f"llama.cpp tokens/s with sampling every {AGGRESSIVE_INTERVAL_S:g} s / without: {result['ratio']} "
        f"(target >= {TARGET_RATIO}: {'met' if meets else 'NOT met'}); at the default {DEFAULT_INTERVAL_S:g} s: "
        f"{result['ratio_default_interval']}; debug engine: {result['debug_ratio']}"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000, help="timed calls per sample kind (default 2000)")
    parser.add_argument("--pairs", type=int, default=5, help="rounds of off / on runs per engine (default 5)")
    parser.add_argument("--max-tokens", type=int, default=256, help="llama.cpp tokens per run (default 256)")
    parser.add_argument("--debug-tokens", type=int, default=200_000, help="debug tokens per run (default 200000)")
    parser.add_argument(
        "--quick", action="store_true", help="20 samples, one round of 16 llama.cpp and 2000 debug tokens (CI)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.pairs, args.max_tokens, args.debug_tokens = 20, 1, 16, 2_000
    if args.samples < 1 or args.pairs < 1 or args.max_tokens < 2 or args.debug_tokens < 2:
        parser.error("--samples and --pairs must be at least 1, --max-tokens and --debug-tokens at least 2")
    with private_tether_dirs("tether-bench-memory-"):
        result = anyio.run(bench, args)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
