"""What the commands share: exit codes, the engine options and deadlines a command line sets, reaping at start."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from tether.engines import chat_templates, registry
from tether.errors import TetherError
from tether.node import orphans
from tether.node.hangs import Deadlines
from tether.units import format_bytes

EXIT_OK = 0
EXIT_FAILED = 2  # the runner failed, or the model or engine cannot be used
EXIT_DOES_NOT_FIT = 3
EXIT_CANNOT_BIND = 4  # tether serve: the address is taken or not ours
EXIT_USAGE = 64  # EX_USAGE: the command line is wrong
EXIT_INTERRUPTED = 130


def fail(message: str, code: int = EXIT_FAILED) -> int:
    """Say why the command stops, on stderr, and return its exit status."""
    print(f"tether: {message}", file=sys.stderr)
    return code


class RunnerFlags(Protocol):
    """What ``run``'s namespace and ``serve``'s settings both carry about the runner."""

    @property
    def n_ctx(self) -> int | None: ...
    @property
    def threads(self) -> int | None: ...
    @property
    def parallel(self) -> int | None: ...
    @property
    def prompt_cache_ram(self) -> int | None: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def deterministic(self) -> bool: ...
    @property
    def speculation(self) -> bool: ...
    @property
    def n_gpu_layers(self) -> str | None: ...
    @property
    def gpu(self) -> str | None: ...
    @property
    def gpu_memory_limit(self) -> int | None: ...
    @property
    def deadlines(self) -> Mapping[str, float] | list[tuple[str, float]]: ...
    @property
    def no_reap(self) -> bool: ...
    @property
    def engine(self) -> str: ...


def engine_options(args: RunnerFlags) -> dict[str, object]:
    """The engine options a command line sets (``--n-ctx``, ``--threads``, ``--parallel``, ``--prompt-cache-ram``,
    ``--chat-template``: a file's path made absolute, as the runner reads it; ``--deterministic``,
    ``--speculation``; ``--n-gpu-layers``, ``--gpu``, ``--gpu-memory-limit``), for ``run`` and ``serve`` alike."""
    options: dict[str, object] = {}
    if args.n_ctx is not None:
        options["n_ctx"] = args.n_ctx
    if args.threads is not None:
        options["n_threads"] = args.threads
    if args.parallel is not None:
        options["parallel"] = args.parallel
    if args.prompt_cache_ram is not None:
        options["prompt_cache_ram"] = args.prompt_cache_ram
    if args.chat_template is not None:
        chosen = args.chat_template
        builtin = chosen in chat_templates.BUILTIN
        options["chat_template"] = chosen if builtin else str(Path(chosen).expanduser().absolute())
    if args.deterministic:
        options["deterministic"] = True
    if args.speculation:
        options["speculation"] = True
    if args.n_gpu_layers is not None:
        options["n_gpu_layers"] = args.n_gpu_layers if args.n_gpu_layers == "auto" else int(args.n_gpu_layers)
    if args.gpu is not None:
        options["gpu"] = args.gpu
    if args.gpu_memory_limit is not None:
        options["gpu_memory_limit"] = args.gpu_memory_limit
    return options


def declared_only(options: dict[str, object], engine: str) -> dict[str, object]:
    """The flags' ``options`` that ``engine`` declares: one that is another engine's (the debug engine has no
    ``--threads`` or ``--speculation``) is left out, said on stderr, rather than failing the load. An engine that
    declares no options gets them all (its constructor decides)."""
    try:
        known = registry.resolve(engine).options
    except TetherError:
        return options  # an unknown engine: the instance's check names what is installed
    if not known:
        return options
    dropped = sorted(set(options) - set(known))
    if dropped:
        print(f"tether: the {engine} engine has no option {', '.join(dropped)}: the flag is ignored", file=sys.stderr)
    return {name: value for name, value in options.items() if name in known}


def deadlines_from(args: RunnerFlags) -> Deadlines:
    """The hang deadlines ``--deadline NAME=SECONDS`` (or the settings' ``deadlines``) set, the rest at their
    defaults; ``ValueError`` says what is wrong with a value."""
    return Deadlines(**dict(args.deadlines))


def engine_name(args: RunnerFlags) -> str:
    """The engine ``--engine`` names, as the registry calls it (``InvalidField`` when it names none)."""
    return registry.canonical(args.engine)


def reap_at_start(args: RunnerFlags) -> None:
    """A worker starting: reap the runners dead workers left behind (unless ``--no-reap`` or TETHER_AUTO_REAP=0),
    and say so even without -v."""
    if args.no_reap or not orphans.auto_reap_enabled():
        return
    for result in orphans.reap_at_start():
        state = "reaped" if result.ok else "could not reap"
        print(
            f"tether: {state} orphaned {result.group.label} of dead worker {result.group.worker_pid} "
            f"({len(result.gone)} process{'' if len(result.gone) == 1 else 'es'}): "
            f"freed {format_bytes(result.freed.footprint)}",
            file=sys.stderr,
        )


def table(rows: list[list[str]]) -> list[str]:
    """Rows (the first is the header) as aligned lines."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
