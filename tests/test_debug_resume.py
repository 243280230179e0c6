"""The debug engine's resume and poison: what the worker's resume is rehearsed against.

A generation resumed from the ids it had sent must send exactly what the uninterrupted one sent after them (the
stop strings' held-back text included); a resume that does not match is refused; the ``poison`` option fires a real
fault for every request whose prompt holds its marker, again on every runner it is resumed on. The replay is pure,
so engines run in-process; the poison's real SIGSEGV needs real runners.
"""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import msgspec
import pytest

from tether.engines.base import Delta, EngineLoadError, RequestError
from tether.engines.debug import VOCAB, DebugEngine
from tether.engines.registry import spec_problem
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.node.tasks import TaskHandle
from tether.protocol import (
    CauseKind,
    ChatMessage,
    Chunk,
    EmbedParams,
    EngineSpec,
    Failed,
    GenerateParams,
    Resume,
    TaskState,
    TaskStatus,
)

POISON = {"marker": "NIGHTSHADE", "fault": "request_error", "after_tokens": 2}


def debug_engine(**options: object) -> DebugEngine:
    engine = DebugEngine(EngineSpec(engine="debug", options={"load_step_seconds": 0, **options}))
    engine.load(lambda fraction, detail: None)
    return engine


def run_all(engine: DebugEngine, params: GenerateParams | EmbedParams) -> list[Delta]:
    return list(engine.generate(params, lambda: False))


def sent_ids(deltas: list[Delta]) -> tuple[int, ...]:
    return tuple(itertools.chain.from_iterable(d.ids for d in deltas))


def resumed(params: GenerateParams, deltas: list[Delta]) -> GenerateParams:
    """``params`` resumed after ``deltas``, as the worker builds it from the chunks it received."""
    return msgspec.structs.replace(params, resume=Resume(ids=sent_ids(deltas)))


def pieces(params: GenerateParams, n: int) -> list[str]:
    """The text pieces of the first ``n`` tokens of ``params``, stop strings aside (from their logprobs)."""
    plain = msgspec.structs.replace(params, stop=(), max_tokens=n, logprobs=0, echo=False, resume=None)
    return [entry.token for d in run_all(debug_engine(), plain) for entry in d.logprobs]


# --------------------------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------------------------


def test_an_unknown_option_is_refused_naming_it_and_the_valid_ones() -> None:
    with pytest.raises(EngineLoadError) as refused:
        DebugEngine(EngineSpec(engine="debug", options={"bogus_option": 1, "token_seconds": 0.1, "another": 2}))
    message = str(refused.value)
    assert message.startswith("unknown debug engine option(s) another, bogus_option: valid options are "), message
    assert all(name in message for name in DebugEngine.options), message
    assert "token_seconds," not in message.split(":")[0], message  # the known one is not blamed
    problem = spec_problem(EngineSpec(engine="debug", options={"bogus_option": 1}))  # how an instance is refused
    assert problem is not None and "bogus_option" in str(problem), problem


def test_every_declared_option_at_its_default_is_accepted() -> None:
    engine = DebugEngine(EngineSpec(engine="debug", options=dict(DebugEngine.options)))
    assert DebugEngine.options["poison"] is None and engine.poison is None
    assert DebugEngine.resumes is True


@pytest.mark.parametrize(
    ("poison", "message"),
    [
        ("NIGHTSHADE", "poison: must be an object like"),
        ({"marker": "x", "fault": "segv"}, "poison: missing after_tokens"),
        ({"fault": "segv"}, "missing marker, after_tokens"),
        ({**POISON, "rank": 1}, "unknown key(s) rank: it takes exactly marker, fault and after_tokens"),
        ({**POISON, "marker": ""}, "marker must be a non-empty string"),
        ({**POISON, "marker": 3}, "marker must be a non-empty string (text a prompt holds), got 3"),
        ({**POISON, "fault": "explode"}, "fault must be one of raise, request_error, exit, segv"),
        (
            {**POISON, "after_tokens": -1},
            "after_tokens must be an integer >= 0 (the tokens produced before it fires), got -1",
        ),
        ({**POISON, "after_tokens": "2"}, "after_tokens must be an integer >= 0"),
        ({**POISON, "after_tokens": True}, "after_tokens must be an integer >= 0"),
    ],
)
def test_a_bad_poison_option_is_refused_saying_what_is_wrong(poison: object, message: str) -> None:
    with pytest.raises(EngineLoadError, match="invalid debug engine option poison") as refused:
        DebugEngine(EngineSpec(engine="debug", options={"poison": poison}))
    assert message in str(refused.value), str(refused.value)


# --------------------------------------------------------------------------------------------------------------
# Ids and resume
# --------------------------------------------------------------------------------------------------------------


def test_each_token_delta_carries_its_words_id_and_nothing_else_does() -> None:
    engine = debug_engine()
    deltas = run_all(engine, GenerateParams(prompt="ids please", max_tokens=40, logprobs=0))
    assert all(d.tokens == 1 and len(d.ids) == 1 and d.draws == 0 for d in deltas)
    for d in deltas:  # the id is the word's first index: "a" is in VOCAB twice
        assert VOCAB[d.ids[0]] == d.logprobs[0].token.strip() and VOCAB.index(VOCAB[d.ids[0]]) == d.ids[0]
    (echo_only,) = run_all(engine, GenerateParams(prompt="just me", max_tokens=0, echo=True))
    (embedded,) = run_all(engine, EmbedParams(prompt="a vector"))
    assert echo_only.ids == () and embedded.ids == ()


CASES = {
    "plain": GenerateParams(prompt="the story of a resumed stream", max_tokens=12),
    "seeded": GenerateParams(prompt="the story of a resumed stream", max_tokens=9, seed=7),
    "echo": GenerateParams(prompt="echo me back", max_tokens=6, echo=True),
    "echo-logprobs": GenerateParams(prompt="echo me back please", max_tokens=5, echo=True, logprobs=2),
    "chat": GenerateParams(messages=(ChatMessage("user", "hello"),), max_tokens=7),
    "n_ctx": GenerateParams(prompt="one two three four five six", max_tokens=50),  # n_ctx 12: 6 tokens left
    "stop-unmet": GenerateParams(prompt="the story of a resumed stream", max_tokens=8, stop=("zzz", "q")),
}


@pytest.mark.parametrize("name", CASES)
def test_a_resumed_generation_sends_exactly_what_the_uninterrupted_one_sent_after_the_split(name: str) -> None:
    engine = debug_engine(n_ctx=12)
    params = CASES[name]
    whole = run_all(engine, params)
    assert whole[-1].finish_reason == "length" and len(whole) >= 5, whole
    for split in range(len(whole)):  # 0 included: a death before the first token
        rest = run_all(engine, resumed(params, whole[:split]))
        assert rest == whole[split:], (split, rest, whole[split:])
        assert rest[-1].completion_tokens == len(whole) == rest[-1].decode_steps  # the resumed tokens counted
    assert engine.active() == 0


@pytest.mark.parametrize("span", [2, 3])  # a stop string over two tokens, and over three
def test_a_stop_string_straddling_the_resume_point_still_stops_it(span: int) -> None:
    base = GenerateParams(prompt="stop me somewhere in the middle", max_tokens=30)
    words = pieces(base, 12)
    full = "".join(words)
    starts = list(itertools.accumulate(len(p) for p in words))  # where each piece ends in ``full``
    first = 4  # the stop string begins in the last two characters of piece 4 and ends in piece 4 + span - 1
    begin = starts[first] - 2
    end = starts[first + span - 2] + 2
    stop = full[begin:end]
    assert full.find(stop) == begin, (stop, full)  # no earlier occurrence: it ends the generation here
    params = msgspec.structs.replace(base, stop=(stop,))
    engine = debug_engine()
    whole = run_all(engine, params)
    assert whole[-1].finish_reason == "stop" and len(whole) == first + span, whole
    assert "".join(d.text for d in whole) == full[:begin]
    assert "".join(d.text for d in whole[: first + 1]) == full[:begin]  # the start of the stop string was held back
    for split in range(len(whole)):
        assert run_all(engine, resumed(params, whole[:split])) == whole[split:], split


def test_a_resume_whose_ids_differ_is_refused_with_the_numbers() -> None:
    engine = debug_engine()
    params = GenerateParams(prompt="who said that", max_tokens=10)
    ids = list(sent_ids(run_all(engine, params)[:4]))
    wrong = next(i for i in range(len(VOCAB)) if i != ids[2] and VOCAB.index(VOCAB[i]) == i)
    ids[2] = wrong
    with pytest.raises(RequestError) as refused:
        run_all(engine, msgspec.structs.replace(params, resume=Resume(ids=tuple(ids))))
    mine = sent_ids(run_all(engine, params))[2]
    expected = f"cannot resume: token 2 is {mine} ({VOCAB[mine]!r}) on this runner but {wrong} was sent"
    assert str(refused.value).startswith(expected), str(refused.value)
    assert engine.active() == 0  # nothing was started
    other = msgspec.structs.replace(params, prompt="who said this", resume=Resume(ids=tuple(ids[:2])))
    with pytest.raises(RequestError, match=r"cannot resume: token [01] is"):  # another prompt's words
        run_all(engine, other)


def test_a_finished_generation_is_not_resumed() -> None:
    engine = debug_engine()
    params = GenerateParams(prompt="all of it", max_tokens=5)
    whole = run_all(engine, params)
    with pytest.raises(RequestError, match=r"5 tokens were sent and this generation ends at 5 .* is not resumed"):
        run_all(engine, resumed(params, whole))
    words = pieces(params, 5)
    stopped = msgspec.structs.replace(params, stop=(words[1] + words[2],))  # the second and third words stop it
    ended = run_all(engine, stopped)
    assert ended[-1].finish_reason == "stop" and len(ended) <= 3, ended
    with pytest.raises(RequestError, match=f"token {len(ended) - 1} of the 4 sent .* completes a stop string"):
        run_all(engine, resumed(stopped, whole[:4]))


# --------------------------------------------------------------------------------------------------------------
# Poison, in-process (request_error: the one fault a test process survives)
# --------------------------------------------------------------------------------------------------------------


def test_a_poison_request_fails_after_its_tokens_and_at_once_when_resumed_past_them() -> None:
    engine = debug_engine(poison=POISON, parallel=2)
    poisoned = GenerateParams(prompt="a cup of NIGHTSHADE tea", max_tokens=10)
    got: list[Delta] = []
    with pytest.raises(RequestError, match="injected fault 'request_error' after 2 tokens"):
        for delta in engine.generate(poisoned, lambda: False):
            got.append(delta)
    assert len(got) == 2  # exactly after_tokens tokens, then the fault
    ids = sent_ids(run_all(debug_engine(), poisoned))  # the same words, from an engine without the option
    assert ids[:2] == sent_ids(got)
    for done in (2, 3):  # resumed with after_tokens or more: fires before any token
        stream = engine.generate(msgspec.structs.replace(poisoned, resume=Resume(ids=ids[:done])), lambda: False)
        with pytest.raises(RequestError, match=f"injected fault 'request_error' after {done} tokens"):
            next(stream)
    early = msgspec.structs.replace(poisoned, resume=Resume(ids=sent_ids(got)[:1]))
    late: list[Delta] = []
    with pytest.raises(RequestError):
        late.extend(engine.generate(early, lambda: False))
    assert late == got[1:]  # resumed before it: the one missing token, then the fault
    chat = GenerateParams(messages=(ChatMessage("user", "NIGHTSHADE"),), max_tokens=5)  # a chat's text counts
    with pytest.raises(RequestError):
        run_all(engine, chat)
    short = msgspec.structs.replace(poisoned, max_tokens=2)
    assert len(run_all(engine, short)) == 2  # done before a third step: nothing fires
    with pytest.raises(RequestError):
        run_all(engine, EmbedParams(prompt="embed NIGHTSHADE"))  # an embedding: at its one step
    clean = run_all(engine, GenerateParams(prompt="a cup of tea", max_tokens=10))
    assert clean[-1].finish_reason == "length" and len(clean) == 10
    assert engine.active() == 0
    warm = debug_engine(poison={"marker": "warmup", "fault": "request_error", "after_tokens": 0})
    warm.warmup()  # poison is for requests: the engine's own warm-up generation ("warmup") is not one
    with pytest.raises(RequestError):
        run_all(warm, GenerateParams(prompt="warmup", max_tokens=1))


# --------------------------------------------------------------------------------------------------------------
# Poison for real: a SIGSEGV on every runner it reaches
# --------------------------------------------------------------------------------------------------------------


async def _events(handle: TaskHandle) -> tuple[list[Chunk], TaskStatus]:
    chunks = [event async for event in handle if isinstance(event, Chunk)]
    assert handle.final is not None
    return chunks, handle.final


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.usefixtures("no_leftover_runners")
async def test_a_poison_request_segfaults_each_runner_it_is_resumed_on_while_a_clean_one_completes() -> None:
    poison: dict[str, Any] = {"marker": "NIGHTSHADE", "fault": "segv", "after_tokens": 2}
    spec = EngineSpec(engine="debug", options={"load_step_seconds": 0, "token_seconds": 0.005, "poison": poison})
    settings = SupervisorSettings(stop_timeout=2)
    poisoned = GenerateParams(prompt="a cup of NIGHTSHADE tea", max_tokens=20)
    with anyio.fail_after(25):
        async with Supervisor(spec, settings) as first, Supervisor(spec, settings) as second:
            async with anyio.create_task_group() as tg:
                tg.start_soon(first.ready)
                tg.start_soon(second.ready)
            chunks, final = await _events(await first.generate(poisoned))
            await first.wait_status(lambda s: isinstance(s, Failed), 10)
            clean_chunks, clean = await _events(
                await second.generate(GenerateParams(prompt="a cup of tea", max_tokens=16))
            )
            again, final_again = await _events(
                await second.generate(msgspec.structs.replace(poisoned, resume=Resume(ids=sent_ids(chunks))))
            )
            await second.wait_status(lambda s: isinstance(s, Failed), 10)
    assert [c.tokens for c in chunks] == [1, 1] and all(len(c.ids) == 1 for c in chunks), chunks
    assert clean.state is TaskState.COMPLETE and clean_chunks[-1].finish_reason == "length", clean
    assert sum(c.tokens for c in clean_chunks) == 16 and len(sent_ids(clean_chunks)) == 16
    assert again == []  # the resumed poison request fired before a token
    for sup, task in ((first, final), (second, final_again)):
        cause = sup.cause
        assert cause is not None and cause.kind is CauseKind.NATIVE_CRASH and cause.signal == "SIGSEGV", cause
        assert cause.phase == "generating", cause.render()
        assert task.state is TaskState.FAILED and task.cause == cause, task


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.usefixtures("no_leftover_runners")
async def test_a_resumed_request_goes_ahead_of_the_requests_waiting_in_its_new_runners_queue() -> None:
    """One batch slot, one request in it and two waiting: two resumes that arrive last start next, in their order."""
    spec = EngineSpec(engine="debug", options={"load_step_seconds": 0, "token_seconds": 0.01, "parallel": 1})
    started: list[str] = []
    with anyio.fail_after(25):
        async with Supervisor(spec, SupervisorSettings(stop_timeout=2)) as sup:
            await sup.ready()
            first = await sup.generate(GenerateParams(prompt="plain 0", max_tokens=5))
            async for event in first:  # in the slot before the others come
                if isinstance(event, TaskStatus) and event.state is TaskState.RUNNING:
                    started.append("p0")
                    break
            plain = [first] + [await sup.generate(GenerateParams(prompt=f"plain {i}", max_tokens=5)) for i in (1, 2)]
            resumed = [
                await sup.generate(GenerateParams(prompt=f"resumed {i}", max_tokens=5, resume=Resume(ids=())))
                for i in range(2)
            ]
            names = {
                h.task_id: name for h, name in zip([*plain, *resumed], ["p0", "p1", "p2", "r0", "r1"], strict=True)
            }

            async def watch(handle: TaskHandle) -> None:
                async for event in handle:
                    if isinstance(event, TaskStatus) and event.state is TaskState.RUNNING:
                        started.append(names[handle.task_id])

            async with anyio.create_task_group() as tg:
                for handle in [*plain, *resumed]:
                    tg.start_soon(watch, handle)
    assert started == ["p0", "r0", "r1", "p1", "p2"], started
