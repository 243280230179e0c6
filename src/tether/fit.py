"""Fit check before load: what a GGUF model will need, compared with what this node can give it.

A model is admitted only when weights + KV cache + runtime + headroom fit in the available memory; otherwise the
refusal says every number (``needs ~556 MiB (weights 92.1 MiB + KV cache 180 MiB at n_ctx 8192 + runtime 284 MiB +
headroom 128 MiB), 300 MiB available (cgroup limit)``) and what to do, and an explicit override loads it anyway.
After load, :func:`record_measured` puts the runner's measured memory beside the estimate.

**Reading GGUF.** The metadata comes from the file's header, read here by a small reader of the GGUF v2/v3 layout
(magic, version, counts, key/value section, tensor infos, aligned data) rather than with the ``gguf`` package of the
llama.cpp project: its ``GGUFReader`` decodes every element of every array (the tokenizer's vocabulary and merges)
into numpy views, which took 3.5-4.3 s for the 94 MiB default model on the 2-CPU test machine (and grows with the
vocabulary), and it pulls ``requests``, ``tqdm`` and ``pyyaml`` into the worker. This reader skips large arrays
(their element count is kept) and takes ~0.1 s; its values were cross-checked against ``gguf`` 0.19.0 and
llama.cpp's own metadata for the default model (see ``tests/test_fit.py``). Tensor sizes use ggml's block sizes
(the table mirrors ``gguf.constants.GGML_QUANT_SIZES``); a tensor of a type newer than the table is sized from the
tensor offsets instead. Split models (``*-00001-of-00003.gguf``) are read part by part.

**The estimate** is for host memory with the engine's CPU settings (``n_gpu_layers`` 0, no flash attention, the
llama-cpp-python defaults the llama.cpp engine uses). It is the runner's *peak*, reached when a full batch of
prompt tokens attends to a nearly full context, not its footprint right after load, which is lower:

* weights: the sum of the tensors' data sizes (mmapped: resident file-backed pages once touched);
* KV cache: 2 (K and V) x layers x n_ctx x kv heads x head dim x bytes per element of the cache type, with n_ctx
  rounded up to a multiple of 256 as llama.cpp does (n_ctx 1000 gets 1024 cells);
* runtime: a fixed base for the interpreter, tether's runner and the llama.cpp/ggml/numpy libraries
  (:data:`RUNTIME_BASE`), the tokenizer's tables (:data:`VOCAB_BYTES_PER_TOKEN` per vocabulary entry) and the
  compute scratch of one micro-batch: without flash attention, the attention scores of n_ubatch tokens against
  n_ctx cells for every query head, kept in f32 in ggml's compute buffer and copied to f16 in the CPU backend's
  work buffer for the V product (:data:`ATTENTION_BYTES_PER_SCORE` = 4 + 2 bytes), or the feed-forward activations
  if larger. llama.cpp reserves more compute buffer than that (logits for a whole batch, 96 MiB for the default
  model), but the engine asks for the last token's logits only, so those pages are never touched.
* headroom: a configurable margin (:data:`DEFAULT_HEADROOM`) for what the model above leaves out.

Measured on the default model (SmolLM2-135M-Instruct Q4_1: weights 92.1 MiB, llama-cpp-python 0.3.36, x86-64 Linux,
2 CPUs), RSS of the runner started by :class:`tether.supervisor.Supervisor`, and its estimate without headroom:

=======  =========================================  ===================================================  ==========
n_ctx    ready (after warm-up)                      after a prompt filling 95% of the context (= VmHWM)  estimate
=======  =========================================  ===================================================  ==========
1024     182 MiB (anon 67.3 + file 115)             -                                                    -
2048     205 MiB (anon 89.8 + file 115; KV 45.0)    257 MiB (anon 142 + file 115)                        259 MiB
8192     340 MiB (anon 225 + file 115; KV 180)      564 MiB (anon 449 + file 115)                        556 MiB
=======  =========================================  ===================================================  ==========

At every n_ctx the ready RSS minus weights and KV cache is the same 68 MiB: 43 MiB for a bare runner interpreter
with llama_cpp imported (anon 23.4 + file 19.7), +17.6 MiB once the vocabulary is loaded (``vocab_only``), the rest
llama.cpp's context. Filling the context adds 52 MiB at n_ctx 2048 and 224 MiB at n_ctx 8192: 5.8 and 6.2 bytes
per attention score (512 x n_ctx x 9 heads). So the estimate is within 2% of the peak at both sizes and above the
ready RSS (+26% at 2048, +64% at 8192, where most of the scratch is not touched yet).

Not modelled (said in :attr:`ModelEstimate.notes` where the metadata shows it): GPU offload, sliding-window layers
(their smaller cache: the estimate is then an upper bound), recurrent state of SSM layers, and weights a CPU backend
repacks into anonymous copies (Q4_0/IQ4_NL/Q4_K on some CPUs: resident weights may then count twice in RSS, the
file-backed pages being reclaimable page cache).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tether.memory import ProcessMemory, format_bytes
from tether.models import default_model_path
from tether.protocol import EngineSpec

MiB = 1 << 20

DEFAULT_HEADROOM = 128 * MiB
"""Margin added to every estimate for what the model leaves out (allocator slack, request buffers, thread stacks)."""

RUNTIME_BASE = 50 * MiB
"""Interpreter, tether's runner, llama.cpp/ggml/numpy libraries and llama.cpp's context (measured: 68 MiB of ready
RSS beyond weights and KV cache for the default model, of which 18 MiB is its 49152-entry vocabulary)."""

VOCAB_BYTES_PER_TOKEN = 384
"""Tokenizer tables per vocabulary entry (measured: +17.6 MiB when llama.cpp loads the default model's 49152-entry
vocabulary alone)."""

ATTENTION_BYTES_PER_SCORE = 6
"""Scratch per attention score (n_ubatch x n_ctx x query heads): the f32 scores in the compute buffer plus their f16
copy in the CPU backend's work buffer (measured 5.8-6.2 bytes)."""

DEFAULT_N_BATCH = 512  # the llama.cpp engine's n_batch default
MAX_N_UBATCH = 512  # llama-cpp-python's n_ubatch default: micro-batches are min(n_batch, 512) tokens
KV_CELL_PADDING = 256  # llama.cpp rounds the context up to a multiple of this many KV cells

_DEFAULT_CTX_NOTE = "n_ctx not given: using the model's context length"
WHAT_TO_DO = "use a smaller --n-ctx, free memory, or pass --force to load anyway"

# ggml tensor types: id -> (name, elements per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES.
GGML_TYPES: Mapping[int, tuple[str, int, int]] = MappingProxyType(
    {
        0: ("F32", 1, 4),
        1: ("F16", 1, 2),
        2: ("Q4_0", 32, 18),
        3: ("Q4_1", 32, 20),
        6: ("Q5_0", 32, 22),
        7: ("Q5_1", 32, 24),
        8: ("Q8_0", 32, 34),
        9: ("Q8_1", 32, 40),
        10: ("Q2_K", 256, 84),
        11: ("Q3_K", 256, 110),
        12: ("Q4_K", 256, 144),
        13: ("Q5_K", 256, 176),
        14: ("Q6_K", 256, 210),
        15: ("Q8_K", 256, 292),
        16: ("IQ2_XXS", 256, 66),
        17: ("IQ2_XS", 256, 74),
        18: ("IQ3_XXS", 256, 98),
        19: ("IQ1_S", 256, 50),
        20: ("IQ4_NL", 32, 18),
        21: ("IQ3_S", 256, 110),
        22: ("IQ2_S", 256, 82),
        23: ("IQ4_XS", 256, 136),
        24: ("I8", 1, 1),
        25: ("I16", 1, 2),
        26: ("I32", 1, 4),
        27: ("I64", 1, 8),
        28: ("F64", 1, 8),
        29: ("IQ1_M", 256, 56),
        30: ("BF16", 1, 2),
        34: ("TQ1_0", 256, 54),
        35: ("TQ2_0", 256, 66),
        39: ("MXFP4", 32, 17),
        40: ("NVFP4", 64, 36),
        41: ("Q1_0", 128, 18),
    }
)
_TYPE_BY_NAME = {name.lower(): (block, size) for name, block, size in GGML_TYPES.values()}
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
"""KV cache types llama.cpp accepts (``--cache-type-k/-v``); quantized ones need flash attention there."""


class GgufError(ValueError):
    """A model file that is missing, unreadable, not GGUF, truncated or lacks what the estimate needs."""


# --------------------------------------------------------------------------------------------------------------
# Reading GGUF
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GgufArray:
    """A metadata array too large to keep (the vocabulary, merges): its element type and count only."""

    element_type: str
    count: int


GgufValue = int | float | bool | str | tuple[Any, ...] | GgufArray


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]
    type_name: str  # ggml type ("Q4_1", "F32", or "type 57" when this table does not know it)
    n_bytes: int
    offset: int  # from the start of the file's data section


@dataclass(frozen=True)
class GgufFile:
    """The header of one GGUF file: its metadata and tensor table."""

    path: Path
    version: int
    metadata: Mapping[str, GgufValue]
    tensors: tuple[GgufTensor, ...]
    data_offset: int
    file_size: int

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


_SCALARS: Mapping[int, tuple[str, str]] = MappingProxyType(
    {
        0: ("uint8", "B"),
        1: ("int8", "b"),
        2: ("uint16", "H"),
        3: ("int16", "h"),
        4: ("uint32", "I"),
        5: ("int32", "i"),
        6: ("float32", "f"),
        7: ("bool", "?"),
        10: ("uint64", "Q"),
        11: ("int64", "q"),
        12: ("float64", "d"),
    }
)
_STRING, _ARRAY = 8, 9
_KEEP_NUMBERS = 4096  # numeric arrays up to this length are decoded (per-layer values); longer ones are skipped
_KEEP_STRINGS = 64
_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


class _Reader:
    """Cursor over a mapped GGUF file; every read is bounds-checked into a :class:`GgufError`."""

    def __init__(self, path: Path, buf: mmap.mmap, order: str) -> None:
        self.path, self.buf, self.order, self.pos = path, buf, order, 0
        self.size = len(buf)

    def fail(self, what: str) -> GgufError:
        return GgufError(
            f"{self.path} is truncated or corrupt: cannot read {what} at byte {self.pos} of {self.size} "
            "(an incomplete download?): get the file again"
        )

    def unpack(self, fmt: str, what: str) -> Any:
        fmt = self.order + fmt
        end = self.pos + struct.calcsize(fmt)
        if end > self.size:
            raise self.fail(what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos = end
        return value

    def string(self, what: str) -> str:
        n = self.unpack("Q", what)
        if self.pos + n > self.size:
            raise self.fail(what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self, what: str) -> None:
        n = self.unpack("Q", what)
        self.pos += n
        if self.pos > self.size:
            raise self.fail(what)

    def value(self, vtype: int, what: str) -> GgufValue:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][1], what)  # type: ignore[no-any-return]
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, count = self.unpack("I", what), self.unpack("Q", what)
            if etype in _SCALARS:
                _, code = _SCALARS[etype]
                nbytes = count * struct.calcsize(code)
                if self.pos + nbytes > self.size:
                    raise self.fail(what)
                if count > _KEEP_NUMBERS:
                    self.pos += nbytes
                    return GgufArray(_SCALARS[etype][0], count)
                values = struct.unpack_from(f"{self.order}{count}{code}", self.buf, self.pos)
                self.pos += nbytes
                return tuple(values)
            if etype == _STRING:
                if count <= _KEEP_STRINGS:
                    return tuple(self.string(what) for _ in range(count))
                for _ in range(count):
                    self.skip_string(what)
                return GgufArray("string", count)
            if etype == _ARRAY:  # nested arrays: kept as their count only
                for _ in range(count):
                    self.value(_ARRAY, what)
                return GgufArray("array", count)
            raise self.fail(f"{what} (unknown array element type {etype})")
        raise self.fail(f"{what} (unknown value type {vtype})")


def read_gguf(path: str | os.PathLike[str]) -> GgufFile:
    """The metadata and tensor table of a GGUF file (v2 or v3, either byte order); :class:`GgufError` otherwise."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            magic = f.read(4)
            if size == 0:
                raise GgufError(f"{p} is empty, expected a GGUF model file")
            if magic != b"GGUF":
                raise GgufError(
                    f"{p} is not a GGUF file (starts with {magic!r}, expected b'GGUF'): llama.cpp needs a GGUF "
                    "model; convert it with llama.cpp's convert_hf_to_gguf.py"
                )
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(p, buf, size)
    except OSError as exc:
        raise GgufError(f"cannot read model file {p}: {exc.strerror or exc}") from exc


def _parse(path: Path, buf: mmap.mmap, size: int) -> GgufFile:
    if size < 24:
        raise GgufError(f"{path} is truncated: {size} bytes, too short for a GGUF header (an incomplete download?)")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version >= 1 << 16:  # a big-endian file (converted with --bigendian)
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise GgufError(
            f"{path} is GGUF version {version}; this llama.cpp reads versions 2 and 3"
            + (": convert the model again with a current convert_hf_to_gguf.py" if version == 1 else "")
        )
    r = _Reader(path, buf, order)
    r.pos = 8
    n_tensors, n_kv = r.unpack("Q", "the tensor count"), r.unpack("Q", "the metadata count")
    if n_tensors > size // 24 or n_kv > size // 12:  # each entry takes at least that many bytes
        raise r.fail(f"the header (claims {n_tensors} tensors and {n_kv} metadata entries)")
    metadata: dict[str, GgufValue] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        metadata[key] = r.value(r.unpack("I", f"the type of {key!r}"), f"metadata value {key!r}")
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for i in range(n_tensors):
        name = r.string(f"tensor name {i}")
        n_dims = r.unpack("I", f"the rank of tensor {name!r}")
        if n_dims > 8:
            raise r.fail(f"the shape of tensor {name!r} (rank {n_dims})")
        shape = tuple(r.unpack("Q", f"the shape of tensor {name!r}") for _ in range(n_dims))
        raw.append((name, shape, r.unpack("I", f"the type of tensor {name!r}"), r.unpack("Q", f"tensor {name!r}")))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise GgufError(f"{path} has an invalid general.alignment {alignment!r}")
    data_offset = -(-r.pos // alignment) * alignment
    data_size = size - data_offset
    by_offset = sorted(offset for *_, offset in raw)
    tensors = []
    for name, shape, type_id, offset in raw:
        n_bytes = _tensor_bytes(shape, type_id)
        if n_bytes is None:  # a type newer than the table: up to the next tensor (or the end of the data)
            i = by_offset.index(offset)
            n_bytes = (by_offset[i + 1] if i + 1 < len(by_offset) else data_size) - offset
        if offset + n_bytes > data_size:
            raise GgufError(
                f"{path} is truncated: tensor {name!r} ends at byte {data_offset + offset + n_bytes} but the file "
                f"has {size} bytes (an incomplete download?): get the file again"
            )
        type_name = GGML_TYPES[type_id][0] if type_id in GGML_TYPES else f"type {type_id}"
        tensors.append(GgufTensor(name, shape, type_name, n_bytes, offset))
    return GgufFile(path, version, MappingProxyType(metadata), tuple(tensors), data_offset, size)


def _tensor_bytes(shape: tuple[int, ...], type_id: int) -> int | None:
    if type_id not in GGML_TYPES:
        return None
    _, block, size = GGML_TYPES[type_id]
    return -(-math.prod(shape) // block) * size


def _split_parts(first: GgufFile) -> list[GgufFile]:
    """All parts of a split model (``split.count`` > 1), found beside the given one by llama.cpp's naming."""
    count = first.metadata.get("split.count", 1)
    if not isinstance(count, int) or count <= 1:
        return [first]
    m = _SPLIT_NAME.match(first.path.name)
    if m is None:
        raise GgufError(
            f"{first.path} is part of a model split in {count} files, but its name does not follow the "
            "<name>-00001-of-0000N.gguf pattern, so the other parts cannot be found"
        )
    parts = []
    for i in range(1, count + 1):
        part_path = first.path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf")
        if part_path == first.path:
            parts.append(first)
        elif not part_path.is_file():
            raise GgufError(f"{first.path} is part {m['index']} of {count}, but part {i} ({part_path}) is missing")
        else:
            parts.append(read_gguf(part_path))
    return parts


# --------------------------------------------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------------------------------------------


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
    kv_cache: int
    runtime_base: int  # interpreter, libraries, tokenizer
    compute: int  # attention or feed-forward scratch of one micro-batch
    headroom: int
    notes: tuple[str, ...] = field(default=())

    @property
    def runtime(self) -> int:
        return self.runtime_base + self.compute

    @property
    def expected(self) -> int:
        """What the runner itself is expected to hold at its peak: everything but the headroom."""
        return self.weights + self.kv_cache + self.runtime

    @property
    def total(self) -> int:
        return self.expected + self.headroom

    @property
    def architecture(self) -> str:
        return self.shape.architecture

    def describe(self) -> str:
        """``needs ~X (weights A + KV cache B at n_ctx N + runtime C + headroom D)``."""
        ctx = f"the model's n_ctx {self.n_ctx}" if self.n_ctx_from_model else f"n_ctx {self.n_ctx}"
        cache = "" if self.cache_type == "f16" else f" ({self.cache_type})"
        return (
            f"needs ~{format_bytes(self.total)} (weights {format_bytes(self.weights)} + KV cache"
            f"{cache} {format_bytes(self.kv_cache)} at {ctx} + runtime {format_bytes(self.runtime)} + headroom "
            f"{format_bytes(self.headroom)})"
        )

    def with_n_ctx(self, n_ctx: int) -> ModelEstimate:
        """The same model at another context size (no file read)."""
        notes = tuple(n for n in self.notes if not n.startswith(_DEFAULT_CTX_NOTE))
        return _estimate(replace(self, notes=notes), n_ctx=n_ctx, n_ctx_from_model=False)


def estimate_gguf(
    path: str | os.PathLike[str],
    n_ctx: int | None = None,
    cache_type: str = "f16",
    headroom: int = DEFAULT_HEADROOM,
    *,
    n_batch: int = DEFAULT_N_BATCH,
) -> ModelEstimate:
    """Estimate what loading the GGUF model at ``path`` with the llama.cpp engine needs (see the module docstring).

    ``n_ctx`` None means the model's own context length (``{arch}.context_length``; ``describe`` says so).
    ``cache_type`` is the KV cache element type (one of :data:`CACHE_TYPES`). Raises :class:`GgufError` for a file
    that is not a readable GGUF model or lacks the metadata needed, and ``ValueError`` for bad arguments.
    """
    if cache_type.lower() not in CACHE_TYPES:
        raise ValueError(f"unknown KV cache type {cache_type!r}: use one of {', '.join(CACHE_TYPES)}")
    if headroom < 0 or n_batch < 1 or (n_ctx is not None and n_ctx < 1):
        raise ValueError(f"need n_ctx >= 1, n_batch >= 1 and headroom >= 0 (got {n_ctx}, {n_batch}, {headroom})")
    gguf = read_gguf(path)
    parts = _split_parts(gguf)
    shape = _shape(gguf)
    types: dict[str, int] = {}
    for part in parts:
        for t in part.tensors:
            types[t.type_name] = types.get(t.type_name, 0) + t.n_bytes
    notes = []
    if n_ctx is None:
        if shape.context_length is None:
            raise GgufError(f"{gguf.path} does not say its context length ({shape.architecture}.context_length)")
        notes.append(f"{_DEFAULT_CTX_NOTE} {shape.context_length}")
    if shape.sliding_window:
        notes.append(
            f"sliding-window attention ({shape.sliding_window} tokens) on some layers: their smaller KV cache is not "
            "modelled, so the KV cache figure is an upper bound"
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
        n_ctx_from_model=n_ctx is None,
        cache_type=cache_type.lower(),
        n_batch=n_batch,
        n_ubatch=0,
        kv_cache=0,
        runtime_base=0,
        compute=0,
        headroom=headroom,
        notes=tuple(notes),
    )
    chosen = n_ctx if n_ctx is not None else shape.context_length or 0
    return _estimate(seed, n_ctx=chosen, n_ctx_from_model=n_ctx is None)


def _estimate(base: ModelEstimate, *, n_ctx: int, n_ctx_from_model: bool) -> ModelEstimate:
    s = base.shape
    cells = -(-n_ctx // KV_CELL_PADDING) * KV_CELL_PADDING
    block, size = _TYPE_BY_NAME[base.cache_type]
    kv = cells * sum(
        -(-(heads * s.head_dim_k) // block) * size + -(-(heads * s.head_dim_v) // block) * size for heads in s.n_head_kv
    )
    n_ubatch = min(base.n_batch, MAX_N_UBATCH, n_ctx)
    attention = n_ubatch * cells * max(s.n_head) * ATTENTION_BYTES_PER_SCORE
    feed_forward = n_ubatch * s.n_ff * 4 * 3  # gate, up and their product, f32
    return replace(
        base,
        n_ctx=n_ctx,
        n_ctx_cells=cells,
        n_ctx_from_model=n_ctx_from_model,
        n_ubatch=n_ubatch,
        kv_cache=kv,
        runtime_base=RUNTIME_BASE + VOCAB_BYTES_PER_TOKEN * s.n_vocab,
        compute=max(attention, feed_forward),
    )


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
    window = md.get(f"{arch}.attention.sliding_window")
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
        sliding_window=window if isinstance(window, int) and window > 0 else None,
    )


# --------------------------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitResult:
    """The verdict: ``ok`` when it fits or the caller overrode the refusal; ``message`` says it with the numbers."""

    estimate: ModelEstimate
    available: int
    source: str
    fits: bool
    overridden: bool
    message: str
    max_n_ctx: int | None = None  # the largest n_ctx (multiple of 256) that would fit, when the model does not

    @property
    def ok(self) -> bool:
        return self.fits or self.overridden

    @property
    def needed(self) -> int:
        return self.estimate.total


class DoesNotFit(RuntimeError):
    """Raised by :func:`ensure_fits`; ``result`` has the numbers."""

    def __init__(self, result: FitResult) -> None:
        super().__init__(result.message)
        self.result = result


def check_fit(estimate: ModelEstimate, available: int, source: str, *, override: bool = False) -> FitResult:
    """Compare ``estimate.total`` with ``available`` bytes (``source`` says where that figure comes from, e.g.
    "cgroup limit"). A model that does not fit is refused unless ``override``; either way ``message`` has the
    numbers: ``needs ~X (weights ... + headroom ...), Y available (source)``."""
    numbers = f"{estimate.describe()}, {format_bytes(available)} available ({source})"
    if estimate.total <= available:
        return FitResult(estimate, available, source, True, False, f"{estimate.path.name} fits: {numbers}")
    best = _max_n_ctx(estimate, available)
    if override:
        message = f"loading {estimate.path.name} anyway (override): it does not fit: {numbers}"
        return FitResult(estimate, available, source, False, True, message, best)
    if best is not None:
        advice = f"use a smaller --n-ctx (up to {best} fits), free memory, or pass --force to load anyway"
    elif estimate.with_n_ctx(KV_CELL_PADDING).total > available:
        smallest = estimate.with_n_ctx(KV_CELL_PADDING)
        advice = (
            f"even n_ctx {KV_CELL_PADDING} {smallest.describe()}: free memory, use a smaller or more quantized "
            "model, or pass --force to load anyway"
        )
    else:
        advice = WHAT_TO_DO
    message = f"{estimate.path.name} does not fit: {numbers}: {advice}"
    return FitResult(estimate, available, source, False, False, message, best)


def ensure_fits(estimate: ModelEstimate, available: int, source: str, override: bool = False) -> FitResult:
    """:func:`check_fit`, raising :class:`DoesNotFit` (with the result) when refused."""
    result = check_fit(estimate, available, source, override=override)
    if not result.ok:
        raise DoesNotFit(result)
    return result


def _max_n_ctx(estimate: ModelEstimate, available: int) -> int | None:
    """The largest n_ctx below the requested one, in steps of 256, that fits (memory grows with n_ctx)."""
    lo, hi = 1, (estimate.n_ctx - 1) // KV_CELL_PADDING  # candidates are k * 256 for lo <= k <= hi
    if hi < lo or estimate.with_n_ctx(lo * KV_CELL_PADDING).total > available:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate.with_n_ctx(mid * KV_CELL_PADDING).total <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo * KV_CELL_PADDING


# --------------------------------------------------------------------------------------------------------------
# After load
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredFit:
    """The runner's measured memory beside its estimate, recorded after load."""

    estimate: ModelEstimate
    memory: ProcessMemory

    @property
    def resident(self) -> int:
        """What the runner holds in RAM: resident weights (file-backed or not) plus its private memory (RSS)."""
        return self.memory.rss

    @property
    def ratio(self) -> float:
        """Measured resident memory over the estimate without headroom (below 1 before the context fills)."""
        return self.resident / self.estimate.expected if self.estimate.expected else math.inf

    def describe(self) -> str:
        m = self.memory
        return (
            f"estimated ~{format_bytes(self.estimate.expected)} + headroom {format_bytes(self.estimate.headroom)} "
            f"at n_ctx {self.estimate.n_ctx}; measured {format_bytes(m.rss)} resident (file-backed "
            f"{format_bytes(m.file)} + anonymous {format_bytes(m.anon)}), footprint {format_bytes(m.footprint)}: "
            f"{self.ratio:.2f} of the estimate"
        )


def record_measured(estimate: ModelEstimate, memory: ProcessMemory) -> MeasuredFit:
    """Pair a loaded runner's memory (``tether.memory.process_memory(pid)``) with the estimate it was admitted on."""
    return MeasuredFit(estimate, memory)


def estimate_for_spec(spec: EngineSpec, headroom: int = DEFAULT_HEADROOM) -> ModelEstimate | None:
    """The estimate for what a runner of ``spec`` will hold, with the engine's own defaults; None for engines
    without a model file (the debug engine). Raises ``GgufError`` for a file that is not a readable GGUF."""
    if spec.engine != "llama.cpp":
        return None
    from tether.engines.llamacpp import OPTION_DEFAULTS  # the engine's defaults, so the estimate matches the load

    options = {**OPTION_DEFAULTS, **spec.options}
    path = Path(spec.model) if spec.model else default_model_path()
    return estimate_gguf(path, n_ctx=int(options["n_ctx"]), n_batch=int(options["n_batch"]), headroom=headroom)
