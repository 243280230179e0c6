"""Fit check before load: GGUF metadata, the estimate, the refusal, and the estimate against a real runner."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import gemma_missing, gemma_path
from tether.engines.base import EngineLoadError
from tether.engines.gguf import GgufArray, GgufError, read_gguf
from tether.engines.llamacpp.engine import PARALLEL_DEFAULT, LlamaCppEngine
from tether.engines.llamacpp.estimate import DEFAULT_HEADROOM, estimate_gguf
from tether.models import DefaultModelMissing, default_model_path
from tether.node.fit import DoesNotFit, check_fit, ensure_fits, record_measured
from tether.node.memory import process_memory
from tether.node.supervisor import Supervisor
from tether.protocol import EngineSpec, GenerateParams
from tether.units import format_bytes

MiB = 1 << 20


@pytest.fixture(scope="module")
def model_path() -> Path:
    try:
        return default_model_path()
    except DefaultModelMissing as exc:
        pytest.skip(f"the default model is needed for this test: {exc}")


# ----------------------------------------------------------------------------------------------------------
# Synthetic GGUF files
# ----------------------------------------------------------------------------------------------------------

U32, I32, F32, BOOL, STR, ARR, U64 = 4, 5, 6, 7, 8, 9, 10
_CODES = {U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q"}


def _value(order: str, vtype: int, value: Any) -> bytes:
    if vtype == STR:
        raw = value.encode()
        return struct.pack(order + "Q", len(raw)) + raw
    if vtype == ARR:
        etype, items = value
        return struct.pack(order + "IQ", etype, len(items)) + b"".join(_value(order, etype, v) for v in items)
    return struct.pack(order + _CODES[vtype], value)


def write_gguf(
    path: Path,
    kv: dict[str, tuple[int, Any]],
    tensors: list[tuple[str, tuple[int, ...], int, int]],
    *,
    order: str = "<",
    version: int = 3,
    data_bytes: int | None = None,
) -> Path:
    """A GGUF file with the given metadata and tensor infos ``(name, shape, ggml type, offset)``; the data section
    is ``data_bytes`` zero bytes (default: the last tensor's offset + 4096)."""
    out = b"GGUF" + struct.pack(order + "IQQ", version, len(tensors), len(kv))
    for key, (vtype, value) in kv.items():
        out += _value(order, STR, key) + struct.pack(order + "I", vtype) + _value(order, vtype, value)
    for name, shape, type_id, offset in tensors:
        out += _value(order, STR, name) + struct.pack(order + "I", len(shape))
        out += b"".join(struct.pack(order + "Q", d) for d in shape) + struct.pack(order + "IQ", type_id, offset)
    out += b"\0" * (-len(out) % 32)
    if data_bytes is None:
        data_bytes = max((offset for *_, offset in tensors), default=0) + 4096
    path.write_bytes(out + b"\0" * data_bytes)
    return path


def tiny_kv(**extra: tuple[int, Any]) -> dict[str, tuple[int, Any]]:
    kv: dict[str, tuple[int, Any]] = {
        "general.architecture": (STR, "toy"),
        "toy.block_count": (U32, 4),
        "toy.context_length": (U32, 4096),
        "toy.embedding_length": (U32, 256),
        "toy.feed_forward_length": (U32, 1024),
        "toy.attention.head_count": (U32, 8),
        "tokenizer.ggml.tokens": (ARR, (STR, [f"t{i}" for i in range(1000)])),
    }
    kv.update(extra)
    return kv


# ----------------------------------------------------------------------------------------------------------
# Reading the default model
# ----------------------------------------------------------------------------------------------------------


def test_default_model_metadata(model_path: Path) -> None:
    g = read_gguf(model_path)
    assert g.version == 3
    assert g.architecture == "llama"
    md = g.metadata
    assert md["llama.block_count"] == 30
    assert md["llama.attention.head_count"] == 9
    assert md["llama.attention.head_count_kv"] == 3
    assert md["llama.embedding_length"] == 576
    assert md["llama.feed_forward_length"] == 1536
    assert md["llama.context_length"] == 8192
    assert md["general.languages"] == ("en",)
    assert md["tokenizer.ggml.tokens"] == GgufArray("string", 49152)  # too big to keep: counted, skipped
    # Tensor table: 272 tensors whose data ends exactly at the end of the file.
    assert len(g.tensors) == 272
    assert g.tensor_bytes == 96_576_768  # llama.cpp logs "CPU_Mapped model buffer size = 92.10 MiB"
    assert g.data_offset + g.tensor_bytes == g.file_size == model_path.stat().st_size
    types: dict[str, int] = {}
    for t in g.tensors:
        types[t.type_name] = types.get(t.type_name, 0) + 1
    assert types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    embd = next(t for t in g.tensors if t.name == "token_embd.weight")
    assert embd.shape == (576, 49152) and embd.type_name == "Q8_0" and embd.n_bytes == 576 * 49152 * 34 // 32

    e = estimate_gguf(model_path, 2048)
    s = e.shape
    assert (s.architecture, s.n_layers, s.n_embd, s.n_vocab, s.context_length) == ("llama", 30, 576, 49152, 8192)
    assert s.n_head == (9,) * 30 and s.n_head_kv == (3,) * 30
    assert (s.head_dim_k, s.head_dim_v) == (64, 64)  # no key_length/value_length keys: 576 / 9
    assert e.weights == g.tensor_bytes and e.file_size == g.file_size
    assert dict(e.tensor_types) == {"Q4_1": 66_355_200, "Q8_0": 30_081_024, "F32": 140_544}


@pytest.mark.model
@pytest.mark.timeout(60)
def test_default_model_metadata_matches_llama_cpp(model_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: run `make install`")
    theirs: dict[str, str] = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False).metadata
    ours = read_gguf(model_path).metadata
    compared = 0
    for key, text in theirs.items():  # llama.cpp's own reader gives scalars and strings as text, no arrays
        value = ours[key]
        if isinstance(value, bool):
            expected = str(value).lower()
        elif isinstance(value, float):
            expected = f"{value:.6f}"
        else:
            expected = str(value)
        assert expected == text, key
        compared += 1
    assert compared >= 25 and theirs["llama.attention.head_count_kv"] == "3"


# ----------------------------------------------------------------------------------------------------------
# The estimate
# ----------------------------------------------------------------------------------------------------------


def test_kv_cache_scales_with_n_ctx_and_cache_type(model_path: Path) -> None:
    at = {n: estimate_gguf(model_path, n) for n in (1024, 2048, 4096, 8192)}
    # 2 (K, V) x 30 layers x 2048 x 3 kv heads x 64 x 2 bytes: llama.cpp logs "KV buffer size = 45.00 MiB".
    assert at[2048].kv_cache == 2 * 30 * 2048 * 3 * 64 * 2 == 45 * MiB
    assert at[8192].kv_cache == 180 * MiB
    for n, e in at.items():
        assert e.kv_cache * 2048 == at[2048].kv_cache * n
        assert e.weights == at[2048].weights
        assert e.total == e.weights + e.kv_cache + e.runtime_base + e.compute + DEFAULT_HEADROOM
    assert at[1024].total < at[2048].total < at[4096].total < at[8192].total

    f16 = at[2048].kv_cache
    assert estimate_gguf(model_path, 2048, "f32").kv_cache == 2 * f16
    assert estimate_gguf(model_path, 2048, "q8_0").kv_cache == f16 * 34 // 64  # 34 bytes per 32 elements
    assert estimate_gguf(model_path, 2048, "q4_0").kv_cache == f16 * 18 // 64
    assert "KV cache (q8_0)" in estimate_gguf(model_path, 2048, "q8_0").describe()

    odd = estimate_gguf(model_path, 1000)  # llama.cpp rounds the context up to 256 cells: 1000 -> 1024
    assert (odd.n_ctx, odd.n_ctx_cells, odd.kv_cache) == (1000, 1024, at[1024].kv_cache)

    own = estimate_gguf(model_path)  # no n_ctx: the model's own 8192, and it says so
    assert own.n_ctx == 8192 and own.n_ctx_from_model and own.kv_cache == at[8192].kv_cache
    assert "at the model's n_ctx 8192" in own.describe()
    assert any("model's context length 8192" in n for n in own.notes)
    smaller = own.with_n_ctx(2048)
    assert smaller == at[2048]  # same as estimating from the file, and the "not given" note is gone

    assert at[2048].describe() == (
        f"needs ~{format_bytes(at[2048].total)} (weights 92.1 MiB + KV cache 45.0 MiB at n_ctx 2048 + runtime "
        f"{format_bytes(at[2048].runtime)} + headroom 128 MiB)"
    )
    assert estimate_gguf(model_path, 2048, headroom=0).total == at[2048].expected
    with pytest.raises(ValueError, match="unknown KV cache type 'q3'"):
        estimate_gguf(model_path, 2048, "q3")


def test_each_parallel_sequence_has_a_cache_of_its_own_in_the_estimate(model_path: Path) -> None:
    one, eight = estimate_gguf(model_path, 2048), estimate_gguf(model_path, 2048, parallel=8)
    assert eight.kv_cache == 8 * one.kv_cache == 360 * MiB
    assert eight.compute == one.compute  # a sequence attends to its own 2048 cells, not to all of them
    assert "KV cache 360 MiB at n_ctx 2048 x parallel 8" in eight.describe()
    assert "or a smaller --parallel" in eight.advice(eight.total - 1)
    served = LlamaCppEngine.estimate_memory(EngineSpec(engine="llama.cpp"))  # what `tether serve` asks by default
    own = estimate_gguf(model_path)  # the model's own context (8192): what n_ctx "auto" gives it
    assert served.parallel == PARALLEL_DEFAULT and served.kv_cache == PARALLEL_DEFAULT * own.kv_cache == 1440 * MiB


def test_the_prompt_caches_ram_budget_is_counted_in_the_estimate(model_path: Path) -> None:
    """The RAM store may fill its whole budget under churn, so the fit check counts all of it: by default ("auto")
    as much again as the KV cache, else the size asked for; nothing without a prompt cache or for embeddings."""
    served = LlamaCppEngine.estimate_memory(EngineSpec(engine="llama.cpp", options={"n_ctx": 2048}))
    assert served.prompt_cache_ram == served.kv_cache == 360 * MiB
    assert served.expected == served.weights + 2 * served.kv_cache + served.runtime + served.outputs
    assert served.held == served.expected - served.prompt_cache_ram  # what a measurement is compared with
    assert "prompt cache in RAM up to 360 MiB (held as it fills)" in served.describe()
    advice = served.advice(served.total - 100 * MiB)  # fits with 260 MiB of prompt cache, not with 360
    assert advice.startswith("lower --prompt-cache-ram") and "260 MiB or less fits" in advice, advice
    sized = LlamaCppEngine.estimate_memory(
        EngineSpec(engine="llama.cpp", options={"n_ctx": 2048, "prompt_cache_ram": "64M"})
    )
    assert sized.prompt_cache_ram == 64 * MiB and sized.kv_cache == served.kv_cache
    off = LlamaCppEngine.estimate_memory(EngineSpec(engine="llama.cpp", options={"prompt_cache": False}))
    embed = LlamaCppEngine.estimate_memory(EngineSpec(engine="llama.cpp", options={"embedding": True}))
    assert off.prompt_cache_ram == embed.prompt_cache_ram == 0
    with pytest.raises(EngineLoadError, match=r"prompt_cache_ram.*bad size 'lots'"):
        LlamaCppEngine(EngineSpec(engine="llama.cpp", options={"prompt_cache_ram": "lots"}))


def test_sliding_window_layers_hold_their_window_and_a_micro_batch(tmp_path: Path) -> None:
    """Gemma 3's pattern (5 of every 6 layers slide): those layers hold n_swa + n_ubatch cells a stream, rounded up to
    256, as llama.cpp's iSWA cache sizes them; every cell with swa_full; one pool's worth with a unified cache. The
    GGUF's own per-layer pattern wins over the architecture's."""
    kv = tiny_kv(
        **{
            "general.architecture": (STR, "gemma3"),
            **{k.replace("toy.", "gemma3."): v for k, v in tiny_kv().items() if k.startswith("toy.")},
            "gemma3.block_count": (U32, 12),
            "gemma3.attention.head_count_kv": (U32, 1),
            "gemma3.attention.key_length": (U32, 256),
            "gemma3.attention.value_length": (U32, 256),
            "gemma3.attention.sliding_window": (U32, 512),
        }
    )
    path = write_gguf(tmp_path / "gemma3.gguf", kv, [])
    per_cell = 2 * 256 * 2  # K and V, one head of 256, f16
    e = estimate_gguf(path, 8192, parallel=8)
    assert e.shape.swa_layers == (True,) * 5 + (False,) + (True,) * 5 + (False,)
    assert e.swa_cells == 1024 and e.kv_cache == 8 * (2 * 8192 + 10 * 1024) * per_cell
    assert "at n_ctx 8192 x parallel 8, 10 of 12 layers in a 1024-cell sliding window + runtime" in e.describe()
    assert not any("sliding" in note for note in e.notes)  # modelled, so no "upper bound" note
    assert estimate_gguf(path, 8192, parallel=8, swa_full=True).kv_cache == 8 * 12 * 8192 * per_cell
    assert estimate_gguf(path, 512, parallel=8).kv_cache == 8 * 12 * 512 * per_cell  # the window exceeds n_ctx
    pooled = estimate_gguf(path, 2048, parallel=4, unified=True)  # llama-server's default: 4 slots in one pool
    assert pooled.swa_cells == 2560 and pooled.kv_cache == (2 * 4 * 2048 + 10 * 2560) * per_cell
    assert estimate_gguf(path, 8192, parallel=8, n_batch=256).swa_cells == 768

    kv["gemma3.attention.sliding_window_pattern"] = (ARR, (BOOL, [True, False] * 6))  # per layer, as GGUFs write it
    assert estimate_gguf(write_gguf(tmp_path / "own.gguf", kv, []), 2048).shape.swa_layers == (True, False) * 6


def test_estimate_uses_per_layer_heads_and_key_value_lengths(tmp_path: Path) -> None:
    kv = tiny_kv(
        **{
            "toy.attention.head_count_kv": (ARR, (I32, [2, 0, 2, 4])),  # a layer without attention has no cache
            "toy.attention.key_length": (U32, 48),
            "toy.attention.value_length": (U32, 40),
            "toy.attention.sliding_window": (U32, 512),
        }
    )
    path = write_gguf(tmp_path / "toy.gguf", kv, [("w", (256, 4), 1, 0), ("b", (256,), 0, 2048)])
    e = estimate_gguf(path, 1024)
    assert e.shape.n_head_kv == (2, 0, 2, 4) and (e.shape.head_dim_k, e.shape.head_dim_v) == (48, 40)
    assert e.kv_cache == 1024 * (2 + 0 + 2 + 4) * (48 + 40) * 2
    assert e.weights == 256 * 4 * 2 + 256 * 4
    assert e.shape.n_vocab == 1000
    assert any("sliding-window" in n and "upper bound" in n for n in e.notes)

    plain = write_gguf(tmp_path / "plain.gguf", tiny_kv(), [])
    p = estimate_gguf(plain, 1024)  # no head_count_kv: as many as query heads; head dim 256 / 8
    assert p.shape.n_head_kv == (8,) * 4 and p.kv_cache == 1024 * 4 * 8 * (32 + 32) * 2

    big_endian = write_gguf(tmp_path / "be.gguf", tiny_kv(), [("w", (64,), 0, 0)], order=">")
    assert estimate_gguf(big_endian, 1024).kv_cache == p.kv_cache
    assert read_gguf(big_endian).tensors[0].n_bytes == 256

    # A tensor type newer than the table is sized up to the next tensor (or the end of the data).
    future = write_gguf(tmp_path / "future.gguf", tiny_kv(), [("a", (64,), 99, 0), ("b", (64,), 0, 96)])
    sizes = {t.name: (t.type_name, t.n_bytes) for t in read_gguf(future).tensors}
    assert sizes == {"a": ("type 99", 96), "b": ("F32", 256)}


# ----------------------------------------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------------------------------------


def test_refusal_has_the_numbers_and_override_passes(model_path: Path) -> None:
    e = estimate_gguf(model_path, 8192)
    available = 500 * MiB
    assert e.total > available
    result = check_fit(e, available, "cgroup limit")
    assert not result.ok and not result.fits and not result.overridden and result.needed == e.total
    msg = result.message
    for number in (e.total, e.weights, e.kv_cache, e.runtime, e.headroom):
        assert format_bytes(number) in msg, (format_bytes(number), msg)
    assert "n_ctx 8192" in msg and "500 MiB available (cgroup limit)" in msg
    assert msg.startswith(f"{model_path.name} does not fit: needs ~{format_bytes(e.total)} (weights 92.1 MiB + ")
    assert "--n-ctx" in msg and "--force" in msg and "free memory" in msg
    # The largest context that fits is suggested, and it does fit.
    best = e.max_n_ctx(available)
    assert best is not None and f"up to {best} fits" in msg
    assert e.with_n_ctx(best).total <= available < e.with_n_ctx(best + 256).total

    with pytest.raises(DoesNotFit) as refused:
        ensure_fits(e, available, "cgroup limit")
    assert refused.value.result.message == msg and str(refused.value) == msg

    forced = ensure_fits(e, available, "cgroup limit", override=True)
    assert forced.ok and forced.overridden and not forced.fits
    assert "anyway" in forced.message and "500 MiB available (cgroup limit)" in forced.message

    fits = ensure_fits(e, e.total, "host MemAvailable")
    assert fits.ok and fits.fits and not fits.overridden and "fits" in fits.message

    hopeless = check_fit(e, 100 * MiB, "cgroup limit")  # not even the smallest context fits
    assert e.max_n_ctx(100 * MiB) is None and "even n_ctx 256 needs" in hopeless.message


# ----------------------------------------------------------------------------------------------------------
# Files that are not (complete) GGUF models
# ----------------------------------------------------------------------------------------------------------


def test_non_gguf_files_give_a_clear_error(tmp_path: Path, model_path: Path) -> None:
    zipped = tmp_path / "model.safetensors"
    zipped.write_bytes(b"PK\x03\x04 something else entirely")
    with pytest.raises(GgufError, match=r"model\.safetensors is not a GGUF file \(starts with b'PK\\x03\\x04'"):
        estimate_gguf(zipped)
    with pytest.raises(GgufError, match="expected b'GGUF'"):
        read_gguf(zipped)

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GgufError, match=r"empty\.gguf is empty, expected a GGUF model file"):
        read_gguf(empty)

    with pytest.raises(GgufError, match=r"cannot read model file .*missing\.gguf: No such file"):
        read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(GgufError, match="cannot read model file"):
        read_gguf(tmp_path)  # a directory

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_path.read_bytes()[:100_000])  # inside the vocabulary
    with pytest.raises(GgufError, match=r"cut\.gguf is truncated or corrupt: cannot read .* incomplete download"):
        read_gguf(cut)
    short_data = tmp_path / "short.gguf"
    short_data.write_bytes(model_path.read_bytes()[: 50 * MiB])  # header intact, tensor data cut
    with pytest.raises(GgufError, match=r"short\.gguf is truncated: tensor '.*' ends at byte \d+ but the file has"):
        read_gguf(short_data)

    old = write_gguf(tmp_path / "v1.gguf", tiny_kv(), [], version=1)
    with pytest.raises(GgufError, match=r"GGUF version 1; .* convert the model again"):
        read_gguf(old)
    no_arch = write_gguf(tmp_path / "noarch.gguf", {"general.name": (STR, "x")}, [])
    with pytest.raises(GgufError, match=r"has no general\.architecture"):
        estimate_gguf(no_arch)
    kv = tiny_kv()
    del kv["toy.block_count"]
    with pytest.raises(GgufError, match=r"lacks toy\.block_count"):
        estimate_gguf(write_gguf(tmp_path / "nolayers.gguf", kv, []))


# ----------------------------------------------------------------------------------------------------------
# The estimate against a real llama.cpp runner
# ----------------------------------------------------------------------------------------------------------


def _vm_hwm(pid: int) -> int:
    """The process's peak RSS so far (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


@pytest.fixture(params=["smollm2", "gemma3-270m"])
def family(request: pytest.FixtureRequest, model_path: Path) -> Path:
    """Each model family the estimate must hold for: the default model (llama, every layer attends to the whole
    context) and Gemma 3 270M (sliding-window attention on 15 of 18 layers, a 262,144-token vocabulary)."""
    if request.param == "smollm2":
        return model_path
    missing = gemma_missing()
    if missing:
        pytest.skip(missing)
    return gemma_path()


@pytest.mark.model
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_refused_model_loads_with_override_and_estimate_matches_the_runner(family: Path) -> None:
    """The estimate of what the runner holds (``held``: weights + KV cache + runtime, without headroom) is its peak.
    It is compared with the runner's RSS, which counts resident weights whether file-backed or not plus its private
    memory: right after ready (below: the attention scratch is not touched yet; within +-30%) and at its peak
    (VmHWM) after a prompt that fills ~90% of the context: within 10%, for both families. Measured here: see
    docs/design.md, "The memory estimate"."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: run `make install`")
    estimate = estimate_gguf(family, 2048)
    available = estimate.total // 2
    with pytest.raises(DoesNotFit, match=r"does not fit: needs ~.* available \(test limit\)"):
        ensure_fits(estimate, available, "test limit")
    assert ensure_fits(estimate, available, "test limit", override=True).ok  # ... so it is loaded anyway

    # One thread: on a small shared box, ggml's spinning thread barriers collapse under CPU contention.
    options = {"n_ctx": 2048, "n_threads": 1, "parallel": 1, "prompt_cache_ram": 0}
    spec = EngineSpec(engine="llama.cpp", model=str(family), options=options)
    with anyio.fail_after(110):
        async with Supervisor(spec) as sup:
            await sup.ready()
            assert sup.pid is not None
            ready = process_memory(sup.pid)
            assert ready is not None
            record = record_measured(estimate, ready)
            print("ready:", record.describe())
            assert ready.file >= 0.9 * estimate.weights  # the mmapped weights are resident
            assert ready.anon >= estimate.kv_cache  # the KV cache is allocated and zeroed at load
            assert 0.7 <= record.ratio <= 1.3, record.describe()

            handle = await sup.generate(GenerateParams(prompt="hello world " * 900, max_tokens=4))  # ~1800 tokens
            _, status = await handle.text()
            assert status.state == "complete", status
            peak = _vm_hwm(sup.pid)
            print(f"peak: VmHWM {format_bytes(peak)}, {peak / estimate.held:.3f} of the estimate {estimate.describe()}")
            assert 0.9 * estimate.held <= peak <= 1.1 * estimate.held, (peak, estimate.describe())


@pytest.mark.model
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_estimate_bounds_the_ready_runner_at_n_ctx_8192(model_path: Path) -> None:
    """At n_ctx 8192 the ready runner holds weights + KV cache (180 MiB) + its base, but not yet the attention
    scratch a full context needs (measured: 340 MiB ready, 564 MiB after a 95%-full prompt, estimate 556 MiB):
    the estimate must bound it from above, and the static part from below."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: run `make install`")
    estimate = estimate_gguf(model_path, 8192)
    spec = EngineSpec(engine="llama.cpp", options={"n_ctx": 8192, "n_threads": 1, "parallel": 1})
    with anyio.fail_after(110):
        async with Supervisor(spec) as sup:
            await sup.ready()
            assert sup.pid is not None
            ready = process_memory(sup.pid)
            assert ready is not None
            print("ready:", record_measured(estimate, ready).describe())
            static = estimate.weights + estimate.kv_cache + estimate.runtime_base
            assert 0.7 * static <= ready.rss <= estimate.expected, (ready, estimate.describe())
            assert ready.anon >= estimate.kv_cache


def test_an_auto_context_is_the_models_own_and_the_fit_check_lowers_it_to_what_memory_holds(model_path: Path) -> None:
    """n_ctx "auto" (the default) is the context the model was trained for (8192 for the default model); the fit
    check pins it in the spec it hands on, and on a node that cannot hold it lowers it to the largest that fits and
    says so with the numbers; a context the user chose is never changed."""
    from tether.engines.llamacpp.estimate import estimate_for_spec
    from tether.node import fit
    from tether.node.memory import NodeMemory

    spec = EngineSpec(engine="llama.cpp", options={})
    own = estimate_for_spec(spec, LlamaCppEngine.options)
    assert own.n_ctx == 8192 and own.n_ctx_from_model and own.parallel == PARALLEL_DEFAULT
    roomy = NodeMemory(available=64 << 30, source="test", host_total=64 << 30, host_available=64 << 30)
    result = fit.assess(spec, node=roomy, sized=True)
    assert result.ok and result.spec is not None and result.spec.options["n_ctx"] == 8192
    assert "lowered" not in result.message

    # Between what 8192 needs with its RAM store and without it: the store (auto) takes the room left, n_ctx stays.
    rest = own.total - own.prompt_cache_ram
    roomy_enough = rest + own.prompt_cache_ram // 4
    node = NodeMemory(available=roomy_enough, source="test", host_total=64 << 30, host_available=roomy_enough)
    result = fit.assess(spec, node=node, sized=True)
    assert result.ok and result.spec is not None and result.spec.options["n_ctx"] == 8192
    assert result.spec.options["prompt_cache_ram"] == own.prompt_cache_ram // 4, result.spec.options
    assert result.estimate is not None and result.estimate.total == roomy_enough
    assert f"the prompt cache's RAM store (auto: the KV cache's size, {format_bytes(own.prompt_cache_ram)}) gets" in (
        result.message
    )

    smaller = own.with_n_ctx(2048)
    tight = rest - (rest - (smaller.total - smaller.prompt_cache_ram)) // 2  # between 2048's rest and 8192's
    small = NodeMemory(available=tight, source="test", host_total=64 << 30, host_available=tight)
    result = fit.assess(spec, node=small, sized=True)
    lowered = result.spec.options["n_ctx"] if result.spec is not None else None
    assert result.ok and isinstance(lowered, int) and 2048 <= lowered < 8192 and lowered % 256 == 0
    assert result.estimate is not None and result.estimate.total <= tight
    assert f"n_ctx lowered from 8192 (auto: the model's context) to {lowered}, the most that fits" in result.message
    assert format_bytes(tight) in result.message

    chosen = EngineSpec(engine="llama.cpp", options={"n_ctx": 8192})  # the user's choice: refused, never lowered
    result = fit.assess(chosen, node=small, sized=True)
    assert not result.ok and result.spec is not None and result.spec.options["n_ctx"] == 8192
    assert "use a smaller --n-ctx" in result.message or "prompt-cache-ram" in result.message
