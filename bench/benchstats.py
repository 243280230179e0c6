"""What the benchmarks share: one percentile definition, how figures are rounded and printed, private dirs, and how
a run's last line is printed and kept.

Every benchmark prints its figures as one JSON object, its last line, with ``emit``. Run it with
``TETHER_BENCH_RECORD=1`` in the environment and ``emit`` also appends the run to ``bench/results/<bench>.jsonl`` as a
record: ``{"id", "bench", "commit", "dirty", "date", "machine", "command", "provenance", "result"}`` (``id`` the bench
and the UTC time, ``commit`` ``git rev-parse HEAD`` and ``dirty`` whether tracked files differ from it, ``date`` UTC
ISO, ``machine`` the CPU model, CPUs, RAM and kernel read from /proc, ``command`` the argv, ``result`` the printed
object). The docs' benchmarks page and the README's figures are drawn from those files (``docs/gen/figures.py``), so
a figure is cited by its record's id, never pasted.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio

from tether.env import flag
from tether.models import DefaultModelMissing, default_model_path
from tether.node.output import LOG_DIR_ENV
from tether.node.registry import RUNTIME_DIR_ENV

PERCENTILE = "statistics.quantiles(n=100, method='inclusive')"
RECORD_ENV = "TETHER_BENCH_RECORD"  # 1: emit() also appends the run to bench/results/<bench>.jsonl
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def percentile(samples: Sequence[float], pct: int) -> float:
    """The ``pct``-th percentile, ``statistics.quantiles(method="inclusive")``; nan without samples."""
    if not samples:
        return float("nan")
    if len(samples) == 1:
        return float(samples[0])
    return statistics.quantiles(samples, n=100, method="inclusive")[pct - 1]


def ms(value: float) -> float | None:
    """Rounded for the JSON line; nan (no samples) becomes null."""
    return None if value != value else round(value, 2)


def fmt(value: float) -> str:
    """For the printed table; nan (no samples) becomes "-"."""
    return "-" if value != value else f"{value:,.2f}"


@contextlib.contextmanager
def private_tether_dirs(prefix: str) -> Iterator[None]:
    """Point the runner registry and runner logs at a temporary directory for the run (the runners inherit it), so
    a benchmark that SIGKILLs workers leaves nothing in the user's directories."""
    saved = {name: os.environ.get(name) for name in (RUNTIME_DIR_ENV, LOG_DIR_ENV)}
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for name in saved:
            path = os.path.join(tmp, name.lower())
            os.mkdir(path, 0o700)
            os.environ[name] = path
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def llama_unavailable() -> str | None:
    """Why the parts of a benchmark that run the default model on llama.cpp cannot run here, or None."""
    try:
        default_model_path()
    except DefaultModelMissing as exc:
        return str(exc)
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed: run `make install` (or `pip install 'tether[llama]'`)"
    return None


def print_rows(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> None:
    """A plain table: the first ``left`` columns left-aligned, the rest right-aligned, each as wide as its widest."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    for row in (headers, *rows):
        print(
            "  ".join(v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        )


async def closed_loop(concurrency: int, per_client: int, send: Callable[[int, int], Awaitable[None]]) -> float:
    """``concurrency`` clients, each awaiting ``send(client, j)`` for its requests ``j`` < ``per_client`` back to
    back (a closed loop); returns the wall seconds from the first send to the last answer."""

    async def client_loop(i: int) -> None:
        for j in range(per_client):
            await send(i, j)

    began = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(concurrency):
            tg.start_soon(client_loop, i)
    return time.perf_counter() - began


class BenchFailed(RuntimeError):
    """Something a bench needs did not happen (within its bound): a server that did not start, a refused request."""


def describe(exc: BaseException) -> str:
    """One line for an exception, the first of a task group's included."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


def emit(result: dict[str, Any]) -> None:
    """Print ``result`` as the run's last line (``json.dumps``, as every bench always printed it) and, with
    ``TETHER_BENCH_RECORD=1``, append it to ``bench/results/<bench>.jsonl`` first (saying where on stderr, so stdout's
    last line stays the object)."""
    if flag(RECORD_ENV, False):
        rec = record(result)
        path = RESULTS / f"{result['bench']}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        print(f"recorded as {rec['id']} in {_from_root(str(path))}", file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)


def record(result: dict[str, Any]) -> dict[str, Any]:
    """The record of this run: what was measured, on which code, when, where and by which command."""
    now = datetime.datetime.now(datetime.UTC)
    head, dirty = _git_head()
    return {
        "id": f"{result['bench']}-{now:%Y%m%dT%H%M%SZ}",
        "bench": result["bench"],
        "commit": head,
        "dirty": dirty,
        "date": now.isoformat(timespec="seconds"),
        "machine": machine(),
        "command": shlex.join([_from_root(sys.executable), *(_from_root(a) for a in sys.argv[:1]), *sys.argv[1:]]),
        "provenance": f"recorded by the bench itself ({RECORD_ENV}=1)",
        "result": result,
    }


def machine() -> str:
    """CPU model, CPUs this process may use, RAM and kernel, from /proc: e.g. ``AMD EPYC, 2 CPUs, 23.5 GiB RAM,
    Linux 6.18.44``."""

    def field(path: str, name: str) -> str | None:
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
        return None

    cpu = field("/proc/cpuinfo", "model name") or "unknown CPU"
    mem_kib = (field("/proc/meminfo", "MemTotal") or "0 kB").split()[0]
    try:
        kernel = Path("/proc/sys/kernel/osrelease").read_text().strip()
    except OSError:
        kernel = "unknown"
    cpus = len(os.sched_getaffinity(0))
    return f"{cpu}, {cpus} CPUs, {int(mem_kib) / (1 << 20):.1f} GiB RAM, Linux {kernel}"


def _git_head() -> tuple[str | None, bool | None]:
    """HEAD's sha and whether tracked files differ from it (None, None outside a git checkout). The results files
    themselves do not count: recording one run after another, uncommitted, must not call the second's tree dirty."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip())


def _from_root(path: str) -> str:
    """``path`` relative to the repository when it lies inside it (``.venv/bin/python``, ``bench/detect.py``)."""
    absolute = Path(path).absolute()
    return str(absolute.relative_to(ROOT)) if absolute.is_relative_to(ROOT) else path
