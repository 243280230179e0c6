"""One-off: turn the figures the README kept (its "## Figures" section at README_REV) into bench/results/*.jsonl.

Each JSON line becomes a record whose ``result`` is the line exactly as the README kept it; its commit and date are
those of the commit that added the line to the README (``git log -S``), its command the one the prose gives. A few
figures the docs cite exist only as a table or in prose: they become records saying so, every number checked to
appear in the section's text. Run once from the repository root; not part of the build.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

README_REV = "823e06a"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MACHINE = (
    "development VM: 2 vCPUs, 24 GiB RAM; noisy (Intel Sapphire Rapids per the Makefile's AMX note; the run did not "
    "record its CPU)"
)
PY = ".venv/bin/python bench/"

# In the order the JSON lines appear in the section: (id, command, what the prose adds about this run).
LINES: list[tuple[str, str, str]] = [
    ("ranks-ring", PY + "ranks.py", ""),
    ("ranks-llamacpp", PY + "ranks.py --sides llamacpp", ""),
    ("cluster", PY + "cluster.py", ""),
    ("swap", PY + "swap.py", ""),
    ("ipc", PY + "ipc.py", "the prose: run after the move to one package per process side"),
    ("orphan_exit", PY + "orphan_exit.py", "the prose: the first run of that session"),
    ("detect", PY + "detect.py", ""),
    (
        "chaos-single-1000",
        PY + "chaos.py --trials 1000 --seed 0",
        "the prose: this run predates a fix to the campaign's own orphan check (ServeChild.runners() never matched "
        "a runner; the runners' cgroups still counted any orphan)",
    ),
    ("chaos-batch-llamacpp-1000", PY + "chaos.py --target batch --engine llama.cpp --trials 1000 --seed 0", ""),
    ("chaos-ranks-300", PY + "chaos.py --target ranks --trials 300 --seed 0", ""),
    ("chaos-ranks-llamacpp-100", PY + "chaos.py --target ranks --engine llama.cpp --trials 100 --seed 0", ""),
    ("chaos-cluster-ranks-100", PY + "chaos.py --target cluster-ranks --trials 100 --seed 0", ""),
    ("chaos-cluster-300", PY + "chaos.py --target cluster --trials 300 --seed 0", ""),
    ("chaos-models-1000", PY + "chaos.py --target models --trials 1000 --seed 0", ""),
    (
        "fuzz",
        PY + "fuzz.py --examples 200 --seed 0",
        "the prose beside it in the README (statuses, 194 s, the transport table) describes a later run, kept as "
        "fuzz-prose-33d642e",
    ),
    ("load", PY + "load.py", ""),
    (
        "soak-30min",
        PY + "soak.py --minutes 30",
        "abridged in the README: the per-window list and a few counters left out (the prose says so)",
    ),
    (
        "soak-gc0-15min",
        PY + "soak.py --minutes 15 --no-tracemalloc --gc-interval 0",
        "abridged in the README: windows and fault tables left out (the prose says so)",
    ),
    (
        "soak-gc5-15min",
        PY + "soak.py --minutes 15 --no-tracemalloc",
        "abridged in the README: windows and fault tables left out (the prose says so); run right after soak-gc0-15min",
    ),
    ("soak-batch-120min", PY + "soak.py --target batch --minutes 120 --no-tracemalloc", ""),
    ("memory", PY + "memory.py", ""),
    ("hang", PY + "hang.py", ""),
    ("cancel", PY + "cancel.py", ""),
    ("serve-cpu-hog", PY + "serve.py --cpu-hog --rounds 1 --workloads distinct --variants --concurrency 1 8", ""),
    ("serve-issue32", PY + "serve.py --rounds 2", ""),
    ("serve-three-servers", PY + "serve.py", "then the default sides were all three servers"),
    ("serve-variants", PY + "serve.py --sides tether llama_server --variants logprobs json_schema", ""),
]

# The 120-minute soak's prose names the tree it ran on.
MEASURED_ON = {"soak-batch-120min": "d2ea915"}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def section() -> str:
    readme = git("show", f"{README_REV}:README.md")
    return readme[readme.index("\n## Figures\n") + 1 :]


def added_by(text: str) -> tuple[str, str, str]:
    """The commit that added ``text`` to the README: full sha, author date, subject."""
    found = git("log", "-S", text, "--format=%H %aI %s", README_REV, "--", "README.md").splitlines()
    if len(found) != 1:
        sys.exit(f"expected one commit adding {text[:60]!r}, found {len(found)}")
    sha, date, subject = found[0].split(" ", 2)
    return sha, date, subject


def readme_only(sha: str) -> bool:
    return git("show", "--format=", "--name-only", sha).split() == ["README.md"]


def provenance(sha: str, date: str, kind: str, note: str) -> str:
    short, parent = sha[:7], git("rev-parse", "--short=7", f"{sha}^")
    same = " (it changed only README.md: both hold the same code)" if readme_only(sha) else ""
    text = (
        f"{kind} recorded in the README by {short} on {date[:10]}; measured on that tree or its parent {parent}{same}"
    )
    return text + (f"; {note}" if note else "")


def record(
    rid: str, bench: str, sha: str, date: str, command: str, prov: str, result: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "bench": bench,
        "commit": sha,
        "date": date,
        "machine": MACHINE,
        "command": command,
        "provenance": prov,
        "result": result,
    }


def json_records(text: str) -> list[dict[str, Any]]:
    lines = [line for line in text.splitlines() if line.startswith('{"bench"')]
    if len(lines) != len(LINES):
        sys.exit(f"{len(lines)} JSON lines in the section, {len(LINES)} described")
    out = []
    for line, (name, command, note) in zip(lines, LINES, strict=True):
        sha, date, _ = added_by(line)
        result = json.loads(line)
        prov = provenance(sha, date, "JSON line", note)
        commit = sha
        if name in MEASURED_ON:
            commit = git("rev-parse", MEASURED_ON[name])
            prov = (
                f"JSON line recorded in the README by {sha[:7]} on {date[:10]}; measured on {commit[:7]} "
                "(the prose: run from a worktree of it, without that session's later changes)"
            )
        out.append(record(f"{name}-{sha[:7]}", result["bench"], commit, date, command, prov, result))
    return out


def number(cell: str) -> float | int:
    value = cell.strip().strip("*").replace(",", "").split()[0]
    return float(value) if "." in value else int(value)


def table_rows(text: str, first_cells: list[str]) -> list[list[str]]:
    rows = []
    for first in first_cells:
        line = next(x for x in text.splitlines() if x.startswith(f"| {first} |"))
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def orphan_table(text: str) -> dict[str, Any]:
    names = {
        "default (all three layers)": "default",
        "pdeathsig alone": "pdeathsig",
        "lifeline pipe alone": "lifeline",
        "parent-pid poll alone (0.5 s)": "poll",
        "seed: parent-pid poll every 5 s": "seed",
    }
    out: dict[str, Any] = {}
    for row in table_rows(text, list(names)):
        out[names[row[0]]] = {"p50_ms": number(row[1]), "p99_ms": number(row[2]), "group_p99_ms": number(row[3])}
    (worker,) = table_rows(text, ["*the SIGKILLed worker's own exit*"])
    out["worker_exit"] = {"p50_ms": number(worker[1]), "p99_ms": number(worker[2])}
    out["drill"] = {"processes": 700, "survivors": 0, "last_exit_p50_ms": 10.2, "last_exit_p99_ms": 14.4}
    return out


def chaos_text_table(text: str) -> dict[str, Any]:
    block = text[text.index("```text\nattack") + len("```text\n") :]
    lines = block[: block.index("```")].splitlines()
    phases = lines[0].split()[1:-1]
    per_attack: dict[str, dict[str, list[int]]] = {}
    for line in lines[1:]:
        cells = line.split()
        per_attack[cells[0]] = {
            phase: [int(x) for x in cell.split("/")]
            for phase, cell in zip(phases, cells[1:-1], strict=True)
            if cell != "-"
        }
    return {"per_attack": per_attack}


def k(n: int) -> list[int]:
    return [n, n]


# Per-attack counts the prose gives (kept / drawn), in its own words; keyed by the campaign's record name.
PROSE_ATTACKS: dict[str, tuple[str, dict[str, dict[str, list[int]]], str]] = {
    "chaos-batch-llamacpp-1000": (
        "sigkill 117/117",
        {
            "sigkill": {"all": k(117)},
            "sigstop": {"all": k(109)},
            "worker SIGKILL": {"all": k(101)},
            "worker SIGTERM": {"all": k(100)},
            "clients gone": {"all": k(116)},
            "cancel storms": {"all": k(117)},
            "one stream cancelled": {"all": k(113)},
            "one client gone": {"all": k(116)},
            "one request refused alone": {"all": k(111)},
        },
        "",
    ),
    "chaos-ranks-300": (
        "sigkill\n  80/80",
        {"sigkill": {"all": k(80)}, "oom": {"all": k(83)}, "sigstop": {"all": k(67)}, "held_port": {"all": k(70)}},
        "",
    ),
    "chaos-ranks-llamacpp-100": (
        "Per attack: sigkill 27/27",
        {"sigkill": {"all": k(27)}, "sigstop": {"all": k(36)}, "held_port": {"all": k(37)}},
        "",
    ),
    "chaos-cluster-ranks-100": (
        "sigkill 22/22, oom 27/27",
        {"sigkill": {"all": k(22)}, "oom": {"all": k(27)}, "sigstop": {"all": k(29)}, "held_port": {"all": k(22)}},
        "",
    ),
    "chaos-cluster-300": (
        "agent SIGKILL 35/35",
        {
            "agent SIGKILL": {"all": k(35)},
            "agent SIGSTOP past the lease": {"all": k(49)},
            "agent SIGSTOP shorter": {"all": k(50)},
            "coordinator SIGKILL": {"all": k(43)},
            "coordinator SIGSTOP past the lease": {"all": k(45)},
            "raylet SIGKILL": {"all": k(35)},
            "node removed and re-added": {"all": k(43)},
        },
        "",
    ),
    "chaos-models-1000": (
        "sigkill 71/71 while evicted",
        {
            "sigkill": {"while evicted": k(71), "loading": k(53), "unloading": k(60)},
            "sigstop": {"while evicted": k(74), "loading": k(69), "unloading": k(52)},
            "a load that OOMs": {"all": k(194)},
            "worker SIGKILL": {"mid-eviction": k(112), "mid-load": k(99)},
            "requests racing loads and unloads alone": {"all": k(216)},
        },
        "the prose first gave these counts for the run before, same seed (01e2ab5, which broke no trial either), "
        "and kept them for this one at 7ce1264; the seed draws the same trials",
    ),
}


def leaves(value: Any) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in leaves(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def check_numbers(rid: str, result: dict[str, Any], text: str) -> None:
    """Every number of a table-only record appears in the README's text, in one of the ways it writes numbers."""
    for v in leaves(result):
        shown = {str(v), f"{v:,}", f"{v:,.1f}", f"{v:,.2f}", f"{v:,.0f}", f"{v:.2f}"}
        if not any(s in text for s in shown):
            sys.exit(f"{rid}: {v} is not in the README's text")


def table_records(text: str, by_name: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []

    def add(
        rid: str,
        bench: str,
        anchor: str,
        command: str,
        note: str,
        result: dict[str, Any],
        kind: str = "table only, no JSON line kept:",
        run: dict[str, Any] | None = None,
    ) -> None:
        """``anchor``: text the README added with these figures; ``run``: the JSON line's record of the same run,
        whose commit and date the figures share."""
        sha, date, _ = added_by(anchor)
        check_numbers(rid, result, text)
        if run is None:
            out.append(record(f"{rid}-{sha[:7]}", bench, sha, date, command, provenance(sha, date, kind, note), result))
            return
        prov = (
            f"{kind} recorded in the README by {sha[:7]} on {date[:10]}, of the same run as {run['id']} (its commit "
            f"and date are this record's; see its provenance); {note}"
        )
        out.append(
            record(f"{rid}-{run['id'].rsplit('-', 1)[1]}", bench, run["commit"], run["date"], command, prov, result)
        )

    add(
        "orphan_exit-table",
        "orphan_exit",
        "| default (all three layers) | 3.78 ms",
        PY + "orphan_exit.py",
        "the README's table, p50 / p99 / every process it started p99 per "
        "configuration, and the survivor drill's figures from the prose",
        orphan_table(text),
        run=by_name["orphan_exit"],
    )
    add(
        "chaos-single-1000-attacks",
        "chaos",
        "sigkill                4/4",
        PY + "chaos.py --trials 1000 --seed 0",
        "the campaign's own table: trials kept / drawn per attack and moment",
        chaos_text_table(text),
        run=by_name["chaos-single-1000"],
    )
    for name, (anchor, attacks, note) in PROSE_ATTACKS.items():
        rec = by_name[name]
        add(
            f"{name}-attacks",
            "chaos",
            anchor,
            rec["command"],
            "trials kept / drawn per attack (and moment, where given), in the prose's words"
            + (f"; {note}" if note else ""),
            {"per_attack": attacks},
            kind="prose only, no JSON line kept:",
            run=rec,
        )
    ab_anchor = "630,867; 93,503"
    add(
        "ipc-rebuild-ab",
        "ipc",
        ab_anchor,
        PY + "ipc.py",
        "the serving wing's rebuild, this tree then the tree before it (a79e07b), back to back in one session",
        {
            "now": {"tether_events_per_s": 630867, "tether_supervisor_events_per_s": 93503, "ratio": 110.7},
            "before": {"tether_events_per_s": 710443, "tether_supervisor_events_per_s": 88777, "ratio": 104.8},
        },
    )
    add(
        "detect-rebuild-ab",
        "detect",
        ab_anchor,
        PY + "detect.py",
        "the serving wing's rebuild, this tree then the tree before it (a79e07b), back to back in one session",
        {"now": {"p50_ms": 4.62, "p99_ms": 7.2}, "before": {"p50_ms": 4.61, "p99_ms": 7.32}},
    )
    add(
        "serve-rebuild-ab",
        "serve",
        ab_anchor,
        PY + "serve.py --sides tether llama_server --concurrency 8",
        "the serving wing's rebuild, this tree then the tree before it (a79e07b), back to back in one session",
        {
            "now": {
                "tether_tokens_per_s_c8": 134.8,
                "llama_server_tokens_per_s_c8": 133.9,
                "tokens_per_s_ratio_vs_llama_server_c8": 1.01,
                "tether_ttft_p50_ms_c8": 253,
                "llama_server_ttft_p50_ms_c8": 599,
                "tether_itl_p99_ms_c8": 177,
            },
            "before": {
                "tether_tokens_per_s_c8": 127.1,
                "llama_server_tokens_per_s_c8": 141.5,
                "tokens_per_s_ratio_vs_llama_server_c8": 0.9,
                "tether_ttft_p50_ms_c8": 289,
                "llama_server_ttft_p50_ms_c8": 615,
                "tether_itl_p99_ms_c8": 183,
            },
        },
    )
    add(
        "fuzz-prose",
        "fuzz",
        "194 s in all",
        PY + "fuzz.py --examples 200 --seed 0",
        "the fuzzer's default run after the serving wing's rebuild, with its transport-abuse table (first "
        "token of a healthy stream during each abuse)",
        {
            "examples": 6009,
            "examples_positive": 3809,
            "examples_negative": 2200,
            "operations": 28,
            "unexpected_5xx": 0,
            "nonconforming": 0,
            "dropped_connections": 0,
            "statuses": {"200": 1899, "201": 3, "400": 2292, "404": 1729, "409": 86},
            "exit_status": 0,
            "wall_s": 194,
            "header_cases": 5600,
            "header_cases_by_class": {
                "loopback": 2541,
                "foreign_host": 1920,
                "foreign_origin": 747,
                "malformed_host": 392,
            },
            "header_served_foreign": 0,
            "header_refused_loopback": 0,
            "healthy_first_token_idle_p50_ms": 5.8,
            "first_token_bound_s": 2,
            "transport": {
                "slowloris": {"connections": 1000, "healthy_first_token_ms": 7.6, "fds_before": 15, "fds_after": 15},
                "half_bodies": {"connections": 50, "healthy_first_token_ms": 3.5, "fds_before": 15, "fds_after": 15},
                "invalid_http": {
                    "connections": 50,
                    "healthy_first_token_ms": 6.2,
                    "answers": {"400": 33, "404": 17},
                    "fds_before": 15,
                    "fds_after": 15,
                },
                "oversized_headers": {
                    "requests": 10,
                    "healthy_first_token_ms": 4.5,
                    "answers": {"400": 10},
                    "fds_before": 15,
                    "fds_after": 15,
                },
                "never_reading": {"streams": 8, "healthy_first_token_ms": 381, "fds_before": 15, "fds_after": 15},
            },
        },
        kind="prose only, no JSON line kept:",
    )
    add(
        "cluster-stream-issue32-a",
        "cluster",
        "**`stream_ratio` 0.96**",
        PY + "cluster.py --stream-rounds 1 --rounds 1 --requests 10",
        "the first of two runs after the node agent began relaying two tokens an item (issue 32)",
        {
            "stream_ratio": 0.96,
            "cluster_tokens_per_s": 84.39,
            "local_tokens_per_s": 87.78,
            "cluster_ttft_p50_ms": 87,
            "local_ttft_p50_ms": 79,
        },
        kind="prose only, no JSON line kept:",
    )
    add(
        "cluster-stream-issue32-b",
        "cluster",
        "**`stream_ratio` 0.96**",
        PY + "cluster.py --stream-rounds 4 --rounds 2",
        "the second run, the same code, this machine's speed changing between its rounds (local 88-101 "
        "tokens/s in round 0, 102-115 in round 3)",
        {"stream_ratio": 0.81, "cluster_tokens_per_s": 80.99, "local_tokens_per_s": 99.61},
        kind="prose only, no JSON line kept:",
    )
    add(
        "serve-no-hog",
        "serve",
        "Without the hog, the same command less",
        PY + "serve.py --rounds 1 --workloads distinct --variants --concurrency 1 8",
        "the cpu-hog run's command less --cpu-hog (tether at --threads 2, the thread governor on)",
        {
            "tokens_per_s_distinct_c1": 74.7,
            "llama_server_tokens_per_s_distinct_c1": 76.9,
            "tokens_per_s_ratio_vs_llama_server_distinct_c1": 0.971,
            "tokens_per_s_distinct_c8": 157.4,
            "llama_server_tokens_per_s_distinct_c8": 150.6,
            "tokens_per_s_ratio_vs_llama_server_distinct_c8": 1.045,
        },
        kind="prose only, no JSON line kept:",
    )
    windows = table_rows(text, ["RSS, MiB"])[0][1:]
    minutes = [5 * (i + 1) for i in range(12)]
    low, high = (float(x) for x in windows[-1].split("\u2013"))
    add(
        "soak-batch-120min-rss",
        "soak",
        "| RSS, MiB | 58.7",
        PY + "soak.py --target batch --minutes 120 --no-tracemalloc",
        "the worker's RSS at the end of each 5-minute window; the last 12 windows given as a range only",
        {
            "window_minutes": minutes,
            "rss_mib": [float(x) for x in windows[:12]],
            "later_windows": {"minutes": [65, 120], "rss_mib_min": low, "rss_mib_max": high},
        },
        run=by_name["soak-batch-120min"],
    )
    return out


def main() -> int:
    text = section()
    records = json_records(text)
    by_name = {r["id"].rsplit("-", 1)[0]: r for r in records}
    records += table_records(text, by_name)
    RESULTS.mkdir(exist_ok=True)
    files: dict[str, list[str]] = {}
    for rec in records:
        files.setdefault(rec["bench"], []).append(json.dumps(rec, ensure_ascii=False))
    for bench, lines in files.items():
        (RESULTS / f"{bench}.jsonl").write_text("\n".join(lines) + "\n")
    for rec in records:
        print(f"{rec['bench']:12} {rec['id']:40} {rec['provenance'][:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
