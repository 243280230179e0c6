"""Many models on one node, with real runners: load on demand, keep-alive, eviction under a real memory limit.

Models are debug-engine instances that really hold memory (``hold_bytes``: anonymous pages, every one written), so
a worker in a memory cgroup runs out of room for real, and what the scheduler measures is what the kernel counts.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import TETHER, MakeCgroup, Server, model_missing, pid_alive, serving, wait_until
from tether.errors import InvalidField
from tether.fleet.catalog import keep_alive_seconds
from tether.models import default_model_path

pytestmark = pytest.mark.slow  # each test starts its own worker and waits on loads, unloads, keep-alives in real time

MiB = 1 << 20


def toml(value: Any) -> str:
    """A value in TOML (what a catalog holds: strings, numbers, booleans, lists and tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return "{ " + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + " }"


def write_catalog(path: Path, keep_alive: str = "5m", **models: dict[str, Any]) -> Path:
    lines = [f"keep_alive = {toml(keep_alive)}"]
    for model_id, fields in models.items():
        lines += ["", "[[models]]", f"id = {toml(model_id)}", 'engine = "debug"']
        lines += [f"{key} = {toml(value)}" for key, value in fields.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def ask(server: Server, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}
    return server.http.post("/v1/chat/completions", json=body, timeout=60)


def models(server: Server) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in server.http.get("/v1/models").json()["data"]}


def decisions(server: Server) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = server.http.get("/v1/instances").json()["scheduler"]["decisions"]
    return listed


def kinds(server: Server, model: str) -> list[str]:
    return [d["kind"] for d in decisions(server) if d["model"] == model]


def runner_pid(server: Server, model: str) -> int:
    pid: int = server.instance(model)["runner"]["pid"]
    return pid


@pytest.fixture
def catalog(tmp_path: Path) -> Path:
    return tmp_path / "catalog.toml"


@pytest.mark.timeout(60)
def test_a_request_for_an_unloaded_model_loads_it_once_however_many_ask(catalog: Path) -> None:
    write_catalog(catalog, a={"options": {"load_step_seconds": 0.1}, "aliases": ["gpt-4o-mini"]})
    with serving("--engine", "debug", "--catalog", str(catalog)) as server:
        listed = models(server)
        assert listed["a"]["state"] == "unloaded" and listed["a"]["estimate"] > 40 * MiB, listed["a"]
        assert listed["debug"]["state"] == "loaded" and listed["debug"]["footprint"] > 0
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: answers.append(ask(server, "gpt-4o-mini"))) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
        assert {a.json()["model"] for a in answers} == {"a"}
        assert kinds(server, "a") == ["load", "loaded"]  # six first requests, one load
        after = models(server)["a"]
        assert after["state"] == "loaded" and after["loads"] == 1 and after["footprint"] > 0, after
        unknown = ask(server, "nope")
        assert unknown.status_code == 404 and "'nope'" in unknown.text
        assert "debug, a" in unknown.json()["error"]["message"]
        metrics = server.http.get("/metrics").text
        assert 'tether_model_loads_total{model="a",outcome="loaded"} 1.0' in metrics
        assert 'tether_model_state{model="a",state="loaded"} 1.0' in metrics
        assert 'tether_model_load_wait_seconds_count{model="a"} 6.0' in metrics  # each waited for the one load


@pytest.mark.timeout(60)
def test_keep_alive_unloads_an_idle_model_and_0_unloads_it_after_the_request(catalog: Path) -> None:
    write_catalog(catalog, keep_alive="1s", a={}, b={})
    with serving("--engine", "debug", "--catalog", str(catalog)) as server:
        assert ask(server, "a").status_code == 200
        pid = runner_pid(server, "a")
        began = time.monotonic()
        wait_until(lambda: models(server)["a"]["state"] == "unloaded", 10, "a unloaded after its keep-alive")
        assert time.monotonic() - began >= 0.5  # not before its keep-alive (1 s from the request's end)
        assert not pid_alive(pid)
        [unload] = [d for d in decisions(server) if d["model"] == "a" and d["kind"] == "unload"]
        assert unload["why"] == "keep_alive" and "keep-alive expired" in unload["reason"], unload
        # keep_alive as a request extension: 0 unloads the model as soon as this request is done
        assert ask(server, "b", keep_alive=0).status_code == 200
        wait_until(lambda: models(server)["b"]["state"] == "unloaded", 3, "b unloaded right after its request")
        # -1: for ever (no countdown), then Ollama's `ollama stop`: an empty prompt with keep_alive 0
        assert ask(server, "a", keep_alive=-1).status_code == 200
        assert models(server)["a"]["keep_alive"] is None and models(server)["a"]["expires_in"] is None
        stop = server.http.post("/api/generate", json={"model": "a", "prompt": "", "keep_alive": 0, "stream": False})
        assert stop.status_code == 200 and stop.json()["done_reason"] == "unload", stop.text
        assert models(server)["a"]["state"] == "unloaded"
        assert {m["name"] for m in server.http.get("/api/ps").json()["models"]} == {"debug"}
        generate = {"model": "a", "prompt": "hi", "stream": False, "options": {"num_predict": 2}, "keep_alive": "9s"}
        loading = server.http.post("/api/generate", json=generate)
        assert loading.status_code == 200 and loading.json()["load_duration"] > 0, loading.text  # it waited for a load
        ps = {m["name"]: m for m in server.http.get("/api/ps").json()["models"]}
        assert ps["a"]["expires_at"] < ps["debug"]["expires_at"]  # a: in 9 s (this request said so); debug: 5 min
        assert ask(server, "a").status_code == 200  # without keep_alive: the model's own again (1 s), as in Ollama
        wait_until(lambda: models(server)["a"]["state"] == "unloaded", 10, "a unloaded on its own keep-alive")


@pytest.mark.timeout(60)
def test_a_request_racing_an_unload_is_served_by_a_fresh_load(catalog: Path) -> None:
    write_catalog(catalog, slow_exit={"options": {"close_seconds": 1.5}})
    with serving("--engine", "debug", "--catalog", str(catalog)) as server:
        assert ask(server, "slow_exit", keep_alive=0).status_code == 200
        wait_until(lambda: models(server)["slow_exit"]["state"] == "unloading", 5, "the unload under way")
        racing = ask(server, "slow_exit")  # arrives while the runner shuts down
        assert racing.status_code == 200, racing.text
        assert kinds(server, "slow_exit") == ["load", "loaded", "unload", "load", "loaded"]
        assert models(server)["slow_exit"]["loads"] == 2


@pytest.mark.timeout(60)
def test_a_load_that_outlasts_load_wait_is_a_503_with_retry_after_and_still_loads(catalog: Path) -> None:
    write_catalog(catalog, slow={"options": {"load_steps": 6, "load_step_seconds": 0.5}})
    with serving("--engine", "debug", "--catalog", str(catalog), "--load-wait", "1") as server:
        late = ask(server, "slow")
        assert late.status_code == 503 and int(late.headers["Retry-After"]) >= 1, late.text
        assert "still loading after 1 s" in late.json()["error"]["message"] and "--load-wait" in late.text
        wait_until(lambda: models(server)["slow"]["state"] == "loaded", 20, "slow loaded all the same")
        assert ask(server, "slow").status_code == 200


@pytest.mark.timeout(60)
def test_max_loaded_evicts_the_least_recently_used_idle_model(catalog: Path) -> None:
    write_catalog(catalog, a={}, b={})
    with serving("--engine", "debug", "--catalog", str(catalog), "--max-loaded", "2") as server:
        assert ask(server, "a").status_code == 200  # debug (loaded at start) is now the least recently used
        debug_pid = runner_pid(server, "debug")
        assert ask(server, "b").status_code == 200
        [evict] = [d for d in decisions(server) if d["kind"] == "evict"]
        assert evict["model"] == "debug" and evict["why"] == "max_loaded", evict
        assert not pid_alive(debug_pid)
        assert {m: s["state"] for m, s in models(server).items() if s["state"] == "loaded"} == {
            "a": "loaded",
            "b": "loaded",
        }


def oom_kills(cgroup: Path) -> int:
    for line in (cgroup / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


@pytest.fixture
def limited(memory_cgroup: MakeCgroup, own_cgroups: None) -> Iterator[Path]:
    """A 700 MiB memory cgroup for the worker: its base (interpreter, API, a bare debug runner: ~130 MiB) and two
    models holding 200 MiB each fit; a third does not (each is estimated at 256 MiB)."""
    yield memory_cgroup(700 * MiB)


@pytest.mark.timeout(120)
def test_eviction_under_a_real_memory_limit_frees_the_lru_idle_model_without_an_oom_kill(
    catalog: Path, limited: Path
) -> None:
    held = {"options": {"hold_bytes": 200 * MiB}}
    write_catalog(catalog, a=held, b=held, c=held, huge={"options": {"hold_bytes": 2048 * MiB}})
    with serving("--engine", "debug", "--catalog", str(catalog), cgroup=limited) as server:
        for model in ("a", "b", "debug", "a"):  # least recently used now: b, then debug, then a
            assert ask(server, model).status_code == 200
        assert [d for d in decisions(server) if d["kind"] == "evict"] == []  # a and b both fit
        b_pid = runner_pid(server, "b")
        assert ask(server, "c").status_code == 200
        evicted = [d for d in decisions(server) if d["kind"] == "evict"]
        assert [(d["model"], d["why"]) for d in evicted] == [("b", "memory")], evicted  # b alone was enough
        assert evicted[0]["bytes"] > 200 * MiB
        assert not pid_alive(b_pid)
        [reclaimed] = [d for d in decisions(server) if d["kind"] == "reclaimed"]
        assert reclaimed["model"] == "c" and reclaimed["bytes"] >= 0.9 * evicted[0]["bytes"], reclaimed
        states = {m: s["state"] for m, s in models(server).items()}
        assert states["a"] == states["c"] == states["debug"] == "loaded" and states["b"] == "unloaded", states
        # Too big even with every idle model evicted: a 507 with the numbers, and nothing evicted for it.
        huge = ask(server, "huge")
        assert huge.status_code == 507, huge.text
        message = huge.json()["error"]["message"]
        for words in ("does not fit: needs ~2.", "available (cgroup limit", "that evicting every idle model (3)"):
            assert words in message, message
        assert len([d for d in decisions(server) if d["kind"] == "evict"]) == 1
        assert {m: s["state"] for m, s in models(server).items()}["a"] == "loaded"
        assert oom_kills(limited) == 0
        for instance in server.http.get("/v1/instances").json()["data"]:
            assert instance["failures"] == {} and instance["restarts"] == 0, instance


@pytest.mark.timeout(120)
def test_a_crashed_runners_memory_is_reused_at_once(catalog: Path, limited: Path) -> None:
    """``crashy`` dies at its first token and restarts only in a minute (its request is not resumed, which would
    restart it at once): its 350 MiB come back when it dies, and ``b`` (estimated 406 MiB) loads at once, with
    nothing evicted and no wait for memory. A monitor reads its ``/proc`` smaps all along: while a reader holds a
    process's address space, its exit is reported before its memory is freed, and the placement must wait for it."""
    crash = [{"kind": "sigkill", "phase": "generate", "after_tokens": 0}]
    restart = {"initial_backoff": 60.0, "max_backoff": 60.0}
    write_catalog(
        catalog,
        crashy={"options": {"hold_bytes": 350 * MiB}, "faults": crash, "restart": restart, "resume": False},
        b={"options": {"hold_bytes": 350 * MiB}},
    )
    with serving("--engine", "debug", "--catalog", str(catalog), cgroup=limited) as server:
        load = server.http.post("/api/generate", json={"model": "crashy", "prompt": "", "stream": False})
        assert load.status_code == 200, load.text
        smaps = Path(f"/proc/{runner_pid(server, 'crashy')}/smaps_rollup")

        def monitor() -> None:  # until the runner is gone
            with contextlib.suppress(OSError):
                while True:
                    smaps.read_bytes()

        readers = [threading.Thread(target=monitor) for _ in range(2)]
        for reader in readers:
            reader.start()
        died = ask(server, "crashy")
        assert died.status_code == 500 and "SIGKILL" in died.text, died.text
        began = time.monotonic()
        served = ask(server, "b")
        took = time.monotonic() - began
        for reader in readers:
            reader.join(10)
        assert served.status_code == 200, served.text
        assert took < 10, took
        assert not [d for d in decisions(server) if d["kind"] in ("evict", "wait_memory", "refuse")], decisions(server)
        assert oom_kills(limited) == 0


@pytest.mark.timeout(90)
def test_a_loaded_models_stream_keeps_its_pace_while_another_loads(catalog: Path) -> None:
    write_catalog(
        catalog,
        fast={"options": {"token_seconds": 0.02, "parallel": 2}, "pinned": True},
        slow={"options": {"load_steps": 6, "load_step_seconds": 0.5}},
    )
    with serving("--engine", "debug", "--catalog", str(catalog)) as server:
        wait_until(lambda: models(server)["fast"]["state"] == "loaded", 20, "fast (pinned) loaded at start")
        arrivals: list[float] = []
        first_token: list[float] = []

        def stream() -> None:
            body = {"model": "fast", "prompt": "go", "max_tokens": 200, "stream": True}
            with server.http.stream("POST", "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.time())

        streaming = threading.Thread(target=stream)
        streaming.start()
        wait_until(lambda: len(arrivals) >= 20, 10, "the stream under way")
        loading = threading.Thread(target=lambda: ask(server, "slow"))
        loading.start()
        wait_until(lambda: models(server)["slow"]["state"] == "loading", 10, "slow loading")
        began = time.monotonic()  # a second request to the loaded model, while slow loads
        with server.http.stream("POST", "/v1/completions", json={"model": "fast", "prompt": "x", "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first_token.append(time.monotonic() - began)
                    break
        loading.join(30)
        streaming.join(30)
        load = {d["kind"]: d["at"] for d in decisions(server) if d["model"] == "slow"}
        during = [b - a for a, b in itertools.pairwise(arrivals) if load["load"] <= a <= load["loaded"]]
        assert load["loaded"] - load["load"] >= 2.5  # the load really lasted
        assert len(during) >= 20, during
        assert first_token and first_token[0] < 1.0, first_token  # never behind the 3 s load
        during.sort()
        assert during[len(during) // 2] < 0.06 and during[-1] < 0.5, during  # 20 ms a token, as before the load


@pytest.mark.timeout(30)
def test_a_bad_catalog_stops_the_server_before_it_listens_naming_the_file_and_field(tmp_path: Path) -> None:
    cases = {
        "keep_alive = 5\n[[models]]\nid = 'a'\nengine = 'debug'\nkeep_alive = 'soon'\n": "keep_alive must be",
        "[[models]]\nid = 'a'\nengine = 'debug'\ncolour = 'red'\n": "models[0]: unknown key 'colour': valid names",
        "[[models]]\nid = 'a'\nengine = 'debug'\nmodle = 'a.gguf'\n": "unknown key 'modle': did you mean 'model'?",
        "[[models]]\nid = 'a'\nengine = 'debug'\n[[models]]\nid = 'b'\nengine = 'debug'\naliases = ['a']\n": (
            "the name 'a' of model 'b'"
        ),
        "[[models]\n": "is not valid TOML",
    }
    for text, words in cases.items():
        path = tmp_path / "catalog.toml"
        path.write_text(text)
        out = subprocess.run(
            [*TETHER, "serve", "--engine", "debug", "--port", "0", "--catalog", str(path)],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert out.returncode == 64 and words in out.stderr and str(path) in out.stderr, (out.returncode, out.stderr)
        assert "listening" not in out.stderr


@pytest.mark.timeout(120)
def test_models_dir_serves_each_gguf_by_its_stem_loaded_on_demand_and_status_shows_the_decisions(
    tmp_path: Path,
) -> None:
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    directory = tmp_path / "models"
    directory.mkdir()
    for name in ("smol-a", "smol-b"):  # copies of the default model: distinct models, as far as anyone can tell
        shutil.copy(default_model_path(), directory / f"{name}.gguf")
    with serving("--engine", "debug", "--models", str(directory), "--n-ctx", "512", "--threads", "1") as server:
        listed = models(server)
        assert {"smol-a", "smol-b", default_model_path().stem} <= set(listed), listed
        assert listed["smol-a"]["state"] == "unloaded" and listed["smol-a"]["engine"] == "llama.cpp"
        answer = server.http.post(
            "/v1/chat/completions",
            json={"model": "smol-b", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert answer.status_code == 200 and answer.json()["model"] == "smol-b", answer.text
        assert models(server)["smol-b"]["state"] == "loaded" and models(server)["smol-a"]["state"] == "unloaded"
        status = subprocess.run(
            [*TETHER, "status", "--url", server.url], capture_output=True, text=True, timeout=30, check=True
        )
        assert "smol-b" in status.stdout and "scheduler decisions" in status.stdout, status.stdout
        assert re.search(r"loaded smol-b: smol-b loaded in [\d.]+ s, holding [\d.]+ [MG]iB", status.stdout), (
            status.stdout
        )


def test_keep_alive_takes_seconds_and_go_durations_and_anything_beyond_31_years_is_for_ever() -> None:
    assert keep_alive_seconds("1h30m") == 5400 and keep_alive_seconds("250ms") == 0.25 and keep_alive_seconds(0) == 0
    assert keep_alive_seconds(-1) == keep_alive_seconds("-1s") == keep_alive_seconds(4.1e16) == math.inf
    assert keep_alive_seconds(None) is None
    for bad in ("soon", "5 m", True):
        with pytest.raises(InvalidField, match="keep_alive must be"):
            keep_alive_seconds(bad)  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_a_request_for_a_model_that_needs_a_busy_one_unloaded_waits_its_turn(catalog: Path) -> None:
    """Ollama queues such a request: two catalogued models, --max-loaded 1, four clients asking for either at random,
    60 requests: none refused, each answered by the model it asked for; the loads waited for the busy model to be
    idle (``wait_idle``) and evicted it then."""
    busy = {"options": {"token_seconds": 0.02, "parallel": 4}}
    write_catalog(catalog, ma=busy, mb=busy)
    with serving("--engine", "debug", "--catalog", str(catalog), "--max-loaded", "1", "--load-wait", "120") as server:
        rng = random.Random(34)
        plan = [rng.choice(["ma", "mb"]) for _ in range(60)]
        answers: list[tuple[str, int, str]] = []
        lock = threading.Lock()

        def client(mine: list[str]) -> None:
            for model in mine:
                response = ask(server, model)
                model_out = response.json().get("model", "") if response.status_code == 200 else response.text
                with lock:
                    answers.append((model, response.status_code, model_out))

        threads = [threading.Thread(target=client, args=(plan[i::4],)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(200)
        failed = [a for a in answers if a[1] != 200]
        assert len(answers) == 60 and not failed, failed
        assert all(model == served for model, _, served in answers), answers
        swaps = decisions(server)
        assert any(d["kind"] == "wait_idle" for d in swaps), swaps  # it waited, at least once
        assert not [d for d in swaps if d["kind"] in ("refuse", "load_failed")], swaps
        assert len([h for h in server.http.get("/v1/instances").json()["data"]]) <= 1


@pytest.mark.timeout(60)
def test_a_load_waiting_for_a_busy_model_past_load_wait_is_a_503_naming_it(catalog: Path) -> None:
    write_catalog(catalog, ma={"options": {"token_seconds": 0.05}}, mb={})
    with serving("--engine", "debug", "--catalog", str(catalog), "--max-loaded", "1", "--load-wait", "2") as server:
        assert ask(server, "ma").status_code == 200
        streaming = threading.Thread(target=lambda: ask(server, "ma", max_tokens=200))  # ~10 s busy
        streaming.start()
        wait_until(lambda: models(server)["ma"]["busy"], 10, "ma busy")
        began = time.monotonic()
        late = ask(server, "mb")
        took = time.monotonic() - began
        assert late.status_code == 503 and 1.5 < took < 8, (late.status_code, took, late.text)
        message = late.json()["error"]["message"]
        for words in ("mb", "ma busy with 1 request(s)", "--load-wait", "--max-loaded 1"):
            assert words in message, message
        assert models(server)["ma"]["state"] == "loaded"  # never evicted under its stream
        streaming.join(30)
        again = ask(server, "mb")
        assert again.status_code == 200, again.text  # ma idle now: evicted at once for mb
