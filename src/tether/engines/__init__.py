"""Engines a runner hosts, and the contract an engine of your own implements (re-exported here, one import).

Runs inside a runner process (and in the worker, to check options and estimate memory before a runner starts).
May import ``tether.protocol``, ``tether.errors``, ``tether.units``, ``tether.models``, ``tether.kernel`` and
``tether.runner.faults``; never worker-side code (``tether.node``, ``tether.serve``, ``tether.cli``).
"""

from tether.engines.base import (
    Delta,
    Engine,
    EngineLoadError,
    Estimate,
    MemoryEstimate,
    PeerLost,
    ProgressCallback,
    RequestError,
)
from tether.engines.registry import (
    ENTRY_POINT_GROUP,
    EngineEntry,
    canonical,
    create_engine,
    estimate,
    installed,
    names,
    resolve,
    spec_problem,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Delta",
    "Engine",
    "EngineEntry",
    "EngineLoadError",
    "Estimate",
    "MemoryEstimate",
    "PeerLost",
    "ProgressCallback",
    "RequestError",
    "canonical",
    "create_engine",
    "estimate",
    "installed",
    "names",
    "resolve",
    "spec_problem",
]
