"""A reader of GGUF model headers: metadata and tensor table, without loading the model.

A small reader of the GGUF v2/v3 layout (magic, version, counts, key/value section, tensor infos, aligned data),
not the ``gguf`` package's ``GGUFReader``, which decodes every element of every array (the vocabulary and merges)
and pulls ``requests``, ``tqdm`` and ``pyyaml`` into the worker: this one skips large arrays, keeping their element
count (why, measured: docs/design.md, "Memory"). Its values are checked against ``gguf`` and llama.cpp's own in
``tests/test_fit.py``. Tensor sizes use ggml's block sizes (the table mirrors ``gguf.constants.GGML_QUANT_SIZES``);
a tensor of a type newer than the table is sized from the tensor offsets. Split models (``*-00001-of-00003.gguf``)
are read part by part.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tether.errors import InvalidModel

GGUF_MAGIC = b"GGUF"

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
TYPE_SIZES = {name.lower(): (block, size) for name, block, size in GGML_TYPES.values()}
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
"""KV cache types llama.cpp accepts (``--cache-type-k/-v``); quantized ones need flash attention there."""


class GgufError(InvalidModel):
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
            if magic != GGUF_MAGIC:
                raise not_gguf(p, magic)
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


def split_parts(first: GgufFile) -> list[GgufFile]:
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


def not_gguf(path: Path, magic: bytes) -> GgufError:
    """The one refusal of a file that is not GGUF (the fit check's reader and the llama.cpp engine both say it)."""
    return GgufError(
        f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}): llama.cpp needs a GGUF "
        "model; convert it with llama.cpp's convert_hf_to_gguf.py"
    )
