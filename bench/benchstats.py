"""What the benchmarks share: one percentile definition, how figures are rounded and printed, and private dirs."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence

import anyio

from tether.models import DefaultModelMissing, default_model_path
from tether.node.output import LOG_DIR_ENV
from tether.node.registry import RUNTIME_DIR_ENV

PERCENTILE = "statistics.quantiles(n=100, method='inclusive')"


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
