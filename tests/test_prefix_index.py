"""The prompt cache's radix tree against a brute-force model: after any sequence of registrations and removals, a
match finds the longest prefix any holder has, and exactly the holders that have all of it; and ``prefixes`` every
holder whose whole sequence is a prefix of the prompt."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from tether.engines.llamacpp.prefix import Holder, PrefixIndex

TOKENS = st.lists(st.integers(0, 3), max_size=12)  # a tiny vocabulary: many shared prefixes and splits
HOLDERS = st.one_of(st.integers(0, 3), st.sampled_from(["ram-1", "ram-2", "ram-3"]))
OPS = st.lists(st.tuples(st.booleans(), HOLDERS, TOKENS), max_size=30)


def common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(OPS, st.lists(TOKENS, min_size=1, max_size=5))
def test_a_match_is_the_longest_prefix_any_holder_has_and_names_every_holder_that_has_it(
    ops: list[tuple[bool, Holder, list[int]]], prompts: list[list[int]]
) -> None:
    index = PrefixIndex()
    model: dict[Holder, list[int]] = {}
    for insert, holder, tokens in ops:
        if insert:
            covered = index.insert(holder, tokens)
            model.pop(holder, None)
            if tokens:  # an empty registration is none
                model[holder] = tokens
            expected = {h for h, t in model.items() if h != holder and tokens[: len(t)] == t}
            assert set(covered) == expected
        else:
            index.remove(holder)
            model.pop(holder, None)
        assert len(index) == len(model)
    for prompt in prompts:
        for limit in (None, max(0, len(prompt) - 1)):
            stop = len(prompt) if limit is None else limit
            found = index.match(prompt, limit)
            best = max((min(common(t, prompt), stop) for t in model.values()), default=0)
            assert found.length == best
            have = {h for h, t in model.items() if best > 0 and min(common(t, prompt), stop) == best}
            assert set(found.slots) | set(found.ram) == have
            # and every holder that is a whole prefix, longest first (what serves when the longest ones cannot)
            shorter = index.prefixes(prompt, limit)
            assert len(set(shorter)) == len(shorter)
            assert set(shorter) == {(len(t), h) for h, t in model.items() if prompt[:stop][: len(t)] == t}
            assert [n for n, _ in shorter] == sorted((n for n, _ in shorter), reverse=True)


def test_removing_every_holder_leaves_an_empty_tree() -> None:
    index = PrefixIndex()
    for i, tokens in enumerate(([1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6], [7])):
        index.insert(i, tokens)
    assert index.match([1, 2, 3, 4, 6, 9]).length == 5
    for i in range(4):
        index.remove(i)
    assert index.match([1, 2, 3]).length == 0 and len(index) == 0
    assert not index._root.children  # pruned: nothing is kept for holders that left


def test_a_match_walks_the_prompt_once_whatever_the_number_of_holders() -> None:
    """10,000 RAM entries sharing a 600-token prefix: a match costs one walk of the prompt (the tree has one node
    per branch point, and the holders' set is returned, not copied)."""
    index = PrefixIndex()
    shared = list(range(600))
    for i in range(10_000):
        index.insert(f"ram-{i}", [*shared, 1000 + i, 5])
    assert len(index._root.children) == 1
    match = index.match([*shared, 1000 + 42, 5, 9])
    assert match.length == 602 and set(match.ram) == {"ram-42"}
    assert index.match([*shared, 7]).length == 600
