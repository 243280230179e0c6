"""Runner output: whole lines (a last partial one included), a bounded tail, and size-bounded rotating files."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tether.node.output import OutputCapture
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.protocol import EngineSpec, Fault, GenerateParams, TaskState


def test_lines_are_split_across_reads_and_a_last_partial_line_counts(tmp_path: Path) -> None:
    out = OutputCapture("r1", tail_lines=3, log_dir=tmp_path)
    for chunk in (b"one\ntw", b"o\r\nthree\nfo", b"ur"):
        out.feed(chunk)
    assert list(out.lines) == ["one", "two", "three"]
    out.close()
    assert list(out.lines) == ["two", "three", "four"]  # bounded: the oldest line went
    assert out.path == tmp_path / "runner-r1.log"
    assert [line.split(" ", 2)[2] for line in out.path.read_text().splitlines()] == ["one", "two", "three", "four"]


def test_an_unwritable_log_dir_keeps_the_tail_working(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = OutputCapture("r2", log_dir=blocker / "logs")
    out.feed(b"still kept\n")
    assert out.path is None and list(out.lines) == ["still kept"]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_flooding_runner_fills_rotating_files_of_bounded_size(tmp_path: Path) -> None:
    flood = Fault(kind="stderr_flood", after_tokens=1, lines=20_000)
    with anyio.fail_after(30):
        async with Supervisor(
            EngineSpec(engine="debug"), SupervisorSettings(log_dir=tmp_path, log_max_bytes=64 << 10, log_backups=2)
        ) as sup:
            await sup.ready()
            final = await (await sup.generate(GenerateParams(prompt="x", max_tokens=3, faults=(flood,)))).wait()
    assert final.state is TaskState.COMPLETE
    assert sup.output_log == tmp_path / f"runner-{sup.runner_id}.log"
    files = sorted(tmp_path.glob(f"runner-{sup.runner_id}.log*"))
    assert [f.name for f in files] == [f"runner-{sup.runner_id}.log{s}" for s in ("", ".1", ".2")]
    assert all(f.stat().st_size <= 64 << 10 for f in files)
    assert sup.output_log.read_text().splitlines()[-1].endswith("stderr flood line 20000/20000")
