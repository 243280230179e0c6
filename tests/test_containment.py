"""Node memory as a cgroup sees it, and each runner in a memory cgroup of its own (where the machine allows)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import anyio
import pytest

from conftest import MakeCgroup
from tether.kernel.cgroups import MemoryCgroup
from tether.node.hangs import Deadlines
from tether.node.memory import node_memory
from tether.node.oom import OomEvidence
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.protocol import CauseKind, EngineSpec, Fault, GenerateParams, TaskState

MiB = 1 << 20


@pytest.mark.timeout(30)
def test_node_memory_inside_a_limited_cgroup_is_the_limit_derived_figure(memory_cgroup: MakeCgroup) -> None:
    limited_cgroup = memory_cgroup(256 * MiB)
    code = (
        "import json, os, sys\n"
        f"open({str(limited_cgroup / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
        "from tether.node.memory import node_memory\n"
        "n = node_memory()\n"
        "print(json.dumps(dict(available=n.available, source=n.source, limit=n.cgroup_limit, usage=n.cgroup_usage,"
        " reclaimable=n.cgroup_reclaimable, host=n.host_available, lines=n.describe())))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    n = json.loads(out.stdout)
    assert n["limit"] == 256 * MiB
    assert n["source"] == f"cgroup limit ({limited_cgroup})"
    assert n["available"] == 256 * MiB - (n["usage"] - n["reclaimable"]) < n["host"]
    assert any(line.startswith("available ") and "cgroup limit" in line for line in n["lines"])


def test_node_memory_outside_a_limit_is_the_hosts() -> None:
    n = node_memory()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert n.host_total == total
    assert 0 < n.available <= n.host_available <= n.host_total
    assert n.gpus or n.gpu_reason  # GPU figures, or why there are none


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("own_cgroups")
async def test_a_runner_gets_its_own_cgroup_and_it_is_removed_after_the_runner() -> None:
    with anyio.fail_after(30):
        async with Supervisor(
            EngineSpec(engine="debug", options={"helpers": 1}), SupervisorSettings(memory_interval=0.05)
        ) as sup:
            await sup.ready()
            assert sup.pid is not None and sup.cgroup is not None
            cgroup = MemoryCgroup.of_pid(sup.pid)
            assert cgroup is not None and cgroup.path == sup.cgroup
            members = {int(p) for p in (sup.cgroup / "cgroup.procs").read_text().split()}
            assert sup.pid in members and len(members) == 3  # the runner, its guard and its helper
            sampled = await sup.sample_memory()
            assert sampled is not None and sampled.rss > 0 and sampled.footprint > 0
            with anyio.fail_after(5):  # and the periodic sampler keeps it fresh
                while sup.footprint is sampled:
                    await anyio.sleep(0.05)
        path = sup.cgroup
    assert not path.exists()


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("own_cgroups")
async def test_a_runner_in_its_own_limited_cgroup_killed_by_the_oom_killer_is_reported_as_such() -> None:
    oom = GenerateParams(prompt="x", max_tokens=50, faults=(Fault(kind="oom", after_tokens=2),))
    with anyio.fail_after(45):
        async with Supervisor(EngineSpec(engine="debug"), memory_limit=128 * MiB) as sup:
            await sup.ready()
            final = await (await sup.generate(oom)).wait()
    assert final.state is TaskState.FAILED
    cause = sup.cause
    assert cause is not None and cause.kind is CauseKind.OUT_OF_MEMORY, cause
    assert "was killed by the out-of-memory killer while generating" in cause.summary, cause.summary
    assert "cgroup limit 128 MiB" in cause.summary
    counter = [line for line in cause.evidence if "oom_kill 0 -> 1" in line]
    assert counter and "shared" not in counter[0]  # its own cgroup: the counter alone is certain evidence


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("own_cgroups")
async def test_a_runner_stalled_at_its_memory_limit_is_out_of_memory_not_a_deadlock() -> None:
    """Regression (the cluster-ranks campaign on a loaded machine): a rank filling its 96 MiB cgroup went 1.5 s
    without a heartbeat while the kernel reclaimed for it, before any OOM kill, and tether reported a deadlock
    ("hang ... blocked in native code holding the GIL"). A runner that goes silent with its cgroup full is out of
    memory, with how full; the same native hang with room to spare is still a hang."""
    limits = Deadlines(heartbeat=1.0, stacks=0.5)
    causes = {}
    for kind in ("stall_at_limit", "hang_gil"):
        params = GenerateParams(prompt="x", max_tokens=50, faults=(Fault(kind=kind, after_tokens=2),))
        with anyio.fail_after(45):
            async with Supervisor(
                EngineSpec(engine="debug"),
                SupervisorSettings(heartbeat_interval=0.25),
                memory_limit=128 * MiB,
                deadlines=limits,
            ) as sup:
                await sup.ready()
                final = await (await sup.generate(params)).wait()
        assert final.state is TaskState.FAILED and final.cause == sup.cause
        causes[kind] = sup.cause
    stalled, hung = causes["stall_at_limit"], causes["hang_gil"]
    assert stalled is not None and stalled.kind is CauseKind.OUT_OF_MEMORY, stalled
    assert "stalled at its memory limit in decode for 1." in stalled.summary, stalled.summary
    silent = r"of the 128 MiB limit, [\d,]+ pages dropped and read back while it was silent, no heartbeat; the kernel"
    assert re.search(silent, stalled.summary), stalled.summary  # its cgroup thrashed: the cache pages read back
    assert any(line.startswith("what to do: raise the memory limit (now 128 MiB)") for line in stalled.evidence)
    assert any("in _stall_at_limit" in line for line in stalled.evidence), stalled.evidence  # its stacks are kept
    assert hung is not None and hung.kind is CauseKind.HANG and "memory" not in hung.summary, hung


def test_the_counter_of_an_unshared_cgroup_is_enough_without_the_kernel_log() -> None:
    own = OomEvidence(cgroup="/x", oom_kills_before=0, oom_kills_after=1, shared_cgroup=False)
    shared = OomEvidence(cgroup="/x", oom_kills_before=0, oom_kills_after=1, shared_cgroup=True)
    assert own.killed_by_oom and not shared.killed_by_oom and shared.counter_rose


_OOM_UNDER_AN_ENCLOSING_LIMIT = """
import json, os, sys
open(sys.argv[1] + "/cgroup.procs", "w").write(str(os.getpid()))  # the worker, in the limited cgroup
import anyio
from tether.protocol import EngineSpec, Fault, GenerateParams
from tether.node.supervisor import Supervisor

async def main():
    oom = GenerateParams(prompt="x", max_tokens=50, faults=(Fault(kind="oom", after_tokens=2),))
    async with Supervisor(EngineSpec(engine="debug")) as sup:  # its own cgroup, with no limit of its own
        await sup.ready()
        own = str(sup.cgroup)
        await (await sup.generate(oom)).wait()
    print(json.dumps({"kind": sup.cause.kind.value, "summary": sup.cause.summary, "own": own}))

anyio.run(main)
"""


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("own_cgroups")
def test_an_oom_kill_under_an_enclosing_cgroups_limit_names_that_limit_and_where_it_is_set(
    memory_cgroup: MakeCgroup,
) -> None:
    """The runner's own cgroup has no limit; the worker's has 171 MiB. The cause used to say "no cgroup limit"."""
    limited = memory_cgroup(171 * MiB)
    out = subprocess.run(
        [sys.executable, "-c", _OOM_UNDER_AN_ENCLOSING_LIMIT, str(limited)], capture_output=True, text=True, timeout=45
    )
    assert out.returncode == 0, out.stderr
    cause = json.loads(out.stdout.strip().splitlines()[-1])
    assert cause["kind"] == "out_of_memory", cause
    assert cause["own"].startswith(str(limited) + "/tether-")  # the runner's own cgroup, below the limited one
    assert f"cgroup limit 171 MiB set on the enclosing cgroup {limited}" in cause["summary"], cause["summary"]
    assert "no cgroup limit" not in cause["summary"]


def test_the_binding_limit_is_the_tightest_on_the_way_to_the_root(memory_cgroup: MakeCgroup) -> None:
    outer = memory_cgroup(300 * MiB)
    inner = outer / "inner"
    inner.mkdir()
    try:
        (inner / "memory.limit_in_bytes").write_text(str(400 * MiB))  # looser than its parent's: the parent binds
        assert MemoryCgroup(inner, 1).binding_limit() == (300 * MiB, outer)
        (inner / "memory.limit_in_bytes").write_text(str(200 * MiB))
        assert MemoryCgroup(inner, 1).binding_limit() == (200 * MiB, inner)
        assert MemoryCgroup(inner, 1).effective_limit() == 200 * MiB
    finally:
        inner.rmdir()
