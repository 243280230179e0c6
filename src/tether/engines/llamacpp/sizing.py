"""How the llama.cpp engine sizes what it leaves to the memory (the engine's ``Sizable``, run by the fit check).

Two options default to "auto" and get their number here, per node, from the estimate (``estimate``):
``n_gpu_layers`` becomes the most layers whose share fits each chosen GPU's NVML free memory less
:data:`~tether.engines.llamacpp.estimate.GPU_MARGIN` (or its ``gpu_memory_limit``), with ``gpu`` and
``tensor_split`` resolved beside it; ``n_ctx`` becomes the context the estimate used when that fits the host's
memory, else the largest that fits; a prompt cache whose RAM budget is "auto" gets the room the rest leaves. Every
choice is said in words with its numbers, and a count given is kept and checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from tether.engines.base import GpuRoom, MemoryEstimate, Room, Shortfall, Sized
from tether.engines.llamacpp.estimate import GPU_MARGIN, ModelEstimate, fit_layers, gpu_build_missing, gpu_indexes
from tether.protocol import EngineSpec
from tether.units import format_bytes, parse_size

EACH_LIFE = ("n_gpu_layers", "gpu", "tensor_split")  # resolved from the GPUs' free memory: asked again each life


class LlamaCppSizing:
    """The llama.cpp engine's ``Sizable``: GPU layers, then the context and the prompt cache's RAM store."""

    each_life = EACH_LIFE

    def sized(self, spec: EngineSpec, estimate: MemoryEstimate, room: Room) -> Sized:
        if not isinstance(estimate, ModelEstimate):  # not this engine's estimate: nothing here to size
            return Sized(spec, estimate)
        placed = size_offload(spec, estimate, room)
        if room.available is None or not isinstance(placed.estimate, ModelEstimate):
            return placed
        run, host, note = size_context(placed.spec, placed.estimate, room.available)
        return Sized(run, host, note, placed.gpu_note, placed.gpu_problem, placed.gpu_layers)

    def gpu_shortfall(self, spec: EngineSpec, estimate: MemoryEstimate, gpus: Sequence[GpuRoom]) -> Shortfall:
        if not isinstance(estimate, ModelEstimate):
            return Shortfall()
        return gpu_shortfall(spec, estimate, gpus)


SIZING = LlamaCppSizing()


def size_context(
    spec: EngineSpec, estimate: ModelEstimate, available: int
) -> tuple[EngineSpec, ModelEstimate, str | None]:
    """A context that is "auto" (the model's trained context, capped) the one the estimate used when that fits
    ``available``, else the largest that fits; then a RAM prompt cache whose budget is "auto" (the KV cache's size)
    the room the rest leaves, when that is less (a cache takes what is left: it never makes a model not fit, nor
    lowers its context). Returns the spec to run, its estimate and the choices in words (None: none made)."""
    options = dict(spec.options)
    notes = []
    n_ctx = estimate.n_ctx
    if options.get("n_ctx", "auto") == "auto":
        if estimate.within(available).total > available and not estimate.embedding:
            best = estimate.max_n_ctx(available)
            if best is not None:
                notes.append(
                    f"n_ctx lowered from {n_ctx} (auto: the model's context) to {best}, the most that fits: at {n_ctx}"
                    f" it {estimate.describe()}, {format_bytes(available)} available; pass --n-ctx to choose"
                )
                estimate, n_ctx = estimate.with_n_ctx(best), best
        options["n_ctx"] = n_ctx
    budget = estimate.prompt_cache_ram
    if estimate.prompt_cache_ram_auto:
        estimate = estimate.within(available)
        lowered = estimate.prompt_cache_ram
        if lowered < budget:
            options["prompt_cache_ram"] = lowered
            notes.append(
                f"the prompt cache's RAM store (auto: the KV cache's size, {format_bytes(budget)}) gets the "
                f"{format_bytes(lowered)} the rest leaves; pass --prompt-cache-ram to choose"
            )
    note = "; ".join(notes) or None
    if options == dict(spec.options):
        return spec, estimate, note
    return msgspec.structs.replace(spec, options=options), estimate, note


def size_offload(spec: EngineSpec, estimate: ModelEstimate, room: Room) -> Sized:
    """Layers on the GPUs: ``n_gpu_layers`` "auto" (the default) becomes the most layers whose share fits each chosen
    GPU's free memory less the margin (or its ``gpu_memory_limit``), a count given is kept and checked. The spec to
    run has the count, the devices and their split resolved; the estimate is the host's share (its ``offload`` says
    each device's). A rank of a split instance offloads nothing here (its layers are the ranks')."""
    options = dict(spec.options)
    wanted = options.get("n_gpu_layers", "auto")
    if spec.rank is not None:
        return Sized(spec, estimate)
    if wanted == "auto" and options.get("deterministic"):
        wanted = 0  # the batch-invariant kernels are the CPU's
    gpus = {g.index: g for g in room.gpus}
    try:
        indexes = _chosen(options, gpus)
        limit = parse_size(options["gpu_memory_limit"]) if options.get("gpu_memory_limit") is not None else None
        count = None if wanted == "auto" else int(wanted)
    except (TypeError, ValueError) as exc:
        why = f'invalid GPU option ({exc}): gpu is device indexes, e.g. [0] or "0,1"'
        return Sized(spec, estimate, gpu_problem=why)
    unknown = [i for i in indexes if i not in gpus]
    if unknown and gpus:
        why = f"gpu names device {unknown[0]}, and this node's GPUs are {sorted(gpus)} (NVML)"
        return Sized(spec, estimate, gpu_problem=why)
    on_cpu = msgspec.structs.replace(spec, options={**options, "n_gpu_layers": 0})
    if not gpus or not indexes or (count is not None and count <= 0):
        if count:  # asked for layers on a GPU this node does not have
            why = room.no_gpu or "no GPU"
            note = f"n_gpu_layers {count} asked, but this node has no NVIDIA GPU to put them on ({why}): all on the CPU"
            return Sized(spec, estimate, gpu_note=note)
        return Sized(on_cpu, estimate)
    build = gpu_build_missing()
    if build is not None:
        names = ", ".join(f"GPU {i} ({gpus[i].name})" for i in indexes)
        return Sized(on_cpu, estimate, gpu_note=f"{names} visible, but {build}: every layer on the CPU")
    budgets = _budgets(gpus, indexes, limit)
    if count is None:
        host = fit_layers(estimate, budgets, indexes)
    else:
        host = estimate.offloaded(count, indexes, [float(max(b, 1)) for b in budgets], budgets)
    offload = host.offload
    assert offload is not None  # ``offloaded`` always says what it put where
    layers = offload.n_gpu_layers
    options.update(n_gpu_layers=layers, gpu=list(indexes))
    if len(indexes) > 1:
        options["tensor_split"] = list(offload.split)
    run = msgspec.structs.replace(spec, options=options)
    free = ", ".join(
        f"GPU {i} {format_bytes(gpus[i].free)} free less a {format_bytes(GPU_MARGIN)} margin"
        + (f", limited to {format_bytes(limit)}" if limit is not None else "")
        for i in indexes
    )
    per_layer = f"~{format_bytes(offload.per_layer)} a layer" if layers else "not one layer fits"
    how = "auto" if count is None else "given"
    note = f"n_gpu_layers {layers} ({how}: {per_layer}; {free})"
    over = (
        [
            f"GPU {i} needs ~{format_bytes(need)} for {layers} layers, {format_bytes(budget)} it may use"
            for i, need, budget in zip(indexes, offload.vram, budgets, strict=True)
            if need > budget
        ]
        if layers
        else []  # no layer on a GPU: no device's figures to compare
    )
    if not over:
        return Sized(run, host, gpu_note=note, gpu_layers=layers)
    best = fit_layers(estimate, budgets, indexes).offload
    fewer = f"n_gpu_layers {best.n_gpu_layers} fits (auto)" if best is not None else "fewer layers"
    problem = f"{'; '.join(over)} ({free}): use {fewer}, free VRAM, or pass --force"
    return Sized(run, host, gpu_note=note, gpu_problem=problem, gpu_layers=layers)


def gpu_shortfall(spec: EngineSpec, estimate: ModelEstimate, gpus: Sequence[GpuRoom]) -> Shortfall:
    """What the chosen GPUs lack, beyond their free memory less the margin, to hold every layer ("auto") or the
    count given, and the host's share with those layers on them. Nothing when nothing offloads here: no GPU, a CPU
    build, a deterministic instance, a ``gpu_memory_limit`` that caps it anyway, a rank of a split instance."""
    options = spec.options
    if spec.rank is not None or not gpus:
        return Shortfall()
    if options.get("deterministic") or options.get("gpu_memory_limit") is not None or gpu_build_missing() is not None:
        return Shortfall()
    by_index = {g.index: g for g in gpus}
    wanted = options.get("n_gpu_layers", "auto")
    try:
        indexes = _chosen(options, by_index)
        count = estimate.shape.n_layers + 1 if wanted == "auto" else int(wanted)
    except (TypeError, ValueError):
        return Shortfall()
    if count <= 0 or any(i not in by_index for i in indexes):
        return Shortfall()
    budgets = _budgets(by_index, indexes)
    target = estimate.offloaded(count, indexes, [float(by_index[i].total) for i in indexes], budgets)
    needs = target.offload.vram if target.offload is not None else ()
    return Shortfall(sum(max(0, need - budget) for need, budget in zip(needs, budgets, strict=False)), target)


def _chosen(options: Mapping[str, Any], gpus: Mapping[int, GpuRoom]) -> list[int]:
    """The GPUs the option ``gpu`` names (``ValueError`` when it is not indexes), every one NVML lists without it."""
    return sorted(gpus) if options.get("gpu") is None else gpu_indexes(options["gpu"])


def _budgets(gpus: Mapping[int, GpuRoom], indexes: list[int], limit: int | None = None) -> list[int]:
    """What each chosen GPU may hold: its free memory less the margin, at most ``limit`` (``gpu_memory_limit``)."""
    budgets = [max(0, gpus[i].free - GPU_MARGIN) for i in indexes]
    return budgets if limit is None else [min(budget, limit) for budget in budgets]
