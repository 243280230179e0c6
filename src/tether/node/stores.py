"""Where state that outlives a runner lives (``EngineSpec.store``: the llama.cpp prompt cache's saved sequences,
which a resumed request's new runner restores instead of prefilling them again): a directory per instance under
this worker's root on tmpfs, ``/dev/shm/tether-store-<pid namespace>-<worker pid>-<start ticks>``.

Worker side. Its bytes are memory nobody's process counts (tmpfs pages live on after the runner that wrote them),
so the worker counts them (``size``): in the instance's memory, what evicting it frees and the figures it serves. A
store goes with its instance (an unload frees it), the root with the worker, and a hard-killed worker's root is
removed by the next worker to start (``sweep``), as its runners' cgroups are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from tether.kernel.pids import proc_stat

log = logging.getLogger("tether.node.stores")

BASE = Path("/dev/shm")
PREFIX = "tether-store-"


def _namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]") or "0"
    except OSError:
        return "0"


def root() -> Path | None:
    """This worker's root, or None where there is no tmpfs to keep it on."""
    if not BASE.is_dir() or not os.access(BASE, os.W_OK):
        return None
    stat = proc_stat(os.getpid())
    ticks = stat.start_ticks if stat is not None else 0
    return BASE / f"{PREFIX}{_namespace()}-{os.getpid()}-{ticks}"


def directory(instance: str) -> Path | None:
    """``instance``'s store (made by the runner that first saves into it)."""
    base = root()
    return base / instance if base is not None else None


def size(path: Path | None) -> int:
    """Bytes its files hold (allocated, as tmpfs charges them)."""
    if path is None:
        return 0
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def remove(path: Path | None) -> None:
    """Free a store (its instance unloaded or gone, or the worker ending)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def release() -> None:
    """Remove this worker's root once its instances' stores are gone (another fleet in this process may still use
    it: then it stays, and goes with the last)."""
    base = root()
    if base is not None:
        with contextlib.suppress(OSError):
            base.rmdir()


def sweep() -> list[Path]:
    """Remove the roots of dead workers of this pid namespace (a hard-killed worker cannot remove its own)."""
    removed = []
    namespace = _namespace()
    for path in BASE.glob(f"{PREFIX}{namespace}-*"):
        try:
            pid, ticks = (int(part) for part in path.name.removeprefix(f"{PREFIX}{namespace}-").split("-"))
        except ValueError:
            continue
        stat = proc_stat(pid)
        if stat is None or stat.state in ("Z", "X") or stat.start_ticks != ticks:
            held = size(path) + sum(size(child) for child in path.iterdir() if child.is_dir())
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed the prompt store %s of a dead worker (%d bytes)", path, held)
            removed.append(path)
    return removed
