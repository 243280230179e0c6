"""The prompt cache's store that outlives its runner: saved sequences in files of a directory the worker owns
(``EngineSpec.store``, on tmpfs), so the runner that replaces a dead one restores the prompts it held instead of
prefilling them again (``tether.fleet.resume``).

An entry is two files: ``<key>.kv``, llama.cpp's sequence state, and ``<key>.json``, what it holds (the tokens, its
window start) and for what (``identity``: the model file and every engine option, since a state restored into another
model or another cache layout is garbage). The header is renamed in after the state is written, so a runner killed
mid-save leaves no entry, only a state file its successor removes. Entries of another identity are removed when a
runner adopts the directory: a model changed is a cache dropped.

The files are mapped only while one is written or read: the runner's own memory never includes the store, whose size
the worker counts from the files (``tether.node.stores``). Space is reserved with ``posix_fallocate`` before anything
is written, so a full tmpfs is a refused save, never a SIGBUS in the middle of one.

Only the engine's thread uses any of this.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tether.protocol import EngineSpec

log = logging.getLogger(__name__)


class Header(msgspec.Struct, frozen=True):
    identity: str
    tokens: list[int]
    start: int  # the first position whose sliding-window cells it holds
    size: int  # bytes of state llama.cpp wrote
    order: int  # when it was saved, for least-recently-used order on adoption


@dataclass
class Stored:
    """An adopted or new entry: where its state is and what it holds."""

    key: str
    header: Header
    held: int  # bytes its state file holds


def identity(spec: EngineSpec) -> str:
    """What a saved state is valid for: the model file (path, size, modification time) and every engine option."""
    model = spec.model or ""
    try:
        stat = os.stat(model) if model else None
    except OSError:
        stat = None
    facts = [model, str(stat.st_size if stat else ""), str(stat.st_mtime_ns if stat else "")]
    options = msgspec.json.encode(dict(sorted(spec.options.items()))).decode()
    return hashlib.sha256("\0".join([*facts, options]).encode()).hexdigest()[:32]


class KvStore:
    """One runner's view of its instance's store directory."""

    def __init__(self, directory: Path, identity: str) -> None:
        self.directory = directory
        self.identity = identity
        self._order = 0
        directory.mkdir(parents=True, exist_ok=True)

    def adopt(self) -> list[Stored]:
        """The entries a dead predecessor left for this identity, oldest first; every other file is removed."""
        found: list[Stored] = []
        for header_path in self.directory.glob("*.json"):
            key = header_path.stem
            try:
                header = msgspec.json.decode(header_path.read_bytes(), type=Header)
                held = (self.directory / f"{key}.kv").stat().st_size
            except (OSError, msgspec.DecodeError):
                self.remove(key)
                continue
            if header.identity != self.identity or held < header.size:
                self.remove(key)
                continue
            found.append(Stored(key, header, held))
        keys = {entry.key for entry in found}
        for state in self.directory.glob("*.kv"):  # a save cut short: no header
            if state.stem not in keys:
                state.unlink(missing_ok=True)
        for staged in self.directory.glob("*.json.tmp"):  # or cut between its header's write and rename
            staged.unlink(missing_ok=True)
        found.sort(key=lambda entry: entry.header.order)
        self._order = max((entry.header.order for entry in found), default=0)
        if found:
            tokens = sum(len(entry.header.tokens) for entry in found)
            log.info("adopted %d saved sequences (%d tokens) from %s", len(found), tokens, self.directory)
        return found

    def save(self, size: int, write: Callable[[Any, int], int], tokens: list[int], start: int) -> Stored | None:
        """A new entry of ``size`` bytes: ``write(buffer, size)`` fills it (llama.cpp's state) and returns the bytes
        written; None when the store has no room (tmpfs full) or nothing was written."""
        key = uuid.uuid4().hex[:16]  # not the pid: a later runner may be given a dead one's
        path = self.directory / f"{key}.kv"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            log.warning("prompt store %s: cannot create an entry: %s", self.directory, exc)
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            with mmap.mmap(fd, size) as mapping:
                data = (ctypes.c_uint8 * size).from_buffer(mapping)
                try:
                    written = int(write(data, size))
                finally:
                    del data
        except OSError as exc:
            log.info("prompt store %s: no room for %d bytes (%s): not saved", self.directory, size, exc)
            written = 0
        finally:
            os.close(fd)
        if written <= 0:
            path.unlink(missing_ok=True)
            return None
        self._order += 1
        header = Header(self.identity, tokens, start, written, self._order)
        staged = self.directory / f"{key}.json.tmp"
        try:
            staged.write_bytes(msgspec.json.encode(header))
            staged.rename(self.directory / f"{key}.json")
        except OSError as exc:  # no room left even for the header: no entry, and nothing of it left behind
            log.info("prompt store %s: its header not written (%s): not saved", self.directory, exc)
            self.remove(key)
            return None
        return Stored(key, header, size)

    def load(self, entry: Stored, read: Callable[[Any, int], int]) -> int:
        """``read(buffer, size)`` (llama.cpp's restore) on the entry's state, mapped for the call alone (a private
        mapping: reading shares the file's pages and copies none); what ``read`` returns, 0 if the file is gone."""
        try:
            f = open(self.directory / f"{entry.key}.kv", "rb")  # noqa: SIM115 (closed below, after the mapping)
        except OSError:
            return 0
        with f:
            flags, prot = mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE
            with mmap.mmap(f.fileno(), entry.held, flags=flags, prot=prot) as mapping:
                data = (ctypes.c_uint8 * entry.held).from_buffer(mapping)
                try:
                    return read(data, entry.header.size)
                finally:
                    del data

    def remove(self, key: str) -> None:
        for suffix in (".json", ".kv", ".json.tmp"):
            (self.directory / f"{key}{suffix}").unlink(missing_ok=True)
