"""The GPU proof's plumbing, without a GPU: what ``bench/gpu_bundle.py`` carries to the device machine (the strip
list, the size check, the wheels' closure, the random-weights GGUF) and ``bench/gpu.py --engine llama.cpp``'s
CPU rehearsal. The device run itself (``bench/gpu_device.sh``, a ~4 min CUDA build) is not a test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gpu_bundle  # noqa: E402
from tether.engines.gguf import read_gguf  # noqa: E402

MIB = 1 << 20

KEPT = (
    "CMakeLists.txt",
    "LICENSE",
    "cmake/common.cmake",
    "include/llama.h",
    "src/llama.cpp",
    "src/models/llama.cpp",
    "ggml/CMakeLists.txt",
    "ggml/cmake/common.cmake",
    "ggml/include/ggml.h",
    "ggml/src/CMakeLists.txt",
    "ggml/src/ggml.c",
    "ggml/src/ggml-cpu/ggml-cpu.c",
    "ggml/src/ggml-cpu/arch/x86/quants.c",
    "ggml/src/ggml-cuda/CMakeLists.txt",
    "ggml/src/ggml-cuda/vendors/cuda.h",
    "ggml/src/ggml-cuda/template-instances/mmq-instance-q8_0.cu",
    "vendor/CMakeLists.txt",
    "vendor/nlohmann/CMakeLists.txt",
    "vendor/hash/sha1/sha1.c",
    "gguf-py/gguf/gguf_writer.py",
    "gguf-py/LICENSE",
)
STRIPPED = (
    "models/ggml-vocab-llama-bpe.gguf",
    "docs/build.md",
    "tests/test-backend-ops.cpp",
    "examples/simple/simple.cpp",
    "tools/server/server.cpp",
    "tools/server/public/index.html.gz",
    "common/common.cpp",
    "media/llama0-logo.png",
    ".github/workflows/build.yml",
    "ggml/src/ggml-vulkan/ggml-vulkan.cpp",
    "ggml/src/ggml-metal/ggml-metal.m",
    "ggml/src/ggml-sycl/CMakeLists.txt",
    "ggml/src/ggml-hip/CMakeLists.txt",
    "vendor/cpp-httplib/httplib.cpp",
    "vendor/cpp-httplib/CMakeLists.txt",
    "vendor/miniaudio/miniaudio.h",
    "vendor/stb/stb_image.h",
    "gguf-py/tests/test_quants.py",
    "gguf-py/gguf/__pycache__/constants.cpython-312.pyc",
    "convert_hf_to_gguf.py",
)


def test_the_strip_keeps_what_cmake_builds_and_removes_the_rest(tmp_path: Path) -> None:
    for rel in (*KEPT, *STRIPPED):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x" * 10)
    removed = gpu_bundle.strip(tmp_path)
    assert removed == sorted(STRIPPED)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(KEPT)
    assert not (tmp_path / "models").exists() and not (tmp_path / "ggml" / "src" / "ggml-vulkan").exists()
    assert gpu_bundle.carry_size(tmp_path) == 10 * len(KEPT)


def test_the_size_check_names_what_is_too_big() -> None:
    assert gpu_bundle.over_budget({"llama.cpp": 13 * MIB, "wheels": 4 * MIB}, tree=4 * MIB) == []
    (problem,) = gpu_bundle.over_budget({"llama.cpp": 50 * MIB, "wheels": 6 * MIB}, tree=4 * MIB)
    assert "56.0 MiB, over its 55 MiB budget (llama.cpp 50.0 MiB, wheels 6.0 MiB)" in problem
    (problem,) = gpu_bundle.over_budget({"llama.cpp": 50 * MIB}, tree=20 * MIB)
    assert "70.0 MiB, over the device tool's 64 MiB" in problem


def test_the_wheels_are_what_tether_and_llama_cpp_python_need_but_numpy() -> None:
    closure = gpu_bundle.runtime_closure([*gpu_bundle.tether_requirements(), "diskcache>=5.6.1", "numpy"])
    carried = {name for name in closure if name not in gpu_bundle.DEVICE_HAS}
    assert {"msgspec", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "pydantic-settings"} <= carried
    assert {"python-dotenv", "diskcache", "typing-extensions", "anyio", "httpx", "psutil", "nvidia-ml-py"} <= carried
    assert "numpy" in closure and "numpy" not in carried  # the device's own, which its torch was built against
    assert "tether" not in closure and "colorama" not in closure  # markers false on the device's Linux


def test_synth_writes_the_skeletons_keys_and_tensors_with_random_weights(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    spec: dict[str, Any] = {
        "source": "tiny.gguf",
        "architecture": "llama",
        "kv": [
            ["general.name", ["STRING"], "Tiny"],
            ["general.file_type", ["UINT32"], 3],
            ["llama.block_count", ["UINT32"], 1],
            ["llama.attention.layer_norm_rms_epsilon", ["FLOAT32"], 1e-5],
            ["tokenizer.ggml.add_bos_token", ["BOOL"], False],
            ["tokenizer.ggml.tokens", ["ARRAY", "STRING"], ["<s>", "</s>", "Ġa"]],
            ["tokenizer.ggml.token_type", ["ARRAY", "INT32"], [3, 3, 1]],
            ["tokenizer.ggml.eos_token_id", ["UINT32"], 1],
        ],
        "tensors": [["token_embd.weight", [64, 3], "Q4_1"], ["blk.0.attn_norm.weight", [64], "F32"]],
    }
    out = tmp_path / "tiny.gguf"
    assert gpu_bundle.synthesize(spec, out) == out.stat().st_size
    written = read_gguf(out)
    meta = written.metadata
    assert meta["general.architecture"] == "llama" and meta["general.file_type"] == 7  # MOSTLY_Q8_0
    assert str(meta["general.name"]).startswith("Tiny (random weights")
    assert meta["llama.block_count"] == 1 and meta["tokenizer.ggml.eos_token_id"] == 1
    assert meta["tokenizer.ggml.tokens"] == ("<s>", "</s>", "Ġa") and meta["tokenizer.ggml.add_bos_token"] is False
    tensors = {t.name: (t.shape, t.type_name) for t in written.tensors}
    assert tensors == {"token_embd.weight": ((64, 3), "Q8_0"), "blk.0.attn_norm.weight": ((64,), "F32")}
    embd = next(t for t in written.tensors if t.name == "token_embd.weight")
    data = out.read_bytes()[written.data_offset + embd.offset :][: embd.n_bytes]
    assert len(set(data)) > 16  # random, not zeros


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_llama_cpp_gpu_check_rehearses_on_the_cpu_or_runs() -> None:
    """Without a GPU: skipped with the reason, after serving the model on the CPU (the device script's plumbing);
    on a GPU machine, the whole check."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--engine", "llama.cpp", "--tokens", "16"],
        capture_output=True,
        text=True,
        timeout=380,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "gpu" and result["engine"] == "llama.cpp", out.stdout
    if result.get("skipped"):
        assert out.returncode == 0 and result["ok"] is None, out.stdout + out.stderr
        assert "NVML" in result["skipped"] or "nvidia-smi" in result["skipped"] or "CPU build" in result["skipped"]
        rehearsal = result["rehearsal"]
        assert rehearsal["cpu_tokens_per_s"] > 0 and rehearsal["footprint"] > 0, result
        assert not (rehearsal["offload"] or {}).get("n_gpu_layers"), result
    else:
        assert out.returncode == 0 and result["ok"] is True, out.stdout + out.stderr
