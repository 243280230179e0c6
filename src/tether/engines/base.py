"""The engine contract: what a runner drives, what it tells apart, and how an engine declares options and memory.

A runner builds its engine from its ``EngineSpec`` (checks only, no heavy work: the worker builds one too, to refuse
bad options before a runner starts), drives it from one thread (so it need not be thread-safe), calls ``load`` and
``warmup`` once, generates any number of times, then ``close``. A ``BatchEngine`` advances up to ``parallel``
sequences a ``step``, ``start``ed and ``drop``ped between steps; an engine with only ``generate`` runs as ``Serial``,
a batch of one that declines every ``Work`` but a generation. ``RequestError`` fails one request, any other exception
the runner; ``EngineLoadError`` says a restart would not help. Optional class attributes: ``options``,
``estimate_memory(spec)`` (a ``MemoryEstimate`` for the fit check), ``sizing`` (a ``Sizable``: numbers for options
left to the memory), ``distributed`` (it runs as ``ranks: N``: rank 0 steps every rank, the others ``follow()``, a
broken peer raises ``PeerLost``), ``splits_model`` (each rank estimates its share) and ``resumes`` (its deltas carry
their token ids and it continues a generation from a ``Resume``: docs/resume.md). docs/engines.md, docs/ranks.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, runtime_checkable

import msgspec

from tether.errors import TetherError
from tether.protocol import EmbedParams, EngineSpec, FinishReason, GenerateParams, TokenizerAnswer, TokenLogprob, Work
from tether.units import format_bytes

ProgressCallback = Callable[[float, str], None]  # (fraction 0..1, detail)


class Delta(msgspec.Struct, frozen=True):
    """One step of a generation: text covering ``tokens`` tokens; the last one carries the finish reason."""

    text: str
    tokens: int = 1
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # for the tokens this delta covers, when the request asked
    embedding: tuple[float, ...] | None = None  # an embedding request's vector, on its final delta
    cached_tokens: int = 0  # of prompt_tokens, those whose KV came from the prompt cache (final delta)
    dropped_messages: int = 0  # a chat's oldest turns left out to fit the context (``fit_context``; final delta)
    prefilled: int = 0  # a progress delta (no text, no tokens): the prompt tokens prefilled so far
    tokenized: TokenizerAnswer | None = None  # a tokenizer request's answer (``TokenizerWork``; final delta)
    reasoning: str = ""  # a reasoning model's thinking in these tokens (``text``: the answer's part; ``reasoning``)
    draft_tokens: int = 0  # drafted tokens the model verified for this request (speculation; final delta)
    draft_accepted: int = 0  # of those, the ones it kept
    prediction_accepted: int = 0  # of draft_accepted, those drawn from the request's ``prediction``
    prediction_rejected: int = 0  # tokens drafted from ``prediction`` and not kept
    decode_steps: int = 0  # engine steps that produced this request's completion tokens
    ids: tuple[int, ...] = ()  # the token ids this delta covers: an engine that resumes (``resumes``) sends them
    draws: int = 0  # values the sequence's seeded draw has drawn so far, after this delta's tokens
    seed: int | None = None  # the seed of that draw (with ``ids``)


class RequestError(TetherError):
    """A request the engine cannot serve (bad input, prompt longer than the context): fails that task only.

    Any other exception from an engine is treated as fatal for the runner, since the engine's state is unknown.
    """


class PeerLost(TetherError):
    """Another rank of this multi-rank instance failed (its connection closed or broke, it sent nonsense): this
    rank's failure is a consequence of that one, and fatal for this runner."""


class EngineLoadError(TetherError):
    """The model cannot be loaded (missing file, unsupported format, bad options): the message says what to do."""


class Engine(Protocol):
    name: str

    def load(self, progress: ProgressCallback) -> None: ...

    def warmup(self) -> None: ...

    def generate(self, params: GenerateParams, cancelled: Callable[[], bool]) -> Iterator[Delta]: ...

    def close(self) -> None: ...


StepResult = tuple[str, "Delta | RequestError"]  # (sequence id, its next delta, or why that sequence alone failed)


class BatchEngine(Protocol):
    """An engine that advances several sequences per step: the runner ``start``s a sequence between steps
    (continuous batching), and ``step`` advances every started one by a token.

    ``start`` checks the request and raises ``RequestError`` for a bad one (nothing is started); ``step`` returns
    what each sequence produced this step (a sequence still prefilling its prompt may produce nothing): its final
    ``Delta`` carries the finish reason, after which the sequence is gone; a ``RequestError`` ends that sequence
    alone. Any other exception from ``step`` is fatal for the runner, as for ``generate``. ``drop`` ends a sequence
    at once (cancel) and returns its final delta (finish reason "cancelled", with its token counts): it produces
    nothing more, and its cache is free for the next one.
    """

    name: str
    parallel: int  # sequences one step can advance

    def load(self, progress: ProgressCallback) -> None: ...

    def warmup(self) -> None: ...

    def start(self, seq_id: str, params: Work) -> None: ...

    def step(self) -> list[StepResult]: ...

    def drop(self, seq_id: str) -> Delta: ...

    def active(self) -> int: ...

    def close(self) -> None: ...


def is_batched(engine: object) -> bool:
    return all(callable(getattr(engine, name, None)) for name in ("start", "step", "drop", "active")) and isinstance(
        getattr(engine, "parallel", None), int
    )


class Serial:
    """A ``generate``-only engine as a batch of one: each step is one ``next`` of its one stream."""

    parallel = 1

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # An engine of your own may leave ``name`` out (only the methods are checked): then its class names it.
        self.name = str(getattr(engine, "name", type(engine).__name__))
        self._seq: tuple[str, Iterator[Delta]] | None = None
        self._dropped = False
        self._tokens = 0

    def load(self, progress: ProgressCallback) -> None:
        self.engine.load(progress)

    def warmup(self) -> None:
        self.engine.warmup()

    def start(self, seq_id: str, params: Work) -> None:
        if not isinstance(params, GenerateParams):
            raise RequestError(declined(self.name, params))
        if params.resume is not None and params.resume.ids:  # (one with no token yet is the request afresh)
            raise RequestError(f"the {self.name} engine cannot resume a generation (it declares no ``resumes``)")
        if self._seq is not None:
            raise RuntimeError(f"{self.name} serves one sequence at a time; {self._seq[0]!r} is running")
        self._dropped = False
        self._tokens = 0
        self._seq = (seq_id, iter(self.engine.generate(params, lambda: self._dropped)))

    def step(self) -> list[StepResult]:
        if self._seq is None:
            return []
        seq_id, stream = self._seq
        try:
            delta = next(stream, None)
        except RequestError as exc:
            self._end()
            return [(seq_id, exc)]
        if delta is None:  # ended without a finish reason: the length limit
            delta = Delta("", 0, "length", 0, self._tokens)
        self._tokens += delta.tokens
        if delta.finish_reason is not None:
            self._end()
        return [(seq_id, delta)]

    def drop(self, seq_id: str) -> Delta:
        if self._seq is not None and self._seq[0] == seq_id:
            self._dropped = True
            self._end()
        return Delta("", 0, "cancelled", 0, self._tokens)

    def active(self) -> int:
        return 0 if self._seq is None else 1

    def close(self) -> None:
        self._end()
        self.engine.close()

    def _end(self) -> None:
        if self._seq is not None:
            stream, self._seq = self._seq[1], None
            close = getattr(stream, "close", None)
            if close is not None:
                close()


def batched(engine: Engine | BatchEngine) -> BatchEngine:
    """The engine as a ``BatchEngine``: itself when it batches, else wrapped in ``Serial``."""
    if is_batched(engine):
        return engine  # type: ignore[return-value]
    return Serial(engine)  # type: ignore[arg-type]


def declined(engine: str, params: Work) -> str:
    """Why ``engine``, which generates text and nothing else, refuses ``params``, and where to send them."""
    if isinstance(params, EmbedParams):
        return (
            f"the {engine} engine generates text and does not compute embeddings: start a llama.cpp instance with "
            "option embedding: true for embedding requests"
        )
    return f"the {engine} engine answers no tokenizer requests: ask a llama.cpp instance"


def generate_one(
    engine: BatchEngine, params: Work, cancelled: Callable[[], bool], seq_id: str = "one"
) -> Iterator[Delta]:
    """One request as a delta stream through a batch engine's ``start``/``step`` (a batch engine's ``generate``).

    ``start`` runs now, so a bad request raises ``RequestError`` here, not at the first ``next``.
    """
    engine.start(seq_id, params)
    return _one(engine, seq_id, cancelled)


def _one(engine: BatchEngine, seq_id: str, cancelled: Callable[[], bool]) -> Iterator[Delta]:
    emitted = 0
    done = False
    try:
        while True:
            results = [] if cancelled() else engine.step()
            if cancelled():  # before the step, or during a long one: nothing after a cancel is emitted
                done = True
                final = engine.drop(seq_id)
                yield Delta(
                    "",
                    0,
                    "cancelled",
                    final.prompt_tokens,
                    emitted,
                    draft_tokens=final.draft_tokens,
                    draft_accepted=final.draft_accepted,
                    prediction_accepted=final.prediction_accepted,
                    prediction_rejected=final.prediction_rejected,
                    decode_steps=final.decode_steps,
                )
                return
            for sid, result in results:
                if sid != seq_id:
                    continue
                if isinstance(result, RequestError):
                    done = True
                    raise result
                emitted += result.tokens
                yield result
                if result.finish_reason is not None:
                    done = True
                    return
    finally:
        if not done:
            engine.drop(seq_id)


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


@runtime_checkable
class GrowingEstimate(MemoryEstimate, Protocol):
    """An estimate of a runner whose caches grow as it serves (llama.cpp's prompt cache in RAM): what a measurement
    right after load is compared with is ``held``, not ``expected``, at the context ``n_ctx``."""

    @property
    def held(self) -> int: ...  # what the runner holds at its peak before such a cache fills, without headroom

    @property
    def n_ctx(self) -> int: ...  # the context (cells a sequence) the estimate is for


class GpuRoom(Protocol):
    """One GPU as the node reads it now (NVML): what an engine's sizing may put on it."""

    @property
    def index(self) -> int: ...  # as NVML and CUDA_DEVICE_ORDER=PCI_BUS_ID number it

    @property
    def name(self) -> str: ...

    @property
    def total(self) -> int: ...

    @property
    def free(self) -> int: ...  # device-wide: every process's use already taken off


@dataclass(frozen=True)
class Room:
    """What a runner may take on this node: ``available`` host bytes (None: size the GPUs only, leave the context
    as asked) and the GPUs (``no_gpu``: why there are none)."""

    available: int | None
    gpus: Sequence[GpuRoom] = ()
    no_gpu: str | None = None


@dataclass(frozen=True)
class Sized:
    """An engine's sizing of one spec for a node's ``Room``: the spec to run (its "auto" options given numbers),
    the estimate of what it then holds on the host, and what was chosen, in words."""

    spec: EngineSpec
    estimate: MemoryEstimate  # the host's share (layers on GPUs are not in it)
    note: str | None = None  # a choice made for the host's memory (a context lowered to fit), said with numbers
    gpu_note: str | None = None  # what went on the GPUs, with their numbers
    gpu_problem: str | None = None  # why the GPUs cannot hold what was asked (None: they can)
    gpu_layers: int = 0  # the layers placed on GPUs (a cluster prefers the node whose GPUs hold the most)


class Shortfall(NamedTuple):
    """What the GPUs lack to hold what a spec asks (every layer, for "auto"): ``bytes`` beyond their free memory less
    the margin, which evicting idle models could give back, and ``estimate``, the host's share once they hold it
    (None when nothing would go on a GPU here)."""

    bytes: int = 0
    estimate: MemoryEstimate | None = None


class Sizable(Protocol):
    """How an engine sizes what it left to the memory, for the fit check of ``tether.node.fit`` (which runs it and
    knows no option name). Both get the estimate the engine's ``estimate_memory`` made for ``spec``."""

    @property
    def each_life(self) -> tuple[str, ...]:
        """The options sized again for every life, from their value as asked (what the GPUs hold changes)."""
        ...

    def sized(self, spec: EngineSpec, estimate: MemoryEstimate, room: Room) -> Sized:
        """``spec`` sized for ``room``: GPU layers by the GPUs' free memory, then (``room.available`` given) what
        the host's memory holds. An estimate this engine did not make, or a spec it leaves as is, comes back as is."""
        ...

    def gpu_shortfall(self, spec: EngineSpec, estimate: MemoryEstimate, gpus: Sequence[GpuRoom]) -> Shortfall:
        """What ``gpus`` lack to hold what ``spec`` asks (see ``Shortfall``); nothing when nothing goes on them."""
        ...


NO_OPTIONS: Mapping[str, Any] = MappingProxyType({})
