"""The llama.cpp engine (llama-cpp-python's bindings), serving the built-in SmolLM2 model or any GGUF file.

It generates through llama.cpp's batch API (``batch``), not llama-cpp-python's ``Llama`` generator: up to
``parallel`` sequences decoded together, each request with its own sampling, stop strings, token counts and cancel.
Three choices, each for the supervisor's sake:

* llama-cpp-python's stderr suppression stays off: it points fds 1 and 2 at /dev/null process-wide for the whole
  load, which would lose a crash's native stack (faulthandler writes to fd 2) and every other thread's output.
  llama.cpp's log callback forwards warnings and errors instead (everything with ``verbose``).
* Load progress is real: ``llama_model_params.progress_callback`` is wired through ctypes.
* Chat prompts are rendered here with the GGUF's chat template (or ``chat_template``'s: ``chat_templates``), so a
  prompt's exact token count is known before generating: one too long is a ``RequestError`` with both numbers.

An ``embedding`` instance serves embeddings only, from a context built for pooling. With ranks > 1 the model's
layers are split over the ranks through ggml RPC (``rpc``): rank 0 is this engine, holding the tokenizer, the
sampler, the batch loop, the prompt cache and the first layers. ``deterministic`` loads the batch-invariant build
(``invariant``). The options: ``OPTION_DEFAULTS``, and docs/serving.md for what each does.
"""

from __future__ import annotations

import codecs
import functools
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import msgspec

from tether.engines import reasoning
from tether.engines.base import Delta, EngineLoadError, ProgressCallback, RequestError, StepResult, generate_one
from tether.engines.chat_templates import HOW_TO_SET, ChatTemplate, TemplateError, resolve
from tether.engines.gguf import GGUF_MAGIC, not_gguf
from tether.engines.llamacpp import invariant
from tether.engines.llamacpp.sizing import SIZING
from tether.engines.llamacpp.store import KvStore
from tether.engines.llamacpp.store import identity as store_identity
from tether.engines.llamacpp.tools import LEADING_SPACE, template_messages, tool_grammar
from tether.engines.llamacpp.tools import ROOT as TOOLS_ROOT
from tether.engines.reasoning import Block, ReasoningFormat, Splitter, closes_in_prompt, opens_in_prompt
from tether.errors import InvalidField
from tether.models import DEFAULT_MODEL_NAME, PULL_HINT, DefaultModelMissing, default_model_path, describe_model
from tether.protocol import (
    ChatMessage,
    DetokenizeParams,
    EmbedParams,
    EngineSpec,
    GenerateParams,
    RankInfo,
    TokenizeParams,
    TokenizerAnswer,
    TokenizerWork,
    Work,
)
from tether.units import parse_size

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tether.engines.llamacpp.batch import Batch, Thought
    from tether.engines.llamacpp.estimate import ModelEstimate

INSTALL_HINT = "install tether's llama extra (`make install`, or `pip install '.[llama]'` in the checkout)"
PARALLEL_DEFAULT = 8
PROMPT_CACHE_FALLBACK = 256 << 20  # the RAM store's "auto" budget when the GGUF's header cannot be sized

OPTION_DEFAULTS: dict[str, Any] = {
    "n_ctx": "auto",  # per sequence: the model's trained context (capped, see auto_context), lowered by the fit check
    "parallel": PARALLEL_DEFAULT,
    "n_threads": None,  # computed: usable CPUs, at most 8
    "n_batch": 512,
    "prompt_cache": True,  # reuse a cached prefix from any slot or RAM (faster; a greedy text may then differ, rarely)
    "prompt_cache_ram": "auto",  # bytes of saved sequences kept in RAM (a size: 1G, 512M; 0: none; auto: the KV's)
    "prefill_chunk": 32,  # prompt tokens beside decode rows: bounds what an arrival costs the running streams
    "seed": None,  # for unseeded requests: None draws one per request (as OpenAI, llama-server do); an int fixes it
    "n_gpu_layers": "auto",  # layers on NVIDIA GPUs: "auto" = as many as NVML's free VRAM holds (the fit check's)
    "gpu": None,  # GPU indexes to use (None: every GPU NVML lists)
    "gpu_memory_limit": None,  # VRAM per GPU the "auto" split may plan into (a size; None: free less a margin)
    "tensor_split": None,  # each GPU's relative share of the layers (None: the fit check's, by free VRAM)
    "repeat_penalty": 1.0,  # neutral, as in OpenAI's API; llama-cpp-python's 1.1 derails small models
    "verbose": False,
    "embedding": False,  # serve embeddings (embed requests) instead of generations, from a context built to pool
    "layer_split": None,  # ranks > 1: each rank's relative share of the layers (None: by placement, else equal)
    "rpc_timeout": 10.0,  # ranks > 1: seconds a peer may stay silent mid-step before rank 0 gives it up
    "adaptive_threads": True,  # one thread while other processes hold the cores (``threads``)
    "kv_unified": False,  # one cell pool for every sequence: same memory, slower (each attends over the whole pool)
    "swa_full": False,  # sliding-window layers keep every position (more KV; prefixes reusable past the window)
    "chat_template": None,  # a built-in template's name or a Jinja file (``chat_templates``); None: the GGUF's own
    "deterministic": False,  # the batch-invariant build: greedy texts independent of load (``invariant``)
    "speculation": False,  # verify draft tokens where the measured cost says it pays (``speculation``): see the docs
    "draft_max": 32,  # the most draft tokens a sequence verifies in one step
}
UINT32_MAX = (1 << 32) - 1  # llama.cpp's context and batch sizes are uint32
MAX_PARALLEL = 256  # llama.cpp's LLAMA_MAX_SEQ
PROGRESS_STEP = 0.05  # report load progress in steps of at least 5% so the channel is not flooded
GGML_LOG_WARN, GGML_LOG_ERROR, GGML_LOG_CONT = 3, 4, 5  # enum ggml_log_level (NONE 0, DEBUG 1, INFO 2)


def cpu_quota() -> float | None:
    """CPUs' worth of time this process's cgroup may use (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), None: no limit."""
    for quota_file, period_file in (
        ("/sys/fs/cgroup/cpu.max", None),
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    ):
        try:
            text = Path(quota_file).read_text().split()
            quota, period = text[0], (text[1] if period_file is None else Path(period_file).read_text().strip())
            if quota in ("max", "-1"):
                return None
            return int(quota) / int(period)
        except (OSError, ValueError, IndexError):
            continue
    return None


def default_threads() -> int:
    """CPUs this process may run on (affinity, cpusets and a cgroup CPU quota honoured), capped at 8: beyond that,
    token generation is memory-bound and extra threads only contend."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        usable = min(usable, max(1, int(quota)))
    return max(1, min(usable, 8))


class LlamaCppEngine:
    """llama.cpp behind the tether batch-engine protocol. Driven by one thread; see the module docstring."""

    name = "llama.cpp"
    options = MappingProxyType(OPTION_DEFAULTS)
    distributed = True  # ranks > 1 split the model's layers over the ranks (ggml RPC), see the module docstring
    splits_model = True  # each rank holds a share of the model, not a copy: the fit counts each rank's share
    resumes = True  # deltas carry their token ids; a ``Resume`` goes on from the next token (``Batch._replay``)
    sizing = SIZING  # n_gpu_layers, n_ctx and the prompt cache's RAM store "auto": sized by the fit check per node

    @staticmethod
    def estimate_memory(spec: EngineSpec) -> ModelEstimate:
        """Weights + KV cache (parallel x n_ctx) + runtime + headroom, read from the GGUF's header. Asked when an
        instance is created: a deterministic one without the build it loads is refused here (``InvalidField``)."""
        from tether.engines.llamacpp.estimate import estimate_for_spec

        options = {**OPTION_DEFAULTS, **spec.options}
        why = invariant.missing() if options["deterministic"] else None
        if why is not None:
            raise InvalidField("options", why)
        return estimate_for_spec(spec, options)

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        unknown = sorted(set(spec.options) - set(OPTION_DEFAULTS))
        if unknown:
            raise EngineLoadError(
                f"unknown llama.cpp engine option(s) {', '.join(unknown)}: "
                f"valid options are {', '.join(OPTION_DEFAULTS)}"
            )
        options = {**OPTION_DEFAULTS, **spec.options}
        from tether.engines.llamacpp.estimate import AUTO_CTX_CAP, gpu_indexes, prompt_cache_budget

        try:
            self.n_ctx_auto = options["n_ctx"] == "auto"  # resolved at load from the model (``auto_context``)
            self.n_ctx = AUTO_CTX_CAP if self.n_ctx_auto else int(options["n_ctx"])
            self.parallel = int(options["parallel"])
            self.n_threads = int(options["n_threads"]) if options["n_threads"] else default_threads()
            self.n_batch = int(options["n_batch"])
            self.prefill_chunk = int(options["prefill_chunk"])
            self.prompt_cache = bool(options["prompt_cache"])
            self.prompt_cache_ram = prompt_cache_budget(options)  # None: the KV cache's size, known at load
            self.seed: int | None = None if options["seed"] is None else int(options["seed"])
            # "auto" that reaches the runner unresolved (no fit check ran, or no GPU): the CPU
            self.n_gpu_layers = 0 if options["n_gpu_layers"] == "auto" else int(options["n_gpu_layers"])
            self.gpu = None if options["gpu"] is None else gpu_indexes(options["gpu"])
            self.tensor_split = None if options["tensor_split"] is None else [float(v) for v in options["tensor_split"]]
            if options["gpu_memory_limit"] is not None:
                parse_size(options["gpu_memory_limit"])  # the fit check's; refused here when it is not a size
            self.repeat_penalty = float(options["repeat_penalty"])
            self.verbose = bool(options["verbose"])
            self.embedding = bool(options["embedding"])
            self.adaptive_threads = bool(options["adaptive_threads"])
            self.kv_unified = bool(options["kv_unified"])
            self.deterministic = bool(options["deterministic"])
            self.swa_full = bool(options["swa_full"]) or self.deterministic  # see "Deterministic decoding" above
            self.speculation = bool(options["speculation"])
            self.draft_max = int(options["draft_max"])
            chosen = options["chat_template"]
            self.template: ChatTemplate | None = None if chosen is None else resolve(chosen)
        except TemplateError as exc:
            raise EngineLoadError(str(exc)) from exc
        except (TypeError, ValueError, OverflowError) as exc:
            raise EngineLoadError(f"invalid llama.cpp engine option in {spec.options!r}: {exc}") from exc
        if not (
            16 <= self.n_ctx <= UINT32_MAX // max(self.parallel, 1)
            and 1 <= self.parallel <= MAX_PARALLEL
            and 1 <= self.n_threads <= 4096
            and 1 <= self.n_batch <= UINT32_MAX
            and 1 <= self.prefill_chunk <= UINT32_MAX
            and 0 <= self.draft_max <= 256
            and self.n_gpu_layers >= 0
            and (self.tensor_split is None or (0 < len(self.tensor_split) <= 16 and min(self.tensor_split) >= 0))
        ):
            raise EngineLoadError(
                f"n_ctx must be in [16, {UINT32_MAX} / parallel], parallel in [1, {MAX_PARALLEL}], n_threads in "
                f"[1, 4096], n_batch and prefill_chunk in [1, {UINT32_MAX}], draft_max in [0, 256] (got "
                f"n_ctx={self.n_ctx}, parallel={self.parallel}, n_threads={self.n_threads}, n_batch={self.n_batch}, "
                f'prefill_chunk={self.prefill_chunk}, draft_max={self.draft_max}); n_gpu_layers >= 0 or "auto", '
                f"tensor_split up to 16 shares >= 0 (got {self.n_gpu_layers}, {self.tensor_split})"
            )
        if self.deterministic and (self.kv_unified or self.n_gpu_layers):
            raise EngineLoadError(
                "deterministic decoding needs each sequence's cells in a stream of its own (kv_unified false: a "
                "shared pool places them by what else runs) and the CPU (n_gpu_layers 0: only ggml's CPU kernels are "
                f"made batch-invariant here); got kv_unified={self.kv_unified}, n_gpu_layers={self.n_gpu_layers}"
            )
        if not self.repeat_penalty > 0:  # also refuses NaN
            raise EngineLoadError(f"repeat_penalty must be > 0 (1.0 is neutral), got {self.repeat_penalty}")
        self.layer_split, self.rpc_timeout = _split_options(options, spec)
        self._server: Any = None  # a rank above 0: its RPC server (``rpc.Server``)
        self.model_path: Path | None = None
        self._model: Any = None  # llama-cpp-python's LlamaModel: weights, vocabulary, tokenizer, metadata
        self._batch: Batch | None = None
        self._chat_formatter: Any = None
        self._n_vocab = 0  # known once loaded
        self._calls = 0
        self._answers: list[StepResult] = []  # tokenizer requests, answered at start, returned by the next step
        self._facts: TokenizerAnswer | None = None  # the tokenizer's facts, read once
        self._dropped: dict[str, int] = {}  # sequence id -> turns a fitted chat left out (until its final delta)
        self._reasoning: ReasoningFormat | None = None  # the template's, when its model thinks (``reasoning``)
        self._splitters: dict[str, Splitter] = {}  # sequence id -> its thinking kept apart from its answer
        self._block: Block = None  # how the prompt ``_render_chat`` wrote last leaves its thinking block

    # -------------------------------------------------------------------------------------------------------

    def load(self, progress: ProgressCallback) -> None:
        """Open the GGUF and build the model and its context, reporting llama.cpp's real tensor-loading progress (a
        rank above 0 starts its RPC server instead: rank 0 sends it its layers)."""
        rank = self.spec.rank
        if self.deterministic:  # before llama-cpp-python is imported: it loads the library it names
            try:
                invariant.activate()
            except invariant.InvariantBuildMissing as exc:
                raise EngineLoadError(str(exc)) from exc
        if rank is not None:
            os.environ["GGML_NO_BACKTRACE"] = "1"  # a peer's death aborts rank 0: in 0.06 s, not 1.3 s of gdb
        if rank is not None and rank.rank > 0:
            self._serve(rank, progress)
            return
        path = self._resolve_model_path()
        self._choose_gpus()
        try:
            import llama_cpp
            import llama_cpp._internals as internals
            import llama_cpp.llama_cpp as lib
        except ImportError as exc:
            raise EngineLoadError(f"llama-cpp-python is not installed ({exc}): {INSTALL_HINT}") from exc
        from tether.engines.llamacpp.batch import Batch

        described = describe_model(path)
        progress(0.0, f"opening {described}")
        _install_log_filter(lib, self.verbose)
        lib.llama_backend_init()
        reporter = _ProgressReporter(progress, described)
        callback = lib.llama_progress_callback(reporter)  # referenced until the load returns
        params = lib.llama_model_default_params()
        params.n_gpu_layers = self.n_gpu_layers
        if self.tensor_split is not None and rank is None:
            import ctypes

            self._tensor_split = (ctypes.c_float * 16)(*self.tensor_split)  # referenced while llama.cpp may read it
            params.tensor_split = ctypes.cast(self._tensor_split, ctypes.POINTER(ctypes.c_float))
        params.use_extra_bufts = not self.deterministic  # repacked weights: a GEMM for each 4 rows, a GEMV for the rest
        params.progress_callback = callback
        params.progress_callback_user_data = None
        split = self._join_peers(lib, params, path, progress) if rank is not None else None
        started = time.monotonic()
        try:
            model = internals.LlamaModel(path_model=str(path), params=params, verbose=True)  # see the docstring
        except ValueError as exc:  # llama-cpp-python reports load failures as ValueError
            raise EngineLoadError(
                f"llama.cpp could not load {described} from {path}: {exc}. Check that it is a complete GGUF "
                "file this llama.cpp version supports (the stderr tail has llama.cpp's reason)"
            ) from exc
        if reporter.error is not None:
            raise reporter.error
        self._model = model
        self._n_vocab = int(lib.llama_vocab_n_tokens(model.vocab))
        if self.n_ctx_auto:
            from tether.engines.llamacpp.estimate import auto_context

            self.n_ctx = auto_context(int(lib.llama_model_n_ctx_train(model.model)), self.embedding)
        self._batch = Batch(
            lib,
            model.model,
            model.vocab,
            parallel=self.parallel,
            n_ctx=self.n_ctx,
            n_batch=min(self.n_batch, self.n_ctx * self.parallel),
            n_threads=self.n_threads,
            prefill_chunk=self.prefill_chunk,
            prompt_cache=self.prompt_cache,
            prompt_cache_ram=self._prompt_cache_budget(),
            embedding=self.embedding,
            pooling=_pooling(lib, model) if self.embedding else None,
            adaptive_threads=self.adaptive_threads,
            unified=self.kv_unified,
            swa_full=self.swa_full,
            invariant=self.deterministic,
            speculation=self.speculation,
            draft_max=self.draft_max,
            store=self._store(),
        )
        self._chat_formatter = _chat_formatter(llama_cpp, model, self.template)
        self._reasoning = reasoning.detect(self._template_text())
        where = ""
        if rank is not None and split is not None:
            from tether.engines.llamacpp import rpc

            rpc.bound_peer_sockets(list(rank.peers[1:]), self.rpc_timeout)
            where = f", {split}"
        progress(1.0, f"loaded {described} in {time.monotonic() - started:.1f} s{where}")

    def _serve(self, rank: RankInfo, progress: ProgressCallback) -> None:
        """A rank above 0: serve this CPU as an RPC device on the rank's own address until the process ends."""
        from tether.engines.llamacpp import rpc

        who = f"rank {rank.rank} of {rank.world_size}"
        host, port = rank.address()
        progress(0.0, f"{who}: starting ggml's RPC server on {host}:{port}")
        try:
            server = rpc.Server(host, port, self.n_threads, who)
        except ImportError as exc:
            raise EngineLoadError(f"llama-cpp-python is not installed ({exc}): {INSTALL_HINT}") from exc
        server.start()
        self._server = server
        progress(1.0, f"{who}: serving its share of rank 0's layers on {host}:{port} (ggml RPC)")

    def _join_peers(self, lib: Any, params: Any, path: Path, progress: ProgressCallback) -> str:
        """Rank 0: wait for every peer's server, register them, and set the layer split on ``params``; returns the
        split in words."""
        import ctypes

        from tether.engines.gguf import GgufError
        from tether.engines.llamacpp import rpc
        from tether.engines.llamacpp.estimate import block_count, layer_plan, layers_words, split_shares

        rank = self.spec.rank
        assert rank is not None
        try:
            n_layers = block_count(path)
            plan = layer_plan(n_layers, split_shares(rank, self.layer_split))
        except (GgufError, ValueError) as exc:
            raise EngineLoadError(f"cannot split {describe_model(path)} over {rank.world_size} ranks: {exc}") from exc
        peers = list(rank.peers[1:])
        progress(0.0, f"waiting for the RPC servers of ranks 1-{rank.world_size - 1} ({', '.join(peers)})")
        rpc.wait_listening(peers, self.rpc_timeout * 3, f"rank 0 of {rank.world_size}")
        rpc.add_servers(peers)
        split = (ctypes.c_float * 16)(*plan.tensor_split)
        self._tensor_split = split  # referenced while llama.cpp may read it
        params.n_gpu_layers = plan.n_gpu_layers
        params.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
        return "; ".join(f"rank {r} holds {layers_words(held, n_layers)}" for r, held in enumerate(plan.layers))

    def _choose_gpus(self) -> None:
        """The GPUs this runner's llama.cpp sees, set before it is imported (CUDA reads them once): none for 0
        layers (else a CUDA build still makes a context, ~0.5 GiB of VRAM, and copies large batches' weights to
        the GPU), the chosen ones in NVML's order otherwise. A runner is a process of its own, so this is its
        environment alone."""
        if self.n_gpu_layers == 0:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
            return
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # NVML's numbering, which the fit's tensor_split follows
        if self.gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu)

    def _store(self) -> KvStore | None:
        """Where the prompt cache's saved sequences outlive this runner (``EngineSpec.store``), if the worker gave a
        place and there is a prompt cache to keep; a store that cannot be made is logged and done without."""
        if self.spec.store is None or not self.prompt_cache or self.embedding or self.spec.rank is not None:
            return None
        try:
            return KvStore(Path(self.spec.store), store_identity(self.spec))
        except OSError as exc:
            log.warning("no prompt store at %s (%s): a resumed prompt is prefilled again", self.spec.store, exc)
            return None

    def _prompt_cache_budget(self) -> int:
        """The RAM store's budget in bytes: the option's, or (auto) the KV cache's size from the GGUF's header."""
        if self.prompt_cache_ram is not None:
            return self.prompt_cache_ram
        from tether.engines.gguf import GgufError
        from tether.engines.llamacpp.estimate import estimate_for_spec

        try:
            return estimate_for_spec(self.spec, {**OPTION_DEFAULTS, **self.spec.options}).prompt_cache_ram
        except GgufError:  # llama.cpp loaded what the header reader cannot size: keep a modest store
            return PROMPT_CACHE_FALLBACK

    def warmup(self) -> None:
        """Generate one token (or embed one word) so weights are paged in and buffers allocated before the first
        request (a rank above 0 has nothing to warm: rank 0's warm-up runs its layers)."""
        if self._server is not None:
            return
        hello = EmbedParams(prompt="Hello") if self.embedding else GenerateParams(prompt="Hello", max_tokens=1)
        for _ in self.generate(hello, lambda: False):
            pass
        batch = self._require_batch()
        batch.measure_costs()  # speculation's cost curve: this machine's, at this context's shape
        batch.clear()

    def generate(self, params: Work, cancelled: Callable[[], bool]) -> Iterator[Delta]:
        """One request on its own (a bad request raises ``RequestError`` now, not at the first ``next``)."""
        self._calls += 1
        return generate_one(self, params, cancelled, seq_id=f"generate-{self._calls}")

    def start(self, seq_id: str, params: Work) -> None:
        """Check the request (``RequestError``), then answer it by its kind: a tokenizer question at once, an
        embedding or a generation in the batch (each only by an instance started for it)."""
        batch = self._require_batch()
        problem = params.check()
        if problem is not None:
            raise RequestError(str(problem))
        if isinstance(params, TokenizerWork):  # a question to the tokenizer: any instance answers it, at once
            self._answers.append((seq_id, self._tokenizer_answer(params)))
        elif isinstance(params, EmbedParams):
            if not self.embedding:
                raise RequestError(
                    "this llama.cpp instance generates text and does not compute embeddings: start an instance "
                    "with option embedding: true for embedding requests"
                )
            self._start_embedding(batch, seq_id, params)
        elif self.embedding:
            raise RequestError(
                "this llama.cpp instance serves embeddings only (it was started with the embedding option): send "
                "generations to an instance started without the embedding option"
            )
        else:
            self._start_generation(batch, seq_id, params)

    def _start_generation(self, batch: Batch, seq_id: str, params: GenerateParams) -> None:
        """Check a generation's sampling and prompt length (``RequestError``), then add it to the batch."""
        from tether.engines.llamacpp.batch import Sampling

        grammar, root = self._check_sampling(params)  # before the chat is rendered: the cheap refusals first
        stop = list(params.stop)
        window = min(params.context or self.n_ctx, self.n_ctx)  # a request's own context (num_ctx) within n_ctx
        thought: Thought | None = None
        if params.messages is not None:
            prompt_tokens, template_stop = self._fitted_chat(seq_id, params, window)
            stop += template_stop
            if grammar is not None and self._reasoning is not None and self._block != "closed":
                room = min(params.max_tokens, window - len(prompt_tokens))
                prompt_tokens, thought = self._think_first(prompt_tokens, self._reasoning, room)
                grammar, root = answer_grammar(params, after_thought=True)  # (its pieces cached: built above)
        elif params.prompt_ids is not None:
            prompt_tokens = self._known_ids(params.prompt_ids, "prompt")
        else:
            prompt_tokens = self._tokenize(params.prompt or "")
        echo: str | None = None
        if params.echo:  # the prompt as sent: its text, or its token ids written out
            echo = params.prompt if params.prompt is not None else self._detokenize(prompt_tokens)
        if len(prompt_tokens) >= window:
            if window < self.n_ctx:
                raise RequestError(
                    f"prompt is {len(prompt_tokens)} tokens but the request's context (num_ctx) is {window}: shorten "
                    f"it or raise num_ctx (this instance's n_ctx is {self.n_ctx})"
                )
            raise RequestError(
                f"prompt is {len(prompt_tokens)} tokens but a sequence's context (n_ctx) is {self.n_ctx}: shorten "
                "it or raise n_ctx"
            )
        max_tokens = min(params.max_tokens, window - len(prompt_tokens)) if window < self.n_ctx else params.max_tokens
        resume = params.resume
        if resume is not None and len(prompt_tokens) + len(resume.ids) >= window:
            raise RequestError(
                f"cannot resume: the prompt ({len(prompt_tokens)} tokens) and the {len(resume.ids)} tokens generated "
                f"before the runner died do not fit the context ({window}) with room for the next"
            )
        seed = params.seed if params.seed is not None else self.seed
        if seed is None and resume is not None:  # the draw the first runner made
            seed = resume.seed
        if seed is None:  # a fresh draw: the same question asked again (a regenerate button) gets a new answer
            seed = random.getrandbits(32)
        sampling = Sampling(
            params.temperature,
            params.top_p,
            seed,
            repeat_penalty=params.repeat_penalty if params.repeat_penalty is not None else self.repeat_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            top_k=params.top_k,
            min_p=params.min_p,
            logit_bias=params.logit_bias,
            grammar=grammar,
            logprobs=params.logprobs,
            grammar_root=root,
            ends_on_json=params.tool_syntax is None,
            special_pieces=params.tool_syntax is not None or thought is not None,
            thought=thought,
        )
        predicted = None
        if params.prediction:  # its tokens as the tokenizer splits the text alone (the output may split it otherwise)
            predicted = list(self._model.tokenize(params.prediction.encode("utf-8"), add_bos=False, special=False))
        replayed = batch.start(
            seq_id,
            prompt_tokens,
            max_tokens,
            stop,
            sampling,
            echo=echo,
            prediction=predicted,
            resumed=resume.ids if resume is not None else (),
            draws=resume.draws if resume is not None else 0,
        )
        if self._reasoning is not None and params.messages is not None and (grammar is None or thought is not None):
            # a grammar from the first token (thinking off) holds the whole answer: there is no thinking to keep apart
            splitter = Splitter(self._reasoning, inside=thought is not None or self._block == "open")
            splitter.feed(replayed)  # a resumed sequence's text so far, sent already: where the split stood
            self._splitters[seq_id] = splitter

    def _think_first(self, prompt: list[int], fmt: ReasoningFormat, room: int) -> tuple[list[int], Thought]:
        """A structured answer from a model that thinks: the prompt with its thinking block open (opened here where
        the template leaves that to the model, so the answer's start is known), and the ``Thought`` the grammar
        waits for, which may take half the ``room`` the answer has (tokens; the answer keeps the rest)."""
        from tether.engines.llamacpp.batch import Thought

        if self._block != "open":
            opening = self._model.tokenize(f"{fmt.open}\n".encode(), add_bos=False, special=True)
            prompt = [*prompt, *opening]
        close = tuple(self._model.tokenize(fmt.close.encode(), add_bos=False, special=True))
        return prompt, Thought(fmt.close.encode(), close, max(1, room // 2))

    def _check_sampling(self, params: GenerateParams) -> tuple[str | None, str]:
        """Refuse token ids outside the vocabulary; return the answer's grammar and its start rule
        (``answer_grammar``)."""
        for token, _ in params.logit_bias:
            if token >= self._n_vocab:
                raise RequestError(
                    f"logit_bias names token {token}, but {describe_model(self.model_path or '?')} has "
                    f"{self._n_vocab} tokens (n_vocab; ids 0 to {self._n_vocab - 1})"
                )
        return answer_grammar(params)

    def _start_embedding(self, batch: Batch, seq_id: str, params: EmbedParams) -> None:
        if params.messages is not None:
            prompt_tokens, _ = self._render_chat(params)
        else:
            prompt_tokens = self._tokenize(params.prompt or "")
        if len(prompt_tokens) > self.n_ctx:
            if params.fit_context:  # Ollama's truncate: the input's start, as much as the context holds
                prompt_tokens = prompt_tokens[: self.n_ctx]
            else:
                raise RequestError(
                    f"the input is {len(prompt_tokens)} tokens but this embedding instance's context (n_ctx) is "
                    f"{self.n_ctx}: shorten it, start the instance with a larger n_ctx, or (Ollama's /api/embed) "
                    f"send truncate: true to embed its first {self.n_ctx} tokens"
                )
        batch.start_embedding(seq_id, prompt_tokens)

    def _tokenize(self, text: str) -> list[int]:
        tokens: list[int] = self._model.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        return tokens or [self._model.token_bos()]  # an empty prompt on a model without BOS-adding: BOS alone

    def _known_ids(self, ids: tuple[int, ...], field: str) -> list[int]:
        """``ids`` when every one is in the vocabulary, else ``RequestError`` naming the first that is not."""
        for i, token in enumerate(ids):
            if token >= self._n_vocab:
                raise RequestError(
                    f"{field} names token {token} (at index {i}), but {describe_model(self.model_path or '?')} has "
                    f"{self._n_vocab} tokens (n_vocab; ids 0 to {self._n_vocab - 1}): send ids this model's "
                    "tokenizer gave (POST /tokenize)"
                )
        return list(ids)

    def _detokenize(self, ids: list[int]) -> str:
        """Token ids as text, special tokens written out (as llama-server's /detokenize); an unfinished character
        at the end is dropped, one in the middle becomes U+FFFD."""
        batch = self._require_batch()
        raw = b"".join(batch.piece(token, special=True) for token in ids)
        return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw)

    def _tokenizer_answer(self, params: TokenizerWork) -> Delta:
        """A tokenizer request's final delta: the prompt's (or the rendered chat's) token ids and pieces, or the
        token ids' text; with the tokenizer's facts either way."""
        facts = self._tokenizer_facts()
        if isinstance(params, DetokenizeParams):
            ids = self._known_ids(params.ids, "tokens")
            return Delta(self._detokenize(ids), 0, "stop", len(ids), 0, tokenized=facts)
        if params.messages is not None:
            ids, _ = self._render_chat(params)
        else:
            text = (params.prompt or "").encode("utf-8")
            ids = list(self._model.tokenize(text, add_bos=params.add_special, special=True))
        batch = self._require_batch()
        pieces = tuple(batch.piece(token, special=True) for token in ids)
        answer = msgspec.structs.replace(facts, ids=tuple(ids), pieces=pieces)
        return Delta("", 0, "stop", len(ids), 0, tokenized=answer)

    def _tokenizer_facts(self) -> TokenizerAnswer:
        """What a remote tokenizer needs to know of this model's (read once): its special tokens, its context, its
        chat template."""
        if self._facts is None:
            model, batch = self._model, self._require_batch()

            def special(token: int) -> tuple[str | None, int | None]:
                if token < 0:
                    return None, None
                return batch.piece(token, special=True).decode("utf-8", errors="replace"), token

            bos, bos_id = special(int(model.token_bos()))
            eos, eos_id = special(int(model.token_eos()))
            metadata = model.metadata()
            self._facts = TokenizerAnswer(
                n_ctx=self.n_ctx,
                n_vocab=self._n_vocab,
                bos_token=bos,
                bos_id=bos_id,
                eos_token=eos,
                eos_id=eos_id,
                add_bos=bool(model.add_bos_token()),
                chat_template=self._template_text(),
                kind=str(metadata.get("tokenizer.ggml.model", "")),
            )
        return self._facts

    def _template_text(self) -> str | None:
        """The chat template in use: the ``chat_template`` option's, else the GGUF's own (None: neither)."""
        if self.template is not None:
            return self.template.text
        own = self._model.metadata().get("tokenizer.chat_template") if self._model is not None else None
        return own or None

    def step(self) -> list[StepResult]:
        answers, self._answers = self._answers, []  # tokenizer requests answered since the last step
        results = answers + self._require_batch().step()
        if self._splitters:  # a reasoning model's thinking kept apart from its answer
            for i, (seq_id, delta) in enumerate(results):
                splitter = self._splitters.get(seq_id)
                if splitter is None or not isinstance(delta, Delta) or delta.prefilled:
                    continue
                thought, said = splitter.feed(delta.text)
                if delta.finish_reason is not None:
                    rest = splitter.flush()
                    thought, said = thought + rest[0], said + rest[1]
                    del self._splitters[seq_id]
                results[i] = (seq_id, msgspec.structs.replace(delta, text=said, reasoning=thought))
        if self._dropped:  # say on a fitted chat's final delta how many turns were left out
            for i, (seq_id, delta) in enumerate(results):
                if isinstance(delta, Delta) and delta.finish_reason is not None and seq_id in self._dropped:
                    results[i] = (seq_id, msgspec.structs.replace(delta, dropped_messages=self._dropped.pop(seq_id)))
        return results

    def drop(self, seq_id: str) -> Delta:
        self._dropped.pop(seq_id, None)
        self._splitters.pop(seq_id, None)
        self._answers = [answer for answer in self._answers if answer[0] != seq_id]
        return self._require_batch().cancel(seq_id)

    def active(self) -> int:
        return self._require_batch().active() + len(self._answers)

    def follow(self) -> None:
        """A rank above 0, on the runner's follow thread: serve rank 0 until the process ends; ggml's server returns
        only when it fails, which raises here (and ends the runner)."""
        if self._server is not None:
            self._server.wait()

    def close(self) -> None:
        """Free the context and the model now rather than whenever the garbage collector runs (a rank's RPC server
        has no stop: it ends with the process)."""
        batch, model, self._batch, self._model, self._chat_formatter = self._batch, self._model, None, None, None
        if batch is not None:
            batch.close()
        if model is not None:
            model.close()

    # -------------------------------------------------------------------------------------------------------

    def _resolve_model_path(self) -> Path:
        if self.spec.model is None:
            try:
                path = default_model_path()
            except DefaultModelMissing as exc:
                raise EngineLoadError(str(exc)) from exc
        else:
            path = Path(self.spec.model).expanduser()
        if not path.is_file():
            raise EngineLoadError(
                f"model file {path} does not exist: pass the path of a GGUF file, or omit the model to use "
                f"the built-in {DEFAULT_MODEL_NAME} ({PULL_HINT} if it is missing)"
            )
        try:
            with path.open("rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise EngineLoadError(f"cannot read model file {path}: {exc}") from exc
        if magic != GGUF_MAGIC:
            raise EngineLoadError(str(not_gguf(path, magic)))
        self.model_path = path
        return path

    def _require_batch(self) -> Batch:
        if self._batch is None:
            raise RuntimeError("llama.cpp engine used before load() (or after close())")
        return self._batch

    def _fitted_chat(self, seq_id: str, params: GenerateParams, window: int) -> tuple[list[int], list[str]]:
        """The chat's tokens; with ``fit_context`` (Ollama's routes), a chat too long for its context (``window``
        tokens) keeps its system messages and its latest turns, as Ollama does: the fewest oldest turns are left out
        that leave room for ``min(max_tokens, window / 4)`` tokens of answer (the latest message always stays: alone
        too long, it is the usual refusal with the numbers)."""
        messages = list(params.messages or ())
        tokens, stop = self._render_chat(params, messages)
        room = window - min(params.max_tokens, window // 4)
        if not params.fit_context or len(tokens) <= room:
            return tokens, stop
        droppable = [i for i, m in enumerate(messages[:-1]) if m.role != "system"]

        def without(k: int) -> list[ChatMessage]:
            gone = set(droppable[:k])
            while k < len(droppable) and messages[droppable[k]].role not in ("user",):
                gone.add(droppable[k])  # a kept history starts with a user turn, as templates expect
                k += 1
            return [m for i, m in enumerate(messages) if i not in gone]

        lo, hi = 1, len(droppable)  # the fewest oldest turns to leave out: fits(k) is monotonic in k
        best: tuple[list[int], list[str], int] | None = None
        while lo <= hi:
            mid = (lo + hi) // 2
            kept = without(mid)
            fitted, fitted_stop = self._render_chat(params, kept)
            if len(fitted) <= room:
                best, hi = (fitted, fitted_stop, len(messages) - len(kept)), mid - 1
            else:
                lo = mid + 1
        if best is None:  # the system messages and the latest alone are too long: refused as any long prompt
            return self._render_chat(params, without(len(droppable)))
        self._dropped[seq_id] = best[2]
        return best[0], best[1]

    def _render_chat(
        self, params: GenerateParams | EmbedParams | TokenizeParams, chat: list[ChatMessage] | None = None
    ) -> tuple[list[int], list[str]]:
        """Render the chat (``chat``, else the request's messages) with the model's template and tokenize it,
        exactly as llama-cpp-python's chat handler does, so the token count is the real one. With a tool syntax the
        template gets the tools (and renders earlier calls and results itself); only a generation has tools, a
        thinking switch or more template variables."""
        messages = template_messages(params.messages or () if chat is None else chat)
        syntax, kwargs, thinking = (
            (params.tool_syntax, params.template_kwargs, params.thinking)
            if isinstance(params, GenerateParams)
            else (None, None, None)
        )
        tools = json.loads(syntax.tools) if syntax is not None else None
        if self._chat_formatter is None:
            raise RequestError(
                f"{describe_model(self.model_path or '?')} has no chat template (a base model's GGUF carries none), "
                f"so a chat cannot be written as the model reads one: {HOW_TO_SET}. Or send a raw 'prompt' instead"
            )
        variables = json.loads(kwargs) if kwargs is not None else {}
        if thinking is not None:
            variables[reasoning.SWITCH] = thinking
        try:
            result = self._chat_formatter(messages=messages, tools=tools, **variables)
        except Exception as exc:  # template errors (e.g. unsupported roles) are the request's fault
            raise RequestError(f"the model's chat template rejected these messages: {exc}") from exc
        tokens = self._model.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True)
        self._block = None
        if self._reasoning is not None and opens_in_prompt(result.prompt, self._reasoning):
            self._block = "open"
        elif self._reasoning is not None and closes_in_prompt(result.prompt, self._reasoning):
            self._block = "closed"
        stop = result.stop
        template_stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        if self.template is not None:
            template_stop += [s for s in self.template.stop if s not in template_stop]
        return tokens, template_stop


def _split_options(options: dict[str, Any], spec: EngineSpec) -> tuple[tuple[float, ...] | None, float]:
    """The checked ``layer_split`` and ``rpc_timeout`` options (``EngineLoadError`` saying what is wrong)."""
    raw, timeout = options["layer_split"], options["rpc_timeout"]
    split: tuple[float, ...] | None = None
    if raw is not None:
        if isinstance(raw, str | bytes) or not hasattr(raw, "__len__"):
            raise EngineLoadError(f"layer_split must be a list of relative shares, one per rank ([3, 1]), got {raw!r}")
        try:
            split = tuple(float(v) for v in raw)
        except (TypeError, ValueError) as exc:
            raise EngineLoadError(f"layer_split must be a list of numbers, got {raw!r}") from exc
        if not 2 <= len(split) <= 16 or not all(0 < v < float("inf") for v in split):
            raise EngineLoadError(f"layer_split needs 2 to 16 positive shares, one per rank, got {list(raw)}")
        if spec.rank is not None and len(split) != spec.rank.world_size:
            raise EngineLoadError(
                f"layer_split names {len(split)} shares for {spec.rank.world_size} ranks: give one per rank"
            )
    try:
        seconds = float(timeout)
    except (TypeError, ValueError) as exc:
        raise EngineLoadError(f"rpc_timeout must be a number of seconds, got {timeout!r}") from exc
    if not 0.5 <= seconds <= 3600:
        raise EngineLoadError(f"rpc_timeout must be in [0.5, 3600] seconds, got {timeout!r}")
    if spec.rank is not None and options["n_gpu_layers"] not in ("auto", 0):
        raise EngineLoadError(
            "n_gpu_layers is the layer split's with ranks > 1 (the last layers go to the other ranks): leave it out, "
            "and use layer_split to choose each rank's share"
        )
    return split, seconds


# ----------------------------------------------------------------------------------------------------------
# Structured output and pooling
# ------------------------------------------------------------------------------------------------------------

_LOOSE_CHAR = r'char ::= [^"\\] |'
_STRICT_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


@functools.lru_cache(maxsize=64)
def schema_grammar(schema: str) -> str:
    """The GBNF grammar (root rule ``root``) for a JSON Schema's text, by llama-cpp-python's converter; a schema it
    cannot convert is a ``RequestError`` (cached per schema text: a client sends the same schema again and again).

    The converter's string characters admit raw control characters (a newline inside a string), which strict JSON
    parsers refuse; they are excluded here, as llama.cpp's own converter does now.
    """
    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise RequestError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise RequestError(
            f'json_schema must be a JSON object (a JSON Schema such as {{"type": "object"}}), got {schema[:60]!r}'
        )
    try:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        grammar: str = json_schema_to_gbnf(schema)
    except Exception as exc:  # the converter raises ValueError, KeyError, TypeError, ... for what it cannot do
        raise RequestError(f"json_schema is not supported: {type(exc).__name__}: {exc}") from None
    if "\x00" in grammar:  # llama.cpp reads the grammar as a C string: it would end there
        raise RequestError("json_schema asks for a NUL character (U+0000), which no token of the model can produce")
    return grammar.replace(_LOOSE_CHAR, _STRICT_CHAR)


AFTER_THOUGHT = "tether-after-thought"  # the start rule of a JSON Schema's grammar that follows the thinking


def answer_grammar(params: GenerateParams, after_thought: bool = False) -> tuple[str | None, str]:
    """The GBNF grammar an answer is held to and its start rule: the tool syntax's, else the ``json_schema``'s (None
    without either). ``after_thought``: the answer follows a closed thinking block, so the few newlines or spaces a
    model writes after the tag may lead it, and it is owed (a tool answer's text is not empty)."""
    syntax = params.tool_syntax
    if syntax is not None:  # (a tool grammar lets the whitespace lead either way)
        return tool_grammar(syntax, schema_grammar(syntax.call_schema), owed=after_thought), TOOLS_ROOT
    if params.json_schema is None:
        return None, "root"
    grammar = schema_grammar(params.json_schema)
    if not after_thought:
        return grammar, "root"
    return f"{grammar.rstrip()}\n{AFTER_THOUGHT} ::= {LEADING_SPACE} root\n", AFTER_THOUGHT


def _pooling(lib: Any, model: Any) -> int | None:
    """The pooling an embedding context uses: None (llama.cpp then takes the model's own) when the GGUF declares
    mean, cls or last; mean when it declares none; a reranker's rank pooling is refused (it gives scores, not
    vectors)."""
    metadata = model.metadata()
    declared = metadata.get(f"{metadata.get('general.architecture', '')}.pooling_type")
    try:
        kind = int(declared) if declared is not None else lib.LLAMA_POOLING_TYPE_NONE
    except ValueError:
        kind = lib.LLAMA_POOLING_TYPE_NONE
    if kind == lib.LLAMA_POOLING_TYPE_RANK:
        raise EngineLoadError(
            "this model is a reranker (its pooling type is rank): it scores pairs and gives no embedding, and "
            "tether does not serve reranking"
        )
    if kind in (lib.LLAMA_POOLING_TYPE_MEAN, lib.LLAMA_POOLING_TYPE_CLS, lib.LLAMA_POOLING_TYPE_LAST):
        return None
    return int(lib.LLAMA_POOLING_TYPE_MEAN)


# ----------------------------------------------------------------------------------------------------------
# Load-time plumbing
# ------------------------------------------------------------------------------------------------------------


class _ProgressReporter:
    """Turns llama.cpp's progress callback (called from C, on the loading thread) into throttled reports.

    Tensor loading maps to 0..0.95; the last 5% is context creation, reported as 1.0 by ``load`` itself. It
    never raises into C and always returns True: a ctypes callback that raises returns False, which would make
    llama.cpp abort the load.
    """

    def __init__(self, progress: ProgressCallback, described: str) -> None:
        self.progress = progress
        self.described = described
        self.last = 0.0
        self.error: BaseException | None = None

    def __call__(self, fraction: float, _user_data: Any) -> bool:
        try:
            value = 0.95 * min(max(float(fraction), 0.0), 1.0)
            if value - self.last >= PROGRESS_STEP * 0.95 or (fraction >= 1.0 and value > self.last):
                self.last = value
                self.progress(value, f"loading {self.described}: tensors {fraction:.0%}")
        except BaseException as exc:  # must not propagate into C
            self.error = exc
        return True


_log_callback: Any = None  # the installed ctypes log callback; must stay referenced while llama.cpp may log


def _install_log_filter(llama_lowlevel: Any, verbose: bool) -> None:
    """Route llama.cpp's log to fd 2 directly: warnings and errors always, everything when ``verbose``.

    Writing to the fd (not ``sys.stderr``) works from any native thread and cannot be swallowed by stream
    swapping; the supervisor captures fd 2 line by line and scans it for engine error patterns.
    """
    global _log_callback
    state = {"forward": False}

    def on_log(level: int, text: bytes | None, _user_data: Any) -> None:
        try:
            if level != GGML_LOG_CONT:
                state["forward"] = verbose or level in (GGML_LOG_WARN, GGML_LOG_ERROR)
            if state["forward"] and text:
                os.write(2, text)
        except BaseException:  # never raise into C
            pass

    _log_callback = llama_lowlevel.llama_log_callback(on_log)
    llama_lowlevel.llama_log_set(_log_callback, None)


def _chat_formatter(llama_cpp: Any, model: Any, chosen: ChatTemplate | None) -> Any:
    """The chat template as a formatter, built as llama-cpp-python does for its default chat handler: ``chosen``
    (the ``chat_template`` option), else the GGUF's own; None when there is neither."""
    template = chosen.text if chosen is not None else model.metadata().get("tokenizer.chat_template")
    if not template:
        return None

    def token_text(token_id: int) -> str:
        if token_id == -1:
            return ""
        piece: bytes = model.detokenize([token_id], special=True)
        return piece.decode("utf-8", errors="replace")

    eos_id = model.token_eos()
    return llama_cpp.llama_chat_format.Jinja2ChatFormatter(
        template=template,
        eos_token=token_text(eos_id),
        bos_token=token_text(model.token_bos()),
        stop_token_ids=[eos_id],
    )
