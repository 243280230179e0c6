"""A model-free engine for rehearsing the supervisor: deterministic tokens and real, injectable faults.

Output is a pseudo-random word sequence seeded by a stable hash of the prompt (and ``params.seed``), so the same
request always produces the same text, in any process, without a model. Faults come from the engine spec (load,
warmup, generate and idle phases; generate faults apply to every request) and from each request's params, and are
performed for real (``tether.runner.faults``). The engine says about the rest of a request only what a
deterministic engine honestly can (``DebugEngine._start``), and declares a memory estimate (the interpreter plus
``hold_bytes``) so the fit check and the scheduler see a debug model as they see a real one. With ``spec.rank`` its
ranks form a ring (``ring``), for rehearsing multi-rank instances. It resumes (``resumes``): each token's delta
carries its id (the word's first index in ``VOCAB``), and a generation started with ``params.resume`` replays the
words it had produced and continues with exactly what the uninterrupted one would have sent (``DebugEngine._start``).
The ``poison`` option makes every request whose prompt holds a marker fire a fault, on every runner it is resumed
on. Its options: ``DebugEngine.options``; an option it does not know is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, get_args

import msgspec

from tether.engines.base import (
    Delta,
    EngineLoadError,
    Estimate,
    PeerLost,
    ProgressCallback,
    RequestError,
    StepResult,
    generate_one,
)
from tether.engines.ring import Ring
from tether.engines.text import TextStream
from tether.protocol import (
    EmbedParams,
    EngineSpec,
    Fault,
    FaultKind,
    GenerateParams,
    TokenizerWork,
    TokenLogprob,
    TopLogprob,
    Work,
)
from tether.runner.faults import faults_for, fire, trigger

VOCAB = tuple(
    " ".join(
        (
            "the quick brown fox jumps over a lazy dog while tether keeps every runner on a short leash",
            "and no request ever hangs because each wait has a bound so heartbeats flow tokens stream",
            "stacks dump pipes drain memory stays honest signals speak causes travel orphans vanish",
        )
    ).split()
)


WORD_IDS = MappingProxyType({word: VOCAB.index(word) for word in VOCAB})  # a word's id: its first index ("a" is twice)
POISON_KEYS = ("marker", "fault", "after_tokens")
FAULT_KINDS = get_args(FaultKind)
HELPER_KINDS = ("exec", "fork", "setsid", "setpgid", "double_fork")
_NEEDS_ENGINE_CODE = frozenset({"raise", "memory_error", "hang", "slow", "request_error"})  # inside an engine call
MAX_PARALLEL = 256
MAX_EMBEDDING_DIM = 65536
PAGE = 4096
RUNTIME_BYTES = 40 << 20  # a debug runner without hold_bytes, measured: 23 MiB footprint, 38 MiB resident
RUNTIME_HEADROOM = 16 << 20
GOODBYE_SECONDS = 1.0  # how long rank 0's close may spend telling the ring it ends


@dataclass
class _DebugSequence:
    """One running generation of a batch."""

    words: Iterator[str]
    text: TextStream
    faults: tuple[Fault, ...]
    prompt_tokens: int
    budget: int
    done: int = 0
    logprobs: int | None = None  # alternatives per token, None for no logprobs
    embedding: tuple[float, ...] | None = None  # an embed request's vector: it ends at its first step
    carried: tuple[Fault, ...] = ()  # its request's generate faults for other ranks, carried round the ring
    ringed: bool = True  # its tokens go round the ring (not the warm-up generation's: the warm-up frame did that)
    echo: str | None = None  # ``echo``: the prompt, to lead the first delta (None once sent)
    echoed: tuple[TokenLogprob, ...] = ()  # ``echo`` with logprobs: the prompt's words' entries
    resumed: bool = False  # a resume (``params.resume``): the instance's generate faults pass it by


class RingToken(msgspec.Struct, frozen=True, array_like=True):
    """One token of one sequence as it passes the ring: ``index`` is the tokens that sequence produced before it
    (what ``after_tokens`` compares with), ``faults`` its request's faults for the other ranks."""

    seq_id: str
    index: int
    piece: str
    faults: tuple[Fault, ...] = ()
    resumed: bool = False  # its sequence is a resume: the instance's faults do not strike it (``start``)


class RingFrame(msgspec.Struct, frozen=True, array_like=True):
    """What goes round the ring: the warm-up frame, one per step (every token of it), or rank 0's goodbye."""

    kind: Literal["warmup", "step", "goodbye"]
    step: int = 0
    tokens: tuple[RingToken, ...] = ()


class DebugEngine:
    """Deterministic fake engine, batched as llama.cpp's: one step advances every running sequence by one token.

    Ring mode (as exo's MLX ring), on when ``spec.rank`` says ``world_size`` > 1: every rank listens on its
    ``host:port`` from load on (a port another live process holds fails the load with an ordinary ``RuntimeError``,
    which a restart policy retries: what an orphan of an earlier life does to its replacement), and warm-up forms a
    TCP ring. Rank 0 serves the requests; each of its steps sends the step's tokens round the ring and returns them
    only once they are back, so every token visibly passes every rank. The other ranks forward frames in
    ``follow()``; any broken connection is ``PeerLost`` naming both ranks. Rank 0's clean close says goodbye round
    the ring, so the others do not count it as a failure.

    A rank fires only the faults whose ``rank`` is None (every rank) or its own (a runner without ``spec.rank`` is
    rank 0). A rank above 0 fires its generate faults, from its spec and from the request (rank 0 carries a
    request's faults for other ranks in each token's frame), as each token passes it, at that token's index, with
    rank 0's semantics: a fault ``after_tokens=3`` lets exactly three tokens through (``slow`` applies from it on).
    ``request_error`` fires on rank 0 only, which alone has requests to fail."""

    name = "debug"
    options = MappingProxyType(
        {
            "load_steps": 5,  # load progress steps: 0.2, 0.4, ... 1.0
            "load_step_seconds": 0.001,  # delay per load step
            "token_seconds": 0.0,  # delay per step: a batch of 8 makes 8 tokens per token_seconds, as a real one
            "parallel": 1,  # sequences served at once; beyond it requests wait in the runner's queue
            # if set, longer prompts (in whitespace tokens) fail with RequestError, and a generation ends ("length")
            # when prompt and output fill it, as a real engine's context does
            "n_ctx": None,
            # helper processes started at load, like an engine's tokenizer or compile workers: they live until
            # close() and prove a runner's group dies with it (their kinds: ``_start_helper``)
            "helpers": 0,
            "helper_kind": "exec",  # a kind, or a comma-separated list: helper i gets kind i modulo its length
            "embedding_dim": 64,  # the dimension of ``embed`` vectors
            # GPU memory allocated (and touched) with torch.cuda at load and held until close(), as a real engine's
            # weights: for checking GPU memory is reported and given back (needs torch with CUDA)
            "gpu_bytes": 0,
            # anonymous memory allocated and touched at load and held until close(): a model's weights and KV
            # cache, for rehearsing memory-aware loading and eviction
            "hold_bytes": 0,
            "close_seconds": 0.0,  # delay in close(): a runner slow to shut down, so an unload can be raced
            "ring_timeout": 30.0,  # ring mode: how long forming the ring, and one step's round trip, may take
            # {"marker": TEXT, "fault": KIND, "after_tokens": N}: a request whose prompt holds TEXT fires fault KIND
            # (generate phase, rank 0) once it has N tokens, resumed ones included (so again on every runner it is
            # resumed on); an embedding request at its one step
            "poison": None,
        }
    )
    distributed = True  # ranks of a multi-rank instance form a ring (see the class docstring)
    resumes = True  # deltas carry their token ids; ``params.resume`` continues a generation (``_start``)

    @staticmethod
    def estimate_memory(spec: EngineSpec) -> Estimate:
        """The runner's interpreter plus ``hold_bytes``; an option that is no number is left to ``load`` to refuse."""
        try:
            held = max(0, int(spec.options.get("hold_bytes", 0)))
        except (TypeError, ValueError):
            held = 0
        return Estimate("the debug engine", {"runtime": RUNTIME_BYTES, "held": held}, headroom=RUNTIME_HEADROOM)

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        options = spec.options
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise EngineLoadError(
                f"unknown debug engine option(s) {', '.join(unknown)}: valid options are {', '.join(self.options)}"
            )
        self.poison = _poison(options.get("poison"))
        try:
            self.load_steps = max(1, int(options.get("load_steps", 5)))
            self.load_step_seconds = max(0.0, float(options.get("load_step_seconds", 0.001)))
            self.token_seconds = max(0.0, float(options.get("token_seconds", 0.0)))
            self.parallel = int(options.get("parallel", 1))
            if not 1 <= self.parallel <= MAX_PARALLEL:
                raise ValueError(f"parallel must be in [1, {MAX_PARALLEL}], got {self.parallel}")
            n_ctx = options.get("n_ctx")
            self.n_ctx = int(n_ctx) if n_ctx is not None else None
            self.helpers = max(0, int(options.get("helpers", 0)))
            self.helper_kind = str(options.get("helper_kind", "exec"))
            self.gpu_bytes = max(0, int(options.get("gpu_bytes", 0)))
            self.hold_bytes = max(0, int(options.get("hold_bytes", 0)))
            self.close_seconds = max(0.0, float(options.get("close_seconds", 0.0)))
            self.embedding_dim = int(options.get("embedding_dim", 64))
            if not 1 <= self.embedding_dim <= MAX_EMBEDDING_DIM:
                raise ValueError(f"embedding_dim must be in [1, {MAX_EMBEDDING_DIM}], got {self.embedding_dim}")
            self._kinds = self.helper_kind.split(",")
            unknown = [kind for kind in self._kinds if kind not in HELPER_KINDS]
            if unknown:
                raise ValueError(
                    f"helper_kind must be one of {', '.join(HELPER_KINDS)} (or several, comma-separated), got "
                    f"{', '.join(repr(kind) for kind in unknown)}"
                )
            self.ring_timeout = float(options.get("ring_timeout", 30.0))
            if not 0 < self.ring_timeout < math.inf:
                raise ValueError(f"ring_timeout must be a positive number of seconds, got {self.ring_timeout}")
            idle_exceptions = [f.kind for f in spec.faults if f.phase == "idle" and f.kind in _NEEDS_ENGINE_CODE]
            if idle_exceptions:
                raise ValueError(
                    f"fault kinds {idle_exceptions} cannot fire while idle (no engine code runs then); use exit, "
                    "segv, abort, sigkill or oom"
                )
        except (TypeError, ValueError) as exc:
            raise EngineLoadError(f"invalid debug engine option in {options!r}: {exc}") from exc
        self.rank = spec.rank.rank if spec.rank is not None else 0
        self._ring: Ring | None = None  # ring mode: a rank of a multi-rank instance
        if spec.rank is not None and spec.rank.world_size > 1:
            problem = _rank_problem(spec)
            if problem is not None:
                raise EngineLoadError(f"invalid rank for the debug engine ({spec.rank!r}): {problem}")
            self._ring = Ring(spec.rank, self.ring_timeout)
        self._faults = self._mine(spec.faults)
        # What a follower fires at each token passing it: its spec's generate faults (``request_error`` is rank 0's
        # alone, since only rank 0 has requests to fail).
        self._follow_faults = tuple(f for f in self._faults if f.phase == "generate" and f.kind != "request_error")
        self._steps = 0  # ring steps rank 0 has sent round
        self._loaded = False
        self._helper_pids: list[int] = []
        self._gpu: object | None = None  # a torch tensor holding gpu_bytes
        self._held: bytearray | None = None  # hold_bytes, every page written
        self._seqs: dict[str, _DebugSequence] = {}
        self._calls = 0  # generate() calls, for their sequence ids

    def load(self, progress: ProgressCallback) -> None:
        """Start the helpers, then report ``load_steps`` progress steps; load faults fire at step 0 (``slow`` at
        each step)."""
        for i in range(self.helpers):
            self._helper_pids.append(_start_helper(self._kinds[i % len(self._kinds)]))
        if self.helpers:
            progress(0.0, f"started {self.helpers} helper processes ({self.helper_kind})")
        if self._ring is not None:  # after the helpers, so a forked one never holds the port
            self._ring.listen()
            progress(0.0, f"{self._ring.me} listening on {self._ring.info.peers[self.rank]}")
        if self.gpu_bytes:
            self._gpu = _hold_gpu_memory(self.gpu_bytes)
            progress(0.0, f"holding {self.gpu_bytes} bytes of GPU memory")
        if self.hold_bytes:
            self._held = bytearray(self.hold_bytes)
            self._held[::PAGE] = b"\x01" * len(range(0, self.hold_bytes, PAGE))  # calloc's pages are not backed yet
            progress(0.0, f"holding {self.hold_bytes} bytes of memory")
        for step in range(self.load_steps):
            fire(self._faults, "load", step)
            if self.load_step_seconds:
                time.sleep(self.load_step_seconds)
            progress((step + 1) / self.load_steps, f"debug engine load step {step + 1}/{self.load_steps}")
        self._loaded = True

    def warmup(self) -> None:
        """Fire warmup-phase faults; in ring mode form the ring (rank 0 then sends a frame round it and waits for
        it to come back: followers forward it once their ``follow`` runs); then run a one-token generation like a
        real engine would."""
        self._require_loaded()
        fire(self._faults, "warmup", 0)
        if self._ring is not None:
            self._ring.connect()
            if self.rank == 0:
                self._round(RingFrame("warmup"), "with the warm-up frame")
        self._start("warmup", GenerateParams(prompt="warmup", max_tokens=1), faults=(), ringed=False)
        while self._seqs:
            self.step()
        for fault in faults_for(self._faults, "idle"):
            timer = threading.Timer(fault.seconds, trigger, args=(fault,))
            timer.daemon = True
            timer.start()

    def generate(self, params: Work, cancelled: Callable[[], bool]) -> Iterator[Delta]:
        """One request on its own (a bad request raises ``RequestError`` now, not at the first ``next``)."""
        self._calls += 1
        return generate_one(self, params, cancelled, seq_id=f"generate-{self._calls}")

    def start(self, seq_id: str, params: Work) -> None:
        """Check the request (``RequestError``) and add it to the batch: its first token comes with the next step."""
        if self._ring is not None and self.rank != 0:
            raise RequestError(f"{self._ring.me} takes no requests: send them to rank 0 of the instance")
        problem = params.check()
        if problem is not None:
            raise RequestError(str(problem))
        if isinstance(params, GenerateParams) and (params.json_schema is not None or params.tool_syntax is not None):
            raise RequestError(
                "the debug engine does not do structured output (json_schema, tools): use the llama.cpp engine for it"
            )
        if isinstance(params, TokenizerWork) or (isinstance(params, GenerateParams) and params.prompt_ids is not None):
            raise RequestError(
                "the debug engine has no tokenizer (its tokens are words): send a text prompt, and token ids or "
                "tokenizer requests to a llama.cpp instance"
            )
        carried = tuple(
            f for f in params.faults if f.rank != self.rank and f.phase == "generate" and f.kind != "request_error"
        )
        # The instance's faults rehearse a crash that strikes a request once: not its resume (``params.resume``). The
        # request's own faults, and a poison, strike every runner it is resumed on.
        resumed = isinstance(params, GenerateParams) and params.resume is not None
        own = tuple(f for f in self._faults if f.phase != "generate") if resumed else self._faults
        self._start(seq_id, params, own + self._mine(params.faults) + self._poisoned(params), carried=carried)
        if resumed:
            self._seqs[seq_id].resumed = True

    def step(self) -> list[StepResult]:
        """One token for every sequence: each one's faults fire first (a ``request_error`` ends that sequence
        alone; any other fault is the whole runner's), then one ``token_seconds`` for the batch. In ring mode the
        step's tokens then go round the ring (``PeerLost`` if it broke) before any of them is returned."""
        results: list[StepResult] = []
        for seq_id, seq in list(self._seqs.items()):
            try:
                fire(seq.faults, "generate", seq.done)
            except RequestError as exc:
                del self._seqs[seq_id]
                results.append((seq_id, exc))
        if self._seqs and self.token_seconds:
            time.sleep(self.token_seconds)
        tokens: list[RingToken] = []
        for seq_id, seq in list(self._seqs.items()):
            delta, piece = self._advance(seq_id, seq)
            results.append((seq_id, delta))
            if delta.tokens and seq.ringed:
                tokens.append(RingToken(seq_id, seq.done - 1, piece, seq.carried, seq.resumed))
        if tokens and self._ring is not None and self.rank == 0:
            self._steps += 1
            self._round(RingFrame("step", self._steps, tuple(tokens)), f"during step {self._steps}")
        return results

    def follow(self) -> None:
        """A rank above 0, on the runner's follow thread: forward every frame from the predecessor to the
        successor, firing this rank's generate faults (its spec's, and the request faults the frame carries for
        it) at each token's index first. Returns only once ``close`` was called; a broken ring is ``PeerLost``."""
        ring = self._ring
        if ring is None or self.rank == 0:
            raise RuntimeError("follow() is for the ranks above 0 of a multi-rank instance")
        last = 0
        try:
            while True:
                frame = ring.recv(RingFrame, f"while waiting for step {last + 1}", forever=True)
                if frame.kind == "goodbye":  # rank 0 closed cleanly: pass it on, then wait for our own close
                    with contextlib.suppress(PeerLost):
                        ring.send(frame, "passing on rank 0's goodbye", timeout=GOODBYE_SECONDS)
                    ring.wait_closed()
                    return
                for token in frame.tokens:
                    spec = () if token.resumed else self._follow_faults
                    mine = spec + tuple(f for f in self._mine(token.faults) if f.kind != "request_error")
                    fire(mine, "generate", token.index)
                ring.send(frame, f"during step {frame.step}" if frame.kind == "step" else "with the warm-up frame")
                last = frame.step
        except PeerLost:
            if ring.closed:  # our own close woke the wait: the ring's end is expected
                return
            raise

    def drop(self, seq_id: str) -> Delta:
        seq = self._seqs.pop(seq_id, None)
        return _cancelled(seq.prompt_tokens if seq else 0, seq.done if seq else 0)

    def active(self) -> int:
        return len(self._seqs)

    def close(self) -> None:
        """Close the ring first (a follow thread blocked on it returns at once; rank 0 first tells the others it
        ends, so their ``follow`` does not count it as a failure), then everything else."""
        if self._ring is not None:
            if self.rank == 0 and self._ring.connected:
                with contextlib.suppress(PeerLost):
                    self._ring.send(RingFrame("goodbye"), "with the goodbye", timeout=GOODBYE_SECONDS)
            self._ring.close()
        if self.close_seconds:
            time.sleep(self.close_seconds)
        self._loaded = False
        self._seqs.clear()
        for pid in self._helper_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._helper_pids.clear()
        self._gpu = None
        self._held = None

    # ------------------------------------------------------------------------------------------------------

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise RuntimeError("debug engine used before load() (or after close())")

    def _mine(self, faults: tuple[Fault, ...]) -> tuple[Fault, ...]:
        """The faults this rank fires: those for every rank (``rank`` None) and those for this one."""
        return tuple(f for f in faults if f.rank is None or f.rank == self.rank)

    def _poisoned(self, params: GenerateParams | EmbedParams) -> tuple[Fault, ...]:
        """The ``poison`` fault of a request whose prompt holds the marker (else nothing): it fires at the first step
        with ``after_tokens`` tokens or more, counting the ones a resume brings, so a poison request resumed past it
        fires at once on the new runner; an embedding's at its one step."""
        if self.poison is None or self.poison.marker not in prompt_text(params):
            return ()
        after = 0
        if isinstance(params, GenerateParams):
            after = max(self.poison.after_tokens, len(params.resume.ids) if params.resume is not None else 0)
        return (Fault(kind=self.poison.fault, phase="generate", after_tokens=after),)

    def _round(self, frame: RingFrame, detail: str) -> None:
        """Rank 0: send ``frame`` round the ring and wait (bounded by ``ring_timeout``) until it is back."""
        assert self._ring is not None
        self._ring.send(frame, detail)
        back = self._ring.recv(RingFrame, detail)
        if back != frame:
            raise PeerLost(
                f"{self._ring.me}: the ring returned a different step: sent {frame.kind} {frame.step} with "
                f"{len(frame.tokens)} tokens, got {back.kind} {back.step} with {len(back.tokens)} from "
                f"{self._ring.peer(self._ring.predecessor)}"
            )

    def _start(
        self,
        seq_id: str,
        params: GenerateParams | EmbedParams,
        faults: tuple[Fault, ...],
        *,
        carried: tuple[Fault, ...] = (),
        ringed: bool = True,
    ) -> None:
        """Add a checked request's sequence. What a deterministic engine can honestly say about each field:

        * an embedding (``EmbedParams``): a unit vector of ``embedding_dim`` numbers from a stable hash of the
          prompt (or the chat, as ``role: content`` lines), in one step, at which ``generate`` faults fire as at a
          first token;
        * ``logprobs``: every word is the only possible one: logprob 0.0, and ``top`` holds just that token;
        * ``echo``: the prompt's text leads the first delta; with ``logprobs``, one entry per word of it, the first
          NaN (nothing precedes it); ``max_tokens`` 0 ends the request with the echo alone;
        * ``json_schema``, tools, ``prompt_ids`` and tokenizer requests: refused (``RequestError``, by ``start``):
          words follow no schema and have no ids;
        * ``prediction``: accepted, never drafted from (its draft counts stay 0); the other sampling parameters are
          checked and change nothing: the text depends on the prompt and ``seed`` alone;
        * ``resume``: the word stream is replayed through the ids sent before the death (each must be the id this
          runner draws, and none may end the generation: else ``RequestError``), their pieces fed silently to the
          stop strings, so what follows is exactly what the uninterrupted generation sent after them; the echo (gone
          with the first delta) is not sent again, ``max_tokens`` still counts every token and ``completion_tokens``
          too. ``resume.draws`` and ``resume.seed`` are not used: the stream depends on the prompt and ``seed``."""
        self._require_loaded()
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id!r} is already running")
        if len(self._seqs) >= self.parallel:
            raise RuntimeError(f"the batch is full ({self.parallel} sequences): a sequence must end first")
        text = prompt_text(params)
        prompt_tokens = len(text.split())
        fit = isinstance(params, EmbedParams) and params.fit_context
        if fit and self.n_ctx is not None and prompt_tokens > self.n_ctx:
            text = " ".join(text.split()[: self.n_ctx])  # Ollama's truncate: the input's first n_ctx tokens
            prompt_tokens = self.n_ctx
        if self.n_ctx is not None and prompt_tokens > self.n_ctx:
            raise RequestError(f"prompt is {prompt_tokens} tokens but n_ctx is {self.n_ctx}: shorten it or raise n_ctx")
        if isinstance(params, EmbedParams):  # its vector comes with its first step
            vector = embedding_vector(text, self.embedding_dim)
            self._seqs[seq_id] = _DebugSequence(
                iter(()), TextStream(()), faults, prompt_tokens, 1, embedding=vector, carried=carried, ringed=ringed
            )
            return
        budget = params.max_tokens if self.n_ctx is None else max(1, min(params.max_tokens, self.n_ctx - prompt_tokens))
        if params.max_tokens == 0:  # echo alone (``check`` allows 0 only with echo)
            budget = 0
        echoed: tuple[TokenLogprob, ...] = ()
        if params.echo and params.logprobs is not None:
            words = text.split()  # the first has no logprob (nothing precedes it), the others are certain
            first = tuple(TokenLogprob(w, math.nan, w.encode()) for w in words[:1])
            echoed = first + tuple(certain(w, params.logprobs) for w in words[1:])
        seq = _DebugSequence(
            token_stream(text, params.seed),
            TextStream(params.stop),
            faults,
            prompt_tokens,
            budget,
            logprobs=params.logprobs,
            carried=carried,
            ringed=ringed,
            echo=text if params.echo else None,
            echoed=echoed,
        )
        if params.resume is not None:
            _replay(seq, params.resume.ids)
        self._seqs[seq_id] = seq

    def _advance(self, seq_id: str, seq: _DebugSequence) -> tuple[Delta, str]:
        """The sequence's next delta, and the token's text piece (before stop handling; "" for an embedding)."""
        if seq.embedding is not None:
            del self._seqs[seq_id]
            return Delta("", 0, "stop", seq.prompt_tokens, 0, embedding=seq.embedding), ""
        lead, seq.echo = seq.echo or "", None
        lead_logprobs, seq.echoed = seq.echoed, ()
        if seq.budget == 0:  # echo with max_tokens 0: the prompt alone
            del self._seqs[seq_id]
            return Delta(lead, 0, "length", seq.prompt_tokens, 0, logprobs=lead_logprobs), ""
        word = next(seq.words)
        seq.done += 1
        piece = _piece(word, seq.done, lead)
        ids = (WORD_IDS[word],)
        logprobs = lead_logprobs + (() if seq.logprobs is None else (certain(piece, seq.logprobs),))
        text, stopped = seq.text.feed(piece)
        text = lead + text
        if stopped or seq.done == seq.budget:
            del self._seqs[seq_id]
            if not stopped:
                text += seq.text.flush()
            final = Delta(
                text,
                1,
                "stop" if stopped else "length",
                seq.prompt_tokens,
                seq.done,
                logprobs=logprobs,
                decode_steps=seq.done,  # one token a step (a resumed one's count the first runner's steps too)
                ids=ids,
            )
            return final, piece
        return Delta(text, 1, logprobs=logprobs, ids=ids), piece


def _piece(word: str, n: int, lead: str | None) -> str:
    """The text piece of a sequence's ``n``-th token (from 1): words follow one another, and an echoed prompt
    (``lead``, sent with the first token), after a space."""
    return " " + word if n > 1 or lead else word


def _replay(seq: _DebugSequence, ids: tuple[int, ...]) -> None:
    """Bring a new sequence to where its generation stood after ``ids`` (``Resume.ids``): draw as many words, each
    checked against the id sent, and feed their pieces to its stop strings (the text they return was delivered
    already; a prefix of a stop string is held back again, as it was). ``RequestError`` where the words differ or
    the ids already ended the generation."""
    if ids and len(ids) >= seq.budget:
        raise RequestError(
            f"cannot resume: {len(ids)} tokens were sent and this generation ends at {seq.budget} (max_tokens, or "
            "what n_ctx leaves of the context): a finished generation is not resumed"
        )
    for i, sent in enumerate(ids):
        word = next(seq.words)
        mine = WORD_IDS[word]
        if mine != sent:
            raise RequestError(
                f"cannot resume: token {i} is {mine} ({word!r}) on this runner but {sent} was sent: the prompt, seed "
                "or engine differ from the first runner's"
            )
        _, stopped = seq.text.feed(_piece(word, i + 1, seq.echo))
        if stopped:
            raise RequestError(
                f"cannot resume: token {i} of the {len(ids)} sent ({word!r}) completes a stop string, so the "
                "generation had ended there: a finished generation is not resumed"
            )
    seq.done = len(ids)
    if ids:  # the echo went with the first delta
        seq.echo, seq.echoed = None, ()


@dataclass(frozen=True)
class _Poison:
    """The ``poison`` option, checked."""

    marker: str
    fault: FaultKind
    after_tokens: int


def _poison(value: Any) -> _Poison | None:
    """The ``poison`` option checked (``EngineLoadError`` says what is wrong), or None when unset."""
    if value is None:
        return None
    example = '{"marker": "POISON", "fault": "segv", "after_tokens": 2}'
    if not isinstance(value, Mapping):
        raise EngineLoadError(f"invalid debug engine option poison: must be an object like {example}, got {value!r}")
    missing = [key for key in POISON_KEYS if key not in value]
    unknown = sorted(str(key) for key in value if key not in POISON_KEYS)
    if missing or unknown:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown key(s) {', '.join(unknown)}"] if unknown else []
        )
        raise EngineLoadError(
            f"invalid debug engine option poison: {'; '.join(problems)}: it takes exactly marker, fault and "
            f"after_tokens, like {example}"
        )
    marker, fault, after = value["marker"], value["fault"], value["after_tokens"]
    if not isinstance(marker, str) or not marker:
        raise EngineLoadError(
            f"invalid debug engine option poison: marker must be a non-empty string (text a prompt holds), got "
            f"{marker!r}"
        )
    if fault not in FAULT_KINDS:
        raise EngineLoadError(
            f"invalid debug engine option poison: fault must be one of {', '.join(FAULT_KINDS)}, got {fault!r}"
        )
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise EngineLoadError(
            f"invalid debug engine option poison: after_tokens must be an integer >= 0 (the tokens produced before "
            f"it fires), got {after!r}"
        )
    return _Poison(marker, fault, after)


def _rank_problem(spec: EngineSpec) -> str | None:
    """What is wrong with a spec's rank information, or None."""
    info = spec.rank
    assert info is not None
    if not 0 <= info.rank < info.world_size:
        return f"rank must be in [0, {info.world_size}), got {info.rank}"
    if len(info.peers) != info.world_size:
        return f"peers must name {info.world_size} addresses (one per rank), got {len(info.peers)}"
    for i, peer in enumerate(info.peers):
        host, sep, port = peer.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"peer {i} must be host:port with a port in [1, 65535], got {peer!r}"
    return None


def _hold_gpu_memory(n: int) -> object:
    """``n`` bytes of CUDA memory, written (so the driver really backs them), as a tensor to keep."""
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        raise EngineLoadError(
            "gpu_bytes needs torch with CUDA in the runner's environment: pip install torch"
        ) from None
    if not torch.cuda.is_available():
        raise EngineLoadError("gpu_bytes needs a CUDA device, and torch sees none (torch.cuda.is_available() is False)")
    tensor = torch.empty(n, dtype=torch.uint8, device="cuda")
    tensor.fill_(1)
    torch.cuda.synchronize()
    return tensor


def _start_helper(kind: str) -> int:
    """Start one helper process of ``kind`` and return its pid: "exec" (a fresh ``sleep``), "fork" (a forked copy of
    the runner that keeps every inherited descriptor, as multiprocessing's fork does), or one that leaves the runner's
    process group, out of reach of a group kill (only the runner's cgroup still holds it): "setsid" (``sleep`` in a
    session of its own), "setpgid" (in a process group of its own) or "double_fork" (a daemon reparented to init)."""
    if kind in ("exec", "setsid", "setpgid"):
        return subprocess.Popen(
            ["sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            start_new_session=kind == "setsid",
            process_group=0 if kind == "setpgid" else None,
        ).pid
    if kind == "double_fork":
        return _daemon()
    pid = os.fork()  # the runner has threads; the child only sleeps, so no lock it inherits is ever taken
    if pid == 0:
        while True:
            signal.pause()
    return pid


def _daemon() -> int:
    """The classic daemon: fork, setsid, fork again and let the middle process exit; the grandchild closes what it
    inherited and execs ``sleep``. Its pid comes back through a pipe (it is nobody's child once the middle exits)."""
    read_end, write_end = os.pipe()
    middle = os.fork()  # only async-signal-safe calls follow in the children: no lock of the threaded runner
    if middle == 0:
        try:
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                os.execvp("sleep", ["sleep", "infinity"])
            os.write(write_end, str(grandchild).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        pid = int(os.read(read_end, 32))
    finally:
        os.close(read_end)
        os.waitpid(middle, 0)
    return pid


def prompt_text(params: GenerateParams | EmbedParams) -> str:
    """The text a request conditions on: the prompt, or the chat rendered as ``role: content`` lines."""
    if params.prompt is not None:
        return params.prompt
    return "\n".join(f"{m.role}: {m.content}" for m in params.messages or ())


def token_stream(text: str, seed: int | None = None) -> Iterator[str]:
    """An endless deterministic word stream for ``text``: a stable hash (not ``hash()``, which is salted per
    process) seeds a private RNG, so the same request yields the same words in every process."""
    digest = hashlib.blake2b(f"{seed}\x00{text}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    while True:
        yield rng.choice(VOCAB)


def embedding_vector(text: str, dim: int) -> tuple[float, ...]:
    """A unit vector of ``dim`` numbers drawn from a stable hash of ``text`` (the same in every process)."""
    digest = hashlib.blake2b(f"embed\x00{text}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    values = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return tuple(v / norm for v in values)


def certain(piece: str, alternatives: int) -> TokenLogprob:
    """The logprobs of a token that was the only possible one: 0.0, and itself as the one alternative."""
    raw = piece.encode()
    return TokenLogprob(piece, 0.0, raw, (TopLogprob(piece, 0.0, raw),) if alternatives >= 1 else ())


def _cancelled(prompt_tokens: int, done: int) -> Delta:
    return Delta("", 0, "cancelled", prompt_tokens, done)
