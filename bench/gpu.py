"""GPU memory on a real NVIDIA GPU: a runner holding GiBs of it is reported, found as an orphan, and reaped for real.

The orphan that started tether hid its footprint in GPU memory. This check meets NVML with a real driver:

1. NVML's free memory on device 0 before anything starts (``free_before``).
2. Our own ``tether serve --engine debug`` with ``TETHER_DISABLE_ORPHAN_WATCHDOG=1`` (the escape hatch: its runners
   may outlive it), private runtime and log dirs; ``POST /v1/instances`` adds ``gpu``, a debug runner whose engine
   allocates and writes ``--gib`` GiB with ``torch.cuda`` at load (the debug engine's ``gpu_bytes`` option).
3. Once it is ready: the instance's runner footprint and its ``gpu`` figure (``GET /v1/instances/gpu``, sampled
   then), and NVML's free memory (``free_loaded``); each must show at least the allocation.
4. SIGKILL of the worker; its runner lives on (the watchdog is off). ``tether orphans --json`` must list it, with
   its GPU memory at least the allocation.
5. ``tether orphans --reap --json``; then NVML's free memory is read every 50 ms until it is back within 64 MiB of
   ``free_before`` (bounded, 30 s): ``reclaimed_ms``, ``free_after``.

Without an NVIDIA device, NVML or torch with CUDA, it prints why (``skipped``) and exits 0. No baseline: the point
is whether tether's figures match the driver's. Run (on a GPU machine): ``python bench/gpu.py [--gib 4]``. The last
line printed is one JSON object.

``--engine llama.cpp`` runs a real llama.cpp runner on the GPU instead (``bench/gpu_device.sh`` builds llama.cpp with
CUDA on the device machine and synthesizes ``--model``, the default model's architecture with random weights: its
speed and memory, not its text). Each figure is checked against the bound stated beside it, and what fails is a line
of ``problems``:

1. ``tether serve --model M`` with the watchdog off (as above): ``n_gpu_layers`` "auto" must put every layer on an
   idle GPU (``auto_n_gpu_layers == layers``, from the instance's ``offload`` view). Decode tokens/s of greedy
   ``--tokens``-token completions (end-of-generation tokens banned by ``logit_bias``, so each runs to its length;
   timed from the first streamed token to the last), one warm-up then the median of ``--runs``: on the GPU, and on
   an instance with ``n_gpu_layers`` 0 beside it (the GPU must not be slower; that runner must hold no VRAM).
2. After the decodes (VRAM steady): the runner's VRAM as tether reports it (``runner.memory.gpu``) against
   ``nvidia-smi --query-compute-apps`` for its pid, within 5 % (``vram_vs_nvidia_smi_error_pct``); the plan's
   ``offload.vram_needed`` (summed over devices) must not be below what the runner holds (the fit check relies on
   it).
3. An instance with ``gpu_memory_limit`` half the plan's VRAM: "auto" must offload fewer layers, say so in
   ``offload``, and hold less VRAM (the two runners give ``vram_per_layer`` and ``vram_fixed``, the context's share).
4. SIGKILL of the worker: ``tether orphans --json`` lists the runner with its VRAM (at least 90 % of what it held),
   and ``tether orphans --reap --json`` brings NVML's free memory back within 64 MiB of the start (``reaped_ms``,
   bounded 30 s).
5. A second server, watchdog on: SIGKILL of the worker brings the VRAM back (``watchdog_reclaimed_ms``, bounded
   30 s) and leaves no runner alive.
6. The card filled by a torch allocation in this process, ``--oom-free-mib`` left free, an instance that asks for
   every layer (``force`` when the fit check refuses) must fail within 180 s, its cause naming the GPU's out of
   memory, not hang (``oom_*``).

Without an NVIDIA GPU (NVML), nvidia-smi, llama-cpp-python or a build of it that offloads, it prints ``skipped``
with why, after a CPU rehearsal of the same plumbing (``tether serve`` on ``--model`` with ``n_gpu_layers`` 0, one
generation, its tokens/s): exit 0 when that ran, 1 when it broke.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchstats import describe, emit, private_tether_dirs
from tether.chaos.target import ServeChild
from tether.engines.gguf import read_gguf
from tether.env import DISABLE_ORPHAN_WATCHDOG
from tether.models import DefaultModelMissing, default_model_path
from tether.node.nvml import GpuUsage
from tether.node.output import LOG_DIR_ENV
from tether.node.settings import SupervisorSettings

MIB = 1 << 20
SLACK = 64 * MIB  # NVML's free memory moves by a few MiB on its own
VRAM_ERROR_PCT = 5.0  # tether's per-pid VRAM against nvidia-smi's
ORPHAN_SHARE = 0.9  # what tether orphans shows of the VRAM the runner held, at least
RECLAIM_BOUND = 30.0  # seconds for NVML to show the VRAM back after a reap or a worker's death
SAMPLE_INTERVAL = SupervisorSettings().memory_interval  # how often tether samples a runner's memory (2 s)
READY_BOUND = 180.0  # seconds for an instance to get ready (CUDA's first initialisation, the load) or to fail
PROMPT = "The history of the city begins with a small settlement by the river, where"


def _free() -> int:
    snapshot = GpuUsage.snapshot()
    assert snapshot.available and snapshot.devices, snapshot.reason
    return snapshot.devices[0].free


def skipped_because() -> str | None:
    snapshot = GpuUsage.snapshot()
    if not snapshot.available or not snapshot.devices:
        return f"no NVIDIA GPU through NVML: {snapshot.reason or 'no device'}"
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        return "torch is not installed (the debug engine allocates GPU memory with torch.cuda)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def _orphans(*extra: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tether", "orphans", "--json", *extra], capture_output=True, text=True, timeout=60
    )
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def check(gib: float) -> dict[str, Any]:
    size = int(gib * (1 << 30))
    result: dict[str, Any] = {"bench": "gpu", "allocated_bytes": size, "problems": []}
    problems: list[str] = result["problems"]
    result["free_before"] = free_before = _free()
    env = dict(os.environ, **{DISABLE_ORPHAN_WATCHDOG: "1"})
    server = ServeChild("--engine", "debug", "--name", "base", env=env, startup=60)
    try:
        server.wait_for(r"base ready \(runner pid", 60)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            made = http.post("/v1/instances", json={"id": "gpu", "engine": "debug", "options": {"gpu_bytes": size}})
            assert made.status_code == 201, made.text
            deadline = time.monotonic() + 120  # CUDA's first initialisation takes seconds
            instance: dict[str, Any] = {}
            while time.monotonic() < deadline:
                instance = http.get("/v1/instances/gpu").json()
                if instance["ready"] or instance["state"] == "failed":
                    break
                time.sleep(0.1)
            assert instance.get("ready"), f"the GPU instance did not get ready: {json.dumps(instance)[:2000]}"
            memory = instance["runner"]["memory"]
            result["runner_pid"] = runner = instance["runner"]["pid"]
            result["reported_gpu"], result["reported_footprint"] = memory["gpu"], memory["footprint"]
        result["free_loaded"] = free_loaded = _free()
        result["driver_used"] = free_before - free_loaded
        if (memory["gpu"] or 0) < size:
            problems.append(f"the instance reports {memory['gpu']} GPU bytes for a {size}-byte allocation")
        if memory["footprint"] < size:
            problems.append(f"the footprint {memory['footprint']} is below the {size} GPU bytes held")
        if free_before - free_loaded < size:
            problems.append(f"NVML's free memory fell by {free_before - free_loaded}, less than {size}")

        result["orphan_listed"], result["orphan_gpu"] = orphan_after_kill(server, runner)
        if not result["orphan_listed"]:
            problems.append(f"tether orphans did not list runner {runner} after its worker's SIGKILL")
        elif (result["orphan_gpu"] or 0) < size:
            problems.append(f"tether orphans shows {result['orphan_gpu']} GPU bytes for runner {runner}")

        began = time.monotonic()
        result["reaped"] = [r["pid"] for r in _orphans("--reap").get("reaped", [])]
        result["free_after"] = free_after = wait_free(free_before)
        result["reclaimed_ms"] = round((time.monotonic() - began) * 1000, 1)
        if free_after < free_before - SLACK:
            problems.append(f"after the reap NVML's free memory is {free_before - free_after} bytes below the start")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        _orphans("--reap")  # whatever a failed check left
    result["ok"] = not problems
    return result


# --------------------------------------------------------------------------------------------------------------
# --engine llama.cpp
# --------------------------------------------------------------------------------------------------------------


def llama_skipped_because() -> str | None:
    """Why the llama.cpp check cannot run here (None: it can). Asks llama.cpp in a child process, so this one
    holds no CUDA context while it measures free memory."""
    snapshot = GpuUsage.snapshot()
    if not snapshot.available or not snapshot.devices:
        return f"no NVIDIA GPU through NVML: {snapshot.reason or 'no device'}"
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi is not installed (the per-process VRAM is checked against it)"
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed"
    asked = subprocess.run(
        [sys.executable, "-c", "import llama_cpp; print(bool(llama_cpp.llama_supports_gpu_offload()))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if asked.returncode != 0:
        return f"llama_cpp does not load: {asked.stderr.strip().splitlines()[-1:]}"
    if asked.stdout.strip() != "True":
        return "this llama-cpp-python is a CPU build (llama_supports_gpu_offload() is false)"
    return None


def banned_tokens(model: Path) -> dict[str, int]:
    """``logit_bias`` banning the special tokens the GGUF names (BOS, EOS, EOT, padding, unknown: SmolLM2's
    <|endoftext|>, <|im_start|>, <|im_end|>), so a random-weights model's greedy text runs to ``max_tokens``."""
    meta = read_gguf(model).metadata
    ids = {v for k, v in meta.items() if re.fullmatch(r"tokenizer\.ggml\.\w+_token_id", k) and isinstance(v, int)}
    return {str(i): -100 for i in sorted(ids)}


def decode_rate(http: httpx.Client, model: str, tokens: int, bias: dict[str, int]) -> float:
    """Decode tokens/s of one greedy streamed completion: its tokens after the first over the time from the first
    streamed token to the last (the prompt's prefill left out). ``RuntimeError`` when it stopped short of
    ``tokens``: the ban on end-of-generation tokens did not hold, and a shorter run would time something else."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": bias,
    }
    first = last = 0.0
    produced = 0
    with http.stream("POST", "/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"completion refused: {answer.status_code} {answer.read().decode()[:500]}")
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                produced = int(chunk["usage"]["completion_tokens"])
            if any(choice.get("text") for choice in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    if produced != tokens or last <= first:
        raise RuntimeError(f"the completion produced {produced} of {tokens} tokens (or none streamed): not timed")
    return (produced - 1) / (last - first)


def median_rate(http: httpx.Client, model: str, tokens: int, runs: int, bias: dict[str, int]) -> float:
    decode_rate(http, model, tokens, bias)  # warm-up: first-use allocations, CUDA graphs
    return statistics.median(decode_rate(http, model, tokens, bias) for _ in range(runs))


def vram_needed(offload: dict[str, Any]) -> int | None:
    """The VRAM an ``offload`` view plans, over its devices (``vram_needed``: one figure per device)."""
    needed = offload.get("vram_needed")
    if needed is None:
        return None
    return sum(needed) if isinstance(needed, list) else int(needed)


def wait_instance(http: httpx.Client, name: str, bound: float = READY_BOUND) -> dict[str, Any]:
    """The instance once ready, failed or restarting (a life died), or as it is after ``bound`` s."""
    deadline = time.monotonic() + bound
    while True:
        instance: dict[str, Any] = http.get(f"/v1/instances/{name}").json()
        ended = instance.get("state") in ("failed", "restarting")
        if instance.get("ready") or ended or time.monotonic() > deadline:
            return instance
        time.sleep(0.1)


def add_instance(http: httpx.Client, name: str, model: Path, options: dict[str, Any], **extra: Any) -> httpx.Response:
    body = {"id": name, "engine": "llama.cpp", "model": str(model), "options": options, **extra}
    return http.post("/v1/instances", json=body)


def smi_used(pid: int) -> int | None:
    """VRAM bytes ``nvidia-smi --query-compute-apps`` shows for ``pid`` (it prints MiB), None when not listed."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1]) * MIB
    return None


def runner_vram(http: httpx.Client, name: str) -> tuple[int, int | None, dict[str, Any]]:
    """(tether's figure for the instance's runner, nvidia-smi's for its pid, the instance), read back to back once
    tether has sampled the runner since now: its sampler runs every ``SAMPLE_INTERVAL`` s, so a figure read at once
    could predate the last allocations (a load's end, a first decode's workspaces)."""
    time.sleep(SAMPLE_INTERVAL + 0.5)
    deadline = time.monotonic() + 10
    while True:
        instance: dict[str, Any] = http.get(f"/v1/instances/{name}").json()
        memory = (instance.get("runner") or {}).get("memory")
        if memory is not None or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert memory is not None, f"tether shows no memory for instance {name}'s runner: {json.dumps(instance)[:1000]}"
    return int(memory["gpu"] or 0), smi_used(instance["runner"]["pid"]), instance


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not: the driver freed its VRAM at its exit)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def orphan_after_kill(server: ServeChild, runner: int) -> tuple[bool, int | None]:
    """SIGKILL the worker (its watchdog off) and ask ``tether orphans``: whether it lists ``runner``, and the GPU
    bytes it shows for it."""
    server.signal(signal.SIGKILL)
    server.proc.wait(10)
    listed = [o for o in _orphans()["orphans"] if o["pid"] == runner]
    return bool(listed), listed[0]["memory"]["gpu"] if listed and listed[0]["memory"] else None


def wait_free(free_before: int, bound: float = RECLAIM_BOUND, also: Callable[[], bool] = lambda: True) -> int:
    """NVML's free memory, read every 50 ms until it is back within ``SLACK`` of ``free_before`` and ``also()``
    holds, or ``bound`` s passed."""
    began = time.monotonic()
    free = _free()
    while (free < free_before - SLACK or not also()) and time.monotonic() - began < bound:
        time.sleep(0.05)
        free = _free()
    return free


def await_ready(server: ServeChild, name: str, bound: float = READY_BOUND) -> None:
    """Until the server says its first instance ``name`` is ready; ``AssertionError`` at once when it says the
    instance failed or restarts (a runner died), when it exits (a refused fit), or after ``bound`` s."""
    pattern = rf"{re.escape(name)} (ready \(runner pid|failed: |: .*; restarting in )"
    said = server.wait_for(pattern, bound)
    assert said.group(1).startswith("ready"), f"{said.string}\n" + "\n".join(server.drain()[-20:])


@contextlib.contextmanager
def serving(*args: str, env: dict[str, str], logs: dict[str, list[str]], name: str) -> Iterator[ServeChild]:
    """A ``tether serve`` child for the block; SIGKILLed if still running at its end (its runners are reaped by
    the caller), its stderr kept in ``logs[name]``."""
    server = ServeChild(*args, env=env, startup=60)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        logs[name] = server.drain()


_BEGAN = time.monotonic()


def say(what: str) -> None:
    """A progress line on stderr (stdout's last line is the result), with the seconds since the start."""
    print(f"[gpu.py +{time.monotonic() - _BEGAN:.1f}s] {what}", file=sys.stderr, flush=True)


def llama_check(model: Path, args: argparse.Namespace, logs: dict[str, list[str]], result: dict[str, Any]) -> None:
    """The six checks of the module docstring on the GPU, into ``result`` as they go (a check cut short keeps
    what it measured): every figure, and every miss in ``result["problems"]``."""
    problems: list[str] = result.setdefault("problems", [])
    bias = banned_tokens(model)
    result["free_before"] = free_before = _free()
    result["device"] = GpuUsage.snapshot().devices[0].name
    watchdog_off = dict(os.environ, **{DISABLE_ORPHAN_WATCHDOG: "1"})
    watchdog_on = {k: v for k, v in os.environ.items() if k != DISABLE_ORPHAN_WATCHDOG}

    # 1-4: one server (its runners may outlive it): auto offload, speeds, VRAM figures, the limit, the orphan
    say(f"1. tether serve --model {model.name}, n_gpu_layers auto, watchdog off")
    with serving("--model", str(model), "--name", "gpu", env=watchdog_off, logs=logs, name="serve-1") as server:
        began = time.monotonic()
        await_ready(server, "gpu")
        result["gpu_ready_s"] = round(time.monotonic() - began, 2)
        with httpx.Client(base_url=server.url, timeout=120) as http:
            instance = http.get("/v1/instances/gpu").json()
            offload = instance.get("offload") or {}
            result["offload"] = instance.get("offload")
            layers = int(offload.get("layers") or 0)
            result["auto_n_gpu_layers"], result["layers"] = offload.get("n_gpu_layers"), layers
            if not offload:
                problems.append("the instance has no offload view (n_gpu_layers auto planned nothing)")
            elif not offload.get("auto") or offload.get("n_gpu_layers") != layers:
                problems.append(f"auto offloaded {offload.get('n_gpu_layers')} of {layers} layers on an idle GPU")

            say(f"ready in {result['gpu_ready_s']} s, offload {offload}; decoding on the GPU")
            result["gpu_tokens_per_s"] = gpu_rate = round(median_rate(http, "gpu", args.tokens, args.runs, bias), 1)
            say(f"GPU {gpu_rate} tokens/s; an instance with n_gpu_layers 0 beside it")
            made = add_instance(http, "cpu", model, {"n_gpu_layers": 0})
            assert made.status_code == 201, made.text
            cpu = wait_instance(http, "cpu")
            assert cpu.get("ready"), f"the n_gpu_layers 0 instance did not get ready: {json.dumps(cpu)[:2000]}"
            result["cpu_tokens_per_s"] = cpu_rate = round(median_rate(http, "cpu", args.tokens, args.runs, bias), 1)
            result["gpu_speedup"] = round(gpu_rate / cpu_rate, 2)
            result["cpu_runner_vram"] = cpu_vram = runner_vram(http, "cpu")[0]
            http.delete("/v1/instances/cpu")
            if gpu_rate <= cpu_rate:
                problems.append(f"decode on the GPU ({gpu_rate} tokens/s) is not faster than on the CPU ({cpu_rate})")
            if cpu_vram:
                problems.append(f"the n_gpu_layers 0 runner holds {cpu_vram} bytes of VRAM")

            say(f"CPU {cpu_rate} tokens/s; 2. the runner's VRAM against nvidia-smi's")
            reported, smi, instance = runner_vram(http, "gpu")  # after the decodes: compute buffers, graphs made
            result["runner_pid"] = runner = instance["runner"]["pid"]
            result["reported_vram"], result["nvidia_smi_vram"] = reported, smi
            result["reported_footprint"] = instance["runner"]["memory"]["footprint"]
            result["planned_vram"] = planned = vram_needed(offload)
            result["planned_host"] = offload.get("host")
            if smi is None:
                problems.append(f"nvidia-smi does not list runner {runner}")
            else:
                error = abs(reported - smi) / smi * 100
                result["vram_vs_nvidia_smi_error_pct"] = round(error, 2)
                if error > VRAM_ERROR_PCT:
                    problems.append(f"tether reports {reported} VRAM bytes, nvidia-smi {smi}: {error:.1f} % apart")
            if result["reported_footprint"] < reported:
                problems.append(f"the footprint {result['reported_footprint']} leaves out the {reported} VRAM bytes")
            if planned is not None and planned < reported:
                problems.append(f"the plan's {planned} VRAM bytes are below the {reported} held")

            limit = max((planned or reported) // 2, 64 * MIB)
            result["gpu_memory_limit"] = f"{limit // MIB}MiB"
            say(f"tether {reported}, nvidia-smi {smi} bytes; 3. an instance limited to {result['gpu_memory_limit']}")
            made = add_instance(http, "limited", model, {"gpu_memory_limit": result["gpu_memory_limit"]})
            assert made.status_code == 201, made.text
            limited = wait_instance(http, "limited")
            result["limited_offload"] = limited_offload = limited.get("offload") or {}
            if not limited.get("ready"):
                problems.append(f"the instance limited to {result['gpu_memory_limit']} did not get ready")
            else:
                result["limited_vram"] = limited_vram = runner_vram(http, "limited")[0]
                got = limited_offload.get("n_gpu_layers")
                if not limited_offload.get("auto") or got is None or got >= layers:
                    problems.append(f"limited to {result['gpu_memory_limit']}, auto offloaded {got} of {layers} layers")
                elif 0 < got < layers and limited_vram < reported:  # 0 layers: no CUDA context either
                    per_layer = (reported - limited_vram) / (layers - got)
                    result["vram_per_layer"] = round(per_layer)
                    result["vram_fixed"] = round(reported - per_layer * layers)  # context, scratch: no layer's
                if limited_vram >= reported:
                    problems.append(f"with fewer layers the runner holds {limited_vram} VRAM bytes, not less")
            http.delete("/v1/instances/limited")

        say(f"limited: {result['limited_offload']}; 4. SIGKILL of the worker, tether orphans")
        result["orphan_listed"], result["orphan_vram"] = orphan_after_kill(server, runner)
        if not result["orphan_listed"]:
            problems.append(f"tether orphans did not list runner {runner} after its worker's SIGKILL")
        elif (result["orphan_vram"] or 0) < ORPHAN_SHARE * reported:
            problems.append(f"tether orphans shows {result['orphan_vram']} VRAM bytes of runner {runner}'s {reported}")
        began = time.monotonic()
        result["reaped"] = [r["pid"] for r in _orphans("--reap").get("reaped", [])]
        result["free_after_reap"] = free = wait_free(free_before)
        result["reaped_ms"] = round((time.monotonic() - began) * 1000, 1)
        if free < free_before - SLACK:
            problems.append(f"after the reap NVML's free memory is {free_before - free} bytes below the start")

    # 5: the watchdog on: the worker's death alone brings the VRAM back
    say(f"reaped in {result['reaped_ms']} ms; 5. a server with the watchdog on, its worker SIGKILLed")
    with serving("--model", str(model), "--name", "gpu", env=watchdog_on, logs=logs, name="serve-2") as server:
        await_ready(server, "gpu")
        with httpx.Client(base_url=server.url, timeout=60) as http:
            runner = int(http.get("/v1/instances/gpu").json()["runner"]["pid"])
        result["watchdog_free_loaded"] = _free()
        server.signal(signal.SIGKILL)
        began = time.monotonic()
        server.proc.wait(10)
        result["watchdog_free_after"] = free = wait_free(free_before, also=lambda: not alive(runner))
        result["watchdog_reclaimed_ms"] = round((time.monotonic() - began) * 1000, 1)
        result["watchdog_survivors"] = int(alive(runner))
        if alive(runner):
            problems.append(f"runner {runner} outlived its SIGKILLed worker by {RECLAIM_BOUND} s, watchdog on")
        if free < free_before - SLACK:
            problems.append(f"{RECLAIM_BOUND} s after the worker's death NVML's free memory is still low")
    _orphans("--reap")

    # 6: every layer asked for on a full card: a failure naming the out of memory, within a bound
    say(f"VRAM back in {result['watchdog_reclaimed_ms']} ms; 6. all layers with {args.oom_free_mib} MiB free")
    with serving("--engine", "debug", "--name", "base", env=watchdog_on, logs=logs, name="serve-3") as server:
        await_ready(server, "base", 60)
        result.update(oom_check(server, model, layers or 999, args.oom_free_mib, problems))  # 999: llama.cpp's "all"
    _orphans("--reap")
    result["ok"] = not problems


def oom_check(server: ServeChild, model: Path, layers: int, free_mib: int, problems: list[str]) -> dict[str, Any]:
    """Fill device 0 with a torch allocation but ``free_mib``, ask for ``layers`` layers on it; the failure."""
    import torch  # type: ignore[import-not-found]

    out: dict[str, Any] = {}
    free, _total = torch.cuda.mem_get_info(0)
    hold = max(free - free_mib * MIB, 0)
    block = torch.empty(hold, dtype=torch.uint8, device="cuda:0")
    try:
        out["oom_free_left"] = _free()
        with httpx.Client(base_url=server.url, timeout=120) as http:
            options, never = {"n_gpu_layers": layers}, {"restart": {"mode": "never"}}
            made = add_instance(http, "oom", model, options, **never)
            out["oom_first_status"] = made.status_code
            if made.status_code != 201:  # the fit check's refusal, with its numbers: then forced
                out["oom_refusal"] = made.text[:1000]
                made = add_instance(http, "oom", model, options, force=True, **never)
                out["oom_forced"] = True
            assert made.status_code == 201, made.text
            began = time.monotonic()
            instance = wait_instance(http, "oom")
            out["oom_state"], out["oom_failed_in_s"] = instance.get("state"), round(time.monotonic() - began, 2)
            cause = instance.get("cause") or (instance.get("history") or [{}])[-1].get("cause") or {}
            out["oom_cause"] = {k: cause.get(k) for k in ("kind", "summary", "evidence", "phase", "signal")}
            text = " ".join([str(cause.get("summary")), *(cause.get("evidence") or [])])
            if instance.get("state") != "failed":
                state, seconds = instance.get("state"), out["oom_failed_in_s"]
                problems.append(f"all {layers} layers with {free_mib} MiB free: {state} after {seconds} s, not failed")
            elif not re.search(r"out of memory|cudaMalloc failed", text, re.IGNORECASE):
                problems.append(f"the out-of-VRAM failure's cause does not say so: {cause.get('summary')!r}")
    finally:
        del block
        torch.cuda.empty_cache()
    return out


def rehearse(model: Path, tokens: int, logs: dict[str, list[str]]) -> dict[str, Any]:
    """Without a GPU: the same plumbing on the CPU (serve the model with n_gpu_layers 0, one generation)."""
    out: dict[str, Any] = {}
    with serving(
        "--model",
        str(model),
        "--name",
        "cpu",
        "--n-gpu-layers",
        "0",
        env=dict(os.environ),
        logs=logs,
        name="serve-rehearsal",
    ) as server:
        began = time.monotonic()
        await_ready(server, "cpu")
        out["ready_s"] = round(time.monotonic() - began, 2)
        with httpx.Client(base_url=server.url, timeout=120) as http:
            out["cpu_tokens_per_s"] = round(decode_rate(http, "cpu", tokens, banned_tokens(model)), 1)
            instance = http.get("/v1/instances/cpu").json()
            out["offload"] = instance.get("offload")
            out["runner_vram"] = instance["runner"]["memory"]["gpu"]
            out["footprint"] = instance["runner"]["memory"]["footprint"]
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
    return out


def keep_logs(where: Path | None, logs: dict[str, list[str]]) -> None:
    """The servers' stderr and the runners' log files (the private log dir) into the ``where`` tar.gz."""
    if where is None:
        return
    with tarfile.open(where, "w:gz") as archive:
        for name, lines in logs.items():
            data = ("\n".join(lines) + "\n").encode()
            info = tarfile.TarInfo(f"{name}.log")
            info.size = len(data)
            archive.addfile(info, fileobj=io.BytesIO(data))
        runner_logs = os.environ.get(LOG_DIR_ENV)
        if runner_logs and os.path.isdir(runner_logs):
            archive.add(runner_logs, arcname="runners")


def _interrupted(signum: int, _frame: object) -> None:
    raise TimeoutError(f"stopped by {signal.Signals(signum).name} (the device script's time bound)")


def llama_main(args: argparse.Namespace) -> int:
    try:
        model = args.model or default_model_path()
    except DefaultModelMissing as exc:
        emit({"bench": "gpu", "engine": "llama.cpp", "skipped": str(exc), "ok": None})
        return 0
    signal.signal(signal.SIGTERM, _interrupted)  # a bound's SIGTERM still stops the servers and prints the figures
    reason = llama_skipped_because()
    result: dict[str, Any] = {"bench": "gpu", "engine": "llama.cpp", "model": model.name}
    logs: dict[str, list[str]] = {}
    with private_tether_dirs("tether-gpu-"):
        try:
            if reason is not None:
                result.update(skipped=reason, ok=None)
                if importlib.util.find_spec("llama_cpp") is None:
                    emit(result)
                    return 0
                say(f"skipped ({reason}); the CPU rehearsal")
                try:
                    result["rehearsal"] = rehearse(model, args.tokens, logs)
                except Exception as exc:  # the plumbing broke: say where, and fail
                    result["rehearsal_error"] = describe(exc)
                    for name, lines in logs.items():
                        print(f"--- {name} (stderr tail)\n" + "\n".join(lines[-30:]), file=sys.stderr)
                emit(result)
                return 1 if "rehearsal_error" in result else 0
            try:
                llama_check(model, args, logs, result)
            except Exception as exc:
                result.update(error=describe(exc), ok=False)
                for name, lines in logs.items():
                    print(f"--- {name} (stderr tail)\n" + "\n".join(lines[-30:]), file=sys.stderr)
            finally:
                _orphans("--reap")  # whatever a failed check left
        finally:
            keep_logs(args.logs_out, logs)
    for problem in result.get("problems", []):
        print(f"PROBLEM: {problem}")
    emit(result)
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("debug", "llama.cpp"), default="debug", help="the runner (default debug)")
    parser.add_argument("--gib", type=float, default=4.0, help="debug: GPU memory the runner holds (default 4 GiB)")
    parser.add_argument("--model", type=Path, default=None, help="llama.cpp: the GGUF (default: the default model)")
    parser.add_argument("--tokens", type=int, default=128, help="llama.cpp: tokens per timed generation (128)")
    parser.add_argument("--runs", type=int, default=3, help="llama.cpp: timed generations per side (3, median)")
    parser.add_argument("--oom-free-mib", type=int, default=256, help="llama.cpp: VRAM left free to fail in (256)")
    parser.add_argument("--logs-out", type=Path, default=None, help="llama.cpp: servers' and runners' logs, tar.gz")
    args = parser.parse_args(argv)
    if args.engine == "llama.cpp":
        return llama_main(args)
    reason = skipped_because()
    if reason is not None:
        emit({"bench": "gpu", "skipped": reason, "ok": None})
        return 0
    with private_tether_dirs("tether-gpu-"):
        result = check(args.gib)
    for problem in result["problems"]:
        print(f"PROBLEM: {problem}")
    emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
