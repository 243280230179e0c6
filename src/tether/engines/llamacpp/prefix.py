"""Which cached token sequence shares the longest prefix with a prompt: a radix tree keyed by token ids.

The llama.cpp batch (``batch``) keeps KV cells in two places: its slots (one sequence each, busy or idle)
and a RAM store of sequences saved from slots that a new request took over. Each is a *holder* here, registered
with the exact tokens whose cells it holds. ``match(prompt)`` walks the prompt down the tree once: its cost is the
prompt's length (plus one step per tree node on the way), whatever the number of holders, and it returns the
matched length with the holders that share all of it, slots and RAM entries apart, so the caller can prefer a slot
(a copy between slots) over a restore from RAM. A holder's registration must never claim a token whose
cells it no longer holds: the prompt cache removes a slot's entry before it truncates or overwrites its cells,
and registers it again once its cells are computed.

Nodes are split where sequences diverge and pruned when their last holder leaves, so the tree holds at most one
node per distinct branch point of the live holders (not one per token).
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

Holder = int | str  # a slot's index, or a RAM entry's key


@dataclass(eq=False)
class _Node:
    edge: list[int]  # the tokens from the parent to this node
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # by the first token of the child's edge
    slots: set[int] = field(default_factory=set)  # holders whose tokens run through the whole edge
    ram: set[str] = field(default_factory=set)
    ends: set[Holder] = field(default_factory=set)  # holders whose tokens end exactly here

    def add(self, holder: Holder) -> None:
        if isinstance(holder, int):
            self.slots.add(holder)
        else:
            self.ram.add(holder)

    def discard(self, holder: Holder) -> None:
        if isinstance(holder, int):
            self.slots.discard(holder)
        else:
            self.ram.discard(holder)

    @property
    def empty(self) -> bool:
        return not self.slots and not self.ram


@dataclass(frozen=True)
class Match:
    """The longest prefix of a prompt some holder has: its length, and every holder that has all of it (the
    tree's own sets, not copies: read them before the index changes)."""

    length: int
    slots: AbstractSet[int]
    ram: AbstractSet[str]


NO_MATCH = Match(0, frozenset(), frozenset())


class PrefixIndex:
    """The radix tree over every holder's tokens (see the module docstring). Not thread-safe: the engine's thread
    alone uses it."""

    def __init__(self) -> None:
        self._root = _Node([], None)
        self._where: dict[Holder, tuple[_Node, int]] = {}  # holder -> (its last node, its length)

    def __len__(self) -> int:
        return len(self._where)

    def insert(self, holder: Holder, tokens: Sequence[int]) -> list[Holder]:
        """Register ``holder`` as holding exactly ``tokens`` (replacing what it held before). Returns the *other*
        holders whose whole sequence is a prefix of ``tokens`` (those it makes redundant, for the RAM store). No
        tokens: nothing is registered (an empty prefix is no match)."""
        self.remove(holder)
        if not tokens:
            return []
        node = self._root
        i = 0
        covered: list[Holder] = []
        n = len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(list(tokens[i:]), node)
                node.children[tokens[i]] = leaf
                node = leaf
                node.add(holder)
                i = n
                break
            edge = child.edge
            k = common_length(edge, tokens, i)
            if k < len(edge):
                child = self._split(child, k)
            child.add(holder)
            covered.extend(child.ends)
            node = child
            i += k
        node.ends.add(holder)
        self._where[holder] = (node, n)
        return [h for h in covered if h != holder]

    def remove(self, holder: Holder) -> None:
        """Forget ``holder`` (nothing happens when it is not registered)."""
        where = self._where.pop(holder, None)
        if where is None:
            return
        node: _Node | None = where[0]
        node.ends.discard(holder)  # type: ignore[union-attr]
        while node is not None and node.parent is not None:
            node.discard(holder)
            parent = node.parent
            if node.empty:
                del parent.children[node.edge[0]]
            node = parent

    def match(self, prompt: Sequence[int], limit: int | None = None) -> Match:
        """The longest prefix of ``prompt`` (at most ``limit`` tokens) that some holder has, and its holders."""
        n = len(prompt) if limit is None else min(limit, len(prompt))
        node = self._root
        i = 0
        best = NO_MATCH
        while i < n:
            child = node.children.get(prompt[i])
            if child is None:
                break
            k = common_length(child.edge, prompt, i, n)
            i += k
            best = Match(i, child.slots, child.ram)
            if k < len(child.edge):
                break
            node = child
        return best

    def prefixes(self, prompt: Sequence[int], limit: int | None = None) -> list[tuple[int, Holder]]:
        """Every holder whose whole sequence is a prefix of ``prompt`` (at most ``limit`` tokens), with its length,
        longest first: the shorter holders ``match`` does not return, for when its longest ones cannot serve."""
        n = len(prompt) if limit is None else min(limit, len(prompt))
        node = self._root
        i = 0
        found: list[tuple[int, Holder]] = []
        while i < n:
            child = node.children.get(prompt[i])
            if child is None:
                break
            k = common_length(child.edge, prompt, i, n)
            if k < len(child.edge):
                break
            i += k
            found.extend((i, holder) for holder in child.ends)
            node = child
        return found[::-1]

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after ``k`` tokens: a new node there, ``child`` below it. Returns the new node."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.edge[:k], parent, slots=set(child.slots), ram=set(child.ram))
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[k:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle


def common_length(a: Sequence[int], b: Sequence[int], start: int = 0, stop: int | None = None) -> int:
    """How many of ``a``'s first tokens equal those of ``b[start:stop]``: the common prefix's length."""
    end = len(b) if stop is None else min(stop, len(b))
    n = min(len(a), end - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i
