"""The engine protocol: what a runner drives, and the errors it distinguishes.

An engine lives inside one runner process and is driven by one thread (the runner's task loop), so engines need
not be thread-safe. The runner calls: ``load`` once (reporting progress), ``warmup`` once, ``generate`` any number
of times, ``close`` once. ``generate`` must call ``cancelled()`` between tokens and stop promptly when it is true.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import msgspec

from tether.protocol import EngineSpec, FinishReason, GenerateParams

ProgressCallback = Callable[[float, str], None]  # (fraction 0..1, detail)


class Delta(msgspec.Struct, frozen=True):
    """One step of a generation: text covering ``tokens`` tokens; the last one carries the finish reason."""

    text: str
    tokens: int = 1
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class RequestError(Exception):
    """A request the engine cannot serve (bad input, prompt longer than the context): fails that task only.

    Any other exception from an engine is treated as fatal for the runner, since the engine's state is unknown.
    """


class EngineLoadError(Exception):
    """The model cannot be loaded (missing file, unsupported format): the message says what and what to do."""


class Engine(Protocol):
    name: str

    def load(self, progress: ProgressCallback) -> None: ...

    def warmup(self) -> None: ...

    def generate(self, params: GenerateParams, cancelled: Callable[[], bool]) -> Iterator[Delta]: ...

    def close(self) -> None: ...


ENGINE_NAMES = ("llama.cpp", "debug")
ENGINE_ALIASES = {"llamacpp": "llama.cpp", "llama": "llama.cpp"}


def unknown_engine(name: str) -> str | None:
    """Why ``name`` names no engine (with the ones there are), or None when it names one (aliases included)."""
    if name in ENGINE_NAMES or name in ENGINE_ALIASES:
        return None
    return f"unknown engine {name!r}: choose one of {', '.join(repr(n) for n in ENGINE_NAMES)}"


def create_engine(spec: EngineSpec) -> Engine:
    """Build (but do not load) the engine a spec names. Imports lazily: a debug runner never imports llama.cpp."""
    name = ENGINE_ALIASES.get(spec.engine, spec.engine)
    if name == "debug":
        from tether.engines.debug import DebugEngine

        return DebugEngine(spec)
    if name == "llama.cpp":
        from tether.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(spec)
    raise EngineLoadError(unknown_engine(spec.engine) or f"unknown engine {spec.engine!r}")


def spec_problem(spec: EngineSpec) -> str | None:
    """Why the engine would refuse ``spec``'s options (None when it takes them), found without loading anything:
    an engine checks its options when it is built, and building one imports no engine library."""
    try:
        create_engine(spec)
    except EngineLoadError as exc:
        return str(exc)
    return None
