"""Prometheus metrics for ``/metrics``: what the fleet is (read at scrape time) and what it did (counted as it goes).

Instance states, restarts, failures by cause, queue depths and footprints are read from the fleet when scraped, so
they can never drift from the truth; requests, tokens, latencies and failure-detection times are counted by the API
as they happen. One registry per app (not the process-global one), so tests can run several apps side by side.
The worker's own process is there too (``process_resident_memory_bytes``, ``process_open_fds``, CPU seconds: what
the soak watches for growth) with its clocked garbage collections' pauses (``node/upkeep``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tether.fleet.fleet import Fleet, Hosted
from tether.fleet.scheduler import Decision, Scheduler
from tether.node.instance import InstanceFailed, InstanceRestarting, InstanceState
from tether.node.upkeep import Upkeep
from tether.protocol import tag_of

STATES = ("starting", "ready", "restarting", "failed", "stopping", "stopped")
MODEL_STATES = ("unloaded", "loading", "loaded", "unloading")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Instances added through POST /v1/instances (and deleted) each leave label sets on the counters below: a worker
# whose operator (or a test campaign) adds and deletes instances all day would grow without bound, and so would every
# scrape. The series of the latest GONE_IDS ids that are gone stay (a scrape after a delete still sees their final
# counts); older ones are dropped. Prometheus reads a series that disappears as ended, not as a counter reset.
GONE_IDS = 32


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "tether_instance_state", "1 for the state each instance is in", labels=["instance", "state"]
        )
        restarts = CounterMetricFamily("tether_instance_restarts", "Replacement runners started", labels=["instance"])
        failures = CounterMetricFamily(
            "tether_runner_failures", "Runner lives that failed, by cause kind", labels=["instance", "cause"]
        )
        queue = GaugeMetricFamily(
            "tether_queue_depth", "Generations in flight (running + waiting) per instance", labels=["instance"]
        )
        queue_limit = GaugeMetricFamily("tether_queue_limit", "Generations admitted at most", labels=["instance"])
        running = GaugeMetricFamily(
            "tether_generations_running", "Generations in the runner's batch now", labels=["instance"]
        )
        waiting = GaugeMetricFamily(
            "tether_generations_waiting", "Generations admitted and waiting for a batch slot", labels=["instance"]
        )
        parallel = GaugeMetricFamily(
            "tether_batch_slots", "Generations the runner's engine serves at once (parallel)", labels=["instance"]
        )
        occupancy = GaugeMetricFamily(
            "tether_batch_occupancy", "Running generations / batch slots (0..1)", labels=["instance"]
        )
        footprint = GaugeMetricFamily(
            "tether_runner_footprint_bytes",
            "What the runner's process group really holds (anonymous + shmem + swap + GPU)",
            labels=["instance"],
        )
        rss = GaugeMetricFamily("tether_runner_rss_bytes", "Resident memory of the runner's group", labels=["instance"])
        vram = GaugeMetricFamily(
            "tether_runner_gpu_bytes",
            "GPU memory the runner's group holds, from NVML per process (absent where NVML cannot say)",
            labels=["instance"],
        )
        resumed = CounterMetricFamily(
            "tether_requests_resumed",
            "Generations resumed on a new runner after theirs died, by the cause kind of the death",
            labels=["instance", "cause"],
        )
        not_resumed = CounterMetricFamily(
            "tether_requests_not_resumed",
            "Generations failed with their runner's cause where resuming was impossible, by reason",
            labels=["instance", "reason"],
        )
        quarantined = CounterMetricFamily(
            "tether_requests_quarantined",
            "Requests proven to kill their runner (failed with their deaths, then refused for a while)",
            labels=["instance"],
        )
        pause = GaugeMetricFamily(
            "tether_resume_pause_seconds",
            "A resumed stream's pause (its last chunk before the death to its first after), over the latest 1,024",
            labels=["instance", "quantile"],
        )
        for hosted in self.fleet.list():
            name = tag_of(hosted.instance.state)
            if hosted.resumes is not None:
                for cause, count in hosted.resumes.resumed.items():
                    resumed.add_metric([hosted.id, cause], count)
                for reason, count in hosted.resumes.not_resumed.items():
                    not_resumed.add_metric([hosted.id, reason], count)
                quarantined.add_metric([hosted.id], hosted.resumes.proven)
                for q in ("0.5", "0.99"):
                    value = hosted.resumes.pause_quantile(float(q))
                    if value is not None:
                        pause.add_metric([hosted.id, q], value)
            for candidate in STATES:
                state.add_metric([hosted.id, candidate], 1.0 if candidate == name else 0.0)
            restarts.add_metric([hosted.id], hosted.instance.restarts)
            for cause, count in hosted.instance.failures.items():
                failures.add_metric([hosted.id, cause.value], count)
            queue.add_metric([hosted.id], hosted.in_flight)
            queue_limit.add_metric([hosted.id], hosted.limit)
            now_running, now_waiting = hosted.generations()
            running.add_metric([hosted.id], now_running)
            waiting.add_metric([hosted.id], now_waiting)
            parallel.add_metric([hosted.id], hosted.parallel)
            occupancy.add_metric([hosted.id], now_running / hosted.parallel)
            sup = hosted.supervisor
            if sup is not None and sup.footprint is not None:
                footprint.add_metric([hosted.id], sup.footprint.footprint)
                rss.add_metric([hosted.id], sup.footprint.rss)
                if sup.footprint.gpu is not None:
                    vram.add_metric([hosted.id], sup.footprint.gpu)
        yield from (
            state,
            restarts,
            failures,
            queue,
            queue_limit,
            running,
            waiting,
            parallel,
            occupancy,
            footprint,
            rss,
            vram,
            resumed,
            not_resumed,
            quarantined,
            pause,
        )


class _SchedulerCollector(Collector):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "tether_model_state", "1 for the state each catalogued model is in", labels=["model", "state"]
        )
        busy = GaugeMetricFamily("tether_model_busy", "1 while a request holds the model", labels=["model"])
        for slot in self.scheduler.slots.values():
            for candidate in MODEL_STATES:
                state.add_metric([slot.id, candidate], 1.0 if candidate == slot.state else 0.0)
            busy.add_metric([slot.id], 0.0 if slot.idle else 1.0)
        yield from (state, busy)


class Metrics:
    """The app's registry and the counters the API (and the scheduler's decisions) update."""

    def __init__(self, fleet: Fleet, scheduler: Scheduler | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(fleet))
        ProcessCollector(registry=self.registry)  # this worker's RSS, fds and CPU, read from /proc at each scrape
        self.gc_pause = Histogram(
            "tether_worker_gc_pause_seconds",
            "How long each of the worker's clocked full garbage collections held its event loop (TETHER_GC_INTERVAL)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.gc_collected = Counter(
            "tether_worker_gc_collected_objects",
            "Unreachable objects the worker's clocked collections freed (reference cycles requests left)",
            registry=self.registry,
        )
        self.requests = Counter(
            "tether_requests",
            "Generation requests by endpoint and outcome (complete, cancelled, failed, rejected, bad_request)",
            ["instance", "endpoint", "outcome"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "tether_tokens",
            "Tokens processed, by kind (prompt, completion; prompt_cached: prompt tokens the prompt cache supplied; "
            "drafted: tokens speculative decoding drafted and the model verified, draft_accepted: those it kept; "
            "prediction_accepted, prediction_rejected: drafted from a request's prediction, kept or not)",
            ["instance", "kind"],
            registry=self.registry,
        )
        self.decode_steps = Counter(
            "tether_decode_steps",
            "Engine steps that produced completion tokens (with speculative decoding one step may give several: "
            "completion tokens / steps is the tokens per step)",
            ["instance"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tether_time_to_first_token_seconds",
            "From the request's arrival to its first token",
            ["instance"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.duration = Histogram(
            "tether_request_duration_seconds",
            "From the request's arrival to its end",
            ["instance"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.detection = Histogram(
            "tether_failure_detection_seconds",
            "From a runner's death (or its hang deadline) to every request ended with the cause",
            ["cause"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.loads = Counter(
            "tether_model_loads",
            "Model loads by the scheduler, by outcome (loaded, failed)",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.load_seconds = Histogram(
            "tether_model_load_seconds",
            "From a load's start (a request for an unloaded model) to its runner ready, evictions included",
            ["model"],
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.load_wait = Histogram(
            "tether_model_load_wait_seconds",
            "How long a request for a model that was not loaded waited for its load",
            ["model"],
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.evictions = Counter(
            "tether_model_evictions",
            "Models unloaded by the scheduler, by reason (memory, gpu_memory, max_loaded, keep_alive, deleted, failed, "
            "requested)",
            ["model", "reason"],
            registry=self.registry,
        )
        self.reclaim_wait = Histogram(
            "tether_memory_reclaim_wait_seconds",
            "From evicting models to node memory back (their groups reaped and memory risen)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.reclaimed = Counter(
            "tether_memory_reclaimed_bytes", "Node memory that came back after evictions", registry=self.registry
        )
        self.refusals = Counter(
            "tether_model_refusals",
            "Loads refused (does not fit, reclaim timed out)",
            ["model"],
            registry=self.registry,
        )
        self.guard_refusals = Counter(
            "tether_guard_refusals",
            "Requests refused before any route, by why: host (not a name this server answers to: DNS rebinding), "
            "origin (another site's web page), api_key, body (over --max-body)",
            ["reason"],
            registry=self.registry,
        )
        self._fleet = fleet
        self._scheduler = scheduler
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()  # ids labelled, oldest first
        fleet.listeners.add(self.watch)
        if scheduler is not None:
            self.registry.register(_SchedulerCollector(scheduler))
            scheduler.listeners.add(self.decided)

    def watch_upkeep(self, upkeep: Upkeep) -> None:
        """Observe each of the worker's clocked collections."""

        def collected(pause: float, found: int) -> None:
            self.gc_pause.observe(pause)
            self.gc_collected.inc(found)

        upkeep.listeners.append(collected)

    def decided(self, d: Decision) -> None:
        """Count one scheduler decision."""
        if d.kind == "loaded":
            self.loads.labels(d.model, "loaded").inc()
            if d.seconds is not None:
                self.load_seconds.labels(d.model).observe(d.seconds)
        elif d.kind == "load_failed":
            self.loads.labels(d.model, "failed").inc()
        elif d.kind in ("evict", "unload"):
            self.evictions.labels(d.model, d.why or d.kind).inc()
        elif d.kind == "reclaimed":
            if d.seconds is not None:
                self.reclaim_wait.observe(d.seconds)
            self.reclaimed.inc(d.bytes or 0)
        elif d.kind in ("refuse", "wait_memory"):
            self.refusals.labels(d.model).inc()

    def by_id(self) -> list[Any]:
        """The metrics whose first label is an instance or model id."""
        return [
            self.requests,
            self.tokens,
            self.decode_steps,
            self.ttft,
            self.duration,
            self.loads,
            self.load_seconds,
            self.load_wait,
            self.evictions,
            self.refusals,
        ]

    def labelled_ids(self) -> set[str]:
        """Every instance or model id some metric has a label set for."""
        return {key[0] for metric in self.by_id() for key in list(_label_sets(metric))}

    def forget_gone(self) -> None:
        """Drop the label sets of ids neither served nor catalogued any more, but the latest ``GONE_IDS``."""
        live = {h.id for h in self._fleet.list()}
        if self._scheduler is not None:
            live |= set(self._scheduler.slots)
        for seen in self.labelled_ids() - set(self._ids):  # labelled before its instance was watched
            self._ids[seen] = None
        gone = [i for i in self._ids if i not in live]
        for old in gone[: max(0, len(gone) - GONE_IDS)]:
            del self._ids[old]
            for metric in self.by_id():
                for key in [k for k in list(_label_sets(metric)) if k[0] == old]:
                    metric.remove(*key)

    def watch(self, hosted: Hosted) -> None:
        """Observe each failed life's detection latency as it is recorded (and forget the oldest gone ids' label
        sets: an instance added is when one may have gone)."""
        self._ids.pop(hosted.id, None)
        self._ids[hosted.id] = None
        self.forget_gone()
        inst = hosted.instance
        observed = inst.failures.total()

        def on_state(state: InstanceState) -> None:
            nonlocal observed
            if not isinstance(state, InstanceRestarting | InstanceFailed):
                return
            new = inst.failures.total() - observed  # the history keeps the latest: the new ones are at its end
            for failure in inst.history[max(0, len(inst.history) - new) :] if new else ():
                if failure.detected_in is not None:
                    self.detection.labels(failure.cause.kind.value).observe(failure.detected_in)
            observed = inst.failures.total()

        hosted.instance.add_state_listener(on_state)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _label_sets(metric: Any) -> dict[tuple[str, ...], Any]:
    """A labelled metric's children by label values (prometheus_client keeps them in ``_metrics``; its public API
    removes one but cannot list them)."""
    found: dict[tuple[str, ...], Any] = getattr(metric, "_metrics", {})
    return found
