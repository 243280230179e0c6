"""How often a greedy text, and its logprobs, differ from the same request's alone: with and without ``deterministic``.

Each configuration (a model family, the option on or off) runs in a child process of its own (a deterministic
engine loads another build of llama.cpp) and drives the engine's step loop directly, so arrivals, cancellations and
contention land at chosen steps. Every request is greedy with ``logprobs`` and is compared with its reference, the
same request run alone on a cold engine with nothing cached: the same text, and every token's logprob bit for bit
(a request cancelled midway: a prefix of both). The scenarios, ``--requests`` each (default 200):

* ``arrivals``: rounds of 8 requests, each arriving at a random step while the ones before it decode (1 to 7);
* ``prefix_copies``: rounds of 4 requests that share one of 6 long system prompts, arriving at random steps, so a
  prompt's prefix is copied from a busy slot, or restored from RAM after other prompts took the slots (a small RAM
  store, so entries are evicted too); one request of each round is cancelled at a random step, often while another
  copies from its slot;
* ``together``: rounds of 8 requests that arrive at once;
* ``thread_switch``: rounds of 8 requests, with two busy-looping processes started at a random step and stopped
  later, so the thread governor steps down to one thread mid-stream and back (its switches are counted).

Engine options are the defaults (prompt cache on, 8 sequences, adaptive threads) on a 1024-token context.
Run: ``.venv/bin/python bench/determinism.py``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

QUESTIONS = (
    "Name three rivers in Europe and say one thing about each.",
    "What is a prime number? Give a few examples.",
    "Describe how bread is baked.",
    "Why do cats purr?",
    "Explain gravity to a child.",
    "List the planets in order from the sun.",
    "What makes the sea salty?",
    "How does a bicycle stay upright?",
    "Write a short poem about autumn leaves.",
    "What is the difference between weather and climate?",
    "Give three tips for learning a new language.",
    "How do bees make honey?",
    "What is photosynthesis?",
    "Describe a busy market in the morning.",
    "Why is the sky blue?",
    "How do vaccines work?",
    "Explain what a computer program is.",
    "What are clouds made of?",
    "Tell me about the moon's phases.",
    "How do trains run on tracks?",
    "What is a volcano?",
    "Describe the taste of a lemon.",
    "Why do leaves change colour in autumn?",
    "How is paper made?",
)
QUALITIES = ("clear", "kind", "brief", "accurate", "honest", "careful", "friendly", "patient") * 3
SYSTEMS = tuple(  # ~300 tokens each
    f"You are assistant number {i}, who works for a {kind}. "
    + " ".join(f"Rule {j}: always be {quality} when answering about {kind}s." for j, quality in enumerate(QUALITIES))
    for i, kind in enumerate(("library", "bakery", "harbour", "school", "garden", "museum"))
)
TOKENS = 32
SCENARIOS = ("arrivals", "prefix_copies", "together", "thread_switch")


@dataclass
class Tally:
    requests: int = 0
    divergent_texts: int = 0
    divergent_logprobs: int = 0  # the text the same, a logprob not bit-identical
    cancelled: int = 0
    cached_tokens: int = 0  # prompt tokens whose cells came from the prompt cache
    examples: list[str] = field(default_factory=list)


class Driver:
    """The engine in this process, its references, and the rounds that attack them."""

    def __init__(self, family: str, deterministic: bool) -> None:
        from tether.engines import create_engine
        from tether.models import PACKAGED, default_model_path, pulled_path
        from tether.protocol import EngineSpec

        self.chat = family == "smollm2"
        path = default_model_path() if self.chat else pulled_path(PACKAGED["gemma3-270m"])
        base = {"n_ctx": 1024, "deterministic": deterministic}
        # the prompt cache RAM store holds a few of the long system prompts: later rounds restore and evict
        self.engine = create_engine(EngineSpec(model=str(path), options={**base, "prompt_cache_ram": "24M"}))
        self.engine.load(lambda fraction, detail: None)
        self.engine.warmup()
        self.cold = create_engine(EngineSpec(model=str(path), options={**base, "prompt_cache": False}))
        self.cold.load(lambda fraction, detail: None)
        self.cold.warmup()
        self.references: dict[tuple[str, str], tuple[str, tuple[float, ...]]] = {}
        self.switches = 0
        self.n = 0

    def params(self, system: str, question: str) -> Any:
        from tether.protocol import ChatMessage, GenerateParams

        if self.chat:
            messages = (*((ChatMessage("system", system),) if system else ()), ChatMessage("user", question))
            return GenerateParams(messages=messages, max_tokens=TOKENS, temperature=0.0, logprobs=0)
        prompt = f"{system}\n\nQuestion: {question}\nAnswer:" if system else f"Question: {question}\nAnswer:"
        return GenerateParams(prompt=prompt, max_tokens=TOKENS, temperature=0.0, logprobs=0)

    def reference(self, system: str, question: str) -> tuple[str, tuple[float, ...]]:
        key = (system, question)
        if key not in self.references:
            deltas = list(self.cold.generate(self.params(system, question), lambda: False))
            self.references[key] = _key(deltas)
        return self.references[key]

    def round(self, tally: Tally, arrivals: list[tuple[int, str, str]], cancel: tuple[int, int] | None = None,
              contention: tuple[int, int] | None = None) -> None:  # fmt: skip
        """Start request i at step ``arrivals[i][0]``; cancel request ``cancel[1]`` at step ``cancel[0]``; two
        busy loops from step ``contention[0]`` to ``contention[1]``. Step until all have ended; tally each."""
        ids = [f"r{self.n}-{i}" for i in range(len(arrivals))]
        self.n += 1
        deltas: dict[str, list[Any]] = {seq: [] for seq in ids}
        ended: set[str] = set()
        cancelled: set[str] = set()
        started: set[str] = set()
        busy: list[subprocess.Popen[bytes]] = []
        step = 0
        try:
            while len(ended) < len(ids):
                for i, (at, system, question) in enumerate(arrivals):
                    if at == step:
                        self.engine.start(ids[i], self.params(system, question))
                        started.add(ids[i])
                victim = ids[cancel[1]] if cancel is not None else ""
                if cancel is not None and step >= cancel[0] and victim in started and victim not in ended:
                    self.engine.drop(victim)  # at its step, or as soon as it has started when it arrives later
                    ended.add(victim)
                    cancelled.add(victim)
                if contention is not None and step == contention[0]:
                    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
                if contention is not None and step == contention[1]:
                    _stop(busy)
                for seq, result in self.engine.step():
                    if seq in cancelled:
                        continue
                    deltas[seq].append(result)
                    if result.finish_reason is not None:
                        ended.add(seq)
                step += 1
                if step > 100_000:
                    raise RuntimeError(f"round {self.n} did not end in 100000 steps")
        finally:
            _stop(busy)
        for i, seq in enumerate(ids):
            _, system, question = arrivals[i]
            text, logprobs = _key(deltas[seq])
            ref_text, ref_logprobs = self.reference(system, question)
            tally.requests += 1
            tally.cached_tokens += sum(getattr(d, "cached_tokens", 0) or 0 for d in deltas[seq])
            if seq in cancelled:
                tally.cancelled += 1
                same_text = ref_text.startswith(text)
                same_logprobs = ref_logprobs[: len(logprobs)] == logprobs
            else:
                same_text, same_logprobs = text == ref_text, logprobs == ref_logprobs
            if not same_text:
                tally.divergent_texts += 1
                if len(tally.examples) < 3:
                    tally.examples.append(f"{question!r}: {text[:60]!r} vs alone {ref_text[:60]!r}")
            elif not same_logprobs:
                tally.divergent_logprobs += 1


def _key(deltas: list[Any]) -> tuple[str, tuple[float, ...]]:
    return "".join(d.text for d in deltas), tuple(lp.logprob for d in deltas for lp in d.logprobs)


def _stop(busy: list[subprocess.Popen[bytes]]) -> None:
    for proc in busy:
        proc.kill()
        proc.wait()
    busy.clear()


class _Switches(logging.Handler):
    def __init__(self, driver: Driver) -> None:
        super().__init__()
        self.driver = driver

    def emit(self, record: logging.LogRecord) -> None:
        self.driver.switches += 1


def run_child(family: str, deterministic: bool, requests: int, seed: int) -> dict[str, Any]:
    began = time.monotonic()
    driver = Driver(family, deterministic)
    governor = logging.getLogger("tether.engines.llamacpp.threads")
    governor.setLevel(logging.INFO)
    governor.addHandler(_Switches(driver))
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    for scenario in SCENARIOS:
        tally = Tally()
        while tally.requests < requests:
            if scenario == "arrivals":
                steps = sorted(rng.randint(1, 40) for _ in range(7))
                arrivals = [(at, "", rng.choice(QUESTIONS)) for at in (0, *steps)]
                driver.round(tally, arrivals)
            elif scenario == "prefix_copies":
                system = rng.choice(SYSTEMS)
                steps = sorted(rng.randint(1, 30) for _ in range(3))
                arrivals = [(at, system, rng.choice(QUESTIONS)) for at in (0, *steps)]
                driver.round(tally, arrivals, cancel=(rng.randint(1, 40), rng.randrange(4)))
            elif scenario == "together":
                driver.round(tally, [(0, "", rng.choice(QUESTIONS)) for _ in range(8)])
            else:
                start = rng.randint(2, 12)
                arrivals = [(rng.randint(0, 30), "", rng.choice(QUESTIONS)) for _ in range(8)]
                driver.round(tally, arrivals, contention=(start, start + rng.randint(20, 50)))
        out[scenario] = vars(tally)
    out["thread_switches"] = driver.switches
    out["seconds"] = round(time.monotonic() - began, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per scenario (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", default="smollm2,gemma3-270m")
    parser.add_argument("--child", nargs=2, metavar=("FAMILY", "DETERMINISTIC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_child(args.child[0], args.child[1] == "1", args.requests, args.seed)
        print(json.dumps(result))
        return
    from benchstats import emit

    results: dict[str, Any] = {}
    for family in args.families.split(","):
        for deterministic in (False, True):
            argv = [sys.executable, __file__, "--child", family, "1" if deterministic else "0"]
            argv += ["--requests", str(args.requests), "--seed", str(args.seed)]
            done = subprocess.run(argv, capture_output=True, text=True, check=False, env=dict(os.environ))
            if done.returncode != 0:
                sys.exit(f"{family} deterministic={deterministic} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results.setdefault(family, {})["on" if deterministic else "off"] = result
            for scenario in SCENARIOS:
                t = result[scenario]
                print(
                    f"{family:>12} deterministic {'on ' if deterministic else 'off'} {scenario:>14}: "
                    f"{t['divergent_texts']}/{t['requests']} texts differ, {t['divergent_logprobs']} more logprobs "
                    f"only ({t['cancelled']} cancelled, {t['cached_tokens']} cached tokens)",
                    file=sys.stderr,
                    flush=True,
                )
    emit({"bench": "determinism", "requests_per_scenario": args.requests, "tokens": TOKENS, "results": results})


if __name__ == "__main__":
    main()
