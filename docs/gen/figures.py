"""The benchmarks page, its plots and the README's headline figures, drawn from the runs kept in bench/results.

Every figure the docs show is a record's: ``bench/results/<bench>.jsonl`` holds one record per run (written by
``bench/benchstats.py``'s ``emit`` with ``TETHER_BENCH_RECORD=1``: command, commit, date, machine, result), and
``bench/results/cited.toml`` says which records are cited, which of their keys as which labeled figures, and the words
around them. Numbers in those words are placeholders filled from the record, never typed: ``{p99_ms}`` is a dotted
path into the record's result, ``{seed_poll_p99_ms:,.0f}`` one with a format. A cited record that is missing, or a
placeholder naming a key its record lacks, fails the build with an error that says which and what to do.

``mkdocs build`` runs ``write_pages()`` (through docs/gen/pages.py): ``benchmarks/index.md`` and one PNG per plot
(matplotlib, Agg). ``.venv/bin/python docs/gen/figures.py --readme`` rewrites the README's block between
``<!-- figures:start -->`` and ``<!-- figures:end -->``; ``--check`` exits 1 when that block is stale. Both are what
tests/test_figures.py checks, so a figure is changed in one place: the record a spec entry cites.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import re
import statistics
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SPEC = RESULTS / "cited.toml"
README = ROOT / "README.md"
START, END = "<!-- figures:start -->", "<!-- figures:end -->"
PAGE = "benchmarks/index.md"
PLACEHOLDER = re.compile(r"\{(\w[\w.-]*)(?::([^{}]*))?\}")  # a key may have a hyphen: gemma3-270m

Record = dict[str, Any]


class FigureError(LookupError):
    """What the docs cite is not in bench/results (a record, a results file, a key of a record)."""


class MissingRecord(FigureError):
    """A record the docs cite is in no results file."""


def load_records(results: Path = RESULTS) -> dict[str, Record]:
    """Every record in ``results/*.jsonl`` by id; a malformed line, a record in the wrong file or an id used twice
    raises (a figure must have one source)."""
    records: dict[str, Record] = {}
    for path in sorted(results.glob("*.jsonl")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                rid, bench = record["id"], record["bench"]
            except (ValueError, KeyError, TypeError) as exc:
                raise FigureError(f"{_rel(path)}:{number}: not a record ({exc})") from exc
            if bench != path.stem:
                raise FigureError(f"{_rel(path)}:{number}: record {rid} is a {bench!r} run, in {path.name}")
            if rid in records:
                raise FigureError(f"{_rel(path)}:{number}: the id {rid} is used twice")
            records[rid] = record
    return records


def load_spec(path: Path = SPEC) -> dict[str, Any]:
    with path.open("rb") as f:
        return tomllib.load(f)


def cited(spec: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Each cited record id, with where the spec cites it."""
    for row in spec.get("headline", []):
        yield row["record"], f"headline {row['label']!r}"
    for section in spec["section"]:
        for run in section["run"]:
            yield run["record"], f"section {section['anchor']!r}"


def require(spec: dict[str, Any], records: dict[str, Record], results: Path = RESULTS) -> None:
    """Raise ``MissingRecord`` naming every cited record that no results file holds, and the file it belongs in
    (its bench: the id up to the first ``-``)."""
    missing = []
    for rid, where in cited(spec):
        if rid in records:
            continue
        path = results / f"{rid.split('-', 1)[0]}.jsonl"
        why = "no record with that id in it" if path.exists() else "the file does not exist"
        missing.append(f"  {rid} (cited by the {where}): {_rel(path)}: {why}")
    if missing:
        raise MissingRecord(
            f"the docs cite records that bench/results does not hold ({_rel(SPEC)}):\n"
            + "\n".join(missing)
            + "\nRecord the run (TETHER_BENCH_RECORD=1 .venv/bin/python bench/<bench>.py ...; see "
            "bench/benchstats.py), commit its results file, or cite a record that exists."
        )


def lookup(record: Record, path: str) -> Any:
    """The value at dotted ``path`` in the record's result (``trials.default``, ``samples_ms.seed``)."""
    value: Any = record["result"]
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise FigureError(f"record {record['id']} has no {path!r} (bench/results/{record['bench']}.jsonl)")
    return value


def show(value: Any, spec: str = "") -> str:
    """A value as the docs print it: thousands separated, booleans as yes/no, a missing figure as a dash."""
    if spec:
        return format(value, spec)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "—"
    if isinstance(value, float) and value.is_integer():
        return f"{int(value):,}"  # 5.0 s reads as 5 s
    if isinstance(value, int | float):
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(show(v) for v in value)
    if isinstance(value, dict):
        return "; ".join(f"{k}: {show(v)}" for k, v in value.items())
    return str(value)


def fill(text: str, record: Record, x: Any = None) -> str:
    """``text`` with every ``{path}`` / ``{path:format}`` replaced by the record's value (``{x}`` first by ``x``)."""
    if x is not None:
        text = text.replace("{x}", str(x))
    return PLACEHOLDER.sub(lambda m: show(lookup(record, m.group(1)), m.group(2) or ""), text)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _file(record: Record) -> str:
    return f"bench/results/{record['bench']}.jsonl"


# --- the page ---------------------------------------------------------------------------------------------------------


def page_markdown(spec: dict[str, Any], records: dict[str, Record]) -> str:
    """``benchmarks/index.md``: the headline figures, then a section per benchmark, each run with its command,
    commit, date, machine and provenance, its figures, its plot and the words around them."""
    require(spec, records)
    out = ["# Benchmarks", "", spec["page"]["intro"].strip(), "", "| figure | value |", "| --- | --- |"]
    for row in spec.get("headline", []):
        record = records[row["record"]]
        out.append(
            f"| [{_cell(fill(row['label'], record))}](#{row['section']}) | {_cell(fill(row['value'], record))} |"
        )
    for section in spec["section"]:
        first = records[section["run"][0]["record"]]
        out += ["", f"## {section['title']} {{#{section['anchor']}}}", "", fill(section["setup"].strip(), first)]
        for run in section["run"]:
            out += ["", *_run_markdown(run, records[run["record"]])]
    return "\n".join(out) + "\n"


def _run_markdown(run: dict[str, Any], record: Record) -> list[str]:
    commit = record.get("commit") or "unknown"
    dirty = " with uncommitted changes" if record.get("dirty") else ""
    out = [f"### {fill(run['title'], record)}", ""] if "title" in run else []
    out += [
        f"- Command: `{record['command']}`",
        f"- Commit `{commit[:7]}`{dirty}, {record['date'][:10]}; machine: {record['machine']}",
        f"- Record `{record['id']}` in `{_file(record)}`: {record['provenance']}",
    ]
    if run.get("figures"):
        out += ["", "| figure | value |", "| --- | --- |"]
    for row in run.get("figures", []):
        label, value, *each = row
        for x in lookup(record, each[0]) if each else [None]:
            out.append(f"| {_cell(fill(label, record, x))} | {_cell(fill(value, record, x))} |")
    if "plot" in run:
        out += ["", f"![{fill(run['plot']['title'], record)}]({_plot_name(run)})"]
    if "note" in run:
        out += ["", fill(run["note"].strip(), record)]
    return out


def _plot_name(run: dict[str, Any]) -> str:
    return f"{run['record']}.png"


# --- the plots --------------------------------------------------------------------------------------------------------

TETHER = "#3f51b5"


def plots(spec: dict[str, Any], records: dict[str, Record]) -> dict[str, bytes]:
    """Every plot the spec asks for, as PNG bytes by file name (next to the page)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    require(spec, records)
    drawers = {"distribution": _distribution, "lines": _lines, "campaign": _campaign}
    out = {}
    for section in spec["section"]:
        for run in section["run"]:
            if "plot" not in run:
                continue
            plot, record = run["plot"], records[run["record"]]
            fig = drawers[plot["kind"]](plt, plot, record)
            fig.suptitle(fill(plot["title"], record), fontsize=11)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
            plt.close(fig)
            out[_plot_name(run)] = buf.getvalue()
    return out


def _distribution(plt: Any, plot: dict[str, Any], record: Record) -> Any:
    """One row per series: every sample (box and points) where the record kept them (``samples_ms``), else the
    percentiles it kept, marked as such."""
    series = plot["series"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(series) + 1.8), layout="constrained")
    rng = random.Random(0)  # the same jitter every build: the same PNG
    marks = {"p50": ("o", "p50"), "p99": ("^", "p99"), "max": ("x", "max")}
    shown_marks: set[str] = set()
    kept_samples = False
    for i, s in enumerate(series):
        y = len(series) - 1 - i
        values = _samples(record, s)
        if values:
            kept_samples = True
            _box(ax, values, y)
            ax.scatter(values, [y + rng.uniform(-0.18, 0.18) for _ in values], s=9, alpha=0.6, color=TETHER, zorder=4)
            continue
        xs = []
        for mark, path in s.get("marks", {}).items():
            value = lookup(record, path)
            marker, label = marks[mark]
            ax.scatter([value], [y], marker=marker, s=50, color="black", label=None if mark in shown_marks else label)
            shown_marks.add(mark)
            xs.append(value)
        if xs:
            ax.plot([min(xs), max(xs)], [y, y], color="grey", linewidth=1)
    labels = []
    for s in series:
        values = _samples(record, s)
        labels.append(fill(s["label"], record) + (f" (n={len(values)})" if values else ""))
    ax.set_yticks(range(len(series)), labels[::-1])
    if plot.get("log"):
        ax.set_xscale("log")
    ax.set_xlabel(plot["xlabel"])
    ax.grid(axis="x", which="both", alpha=0.3)
    if shown_marks:
        fig.legend(loc="outside lower center", ncol=len(shown_marks), fontsize=8)
    notes = ["points: every trial; box: the middle half and median; whiskers: min to max"] if kept_samples else []
    if shown_marks:
        notes.append(f"{'marked rows' if kept_samples else 'this run'}: percentiles only (no samples kept)")
    ax.set_title("\n".join(notes), fontsize=9)
    return fig


def _box(ax: Any, values: list[float], y: float) -> None:
    """A horizontal box: whiskers from min to max, the box over the middle half, a line at the median."""
    from matplotlib.patches import Rectangle

    ax.plot([min(values), max(values)], [y, y], color="black", linewidth=1)
    if len(values) > 1:
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
        ax.add_patch(Rectangle((q1, y - 0.22), q3 - q1, 0.44, facecolor="white", edgecolor="black", zorder=2))
        ax.plot([median, median], [y - 0.22, y + 0.22], color="#ff9800", linewidth=2, zorder=3)


def _samples(record: Record, series: dict[str, Any]) -> list[float] | None:
    """The series' samples (a dotted path to a list, e.g. ``samples_ms.default``) when the record kept them."""
    try:
        values = lookup(record, series["samples"]) if "samples" in series else None
    except FigureError:
        return None
    return [v for v in values if v is not None] if isinstance(values, list) and values else None


def _lines(plt: Any, plot: dict[str, Any], record: Record) -> Any:
    """A panel per workload, a line per server: a figure at each ``x`` (e.g. concurrency), its key ``y`` with
    ``{x}`` in it, or ``y`` a list of one value per ``x``."""
    xs = lookup(record, plot["x"])
    panels = plot["panels"]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(3.6 * len(panels) + 1, 3.6), sharey=True, squeeze=False, layout="constrained"
    )
    for ax, panel in zip(axes[0], panels, strict=True):
        for s in panel["series"]:
            if "{x}" in s["y"]:
                points = [(x, lookup(record, s["y"].replace("{x}", str(x)))) for x in xs]
            else:  # a list, one value per x
                points = list(zip(xs, lookup(record, s["y"]), strict=True))
            points = [(x, y) for x, y in points if y is not None]
            ax.plot(*zip(*points, strict=True), marker="o", label=s["label"], color=s.get("color"))
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xticks(xs)
        ax.set_xlabel(plot["xlabel"])
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(plot["ylabel"])
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8)
    return fig


def _campaign(plt: Any, plot: dict[str, Any], record: Record) -> Any:
    """A bar per attack: trials that kept every promise, and (in red, stacked) those that broke one."""
    per_attack = lookup(record, "per_attack")
    names = list(per_attack)
    kept = [sum(cell[0] for cell in per_attack[a].values()) for a in names]
    drawn = [sum(cell[1] for cell in per_attack[a].values()) for a in names]
    broken = [d - k for k, d in zip(kept, drawn, strict=True)]
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(names) + 1.5), layout="constrained")
    ax.barh(names, kept, color="#4caf50", label="kept every promise")
    ax.barh(names, broken, left=kept, color="#e53935", label="broke one")
    for y, (k, d) in enumerate(zip(kept, drawn, strict=True)):
        ax.text(d, y, f" {k}/{d}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("trials")
    ax.set_xlim(0, max(drawn) * 1.15)
    ax.xaxis.get_major_locator().set_params(integer=True)
    fig.legend(loc="outside lower center", ncol=2, fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return fig


def write_pages() -> None:
    """The page and its plots, at every ``mkdocs build`` (mkdocs-gen-files)."""
    import mkdocs_gen_files

    spec, records = load_spec(), load_records()
    with mkdocs_gen_files.open(PAGE, "w") as out:
        out.write(page_markdown(spec, records))
    for name, png in plots(spec, records).items():
        with mkdocs_gen_files.open(f"{Path(PAGE).parent}/{name}", "wb") as out:
            out.write(png)


# --- the README's block -----------------------------------------------------------------------------------------------


def readme_block(spec: dict[str, Any], records: dict[str, Record]) -> str:
    """The README's headline figures, markers included: each row links the results file that holds its run."""
    require(spec, records)
    out = [
        START,
        "<!-- generated from bench/results by `.venv/bin/python docs/gen/figures.py --readme`: do not edit by hand -->",
        "",
        spec["readme"]["intro"].strip(),
        "",
        "| figure | value | run |",
        "| --- | --- | --- |",
    ]
    for row in spec["headline"]:
        record = records[row["record"]]
        run = f"[`{record['id']}`]({_file(record)})"
        out.append(f"| {_cell(fill(row['label'], record))} | {_cell(fill(row['value'], record))} | {run} |")
    return "\n".join([*out, END])


def readme_with_block(text: str, block: str) -> str:
    """``text`` with its figures block replaced by ``block``; FigureError when the markers are not there once."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise FigureError(f"README.md must hold one {START} line, then one {END} line: the headline figures go there")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    return before + block + after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--readme", action="store_true", help="rewrite README.md's figures block from bench/results")
    mode.add_argument("--check", action="store_true", help="exit 1 when README.md's figures block is stale")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    try:
        current = readme_with_block(text, readme_block(load_spec(), load_records()))
    except FigureError as exc:
        print(f"figures: {exc}", file=sys.stderr)
        return 1
    if args.check:
        if current != text:
            print(
                "README.md's figures block is stale: run .venv/bin/python docs/gen/figures.py --readme", file=sys.stderr
            )
            return 1
        return 0
    if current != text:
        README.write_text(current, encoding="utf-8")
        print("README.md: figures block rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
