"""Figures come from recorded runs: every record the docs cite is in bench/results, the README's headline table is
what bench/results renders, no benchmark's JSON line is pasted into the docs, and a bench asked to record its run
appends exactly what it printed."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "gen"))
sys.path.insert(0, str(ROOT / "bench"))
import figures  # noqa: E402

import benchstats  # noqa: E402


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return figures.load_spec()


@pytest.fixture(scope="module")
def records() -> dict[str, figures.Record]:
    return figures.load_records()


def test_every_cited_record_is_in_bench_results_and_every_placeholder_in_its_record(
    spec: dict[str, Any], records: dict[str, figures.Record]
) -> None:
    figures.require(spec, records)
    page = figures.page_markdown(spec, records)  # a placeholder naming a key its record lacks raises
    assert figures.PLACEHOLDER.search(page) is None, "a placeholder was left unfilled"
    for section in spec["section"]:
        assert f"{{#{section['anchor']}}}" in page


def test_a_missing_record_fails_the_build_naming_it_and_its_file(
    spec: dict[str, Any], records: dict[str, figures.Record]
) -> None:
    broken = copy.deepcopy(spec)
    broken["section"][0]["run"][0]["record"] = "orphan_exit-0000000"
    broken["headline"][0]["record"] = "nosuchbench-0000000"
    with pytest.raises(figures.MissingRecord) as caught:
        figures.page_markdown(broken, records)
    message = str(caught.value)
    assert "orphan_exit-0000000" in message and "bench/results/orphan_exit.jsonl: no record with that id" in message
    assert "bench/results/nosuchbench.jsonl: the file does not exist" in message
    assert "TETHER_BENCH_RECORD=1" in message


def test_a_placeholder_without_its_key_fails_naming_the_record(records: dict[str, figures.Record]) -> None:
    record = records["detect-b699884"]
    assert figures.fill("{p99_ms} ms, {trials} trials", record) == "6.72 ms, 50 trials"
    with pytest.raises(figures.FigureError, match="detect-b699884 has no 'p98_ms'"):
        figures.fill("{p98_ms}", record)


def test_the_readme_figures_block_is_what_bench_results_renders(
    spec: dict[str, Any], records: dict[str, figures.Record]
) -> None:
    readme = figures.README.read_text(encoding="utf-8")
    block = figures.readme_block(spec, records)
    assert figures.readme_with_block(readme, block) == readme, (
        "README.md's figures block is stale: run .venv/bin/python docs/gen/figures.py --readme"
    )
    for row in spec["headline"]:
        assert f"bench/results/{records[row['record']]['bench']}.jsonl" in block


def test_no_benchmark_json_line_is_pasted_into_the_docs() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pasted = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in pages
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if line.lstrip().startswith('{"bench"')
    ]
    assert not pasted, f"a benchmark's JSON line pasted into the docs (cite its record in bench/results): {pasted}"


def test_the_plots_are_drawn(spec: dict[str, Any], records: dict[str, figures.Record]) -> None:
    drawn = figures.plots(spec, records)
    assert len(drawn) >= 3
    assert all(png.startswith(b"\x89PNG") for png in drawn.values())
    page = figures.page_markdown(spec, records)
    assert all(f"]({name})" in page for name in drawn)


def test_emit_prints_the_line_and_records_the_run_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = {"bench": "detect", "p99_ms": 6.72, "samples_ms": {"all_terminal": [1.5, 2.25]}}
    monkeypatch.setattr(benchstats, "RESULTS", tmp_path)
    monkeypatch.delenv(benchstats.RECORD_ENV, raising=False)
    benchstats.emit(result)
    assert capsys.readouterr().out.splitlines()[-1] == json.dumps(result)
    assert not list(tmp_path.iterdir())

    monkeypatch.setenv(benchstats.RECORD_ENV, "1")
    benchstats.emit(result)
    assert capsys.readouterr().out.splitlines()[-1] == json.dumps(result)
    (line,) = (tmp_path / "detect.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["result"] == result and record["bench"] == "detect" and record["id"].startswith("detect-")
    assert set(record) == {"id", "bench", "commit", "dirty", "date", "machine", "command", "provenance", "result"}
    assert record["date"].endswith("+00:00") and "CPUs" in record["machine"] and "GiB RAM" in record["machine"]
    loaded = figures.load_records(tmp_path)
    assert figures.lookup(loaded[record["id"]], "samples_ms.all_terminal.1") == 2.25
