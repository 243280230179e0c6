"""The llama.cpp prompt cache with the real default model: prefixes reused from the slot's own cells, from a busy
slot and from RAM, within the RAM budget, and never corrupted by a sequence that ended early.

One engine in-process (one thread); each test starts from an empty cache (``clear``). The strict comparisons are
between paths that prefill in the same chunks (a copy or a restore is exact: bit-identical cells), so their texts
must be equal; against a cold prefill (one chunk), a reused prefix may change a greedy text, as llama-server's
``cache_prompt`` may: those divergences are counted and bounded, not hidden.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import model_missing
from tether.engines import create_engine
from tether.engines.base import Delta, RequestError
from tether.node.memory import process_memory
from tether.protocol import ChatMessage, EngineSpec, GenerateParams

MISSING = model_missing()
pytestmark = [
    pytest.mark.model,
    pytest.mark.timeout(240),
    pytest.mark.skipif(MISSING is not None, reason=MISSING or ""),
]

SYSTEM = ChatMessage(
    "system",
    "You are Harbor, the assistant of a small maritime museum. "
    + " ".join(
        f"Rule {i}: answer visitors politely, mention the {topic} exhibit when it is relevant, keep answers short, "
        "and never invent opening hours."
        for i, topic in enumerate(
            ("lighthouse", "anchor", "compass", "sail", "knot", "map", "whale", "storm", "harbor", "ship")
        )
    ),
)
QUESTIONS = (
    "What can I see in the lighthouse room?",
    "Tell me a short story about a sailor.",
    "How does a compass work?",
)


def chat(question: str, max_tokens: int = 32) -> GenerateParams:
    return GenerateParams(messages=(SYSTEM, ChatMessage("user", question)), max_tokens=max_tokens)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    engine = create_engine(
        EngineSpec(options={"n_ctx": 1024, "n_threads": 1, "parallel": 8, "prompt_cache_ram": "64M"})
    )
    engine.load(lambda f, d: None)
    engine.warmup()
    yield engine
    engine.close()


@pytest.fixture()
def cache(engine: Any) -> Any:
    batch = engine._require_batch()
    batch.clear()
    batch.cache.stats = type(batch.cache.stats)()
    return batch.cache


def step_until(engine: Any, done: Any, deltas: dict[str, list[Delta]], timeout: float = 120) -> None:
    """Step the batch, collecting every sequence's deltas, until ``done()``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not done within {timeout} s"
        for seq_id, result in engine.step():
            assert not isinstance(result, RequestError), result
            deltas.setdefault(seq_id, []).append(result)


def ended(deltas: dict[str, list[Delta]], seq_id: str) -> bool:
    return bool(deltas.get(seq_id)) and deltas[seq_id][-1].finish_reason is not None


def text(deltas: dict[str, list[Delta]], seq_id: str) -> str:
    return "".join(d.text for d in deltas[seq_id])


def alone(engine: Any, params: GenerateParams) -> tuple[str, Delta]:
    deltas = list(engine.generate(params, lambda: False))
    return "".join(d.text for d in deltas), deltas[-1]


DONOR = "Write a long story about the museum's lighthouse keeper."


@pytest.mark.cores
def test_a_prefix_copied_from_a_busy_slot_is_exact_and_its_divergence_from_cold_is_counted(
    engine: Any, cache: Any
) -> None:
    """Each question, three ways: cold (an empty cache), reusing the system prompt from the slot's own cells, and
    copied from another slot while that slot decodes. Own and copied prefill the same chunks after the same cells,
    so their texts must be identical; cold prefills the whole prompt in one chunk, so a greedy text may differ."""
    batch = engine._require_batch()
    cold: list[str] = []
    for question in QUESTIONS:
        batch.clear()
        cold.append(alone(engine, chat(question))[0])
    batch.clear()
    alone(engine, chat(DONOR, max_tokens=1))  # the system prompt now sits in one slot
    own = [alone(engine, chat(question)) for question in QUESTIONS]
    assert all(final.cached_tokens > 200 for _, final in own), [final.cached_tokens for _, final in own]

    batch.clear()
    cache.stats = type(cache.stats)()
    deltas: dict[str, list[Delta]] = {}
    engine.start("donor", chat(DONOR, max_tokens=400))
    step_until(engine, lambda: bool(deltas.get("donor")), deltas)  # the donor decodes from now on
    for i, question in enumerate(QUESTIONS):
        engine.start(f"copy-{i}", chat(question))
    step_until(engine, lambda: all(ended(deltas, f"copy-{i}") for i in range(len(QUESTIONS))), deltas)
    assert not ended(deltas, "donor"), "the donor must be busy throughout"
    engine.drop("donor")
    copied = [text(deltas, f"copy-{i}") for i in range(len(QUESTIONS))]
    cached = [deltas[f"copy-{i}"][-1].cached_tokens for i in range(len(QUESTIONS))]
    assert cache.stats.from_other_slot > 0 and all(n > 200 for n in cached), (cache.stats, cached)
    assert copied == [t for t, _ in own]
    diverged = sum(c != o for c, o in zip(cold, copied, strict=True))
    print(f"prompt cache: {diverged} of {len(QUESTIONS)} greedy texts differ from a cold prefill")
    assert diverged <= len(QUESTIONS) // 2, list(zip(cold, copied, strict=True))


CHURN = "Question: " + " ".join(f"item-{j}" for j in range(80))  # what the churn's prompts share after SYSTEM


def churn(i: int, max_tokens: int = 4) -> GenerateParams:
    """A long prompt (~700 tokens) whose last ~110 are its own: each overwrite of the slot prefills only those."""
    return chat(f"{CHURN} Then {i}: " + " ".join(f"item{i}-{j}" for j in range(20)), max_tokens=max_tokens)


@pytest.mark.cores
@pytest.mark.timeout(240)  # 67 s in CI beside the suite (the default is 120)
def test_the_ram_store_keeps_to_its_budget_under_churn_and_restores_exactly(engine: Any, cache: Any) -> None:
    """Six distinct long prompts: the slot they share is overwritten again and again, each overwrite saves its
    sequence to RAM, and the budget (64 MiB, ~4 sequences) makes the store evict from the fifth on. The store's
    bytes and the process's resident growth stay within it. A prompt whose sequence is only in RAM now is restored
    from there and gives the text it gave when its own slot still held it (the same cells, the same last-token
    step)."""
    budget = 64 << 20
    alone(engine, churn(99))  # the scratch a prompt this long needs is touched before the measurement
    engine._require_batch().clear()
    start = process_memory(os.getpid())
    assert start is not None
    repeats: dict[int, str] = {}
    for i in range(6):
        alone(engine, churn(i))
        repeats[i], final = alone(engine, churn(i, 16))  # all but its last token from its own slot
        assert final.cached_tokens == final.prompt_tokens - 1, final
        assert cache.ram_bytes <= budget, (i, cache.ram_bytes)
    end = process_memory(os.getpid())
    assert end is not None
    assert cache.stats.saved >= 5 and cache.stats.evicted > 0 and cache.ram_entries > 0, cache.stats
    grown = end.rss - start.rss
    assert grown <= budget + (32 << 20), f"resident grew {grown >> 20} MiB with a {budget >> 20} MiB budget"
    from_ram = cache.stats.from_ram
    restored, final = alone(engine, churn(4, 16))  # overwritten by 5 since, so saved; 16 tokens to tell cells apart
    assert cache.stats.from_ram > from_ram and final.cached_tokens == final.prompt_tokens - 1, cache.stats
    assert restored == repeats[4]


def test_the_entry_chosen_for_a_restore_is_never_evicted_by_saving_the_slot_it_goes_into() -> None:
    """Regression (``bench/determinism.py``'s prefix scenario, a small RAM store: KeyError, the runner dead): a prompt
    whose prefix only RAM holds goes into a slot whose own sequence must be saved first, and the store has room for
    one of the two. Saving evicted the least recently used entry, the very one about to be restored. Now the chosen
    entry stays, the slot's sequence is not saved (no room beside it), and the prefix is restored."""
    engine = create_engine(
        EngineSpec(options={"n_ctx": 1024, "n_threads": 1, "parallel": 1, "prompt_cache_ram": "12M"})
    )
    engine.load(lambda f, d: None)
    try:
        cache = engine._require_batch().cache
        alone(engine, chat(QUESTIONS[0], max_tokens=4))  # the slot holds SYSTEM + question 0
        other = " ".join(f"item-{j}" for j in range(100))  # ~9 MiB of cells: the two do not fit together
        alone(engine, GenerateParams(messages=(ChatMessage("user", other),), max_tokens=4))  # it is saved to RAM
        assert cache.ram_entries == 1, cache.stats
        _, final = alone(engine, chat(QUESTIONS[1], max_tokens=4))  # SYSTEM is only in RAM; the slot's must go
        assert cache.stats.from_ram > 0 and final.cached_tokens > 0, (cache.stats, final)
        assert final.finish_reason == "length", final
    finally:
        engine.close()


def test_a_sequence_cancelled_mid_prefill_leaves_a_prefix_that_continues_exactly(engine: Any, cache: Any) -> None:
    """A neighbour decodes, so a long prompt is prefilled in chunks; cancelled after two chunks, its slot keeps the
    cells it computed, and the same prompt sent again continues from them: chunk for chunk what an uncancelled
    run prefills, so the text must be identical."""
    batch = engine._require_batch()
    long = chat("Summarise this list: " + ", ".join(f"entry {j}" for j in range(60)), max_tokens=24)

    def with_neighbour(cancel_after: int | None) -> str:
        batch.clear()
        deltas: dict[str, list[Delta]] = {}
        engine.start("neighbour", GenerateParams(prompt="Once upon a time", max_tokens=600))
        step_until(engine, lambda: bool(deltas.get("neighbour")), deltas)
        if cancel_after is not None:
            engine.start("victim", long)
            for _ in range(cancel_after):
                for seq_id, result in engine.step():
                    deltas.setdefault(seq_id, []).append(result)
            engine.drop("victim")
        engine.start("target", long)
        step_until(engine, lambda: ended(deltas, "target"), deltas)
        assert not ended(deltas, "neighbour")
        engine.drop("neighbour")
        final = deltas["target"][-1]
        if cancel_after is not None:  # the target reused what the victim computed and nothing more
            assert final.cached_tokens == cancel_after * batch.prefill_chunk, final
        return text(deltas, "target")

    uncancelled = with_neighbour(None)
    assert with_neighbour(2) == uncancelled
