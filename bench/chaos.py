"""The fault campaign as a benchmark: ``tether chaos`` over N trials of seed S, its JSON summary as the last line.

Usage: ``.venv/bin/python bench/chaos.py --trials 1000 --seed 0`` (the published figure) or ``--quick`` (20 trials);
``--target batch|models|ranks|cluster`` attacks another target (``--engine llama.cpp``: batch, or ranks, on the default
model).
The baseline a user would otherwise have is no campaign at all: no peer server publishes one, so this benchmark
reports tether's own figures (hung, orphans, misclassified, lost requests, leaked fds, worker RSS growth) and how
long the campaign took, with a table per attack and phase (in the JSON too: ``per_attack``, trials kept / drawn per
attack and moment).
"""

from __future__ import annotations

import argparse
import sys

import anyio

from benchstats import emit
from tether.chaos.campaign import Report, print_progress
from tether.chaos.targets import TARGETS, campaign
from tether.models import named_or_file


def per_attack(report: Report) -> dict[str, dict[str, list[int]]]:
    """Trials kept / drawn per attack and moment (the printed table's cells), for the docs' plot of a recorded run."""
    cells: dict[str, dict[str, list[int]]] = {}
    for result in report.results:
        kept_drawn = cells.setdefault(result.trial.attack.name, {}).setdefault(result.trial.phase, [0, 0])
        kept_drawn[0] += result.ok
        kept_drawn[1] += 1
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 trials (the test suite's check of this script)")
    parser.add_argument("--target", default="single", choices=tuple(TARGETS), help="what to attack (default single)")
    parser.add_argument(
        "--engine",
        default="debug",
        choices=("debug", "llama.cpp"),
        help="the batch or ranks target's engine (default debug; llama.cpp: the default model)",
    )
    parser.add_argument(
        "--model", default=None, metavar="NAME|FILE", help="the batch target's llama.cpp model (default: the built-in)"
    )
    args = parser.parse_args(argv)
    trials = 20 if args.quick else args.trials
    run = campaign(args.target, args.engine)
    extra = {"model": str(named_or_file(args.model))} if args.model else {}
    report = anyio.run(lambda: run(args.seed, trials, progress=print_progress, engine=args.engine, **extra))
    for line in report.table():
        print(line)
    summary = report.summary()
    summary["quick"] = args.quick
    summary["per_attack"] = per_attack(report)
    print(
        f"{summary['trials']} trials, {summary['requests']} requests, {summary['wall_s']:.0f} s "
        f"(p50 {summary['trial_p50_s']:.2f} s a trial): {summary['failed_trials']} broke a promise"
    )
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
