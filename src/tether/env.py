"""The environment variables tether reads: one list of names, and one vocabulary for switching a flag on or off.

Shared by both process sides (it imports nothing). A flag is on for ``1``, ``true``, ``yes`` or ``on`` and off for
``0``, ``false``, ``no`` or ``off`` (any case, spaces ignored); unset, empty or anything else is its default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RUNNER_CONFIG = "TETHER_RUNNER_CONFIG"  # how a worker hands a runner its RunnerConfig (JSON)
DISABLE_ORPHAN_WATCHDOG = "TETHER_DISABLE_ORPHAN_WATCHDOG"  # 1: runners may outlive their worker (debugging only)
AUTO_REAP = "TETHER_AUTO_REAP"  # 0: a starting worker does not reap the runners of dead workers
RUNTIME_DIR = "TETHER_RUNTIME_DIR"  # where runner records live (default $XDG_RUNTIME_DIR/tether)
LOG_DIR = "TETHER_LOG_DIR"  # where runner output logs go (default $XDG_STATE_HOME/tether/logs)
DATA_DIR = "TETHER_DATA_DIR"  # where `tether pull` keeps models, in models/ (default $XDG_DATA_HOME/tether)
API_KEY = "TETHER_API_KEY"  # the bearer key `tether serve` requires and `tether status` sends
ALLOWED_HOSTS = "TETHER_ALLOWED_HOSTS"  # more names `tether serve` answers to (comma-separated; see --allowed-hosts)
CORS_ORIGINS = "TETHER_CORS_ORIGINS"  # web origins whose pages may call `tether serve` (comma-separated)
TRACEMALLOC = "TETHER_TRACEMALLOC"  # 1: the worker traces its allocations, POST /v1/debug/tracemalloc (bench/soak.py)
GC_INTERVAL = "TETHER_GC_INTERVAL"  # seconds between the worker's full collections (0: CPython's; node/upkeep)

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})


def flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the flag ``name`` is on."""
    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    return default
