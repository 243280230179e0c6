"""The coordinator's view of one node agent, shared by the coordinator (which owns it) and every remote runner
life hosted there (which attaches to it): its own module so that neither imports the other.

A link knows nothing of the lives beyond ``LinkedLife``: when its node is lost, each attached life is told so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import msgspec
from anyio.abc import SocketStream

from tether.clock import MONOTONIC, Clock
from tether.cluster import wire
from tether.protocol import Cause


class LinkedLife(Protocol):
    """What a link needs of a runner life it hosts: its id, its agent's beats about it, being told its node was lost."""

    runner_id: str

    def reported(self, report: wire.RunnerReport) -> None: ...

    def lose(self, cause: Cause, detected_at: float, *, settled: bool = False) -> None: ...


@dataclass(eq=False)
class AgentLink:
    """The coordinator's view of one node agent."""

    node_id: str
    actor: Any
    lost_after: float
    settle: float = 0.0  # after its last word, by when a partitioned agent has fenced itself: lease + stop + reap
    pid: int | None = None
    host: str | None = None  # the node's host name, for messages
    ip: str | None = None  # the node's address (Ray's node IP), where ranks listen and their peers reach them
    clock: Clock = MONOTONIC  # the coordinator's: every time below is on it, and its lives' waits read it too
    last_seen: float = field(init=False)  # the agent's last word; from the link's making until the first
    report: wire.NodeReport | None = None
    fenced: bool = False
    lost: Cause | None = None
    lost_at: float | None = None  # tether's verdict
    died_at: float | None = None  # when Ray failed the held call: Ray's own notification
    stream: SocketStream | None = None
    supervisors: set[LinkedLife] = field(default_factory=set)
    connected: anyio.Event = field(default_factory=anyio.Event)
    death: list[str] = field(default_factory=list)  # Ray's words, once its watch call failed
    died: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        self.last_seen = self.clock.now()

    @property
    def short(self) -> str:
        return self.node_id[:8]

    @property
    def live(self) -> bool:
        """Joined (connected, and its start answered: pid and host known) and not lost."""
        return self.lost is None and self.connected.is_set() and self.pid is not None

    def attach(self, sup: LinkedLife) -> None:
        if self.lost is not None:
            sup.lose(self.lost, self.clock.now())
        else:
            self.supervisors.add(sup)

    def detach(self, sup: LinkedLife) -> None:
        self.supervisors.discard(sup)

    @property
    def state(self) -> str:
        if self.lost is not None:
            return "lost"
        return "fenced" if self.fenced else ("live" if self.live else "joining")

    def view(self) -> dict[str, Any]:
        report = self.report
        return {
            "node": self.node_id,
            "host": self.host,
            "ip": self.ip,
            "agent_pid": self.pid,
            "state": self.state,
            "cause": self.lost.summary if self.lost is not None else None,
            "heard_ago": round(self.clock.now() - self.last_seen, 3),
            # on the link's clock (CLOCK_MONOTONIC in production): tether's verdict and Ray's notification of the same
            # death, comparable (bench/cluster.py)
            "lost_at": self.lost_at,
            "ray_notified_at": self.died_at,
            "memory": msgspec.to_builtins(report) if report is not None else None,
            "runners": sorted(sup.runner_id for sup in self.supervisors),
        }
