"""Deterministic decoding: with the ``deterministic`` option a greedy text and its logprobs are the request's own, bit
for bit, whatever traffic does around it (``tether.engines.llamacpp.invariant``, ``bench/determinism.py`` for the
rates with and without it).

Real runners load the batch-invariant build of llama.cpp and serve both families. Traffic attacks the promise as it
comes: requests arrive at random moments while others decode, share long system prompts (so prefixes are copied
from busy slots, and restored from RAM once more prompts than slots have come and gone), and some are cancelled
midway (often the slot another request copies from). Every answer is compared with the same request run alone, one
at a time on a runner with no prompt cache: the same text and every logprob bit for bit; a cancelled one, a prefix
of both. A conversation past Gemma's 512-token window, and the thread governor stepping down beside two busy-looping
processes, each have a test of their own.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import gemma_missing, gemma_path, model_missing, run_options
from tether.engines import create_engine
from tether.engines.base import EngineLoadError
from tether.engines.llamacpp import invariant
from tether.errors import InvalidField
from tether.fleet.catalog import catalog_models
from tether.node.supervisor import Supervisor
from tether.node.tasks import TaskHandle
from tether.protocol import ChatMessage, Chunk, EngineSpec, GenerateParams, TaskState

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leftover_runners")]

NOT_BUILT = None if invariant.built() else f"the batch-invariant build is missing: {invariant.BUILD_HINT}"
TOKENS = 24
QUESTIONS = ("Why is the sky blue?", "Name three rivers and one fact about each.")
RULES = " ".join(f"Rule {i}: answer {('clearly', 'kindly', 'briefly', 'honestly')[i % 4]}." for i in range(32))
SYSTEMS = tuple(f"You are the assistant of a {place}. {RULES}" for place in ("library", "harbour", "bakery"))


def test_the_option_refuses_a_shared_cell_pool_and_a_missing_build_says_how_to_build_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(EngineLoadError, match="kv_unified false"):
        create_engine(EngineSpec(engine="llama.cpp", options={"deterministic": True, "kv_unified": True}))
    with pytest.raises(EngineLoadError, match="n_gpu_layers 0"):
        create_engine(EngineSpec(engine="llama.cpp", options={"deterministic": True, "n_gpu_layers": 99}))
    monkeypatch.setattr(invariant, "library_dir", lambda version=None: tmp_path / "nothing")
    with pytest.raises(invariant.InvariantBuildMissing, match="tether build deterministic"):
        invariant.activate()
    # refused when the instance is created (the worker's estimate), not by its runner once it starts
    from tether.engines.llamacpp.engine import LlamaCppEngine

    with pytest.raises(InvalidField, match=r"batch-invariant build .* is not at .*nothing: build it once"):
        LlamaCppEngine.estimate_memory(EngineSpec(engine="llama.cpp", options={"deterministic": True}))


def test_the_flag_and_the_catalog_field_set_the_option_once(tmp_path: Path) -> None:
    assert run_options("--deterministic") == {"deterministic": True}
    data = {"models": [{"id": "a", "deterministic": True}, {"id": "b"}]}
    models = catalog_models(data, "catalog.toml", tmp_path, 300.0, False)
    assert [m.config.options.get("deterministic") for m in models] == [True, None]
    twice = {"models": [{"id": "c", "deterministic": True, "options": {"deterministic": False}}]}
    with pytest.raises(InvalidField, match="set deterministic once"):
        catalog_models(twice, "catalog.toml", tmp_path, 300.0, False)


def test_the_fit_check_counts_the_full_window_it_keeps_for_gemma() -> None:
    """Deterministic keeps every position in sliding-window layers (``swa_full``): the estimate must say so."""
    missing = gemma_missing()
    if missing is not None:
        pytest.skip(missing)
    from tether.engines.llamacpp.engine import LlamaCppEngine

    def kv(**options: object) -> int:
        spec = EngineSpec(engine="llama.cpp", model=str(gemma_path()), options={"n_ctx": 8192, **options})
        return LlamaCppEngine.estimate_memory(spec).kv_cache

    assert kv(deterministic=True) == kv(swa_full=True) > 3 * kv()


@pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")
def test_a_process_that_loaded_the_default_build_is_refused_rather_than_silently_nondeterministic() -> None:
    script = (
        "import llama_cpp.llama_cpp\n"
        "from tether.engines.llamacpp import invariant\n"
        "try:\n"
        "    invariant.activate()\n"
        "except invariant.InvariantBuildMissing as exc:\n"
        "    print(exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert "needs a process of its own" in done.stdout, done.stdout + done.stderr


@pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")
def test_the_build_is_the_installed_bindings_source_without_llamafile_or_amx() -> None:
    where = invariant.built()
    assert where is not None
    marker = json.loads((where / invariant.MARKER).read_text())
    assert marker["version"] == invariant.bindings_version()
    assert "-DGGML_LLAMAFILE=OFF" in marker["cmake"]
    script = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(where)}
    info = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env).stdout
    assert "AVX" in info or "NEON" in info, info  # it loaded, and says what it was built with
    assert "LLAMAFILE" not in info and "AMX" not in info, info


# --------------------------------------------------------------------------------------------------------------
# Traffic against the promise, on both families
# --------------------------------------------------------------------------------------------------------------


def family_setup(family: str) -> tuple[str, bool]:
    """The model's path, and whether it is asked by chat (SmolLM2) or raw prompt (Gemma 3 270M, a base model)."""
    if family == "smollm2":
        missing = model_missing()
        if missing is not None:
            pytest.skip(missing)
        from tether.models import default_model_path

        return str(default_model_path()), True
    missing = gemma_missing()
    if missing is not None:
        pytest.skip(missing)
    return str(gemma_path()), False


def ask(chat: bool, system: str, question: str) -> GenerateParams:
    if chat:
        messages = (ChatMessage("system", system), ChatMessage("user", question))
        return GenerateParams(messages=messages, max_tokens=TOKENS, temperature=0.0, logprobs=0)
    return GenerateParams(
        prompt=f"{system}\nQuestion: {question}\nAnswer:", max_tokens=TOKENS, temperature=0.0, logprobs=0
    )


async def answer(handle: TaskHandle) -> tuple[str, tuple[float, ...], int, TaskState]:
    chunks = [event async for event in handle if isinstance(event, Chunk) and not event.is_progress]
    assert handle.final is not None
    logprobs = tuple(lp.logprob for c in chunks for lp in c.logprobs)
    cached = sum(c.cached_tokens for c in chunks)
    return "".join(c.text for c in chunks), logprobs, cached, handle.final.state


@pytest.mark.cores
@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(400)  # ~190 s beside the suite's runners on two cores
@pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")
@pytest.mark.parametrize("family", ["smollm2", "gemma3-270m"])
async def test_every_greedy_text_and_logprob_is_the_requests_own_whatever_arrives_is_cancelled_or_cached(
    family: str,
) -> None:
    path, chat = family_setup(family)
    rng = random.Random(f"deterministic:{family}")
    # 12 requests of at most 6 kinds (the reference runs each once): a repeat finds its whole prompt cached; a
    # question whose system prompt is cached is prefilled beside others' rows, where the default build's SmolLM2
    # parts from its alone run (with 8 requests, or 16 rules, too few such came for it to show: keep both)
    requests = [(rng.choice(SYSTEMS), rng.choice(QUESTIONS)) for _ in range(12)]
    cancelled_after = {i: rng.randint(1, 8) for i in rng.sample(range(len(requests)), 2)}  # chunks before cancel
    delays = sorted(rng.uniform(0.0, 2.0) for _ in requests)
    common = {"deterministic": True, "n_ctx": 1024, "n_threads": 1}
    # 4 slots and a RAM store that holds two of the system prompts: copies from busy slots, restores, evictions
    traffic = EngineSpec(engine="llama.cpp", model=path, options={**common, "parallel": 4, "prompt_cache_ram": "20M"})
    alone = EngineSpec(engine="llama.cpp", model=path, options={**common, "parallel": 1, "prompt_cache": False})
    with anyio.fail_after(380):
        async with Supervisor(alone) as sup:
            await sup.ready()
            expected = {}
            for system, question in sorted(set(requests)):
                expected[(system, question)] = await answer(await sup.generate(ask(chat, system, question)))
        async with Supervisor(traffic) as sup:
            await sup.ready()
            pid = sup.pid
            assert pid is not None
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert str(invariant.built()) in maps, "the runner did not load the batch-invariant build"
            results: dict[int, tuple[str, tuple[float, ...], int, TaskState]] = {}

            async def one(i: int) -> None:
                await anyio.sleep(delays[i])
                handle = await sup.generate(ask(chat, *requests[i]))
                if i not in cancelled_after:
                    results[i] = await answer(handle)
                    return
                seen: list[Chunk] = []
                async for event in handle:
                    if isinstance(event, Chunk) and not event.is_progress:
                        seen.append(event)
                        if len(seen) == cancelled_after[i]:
                            await sup.cancel(handle.task_id)
                assert handle.final is not None
                text = "".join(c.text for c in seen)
                results[i] = text, tuple(lp.logprob for c in seen for lp in c.logprobs), 0, handle.final.state

            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
    cached = 0
    for i, (system, question) in enumerate(requests):
        text, logprobs, hits, state = results[i]
        ref_text, ref_logprobs, _, ref_state = expected[(system, question)]
        assert ref_state is TaskState.COMPLETE
        cached += hits
        if i in cancelled_after and state is TaskState.CANCELLED:
            assert ref_text.startswith(text) and ref_logprobs[: len(logprobs)] == logprobs, (i, text, ref_text)
        else:
            assert state is TaskState.COMPLETE, (i, state)
            assert text == ref_text, f"request {i} ({question!r}) differs from its text alone: {text!r} vs {ref_text!r}"
            assert logprobs == ref_logprobs, f"request {i}: same text, logprobs not bit-identical"
    assert cached > 0, "the prompt cache served nothing: the test did not exercise it"


@pytest.mark.cores
@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(180)
@pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")
async def test_a_conversation_past_gemmas_window_is_not_restored_packed_but_read_again_exactly() -> None:
    """Regression: a RAM entry of a sequence longer than the 512-token window holds only its window in those layers,
    and a restore packs those cells from the stream's start; the next turn's logprobs then differed from a cold
    prefill's (the attention sums over cells in the order of their places). A deterministic engine reads such a
    prefix again instead: the same text and logprobs as cold, and the prompt cache says it supplied (almost) none."""
    path, _ = family_setup("gemma3-270m")
    # ~1,040 tokens, twice the window (at ~650 a packed restore gave the cold logprobs here); then any other prompt
    # sends the slot's sequence to RAM
    log = " ".join(f"Entry {i}: the ship {i % 7} came in at {i % 24} hours with {i * 3} crates." for i in range(48))
    other = " ".join(f"Note {i}: the {('north', 'south')[i % 2]} gate opened at {i % 12}." for i in range(4))
    common = {"deterministic": True, "n_ctx": 4096, "n_threads": 1, "parallel": 1}
    cached_spec = EngineSpec(engine="llama.cpp", model=path, options={**common, "prompt_cache_ram": "256M"})
    cold_spec = EngineSpec(engine="llama.cpp", model=path, options={**common, "prompt_cache": False})

    def params(prompt: str) -> GenerateParams:
        return GenerateParams(prompt=prompt, max_tokens=16, temperature=0.0, logprobs=0)

    with anyio.fail_after(170):
        async with Supervisor(cached_spec) as sup:
            await sup.ready()
            first, *_ = await answer(await sup.generate(params(log)))
            await answer(await sup.generate(params(other)))  # the slot's sequence (past the window) goes to RAM
            turn = log + first + " Entry 48: the ship 6 came in at 0 hours with 144 crates. Summary:"
            text, logprobs, cached, state = await answer(await sup.generate(params(turn)))
        async with Supervisor(cold_spec) as sup:
            await sup.ready()
            cold_text, cold_logprobs, _, _ = await answer(await sup.generate(params(turn)))
    assert state is TaskState.COMPLETE and cached < 16, (state, cached)
    assert (text, logprobs) == (cold_text, cold_logprobs), (text, cold_text)


def own_process(script: str, *args: str, timeout: float) -> dict[str, Any]:
    """``script`` run in a process of its own on the default model (its path the first argument; a deterministic
    engine loads its build before anything else can): the JSON its last line printed."""
    path, _ = family_setup("smollm2")
    done = subprocess.run([sys.executable, "-c", script, path, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


THREAD_SWITCH = """
import json, subprocess, sys
from tether.engines.llamacpp.engine import LlamaCppEngine
from tether.protocol import ChatMessage, EngineSpec, GenerateParams

options = {"n_threads": 2, "parallel": 1, "n_ctx": 512, "prompt_cache": False, "deterministic": True}
engine = LlamaCppEngine(EngineSpec(model=sys.argv[1], options=options))
engine.load(lambda fraction, detail: None)
batch = engine._require_batch()
params = GenerateParams(
    messages=(ChatMessage("user", "Tell me a long story about a lighthouse."),), max_tokens=int(sys.argv[2]),
    temperature=0.0, logprobs=0,
)

def run():
    deltas = list(engine.generate(params, lambda: False))
    return "".join(d.text for d in deltas), [lp.logprob for d in deltas for lp in d.logprobs]

reference, governor = run(), batch.threads
if governor.current != governor.most:  # the reference was contended (tests beside it): all threads again
    governor._set(governor.most)
before = governor.switches
hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
try:
    contended = run()
finally:
    for hog in hogs:
        hog.kill()
print(json.dumps({"same": contended == reference, "switches": governor.switches - before}))
"""
# The governor steps down after two contended 0.25 s windows of decoding (``threads.PATIENCE``): ~20 tokens beside
# two busy loops; the rest of the run is on one thread.
SWITCH_TOKENS = 96


@pytest.mark.cores
@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(180)
@pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")
def test_the_thread_governor_stepping_down_mid_stream_changes_no_logprob() -> None:
    """Its own process (a deterministic engine must load its build first): a reference, then the same run beside two
    busy loops, during which the governor steps down to one thread."""
    result = own_process(THREAD_SWITCH, str(SWITCH_TOKENS), timeout=170)
    assert result["switches"] >= 1, "the governor never switched: the test proved nothing"
    assert result["same"], "a run with its threads switched mid-stream differs from the reference"


RESUMED_LONG = """
import json, sys, tempfile
from tether.engines.llamacpp.engine import LlamaCppEngine
from tether.protocol import ChatMessage, EngineSpec, GenerateParams, Resume

CUT, MAX = 80, 100
store = tempfile.mkdtemp()
# room for about two saves of ~70 tokens (~23 KB a token): the last ones fit only in place of their predecessor
options = {"n_threads": 1, "parallel": 1, "n_ctx": 256, "deterministic": True, "prompt_cache_ram": "4M"}
chat = (ChatMessage("user", "Tell me a long story about a lighthouse keeper and the storms of one winter."),)

def engine():
    e = LlamaCppEngine(EngineSpec(model=sys.argv[1], options=options, store=store))
    e.load(lambda fraction, detail: None)
    e.warmup()
    return e

def until(e, seq_id, ids, n):
    while len(ids) < n:
        for _, delta in e.step():
            ids += delta.ids
            if delta.finish_reason:
                return delta

first, ids = engine(), []
first.start("a", GenerateParams(messages=chat, max_tokens=MAX, temperature=0.0))
until(first, "a", ids, CUT)  # then it is abandoned mid-answer, as a killed runner's is
saves = first._require_batch().cache.stats.checkpoints
second, resumed = engine(), []
second.start("b", GenerateParams(messages=chat, max_tokens=MAX, temperature=0.0, resume=Resume(tuple(ids))))
final = until(second, "b", resumed, MAX)
restored = second._require_batch().cache.stats.from_ram
until(first, "a", ids, MAX)  # the first runner's uninterrupted answer
print(json.dumps({"same": ids[:CUT] + resumed == ids, "cut": CUT, "prompt": final.prompt_tokens, "saves": saves,
                  "restored": restored}))
"""


RESUMED_YOUNG = """
import json, sys, tempfile
from tether.engines.llamacpp.engine import LlamaCppEngine
from tether.protocol import ChatMessage, EngineSpec, GenerateParams, Resume

N, CUT, MAX = 8, 12, 20
store = tempfile.mkdtemp()
options = {"n_threads": 1, "parallel": N, "n_ctx": 128, "n_batch": 32, "deterministic": True}
places = ("a lighthouse", "a bakery", "a harbour", "a library", "a forest", "a train", "a castle", "a garden")
chats = [(ChatMessage("user", f"Tell me a long story about {p} and the storms of one winter."),) for p in places]

def engine():
    e = LlamaCppEngine(EngineSpec(model=sys.argv[1], options=options, store=store))
    e.load(lambda fraction, detail: None)
    e.warmup()
    return e

def run(e, ids, until, prompts):
    while min(len(v) for v in ids.values()) < until:
        for seq_id, delta in e.step():
            ids[seq_id] += delta.ids
            if delta.finish_reason:
                prompts[seq_id] = delta.prompt_tokens
                ids[seq_id] += [None] * MAX  # ended: never the shortest

first, ids, prompts = engine(), {str(i): [] for i in range(N)}, {}
for i in range(N):
    first.start(str(i), GenerateParams(messages=chats[i], max_tokens=MAX, temperature=0.0))
run(first, ids, CUT, prompts)  # then it is abandoned, every answer young, as a killed runner's are
cut = {k: list(v) for k, v in ids.items()}
second, resumed = engine(), {str(i): [] for i in range(N)}
for i in range(N):
    resume = Resume(tuple(cut[str(i)]))
    second.start(str(i), GenerateParams(messages=chats[i], max_tokens=MAX, temperature=0.0, resume=resume))
run(second, resumed, MAX, prompts)
restored = second._require_batch().cache.stats.from_ram
run(first, ids, MAX, prompts)  # the uninterrupted answers
same = all([t for t in cut[k] + resumed[k] if t is not None] == [t for t in ids[k] if t is not None] for k in ids)
held = sum(prompts[k] + len(cut[k]) - 1 for k in cut)  # the cells at the cut: each last token never decoded
print(json.dumps({"same": same, "held": held, "generated": sum(len(v) - 1 for v in cut.values()),
                  "restored": restored}))
"""


RESUMED_BURST = """
import json, sys
from tether.engines.llamacpp.engine import LlamaCppEngine
from tether.protocol import ChatMessage, EngineSpec, GenerateParams, Resume

N, SENT = 8, 3
spec = EngineSpec(model=sys.argv[1], options={"n_threads": 1, "parallel": N, "n_ctx": 256, "deterministic": True})
places = ("a lighthouse", "a bakery", "a harbour", "a library", "a forest", "a train", "a castle", "a garden")

def run(pack, resumes=None):
    engine = LlamaCppEngine(spec)
    engine.load(lambda fraction, detail: None)
    engine.warmup()
    engine._require_batch().invariant = pack
    ids = {i: [] for i in range(N)}
    first = {}
    for i in range(N):
        resume = Resume(tuple(resumes[i][:SENT])) if resumes else None
        chat = (ChatMessage("user", f"Tell me a story about {places[i]}."),)
        engine.start(str(i), GenerateParams(messages=chat, max_tokens=8, temperature=0.0, resume=resume))
    steps, ended = 0, set()
    while len(ended) < N:
        steps += 1
        for seq_id, delta in engine.step():
            ids[int(seq_id)] += delta.ids
            if delta.tokens:
                first.setdefault(int(seq_id), steps)
            if delta.finish_reason:
                ended.add(int(seq_id))
    engine.close()
    return ids, max(first.values())

whole, _ = run(True)
packed, packed_steps = run(True, whole)
single, single_steps = run(False, whole)
same = all(whole[i][:SENT] + packed[i] == whole[i] == whole[i][:SENT] + single[i] for i in range(N))
print(json.dumps({"same": same, "packed_steps": packed_steps, "single_steps": single_steps}))
"""


@pytest.mark.cores
@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(60)
@pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")
def test_a_long_answer_resumed_on_a_new_runner_restores_most_of_what_it_had_generated() -> None:
    """A runner abandoned 80 tokens into an answer had saved the generation as it grew (``Batch._save_progress``),
    so the runner that resumes it restores the prompt and most of those tokens from the store instead of reading
    them again, and goes on bit for bit. Without those saves only the prompt is there to restore: the break. Its
    budget holds one save of the whole answer and not two: each save takes its predecessor's room."""
    result = own_process(RESUMED_LONG, timeout=55)
    assert result["same"], "the resumed answer differs from the uninterrupted one"
    held = result["prompt"] + result["cut"] - 1  # the cells it had when abandoned: its last token was never decoded
    assert result["saves"] >= 3, result  # the prompt, then as the answer grew
    assert result["restored"] > result["prompt"], result  # the break: no generated token restored
    assert result["restored"] >= held - max(32, held // 4), result  # at most one save's growth read again


@pytest.mark.cores
@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(60)
@pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")
def test_young_answers_resumed_together_read_again_only_what_the_batch_left_unsaved() -> None:
    """A death resumes every stream of its runner at once, and their unsaved tails are read again together: so
    while the batch's tails add up to more than a quarter of ``n_batch`` the sequences are saved though each is
    short of its own growth rule (``Batch._save_progress``). 8 answers abandoned 12 tokens in read again a few
    tokens, not the ~88 they generated (the break: each answer's own rule alone saves none of them that young),
    and go on bit for bit."""
    result = own_process(RESUMED_YOUNG, timeout=55)
    assert result["same"], "a resumed answer differs from the uninterrupted one"
    reread = result["held"] - result["restored"]
    assert reread <= result["generated"] // 3, result  # without the batch's rule: every generated token


@pytest.mark.cores
@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(120)
@pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")
def test_streams_resumed_together_are_placed_in_one_step_and_go_on_bit_for_bit() -> None:
    """With the batch-invariant build several prompts share a step: 8 streams resumed on a fresh runner (prompt and
    3 tokens each to prefill again) reach their next token in 2 steps, not a step each as one prompt per step
    takes; every stream goes on as the uninterrupted run did. Its own process: the build is loaded first."""
    result = own_process(RESUMED_BURST, timeout=110)
    assert result["same"], "a stream resumed beside others differs from its uninterrupted run"
    assert result["packed_steps"] == 2, result  # the 8 prompts' chunks in one step, their next tokens in the next
    assert result["single_steps"] == 9, result  # one prompt a step: the break this test would see
