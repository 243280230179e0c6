"""OpenAI's sampling parameters, logprobs, structured output and embeddings, engine side.

The llama.cpp tests drive one loaded default model in-process (module-scoped, one thread, no prompt cache, so a
text depends on nothing but its request), plus one embedding instance; one test goes through a real runner, so
logprobs cross the wire. The debug engine's honest versions of the same features need no model.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import anyio
import jsonschema
import pytest
from msgspec.structs import replace

from conftest import model_missing
from tether.engines import create_engine
from tether.engines.base import Delta, EngineLoadError, RequestError
from tether.engines.debug import DebugEngine, embedding_vector
from tether.engines.llamacpp.engine import LlamaCppEngine, schema_grammar
from tether.node.supervisor import Supervisor
from tether.protocol import (
    CauseKind,
    ChatMessage,
    Chunk,
    EmbedParams,
    EngineSpec,
    Fault,
    GenerateParams,
    TaskState,
    Work,
)

pytestmark = [pytest.mark.timeout(120)]

MISSING = model_missing()
F = TypeVar("F", bound=Callable[..., Any])


def needs_model(test: F) -> F:
    marked: F = pytest.mark.model(pytest.mark.skipif(MISSING is not None, reason=MISSING or "")(test))
    return marked


SYSTEM = ChatMessage("system", "You are a helpful AI assistant.")
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def ask(question: str, **params: Any) -> GenerateParams:
    return GenerateParams(messages=(SYSTEM, ChatMessage("user", question)), **params)


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


def run(engine: Any, params: Work) -> tuple[str, list[Delta]]:
    deltas = list(engine.generate(params, lambda: False))
    return text_of(deltas), deltas


def run_together(engine: Any, requests: Sequence[Work], timeout: float = 60) -> list[tuple[str, list[Delta]]]:
    """Start every request, then step the batch until all have ended (all in one batch: checked)."""
    ids = [f"together-{i}" for i in range(len(requests))]
    for seq_id, params in zip(ids, requests, strict=True):
        engine.start(seq_id, params)
    assert engine.active() == len(requests)
    deltas: dict[str, list[Delta]] = {seq_id: [] for seq_id in ids}
    ended: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(ended) < len(ids):
        assert time.monotonic() < deadline, f"not all ended within {timeout} s: {sorted(set(ids) - ended)}"
        for seq_id, result in engine.step():
            assert not isinstance(result, RequestError), result
            deltas[seq_id].append(result)
            if result.finish_reason is not None:
                ended.add(seq_id)
    return [(text_of(deltas[seq_id]), deltas[seq_id]) for seq_id in ids]


def logprobs_of(deltas: list[Delta]) -> list[Any]:
    return [entry for d in deltas for entry in d.logprobs]


# --------------------------------------------------------------------------------------------------------------
# The debug engine: honest values for a deterministic engine
# --------------------------------------------------------------------------------------------------------------


def loaded_debug(**options: object) -> DebugEngine:
    engine = DebugEngine(EngineSpec(engine="debug", options=dict(options)))
    engine.load(lambda f, d: None)
    engine.warmup()
    return engine


def test_debug_embeddings_are_deterministic_unit_vectors_of_embedding_dim() -> None:
    engine = loaded_debug(parallel=2)
    _, [final] = run(engine, EmbedParams(prompt="tell me about supervision"))
    vector = final.embedding
    assert vector is not None and len(vector) == 64
    assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-9)
    assert (final.finish_reason, final.tokens, final.prompt_tokens, final.completion_tokens) == ("stop", 0, 4, 0)
    assert run(engine, EmbedParams(prompt="tell me about supervision"))[1][0].embedding == vector
    other = run(engine, EmbedParams(prompt="tell me about something else"))[1][0].embedding
    assert other is not None and other != vector
    small = loaded_debug(embedding_dim=16)
    chat = EmbedParams(messages=(ChatMessage("user", "hi"),))
    assert len(run(small, chat)[1][0].embedding or ()) == 16
    with pytest.raises(EngineLoadError, match=r"embedding_dim must be in \[1, 65536\]"):
        DebugEngine(EngineSpec(engine="debug", options={"embedding_dim": 0}))


def test_debug_logprobs_say_each_token_was_certain() -> None:
    engine = loaded_debug()
    plain, plain_deltas = run(engine, GenerateParams(prompt="tell me about supervision", max_tokens=12))
    text, deltas = run(engine, GenerateParams(prompt="tell me about supervision", max_tokens=12, logprobs=3))
    assert text == plain and not logprobs_of(plain_deltas)  # logprobs change no text and cost nothing when off
    entries = logprobs_of(deltas)
    assert len(entries) == 12 and b"".join(e.piece for e in entries) == text.encode()
    assert all(
        e.logprob == 0.0 and [(t.token, t.logprob, t.piece) for t in e.top] == [(e.token, 0.0, e.piece)]
        for e in entries
    )
    _, none = run(engine, GenerateParams(prompt="tell me about supervision", max_tokens=4, logprobs=0))
    assert [e.top for e in logprobs_of(none)] == [()] * 4


def test_debug_engine_refuses_json_schema() -> None:
    with pytest.raises(RequestError, match="the debug engine does not do structured output"):
        loaded_debug().generate(GenerateParams(prompt="x", json_schema='{"type": "object"}'), lambda: False)


@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_debug_embeddings_through_a_runner_and_faults_still_fire() -> None:
    """An embedding crosses the wire on the final chunk; a per-request fault fires for an embed request as for a
    generation (a request_error fails it alone; a sigkill kills the runner, reported with its cause)."""
    with anyio.fail_after(60):
        async with Supervisor(EngineSpec(engine="debug", options={"embedding_dim": 8})) as sup:
            await sup.ready()
            handle = await sup.generate(EmbedParams(prompt="embed me"))
            chunks = [event async for event in handle if isinstance(event, Chunk)]
            refused = await (await sup.generate(EmbedParams(prompt="x", faults=(Fault("request_error"),)))).wait()
            served = await (await sup.generate(EmbedParams(prompt="embed me"))).wait()
            killed = await (await sup.generate(EmbedParams(prompt="x", faults=(Fault("sigkill"),)))).wait()
    assert handle.final is not None and handle.final.state is TaskState.COMPLETE
    assert chunks[-1].embedding == embedding_vector("embed me", 8) and chunks[-1].finish_reason == "stop"
    assert refused.state is TaskState.FAILED and "injected fault 'request_error'" in (refused.error or "")
    assert served.state is TaskState.COMPLETE  # the runner served on
    assert killed.state is TaskState.FAILED and killed.cause is not None and killed.cause.kind is CauseKind.SIGNAL


# --------------------------------------------------------------------------------------------------------------
# llama.cpp with the default model
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama() -> Iterator[Any]:
    if MISSING is not None:
        pytest.skip(MISSING)
    # One thread: on a small shared box, ggml's spinning thread barriers collapse under CPU contention.
    engine = create_engine(EngineSpec(options={"n_ctx": 512, "n_threads": 1, "parallel": 4, "prompt_cache": False}))
    engine.load(lambda f, d: None)
    engine.warmup()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def embedder() -> Iterator[Any]:
    if MISSING is not None:
        pytest.skip(MISSING)
    engine = create_engine(EngineSpec(options={"n_ctx": 128, "n_threads": 1, "parallel": 2, "embedding": True}))
    engine.load(lambda f, d: None)
    engine.warmup()
    yield engine
    engine.close()


def token_id(engine: Any, piece: bytes) -> int:
    ids = engine._model.tokenize(piece, add_bos=False, special=False)
    assert len(ids) == 1, (piece, ids)
    return int(ids[0])


STORY = GenerateParams(prompt="Once upon a time", max_tokens=16, temperature=0.0)


@needs_model
def test_logprobs_match_the_text_and_greedy_picks_the_top_alternative(llama: Any) -> None:
    plain, plain_deltas = run(llama, STORY)
    text, deltas = run(llama, replace(STORY, logprobs=5))
    assert text == plain and not logprobs_of(plain_deltas)
    entries = logprobs_of(deltas)
    assert len(entries) == deltas[-1].completion_tokens == 16
    assert all(len(d.logprobs) == d.tokens for d in deltas)  # each on the delta that carries its token
    assert b"".join(e.piece for e in entries) == text.encode()
    for e in entries:
        assert e.token == e.piece.decode("utf-8", errors="replace")
        assert len(e.top) == 5 and all(-math.inf < t.logprob <= 0.0 for t in e.top) and e.logprob <= 0.0
        assert [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
        assert (e.top[0].token, e.top[0].piece, e.top[0].logprob) == (e.token, e.piece, e.logprob)  # greedy
        assert math.fsum(math.exp(t.logprob) for t in e.top) <= 1.0 + 1e-6
    _, zero = run(llama, replace(STORY, logprobs=0, max_tokens=4))
    assert [e.top for e in logprobs_of(zero)] == [()] * 4
    # A chat ends on end-of-generation: that token is no entry, and the bytes still add up to the text.
    chat_text, chat = run(llama, ask("What is the capital of France?", max_tokens=40, temperature=0.0, logprobs=1))
    assert chat[-1].finish_reason == "stop" and len(logprobs_of(chat)) == chat[-1].completion_tokens
    assert b"".join(e.piece for e in logprobs_of(chat)) == chat_text.encode()


@needs_model
def test_logit_bias_bans_and_forces_tokens_and_logprobs_stay_the_models(llama: Any) -> None:
    text, deltas = run(llama, replace(STORY, max_tokens=6, logprobs=1))
    first = logprobs_of(deltas)[0]
    banned_id = token_id(llama, first.piece)
    banned_text, _ = run(llama, replace(STORY, max_tokens=6, logprobs=1, logit_bias=((banned_id, -100.0),)))
    assert not banned_text.startswith(first.token), (banned_text, text)
    forced = token_id(llama, b" dragon")
    forced_text, forced_deltas = run(llama, replace(STORY, max_tokens=4, logprobs=1, logit_bias=((forced, 100.0),)))
    assert forced_text == " dragon" * 4
    entry = logprobs_of(forced_deltas)[0]
    assert entry.token == " dragon" and entry.logprob < entry.top[0].logprob  # the raw distribution, before the bias
    assert entry.top[0].token == first.token
    with pytest.raises(RequestError, match=r"logit_bias names token 49152, but .* has 49152 tokens"):
        llama.generate(replace(STORY, logit_bias=((49152, 1.0),)), lambda: False)


@needs_model
def test_penalties_break_a_repetition(llama: Any) -> None:
    loop = GenerateParams(prompt="one two one two one two one two", max_tokens=24, temperature=0.0)
    plain, _ = run(llama, loop)
    presence, _ = run(llama, replace(loop, presence_penalty=1.5))
    frequency, _ = run(llama, replace(loop, frequency_penalty=1.5))
    assert Counter(plain.replace("-", " ").split())["two"] >= 8, plain  # the model loops on "two"
    for penalized in (presence, frequency):
        assert penalized != plain
        assert Counter(penalized.replace("-", " ").split())["two"] < 4, penalized
    la = GenerateParams(prompt="Repeat after me: la la la la la la la la", max_tokens=12, temperature=0.0)
    assert run(llama, la)[0] == " la" * 12
    assert run(llama, replace(la, repeat_penalty=1.5))[0] != " la" * 12  # the prompt's "la"s count


@needs_model
def test_top_k_1_or_min_p_1_at_temperature_1_is_greedy(llama: Any) -> None:
    greedy, _ = run(llama, STORY)
    for seed in (1, 2):
        assert run(llama, replace(STORY, temperature=1.0, seed=seed, top_k=1))[0] == greedy
        assert run(llama, replace(STORY, temperature=1.0, seed=seed, top_k=0, min_p=1.0))[0] == greedy
    sampled = {run(llama, replace(STORY, temperature=1.5, seed=seed, top_k=0))[0] for seed in (1, 2, 3)}
    assert len(sampled) > 1  # without them, the seeds do differ


PEOPLE = (
    "Describe a person named Bob who is 42 as JSON.",
    "Invent a pirate captain and give their name and age.",
    "Who is the oldest person you know? Answer in JSON.",
    "My grandmother Rose turned 90 today.",
    "Create a character for a fantasy novel.",
    "Tell me about a famous scientist.",
)
OBJECTS = (
    "Return a JSON object with your favourite color.",
    "Describe the weather today as a JSON object.",
    "List two fruits as a JSON object.",
)


@needs_model
def test_json_schema_outputs_parse_validate_and_end_with_the_value(llama: Any) -> None:
    person = json.dumps(PERSON)
    cases = [(PERSON, ask(q, max_tokens=60, temperature=0.0, json_schema=person)) for q in PEOPLE]
    cases += [
        ({"type": "object"}, ask(q, max_tokens=80, temperature=0.0, json_schema='{"type": "object"}')) for q in OBJECTS
    ]
    cases += [
        (PERSON, ask("Invent a person.", max_tokens=60, temperature=1.0, seed=seed, json_schema=person))
        for seed in range(3)
    ]
    results = []
    for i in range(0, len(cases), 4):
        results += run_together(llama, [params for _, params in cases[i : i + 4]])
    for (schema, _), (text, deltas) in zip(cases, results, strict=True):
        value = json.loads(text)  # strict JSON: no raw control characters inside strings
        jsonschema.validate(value, schema)
        assert deltas[-1].finish_reason == "stop" and text == text.strip(), text  # ended at the value's last byte
    assert len({text for text, _ in results}) == len(results)


@needs_model
def test_json_schema_problems_are_request_errors(llama: Any) -> None:
    for schema, message in (
        ("{not json", "json_schema is not valid JSON"),
        ('["type"]', "json_schema must be a JSON object"),
        (
            '{"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}',
            "json_schema is not supported",
        ),
    ):
        with pytest.raises(RequestError, match=message):
            llama.generate(GenerateParams(prompt="x", json_schema=schema), lambda: False)
    assert llama.active() == 0


@needs_model
def test_each_sequence_in_a_batch_keeps_its_own_sampling(llama: Any) -> None:
    """Four requests with different parameters, alone and then together in one batch: the same texts."""
    _, deltas = run(llama, replace(STORY, max_tokens=1, logprobs=1))
    banned_id = token_id(llama, logprobs_of(deltas)[0].piece)
    requests = [
        replace(STORY, logit_bias=((banned_id, -100.0),)),
        STORY,
        ask("List three colors.", max_tokens=16, temperature=0.0, logprobs=3),
        ask("Invent a person.", max_tokens=40, temperature=0.8, seed=7, json_schema=json.dumps(PERSON)),
    ]
    alone = [run(llama, params) for params in requests]
    together = run_together(llama, requests)
    assert [text for text, _ in together] == [text for text, _ in alone]
    assert alone[0][0] != alone[1][0]  # the ban applied to its own sequence only
    assert [bool(logprobs_of(deltas)) for _, deltas in together] == [False, False, True, False]
    assert logprobs_of(together[2][1]) == logprobs_of(alone[2][1])
    jsonschema.validate(json.loads(together[3][0]), PERSON)


@needs_model
def test_an_unseeded_request_draws_its_own_seed_and_a_seeded_one_repeats(llama: Any) -> None:
    """Asking again without a seed (a regenerate button) gets a new sample, as from OpenAI or llama-server; the same
    seed gets the same text."""
    sampled = replace(STORY, max_tokens=24, temperature=1.0)
    unseeded = {run(llama, sampled)[0] for _ in range(4)}
    assert len(unseeded) > 1, unseeded  # four identical 24-token samples at temperature 1: a fixed seed
    seeded = {run(llama, replace(sampled, seed=11))[0] for _ in range(3)}
    assert len(seeded) == 1, seeded


@needs_model
def test_embeddings_are_deterministic_unit_vectors_of_the_models_width(embedder: Any) -> None:
    _, [final] = run(embedder, EmbedParams(prompt="The cat sat on the mat."))
    vector = final.embedding
    assert vector is not None and len(vector) == 576  # SmolLM2-135M's n_embd
    assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-6)
    assert (final.finish_reason, final.tokens, final.completion_tokens) == ("stop", 0, 0) and final.prompt_tokens > 3
    assert run(embedder, EmbedParams(prompt="The cat sat on the mat."))[1][0].embedding == vector
    other = run(embedder, EmbedParams(prompt="Stock markets fell sharply on Monday."))[1][0].embedding
    assert other is not None and other != vector
    chat = run(embedder, EmbedParams(messages=(ChatMessage("user", "hello"),)))[1][0]
    assert chat.embedding is not None and len(chat.embedding) == 576 and chat.prompt_tokens > 1
    # Several queued at once (one prompt per step): each gets the vector it gets alone.
    texts = ["first text", "a second, longer text to embed"]
    alone = [run(embedder, EmbedParams(prompt=t))[1][0].embedding for t in texts]
    together = run_together(embedder, [EmbedParams(prompt=t) for t in texts])
    assert [deltas[-1].embedding for _, deltas in together] == alone


@needs_model
def test_embedding_and_generating_instances_refuse_each_others_requests(llama: Any, embedder: Any) -> None:
    with pytest.raises(RequestError, match=r"serves embeddings only .* an instance started without the embedding"):
        embedder.generate(GenerateParams(prompt="hello"), lambda: False)
    with pytest.raises(RequestError, match="start an instance with option embedding: true"):
        llama.generate(EmbedParams(prompt="hello"), lambda: False)
    with pytest.raises(RequestError, match=r"the input is \d+ tokens but this embedding instance's context .* is 128"):
        embedder.generate(EmbedParams(prompt="word " * 200), lambda: False)
    assert llama.active() == 0 and embedder.active() == 0


@needs_model
@pytest.mark.anyio
@pytest.mark.usefixtures("no_leftover_runners")
async def test_logprobs_and_json_schema_through_a_runner() -> None:
    spec = EngineSpec(options={"n_ctx": 512, "n_threads": 1, "parallel": 2, "prompt_cache": False})
    with anyio.fail_after(90):
        async with Supervisor(spec) as sup:
            await sup.ready()
            handle = await sup.generate(replace(STORY, logprobs=2))
            chunks = [event async for event in handle if isinstance(event, Chunk)]
            structured, status = await (
                await sup.generate(ask(PEOPLE[0], max_tokens=60, json_schema=json.dumps(PERSON)))
            ).text()
    text = "".join(c.text for c in chunks)
    entries = [e for c in chunks for e in c.logprobs]
    assert len(entries) == 16 and b"".join(e.piece for e in entries) == text.encode()
    assert all(len(e.top) == 2 and e.top[0].logprob == e.logprob for e in entries)
    assert status.state is TaskState.COMPLETE
    jsonschema.validate(json.loads(structured), PERSON)


@needs_model
def test_a_grammar_with_no_way_on_or_that_does_not_parse_fails_its_request_alone(llama: Any) -> None:
    """Accepting a token the grammar refuses would abort the process inside llama.cpp: such a sequence ends with a
    RequestError instead, and one beside it completes."""
    from tether.engines.llamacpp.batch import Sampling  # numpy comes with llama-cpp-python

    batch = llama._batch
    prompt = llama._tokenize("hello")
    batch.start("dead", prompt, 8, [], Sampling(0.0, 1.0, 0, grammar='root ::= "\\x00"'))  # no token's piece is NUL
    batch.start("alive", prompt, 4, [], Sampling(0.0, 1.0, 0))
    first: dict[str, Any] = {}
    for _ in range(4):  # both prompts prefilled, then their first tokens in one step (see engines/llamacpp/batch)
        first = dict(batch.step())
        if first:
            break
    assert isinstance(first["dead"], RequestError) and "the json_schema grammar allows no token" in str(first["dead"])
    assert isinstance(first["alive"], Delta)
    while batch.active():
        for seq_id, result in batch.step():
            assert seq_id == "alive" and isinstance(result, Delta)
    with pytest.raises(RequestError, match=r"llama\.cpp could not build a grammar from this json_schema"):
        batch.start("unparsable", prompt, 8, [], Sampling(0.0, 1.0, 0, grammar="root ::= ("))
    assert batch.active() == 0


def test_the_grammar_keeps_raw_control_characters_out_of_strings() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: run `make install`")
    grammar = schema_grammar(json.dumps(PERSON))
    [char] = [line for line in grammar.splitlines() if line.startswith("char ::=")]
    assert char.startswith('char ::= [^"\\\\\\x7F\\x00-\\x1F] |'), char


@needs_model
def test_an_embedding_instance_is_estimated_with_one_prompts_cache_and_every_tokens_logits() -> None:
    spec = EngineSpec(options={"n_ctx": 512, "parallel": 4})
    generating = LlamaCppEngine.estimate_memory(spec)
    embedding = LlamaCppEngine.estimate_memory(EngineSpec(options={"n_ctx": 512, "parallel": 4, "embedding": True}))
    assert embedding.kv_cache == generating.kv_cache // 4  # n_ctx cells in all, whatever parallel
    assert embedding.n_ubatch == 512 and embedding.outputs >= 512 * 49152 * 4  # every token's logits, kept
    assert embedding.total > generating.total - generating.kv_cache
    assert "outputs" in embedding.describe() and "parallel" not in embedding.describe()
