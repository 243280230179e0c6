"""What ``--deterministic`` costs: ``bench/serve.py``'s tether side with and without it, on each model family.

Each round runs ``bench/serve.py --rounds 1 --sides tether`` twice per family, once plain and once with
``--deterministic`` (the order alternating from round to round, so a slow stretch of a noisy machine falls on both),
on every workload (``distinct``, ``shared_prefix``, ``multi_turn``) at concurrency 1, 4 and 8. Per family, workload
and concurrency: the median over the rounds of each mode's aggregate output tokens/s, and ``ratio`` = deterministic
over plain (1.0: free; the option becomes the default only if every ratio is at least ``DEFAULT_IF``).

Shorter than serve.py's defaults so that both families fit in one sitting (two cores: ~25 min with 2 rounds):
``max_tokens`` 64, ``multi_turn`` 8 conversations of 4 turns. Gemma 3 270M is a base model: its chats are written
with the built-in ``gemma`` template. Run: ``.venv/bin/python bench/deterministic_cost.py [--rounds N]``; the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchstats import RECORD_ENV, emit

SERVE = Path(__file__).resolve().parent / "serve.py"
WORKLOADS = ("distinct", "shared_prefix", "multi_turn")
CONCURRENCY = (1, 4, 8)
DEFAULT_IF = 0.95  # the rule: the default only if it costs at most 5 % tokens/s everywhere
FAMILIES = {"smollm2": (), "gemma3-270m": ("--model", "gemma3-270m", "--chat-template", "gemma")}
SHAPE = ("--max-tokens", "64", "--conversations", "8", "--turns", "4", "--requests", "16")


def serve_once(family: str, deterministic: bool) -> dict[str, Any]:
    argv = [sys.executable, str(SERVE), "--rounds", "1", "--sides", "tether", "--variants", "--no-build", *SHAPE]
    argv += ["--workloads", *WORKLOADS, "--concurrency", *map(str, CONCURRENCY), *FAMILIES[family]]
    argv += ["--deterministic"] if deterministic else []
    env = {k: v for k, v in os.environ.items() if k != RECORD_ENV}  # this bench records the pair, not each run
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        sys.exit(f"{' '.join(argv)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    if result.get("error") or result.get("skipped"):
        sys.exit(f"{family}: serve.py says {result.get('error') or result.get('skipped')}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default both)")
    args = parser.parse_args()
    began = time.monotonic()
    keys = [f"tokens_per_s_{w}_c{c}" for w in WORKLOADS for c in CONCURRENCY]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for rnd in range(args.rounds):
        for family in args.families.split(","):
            for deterministic in (rnd % 2 == 1, rnd % 2 == 0):
                result = serve_once(family, deterministic)
                runs.setdefault(family, {}).setdefault("on" if deterministic else "off", []).append(result)
                shown = "  ".join(f"{k.removeprefix('tokens_per_s_')}={result.get(k)}" for k in keys)
                print(f"round {rnd} {family} deterministic={deterministic}: {shown}", file=sys.stderr, flush=True)
    families: dict[str, Any] = {}
    ratios: list[float] = []
    for family, modes in runs.items():
        medians = {
            mode: {k: statistics.median(r[k] for r in results if r.get(k) is not None) for k in keys}
            for mode, results in modes.items()
        }
        ratio = {k: round(medians["on"][k] / medians["off"][k], 3) for k in keys if medians["off"][k]}
        ratios += ratio.values()
        families[family] = {"off": medians["off"], "on": medians["on"], "ratio": ratio}
    lowest = min(ratios) if ratios else None
    emit(
        {
            "bench": "deterministic_cost",
            "rounds": args.rounds,
            "shape": " ".join(SHAPE),
            "families": families,
            "min_ratio": lowest,
            "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
            "default_if": DEFAULT_IF,
            "would_be_default": lowest is not None and lowest >= DEFAULT_IF,
            "seconds": round(time.monotonic() - began, 1),
        }
    )


if __name__ == "__main__":
    main()
