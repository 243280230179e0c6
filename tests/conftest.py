"""Shared fixtures: anyio on asyncio, and helpers that keep every wait bounded."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.memory import sweep_stale_cgroups
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
