"""tether installs like a tool: the wheel ``python -m build`` makes serves a GGUF and answers a chat from a fresh venv
outside the checkout (with its ``llama`` extra and ``tether pull``, the commands the docs give), carrying its
dashboard and none of the dev tools; ``uv tool install`` and ``pipx install`` of the checkout give a working
``tether`` command too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from conftest import model_missing
from tether.chaos.target import ServeChild

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from gpu_bundle import working_tree_files  # noqa: E402

pytestmark = pytest.mark.slow  # builds and installs: tens of seconds each


def run(argv: list[str | Path], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ)
    )
    assert out.returncode == 0, f"{argv}: {out.stdout[-2000:]}{out.stderr[-4000:]}"
    return out.stdout


@pytest.fixture()
def outside(tmp_path: Path) -> Iterator[Path]:
    """A directory outside the checkout, with nothing of it importable (no PYTHONPATH, no checkout on sys.path)."""
    assert not tmp_path.is_relative_to(ROOT)
    yield tmp_path


def fresh_source(into: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked, and untracked ones git does not ignore), copied to
    ``into``: setuptools builds in the tree's ``build/``, so two installs building the checkout itself at once broke
    each other, and an old ``build/lib`` put modules since deleted into the wheel."""
    for name in working_tree_files(ROOT):
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, into / name)
    return into


def serve_and_chat(tether: Path, cwd: Path, model: str | None, *args: str) -> None:
    """Serve with ``tether`` from ``cwd``, answer one chat through the openai client, and stop with nothing left."""
    server = ServeChild(*args, program=(str(tether),), cwd=cwd)
    try:
        server.wait_for(r"ready \(runner pid (\d+)", 90)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        chat = client.chat.completions.create(
            model=model or "default",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert chat.choices[0].message.content, chat
        page = httpx.get(f"{server.url}/", headers={"Accept": "text/html"}, timeout=10)
        assert page.status_code == 200 and "<html" in page.text.lower(), page.text[:200]  # the dashboard shipped
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(20) == 0
        server.wait_for(r"stopped in", 5)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


@pytest.mark.model
@pytest.mark.timeout(600)
def test_the_wheel_in_a_fresh_venv_outside_the_checkout_serves_a_gguf_and_answers_a_chat(outside: Path) -> None:
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    source = fresh_source(outside / "source")
    run([sys.executable, "-m", "build", "--wheel", "--outdir", outside / "dist", source], outside, 300)
    wheels = list((outside / "dist").glob("tether-*.whl"))
    assert len(wheels) == 1, wheels
    run([sys.executable, "-m", "venv", outside / "venv"], outside, 60)
    python = outside / "venv" / "bin" / "python"
    # llama-cpp-python comes from pip's cache of the wheel `make install` built (a user's pip builds it from source)
    run([python, "-m", "pip", "install", "--quiet", f"{wheels[0]}[llama]"], outside, 420)
    where = run([python, "-c", "import tether, llama_cpp; print(tether.__file__)"], outside, 60).strip()
    assert Path(where).is_relative_to(outside / "venv"), where
    absent = (
        "import importlib.util as u; print([m for m in ('pytest', 'ray', 'playwright', 'mkdocs') if u.find_spec(m)])"
    )
    assert run([python, "-c", absent], outside, 60).strip() == "[]"
    tether = outside / "venv" / "bin" / "tether"
    pulled = run([tether, "pull"], outside, 120).strip()  # what the docs tell a wheel user to run
    assert pulled.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    serve_and_chat(tether, outside, None, "--model", pulled, "--threads", "1", "--n-ctx", "1024")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("installer", ["uv", "pipx"])
def test_a_tool_install_of_the_checkout_gives_a_working_tether_command(installer: str, outside: Path) -> None:
    """Without the llama extra (whose llama-cpp-python a tool install builds from source, minutes): the command,
    its dependencies and the debug engine, served and answering."""
    found = shutil.which(installer, path=str(Path(sys.executable).parent)) or shutil.which(installer)
    if found is None:
        pytest.skip(f"{installer} is not installed (the dev extra has it)")
    bin_dir = outside / "bin"
    environment = {**os.environ, "UV_TOOL_DIR": str(outside / "uv-tools"), "UV_TOOL_BIN_DIR": str(bin_dir)}
    environment |= {"PIPX_HOME": str(outside / "pipx"), "PIPX_BIN_DIR": str(bin_dir), "PIPX_MAN_DIR": str(outside)}
    source = fresh_source(outside / "source")
    argv: list[str | Path] = [found, "tool", "install", source] if installer == "uv" else [found, "install", source]
    run(argv, outside, 540, environment)
    tether = bin_dir / "tether"
    assert run([tether, "--version"], outside, 30).startswith("tether ")
    assert "smollm2" in run([tether, "pull", "--list"], outside, 30)
    serve_and_chat(tether, outside, "debug", "--engine", "debug")
