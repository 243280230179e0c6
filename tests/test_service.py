"""tether as a systemd service: deploy/tether.service passes ``systemd-analyze verify``, its stop timeout covers
tether's own stop bound, and tether started exactly as the unit's ExecStart starts it (its command line, its config
file, its environment), then sent the unit's KillSignal, exits by itself within TimeoutStopSec with a stream in
flight and leaves no process, no runner record and no runner cgroup behind, with no SIGKILL from systemd needed."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import model_missing
from tether.cli import settings
from tether.kernel.cgroups import runner_cgroups
from tether.kernel.pids import alive
from tether.models import default_model_path

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "tether.service"
CONFIG = ROOT / "deploy" / "tether.toml"
VENV_TETHER = Path(sys.executable).parent / "tether"


def unit(path: Path = UNIT) -> dict[str, list[str]]:
    """``Key=Value`` lines by key (a key may repeat, as Environment= does), sections merged: what the tests read."""
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def seconds(value: str) -> float:
    """A systemd time span as this unit writes it: plain seconds or with an 's'/'min' suffix."""
    value = value.strip()
    if value.endswith("min"):
        return float(value[:-3]) * 60
    return float(value.removesuffix("s"))


@pytest.mark.timeout(60)
def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """Verified as written, but for ExecStart's program (systemd checks it exists): this venv's tether in its place."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package; `make test` installs it)")
    program = shlex.split(unit()["ExecStart"][0])[0]
    copy = tmp_path / "tether.service"
    copy.write_text(UNIT.read_text().replace(program, str(VENV_TETHER)))
    out = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    broken = tmp_path / "broken.service"
    broken.write_text(copy.read_text().replace("KillMode=mixed", "KillMode=mixd"))
    out = subprocess.run([analyze, "verify", str(broken)], capture_output=True, text=True, timeout=50)
    assert "Failed to parse kill mode" in out.stderr, out.stderr  # the check does check


def test_systemd_stops_tether_with_the_signal_it_handles_and_waits_longer_than_its_bound() -> None:
    keys = unit()
    assert keys["KillMode"] == ["mixed"], "SIGTERM to tether alone: it stops its runners itself, in order"
    assert keys["KillSignal"] == ["SIGTERM"]
    assert shlex.split(keys["ExecStart"][0])[1:3] == ["serve", "--config"]
    configured = settings.load({"config": CONFIG})  # the example config the docs install as /etc/tether/tether.toml
    grace = configured.stop_timeout / 4  # open requests' grace, then every runner within the bound
    assert seconds(keys["TimeoutStopSec"][0]) >= 1.5 * (configured.stop_timeout + grace), keys["TimeoutStopSec"]


@pytest.fixture()
def unit_environment(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The unit's Environment= with each of its directories made under ``tmp_path`` (as systemd makes them from
    StateDirectory= and the like), the default model and a free port chosen by variables (a variable wins over the
    file, so the command line and the file stay the unit's)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    for assignment in unit()["Environment"]:
        name, _, value = assignment.partition("=")
        directory = tmp_path / value.strip("/").replace("/", "_")
        directory.mkdir(mode=0o700)
        environment[name] = str(directory)
    environment |= {"TETHER_PORT": "0", "TETHER_MODEL": str(default_model_path()), "TETHER_THREADS": "2"}
    yield environment


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tether_started_as_the_unit_starts_it_stops_on_its_signal_within_its_timeout_leaving_nothing(
    unit_environment: dict[str, str],
) -> None:
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    keys = unit()
    argv = shlex.split(keys["ExecStart"][0])
    argv = [str(VENV_TETHER), *(str(CONFIG) if arg == "/etc/tether/tether.toml" else arg for arg in argv[1:])]
    proc = subprocess.Popen(
        argv,
        env=unit_environment,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # systemd starts a service as a session of its own
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if " ready (runner pid " in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(60), "".join(lines)
        url = next(line.split("listening on ")[1].split()[0] for line in lines if "listening on " in line)
        runners = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert runners, "the runner and its guard"
        outcome: list[str] = []
        streaming = threading.Event()

        def stream() -> None:
            body = {
                "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}],
                "stream": True,
            }
            body |= {"max_tokens": 2000, "temperature": 0}
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as answer:
                    for line in answer.iter_lines():
                        streaming.set()
                        if line.startswith("data: "):
                            outcome.append(line)
            except httpx.HTTPError as exc:
                outcome.append(f"transport error: {exc}")
            finally:
                streaming.set()

        client = threading.Thread(target=stream)
        client.start()
        assert streaming.wait(30), "the stream began"
        began = time.monotonic()
        os.kill(proc.pid, getattr(signal, keys["KillSignal"][0]))  # KillMode=mixed: the main process only
        code = proc.wait(seconds(keys["TimeoutStopSec"][0]))
        took = time.monotonic() - began
        client.join(30)
        assert code == 0, "".join(lines)
        assert took < seconds(keys["TimeoutStopSec"][0]), took
        assert (outcome and outcome[-1] in ("data: [DONE]",)) or '"error"' in outcome[-1], outcome[-3:]
        deadline = time.monotonic() + 3  # an orphaned zombie is reaped late here: dead is Z or gone
        while any(alive(pid) for pid in runners) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [pid for pid in runners if alive(pid)], "a runner outlived the service"
        records = Path(unit_environment["TETHER_RUNTIME_DIR"])
        assert not [p for p in records.rglob("*") if p.is_file()], list(records.rglob("*"))
        assert not [c for c in runner_cgroups() if c.worker_pid == proc.pid], "a runner cgroup was left"
        assert "stopped in" in "".join(lines)
        print(f"stopped in {took:.2f} s; the stream's last event: {outcome[-1][:200]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
