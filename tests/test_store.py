"""What outlives a runner: the prompt store's files (``tether.engines.llamacpp.store``) and the worker's directories
for them (``tether.node.stores``). The restore itself, through a real runner's death, is in ``test_resume.py``."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tether.engines.llamacpp.store import KvStore, identity
from tether.kernel.pids import proc_stat
from tether.node import fit, stores
from tether.node.memory import NodeMemory
from tether.protocol import EngineSpec


def pattern(size: int) -> bytes:
    return bytes(i % 251 for i in range(size))


def write_pattern(data: Any, size: int) -> int:
    ctypes.memmove(data, pattern(size), size)
    return size


def test_a_saved_state_is_adopted_by_the_next_store_of_its_identity_and_dropped_by_another(tmp_path: Path) -> None:
    first = KvStore(tmp_path / "store", "model-a")
    saved = first.save(8192, write_pattern, [1, 2, 3], 0)
    assert saved is not None
    again = KvStore(tmp_path / "store", "model-a").adopt()  # the runner that replaces this one
    assert [(e.key, e.header.tokens, e.header.size) for e in again] == [(saved.key, [1, 2, 3], 8192)]
    read: list[bytes] = []
    assert KvStore(tmp_path / "store", "model-a").load(again[0], lambda data, n: read.append(bytes(data)[:n]) or n)
    assert read == [pattern(8192)]
    assert KvStore(tmp_path / "store", "model-b").adopt() == []  # the model changed: the cache is dropped
    assert list((tmp_path / "store").iterdir()) == []


def test_a_save_cut_short_leaves_no_entry_and_its_state_file_is_removed(tmp_path: Path) -> None:
    store = KvStore(tmp_path, "m")
    (tmp_path / "123-1.kv").write_bytes(b"\0" * 4096)  # killed after the state, before the header's rename
    (tmp_path / "123-2.json").write_bytes(b"{not json")  # or a header torn some other way
    (tmp_path / "123-3.json.tmp").write_bytes(b"{}")  # or killed between the header's write and its rename
    assert store.save(4096, lambda data, n: 0, [1], 0) is None  # llama.cpp wrote nothing: no entry either
    assert store.adopt() == []
    assert list(tmp_path.iterdir()) == []


def test_the_identity_changes_with_the_model_file_and_every_option(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    spec = EngineSpec(model=str(model), options={"n_ctx": 512})
    same = identity(spec)
    assert identity(EngineSpec(model=str(model), options={"n_ctx": 512}, store="/elsewhere")) == same
    assert identity(EngineSpec(model=str(model), options={"n_ctx": 1024})) != same
    os.utime(model, ns=(1, 1))
    assert identity(spec) != same


def test_a_dead_workers_stores_are_swept_and_a_live_ones_are_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(stores, "BASE", tmp_path)
    mine = stores.directory("inst")
    assert mine is not None
    mine.mkdir(parents=True)
    (mine / "1-1.kv").write_bytes(b"x" * 4096)
    assert stores.size(mine) >= 4096
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    stat = proc_stat(child.pid)
    assert stat is not None
    child.wait(10)  # dead and reaped: its pid names no process
    namespace = mine.parent.name.removeprefix(stores.PREFIX).split("-")[0]
    dead = tmp_path / f"{stores.PREFIX}{namespace}-{child.pid}-{stat.start_ticks}" / "inst"
    dead.mkdir(parents=True)
    (dead / "7-1.kv").write_bytes(b"x" * 4096)
    assert stores.sweep() == [dead.parent]
    assert not dead.parent.exists() and mine.exists()
    stores.remove(mine)
    stores.release()
    assert not mine.parent.exists()


def test_a_new_lifes_fit_counts_its_own_saved_prompts_as_room(tmp_path: Path) -> None:
    """A restarted life takes its store over within the prompt cache its estimate already counts: the node's memory
    in use for the store is room for it, not a second charge (a life that does not fit only because of its own
    saved prompts would fail every request it was to resume)."""
    store = tmp_path / "inst"
    store.mkdir()
    (store / "a.kv").write_bytes(b"x" * (64 << 20))
    spec = EngineSpec(engine="debug", options={"hold_bytes": 100 << 20}, store=str(store))
    needs = 156 << 20  # its runtime, what it holds and its headroom (the debug engine's estimate)
    tight = NodeMemory(available=needs - (32 << 20), source="test", host_total=1 << 34, host_available=1 << 34)
    fits = fit.assess(spec, node=tight)
    assert fits.fits and fits.available == tight.available + stores.size(store), fits
    assert "64.0 MiB of its own saved prompts" in fits.message
    assert not fit.assess(msgspec.structs.replace(spec, store=None), node=tight).fits
