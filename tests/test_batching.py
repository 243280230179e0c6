"""Many users at once: one runner serves up to ``parallel`` generations in one batch, and every promise holds per
sequence. Real runners throughout; the debug engine rehearses each failure for real, and the real default model,
deterministic, shows that batching changes no greedy text (``test_deterministic`` attacks that promise harder)."""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest

from conftest import debug, model_missing
from tether.engines.llamacpp import invariant
from tether.engines.text import TextStream
from tether.node.hangs import Deadlines, stack_dump
from tether.node.supervisor import Supervisor
from tether.node.tasks import TaskHandle
from tether.protocol import (
    CauseKind,
    ChatMessage,
    Chunk,
    EngineSpec,
    Fault,
    GenerateParams,
    Running,
    TaskState,
    TaskStatus,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90), pytest.mark.usefixtures("no_leftover_runners")]

TOPICS = ("lighthouses", "robots", "forests", "dragons", "boats", "cats", "clocks", "fields")


def ask(i: int, max_tokens: int = 40, *faults: Fault) -> GenerateParams:
    return GenerateParams(prompt=f"tell me about {TOPICS[i % len(TOPICS)]} {i}", max_tokens=max_tokens, faults=faults)


async def collect(handle: TaskHandle) -> tuple[str, TaskStatus, list[Chunk]]:
    chunks = [event async for event in handle if isinstance(event, Chunk)]
    assert handle.final is not None
    return "".join(c.text for c in chunks), handle.final, chunks


async def first_chunk(handle: TaskHandle) -> Chunk:
    async for event in handle:
        if isinstance(event, Chunk):
            return event
    raise AssertionError(f"{handle.task_id} ended without a chunk: {handle.final}")


async def run_all(sup: Supervisor, params: list[GenerateParams]) -> list[tuple[str, TaskStatus, list[Chunk]]]:
    handles = [await sup.generate(p) for p in params]
    results: list[tuple[str, TaskStatus, list[Chunk]] | None] = [None] * len(handles)

    async def one(i: int) -> None:
        results[i] = await collect(handles[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(handles)):
            tg.start_soon(one, i)
    return [r for r in results if r is not None]


# --------------------------------------------------------------------------------------------------------------
# Text per sequence: whole characters, stop strings never emitted
# --------------------------------------------------------------------------------------------------------------


def test_a_character_split_over_two_pieces_is_emitted_whole_and_stops_span_pieces() -> None:
    stream = TextStream(stops=("STOP",))
    snowman = "☃".encode()
    assert stream.feed(b"a" + snowman[:1]) == ("a", False)  # the character is incomplete: held
    assert stream.feed(snowman[1:]) == ("☃", False)
    assert stream.feed(b" xS") == (" x", False)  # "S" may start "STOP": held
    assert stream.feed(b"T") == ("", False)
    assert stream.feed(b"OP and more") == ("", True)  # the stop string ends the text before it
    other = TextStream(stops=("STOP",))
    assert other.feed(b"S") == ("", False)
    assert other.feed(b"ky") == ("Sky", False)  # not a stop after all: released
    assert other.feed(snowman[:2]) == ("", False)
    assert other.flush() == ""  # the sequence ended inside a character: its bytes are dropped, never U+FFFD


# --------------------------------------------------------------------------------------------------------------
# The debug engine: batching, and each failure provoked for real
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_eight_requests_run_in_one_batch_with_the_texts_they_have_alone() -> None:
    with anyio.fail_after(60):
        async with Supervisor(debug(parallel=8, token_seconds=0.01)) as alone:
            await alone.ready()
            expected = [(await (await alone.generate(ask(i))).text())[0] for i in range(8)]
        async with Supervisor(debug(parallel=8, token_seconds=0.01)) as sup:
            await sup.ready()
            seen: list[Running] = []
            sup.add_status_listener(lambda s: seen.append(s) if isinstance(s, Running) else None)
            began = time.monotonic()
            results = await run_all(sup, [ask(i) for i in range(8)])
            took = time.monotonic() - began
    assert [text for text, _, _ in results] == expected
    assert all(final.state is TaskState.COMPLETE and final.tokens == 40 for _, final, _ in results)
    assert max(s.running for s in seen) == 8, seen  # all eight in the batch at once
    assert took < 8 * 40 * 0.01, took  # one step advances them all: far less than one after the other


@pytest.mark.slow
async def test_cancel_one_of_eight_ends_it_within_one_step_and_the_others_complete_unchanged() -> None:
    with anyio.fail_after(60):
        async with Supervisor(debug(parallel=8, token_seconds=0.01)) as sup:
            await sup.ready()
            expected = [(await (await sup.generate(ask(i))).text())[0] for i in range(8)]
            handles = [await sup.generate(ask(i, 10_000 if i == 3 else 40)) for i in range(8)]
            victim = handles[3]
            tokens = 0
            async for event in victim:
                if isinstance(event, Chunk):
                    tokens += event.tokens
                    if tokens == 5:
                        reply = await sup.cancel(victim.task_id)
                        assert reply.outcome == "requested", reply
                        break
            final = await victim.wait()
            others = [await collect(h) for i, h in enumerate(handles) if i != 3]
    assert final.state is TaskState.CANCELLED and 5 <= final.tokens <= 6, final  # at most the step under way
    assert [text for text, _, _ in others] == [t for i, t in enumerate(expected) if i != 3]
    assert all(f.state is TaskState.COMPLETE for _, f, _ in others)


async def test_a_request_error_in_one_sequence_fails_it_alone_and_the_batch_serves_on() -> None:
    with anyio.fail_after(60):
        async with Supervisor(debug(parallel=4, token_seconds=0.01)) as sup:
            await sup.ready()
            params = [ask(i, 30, *((Fault(kind="request_error", after_tokens=7),) if i == 1 else ())) for i in range(4)]
            results = await run_all(sup, params)
            pid = sup.pid
            after = await (await sup.generate(ask(9, 3))).text()
            assert sup.pid == pid and sup.alive
    failed = results[1][1]
    assert (
        failed.state is TaskState.FAILED
        and failed.tokens == 7
        and "injected fault 'request_error'" in (failed.error or "")
    ), failed
    assert failed.cause is None  # the request's fault, not the runner's: no runner cause
    assert [f.state for i, (_, f, _) in enumerate(results) if i != 1] == [TaskState.COMPLETE] * 3
    assert after[1].state is TaskState.COMPLETE


async def test_sigkill_with_eight_running_and_eight_waiting_fails_all_sixteen_with_the_cause() -> None:
    with anyio.fail_after(60):
        async with Supervisor(debug(parallel=8, token_seconds=0.01)) as sup:
            await sup.ready()
            handles = [await sup.generate(ask(i, 100_000)) for i in range(16)]
            await sup.wait_status(lambda s: isinstance(s, Running) and (s.running, s.waiting) == (8, 8), 10)
            assert sup.generations() == (8, 8)
            for handle in handles[:8]:  # each running one is mid-stream
                await first_chunk(handle)
            assert sup.pid is not None
            os.kill(sup.pid, signal.SIGKILL)
            finals = [await h.wait() for h in handles]
    assert all(f.state is TaskState.FAILED for f in finals), finals
    assert all(f.cause is not None and f.cause.kind is CauseKind.SIGNAL and f.cause.signal == "SIGKILL" for f in finals)
    assert all(f.tokens > 0 for f in finals[:8]) and all(f.tokens == 0 for f in finals[8:]), finals


@pytest.mark.slow
async def test_a_hang_in_one_sequence_fails_every_request_of_the_batch_with_the_hang_and_the_stacks() -> None:
    hang = Fault(kind="hang", after_tokens=5)
    with anyio.fail_after(60):
        async with Supervisor(debug(parallel=4, token_seconds=0.01), deadlines=Deadlines(token_gap=1.0)) as sup:
            await sup.ready()
            params = [ask(i, 1_000, *((hang,) if i == 2 else ())) for i in range(4)] + [ask(4, 10)]  # one waits
            results = await run_all(sup, params)
    for _, final, _ in results:
        assert final.state is TaskState.FAILED and final.cause is not None, final
        assert final.cause.kind is CauseKind.HANG and "hung in decode" in final.cause.summary, final.cause
        assert any("in _hang" in line for line in stack_dump(list(final.cause.evidence))), final.cause.render()


@pytest.mark.slow
async def test_deadlines_are_per_request_a_request_waiting_for_a_slot_is_not_late() -> None:
    """The first-token clock starts when a request enters the batch: waiting behind others for 2 s is not a hang
    of a 1 s first-token deadline."""
    with anyio.fail_after(60):
        async with Supervisor(debug(parallel=1, token_seconds=0.01), deadlines=Deadlines(first_token=1.0)) as sup:
            await sup.ready()
            results = await run_all(sup, [ask(0, 200), ask(1, 20)])
    assert [f.state for _, f, _ in results] == [TaskState.COMPLETE, TaskState.COMPLETE], results


async def test_the_runner_reports_running_and_waiting_and_frees_slots_as_sequences_end() -> None:
    events: list[object] = []
    with anyio.fail_after(60):
        async with Supervisor(debug(parallel=2, token_seconds=0.01)) as sup:
            await sup.ready()
            sup.add_status_listener(events.append)
            results = await run_all(sup, [ask(0, 5), ask(1, 30), ask(2, 5), ask(3, 5)])
            assert sup.generations() == (0, 0)
    assert all(f.state is TaskState.COMPLETE for _, f, _ in results)
    running = [(s.running, s.waiting) for s in events if isinstance(s, Running)]
    assert (2, 2) in running or (2, 1) in running, running  # two in the batch, the rest waiting
    assert max(r for r, _ in running) == 2  # never more than parallel


# --------------------------------------------------------------------------------------------------------------
# The real default model
# --------------------------------------------------------------------------------------------------------------

MISSING = model_missing()
NOT_BUILT = None if invariant.built() else f"no batch-invariant build: {invariant.BUILD_HINT}"
needs_model = pytest.mark.skipif(MISSING is not None or NOT_BUILT is not None, reason=MISSING or NOT_BUILT or "")
SYSTEM = ChatMessage("system", "You are a helpful AI assistant.")
QUESTIONS = (
    "Write a story about a lighthouse keeper.",
    "Write a story about a robot that bakes bread.",
    "What is the capital of France?",
    "List three colors.",
    "Write a poem about the sea.",
    "Explain gravity to a child.",
    "Tell me a joke about cats.",
    "Describe a sunset.",
)


def chat(i: int, max_tokens: int = 48, stop: tuple[str, ...] = ()) -> GenerateParams:
    return GenerateParams(messages=(SYSTEM, ChatMessage("user", QUESTIONS[i])), max_tokens=max_tokens, stop=stop)


def llama(**options: object) -> EngineSpec:
    """The default model, ``deterministic``: without it a batch may (rarely) change a greedy text, as in llama-server
    (``tether.engines.llamacpp.invariant``); with it, nothing may, the prompt cache included."""
    return EngineSpec(options={"n_threads": 1, "n_ctx": 512, "deterministic": True, **options})


@pytest.mark.model
@needs_model
@pytest.mark.timeout(240)
@pytest.mark.slow
async def test_eight_concurrent_greedy_chats_give_the_texts_of_eight_sequential_ones() -> None:
    """The same runner, the same prompts: one at a time, then all eight at once in one batch (the first chat also
    with a stop string, so stops are checked per sequence). Every text must be identical, not similar."""
    with anyio.fail_after(220):
        async with Supervisor(llama(parallel=8)) as sup:
            await sup.ready()
            sequential = [(await (await sup.generate(chat(i))).text())[0] for i in range(8)]
            stop = sequential[0].split()[3]  # a word from the middle of the first answer
            cut = sequential[0][: sequential[0].index(stop)]
            params = [chat(i) for i in range(8)] + [chat(0, stop=(stop,))]  # the ninth waits for a free slot
            results = await run_all(sup, params)
            again = await run_all(sup, [chat(i) for i in reversed(range(8))])  # other slots, other neighbours
    assert [text for text, _, _ in results[:8]] == sequential
    assert [text for text, _, _ in again] == sequential[::-1]
    assert results[8][0] == cut and results[8][1].state is TaskState.COMPLETE, (results[8][0], cut)
    assert all(f.state is TaskState.COMPLETE for _, f, _ in results)


@pytest.mark.model
@needs_model
@pytest.mark.timeout(240)
@pytest.mark.slow
async def test_with_the_real_model_cancel_one_of_eight_and_a_too_long_prompt_each_end_alone() -> None:
    """One of eight is cancelled mid-stream (it ends within one step, the other seven complete unchanged), and a
    prompt longer than a sequence's context, sent beside them, fails alone."""
    with anyio.fail_after(220):
        async with Supervisor(llama(parallel=8)) as sup:
            await sup.ready()
            expected = [(await (await sup.generate(chat(i, 32))).text())[0] for i in range(7)]
            handles = [await sup.generate(chat(i, 32)) for i in range(7)]
            victim = await sup.generate(chat(7, 400))
            too_long = await sup.generate(GenerateParams(prompt="word " * 600, max_tokens=8))
            tokens = 0
            async for event in victim:
                if isinstance(event, Chunk):
                    tokens += event.tokens
                    if tokens >= 4:
                        await sup.cancel(victim.task_id)
                        break
            cancelled = await victim.wait()
            refused = await too_long.wait()
            others = [await collect(h) for h in handles]
    assert cancelled.state is TaskState.CANCELLED and cancelled.tokens <= tokens + 1, (cancelled, tokens)
    assert refused.state is TaskState.FAILED and "but a sequence's context (n_ctx) is 512" in (refused.error or "")
    assert [text for text, _, _ in others] == expected
    assert all(f.state is TaskState.COMPLETE for _, f, _ in others)


@pytest.mark.model
@needs_model
@pytest.mark.timeout(240)
@pytest.mark.slow
async def test_with_the_real_model_sigkill_fails_eight_running_and_eight_waiting_with_the_cause() -> None:
    with anyio.fail_after(220):
        async with Supervisor(llama(parallel=8)) as sup:
            await sup.ready()
            handles = [await sup.generate(chat(i % 8, 400)) for i in range(16)]
            await sup.wait_status(lambda s: isinstance(s, Running) and (s.running, s.waiting) == (8, 8), 60)
            assert sup.generations() == (8, 8)
            for handle in handles[:8]:
                await first_chunk(handle)
            assert sup.pid is not None
            os.kill(sup.pid, signal.SIGKILL)
            finals = [await h.wait() for h in handles]
    assert all(f.state is TaskState.FAILED and f.cause is not None for f in finals), finals
    assert {f.cause.kind for f in finals if f.cause} == {CauseKind.SIGNAL}
    assert all(f.cause is not None and "SIGKILL" in f.cause.summary for f in finals)
