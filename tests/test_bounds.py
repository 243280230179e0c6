"""Every store in the worker that grows with traffic stays bounded: each test drives more than the bound through
the real code that fills it and checks the size.

bench/soak.py (a fault every 5 s, 8 streaming clients, for hours) is where an unbounded one shows, as a worker RSS
that keeps rising; these find it in a second, without runners.
"""

from __future__ import annotations

import collections
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from tether.cli.serve import _RefusalReport
from tether.cluster import coordinator as coordinator_module
from tether.cluster.coordinator import Cluster, ClusterSettings
from tether.cluster.link import AgentLink
from tether.fleet import fleet as fleet_module
from tether.fleet.catalog import Catalog
from tether.fleet.fleet import Fleet, Hosted, InstanceConfig
from tether.fleet.scheduler import Scheduler
from tether.fleet.scheduling import decisions as decisions_module
from tether.node import instance as instance_module
from tether.node import supervisor as supervisor_module
from tether.node.instance import Backoff, InstanceReady, RestartPolicy, remove_logs
from tether.node.listeners import Listeners
from tether.node.output import OutputCapture
from tether.node.recent import Recent
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.node.tasks import CancelReply, InFlight, TaskHandle
from tether.protocol import EngineSpec, GenerateParams, TaskState, TaskStatus
from tether.serve import metrics as metrics_module
from tether.serve.guard import Refusal
from tether.serve.metrics import Metrics

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------------------------------------------
# The fleet: ended request ids, requests in flight, cancels requested
# --------------------------------------------------------------------------------------------------------------


class _Replica:
    """A replica whose runner completes every generation at once, and answers cancels."""

    def __init__(self) -> None:
        self.supervisor = SimpleNamespace(cancel=self._cancel)
        self.name = "fake"
        self.state = InstanceReady(life=1, pid=1)

    async def _cancel(self, task_id: str) -> CancelReply:
        return CancelReply(task_id, "requested", "cancel sent")

    async def generate(self, params: GenerateParams, *, task_id: str) -> TaskHandle:
        _, receive = anyio.create_memory_object_stream[Any](1)
        handle = TaskHandle(task_id, "generate", receive)
        handle.final = TaskStatus(task_id, TaskState.COMPLETE, tokens=1)
        return handle


class _Hosted(Hosted):
    def pick(self) -> Any:
        return self.replicas[0]


def _hosted() -> _Hosted:
    return _Hosted("fake", InstanceConfig(id="fake", engine="debug", max_queue=4), [_Replica()])  # type: ignore[list-item]


@pytest.mark.anyio
async def test_the_fleet_remembers_at_most_RECENT_REQUESTS_ended_ids_and_nothing_else_per_request() -> None:
    fleet, hosted = Fleet(), _hosted()
    n = fleet_module.RECENT_REQUESTS + 500
    for i in range(n):
        async with fleet.generation(hosted, GenerateParams(prompt="x"), f"req-{i}"):
            if i % 7 == 0:  # a cancel while it runs: remembered only while it runs
                assert (await fleet.cancel(f"req-{i}")).outcome == "requested"
    assert len(fleet._recent) == fleet_module.RECENT_REQUESTS
    assert not fleet._requests and not fleet._cancelled
    assert hosted.in_flight == 0 and set(hosted.serving.values()) == {0} and len(hosted.serving) == 1
    assert (await fleet.cancel(f"req-{n - 1}")).outcome == "finished"
    assert (await fleet.cancel("req-0")).outcome == "unknown", "the oldest ended id was forgotten"


def test_ended_ids_are_also_forgotten_once_older_than_RECENT_SECONDS() -> None:
    """The count bounds the store at high request rates; age keeps it at its steady state after a few minutes of
    traffic at any lower rate (a soak's RSS then stops rising once that much has passed, not after 10,000 ids)."""
    now = [0.0]
    recent: Recent[str] = Recent(limit=100, seconds=fleet_module.RECENT_SECONDS, clock=lambda: now[0])
    for i in range(50):
        now[0] = i * 10.0  # one id every 10 s: 30 fit in the window
        recent.add(f"req-{i}", "complete")
    assert len(recent) == int(fleet_module.RECENT_SECONDS / 10) + 1
    assert recent.get("req-49") == "complete" and "req-18" not in recent and "req-19" in recent
    now[0] += fleet_module.RECENT_SECONDS + 1
    assert len(recent) == 0 and recent.get("req-49") is None
    for i in range(150):  # a burst: the count bounds it
        recent.add(f"burst-{i}", "failed")
    assert len(recent) == 100 and "burst-49" not in recent and "burst-50" in recent
    assert fleet_module.RECENT_SECONDS == supervisor_module.RECENT_SECONDS


# --------------------------------------------------------------------------------------------------------------
# A runner life: finished task ids, the output tail
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_supervisor_remembers_at_most_RECENT_FINISHED_task_ids(tmp_path: Path) -> None:
    sup = Supervisor(EngineSpec(engine="debug"), SupervisorSettings(log_dir=tmp_path), runner_id="bounds")
    for i in range(supervisor_module.RECENT_FINISHED + 300):
        send, _ = anyio.create_memory_object_stream[Any](1)
        sup._inflight[f"t{i}"] = InFlight(task=None, send=send)  # type: ignore[arg-type]
        sup._progress.generation_started(f"t{i}", 0.0)
        sup._finish(f"t{i}", TaskState.COMPLETE)
    assert len(sup._finished) == supervisor_module.RECENT_FINISHED
    assert not sup._inflight and not sup._progress._tasks and not sup._progress._acks
    assert "t0" not in sup._finished and f"t{supervisor_module.RECENT_FINISHED + 299}" in sup._finished


def test_the_output_tail_keeps_its_last_lines(tmp_path: Path) -> None:
    capture = OutputCapture("bounds", tail_lines=50, log_dir=tmp_path, max_bytes=4096, backups=2)
    capture.feed(b"".join(f"line {i}\n".encode() for i in range(5000)))
    capture.close()
    assert len(capture.lines) == 50 and capture.lines[-1] == "line 4999"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "runner-bounds.log",
        "runner-bounds.log.1",
        "runner-bounds.log.2",
    ]
    assert all(p.stat().st_size <= 4096 for p in tmp_path.iterdir())


# --------------------------------------------------------------------------------------------------------------
# An instance: failed lives, their logs, the crash-loop window
# --------------------------------------------------------------------------------------------------------------


def test_a_forgotten_life_takes_its_log_files_with_it(tmp_path: Path) -> None:
    kept = tmp_path / "runner-x-9.log"
    gone = tmp_path / "runner-x-1.log"
    for path in (kept, gone, gone.with_name(gone.name + ".1"), gone.with_name(gone.name + ".2")):
        path.write_text("x\n")
    orphan_backup = tmp_path / "runner-x-2.log.1"  # its base already removed by hand
    orphan_backup.write_text("x\n")
    remove_logs([str(gone), str(tmp_path / "runner-x-2.log"), None, str(tmp_path / "never-existed.log")])
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept.name]


def test_the_crash_loop_window_holds_at_most_crash_loop_failures_times() -> None:
    backoff = Backoff(RestartPolicy(crash_loop_failures=5, crash_loop_window=1e9))
    for i in range(10_000):
        backoff.record_failure(float(i))
    assert len(backoff._failures) == 5 and backoff.crash_looping(10_000.0)


def test_the_history_bound_is_stated() -> None:
    """The history itself is driven past its bound with real runners in test_restarts (slow):
    test_an_instance_that_keeps_failing_remembers_its_latest_failures_and_counts_them_all."""
    assert 1 <= instance_module.HISTORY_LIMIT <= 256


# --------------------------------------------------------------------------------------------------------------
# The scheduler's decisions
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_scheduler_keeps_its_last_DECISIONS_decisions() -> None:
    scheduler = Scheduler(Fleet(), Catalog())
    seen: list[Any] = []
    scheduler.listeners.add(seen.append)
    for i in range(decisions_module.DECISIONS * 4):
        scheduler.state.log.decide("loaded", f"m{i % 3}", "loaded", seconds=0.1)
    assert len(scheduler.decisions) == decisions_module.DECISIONS and len(seen) == decisions_module.DECISIONS * 4
    assert not scheduler.placing.awaited and not scheduler.placing.refused


# --------------------------------------------------------------------------------------------------------------
# Metrics: label sets of instances that come and go
# --------------------------------------------------------------------------------------------------------------


class _FakeFleet:
    def __init__(self) -> None:
        self.listeners: Listeners[Any] = Listeners("fleet")
        self.hosted: dict[str, Any] = {}

    def list(self) -> list[Any]:
        return list(self.hosted.values())


def _fake_hosted(instance_id: str) -> Any:
    inst = SimpleNamespace(failures=collections.Counter(), history=[], add_state_listener=lambda callback: None)
    return SimpleNamespace(id=instance_id, instance=inst)


def test_metrics_keep_the_label_sets_of_at_most_GONE_IDS_deleted_instances() -> None:
    fleet = _FakeFleet()
    metrics = Metrics(fleet)  # type: ignore[arg-type]
    live = _fake_hosted("stays")
    fleet.hosted["stays"] = live
    metrics.watch(live)
    total = metrics_module.GONE_IDS * 5
    for i in range(total):  # an operator adds an instance, it serves a request, it is deleted
        hosted = _fake_hosted(f"tmp-{i}")
        fleet.hosted[hosted.id] = hosted
        metrics.watch(hosted)
        for name in (hosted.id, "stays"):
            metrics.requests.labels(name, "chat", "complete").inc()
            metrics.tokens.labels(name, "completion").inc(3)
            metrics.ttft.labels(name).observe(0.1)
            metrics.duration.labels(name).observe(0.2)
        metrics.evictions.labels(hosted.id, "deleted").inc()
        del fleet.hosted[hosted.id]
    ids = metrics.labelled_ids()
    assert "stays" in ids, "a live instance's series are never dropped"
    assert len(ids) <= metrics_module.GONE_IDS + 1 + 1  # the gone ones kept, the live one, the last deleted
    assert f"tmp-{total - 1}" in ids and "tmp-0" not in ids
    assert len(metrics._ids) == len(ids)
    fleet.hosted.clear()  # the scrape's fleet half reads real instances: not these fakes
    text = metrics.render().decode()
    assert 'instance="tmp-0"' not in text and f'instance="tmp-{total - 1}"' in text
    assert 'tether_requests_total{endpoint="chat",instance="stays",outcome="complete"} 160.0' in text


# --------------------------------------------------------------------------------------------------------------
# The worker's stderr: refused Hosts and Origins
# --------------------------------------------------------------------------------------------------------------


def test_refusals_are_reported_once_each_for_at_most_LIMIT_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    report = _RefusalReport()
    for i in range(_RefusalReport.LIMIT * 10):
        report(Refusal("host", f"evil-{i}.example", "refused"))
        report(Refusal("origin", f"http://evil-{i}.example", "refused"))
    assert len(report.seen) == _RefusalReport.LIMIT
    assert len(capsys.readouterr().err.splitlines()) == _RefusalReport.LIMIT


# --------------------------------------------------------------------------------------------------------------
# The cluster: lost agents
# --------------------------------------------------------------------------------------------------------------


class _DeadAgent:
    """An agent actor Ray reports dead: its held call fails, as ``Cluster._watch_actor`` sees a dead actor's."""

    class hold:  # named as Ray's call syntax wants: actor.hold.remote()
        @staticmethod
        async def remote() -> None:
            raise RuntimeError("The actor died unexpectedly before finishing this task")


def test_the_cluster_keeps_the_latest_GONE_NODES_lost_agents_and_every_live_one() -> None:
    """Each removed node comes back, if ever, under a new id: its lost agent's link must not stay for the
    coordinator's life (nor be listed by every GET /v1/instances)."""
    bound = coordinator_module.GONE_NODES

    async def main() -> Cluster:
        cluster = Cluster(ClusterSettings())
        live = AgentLink("live" + "0" * 36, _DeadAgent(), 1.0)
        cluster.links[live.node_id] = live
        for i in range(bound + 10):
            link = AgentLink(f"{i:040x}", _DeadAgent(), 1.0)
            cluster.links[link.node_id] = link
            await cluster._lose(link, "its node was removed", ask_ray=False)
            await cluster._watch_actor(link)  # Ray's word: dead
        return cluster

    cluster = anyio.run(main)
    lost = [link for link in cluster.links.values() if link.lost is not None]
    assert len(lost) == bound, len(lost)
    assert sorted(link.node_id for link in lost) == [f"{i:040x}" for i in range(10, bound + 10)]  # the latest
    assert "live" + "0" * 36 in cluster.links
    assert len(cluster.view()["nodes"]) == bound + 1
