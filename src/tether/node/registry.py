"""Runner records in a private per-user runtime directory, so survivors of dead workers can be found and reaped.

The worker writes one record per runner right after spawning it and removes it once the runner is gone (reaped,
its group killed). A worker that dies hard leaves its records behind: that is the point. Records are only ever a
hint: ``orphans`` trusts a record only while the process it names has the recorded start time and command line.

Where: ``$TETHER_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/tether``, else ``<tmp>/tether-<uid>``; the directory is mode
0700 and must belong to this user, files are 0600.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import psutil

from tether import env
from tether.errors import TetherError

log = logging.getLogger("tether.node.registry")

RUNTIME_DIR_ENV = env.RUNTIME_DIR
START_TIME_TOLERANCE = 0.05  # seconds; start times come from clock ticks (10 ms) and boot time, both exact


class RegistryError(TetherError, OSError):
    """The runtime directory is unusable (not ours, not private, not writable); says which and what to do."""


class RunnerRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker knows about one of its runners, enough to recognise it (and only it) later."""

    pid: int
    start_time: float  # the runner's start, seconds since the epoch (as psutil's create_time)
    pgid: int
    cmdline: list[str]
    worker_pid: int
    worker_start_time: float
    runner_id: str
    engine: str
    model: str | None
    watchdog: bool = True  # False when the runner was started with the orphan watchdog disabled
    cgroup: str | None = None  # the runner's own memory cgroup: it also holds helpers that left the process group
    created: float = msgspec.field(default_factory=time.time)
    version: int = 1


@dataclass(frozen=True)
class RecordFile:
    path: Path
    record: RunnerRecord | None  # None: unreadable or corrupt (stale by definition)
    error: str | None = None


def runtime_dir() -> Path:
    """Where records live (not created here)."""
    override = os.environ.get(RUNTIME_DIR_ENV)
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "tether"
    return Path(tempfile.gettempdir()) / f"tether-{os.getuid()}"


def start_time(pid: int) -> float | None:
    """A process's start time (seconds since the epoch), or None when it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def same_start(a: float, b: float) -> bool:
    return abs(a - b) < START_TIME_TOLERANCE


class Registry:
    """The records of one runtime directory."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or runtime_dir()

    def ensure(self) -> Path:
        """Create the directory (0700) if needed and check it is private to this user."""
        with contextlib.suppress(FileExistsError):
            self.path.mkdir(mode=0o700, parents=True)
        st = os.lstat(self.path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise RegistryError(f"{self.path} is not a directory; remove it or set {RUNTIME_DIR_ENV}")
        if st.st_uid != os.getuid():
            raise RegistryError(
                f"{self.path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
                f"set {RUNTIME_DIR_ENV} to a private directory"
            )
        if st.st_mode & 0o077:
            os.chmod(self.path, 0o700)
        return self.path

    def _file(self, pid: int) -> Path:
        return self.path / f"runner-{pid}.json"

    def add(self, record: RunnerRecord) -> Path:
        """Write ``record`` atomically (a reader never sees half a record) with mode 0600."""
        self.ensure()
        final = self._file(record.pid)
        tmp = self.path / f".{final.name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, msgspec.json.encode(record))
        finally:
            os.close(fd)
        os.replace(tmp, final)
        return final

    def remove(self, pid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._file(pid).unlink()

    def discard(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def records(self) -> list[RecordFile]:
        """Every record file, corrupt ones included (``record`` None, ``error`` says why)."""
        try:
            paths = sorted(self.path.glob("runner-*.json"))
        except OSError:
            return []
        out = []
        for path in paths:
            try:
                out.append(RecordFile(path, msgspec.json.decode(path.read_bytes(), type=RunnerRecord)))
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                out.append(RecordFile(path, None, str(exc)))
        return out


def record_for(
    pid: int,
    cmdline: list[str],
    worker_pid: int,
    runner_id: str,
    engine: str,
    model: str | None,
    watchdog: bool,
    cgroup: Path | None = None,
) -> RunnerRecord:
    """A record for a freshly spawned runner (the runner leads its own group: pgid == pid)."""
    return RunnerRecord(
        pid=pid,
        start_time=start_time(pid) or time.time(),
        pgid=pid,
        cmdline=cmdline,
        worker_pid=worker_pid,
        worker_start_time=start_time(worker_pid) or 0.0,
        runner_id=runner_id,
        engine=engine,
        model=model,
        watchdog=watchdog,
        cgroup=str(cgroup) if cgroup is not None else None,
    )
