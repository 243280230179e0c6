"""The campaign's other targets (``tether chaos --target batch|models``): a short fixed-seed campaign of each keeps
every promise, trials replay alone per target, and the targets' own checks fail when their invariant breaks.

The campaigns run for real (``tether chaos`` in a child process); the checks' own tests feed them a broken case
directly, without a server.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from conftest import TETHER, chaos, model_missing
from tether.chaos import batch, models
from tether.chaos.plan import BY_NAME, Trial, draw
from tether.chaos.target import Target, runner_processes
from tether.chaos.targets import TARGETS, TargetKind, TargetUnavailable, campaign
from tether.chaos.trial import (
    Outcome,
    Solo,
    Streams,
    TrialResult,
    _expect_cancel_heeded,
    _expect_shutdown_refusals,
    expect_solo_texts,
)
from tether.kernel.cgroups import MemoryCgroup
from tether.kernel.pids import alive

COUNTERS = ("hung", "orphans", "misclassified", "lost_requests", "leaked_fds", "failed_trials", "other_problems")


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_a_short_batch_campaign_keeps_every_promise() -> None:
    """6 trials of seed 2370, the fewest that draw every per-sequence fault and a runner SIGKILL at 1, 4, 8 and 16
    streams in flight on 8 decoding (the single target's campaign draws every other attack); each stream's text
    compared with its prompt's solo run."""
    trials = batch.plan(2370, 6)
    assert {t.attack.name for t in trials} >= {"seq_error", "seq_cancel", "seq_disconnect", "sigkill"}
    assert {t.streams for t in trials} == {1, 4, 8, 16}
    out, summary = chaos("--target", "batch", "--trials", "6", "--seed", "2370", timeout=95)
    assert out.returncode == 0, out.stderr[-3000:]
    assert summary["target"] == "batch" and summary["engine"] == "debug" and summary["trials"] == 6
    assert {k: summary[k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0), out.stderr[-3000:]
    assert summary["solo_prompts"] == len(batch.PROMPTS)


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_a_short_models_campaign_keeps_every_promise() -> None:
    """3 trials of seed 14 on 3 models in a cgroup that holds 2 (the fewest that draw a runner SIGKILLed as it is
    evicted, a load OOM-killed and the worker killed while it loads): evictions and unloads happen, and no attack
    breaks a promise."""
    names = {(t.attack.name, t.phase) for t in models.plan(14, 3)}
    assert {("sigkill", "evict"), ("oom", "load"), ("worker_sigkill", "load")} <= names, names
    out, summary = chaos("--target", "models", "--trials", "3", "--seed", "14", timeout=95)
    assert out.returncode == 0, out.stderr[-3000:]
    assert summary["target"] == "models" and summary["trials"] == 3
    assert {k: summary[k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0), out.stderr[-3000:]
    if summary["memory_limit_mib"] is not None:
        assert summary["evictions"] > 0, summary
    assert summary["unloads"] > 0, summary
    assert summary["missed_strikes"] == 0, summary  # a moment the drawn requests missed is made again


REAL_TRIALS = (2,)  # seed 0's first trial that strikes the shared server amid more streams than slots


@pytest.mark.cores
@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(300)
def test_a_short_batch_campaign_on_the_real_model_keeps_every_promise() -> None:
    """Trial 2 of seed 0 on llama.cpp and the default model: one stream cancelled amid 16 (8 decoding, 8 waiting);
    every greedy text equal to its solo run. What the other attacks add does not depend on the engine, and the
    debug campaigns make them: a client gone ends its sequence as a cancel does; a runner dies with its worker
    (test_orphans.py); a SIGTERM's waiting requests end in 503 shutting_down
    (``test_a_sigterm_with_requests_waiting_for_a_slot_ends_each_with_an_error_not_a_plain_500``)."""
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    drawn = {t.index: t for t in batch.plan(0, max(REAL_TRIALS) + 1, engine="llama.cpp")}
    assert [(drawn[i].attack.name, drawn[i].streams) for i in REAL_TRIALS] == [("seq_cancel", 16)]
    only = ",".join(map(str, REAL_TRIALS))
    # one thread, as every real-model test beside make test's other workers: a second one only spins for a core
    args = ("--target", "batch", "--engine", "llama.cpp", "--threads", "1", "--seed", "0", "--only", only)
    out, summary = chaos(*args, timeout=290)
    assert out.returncode == 0, out.stderr[-3000:]
    assert summary["engine"] == "llama.cpp" and summary["trials"] == len(REAL_TRIALS), summary
    assert summary["threads"] == 1, summary  # the record says how its runners ran
    # every stream of every trial was sent
    assert summary["requests"] == sum(drawn[i].streams for i in REAL_TRIALS), summary
    assert {k: summary[k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0), out.stdout[-3000:] + out.stderr[-3000:]


def test_trials_replay_alone_per_target_and_single_keeps_its_seeds() -> None:
    for plan in (batch.plan, models.plan):
        assert plan(5, 40)[23] == plan(5, 1, only=23)[0]
    assert batch.plan(5, 1, only=2)[0].replay() == "tether chaos --target batch --seed 5 --only 2"
    real = batch.plan(5, 1, only=2, engine="llama.cpp")[0]
    assert real.replay() == "tether chaos --target batch --engine llama.cpp --seed 5 --only 2"
    assert all(t.attack.engine_fault is None for t in batch.plan(5, 60, engine="llama.cpp"))
    # the single target's trials are drawn as before targets existed: old replays still name the same trial
    import random

    rng = random.Random("7:4")
    assert draw(7, 4).attack.name == rng.choice(tuple(BY_NAME.values())).name
    assert [draw(7, i, target="batch") for i in range(20)] != [draw(7, i) for i in range(20)]


def test_a_target_not_written_yet_or_on_an_engine_it_does_not_run_is_refused_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(TARGETS, "ghost", TargetKind("ghost", "tether.chaos.ghost_not_written", "a later target"))
    with pytest.raises(TargetUnavailable, match="not in this version of tether yet: choose one of single, batch"):
        campaign("ghost")
    with pytest.raises(TargetUnavailable, match=re.escape("the models target runs the debug engine, not 'llama.cpp'")):
        campaign("models", "llama.cpp")
    with pytest.raises(TargetUnavailable, match="no chaos target 'nope'"):
        campaign("nope")
    out = subprocess.run(
        [*TETHER, "chaos", "--target", "models", "--engine", "llama.cpp"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "runs the debug engine" in out.stderr, out.stderr
    out = subprocess.run([*TETHER, "chaos", "--threads", "1"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--threads is for the batch target with --engine llama.cpp" in out.stderr, out.stderr


def _trial(name: str, tokens: int = 24) -> Trial:
    return Trial(1, 1, BY_NAME.get(name) or batch.SEQUENCE_ATTACKS[1], "generating", 4, 1, 0.0, tokens, "batch")


def test_a_batched_stream_whose_text_is_not_its_solo_text_is_caught() -> None:
    """The batch target's text check: a completed stream with another's words, one cut short that is not a
    prefix, one that lost tokens, all misclassified; equal texts and true prefixes pass."""
    solo = Solo("http://unused", "solo", 64, {})
    solo.texts = {
        "a": Outcome("complete", text="one two three four five", finish="length", tokens=64),
        "b": Outcome("complete", text="ends early", finish="stop", tokens=2),
    }
    good = [
        Outcome("complete", prompt="a", text="one two three", finish="length", tokens=24),
        Outcome("cancelled", prompt="a", text="one two"),
        Outcome("complete", prompt="b", text="ends early", finish="stop", tokens=2),
    ]
    result = TrialResult(_trial("seq_cancel"))
    anyio.run(expect_solo_texts, result, good, solo, 24)
    assert result.ok, result.problems
    bad = [
        Outcome("complete", prompt="a", text="one two six", finish="length", tokens=24, index=1),  # a neighbour's
        Outcome("failed", prompt="a", text="two", index=2),  # cut short, not a prefix
        Outcome("complete", prompt="a", text="one two", finish="length", tokens=20, index=3),  # tokens lost
        Outcome("complete", prompt="b", text="ends", finish="stop", tokens=1, index=4),  # ended before its end
    ]
    result = TrialResult(_trial("seq_cancel"))
    anyio.run(expect_solo_texts, result, bad, solo, 24)
    assert result.misclassified == 4 and all("differs from its solo run" in p for p in result.problems)


def test_on_sigterm_only_the_shutdowns_own_refusal_passes() -> None:
    shutdown = "the server is shutting down (SIGTERM or SIGINT) and its graceful shutdown ended before this request"
    told = Outcome("rejected", status=503, detail=shutdown, retry_after=True)
    result = TrialResult(_trial("worker_sigterm"))
    _expect_shutdown_refusals(result, [told, Outcome("complete")])
    assert result.ok, result.problems
    other = Outcome("rejected", status=503, detail="the queue is full", retry_after=True, index=1)
    untold = Outcome("rejected", status=503, detail=shutdown, index=2)  # no Retry-After
    _expect_shutdown_refusals(result, [other, untold])
    assert result.misclassified == 2 and all("not by the shutdown" in p for p in result.problems)


def test_a_cancel_that_is_not_heeded_is_caught() -> None:
    result = TrialResult(_trial("seq_cancel", tokens=48))
    heeded = Outcome("complete", request_id="r1", deltas=10)
    ignored = Outcome("complete", request_id="r2", deltas=49, index=2)
    _expect_cancel_heeded(result, [heeded, ignored], {"r1": 3, "r2": 2}, 48)
    assert result.hung == 1 and "stream 2 completed 47 tokens after its cancel was answered" in result.problems[0]


def test_a_runner_started_while_an_evicted_one_lives_is_caught() -> None:
    """The models target's reclaim check: a new runner seen while a runner evicted before its load still lives."""
    evicted = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watcher = models.ModelWatcher(None, _trial("race"))  # type: ignore[arg-type]
        now = time.time()

        snapshot = _models_snapshot
        evict = {"at": now, "kind": "evict", "model": "m0", "why": "memory"}
        watcher._see(snapshot([], {"m0": "loaded"}, {"m0": evicted.pid}))
        watcher._see(snapshot([evict], {"m0": "unloading"}, {"m0": evicted.pid}))
        load = {"at": now + 0.1, "kind": "load", "model": "m2", "why": None}
        watcher._see(snapshot([evict, load], {"m0": "unloading", "m2": "loading"}, {"m2": 999_999_999}))
        assert watcher.problems and f"were alive: [{evicted.pid}]" in watcher.problems[0], watcher.problems
    finally:
        evicted.kill()
        evicted.wait()


def _models_snapshot(decisions: list[dict[str, Any]], states: dict[str, str], pids: dict[str, int]) -> dict[str, Any]:
    """What ``GET /v1/instances`` answers, cut to what the models target's watcher reads."""
    return {
        "scheduler": {"models": {m: {"state": s} for m, s in states.items()}, "decisions": decisions},
        "data": [{"id": m, "runner": {"pid": p, "status": "ready"}} for m, p in pids.items()],
    }


def test_the_unload_strike_finds_its_moment_though_the_unload_is_decided_only_once_it_is_done() -> None:
    """Regression: the watcher waited for an ``unload`` decision while the model was unloading, but the scheduler
    records it only after the runner is gone, so no ``unload`` trial ever struck (the 1,000-trial campaign's 112
    ``missed_strikes``). An unloading model whose last decision is no eviction is the unload's moment; one whose last
    decision is an eviction is the eviction's, and only that."""
    now = time.time()
    loaded = {"at": now, "kind": "loaded", "model": "m1", "why": None}
    evict = {"at": now + 1, "kind": "evict", "model": "m1", "why": "memory"}
    for moment, decisions, strikes in (
        ("unload", [loaded], True),
        ("unload", [loaded, evict], False),
        ("evict", [loaded], False),
        ("evict", [loaded, evict], True),
    ):
        struck: list[tuple[str, int]] = []
        watcher = models.ModelWatcher(None, _trial("sigkill"), moment=moment)  # type: ignore[arg-type]
        watcher.strike = lambda model, pid, struck=struck: struck.append((model, pid))
        watcher._see(_models_snapshot([loaded], {"m1": "loaded"}, {"m1": 4242}))
        assert not struck
        watcher._see(_models_snapshot(decisions, {"m1": "unloading"}, {"m1": 4242}))
        assert struck == ([("m1", 4242)] if strikes else []), (moment, decisions, struck)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_campaign_killed_outright_leaves_no_server_runner_or_cgroup_behind() -> None:
    """Found by the models campaign's own test: a ``tether chaos`` killed by its timeout left its ``tether serve``
    (and runners, and the models cgroup) running for ever. Each server now has a reaper that outlives the campaign."""
    campaign_proc = subprocess.Popen(
        [*TETHER, "chaos", "--target", "models", "--trials", "50", "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        servers: list[int] = []
        while not servers and time.monotonic() < deadline:
            servers = [p for p in _children(campaign_proc.pid) if b"serve" in _cmdline(p)]
            time.sleep(0.05)
        assert servers, "the campaign started no server within 60 s"
        [server] = servers
        runners: list[int] = []
        while not runners and time.monotonic() < deadline:  # killed once it serves: its runners exist
            runners = runner_processes({server})
            time.sleep(0.05)
        assert runners, "the campaign's server started no runner"
        cgroups = [c for c in _cgroup_dirs() if c.name.startswith("chaos-models-")]
        assert cgroups
    finally:
        campaign_proc.kill()
        campaign_proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
        alive(server) or any(alive(p) for p in runners) or any(c.exists() for c in cgroups)
    ):
        time.sleep(0.05)
    assert not alive(server), f"the campaign's server {server} outlived it"
    assert not [p for p in runners if alive(p)], "its runners outlived it"
    assert not [c for c in cgroups if c.exists()], f"its memory cgroup outlived it: {cgroups}"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _cgroup_dirs() -> list[Path]:
    own = MemoryCgroup.of_pid(os.getpid())
    return [p for p in own.path.iterdir() if p.is_dir()] if own is not None else []


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_sigterm_with_requests_waiting_for_a_slot_ends_each_with_an_error_not_a_plain_500(tmp_path: Path) -> None:
    """Found by the batch campaign on llama.cpp (trial 10 of seed 0): on SIGTERM uvicorn's graceful shutdown ran out
    and cancelled the requests still waiting for a batch slot, which ended in the web server's plain-text 500. One
    sequence decodes (parallel 1, 50 ms a token), three wait; SIGTERM lands after the first token. Each request must
    end exactly once in a form the API documents: completed, an error event, a JSON error, or cut."""
    target = Target(tmp_path, serve=("--engine", "debug", "--name", "warm"))
    config = {"id": "slow", "engine": "debug", "options": {"token_seconds": 0.05, "parallel": 1}, "max_queue": 8}

    async def main() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=target.url, timeout=30) as client:
            assert (await client.post("/v1/instances", json=config)).status_code == 201
            with anyio.fail_after(20):
                while not (await client.get("/v1/instances/slow")).json()["ready"]:
                    await anyio.sleep(0.02)
            streams = Streams(client, "slow", 100)

            async def strike() -> None:
                with anyio.fail_after(20):
                    await streams.first.wait()
                target.signal(signal.SIGTERM)

            async with anyio.create_task_group() as tg:
                tg.start_soon(strike)
                await streams.run(4)
            return streams.outcomes

    try:
        outcomes = anyio.run(main)
    finally:
        target.stop()
    assert len(outcomes) == 4
    plain = [o for o in outcomes if o.kind == "unexpected"]
    assert not plain, [f"{o.status} {o.detail}" for o in plain]
    stopped = [o for o in outcomes if "shutting down" in o.detail]  # those the shutdown's bound ended say so
    assert stopped and all(o.kind in ("complete", "cut") for o in outcomes if o not in stopped), outcomes
    for o in stopped:  # before their answer started: a 503 to retry; mid-stream: the stream's error event
        assert (o.kind, o.status, o.retry_after) == ("rejected", 503, True) or (o.kind, o.cause) == (
            "failed",
            "shutting_down",
        ), o
