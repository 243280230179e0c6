"""Shared fixtures: anyio on asyncio, and helpers that keep every wait bounded."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tether.memory import create_child_cgroup, remove_cgroup
from tether.orphans import sweep_stale_cgroups
from tether.process import live_processes
from tether.protocol import EngineSpec


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def private_runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own runner registry and log directory, so tests never see (or reap) each other's records
    or write into the user's."""
    path = tmp_path_factory.mktemp("runtime")
    monkeypatch.setenv("TETHER_RUNTIME_DIR", str(path))
    monkeypatch.setenv("TETHER_LOG_DIR", str(tmp_path_factory.mktemp("logs")))
    return path


@pytest.fixture(autouse=True, scope="session")
def sweep_runner_cgroups() -> Iterator[None]:
    """Drills SIGKILL workers, which then cannot remove their runners' cgroups: sweep them when the session ends."""
    yield
    sweep_stale_cgroups()


@pytest.fixture
def debug_spec() -> EngineSpec:
    return EngineSpec(engine="debug")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def no_leftover_runners() -> Iterator[None]:
    """Fail a test that leaves a tether runner of this process behind."""
    yield
    me = os.getpid()
    leftovers = []
    for proc in live_processes():
        if proc.ppid != me:
            continue
        try:
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"tether.runner" in cmdline:
            leftovers.append(proc.pid)
    assert not leftovers, f"runner processes left behind: {leftovers}"


CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
MakeCgroup = Callable[[int], Path]


@pytest.fixture
def memory_cgroup() -> Iterator[MakeCgroup]:
    """Make fresh cgroup-v1 memory cgroups with a limit (swap included), removed after the test.

    Skips, saying why, where there is no writable v1 memory hierarchy: real OOM kills and limits need one.
    """
    created: list[Path] = []

    def make(limit: int) -> Path:
        if not (CGROUP_V1_MEMORY / "memory.limit_in_bytes").exists():
            pytest.skip(f"no cgroup v1 memory hierarchy at {CGROUP_V1_MEMORY}: cannot set a memory limit")
        path = CGROUP_V1_MEMORY / f"tether-test-{uuid.uuid4().hex[:8]}"
        try:
            path.mkdir()
        except OSError as exc:
            pytest.skip(f"cannot create a memory cgroup at {path}: {exc}")
        created.append(path)
        try:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # with swap, the process would swap instead of being killed
                memsw.write_text(str(limit))
        except OSError as exc:
            pytest.skip(f"cannot set a memory limit on {path}: {exc}")
        return path

    yield make
    for path in created:
        for child in sorted((c for c in path.glob("**/*") if c.is_dir()), reverse=True):
            child.rmdir()  # a runner cgroup below it that its worker could not remove
        deadline = time.monotonic() + 5  # the last members leave as the kernel finishes tearing them down
        while path.exists():
            try:
                path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


@pytest.fixture
def own_cgroups() -> None:
    """Skip (saying why) where this machine gives runners no memory cgroups of their own."""
    probe, why = create_child_cgroup(f"tether-probe-{uuid.uuid4().hex[:8]}")
    if probe is None:
        pytest.skip(f"no per-runner cgroups here: {why}")
    remove_cgroup(probe)
