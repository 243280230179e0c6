"""The engine contract: what a runner drives, what it tells apart, and how an engine declares options and memory.

An engine lives inside one runner process and is driven by one thread (the runner's task loop), so engines need
not be thread-safe. The runner builds it with its ``EngineSpec`` (the constructor checks the options and does no
heavy work: the worker builds one too, to refuse bad options before a runner starts), then calls ``load`` once
(reporting progress), ``warmup`` once, ``generate`` any number of times, ``close`` once. ``generate`` must call
``cancelled()`` between tokens and stop promptly when it is true.

``RequestError`` fails one request and the runner serves on; any other exception from an engine is fatal for the
runner (the engine's state is unknown), and ``EngineLoadError`` from ``load`` says the model cannot be loaded (a
restart would not help). Optional class attributes: ``options`` (the option names and their defaults) and
``estimate_memory(spec)`` (a static or class method returning a ``MemoryEstimate``, or None), which the worker's
fit check asks before a runner of ``spec`` starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import msgspec

from tether.errors import TetherError
from tether.protocol import FinishReason, GenerateParams
from tether.units import format_bytes

ProgressCallback = Callable[[float, str], None]  # (fraction 0..1, detail)


class Delta(msgspec.Struct, frozen=True):
    """One step of a generation: text covering ``tokens`` tokens; the last one carries the finish reason."""

    text: str
    tokens: int = 1
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class RequestError(TetherError):
    """A request the engine cannot serve (bad input, prompt longer than the context): fails that task only.

    Any other exception from an engine is treated as fatal for the runner, since the engine's state is unknown.
    """


class EngineLoadError(TetherError):
    """The model cannot be loaded (missing file, unsupported format, bad options): the message says what to do."""


class Engine(Protocol):
    name: str

    def load(self, progress: ProgressCallback) -> None: ...

    def warmup(self) -> None: ...

    def generate(self, params: GenerateParams, cancelled: Callable[[], bool]) -> Iterator[Delta]: ...

    def close(self) -> None: ...


class MemoryEstimate(Protocol):
    """What a runner of one spec is expected to hold at its peak, in bytes (the fit check compares ``total``)."""

    @property
    def subject(self) -> str: ...  # what is estimated, for messages: a model file's name

    @property
    def expected(self) -> int: ...  # what the runner itself holds at its peak

    @property
    def headroom(self) -> int: ...  # the margin on top

    @property
    def total(self) -> int: ...  # expected + headroom

    def describe(self) -> str: ...  # "needs ~X (part A + part B + headroom C)"

    def advice(self, available: int) -> str | None: ...  # what would fit in ``available`` (None: nothing to add)


@dataclass(frozen=True)
class Estimate:
    """A plain ``MemoryEstimate`` for engines of your own: named parts in bytes, plus headroom."""

    subject: str
    parts: Mapping[str, int]
    headroom: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def expected(self) -> int:
        return sum(self.parts.values())

    @property
    def total(self) -> int:
        return self.expected + self.headroom

    def describe(self) -> str:
        parts = " + ".join(f"{name} {format_bytes(size)}" for name, size in self.parts.items())
        headroom = f" + headroom {format_bytes(self.headroom)}" if self.headroom else ""
        return f"needs ~{format_bytes(self.total)} ({parts or 'nothing'}{headroom})"

    def advice(self, available: int) -> str | None:
        return None


NO_OPTIONS: Mapping[str, Any] = MappingProxyType({})
