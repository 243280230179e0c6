"""How every runner of one worker is supervised, as one value.

Built once (``tether serve`` from its flags, config file and environment; the node agent from its ``AgentSettings``;
the drill and ``tether run`` from theirs) and handed down through the fleet and each instance to every runner life,
instead of a keyword argument threaded through each layer by hand. What differs per instance (its engine spec, phase
deadlines, restart policy and memory limit) stays in the instance's own config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tether.clock import MONOTONIC, Clock
from tether.node.output import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from tether.runner import lifeline


@dataclass(frozen=True, slots=True)
class SupervisorSettings:
    """Timeouts, the heartbeat, logs, containment and the clock every runner of this worker is supervised by."""

    stop_timeout: float = 10.0  # shutdown -> SIGTERM -> SIGKILL, all within this (``Supervisor.stop``)
    start_timeout: float = 30.0  # from spawn to the runner's hello
    send_timeout: float = 5.0  # one write to the task pipe; past it the runner is not reading: hung
    reap_timeout: float = 10.0  # a failed life's process group gone before a replacement starts
    heartbeat_interval: float = 0.5  # the runner's beat; the ``heartbeat`` deadline must be longer
    output_lines: int = 200  # the tail of runner output a cause quotes
    log_dir: Path | None = None  # runner logs (default: ``output.default_log_dir()``)
    log_max_bytes: int = DEFAULT_MAX_BYTES
    log_backups: int = DEFAULT_BACKUPS
    env: Mapping[str, str] | None = None  # the runner's environment (default: this process's)
    orphan_layers: tuple[str, ...] = lifeline.LAYERS  # how a runner dies with its worker (``runner.lifeline``)
    orphan_poll_interval: float = lifeline.DEFAULT_POLL_INTERVAL
    contain: bool = True  # a memory cgroup of its own per runner, where the machine allows
    memory_interval: float = 2.0  # seconds between samples of a runner's memory (0: never)
    clock: Clock = MONOTONIC  # what every rule about time reads (``tether.clock``)

    def replace(self, **changes: object) -> SupervisorSettings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


DEFAULT = SupervisorSettings()
