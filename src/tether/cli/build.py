"""``tether build deterministic``: compile llama.cpp's batch-invariant build, which ``deterministic`` instances load."""

from __future__ import annotations

import argparse
import sys

from tether.cli.common import EXIT_FAILED, EXIT_OK, fail
from tether.engines import llamacpp_invariant


def command(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        where = llamacpp_invariant.build(force=args.force, log=log)
    except llamacpp_invariant.InvariantBuildFailed as exc:
        return fail(str(exc), EXIT_FAILED)
    print(where)
    return EXIT_OK
