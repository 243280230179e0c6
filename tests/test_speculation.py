"""Draftless speculation (``engines/llamacpp/speculation``, verified in its ``batch``): drafts are decoded with the
row before them and kept only while the sequence's own picks repeat them, so nothing a request gets may change.

The planner's arithmetic is checked on its own (pure functions: what llama.cpp's batch split does, when a draft
pays on a cost curve like this machine's). The promise is checked on real runners: with the batch-invariant build,
requests built to draft a lot (copying a passage, a code edit with its ``prediction``, JSON that repeats the prompt,
a stop string and ``max_tokens`` met inside a draft, logprobs, a seeded draw at temperature 0.8), served together
with speculation on, give token for token and logprob for logprob what each gives alone with it off; and the drafts
were really kept (the test counts them, so it cannot pass by never drafting). The default model suffices for that:
drafting and rolling back are the same for both families wherever every position is kept (a deterministic engine
keeps them all, ``swa_full``). What is Gemma's own, drafts rolled back on a sliding window's ring, has its own test.
"""

from __future__ import annotations

import difflib
import inspect
import json
import textwrap
from typing import Any

import anyio
import pytest

from conftest import gemma_missing, gemma_path, model_missing
from tether.engines.llamacpp import invariant
from tether.engines.llamacpp.speculation import (
    EXPLORE,
    Acceptance,
    Candidate,
    CostCurve,
    Drafter,
    History,
    NgramIndex,
    Payoff,
    PredictionCursor,
    expected,
    plan,
    ubatches,
)
from tether.node.supervisor import Supervisor
from tether.node.tasks import TaskHandle
from tether.protocol import ChatMessage, Chunk, EngineSpec, GenerateParams, TaskState

NOT_BUILT = None if invariant.built() else f"the batch-invariant build is missing: {invariant.BUILD_HINT}"
# milliseconds of one micro-batch by size, as measured on this project's 2-core machine (SmolLM2-135M, 2 threads)
CPU_CURVE = {1: 6.5, 2: 12.4, 3: 15.0, 4: 17.8, 6: 24.7, 8: 30.4, 12: 41.7, 16: 52.6, 24: 76.0, 32: 98.2, 64: 176.0}


def cpu_cost(size: int) -> float:
    curve = CostCurve()
    curve.set(2, CPU_CURVE)
    return curve.cost(2, size)


# --------------------------------------------------------------------------------------------------------------
# The arithmetic
# --------------------------------------------------------------------------------------------------------------


def test_the_split_model_is_llama_cpps_sequential_equal_split() -> None:
    # one sequence: all its tokens in one pass
    assert ubatches([(0, 9)], 512) == [9]
    # equal counts over consecutive ids: one pass
    assert ubatches([(0, 5), (1, 5), (2, 5)], 512) == [15]
    # a drafting sequence beside plain ones: a pass of one token each, then its draft
    assert ubatches([(0, 5), (1, 1), (2, 1)], 512) == [3, 4]
    # a gap in the ids: a run stops at it
    assert ubatches([(0, 1), (2, 1)], 512) == [1, 1]
    # the prompt chunk after the decode rows, its slot's id first among them
    assert ubatches([(1, 1), (2, 1), (0, 32)], 512) == [2, 32]
    # n_ubatch caps a pass: the same share from each sequence of the run
    assert ubatches([(0, 300), (1, 300)], 512) == [512, 88]
    # a unified cache takes the batch in order
    assert ubatches([(0, 300), (1, 300)], 512, per_stream=False) == [512, 88]


def test_a_draft_pays_only_when_long_and_likely_on_a_cpus_cost_curve() -> None:
    one = [(0, 1)]
    assert plan(one, 1, [Candidate(0, 0.6, 32)], cpu_cost, 512, exact_lengths=False) == {}
    chosen = plan(one, 1, [Candidate(0, 0.97, 32)], cpu_cost, 512, exact_lengths=False)
    assert chosen and chosen[0] >= 8
    gain = (1 + expected(0.97, chosen[0])) / cpu_cost(1 + chosen[0]) * cpu_cost(1)
    assert gain > 1.3  # the chosen k's expected speed-up over not drafting
    # a short draft at 0.7 costs more than it brings here (two rows cost about two steps), a long one at 0.7 too
    assert plan(one, 1, [Candidate(0, 0.7, 2)], cpu_cost, 512, exact_lengths=False) == {}
    assert plan(one, 1, [Candidate(0, 0.7, 32)], cpu_cost, 512, exact_lengths=False) == {}
    # a full batch: verification rows displace nothing cheaper, so only a near-certain draft is taken
    full = [(i, 1) for i in range(8)]
    assert plan(full, 8, [Candidate(i, 0.8, 32) for i in range(8)], cpu_cost, 512, exact_lengths=False) == {}
    # where a few rows are nearly free (a GPU's curve), the same 0.6 draft pays
    flat = {1: 10.0, 2: 10.2, 4: 10.5, 8: 11.0, 16: 12.0, 32: 15.0, 64: 22.0}
    curve = CostCurve()
    curve.set(1, flat)
    assert plan(one, 1, [Candidate(0, 0.6, 32)], lambda s: curve.cost(1, s), 512, exact_lengths=False)


def test_a_windowed_cache_drafts_one_length_for_all() -> None:
    layout = [(0, 1), (1, 1)]
    candidates = [Candidate(0, 0.99, 32), Candidate(1, 0.99, 5)]
    free = plan(layout, 2, candidates, cpu_cost, 512, exact_lengths=False)
    assert set(free) == {0, 1} and free[1] <= 5
    windowed = plan(layout, 2, candidates, cpu_cost, 512, exact_lengths=True)
    assert len(set(windowed.values())) == 1  # one k for every drafting sequence
    assert all(candidates[seq].available >= k for seq, k in windowed.items())


def test_the_cost_curve_interpolates_and_follows_new_timings() -> None:
    curve = CostCurve()
    assert not curve.measured(2)
    curve.set(2, {1: 1.0, 4: 4.0, 8: 6.0})
    assert curve.cost(2, 2) == pytest.approx(2.0)
    assert curve.cost(2, 16) == pytest.approx(10.0)  # beyond the largest: the last slope
    for _ in range(100):
        curve.observe(2, 4, 2.0)
    assert curve.cost(2, 4) == pytest.approx(2.0, rel=0.01)
    curve.observe(2, 5, 3.0)  # a size never timed becomes a point
    assert curve.cost(2, 5) == 3.0


def test_drafting_steps_that_cost_more_than_predicted_are_priced_at_what_they_cost() -> None:
    curve = CostCurve()
    curve.set(2, CPU_CURVE)
    one = [(0, 1)]
    offer = [Candidate(0, 0.95, 32)]
    assert plan(one, 1, offer, lambda s: curve.cost(2, s), 512, exact_lengths=False)
    for _ in range(200):  # plain steps as predicted; steps with drafts twice what the curve said (a second pass...)
        curve.step(2, [8], CPU_CURVE[8], drafted=False)
        curve.step(2, [8, 16], (CPU_CURVE[8] + CPU_CURVE[16]) * 2, drafted=True)
    assert curve.draft_factor() == pytest.approx(2.0, rel=0.05)
    cost = lambda s: curve.cost(2, s)  # noqa: E731
    assert plan(one, 1, offer, cost, 512, exact_lengths=False, draft_factor=curve.draft_factor()) == {}
    for _ in range(3000):  # no drafts for a long while: the old evidence fades
        curve.step(2, [8], CPU_CURVE[8], drafted=False)
    assert curve.draft_factor() < 1.1


def test_a_batch_shape_where_drafting_has_not_paid_drafts_only_to_look_again() -> None:
    payoff = Payoff()
    shape = (8, False)
    assert payoff.allows(shape)  # nothing measured yet
    for _ in range(30):
        payoff.record(shape, False, 8, 0.030)  # plain steps: 267 tokens/s
        payoff.record(shape, True, 16, 0.076)  # steps with drafts: 211 tokens/s
    allowed = sum(payoff.allows(shape) for _ in range(100))
    assert allowed == 100 // EXPLORE
    assert payoff.allows((1, False))  # another shape is judged on its own
    for _ in range(60):
        payoff.record(shape, True, 30, 0.076)  # drafts start paying (a copy): 395 tokens/s
    assert payoff.allows(shape)


def test_context_lookup_finds_the_longest_earlier_match_and_its_length() -> None:
    index = NgramIndex((4, 3, 2), [1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4])
    draft, length = index.follow(index.tokens, 3)
    assert draft == [5, 6, 7] and length == 3  # "2 3 4" was followed by 5 6 7; "9 2 3 4" never occurred before
    assert index.follow([8, 8], 3) == ([], 0)


def test_a_prediction_finds_its_place_again_after_an_edit() -> None:
    original = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    prediction = PredictionCursor(original)
    output: list[int] = []

    def write(token: int) -> None:
        output.append(token)
        prediction.observe(token, output)

    assert prediction.propose(4) == [10, 11, 12, 13]
    for token in (10, 11, 12):
        write(token)
    assert prediction.propose(3) == [13, 14, 15] and prediction.run == 3
    write(99)  # the edit: 13 renamed 99
    assert prediction.propose(3) == []  # lost
    write(14)  # the output goes on as the original did: the place is found again right after the edit
    assert prediction.propose(3) == [15, 16, 17]


def test_acceptance_is_learnt_per_kind_and_a_long_match_starts_hopeful() -> None:
    acceptance = Acceptance()
    own: dict[str, Any] = {}
    assert acceptance.q("context:16", own) > 0.85 > 0.5 > acceptance.q("context:0", own)
    for _ in range(20):
        acceptance.record("context:16", own, 0, True)  # drafted, first token rejected, twenty times
    assert acceptance.q("context:16", own) < 0.2
    assert acceptance.q("context:16", {}) < 0.5  # the engine's estimate moved too, for other sequences


def test_earlier_completions_are_drafted_from_and_the_oldest_forgotten() -> None:
    history = History(budget=40)
    history.add(list(range(100, 130)))
    drafter = Drafter.start([1, 2, 100, 101, 102, 103], None)
    found = dict(drafter.proposals(history, 4))
    assert found["history:4"] == [104, 105, 106, 107]
    history.add(list(range(200, 230)))  # over the budget: the first completion goes, and its index entries
    assert history.follow([100, 101, 102, 103], 4) == ([], 0)
    assert history.entries() == 2 * 30 - 4 - 3  # the second completion's 4-grams and 3-grams, nothing else


# --------------------------------------------------------------------------------------------------------------
# The promise, on real runners
# --------------------------------------------------------------------------------------------------------------

PASSAGE = (
    "The lighthouse stood on a rock at the mouth of the harbour. Every evening the keeper climbed the hundred and "
    "twelve steps, trimmed the wick, wound the clockwork that turned the lens, and wrote the time in the log. Ships "
    "that passed at night saw the beam sweep the water once every ten seconds, and knew where the rocks were."
)
CODE = textwrap.dedent(inspect.getsource(textwrap.indent))
RECORD = {"keeper": "Ada", "steps": 112, "period_s": 10, "log": ["wick", "clock", "time"]}
SCHEMA = {
    "type": "object",
    "properties": {
        "keeper": {"type": "string"},
        "steps": {"type": "integer"},
        "period_s": {"type": "integer"},
        "log": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["keeper", "steps", "period_s", "log"],
}


def workload() -> list[GenerateParams]:
    """Requests that draft: each copies something it was given (a passage, code, a JSON record)."""

    def ask(text: str, **more: object) -> GenerateParams:
        return GenerateParams(messages=(ChatMessage("user", text),), **more)  # type: ignore[arg-type]

    quote = "Repeat this passage word for word:\n\n" + PASSAGE
    edit = f"Rename the function indent to add_prefix and return the whole code:\n\n```python\n{CODE}```"
    record = "Return this JSON record exactly: " + json.dumps(RECORD)
    # each as long as its case needs: drafts start after a few tokens of a copy (the passage's "clockwork" is ~35
    # tokens in), so a short answer still shows kept and rejected drafts
    return [
        ask(quote, max_tokens=44),
        ask(quote, max_tokens=44, logprobs=2),
        ask(quote, max_tokens=44, temperature=0.8, seed=7),
        ask(quote, max_tokens=29),  # ends inside a draft
        ask(quote, max_tokens=56, stop=("clockwork",)),  # a stop string inside a draft
        ask(edit, max_tokens=72, prediction=CODE),
        ask(edit, max_tokens=72),
        ask(record, max_tokens=64, json_schema=json.dumps(SCHEMA)),
    ]


ALONE_AGAIN = (1, 3, 5)  # logprobs, ending inside a draft, the edit with a prediction


async def run(handle: TaskHandle) -> tuple[str, tuple[float, ...], Chunk]:
    chunks = [event async for event in handle if isinstance(event, Chunk) and not event.is_progress]
    assert handle.final is not None and handle.final.state is TaskState.COMPLETE, handle.final
    return "".join(c.text for c in chunks), tuple(lp.logprob for c in chunks for lp in c.logprobs), chunks[-1]


@pytest.mark.cores
@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(480)  # ~10 s alone, ~17 s beside two busy loops
@pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")
async def test_speculation_changes_no_token_and_no_logprob_and_really_drafts() -> None:
    missing = model_missing()
    if missing is not None:
        pytest.skip(missing)
    requests = workload()
    # one thread, fixed: beside make test's other workers two fixed threads waited at llama.cpp's barriers for a core
    # (~60 s, where one thread takes ~17 s), and four sequences drafting on one thread still take a third of their
    # tokens from drafts (164 of 520 alone here, 271 beside two busy loops)
    common = {"deterministic": True, "n_ctx": 1024, "n_threads": 1, "adaptive_threads": False}
    plain = EngineSpec(engine="llama.cpp", options={**common, "parallel": 1})
    drafting = EngineSpec(engine="llama.cpp", options={**common, "parallel": 4, "speculation": True})
    with anyio.fail_after(460):
        async with Supervisor(plain) as sup:
            await sup.ready()
            alone = [await run(await sup.generate(params)) for params in requests]
        async with Supervisor(drafting) as sup:
            await sup.ready()
            together: dict[int, tuple[str, tuple[float, ...], Chunk]] = {}

            async def one(i: int) -> None:
                await anyio.sleep(0.05 * i)  # arrivals while others decode, some prefilling beside drafting rows
                together[i] = await run(await sup.generate(requests[i]))

            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
            # and the copies once more alone on the drafting runner: a sequence drafting with the batch to itself
            again = {i: await run(await sup.generate(requests[i])) for i in ALONE_AGAIN}
    for i, (text, logprobs, final) in enumerate(alone):
        runs = [("together", together[i])] + ([("alone", again[i])] if i in again else [])
        for label, (spec_text, spec_logprobs, spec_final) in runs:
            assert spec_text == text, f"request {i} ({label}) differs with speculation on"
            assert spec_logprobs == logprobs, f"request {i} ({label}): logprobs not bit-identical"
            assert spec_final.completion_tokens == final.completion_tokens
            assert spec_final.finish_reason == final.finish_reason
            assert spec_final.draft_accepted <= spec_final.draft_tokens
    assert alone[4][2].finish_reason == "stop" and "clockwork" not in alone[4][0]
    json.loads(alone[7][0])
    finals = [final for _, _, final in (*together.values(), *again.values())]
    accepted = sum(final.draft_accepted for final in finals)
    steps = sum(final.decode_steps for final in finals)
    tokens = sum(final.completion_tokens for final in finals)
    assert accepted >= tokens // 5, f"only {accepted} of {tokens} tokens came from drafts: speculation barely ran"
    assert steps < tokens, "no step wrote more than one token of a sequence"
    # the edit with a prediction: drafts from it or from the prompt's copy of the file (whichever source the
    # sequence trusts more), kept ones counted; a prediction's own are counted apart and never exceed them
    assert all(final.prediction_accepted <= final.draft_accepted for final in finals)
    assert all(final.draft_tokens == 0 for _, _, final in alone)


COPIED = 0.82  # of a copy, at least this share is the source's text (see below; a lost cell: ~0.3)


@pytest.mark.cores
@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(400)  # ~9 s alone, ~13 s beside two busy loops
async def test_drafts_past_gemmas_window_keep_the_copy_whole_on_a_windowed_cache() -> None:
    """Gemma 3's sliding-window layers keep only their window (``swa_full`` off, the default build): drafts past the
    512-token window, two sequences drafting at once, are rolled back without losing a cell the next step attends
    to. A lost cell would show as a copy that goes wrong. The default build's texts may part from the plain ones
    (rows verified together are another batch shape), so each answer is held to how much of it is the source's
    text in runs of 20+ characters: most of it (without drafts the model skips a line or repeats a comment: 90% and
    96% here, with drafts the same), over hundreds of characters past the window, a good share of its tokens from
    drafts."""
    missing = gemma_missing()
    if missing is not None:
        pytest.skip(missing)
    source = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._wrap_chunks))
    starts = [source.index("\n", at) + 1 for at in (40, 400)]  # the copies begin at a line's start
    prompts = [f"Code:\n{source}\nThe same code, copied exactly:\n{source[:start]}" for start in starts]

    def copied(text: str) -> float:
        blocks = difflib.SequenceMatcher(None, source, text, autojunk=False).get_matching_blocks()
        return sum(block.size for block in blocks if block.size >= 20) / max(len(text), 1)

    answers: dict[int, tuple[str, tuple[float, ...], Chunk]] = {}
    options = {"n_ctx": 2048, "parallel": 2, "n_threads": 1, "adaptive_threads": False, "speculation": True}
    with anyio.fail_after(380):
        async with Supervisor(EngineSpec(engine="llama.cpp", model=str(gemma_path()), options=options)) as sup:
            await sup.ready()

            async def one(i: int) -> None:
                answers[i] = await run(await sup.generate(GenerateParams(prompt=prompts[i], max_tokens=192)))

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
    for i in range(len(prompts)):
        text, _, final = answers[i]
        assert len(text) >= 400 and copied(text) >= COPIED, f"copy {i} strays from the source: {text!r}"
        assert final.prompt_tokens + final.completion_tokens > 512 + 100  # well past the window
        assert final.draft_accepted > final.completion_tokens // 4, final
