"""Bugs the chaos campaign's targets found, each pinned by a fast test of its own (issue 35).

The campaigns that found them (``tests/test_chaos_targets.py``, ``test_chaos_ranks.py``, ``test_chaos_cluster.py``)
catch them again end to end; these say exactly what was wrong, in milliseconds.
"""

from __future__ import annotations

import socket
from typing import Any

import anyio

from tether.cli.serve import _bind
from tether.cluster.agent import _imposed_end, _Life
from tether.protocol import Cause, CauseKind, TaskState, TaskStatus


def test_serve_accepts_connections_as_soon_as_it_says_listening() -> None:
    """Found by the cluster target: "listening on" was printed once the socket was bound, but it listened only when
    uvicorn started serving (over a second later with --ray), so a client acting on the line was refused."""
    sock = _bind("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=2):  # refused before the fix
            pass
    finally:
        sock.close()


def test_a_fenced_agents_requests_fail_with_its_cause_not_cancelled() -> None:
    """Found by the cluster target (coordinator SIGSTOP past the lease): the agent fenced itself and stopped its
    runner, whose tasks then ended CANCELLED, and when that arrived before the fence's message the client was told
    its request was cancelled though it never asked. A cancel the coordinator did ask for stays a cancel."""
    fence = Cause(CauseKind.NODE_LOST, "agent a1 fenced itself: no coordinator for 2.5 s (its lease)")

    async def main() -> tuple[Any, Any, Any]:
        life = _Life("r1", sup=None)  # type: ignore[arg-type]  # the supervisor is not consulted
        life.imposed = fence
        life.cancelled.add("asked")
        unasked = _imposed_end(life, TaskStatus("t1", TaskState.CANCELLED, tokens=122))
        asked = _imposed_end(life, TaskStatus("asked", TaskState.CANCELLED))
        life.imposed = None
        plain = _imposed_end(life, TaskStatus("t2", TaskState.CANCELLED))
        return unasked, asked, plain

    unasked, asked, plain = anyio.run(main)
    assert unasked.state is TaskState.FAILED and unasked.cause == fence and unasked.tokens == 122
    assert asked.state is TaskState.CANCELLED and plain.state is TaskState.CANCELLED
