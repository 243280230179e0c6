"""A model-free engine for rehearsing the supervisor: deterministic tokens and real, injectable faults.

Output is a pseudo-random word sequence seeded by a stable hash of the prompt (and ``params.seed``), so the
same request always produces the same text, in any process, without a model. Faults come from the engine spec
(load, warmup, generate and idle phases; generate faults apply to every request) and from each request's params.

What a deterministic engine can honestly say about the rest of a request:

* ``embed``: an embedding of the prompt (or the chat, rendered as ``role: content`` lines) in one step: a unit
  vector of ``embedding_dim`` numbers drawn from a stable hash of that text, so the same text always gives the same
  vector and different texts (almost surely) different ones. ``generate`` faults fire at that step as at a
  generation's first token, so supervision can be rehearsed for embedding requests too.
* ``logprobs``: every word is the only possible one, so each token's logprob is 0.0 (probability 1) and ``top``
  holds just that token when the request asks for one or more alternatives.
* ``json_schema``: refused (``RequestError``): the word stream cannot follow a schema.
* The other sampling parameters (temperature, penalties, ``logit_bias``, top_k, ...) are checked and otherwise
  change nothing: the text depends on the prompt and ``seed`` alone.

Options (``spec.options``):
  load_steps         number of load progress steps (default 5: progress 0.2, 0.4, ... 1.0)
  load_step_seconds  delay per load step (default 0.001)
  token_seconds      delay per step (default 0): one step advances every running sequence by one token, so a
                     batch of 8 produces 8 tokens per ``token_seconds``, as a real engine's batched decode does
  parallel           sequences served at once (default 1); beyond it requests wait in the runner's queue
  n_ctx              if set, prompts longer than this many (whitespace) tokens fail with RequestError, and a
                     generation ends ("length") when prompt and output fill it, as a real engine's context does
  helpers            number of helper processes to start at the beginning of load (default 0), like an engine's
                     tokenizer or compile workers; they live until close() and prove a runner's group dies with it
  helper_kind        "exec" (a fresh ``sleep`` program, default), "fork" (a forked copy of the runner that keeps every
                     inherited descriptor, as multiprocessing's fork start method does), or one that leaves the
                     runner's process group, out of reach of a group kill (only the runner's cgroup still holds it):
                     "setsid" (``sleep`` in a session of its own), "setpgid" (``sleep`` in a process group of its own)
                     or "double_fork" (a daemon: fork, setsid, fork again, the middle process exits, so ``sleep`` is
                     reparented to init and nothing links it to the runner but its cgroup); a comma-separated list
                     gives helper ``i`` the kind ``i`` modulo its length
  embedding_dim      the dimension of ``embed`` vectors (default 64)
  gpu_bytes          if set, allocate (and touch) this many bytes of GPU memory with ``torch.cuda`` at load and hold
                     them until close(): what a real engine's weights do to a GPU, for checking that GPU memory is
                     reported and given back (needs torch with CUDA; without it the load fails saying so)
  close_seconds      delay in close() (default 0): a runner slow to shut down, so an unload can be raced
  hold_bytes         if set, allocate and touch this many bytes of anonymous memory at load and hold them until
                     close(): a model's weights and KV cache, for rehearsing memory-aware loading and eviction

The engine declares a memory estimate (``estimate_memory``): the runner's own interpreter (``RUNTIME_BYTES``) plus
``hold_bytes``, so the fit check and the scheduler's eviction see a debug model as they see a real one.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import MappingProxyType

from tether.engines.base import (
    Delta,
    EngineLoadError,
    Estimate,
    ProgressCallback,
    RequestError,
    StepResult,
    generate_one,
)
from tether.engines.text import TextStream
from tether.protocol import EngineSpec, Fault, GenerateParams, TokenLogprob, TopLogprob
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


HELPER_KINDS = ("exec", "fork", "setsid", "setpgid", "double_fork")
_NEEDS_ENGINE_CODE = frozenset({"raise", "memory_error", "hang", "slow", "request_error"})  # inside an engine call
MAX_PARALLEL = 256
MAX_EMBEDDING_DIM = 65536
PAGE = 4096
RUNTIME_BYTES = 40 << 20  # a debug runner without hold_bytes, measured: 23 MiB footprint, 38 MiB resident
RUNTIME_HEADROOM = 16 << 20


@dataclass
class _Sequence:
    """One running generation of a batch."""

    words: Iterator[str]
    text: TextStream
    faults: tuple[Fault, ...]
    prompt_tokens: int
    budget: int
    done: int = 0
    logprobs: int | None = None  # alternatives per token, None for no logprobs
    embedding: tuple[float, ...] | None = None  # an embed request's vector: it ends at its first step


class DebugEngine:
    """Deterministic fake engine; see the module docstring for options and fault semantics."""

    name = "debug"
    options = MappingProxyType(
        {
            "load_steps": 5,
            "load_step_seconds": 0.001,
            "token_seconds": 0.0,
            "parallel": 1,
            "n_ctx": None,
            "helpers": 0,
            "helper_kind": "exec",
            "embedding_dim": 64,
            "gpu_bytes": 0,
            "hold_bytes": 0,
            "close_seconds": 0.0,
        }
    )

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
            idle_exceptions = [f.kind for f in spec.faults if f.phase == "idle" and f.kind in _NEEDS_ENGINE_CODE]
            if idle_exceptions:
                raise ValueError(
                    f"fault kinds {idle_exceptions} cannot fire while idle (no engine code runs then); use exit, "
                    "segv, abort, sigkill or oom"
                )
        except (TypeError, ValueError) as exc:
            raise EngineLoadError(f"invalid debug engine option in {options!r}: {exc}") from exc
        self._loaded = False
        self._helper_pids: list[int] = []
        self._gpu: object | None = None  # a torch tensor holding gpu_bytes
        self._held: bytearray | None = None  # hold_bytes, every page written
        self._seqs: dict[str, _Sequence] = {}
        self._calls = 0  # generate() calls, for their sequence ids

    def load(self, progress: ProgressCallback) -> None:
        """Start the helpers, then report ``load_steps`` progress steps; load faults fire at step 0 (``slow`` at
        each step)."""
        for i in range(self.helpers):
            self._helper_pids.append(_start_helper(self._kinds[i % len(self._kinds)]))
        if self.helpers:
            progress(0.0, f"started {self.helpers} helper processes ({self.helper_kind})")
        if self.gpu_bytes:
            self._gpu = _hold_gpu_memory(self.gpu_bytes)
            progress(0.0, f"holding {self.gpu_bytes} bytes of GPU memory")
        if self.hold_bytes:
            self._held = bytearray(self.hold_bytes)
            self._held[::PAGE] = b"\x01" * len(range(0, self.hold_bytes, PAGE))  # calloc's pages are not backed yet
            progress(0.0, f"holding {self.hold_bytes} bytes of memory")
        for step in range(self.load_steps):
            fire(self.spec.faults, "load", step)
            if self.load_step_seconds:
                time.sleep(self.load_step_seconds)
            progress((step + 1) / self.load_steps, f"debug engine load step {step + 1}/{self.load_steps}")
        self._loaded = True

    def warmup(self) -> None:
        """Fire warmup-phase faults, then run a one-token generation like a real engine would."""
        self._require_loaded()
        fire(self.spec.faults, "warmup", 0)
        self._start("warmup", GenerateParams(prompt="warmup", max_tokens=1), faults=())
        while self._seqs:
            self.step()
        for fault in faults_for(self.spec.faults, "idle"):
            timer = threading.Timer(fault.seconds, trigger, args=(fault,))
            timer.daemon = True
            timer.start()

    def generate(self, params: GenerateParams, cancelled: Callable[[], bool]) -> Iterator[Delta]:
        """One request on its own (a bad request raises ``RequestError`` now, not at the first ``next``)."""
        self._calls += 1
        return generate_one(self, params, cancelled, seq_id=f"generate-{self._calls}")

    def start(self, seq_id: str, params: GenerateParams) -> None:
        """Check the request (``RequestError``) and add it to the batch: its first token comes with the next step."""
        self._start(seq_id, params, self.spec.faults + params.faults)

    def step(self) -> list[StepResult]:
        """One token for every sequence: each one's faults fire first (a ``request_error`` ends that sequence
        alone; any other fault is the whole runner's), then one ``token_seconds`` for the batch."""
        results: list[StepResult] = []
        for seq_id, seq in list(self._seqs.items()):
            try:
                fire(seq.faults, "generate", seq.done)
            except RequestError as exc:
                del self._seqs[seq_id]
                results.append((seq_id, exc))
        if self._seqs and self.token_seconds:
            time.sleep(self.token_seconds)
        for seq_id, seq in list(self._seqs.items()):
            results.append((seq_id, self._advance(seq_id, seq)))
        return results

    def drop(self, seq_id: str) -> Delta:
        seq = self._seqs.pop(seq_id, None)
        return _cancelled(seq.prompt_tokens if seq else 0, seq.done if seq else 0)

    def active(self) -> int:
        return len(self._seqs)

    def close(self) -> None:
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

    def _start(self, seq_id: str, params: GenerateParams, faults: tuple[Fault, ...]) -> None:
        self._require_loaded()
        problem = params.check()
        if problem is not None:
            raise RequestError(str(problem))
        if params.json_schema is not None and not params.embed:
            raise RequestError(
                "the debug engine does not do structured output (json_schema): use the llama.cpp engine for it"
            )
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id!r} is already running")
        if len(self._seqs) >= self.parallel:
            raise RuntimeError(f"the batch is full ({self.parallel} sequences): a sequence must end first")
        text = prompt_text(params)
        prompt_tokens = len(text.split())
        if self.n_ctx is not None and prompt_tokens > self.n_ctx:
            raise RequestError(f"prompt is {prompt_tokens} tokens but n_ctx is {self.n_ctx}: shorten it or raise n_ctx")
        budget = params.max_tokens if self.n_ctx is None else max(1, min(params.max_tokens, self.n_ctx - prompt_tokens))
        self._seqs[seq_id] = _Sequence(
            token_stream(text, params.seed),
            TextStream(params.stop),
            faults,
            prompt_tokens,
            budget,
            logprobs=params.logprobs,
            embedding=embedding_vector(text, self.embedding_dim) if params.embed else None,
        )

    def _advance(self, seq_id: str, seq: _Sequence) -> Delta:
        if seq.embedding is not None:
            del self._seqs[seq_id]
            return Delta("", 0, "stop", seq.prompt_tokens, 0, embedding=seq.embedding)
        word = next(seq.words)
        seq.done += 1
        piece = word if seq.done == 1 else " " + word
        logprobs = () if seq.logprobs is None else (certain(piece, seq.logprobs),)
        text, stopped = seq.text.feed(piece)
        if stopped or seq.done == seq.budget:
            del self._seqs[seq_id]
            if not stopped:
                text += seq.text.flush()
            return Delta(text, 1, "stop" if stopped else "length", seq.prompt_tokens, seq.done, logprobs=logprobs)
        return Delta(text, 1, logprobs=logprobs)


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
    """Start one helper process of ``kind`` (see the module docstring) and return its pid."""
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


def prompt_text(params: GenerateParams) -> str:
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
