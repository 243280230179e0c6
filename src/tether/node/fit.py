"""The fit check before load: what the engine says a runner will need, compared with what this node can give it.

A model is admitted only when the engine's estimate (for llama.cpp: weights + KV cache + runtime + headroom, see
``tether.engines.llamacpp.estimate``) fits the available memory; otherwise the refusal says every number (``needs
~556 MiB (weights 92.1 MiB + KV cache 180 MiB at n_ctx 8192 + runtime 284 MiB + headroom 128 MiB), 300 MiB
available (cgroup limit)``) and what to do, and an explicit override loads it anyway. An engine that declares no
estimator is admitted with that said, never silently. After load, :func:`record_measured` puts the runner's
measured memory beside the estimate.

The estimate and the engine's sizing (``Sizable``: what it left to the memory, such as GPU layers or a context,
given a number for this node) come from the engine registry, so every name of an engine (aliases, plugins) gets the
same check; :func:`judge` is the one place that runs the sequence, knowing no engine's options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec

from tether.engines import registry
from tether.engines.base import Estimate, GrowingEstimate, MemoryEstimate, Room, Shortfall, Sized
from tether.errors import TetherError
from tether.node import stores
from tether.node.memory import NodeMemory, ProcessMemory, node_memory
from tether.protocol import EngineSpec, RankInfo
from tether.units import format_bytes

WHAT_TO_DO = "free memory, or pass --force to load anyway"


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
    spec: EngineSpec | None = None  # the spec to run, when the check sized it (its engine's ``Sizable``: ``judge``)
    gpu_layers: int = 0  # the layers the sizing put on this node's GPUs

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


def size(spec: EngineSpec, estimate: MemoryEstimate, node: NodeMemory, available: int | None = None) -> Sized:
    """The engine's sizing of ``spec`` for ``node`` (``Sizable``: GPU layers by the GPUs' free memory, then, with
    ``available`` host bytes, what that memory holds), or ``spec`` as it is for an engine that sizes nothing."""
    sizing = registry.sizing(spec.engine)
    if sizing is None:
        return Sized(spec, estimate)
    return sizing.sized(spec, estimate, Room(available, node.gpus, node.gpu_reason))


def gpu_shortfall(spec: EngineSpec, estimate: MemoryEstimate, node: NodeMemory) -> Shortfall:
    """What ``node``'s GPUs lack to hold what ``spec`` asks (every layer, for "auto"): the VRAM that evicting idle
    models could give back, and the host's share once they hold it (nothing for an engine that sizes nothing)."""
    sizing = registry.sizing(spec.engine)
    if sizing is None or not node.gpus:
        return Shortfall()
    return sizing.gpu_shortfall(spec, estimate, node.gpus)


def each_life(spec: EngineSpec) -> tuple[str, ...]:
    """The options of ``spec`` its engine sizes again for every life, from their value as asked."""
    sizing = registry.sizing(spec.engine)
    return sizing.each_life if sizing is not None else ()


def judge(
    spec: EngineSpec,
    estimate: MemoryEstimate,
    node: NodeMemory,
    available: int,
    source: str,
    *,
    override: bool = False,
    context: bool = True,
) -> FitResult:
    """The one sizing sequence: the engine sizes ``spec`` for ``node`` (what goes on its GPUs, and with ``context``
    what ``available`` host bytes hold), the host's share is checked against ``available`` (``source`` says where
    that figure comes from), and the GPUs' verdict joins it. The result's ``spec`` is the one to run."""
    done = size(spec, estimate, node, available if context else None)
    result = check_fit(done.estimate, available, source, override=override)
    message = f"{result.message}; {done.note}" if done.note else result.message
    result = replace(result, spec=done.spec, gpu_layers=done.gpu_layers, message=message)
    return with_gpus(result, done.gpu_note, done.gpu_problem, override)


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
    registry's estimate against this node's memory (read now unless ``node`` is given), sized by ``judge`` (``sized``:
    what the engine left to the host's memory too, not only its GPU layers); the result's ``spec`` is the one to run.
    Reads the model file's header, so call it off the event loop. Raises ``InvalidModel`` for a model file the estimator
    cannot read and ``UnknownEngine`` for an engine that names none."""
    estimate = ranks_estimate(spec, ranks)
    if estimate is None:
        engine = registry.canonical(spec.engine)
        message = f"no memory estimate for engine {engine!r} (it declares none): admitted without a fit check"
        return FitResult(None, None, "none", True, False, message)
    node = node if node is not None else node_memory()
    if ranks != 1:
        return check_fit(estimate, node.available, node.source, override=override)
    credit, note = adopted(spec)
    available = node.available + credit
    return judge(spec, estimate, node, available, node.source + note, override=override, context=sized)


def adopted(spec: EngineSpec) -> tuple[int, str]:
    """What a new life of ``spec`` takes over from its predecessors: its instance's store of saved prompts
    (``tether.node.stores``), which the node counts as used and the estimate counts again in the prompt cache it
    fills (what exceeds that budget is dropped when adopted). (bytes, the words a fit's source adds.)"""
    held = stores.size(Path(spec.store)) if spec.store else 0
    note = f", plus {format_bytes(held)} of its own saved prompts it takes over" if held else ""
    return held, note


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
        return self.estimate.held if isinstance(self.estimate, GrowingEstimate) else self.estimate.expected

    @property
    def ratio(self) -> float:
        """Measured resident memory over ``held`` (below 1 before the context fills)."""
        return self.resident / self.held if self.held else math.inf

    def describe(self) -> str:
        m = self.memory
        at = f" at n_ctx {self.estimate.n_ctx}" if isinstance(self.estimate, GrowingEstimate) else ""
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
