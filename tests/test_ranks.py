"""Multi-rank instances on one machine: the ranks of a debug ring fail together with the failed rank's cause, a
replacement starts only once every rank is gone and gets the same ports, and the seed's crash loop (an orphaned rank
keeps its port) is shown for real with orphan protection off, then shown gone with it on.

Every fault fires in rank 1 for real (the debug engine's ring mode carries a request's faults round the ring);
every "gone" is checked on /proc."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from conftest import (
    Server,
    debug_server,
    free_rank_ports,
    pid_alive,
    prompt,
    rank_group,
    rank_pids,
    ready_group,
    wait_until,
)
from tether import env
from tether.errors import InvalidField
from tether.fleet.fleet import Fleet, Hosted, InstanceConfig
from tether.kernel.pids import holds_listener
from tether.node.hangs import Deadlines
from tether.node.instance import InstanceFailed, InstanceReady, RestartPolicy
from tether.node.settings import SupervisorSettings
from tether.protocol import CauseKind, Fault, TaskState

pytestmark = pytest.mark.timeout(90)
FAST = RestartPolicy(initial_backoff=0.05, max_backoff=0.2, jitter=0.0)
MiB = 1 << 20


@pytest.fixture
async def ring(caplog: pytest.LogCaptureFixture) -> AsyncIterator[tuple[Fleet, Hosted]]:
    """A 2-rank debug ring in an in-process fleet; leaving the fleet must end the instance without an error."""
    caplog.set_level(logging.ERROR, logger="tether.fleet.fleet")
    async with Fleet(SupervisorSettings(stop_timeout=10)) as fleet:
        hosted = await fleet.add(
            InstanceConfig(
                id="ring",
                engine="debug",
                ranks=2,
                ports=tuple(free_rank_ports(2)),
                options={"token_seconds": 0.01},
                restart=FAST,
                deadlines=Deadlines(heartbeat=1.5, stacks=0.5),
                memory_limit=256 * MiB,
            )
        )
        await hosted.instance.wait_ready(30)
        yield fleet, hosted
    ended = [r.getMessage() for r in caplog.records if r.name == "tether.fleet.fleet"]
    assert not ended, f"the fleet's instance ended with an error: {ended}"


# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "cause"),
    [
        ("sigkill", CauseKind.SIGNAL),
        ("segv", CauseKind.NATIVE_CRASH),
        ("oom", CauseKind.OUT_OF_MEMORY),
        ("hang_gil", CauseKind.HANG),
    ],
)
@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners", "own_cgroups")
@pytest.mark.slow
async def test_a_rank_that_dies_fails_every_rank_with_its_cause_and_the_replacement_gets_the_same_ports(
    ring: tuple[Fleet, Hosted], kind: str, cause: CauseKind
) -> None:
    _, hosted = ring
    inst = hosted.instance
    group = rank_group(hosted)
    old = rank_pids(group)
    peers = group.peers
    with anyio.fail_after(40):
        final = await (await inst.generate(prompt(200, Fault(kind=kind, rank=1, after_tokens=3)))).wait()
        assert final.state is TaskState.FAILED and final.cause is not None
        assert final.cause.kind is cause and final.cause.rank == 1, final.cause.render()
        assert final.cause.summary.startswith("rank 1 of 2 failed: runner ring-1.rank1"), final.cause.summary
        assert "following rank 0's steps (rank 1 of 2)" in final.cause.summary, "what rank 1 was doing, not idle"
        assert any(line.startswith("rank 0: ") and "(a consequence)" in line for line in final.cause.evidence)
        assert not any(pid_alive(pid) for pid in old), "every rank of the failed life is gone"
        new = await ready_group(inst, set(old))
    assert new.peers == peers, "the replacement's ranks listen on the same ports"
    assert inst.history[-1].cause == final.cause and inst.history[-1].cause.rank == 1
    text, done = await (await inst.generate(prompt(5))).text()
    assert done.state is TaskState.COMPLETE and len(text.split()) == 5, "the replacement ring serves"


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_a_rank_killed_from_outside_ends_every_request_with_its_cause(ring: tuple[Fleet, Hosted]) -> None:
    _, hosted = ring
    inst = hosted.instance
    group = rank_group(hosted)
    old = rank_pids(group)
    with anyio.fail_after(30):
        handles = [await inst.generate(prompt(2000)) for _ in range(1)]
        async for _ in handles[0]:
            break  # streaming
        os.kill(old[1], signal.SIGKILL)
        killed = time.monotonic()
        finals = [await h.wait() for h in handles]
        failed_in = time.monotonic() - killed
        for final in finals:
            assert final.state is TaskState.FAILED and final.cause is not None
            assert final.cause.rank == 1 and final.cause.signal == "SIGKILL", final.cause.render()
        assert failed_in < 2.0, f"the request failed {failed_in:.2f} s after its rank died"
        assert not any(pid_alive(pid) for pid in old)
        await ready_group(inst, set(old))


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
@pytest.mark.slow
async def test_cancel_is_per_request_and_a_rank_stuck_in_the_ring_is_a_hang_of_the_instance() -> None:
    async with Fleet(SupervisorSettings(stop_timeout=10)) as fleet:
        hosted = await fleet.add(
            InstanceConfig(
                id="slowring",
                engine="debug",
                ranks=2,
                ports=tuple(free_rank_ports(2)),
                options={"token_seconds": 0.01, "parallel": 2},
                restart=RestartPolicy(mode="never"),
                deadlines=Deadlines(token_gap=1.0, stacks=0.5),
            )
        )
        inst = hosted.instance
        with anyio.fail_after(40):
            await inst.wait_ready(30)
            group = rank_group(hosted)
            pids = rank_pids(group)
            keep = await inst.generate(prompt(40))
            drop = await inst.generate(prompt(2000))
            async for _ in drop:
                break
            reply = await group.cancel(drop.task_id)
            assert reply.outcome == "requested"
            cancelled = await drop.wait()
            text, done = await keep.text()
            assert cancelled.state is TaskState.CANCELLED, "a cancel ends its own request"
            assert done.state is TaskState.COMPLETE and len(text.split()) > 0, "and no other"
            assert isinstance(inst.state, InstanceReady) and inst.state.life == 1
            # rank 1 takes 3 s per token: rank 0 waits on the ring past its token_gap deadline
            stuck = await (await inst.generate(prompt(50, Fault(kind="slow", seconds=3.0, rank=1)))).wait()
            assert stuck.state is TaskState.FAILED and stuck.cause is not None
            assert stuck.cause.kind is CauseKind.HANG and stuck.cause.rank == 0, stuck.cause.render()
            assert "token_gap" in stuck.cause.render()
            await inst.wait_state(lambda s: isinstance(s, InstanceFailed), 15)
            assert not any(pid_alive(pid) for pid in pids), "the stuck rank is stopped with the hung one"


SOLO_ENGINE = """
class Solo:
    def load(self, progress): pass
    def warmup(self): pass
    def generate(self, params, cancelled): return iter(())
    def close(self): pass
"""


@pytest.mark.anyio
async def test_ranks_need_an_engine_that_takes_part_and_ports_that_fit(tmp_path: Any) -> None:
    (tmp_path / "solo.py").write_text(SOLO_ENGINE)
    problems = {
        "solo": InstanceConfig(engine=f"{tmp_path / 'solo.py'}:Solo", ranks=2).check(),
        "ports": InstanceConfig(engine="debug", ranks=2, ports=(47001,)).check(),
        "dup": InstanceConfig(engine="debug", ranks=2, ports=(47001, 47001)).check(),
        "replicas": InstanceConfig(engine="debug", ranks=2, replicas=2).check(),
        "alone": InstanceConfig(engine="debug", ports=(47001,)).check(),
    }
    assert problems["solo"] is not None and problems["solo"].field == "ranks"
    assert "distributed" in str(problems["solo"])
    for name in ("ports", "dup", "alone"):
        assert problems[name] is not None and problems[name].field == "ports", name
    assert problems["replicas"] is not None and problems["replicas"].field == "replicas"
    assert InstanceConfig(engine="debug", ranks=2, ports=(47001, 47002)).check() is None
    assert InstanceConfig(engine="llama.cpp", ranks=3).check() is None, "llama.cpp splits its layers over ranks"


# --------------------------------------------------------------------------------------------------------------
# The seed's failure, for real, then its absence
# --------------------------------------------------------------------------------------------------------------


def ring_body(ports: list[int], crash_loop: int = 3) -> dict[str, Any]:
    return {
        "id": "ring",
        "engine": "debug",
        "ranks": 2,
        "ports": ports,
        "restart": {"initial_backoff": 0.1, "max_backoff": 0.2, "jitter": 0.0, "crash_loop_failures": crash_loop},
    }


def ranks_of(server: Server) -> list[dict[str, Any]]:
    ranks = server.instance("ring")["ranks"]
    assert ranks is not None
    return list(ranks)


@pytest.mark.timeout(120)
@pytest.mark.slow
@pytest.mark.serial  # its orphaned rank must live until it is looked at: no other worker may reap it
def test_an_orphaned_rank_makes_a_naive_restart_crash_loop_and_tether_never_leaves_one() -> None:
    ports = free_rank_ports(2)
    naive = {**os.environ, env.DISABLE_ORPHAN_WATCHDOG: "1"}  # the whole environment of the worker
    orphans: list[int] = []
    left: list[int] = []  # everything of the naive workers' that outlives them: killed at the end, whatever happens
    try:
        # The seed's case: orphan protection off, the worker SIGKILLed, a new worker starts the same instance.
        first = Server("--engine", "debug", "--no-reap", env=naive)
        first.wait_ready()
        first.add_instance(ring_body(ports))
        orphans = [r["pid"] for r in ranks_of(first)]
        first.proc.kill()
        first.proc.wait(10)
        left = first.runners()  # the ranks, its first instance's runner, and their guards
        assert all(pid_alive(pid) for pid in orphans), "with the escape hatch the ranks outlive their worker"
        assert holds_listener(orphans[1], ports[1]), "and the orphaned rank 1 keeps its port"
        second = Server("--engine", "debug", "--no-reap", env=naive)
        try:
            second.wait_ready()
            assert second.http.post("/v1/instances", json=ring_body(ports)).status_code == 201
            wait_until(lambda: second.instance("ring")["state"] == "failed", 60, "the replacement crash-looped")
            view = second.instance("ring")
            assert "crash loop" in view["detail"]["reason"], view["detail"]
            assert len(view["history"]) == 3
            assert all("Address already in use" in h["cause"]["summary"] for h in view["history"]), view["history"]
            assert not view["ready"]
        finally:
            second.stop()
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(pid_alive(pid) for pid in orphans), 10, "the orphans killed")

        # tether: the same instance, the same ports, the same kill.
        third = Server("--engine", "debug")
        third.wait_ready()
        third.add_instance(ring_body(ports))
        ranks = [r["pid"] for r in ranks_of(third)]
        third.proc.kill()
        third.proc.wait(10)
        wait_until(lambda: not any(pid_alive(pid) for pid in ranks), 5, "every rank died with its worker")
        fourth = Server("--engine", "debug")
        try:
            fourth.wait_ready()
            fourth.add_instance(ring_body(ports), timeout=30)
            assert [r["address"] for r in ranks_of(fourth)] == [f"127.0.0.1:{p}" for p in ports]
            answer = fourth.http.post(
                "/v1/chat/completions",
                json={"model": "ring", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
            assert answer.status_code == 200, answer.text
            assert fourth.instance("ring")["restarts"] == 0
        finally:
            fourth.stop()
    finally:
        for pid in orphans + left:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_the_api_shows_each_rank_and_a_rank_killed_mid_stream_fails_the_stream_with_its_cause() -> None:
    with debug_server() as server:
        server.add_instance(  # resume off: the stream ends with the cause (tests/test_resume.py resumes a ring's)
            {"id": "ring", "engine": "debug", "ranks": 2, "options": {"token_seconds": 0.02}, "resume": False}
        )
        ranks = ranks_of(server)
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["alive"] for r in ranks)
        shown = subprocess.run(
            [sys.executable, "-m", "tether", "status", "--url", server.url], capture_output=True, text=True, timeout=30
        )
        for r in ranks:
            assert f"rank {r['rank']} at {r['address']}: pid {r['pid']}, ready" in shown.stdout, shown.stdout
        old = [r["pid"] for r in ranks]
        body = {"model": "ring", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000, "stream": True}
        last: Any = None
        with (
            httpx.Client(base_url=server.url, timeout=30) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if last is None:
                    os.kill(old[1], signal.SIGKILL)
                last = line
        assert last is not None and '"error"' in last, last
        assert "rank 1 of 2 failed" in last and "SIGKILL" in last, last
        wait_until(lambda: server.instance("ring")["ready"] and server.instance("ring")["restarts"] == 1, 30, "back")
        view = server.instance("ring")
        assert view["history"][-1]["cause"]["rank"] == 1
        assert not any(pid_alive(pid) for pid in old)
        assert [r["address"] for r in view["ranks"]] == [r["address"] for r in ranks]


@pytest.mark.anyio
async def test_a_split_instance_refuses_options_only_its_ranks_would_refuse_before_any_runner_starts() -> None:
    async with Fleet() as fleet:
        for options, words in (
            ({"layer_split": [1, 2, 3]}, "3 shares for 2 ranks"),
            ({"n_gpu_layers": 4}, "n_gpu_layers is the layer split's"),
            ({"layer_split": [1, 0]}, "positive shares"),
        ):
            with pytest.raises(InvalidField, match=words) as refused:
                await fleet.add(InstanceConfig(id="split", engine="llama.cpp", ranks=2, options=options))
            assert refused.value.field == "options"
        assert fleet.list() == []
