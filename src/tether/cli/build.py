"""``tether build deterministic``: compile llama.cpp's batch-invariant build, which ``deterministic`` instances load."""

from __future__ import annotations

import argparse
import sys

from tether.cli.common import EXIT_FAILED, EXIT_OK, fail
from tether.engines.llamacpp import invariant


def command(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        where = invariant.build(force=args.force, log=log)
    except invariant.InvariantBuildFailed as exc:
        return fail(str(exc), EXIT_FAILED)
    print(where)
    return EXIT_OK
