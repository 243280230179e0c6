"""The placement rule of a split model's ranks (``tether.cluster.placement``), without Ray: nodes by free memory,
shares by that memory, the fewest ranks whose every share fits; and ``ranks: "auto"``'s validation."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest

from tether.cli.parser import build_parser
from tether.cluster.placement import Offer, fewest, split_over, whole_order
from tether.engines.base import Estimate
from tether.fleet.fleet import InstanceConfig

MiB = 1 << 20
GiB = 1 << 30
MODEL = 900 * MiB  # what the whole model's layers need, shared by the ranks
RUNTIME = 100 * MiB  # what every rank needs beside its layers


def layers(rank: int, world: int, shares: tuple[float, ...]) -> Estimate:
    """A model whose ranks hold their share of MODEL plus RUNTIME each (rank 0 another 50 MiB: the batch loop)."""
    share = shares[rank] / sum(shares) if shares else 1 / world
    extra = 50 * MiB if rank == 0 else 0
    return Estimate(f"rank {rank} of {world}", {"layers": int(MODEL * share), "runtime": RUNTIME + extra})


def test_ranks_go_to_the_nodes_with_the_most_memory_rank_0_on_the_most_with_shares_by_that_memory() -> None:
    offers = [Offer("a", 300 * MiB), Offer("b", 900 * MiB), Offer("c", 600 * MiB)]
    split = split_over(offers, 2, layers)
    assert split.nodes == ("b", "c")
    assert split.shares == (900.0 * MiB, 600.0 * MiB)
    needs = [r.needed for r in split.ranks]
    assert needs == [int(MODEL * 0.6) + 150 * MiB, int(MODEL * 0.4) + 100 * MiB]
    assert split.fits, split.describe()
    assert "rank 0 on node b fits: needs ~" in split.describe()
    with pytest.raises(ValueError, match="one per node"):
        split_over(offers, 4, layers)


def test_the_fewest_ranks_whose_every_share_fits() -> None:
    # 450 MiB each: two ranks need 450 + 150 and 450 + 100 (too much); three need 300 + 150, 300 + 100, 300 + 100
    offers = [Offer(name, 450 * MiB, "cgroup limit") for name in "abcd"]
    chosen, tried = fewest(offers, layers, 16)
    assert chosen is not None and chosen.world == 3, [s.describe() for s in tried]
    assert [s.world for s in tried] == [2, 3] and not tried[0].fits
    assert "does not fit" in tried[0].describe() and "(cgroup limit)" in tried[0].describe()


def test_a_model_no_split_can_hold_is_refused_with_every_split_tried() -> None:
    offers = [Offer("a", 200 * MiB), Offer("b", 200 * MiB), Offer("c", 200 * MiB)]
    chosen, tried = fewest(offers, layers, 16)
    assert chosen is None
    assert [s.world for s in tried] == [2, 3]
    assert all(not s.fits for s in tried)
    assert fewest(offers, layers, 2)[1][-1].world == 2  # never beyond max_ranks


def test_an_estimate_that_cannot_be_made_is_that_ranks_problem() -> None:
    def no_layer(rank: int, world: int, shares: tuple[float, ...]) -> Estimate:
        if rank == 1:
            raise ValueError("the layer split leaves rank 1 without a layer")
        return layers(rank, world, shares)

    split = split_over([Offer("a", 8 << 30), Offer("b", 1)], 2, no_layer)
    assert not split.fits
    assert "rank 1 on node b: the layer split leaves rank 1 without a layer" in split.describe()


def test_ranks_auto_is_for_engines_that_split_the_model() -> None:
    assert InstanceConfig(engine="llama.cpp", ranks="auto").check() is None
    ring = InstanceConfig(engine="debug", ranks="auto").check()
    assert ring is not None and ring.field == "ranks"
    assert "gives every rank a whole copy" in str(ring) and "give ranks a number" in str(ring)
    ports = InstanceConfig(engine="llama.cpp", ranks="auto", ports=(25100, 25101)).check()
    assert ports is not None and ports.field == "ports" and "the number of ranks is the placement's" in str(ports)
    replicas = InstanceConfig(engine="llama.cpp", ranks="auto", replicas=2).check()
    assert replicas is not None and replicas.field == "replicas"
    assert msgspec.json.decode(b'{"ranks": "auto"}', type=InstanceConfig).ranks == "auto"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"ranks": "many"}', type=InstanceConfig)
    assert build_parser().parse_args(["serve", "--ranks", "auto"]).ranks == "auto"
    assert build_parser().parse_args(["serve", "--ranks", "2"]).ranks == 2


@dataclass(frozen=True)
class Node:
    node_id: str
    available: int
    gpu_layers: int = 0


def test_a_whole_model_goes_where_the_gpus_hold_the_most_layers_within_its_replicas_spread() -> None:
    """Among nodes that each hold the model: the spread's preference first, then the most layers on GPUs (VRAM
    outranks host memory), then host memory (SPREAD the most, PACK the least); ties by node id."""
    big_host = Node("a", 100 * GiB)  # no GPU
    some_gpu = Node("b", 10 * GiB, gpu_layers=12)
    all_gpu = Node("c", 5 * GiB, gpu_layers=31)
    all_gpu_more_host = Node("d", 8 * GiB, gpu_layers=31)
    nodes = [big_host, some_gpu, all_gpu, all_gpu_more_host]
    assert whole_order(nodes, set(), "SPREAD") == [all_gpu_more_host, all_gpu, some_gpu, big_host]
    assert whole_order(nodes, set(), "PACK") == [all_gpu, all_gpu_more_host, some_gpu, big_host]
    # a replica on d: SPREAD goes elsewhere first, PACK joins it, STRICT_SPREAD never uses it
    assert whole_order(nodes, {"d"}, "SPREAD") == [all_gpu, some_gpu, big_host, all_gpu_more_host]
    assert whole_order(nodes, {"d"}, "PACK")[0] == all_gpu_more_host
    assert whole_order(nodes, {"d"}, "STRICT_SPREAD") == [all_gpu, some_gpu, big_host]
    # equal in everything: by node id, whatever order the agents answered in
    twins = [Node("z", GiB), Node("y", GiB)]
    assert [n.node_id for n in whole_order(twins, set(), "SPREAD")] == ["y", "z"]
