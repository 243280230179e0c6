"""``tether chaos``: the randomized fault campaign against a ``tether serve`` it starts itself (see
``tether.chaos``), on the target ``--target`` names. Exit status 0 when every trial kept every promise, 1 when one
broke (each with its replay), 2 when the target cannot run as asked."""

from __future__ import annotations

import argparse
import json
import sys

import anyio

from tether.chaos.campaign import print_progress
from tether.chaos.targets import TargetUnavailable, campaign
from tether.errors import InvalidModel
from tether.models import named_or_file


def command(args: argparse.Namespace) -> int:
    try:
        run = campaign(args.target, args.engine)
        extra: dict[str, object] = {"model": str(named_or_file(args.model))} if args.model is not None else {}
        if args.threads is not None:
            extra["threads"] = args.threads
        if extra and (args.target != "batch" or args.engine != "llama.cpp"):
            raise TargetUnavailable(f"--{'/--'.join(extra)} is for the batch target with --engine llama.cpp")
    except (TargetUnavailable, InvalidModel) as exc:
        print(f"tether chaos: {exc}", file=sys.stderr)
        return 2
    report = anyio.run(
        lambda: run(args.seed, args.trials, only=args.only, progress=print_progress, engine=args.engine, **extra)
    )
    summary = report.summary()
    if not args.json:
        for line in report.table():
            print(line)
        print(
            f"{args.target}: {summary['trials']} trials ({summary['requests']} requests) in {summary['wall_s']:.1f} s: "
            f"{summary['failed_trials']} broke a promise; hung {summary['hung']}, orphans {summary['orphans']}, "
            f"misclassified {summary['misclassified']}, lost requests {summary['lost_requests']}, leaked fds "
            f"{summary['leaked_fds']}, worker RSS growth {summary['worker_rss_growth_mib']:.1f} MiB"
        )
    print(json.dumps(summary), file=sys.stdout)
    return 1 if report.failed else 0
