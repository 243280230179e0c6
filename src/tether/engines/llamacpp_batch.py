"""The llama.cpp step loop: several sequences decoded in one ``llama_decode`` batch per step (continuous batching).

One llama.cpp context holds ``parallel`` sequences, each in a *slot* (a sequence id with its own KV cells: the
cache is not unified, so a sequence attends only to its own cells and ``n_ctx`` is per sequence). Each step builds
one batch: the last sampled token of every decoding sequence (one row each, logits on) and a chunk of one
prefilling sequence's prompt (the earliest admitted). While any sequence decodes, that chunk is at most
``prefill_chunk`` tokens, so a long prompt arriving mid-stream delays the running streams by one short chunk per step
instead of its whole prefill; with nothing decoding, it is up to ``n_batch`` tokens. One prompt per step, not
several: measured here, prompts of several sequences prefilled in one batch change llama.cpp's arithmetic enough
to flip a greedy choice (4 of 8 chat prompts together: one of them diverged after ~40 tokens), while one prompt
beside decode rows gives exactly the text of the one-at-a-time path; the cost is at most one step of first-token
latency per request queued ahead in the same burst. Every sequence samples with its own
sampler chain (its temperature, top_p and seed), decodes its pieces with its own ``TextStream`` (UTF-8 and stop
strings), and ends on end-of-generation, a stop string, ``max_tokens`` or its context.

A slot keeps the tokens its cells hold after its sequence ends: the next request placed there reuses the longest
common prefix (a chat's system prompt, a conversation's history) and prefills only the rest, as llama.cpp's own
server does. A request goes to the free slot with the longest common prefix, the lowest on a tie. The price, as
with llama-server's ``cache_prompt``: a reused prefix's cells were computed in another batch, so a greedy answer can
(rarely) differ from the one a cold cache gives — measured here, 2 of 8 prompts differed across 48 requests with
reuse, none without. Batching itself changes no text. ``prompt_cache=False`` prefills every prompt whole, for texts
that depend on nothing but the request. (llama.cpp
splits a batch over separate caches into one pass per run of consecutive sequence ids, so a gap among the busy slots
costs a second pass; measured here, decoding is compute-bound on a CPU, so that costs far less than re-prefilling a
prompt the cache already holds.) Decode rows go into the batch in slot order for the same reason.

Only the thread that owns the engine touches any of this (llama.cpp contexts are not thread-safe).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tether.engines.base import Delta, RequestError, StepResult
from tether.engines.text import TextStream
from tether.errors import TetherError
from tether.protocol import FinishReason

TOP_K, MIN_P = 40, 0.05  # llama-cpp-python's and llama-server's defaults, for temperature > 0
PENALTY_LAST_N = 64  # llama-cpp-python's last_n_tokens_size
PIECE_BUFFER = 256


class DecodeError(TetherError):
    """``llama_decode`` failed: the context's state is unknown, so this is fatal for the runner."""


@dataclass
class Sampling:
    """One sequence's sampling parameters."""

    temperature: float
    top_p: float
    seed: int
    repeat_penalty: float


@dataclass
class _Slot:
    index: int  # the llama.cpp sequence id
    cached: list[int] = field(default_factory=list)  # tokens whose KV cells this slot holds, in order


@dataclass
class _Sequence:
    seq_id: str
    slot: _Slot
    prompt: list[int]
    prefilled: int  # prompt tokens in the slot's cells
    max_tokens: int
    text: TextStream
    sampler: Any
    completion: int = 0
    next_token: int | None = None  # sampled, not yet decoded: goes into the next step's batch
    row: int = -1  # this step: the batch row whose logits it samples from (-1: none)

    @property
    def decoding(self) -> bool:
        return self.next_token is not None


class Batch:
    """The step loop over one llama.cpp context (see the module docstring)."""

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
        unified: bool = False,
    ) -> None:
        self.lib = lib
        self.vocab = vocab
        self.parallel = parallel
        self.n_ctx = n_ctx  # per sequence
        self.n_batch = n_batch
        self.prefill_chunk = prefill_chunk
        self.prompt_cache = prompt_cache
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx * parallel
        params.n_batch = n_batch + parallel  # a step: up to parallel decode rows, plus up to n_batch prompt tokens
        params.n_ubatch = min(n_batch, 512)
        params.n_seq_max = parallel
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.kv_unified = unified  # each sequence attends to its own cells only
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as the Llama class builds its context
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(
                f"llama.cpp could not create a context of {n_ctx * parallel} cells ({parallel} sequences of "
                f"{n_ctx}): lower parallel or n_ctx (the stderr tail has llama.cpp's reason)"
            )
        self.memory = lib.llama_get_memory(self.ctx)
        self._batch = lib.llama_batch_init(n_batch + parallel, 0, 1)
        self._slots = [_Slot(i) for i in range(parallel)]
        self._seqs: dict[str, _Sequence] = {}
        self._piece = ctypes.create_string_buffer(PIECE_BUFFER)

    # --- sequences ------------------------------------------------------------------------------------------

    def start(
        self, seq_id: str, prompt: Sequence[int], max_tokens: int, stops: Sequence[str], sampling: Sampling
    ) -> None:
        """Place a sequence in the free slot that shares the longest prefix with ``prompt`` (its first token comes
        with a later step). The caller has checked the prompt fits the context."""
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id!r} is already running")
        busy = {seq.slot.index for seq in self._seqs.values()}
        free = [slot for slot in self._slots if slot.index not in busy]
        if not free:
            raise RuntimeError(f"the batch is full ({self.parallel} sequences): a sequence must end first")
        slot = max(free, key=lambda s: (_common_prefix(s.cached, prompt), -s.index))
        keep = min(_common_prefix(slot.cached, prompt), len(prompt) - 1) if self.prompt_cache else 0
        # (the last prompt token is always decoded again: its logits make the first token)
        if not self.lib.llama_memory_seq_rm(self.memory, slot.index, keep, -1):
            self.lib.llama_memory_seq_rm(self.memory, slot.index, -1, -1)
            keep = 0
        del slot.cached[keep:]
        self._seqs[seq_id] = _Sequence(
            seq_id, slot, list(prompt), keep, max_tokens, TextStream(stops), self._sampler(sampling)
        )

    def drop(self, seq_id: str) -> tuple[int, int] | None:
        """End a sequence now; returns its (prompt, completion) token counts, None when it is not running."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        self.lib.llama_sampler_free(seq.sampler)
        return len(seq.prompt), seq.completion

    def active(self) -> int:
        return len(self._seqs)

    def clear(self) -> None:
        """Forget every slot's cached tokens (after warm-up: the next requests start from empty cells)."""
        self.lib.llama_memory_clear(self.memory, True)
        for slot in self._slots:
            slot.cached.clear()

    # --- the step -------------------------------------------------------------------------------------------

    def step(self) -> list[StepResult]:
        """One ``llama_decode``: a token for every decoding sequence, prompt chunks for the prefilling ones."""
        lib, batch = self.lib, self._batch
        n = 0
        decoding = sorted((seq for seq in self._seqs.values() if seq.decoding), key=lambda seq: seq.slot.index)
        for seq in decoding:
            token = seq.next_token
            assert token is not None
            self._put(n, token, len(seq.slot.cached), seq.slot.index, True)
            seq.slot.cached.append(token)
            seq.next_token = None
            seq.row = n
            n += 1
        budget = min(self.n_batch, self.prefill_chunk) if decoding else self.n_batch
        prefilling = next((seq for seq in self._seqs.values() if seq.prefilled < len(seq.prompt)), None)
        if prefilling is not None and budget > 0:  # one prompt per step: see the module docstring
            seq = prefilling
            chunk = seq.prompt[seq.prefilled : seq.prefilled + budget]
            for i, token in enumerate(chunk):
                self._put(n, token, seq.prefilled + i, seq.slot.index, False)
                n += 1
            seq.slot.cached.extend(chunk)
            seq.prefilled += len(chunk)
            if seq.prefilled == len(seq.prompt):  # the prompt's last token: its logits make the first token
                batch.logits[n - 1] = 1
                seq.row = n - 1
            else:
                seq.row = -1
        if n == 0:
            return []
        batch.n_tokens = n
        code = lib.llama_decode(self.ctx, batch)
        if code != 0:
            raise DecodeError(
                f"llama_decode failed with {code} for a batch of {n} tokens over {len(self._seqs)} sequences "
                f"({'no free KV cells' if code == 1 else 'see the stderr tail'})"
            )
        results: list[StepResult] = []
        for seq in list(self._seqs.values()):
            if seq.row >= 0:
                results.append((seq.seq_id, self._sample(seq)))
                seq.row = -1
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

    def _put(self, row: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch = self._batch
        batch.token[row] = token
        batch.pos[row] = pos
        batch.n_seq_id[row] = 1
        batch.seq_id[row][0] = seq
        batch.logits[row] = 1 if logits else 0

    def _sample(self, seq: _Sequence) -> Delta | RequestError:
        lib = self.lib
        token = lib.llama_sampler_sample(seq.sampler, self.ctx, seq.row)
        finish: FinishReason | None = None
        if lib.llama_vocab_is_eog(self.vocab, token):
            text, finish = seq.text.flush(), "stop"
            tokens = 0
        else:
            seq.completion += 1
            tokens = 1
            size = lib.llama_token_to_piece(self.vocab, token, self._piece, PIECE_BUFFER, 0, False)
            text, stopped = seq.text.feed(self._piece.raw[: max(size, 0)])
            if stopped:
                finish = "stop"
            elif seq.completion >= seq.max_tokens or len(seq.slot.cached) + 1 >= self.n_ctx:
                text += seq.text.flush()
                finish = "length"
            else:
                seq.next_token = token
        if finish is None:
            return Delta(text, tokens)
        self.drop(seq.seq_id)
        return Delta(text, tokens, finish, len(seq.prompt), seq.completion)

    def _sampler(self, sampling: Sampling) -> Any:
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        add = lib.llama_sampler_chain_add
        if sampling.repeat_penalty != 1.0:
            n_vocab = lib.llama_vocab_n_tokens(self.vocab)
            add(chain, lib.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N, sampling.repeat_penalty, 0.0, 0.0))
        if sampling.temperature <= 0.0:
            add(chain, lib.llama_sampler_init_greedy())
        else:
            add(chain, lib.llama_sampler_init_top_k(TOP_K))
            add(chain, lib.llama_sampler_init_top_p(sampling.top_p, 1))
            add(chain, lib.llama_sampler_init_min_p(MIN_P, 1))
            add(chain, lib.llama_sampler_init_temp(sampling.temperature))
            add(chain, lib.llama_sampler_init_dist(sampling.seed & 0xFFFFFFFF))
        return chain


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
