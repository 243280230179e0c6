"""Allocation tracing of a long-running worker (``TETHER_TRACEMALLOC=1``): what it keeps, by traceback.

``bench/soak.py`` starts its worker with tracing on and asks ``POST /v1/debug/tracemalloc`` (``serve/admin``) for a
snapshot at each window's end. Off by default: no route, no cost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import gc
import os
import signal
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, NoReturn

import anyio
import msgspec

from tether import env

# Allocation tracing, for finding what a long-running worker keeps (bench/soak.py): off unless the worker starts with
# TRACEMALLOC on (then ``tether serve`` traces from its first line), and its route exists only then.
TRACEMALLOC = env.TRACEMALLOC
TRACE_FRAMES = 12  # frames kept per allocation: deep enough to get from asyncio/anyio/starlette into tether's code
TRACE_TOP = 20  # growth entries a snapshot's answer lists by default
TRACE_TOP_LIMIT = 200  # and at most
TRACE_TIMEOUT = 120.0  # seconds a snapshot's process may take (100,000 traces: ~5 s on a busy core)
TRACE_POLL = 0.05
ALLOCATOR_STATS_TIMEOUT = 10.0  # seconds the allocators' reading may take (milliseconds, normally)
TASK_FRAMES = 6  # awaiting frames that name where a task waits (innermost first)


def tracing_wanted() -> bool:
    """Whether this worker was started with allocation tracing on (``TETHER_TRACEMALLOC``)."""
    return env.flag(TRACEMALLOC, False)


def start_tracing() -> None:
    """Trace allocations from now on, ``TRACE_FRAMES`` deep (``tether serve`` calls this first, when wanted)."""
    if not tracemalloc.is_tracing():
        tracemalloc.start(TRACE_FRAMES)


class TraceSnapshots:
    """Snapshots of the worker's traced allocations, compared with a baseline: what grew since, by traceback.

    Each is taken by a forked copy of the worker, which writes it (and its comparison) to files in ``directory`` and
    exits: snapshotting 100,000 traces in the worker itself held its event loop for 8 s and left its RSS 40 MiB
    higher (the figure being explained), while the copy costs the worker one ``fork`` (its page tables, a few ms).
    The copy runs no event loop and no thread of the worker's, closes every inherited fd first (runner lifelines,
    the listening socket) and ends by ``os._exit``; it is killed after ``TRACE_TIMEOUT`` s."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.taken = 0
        self._one = anyio.Lock()  # one snapshot at a time: they share their files

    def path(self, which: str) -> Path:
        return self.directory / f"tracemalloc-{os.getpid()}-{which}"

    async def take(self, top: int, rebase: bool) -> dict[str, Any]:
        """A snapshot now (the baseline when it is the first or ``rebase``), and the ``top`` tracebacks whose
        allocations grew most since the baseline, biggest first."""
        async with self._one:
            return await self._take(top, rebase)

    async def _take(self, top: int, rebase: bool) -> dict[str, Any]:
        self.directory.mkdir(parents=True, exist_ok=True)
        base, last, result = self.path("base.pickle"), self.path("last.pickle"), self.path("result.json")
        result.unlink(missing_ok=True)
        self.taken += 1
        began = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the copy: never returns
            _snapshot_child(base, last, result, top, rebase)
        status: int | None = None
        with anyio.move_on_after(TRACE_TIMEOUT):
            while (status := _reaped(pid)) is None:
                await anyio.sleep(TRACE_POLL)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # at once: it was killed
            return {"snapshot": self.taken, "error": f"the snapshot took over {TRACE_TIMEOUT:g} s: killed"}
        tasks = suspended_tasks(top)  # the worker's own, now: a task that never ends holds all it references
        try:
            answer: dict[str, Any] = msgspec.json.decode(result.read_bytes())  # a few KiB
            result.unlink()
        except (OSError, msgspec.DecodeError) as exc:
            return {"snapshot": self.taken, "error": f"the snapshot process exited {status}: no result ({exc})"}
        return {"snapshot": self.taken, "took_s": round(time.monotonic() - began, 3), **answer, **tasks}


def suspended_tasks(top: int) -> dict[str, Any]:
    """The event loop's tasks, counted by where each is suspended (its innermost ``TASK_FRAMES`` awaiting frames): a
    count that grows with traffic is a task that never ends, and the place it waits is why."""
    sites: collections.Counter[tuple[str, ...]] = collections.Counter()
    tasks = asyncio.all_tasks()
    for task in tasks:
        frames: list[str] = []
        awaited: Any = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        sites[tuple(reversed(frames[-TASK_FRAMES:]))] += 1
    return {"tasks": len(tasks), "task_sites": [{"tasks": n, "stack": list(k)} for k, n in sites.most_common(top)]}


def _reaped(pid: int) -> int | None:
    """The exit code of child ``pid`` once it has ended (reaped now; -1: reaped by someone else), else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -1
    return os.waitstatus_to_exitcode(status) if done else None


def _wait_or_kill(pid: int, bound: float) -> None:
    """Wait (blocking: in a forked copy, no event loop) for child ``pid`` at most ``bound`` s, then kill it."""
    deadline = time.monotonic() + bound
    while _reaped(pid) is None:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(TRACE_POLL)


def _snapshot_child(base: Path, last: Path, result: Path, top: int, rebase: bool) -> NoReturn:
    """In the forked copy: snapshot, compare with the baseline (or become it), write ``result`` as JSON, exit."""
    code = 1
    try:
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        allocators = _allocator_stats(result.with_suffix(".allocators"))  # before this copy allocates anything
        traced_before, _ = tracemalloc.get_traced_memory()
        counts = list(gc.get_count())  # the worker's, at the fork: allocations since each generation's last collection
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)  # a finalizer's warning (an unclosed transport, say) is not for the worker's output
        os.dup2(quiet, 2)
        # Cycles the worker's collector has not reached yet are garbage, not growth: collected here (in the copy)
        # the snapshot holds what the worker really keeps, and ``gc_unreachable`` says how much was waiting.
        gc.disable()  # the snapshot allocates enough to set off a collection: the one below is the only one
        with_garbage = tracemalloc.take_snapshot()  # unfiltered: filter_traces took 15 s for 250,000 traces
        gc.set_debug(gc.DEBUG_SAVEALL)
        unreachable = gc.collect()
        kinds = collections.Counter(type(o).__qualname__ for o in gc.garbage)
        errors = collections.Counter(type(o).__qualname__ for o in gc.garbage if isinstance(o, BaseException))
        gc.garbage.clear()
        gc.set_debug(0)
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
        garbage = [d for d in with_garbage.compare_to(snapshot, "traceback") if d.size_diff > 0][:top]
        del with_garbage
        traced, peak = tracemalloc.get_traced_memory()
        answer: dict[str, Any] = {
            "traced_bytes": traced,
            "traced_bytes_with_garbage": traced_before,
            "peak_bytes": peak,
            "gc_unreachable": unreachable,
            "gc_counts": counts,
            "garbage": [_growth(d) for d in garbage],  # where the uncollected cycles were allocated
            "garbage_types": dict(kinds.most_common(top)),
            "garbage_exceptions": dict(errors.most_common(top)),  # a traceback's frames keep a whole request alive
            "baseline": rebase or not base.exists(),
        }
        answer.update(allocators)
        if answer["baseline"]:
            snapshot.dump(str(base))
            answer.update(path=str(base), growth=[])
        else:
            snapshot.dump(str(last))
            stats = [s for s in snapshot.compare_to(tracemalloc.Snapshot.load(str(base)), "traceback") if s.size_diff]
            answer.update(path=str(last), base_path=str(base), growth=[_growth(s) for s in stats[:top]])
        part = result.with_suffix(".part")
        part.write_bytes(msgspec.json.encode(answer))
        part.rename(result)
        code = 0
    finally:
        os._exit(code)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _allocator_stats(scratch: Path) -> dict[str, Any]:
    """The allocators' state at the fork: read by a copy of this copy (pymalloc's needs tracing stopped, and the
    snapshot needs it on), which writes them to ``scratch``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            stats = _malloc_stats()
            tracemalloc.stop()
            stats.update(_pymalloc_stats(scratch.with_suffix(".pymalloc")))
            scratch.write_bytes(msgspec.json.encode(stats))
            code = 0
        finally:
            os._exit(code)
    _wait_or_kill(pid, ALLOCATOR_STATS_TIMEOUT)
    try:
        found: dict[str, Any] = msgspec.json.decode(scratch.read_bytes())
    except (OSError, msgspec.DecodeError):
        return {}
    scratch.unlink()
    return found


def _malloc_stats() -> dict[str, Any]:
    """glibc malloc's heap (``mallinfo2``; the forked copy's is the worker's at the fork, tracemalloc's own tables
    included): RSS that grows beside a flat traced total is placed, as fragmentation or as memory no Python
    allocator handed out."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        return {
            "malloc": {
                "heap_bytes": info.arena,  # the main and thread arenas (sbrk and mmapped arenas)
                "mmapped_bytes": info.hblkhd,  # big blocks, each its own mapping
                "in_use_bytes": info.uordblks,
                "free_bytes": info.fordblks,  # freed but held: fragmentation, or room for the next burst
            }
        }
    return {}


def _pymalloc_stats(scratch: Path) -> dict[str, Any]:
    """pymalloc's arenas and blocks (``sys._debugmallocstats``, written to ``scratch`` through fd 2). It says nothing
    while tracemalloc's hooks wrap the allocator: call it after ``tracemalloc.stop()`` (in the forked copy)."""
    with contextlib.suppress(OSError):
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)  # the worker's stderr is not for this
        sys._debugmallocstats()
        text = scratch.read_text()
        scratch.unlink()
        pymalloc = {}
        for line in text.splitlines():
            name, sep, value = line[2:].partition("=")
            if line.startswith("# ") and sep and value.strip().replace(",", "").isdigit():
                pymalloc[name.strip().replace(" ", "_")] = int(value.strip().replace(",", ""))
        return {"pymalloc": pymalloc}
    return {}


def _growth(diff: tracemalloc.StatisticDiff) -> dict[str, Any]:
    frames = [f"{frame.filename}:{frame.lineno}" for frame in reversed(diff.traceback)]  # innermost first
    return {"size_diff": diff.size_diff, "count_diff": diff.count_diff, "size": diff.size, "traceback": frames}
