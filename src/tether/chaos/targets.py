"""The campaign's targets: what ``tether chaos --target NAME`` attacks, each a module with a campaign function.

A target is a module exposing ``run_campaign(seed, trials, *, only=None, progress=None, engine="debug") ->
Report`` (``tether.chaos.campaign.Report``: the summary's common keys plus ``target``). Its trials are drawn from
``random.Random(f"{seed}:{index}:{target}")`` (``single`` keeps its older ``seed:index``), so any trial replays
alone with ``--target NAME --seed S --only K``. Modules are imported on use: a target whose module is not written
yet is listed and refused with a message, never an ImportError.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tether.chaos.campaign import Report
from tether.errors import TetherError


@dataclass(frozen=True)
class TargetKind:
    name: str
    module: str  # exposes run_campaign
    help: str
    engines: tuple[str, ...] = ("debug",)  # the engines its servers can run
    options: tuple[tuple[str, Any], ...] = ()  # keyword arguments its module's run_campaign takes for this target


TARGETS: dict[str, TargetKind] = {
    kind.name: kind
    for kind in (
        TargetKind("single", "tether.chaos.campaign", "one stream or queue per instance (the original campaign)"),
        TargetKind(
            "batch",
            "tether.chaos.batch",
            "8 sequences decoded at once (16 in flight); per-sequence faults leave the others' texts as run alone",
            ("debug", "llama.cpp"),
        ),
        TargetKind("models", "tether.chaos.models", "3 catalogued models in a memory cgroup that holds 2"),
        TargetKind("cluster", "tether.chaos.cluster", "nodes of a Ray cluster"),
        TargetKind(
            "ranks",
            "tether.chaos.ranks",
            "the ranks of one multi-rank instance (debug rings; the default model over ggml RPC with llama.cpp)",
            ("debug", "llama.cpp"),
        ),
        TargetKind(
            "cluster-ranks",
            "tether.chaos.ranks",
            "the ranks target's trials on a Ray cluster of 3 nodes, each rank on its own node",
            ("debug", "llama.cpp"),
            (("on_cluster", True),),
        ),
    )
}

Campaign = Callable[..., Awaitable[Report]]


class TargetUnavailable(TetherError):
    """A target that cannot run as asked (its module is not there yet, or the engine is not one it runs)."""


def campaign(name: str, engine: str = "debug") -> Campaign:
    """The campaign function of target ``name`` for ``engine``; ``TargetUnavailable`` saying why not."""
    kind = TARGETS.get(name)
    if kind is None:
        raise TargetUnavailable(f"no chaos target {name!r}: choose one of {', '.join(TARGETS)}")
    if engine not in kind.engines:
        raise TargetUnavailable(
            f"the {name} target runs the {' or '.join(kind.engines)} engine, not {engine!r}: "
            f"drop --engine or use {kind.engines[0]}"
        )
    try:
        module: Any = importlib.import_module(kind.module)
    except ModuleNotFoundError as exc:
        if exc.name != kind.module:
            raise
        raise TargetUnavailable(
            f"the {name} target ({kind.module}) is not in this version of tether yet: choose one of "
            f"{', '.join(n for n, k in TARGETS.items() if _present(k))}"
        ) from None
    fn: Campaign = module.run_campaign
    return functools.partial(fn, **dict(kind.options)) if kind.options else fn


def _present(kind: TargetKind) -> bool:
    return importlib.util.find_spec(kind.module) is not None
