"""Where the ranks of a split model go: a pure rule (no Ray, no I/O) from each node's measured free memory.

An engine that divides one model among its ranks (``splits_model``: llama.cpp's layer split over ggml RPC) needs no
node that holds the whole model. The rule:

- the ``world`` nodes with the most memory available, rank 0 on the most (it also keeps the batch loop and the
  prompt cache), one rank per node;
- each rank's share of the layers is its node's available memory (relative: ``shares``), so a node with twice the
  room holds about twice the layers;
- each rank's estimate (``estimate(rank, world, shares)``: that rank's weights, KV cache and runtime) must fit its
  node's available memory.

``fewest`` is ``ranks: "auto"``'s search: the smallest ``world`` from 2 up whose every share fits. The caller
(``tether.cluster.coordinator``) first places the model whole when a node can hold it, and has each chosen node's
agent confirm its share's fit on its own memory before anything starts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from tether.engines.base import MemoryEstimate
from tether.errors import TetherError
from tether.units import format_bytes

Estimator = Callable[[int, int, tuple[float, ...]], MemoryEstimate | None]  # (rank, world, shares) -> its estimate


class Whole(Protocol):
    """A node that holds a model whole, as its agent's fit check found it."""

    @property
    def node_id(self) -> str: ...
    @property
    def available(self) -> int: ...  # host memory available, bytes
    @property
    def gpu_layers(self) -> int: ...  # layers its GPUs would hold


W = TypeVar("W", bound=Whole)


@dataclass(frozen=True)
class Offer:
    """A node as placement sees it: its id and the memory available there, as its agent measured it."""

    node_id: str
    available: int
    source: str = ""


@dataclass(frozen=True)
class RankFit:
    """One rank of a split on its node: what it needs (None: no estimate, or ``problem`` says why none)."""

    rank: int
    node: Offer
    needed: int | None
    problem: str | None = None

    @property
    def fits(self) -> bool:
        return self.problem is None and (self.needed is None or self.needed <= self.node.available)

    def describe(self) -> str:
        where = f"rank {self.rank} on node {self.node.node_id[:8]}"
        if self.problem is not None:
            return f"{where}: {self.problem}"
        needs = f"needs ~{format_bytes(self.needed)}" if self.needed is not None else "has no estimate"
        source = f" ({self.node.source})" if self.node.source else ""
        verdict = "fits" if self.fits else "does not fit"
        return f"{where} {verdict}: {needs}, {format_bytes(self.node.available)} available{source}"


@dataclass(frozen=True)
class Split:
    """``world`` ranks on as many nodes, with their shares of the model and each rank's verdict."""

    ranks: tuple[RankFit, ...]
    shares: tuple[float, ...]

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def fits(self) -> bool:
        return all(rank.fits for rank in self.ranks)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(rank.node.node_id for rank in self.ranks)

    def describe(self) -> str:
        return "; ".join(rank.describe() for rank in self.ranks)


def by_room(offers: Sequence[Offer]) -> list[Offer]:
    """Most memory available first (ties: by node id, so the order does not depend on who answered first)."""
    return sorted(offers, key=lambda o: (-o.available, o.node_id))


def split_over(offers: Sequence[Offer], world: int, estimate: Estimator) -> Split:
    """``world`` ranks on the ``world`` nodes of ``offers`` with the most memory available, shares by that memory.
    ``ValueError`` when there are fewer nodes than ranks. An estimate that cannot be made (a share too small for a
    layer, a model the estimator cannot read) is that rank's ``problem``, not an exception."""
    chosen = by_room(offers)[:world]
    if len(chosen) < world or world < 2:
        raise ValueError(f"a split needs 2 or more ranks, one per node: {world} ranks over {len(offers)} nodes")
    shares = tuple(float(max(offer.available, 1)) for offer in chosen)
    ranks = []
    for rank, offer in enumerate(chosen):
        try:
            part = estimate(rank, world, shares)
        except (ValueError, TetherError) as exc:
            ranks.append(RankFit(rank, offer, None, str(exc)))
        else:
            ranks.append(RankFit(rank, offer, part.total if part is not None else None))
    return Split(tuple(ranks), shares)


def candidates(offers: Sequence[Offer], estimate: Estimator, max_ranks: int) -> Iterator[Split]:
    """Every split from 2 ranks up to ``max_ranks`` (or one per node, if fewer), fewest first."""
    for world in range(2, min(max_ranks, len(offers)) + 1):
        yield split_over(offers, world, estimate)


def fewest(offers: Sequence[Offer], estimate: Estimator, max_ranks: int) -> tuple[Split | None, list[Split]]:
    """The split with the fewest ranks whose every share fits (None when none does), and every split tried."""
    tried = []
    for split in candidates(offers, estimate, max_ranks):
        tried.append(split)
        if split.fits:
            return split, tried
    return None, tried


def whole_order(fitting: Sequence[W], siblings: Collection[str], spread: str) -> list[W]:
    """Nodes that each hold the model whole, best first, by its replicas' ``spread``: SPREAD prefers nodes without a
    replica, PACK nodes with one, STRICT_SPREAD drops nodes with one. Then the node whose GPUs hold the most layers
    (a layer on a GPU decodes many times faster than on the host, so VRAM outranks host memory), then host memory:
    the most (SPREAD) or the least that fits (PACK); ties by node id, not by who answered first."""
    if spread == "STRICT_SPREAD":
        fitting = [n for n in fitting if n.node_id not in siblings]
    if spread == "PACK":
        return sorted(fitting, key=lambda n: (n.node_id not in siblings, -n.gpu_layers, n.available, n.node_id))
    return sorted(fitting, key=lambda n: (n.node_id in siblings, -n.gpu_layers, -n.available, n.node_id))
