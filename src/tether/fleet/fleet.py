"""The serving worker's model instances: created and deleted at run time, each with a bounded request queue.

A ``Fleet`` owns every ``Instance`` of a worker (``tether serve``). Each instance runs in a host task of its own (an
``Instance`` is an async context manager, and a task group must be left by the task that entered it), so an HTTP
handler can create one and another can delete it. Requests are admitted per instance up to its runner's
``parallel`` (the generations its engine batches) plus ``max_queue`` waiting for a slot; a runner that dies fails
everything running and waiting with its cause (the supervisor's guarantee), and a full queue answers "busy, retry
in N s" instead of letting latency grow without bound.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, Literal, Protocol

import anyio
import msgspec
from anyio.abc import TaskGroup

from tether.engines import registry
from tether.errors import (
    InstanceExists,
    InvalidField,
    NotFound,
    TetherError,
    UnknownEngine,
)
from tether.fleet.resume import Journal, Resumable, ResumePolicy, Resumes, policy_of
from tether.kernel.ports import RankPorts
from tether.models import DefaultModelMissing, default_model_path
from tether.node import fit, stores
from tether.node.hangs import Deadlines
from tether.node.instance import (
    Instance,
    InstanceReady,
    InstanceRestarting,
    InstanceStarting,
    LifeFactory,
    Placer,
    RestartPolicy,
)
from tether.node.life import RunnerLife
from tether.node.listeners import Listeners
from tether.node.ranks import MAX_RANKS, RankGroup, Site, check_ports
from tether.node.recent import Recent
from tether.node.settings import DEFAULT, SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.node.tasks import CancelReply, RunnerUnavailable
from tether.protocol import Cause, EngineSpec, Fault, Work, documented

log = logging.getLogger("tether.fleet.fleet")

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Ended request ids (and their outcomes) remembered so a late cancel answers "finished", not "unknown": minutes of
# traffic at hundreds of requests a second, ~170 bytes each (1.7 MB when full; bench/soak.py's worker fills it in
# about 15 minutes, then it stays flat). Requests in flight and their cancels are kept only while they run.
RECENT_REQUESTS = 10_000  # ended request ids kept for a late cancel's answer, at most
RECENT_SECONDS = 300.0  # and none older (a cancel that late answers "unknown": a no-op either way)
MAX_QUEUE_LIMIT = 1 << 20
MIN_MEMORY_LIMIT = 16 << 20  # below this a runner cannot even start Python
MAX_REPLICAS = 64
Spread = Literal["SPREAD", "STRICT_SPREAD", "PACK"]
LOCAL_HOST = "127.0.0.1"  # where the ranks of a multi-rank instance on this machine reach each other


class Unavailable(TetherError):
    """A request cannot be served now: why, and when to retry (``retry_after`` seconds; None: not by retrying).

    ``cause`` is the runner failure behind it, when there is one.
    """

    def __init__(self, message: str, *, retry_after: float | None, cause: Cause | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.cause = cause


class InstanceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model instance, as ``POST /v1/instances`` takes it (and ``tether serve`` builds its first one)."""

    id: Annotated[str, documented(pattern=ID_PATTERN.pattern)] | None = None  # default: see ``default_id``
    engine: str = "llama.cpp"
    model: str | None = None  # a GGUF path; None is the built-in default model
    options: dict[str, Any] = msgspec.field(default_factory=dict)  # engine options (n_ctx, n_threads, ...)
    faults: tuple[Fault, ...] = ()  # debug engine only
    restart: RestartPolicy = msgspec.field(default_factory=RestartPolicy)
    deadlines: Deadlines = msgspec.field(default_factory=Deadlines)
    memory_limit: Annotated[int, documented(minimum=MIN_MEMORY_LIMIT, maximum=(1 << 63) - 1)] | None = None  # bytes
    max_queue: Annotated[int, documented(minimum=1, maximum=MAX_QUEUE_LIMIT)] = 16  # waiting, beyond parallel running
    force: bool = False  # load even when the fit check says it does not fit
    # Copies of the instance, each a runner of its own; requests go to the least loaded ready one. On a cluster
    # ``spread`` says where: SPREAD prefers distinct nodes, STRICT_SPREAD requires them, PACK prefers shared ones.
    replicas: Annotated[int, documented(minimum=1, maximum=MAX_REPLICAS)] = 1
    spread: Spread = "SPREAD"
    # Runners per life, one per rank, that fail and restart together (an engine that declares ``distributed``); on a
    # cluster each on a node of its own. Requests go to rank 0. ``ports``: one per rank, the same for every life
    # (default: tether picks free ones from 25100 on). "auto", for an engine that splits the model among its ranks
    # (llama.cpp): on a cluster, one runner when a node holds the model whole, else the fewest nodes whose shares
    # (by their free memory) fit, decided again for every life; without a cluster, 1 (splitting one machine's memory
    # among ranks on it adds none).
    ranks: Annotated[int, documented(minimum=1, maximum=MAX_RANKS)] | Literal["auto"] = 1
    ports: tuple[Annotated[int, documented(minimum=1024, maximum=65535)], ...] | None = None
    # What happens to the requests a runner held when it dies: they resume on its next life or another replica
    # (true, or a ``ResumePolicy``: how often, how long a request proven to kill its runner is refused); false fails
    # them with the cause at once.
    resume: bool | ResumePolicy = True

    def check(self) -> InvalidField | None:
        """What is wrong with this config (naming the field), or None. Resolves the engine through the registry
        (``UnknownEngine`` lists what is installed), so every name of an engine is checked alike."""
        if self.id is not None and not ID_PATTERN.match(self.id):
            return InvalidField(
                "id",
                f"id must match {ID_PATTERN.pattern} (letters, digits, '.', '_', '-'; at most 64), got {self.id!r}",
            )
        try:
            engine = registry.canonical(self.engine)
            registry.engine_class(engine)  # an engine named where it is must import, and keep the contract
        except UnknownEngine as exc:
            return exc
        if self.id is None and not ID_PATTERN.match(default := self.default_id()):
            return InvalidField(
                "id",
                f"without an id, the instance is named after its model file's stem, {default!r}, which is no valid id "
                f"({ID_PATTERN.pattern}): pass an id",
            )
        if not 1 <= self.max_queue <= MAX_QUEUE_LIMIT:
            return InvalidField("max_queue", f"max_queue must be in [1, {MAX_QUEUE_LIMIT}], got {self.max_queue}")
        if self.memory_limit is not None and not MIN_MEMORY_LIMIT <= self.memory_limit < (1 << 63):
            return InvalidField(
                "memory_limit",
                f"memory_limit must be at least 16 MiB (16777216 bytes) and below 2**63 bytes, got {self.memory_limit}",
            )
        if not 1 <= self.replicas <= MAX_REPLICAS:
            return InvalidField("replicas", f"replicas must be in [1, {MAX_REPLICAS}], got {self.replicas}")
        problem = self._check_ranks(engine)
        if problem is not None:
            return problem
        problem = policy_of(self.resume).check()
        if problem is not None:
            return problem
        if self.faults and engine != "debug":
            return InvalidField("faults", "faults are for the debug engine only")
        if self.memory_limit is None and any(fault.kind == "oom" for fault in self.faults):
            return InvalidField(
                "faults",
                "an 'oom' fault allocates until the kernel kills the process: without memory_limit that is the whole "
                "machine's memory (and the OOM killer may pick another process); set memory_limit, e.g. 134217728",
            )
        return None

    def _check_ranks(self, engine: str) -> InvalidField | None:
        if self.ranks == "auto":
            return self._check_auto_ranks(engine)
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int):
            return InvalidField("ranks", f"ranks must be a number in [1, {MAX_RANKS}] or 'auto', got {self.ranks!r}")
        if not 1 <= self.ranks <= MAX_RANKS:
            return InvalidField("ranks", f"ranks must be in [1, {MAX_RANKS}], got {self.ranks}")
        if self.ranks == 1:
            return None if self.ports is None else InvalidField("ports", "ports are for multi-rank instances (ranks>1)")
        if not getattr(registry.engine_class(engine), "distributed", False):
            return InvalidField(
                "ranks",
                f"engine {engine!r} runs in one process: ranks > 1 needs an engine that declares distributed = True "
                "and takes part in every step of rank 0 (the debug engine's ring mode does; see the README on "
                "multi-rank instances)",
            )
        if self.replicas > 1:
            return InvalidField("replicas", "replicas of a multi-rank instance are not supported yet: use ranks alone")
        return check_ports(self.ports, self.ranks) if self.ports is not None else None

    def _check_auto_ranks(self, engine: str) -> InvalidField | None:
        if not registry.splits_model(engine):
            return InvalidField(
                "ranks",
                f"ranks 'auto' is for an engine that divides one model among its ranks (splits_model = True, as "
                f"llama.cpp does): engine {engine!r} "
                + (
                    "gives every rank a whole copy, so more ranks never make it fit"
                    if getattr(registry.engine_class(engine), "distributed", False)
                    else "runs in one process"
                )
                + f"; give ranks a number (1..{MAX_RANKS})",
            )
        if self.ports is not None:
            return InvalidField(
                "ports",
                "ports are one per rank, and with ranks 'auto' the number of ranks is the placement's: give ranks a "
                "number with as many ports, or leave ports out (tether picks free ones)",
            )
        if self.replicas > 1:
            return InvalidField("replicas", "replicas of a multi-rank instance are not supported yet: use ranks alone")
        return None

    def spec(self) -> EngineSpec:
        """The engine spec, under the engine's one name (an alias resolved, a file path made absolute)."""
        return EngineSpec(
            engine=registry.canonical(self.engine), model=self.model, options=dict(self.options), faults=self.faults
        )

    def default_id(self) -> str:
        """The id when none is given: the model file's stem, the default model's for llama.cpp without a model, else
        the engine's own ``name`` (a plugin without a model is not named after llama.cpp's default model)."""
        if self.id is not None:
            return self.id
        engine = registry.canonical(self.engine)
        if self.model is not None and engine != "debug":  # the debug engine reads no model
            return Path(self.model).stem
        if engine == "llama.cpp":
            try:
                return default_model_path().stem
            except DefaultModelMissing:
                return "default"
        name = getattr(registry.engine_class(engine), "name", None)
        return name if isinstance(name, str) and ID_PATTERN.match(name) else "engine"


@dataclass
class Drafts:
    """Speculative decoding on one instance, summed over its ended generations: tokens drafted and verified, those
    the model kept, and the engine steps and completion tokens of the generations that counted their steps (so
    kept / drafted is the acceptance, and completion tokens / steps the tokens each step gave)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int = 0
    completion_tokens: int = 0

    def add(self, drafted: int, accepted: int, steps: int, completion_tokens: int) -> None:
        """Count one ended generation (its completion tokens only when it counted its steps)."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if steps:
            self.decode_steps += steps
            self.completion_tokens += completion_tokens


@dataclass
class Hosted:
    """One instance of the fleet and what the API needs beside it: its config, its replicas and its request queue."""

    id: str
    config: InstanceConfig
    replicas: list[Instance]
    parallel: int = 1  # generations each replica's runner serves at once
    created_at: float = field(default_factory=time.time)
    in_flight: int = 0  # generations admitted and not ended (running + waiting in the runner's queue)
    serving: dict[Instance, int] = field(default_factory=dict)  # replica -> generations handed to it, not ended
    tokens_done: int = 0  # completion tokens of the generations that ended (``tokens`` adds those in flight)
    drafts: Drafts = field(default_factory=Drafts)  # speculative decoding, over the generations that ended
    resumes: Resumes | None = None  # the requests its runners' deaths resumed, and the ones proven to cause them
    _stop: anyio.Event = field(default_factory=anyio.Event)
    _done: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        if self.resumes is None:  # (the fleet passes one answering its replicas' restart policies)
            self.resumes = Resumes(self.id, policy_of(self.config.resume), DEFAULT.clock)

    @property
    def instance(self) -> Instance:
        """The replica that speaks for the instance: the first ready one, else the first (its only one, mostly)."""
        return next((r for r in self.replicas if isinstance(r.state, InstanceReady)), self.replicas[0])

    @property
    def supervisor(self) -> RunnerLife | None:
        return self.instance.supervisor

    @property
    def limit(self) -> int:
        """Generations admitted at most: ``parallel`` running on each replica plus ``max_queue`` waiting."""
        return self.parallel * len(self.replicas) + self.config.max_queue

    def pick(self) -> Instance | None:
        """The least loaded ready replica (ties: the first), or None when none is ready."""
        ready = [r for r in self.replicas if isinstance(r.state, InstanceReady)]
        return min(ready, key=lambda r: self.serving.get(r, 0)) if ready else None

    def generations(self) -> tuple[int, int]:
        """(running, waiting) now: in the runners' batches, and admitted but waiting for a slot (in a runner's queue
        or not yet handed to one)."""
        running = 0
        for replica in self.replicas:
            sup = replica.supervisor
            running += sup.generations()[0] if sup is not None else 0
        return running, max(self.in_flight - running, 0)

    @property
    def stores(self) -> list[Path]:
        """Its replicas' stores (``EngineSpec.store``, ``tether.node.stores``), where they have one."""
        return [Path(replica.spec.store) for replica in self.replicas if replica.spec.store is not None]

    def store_bytes(self) -> int:
        """What its stores hold: memory that outlives its runners, freed with the instance."""
        return sum(stores.size(path) for path in self.stores)

    def tokens(self) -> int:
        """Completion tokens served so far, streams in flight included: two reads a second apart give tokens/s now."""
        live = 0
        for replica in self.replicas:
            sup = replica.supervisor
            if sup is not None:
                live += sum(record.tokens for record in sup.in_flight())
        return self.tokens_done + live

    def retry_after(self) -> float | None:
        """How long until this instance can take a request again, as best known; None when retrying cannot help."""
        state = self.instance.state
        if isinstance(state, InstanceRestarting):
            return max(state.resume_at - self.instance.settings.clock.now(), 0.0) + 1.0  # the backoff, then a load
        if isinstance(state, InstanceStarting | InstanceReady):
            return 1.0
        return None


class Runners(Protocol):
    """Where an instance's runners live when not on this machine (the Ray cluster): it builds each replica's
    life factory, each rank's site, and learns which replicas belong together, so placement can spread them."""

    def runners(self, memory_limit: int | None) -> LifeFactory: ...

    def sites(self, instance: str, memory_limit: int | None) -> list[Site]: ...

    def world(self, instance: str) -> int: ...

    def join(self, instances: list[Instance], spread: Spread) -> None: ...

    def forget(self, instances: list[Instance]) -> None: ...


class Fleet:
    """The instances of one serving worker. Use as ``async with Fleet() as fleet:``; leaving stops them all."""

    def __init__(
        self,
        settings: SupervisorSettings = DEFAULT,
        *,
        placer: Placer | None = None,
        cluster: Runners | None = None,
    ) -> None:
        self.settings = settings  # how every local runner is supervised (a cluster's agents have their own)
        self.placer = placer  # decides every life's placement (the scheduler); None: the fit check alone
        self.cluster = cluster  # None: every runner on this machine
        self.rank_ports = RankPorts()  # each multi-rank instance's ports, kept for all its lives
        self._auto_ports: dict[str, dict[int, tuple[int, ...]]] = {}  # a ranks "auto" instance's ports, by rank count
        self._hosted: dict[str, Hosted] = {}
        self._requests: dict[str, tuple[Hosted, Resumable]] = {}  # request id -> its instance and handle, in flight
        self._recent: Recent[str] = Recent(RECENT_REQUESTS, RECENT_SECONDS)  # ended request id -> outcome
        self._cancelled: set[str] = set()  # requests in flight whose cancel was requested (a client gone, the route)
        self._tg: TaskGroup | None = None
        self.listeners: Listeners[Hosted] = Listeners("fleet")  # told of every instance added (metrics)

    async def __aenter__(self) -> Fleet:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:  # every instance stops concurrently, each within its bound
                for hosted in list(self._hosted.values()):
                    tg.start_soon(self._stop_one, hosted)
            stores.release()  # each instance's store went with it
        assert self._tg is not None
        await self._tg.__aexit__(exc_type, exc, tb)
        return None

    # --- instances ------------------------------------------------------------------------------------------

    def list(self) -> list[Hosted]:
        return list(self._hosted.values())

    def get(self, instance_id: str) -> Hosted:
        hosted = self._hosted.get(instance_id)
        if hosted is None:
            raise NotFound(f"no instance {instance_id!r}; instances: {', '.join(self._hosted) or 'none'}")
        return hosted

    async def add(self, config: InstanceConfig) -> Hosted:
        """Start an instance (it loads in the background). Raises ``InvalidField`` for a bad config (naming the
        field: ``UnknownEngine``, ``InvalidModel`` among them), ``InstanceExists`` for a taken id, and ``DoesNotFit``
        (with the numbers) when the model does not fit the memory available, unless ``force``."""
        assert self._tg is not None, "use 'async with Fleet()'"
        problem = config.check()
        if problem is not None:
            raise problem
        instance_id = config.default_id()
        if instance_id in self._hosted:
            raise InstanceExists(instance_id)
        spec = config.spec()
        refused = registry.spec_problem(spec)
        if (
            refused is None
            and isinstance(config.ranks, int)
            and config.ranks > 1
            and registry.splits_model(spec.engine)
        ):
            refused = next(  # what only a rank refuses (llama.cpp: n_gpu_layers, a layer_split of the wrong length)
                (p for r in (0, 1) if (p := registry.spec_problem(fit.rank_spec(spec, r, config.ranks))) is not None),
                None,
            )
        if refused is not None:
            raise refused
        if config.spread == "STRICT_SPREAD" and config.replicas > 1 and self.cluster is None:
            raise InvalidField(
                "spread",
                f"STRICT_SPREAD puts each of the {config.replicas} replicas on a node of its own: this worker is one "
                "node (tether serve --ray serves a cluster); use SPREAD or PACK",
            )
        admitted = None  # a placer decides (under its node-wide load lock), else the fit check runs now
        if self.placer is None and self.cluster is None:
            admitted = await anyio.to_thread.run_sync(partial(fit.admit, spec, override=config.force, sized=True))
        auto = config.ranks == "auto" and self.cluster is not None  # each placement chooses the ranks of a life
        ranks = config.ranks if isinstance(config.ranks, int) else 1  # "auto" on one machine: one runner
        admitted = admitted if ranks == 1 and not auto else None  # the fit of every rank is the placement's
        factory: LifeFactory = (
            partial(Supervisor, settings=self.settings, memory_limit=config.memory_limit)
            if self.cluster is None
            else self.cluster.runners(config.memory_limit)
        )
        if ranks > 1:
            ports = self.rank_ports.allocate(instance_id, ranks, config.ports)
            factory = partial(self._rank_group, config=config, ports=ports)
        elif auto:
            factory = partial(self._placed_life, single=factory, config=config, instance_id=instance_id)
        policy = policy_of(config.resume)
        keeps = policy.enabled and policy.store and self.cluster is None and ranks == 1 and not auto
        stored = {name: stores.directory(name) if keeps else None for name in replica_names(config)}
        replicas = [
            Instance(
                msgspec.structs.replace(spec, store=str(stored[name])) if stored[name] is not None else spec,
                config.restart,
                name=name,
                supervisor_factory=factory,
                deadlines=config.deadlines,
                force=config.force,
                settings=self.settings,
                admitted=admitted if i == 0 else None,
                placer=self.placer,
                ranks=ranks,
                auto_ranks=auto,
            )
            for i, name in enumerate(replica_names(config))
        ]
        if self.cluster is not None:
            self.cluster.join(replicas, config.spread)
        resumes = Resumes(instance_id, policy, self.settings.clock)
        for replica in replicas:
            resumes.attach(replica)
        hosted = Hosted(
            id=instance_id,
            config=config,
            replicas=replicas,
            parallel=registry.parallel(spec),
            resumes=resumes,
        )
        self._hosted[instance_id] = hosted
        self.listeners(hosted)
        self._tg.start_soon(self._host, hosted)
        log.info("instance %s added (%s: %s)", instance_id, spec.engine, spec.model or "default model")
        return hosted

    def _rank_group(
        self, spec: EngineSpec, *, runner_id: str, deadlines: Deadlines, config: InstanceConfig, ports: tuple[int, ...]
    ) -> RankGroup:
        """One life of a multi-rank instance: its ranks where its placement put them (this machine, without a
        cluster), on the instance's own ports."""
        if self.cluster is not None:
            sites = self.cluster.sites(runner_id.rpartition("-")[0], config.memory_limit)  # runner ids: <name>-<life>
        else:
            local = partial(Supervisor, settings=self.settings, memory_limit=config.memory_limit)
            sites = [Site(LOCAL_HOST, local)] * len(ports)
        return RankGroup(
            spec,
            runner_id=runner_id,
            deadlines=deadlines,
            sites=sites,
            ports=ports,
            stop_timeout=self.settings.stop_timeout,
            clock=self.settings.clock,
        )

    def _placed_life(
        self,
        spec: EngineSpec,
        *,
        runner_id: str,
        deadlines: Deadlines,
        single: LifeFactory,
        config: InstanceConfig,
        instance_id: str,
    ) -> RunnerLife:
        """One life of a ``ranks: "auto"`` instance on the cluster: a single runner or a rank group, as its
        placement decided. Each rank count gets its ports once and keeps them for every life with that count."""
        assert self.cluster is not None
        world = self.cluster.world(runner_id.rpartition("-")[0])  # runner ids: <name>-<life>
        if world == 1:
            return single(spec, runner_id=runner_id, deadlines=deadlines)
        by_world = self._auto_ports.setdefault(instance_id, {})
        if world not in by_world:
            by_world[world] = self.rank_ports.allocate(f"{instance_id} ({world} ranks)", world)
        return self._rank_group(spec, runner_id=runner_id, deadlines=deadlines, config=config, ports=by_world[world])

    async def remove(self, instance_id: str) -> Hosted:
        """Stop an instance (its runner within the stop bound) and forget it; its waiting requests fail."""
        hosted = self.get(instance_id)
        await self._stop_one(hosted)
        self._hosted.pop(instance_id, None)
        self.rank_ports.release(instance_id)
        for world in self._auto_ports.pop(instance_id, {}):
            self.rank_ports.release(f"{instance_id} ({world} ranks)")
        if self.cluster is not None:
            self.cluster.forget(hosted.replicas)
        return hosted

    async def _host(self, hosted: Hosted) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                for replica in hosted.replicas:
                    await stack.enter_async_context(replica)
                await hosted._stop.wait()
        except Exception:
            log.exception("instance %s ended with an error", hosted.id)
        finally:
            for path in hosted.stores:  # its runners are gone: what outlived them goes with the instance
                stores.remove(path)
            hosted._done.set()

    async def _stop_one(self, hosted: Hosted) -> None:
        hosted._stop.set()
        with anyio.move_on_after(self.settings.stop_timeout + 5):
            await hosted._done.wait()
        if not hosted._done.is_set():
            log.error("instance %s did not stop within %g s", hosted.id, self.settings.stop_timeout + 5)

    # --- requests -------------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def generation(self, hosted: Hosted, params: Work, request_id: str) -> AsyncIterator[Resumable]:
        """Admit a generation to ``hosted``'s queue and submit it; ``Unavailable`` says why not and when to retry.
        The handle resumes it where its runner dies under it (``tether.fleet.resume``)."""
        resumes = hosted.resumes
        assert resumes is not None
        refusal = resumes.quarantine.refusal(params)
        if refusal is not None:
            left, why = refusal
            raise Unavailable(f"{why} ({left:.0f} s left)", retry_after=left)
        replica = hosted.pick()
        if replica is None:
            inst = hosted.instance
            raise Unavailable(inst.unavailable_reason(), retry_after=hosted.retry_after(), cause=inst.cause)
        if hosted.in_flight >= hosted.limit:
            running, waiting = hosted.generations()
            raise Unavailable(
                f"instance {hosted.id} is busy: {running} requests generating (parallel {hosted.parallel}"
                f"{f' on each of {len(hosted.replicas)} replicas' if len(hosted.replicas) > 1 else ''}) and "
                f"{waiting} waiting (max_queue {hosted.config.max_queue}); retry shortly, or raise max_queue (more "
                "waiting) or the engine's parallel option (more at once, more memory)",
                retry_after=1.0,
            )
        hosted.in_flight += 1
        hosted.serving[replica] = hosted.serving.get(replica, 0) + 1
        outcome = "failed"
        handle: Resumable | None = None
        try:
            try:
                inner = await replica.generate(params, task_id=request_id)
            except RunnerUnavailable as exc:
                raise Unavailable(str(exc), retry_after=hosted.retry_after(), cause=exc.cause) from exc

            def moved(old: Instance, new: Instance) -> None:
                hosted.serving[old] -= 1
                hosted.serving[new] = hosted.serving.get(new, 0) + 1

            handle = Resumable(Journal(request_id, params), inner, replica, hosted.pick, resumes, moved)
            self._requests[request_id] = (hosted, handle)
            try:
                yield handle
            finally:
                handle.close()
                if handle.final is not None:
                    outcome = handle.final.state.value
                    hosted.tokens_done += handle.final.tokens
                elif request_id in self._cancelled:  # left before the runner's last word: cancelled, not failed
                    outcome = "cancelled"
        finally:
            self._cancelled.discard(request_id)
            hosted.in_flight -= 1
            hosted.serving[handle.replica if handle is not None else replica] -= 1
            self._requests.pop(request_id, None)
            self._recent.add(request_id, outcome)

    def in_flight(self, hosted: Hosted) -> builtins.list[dict[str, Any]]:
        """The requests ``hosted`` serves now: id, replica and tokens so far (the dashboard cancels one by id)."""
        found = []
        for request_id, (owner, handle) in self._requests.items():
            if owner is hosted:
                replica = handle.replica
                sup = replica.supervisor
                records = {r.task.task_id: r.tokens for r in sup.in_flight()} if sup is not None else {}
                found.append({"id": request_id, "replica": replica.name, "tokens": records.get(request_id, 0)})
        return found

    async def cancel(self, request_id: str) -> CancelReply:
        """Cancel a request by id; a finished or unknown one is a no-op that says so."""
        serving = self._requests.get(request_id)
        if serving is not None:
            reply = await serving[1].cancel()
            if reply.outcome == "requested" and request_id in self._requests:
                self._cancelled.add(request_id)
            return reply
        ended = self._recent.get(request_id)
        if ended is not None:
            return CancelReply(request_id, "finished", f"already {ended}: nothing to cancel")
        return CancelReply(request_id, "unknown", f"no request {request_id!r}: nothing to cancel")


def replica_names(config: InstanceConfig) -> list[str]:
    """The names of an instance's replicas (in runner ids, logs and cgroups): its id alone, or ``<id>.r<i>``."""
    instance_id = config.default_id()
    return [instance_id] if config.replicas == 1 else [f"{instance_id}.r{i}" for i in range(config.replicas)]


def new_request_id(prefix: str, sep: str = "-") -> str:
    """A fresh id in OpenAI's style: ``chatcmpl-...`` (``sep`` "_" for the newer ``resp_...``, ``call_...``)."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"
