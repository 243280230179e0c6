"""The llama.cpp step loop: several sequences decoded in one ``llama_decode`` batch per step (continuous batching).

One context holds ``parallel`` sequences, each in a *slot* (a sequence id with KV cells of its own: ``n_ctx`` is per
sequence). Each step builds one batch: a row for every decoding sequence (its last sampled token, and any draft
tokens after it) and a chunk of one prefilling sequence's prompt (of several with the batch-invariant build), at most
``prefill_chunk`` tokens while any row decodes, so an arrival delays the running streams by one short chunk per
step, not by its whole prefill.

llama.cpp sums a row in an order set by its batch's shape, so a greedy text can change with what was computed
beside it. The rules ``step`` keeps so that it changes as rarely as it can (with the batch-invariant build,
``invariant``, it never does): one prompt per step (the invariant build packs several); a prompt's last token is a
decode row, never part of its chunk; decode rows in slot order; a draft row's pick is the one the plain path would
make there (``_verify``). Each sequence samples with its own chain (``_sampler``), reuses a cached prefix
(``cache``) and decodes its pieces with its own ``TextStream``. Why, with the figures measured: docs/design.md, "The
llama.cpp step loop".

Only the thread that owns the engine touches any of this (llama.cpp contexts are not thread-safe).
"""

from __future__ import annotations

import ctypes
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from tether.engines.base import Delta, EngineLoadError, RequestError, StepResult
from tether.engines.llamacpp.cache import PromptCache
from tether.engines.llamacpp.prefix import common_length
from tether.engines.llamacpp.speculation import (
    Q_FLOOR,
    Acceptance,
    Candidate,
    CostCurve,
    Drafter,
    History,
    Payoff,
    plan,
    probe_points,
    ubatches,
)
from tether.engines.llamacpp.store import KvStore
from tether.engines.llamacpp.threads import ThreadGovernor
from tether.engines.text import TextStream
from tether.errors import TetherError
from tether.protocol import FinishReason, TokenLogprob, TopLogprob

TOP_K, MIN_P = 40, 0.05  # llama-cpp-python's and llama-server's defaults, for temperature > 0
PENALTY_LAST_N = 64  # llama-cpp-python's last_n_tokens_size
PIECE_BUFFER = 256
GREEDY_SEARCH = 64  # a greedy json_schema pick checks the grammar on this many likeliest tokens before masking all
PROBE_CONTEXT = 128  # tokens in the slot while micro-batches are timed (attention adds little at this size)
PROBE_MOST = 64  # the largest micro-batch timed; beyond it the curve is extrapolated
PROBE_MOST_ONE_THREAD = 8  # on one thread (the governor's answer to busy cores) only short drafts can pay
SAVE_SHARE = 0.1  # of the steps' time, at most, spent saving growing generations to the store (``_save_progress``)
SAVE_GROWTH = 32  # tokens a generation grows by before it is saved again (and a quarter of what it holds)
SAVE_TAIL = 0.25  # of n_batch: the unsaved tokens every decoding sequence together may hold, credit allowing
JSON_VALUE_ENDS = frozenset(b'}]"el')  # a JSON value nothing can extend ends so: {...} [...] "..." true false null


class DecodeError(TetherError):
    """``llama_decode`` failed: the context's state is unknown, so this is fatal for the runner."""


@dataclass(frozen=True)
class Thought:
    """A reasoning model's structured answer follows its thinking, so its grammar waits: while the block is open the
    sequence samples with its chain alone, and once its output holds the closing tag (``tag``, its bytes) the grammar
    holds what follows. Where the model would end its turn inside the block, or close it and begin its answer in one
    token, the tag's tokens (``close``) are written for it instead, one a step, each with its own logprob: the answer
    is owed, and a grammar cannot start inside a token. So they are once the thinking has taken ``budget`` tokens
    (half the room the request has: the answer keeps the rest)."""

    tag: bytes
    close: tuple[int, ...]
    budget: int


@dataclass(frozen=True)
class Sampling:
    """One sequence's sampling parameters (the chain they build: ``Batch._sampler``)."""

    temperature: float
    top_p: float
    seed: int
    repeat_penalty: float = 1.0  # over the last PENALTY_LAST_N tokens, the prompt's included; 1.0 is neutral
    presence_penalty: float = 0.0  # over the completion so far; 0 is neutral
    frequency_penalty: float = 0.0
    top_k: int | None = None  # None: TOP_K; 0 keeps every token
    min_p: float | None = None  # None: MIN_P; 0 keeps every token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias): the caller has checked the ids are < n_vocab
    grammar: str | None = None  # GBNF (a json_schema converted, or a tool syntax's: see ``tools``)
    logprobs: int | None = None  # None: none; else how many alternatives beside each chosen token
    grammar_root: str = "root"  # the grammar's start rule
    ends_on_json: bool = True  # the grammar's output is one JSON value: the sequence stops once it is complete
    special_pieces: bool = False  # control tokens' text is output (a native tool format's markers can be such)
    thought: Thought | None = None  # the grammar waits for the thinking block to close


@dataclass
class _Slot:
    index: int  # the llama.cpp sequence id
    cached: list[int] = field(default_factory=list)  # tokens whose KV cells this slot holds, in order


@dataclass
class _BatchSequence:
    seq_id: str
    slot: _Slot
    prompt: list[int]
    prefilled: int  # prompt tokens in the slot's cells
    max_tokens: int
    text: TextStream
    sampler: Any  # its chain (None for an embedding)
    grammar: Any = None  # its grammar sampler, apart from the chain (json_schema)
    completion: int = 0
    next_token: int | None = None  # sampled, not yet decoded: goes into the next step's batch
    row: int = -1  # this step: the batch row whose logits it samples from (-1: none)
    logprobs: int | None = None
    output: bytearray | None = None  # the completion's bytes, for a grammar's sequence (JSON ends on a whole value)
    ends_on_json: bool = True  # with ``output``: stop once it is one complete JSON value
    special_pieces: bool = False  # control tokens' pieces are output as text
    plain_greedy: bool = False  # temperature 0 and nothing else in the chain: the allowed argmax is searched for
    placed: bool = False  # its prefix brought into its slot (when its prefill begins: see cache)
    reused: int = 0  # prompt tokens whose cells came from the cache, not prefilled

    waits_for: frozenset[str] = frozenset()  # once ready: the sequences prefilling then (see ``Batch.step``)
    echo: str | None = None  # the prompt's text, to lead the first delta (``echo``; None once sent, or not asked)
    echoed: list[TokenLogprob] | None = None  # ``echo`` with logprobs: the prompt tokens' entries computed so far
    eog_entry: bool = False  # ``echo`` with logprobs: an end-of-generation token gets an entry too (vLLM's way)
    chunk_rows: tuple[int, int, int] = (0, 0, 0)  # this step's prompt rows with logits: (first row, count, position)
    drafter: Drafter | None = None  # its draft sources and acceptance (speculation on)
    draft: list[int] = field(default_factory=list)  # this step: the draft tokens decoded after its row
    draft_kind: str = ""  # their source's kind
    steps: int = 0  # steps that sampled a token of it
    finished: bool = False  # its last sample ended it: dropped once its cells are trimmed
    thought: Thought | None = None  # while its thinking block is open: the grammar waits (see ``Thought``)
    saved: int = 0  # tokens its cells held at its last save to the store (``Batch._save_progress``)
    thought_tail: bytes = b""  # the thinking's last bytes, where the closing tag may have begun
    forced: list[int] = field(default_factory=list)  # the closing tag's tokens still to write for it
    resumed: int = 0  # completion tokens an earlier runner produced (``Resume``): the tail of ``prompt``
    seed: int = 0  # its draw's seed
    draws: int = 0  # values its chain has drawn (each apply of the chain draws once where it ends in a seeded draw)

    @property
    def prompt_tokens(self) -> int:
        """The request's own prompt, without the completion tokens a resume put after it."""
        return len(self.prompt) - self.resumed

    @property
    def decoding(self) -> bool:
        return self.next_token is not None

    @property
    def prefilling(self) -> bool:
        """Not yet placed, or some of its prompt but the last token still to prefill."""
        return not self.placed or self.prefilled < len(self.prompt) - 1

    @property
    def ready(self) -> bool:
        """All its prompt in its cells but the last token, which goes in with the decode rows."""
        return self.placed and self.prefilled == len(self.prompt) - 1

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: it ends once its prompt's logprobs are known, generating nothing."""
        return self.max_tokens == 0


class Batch:
    """The step loop over one llama.cpp context (the rules it keeps: the module docstring)."""

    def __init__(
        self,
        lib: Any,
        model: Any,
        vocab: Any,
        *,
        parallel: int,
        n_ctx: int,
        n_batch: int,
        n_threads: int,
        prefill_chunk: int,
        prompt_cache: bool = True,
        prompt_cache_ram: int = 0,
        unified: bool = False,
        embedding: bool = False,
        pooling: int | None = None,
        adaptive_threads: bool = True,
        swa_full: bool = False,
        invariant: bool = False,
        speculation: bool = False,
        draft_max: int = 32,
        store: KvStore | None = None,
    ) -> None:
        """``embedding``: a context for pooled embeddings (``pooling``: a ``LLAMA_POOLING_TYPE_*``, None for the
        model's own); it serves ``start_embedding`` only, and its ``n_batch`` is ``n_ctx``. ``adaptive_threads``:
        one thread while other processes hold the cores (``threads``). ``swa_full``: sliding-window layers
        keep every position as the others do (llama.cpp's C default, and ``llama-server --swa-full``), instead of
        the window's (llama-server's default: for Gemma 3 270M at 8 x 8192 cells, a KV cache of 312 MiB instead of
        1.1 GiB); the prompt cache reuses less with the window's (see ``cache``). ``invariant``: the batch-invariant
        build is loaded (a deterministic engine's), so several prompts may share a step (``step``) and the prompt
        cache restores only what gives the cells of a cold prefill in the same places.
        ``speculation``: decoding sequences may verify up to ``draft_max`` draft tokens a step (``_verify``), once
        ``measure_costs`` has timed this context's micro-batches."""
        self.lib = lib
        self.vocab = vocab
        self.parallel = parallel
        self.n_ctx = n_ctx  # per sequence
        self.embedding = embedding
        self.n_batch = n_ctx if embedding else n_batch
        self.prefill_chunk = prefill_chunk
        self.invariant = invariant
        self.prompt_cache = prompt_cache and not embedding
        self.n_vocab: int = lib.llama_vocab_n_tokens(vocab)
        n_embd_out = getattr(lib, "llama_model_n_embd_out", None) or lib.llama_model_n_embd
        self.n_embd: int = n_embd_out(model)
        params = lib.llama_context_default_params()
        if embedding:  # one whole prompt at a time, in one micro-batch (pooling needs all of it): n_ctx cells
            params.n_ctx = n_ctx
            params.n_batch = params.n_ubatch = n_ctx
            params.embeddings = True
            params.pooling_type = lib.LLAMA_POOLING_TYPE_UNSPECIFIED if pooling is None else pooling
            unified = True
        else:
            params.n_ctx = n_ctx * parallel
            params.n_batch = n_batch + parallel  # a step: up to parallel decode rows, plus up to n_batch prompt tokens
            params.n_ubatch = min(n_batch, 512)
        params.n_seq_max = parallel
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.kv_unified = unified  # else each sequence attends to its own cells only
        params.swa_full = swa_full
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as the Llama class builds its context
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(model, params)
        if not self.ctx:
            cells = n_ctx if embedding else n_ctx * parallel
            raise RuntimeError(
                f"llama.cpp could not create a context of {cells} cells ({parallel} sequences of {n_ctx}"
                f"{', embeddings' if embedding else ''}): lower parallel or n_ctx (the stderr tail has llama.cpp's "
                "reason)"
            )
        self.threads = ThreadGovernor(lib, self.ctx, n_threads, adaptive=adaptive_threads)
        if embedding and lib.llama_pooling_type(self.ctx) not in (
            lib.LLAMA_POOLING_TYPE_MEAN,
            lib.LLAMA_POOLING_TYPE_CLS,
            lib.LLAMA_POOLING_TYPE_LAST,
        ):
            kind = lib.llama_pooling_type(self.ctx)
            lib.llama_free(self.ctx)
            self.ctx = None
            raise EngineLoadError(
                f"llama.cpp's embedding context has pooling type {kind}, not mean, cls or last: this model gives no "
                "embedding per input (a reranker's pooling is 4, rank)"
            )
        self.memory = lib.llama_get_memory(self.ctx)
        n_swa = getattr(lib, "llama_model_n_swa", None)
        # the model's window even with swa_full: a sequence saved to RAM keeps only its last window in those layers
        self.n_swa = 0 if n_swa is None else max(0, int(n_swa(model)))
        self.cache = PromptCache(
            lib,
            self.ctx,
            self.memory,
            prompt_cache_ram,
            enabled=self.prompt_cache,
            n_swa=self.n_swa,
            exact=invariant,
            store=None if embedding else store,
        )
        self._batch = lib.llama_batch_init(self.n_batch + parallel, 0, 1)
        self._slots = [_Slot(i) for i in range(parallel)]
        self._seqs: dict[str, _BatchSequence] = {}
        self._piece = ctypes.create_string_buffer(PIECE_BUFFER)
        self._candidates: Any = None  # llama_token_data[n_vocab] for grammar sampling, made on first use
        self._candidate_view: Any = None  # a numpy view of it
        self._one = lib.llama_token_data_array()  # one candidate, for the grammar's check of a pick
        self._one_data = lib.llama_token_data()
        self._ids = np.arange(self.n_vocab, dtype=np.int32)
        self.speculation = speculation and not embedding
        self.draft_max = max(0, draft_max)
        self.n_ubatch = int(params.n_ubatch)
        self.unified = unified
        self.windowed = self.n_swa > 0 and not swa_full  # a window's ring: see ``_drafts``
        self.costs = CostCurve()
        self.acceptance = Acceptance()
        self.history = History()
        self.payoff = Payoff()
        self._save_credit = 0.0  # seconds of saving the steps have earned (``_save_progress``)

    # --- sequences ------------------------------------------------------------------------------------------

    def start(
        self,
        seq_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        stops: Sequence[str],
        sampling: Sampling,
        echo: str | None = None,
        prediction: Sequence[int] | None = None,
        resumed: Sequence[int] = (),
        draws: int = 0,
    ) -> str:
        """Place a sequence in the free slot that shares the longest prefix with ``prompt`` (its first token comes
        with a later step). The caller has checked the prompt fits the context. ``RequestError`` (nothing started)
        when llama.cpp cannot build its sampler (a grammar it cannot parse).

        ``echo`` (the completions API's): the prompt's text, which leads the sequence's first delta. With
        ``sampling.logprobs`` so do its tokens' entries, computed as a generated token's are: each prompt chunk row
        is decoded with its logits on, and row ``p`` gives the entry of prompt token ``p + 1`` (the first one's
        logprob is NaN: nothing precedes it), so such a prompt reuses nothing from the cache (cached cells have no
        logits); an end-of-generation token then gets an entry too (vLLM's way: lm-eval drops an echo's last entry
        as the generated one). ``max_tokens`` 0 (with ``echo`` only) ends the sequence once its prompt is in,
        generating nothing (lm-eval's loglikelihood). ``prediction``: the tokens the answer is
        expected to repeat (OpenAI's Predicted Outputs), the first source of its drafts when speculation is on.

        ``resumed``: the completion tokens a runner that died produced for this request, and ``draws`` the values its
        draw had drawn (``Resume``). They follow the prompt into the cells (prefilled as prompt, or found in the
        cache), and are replayed through everything they changed (``_replay``): the sequence goes on from the next
        token as the uninterrupted one would have. Returns the text the replay wrote (already sent: the caller's
        thinking splitter needs it), "" without ``resumed``."""
        if self.embedding:
            raise RuntimeError("this batch computes embeddings: use start_embedding")
        if max_tokens < (0 if echo is not None else 1) or not prompt:
            raise RuntimeError(f"a sequence needs a prompt and max_tokens >= 1 (0 with echo), got {max_tokens}")
        whole = [*prompt, *resumed]
        slot = self._free_slot(seq_id, whole)
        sampler, grammar = self._sampler(sampling, prompt)
        echo = None if resumed else echo  # the first delta, which it leads, was sent
        echoed: list[TokenLogprob] | None = None
        if echo is not None and sampling.logprobs is not None:  # the first token: nothing precedes it, no logprob
            first = self._token_piece(prompt[0], special=True)
            echoed = [TokenLogprob(first.decode("utf-8", errors="replace"), math.nan, first)]
        seq = _BatchSequence(
            seq_id,
            slot,
            whole,
            0,
            max_tokens,
            TextStream(stops),
            sampler,
            grammar,
            logprobs=sampling.logprobs,
            output=bytearray() if grammar is not None else None,
            ends_on_json=sampling.ends_on_json,
            special_pieces=sampling.special_pieces,
            plain_greedy=_plain_greedy(sampling),
            echo=echo,
            echoed=echoed,
            eog_entry=echoed is not None,
            drafter=Drafter.start(prompt, prediction) if self.speculation else None,
            thought=sampling.thought if grammar is not None else None,
            resumed=len(resumed),
            seed=sampling.seed,
        )
        try:
            replayed = self._replay(seq, resumed, draws) if resumed else ""
        except BaseException:
            lib = self.lib
            lib.llama_sampler_free(sampler)
            if grammar is not None:
                lib.llama_sampler_free(grammar)
            raise
        self._seqs[seq_id] = seq
        return replayed

    def _replay(self, seq: _BatchSequence, resumed: Sequence[int], draws: int) -> str:
        """Bring a resumed sequence's state to where its earlier runner left it: each token is accepted by what
        accepts it there (the chain's penalties; the grammar once the thinking is closed), its piece goes through
        the stop strings and the thinking's tag as ``_sample`` sends it, the draw advances by the values drawn, and
        a closing tag being written for it goes on. ``RequestError`` where the tokens cannot be this request's."""
        lib = self.lib
        out: list[str] = []
        for i, token in enumerate(resumed):
            if not 0 <= token < self.n_vocab or lib.llama_vocab_is_eog(self.vocab, token):
                raise RequestError(
                    f"cannot resume: token {i} of the {len(resumed)} sent before the runner died is {token}, which "
                    "this model cannot have generated there (no such token, or an end of generation)"
                )
            piece = self._token_piece(token, special=seq.special_pieces)
            if seq.thought is not None:
                lib.llama_sampler_accept(seq.sampler, token)
            elif seq.grammar is not None and seq.output is not None:
                if not self._allows(seq.grammar, token):
                    raise RequestError(
                        f"cannot resume: the grammar refuses token {i} ({token}) of the {len(resumed)} sent before "
                        "the runner died"
                    )
                lib.llama_sampler_accept(seq.grammar, token)
                lib.llama_sampler_accept(seq.sampler, token)
            else:
                lib.llama_sampler_accept(seq.sampler, token)
            seq.completion += 1
            text, stopped = seq.text.feed(piece)
            if stopped:
                raise RequestError(f"cannot resume: its output had already reached a stop string at token {i}")
            if seq.thought is not None:
                self._thinking_wrote(seq, piece)
            elif seq.output is not None:
                seq.output += piece
            if seq.drafter is not None:
                seq.drafter.observe(token)
            out.append(text)
        if seq.thought is not None:  # the closing tag's first tokens were being written for it: the rest follow
            close = seq.thought.close
            for j in range(min(len(close) - 1, len(resumed)), 0, -1):
                if tuple(resumed[-j:]) == close[:j]:
                    seq.forced = list(close[j:])
                    break
        self._advance(seq.sampler, draws)
        seq.draws = draws
        return "".join(out)

    def _advance(self, chain: Any, draws: int) -> None:
        """Apply ``chain`` to one candidate ``draws`` times: its seeded draw, if it has one, draws exactly once per
        apply (llama.cpp keeps it so for a single candidate too), and nothing else in the chain keeps state."""
        for _ in range(draws):
            self._apply_one(chain, 0)

    def start_embedding(self, seq_id: str, prompt: Sequence[int]) -> None:
        """Queue an embedding of ``prompt`` (at most ``n_ctx`` tokens: the caller has checked): a later step
        prefills it whole and ends it with its vector (``_embed_step``). An embedding batch's cache is unified and
        only ``n_ctx`` cells in all: one prompt is in it at a time."""
        if not self.embedding:
            raise RuntimeError("this batch generates: build it with embedding=True for embeddings")
        if not 0 < len(prompt) <= self.n_ctx:
            raise RuntimeError(f"an embedding's prompt must have 1 to {self.n_ctx} tokens, got {len(prompt)}")
        slot = self._free_slot(seq_id, ())
        self._seqs[seq_id] = _BatchSequence(seq_id, slot, list(prompt), 0, 0, TextStream(), None)

    def drop(self, seq_id: str) -> tuple[int, int] | None:
        """End a sequence now; returns its (prompt, completion) token counts, None when it is not running."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq.sampler is not None:
            self.lib.llama_sampler_free(seq.sampler)
        if seq.grammar is not None:
            self.lib.llama_sampler_free(seq.grammar)
        if seq.placed:  # its slot's cells hold exactly what it computed, a cancelled prefill's part included
            self.cache.register(seq.slot.index, seq.slot.cached)
        self.cache.unpin(seq.slot.index)
        if seq.drafter is not None:  # its completion, for later requests' drafts
            self.history.add(seq.drafter.context.tokens[seq.prompt_tokens :])
        return seq.prompt_tokens, seq.completion

    def cancel(self, seq_id: str) -> Delta:
        """End a sequence now: its final delta ("cancelled", its counts so far)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return Delta("", 0, "cancelled")
        self.drop(seq_id)
        return msgspec.structs.replace(
            Delta("", 0, "cancelled", seq.prompt_tokens, seq.completion), **_step_counts(seq)
        )

    def active(self) -> int:
        return len(self._seqs)

    def clear(self) -> None:
        """Forget every slot's cached tokens (after warm-up: the next requests start from empty cells)."""
        self.lib.llama_memory_clear(self.memory, True)
        self.cache.clear()
        for slot in self._slots:
            slot.cached.clear()

    # --- the step -------------------------------------------------------------------------------------------

    def step(self) -> list[StepResult]:
        """One ``llama_decode``: a token for every decoding sequence, a prompt chunk for the earliest prefilling one
        (or, in an embedding batch, one whole prompt and its vector).

        One prompt per step: prompts prefilled together change llama.cpp's arithmetic enough to flip
        a greedy choice. With the batch-invariant build (``invariant``) they cannot, so there the chunks of the
        next prefilling sequences share the step while its token budget lasts (``_chunks``): a burst of arrivals, or
        of streams resumed on a new runner, is placed in a few steps instead of one step each. The budget is at most
        ``prefill_chunk`` tokens while any row decodes, else up to ``n_batch``.
        A prompt's chunks stop one token short: its last token joins the decode rows (its logits make the first
        token), since a row computed inside a chunk and the same row among decode rows can give another text. A
        sequence whose prompt is in but for that token is *ready*, and joins once none of the sequences that were
        prefilling (or waiting to) when it became ready still is (``waits_for``): a burst of arrivals is prefilled
        back to back with the whole ``n_batch`` while nothing decodes, then decodes together and, with equal lengths,
        ends together, so the next burst stalls nobody. The price: a burst's first tokens wait for its prefill (as in
        llama-server), and a prompt alone waits one step. Decode rows go in slot order: llama.cpp splits a batch over
        separate caches into one pass per run of consecutive sequence ids."""
        if self.embedding:
            return self._embed_step()
        started = time.perf_counter()
        n = 0
        waiting = {seq.seq_id for seq in self._seqs.values() if seq.prefilling}
        rows = sorted(
            (
                seq
                for seq in self._seqs.values()
                if seq.decoding or (seq.ready and not seq.echo_only and not seq.waits_for & waiting)
            ),
            key=lambda seq: seq.slot.index,
        )
        chunks = self._chunks(min(self.n_batch, self.prefill_chunk) if rows else self.n_batch)
        prompt_rows = sum(len(chunk) for _, chunk in chunks)
        drafts = self._drafts(rows, chunks) if self.speculation and rows else {}
        layout: list[tuple[int, int]] = []
        joined: list[_BatchSequence] = []  # prompts whose last token joins this step
        for seq in rows:  # a token each: the last sampled one, or a ready prompt's last (its logits: the first token)
            token, seq.next_token = seq.next_token, None
            joins = token is None
            if token is None:
                token = seq.prompt[-1]
            self._put(n, token, len(seq.slot.cached), seq.slot.index, True)
            seq.slot.cached.append(token)
            if joins:
                seq.prefilled += 1
                self.cache.register(seq.slot.index, seq.slot.cached)  # the whole prompt now
                joined.append(seq)
            seq.row = n
            n += 1
            seq.draft = drafts.get(seq.seq_id, [])
            for guess in seq.draft:  # its draft, verified by the rows after its own
                self._put(n, guess, len(seq.slot.cached), seq.slot.index, True)
                seq.slot.cached.append(guess)
                n += 1
            layout.append((seq.slot.index, 1 + len(seq.draft)))
        for seq, chunk in chunks:
            logits = seq.echoed is not None  # each prompt row's logits give the next prompt token's logprob
            if logits:
                seq.chunk_rows = (n, len(chunk), seq.prefilled)
            for i, token in enumerate(chunk):
                self._put(n, token, seq.prefilled + i, seq.slot.index, logits)
                n += 1
            seq.slot.cached.extend(chunk)
            seq.prefilled += len(chunk)
            if chunk:
                layout.append((seq.slot.index, len(chunk)))
            if not seq.prefilling:  # all but its last token: it waits for the prompts queued beside it (docstring)
                seq.waits_for = frozenset(waiting - {seq.seq_id})
                self.cache.register(seq.slot.index, seq.slot.cached)
        if n == 0 and not any(seq.echo_only and seq.ready for seq in self._seqs.values()):
            return []
        if n:
            threads = self.threads.current
            seconds = self._decode(n)
            if self.speculation:  # what this step's shape costs on this machine, now
                passes = ubatches(layout, self.n_ubatch, per_stream=not self.unified)
                self.costs.step(threads, passes, seconds, bool(drafts))
        results: list[StepResult] = []
        for seq, _ in chunks:
            if seq.chunk_rows[1]:
                self._prompt_logprobs(seq)
            if seq.prefilling:  # a long prompt advanced: its first-token clock restarts
                results.append((seq.seq_id, Delta("", 0, prefilled=seq.prefilled)))
        made = 0
        for seq in list(self._seqs.values()):
            if seq.row >= 0:
                result = self._verify(seq)
                made += result.tokens if isinstance(result, Delta) else 0
                results.append((seq.seq_id, result))
                seq.row = -1
            elif seq.echo_only and seq.ready:  # its prompt is in: it ends, having generated nothing
                self.drop(seq.seq_id)
                echoed = tuple(seq.echoed or ())
                prompt = seq.prompt_tokens
                final = Delta(seq.echo or "", 0, "length", prompt, 0, logprobs=echoed, cached_tokens=seq.reused)
                results.append((seq.seq_id, final))
        for seq in joined:  # its prompt's cells are computed now: saved where a resume would find them
            if seq.seq_id in self._seqs:
                self.cache.checkpoint(seq.slot.index, seq.slot.cached)
                seq.saved = len(seq.slot.cached)
        self._save_progress(time.perf_counter() - started)
        if self.speculation and rows:  # what this step's shape gave, with its drafts or without
            self.payoff.record((len(rows), bool(prompt_rows)), bool(drafts), made, time.perf_counter() - started)
        return results

    def close(self) -> None:
        for seq_id in list(self._seqs):
            self.drop(seq_id)
        if self._batch is not None:
            self.lib.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None

    # --- internals ------------------------------------------------------------------------------------------

    def _save_progress(self, seconds: float) -> None:
        """Save decoding sequences to the store as their generations grow (``PromptCache.checkpoint``), so that a
        runner's death costs a resumed stream the tokens since its last save to read again, not its whole answer.

        Two rules make a sequence due. Its own: it has grown by ``SAVE_GROWTH`` tokens and by a quarter of what it
        holds; each save copies all of it, so saves grow rarer as it grows (about four copies of each token in all).
        The batch's: a death resumes every sequence at once, and their unsaved tails are read again together, so
        while they add up to more than ``SAVE_TAIL`` of ``n_batch`` tokens, the sequences with the most unsaved per
        token held (what a save spares a resume, per what it copies) are saved too: 200 young chats re-read ~7
        tokens each without it, ~6 s on 2 cores. Either way saves spend the steps' credit only: each step earns
        ``SAVE_SHARE`` of its ``seconds`` (kept for one step only, so saves never come in a burst), each save
        spends what it took, and a save that overdraws waits until the steps have paid it back."""
        if self.cache.store is None:
            return
        self._save_credit = min(self._save_credit + SAVE_SHARE * seconds, SAVE_SHARE * seconds)
        if self._save_credit <= 0:
            return
        growing = [  # (sequence, cells held, of them unsaved)
            (seq, len(seq.slot.cached), len(seq.slot.cached) - seq.saved)
            for seq in self._seqs.values()
            if seq.decoding and not seq.finished and len(seq.slot.cached) > seq.saved
        ]
        unsaved = sum(grown for _, _, grown in growing)
        tail = int(self.n_batch * SAVE_TAIL)
        growing.sort(key=lambda g: g[2] / g[1], reverse=True)
        for seq, held, grown in growing:
            if self._save_credit <= 0:
                return
            if unsaved <= tail and grown < max(SAVE_GROWTH, held // 4):
                continue
            began = time.perf_counter()
            self.cache.checkpoint(seq.slot.index, seq.slot.cached)
            seq.saved = held  # saved, or refused (the budget): not tried again every step
            unsaved -= grown
            self._save_credit -= time.perf_counter() - began

    def _chunks(self, budget: int) -> list[tuple[_BatchSequence, list[int]]]:
        """This step's prompt chunks, within ``budget`` tokens: the earliest prefilling sequence's, placed first
        (``_place``) if its prefill begins now; with the batch-invariant build, the next ones' too while the budget
        lasts (one prompt and at most one placement a step otherwise: see ``step``). Every placement is made
        before any of this step's tokens enter a slot, so a prefix copied from another slot holds computed cells
        only."""
        chunks: list[tuple[_BatchSequence, list[int]]] = []
        for seq in self._seqs.values():
            if not seq.prefilling:
                continue
            if chunks and (not self.invariant or budget <= 0):
                break
            if not seq.placed:
                self._place(seq)
            chunk = seq.prompt[seq.prefilled : min(seq.prefilled + budget, len(seq.prompt) - 1)]
            budget -= len(chunk)
            chunks.append((seq, chunk))
        return chunks

    def _place(self, seq: _BatchSequence) -> None:
        """Bring the prompt's longest cached prefix into the sequence's slot (``PromptCache.place``); none for a
        sequence that needs its prompt's logprobs (cached cells have no logits): placed as a one-token prompt, of
        which the cache never reuses anything, its slot's cells are saved (when worth it) and emptied."""
        prompt = seq.prompt[:1] if seq.echoed is not None else seq.prompt
        reused = self.cache.place(seq.slot.index, seq.slot.cached, prompt, [slot.cached for slot in self._slots])
        seq.prefilled = seq.reused = reused
        seq.placed = True

    def _free_slot(self, seq_id: str, prompt: Sequence[int]) -> _Slot:
        """The free slot whose cached tokens share the longest prefix with ``prompt`` (the lowest on a tie)."""
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id!r} is already running")
        busy = {seq.slot.index for seq in self._seqs.values()}
        free = [slot for slot in self._slots if slot.index not in busy]
        if not free:
            raise RuntimeError(f"the batch is full ({self.parallel} sequences): a sequence must end first")
        return max(free, key=lambda s: (common_length(s.cached, prompt), -s.index))

    def _put(self, row: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch = self._batch
        batch.token[row] = token
        batch.pos[row] = pos
        batch.n_seq_id[row] = 1
        batch.seq_id[row][0] = seq
        batch.logits[row] = 1 if logits else 0

    def _decode(self, n: int) -> float:
        """Decode the batch's first ``n`` rows; returns the seconds it took."""
        self._batch.n_tokens = n
        self.threads.before()
        started = time.perf_counter()
        code = self.lib.llama_decode(self.ctx, self._batch)
        seconds = time.perf_counter() - started
        self.threads.after(seconds)
        if code != 0:
            raise DecodeError(
                f"llama_decode failed with {code} for a batch of {n} tokens over {len(self._seqs)} sequences "
                f"({'no free KV cells' if code == 1 else 'see the stderr tail'})"
            )
        return seconds

    # --- speculation ----------------------------------------------------------------------------------------

    def measure_costs(self) -> dict[int, dict[int, float]]:
        """Time this context's micro-batches (``speculation.probe_points`` sizes, after ``PROBE_CONTEXT`` tokens)
        for each thread count the governor may use: the cost curve drafts are planned with. At load, with nothing
        running; returns {threads: {size: seconds}} ({} when speculation is off)."""
        if not self.speculation or self._seqs or self.draft_max < 2:
            return {}
        lib, slot = self.lib, self._slots[0]
        context = min(PROBE_CONTEXT, self.n_ctx // 2)
        points = probe_points(min(PROBE_MOST, self.n_ctx - context - 1, self.n_batch))
        ids = [(i * 7919 + 13) % self.n_vocab for i in range(context + points[-1])]  # any ids: only time counts
        lib.llama_memory_seq_rm(self.memory, slot.index, -1, -1)
        for begin in range(0, context, self.n_batch):
            part = ids[begin : min(begin + self.n_batch, context)]
            for i, token in enumerate(part):
                self._put(i, token, begin + i, slot.index, False)
            self._batch.n_tokens = len(part)
            if lib.llama_decode(self.ctx, self._batch) != 0:
                raise DecodeError(f"llama_decode failed while timing this context ({context} tokens of slot 0)")
        counts = [self.threads.most] + ([1] if self.threads.enabled and self.threads.most > 1 else [])
        measured: dict[int, dict[int, float]] = {}
        try:
            for threads in counts:
                lib.llama_set_n_threads(self.ctx, threads, threads)
                times: dict[int, float] = {}
                sizes = points if threads > 1 else tuple(p for p in points if p <= PROBE_MOST_ONE_THREAD)
                for size in (sizes[0], *sizes, *sizes):  # the fastest of two (a thread count's first warms it)
                    for i in range(size):
                        self._put(i, ids[context + i], context + i, slot.index, True)
                    self._batch.n_tokens = size
                    started = time.perf_counter()
                    code = lib.llama_decode(self.ctx, self._batch)
                    seconds = time.perf_counter() - started
                    times[size] = min(times.get(size, seconds), seconds)
                    lib.llama_memory_seq_rm(self.memory, slot.index, context, -1)
                    if code != 0:
                        raise DecodeError(f"llama_decode failed with {code} timing a batch of {size} tokens")
                self.costs.set(threads, times)
                measured[threads] = times
        finally:
            lib.llama_set_n_threads(self.ctx, self.threads.current, self.threads.current)
            lib.llama_memory_seq_rm(self.memory, slot.index, -1, -1)
            slot.cached.clear()
        return measured

    def _drafts(
        self, rows: list[_BatchSequence], chunks: Sequence[tuple[_BatchSequence, Sequence[int]]]
    ) -> dict[str, list[int]]:
        """This step's drafts, {sequence id: tokens}: each row's best source, priced by ``speculation.plan``, none
        past where the plain path would end on the context's length or ``max_tokens``.

        A sliding-window cache that keeps only the window (``swa_full`` false: ``windowed``) may reuse, for a later
        micro-batch of the same step, cells that an earlier one's positions put out of the window. So there every
        drafting sequence of a step drafts the same ``k`` (its draft rows then go in one micro-batch, from the first
        draft token on, and nothing its rollback needs can have been reused), and no step drafts beside a prompt
        chunk."""
        threads = self.threads.current
        chunk = sum(len(tokens) for _, tokens in chunks)
        if not self.costs.measured(threads) or self.draft_max < 2 or (self.windowed and chunk):
            return {}  # (a window's ring beside a prompt chunk: see the docstring)
        if not self.payoff.allows((len(rows), bool(chunk))):
            return {}  # drafting has not paid in steps of this shape (``speculation.Payoff``)
        cap = min(self.draft_max, (self.n_batch + self.parallel - len(rows) - chunk) // len(rows))
        if self.windowed:  # every drafting row's tokens in at most two micro-batches, the second from its draft on
            cap = min(cap, self.n_ubatch // len(rows) - 1)
        offers: dict[int, tuple[_BatchSequence, str, list[int]]] = {}
        candidates: list[Candidate] = []
        for seq in rows:
            drafter = seq.drafter
            # no more than it may still write, and its context's end as the plain path finds it (see _verify)
            room = min(cap, seq.max_tokens - seq.completion - 1, self.n_ctx - len(seq.slot.cached) - 3)
            if drafter is None or room < 2:
                continue
            best: tuple[float, str, list[int]] | None = None
            for kind, draft in drafter.proposals(self.history, room):
                q = self.acceptance.q(kind, drafter.own)
                if best is None or q > best[0]:
                    best = (q, kind, draft)
            if best is None or best[0] < Q_FLOOR:
                continue
            q, kind, draft = best
            draft = self._cut(seq, draft)
            if len(draft) >= 2:
                offers[seq.slot.index] = (seq, kind, draft)
                candidates.append(Candidate(seq.slot.index, q, len(draft)))
        if not candidates:
            return {}
        layout = [(seq.slot.index, 1) for seq in rows]
        layout += [(seq.slot.index, len(tokens)) for seq, tokens in chunks if tokens]
        chosen = plan(
            layout,
            len(rows),
            candidates,
            lambda size: self.costs.cost(threads, size),
            self.n_ubatch,
            exact_lengths=self.windowed,
            per_stream=not self.unified,
            draft_factor=self.costs.draft_factor(),
        )
        drafts: dict[str, list[int]] = {}
        for index, k in chosen.items():
            seq, kind, draft = offers[index]
            seq.draft_kind = kind
            drafts[seq.seq_id] = draft[:k]
        return drafts

    def _cut(self, seq: _BatchSequence, draft: list[int]) -> list[int]:
        """The draft up to its first end-of-generation token (the row before it shows whether the sequence ends)
        and, under a grammar, up to its first token the grammar refuses (a clone of it follows the draft)."""
        lib = self.lib
        for i, token in enumerate(draft):
            if lib.llama_vocab_is_eog(self.vocab, token):
                draft = draft[:i]
                break
        if seq.grammar is None or seq.thought is not None or not draft:
            return draft  # (while the thinking is open, each row's pick decides whether the grammar holds the next)
        clone = lib.llama_sampler_clone(seq.grammar)
        try:
            for i, token in enumerate(draft):
                if not self._allows(clone, token):
                    return draft[:i]
                lib.llama_sampler_accept(clone, token)
            return draft
        finally:
            lib.llama_sampler_free(clone)

    def _verify(self, seq: _BatchSequence) -> Delta | RequestError:
        """Sample the sequence's row, then each draft row while its picks repeat the draft; trim the cells of the rows
        no pick used; end it if it finished. One delta for all the tokens it wrote this step.

        Each pick is the one the plain path would make there (the same logits, the chain in the same state): a greedy
        text is the plain one (given the same logits: always with the batch-invariant build, otherwise the rows
        verified together are one more batch shape), a seeded draw draws the same values, and the kept tokens are
        distributed exactly as the plain path's (speculative sampling with a draft certain of its guess). Stop
        strings, logprobs and ``max_tokens`` apply to each pick as without drafts. ``llama_memory_seq_rm`` of the
        unused rows moves the cache's head back to the first freed cell, so the next token takes the place the
        plain path gives it."""
        draft, first = seq.draft, seq.row
        base = len(seq.slot.cached) - 1 - len(draft)  # its row's position
        deltas: list[Delta] = []
        error: RequestError | None = None
        accepted = used = 0
        for i in range(len(draft) + 1):
            seq.row, used = first + i, i
            result = self._sample(seq)
            if isinstance(result, RequestError):
                error = result
                break
            deltas.append(result)
            if seq.finished or seq.next_token is None:
                break
            if seq.drafter is not None:
                seq.drafter.observe(seq.next_token)
            if i < len(draft) and seq.next_token == draft[i]:
                seq.next_token = None  # its cell is in: the next row samples what follows it
                accepted += 1
                continue
            break
        keep = base + used + 1
        if len(seq.slot.cached) > keep:  # the rows after the last one sampled: their cells go
            self.lib.llama_memory_seq_rm(self.memory, seq.slot.index, keep, -1)
            del seq.slot.cached[keep:]
        seq.steps += 1
        if draft and seq.drafter is not None:
            missed = error is None and not seq.finished and accepted < len(draft)
            seq.drafter.outcome(self.acceptance, seq.draft_kind, len(draft), accepted, missed)
        seq.draft = []
        if seq.finished:
            self.drop(seq.seq_id)
        if error is not None:
            return error
        delta = deltas[0]
        if len(deltas) > 1:
            delta = msgspec.structs.replace(
                deltas[-1],
                text="".join(d.text for d in deltas),
                tokens=sum(d.tokens for d in deltas),
                logprobs=tuple(entry for d in deltas for entry in d.logprobs),
                ids=tuple(token for d in deltas for token in d.ids),
            )
        if delta.finish_reason is not None:
            delta = msgspec.structs.replace(delta, **_step_counts(seq))
        return delta

    def _embed_step(self) -> list[StepResult]:
        """The earliest queued embedding: its whole prompt in one decode (pooling needs a sequence's every token in
        one micro-batch), its pooled vector L2-normalised (as llama-server does by default), its cells freed."""
        seq = next(iter(self._seqs.values()), None)
        if seq is None:
            return []
        lib = self.lib
        for pos, token in enumerate(seq.prompt):
            self._put(pos, token, pos, seq.slot.index, True)  # pooling reads every token's output
        self._decode(len(seq.prompt))
        pointer = lib.llama_get_embeddings_seq(self.ctx, seq.slot.index)
        vector = np.ctypeslib.as_array(pointer, shape=(self.n_embd,)).astype(np.float64) if pointer else None
        lib.llama_memory_seq_rm(self.memory, seq.slot.index, -1, -1)
        self.drop(seq.seq_id)
        if vector is None:
            raise DecodeError(f"llama.cpp computed no pooled embedding for sequence {seq.slot.index}")
        norm = float(np.linalg.norm(vector))
        if norm > 0.0:
            vector /= norm
        final = Delta("", 0, "stop", len(seq.prompt), 0, embedding=tuple(vector.tolist()))
        return [(seq.seq_id, final)]

    def _sample(self, seq: _BatchSequence) -> Delta | RequestError:
        lib = self.lib
        if seq.thought is not None:  # (its forced tokens are the closing tag's: they end with the thinking)
            token = self._sample_thinking(seq)
        elif seq.grammar is not None and seq.output is not None:
            held = self._sample_constrained(seq)
            if held is None:
                seq.finished = True
                return RequestError(
                    f"the {'json_schema' if seq.ends_on_json else 'tool call'} grammar allows no token after "
                    f"{len(seq.output)} bytes of output "
                    f"({bytes(seq.output[-40:]).decode('utf-8', 'replace')!r} at its end): the schema cannot be "
                    "completed with this model's vocabulary"
                )
            token = held
        else:
            token = lib.llama_sampler_sample(seq.sampler, self.ctx, seq.row)
            seq.draws += 1
        finish: FinishReason | None = None
        logprobs: tuple[TokenLogprob, ...] = ()
        if lib.llama_vocab_is_eog(self.vocab, token):
            text, finish = seq.text.flush(), "stop"
            tokens = 0
            if seq.eog_entry and seq.logprobs is not None:
                logprobs = (self._logprob(seq.row, token, self._token_piece(token, special=True), seq.logprobs),)
        else:
            seq.completion += 1
            tokens = 1
            piece = self._token_piece(token, special=seq.special_pieces)
            if seq.logprobs is not None:
                logprobs = (self._logprob(seq.row, token, piece, seq.logprobs),)
            text, stopped = seq.text.feed(piece)
            if seq.thought is not None:
                self._thinking_wrote(seq, piece)
            elif seq.output is not None:
                seq.output += piece
            if stopped:
                finish = "stop"
            elif seq.output is not None and seq.ends_on_json and _json_done(seq.output, piece):
                text += seq.text.flush()
                finish = "stop"
            elif seq.completion >= seq.max_tokens or len(seq.slot.cached) + 1 >= self.n_ctx:
                text += seq.text.flush()
                finish = "length"
            else:
                seq.next_token = token
        if seq.echo is not None:  # the first delta: the prompt leads it
            text, logprobs, seq.echo = seq.echo + text, (*(seq.echoed or ()), *logprobs), None
            seq.echoed = None
        ids = (token,) if tokens else ()
        if finish is None:
            return Delta(text, tokens, logprobs=logprobs, ids=ids, draws=seq.draws, seed=seq.seed)
        seq.finished = True
        cached = min(seq.reused, seq.prompt_tokens)
        return Delta(
            text,
            tokens,
            finish,
            seq.prompt_tokens,
            seq.completion,
            logprobs=logprobs,
            cached_tokens=cached,
            ids=ids,
            draws=seq.draws,
            seed=seq.seed,
        )

    def _sample_thinking(self, seq: _BatchSequence) -> int:
        """A pick while the grammar waits for the thinking: the chain's, or the closing tag's next token where the
        pick would end the turn inside the block or begin the answer in the token that closes it."""
        lib, thought = self.lib, seq.thought
        assert thought is not None
        if seq.forced:
            token = seq.forced.pop(0)
        else:
            token, _ = self._draw(seq, self._logits(seq.row), None)
            after = self._after_tag(seq, self._token_piece(token, special=True)) if token >= 0 else None
            closes_into_answer = after is not None and bool(after.strip())
            spent = seq.completion >= thought.budget
            if spent or token < 0 or lib.llama_vocab_is_eog(self.vocab, token) or closes_into_answer:
                # (a token that closes the block and writes some of the answer after the tag: the grammar, which
                # starts after the tag, would not have held that part)
                seq.forced = list(thought.close)
                token = seq.forced.pop(0)
        lib.llama_sampler_accept(seq.sampler, token)
        return token

    @staticmethod
    def _after_tag(seq: _BatchSequence, piece: bytes) -> bytes | None:
        """What follows the closing tag once the thinking goes on by ``piece`` (None: the tag is not whole yet)."""
        assert seq.thought is not None
        tag = seq.thought.tag
        tail = seq.thought_tail + piece
        end = tail.find(tag)
        return None if end < 0 else tail[end + len(tag) :]

    def _thinking_wrote(self, seq: _BatchSequence, piece: bytes) -> None:
        """The thinking went on by ``piece``: once it holds the closing tag, the grammar holds the rest (the
        whitespace after the tag in the same piece is the answer's output)."""
        assert seq.thought is not None
        after = self._after_tag(seq, piece)
        if after is None:
            tail, keep = seq.thought_tail + piece, len(seq.thought.tag) - 1
            seq.thought_tail = tail[-keep:] if keep else b""
            return
        seq.thought, seq.thought_tail, seq.forced = None, b"", []
        seq.output = bytearray(after)

    def _prompt_logprobs(self, seq: _BatchSequence) -> None:
        """The entries of the prompt tokens this step's chunk rows predict: row ``i`` (position ``p``) gives the
        logprob of the prompt's token ``p + 1`` and the ``logprobs`` likeliest tokens there."""
        first, count, position = seq.chunk_rows
        seq.chunk_rows = (0, 0, 0)
        if seq.echoed is None or seq.logprobs is None:
            return
        for i in range(count):
            token = seq.prompt[position + i + 1]
            seq.echoed.append(self._logprob(first + i, token, self._token_piece(token, special=True), seq.logprobs))

    def _sample_constrained(self, seq: _BatchSequence) -> int | None:
        """Sample under the grammar as llama.cpp's common sampler does: the chain's pick if the grammar allows it,
        else the chain's pick among what the grammar allows; None when it allows nothing (accepting a token it
        refuses would abort the process in llama.cpp: that request alone fails).

        Checking one pick is cheap; masking every token's piece against the grammar costs more than a decode step,
        so it is done only when the pick is refused. A greedy choice is the same either way (the argmax, when the
        grammar allows it, is the argmax of the allowed); a seeded draw may differ from masking first, as in
        llama.cpp. A JSON sequence stops once its text is one complete value (``_json_done``): the grammar allows
        nothing after it but a space and end-of-generation."""
        lib = self.lib
        logits = self._logits(seq.row)
        token = self._allowed_argmax(seq.grammar, logits) if seq.plain_greedy else -1
        if token < 0:
            token, _ = self._draw(seq, logits, None)
        if token < 0 or not self._allows(seq.grammar, token):  # mask every token by the grammar, then the chain again
            token, logit = self._draw(seq, logits, seq.grammar)
            if token < 0 or not math.isfinite(logit):
                return None
        lib.llama_sampler_accept(seq.grammar, token)
        lib.llama_sampler_accept(seq.sampler, token)
        return token

    def _allowed_argmax(self, grammar: Any, logits: Any) -> int:
        """The likeliest token the grammar allows among the ``GREEDY_SEARCH`` likeliest (ties: the lowest id, as
        llama.cpp's greedy sampler picks), or -1 when it allows none of them. What masking the whole vocabulary
        and then taking the argmax gives, at a few checks instead of one per token of the vocabulary."""
        k = min(GREEDY_SEARCH, self.n_vocab)
        top = np.argpartition(-logits, k - 1)[:k]
        for token in top[np.lexsort((top, -logits[top]))]:
            if self._allows(grammar, int(token)):
                return int(token)
        return -1

    def _allows(self, grammar: Any, token: int) -> bool:
        """Whether the grammar, in its present state, allows ``token`` next (it is applied to that one candidate)."""
        return math.isfinite(self._apply_one(grammar, token))

    def _apply_one(self, sampler: Any, token: int) -> float:
        """Apply ``sampler`` to ``token`` as the only candidate (logit 1.0); the logit it leaves (-inf: refused)."""
        one, data = self._one, self._one_data
        data.id, data.logit, data.p = token, 1.0, 0.0
        one.data, one.size, one.selected, one.sorted = ctypes.pointer(data), 1, -1, False
        self.lib.llama_sampler_apply(sampler, ctypes.byref(one))
        return float(data.logit)

    def _draw(self, seq: _BatchSequence, logits: Any, grammar: Any) -> tuple[int, float]:
        """Apply ``grammar`` (if any), then ``seq``'s chain, to every token's logit: the selected (token, logit), or
        (-1, -inf) when the chain selected nothing. Accepts nothing; counts the chain's draw (``seq.draws``, by
        which a resume restores a seeded draw)."""
        lib = self.lib
        if self._candidates is None:
            self._candidates = (lib.llama_token_data * self.n_vocab)()
            self._candidate_view = np.ctypeslib.as_array(self._candidates)
        view = self._candidate_view
        view["id"] = self._ids
        view["logit"] = logits
        view["p"] = 0.0
        array = lib.llama_token_data_array(
            ctypes.cast(self._candidates, ctypes.POINTER(lib.llama_token_data)), self.n_vocab, -1, False
        )
        if grammar is not None:
            lib.llama_sampler_apply(grammar, ctypes.byref(array))
        lib.llama_sampler_apply(seq.sampler, ctypes.byref(array))
        seq.draws += 1
        if not 0 <= array.selected < array.size:
            return -1, -math.inf
        chosen = array.data[array.selected]
        return int(chosen.id), float(chosen.logit)

    def _logits(self, row: int) -> Any:
        """The raw logits of a batch row: a numpy view of llama.cpp's buffer (valid until the next decode)."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))

    def _logprob(self, row: int, token: int, piece: bytes, n: int) -> TokenLogprob:
        """The chosen token's log-probability under the raw distribution at ``row`` and the ``n`` likeliest tokens
        there (descending; ties by token id). Alternatives are rendered with special tokens named (``<|im_end|>``);
        the chosen token's text is exactly what it added to the output.

        *Raw*: the log-softmax of the logits ``llama_decode`` produced, before penalties, bias, grammar and truncation
        (vLLM's default; llama-server's ``post_sampling_probs: false``), computed on a view of llama.cpp's row. So a
        token the grammar or a bias forced can have a low logprob, and a greedy pick is the top-1 alternative only
        when nothing but the model shaped it."""
        logits = self._logits(row)
        top = float(logits.max())
        log_z = top + math.log(float(np.exp(logits - top).sum(dtype=np.float64)))
        alternatives: tuple[TopLogprob, ...] = ()
        if n > 0:
            k = min(n, self.n_vocab)
            ids = np.argpartition(-logits, k - 1)[:k]
            ids = ids[np.lexsort((ids, -logits[ids]))]
            alternatives = tuple(self._top(int(i), float(logits[i]) - log_z) for i in ids)
        logprob = min(float(logits[token]) - log_z, 0.0)
        return TokenLogprob(piece.decode("utf-8", errors="replace"), logprob, piece, alternatives)

    def _top(self, token: int, logprob: float) -> TopLogprob:
        piece = self._token_piece(token, special=True)
        return TopLogprob(piece.decode("utf-8", errors="replace"), min(logprob, 0.0), piece)

    def piece(self, token: int, special: bool = True) -> bytes:
        """A token's bytes (``special``: a special token written out, ``<|im_end|>``, rather than as nothing)."""
        return self._token_piece(token, special)

    def _token_piece(self, token: int, special: bool) -> bytes:
        size = self.lib.llama_token_to_piece(self.vocab, token, self._piece, PIECE_BUFFER, 0, special)
        if size >= 0:
            return self._piece.raw[:size]
        buffer = ctypes.create_string_buffer(-size)  # a piece longer than the buffer: llama.cpp says how long
        size = self.lib.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, special)
        return buffer.raw[: max(size, 0)]

    def _sampler(self, sampling: Sampling, prompt: Sequence[int]) -> tuple[Any, Any]:
        """The sequence's chain and its grammar sampler apart (None without ``grammar``); ``RequestError`` for a
        grammar llama.cpp cannot parse.

        The chain, in order: ``logit_bias``; the repeat penalty over the last ``PENALTY_LAST_N`` tokens the model saw
        (the prompt's tail included, as llama.cpp does); ``frequency_penalty`` and ``presence_penalty`` over the
        completion so far (OpenAI's definition: the prompt not counted); then greedy at temperature 0, else top-k,
        top-p, min-p, temperature and a seeded draw. Each stage is left out when neutral, so a plain request pays for
        none. The grammar is applied apart (``_sample_constrained``)."""
        lib = self.lib
        grammar: Any = None
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        add = lib.llama_sampler_chain_add
        try:
            if sampling.logit_bias:
                biases = (lib.llama_logit_bias * len(sampling.logit_bias))(
                    *(lib.llama_logit_bias(token, bias) for token, bias in sampling.logit_bias)
                )
                add(chain, lib.llama_sampler_init_logit_bias(self.n_vocab, len(biases), biases))  # copies them
            if sampling.repeat_penalty != 1.0:
                repeat = lib.llama_sampler_init_penalties(
                    self.n_vocab, PENALTY_LAST_N, sampling.repeat_penalty, 0.0, 0.0
                )
                add(chain, repeat)
                for token in prompt[-PENALTY_LAST_N:]:  # the last 64 tokens the model saw, as llama.cpp counts
                    lib.llama_sampler_accept(repeat, token)
            if sampling.frequency_penalty != 0.0 or sampling.presence_penalty != 0.0:
                add(
                    chain,
                    lib.llama_sampler_init_penalties(
                        self.n_vocab, self.n_ctx, 1.0, sampling.frequency_penalty, sampling.presence_penalty
                    ),
                )
            if sampling.grammar is not None:
                root = sampling.grammar_root.encode()
                grammar = lib.llama_sampler_init_grammar(self.vocab, sampling.grammar.encode("utf-8"), root)
                if not grammar:
                    what = "this json_schema" if sampling.ends_on_json else "these tools' parameter schemas"
                    raise RequestError(
                        f"llama.cpp could not build a grammar from {what} (its parser's reason is in the "
                        "runner's stderr): simplify the schema"
                    )
            if sampling.temperature <= 0.0:
                add(chain, lib.llama_sampler_init_greedy())
            else:
                top_k = TOP_K if sampling.top_k is None else sampling.top_k
                min_p = MIN_P if sampling.min_p is None else sampling.min_p
                if top_k > 0:
                    add(chain, lib.llama_sampler_init_top_k(min(top_k, self.n_vocab)))
                add(chain, lib.llama_sampler_init_top_p(sampling.top_p, 1))
                if min_p > 0.0:
                    add(chain, lib.llama_sampler_init_min_p(min_p, 1))
                add(chain, lib.llama_sampler_init_temp(sampling.temperature))
                add(chain, lib.llama_sampler_init_dist(sampling.seed & 0xFFFFFFFF))
        except BaseException:
            lib.llama_sampler_free(chain)  # and every sampler added to it
            if grammar:
                lib.llama_sampler_free(grammar)
            raise
        return chain, grammar


def _step_counts(seq: _BatchSequence) -> dict[str, int]:
    """A final delta's step and draft counts for ``seq`` (``Delta``'s fields)."""
    drafter = seq.drafter
    return {
        "decode_steps": seq.steps,
        "draft_tokens": drafter.drafted if drafter else 0,
        "draft_accepted": drafter.accepted if drafter else 0,
        "prediction_accepted": drafter.prediction_accepted if drafter else 0,
        "prediction_rejected": drafter.prediction_rejected if drafter else 0,
    }


def _plain_greedy(sampling: Sampling) -> bool:
    """Whether the chain is the greedy argmax of the raw logits and nothing else."""
    return (
        sampling.temperature <= 0.0
        and not sampling.logit_bias
        and sampling.repeat_penalty == 1.0
        and sampling.frequency_penalty == 0.0
        and sampling.presence_penalty == 0.0
    )


def _json_done(output: bytes | bytearray, piece: bytes) -> bool:
    """Whether ``output`` is one complete JSON value that only whitespace could follow: it ends in a byte that
    closes a value nothing can extend, or (a number) the grammar has just let a space end it."""
    end = output.rstrip()
    if not end or (end[-1] not in JSON_VALUE_ENDS and not piece.isspace()):
        return False
    try:
        json.loads(bytes(output))
    except ValueError:
        return False
    return True
