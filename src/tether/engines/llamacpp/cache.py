"""The prompt cache of a llama.cpp batch: a prompt's longest cached prefix, from any slot or from RAM.

A slot keeps the KV cells of the tokens its last sequence saw. When a prompt's prefill begins (``batch``), it is
matched against every slot, busy ones included, and the RAM store (``PrefixIndex``: one walk of the prompt); the
longest usable match is brought into the prompt's own slot (``place``) and only the rest is prefilled. A slot's
sequence is saved to RAM before its cells are overwritten, within the ``prompt_cache_ram`` budget the fit check
counts (``_save_before_overwrite``).

The rules a change must keep: on a model with sliding-window layers a prefix is reused only where the window before
its end is still held (``_usable``), else it decodes against missing positions and silently gives another text; an
``exact`` (deterministic) cache restores only what puts every cell where a cold prefill would (``_exact_enough``).
The copy itself is exact; a reused prefix was computed in another batch, so a greedy text can (rarely) part from a
cold prefill's unless the engine is deterministic. Figures: docs/design.md, "The prompt cache".

Only the engine's thread uses any of this.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tether.engines.llamacpp.prefix import Holder, PrefixIndex, common_length
from tether.engines.llamacpp.store import KvStore, Stored

MIN_COPY = 16  # tokens a copy from another slot or from RAM must save over the slot's own prefix
MIN_SAVE = 32  # shorter sequences are not worth RAM: prefilling them costs ~0.15 s here
STATE_FLAGS = 0  # a whole sequence's cells

log = logging.getLogger(__name__)


@dataclass
class _Saved:
    tokens: list[int]
    size: int  # bytes of it llama.cpp wrote (what a restore reads)
    held: int  # bytes the buffer holds (what the budget counts)
    start: int = 0  # its window start: the first position whose sliding-window cells it holds (0: all of them)
    mapping: mmap.mmap | None = None  # a RAM entry's anonymous memory of its own: unmapped when dropped
    data: Any = None  # ctypes view of ``mapping``: llama.cpp's sequence state
    stored: Stored | None = None  # a store entry: its state in the store's files instead (``store``)

    def free(self) -> None:
        self.data = None  # the view first: an exported mmap cannot close
        if self.mapping is not None:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: unmapped when it goes, not now
                self.mapping.close()


@dataclass
class CacheStats:
    """Where reused prompt tokens came from, and what the RAM store did (counters to inspect: tests, debugging)."""

    from_own_slot: int = 0
    from_other_slot: int = 0
    from_ram: int = 0
    saved: int = 0  # sequences saved to RAM (or to the store)
    checkpoints: int = 0  # of them, sequences saved while their request went on (``checkpoint``)
    adopted: int = 0  # store entries a dead predecessor left, taken over at start
    evicted: int = 0  # RAM entries dropped for the budget
    redundant: int = 0  # RAM entries dropped because a longer one had them all
    swa_reread: int = 0  # cached prompt tokens prefilled again: the sliding window had moved past their end


class PromptCache:
    """Slots' and RAM's cached sequences for one llama.cpp context (the rules it keeps: the module docstring)."""

    def __init__(
        self,
        lib: Any,
        ctx: Any,
        memory: Any,
        budget: int,
        enabled: bool = True,
        n_swa: int = 0,
        exact: bool = False,
        store: KvStore | None = None,
    ) -> None:
        """``n_swa``: the model's sliding window in tokens (0: no sliding-window layers), with ``swa_full`` too.
        ``exact`` (a deterministic engine's): no RAM entry that holds only a window is restored (``_exact_enough``).
        ``store``: the RAM entries live there instead, outliving this runner (``store``); what a dead predecessor
        saved there is adopted now, within the budget."""
        self.lib = lib
        self.ctx = ctx
        self.memory = memory
        self.budget = budget
        self.enabled = enabled
        self.n_swa = n_swa
        self.exact = exact
        self.index = PrefixIndex()
        self._ram: OrderedDict[str, _Saved] = OrderedDict()  # least recently used first
        self._ram_bytes = 0
        self._keys = 0
        self._pinned: dict[int, str] = {}  # slot -> its request's prompt in the store, kept while it is in flight
        self.stats = CacheStats()
        self.store = store if enabled and budget > 0 else None
        if self.store is not None:
            for stored in self.store.adopt():  # oldest first: the budget keeps the latest
                head = stored.header
                self._add(f"kv-{stored.key}", _Saved(head.tokens, head.size, stored.held, head.start, stored=stored))
                self.stats.adopted += 1
                while self._ram_bytes > self.budget:
                    self._drop(next(iter(self._ram)))

    @property
    def ram_bytes(self) -> int:
        return self._ram_bytes

    @property
    def ram_entries(self) -> int:
        return len(self._ram)

    def place(self, slot: int, cached: list[int], prompt: Sequence[int], slots: Sequence[list[int]]) -> int:
        """Bring ``prompt``'s longest cached prefix into ``slot`` (whose cells hold ``cached``, a list this updates
        to what they hold after) and leave the rest of its cells empty; returns that prefix's length. ``slots[i]``
        is slot i's token list (the source of a copy). The last prompt token is never reused: its logits make the
        first token.

        From its own slot: the tail removed. From another slot: ``llama_memory_seq_cp`` of the whole sequence (a
        partial copy between streams is not supported), then the tail removed; llama.cpp copies at the next decode,
        before that step's rows are computed, so a busy source is copied as it stood. From RAM:
        ``llama_state_seq_set_data_ext``, then the tail removed. A holder whose window has moved on is passed over for
        one that passes ``_usable`` (a shorter RAM entry included: ``_shorter_entry``), else the prompt is prefilled
        from the start, and the tokens passed over are counted (``CacheStats.swa_reread``)."""
        limit = len(prompt) - 1
        self._pinned.pop(slot, None)  # the slot's last request is over
        if not self.enabled:
            self._overwrite(slot, cached, 0)
            return 0
        matched = common_length(cached, prompt, 0, limit)
        own = self._usable(matched, self._window_start(slot))
        passed = matched - own  # the longest prefix passed over because its holder's window had moved on
        best = self.index.match(prompt, limit)
        source, reused = ("own", own) if own else ("none", 0)
        donor: int | None = None
        saved: str | None = None
        if best.length >= own + MIN_COPY:
            others = [s for s in best.slots if s != slot]
            usable = [s for s in others if self._usable(best.length, self._window_start(s))]
            entries = [k for k in best.ram if self._usable(best.length, self._ram[k].start) and self._exact_enough(k)]
            if usable:
                donor, source, reused = min(usable), "slot", best.length
            elif entries:
                saved, source, reused = entries[0], "ram", best.length
            elif others or best.ram:
                passed = best.length
                shorter = self._shorter_entry(prompt, limit, own)
                if shorter is not None:
                    reused, saved = shorter
                    source = "ram"
        keep = reused if source == "own" else 0
        self._save_before_overwrite(slot, cached, keep, protect=saved)
        self.index.remove(slot)
        if donor is not None:
            self.lib.llama_memory_seq_cp(self.memory, donor, slot, -1, -1)
            cached[:] = slots[donor][:reused]
            self._truncate(slot, cached, reused)
        elif saved is not None:
            entry = self._ram[saved]
            self._ram.move_to_end(saved)
            if self._restore(entry, slot) == 0:
                self._overwrite(slot, cached, 0)  # llama.cpp could not restore it (no room): prefill it all
                self._drop(saved)
                return 0
            cached[:] = entry.tokens[:reused]
            self._truncate(slot, cached, reused)
        else:
            self._truncate(slot, cached, keep)
        if reused and not self._usable(reused, self._window_start(slot)):  # checked above: a safety net only
            passed, reused = max(passed, reused), 0
            self._truncate(slot, cached, 0)
        if source == "slot":
            self.stats.from_other_slot += reused
        elif source == "ram":
            self.stats.from_ram += reused
        else:
            self.stats.from_own_slot += reused
        if passed > reused:
            self.stats.swa_reread += passed - reused
            log.debug(
                "slot %d: %d cached prompt tokens prefilled again, the sliding window (%d tokens) of their holders "
                "having moved past them; %d reused (%s)",
                slot,
                passed - reused,
                self.n_swa,
                reused,
                source,
            )
        return reused

    def register(self, slot: int, cached: Sequence[int]) -> None:
        """``slot``'s cells now hold exactly ``cached`` (its prompt prefilled, or its sequence ended)."""
        if self.enabled:
            self.index.insert(slot, cached)

    def checkpoint(self, slot: int, cached: Sequence[int]) -> None:
        """Save ``slot``'s sequence (``cached``: exactly its cells) to the store now rather than only before its cells
        are overwritten: should this runner die, the one that resumes its request restores it instead of prefilling
        it again. Called once its prompt is prefilled, then as its generation grows (``Batch._save_progress``). Only
        with a store, any sequence ``_save_before_overwrite`` would keep (``MIN_SAVE`` tokens or more: one prompt
        re-prefills fast, but a runner's death resumes all of its requests at once, and 200 short chats took ~9.5 s
        to read again on 2 cores against ~1.2-2.4 ms each to save here), and none an ``exact`` cache would not
        restore (past a sliding window: ``_exact_enough``), within the budget (least recently used entries go first,
        never the latest save of another request still in flight). The request's own previous save, a prefix of this
        one, may be evicted to make room for it (else a sequence past half the budget is never saved again), and is
        dropped once this one is in, unless its window starts earlier."""
        if self.store is None or (self.exact and self.n_swa and len(cached) > self.n_swa):
            return
        saved = self.stats.saved
        previous = self._pinned.pop(slot, None)  # the request's previous save may make room for this, its successor
        self._save_before_overwrite(slot, cached, 0)
        self.stats.checkpoints += self.stats.saved - saved
        held = self.index.match(cached)
        key = next((k for k in held.ram if held.length == len(cached) == len(self._ram[k].tokens)), None)
        if key is None:
            if previous is not None and previous in self._ram:  # not saved, nor evicted: what a resume restores
                self._pinned[slot] = previous
            return
        self._pinned[slot] = key  # no other save evicts it while its request may still need it
        older = self._ram.get(previous) if previous not in (None, key) else None
        if previous is not None and older is not None and older.start >= self._ram[key].start:
            self._drop(previous)
            self.stats.redundant += 1

    def unpin(self, slot: int) -> None:
        """``slot``'s request ended: its saved prompt is evicted for room again like any other entry."""
        self._pinned.pop(slot, None)

    def clear(self) -> None:
        """Forget every slot's registration and every RAM entry. The store's entries stay: they hold no cell of this
        context (a restore copies one in), and a predecessor's are what a resumed request needs after the warm-up."""
        for key in [key for key, entry in self._ram.items() if entry.stored is None]:
            self._drop(key)
        self._pinned.clear()
        self.index = PrefixIndex()
        for key, entry in self._ram.items():
            self.index.insert(key, entry.tokens)

    # --- internals ------------------------------------------------------------------------------------------

    def _shorter_entry(self, prompt: Sequence[int], limit: int, own: int) -> tuple[int, str] | None:
        """The longest RAM entry that is a whole prefix of ``prompt`` and can serve it, (length, key), when the
        longest holders cannot: a conversation's saved turn whose window has moved past where a resumed answer
        parts from it, beside the prompt alone that was saved when it was prefilled (``checkpoint``)."""
        for length, key in self.index.prefixes(prompt, limit):
            if length < own + MIN_COPY:
                break
            if isinstance(key, str) and self._usable(length, self._ram[key].start) and self._exact_enough(key):
                return length, key
        return None

    def _window_start(self, slot: int) -> int:
        """The first position whose cells ``slot`` holds in every layer: 0 without a sliding window, else llama.cpp's
        ``seq_pos_min``, the window cache's oldest position (it holds every one from there on); -1 when the window
        cache holds none (an empty slot, or a tail removed below the window while other layers keep a prefix)."""
        if not self.n_swa:
            return 0
        return int(self.lib.llama_memory_seq_pos_min(self.memory, slot))

    def _exact_enough(self, key: str) -> bool:
        """Whether restoring RAM entry ``key`` gives the cells a cold prefill would, in the places it would put
        them: always, unless ``exact`` and the entry holds only a window of its sliding-window layers. A restore packs
        a window's cells from the stream's start, where a cold prefill puts each position at its own place, and the
        attention sums over cells in the order of their places; so such an entry's prefix is prefilled again. Copies
        between slots and a slot's own prefix keep every cell in its place."""
        return not self.exact or self._ram[key].start == 0

    def _usable(self, length: int, start: int) -> int:
        """How much of a holder's ``length``-token prefix can be reused when its window starts at ``start``: all of
        it when the ``n_swa`` positions before its end are held (llama-server's rule), else none (a shorter prefix
        needs older positions still).

        Without ``swa_full`` a sliding-window layer keeps ``n_swa + n_ubatch`` cells a slot, a ring that overwrites
        a position once it has slid out of the window of the sequence's last one: a slot holds every position from
        its window start (``_window_start``) to its last. Removing a tail is then not enough: the token after the
        prefix attends to the ``n_swa`` positions before it, and a longer sequence may have moved the window past
        them."""
        return length if start == 0 or 0 < start <= length - self.n_swa else 0

    def _overwrite(self, slot: int, cached: list[int], keep: int) -> None:
        self.index.remove(slot)
        self._truncate(slot, cached, keep)

    def _truncate(self, slot: int, cached: list[int], keep: int) -> None:
        """Remove the slot's cells from position ``keep`` on (all of them if llama.cpp refuses a partial removal)."""
        if not self.lib.llama_memory_seq_rm(self.memory, slot, keep, -1):
            self.lib.llama_memory_seq_rm(self.memory, slot, -1, -1)
            keep = 0
        del cached[keep:]

    def _save_before_overwrite(self, slot: int, cached: Sequence[int], keep: int, protect: str | None = None) -> None:
        """Save ``slot``'s sequence to RAM if placing a prompt there loses some of it and nobody else has it (not when
        shorter than ``MIN_SAVE`` or larger than the budget; least recently used entries go first for room). A saved
        sequence makes a saved prefix of it redundant (a conversation's next turn extends its last), unless that one's
        window starts earlier. The entry ``protect`` (the one about to be restored into that slot) is neither evicted
        for room nor dropped as redundant: without it, the restore that follows would find it gone.

        llama.cpp saves only the last window of a sliding-window layer, even with ``swa_full``, so such an entry
        serves only a prompt that extends all of it."""
        if keep >= len(cached) or len(cached) < MIN_SAVE or self.budget <= 0:
            return
        start = self._window_start(slot)
        if self.n_swa:  # llama.cpp saves a sliding-window layer's last window only: a restore holds no more
            start = max(start, len(cached) - self.n_swa)
        held = self.index.match(cached)
        if held.length == len(cached):
            keeping = [k for k in held.ram if self._ram[k].start <= start]
            for key in keeping:  # it is in use again: the last to be evicted for room
                self._ram.move_to_end(key)
            if keeping or any(0 <= self._window_start(s) <= start for s in held.slots if s != slot):
                return  # another slot or a RAM entry has all of it, its window starting no later
        size = int(self.lib.llama_state_seq_get_size_ext(self.ctx, slot, STATE_FLAGS))
        if size <= 0 or size > self.budget:
            return
        pinned = set(self._pinned.values())
        evictable = sum(entry.held for key, entry in self._ram.items() if key != protect and key not in pinned)
        if self._ram_bytes - evictable + size > self.budget:
            return  # it would not fit even with every entry it may evict gone: evict none for nothing
        while self._ram_bytes + size > self.budget:
            oldest = next((key for key in self._ram if key != protect and key not in pinned), None)
            if oldest is None:
                return  # only the protected entry is left, and the two do not fit together: this one is not saved
            self._drop(oldest)
            self.stats.evicted += 1
        entry = self._write(slot, size, list(cached), start)
        if entry is None:
            return
        key = f"kv-{entry.stored.key}" if entry.stored is not None else f"ram-{self._keys}"
        self.stats.saved += 1
        for prefix in self._add(key, entry):
            # a saved prefix of this one is redundant now, unless it can serve prompts this one cannot: its window
            # starts earlier (this one's moved on)
            if (
                isinstance(prefix, str)
                and prefix != protect
                and prefix not in self._pinned.values()
                and prefix in self._ram
                and self._ram[prefix].start >= start
            ):
                self._drop(prefix)
                self.stats.redundant += 1

    def _write(self, slot: int, size: int, tokens: list[int], start: int) -> _Saved | None:
        """``slot``'s sequence state, in the store when there is one, else in RAM; None if nothing was written."""

        def write(data: Any, length: int) -> int:
            return int(self.lib.llama_state_seq_get_data_ext(self.ctx, data, length, slot, STATE_FLAGS))

        if self.store is not None:
            stored = self.store.save(size, write, tokens, start)
            return None if stored is None else _Saved(tokens, stored.header.size, stored.held, start, stored=stored)
        # Its own anonymous mapping, not malloc's: glibc raises its mmap threshold after a large free, so freed
        # buffers of this size would stay in the heap and the process would hold more than the budget says.
        mapping = mmap.mmap(-1, size)
        data = (ctypes.c_uint8 * size).from_buffer(mapping)
        written = write(data, size)
        if written <= 0:
            del data
            mapping.close()
            return None
        self._keys += 1
        return _Saved(tokens, written, size, start, mapping=mapping, data=data)

    def _add(self, key: str, entry: _Saved) -> list[Holder]:
        """Hold ``entry`` as ``key`` (most recently used); the holders it makes a prefix of (``PrefixIndex.insert``)."""
        self._ram[key] = entry
        self._ram_bytes += entry.held  # the buffer held, not only what llama.cpp wrote into it
        return self.index.insert(key, entry.tokens)

    def _restore(self, entry: _Saved, slot: int) -> int:
        """Copy ``entry``'s state into ``slot``'s cells (from RAM, or its store file); 0 if llama.cpp could not."""

        def read(data: Any, size: int) -> int:
            return int(self.lib.llama_state_seq_set_data_ext(self.ctx, data, size, slot, STATE_FLAGS))

        if entry.stored is None or self.store is None:
            return read(entry.data, entry.size)
        return self.store.load(entry.stored, read)

    def _drop(self, key: str) -> None:
        entry = self._ram.pop(key, None)
        if entry is not None:
            entry.free()
            if entry.stored is not None and self.store is not None:
                self.store.remove(entry.stored.key)
            self._ram_bytes -= entry.held
            self.index.remove(key)
