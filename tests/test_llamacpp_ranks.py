"""The default model split over ranks on one machine, for real: ggml's RPC backend between runner processes.

Rank 0 runs llama.cpp with the first layers, ranks 1.. serve the last ones. Greedy texts must equal the
single-process model's; every failure of rank 1 (SIGKILL, SIGSTOP, the OOM killer) must fail the request in flight
with rank 1's cause within its bound, leave no rank alive, and bring a replacement on the same ports; a held port is
an ordinary, retried load error naming its holder. Every "gone" is checked on /proc."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from conftest import free_rank_ports, model_missing, pid_alive, rank_group, rank_pids, ready_group
from tether.engines.llamacpp.estimate import estimate_for_spec, layer_plan
from tether.fleet.fleet import Fleet, Hosted, InstanceConfig
from tether.kernel.pids import holds_listener
from tether.node.hangs import Deadlines
from tether.node.instance import InstanceFailed, RestartPolicy
from tether.node.settings import SupervisorSettings
from tether.protocol import CauseKind, ChatMessage, EngineSpec, GenerateParams, RankInfo, TaskState

MISSING = model_missing()
pytestmark = [
    pytest.mark.model,
    pytest.mark.timeout(180),
    pytest.mark.skipif(MISSING is not None, reason=MISSING or ""),
]
MiB = 1 << 20
FAST = RestartPolicy(initial_backoff=0.05, max_backoff=0.2, jitter=0.0)
OPTIONS = {"n_ctx": 1024, "parallel": 2, "n_threads": 1}  # two runners' threads on two cores
STORY = GenerateParams(
    messages=(ChatMessage("user", "Tell me a long story about a lighthouse keeper and a storm."),),
    max_tokens=160,
    temperature=0.0,
)


@pytest.fixture
async def split() -> AsyncIterator[Hosted]:
    """The default model over 2 ranks in an in-process fleet (heartbeat deadline 2 s, so a frozen rank is found
    within ~2 s plus its kill)."""
    async with Fleet(SupervisorSettings(stop_timeout=10)) as fleet:
        hosted = await fleet.add(
            InstanceConfig(
                id="split",
                engine="llama.cpp",
                ranks=2,
                ports=tuple(free_rank_ports(2)),  # this test's own: another worker's fleet allocates from the base
                options=OPTIONS,
                restart=FAST,
                deadlines=Deadlines(heartbeat=2.0),
            )
        )
        await hosted.instance.wait_ready(60)
        yield hosted


# --------------------------------------------------------------------------------------------------------------


def test_the_layer_plan_is_llama_cpps_and_the_estimate_counts_each_ranks_share() -> None:
    # SmolLM2-135M: 30 repeating layers + the output layer
    assert layer_plan(30, (1, 1)).layers == (tuple(range(16)), tuple(range(16, 31)))
    assert layer_plan(30, (1, 1)).n_gpu_layers == 15
    three = layer_plan(30, (1, 1, 1))
    assert [len(held) for held in three.layers] == [10, 11, 10] and sum(three.layers, ()) == tuple(range(31))
    assert layer_plan(30, (3, 1)).layers[1] == tuple(range(23, 31))
    with pytest.raises(ValueError, match="without a layer"):
        layer_plan(30, (1, 1000, 1))
    whole = estimate_for_spec(EngineSpec(), {**OPTIONS, "n_batch": 512})
    ranks = [
        estimate_for_spec(EngineSpec(rank=RankInfo(r, 2, ("127.0.0.1:1", "127.0.0.1:2"))), {**OPTIONS, "n_batch": 512})
        for r in range(2)
    ]
    assert sum(r.kv_cache for r in ranks) == whole.kv_cache
    # the tied output layer's copy of the embeddings goes to rank 1, which holds the output layer
    assert sum(r.weights for r in ranks) == whole.weights + whole.tied_output > whole.weights
    assert ranks[1].prompt_cache_ram == 0 and ranks[0].prompt_cache_ram == whole.prompt_cache_ram
    assert "rank 1 of 2" in ranks[1].subject and "layers 16-29 and the output layer" in ranks[1].describe()


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_a_split_model_writes_the_single_process_models_greedy_text(ranks: int) -> None:
    async with Fleet(SupervisorSettings(stop_timeout=10)) as fleet:
        texts = {}
        for n in (1, ranks):
            hosted = await fleet.add(
                InstanceConfig(
                    id=f"m{n}",
                    engine="llama.cpp",
                    ranks=n,
                    ports=tuple(free_rank_ports(n)) if n > 1 else None,  # its own: another worker's fleet is near
                    options=OPTIONS,
                )
            )
            with anyio.fail_after(90):
                await hosted.instance.wait_ready(60)
                text, done = await (await hosted.instance.generate(STORY)).text()
            assert done.state is TaskState.COMPLETE, done.error
            texts[n] = text
            if n > 1:
                group = rank_group(hosted)
                loaded = group.members[0].status
                assert all(m.alive for m in group.members), loaded
                rank1 = group.members[1]
                memory = await rank1.measure()
                assert memory is not None and memory.anon > 40 * MiB, f"rank 1 holds layers: {memory}"
            await fleet.remove(hosted.id)
        assert len(texts[1]) > 200
        assert texts[ranks] == texts[1]


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_rank_1_sigkilled_mid_stream_fails_the_request_with_its_cause_and_the_replacement_serves(
    split: Hosted,
) -> None:
    inst = split.instance
    group = rank_group(split)
    old = rank_pids(group)
    peers = group.peers
    with anyio.fail_after(90):
        handle = await inst.generate(STORY)
        async for _ in handle:
            break  # streaming
        os.kill(old[1], signal.SIGKILL)
        killed = time.monotonic()
        final = await handle.wait()
        failed_in = time.monotonic() - killed
        assert final.state is TaskState.FAILED and final.cause is not None
        cause = final.cause
        assert cause.rank == 1 and cause.signal == "SIGKILL", cause.render()
        assert any(line.startswith("rank 0: ") and "another rank" in line for line in cause.evidence), cause.render()
        assert failed_in < 3.0, f"the request failed {failed_in:.2f} s after rank 1 died"
        assert not any(pid_alive(pid) for pid in old), "every rank of the failed life is gone"
        new = await ready_group(inst, set(old))
        assert new.peers == peers, "the replacement's ranks listen on the same ports"
        text, done = await (await inst.generate(STORY)).text()
    assert done.state is TaskState.COMPLETE and len(text) > 200


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_a_frozen_rank_1_is_a_hang_of_the_instance_within_its_heartbeat_deadline(split: Hosted) -> None:
    inst = split.instance
    group = rank_group(split)
    old = rank_pids(group)
    with anyio.fail_after(90):
        handle = await inst.generate(STORY)
        async for _ in handle:
            break
        os.kill(old[1], signal.SIGSTOP)  # alive, silent: rank 0 blocks in its RPC call
        frozen = time.monotonic()
        final = await handle.wait()
        failed_in = time.monotonic() - frozen
        assert final.state is TaskState.FAILED and final.cause is not None
        assert final.cause.kind is CauseKind.HANG and final.cause.rank == 1, final.cause.render()
        assert failed_in < 2.0 + 3.0, f"failed {failed_in:.2f} s after rank 1 froze (heartbeat deadline 2 s)"
        assert not any(pid_alive(pid) for pid in old)
        await ready_group(inst, set(old))


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners", "own_cgroups")
async def test_rank_1_killed_by_the_oom_killer_is_an_out_of_memory_of_rank_1() -> None:
    # Each rank's cgroup is limited to 192 MiB: rank 1 holds ~167 MiB once loaded (its layers and their KV cache for
    # 8192 cells, cleared at load), and a 1,600-token prompt's attention scratch and cache cells take it past 200 MiB.
    long = GenerateParams(prompt="The lighthouse keeper counted the waves. " * 200, max_tokens=4)
    async with Fleet(SupervisorSettings(stop_timeout=10)) as fleet:
        hosted = await fleet.add(
            InstanceConfig(
                id="oom",
                engine="llama.cpp",
                ranks=2,
                ports=tuple(free_rank_ports(2)),
                options={"n_ctx": 8192, "parallel": 1, "n_threads": 1, "prompt_cache": False},
                restart=RestartPolicy(mode="never"),
                memory_limit=192 * MiB,
                force=True,
            )
        )
        with anyio.fail_after(120):
            await hosted.instance.wait_ready(60)
            group = rank_group(hosted)
            old = rank_pids(group)
            final = await (await hosted.instance.generate(long)).wait()
            assert final.state is TaskState.FAILED and final.cause is not None
            assert final.cause.kind is CauseKind.OUT_OF_MEMORY and final.cause.rank == 1, final.cause.render()
            await hosted.instance.wait_state(lambda s: isinstance(s, InstanceFailed), 30)
            assert not any(pid_alive(pid) for pid in old)


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_a_held_port_is_a_retried_load_error_naming_its_holder() -> None:
    ports = free_rank_ports(2)
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", ports[1]))
    holder.listen(1)
    try:
        async with Fleet(SupervisorSettings(stop_timeout=10)) as fleet:
            hosted = await fleet.add(
                InstanceConfig(
                    id="held",
                    engine="llama.cpp",
                    ranks=2,
                    ports=tuple(ports),
                    options=OPTIONS,
                    restart=RestartPolicy(initial_backoff=0.2, max_backoff=0.2, jitter=0.0, crash_loop_failures=50),
                )
            )
            inst = hosted.instance
            with anyio.fail_after(60):
                await inst.wait_state(lambda s: len(inst.history) >= 2, 50)
                cause = inst.history[0].cause
                assert cause is not None and cause.rank == 1, cause
                assert f"pid {os.getpid()}" in cause.summary and str(ports[1]) in cause.summary, cause.summary
                assert cause.kind is not CauseKind.LOAD_ERROR, "a held port is retried, not a model that cannot load"
                holder.close()
                await inst.wait_ready(50)
                text, done = await (await inst.generate(STORY)).text()
            assert done.state is TaskState.COMPLETE and len(text) > 200
    finally:
        holder.close()


# --------------------------------------------------------------------------------------------------------------
# The seed's case, for real: an orphaned rank (and a child it forked) keeps the RPC port
# --------------------------------------------------------------------------------------------------------------


FORKING_RANK = """
import os, subprocess, time
from tether.engines.llamacpp.engine import LlamaCppEngine


class ForkingRank(LlamaCppEngine):
    \"\"\"llama.cpp whose ranks above 0, once serving, start a program (fork and exec) and fork a child (no exec),
    as engines do for helpers: what the program may inherit is what close-on-exec leaves it.\"\"\"

    def load(self, progress):
        super().load(progress)
        if self.spec.rank is not None and self.spec.rank.rank > 0:
            subprocess.Popen(["sleep", "3600"], close_fds=False)  # every inheritable descriptor goes with it
            if os.fork() == 0:
                time.sleep(3600)
                os._exit(0)
"""


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def command(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.serial  # its orphaned rank must live until it is looked at: no other worker may reap it
def test_an_orphaned_rank_and_its_forked_child_keep_the_rpc_port_and_a_naive_restart_never_serves(
    tmp_path: Any,
) -> None:
    from conftest import Server, wait_until
    from tether import env

    (tmp_path / "forking_rank.py").write_text(FORKING_RANK)
    ports = free_rank_ports(2)
    body = {
        "id": "split",
        "engine": f"{tmp_path / 'forking_rank.py'}:ForkingRank",
        "ranks": 2,
        "ports": ports,
        "options": OPTIONS,
        "restart": {"initial_backoff": 0.1, "max_backoff": 0.2, "jitter": 0.0, "crash_loop_failures": 3},
    }
    naive = {**os.environ, env.DISABLE_ORPHAN_WATCHDOG: "1"}
    left: list[int] = []
    try:
        # The seed's case: orphan protection off, the worker SIGKILLed: rank 1 and the child it forked keep the RPC
        # port (the program it exec'd does not: close-on-exec), and a new worker's instance never serves.
        first = Server("--no-reap", "--allow-engine-import", env=naive)
        first.wait_ready()
        first.add_instance(body, timeout=60)
        orphans = [r["pid"] for r in first.instance("split")["ranks"]]
        helpers = children(orphans[1])
        forked = sorted(pid for pid in helpers if "sleep" not in command(pid))[1:]  # the first: the runner's guard
        execd = [pid for pid in helpers if "sleep" in command(pid)]
        assert len(forked) == 1 and len(execd) == 1, [command(pid) for pid in helpers]
        first.proc.kill()
        first.proc.wait(10)
        left = first.runners() + helpers
        assert all(pid_alive(pid) for pid in orphans), "with the escape hatch the ranks outlive their worker"
        assert holds_listener(orphans[1], ports[1]), "the orphaned rank 1 keeps its RPC port"
        assert holds_listener(forked[0], ports[1]), "and so does the child it forked"
        assert not holds_listener(execd[0], ports[1]), "close-on-exec: the program rank 1 started has no RPC socket"
        second = Server("--no-reap", "--allow-engine-import", env=naive)
        try:
            second.wait_ready()
            assert second.http.post("/v1/instances", json=body).status_code == 201
            wait_until(lambda: second.instance("split")["state"] == "failed", 90, "the replacement crash-looped")
            view = second.instance("split")
            assert not view["ready"] and "crash loop" in view["detail"]["reason"], view["detail"]
            holders = (f"pid {orphans[1]} ", f"pid {forked[0]} ")
            assert all(any(h in c["cause"]["summary"] for h in holders) for c in view["history"]), view["history"]
        finally:
            second.stop()
        for pid in orphans + left:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(pid_alive(pid) for pid in orphans + helpers), 10, "the orphans killed")

        # tether: the same instance, the same ports, the same kill: every rank and every child of theirs dies
        # with the worker, and the next worker's instance serves.
        third = Server("--allow-engine-import")
        third.wait_ready()
        third.add_instance(body, timeout=60)
        ranks = [r["pid"] for r in third.instance("split")["ranks"]]
        theirs = children(ranks[1])
        assert len(theirs) == 3, [command(pid) for pid in theirs]  # the guard, the program, the forked child
        third.proc.kill()
        third.proc.wait(10)
        wait_until(lambda: not any(pid_alive(pid) for pid in ranks + theirs), 5, "every rank and child died with it")
        fourth = Server("--allow-engine-import")
        try:
            fourth.wait_ready()
            fourth.add_instance(body, timeout=60)
            answer = fourth.http.post(
                "/v1/chat/completions",
                json={"model": "split", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            )
            assert answer.status_code == 200, answer.text
            assert fourth.instance("split")["restarts"] == 0
        finally:
            fourth.stop()
    finally:
        for pid in left:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
