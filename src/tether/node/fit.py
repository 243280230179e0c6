"""The fit check before load: what the engine says a runner will need, compared with what this node can give it.

A model is admitted only when the engine's estimate (for llama.cpp: weights + KV cache + runtime + headroom, see
``tether.engines.llamacpp.estimate``) fits the available memory; otherwise the refusal says every number (``needs
~556 MiB (weights 92.1 MiB + KV cache 180 MiB at n_ctx 8192 + runtime 284 MiB + headroom 128 MiB), 300 MiB
available (cgroup limit)``) and what to do, and an explicit override loads it anyway. An engine that declares no
estimator is admitted with that said, never silently. After load, :func:`record_measured` puts the runner's
measured memory beside the estimate.

The estimate comes from the engine registry, so every name of an engine (aliases, plugins) gets the same check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from tether.engines import registry
from tether.engines.base import Estimate, MemoryEstimate
from tether.errors import TetherError
from tether.node.memory import NodeMemory, ProcessMemory, node_memory
from tether.node.nvml import GpuDevice
from tether.protocol import EngineSpec, RankInfo
from tether.units import format_bytes, parse_size

WHAT_TO_DO = "free memory, or pass --force to load anyway"
GPU_PLACED = ("n_gpu_layers", "gpu", "tensor_split")  # the options ``size_offload`` resolves: asked again each life


@dataclass(frozen=True)
class FitResult:
    """The verdict: ``ok`` when it fits, was overridden, or has no estimate; ``message`` says it with the numbers."""

    estimate: MemoryEstimate | None  # None: the engine declares no estimator, so nothing was compared
    available: int | None
    source: str
    fits: bool
    overridden: bool
    message: str
    nodes: tuple[dict[str, Any], ...] = ()  # on a cluster: every node's verdict (node, fits, needed, available, source)
    spec: EngineSpec | None = None  # the spec to run, when the check sized it (n_ctx "auto": see ``size_context``)

    @property
    def ok(self) -> bool:
        return self.fits or self.overridden

    @property
    def needed(self) -> int | None:
        return self.estimate.total if self.estimate is not None else None


class DoesNotFit(TetherError):
    """The model does not fit the memory available; ``result`` has the numbers (here, beside the check that
    raises it: the errors module is shared by every process side and imports nothing)."""

    def __init__(self, result: FitResult) -> None:
        super().__init__(result.message)
        self.result = result


def check_fit(estimate: MemoryEstimate, available: int, source: str, *, override: bool = False) -> FitResult:
    """Compare ``estimate.total`` with ``available`` bytes (``source`` says where that figure comes from, e.g.
    "cgroup limit"). A model that does not fit is refused unless ``override``; either way ``message`` has the
    numbers: ``needs ~X (weights ... + headroom ...), Y available (source)``."""
    numbers = f"{estimate.describe()}, {format_bytes(available)} available ({source})"
    if estimate.total <= available:
        return FitResult(estimate, available, source, True, False, f"{estimate.subject} fits: {numbers}")
    if override:
        message = f"loading {estimate.subject} anyway (override): it does not fit: {numbers}"
        return FitResult(estimate, available, source, False, True, message)
    advice = estimate.advice(available) or WHAT_TO_DO
    return FitResult(estimate, available, source, False, False, f"{estimate.subject} does not fit: {numbers}: {advice}")


def ensure_fits(estimate: MemoryEstimate, available: int, source: str, override: bool = False) -> FitResult:
    """:func:`check_fit`, raising :class:`DoesNotFit` (with the result) when refused."""
    result = check_fit(estimate, available, source, override=override)
    if not result.ok:
        raise DoesNotFit(result)
    return result


def for_ranks(estimate: MemoryEstimate, ranks: int) -> MemoryEstimate:
    """What ``ranks`` runners of one estimate need together on one node (a multi-rank instance on one machine)."""
    if ranks == 1:
        return estimate
    return Estimate(
        f"{ranks} ranks of {estimate.subject}",
        {f"{ranks} x {format_bytes(estimate.expected)}": ranks * estimate.expected},
        headroom=ranks * estimate.headroom,
    )


def rank_spec(spec: EngineSpec, rank: int, ranks: int, shares: tuple[float, ...] = ()) -> EngineSpec:
    """``spec`` as rank ``rank`` of ``ranks`` runs it (no addresses: an estimate needs none), with ``shares``."""
    return msgspec.structs.replace(spec, rank=RankInfo(rank, ranks, (), shares))


def ranks_estimate(spec: EngineSpec, ranks: int, shares: tuple[float, ...] = ()) -> MemoryEstimate | None:
    """What ``ranks`` runners of ``spec`` need together on one node: each rank's own share when the engine divides
    the model among them (``registry.splits_model``; ``shares`` as the placement gave them), else a whole copy each.
    Reads the model file's header: call it off the event loop."""
    if ranks == 1 or not registry.splits_model(spec.engine):
        whole = registry.estimate(spec)
        return for_ranks(whole, ranks) if whole is not None else None
    parts = [registry.estimate(rank_spec(spec, rank, ranks, shares)) for rank in range(ranks)]
    known = [part for part in parts if part is not None]
    if len(known) < ranks:
        return None
    return Estimate(
        f"{ranks} ranks of {known[0].subject.rpartition(' of ')[2]}",
        {f"rank {rank}": part.expected for rank, part in enumerate(known)},
        headroom=sum(part.headroom for part in known),
    )


def size_context(
    spec: EngineSpec, estimate: MemoryEstimate, available: int
) -> tuple[EngineSpec, MemoryEstimate, str | None]:
    """What the engine left to the memory gets a number here, said in words when it is not the engine's own choice:
    a context that is the engine's "auto" (llama.cpp: the model's trained context, capped) the one its estimate used
    when that fits ``available``, else the largest that fits; then a RAM prompt cache whose budget is "auto" (the KV
    cache's size) the room the rest leaves, when that is less (a cache takes what is left: it never makes a model not
    fit, nor lowers its context). Other specs and estimates come back as they are."""
    options = dict(spec.options)
    notes = []
    n_ctx = getattr(estimate, "n_ctx", None)
    largest, resized = getattr(estimate, "max_n_ctx", None), getattr(estimate, "with_n_ctx", None)
    if options.get("n_ctx", "auto") == "auto" and isinstance(n_ctx, int) and largest is not None and resized:
        within = getattr(estimate, "within", None)
        rest = within(available) if within is not None else estimate
        if rest.total > available and not getattr(estimate, "embedding", False):
            best = largest(available)
            if isinstance(best, int):
                notes.append(
                    f"n_ctx lowered from {n_ctx} (auto: the model's context) to {best}, the most that fits: at {n_ctx}"
                    f" it {estimate.describe()}, {format_bytes(available)} available; pass --n-ctx to choose"
                )
                estimate, n_ctx = resized(best), best
        options["n_ctx"] = n_ctx
    within = getattr(estimate, "within", None)
    budget = getattr(estimate, "prompt_cache_ram", None)
    if within is not None and isinstance(budget, int) and getattr(estimate, "prompt_cache_ram_auto", False):
        estimate = within(available)
        lowered = getattr(estimate, "prompt_cache_ram", budget)
        if lowered < budget:
            options["prompt_cache_ram"] = lowered
            notes.append(
                f"the prompt cache's RAM store (auto: the KV cache's size, {format_bytes(budget)}) gets the "
                f"{format_bytes(lowered)} the rest leaves; pass --prompt-cache-ram to choose"
            )
    if options == dict(spec.options):
        return spec, estimate, "; ".join(notes) or None
    return msgspec.structs.replace(spec, options=options), estimate, "; ".join(notes) or None


def size_offload(
    spec: EngineSpec, estimate: MemoryEstimate, node: NodeMemory
) -> tuple[EngineSpec, MemoryEstimate, str | None, str | None]:
    """Layers on the GPUs, for an engine whose estimate can offload (llama.cpp): ``n_gpu_layers`` "auto" (the
    default) becomes the most layers whose share fits each chosen GPU's NVML free memory less a margin (or its
    ``gpu_memory_limit``), a count given is kept and checked. Returns the spec to run (the count, the devices and
    their split resolved), the host's share of the estimate (``offload`` says each device's), a note in words, and
    why the GPUs cannot hold what was asked (None when they can)."""
    offloaded = getattr(estimate, "offloaded", None)
    fit_layers, margin, missing, gpu_indexes = _offload_tools()
    options = dict(spec.options)
    wanted = options.get("n_gpu_layers", "auto")
    if offloaded is None or spec.rank is not None:
        return spec, estimate, None, None
    if wanted == "auto" and options.get("deterministic"):
        wanted = 0  # the batch-invariant kernels are the CPU's
    gpus = {g.index: g for g in node.gpus}
    try:
        indexes = _chosen(options, gpus, gpu_indexes)
        limit = parse_size(options["gpu_memory_limit"]) if options.get("gpu_memory_limit") is not None else None
        count = None if wanted == "auto" else int(wanted)
    except (TypeError, ValueError) as exc:
        return spec, estimate, None, f'invalid GPU option ({exc}): gpu is device indexes, e.g. [0] or "0,1"'
    unknown = [i for i in indexes if i not in gpus]
    if unknown and gpus:
        return spec, estimate, None, f"gpu names device {unknown[0]}, and this node's GPUs are {sorted(gpus)} (NVML)"
    if not gpus or not indexes or (count is not None and count <= 0):
        if count:  # asked for layers on a GPU this node does not have
            why = node.gpu_reason or "no GPU"
            note = f"n_gpu_layers {count} asked, but this node has no NVIDIA GPU to put them on ({why}): all on the CPU"
            return spec, estimate, note, None
        return msgspec.structs.replace(spec, options={**options, "n_gpu_layers": 0}), estimate, None, None
    build = missing()
    if build is not None:
        names = ", ".join(f"GPU {i} ({gpus[i].name})" for i in indexes)
        note = f"{names} visible, but {build}: every layer on the CPU"
        return msgspec.structs.replace(spec, options={**options, "n_gpu_layers": 0}), estimate, note, None
    budgets = _budgets(gpus, indexes, margin, limit)
    if count is None:
        sized = fit_layers(estimate, budgets, indexes)
    else:
        sized = offloaded(count, indexes, [float(max(b, 1)) for b in budgets], budgets)
    offload = getattr(sized, "offload", None)
    layers = gpu_layers(sized)
    options.update(n_gpu_layers=layers, gpu=list(indexes))
    if len(indexes) > 1 and offload is not None:
        options["tensor_split"] = list(offload.split)
    free = ", ".join(
        f"GPU {i} {format_bytes(gpus[i].free)} free less a {format_bytes(margin)} margin"
        + (f", limited to {format_bytes(limit)}" if limit is not None else "")
        for i in indexes
    )
    run = msgspec.structs.replace(spec, options=options)
    if offload is None:
        return run, sized, None, None
    per_layer = f"~{format_bytes(offload.per_layer)} a layer" if layers else "not one layer fits"
    how = "auto" if count is None else "given"
    note = f"n_gpu_layers {layers} ({how}: {per_layer}; {free})"
    over = (
        []
        if not layers
        else [
            f"GPU {i} needs ~{format_bytes(need)} for {layers} layers, {format_bytes(budget)} it may use"
            for i, need, budget in zip(indexes, offload.vram, budgets, strict=True)
            if need > budget
        ]
    )
    if over:
        best = getattr(fit_layers(estimate, budgets, indexes), "offload", None)
        fewer = f"n_gpu_layers {best.n_gpu_layers} fits (auto)" if best is not None else "fewer layers"
        return run, sized, note, f"{'; '.join(over)} ({free}): use {fewer}, free VRAM, or pass --force"
    return run, sized, note, None


def gpu_layers(estimate: MemoryEstimate | None) -> int:
    """The layers an estimate puts on GPUs (``size_offload``'s choice); 0 for one that offloads nothing."""
    offload = getattr(estimate, "offload", None)
    return int(offload.n_gpu_layers) if offload is not None else 0


def gpu_shortfall(spec: EngineSpec, estimate: MemoryEstimate, node: NodeMemory) -> tuple[int, MemoryEstimate | None]:
    """What the chosen GPUs lack, beyond their free memory less the margin, to hold every layer ("auto") or the
    count given: the VRAM that evicting idle models could give back, in bytes (0 when nothing is missing, or when
    nothing offloads here: no GPU, a CPU build, a deterministic instance, a ``gpu_memory_limit`` that caps it
    anyway), and the host's share of the estimate with those layers on the GPUs (None when nothing offloads)."""
    offloaded = getattr(estimate, "offloaded", None)
    shape = getattr(estimate, "shape", None)
    options = spec.options
    if offloaded is None or shape is None or spec.rank is not None or not node.gpus:
        return 0, None
    _, margin, missing, gpu_indexes = _offload_tools()
    if options.get("deterministic") or options.get("gpu_memory_limit") is not None or missing() is not None:
        return 0, None
    gpus = {g.index: g for g in node.gpus}
    wanted = options.get("n_gpu_layers", "auto")
    try:
        indexes = _chosen(options, gpus, gpu_indexes)
        count = shape.n_layers + 1 if wanted == "auto" else int(wanted)
    except (TypeError, ValueError):
        return 0, None
    if count <= 0 or any(i not in gpus for i in indexes):
        return 0, None
    budgets = _budgets(gpus, indexes, margin)
    target = offloaded(count, indexes, [float(gpus[i].total) for i in indexes], budgets)
    needs = getattr(getattr(target, "offload", None), "vram", ())
    return sum(max(0, need - budget) for need, budget in zip(needs, budgets, strict=False)), target


def _chosen(options: Mapping[str, Any], gpus: Mapping[int, GpuDevice], gpu_indexes: Any) -> list[int]:
    """The GPUs the option ``gpu`` names (``ValueError`` when it is not indexes), every one NVML lists without it."""
    return sorted(gpus) if options.get("gpu") is None else list(gpu_indexes(options["gpu"]))


def _budgets(gpus: Mapping[int, GpuDevice], indexes: list[int], margin: int, limit: int | None = None) -> list[int]:
    """What each chosen GPU may hold: its free memory less the margin, at most ``limit`` (``gpu_memory_limit``)."""
    budgets = [max(0, gpus[i].free - margin) for i in indexes]
    return budgets if limit is None else [min(budget, limit) for budget in budgets]


def _offload_tools() -> tuple[Any, int, Any, Any]:
    """The llama.cpp estimator's offload helpers (the one engine that offloads), imported when a fit needs them."""
    from tether.engines.llamacpp.estimate import GPU_MARGIN, fit_layers, gpu_build_missing, gpu_indexes

    return fit_layers, GPU_MARGIN, gpu_build_missing, gpu_indexes


def with_gpus(result: FitResult, note: str | None, problem: str | None, override: bool) -> FitResult:
    """``result`` with the GPU split's note, and refused when the GPUs cannot hold what was asked (unless
    ``override``)."""
    message = f"{result.message}; {note}" if note else result.message
    if problem is None:
        return replace(result, message=message)
    subject = result.estimate.subject if result.estimate is not None else "the model"
    host = "" if result.fits else f"; and the host: {result.message}"  # both memories, when neither holds it
    if override:
        message = f"loading {subject} anyway (override): {problem}{host}"
        return replace(result, fits=False, overridden=True, message=message)
    return replace(result, fits=False, overridden=False, message=f"{subject} does not fit the GPU: {problem}{host}")


def assess(
    spec: EngineSpec,
    *,
    override: bool = False,
    node: NodeMemory | None = None,
    ranks: int = 1,
    sized: bool = False,
) -> FitResult:
    """The fit check for a runner of ``spec`` (``ranks`` of them, for a multi-rank instance on this node): the
    registry's estimate against this node's memory (read now unless ``node`` is given). ``sized``: a single runner's
    "auto" context is sized to the memory (``size_context``) and the result's ``spec`` is the one to run. Reads the
    model file's header, so call it off the event loop. Raises ``InvalidModel`` for a model file the estimator
    cannot read and ``UnknownEngine`` for an engine that names none."""
    estimate = ranks_estimate(spec, ranks)
    if estimate is None:
        engine = registry.canonical(spec.engine)
        message = f"no memory estimate for engine {engine!r} (it declares none): admitted without a fit check"
        return FitResult(None, None, "none", True, False, message)
    node = node if node is not None else node_memory()
    if ranks != 1:
        return check_fit(estimate, node.available, node.source, override=override)
    spec, estimate, gpu_note, problem = size_offload(spec, estimate, node)
    if not sized:
        result = check_fit(estimate, node.available, node.source, override=override)
        return with_gpus(replace(result, spec=spec), gpu_note, problem, override)
    spec, estimate, note = size_context(spec, estimate, node.available)
    result = check_fit(estimate, node.available, node.source, override=override)
    result = replace(result, spec=spec, message=f"{result.message}; {note}" if note else result.message)
    return with_gpus(result, gpu_note, problem, override)


def admit(
    spec: EngineSpec,
    *,
    override: bool = False,
    node: NodeMemory | None = None,
    ranks: int = 1,
    sized: bool = False,
) -> FitResult:
    """:func:`assess`, raising :class:`DoesNotFit` when refused."""
    result = assess(spec, override=override, node=node, ranks=ranks, sized=sized)
    if not result.ok:
        raise DoesNotFit(result)
    return result


# --------------------------------------------------------------------------------------------------------------
# After load
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredFit:
    """The runner's measured memory beside its estimate, recorded after load."""

    estimate: MemoryEstimate
    memory: ProcessMemory

    @property
    def resident(self) -> int:
        """What the runner holds in RAM: resident weights (file-backed or not) plus its private memory (RSS)."""
        return self.memory.rss

    @property
    def held(self) -> int:
        """The estimate of what the runner holds before any cache that grows as it is used fills (llama.cpp: its
        prompt cache's RAM store, reserved by the fit but empty at load), without headroom."""
        held = getattr(self.estimate, "held", None)
        return held if isinstance(held, int) else self.estimate.expected

    @property
    def ratio(self) -> float:
        """Measured resident memory over ``held`` (below 1 before the context fills)."""
        return self.resident / self.held if self.held else math.inf

    def describe(self) -> str:
        m = self.memory
        n_ctx = getattr(self.estimate, "n_ctx", None)
        at = f" at n_ctx {n_ctx}" if isinstance(n_ctx, int) else ""
        grows = self.estimate.expected - self.held
        cache = f" + a cache that grows as used up to {format_bytes(grows)}" if grows > 0 else ""
        return (
            f"estimated ~{format_bytes(self.held)}{cache} + headroom {format_bytes(self.estimate.headroom)}"
            f"{at}; measured {format_bytes(m.rss)} resident (file-backed {format_bytes(m.file)} + anonymous "
            f"{format_bytes(m.anon)}), footprint {format_bytes(m.footprint)}: {self.ratio:.2f} of the estimate"
        )


def record_measured(estimate: MemoryEstimate, memory: ProcessMemory) -> MeasuredFit:
    """Pair a loaded runner's memory (``tether.node.memory.process_memory(pid)``) with the estimate it was admitted
    on."""
    return MeasuredFit(estimate, memory)
