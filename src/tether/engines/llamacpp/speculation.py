"""Draftless speculation: where a sequence's draft tokens come from, and how many of them a step verifies.

Runs in the runner, on the engine's step thread (``batch`` calls it); pure Python, no llama.cpp here.

*Drafts* are guesses at a sequence's next tokens that cost no model: a step decodes them after the sequence's last
sampled token, and the sequence keeps the longest run of them its own sampling picks (``batch``). Three sources, each
a lookup of the tokens just written in something already known: the request's ``prediction``
(:class:`PredictionCursor`), the sequence's own context (:class:`NgramIndex`) and earlier completions
(:class:`History`). Acceptance is learnt per kind of proposal (:class:`Acceptance`).

On a CPU, verifying a draft is not free (two rows cost about two steps), so each step drafts only where the measured
cost curve (:class:`CostCurve`) says it pays (:func:`plan`), and a batch shape where drafting has not paid, measured,
stops drafting (:class:`Payoff`). The curve and why: docs/speculation.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

CONTEXT_NGRAMS = (4, 3, 2)  # a sequence's own context: the longest of these that matched earlier
HISTORY_NGRAMS = (4, 3)  # earlier completions: 2 tokens match too much unrelated text
PREDICTION_NGRAMS = (4, 3, 2, 1)  # re-finding the place in a prediction: one token will do near where it left off
PREDICTION_REACH = 64  # a re-found place within this many tokens after the pointer's last place (one-token match)
HISTORY_TOKENS = 1 << 16  # earlier completions' tokens kept for lookups (their index: ~20 MiB in the runner)
HISTORY_MIN = 8  # a completion shorter than this teaches nothing
MATCHED = (4, 8, 16)  # a proposal's kind says which of these its match reaches (the tokens just written, found)
MATCH_MOST = 32  # a match is measured back this far at most
PRIOR = {  # q before a kind has drafted: a long verbatim match is likely to go on; prediction is given for that
    "prediction": (0.7, 0.8, 0.9, 0.95),
    "context": (0.3, 0.6, 0.8, 0.9),
    "history": (0.3, 0.6, 0.8, 0.9),
}
PRIOR_WEIGHT = 2.0  # pseudo-events behind a kind's prior
SEQUENCE_WEIGHT = 4.0  # the engine's estimate for a kind counts as this many of a sequence's own events
DECAY = 0.98  # an engine-wide count's weight after each later outcome of its kind
Q_FLOOR = 0.5  # a proposal less likely than this is not worth pricing (two rows cost two steps here)
K_CHOICES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the uniform draft lengths a step considers
MARGIN = 1.05  # drafting must beat not drafting by this much in expected tokens per second
CURVE_EMA = 0.1  # the weight of a new timing of one micro-batch size
PAYOFF_DECAY = 0.95  # a step's tokens and seconds weigh this much less with each later step of its kind
PAYOFF_MIN = 8  # steps of each kind (with drafts, without) a batch shape needs before it is judged
EXPLORE = 20  # where drafting has not paid, one step in this many still drafts (to see when that changes)
CALIBRATION_EMA = 0.05  # the weight of a step's measured over predicted seconds
CALIBRATION_DRIFT = 0.002  # per plain step, how far the drafting steps' calibration returns toward the plain ones'


def probe_points(most: int) -> tuple[int, ...]:
    """The micro-batch sizes timed at load, up to ``most`` tokens: powers of two, since the curve interpolates
    between them and every single-pass step refines it where steps really fall. Each point timed is warm-up time,
    and a warm-up on loaded cores is slow enough to miss its deadline."""
    points = (1, 2, 4, 8, 16, 32, 64, 128)
    return tuple(p for p in points if p <= most) or (1,)


class NgramIndex:
    """A growing token list and, for each n, the position after the latest occurrence of each n-gram whose next
    token is known; ``all_positions`` keeps every occurrence (a prediction's, searched from a place onwards)."""

    def __init__(self, sizes: Sequence[int], tokens: Iterable[int] = (), *, all_positions: bool = False) -> None:
        self.sizes = tuple(sizes)
        self.tokens: list[int] = []
        self.all_positions = all_positions
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._every: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.sizes}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """Add a token: the n-grams that end just before it now have a continuation (it)."""
        tokens = self.tokens
        tokens.append(token)
        end = len(tokens) - 1  # the new token's position: what follows each n-gram ending before it
        for n in self.sizes:
            if end >= n:
                key = tuple(tokens[end - n : end])
                if self.all_positions:
                    self._every[n].setdefault(key, []).append(end)
                else:
                    self._latest[n][key] = end

    def follow(self, tail: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of ``tail``'s last n tokens (the longest n
        that matched), and how many of ``tail``'s last tokens that occurrence repeats (``matched``); ([], 0) when
        none did."""
        for n in self.sizes:
            if len(tail) < n:
                continue
            at = self._latest[n].get(tuple(tail[-n:]))
            if at is not None:
                return self.tokens[at : at + k], matched(self.tokens, at, tail)
        return [], 0

    def find(self, tail: Sequence[int], start: int, reach: int) -> int | None:
        """The position after the first occurrence, at or after ``start``, of ``tail``'s last n tokens (the longest
        n that occurs there; a one-token match only within ``reach`` of ``start``); None when none does."""
        for n in self.sizes:
            if len(tail) < n:
                continue
            for at in self._every[n].get(tuple(tail[-n:]), ()):
                if at >= start and (n > 1 or at - start <= reach):
                    return at
        return None


class PredictionCursor:
    """A request's predicted tokens (OpenAI's Predicted Outputs: the text the answer is expected to repeat, as a file
    being edited) and where the output stands in them: a pointer advances while the output repeats them; after a
    difference, the output's last tokens find the place again, the nearest match at or after where the pointer left
    off, so an edit costs one rejected draft, not the rest of the file."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.index = NgramIndex(PREDICTION_NGRAMS, tokens, all_positions=True)
        self.at: int | None = 0  # the prediction's token the output's next one is expected to be (None: lost)
        self.anchor = 0  # where the pointer was last: a lost place is searched for from here on
        self.run = 0  # the output's last tokens that repeat the prediction's up to the pointer

    def propose(self, k: int) -> list[int]:
        if self.at is None:
            return []
        return self.index.tokens[self.at : self.at + k]

    def observe(self, token: int, output: Sequence[int]) -> None:
        """The output gained ``token`` (``output`` ends with it): advance, or find the place again."""
        tokens = self.index.tokens
        if self.at is not None and self.at < len(tokens) and tokens[self.at] == token:
            self.at += 1
            self.anchor = self.at
            self.run += 1
            return
        self.at = self.index.find(output, self.anchor, PREDICTION_REACH)
        self.run = 0
        if self.at is not None:
            self.anchor = self.at
            self.run = matched(tokens, self.at, output)


class History:
    """Earlier completions of this engine, for lookups across requests (suffix decoding's idea): the last 4 or 3
    tokens looked up over the latest ``HISTORY_TOKENS`` tokens of finished completions; the oldest go first, with
    their index entries, so the runner's memory for it is bounded."""

    def __init__(self, budget: int = HISTORY_TOKENS) -> None:
        self.budget = budget
        self._docs: OrderedDict[int, list[int]] = OrderedDict()
        self._held = 0
        self._next = 0
        self._latest: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {n: {} for n in HISTORY_NGRAMS}

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) < HISTORY_MIN:
            return
        doc, self._next = self._next, self._next + 1
        self._docs[doc] = list(tokens)
        self._held += len(tokens)
        for n in HISTORY_NGRAMS:
            latest = self._latest[n]
            for end in range(n, len(tokens)):
                latest[tuple(tokens[end - n : end])] = (doc, end)
        while self._held > self.budget and len(self._docs) > 1:
            gone, old = self._docs.popitem(last=False)
            self._held -= len(old)
            for n in HISTORY_NGRAMS:  # its entries go too (those a later completion has not taken over)
                latest = self._latest[n]
                for end in range(n, len(old)):
                    key = tuple(old[end - n : end])
                    if latest.get(key, (None, 0))[0] == gone:
                        del latest[key]

    def entries(self) -> int:
        """Index entries held (bounded by the completions kept)."""
        return sum(len(latest) for latest in self._latest.values())

    def follow(self, tail: Sequence[int], k: int) -> tuple[list[int], int]:
        for n in HISTORY_NGRAMS:
            if len(tail) < n:
                continue
            key = tuple(tail[-n:])
            hit = self._latest[n].get(key)
            if hit is None:
                continue
            doc = self._docs[hit[0]]
            return doc[hit[1] : hit[1] + k], matched(doc, hit[1], tail)
        return [], 0


def matched(tokens: Sequence[int], at: int, tail: Sequence[int]) -> int:
    """How many of ``tail``'s last tokens ``tokens`` holds just before position ``at`` (up to ``MATCH_MOST``)."""
    n = 0
    while n < MATCH_MOST and n < at and n < len(tail) and tokens[at - 1 - n] == tail[-1 - n]:
        n += 1
    return n


def kind(source: str, length: int) -> str:
    """A proposal's kind: its source and the longest of ``MATCHED`` its match reaches (0 below them all)."""
    return f"{source}:{max((m for m in MATCHED if length >= m), default=0)}"


@dataclass
class _Counts:
    accepted: float = 0.0
    missed: float = 0.0


class Acceptance:
    """Per kind, the chance ``q`` a drafted token is kept given the ones before it were: accepted / (accepted +
    mismatches), counts decayed so that it follows the traffic, a sequence's own counts weighed against the engine's
    for that kind, the first drafts of a kind starting from ``PRIOR``. A kind is a source and how long its match is
    (``context:8``: a context match of 8 to 15 tokens; ``prediction:0``: a prediction the output has not followed
    yet): a 16-token copy is far likelier to go on than a 2-token coincidence, and learning them apart lets the long
    ones draft from the start."""

    def __init__(self) -> None:
        self._engine: dict[str, _Counts] = {}

    def engine_q(self, kind: str) -> float:
        counts = self._engine.get(kind) or _Counts()
        source, _, length = kind.partition(":")
        priors = PRIOR.get(source, (0.5,) * (len(MATCHED) + 1))
        prior = priors[sum(1 for m in MATCHED if int(length or 0) >= m)]
        return (counts.accepted + PRIOR_WEIGHT * prior) / (counts.accepted + counts.missed + PRIOR_WEIGHT)

    def q(self, kind: str, own: dict[str, _Counts]) -> float:
        """A sequence's estimate for ``kind``: its own counts, with the engine's estimate as a prior."""
        mine = own.get(kind) or _Counts()
        return (mine.accepted + SEQUENCE_WEIGHT * self.engine_q(kind)) / (mine.accepted + mine.missed + SEQUENCE_WEIGHT)

    def record(self, kind: str, own: dict[str, _Counts], accepted: int, missed: bool) -> None:
        """A draft of ``kind`` had ``accepted`` tokens kept, then a mismatch (``missed``) or no verdict (the
        sequence ended, or every drafted token was kept)."""
        counts = self._engine.setdefault(kind, _Counts())
        counts.accepted = counts.accepted * DECAY + accepted
        counts.missed = counts.missed * DECAY + (1.0 if missed else 0.0)
        mine = own.setdefault(kind, _Counts())
        mine.accepted += accepted
        mine.missed += 1.0 if missed else 0.0


@dataclass
class Drafter:
    """One sequence's sources and its acceptance counts."""

    context: NgramIndex
    prediction: PredictionCursor | None = None
    own: dict[str, _Counts] = field(default_factory=dict)
    drafted: int = 0  # tokens verified, over the sequence
    accepted: int = 0
    prediction_accepted: int = 0
    prediction_rejected: int = 0

    @classmethod
    def start(cls, prompt: Sequence[int], prediction: Sequence[int] | None) -> Drafter:
        return cls(NgramIndex(CONTEXT_NGRAMS, prompt), PredictionCursor(prediction) if prediction else None)

    def observe(self, token: int) -> None:
        """The sequence's next token is known (sampled): it is now the context's last."""
        self.context.append(token)
        if self.prediction is not None:
            self.prediction.observe(token, self.context.tokens)

    def proposals(self, history: History | None, k: int) -> list[tuple[str, list[int]]]:
        """Every source's draft of up to ``k`` tokens after the context's last, with its kind."""
        found: list[tuple[str, list[int]]] = []
        if self.prediction is not None:
            draft = self.prediction.propose(k)
            if draft:
                found.append((kind("prediction", self.prediction.run), draft))
        tail = self.context.tokens
        draft, length = self.context.follow(tail, k)
        if draft:
            found.append((kind("context", length), draft))
        if history is not None:
            draft, length = history.follow(tail, k)
            if draft:
                found.append((kind("history", length), draft))
        return found

    def outcome(self, acceptance: Acceptance, kind: str, drafted: int, accepted: int, missed: bool) -> None:
        acceptance.record(kind, self.own, accepted, missed)
        self.drafted += drafted
        self.accepted += accepted
        if kind.startswith("prediction"):
            self.prediction_accepted += accepted
            self.prediction_rejected += drafted - accepted


class CostCurve:
    """Seconds of one ``llama_decode`` micro-batch by its size in tokens, per thread count: probed at load
    (``probe_points``), refined by every step decoded in one micro-batch, and calibrated by every step (measured over
    predicted seconds, with drafts and without), so a draft is priced at what drafting steps have really cost."""

    def __init__(self) -> None:
        self._points: dict[int, dict[int, float]] = {}  # threads -> size -> seconds
        self._plain = 1.0  # steps without drafts: measured over predicted seconds (EMA)
        self._drafting = 1.0  # steps with drafts: the same

    def step(self, threads: int, passes: Sequence[int], seconds: float, drafted: bool) -> None:
        """A step's decode took ``seconds`` in micro-batches of ``passes`` tokens: a single micro-batch refines its
        size's cost; every step calibrates the curve's prediction for its kind (with drafts or without), so what the
        curve does not see (a second pass, longer contexts, rows of several sequences) is priced from what steps
        really took."""
        if seconds <= 0.0 or not passes or not self.measured(threads):
            return
        predicted = sum(self.cost(threads, size) for size in passes)
        ratio = seconds / predicted
        if drafted:
            self._drafting += CALIBRATION_EMA * (ratio - self._drafting)
        else:
            self._plain += CALIBRATION_EMA * (ratio - self._plain)
            self._drafting += CALIBRATION_DRIFT * (self._plain - self._drafting)  # old evidence fades
        if len(passes) == 1:
            self.observe(threads, passes[0], seconds)

    def draft_factor(self) -> float:
        """How much dearer than the curve says a step with drafts has been, relative to one without."""
        return self._drafting / self._plain if self._plain > 0.0 else 1.0

    def measured(self, threads: int) -> bool:
        return threads in self._points

    def set(self, threads: int, points: dict[int, float]) -> None:
        self._points[threads] = dict(sorted(points.items()))

    def observe(self, threads: int, size: int, seconds: float) -> None:
        points = self._points.get(threads)
        if points is None or seconds <= 0.0:
            return
        old = points.get(size)
        points[size] = seconds if old is None else old + CURVE_EMA * (seconds - old)
        if old is None:
            self._points[threads] = dict(sorted(points.items()))

    def cost(self, threads: int, size: int) -> float:
        """Interpolated between measured sizes (linearly beyond the largest)."""
        points = self._points.get(threads)
        if not points:
            return float(size)
        if size in points:
            return points[size]
        sizes = list(points)
        below = max((s for s in sizes if s < size), default=None)
        above = min((s for s in sizes if s > size), default=None)
        if below is None:
            return points[sizes[0]] * size / sizes[0]
        if above is None:
            if len(sizes) < 2:
                return points[below] * size / below
            a, b = sizes[-2], sizes[-1]
            slope = (points[b] - points[a]) / (b - a)
            return points[b] + slope * (size - b)
        share = (size - below) / (above - below)
        return points[below] + share * (points[above] - points[below])

    def table(self, threads: int) -> dict[int, float]:
        return dict(self._points.get(threads, {}))


def ubatches(layout: Sequence[tuple[int, int]], n_ubatch: int, *, per_stream: bool = True) -> list[int]:
    """The micro-batch sizes llama.cpp splits a batch into: ``layout`` is (sequence id, tokens) in the batch's
    order. On a cache with a stream per sequence (its ``split_equal``, sequential), each pass takes a run of
    consecutive sequence ids that still have tokens, in the order they first appear, and the same number of tokens
    from each: as many as the one with fewest has left (at most ``n_ubatch`` in all). A unified cache
    (``per_stream`` false) takes the batch in order, ``n_ubatch`` tokens a pass."""
    if not per_stream:
        total = sum(count for _, count in layout)
        return [min(n_ubatch, total - start) for start in range(0, total, n_ubatch)]
    left = {seq: count for seq, count in layout if count > 0}
    order = [seq for seq, count in layout if count > 0]
    sizes: list[int] = []
    while left:
        run: list[int] = []
        for seq in order:
            if seq in left and (not run or seq == run[-1] + 1):
                run.append(seq)
        take = max(1, min(min(left[seq] for seq in run), n_ubatch // len(run)))
        sizes.append(take * len(run))
        for seq in run:
            left[seq] -= take
            if left[seq] <= 0:
                del left[seq]
    return sizes


class Payoff:
    """Whether drafting has paid here, measured rather than predicted: per batch shape (decode rows, and whether a
    prompt chunk rode along), the tokens per second that steps with drafts and steps without really gave, from the
    step's start to its last pick: decayed sums of tokens over decayed sums of seconds (a throughput, so a 9-token
    step weighs as 9 tokens, not as one rate among others). The plan's estimates can be wrong (acceptance learnt on
    other sequences, a cost the curve does not see); once a shape has :data:`PAYOFF_MIN` steps of each kind and its
    steps with drafts have given fewer tokens per second than those without, it drafts only once in
    :data:`EXPLORE` steps. Judged on fewer, one unlucky first draft (a copy's preamble) would stop a copy from
    drafting."""

    def __init__(self) -> None:
        self._sums: dict[tuple[tuple[int, bool], bool], tuple[float, float, int]] = {}  # tokens, seconds, steps
        self._held: dict[tuple[int, bool], int] = {}

    def rate(self, shape: tuple[int, bool], drafted: bool) -> float | None:
        """Tokens per second of this shape's steps of this kind, None before :data:`PAYOFF_MIN` of them."""
        tokens, seconds, steps = self._sums.get((shape, drafted), (0.0, 0.0, 0))
        return tokens / seconds if steps >= PAYOFF_MIN and seconds > 0.0 else None

    def allows(self, shape: tuple[int, bool]) -> bool:
        plain, drafted = self.rate(shape, False), self.rate(shape, True)
        if plain is None or drafted is None or drafted >= plain:
            return True
        held = self._held[shape] = self._held.get(shape, 0) + 1
        if held < EXPLORE:
            return False
        self._held[shape] = 0
        return True

    def record(self, shape: tuple[int, bool], drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0.0:
            return
        old_tokens, old_seconds, steps = self._sums.get((shape, drafted), (0.0, 0.0, 0))
        self._sums[(shape, drafted)] = (
            old_tokens * PAYOFF_DECAY + tokens,
            old_seconds * PAYOFF_DECAY + seconds,
            steps + 1,
        )


@dataclass(frozen=True)
class Candidate:
    """A sequence that may draft this step: its place in the batch, ``q``, and the tokens its source offers."""

    seq: int  # the llama.cpp sequence id
    q: float
    available: int


def expected(q: float, k: int) -> float:
    """Expected kept tokens of a k-token draft at acceptance ``q`` per token: q + q^2 + ... + q^k."""
    if q >= 1.0:
        return float(k)
    return q * (1.0 - q**k) / (1.0 - q)


def plan(
    layout: Sequence[tuple[int, int]],
    producing: int,
    candidates: Sequence[Candidate],
    cost: Callable[[int], float],
    n_ubatch: int,
    *,
    exact_lengths: bool,
    per_stream: bool = True,
    draft_factor: float = 1.0,
) -> dict[int, int]:
    """How many draft tokens each sequence verifies this step: {sequence id: k}, empty for none.

    ``layout``: the step's batch without drafts, (sequence id, tokens) in batch order; ``producing``: how many of its
    rows make a token (decode rows; a prompt chunk's rows make none); ``cost``: a micro-batch's seconds by size;
    ``per_stream``: how the cache splits batches (``ubatches``); ``draft_factor``: what steps with drafts have
    really cost over the curve's prediction, relative to plain steps (``CostCurve.draft_factor``).
    Every drafting sequence drafts the same k, or (unless ``exact_lengths``) all its source has if fewer; with
    ``exact_lengths`` a sequence whose draft is shorter than k does not draft (a sliding-window cache: see
    ``batch``).

    The choice maximises the step's expected tokens per second: a sequence that drafts k tokens at acceptance q
    expects q + q^2 + ... + q^k more, and the step costs the curve summed over the micro-batches llama.cpp will split
    it into (``ubatches``: one drafting sequence beside seven plain ones costs a second pass). Drafting must beat not
    drafting by ``MARGIN``."""
    worth = sorted((c for c in candidates if c.q >= Q_FLOOR and c.available >= 2), key=lambda c: -c.q)
    if not worth or producing == 0:
        return {}

    def seconds(drafts: dict[int, int]) -> float:
        sized = [(seq, count + drafts.get(seq, 0)) for seq, count in layout]
        raw = sum(cost(size) for size in ubatches(sized, n_ubatch, per_stream=per_stream))
        return raw * draft_factor if drafts else raw

    best_value = producing / seconds({}) * MARGIN
    best: dict[int, int] = {}
    for k in K_CHOICES:
        chosen: dict[int, int] = {}
        gain = 0.0
        for candidate in worth:
            if candidate.available < k and (exact_lengths or candidate.available < 2):
                continue
            take = min(k, candidate.available)
            chosen[candidate.seq] = take
            gain += expected(candidate.q, take)
            value = (producing + gain) / seconds(chosen)
            if value > best_value:
                best_value, best = value, dict(chosen)
        if all(c.available < k for c in worth):
            break
    return best
