"""A campaign: many trials against servers the campaign starts, a table per attack and phase, one JSON summary.

The shared server serves every trial but the worker attacks (each of those kills or stops a server of its own).
Its fd count and RSS are read after a warm-up trial and again at the end: what the trials leaked shows there.
"""

from __future__ import annotations

import collections
import functools
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from tether.chaos.plan import ATTACKS, PHASES, WARM_UP, Only, Trial, plan
from tether.chaos.target import Target
from tether.chaos.trial import TrialResult, run_alone, run_on

MiB = 1 << 20


@dataclass
class Report:
    seed: int
    target: str = "single"
    extra: dict[str, Any] = field(default_factory=dict)  # a target's own figures, added to the summary
    results: list[TrialResult] = field(default_factory=list)
    fds_before: int | None = None
    fds_after: int | None = None
    fds_gained: list[str] = field(default_factory=list)  # what each fd above the baseline is: the leak, named
    rss_before: int | None = None
    rss_after: int | None = None
    wall_s: float = 0.0

    @property
    def failed(self) -> list[TrialResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> dict[str, Any]:
        results = self.results
        leaked = max(0, (self.fds_after or 0) - (self.fds_before or 0))
        growth = ((self.rss_after or 0) - (self.rss_before or 0)) / MiB
        return {
            "bench": "chaos",
            "trials": len(results),
            "failed_trials": len(self.failed),
            "hung": sum(r.hung for r in results),
            "orphans": sum(r.orphans for r in results),
            "misclassified": sum(r.misclassified for r in results),
            "lost_requests": sum(r.lost for r in results),
            "other_problems": sum(
                len(r.problems) - r.hung - r.orphans - r.misclassified - r.lost for r in self.results
            ),
            "requests": sum(len(r.outcomes) for r in results),
            "resumed_requests": sum(1 for r in results for o in r.outcomes if o.resumed),
            "by_attack": self.by_attack(),
            "leaked_fds": leaked,
            "worker_fds_before": self.fds_before,
            "worker_fds_after": self.fds_after,
            **({"fds_gained": self.fds_gained} if leaked else {}),
            "worker_rss_growth_mib": round(growth, 2),
            "seed": self.seed,
            "wall_s": round(self.wall_s, 1),
            "trial_p50_s": round(_median([r.seconds for r in results]), 3),
            "target": self.target,
            **self.extra,
        }

    def by_attack(self) -> dict[str, dict[str, int]]:
        """Per attack, how its requests ended: resumed (completed on a new runner after a death), completed, failed
        (with the cause, and why it did not resume), and anything else."""
        counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for r in self.results:
            for o in r.outcomes:
                counts[r.trial.attack.name]["resumed" if o.resumed else o.kind] += 1
        return {attack: dict(sorted(c.items())) for attack, c in sorted(counts.items())}

    def table(self) -> list[str]:
        cells: dict[tuple[str, str], list[TrialResult]] = collections.defaultdict(list)
        for r in self.results:
            cells[(r.trial.attack.name, r.trial.phase)].append(r)
        phases = sorted({p for _, p in cells}, key=functools.partial(_order, _PHASE_ORDER))
        attacks = sorted({a for a, _ in cells}, key=functools.partial(_order, _ATTACK_ORDER))
        width = max(len(a) for a in attacks) if attacks else 6
        lines = [f"{'attack':<{width}}  " + "  ".join(f"{p:>10}" for p in phases) + "      ok"]
        for attack in attacks:
            row = []
            for phase in phases:
                got = cells.get((attack, phase), [])
                row.append(f"{sum(r.ok for r in got)}/{len(got)}" if got else "-")
            total = [r for (a, _), rs in cells.items() if a == attack for r in rs]
            lines.append(
                f"{attack:<{width}}  "
                + "  ".join(f"{c:>10}" for c in row)
                + f"  {sum(r.ok for r in total)}/{len(total)}"
            )
        return lines


async def _settled_fds(target: Target, baseline: dict[int, str] | None, bound: float = 5.0) -> dict[int, str] | None:
    """The server's fds once the campaign's own connections are closed on its side too (within ``bound`` s): what
    stays above the baseline after that is leaked."""
    with anyio.move_on_after(bound):
        while (now := target.fd_links()) is not None and baseline is not None and len(now) > len(baseline):
            await anyio.sleep(0.05)
    return target.fd_links()


def gained(before: dict[int, str], after: dict[int, str]) -> list[str]:
    """The fds in ``after`` that ``before`` did not have (or had as something else), each as ``fd: what``."""
    return [f"{fd}: {link}" for fd, link in sorted(after.items()) if before.get(fd) != link]


def _median(values: list[float]) -> float:
    values = sorted(values)
    if not values:
        return 0.0
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _order(known: list[str], name: str) -> tuple[int, str]:
    """Known names in their declared order, a target's own after them by name."""
    return (known.index(name) if name in known else len(known), name)


_PHASE_ORDER = list(PHASES)
_ATTACK_ORDER = [a.name for a in ATTACKS]


async def drive(
    report: Report,
    target: Target,
    warm: Trial,
    trials: list[Trial],
    run: Callable[[Trial], Awaitable[TrialResult]],
    progress: Callable[[TrialResult], None] | None = None,
) -> None:
    """Every target's loop: a warm-up trial, the shared server's fds and RSS as the baseline, the trials (``run``
    each), then the figures again. The shared server dying is no trial's failure but the campaign's end."""
    await run(warm)  # the first instance and streams allocate what later ones reuse
    before = target.fd_links()
    report.fds_before, report.rss_before = (None if before is None else len(before)), target.rss()
    for trial in trials:
        result = await run(trial)
        report.results.append(result)
        if progress is not None:
            progress(result)
        if target.proc.poll() is not None:
            raise RuntimeError(f"the shared server died during trial {trial.index}: {trial.replay()}")
    after = await _settled_fds(target, before)
    report.fds_after = None if after is None else len(after)
    if before is not None and after is not None and len(after) > len(before):
        report.fds_gained = gained(before, after)
    report.rss_after = target.rss()


async def run_campaign(
    seed: int,
    trials: int,
    *,
    only: Only = None,
    progress: Callable[[TrialResult], None] | None = None,
    engine: str = "debug",
) -> Report:
    """Run the campaign ``seed`` (or only its trial ``only``); every server it starts is stopped before it returns."""
    if engine != "debug":
        raise ValueError(f"the single target runs the debug engine only (its faults are injected), not {engine!r}")
    report = Report(seed)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tether-chaos-") as tmp:
        workdir = Path(tmp)
        target = await anyio.to_thread.run_sync(Target, workdir / "shared")
        try:

            async def run(trial: Trial) -> TrialResult:
                if trial.attack.worker_signal is not None:
                    return await run_alone(trial, workdir)
                return await run_on(target, trial)

            warm = Trial(seed, -1, WARM_UP, "generating", 8, 1, 0.0, 8)
            await drive(report, target, warm, plan(seed, trials, only), run, progress)
        finally:
            await anyio.to_thread.run_sync(target.stop)
    report.wall_s = time.monotonic() - began
    return report


def print_progress(result: TrialResult, *, stream: Any = sys.stderr) -> None:
    t = result.trial
    if result.ok:
        return
    print(
        f"trial {t.index} {t.label} broke {len(result.problems)} invariant(s) in {result.seconds:.2f} s:", file=stream
    )
    for problem in result.problems:
        print(f"  - {problem}", file=stream)
    print(f"  replay: {t.replay()}", file=stream, flush=True)
