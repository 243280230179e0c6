"""Bugs the chaos campaign's targets found, each pinned by a fast test of its own (issue 35).

The campaigns that found them (``tests/test_chaos_targets.py``, ``test_chaos_ranks.py``, ``test_chaos_cluster.py``)
catch them again end to end; these say exactly what was wrong, in milliseconds.
"""

from __future__ import annotations

import math
import os
import signal
import socket
from typing import Any

import anyio
import pytest

from conftest import pid_alive
from tether.cli.serve import _bind
from tether.cluster.agent import _imposed_end, _Life
from tether.engines import registry
from tether.fleet.catalog import Catalog, Model
from tether.fleet.fleet import Fleet, InstanceConfig
from tether.fleet.scheduler import Decision, Scheduler, SchedulerSettings
from tether.node.memory import NodeMemory
from tether.node.settings import SupervisorSettings
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


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_leftover_runners")
async def test_a_load_that_does_not_fit_waits_for_an_unload_under_way_instead_of_refusing() -> None:
    """Found by the models target (seed 0, trial 81): a runner SIGSTOPped as it was unloaded held its memory until
    its stop bound killed it, and a request for another model that needed that memory was refused 507 "does not fit"
    at once, for memory a moment away. The load now waits for runners being stopped (bounded by
    ``reclaim_timeout``), then fits. Node memory here is what the test says: room for one model while a's runner
    lives."""
    needs = registry.estimate(InstanceConfig(id="b", engine="debug").spec())
    assert needs is not None
    runner: list[int] = []

    def memory() -> NodeMemory:
        room = needs.total - 1 if runner and pid_alive(runner[0]) else needs.total * 4
        return NodeMemory(room, "the test", needs.total * 8, room)

    catalog = Catalog([Model(n, InstanceConfig(id=n, engine="debug"), (), math.inf, False, "the test") for n in "ab"])
    decisions: list[Decision] = []
    with anyio.fail_after(30):
        async with (
            Fleet(SupervisorSettings(stop_timeout=0.5)) as fleet,  # the stopped runner is killed 0.5 s into its stop
            Scheduler(fleet, catalog, SchedulerSettings(memory=memory)) as scheduler,
        ):
            scheduler.listeners.add(decisions.append)
            async with scheduler.lease("a") as hosted:
                assert hosted.supervisor is not None and hosted.supervisor.pid is not None
                runner.append(hosted.supervisor.pid)
            os.kill(runner[0], signal.SIGSTOP)
            async with anyio.create_task_group() as tg:
                tg.start_soon(scheduler.unload, "a", "the test")
                while scheduler.slots["a"].state != "unloading":
                    await anyio.sleep(0)  # the unload's first step, in this event loop
                assert pid_alive(runner[0])
                async with scheduler.lease("b"):  # refused DoesNotFit before the fix
                    assert not pid_alive(runner[0])
    kinds = [(d.kind, d.model) for d in decisions]
    assert ("refuse", "b") not in kinds and ("reclaimed", "b") in kinds, kinds
    waited = next(d for d in decisions if d.kind == "reclaimed" and d.model == "b")
    assert "while a were being stopped" in waited.reason and "once they were gone" in waited.reason, waited.reason
