"""The batch target: every attack of the single campaign while 1, 4, 8 or 16 sequences are in flight on an
instance that decodes 8 at once (the rest wait in its runner's queue), plus faults that hit one sequence alone.

The per-sequence faults: one request the engine refuses (a prompt longer than the context: ``RequestError`` at its
admission, while the batch runs; the HTTP API carries no per-request fault, see ``SEQUENCE_ATTACKS``), one stream
cancelled, one client gone. After each, every other stream must complete, and every stream's text must be its
prompt's solo text (greedy, one seed; ``trial.expect_solo_texts``): whole when completed, a prefix when cut.

The debug engine decodes ``parallel`` sequences per step (its option); the real llama.cpp engine (``--engine
llama.cpp``, the default model or ``--model``'s) takes only what needs no injected fault: outside signals, worker
signals, the clients' attacks and the per-sequence faults. Its instances are ``deterministic`` with the prompt cache
and speculation on, half its prompts copy a line (so streams draft), and its solo instance does not speculate: so
every stream's text is held to the plain path's bit for bit whatever arrived beside it, was cancelled beside it,
left the cells its prompt's prefix was copied from, or was drafted and rolled back.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx

from tether.chaos.campaign import Report, drive
from tether.chaos.plan import ATTACKS, WARM_UP, Attack, Only, Trial, engine_plan
from tether.chaos.target import Target
from tether.chaos.trial import DEADLINES, OPTIONS, Setup, Solo, TrialResult, run_alone, run_on

NAME = "batch"
SOLO = "solo"
PARALLEL = 8
STREAMS = (1, 4, 8, 16)  # 16: 8 decoding, 8 waiting
N_CTX = 512  # per sequence: the refused prompt is longer
SOLO_TOKENS = 64  # the plan's longest max_tokens: a solo text covers every trial's
REAL_TOKENS = 32  # the real engine's streams ask at most this many (two rounds of 8 on two cores: ~20 s), its solos too
REAL_REQUEST_BOUND = 60.0
REAL_THREADS = 2  # the real engine's threads per runner (``--threads``): a campaign has the machine to itself
SAMPLING = {"temperature": 0.0, "seed": 11, "stream_options": {"include_usage": True}}
PROMPTS = tuple(
    f"Prompt {i}: {topic}"
    for i, topic in enumerate(
        (
            "list three colours.",
            "say hello in French.",
            "count from one to five.",
            "name a planet.",
            "write a haiku about rain.",
            "what is two plus two?",
            "describe a cat.",
            "spell the word tether.",
            "name a fruit that is red.",
            "give a synonym for fast.",
            "what day comes after Monday?",
            "name an ocean.",
            "write one sentence about trees.",
            "what is the capital of Italy?",
            "describe the sea.",
            "name a musical instrument.",
        )
    )
)
# The real engine's prompts that draft: each asks to copy a line it gives the first words of, so a stream's drafts
# (from its own context) are long and mostly kept, and a cancel or a neighbour can land between a draft's rows.
LINES = (
    "The keeper climbed the hundred and twelve steps, trimmed the wick and wound the clock that turns the lens.",
    "Ships that pass at night see the beam sweep the water once every ten seconds and know where the rocks are.",
    "A baker rises at four, lights the oven, weighs the flour and salt, and shapes the loaves before the sun.",
    "The river bends twice below the mill, runs under the stone bridge and widens into a slow brown lake.",
)
COPY_PROMPTS = tuple(
    f"Copy {i}: repeat the line exactly.\nLine: {line}\nCopy: {' '.join(line.split()[:3])}"
    for i, line in enumerate(LINES)
)
REFUSED_PROMPT = " ".join(["overflow"] * (N_CTX + 64))  # more words (and tokens) than one sequence's context

# One sequence hit alone. A debug-engine ``request_error`` fault would fail a sequence mid-generation, but the HTTP
# API carries no per-request faults, so the error is the engine's refusal of a prompt longer than its context.
SEQUENCE_ATTACKS = (
    Attack("seq_error", None, ("generating",), client="seq_error"),
    Attack("seq_cancel", None, ("generating",), client="seq_cancel"),
    Attack("seq_disconnect", None, ("generating",), client="seq_disconnect"),
)
DEBUG_ATTACKS = ATTACKS + SEQUENCE_ATTACKS


def _real(attack: Attack) -> Attack | None:
    """The attack on the real engine, or None where it needs the debug engine (injected faults, helpers). A load of
    the default model takes a fraction of a second: no phase can be aimed at inside it."""
    if attack.engine_fault is not None or attack.options:
        return None
    phases = tuple(p for p in attack.phases if p not in ("loading", "warming_up"))
    return dataclasses.replace(attack, phases=phases)


REAL_ATTACKS = tuple(a for a in map(_real, DEBUG_ATTACKS) if a is not None)


def setup(engine: str, url: str, model: str | None = None, threads: int = REAL_THREADS) -> Setup:
    """Every trial's instance options and streams; solo texts come from the shared server's ``solo`` instance
    (the trials' options, no fault), which serves nothing else and is asked one prompt at a time. ``model``: the
    real engine's GGUF (None: its default); ``threads``: its threads per runner."""
    solo = Solo(url, SOLO, SOLO_TOKENS if engine == "debug" else REAL_TOKENS, SAMPLING)
    if engine == "debug":
        # 5 ms a step: a 64-token stream lasts 0.3 s, long enough that a cancel not heeded shows
        options = {**OPTIONS, "parallel": PARALLEL, "n_ctx": N_CTX, "token_seconds": 0.005}
        return Setup("debug", options, dict(DEADLINES), PROMPTS, dict(SAMPLING), solo, REFUSED_PROMPT)
    # The real engine on two shared cores: a step of 16 sequences is tens of ms, a load a second; hangs are still
    # found by the heartbeat. Deterministic, so that neither the batch nor the prompt cache may change a text.
    options = {"parallel": PARALLEL, "n_ctx": N_CTX, "n_threads": threads, "deterministic": True, "speculation": True}
    # warm-up times speculation's cost curve too (per thread count): seconds more on loaded cores
    deadlines = {**DEADLINES, "load_stall": 20.0, "warmup": 40.0, "first_token": 10.0, "token_gap": 5.0}
    # 8 prompts (16 streams ask each twice: equal prompts in one batch must give equal texts): half the solo runs.
    # 16 streams of 32 tokens take ~20 s here (2 shared cores, ~170 ms a step of 8): a request's bound is 60 s.
    # Half of them copy a line (speculation drafts them: see LINES); the solo instance does not speculate, so each
    # stream's text is held to the plain path's.
    prompts = PROMPTS[:4] + COPY_PROMPTS
    return Setup(
        "llama.cpp", options, deadlines, prompts, dict(SAMPLING), solo, REFUSED_PROMPT, REAL_REQUEST_BOUND, model
    )


def serve_args(engine: str, model: str | None = None, threads: int = REAL_THREADS) -> tuple[str, ...]:
    if engine == "debug":
        return ("--engine", "debug", "--name", "warm", "--parallel", str(PARALLEL), "--n-ctx", str(N_CTX))
    model_args = ("--model", model) if model else ()
    return ("--engine", "llama.cpp", "--name", "warm", "--parallel", str(PARALLEL), "--n-ctx", str(N_CTX),
            "--threads", str(threads), "--deterministic", "--speculation", *model_args)  # fmt: skip


def plan(seed: int, trials: int, only: Only = None, engine: str = "debug") -> list[Trial]:
    attacks = DEBUG_ATTACKS if engine == "debug" else REAL_ATTACKS
    return engine_plan(
        seed, trials, only, target=NAME, attacks=attacks, streams_choice=STREAMS, engine=engine, real_tokens=REAL_TOKENS
    )


async def _create_solo(url: str, trial_setup: Setup) -> None:
    options = dict(trial_setup.options)
    if trial_setup.engine == "llama.cpp":  # the plain path: every trial's drafts are held to it
        options["speculation"] = False
    config = {"id": SOLO, "engine": trial_setup.engine, "options": options}
    if trial_setup.model is not None:
        config["model"] = trial_setup.model
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:
        created = await client.post("/v1/instances", json=config)
        if created.status_code != 201:
            raise RuntimeError(f"the solo instance was refused: {created.status_code} {created.text[:300]}")
        with anyio.fail_after(120):
            while not (await client.get(f"/v1/instances/{SOLO}")).json().get("ready"):
                await anyio.sleep(0.02)


async def run_campaign(
    seed: int,
    trials: int,
    *,
    only: Only = None,
    progress: Callable[[TrialResult], None] | None = None,
    engine: str = "debug",
    model: str | None = None,
    threads: int = REAL_THREADS,
) -> Report:
    """The batch campaign ``seed`` on ``engine`` (or only its trial ``only``); its servers are stopped before it
    returns. ``model``: the llama.cpp engine's GGUF (None: the default model); ``threads``: its threads per runner."""
    real = {"threads": threads, **({"model": model} if model else {})} if engine != "debug" else {}
    report = Report(seed, NAME, {"engine": engine, "parallel": PARALLEL, **real})
    began = time.monotonic()
    args = serve_args(engine, model, threads)
    with tempfile.TemporaryDirectory(prefix="tether-chaos-batch-") as tmp:
        workdir = Path(tmp)
        make = functools.partial(Target, workdir / "shared", serve=args, startup=120.0)
        target = await anyio.to_thread.run_sync(make)
        try:
            trial_setup = setup(engine, target.url, model, threads)
            await _create_solo(target.url, trial_setup)

            async def run(trial: Trial) -> TrialResult:
                if trial.attack.worker_signal is not None:
                    return await run_alone(trial, workdir, trial_setup, args)
                return await run_on(target, trial, trial_setup)

            warm = Trial(seed, -1, WARM_UP, "generating", PARALLEL, 1, 0.0, 8, NAME)
            await drive(report, target, warm, plan(seed, trials, only, engine), run, progress)
            report.extra["solo_prompts"] = len(trial_setup.solo.texts) if trial_setup.solo else 0
        finally:
            await anyio.to_thread.run_sync(target.stop)
    report.wall_s = time.monotonic() - began
    return report
