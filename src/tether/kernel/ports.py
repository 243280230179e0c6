"""The machine's ports for the ranks of multi-rank instances: a block per instance, free now on this machine.

Shared (no node or serving code): the worker allocates its instances' ports with it, and the chaos campaign, which
may not use the code it attacks, pins the ports of the instances it starts with it too.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from tether.errors import InvalidField, TetherError

PORT_BASE = 25100  # below Linux's ephemeral range (32768+), so no outgoing connection takes a rank's port first
PORT_SPAN = 2000


class RankPorts:
    """The ports of every multi-rank instance of one worker: a block per instance, kept for all its lives."""

    def __init__(self, base: int = PORT_BASE, span: int = PORT_SPAN) -> None:
        self.base = base
        self.span = span
        self._taken: dict[str, tuple[int, ...]] = {}

    def allocate(self, instance_id: str, n: int, pinned: Sequence[int] | None = None) -> tuple[int, ...]:
        """``pinned`` (checked against the other instances' ports), else the first ``n`` ports from ``base`` that no
        instance holds and that nothing on this machine listens on now."""
        held = {port for ports in self._taken.values() for port in ports}
        if pinned is not None:
            clash = sorted(held.intersection(pinned))
            if clash:
                raise InvalidField("ports", f"ports {clash} belong to another multi-rank instance of this worker")
            ports = tuple(pinned)
        else:
            found: list[int] = []
            for port in range(self.base, self.base + self.span):
                if port not in held and _free(port):
                    found.append(port)
                    if len(found) == n:
                        break
            if len(found) < n:
                raise TetherError(
                    f"no {n} free ports for the ranks of {instance_id} in {self.base}..{self.base + self.span - 1}: "
                    "free some, or pin the instance's own ('ports')"
                )
            ports = tuple(found)
        self._taken[instance_id] = ports
        return ports

    def release(self, instance_id: str) -> None:
        self._taken.pop(instance_id, None)


def _free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
