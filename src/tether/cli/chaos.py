"""``tether chaos``: the randomized fault campaign against a ``tether serve`` it starts itself (see
``tether.chaos``). Exit status 0 when every trial kept every promise, 1 when one broke (each with its replay)."""

from __future__ import annotations

import argparse
import json
import sys

import anyio

from tether.chaos.campaign import print_progress, run_campaign


def command(args: argparse.Namespace) -> int:
    report = anyio.run(lambda: run_campaign(args.seed, args.trials, only=args.only, progress=print_progress))
    summary = report.summary()
    if not args.json:
        for line in report.table():
            print(line)
        print(
            f"{summary['trials']} trials ({summary['requests']} requests) in {summary['wall_s']:.1f} s: "
            f"{summary['failed_trials']} broke a promise; hung {summary['hung']}, orphans {summary['orphans']}, "
            f"misclassified {summary['misclassified']}, lost requests {summary['lost_requests']}, leaked fds "
            f"{summary['leaked_fds']}, worker RSS growth {summary['worker_rss_growth_mib']:.1f} MiB"
        )
    print(json.dumps(summary), file=sys.stdout)
    return 1 if report.failed else 0
