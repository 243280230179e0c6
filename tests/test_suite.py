"""What ``make test`` relies on from its own tools: the real-model decoders (``cores``) reach pytest-xdist as one
group, so they run one at a time on one worker. A release of pytest or pytest-xdist can break that without a word
(pytest 9.2 with xdist 3.8 did: pytest-dev/pytest-xdist#1386), and the suite then only grows slower and flakier."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

GROUPED = textwrap.dedent(
    """
    import os
    from pathlib import Path

    import pytest

    def record(name: str) -> None:
        (Path(__file__).parent / f"{name}.worker").write_text(os.environ["PYTEST_XDIST_WORKER"])

    @pytest.mark.cores
    @pytest.mark.parametrize("i", range(4))
    def test_decodes(i: int) -> None:
        record(f"cores-{i}")

    @pytest.mark.parametrize("i", range(4))
    def test_waits(i: int) -> None:
        record(f"plain-{i}")
    """
)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_cores_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    plugins = ("conftest", "no:cacheprovider", "no:langsmith_plugin", "no:schemathesis", "no:hypothesispytest")
    argv = [sys.executable, "-m", "pytest", *(f"-p{p}" for p in plugins), "-n", "2", "--dist", "loadgroup", "-v"]
    out = subprocess.run([*argv, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    grouped = [line for line in out.stdout.splitlines() if "PASSED" in line and line.endswith("@cores ")]
    assert len(grouped) == 4, f"xdist was not told the group:\n{out.stdout[-3000:]}"
    workers = {path.stem: path.read_text() for path in tmp_path.glob("*.worker")}
    assert len(workers) == 8, workers
    assert len({workers[f"cores-{i}"] for i in range(4)}) == 1, workers
