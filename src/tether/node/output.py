"""A runner's stdout and stderr: split into lines, kept in a bounded per-life tail, logged, and written to files.

The tail is the evidence a cause quotes (faulthandler stacks, engine error lines), so it belongs to one runner life
and is never carried over. The files are for people: size-bounded and rotated, so a runner that floods its stderr
cannot fill the disk. Each read is written in one go with one timestamp (``logging``'s rotating handler cost 26 µs
a line: a flood of 20,000 lines held the worker's event loop for half a second). They live in ``$TETHER_LOG_DIR``,
else ``$XDG_STATE_HOME/tether/logs``, else ``~/.local/state/tether/logs``, one ``runner-<id>.log`` per runner (plus
``.1`` ... backups).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from pathlib import Path

from tether import env

LOG_DIR_ENV = env.LOG_DIR
DEFAULT_MAX_BYTES = 10 << 20
DEFAULT_BACKUPS = 3

log = logging.getLogger("tether.runner.output")


def default_log_dir() -> Path:
    override = os.environ.get(LOG_DIR_ENV)
    if override:
        return Path(override)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "tether" / "logs"


class RotatingLog:
    """Lines appended to ``path`` in batches, rotated to ``.1`` ... ``.N`` once a file would exceed ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._file = path.open("ab")
        self._size = self._file.tell()

    def write(self, lines: list[str]) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d} "
        data = "".join(f"{stamp}{line}\n" for line in lines).encode("utf-8", "replace")
        while data:
            room = self.max_bytes - self._size
            if room <= 0 or (len(data) > room and self._size > 0):
                self._rotate()
                room = self.max_bytes
            cut = len(data) if len(data) <= room else data.rfind(b"\n", 0, room) + 1 or room
            self._file.write(data[:cut])
            self._size += cut
            data = data[cut:]
        self._file.flush()

    def _rotate(self) -> None:
        self._file.close()
        if self.backups > 0:  # without backups the file just starts again
            for i in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = self.path.open("wb")
        self._size = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()


class OutputCapture:
    """Feed it raw bytes as they are read; it keeps whole lines (a last line without a newline included)."""

    def __init__(
        self,
        runner_id: str,
        *,
        tail_lines: int = 200,
        log_dir: Path | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
    ) -> None:
        self.runner_id = runner_id
        self.lines: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.count = 0  # lines seen in this life, so a caller can ask for those written since a moment (``since``)
        self._partial = b""
        self._file: RotatingLog | None = None
        self.path: Path | None = None
        if log_dir is not None:
            try:
                log_dir.mkdir(parents=True, exist_ok=True)
                self.path = log_dir / f"runner-{runner_id}.log"
                self._file = RotatingLog(self.path, max_bytes, backups)
            except OSError as exc:  # the tail still works: only the files are lost
                log.warning("runner %s: cannot write its output to %s: %s", runner_id, log_dir, exc)
                self.path = None

    def feed(self, data: bytes) -> None:
        *raw, self._partial = (self._partial + data).split(b"\n")
        if raw:
            self._add([line.decode("utf-8", "replace").rstrip("\r") for line in raw])

    def since(self, mark: int) -> list[str]:
        """The lines added after the ``count`` was ``mark`` (as many of them as the tail still holds)."""
        new = self.count - mark
        if new <= 0:
            return []
        return list(self.lines)[-new:]

    def flush(self) -> None:
        """The runner is gone: a last line without a newline still counts."""
        if self._partial:
            self._add([self._partial.decode("utf-8", "replace").rstrip("\r")])
            self._partial = b""

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _add(self, lines: list[str]) -> None:
        self.lines.extend(lines)
        self.count += len(lines)
        if log.isEnabledFor(logging.DEBUG):
            for line in lines:
                log.debug("[%s] %s", self.runner_id, line)
        if self._file is not None:
            try:
                self._file.write(lines)
            except OSError as exc:  # a full disk: keep the tail, stop writing the file
                log.warning("runner %s: cannot write its output to %s: %s", self.runner_id, self.path, exc)
                self._file.close()
                self._file = None
