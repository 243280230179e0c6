"""What a llama.cpp runner of a GGUF model needs at its peak, from the file's header (the engine's estimator).

The parts (``ModelEstimate``, host memory with the engine's CPU settings): weights, KV cache, runtime (a base, the
tokenizer's tables, one micro-batch's scratch), an embedding instance's outputs, the prompt cache's RAM store and
headroom. ``held`` is what the runner holds at its peak (what a measurement is compared with); ``expected`` adds the
RAM store, which fills as it serves and which the fit check reserves. ``layer_plan`` and ``assign_layers`` put layers
on ranks or GPUs; ``offloaded`` and ``fit_layers`` split an estimate between the host and the GPUs. The rules an edit
must keep: every size follows llama.cpp's own rule (cell padding, a sliding window's cells, the layer split and its
float arithmetic); what the header shows but the estimate leaves out is said in ``notes``; a change is checked
against a runner's measured peak (``tests/test_fit.py``). Each part, and the figures: docs/design.md, "The memory
estimate".
"""

from __future__ import annotations

import bisect
import importlib.util
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tether.engines.gguf import CACHE_TYPES, TYPE_SIZES, GgufArray, GgufError, GgufFile, read_gguf, split_parts
from tether.models import default_model_path
from tether.protocol import EngineSpec, RankInfo
from tether.units import format_bytes, parse_size

MiB = 1 << 20

DEFAULT_HEADROOM = 128 * MiB
"""Margin added to every estimate for what the model leaves out (allocator slack, request buffers, thread stacks)."""

RUNTIME_BASE = 50 * MiB
"""Interpreter, tether's runner, llama.cpp/ggml/numpy libraries and llama.cpp's context (measured: 68 MiB of ready
RSS beyond weights and KV cache for the default model, of which 18 MiB is its 49152-entry vocabulary)."""

VOCAB_BYTES_PER_TOKEN = 169
"""Tokenizer tables per vocabulary entry (measured as the RSS llama.cpp adds loading a vocabulary alone, what the
estimate is compared with: +42.2 MiB for Gemma 3's 262,144 entries, a tokenizer without merges)."""

VOCAB_BYTES_PER_MERGE = 207
"""A BPE tokenizer's merge table per merge rule (measured the same way: +17.6 MiB for the default model's 49,152
entries and 48,900 merges, of which the entries take 7.9 MiB at :data:`VOCAB_BYTES_PER_TOKEN`)."""

CUDA_CONTEXT = 512 * MiB
"""VRAM a runner holds on each device it uses before any tensor: the CUDA context, cuBLAS's handle and workspace
and ggml's memory pools (a CUDA context alone is ~300-500 MiB on a Hopper GPU; checked against ``nvidia-smi`` by
``bench/gpu.py --engine llama.cpp``)."""

CUDA_HOST = 256 * MiB
"""Host memory a runner of a CUDA build holds beyond a CPU build's: the CUDA runtime and cuBLAS libraries mapped and
initialised, and pinned staging buffers."""

GPU_MARGIN = 1024 * MiB
"""VRAM the automatic split leaves free on each device (llama.cpp's ``--fit`` leaves 1 GiB too): other processes'
allocations move, and a step's scratch may grow past the model's estimate."""

ATTENTION_BYTES_PER_SCORE = 6
"""Scratch per attention score (n_ubatch x n_ctx x query heads): the f32 scores in the compute buffer plus their f16
copy in the CPU backend's work buffer (measured 5.8-6.2 bytes)."""

DEFAULT_N_BATCH = 512  # the llama.cpp engine's n_batch default
MAX_N_UBATCH = 512  # llama-cpp-python's n_ubatch default: micro-batches are min(n_batch, 512) tokens
KV_CELL_PADDING = 256  # llama.cpp rounds the context up to a multiple of this many KV cells

SWA_PERIODS: Mapping[str, int] = MappingProxyType({"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2})
"""llama.cpp's sliding-window layer pattern by architecture, where the GGUF does not say it
(``{arch}.attention.sliding_window_pattern``): of every ``n`` layers the first ``n - 1`` slide (``set_swa_pattern``).
Gemma 3: 5 of every 6 (270M: 15 of 18 layers over 512 tokens)."""

AUTO_CTX_CAP = 8192
"""n_ctx "auto" (the default) is the model's trained context up to this many cells per sequence: every sequence's
cache is allocated and cleared at load (8 sequences x 8192 cells are 1.4 GiB for the default model), so a model
trained for 128K does not take its whole context eight times over unless ``--n-ctx`` asks for it. Open WebUI's
default chat with its built-in tools is a ~6,600-token prompt."""

AUTO_CTX_CAP_EMBEDDING = 2048
"""n_ctx "auto" of an embedding instance: its outputs grow with n_ctx x n_vocab (``embedding_outputs``)."""

_DEFAULT_CTX_NOTE = "n_ctx not given: using the model's context length"
_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelShape:
    """What the estimate uses from the metadata (``{arch}.*`` keys). Per-layer values are tuples."""

    architecture: str
    n_layers: int
    context_length: int | None  # the length the model was trained for
    n_embd: int
    n_ff: int
    n_head: tuple[int, ...]  # query heads per layer
    n_head_kv: tuple[int, ...]  # key/value heads per layer (0 for a layer without attention)
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    sliding_window: int | None = None
    n_merges: int = 0  # a BPE tokenizer's merge rules
    swa_layers: tuple[bool, ...] = ()  # per layer: its cache slides over ``sliding_window`` tokens (empty: unknown)


@dataclass(frozen=True)
class ModelEstimate:
    """Memory a llama.cpp runner of this model needs at its peak, in bytes, and where each part comes from."""

    path: Path
    shape: ModelShape
    weights: int
    file_size: int
    tensor_types: Mapping[str, int]  # ggml type -> bytes of tensor data of that type
    n_ctx: int  # as configured (or the model's own); the KV cache holds n_ctx_cells
    n_ctx_cells: int
    n_ctx_from_model: bool  # n_ctx was not given: the model's context length is used
    cache_type: str
    n_batch: int
    n_ubatch: int
    kv_cache: int  # all parallel sequences' caches
    runtime_base: int  # interpreter, libraries, tokenizer
    compute: int  # attention or feed-forward scratch of one micro-batch
    headroom: int
    notes: tuple[str, ...] = field(default=())
    parallel: int = 1  # sequences served at once, each with n_ctx cells
    embedding: bool = False  # an embedding instance: one prompt in n_ctx cells, its micro-batch the whole prompt
    outputs: int = 0  # an embedding instance's logits (and vectors) of a whole prompt, in the output buffer
    prompt_cache_ram: int = 0  # the budget of sequences the prompt cache may save to RAM (held as it fills)
    prompt_cache_ram_auto: bool = False  # that budget is "auto": the KV cache's size at most, the room left at most
    unified: bool = False  # one pool of cells for every sequence (option kv_unified)
    swa_full: bool = False  # sliding-window layers keep every position (llama.cpp's swa_full)
    swa_cells: int = 0  # cells a sliding-window layer keeps per stream (0: none such layer modelled)
    layer_weights: tuple[int, ...] = ()  # bytes of each repeating layer's tensors, then the output layer's
    input_weights: int = 0  # the input embeddings and what belongs to no layer (always on rank 0)
    tied_output: int = 0  # a tied output layer's copy of the input embeddings, on a rank that is not rank 0
    layer_kv: tuple[int, ...] = ()  # each repeating layer's share of kv_cache
    rank: int | None = None  # this estimate is one rank's of a split instance (None: the whole model)
    shares: tuple[float, ...] = ()  # every rank's share of the layers (relative), with ``rank``
    layers: tuple[int, ...] = ()  # the layers this rank holds (n_layers is the output layer), with ``rank``
    offload: Offload | None = None  # layers on GPUs: this estimate is then the host's share (see ``offloaded``)

    @property
    def runtime(self) -> int:
        return self.runtime_base + self.compute

    @property
    def held(self) -> int:
        """What the runner holds at its peak before its prompt cache saves anything to RAM (what a measurement of a
        runner is compared with)."""
        return self.weights + self.kv_cache + self.runtime + self.outputs

    @property
    def expected(self) -> int:
        """What the runner may hold at its peak: ``held`` plus the RAM store filled to its budget (room the fit
        reserves for it), without the headroom."""
        return self.held + self.prompt_cache_ram

    @property
    def total(self) -> int:
        return self.expected + self.headroom

    @property
    def architecture(self) -> str:
        return self.shape.architecture

    def describe(self) -> str:
        """``needs ~X (weights A + KV cache B at n_ctx N + runtime C + headroom D)``."""
        ctx = f"the model's n_ctx {self.n_ctx}" if self.n_ctx_from_model else f"n_ctx {self.n_ctx}"
        if self.parallel > 1 and not self.embedding:
            ctx += f" x parallel {self.parallel}"
        cache = "" if self.cache_type == "f16" else f" ({self.cache_type})"
        if self.swa_cells:
            sliding = sum(self.shape.swa_layers)
            ctx += f", {sliding} of {self.shape.n_layers} layers in a {self.swa_cells}-cell sliding window"
        kind = "embeddings: every token's logits" if self.embedding else "speculation: every draft row's logits"
        outputs = f" + outputs {format_bytes(self.outputs)} ({kind})" if self.outputs else ""
        if self.prompt_cache_ram:
            outputs += f" + prompt cache in RAM up to {format_bytes(self.prompt_cache_ram)} (held as it fills)"
        weights = f"weights {format_bytes(self.weights)}"
        if self.rank is not None:
            weights = f"{layers_words(self.layers, self.shape.n_layers)}: {weights}"
        gpu = f"; {self.offload.describe()}" if self.offload is not None and self.offload.n_gpu_layers else ""
        host = "on the host " if gpu else ""
        return (
            f"needs ~{format_bytes(self.total)} {host}({weights} + KV cache"
            f"{cache} {format_bytes(self.kv_cache)} at {ctx} + runtime {format_bytes(self.runtime)}{outputs} + "
            f"headroom {format_bytes(self.headroom)}){gpu}"
        )

    @property
    def subject(self) -> str:
        if self.rank is None:
            return self.path.name
        return f"rank {self.rank} of {len(self.shares)} of {self.path.name}"

    def advice(self, available: int) -> str:
        """What to do when this does not fit ``available`` bytes: less prompt cache in RAM when that is enough, the
        largest n_ctx that would fit, if any."""
        cache = self.prompt_cache_ram
        if cache and self.total - cache <= available:
            return (
                f"lower --prompt-cache-ram (the option prompt_cache_ram: its {format_bytes(cache)} are counted; "
                f"{format_bytes(max(0, available - (self.total - cache)))} or less fits), free memory, or pass "
                "--force to load anyway"
            )
        best = self.max_n_ctx(available)
        if best is not None:
            fewer = " or a smaller --parallel" if self.parallel > 1 and not self.embedding else ""
            return f"use a smaller --n-ctx (up to {best} fits){fewer}, free memory, or pass --force to load anyway"
        smallest = self.with_n_ctx(KV_CELL_PADDING)
        if smallest.total > available:
            return (
                f"even n_ctx {KV_CELL_PADDING} {smallest.describe()}: free memory, use a smaller or more quantized "
                "model, or pass --force to load anyway"
            )
        return "use a smaller --n-ctx, free memory, or pass --force to load anyway"

    def within(self, available: int) -> ModelEstimate:
        """This estimate with an "auto" RAM store's budget lowered to the room the rest leaves in ``available``
        (none when the rest does not fit): a cache takes what is left, it never makes a model not fit."""
        if not self.prompt_cache_ram_auto or self.total <= available:
            return self
        return replace(self, prompt_cache_ram=max(0, available - (self.total - self.prompt_cache_ram)))

    def max_n_ctx(self, available: int) -> int | None:
        """The largest n_ctx below this one, in steps of 256, that fits ``available`` (memory grows with n_ctx; an
        "auto" RAM store shrinks first)."""
        lo, hi = 1, (self.n_ctx - 1) // KV_CELL_PADDING  # candidates are k * 256 for lo <= k <= hi
        if hi < lo or self.with_n_ctx(lo * KV_CELL_PADDING).within(available).total > available:
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.with_n_ctx(mid * KV_CELL_PADDING).within(available).total <= available:
                lo = mid
            else:
                hi = mid - 1
        return lo * KV_CELL_PADDING

    def with_n_ctx(self, n_ctx: int) -> ModelEstimate:
        """The same model at another context size (no file read)."""
        notes = tuple(n for n in self.notes if not n.startswith(_DEFAULT_CTX_NOTE))
        return _estimate(replace(self, notes=notes), n_ctx=n_ctx, n_ctx_from_model=False)

    def offloaded(
        self,
        n_gpu_layers: int,
        devices: Sequence[int] = (0,),
        split: Sequence[float] = (),
        budgets: Sequence[int | None] = (),
        *,
        auto: bool = False,
    ) -> ModelEstimate:
        """This model with its last ``n_gpu_layers`` on the GPUs ``devices`` (shared by relative ``split``, equal
        when empty; ``budgets``: what each device may use, for the message): the host's share, with ``offload``
        saying what each device needs. 0 layers: the whole model on the host, no GPU used."""
        whole = self.whole()
        if whole.rank is not None:
            raise ValueError("a rank of a split instance offloads nothing: its layers are the ranks' (layer_split)")
        n_layers = whole.shape.n_layers
        count = max(0, min(n_gpu_layers, n_layers + 1))
        if not count:
            return replace(whole, offload=Offload(0, n_layers + 1, tuple(devices), (), (), (), (), auto))
        shares = tuple(split) if split else (1.0,) * len(devices)
        placed = assign_layers(n_layers + 1, n_layers + 1 - count, shares)
        vram = []
        for layers in placed:
            blocks = [i for i in layers if i < n_layers]
            scratch = whole.compute if blocks else whole.n_ubatch * whole.shape.n_vocab * 4 if layers else 0
            vram.append(
                (CUDA_CONTEXT if layers else 0)
                + sum(whole.layer_weights[i] for i in layers)
                + (whole.tied_output if n_layers in layers else 0)
                + sum(whole.layer_kv[i] for i in blocks)
                + scratch
            )
        on_gpu = {i for layers in placed for i in layers}
        host_blocks = [i for i in range(n_layers) if i not in on_gpu]
        offload = Offload(count, n_layers + 1, tuple(devices), shares, tuple(placed), tuple(vram), tuple(budgets), auto)
        return replace(
            whole,
            offload=offload,
            weights=whole.input_weights + sum(whole.layer_weights[i] for i in range(n_layers + 1) if i not in on_gpu),
            kv_cache=sum(whole.layer_kv[i] for i in host_blocks),
            runtime_base=whole.runtime_base + CUDA_HOST,
            # the host still embeds the input rows; without a layer of its own it needs no attention scratch
            compute=whole.compute if host_blocks else whole.n_ubatch * whole.shape.n_embd * 4,
        )

    def whole(self) -> ModelEstimate:
        """This model with nothing offloaded (the host holds every layer)."""
        if self.offload is None:
            return self
        return _estimate(replace(self, offload=None), n_ctx=self.n_ctx, n_ctx_from_model=self.n_ctx_from_model)


def estimate_gguf(
    path: str | os.PathLike[str],
    n_ctx: int | None = None,
    cache_type: str = "f16",
    headroom: int = DEFAULT_HEADROOM,
    *,
    n_batch: int = DEFAULT_N_BATCH,
    parallel: int = 1,
    embedding: bool = False,
    prompt_cache_ram: int | None = 0,
    auto_ctx: bool = False,
    unified: bool = False,
    swa_full: bool = False,
) -> ModelEstimate:
    """Estimate what loading the GGUF model at ``path`` with the llama.cpp engine needs (``ModelEstimate``;
    ``embedding``: for an embedding instance; ``prompt_cache_ram``: the prompt cache's RAM budget, None for
    "auto"; ``unified``: one pool of cells for every sequence; ``swa_full``: sliding-window layers keep every
    position).

    ``n_ctx`` None means the model's own context length (``{arch}.context_length``; ``describe`` says so), or with
    ``auto_ctx`` what the engine's n_ctx "auto" makes of it (``auto_context``: capped; the header is read once).
    ``cache_type`` is the KV cache element type (one of :data:`CACHE_TYPES`). Raises :class:`GgufError` for a file
    that is not a readable GGUF model or lacks the metadata needed, and ``ValueError`` for bad arguments.
    """
    if cache_type.lower() not in CACHE_TYPES:
        raise ValueError(f"unknown KV cache type {cache_type!r}: use one of {', '.join(CACHE_TYPES)}")
    if headroom < 0 or n_batch < 1 or parallel < 1 or (n_ctx is not None and n_ctx < 1):
        raise ValueError(
            f"need n_ctx >= 1, n_batch >= 1, parallel >= 1 and headroom >= 0 (got {n_ctx}, {n_batch}, {parallel}, "
            f"{headroom})"
        )
    gguf = read_gguf(path)
    parts = split_parts(gguf)
    shape = _shape(gguf)
    types: dict[str, int] = {}
    layer_weights = [0] * (shape.n_layers + 1)
    input_weights = 0
    embeddings = 0
    tied = True
    for part in parts:
        for t in part.tensors:
            types[t.type_name] = types.get(t.type_name, 0) + t.n_bytes
            block = _BLOCK.match(t.name)
            if block is not None and int(block.group(1)) < shape.n_layers:
                layer_weights[int(block.group(1))] += t.n_bytes
            elif t.name.startswith(("output.", "output_norm.")):
                layer_weights[shape.n_layers] += t.n_bytes
                tied = tied and not t.name.startswith("output.")
            else:
                input_weights += t.n_bytes
                embeddings += t.n_bytes if t.name.startswith("token_embd.") else 0
    notes = []
    chosen = n_ctx
    if n_ctx is None:  # the model's own context; with ``auto_ctx``, what the engine's n_ctx "auto" makes of it
        trained = shape.context_length
        if auto_ctx:
            chosen = auto_context(trained, embedding)
        elif trained is None:
            raise GgufError(f"{gguf.path} does not say its context length ({shape.architecture}.context_length)")
        else:
            chosen = trained
    from_model = n_ctx is None and chosen == shape.context_length
    if from_model:
        notes.append(f"{_DEFAULT_CTX_NOTE} {shape.context_length}")
    if shape.sliding_window and not shape.swa_layers:
        notes.append(
            f"sliding-window attention ({shape.sliding_window} tokens) on some layers of an architecture whose layer "
            "pattern is not known here: their smaller KV cache is not modelled, so the KV cache figure is an upper "
            "bound"
        )
    if any(k.startswith(f"{shape.architecture}.ssm.") for k in gguf.metadata):
        notes.append("recurrent (SSM) layers: their state is not included")
    seed = ModelEstimate(
        path=gguf.path,
        shape=shape,
        weights=sum(types.values()),
        file_size=sum(p.file_size for p in parts),
        tensor_types=MappingProxyType(dict(sorted(types.items(), key=lambda kv: -kv[1]))),
        n_ctx=0,
        n_ctx_cells=0,
        n_ctx_from_model=from_model,
        cache_type=cache_type.lower(),
        n_batch=n_batch,
        n_ubatch=0,
        kv_cache=0,
        runtime_base=0,
        compute=0,
        headroom=headroom,
        notes=tuple(notes),
        parallel=parallel,
        embedding=embedding,
        prompt_cache_ram=0 if embedding or prompt_cache_ram is None else prompt_cache_ram,
        prompt_cache_ram_auto=prompt_cache_ram is None and not embedding,
        unified=unified or embedding,
        swa_full=swa_full,
        layer_weights=tuple(layer_weights),
        input_weights=input_weights,
        tied_output=embeddings if tied else 0,
    )
    assert chosen is not None
    return _estimate(seed, n_ctx=chosen, n_ctx_from_model=from_model)


def _estimate(base: ModelEstimate, *, n_ctx: int, n_ctx_from_model: bool) -> ModelEstimate:
    s = base.shape
    cells = -(-n_ctx // KV_CELL_PADDING) * KV_CELL_PADDING
    block, size = TYPE_SIZES[base.cache_type]
    n_ubatch = n_ctx if base.embedding else min(base.n_batch, MAX_N_UBATCH, n_ctx)
    # Cells per stream (a pool of its own): one stream per sequence, or one for all (unified; an embedding instance
    # holds one prompt at a time in n_ctx cells). A sliding-window layer keeps the window of each sequence the
    # stream holds plus a micro-batch, as llama.cpp's iSWA cache sizes it, unless swa_full.
    seqs = 1 if base.embedding else base.parallel
    streams, stream_cells = (1, cells * seqs) if base.unified else (seqs, cells)
    swa_cells = 0
    if s.sliding_window and any(s.swa_layers) and not base.swa_full:
        window = s.sliding_window * (seqs if base.unified else 1) + n_ubatch
        swa_cells = min(stream_cells, -(-window // KV_CELL_PADDING) * KV_CELL_PADDING)
    layer_kv = tuple(
        streams
        * (swa_cells if swa_cells and i < len(s.swa_layers) and s.swa_layers[i] else stream_cells)
        * (-(-(heads * s.head_dim_k) // block) * size + -(-(heads * s.head_dim_v) // block) * size)
        for i, heads in enumerate(s.n_head_kv)
    )
    kv = sum(layer_kv)
    attention = n_ubatch * cells * max(s.n_head) * ATTENTION_BYTES_PER_SCORE
    feed_forward = n_ubatch * s.n_ff * 4 * 3  # gate, up and their product, f32
    logits = embedding_outputs(s, n_ctx) if base.embedding else 0
    whole = replace(
        base,
        weights=base.input_weights + sum(base.layer_weights) if base.layer_weights else base.weights,
        n_ctx=n_ctx,
        n_ctx_cells=cells,
        n_ctx_from_model=n_ctx_from_model,
        n_ubatch=n_ubatch,
        kv_cache=kv,
        layer_kv=layer_kv,
        swa_cells=swa_cells if swa_cells < stream_cells else 0,
        runtime_base=RUNTIME_BASE + VOCAB_BYTES_PER_TOKEN * s.n_vocab + VOCAB_BYTES_PER_MERGE * s.n_merges,
        compute=max(attention, feed_forward) + logits // 2,
        outputs=logits // 2 + (n_ctx * s.n_embd * 4 if base.embedding else 0),
        prompt_cache_ram=kv if base.prompt_cache_ram_auto else base.prompt_cache_ram,
    )
    if base.offload is not None:  # another context: the same layers offloaded, their cache resized
        o = base.offload
        return replace(whole, offload=None).offloaded(o.n_gpu_layers, o.devices, o.split, o.budgets, auto=o.auto)
    return whole if base.rank is None else _rank_share(whole, base.rank, base.shares)


def _rank_share(whole: ModelEstimate, rank: int, shares: Sequence[float]) -> ModelEstimate:
    """What rank ``rank`` of a split instance holds of ``whole``: its layers' weights and KV cache, a compute scratch
    and the runtime base; rank 0 alone the input embeddings, the vocabulary and the RAM store, and whichever rank holds
    the output layer a tied output's copy of the input embeddings."""
    n_layers = whole.shape.n_layers
    mine = layer_plan(n_layers, shares).layers[rank]
    weights = sum(whole.layer_weights[i] for i in mine)
    if rank == 0:
        weights += whole.input_weights
    elif n_layers in mine:
        weights += whole.tied_output
    first = rank == 0
    return replace(
        whole,
        rank=rank,
        shares=tuple(shares),
        layers=mine,
        weights=weights,
        kv_cache=sum(whole.layer_kv[i] for i in mine if i < n_layers),
        runtime_base=whole.runtime_base if first else RUNTIME_BASE,
        outputs=whole.outputs if first else 0,
        prompt_cache_ram=whole.prompt_cache_ram if first else 0,
        prompt_cache_ram_auto=whole.prompt_cache_ram_auto and first,
    )


@dataclass(frozen=True)
class LayerPlan:
    """How a split instance's layers fall on its ranks, as llama.cpp assigns them: rank 0 keeps the first layers on
    its CPU; ``n_gpu_layers`` (the last of the n_layers + 1, the output layer counting as one) go to the RPC devices
    of ranks 1.., shared among them by ``tensor_split``."""

    n_gpu_layers: int
    tensor_split: tuple[float, ...]  # ranks 1.. (relative)
    layers: tuple[tuple[int, ...], ...]  # each rank's layers (n_layers: the output layer)


def layer_plan(n_layers: int, shares: Sequence[float]) -> LayerPlan:
    """Each rank's layers for relative ``shares`` (one per rank; llama.cpp's own rule, its float arithmetic too).
    ``ValueError`` when a share is not positive or a rank would get no layer."""
    world = len(shares)
    total = n_layers + 1
    if world < 2 or any(not share > 0 for share in shares):
        raise ValueError(f"a layer split needs two or more positive shares, got {list(shares)}")
    if world > total:
        raise ValueError(f"{world} ranks for {total} layers: every rank needs a layer of its own")
    local = min(max(round(total * shares[0] / sum(shares)), 0), total - (world - 1))
    n_gpu = total - local
    remote = tuple(float(share) for share in shares[1:])
    layers = [list(range(local)), *(list(held) for held in assign_layers(total, local, remote))]
    empty = [rank for rank, held in enumerate(layers) if not held and rank > 0]
    if empty:
        raise ValueError(
            f"the layer split {list(shares)} leaves rank {empty[0]} without a layer of the model's {total}: give "
            "each rank a larger share (layer_split) or use fewer ranks"
        )
    return LayerPlan(n_gpu, remote, tuple(tuple(held) for held in layers))


def assign_layers(total: int, first: int, split: Sequence[float]) -> tuple[tuple[int, ...], ...]:
    """The layers each device gets when layers ``first``.. of ``total`` leave the host, shared by relative ``split``
    (one per device): llama.cpp's own rule (``get_layer_buft_list``), its float arithmetic too."""
    splits, running = [], _f32(0.0)
    for share in split:
        running = _f32(running + _f32(float(share)))
        splits.append(running)
    splits = [_f32(v / running) for v in splits]
    held: list[list[int]] = [[] for _ in split]
    for il in range(first, total):
        device = bisect.bisect_right(splits, _f32(_f32(il - first) / (total - first)))
        held[min(device, len(split) - 1)].append(il)
    return tuple(tuple(layers) for layers in held)


@dataclass(frozen=True)
class Offload:
    """The layers a runner puts on GPUs and what each device needs for them (see ``ModelEstimate.offloaded``)."""

    n_gpu_layers: int
    layers: int  # the model's n_layers + 1 (the output layer counts as one)
    devices: tuple[int, ...]  # GPU indexes, as NVML and CUDA_DEVICE_ORDER=PCI_BUS_ID number them
    split: tuple[float, ...]  # each device's relative share of the offloaded layers (llama.cpp's tensor_split)
    device_layers: tuple[tuple[int, ...], ...]  # each device's layers (n_layers: the output layer)
    vram: tuple[int, ...]  # bytes each device needs
    budgets: tuple[int | None, ...] = ()  # bytes each device may use (None: not known)
    auto: bool = False  # the count was chosen here (n_gpu_layers "auto"), not given

    def describe(self) -> str:
        """``31 of 31 layers on GPU 0 (VRAM ~1.2 GiB of 78.1 GiB it may use)``"""
        chosen = " (auto: the most that fit)" if self.auto and self.n_gpu_layers < self.layers else ""
        if not self.n_gpu_layers:
            return f"no layer on a GPU{chosen}"
        parts = []
        for i, (device, need) in enumerate(zip(self.devices, self.vram, strict=False)):
            budget = self.budgets[i] if i < len(self.budgets) else None
            room = f" of {format_bytes(budget)} it may use" if budget is not None else ""
            parts.append(f"GPU {device} VRAM ~{format_bytes(need)}{room}")
        return f"{self.n_gpu_layers} of {self.layers} layers on the GPU{chosen} ({', '.join(parts)})"

    @property
    def per_layer(self) -> int:
        """Bytes a layer needs on a device, on average: its weights and KV cache, and a share of the compute scratch
        (a device's VRAM less its CUDA context, over its layers; a device given no layer holds neither)."""
        counted = sum(len(layers) for layers in self.device_layers)
        used = sum(1 for layers in self.device_layers if layers)
        return (sum(self.vram) - CUDA_CONTEXT * used) // counted if counted else 0


def fit_layers(whole: ModelEstimate, budgets: Sequence[int], devices: Sequence[int] = (0,)) -> ModelEstimate:
    """``whole`` with the most layers on ``devices`` whose share fits each device's budget (bytes; the split is by
    budget, as llama.cpp splits by free memory), and none when not even one layer fits: the ``n_gpu_layers`` "auto"
    chooses."""
    split = tuple(max(float(b), 0.0) for b in budgets)
    if not any(split):
        return whole.offloaded(0, devices, budgets=budgets, auto=True)
    n = whole.shape.n_layers + 1
    while n > 0:
        candidate = whole.offloaded(n, devices, split, budgets, auto=True)
        assert candidate.offload is not None
        if all(need <= budget for need, budget in zip(candidate.offload.vram, budgets, strict=True)):
            return candidate
        n -= 1
    return whole.offloaded(0, devices, budgets=budgets, auto=True)


def gpu_indexes(value: Any) -> list[int]:
    """The option ``gpu`` as device indexes: [0, 1], "0,1" or 0 (``ValueError`` otherwise)."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list | tuple) else [value]
    indexes = [int(item) for item in items]
    if not indexes or any(i < 0 for i in indexes) or len(set(indexes)) != len(indexes):
        raise ValueError(f'gpu must name distinct device indexes >= 0, e.g. [0] or "0,1"; got {value!r}')
    return indexes


def gpu_build_missing() -> str | None:
    """Why the llama.cpp this process's runners load cannot offload to an NVIDIA GPU (None: it can), from its files
    alone: importing it in the worker would load the CUDA libraries there. The runners load ``LLAMA_CPP_LIB_PATH``
    when set, else llama-cpp-python's own ``lib``."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        where: Path | None = Path(override)
    else:
        found = importlib.util.find_spec("llama_cpp")
        where = Path(found.origin).parent / "lib" if found is not None and found.origin else None
    if where is None:
        return "llama-cpp-python is not installed"
    if any(where.glob("libggml-cuda*")):
        return None
    return (
        f"the llama.cpp in {where} was built for the CPU only (no libggml-cuda): rebuild it with CUDA "
        "(`TETHER_GPU=cuda make install`, see the GPU page of the docs)"
    )


def block_count(path: str | os.PathLike[str]) -> int:
    """The model's repeating layers (``{arch}.block_count``), from its header; ``GgufError`` when unreadable."""
    return _shape(read_gguf(path)).n_layers


def _f32(value: float) -> float:
    """``value`` rounded to a C float, as llama.cpp computes the split points."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def layers_words(layers: Sequence[int], n_layers: int) -> str:
    """``layers 16-29 and the output layer``"""
    blocks = [i for i in layers if i < n_layers]
    parts = [f"layers {blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else f"layer {blocks[0]}"] if blocks else []
    if n_layers in layers:
        parts.append("the output layer")
    return " and ".join(parts) or "no layer"


def embedding_outputs(shape: ModelShape, n_ctx: int) -> int:
    """The logits an embedding instance's full prompt leaves: n_ctx x n_vocab f32 in the compute buffer and again in
    the output buffer. Every token is an output, and a generative model's head runs regardless, so for a small model
    with a large vocabulary this is the largest part: an embedding instance wants a small n_ctx."""
    return 2 * n_ctx * shape.n_vocab * 4


def _shape(gguf: GgufFile) -> ModelShape:
    arch = gguf.architecture
    if arch is None:
        raise GgufError(f"{gguf.path} has no general.architecture: it is not a model llama.cpp can load")
    md = gguf.metadata

    def number(key: str, default: int | None = None) -> int:
        value = md.get(f"{arch}.{key}", default)
        if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
            value = max(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise GgufError(f"{gguf.path} lacks {arch}.{key} (or it is not a number): cannot estimate its memory")
        return value

    n_layers = number("block_count")
    n_embd = number("embedding_length")

    def per_layer(key: str, default: int | None) -> tuple[int, ...]:
        value = md.get(f"{arch}.{key}", default)
        if isinstance(value, tuple) and len(value) == n_layers and all(isinstance(v, int) for v in value):
            return tuple(value)
        return (number(key, default),) * n_layers

    n_head = per_layer("attention.head_count", None)
    n_head_kv = per_layer("attention.head_count_kv", max(n_head))
    head_dim = n_embd // max(max(n_head), 1)
    context = md.get(f"{arch}.context_length")
    vocab = md.get("tokenizer.ggml.tokens")
    n_vocab = vocab.count if isinstance(vocab, GgufArray) else len(vocab) if isinstance(vocab, tuple) else None
    merges = md.get("tokenizer.ggml.merges")
    window = md.get(f"{arch}.attention.sliding_window")
    window = window if isinstance(window, int) and window > 0 else None
    return ModelShape(
        architecture=arch,
        n_layers=n_layers,
        context_length=context if isinstance(context, int) else None,
        n_embd=n_embd,
        n_ff=number("feed_forward_length", 4 * n_embd),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=number("attention.key_length", head_dim),
        head_dim_v=number("attention.value_length", head_dim),
        n_vocab=n_vocab if n_vocab is not None else number("vocab_size", 0),
        n_merges=merges.count if isinstance(merges, GgufArray) else len(merges) if isinstance(merges, tuple) else 0,
        sliding_window=window,
        swa_layers=_swa_layers(md.get(f"{arch}.attention.sliding_window_pattern"), arch, n_layers) if window else (),
    )


def _swa_layers(pattern: Any, arch: str, n_layers: int) -> tuple[bool, ...]:
    """Which layers slide: the GGUF's per-layer pattern, else its period or llama.cpp's for the architecture (of
    every ``n`` layers the first ``n - 1``; 0: all); empty when neither is known."""
    if isinstance(pattern, tuple) and len(pattern) == n_layers and all(isinstance(v, bool) for v in pattern):
        return pattern
    period = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else SWA_PERIODS.get(arch)
    if period is None:
        return ()
    return tuple(period == 0 or i % period < period - 1 for i in range(n_layers))


def estimate_for_spec(spec: EngineSpec, options: Mapping[str, Any], headroom: int = DEFAULT_HEADROOM) -> ModelEstimate:
    """The estimate for a llama.cpp runner of ``spec`` with ``options`` (the engine's defaults under the spec's own,
    so the estimate matches the load). Raises ``GgufError`` for a file that is not a readable GGUF."""
    path = Path(spec.model) if spec.model else default_model_path()
    embedding = bool(options.get("embedding", False))
    auto = options["n_ctx"] == "auto"
    whole = estimate_gguf(
        path,
        n_ctx=None if auto else int(options["n_ctx"]),
        auto_ctx=auto,
        n_batch=int(options["n_batch"]),
        parallel=int(options.get("parallel", 1)),
        headroom=headroom,
        embedding=embedding,
        prompt_cache_ram=prompt_cache_budget(options),
        unified=bool(options.get("kv_unified", False)),
        swa_full=bool(options.get("swa_full", False) or options.get("deterministic", False)),  # it implies swa_full
    )
    if options.get("speculation") and not embedding:  # draft rows want logits too: twice, compute and output buffer
        rows = min(whole.parallel * (int(options.get("draft_max", 32)) + 1), int(options["n_batch"]) + whole.parallel)
        whole = replace(whole, outputs=whole.outputs + 2 * max(0, rows - whole.parallel) * whole.shape.n_vocab * 4)
    if spec.rank is None:
        return whole
    shares = split_shares(spec.rank, options.get("layer_split"))
    return _rank_share(replace(whole, rank=spec.rank.rank, shares=shares), spec.rank.rank, shares)


def split_shares(rank: RankInfo, layer_split: Sequence[float] | None) -> tuple[float, ...]:
    """Every rank's share of the layers: ``layer_split`` when given, else what the placement gave (each rank's
    node's free memory), else equal. ``ValueError`` for a ``layer_split`` that does not name one share per rank."""
    if layer_split is not None:
        if len(layer_split) != rank.world_size:
            raise ValueError(
                f"layer_split names {len(layer_split)} shares for {rank.world_size} ranks: give one per rank"
            )
        return tuple(float(v) for v in layer_split)
    if len(rank.shares) == rank.world_size:
        return rank.shares
    return (1.0,) * rank.world_size


def auto_context(trained: int | None, embedding: bool = False) -> int:
    """The n_ctx that "auto" means for a model trained for ``trained`` tokens (None or 0: unknown)."""
    cap = AUTO_CTX_CAP_EMBEDDING if embedding else AUTO_CTX_CAP
    return min(trained, cap) if trained and trained > 0 else cap


def prompt_cache_budget(options: Mapping[str, Any]) -> int | None:
    """The prompt cache's RAM budget the options ask for: bytes, or None for the KV cache's size ("auto")."""
    if not options.get("prompt_cache", True) or options.get("embedding", False):
        return 0
    value = options.get("prompt_cache_ram", "auto")
    return None if value == "auto" else parse_size(value)
