"""What the API answers beside each dialect's own replies: errors in both shapes, the token log-probability every
dialect writes, the models a request can name, instances, the node and the cluster. Every body is a msgspec struct,
encoded as it is and described by the OpenAPI document (``schema``) from the same struct, so a field a response
carries is a field the schema states; each dialect's own reply types live in its module (``dialects``), under the
same rule.

The builders at the end turn the fleet's objects (instances, their runners, replicas and ranks, the scheduler, the
node, a cluster's view) into these structs; nothing builds a response dict beside them. A field that only some
answers carry is ``UNSET`` (omitted) in the others; ``None`` is sent as ``null``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Literal, Protocol

import msgspec
from msgspec import UNSET, UnsetType

import tether
from tether.fleet.facts import ListedModel, facts
from tether.fleet.fleet import Hosted
from tether.fleet.scheduler import Decision, Scheduler, Slot, footprint_of
from tether.node.hangs import Deadlines
from tether.node.instance import Instance, InstanceReady, InstanceRestarting, RestartPolicy
from tether.node.memory import NodeMemory, ProcessMemory
from tether.node.ranks import RankGroup
from tether.protocol import Cause, TokenLogprob, tag_of

encode = msgspec.json.Encoder().encode

# --------------------------------------------------------------------------------------------------------------
# Errors, in OpenAI's shape and in Ollama's
# --------------------------------------------------------------------------------------------------------------


class CauseOut(msgspec.Struct):
    """Why a runner failed, with its evidence (the same object in errors, instances and their history)."""

    kind: str
    summary: str
    evidence: list[str]
    phase: str | None
    exit_code: int | None
    signal: str | None  # its name: "SIGKILL"
    rank: int | None = None  # the rank that failed, in a multi-rank instance


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None
    cause: CauseOut | UnsetType = UNSET  # a runner failure: why
    completion_tokens: int | UnsetType = UNSET  # a generation that ended early: tokens it produced first
    nodes: list[dict[str, Any]] | UnsetType = UNSET  # a 507 on a cluster: each node's verdict
    host: str | UnsetType = UNSET  # a 403 host_not_allowed: the Host refused
    origin: str | UnsetType = UNSET  # a 403 origin_not_allowed: the Origin refused


class ErrorBody(msgspec.Struct):
    """OpenAI's error shape."""

    error: ErrorDetail


class OllamaErrorBody(msgspec.Struct):
    """Ollama's error shape (the ``ollama`` clients raise ``ResponseError`` with ``error``), with tether's ``code``,
    the invalid field (``param``) and a runner failure's ``cause`` beside the message."""

    error: str
    code: str | None
    param: str | UnsetType = UNSET
    cause: CauseOut | UnsetType = UNSET
    completion_tokens: int | UnsetType = UNSET
    nodes: list[dict[str, Any]] | UnsetType = UNSET
    host: str | UnsetType = UNSET
    origin: str | UnsetType = UNSET


# --------------------------------------------------------------------------------------------------------------
# What every dialect writes: a token's log-probability
# --------------------------------------------------------------------------------------------------------------


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float | None  # null only where the log-probability is -inf
    bytes: list[int]


class LogprobOut(msgspec.Struct):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


def chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    """One token as ``LogprobOut`` (OpenAI's chat shape, which Ollama's and the Responses API's logprobs share):
    ``bytes`` as a list of ints, as OpenAI sends them."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.piece),
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.piece)} for t in entry.top],
    }


class SpeculationUsage(msgspec.Struct):
    """tether's extension of a response's ``usage`` (chat, completions, Responses): tokens speculative decoding
    drafted and the model verified, those it kept, and the engine steps the completion took (fewer than its tokens
    when drafts were kept). All 0 where the engine drafts nothing or counts no steps."""

    draft_tokens: int
    accepted_tokens: int
    decode_steps: int


# --------------------------------------------------------------------------------------------------------------
# Models, instances, the node
# --------------------------------------------------------------------------------------------------------------


class ModelOut(msgspec.Struct):
    """A model as OpenAI lists it, with what tether knows beside: a catalogued model's scheduling (``aliases`` to
    ``source``), or an instance added through ``POST /v1/instances`` (``pinned``: it stays until it is deleted)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    state: str | UnsetType = UNSET  # unloaded, loading, loaded, unloading; an added instance's own state
    engine: str | UnsetType = UNSET
    model: str | UnsetType | None = UNSET
    pinned: bool | UnsetType = UNSET
    footprint: int | UnsetType | None = UNSET  # bytes its runner holds (None: not loaded)
    aliases: list[str] | UnsetType = UNSET
    keep_alive: float | UnsetType | None = UNSET  # seconds idle before it is unloaded (None: for ever)
    expires_in: float | UnsetType | None = UNSET  # seconds until keep-alive unloads it (None: not counting down)
    busy: bool | UnsetType = UNSET
    estimate: int | UnsetType | None = UNSET  # bytes the fit check expects it to need
    loads: int | UnsetType = UNSET
    load_seconds: float | UnsetType | None = UNSET  # the last load's, request to ready
    source: str | UnsetType = UNSET  # where it is catalogued: the catalog file, the models directory, built in
    # what it serves, in Ollama's names: ["embedding"] for an embedding instance (clients must not offer it for chat)
    capabilities: list[str] | UnsetType = UNSET


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelOut]


class CatalogModelOut(msgspec.Struct):
    """A catalogued model's scheduling state (``GET /v1/models`` shows the same beside OpenAI's fields)."""

    state: str
    aliases: list[str]
    engine: str
    model: str | None
    pinned: bool
    keep_alive: float | None
    expires_in: float | None
    busy: bool
    footprint: int | None
    estimate: int | None
    loads: int
    load_seconds: float | None
    source: str


class SchedulerOut(msgspec.Struct):
    """The scheduler: its settings, its models, its last decisions (``tether status`` prints them)."""

    max_loaded: int | None
    load_wait: float
    reclaim_timeout: float
    models: dict[str, CatalogModelOut]
    decisions: list[Decision]


class QueueOut(msgspec.Struct):
    """Generations admitted: ``running`` in the runner's batch (at most ``parallel``) plus ``waiting`` for a slot
    (at most ``max_queue``); ``in_flight`` is their sum, ``limit`` its bound (beyond it: 503 with Retry-After)."""

    running: int
    waiting: int
    in_flight: int
    parallel: int
    max_queue: int
    limit: int


class RunnerMemoryOut(msgspec.Struct):
    """A runner's memory in bytes: ``footprint`` is what killing its group frees (anonymous + shmem + swap + GPU),
    beside the raw figures (``tether.node.memory.ProcessMemory``)."""

    footprint: int
    rss: int
    pss: int | None
    uss: int | None
    anon: int
    file: int
    swap: int
    gpu: int | None
    pss_anon: int | None
    shmem: int


class RunnerOut(msgspec.Struct):
    pid: int
    status: str  # the runner's own status: loading, warming_up, ready, ...
    memory: RunnerMemoryOut | None
    log: str | None  # its log file
    cgroup: str | None  # its own memory cgroup
    node: str | None  # on a cluster: the node it runs on


class PastLife(msgspec.Struct):
    """A life of an instance that ended in a failure."""

    at: float
    life: int
    pid: int | None
    detected_in: float | None  # seconds from the death to tether's verdict
    cause: CauseOut
    log: str | None = None  # that life's runner log file (``GET /v1/instances/{id}/log?life=N`` reads it)
    resumed: int = 0  # requests it held that went on on a new runner (docs/resume.md)


class ReplicaOut(msgspec.Struct):
    """One copy of a replicated instance (each a runner of its own); ``serving``: its requests now."""

    name: str
    state: str
    node: str | None
    pid: int | None
    serving: int
    restarts: int
    cause: CauseOut | None


class RankOut(msgspec.Struct, forbid_unknown_fields=True):
    """One rank of a multi-rank instance (requests go to rank 0)."""

    rank: int
    address: str
    node: str | None
    pid: int | None
    status: str | None
    alive: bool
    log: str | None


class RequestOut(msgspec.Struct):
    """A request an instance serves now (the dashboard cancels one by ``id``)."""

    id: str
    replica: str
    tokens: int


class OffloadOut(msgspec.Struct):
    """The layers an instance puts on GPUs, as its fit check placed them: ``n_gpu_layers`` of ``layers`` (the output
    layer counts as one), on ``devices``; ``vram_needed`` each device's estimate, ``vram_budget`` what each may use
    (its NVML free memory less the margin at placement, or the limit given), ``host`` the estimate left on the host."""

    n_gpu_layers: int
    layers: int
    auto: bool
    devices: list[int]
    vram_needed: list[int]
    vram_budget: list[int | None]
    host: int
    message: str


def offload_of(estimate: object) -> OffloadOut | None:
    """The offload an estimate carries (the llama.cpp engine's), or None."""
    offload = getattr(estimate, "offload", None)
    total = getattr(estimate, "total", None)
    if offload is None or not isinstance(total, int):
        return None
    return OffloadOut(
        n_gpu_layers=offload.n_gpu_layers,
        layers=offload.layers,
        auto=offload.auto,
        devices=list(offload.devices),
        vram_needed=list(offload.vram),
        vram_budget=list(offload.budgets),
        host=total,
        message=offload.describe(),
    )


class SpeculationOut(msgspec.Struct):
    """Speculative decoding on an instance, over its ended generations: ``accepted_tokens`` of ``draft_tokens`` were
    kept (the acceptance); the generations that counted their steps gave ``completion_tokens`` in ``decode_steps``
    engine steps (the tokens per step). All 0 where the engine drafts nothing."""

    draft_tokens: int
    accepted_tokens: int
    decode_steps: int
    completion_tokens: int


class ResumesOut(msgspec.Struct):
    """What its runners' deaths did to the requests they held (docs/resume.md): ``resumed`` went on on a new runner,
    ``not_resumed`` failed with the cause (and why not), ``quarantined`` were proven to kill their runner;
    ``pause_p99_s``: the 0.99 quantile of the latest resumed streams' pauses (None before the first);
    ``store_bytes``: what its store of saved prompts holds, memory that outlives its runners (freed with the
    instance, and counted in what evicting it frees)."""

    enabled: bool
    resumed: int
    not_resumed: int
    quarantined: int
    pause_p99_s: float | None
    store_bytes: int = 0


class InstanceOut(msgspec.Struct):
    """One instance: its state, its runner (pid, memory, log, cgroup) and every failure of its past lives."""

    id: str
    object: Literal["instance"]
    created: int
    engine: str
    model: str | None
    options: dict[str, Any]
    state: str
    detail: dict[str, Any]  # the state's own fields (life, since, cause, resume_at, ...)
    reason: str | None  # why it cannot take requests now (None: it can)
    ready: bool
    runner: RunnerOut | None
    pids: list[int]
    restarts: int
    failures: dict[str, int]  # every failed life by cause kind (``history`` keeps the latest 64)
    queue: QueueOut
    cause: CauseOut | None
    history: list[PastLife]
    life: int | None  # the current life (None once stopped or failed)
    backoff_remaining: float | None  # seconds until a restarting instance's next life starts
    tokens: int  # completion tokens served so far, streams in flight included: two reads give tokens/s
    speculation: SpeculationOut  # drafted and kept tokens, steps: the dashboard's acceptance and tokens per step
    resumes: ResumesOut  # requests its runners' deaths resumed, failed and proved to kill
    fit: str | None  # the fit check's verdict, with the numbers
    offload: OffloadOut | None  # layers on GPUs, as the fit check placed them (None: no split was made)
    measured: str | None  # what the runner was measured to hold once ready, against the estimate
    restart: RestartPolicy
    deadlines: Deadlines
    replicas: list[ReplicaOut]  # each copy (one for an instance without replicas)
    spread: str  # how replicas are placed over nodes (Ray placement strategy: SPREAD, STRICT_SPREAD, PACK)
    ranks: list[RankOut] | None  # a multi-rank instance's ranks now
    chat_template: str | None  # chats are written with: "gguf" (the model's own), a built-in's name, a Jinja file
    in_flight_requests: list[RequestOut] | UnsetType = UNSET  # GET's answers only, not POST's


class NodeMemoryOut(msgspec.Struct):
    available: int
    total: int  # the cgroup's limit where there is one, else the host's memory
    source: str  # where ``available`` comes from
    host_total: int
    host_available: int


class GpuOut(msgspec.Struct):
    index: int
    name: str
    used: int
    total: int


class NodeOut(msgspec.Struct):
    """This machine as tether measures it: the worker, available memory and where the number comes from, GPUs."""

    pid: int
    version: str
    uptime: float
    memory: NodeMemoryOut
    gpus: list[GpuOut] | None
    gpu_reason: str | None  # why there are no GPU figures


class ClusterNodeOut(msgspec.Struct, forbid_unknown_fields=True):
    """A Ray node's agent as the coordinator sees it."""

    node: str
    host: str | None  # None, as agent_pid, while its agent is joining: placed on the node, not yet started
    ip: str | None  # the node's address (Ray's node IP), where its ranks listen; None while joining
    agent_pid: int | None
    state: str
    cause: str | None  # why it was lost
    heard_ago: float  # seconds since its last heartbeat
    lost_at: float | None  # CLOCK_MONOTONIC of tether's verdict
    ray_notified_at: float | None  # and of Ray's notification of the same death
    memory: dict[str, Any] | None  # its memory as its agent measures it
    runners: list[str]


class ClusterOut(msgspec.Struct, forbid_unknown_fields=True):
    address: str | None
    nodes: list[ClusterNodeOut]
    events: list[dict[str, Any]]  # nodes joined and lost: at, node, kind, why
    lost_after: float
    lease: float


class InstanceList(msgspec.Struct):
    object: Literal["list"]
    data: list[InstanceOut]
    node: NodeOut
    scheduler: SchedulerOut
    cluster: ClusterOut | UnsetType = UNSET  # served on a Ray cluster only


class RunnerLog(msgspec.Struct):
    """The last lines of one life's runner log."""

    id: str
    life: int
    path: str
    lines: list[str]
    truncated: bool


class Deleted(msgspec.Struct):
    id: str
    object: Literal["instance"]
    deleted: bool
    state: str


class CancelOut(msgspec.Struct):
    """Always a 200: a cancel of a request that already ended (a client that left, a stop pressed twice) is no
    error, it says so (``cancelled`` false, ``detail`` how it ended)."""

    id: str
    outcome: Literal["requested", "finished", "unknown", "runner_gone"]
    detail: str
    state: str | None
    cancelled: bool  # whether this call cancelled it (false: it had ended, or is unknown)


class Health(msgspec.Struct):
    status: Literal["ok"]


class Readiness(msgspec.Struct):
    ready: bool
    instances: dict[str, str]


# --------------------------------------------------------------------------------------------------------------
# Builders: the fleet's objects as the structs above
# --------------------------------------------------------------------------------------------------------------


class ClusterView(Protocol):
    """The Ray cluster's nodes, agents and events (``tether.cluster.coordinator.Cluster``), for GET /v1/instances."""

    def view(self) -> dict[str, Any]: ...


def cause_out(cause: Cause) -> CauseOut:
    return CauseOut(
        kind=cause.kind.value,
        summary=cause.summary,
        evidence=list(cause.evidence),
        phase=cause.phase,
        exit_code=cause.exit_code,
        signal=cause.signal,
        rank=cause.rank,
    )


def _cause(cause: Cause | None) -> CauseOut | None:
    return cause_out(cause) if cause is not None else None


def runner_memory(memory: ProcessMemory) -> RunnerMemoryOut:
    return RunnerMemoryOut(
        footprint=memory.footprint,
        rss=memory.rss,
        pss=memory.pss,
        uss=memory.uss,
        anon=memory.anon,
        file=memory.file,
        swap=memory.swap,
        gpu=memory.gpu,
        pss_anon=memory.pss_anon,
        shmem=memory.shmem,
    )


def life_of(state: Any) -> int | None:
    """The life an instance state belongs to (None for states outside a life: stopped, failed)."""
    life: int | None = getattr(state, "life", None)
    return life


def _replica(inst: Instance, serving: int) -> ReplicaOut:
    sup = inst.supervisor
    return ReplicaOut(
        name=inst.name,
        state=tag_of(inst.state),
        node=sup.node if sup is not None else None,
        pid=sup.pid if sup is not None else None,
        serving=serving,
        restarts=inst.restarts,
        cause=_cause(inst.cause),
    )


def instance_out(hosted: Hosted, requests: list[RequestOut] | UnsetType = UNSET) -> InstanceOut:
    """``hosted`` now (its runner's memory as last sampled); ``requests``: those it serves, for GET's answers."""
    inst = hosted.instance
    state = inst.state
    sup = hosted.supervisor
    runner: RunnerOut | None = None
    if sup is not None and sup.pid is not None:
        memory = sup.footprint
        runner = RunnerOut(
            pid=sup.pid,
            status=tag_of(sup.status),
            memory=runner_memory(memory) if memory is not None else None,
            log=str(sup.output_log) if sup.output_log else None,
            cgroup=str(sup.cgroup) if sup.cgroup is not None else None,
            node=sup.node,
        )
    running, waiting = hosted.generations()
    ranks = sup.ranks() if isinstance(sup, RankGroup) else None
    return InstanceOut(
        id=hosted.id,
        object="instance",
        created=int(hosted.created_at),
        engine=inst.spec.engine,
        model=hosted.config.model,
        options=hosted.config.options,
        state=tag_of(state),
        detail=msgspec.to_builtins(state),
        reason=inst.unavailable_reason(),
        ready=isinstance(state, InstanceReady),
        runner=runner,
        pids=list(inst.pids),
        restarts=inst.restarts,
        failures={kind.value: count for kind, count in inst.failures.items()},
        queue=QueueOut(
            running=running,
            waiting=waiting,
            in_flight=hosted.in_flight,
            parallel=hosted.parallel,
            max_queue=hosted.config.max_queue,
            limit=hosted.limit,
        ),
        cause=_cause(inst.cause),
        history=[
            PastLife(
                at=f.at,
                life=f.life,
                pid=f.pid,
                detected_in=f.detected_in,
                cause=cause_out(f.cause),
                log=f.log,
                resumed=hosted.resumes.resumed_from(inst.name, f.life) if hosted.resumes is not None else 0,
            )
            for f in inst.history
        ],
        life=life_of(state),
        backoff_remaining=(
            round(max(state.resume_at - inst.settings.clock.now(), 0.0), 2)
            if isinstance(state, InstanceRestarting)
            else None
        ),
        tokens=hosted.tokens(),
        speculation=SpeculationOut(
            draft_tokens=hosted.drafts.draft_tokens,
            accepted_tokens=hosted.drafts.accepted_tokens,
            decode_steps=hosted.drafts.decode_steps,
            completion_tokens=hosted.drafts.completion_tokens,
        ),
        resumes=_resumes(hosted),
        fit=inst.fit.message if inst.fit is not None else None,
        offload=offload_of(inst.fit.estimate) if inst.fit is not None else None,
        measured=inst.measured.describe() if inst.measured is not None else None,
        restart=hosted.config.restart,
        deadlines=hosted.config.deadlines,
        replicas=[_replica(r, hosted.serving.get(r, 0)) for r in hosted.replicas],
        spread=hosted.config.spread,
        ranks=msgspec.convert(ranks, list[RankOut]) if ranks is not None else None,
        chat_template=facts(ListedModel.of(hosted)).template_name or None,
        in_flight_requests=requests,
    )


def _resumes(hosted: Hosted) -> ResumesOut:
    resumes = hosted.resumes
    if resumes is None:
        return ResumesOut(enabled=False, resumed=0, not_resumed=0, quarantined=0, pause_p99_s=None)
    pause = resumes.pause_quantile(0.99)
    return ResumesOut(
        enabled=resumes.policy.enabled,
        resumed=resumes.resumed.total(),
        not_resumed=resumes.not_resumed.total(),
        quarantined=resumes.proven,
        pause_p99_s=round(pause, 3) if pause is not None else None,
        store_bytes=hosted.store_bytes(),
    )


def node_out(memory: NodeMemory, started_at: float) -> NodeOut:
    """This machine as the dashboard and ``tether status`` show it: the worker, and memory as tether measures it."""
    return NodeOut(
        pid=os.getpid(),
        version=tether.__version__,
        uptime=round(time.time() - started_at, 1),
        memory=NodeMemoryOut(
            available=memory.available,
            total=memory.cgroup_limit if memory.cgroup_limit is not None else memory.host_total,
            source=memory.source,
            host_total=memory.host_total,
            host_available=memory.host_available,
        ),
        gpus=[GpuOut(index=g.index, name=g.name, used=g.total - g.free, total=g.total) for g in memory.gpus] or None,
        gpu_reason=memory.gpu_reason,
    )


def catalog_model_out(slot: Slot, now: float) -> CatalogModelOut:
    """A catalogued model as ``GET /v1/models`` and the scheduler's view show it."""
    hosted = slot.hosted
    estimate = slot.estimate
    return CatalogModelOut(
        state=slot.state,
        aliases=list(slot.model.aliases),
        engine=slot.model.config.spec().engine,
        model=slot.model.config.model,
        pinned=slot.model.pinned,
        keep_alive=None if math.isinf(slot.keep_alive) else slot.keep_alive,
        expires_in=slot.expires_in(now),
        busy=not slot.idle,
        footprint=footprint_of(hosted) if hosted is not None else None,
        estimate=estimate.total if estimate is not None else None,
        loads=slot.loads,
        load_seconds=slot.load_seconds,
        source=slot.model.source,
    )


def scheduler_out(scheduler: Scheduler) -> SchedulerOut:
    """The scheduler for ``GET /v1/instances`` and ``tether status``: its settings, its models, its decisions."""
    now = scheduler.now()
    return SchedulerOut(
        max_loaded=scheduler.max_loaded,
        load_wait=scheduler.load_wait,
        reclaim_timeout=scheduler.reclaim_timeout,
        models={slot.id: catalog_model_out(slot, now) for slot in scheduler.slots.values()},
        decisions=list(scheduler.decisions),
    )


def cluster_out(cluster: ClusterView) -> ClusterOut:
    """The coordinator's view, checked against ``ClusterOut`` (a key it does not describe is an error here)."""
    return msgspec.convert(cluster.view(), ClusterOut)
