"""`tether run` as a user runs it: a real process, real signals, the real default model."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import signal
import subprocess

import pytest

import tether
from conftest import TETHER, MakeCgroup, model_missing, pid_alive


@pytest.mark.model
@pytest.mark.timeout(180)
def test_default_model_answers_the_capital_of_france() -> None:
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    out = subprocess.run(
        [*TETHER, "run", "What is the capital of France?", "--max-tokens", "32", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "loading 100.0%" in out.stderr and "tokens/s" in out.stderr


@pytest.mark.timeout(60)
def test_json_mode_prints_every_event_in_order() -> None:
    out = subprocess.run(
        [*TETHER, "run", "hi", "--engine", "debug", "--max-tokens", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    types = [e["type"] for e in events]
    assert types.count("chunk") == 4
    statuses = [e["status"]["type"] for e in events if e["type"] == "status"]
    assert statuses[statuses.index("loading") :][-1] == "shutdown"
    assert {"loading", "loaded", "warming_up", "ready", "running", "shutting_down"} <= set(statuses)
    task_states = [e["state"] for e in events if e["type"] == "task_status"]
    assert task_states == ["running", "complete"]
    assert types.index("ack") < types.index("chunk") < types.index("task_status", types.index("chunk"))


@pytest.mark.timeout(60)
def test_runner_crash_exits_non_zero_with_the_cause() -> None:
    out = subprocess.run(
        [*TETHER, "run", "hi", "--engine", "debug", "--max-tokens", "50", "--fault", "segv:generate:3"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 2
    assert "crashed in native code while generating: killed by SIGSEGV (Segmentation fault)" in out.stderr
    assert "Fatal Python error: Segmentation fault" in out.stderr
    assert len(out.stdout.split()) == 3, "the three tokens produced before the crash are still printed"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_runner_and_leaves_nothing(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [*TETHER, "run", "hi", "--engine", "debug", "--max-tokens", "100000", "--fault", "slow:generate:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None and proc.stdout is not None
        runner_pid = None
        for line in proc.stderr:  # bounded by the test timeout; the pid line comes first
            match = re.search(r": pid (\d+)$", line.strip())
            if match:
                runner_pid = int(match.group(1))
                break
        assert runner_pid is not None
        first_token = proc.stdout.read(1)  # the runner is generating now
        assert first_token
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=15) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not pid_alive(runner_pid)


@pytest.mark.model
@pytest.mark.timeout(120)
def test_a_model_that_does_not_fit_is_refused_with_the_numbers_and_force_loads_it(memory_cgroup: MakeCgroup) -> None:
    """In a 600 MiB cgroup the default model at n_ctx 8192 is estimated at ~684 MiB: refused; --force loads it."""
    if (why := model_missing()) is not None:
        pytest.skip(why)
    cgroup_600m = memory_cgroup(600 << 20)
    procs = cgroup_600m / "cgroup.procs"
    run = ["run", "Say hi.", "--n-ctx", "8192", "--threads", "2", "--max-tokens", "4"]

    def in_cgroup(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = " ".join(shlex.quote(a) for a in [*TETHER, *run, *extra])
        return subprocess.run(
            ["sh", "-c", f"echo $$ > {shlex.quote(str(procs))} && exec {argv}"],
            capture_output=True,
            text=True,
            timeout=100,
        )

    refused = in_cgroup()
    assert refused.returncode == 3, refused.stderr
    message = refused.stderr.strip().splitlines()[-1]
    assert re.search(r"does not fit: needs ~\d+ MiB \(weights 92\.1 MiB \+ KV cache 180 MiB at n_ctx 8192", message)
    assert re.search(r"\d+ MiB available \(cgroup limit \(" + re.escape(str(cgroup_600m)) + r"\)\)", message)
    assert "--force" in message and "runner" not in refused.stderr  # refused before any runner started

    forced = in_cgroup("--force")
    assert forced.returncode == 0, forced.stderr
    assert "--force:" in forced.stderr and "[memory: estimated ~556 MiB" in forced.stderr


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_hung_runner_is_reported_with_its_stacks_within_the_deadline_set_on_the_command_line() -> None:
    out = subprocess.run(
        [*TETHER, "run", "hi", "--engine", "debug", "--fault", "hang:generate:2", "--deadline", "token_gap=1"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 2, out.stderr
    assert re.search(r"hung in decode for 1\.\d s: no token since the previous one", out.stderr), out.stderr
    assert "Current thread 0x" in out.stderr and "in _hang" in out.stderr
    assert "raise the 'token_gap' deadline (now 1 s" in out.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("flag", "message", "code"),
    [
        ("token_gap=-1", "token_gap must be a positive number of seconds, got -1.0", 64),
        ("gap=1", "unknown deadline 'gap': valid names are ack, first_token, heartbeat, load_stall", 2),
        ("token_gapp=1", "unknown deadline 'token_gapp': did you mean 'token_gap'?", 2),
        ("token_gap=soon", "bad deadline 'token_gap=soon': 'soon' is no number of seconds or duration", 2),
    ],
)
def test_a_bad_deadline_is_refused_with_the_reason(flag: str, message: str, code: int) -> None:
    out = subprocess.run(
        [*TETHER, "run", "hi", "--engine", "debug", "--deadline", flag], capture_output=True, text=True, timeout=25
    )
    assert out.returncode == code and message in out.stderr, out.stderr


@pytest.mark.timeout(30)
def test_version_and_help_are_plain_text() -> None:
    version = subprocess.run([*TETHER, "--version"], capture_output=True, text=True, timeout=20)
    assert version.returncode == 0 and version.stdout.strip() == f"tether {tether.__version__}"
    assert tether.__version__ == importlib.metadata.version("tether")
    for command in ([], ["run"], ["serve"], ["status"], ["orphans"]):
        shown = subprocess.run([*TETHER, *command, "--help"], capture_output=True, text=True, timeout=20)
        assert shown.returncode == 0, shown.stderr
        assert "``" not in shown.stdout and ":class:" not in shown.stdout, shown.stdout
    assert (
        "tether: a supervised inference worker"
        in subprocess.run([*TETHER, "--help"], capture_output=True, text=True, timeout=20).stdout
    )


def test_prompt_cache_ram_is_an_engine_option_a_one_shot_run_does_without() -> None:
    """``--prompt-cache-ram`` reaches the engine's options as bytes; ``tether run`` (one prompt, nothing after it
    to reuse a saved prefix) asks for no RAM store unless told, so its fit check does not count one."""
    from tether.cli import run, settings
    from tether.cli.common import engine_options
    from tether.cli.parser import build_parser

    parser = build_parser()

    def served(*argv: str) -> settings.ServeSettings:
        return settings.load(settings.given_flags(parser.parse_args(["serve", *argv])))

    assert engine_options(served("--prompt-cache-ram", "512M")) == {"prompt_cache_ram": 512 << 20}
    assert "prompt_cache_ram" not in engine_options(served())
    assert run._engine_spec(parser.parse_args(["run", "hi"])).options["prompt_cache_ram"] == 0
    assert run._engine_spec(parser.parse_args(["run", "hi", "--prompt-cache-ram", "1G"])).options[
        "prompt_cache_ram"
    ] == (1 << 30)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prompt-cache-ram", "lots"])
