"""Engines a runner can host, behind one protocol; concrete engines are imported lazily by ``create_engine``.

Re-exports the contract from ``base`` so callers import from one place.
"""

from tether.engines.base import (
    ENGINE_NAMES,
    Delta,
    Engine,
    EngineLoadError,
    ProgressCallback,
    RequestError,
    create_engine,
)

__all__ = [
    "ENGINE_NAMES",
    "Delta",
    "Engine",
    "EngineLoadError",
    "ProgressCallback",
    "RequestError",
    "create_engine",
]
