"""The debug engine's ring mode, with real runner processes: a multi-rank instance rehearsed without a model.

Each rank is a runner of its own under its own Supervisor, as tether runs them; the ranks form a TCP ring during
warm-up (so their warm-ups run concurrently), rank 0 serves requests and every token goes round the ring. A
rank's failure must reach rank 0 as ``PEER_LOST`` naming the failed rank, and a port someone holds must fail the
load as an ordinary exception a restart policy retries, never as a load error tether gives up on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator

import anyio
import pytest

from tether.node.hangs import Deadlines
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.node.tasks import TaskFailed
from tether.protocol import (
    CauseKind,
    Chunk,
    EngineSpec,
    Failed,
    Fault,
    GenerateParams,
    RankInfo,
    TaskState,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30), pytest.mark.usefixtures("no_leftover_runners")]

PROMPT = "tell me about rings"
BOUND = 20  # seconds any one test's supervised part may take


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports nobody listens on now: bound to port 0 together (so they differ), then released."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def rank_specs(world: int, *faults: Fault, **options: object) -> list[EngineSpec]:
    peers = tuple(f"127.0.0.1:{port}" for port in free_ports(world))
    return [
        EngineSpec(engine="debug", options=dict(options), faults=faults, rank=RankInfo(i, world, peers))
        for i in range(world)
    ]


@contextlib.asynccontextmanager
async def ring(specs: list[EngineSpec], deadlines: Deadlines | None = None) -> AsyncIterator[list[Supervisor]]:
    """One Supervisor per rank, all made ready together (rank 0's warm-up needs the others' at the same time)."""
    async with contextlib.AsyncExitStack() as stack:
        sups = [
            await stack.enter_async_context(
                Supervisor(spec, SupervisorSettings(stop_timeout=3), runner_id=f"rank{i}", deadlines=deadlines)
            )
            for i, spec in enumerate(specs)
        ]
        async with anyio.create_task_group() as tg:
            for sup in sups:
                tg.start_soon(sup.ready)
        yield sups


async def plain_text(params: GenerateParams) -> str:
    """What a plain (rankless) debug runner answers."""
    async with Supervisor(EngineSpec(engine="debug"), SupervisorSettings(stop_timeout=3)) as sup:
        await sup.ready()
        text, final = await (await sup.generate(params)).text()
    assert final.state is TaskState.COMPLETE, final
    return text


async def failed(sup: Supervisor, timeout: float = 10) -> Failed:
    status = await sup.wait_status(lambda s: isinstance(s, Failed), timeout)
    assert isinstance(status, Failed)
    return status


@pytest.mark.parametrize("world", [2, 3])
async def test_the_ring_is_transparent_and_closes_cleanly(world: int) -> None:
    """A ring answers what a plain runner answers (a batch of two included), and stopping rank 0 first is no
    failure of the others: its goodbye went round."""
    prompts = [GenerateParams(prompt=f"{PROMPT} {i}", max_tokens=40) for i in range(2)]
    with anyio.fail_after(BOUND):
        expected = [await plain_text(params) for params in prompts]
        async with ring(rank_specs(world, parallel=2)) as sups:
            handles = [await sups[0].generate(params) for params in prompts]
            answers = [await handle.text() for handle in handles]
            assert [text for text, _ in answers] == expected
            assert all(final.state is TaskState.COMPLETE for _, final in answers), answers
            await sups[0].stop()
            for sup in sups[1:]:
                await sup.stop()
                assert sup.cause is None, sup.cause.render()
                assert sup.stop_report is not None and sup.stop_report.clean, sup.stop_report


async def test_rank_1_killed_mid_generation_is_peer_lost_on_rank_0() -> None:
    specs = rank_specs(2, token_seconds=0.02)
    with anyio.fail_after(BOUND):
        async with ring(specs) as (rank0, rank1):
            handle = await rank0.generate(GenerateParams(prompt=PROMPT, max_tokens=10_000))
            chunks = 0
            async for event in handle:
                if isinstance(event, Chunk):
                    chunks += 1
                    if chunks == 3:
                        break
            assert rank1.pid is not None
            os.kill(rank1.pid, signal.SIGKILL)
            final = await handle.wait()
            cause = (await failed(rank0)).cause
            await failed(rank1)
    assert final.state is TaskState.FAILED, final
    assert final.cause == cause
    assert cause.kind is CauseKind.PEER_LOST, cause.render()
    assert f"rank 1 ({specs[0].rank.peers[1]})" in cause.summary, cause.render()  # type: ignore[union-attr]
    assert rank1.cause is not None and rank1.cause.signal == "SIGKILL", rank1.cause


@pytest.mark.parametrize("where", ["spec", "request"])
async def test_a_fault_for_rank_1_fires_there_after_its_tokens(where: str) -> None:
    """A sigkill for rank 1 after 3 tokens, in the spec or carried by the ring from the request: exactly three
    tokens reach the client, rank 1 dies of the signal, rank 0 of the lost peer."""
    fault = Fault(kind="sigkill", phase="generate", after_tokens=3, rank=1)
    specs = rank_specs(2, *((fault,) if where == "spec" else ()))
    params = GenerateParams(prompt=PROMPT, max_tokens=50, faults=(fault,) if where == "request" else ())
    with anyio.fail_after(BOUND):
        expected = await plain_text(GenerateParams(prompt=PROMPT, max_tokens=3))
        async with ring(specs) as (rank0, rank1):
            text, final = await (await rank0.generate(params)).text()
            dead = (await failed(rank1)).cause
            cause = (await failed(rank0)).cause
    assert dead.kind is CauseKind.SIGNAL and dead.signal == "SIGKILL", dead.render()
    assert cause.kind is CauseKind.PEER_LOST, cause.render()
    assert "rank 1" in cause.summary, cause.render()
    assert final.state is TaskState.FAILED, final
    assert text == expected  # rank 0 itself ignored the fault: it is rank 1's


async def test_a_held_port_fails_the_load_as_an_exception_a_restart_retries() -> None:
    specs = rank_specs(2)
    host, port = specs[1].rank.address()  # type: ignore[union-attr]
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # what an orphaned earlier life of rank 1 does
    with anyio.fail_after(BOUND):
        try:
            holder.bind((host, port))
            holder.listen()
            async with Supervisor(specs[1], SupervisorSettings(stop_timeout=3)) as sup:
                with pytest.raises(TaskFailed):
                    await sup.load()
                cause = (await failed(sup)).cause
        finally:
            holder.close()
        assert cause.kind is CauseKind.EXCEPTION, cause.render()  # not LOAD_ERROR: tether would never retry that
        assert "Address already in use" in cause.summary and f":{port}" in cause.summary, cause.render()
        assert f"ss -ltnp 'sport = :{port}'" in cause.summary, cause.render()
        assert f"pid {os.getpid()} (" in cause.summary, "the error names who holds the port"
        async with Supervisor(
            specs[1], SupervisorSettings(stop_timeout=3)
        ) as retry:  # the holder is gone: the next life loads
            await retry.load()


@pytest.mark.slow
async def test_rank_1_hung_holding_the_gil_is_killed_and_rank_0_loses_its_peer() -> None:
    fault = Fault(kind="hang_gil", phase="generate", after_tokens=3, rank=1)
    deadlines = Deadlines(heartbeat=1.5, stacks=0.5)
    with anyio.fail_after(BOUND):
        async with ring(rank_specs(2, fault), deadlines) as (rank0, rank1):
            _, final = await (await rank0.generate(GenerateParams(prompt=PROMPT, max_tokens=50))).text()
            hung = (await failed(rank1)).cause
            cause = (await failed(rank0)).cause
    assert hung.kind is CauseKind.HANG, hung.render()
    assert cause.kind is CauseKind.PEER_LOST and "rank 1" in cause.summary, cause.render()
    assert final.state is TaskState.FAILED and final.cause == cause, final
