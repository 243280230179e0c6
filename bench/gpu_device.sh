#!/usr/bin/env bash
# The GPU proof on the device machine, from a working tree with .device-carry/ (bench/gpu_bundle.py made it):
# llama.cpp offloads layers by measured VRAM, VRAM shows in every footprint, an orphan's VRAM is found and reaped.
#
# The device has no network, so everything comes from the carry: its wheels go to $WORK/site (pip, no index), its
# llama.cpp is built here with CMake and ninja (CUDA for sm_90 when `nvidia-smi -L` and nvcc both work, else the
# CPU alone: nvcc without a driver proves nothing), its skeleton becomes a random-weights GGUF of the default model
# (bench/gpu_bundle.py synth), and `bench/gpu.py --engine llama.cpp` measures, its last line one JSON object.
# Without a GPU the bench runs its CPU rehearsal and prints "skipped" with the reason (exit 0): the same plumbing.
#
# The CUDA build is lean: one architecture (90-real: H100 and H200), no NCCL, and flash attention compiled out
# (GGML_CUDA_FA=OFF empties 34 of its 141 CUDA files, the FA kernel templates; llama.cpp's "auto" then finds the
# op unsupported and runs attention without it; GPU_DEVICE_CUDA_FA=ON compiles it, f16 K/V only). The libraries
# are llama-cpp-python 0.3.36's own vendored source, so its bindings (.device-carry/llama_cpp, on PYTHONPATH) load
# them by LLAMA_CPP_LIB_PATH. The variables that tune this script are GPU_DEVICE_* (tether warns of unknown
# TETHER_* ones).
#
# Everything is bounded: the build by a `timeout` (what GPU_DEVICE_DEADLINE, default 530 s from the start, leaves
# once BENCH_NEEDS is set aside), the bench by what is left of the deadline (SIGTERM: it stops its servers and
# prints what it measured). Each phase prints its wall seconds. Output: stdout, and $OUT (the device tool's folder; a
# temporary one when unset): device.log, build.log.gz, gpu-bench.log, gpu.json (the bench's last line),
# runner-logs.tar.gz, nvidia-smi.txt.
#
# Run (device, from the repository root): bash bench/gpu_device.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CARRY=${GPU_DEVICE_CARRY:-$ROOT/.device-carry}
WORK=${GPU_DEVICE_WORK:-/tmp/tether-gpu}
OUT=${OUT:-$(mktemp -d /tmp/tether-gpu-out.XXXXXX)}
DEADLINE=${GPU_DEVICE_DEADLINE:-530}
BENCH_NEEDS=140 # seconds the bench needs after the build (synthesis included); the build gets the rest
CUDA_FA=${GPU_DEVICE_CUDA_FA:-OFF}
PY=${PYTHON:-python3}
SITE=$WORK/site
BUILD=$WORK/build
MODEL=$WORK/smollm2-synthetic-q8_0.gguf
mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1

phase_began=$SECONDS
phase() {
    echo "== +${SECONDS}s (previous phase $((SECONDS - phase_began)) s) $*"
    phase_began=$SECONDS
}
fail() {
    echo "FAILED: $*" >&2
    exit 1
}
finish() {
    local rc=$?
    [ ! -f "$OUT/build.log" ] || gzip -f "$OUT/build.log" # compiler warnings: MiBs
    [ $rc -eq 0 ] || echo "gpu_device.sh: exit $rc after ${SECONDS}s" >&2
}
trap finish EXIT

phase "start: $(uname -srm), $(nproc) CPUs, $("$PY" --version 2>&1) at $(command -v "$PY"), out $OUT"
[ -f "$CARRY/MANIFEST.json" ] || fail "no $CARRY/MANIFEST.json: run bench/gpu_bundle.py here first, carry .device-carry"

phase "installing the carried wheels into $SITE"
rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$CARRY"/wheels/*.whl
cp -r "$CARRY/llama_cpp" "$SITE/llama_cpp"
ln -sfn "$BUILD/bin" "$SITE/llama_cpp/lib" # llama_cpp/_ggml.py loads libggml from there alone
export PYTHONPATH="$ROOT/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

phase "looking for a GPU"
GPU=0
WHY="no GPU"
if ! command -v nvidia-smi >/dev/null 2>&1; then
    WHY="nvidia-smi is not installed (no NVIDIA driver)"
elif ! nvidia-smi -L >"$OUT/nvidia-smi.txt" 2>&1; then
    WHY="nvidia-smi -L failed (no working driver): $(head -c 300 "$OUT/nvidia-smi.txt")"
elif ! command -v nvcc >/dev/null 2>&1; then
    WHY="no nvcc to build llama.cpp's CUDA backend"
else
    GPU=1
    nvidia-smi >>"$OUT/nvidia-smi.txt" 2>&1 || true
    cat "$OUT/nvidia-smi.txt"
    nvcc --version | tail -2
fi
if [ $GPU = 1 ]; then echo "GPU: yes"; else echo "GPU: none ($WHY): a CPU build, the bench rehearses"; fi

command -v cmake >/dev/null 2>&1 || fail "cmake is not installed"
GENERATOR=(-G Ninja)
command -v ninja >/dev/null 2>&1 || { GENERATOR=(); echo "no ninja: CMake's default generator"; }
OPTIONS=(
    "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON
    -DGGML_NATIVE=ON -DGGML_CCACHE=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
)
if [ "$(uname -m)" = x86_64 ]; then # no AMX tiles, as the project builds llama.cpp everywhere (they segfault)
    OPTIONS+=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    OPTIONS+=("-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
if [ $GPU = 1 ]; then
    OPTIONS+=(
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real "-DCMAKE_CUDA_COMPILER=$(command -v nvcc)"
        -DGGML_CUDA_NCCL=OFF "-DGGML_CUDA_FA=$CUDA_FA" -DGGML_CUDA_FA_QUANTS=f16-f16
    )
else
    OPTIONS+=(-DGGML_CUDA=OFF)
fi

phase "configuring llama.cpp ($([ $GPU = 1 ] && echo "CUDA sm_90, flash attention $CUDA_FA" || echo "CPU only"))"
[ -f "$BUILD/CMakeCache.txt" ] && ! grep -q "^GGML_CUDA:BOOL=$([ $GPU = 1 ] && echo ON || echo OFF)$" \
    "$BUILD/CMakeCache.txt" && rm -rf "$BUILD" # another backend's build: start over
configure() { cmake -S "$CARRY/llama.cpp" -B "$BUILD" "${OPTIONS[@]}" "$@" >>"$OUT/build.log" 2>&1; }
first() { find "$@" 2>/dev/null | sort | head -n 1 || true; }
# A CUDA library CMake did not find beside nvcc (cuBLAS as Python wheels, libcuda.so.1 without its unversioned
# link): looked for where the driver and the wheels put them, named to CMake, and put on LD_LIBRARY_PATH
places=(
    "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent/bin/nvcc)")")")" /usr/local/cuda*
    /usr/local/nvidia /usr/lib/x86_64-linux-gnu /usr/lib64 ${GPU_DEVICE_CUDA_PLACES:-}
    "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
)
hints=()
for attempt in 1 2 3 4 5; do
    configure "${hints[@]}" && break
    missing=$(grep -oE "^ +CUDA::[A-Za-z_]+$" "$OUT/build.log" | tail -n 1 | tr -d ' ')
    [ $GPU = 1 ] && [ -n "$missing" ] && [ $attempt -lt 5 ] ||
        { tail -40 "$OUT/build.log"; fail "cmake could not configure llama.cpp (build.log)"; }
    name=${missing#CUDA::}
    file=$(first "${places[@]}" -name "lib${name/cuda_driver/cuda}.so*")
    echo "CMake found no $missing: ${file:-nothing found either} (in ${places[*]})"
    [ -n "$file" ] || { tail -40 "$OUT/build.log"; fail "no library for $missing"; }
    hints+=("-DCUDA_${name}_LIBRARY=$file")
    [ "$name" = cuda_driver ] || export LD_LIBRARY_PATH="$(dirname "$file")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    if [ "$name" = cublas ] && header=$(first "${places[@]}" -name cublas_v2.h) && [ -n "$header" ]; then
        hints+=("-DCMAKE_CUDA_FLAGS=-I$(dirname "$header")")
    fi
    echo "configuring again with ${hints[*]}" >>"$OUT/build.log"
done
grep -E "CUDA Toolkit|CUDAToolkit|Using CMAKE_CUDA_ARCHITECTURES|CMAKE_BUILD_TYPE|GGML_NATIVE|Found OpenMP" \
    "$OUT/build.log" | head -12 || true

BUILD_TIMEOUT=${GPU_DEVICE_BUILD_TIMEOUT:-$((DEADLINE - BENCH_NEEDS - SECONDS))}
phase "building libllama and libggml on $(nproc) cores (bound: $BUILD_TIMEOUT s)"
build_began=$SECONDS
timeout "$BUILD_TIMEOUT" cmake --build "$BUILD" -j "$(nproc)" --target llama >>"$OUT/build.log" 2>&1 ||
    { tail -40 "$OUT/build.log"; fail "the build failed or ran past $BUILD_TIMEOUT s (build.log)"; }
echo "build: $((SECONDS - build_began)) s wall on $(nproc) cores"
ls -l "$BUILD"/bin/lib*.so*
export LLAMA_CPP_LIB_PATH=$BUILD/bin

phase "synthesizing the model"
"$PY" "$ROOT/bench/gpu_bundle.py" synth --skeleton "$CARRY/model-skeleton.json.gz" --out "$MODEL"

phase "checking the bindings"
"$PY" - "$GPU" <<'EOF'
import sys

import llama_cpp

import tether

offload = bool(llama_cpp.llama_supports_gpu_offload())
print(f"llama_cpp {llama_cpp.__version__} from {llama_cpp.llama_cpp._base_path}, GPU offload: {offload}; "
      f"tether {tether.__version__} from {tether.__file__}")
if sys.argv[1] == "1" and not offload:
    sys.exit("FAILED: a CUDA build whose bindings say they cannot offload")
EOF

left=$((DEADLINE - SECONDS))
[ $left -gt 30 ] || fail "only $left s left of the $DEADLINE s for the bench"
phase "bench/gpu.py --engine llama.cpp (bound: $left s)"
status=0
timeout -k 15 "$left" "$PY" "$ROOT/bench/gpu.py" --engine llama.cpp --model "$MODEL" \
    --logs-out "$OUT/runner-logs.tar.gz" 2>&1 | tee "$OUT/gpu-bench.log" || status=$?
tail -n 1 "$OUT/gpu-bench.log" >"$OUT/gpu.json"
if [ $GPU = 1 ]; then
    echo "after the bench:" >>"$OUT/nvidia-smi.txt"
    nvidia-smi >>"$OUT/nvidia-smi.txt" 2>&1 || true
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv || true
fi
phase "done: bench exit $status, ${SECONDS} s in all; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $status
