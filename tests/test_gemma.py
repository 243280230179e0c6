"""Gemma 3 270M, the second family (sliding-window attention on 15 of its 18 layers, a base model without a chat
template), served by ``tether serve`` with the prompt cache on.

Its sliding-window layers keep only a ring of 1,024 cells a slot (the 512-token window plus a micro-batch), so a
cached prefix can be reused only while the 512 positions before its end are still held (``llamacpp/cache``). These
tests make the window move (sequences past 1,024 tokens) and check both sides: what can be reused is (a growing
prompt, a prefix copied from a busy slot, one restored from RAM: ``cached_tokens`` > 0), what cannot is prefilled
again (``cached_tokens`` 0, the cold text exactly), and no request fails and no instance restarts.

What "the same text" can mean here: a copy or a restore gives bit-identical cells in the same layout, so its text
is exactly the one the same prefix gives from the request's own slot. Against a cold prefill, a reused prefix's
cells were computed in other chunks (and, once the ring has wrapped, sit in other cells; a RAM restore packs them
anew), which moves llama.cpp's arithmetic by up to ~0.15 in a logprob (measured here with the full-size cache as
with the ring): a greedy choice at a near tie can flip, as with llama-server's ``cache_prompt``. So those texts must
be equal, or part first at a near tie (:func:`same_or_tie`); a window with positions missing moves logprobs by ~0.5,
and the tests see it in ``cached_tokens``: what the window has left must not be reused at all.

Prompts are token ids (the completions API takes them), cut from one long text, so each test controls exactly which
prefix each holder shares; each test uses its own stretch of it, so nothing a previous test left in a slot or in RAM
matches its prompts. The cold reference is a second instance of the model with ``prompt_cache`` off.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import Server, gemma_missing, gemma_path, serving

MISSING = gemma_missing()
pytestmark = [pytest.mark.model, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

CACHED = "gemma-3-270m-q4_k_m"  # the instance `tether serve --model` names after the file: 256 MiB of RAM store
NO_RAM = "no-ram"  # the same without a RAM store: a copy between slots is then the only way to another slot's prefix
COLD = "cold"  # no prompt cache at all: every prompt prefilled whole
TIE = 0.25  # nats: two greedy runs may part where the top two are this close (see the module docstring)


@pytest.fixture(scope="module")
def served() -> Iterator[Server]:
    path = str(gemma_path())
    args = ("--model", path, "--threads", "1", "--n-ctx", "2048", "--parallel", "2", "--prompt-cache-ram", "256M")
    with serving(*args) as server:
        common = {"n_ctx": 2048, "n_threads": 1}
        server.add_instance({"id": NO_RAM, "model": path, "options": {**common, "parallel": 2, "prompt_cache_ram": 0}})
        server.add_instance({"id": COLD, "model": path, "options": {**common, "parallel": 1, "prompt_cache": False}})
        yield server


@pytest.fixture(scope="module")
def text_ids(served: Server) -> list[int]:
    """A long log's tokens (BOS first), ~7,000: each test takes its own stretch of them."""
    text = " ".join(
        f"Entry {i}: the {('north', 'east', 'south', 'west')[i % 4]} pier logged the ship {i % 7} at {i % 24} hours "
        f"with {i * 3} crates of {('salt', 'tea', 'rope', 'tin', 'wool')[i % 5]}."
        for i in range(300)
    )
    ids = tokenize(served, text, special=True)
    assert len(ids) > 6000 and ids[0] != ids[1], len(ids)
    return ids


def tokenize(served: Server, text: str, special: bool = False) -> list[int]:
    body = {"model": CACHED, "prompt": text, "add_special": special}
    response = served.http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return [t if isinstance(t, int) else t["id"] for t in response.json()["tokens"]]


def complete(served: Server, model: str, prompt: list[int], max_tokens: int = 24) -> tuple[dict[str, Any], int]:
    """A greedy completion of token ids, with each token's 5 likeliest alternatives: its choice and how many prompt
    tokens the cache supplied."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 5}
    response = served.http.post("/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def same_or_tie(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two greedy answers to one prompt agree, or part first where each one's pick was within ``TIE`` of the other's
    in both distributions (a near tie that arithmetic moved, not a different context)."""
    for i, (x, y) in enumerate(zip(a["logprobs"]["tokens"], b["logprobs"]["tokens"], strict=False)):
        if x != y:
            top_a, top_b = a["logprobs"]["top_logprobs"][i], b["logprobs"]["top_logprobs"][i]
            return y in top_a and x in top_b and top_a[x] - top_a[y] < TIE and top_b[y] - top_b[x] < TIE
    return a["text"] == b["text"]


def healthy(served: Server) -> None:
    for instance in (CACHED, NO_RAM, COLD):
        state = served.instance(instance)
        assert state["ready"] and state["restarts"] == 0 and not state["failures"], state


@pytest.mark.cores
@pytest.mark.timeout(180)  # ~25 s alone; 45 s ran out once beside 3 workers and a benchmark, 68 s in CI
def test_a_growing_prompt_reuses_its_prefix_past_the_window(served: Server, text_ids: list[int]) -> None:
    """A 1,300-token prompt, then the next turn: it, its completion and 250 new tokens. The sequence in the slot is
    longer than its window's 1,024 cells (the ring has wrapped), yet the next turn's prefix ends within the window's
    reach and is reused whole; its text is the cold instance's (or parts from it at a near tie)."""
    bos, log = text_ids[:1], text_ids[1:]
    first = bos + log[1:1301]
    answer, _ = complete(served, CACHED, first)
    prompt = first + tokenize(served, answer["text"]) + log[1301:1551]
    answer, cached = complete(served, CACHED, prompt)
    # all but the new turn's tokens (a few at the seam may tokenize differently), more than the ring holds
    assert 1024 < len(prompt) - 260 <= cached < len(prompt), (cached, len(prompt))
    cold, _ = complete(served, COLD, prompt)
    assert same_or_tie(answer, cold), (len(prompt), answer["text"], cold["text"])
    healthy(served)


@pytest.mark.cores
@pytest.mark.timeout(180)  # ~25 s alone; 45 s ran out once beside 3 workers and a benchmark, 68 s in CI
def test_a_prefix_the_window_has_left_is_read_again_never_reused(served: Server, text_ids: list[int]) -> None:
    """A 1,200-token sequence in a slot (its window cache holds positions 177 on): a prompt sharing its first 1,100
    tokens reuses them. A prompt sharing only the first 600 does not (the 512 positions before token 600 are gone,
    from that slot and from the RAM entry the long sequence was saved to) and gives the cold text exactly (the same
    prefill). Then the long sequence decodes again (its ring moving on) while another prompt sharing its first 600
    tokens arrives: nothing is copied from the busy slot, nothing restored."""
    long = text_ids[:1] + text_ids[2000:3200]
    complete(served, CACHED, long, max_tokens=1)
    near = long[:1100] + text_ids[3500:3540]
    answer, cached = complete(served, CACHED, near)
    assert cached >= 1100 and same_or_tie(answer, complete(served, COLD, near)[0]), (cached, answer["text"])

    far = long[:600] + text_ids[3600:3640]
    answer, cached = complete(served, CACHED, far)
    cold, _ = complete(served, COLD, far)
    assert cached == 0 and answer["text"] == cold["text"], (cached, answer["text"], cold["text"])

    with decoding(served, CACHED, long, 100):  # in the slot that holds ``far`` (600 tokens in common, reused)
        far = long[:600] + text_ids[3700:3740]
        answer, cached = complete(served, CACHED, far)
    assert cached == 0 and same_or_tie(answer, complete(served, COLD, far)[0]), (cached, answer["text"])
    healthy(served)


@pytest.mark.cores
@pytest.mark.timeout(180)  # ~25 s alone; 45 s ran out once beside 3 workers and a benchmark, 68 s in CI
def test_a_prefix_copied_from_a_busy_slot_is_exact_and_a_next_turn_is_restored_from_ram(
    served: Server, text_ids: list[int]
) -> None:
    """Reference: a prompt sharing 650 tokens of a 700-token sequence, reused from its own slot. Then the same prompt
    while that sequence decodes in the other slot (an instance without a RAM store: the prefix can only be copied
    from the busy slot): the same cached tokens and exactly the same text (a copy keeps the cells where they were).
    Then, with a RAM store, a conversation's next turn after both slots were taken by other prompts: its whole last
    sequence restored from RAM (the only prefix a saved sliding-window sequence can serve), the cold text."""
    long = text_ids[:1] + text_ids[4000:4700]
    near = long[:650] + text_ids[4800:4840]
    complete(served, NO_RAM, long, max_tokens=1)
    reference, cached = complete(served, NO_RAM, near)
    assert cached == 650, cached
    complete(served, NO_RAM, long, max_tokens=1)  # back in that slot, for the busy sequence to start from
    with decoding(served, NO_RAM, long, 150):  # 700 + 150 tokens: its ring does not wrap
        copied, cached = complete(served, NO_RAM, near)
    assert cached == 650 and copied["text"] == reference["text"], (cached, copied["text"], reference["text"])

    first, _ = complete(served, CACHED, near)
    turn = near + tokenize(served, first["text"]) + text_ids[4900:4940]
    with decoding(served, CACHED, text_ids[:1] + text_ids[5000:5100], 40):  # both slots taken by other prompts
        complete(served, CACHED, text_ids[:1] + text_ids[5200:5300], max_tokens=1)
    restored, cached = complete(served, CACHED, turn)
    assert len(near) + 20 <= cached <= len(turn) - 40, (cached, len(near), len(turn))
    assert same_or_tie(restored, complete(served, COLD, turn)[0]), restored["text"]
    healthy(served)


class decoding:
    """A greedy stream of ``prompt`` that is decoding for the block (its first token out before the block starts)
    and still decoding when the block ends (checked after: it ended after the block did)."""

    def __init__(self, served: Server, model: str, prompt: list[int], max_tokens: int) -> None:
        self.body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        self.served = served
        self.first = threading.Event()
        self.done = threading.Event()
        self.chunks = 0
        self.thread = threading.Thread(target=self._stream, daemon=True)

    def _stream(self) -> None:
        try:
            with self.served.http.stream("POST", "/v1/completions", json=self.body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks += 1
                        self.first.set()
        finally:
            self.done.set()

    def __enter__(self) -> decoding:
        self.thread.start()
        assert self.first.wait(30) and not self.done.is_set(), "the busy sequence never started decoding"
        return self

    def __exit__(self, *exc: object) -> None:
        ended_inside = self.done.is_set()
        assert self.done.wait(40), "the busy sequence did not end"
        self.thread.join(5)
        assert not ended_inside, "the busy sequence must still decode while the block's requests are served"
        assert self.chunks > 1
