"""A runner's stdout and stderr: split into lines, kept in a bounded per-life tail, logged, and written to files.

The tail is the evidence a cause quotes (faulthandler stacks, engine error lines), so it belongs to one runner life
and is never carried over. The files are for people: size-bounded and rotated, so a runner that floods its stderr
cannot fill the disk. They live in ``$TETHER_LOG_DIR``, else ``$XDG_STATE_HOME/tether/logs``, else
``~/.local/state/tether/logs``, one ``runner-<id>.log`` per runner (plus ``.1`` ... backups).
"""

from __future__ import annotations

import collections
import logging
import logging.handlers
import os
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
        self._file: logging.Handler | None = None
        self.path: Path | None = None
        if log_dir is not None:
            try:
                log_dir.mkdir(parents=True, exist_ok=True)
                self.path = log_dir / f"runner-{runner_id}.log"
                self._file = logging.handlers.RotatingFileHandler(
                    self.path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
                )
                self._file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            except OSError as exc:  # the tail still works: only the files are lost
                log.warning("runner %s: cannot write its output to %s: %s", runner_id, log_dir, exc)
                self.path = None

    def feed(self, data: bytes) -> None:
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self._add(line)

    def since(self, mark: int) -> list[str]:
        """The lines added after the ``count`` was ``mark`` (as many of them as the tail still holds)."""
        new = self.count - mark
        if new <= 0:
            return []
        return list(self.lines)[-new:]

    def flush(self) -> None:
        """The runner is gone: a last line without a newline still counts."""
        if self._partial:
            self._add(self._partial)
            self._partial = b""

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _add(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        self.lines.append(line)
        self.count += 1
        log.debug("[%s] %s", self.runner_id, line)
        if self._file is not None:
            self._file.handle(logging.LogRecord(log.name, logging.INFO, "", 0, line, None, None))
