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
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchstats import emit, private_tether_dirs
from tether.chaos.target import ServeChild
from tether.env import DISABLE_ORPHAN_WATCHDOG
from tether.node.nvml import GpuUsage

MIB = 1 << 20
SLACK = 64 * MIB  # NVML's free memory moves by a few MiB on its own


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

        server.signal(signal.SIGKILL)
        server.proc.wait(10)
        listed = [g for g in _orphans()["orphans"] if g["pid"] == runner]
        result["orphan_listed"] = bool(listed)
        result["orphan_gpu"] = listed[0]["memory"]["gpu"] if listed and listed[0]["memory"] else None
        if not listed:
            problems.append(f"tether orphans did not list runner {runner} after its worker's SIGKILL")
        elif (result["orphan_gpu"] or 0) < size:
            problems.append(f"tether orphans shows {result['orphan_gpu']} GPU bytes for runner {runner}")

        began = time.monotonic()
        reaped = _orphans("--reap")
        result["reaped"] = [r["pid"] for r in reaped.get("reaped", [])]
        free_after = _free()
        while free_after < free_before - SLACK and time.monotonic() - began < 30:
            time.sleep(0.05)
            free_after = _free()
        result["free_after"] = free_after
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0, help="GPU memory the runner holds (default 4 GiB)")
    args = parser.parse_args(argv)
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
