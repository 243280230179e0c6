"""Memory numbers of real processes: anonymous vs file-backed, gone processes, NVML present or not."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import tether.node.nvml as nvml
from tether.node.memory import ProcessMemory, process_memory, process_status_memory
from tether.node.nvml import GpuUsage
from tether.units import format_bytes

MiB = 1024 * 1024


@contextmanager
def child(code: str) -> Iterator[subprocess.Popen[str]]:
    """A Python child that runs ``code``, prints "ready", then blocks on stdin until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code + "\nprint('ready', flush=True)\nimport sys\nsys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_anonymous_memory_counts_in_anon_uss_and_footprint() -> None:
    with child("buf = bytearray(512 * 1024 * 1024)\nfor i in range(0, len(buf), 4096): buf[i] = 1") as proc:
        mem = process_memory(proc.pid)
    assert mem is not None
    assert mem.anon >= 512 * MiB
    assert mem.uss >= 512 * MiB
    assert mem.rss >= mem.anon
    assert mem.footprint >= 500 * MiB
    assert mem.gpu is None  # no snapshot given: unknown, not 0


@pytest.mark.slow
def test_mmapped_file_is_file_backed_and_not_footprint(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    with path.open("wb") as f:
        for _ in range(512):
            f.write(b"\x01" * MiB)
    code = (
        "import mmap\n"
        f"f = open({str(path)!r}, 'rb')\n"
        "m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
        "total = sum(m[i] for i in range(0, len(m), 4096))"
    )
    with child(code) as proc:
        mem = process_memory(proc.pid)
    assert mem is not None
    assert mem.rss >= 512 * MiB and mem.file >= 510 * MiB
    assert mem.anon < 32 * MiB
    assert mem.footprint < mem.rss / 10  # far below RSS: the weights are page cache, not the process's own
    # Why footprint is not USS: file pages mapped by one process alone are Private_Clean, so USS counts them.
    assert mem.uss >= 510 * MiB


def test_gone_process_is_none() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert process_memory(proc.pid) is None  # reaped: its pid is free (and far too unlikely to be reused here)
    assert process_memory(2**22 + 1) is None  # above the kernel's pid_max limit: never a process


def test_zombie_is_none() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert proc.stdin is not None
        proc.stdin.close()  # EOF: the child exits
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # wait until it is a zombie, without reaping it
        assert process_memory(proc.pid) is None
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_gpu_snapshot() -> None:
    snapshot = GpuUsage.snapshot()
    with child("pass") as proc:
        mem = process_memory(proc.pid, gpu=snapshot)
    assert mem is not None
    if snapshot.available:
        assert snapshot.reason is None
        assert mem.gpu == 0  # a plain Python child holds no GPU memory
        for pid, used in snapshot.by_pid.items():
            assert isinstance(pid, int)
            assert used is None or (isinstance(used, int) and used >= 0)
            assert snapshot.for_pid(pid) == used
    else:
        assert isinstance(snapshot.reason, str) and snapshot.reason
        assert snapshot.for_pid(proc.pid) is None
        assert mem.gpu is None


def test_gpu_for_pid_unknown_vs_none() -> None:
    usage = GpuUsage(True, None, {10: 5 * MiB, 11: None})
    assert usage.for_pid(10) == 5 * MiB
    assert usage.for_pid(11) is None
    assert usage.for_pid(12) == 0
    assert GpuUsage(False, "NVML: Driver Not Loaded").for_pid(10) is None


class FakeNvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"error {value}")
        self.value = value


@pytest.fixture(autouse=True)
def fresh_nvml_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """GpuUsage remembers a missing NVML library for the process's life: each test starts without that memory."""
    monkeypatch.setattr(nvml, "_NVML_MISSING", None)


def fake_pynvml(devices: list[tuple[list[tuple[int, int | None]], list[tuple[int, int | None]] | None]]) -> Any:
    """A stand-in ``pynvml``: per device, compute processes and graphics processes (``None``: not supported)."""
    nvml = types.ModuleType("pynvml")
    calls: list[str] = []

    def processes(entries: list[tuple[int, int | None]] | None) -> list[types.SimpleNamespace]:
        if entries is None:
            raise FakeNvmlError(3)
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in entries]

    nvml.__dict__.update(
        NVMLError=FakeNvmlError,
        NVML_ERROR_NOT_SUPPORTED=3,
        calls=calls,
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: f"Fake GPU {h}".encode(),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            total=80 << 30, free=(70 - h) << 30, used=(10 + h) << 30
        ),
        nvmlDeviceGetComputeRunningProcesses=lambda h: processes(devices[h][0]),
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: processes(devices[h][1]),
    )
    return nvml


def test_gpu_snapshot_sums_devices_and_keeps_unreported_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_pynvml([([(10, 3 * MiB), (11, None)], [(10, 1 * MiB)]), ([(10, 4 * MiB), (12, 2 * MiB)], None)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    usage = GpuUsage.snapshot()
    assert usage.available and usage.reason is None
    assert dict(usage.by_pid) == {10: 8 * MiB, 11: None, 12: 2 * MiB}
    assert [(d.index, d.name, d.total, d.free) for d in usage.devices] == [
        (0, "Fake GPU 0", 80 << 30, 70 << 30),
        (1, "Fake GPU 1", 80 << 30, 69 << 30),
    ]
    assert nvml.calls == ["init", "shutdown"]


def test_gpu_snapshot_errors_make_it_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_pynvml([([(10, MiB)], [])])

    def fail(handle: int) -> None:
        raise FakeNvmlError(999)

    nvml.nvmlDeviceGetComputeRunningProcesses = fail
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    usage = GpuUsage.snapshot()
    assert (usage.available, usage.reason, usage.for_pid(10)) == (False, "NVML: error 999", None)
    assert nvml.calls == ["init", "shutdown"]  # shut down even when a query fails

    monkeypatch.setitem(sys.modules, "pynvml", None)  # what an uninstalled package looks like to ``import``
    assert GpuUsage.snapshot() == GpuUsage(False, "nvidia-ml-py not installed")


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (None, "n/a"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.50 KiB"),
        (512 * 1024, "512 KiB"),
        (int(98.2 * MiB), "98.2 MiB"),
        (1024 * MiB * 3 // 2, "1.50 GiB"),
        (1024 * 1024 - 1, "1.00 MiB"),
        (int(9.999 * MiB), "10.0 MiB"),
        (5 * 1024**5, "5.00 PiB"),
        (4096 * 1024**5, "4096 PiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes(n: int | None, text: str) -> None:
    assert format_bytes(n) == text


def test_total_sums_and_keeps_unknown_gpu() -> None:
    a = ProcessMemory(rss=10, pss=8, uss=6, anon=5, file=4, swap=1, gpu=None)
    b = ProcessMemory(rss=20, pss=16, uss=12, anon=10, file=8, swap=2, gpu=100)
    assert ProcessMemory.total([a, b]) == ProcessMemory(
        rss=30, pss=24, uss=18, anon=15, file=12, swap=3, gpu=100, pss_anon=15
    )
    assert ProcessMemory.total([a, a]).gpu is None
    assert ProcessMemory.total(iter([a, b])).footprint == 15 + 3 + 100
    assert ProcessMemory.total([]) == ProcessMemory(0, 0, 0, 0, 0, 0, None)
    assert ProcessMemory.total([a, b]).pss_anon == 15  # no Pss_Anon reported: falls back to anon


def _status_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if v.strip().endswith("kB")}


def test_figures_agree_with_proc_status_within_one_percent() -> None:
    """smaps_rollup and /proc/PID/status count the same pages differently (page tables vs per-type counters)."""
    with child("buf = bytearray(256 * 1024 * 1024)\nfor i in range(0, len(buf), 4096): buf[i] = 1") as proc:
        mem = process_memory(proc.pid)
        status = _status_kib(proc.pid)
    assert mem is not None
    for ours, theirs in ((mem.rss, status["VmRSS"]), (mem.anon, status["RssAnon"]), (mem.swap, status["VmSwap"])):
        assert abs(ours - theirs * 1024) <= max(0.01 * theirs * 1024, 256 * 1024), (ours, theirs * 1024)


def test_shared_memory_counts_in_the_footprint_of_its_only_user() -> None:
    code = (
        "import mmap, os\n"
        "fd = os.memfd_create('t')\n"
        "os.ftruncate(fd, 64 * 1024 * 1024)\n"
        "m = mmap.mmap(fd, 64 * 1024 * 1024)\n"
        "for i in range(0, len(m), 4096): m[i] = 1"
    )
    with child(code) as proc:
        mem = process_memory(proc.pid)
    assert mem is not None
    assert mem.shmem >= 64 * MiB
    assert mem.footprint >= 64 * MiB


def test_the_cheap_status_sample_agrees_with_smaps_and_leaves_pss_unknown() -> None:
    with child("buf = bytearray(128 * 1024 * 1024)\nfor i in range(0, len(buf), 4096): buf[i] = 1") as proc:
        detailed = process_memory(proc.pid)
        cheap = process_status_memory(proc.pid)
    assert detailed is not None and cheap is not None
    assert cheap.pss is None and cheap.uss is None  # unknown, never a made-up figure
    for a, b in ((cheap.rss, detailed.rss), (cheap.anon, detailed.anon), (cheap.footprint, detailed.footprint)):
        assert abs(a - b) <= max(0.01 * b, 512 * 1024), (a, b)
    assert ProcessMemory.total([cheap, detailed]).pss is None
