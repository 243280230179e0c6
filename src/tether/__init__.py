"""tether: a supervised inference worker.

Model engines run in child runner processes that never outlive their worker, never die unexplained and never
leave a request hanging. The public API is re-exported here.
"""

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
