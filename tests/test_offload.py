"""Layers on NVIDIA GPUs by measured VRAM: the split as a function of given VRAM figures (pure: NVML's own code paths
run where a device is, in ``bench/gpu.py --engine llama.cpp``), the fit check's verdicts and words, and the per-layer
bytes the split moves against what llama.cpp itself allocates for them on this CPU."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from conftest import gemma_missing, gemma_path, model_missing, run_options
from tether.cluster.agent import Verdict
from tether.cluster.placement import whole_order
from tether.engines.llamacpp.engine import LlamaCppEngine
from tether.engines.llamacpp.estimate import (
    CUDA_CONTEXT,
    GPU_MARGIN,
    ModelEstimate,
    assign_layers,
    estimate_gguf,
    fit_layers,
    gpu_build_missing,
    layer_plan,
)
from tether.models import default_model_path
from tether.node.diagnosis import Evidence, diagnose
from tether.node.fit import assess, gpu_shortfall
from tether.node.memory import NodeMemory
from tether.node.nvml import GpuDevice
from tether.node.spawn import ExitStatus
from tether.protocol import CauseKind, EngineSpec, RunnerException

MiB = 1 << 20
GiB = 1 << 30

pytestmark = pytest.mark.skipif(model_missing() is not None, reason=model_missing() or "")


@pytest.fixture(scope="module")
def smollm2() -> ModelEstimate:
    return estimate_gguf(default_model_path(), n_ctx=8192, parallel=8)


def node(*free: int, total: int = 80 * GiB) -> NodeMemory:
    gpus = tuple(GpuDevice(i, "NVIDIA H100 80GB HBM3", total, f) for i, f in enumerate(free))
    return NodeMemory(64 * GiB, "host MemAvailable", 128 * GiB, 64 * GiB, gpus=gpus)


@pytest.fixture
def cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's llama.cpp is a CPU build; the split is judged here as a CUDA build's would be."""
    monkeypatch.setattr("tether.engines.llamacpp.sizing.gpu_build_missing", lambda: None)


def test_layers_leave_the_host_from_the_output_layer_down_and_share_by_split() -> None:
    # 30 repeating layers and the output layer; the last 11 leave the host, two devices 1:1, as llama.cpp assigns
    assert assign_layers(31, 20, (1.0, 1.0)) == ((20, 21, 22, 23, 24, 25), (26, 27, 28, 29, 30))
    assert assign_layers(31, 30, (1.0,)) == ((30,),)  # one layer offloaded: the output layer
    # the ranks' rule is the same rule
    plan = layer_plan(30, (2.0, 1.0, 1.0))
    assert plan.layers[1:] == assign_layers(31, len(plan.layers[0]), plan.tensor_split)


def test_every_byte_is_on_the_host_or_on_a_device(smollm2: ModelEstimate) -> None:
    layers = smollm2.shape.n_layers
    for n in (0, 1, 2, 15, layers, layers + 1):
        split = smollm2.offloaded(n, (0, 1), (3.0, 1.0))
        offload = split.offload
        assert offload is not None and offload.n_gpu_layers == min(n, layers + 1)
        on_gpu = [i for held in offload.device_layers for i in held]
        assert sorted(on_gpu) == list(range(layers + 1 - n, layers + 1))
        weights = sum(smollm2.layer_weights[i] for i in on_gpu)
        tied = smollm2.tied_output if layers in on_gpu else 0  # the output layer's copy of the embeddings
        kv = sum(smollm2.layer_kv[i] for i in on_gpu if i < layers)
        assert split.weights + weights == smollm2.weights
        assert split.kv_cache + kv == smollm2.kv_cache
        used = [held for held in offload.device_layers if held]
        assert sum(offload.vram) >= weights + tied + kv + CUDA_CONTEXT * len(used)
        assert split.whole().describe() == smollm2.describe()  # nothing lost going there and back


def test_auto_takes_the_most_layers_whose_share_fits_each_budget(smollm2: ModelEstimate) -> None:
    layers = smollm2.shape.n_layers + 1
    everything = smollm2.offloaded(layers).offload
    assert everything is not None
    whole = fit_layers(smollm2, [everything.vram[0]]).offload
    assert whole is not None and whole.n_gpu_layers == layers and whole.vram == everything.vram
    for budget in (CUDA_CONTEXT // 2, CUDA_CONTEXT + 200 * MiB, everything.vram[0] - 1):
        chosen = fit_layers(smollm2, [budget]).offload
        assert chosen is not None and chosen.auto
        n = chosen.n_gpu_layers
        assert n < layers
        if n:
            assert chosen.vram[0] <= budget
        more = smollm2.offloaded(n + 1).offload
        assert more is not None and more.vram[0] > budget, f"{n + 1} layers fit {budget} too"
    # two devices: split by their budgets, each within its own
    two = fit_layers(smollm2, [CUDA_CONTEXT + 600 * MiB, CUDA_CONTEXT + 200 * MiB], (0, 1)).offload
    assert two is not None and two.n_gpu_layers > 0
    assert all(need <= budget for need, budget in zip(two.vram, two.budgets, strict=True) if budget is not None)


def test_a_context_resized_keeps_its_layers_on_the_gpu(smollm2: ModelEstimate) -> None:
    split = smollm2.offloaded(20)
    smaller = split.with_n_ctx(2048)
    assert smaller.offload is not None and smaller.offload.n_gpu_layers == 20
    assert smaller.offload.vram[0] < split.offload.vram[0]  # type: ignore[union-attr]
    assert smaller.kv_cache == smollm2.with_n_ctx(2048).offloaded(20).kv_cache


@pytest.mark.usefixtures("cuda_build")
def test_the_fit_check_chooses_the_layers_and_says_it_with_the_numbers() -> None:
    spec = EngineSpec(engine="llama.cpp", options={"n_ctx": 8192})
    result = assess(spec, node=node(80 * GiB), sized=True)
    assert result.ok and result.spec is not None
    assert result.spec.options["n_gpu_layers"] == 31 and result.spec.options["gpu"] == [0]
    assert "31 of 31 layers on the GPU" in result.message and "n_gpu_layers 31 (auto" in result.message
    assert f"less a {GPU_MARGIN // GiB}.00 GiB margin" in result.message, result.message
    # a VRAM limit: fewer layers, said so, and the host holds the rest
    limited = msgspec.structs.replace(spec, options={**spec.options, "gpu_memory_limit": "700M"})
    result = assess(limited, node=node(80 * GiB), sized=True)
    assert result.ok and result.spec is not None
    n = result.spec.options["n_gpu_layers"]
    assert 0 < n < 31 and "(auto: the most that fit)" in result.message and "limited to 700 MiB" in result.message
    # a card almost full: no layer fits, every layer on the CPU, and the fit says why
    result = assess(spec, node=node(GPU_MARGIN + 100 * MiB), sized=True)
    assert result.ok and result.spec is not None and result.spec.options["n_gpu_layers"] == 0
    assert "not one layer fits" in result.message
    # the batch-invariant kernels are the CPU's: a deterministic instance offloads nothing
    deterministic = msgspec.structs.replace(spec, options={**spec.options, "deterministic": True})
    result = assess(deterministic, node=node(80 * GiB), sized=True)
    assert result.spec is not None and result.spec.options["n_gpu_layers"] == 0


@pytest.mark.usefixtures("cuda_build")
def test_a_count_given_is_kept_and_refused_before_load_when_the_gpu_cannot_hold_it() -> None:
    spec = EngineSpec(engine="llama.cpp", options={"n_ctx": 8192, "n_gpu_layers": 31})
    result = assess(spec, node=node(GPU_MARGIN + CUDA_CONTEXT + 300 * MiB), sized=True)
    assert not result.ok
    assert "does not fit the GPU" in result.message and "GPU 0 needs" in result.message
    assert re.search(r"use n_gpu_layers \d+ fits \(auto\)", result.message), result.message
    forced = assess(spec, node=node(GPU_MARGIN + CUDA_CONTEXT + 300 * MiB), sized=True, override=True)
    assert forced.ok and forced.spec is not None and forced.spec.options["n_gpu_layers"] == 31
    # neither memory holds it: both are named
    small = NodeMemory(100 * MiB, "host MemAvailable", GiB, 100 * MiB, gpus=node(GPU_MARGIN + 300 * MiB).gpus)
    both = assess(spec, node=small, sized=True).message
    assert "does not fit the GPU" in both and "; and the host: " in both and "100 MiB available" in both, both
    # device indexes this node does not have
    other = msgspec.structs.replace(spec, options={"gpu": "0,3"})
    assert "gpu names device 3" in assess(other, node=node(80 * GiB), sized=True).message


def test_without_a_gpu_or_a_cuda_build_every_layer_stays_on_the_cpu_and_a_visible_gpu_is_mentioned() -> None:
    spec = EngineSpec(engine="llama.cpp", options={"n_ctx": 2048})
    alone = assess(spec, node=node(), sized=True)
    assert alone.ok and alone.spec is not None and alone.spec.options["n_gpu_layers"] == 0
    assert "GPU" not in alone.message
    # this machine's build is the CPU's: a GPU that NVML lists is said to be unused, and why
    result = assess(spec, node=node(80 * GiB), sized=True)
    assert result.ok and result.spec is not None and result.spec.options["n_gpu_layers"] == 0
    assert "GPU 0 (NVIDIA H100 80GB HBM3) visible, but the llama.cpp in" in result.message
    assert "TETHER_GPU=cuda make install" in result.message


def test_the_build_probe_reads_the_library_the_runners_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    why = gpu_build_missing()
    assert why is not None and "built for the CPU only (no libggml-cuda)" in why  # this machine's build
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    assert str(tmp_path) in (gpu_build_missing() or "")


# ----------------------------------------------------------------------------------------------------------
# The bytes the split moves, against llama.cpp's own buffers
# ----------------------------------------------------------------------------------------------------------

LOAD = """
import sys
import llama_cpp
llama_cpp.Llama(
    model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_batch=512, n_gpu_layers=0, swa_full=False, verbose=True
)
"""


def buffers(path: Path, n_ctx: int) -> tuple[float, float]:
    """llama.cpp's model and KV buffer sizes (MiB, summed over buffer types) loading ``path`` on the CPU."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LOAD), str(path), str(n_ctx)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    # the mapped file holds every tensor; a CPU_REPACK buffer holds second copies of some (not on a GPU's path)
    model = sum(float(v) for v in re.findall(r"CPU_Mapped model buffer size =\s+([\d.]+) MiB", out.stderr))
    kv = sum(float(v) for v in re.findall(r"KV buffer size =\s+([\d.]+) MiB", out.stderr))
    assert model and kv, out.stderr[-3000:]
    return model, kv


@pytest.mark.model
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["smollm2", "gemma3-270m"])
def test_each_layers_bytes_are_what_llama_cpp_allocates_for_them(family: str) -> None:
    """The split moves each layer's weights and KV cache as the estimate counts them: their sums over every layer
    (and the host's own) are llama.cpp's model and KV buffers to the 0.01 MiB it logs (a CUDA build allocates the
    same tensors in a device's buffers instead of the host's)."""
    if family == "gemma3-270m":
        missing, path = gemma_missing(), gemma_path()
    else:
        missing, path = None, default_model_path()
    if missing is not None:
        pytest.skip(missing)
    estimate = estimate_gguf(path, n_ctx=2048)
    model, kv = buffers(path, 2048)
    assert sum(estimate.layer_weights) + estimate.input_weights == estimate.weights
    assert abs(estimate.weights / MiB - model) < 0.02, (estimate.weights / MiB, model)
    assert abs(sum(estimate.layer_kv) / MiB - kv) < 0.02, (sum(estimate.layer_kv) / MiB, kv)


def test_the_flags_set_the_gpu_options() -> None:
    assert run_options("--n-gpu-layers", "auto", "--gpu", "0,1", "--gpu-memory-limit", "2G") == {
        "n_gpu_layers": "auto",
        "gpu": "0,1",
        "gpu_memory_limit": 2 << 30,
    }
    assert run_options("--n-gpu-layers", "12") == {"n_gpu_layers": 12}


# ----------------------------------------------------------------------------------------------------------
# Causes on the GPU: llama.cpp's CUDA backend's own lines (its format strings; a real one is bench/gpu.py's)
# ----------------------------------------------------------------------------------------------------------

LOAD_OOM = [
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 2048.00 MiB on device 0: cudaMalloc failed: out of memory",
    "alloc_tensor_range: failed to allocate CUDA0 buffer of size 2147483648",
    "llama_model_load: error loading model: unable to allocate CUDA0 buffer",
]
STEP_OOM = [
    "CUDA error: out of memory",
    "  current device: 0, in function alloc at ggml/src/ggml-cuda/ggml-cuda.cu:421",
    "  cudaMalloc((void **) &ptr, look_ahead_size)",
    "ggml/src/ggml-cuda/ggml-cuda.cu:88: CUDA error",
]


def test_a_cuda_out_of_memory_is_an_out_of_memory_of_the_gpu_whether_at_load_or_mid_step() -> None:
    failed = RunnerException(
        "EngineLoadError", "llama.cpp could not load smollm2 from /m.gguf", "", "load", load_error=True
    )
    cause = diagnose(Evidence(ExitStatus(1, None), failed, LOAD_OOM, "load"))
    assert cause.kind is CauseKind.OUT_OF_MEMORY
    assert "ran out of GPU memory while load (CUDA out of memory: ggml_backend_cuda" in cause.summary
    assert any("--n-gpu-layers" in line for line in cause.evidence)
    aborted = diagnose(Evidence(ExitStatus(None, signal.SIGABRT), None, STEP_OOM, "generate"))
    assert aborted.kind is CauseKind.OUT_OF_MEMORY and "was killed by SIGABRT" in aborted.summary, aborted.summary
    # other CUDA failures are the engine's errors, named
    illegal = ["CUDA error: an illegal memory access was encountered", "ggml-cuda.cu:88: CUDA error"]
    crashed = diagnose(Evidence(ExitStatus(None, signal.SIGABRT), None, illegal, "generate"))
    assert crashed.kind is CauseKind.ENGINE_ERROR and "GPU illegal memory access" in crashed.summary
    ecc = ["CUDA error: uncorrectable ECC error encountered"]
    assert "GPU ECC error" in diagnose(Evidence(ExitStatus(None, signal.SIGABRT), None, ecc, "generate")).summary


@pytest.mark.usefixtures("cuda_build")
def test_what_the_gpu_lacks_for_every_layer_is_what_evicting_idle_models_must_give_back() -> None:
    spec = EngineSpec(engine="llama.cpp", options={"n_ctx": 8192})
    whole = LlamaCppEngine.estimate_memory(spec)
    short, target = gpu_shortfall(spec, whole, node(80 * GiB))
    assert short == 0 and target is not None and target.offload is not None and target.offload.n_gpu_layers == 31
    tight = GPU_MARGIN + CUDA_CONTEXT + 100 * MiB
    short, target = gpu_shortfall(spec, whole, node(tight))
    assert target is not None and target.offload is not None
    assert short == target.offload.vram[0] - (tight - GPU_MARGIN) > 0
    given = msgspec.structs.replace(spec, options={**spec.options, "n_gpu_layers": 5})
    short, target = gpu_shortfall(given, whole, node(tight))
    assert target is not None and target.offload is not None and target.offload.n_gpu_layers == 5
    # a limit the user set caps the GPU anyway; the batch-invariant build stays on the CPU: nothing to make room for
    for options in ({"gpu_memory_limit": "1G"}, {"deterministic": True}, {"n_gpu_layers": 0}):
        other = msgspec.structs.replace(spec, options={**spec.options, **options})
        assert gpu_shortfall(other, whole, node(tight)) == (0, None), options


def test_without_a_cuda_build_there_is_no_gpu_room_to_make() -> None:
    spec = EngineSpec(engine="llama.cpp", options={"n_ctx": 8192})
    assert gpu_shortfall(spec, LlamaCppEngine.estimate_memory(spec), node(GPU_MARGIN)) == (0, None)


@pytest.mark.usefixtures("cuda_build")
def test_a_cluster_places_the_model_on_the_node_whose_gpu_holds_the_most_of_it() -> None:
    """Each agent's verdict carries the layers its own fit check put on its GPUs (``FitResult.gpu_layers``); placement
    prefers the node whose GPU holds every layer over one with more host memory and a GPU that holds fewer, or none."""
    spec = EngineSpec(engine="llama.cpp", options={"n_ctx": 8192})

    def verdict(node_id: str, memory: NodeMemory) -> Verdict:
        result = assess(spec, node=memory)
        assert result.ok, result.message
        return Verdict(node_id, True, result.needed, memory.available, memory.source, result.message, result.gpu_layers)

    roomy = NodeMemory(200 * GiB, "host MemAvailable", 256 * GiB, 200 * GiB)  # no GPU
    small_gpu = node(GPU_MARGIN + 1200 * MiB)  # a GPU that holds some layers
    whole_gpu = node(80 * GiB)
    verdicts = [verdict("roomy", roomy), verdict("small", small_gpu), verdict("whole", whole_gpu)]
    assert [v.gpu_layers for v in verdicts][:1] == [0] and 0 < verdicts[1].gpu_layers < verdicts[2].gpu_layers == 31
    assert [v.node_id for v in whole_order(verdicts, set(), "SPREAD")] == ["whole", "small", "roomy"]
