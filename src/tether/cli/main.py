"""The ``tether`` command's entry point: parse, set up logging, run the command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from tether.cli.parser import build_parser


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    """The command's module, imported only when it runs (``tether orphans`` never imports the HTTP stack)."""
    if name == "run":
        from tether.cli.run import command
    elif name == "serve":
        from tether.cli.serve import command
    elif name == "status":
        from tether.cli.status import command
    elif name == "chaos":
        from tether.cli.chaos import command
    elif name == "pull":
        from tether.cli.pull import command
    elif name == "build":
        from tether.cli.build import command
    else:
        from tether.cli.orphans import command
    return command


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The command reports causes itself; logs are for -v (runner output lines need -vv).
    level = logging.CRITICAL + 1 if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _command(args.command)(args)


if __name__ == "__main__":
    sys.exit(main())
