"""tether: a supervised inference worker.

Model engines run in child runner processes that never outlive their worker, never die unexplained and never
leave a request hanging. The public API is re-exported here.
"""

from typing import TYPE_CHECKING, Any

# The public API, imported on first use: a runner process imports ``tether.runner`` and must not pay for the
# supervisor side (anyio, psutil) at start-up, when its orphan protection is not armed yet.
_EXPORTS = {
    "EndOfStream": "tether.channel",
    "ProtocolError": "tether.channel",
    "Cause": "tether.protocol",
    "CauseKind": "tether.protocol",
    "ChatMessage": "tether.protocol",
    "Chunk": "tether.protocol",
    "EngineSpec": "tether.protocol",
    "ErrorChunk": "tether.protocol",
    "Fault": "tether.protocol",
    "GenerateParams": "tether.protocol",
    "RunnerStatus": "tether.protocol",
    "TaskState": "tether.protocol",
    "TaskStatus": "tether.protocol",
    "RunnerUnavailable": "tether.supervisor",
    "StopReport": "tether.supervisor",
    "Supervisor": "tether.supervisor",
    "TaskFailed": "tether.supervisor",
    "TaskHandle": "tether.supervisor",
}

if TYPE_CHECKING:
    from tether.channel import EndOfStream, ProtocolError
    from tether.protocol import (
        Cause,
        CauseKind,
        ChatMessage,
        Chunk,
        EngineSpec,
        ErrorChunk,
        Fault,
        GenerateParams,
        RunnerStatus,
        TaskState,
        TaskStatus,
    )
    from tether.supervisor import RunnerUnavailable, StopReport, Supervisor, TaskFailed, TaskHandle


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tether' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__version__ = "0.1.0"

__all__ = [
    "Cause",
    "CauseKind",
    "ChatMessage",
    "Chunk",
    "EndOfStream",
    "EngineSpec",
    "ErrorChunk",
    "Fault",
    "GenerateParams",
    "ProtocolError",
    "RunnerStatus",
    "RunnerUnavailable",
    "StopReport",
    "Supervisor",
    "TaskFailed",
    "TaskHandle",
    "TaskState",
    "TaskStatus",
    "__version__",
]
