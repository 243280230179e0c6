"""tether: a supervised inference worker.

Model engines run in child runner processes that never outlive their worker, never die unexplained and never
leave a request hanging. The public API is re-exported here, from one list (``_EXPORTS``).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

# The public API, imported on first use: a runner process imports ``tether.runner`` and must not pay for the
# worker side (anyio, psutil) at start-up, when its orphan protection is not armed yet.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "tether.channel": ("EndOfStream", "ProtocolError"),
    "tether.engines.base": ("Delta", "Engine", "EngineLoadError", "Estimate", "MemoryEstimate", "RequestError"),
    "tether.errors": (
        "InstanceExists",
        "InvalidField",
        "InvalidModel",
        "NotFound",
        "TetherError",
        "UnknownEngine",
    ),
    "tether.node.fit": ("DoesNotFit", "FitResult"),
    "tether.node.hangs": ("Deadlines",),
    "tether.node.instance": ("Instance", "InstanceState", "RestartPolicy"),
    "tether.node.supervisor": ("Supervisor",),
    "tether.node.tasks": ("CancelReply", "RunnerUnavailable", "StopReport", "TaskFailed", "TaskHandle"),
    "tether.protocol": (
        "Cause",
        "CauseKind",
        "ChatMessage",
        "Chunk",
        "DetokenizeParams",
        "EmbedParams",
        "EngineSpec",
        "ErrorChunk",
        "Fault",
        "GenerateParams",
        "RunnerStatus",
        "TaskState",
        "TaskStatus",
        "TokenizeParams",
    ),
    "tether.fleet.fleet": ("Fleet", "InstanceConfig", "Unavailable"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # the same names, for type checkers (tests/test_layout.py checks the two agree)
    __version__: str
    from tether.channel import EndOfStream as EndOfStream
    from tether.channel import ProtocolError as ProtocolError
    from tether.engines.base import Delta as Delta
    from tether.engines.base import Engine as Engine
    from tether.engines.base import EngineLoadError as EngineLoadError
    from tether.engines.base import Estimate as Estimate
    from tether.engines.base import MemoryEstimate as MemoryEstimate
    from tether.engines.base import RequestError as RequestError
    from tether.errors import InstanceExists as InstanceExists
    from tether.errors import InvalidField as InvalidField
    from tether.errors import InvalidModel as InvalidModel
    from tether.errors import NotFound as NotFound
    from tether.errors import TetherError as TetherError
    from tether.errors import UnknownEngine as UnknownEngine
    from tether.fleet.fleet import Fleet as Fleet
    from tether.fleet.fleet import InstanceConfig as InstanceConfig
    from tether.fleet.fleet import Unavailable as Unavailable
    from tether.node.fit import DoesNotFit as DoesNotFit
    from tether.node.fit import FitResult as FitResult
    from tether.node.hangs import Deadlines as Deadlines
    from tether.node.instance import Instance as Instance
    from tether.node.instance import InstanceState as InstanceState
    from tether.node.instance import RestartPolicy as RestartPolicy
    from tether.node.supervisor import Supervisor as Supervisor
    from tether.node.tasks import CancelReply as CancelReply
    from tether.node.tasks import RunnerUnavailable as RunnerUnavailable
    from tether.node.tasks import StopReport as StopReport
    from tether.node.tasks import TaskFailed as TaskFailed
    from tether.node.tasks import TaskHandle as TaskHandle
    from tether.protocol import Cause as Cause
    from tether.protocol import CauseKind as CauseKind
    from tether.protocol import ChatMessage as ChatMessage
    from tether.protocol import Chunk as Chunk
    from tether.protocol import DetokenizeParams as DetokenizeParams
    from tether.protocol import EmbedParams as EmbedParams
    from tether.protocol import EngineSpec as EngineSpec
    from tether.protocol import ErrorChunk as ErrorChunk
    from tether.protocol import Fault as Fault
    from tether.protocol import GenerateParams as GenerateParams
    from tether.protocol import RunnerStatus as RunnerStatus
    from tether.protocol import TaskState as TaskState
    from tether.protocol import TaskStatus as TaskStatus
    from tether.protocol import TokenizeParams as TokenizeParams


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the one version, pyproject.toml's as installed; looked up on first use, since
        from importlib.metadata import PackageNotFoundError, version  # importlib.metadata costs a runner's start

        try:
            return version("tether")
        except PackageNotFoundError:  # run from a source tree that is not installed
            return "0+unknown"
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tether' has no attribute {name!r}")
    return getattr(import_module(module), name)


__all__ = sorted([*_WHERE, "__version__"])
