"""Per-slot KV cells (tether's default) against one unified pool, on the default model at the default context.

Usage: ``.venv/bin/python bench/kv_layout.py [--rounds 3] [--n-ctx 8192] [--threads 2]``.

A unified cache (``kv_unified: true``) lets every sequence use any cell, so one long prompt could take the cells
short ones leave, and a prefix copied between slots is metadata only; but each sequence's attention then runs over
the whole pool's mask. Both layouts hold the same ``parallel x n_ctx`` cells here (the memory is the same): this
measures what the layout alone costs. Each round loads an engine of each layout in turn (interleaved: this machine is
noisy) and times, in process (no HTTP): one sequence decoding 128 tokens (c1), eight at once with distinct ~250-token
prompts (c8: prefill then decode), and a prefix shared by eight prompts copied between slots (prompt cache on).
Prints one JSON object last: the medians and the unified/per-slot ratios (> 1: unified faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from benchstats import emit
from tether.engines import create_engine
from tether.engines.base import RequestError
from tether.protocol import EngineSpec, GenerateParams

TOPICS = ["rivers", "mountains", "bread", "trains", "bees", "clocks", "glass", "maps"]


def prompt(topic: str, words: int = 180) -> str:
    filler = " ".join(f"{topic} note {i}." for i in range(words // 3))
    return f"Here are notes about {topic}: {filler} Now write a short essay about {topic}."


def run(engine: Any, requests: list[GenerateParams]) -> tuple[float, float, int]:
    """Start every request at once and step until all end: (seconds to every first token, seconds in all, tokens)."""
    ids = [f"r{i}" for i in range(len(requests))]
    for seq_id, params in zip(ids, requests, strict=True):
        engine.start(seq_id, params)
    started = time.perf_counter()
    first: dict[str, float] = {}
    ended: set[str] = set()
    tokens = 0
    while len(ended) < len(ids):
        for seq_id, result in engine.step():
            if isinstance(result, RequestError):
                raise RuntimeError(f"{seq_id}: {result}")
            tokens += result.tokens
            if result.tokens and seq_id not in first:
                first[seq_id] = time.perf_counter() - started
            if result.finish_reason is not None:
                ended.add(seq_id)
    return max(first.values()), time.perf_counter() - started, tokens


def measure(unified: bool, n_ctx: int, threads: int) -> dict[str, float]:
    options = {"n_ctx": n_ctx, "n_threads": threads, "adaptive_threads": False, "kv_unified": unified}
    engine: Any = create_engine(EngineSpec(engine="llama.cpp", options={**options, "prompt_cache": False}))
    engine.load(lambda fraction, what: None)
    try:
        engine.warmup()
        one = GenerateParams(prompt=prompt("tea"), max_tokens=128, temperature=0.0, stop=("\u0000",))
        _, c1_s, c1_tokens = run(engine, [one])
        eight = [GenerateParams(prompt=prompt(t), max_tokens=128, temperature=0.0) for t in TOPICS]
        c8_first, c8_s, c8_tokens = run(engine, eight)
    finally:
        engine.close()
    cached: Any = create_engine(EngineSpec(engine="llama.cpp", options=options))
    cached.load(lambda fraction, what: None)
    try:
        shared = prompt("ships", 450)
        run(cached, [GenerateParams(prompt=shared, max_tokens=1)])  # the prefix, in slot 0
        again = [GenerateParams(prompt=f"{shared} Mention {t}.", max_tokens=1) for t in TOPICS[:7]]
        copy_first, _, _ = run(cached, again)  # each of 7 other slots copies it, then prefills its tail
    finally:
        cached.close()
    return {
        "c1_tokens_per_s": c1_tokens / c1_s,
        "c8_tokens_per_s": c8_tokens / c8_s,
        "c8_all_first_token_s": c8_first,
        "copy_prefix_all_first_token_s": copy_first,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-ctx", type=int, default=8192, help="cells per sequence (the default model's default)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    started = time.monotonic()
    runs: dict[str, list[dict[str, float]]] = {"per_slot": [], "unified": []}
    for r in range(args.rounds):
        for layout in ("per_slot", "unified") if r % 2 == 0 else ("unified", "per_slot"):
            runs[layout].append(measure(layout == "unified", args.n_ctx, args.threads))
            print(layout, json.dumps({k: round(v, 3) for k, v in runs[layout][-1].items()}), flush=True)
    summary: dict[str, Any] = {"bench": "kv_layout", "n_ctx": args.n_ctx, "parallel": 8, "rounds": args.rounds}
    for layout, results in runs.items():
        for key in results[0]:
            summary[f"{layout}_{key}"] = round(statistics.median(r[key] for r in results), 3)
    for key in ("c1_tokens_per_s", "c8_tokens_per_s"):
        summary[f"unified_over_per_slot_{key}"] = round(summary[f"unified_{key}"] / summary[f"per_slot_{key}"], 3)
    for key in ("c8_all_first_token_s", "copy_prefix_all_first_token_s"):  # a time: per-slot over unified
        summary[f"unified_speedup_{key}"] = round(summary[f"per_slot_{key}"] / summary[f"unified_{key}"], 3)
    summary["wall_s"] = round(time.monotonic() - started, 1)
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
