"""The models target: three catalogued debug models, each really holding memory, under a worker memory cgroup that
holds two, asked for at random with a keep-alive short enough that loads, evictions and unloads race the requests.

Attacks strike a runner while it loads, is evicted or is unloaded (SIGKILL, SIGSTOP), make a load OOM (``oomy``, in
its own runner cgroup), or SIGKILL the worker mid-load or mid-eviction. Beside the single campaign's checks, each
trial checks: no OOM kill the scheduler did not predict (``_check_no_unplanned_oom``); no runner starting while one
evicted before its load still lives (``ModelWatcher``); the models the API calls loaded are exactly those with a live
runner (``_check_reality``). A strike whose moment the drawn requests missed is asked for again
(``_make_moment``). Without cgroup v1's memory controller the campaign runs with ``--max-loaded 3`` and says so:
eviction is then by count. docs/chaos.md, "Targets", says what each means to a user.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from tether.chaos.campaign import Report, drive
from tether.chaos.plan import Attack, Only, Trial, draw, indices
from tether.chaos.target import Target, runner_processes
from tether.chaos.trial import (
    DEADLINES,
    GONE_BOUND,
    REQUEST_BOUND,
    STATE_BOUND,
    Outcome,
    Streams,
    TrialResult,
    _cgroups_of,
    _expect_outcomes,
    _reap,
    _show,
    _still_there,
)
from tether.kernel.cgroups import MemoryCgroup, create_child_cgroup, remove_cgroup
from tether.kernel.pids import alive, cmdline
from tether.protocol import CauseKind, RunnerArgs

NAME = "models"
MiB = 1 << 20
MODELS = ("m0", "m1", "m2")
OOMY = "oomy"  # its load is OOM-killed in its own runner cgroup (64 MiB): the one OOM kill a trial may plant
HOLD = 150 * MiB  # each model's weights: estimated 206 MiB with the runner and headroom
LIMIT = (
    560 * MiB
)  # the worker (~70 MiB), the command line's model (56 MiB estimated) and two models (206 each); not three
KEEP_ALIVE = 0.6  # seconds: idle models unload while the trial's requests still come
STOP_TIMEOUT = 2.0  # a SIGSTOPped runner being stopped is SIGKILLed after this
REQUESTS = (3, 5, 8)
POLL = 0.01
MOMENT_ROUNDS = 3  # rounds of requests a trial makes again when its drawn ones never made its moment come
# An eviction needs two models loaded when the third's load is placed; loads take turns, so on busy cores a load
# outlasts KEEP_ALIVE and the model before it has unloaded by then. A remade round for an eviction asks with this
# keep-alive (seconds), under the unload strike's wait (KEEP_ALIVE + 3 s) so a later trial still sees them unload.
EVICT_KEEP_ALIVE = 3.0

MODEL_ATTACKS: tuple[Attack, ...] = (
    Attack("race", None, ("requests",)),  # no fault: loads, evictions and unloads racing the requests alone
    Attack("sigkill", CauseKind.SIGNAL, ("load", "evict", "unload"), outside_signal="SIGKILL"),
    Attack("sigstop", CauseKind.HANG, ("load", "evict", "unload"), outside_signal="SIGSTOP"),
    Attack("oom", CauseKind.OUT_OF_MEMORY, ("load",), engine_fault={"kind": "oom", "phase": "load"}),
    Attack("worker_sigkill", None, ("load", "evict"), worker_signal="SIGKILL"),
)


def catalog_text() -> str:
    """The catalog: ``m0``-``m2`` (slow enough to load and stop that attacks land inside), and ``oomy``."""
    options = (
        f"{{ hold_bytes = {HOLD}, load_steps = 10, load_step_seconds = 0.02, close_seconds = 0.15, "
        "token_seconds = 0.002, parallel = 4 }"
    )
    restart = "{ initial_backoff = 0.05, max_backoff = 0.5, jitter = 0.0, crash_loop_failures = 100 }"
    deadlines = "{ " + ", ".join(f"{k} = {v}" for k, v in DEADLINES.items()) + " }"
    lines = [f"keep_alive = {KEEP_ALIVE}"]
    for model in MODELS:
        lines += ["", "[[models]]", f'id = "{model}"', 'engine = "debug"', f"options = {options}"]
        lines += [f"restart = {restart}", f"deadlines = {deadlines}"]
    lines += ["", "[[models]]", f'id = "{OOMY}"', 'engine = "debug"', f"memory_limit = {64 * MiB}"]
    lines += ['faults = [{ kind = "oom", phase = "load" }]', 'restart = { mode = "never" }']
    return "\n".join(lines) + "\n"


def plan(seed: int, trials: int, only: Only = None) -> list[Trial]:
    pick = functools.partial(draw, attacks=MODEL_ATTACKS, target=NAME, streams_choice=REQUESTS)
    drawn = [pick(seed, i) for i in indices(trials, only)]
    # ``draw`` gives one stream outside its generating phases: here every trial sends several requests
    return [t if t.streams > 1 else _with_requests(t) for t in drawn]


def _with_requests(trial: Trial) -> Trial:
    import dataclasses

    rng = random.Random(f"{trial.seed}:{trial.index}:{NAME}:requests")
    return dataclasses.replace(trial, streams=rng.choice(REQUESTS))


@dataclass
class ModelsServer:
    """The models server: a ``Target`` in a memory cgroup of its own (None where none can be made)."""

    target: Target
    cgroup: MemoryCgroup | None

    def oom_kills(self) -> int:
        return (self.cgroup.oom_kills() or 0) if self.cgroup is not None else 0


def start_server(workdir: Path) -> ModelsServer:
    """A ``tether serve`` with the catalog, in a fresh memory cgroup (below this process's) limited to ``LIMIT``."""
    workdir.mkdir(parents=True, exist_ok=True)
    catalog = workdir / "catalog.toml"
    catalog.write_text(catalog_text())
    cgroup, _why = create_child_cgroup(f"chaos-models-{uuid.uuid4().hex[:8]}x", LIMIT)
    args = ["--engine", "debug", "--name", "warm", "--catalog", str(catalog), "--reclaim-timeout", "10"]
    if cgroup is None:
        args += ["--max-loaded", "3"]
    try:
        target = Target(workdir, serve=tuple(args), cgroup=cgroup.path if cgroup else None, stop_timeout=STOP_TIMEOUT)
    except BaseException:
        if cgroup is not None:
            _remove_tree(cgroup.path)
        raise
    return ModelsServer(target, cgroup)


def _remove_tree(path: Path, bound: float = GONE_BOUND) -> bool:
    """Remove a cgroup and every cgroup below it (each empty), waiting ``bound`` s for the last members to leave."""
    deadline = time.monotonic() + bound
    while True:
        for child in sorted((c for c in path.glob("**/*") if c.is_dir()), reverse=True):
            with contextlib.suppress(OSError):
                child.rmdir()
        if remove_cgroup(MemoryCgroup.at(path)) or time.monotonic() > deadline:
            return not path.exists()
        time.sleep(POLL)


def _tree_pids(path: Path) -> list[int]:
    pids: list[int] = []
    for procs in [path / "cgroup.procs", *path.glob("**/cgroup.procs")]:
        with contextlib.suppress(OSError, ValueError):
            pids += [int(x) for x in procs.read_text().split()]
    return sorted(set(pids))


@dataclass
class ModelWatcher:
    """Polls the API (one ``GET /v1/instances``: every instance and the scheduler's models and decisions) and
    ``/proc`` every ``POLL`` s through a trial: the runner pids each model had, the strike when its moment comes,
    and any runner that started while one evicted before its load was still alive."""

    client: httpx.AsyncClient
    trial: Trial
    strike: Callable[[str, int], None] | None = None  # (model, runner pid): the attack, once
    moment: str | None = None  # load | evict | unload: when to strike
    pids: dict[str, set[int]] = field(default_factory=dict)
    struck: tuple[str, int] | None = None
    evicted: dict[int, float] = field(default_factory=dict)  # runner pid -> its eviction's decision time
    problems: list[str] = field(default_factory=list)
    snapshot: dict[str, Any] = field(default_factory=dict)
    polls: int = 0
    _stopped: set[int] = field(default_factory=set)  # SIGSTOPped by the trial: alive until the stop's SIGKILL
    _decided: set[tuple[float, str, str]] = field(default_factory=set)  # decisions seen
    _current: dict[str, int] = field(default_factory=dict)  # each model's runner pid at the last poll

    async def poll(self) -> dict[str, Any]:
        response = await self.client.get("/v1/instances")
        data: dict[str, Any] = response.json()
        self.snapshot = data
        self.polls += 1
        return data

    async def run(self) -> None:
        with contextlib.suppress(httpx.TransportError):
            while True:
                self._see(await self.poll())
                await anyio.sleep(POLL)

    def _see(self, data: dict[str, Any]) -> None:
        states = {m: s["state"] for m, s in data["scheduler"]["models"].items()}
        last: dict[str, dict[str, Any]] = {}
        for decision in data["scheduler"]["decisions"]:
            last[decision["model"]] = decision
        runners = {i["id"]: i.get("runner") or {} for i in data["data"]}
        for decision in data["scheduler"]["decisions"]:  # an eviction evicts the runner its model had last
            key = (decision["at"], decision["kind"], decision["model"])
            if key in self._decided:
                continue
            self._decided.add(key)
            pid = self._current.get(decision["model"])
            if decision["kind"] == "evict" and decision.get("why") == "memory" and pid is not None:
                self.evicted.setdefault(pid, decision["at"])
        for model, runner in runners.items():
            pid = runner.get("pid")
            if not isinstance(pid, int):
                continue
            known = self.pids.setdefault(model, set())
            if pid not in known:
                known.add(pid)
                # a new runner: whatever was evicted before this model's load began must be gone by now
                began = last.get(model, {}).get("at", 0.0) if last.get(model, {}).get("kind") == "load" else 0.0
                held = [p for p, at in self.evicted.items() if at <= began and alive(p) and p not in self._stopped]
                if held:
                    self.problems.append(
                        f"runner {pid} of {model} started while runners evicted before its load were alive: {held}"
                    )
        self._current.update({m: r["pid"] for m, r in runners.items() if isinstance(r.get("pid"), int)})
        if self.strike is None or self.struck is not None:
            return
        for model, state in states.items():
            if model not in MODELS:
                continue
            runner = runners.get(model, {})
            pid = runner.get("pid")
            if self.moment == "load":
                ok = state == "loading" and isinstance(pid, int) and runner.get("status") in ("starting", "loading")
            elif self.moment in ("evict", "unload"):
                # The scheduler decides "evict" before it stops the runner, "unload" only once it is gone: an
                # unloading model whose last decision is no eviction is being unloaded (its keep-alive ran out).
                evicting = last.get(model, {}).get("kind") == "evict"
                ok = state == "unloading" and evicting == (self.moment == "evict")
                pid = max(self.pids.get(model, {0}))
            else:
                ok = False
            if ok and isinstance(pid, int) and pid > 0:
                self.struck = (model, pid)
                self.strike(model, pid)
                return


def _draws(trial: Trial) -> list[tuple[str, float, int]]:
    """The trial's requests: (model, when in s from the start, max_tokens). An eviction needs the three models
    asked in turn, so an ``evict`` trial asks them first, each once, in a drawn order."""
    rng = random.Random(f"{trial.seed}:{trial.index}:{NAME}:moments")
    asks = [(rng.choice(MODELS), rng.uniform(0.0, 0.8), rng.randint(4, 24)) for _ in range(trial.streams)]
    if trial.phase in ("evict", "requests") or trial.attack.worker_signal is not None:
        order = rng.sample(MODELS, len(MODELS))
        asks = [(m, 0.3 * i, rng.randint(4, 12)) for i, m in enumerate(order)] + asks
    if trial.attack.name == "oom":
        asks.insert(rng.randrange(len(asks) + 1), (OOMY, rng.uniform(0.0, 0.5), 4))
    return asks


async def _ask(
    client: httpx.AsyncClient,
    model: str,
    after: float,
    tokens: int,
    out: list[Outcome],
    keep_alive: float | None = None,
) -> None:
    await anyio.sleep(after)
    streams = Streams(client, model, tokens, sampling=None if keep_alive is None else {"keep_alive": keep_alive})
    await streams.one(prompt=f"ask {model}")
    outcome = streams.outcomes[0]
    outcome.prompt = model  # which model it asked, for the checks
    out.append(outcome)


async def _await_unload(watcher: ModelWatcher) -> None:
    """For an ``unload`` strike: wait (bounded) for the models just used to unload after their keep-alive."""
    if watcher.moment != "unload" or watcher.strike is None:
        return
    with anyio.move_on_after(KEEP_ALIVE + 3.0):
        while watcher.struck is None:
            await anyio.sleep(POLL)


async def _make_moment(client: httpx.AsyncClient, watcher: ModelWatcher, out: list[Outcome]) -> int:
    """When the drawn requests ended without the trial's moment (a load, an eviction, an unload: the scheduler
    raced them another way), ask again until it comes, at most ``MOMENT_ROUNDS`` rounds: the models loaded now
    first, then the others one by one, so one of them loads, and with two loaded the third evicts one (they are
    asked with ``EVICT_KEEP_ALIVE`` for an eviction); then the keep-alive unloads them. Every request it makes is
    checked like the drawn ones. The rounds it took."""
    rounds = 0
    keep_alive = EVICT_KEEP_ALIVE if watcher.moment == "evict" else None
    while watcher.strike is not None and watcher.struck is None and rounds < MOMENT_ROUNDS:
        rounds += 1
        models = watcher.snapshot.get("scheduler", {}).get("models", {})
        loaded = sorted(m for m in MODELS if models.get(m, {}).get("state") == "loaded")
        for model in loaded + sorted(m for m in MODELS if m not in loaded):
            if watcher.struck is not None:
                break
            await _ask(client, model, 0.0, 6, out, keep_alive)
        await _await_unload(watcher)
    return rounds


def _allowed_for(trial: Trial, model: str) -> tuple[set[str], str | None]:
    """(the outcomes a request for ``model`` may end in, the cause a failure must carry)."""
    attack = trial.attack
    if model == OOMY:
        return {"rejected", "failed"}, CauseKind.OUT_OF_MEMORY.value
    if attack.outside_signal is not None and trial.phase == "load":
        return {"complete", "rejected", "failed"}, attack.expect.value if attack.expect else None
    return {"complete"}, None


async def run_trial(server: ModelsServer, trial: Trial) -> TrialResult:
    """A trial on the shared server: its requests at their moments, the strike, then every check."""
    result = TrialResult(trial)
    began = time.monotonic()
    target = server.target
    kills_before = server.oom_kills()
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(base_url=target.url, timeout=httpx.Timeout(REQUEST_BOUND)) as client:
        watcher = ModelWatcher(client, trial, moment=trial.phase if trial.attack.outside_signal else None)
        sig = getattr(signal, trial.attack.outside_signal or "SIGKILL")

        def strike(model: str, pid: int) -> None:
            if sig == signal.SIGSTOP:
                watcher._stopped.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

        if trial.attack.outside_signal is not None:
            watcher.strike = strike
        async with anyio.create_task_group() as tg:
            tg.start_soon(watcher.run)
            async with anyio.create_task_group() as asks:
                for model, after, tokens in _draws(trial):
                    asks.start_soon(_ask, client, model, after, tokens, outcomes)
            await _await_unload(watcher)
            result.remade = await _make_moment(client, watcher, outcomes)
            settled = await _settle(watcher)
            tg.cancel_scope.cancel()
        if not settled:
            result.broke("hung", f"models still loading or unloading {STATE_BOUND:g} s after the trial")
        for outcome in outcomes:
            allowed, cause = _allowed_for(trial, outcome.prompt)
            _expect_outcomes(result, [outcome], allowed, cause)
            if outcome.kind == "rejected" and cause is not None and outcome.cause not in (cause, None):
                result.broke("misclassified", f"a request for {outcome.prompt} ended {_show(outcome)}, not {cause}")
            if outcome.prompt != OOMY and outcome.cause == CauseKind.OUT_OF_MEMORY.value:
                result.broke("misclassified", f"an OOM kill nobody planted: {outcome.prompt}: {_show(outcome)}")
        result.problems += watcher.problems
        result.missed = watcher.strike is not None and watcher.struck is None
        _check_no_unplanned_oom(result, watcher.snapshot)
        await anyio.to_thread.run_sync(_check_reality, result, target, watcher)
    if server.oom_kills() != kills_before:
        result.broke("misclassified", f"the worker's cgroup counted {server.oom_kills() - kills_before} OOM kill(s)")
    result.outcomes = outcomes
    result.seconds = time.monotonic() - began
    return result


async def _settle(watcher: ModelWatcher) -> bool:
    """Wait (bounded) until no model loads or unloads and every instance is ready."""
    with anyio.move_on_after(STATE_BOUND):
        while True:
            data = await watcher.poll()
            moving = [m for m, s in data["scheduler"]["models"].items() if s["state"] in ("loading", "unloading")]
            busy = [m for m, s in data["scheduler"]["models"].items() if s.get("busy")]
            unready = [i["id"] for i in data["data"] if not i.get("ready")]
            if not (moving or busy or unready):
                return True
            await anyio.sleep(POLL)
    return False


def _check_no_unplanned_oom(result: TrialResult, data: dict[str, Any]) -> None:
    for instance in data.get("data", []):
        if instance["id"] == OOMY:
            continue
        for failure in instance.get("history") or []:
            if (failure.get("cause") or {}).get("kind") == CauseKind.OUT_OF_MEMORY.value:
                result.broke("misclassified", f"{instance['id']} was OOM-killed: {failure['cause'].get('summary')}")


def _check_reality(result: TrialResult, target: Target, watcher: ModelWatcher) -> None:
    """The loaded models are those with a live runner; nothing lives, nor has a cgroup or record, for the others."""
    data = watcher.snapshot
    loaded = {m for m, s in data["scheduler"]["models"].items() if s["state"] == "loaded"}
    running = {i["id"]: (i.get("runner") or {}).get("pid") for i in data["data"]}
    for model in sorted(loaded):
        pid = running.get(model)
        if not isinstance(pid, int) or not alive(pid):
            result.problems.append(f"the API says {model} is loaded, but its runner {pid} is not alive")
    gone = {m: sorted(p) for m, p in watcher.pids.items() if m not in loaded}
    for model, pids in gone.items():
        left, held = _still_there(pids, target.pid, f"{model}-", GONE_BOUND)
        if left or held:
            result.broke("orphans", f"{model} is unloaded, but its runners {left} (in its cgroups {held}) live on")
    deadline = time.monotonic() + GONE_BOUND
    while True:
        strays = _strays(target, loaded)
        if not strays or time.monotonic() > deadline:
            break
        time.sleep(POLL)
    if strays:
        result.problems.append(f"the API says only {sorted(loaded)} are loaded, but these exist: {strays}")


def _strays(target: Target, loaded: set[str]) -> list[str]:
    """Runner processes, runner cgroups and records of the worker that belong to no loaded model."""
    strays = []
    for pid in runner_processes({target.pid}):
        args = RunnerArgs.from_cmdline(cmdline(pid) or [])
        if args is not None and args.runner_id.rsplit("-", 1)[0] not in loaded:
            strays.append(f"runner process {pid} ({args.runner_id})")
    for cgroup in _cgroups_of(target.pid, ""):
        if cgroup.runner_id.rsplit("-", 1)[0] not in loaded:
            strays.append(f"runner cgroup {cgroup.cgroup.path.name}")
    for path in target.runtime_dir.glob("runner-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            runner_id = str(json.loads(path.read_text())["runner_id"])
            if runner_id.rsplit("-", 1)[0] not in loaded:
                strays.append(f"record {path.name} ({runner_id})")
    return strays


async def run_worker_trial(trial: Trial, workdir: Path) -> TrialResult:
    """SIGKILL the worker while a model loads or is evicted, on a server and cgroup of its own: then every runner
    and every process in the cgroup must be gone within the bound, ``tether orphans --reap`` clears the records
    and runner cgroups, and the cgroup can be removed."""
    result = TrialResult(trial)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(dir=workdir, prefix=f"worker-{trial.index}-") as tmp:
        server = await anyio.to_thread.run_sync(start_server, Path(tmp))
        target = server.target
        seen: set[int] = set(target.runners())
        outcomes: list[Outcome] = []
        try:
            async with httpx.AsyncClient(base_url=target.url, timeout=httpx.Timeout(REQUEST_BOUND)) as client:
                watcher = ModelWatcher(client, trial, moment=trial.phase)
                watcher.strike = lambda _model, _pid: target.signal(signal.SIGKILL)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watcher.run)
                    async with anyio.create_task_group() as asks:
                        for model, after, tokens in _draws(trial):
                            asks.start_soon(_ask, client, model, after, tokens, outcomes)
                    result.remade = await _make_moment(client, watcher, outcomes)
                    tg.cancel_scope.cancel()
                seen |= {p for pids in watcher.pids.values() for p in pids}
                result.missed = watcher.struck is None
            _expect_outcomes(result, outcomes, {"complete", "cut"}, None)
        finally:
            target.signal(signal.SIGKILL)  # struck already, or the moment never came: strike now
            await anyio.to_thread.run_sync(target.wait_exit)
        seen |= set(target.runners())
        left, held = await anyio.to_thread.run_sync(_still_there, sorted(seen), target.pid, "", GONE_BOUND)
        if left or held:
            result.broke("orphans", f"the worker's runners outlived it: {left}, in their cgroups {held}")
        if server.cgroup is not None:
            deadline = time.monotonic() + GONE_BOUND
            while (inside := _tree_pids(server.cgroup.path)) and time.monotonic() < deadline:
                await anyio.sleep(POLL)
            if inside:
                result.broke("orphans", f"processes left in the worker's cgroup after it died: {inside}")
        await anyio.to_thread.run_sync(_reap, target)
        if server.cgroup is not None:
            leftover = [p.name for p in server.cgroup.path.iterdir() if p.is_dir()]
            if leftover:
                result.problems.append(f"runner cgroups left after tether orphans --reap: {leftover}")
            if not await anyio.to_thread.run_sync(_remove_tree, server.cgroup.path):
                result.problems.append(f"the worker's cgroup {server.cgroup.path} could not be removed")
        result.outcomes = outcomes
    result.seconds = time.monotonic() - began
    return result


async def run_campaign(
    seed: int,
    trials: int,
    *,
    only: Only = None,
    progress: Callable[[TrialResult], None] | None = None,
    engine: str = "debug",
) -> Report:
    """The models campaign ``seed`` (or only its trial ``only``); its servers and cgroups are gone when it
    returns."""
    if engine != "debug":
        raise ValueError(
            f"the models target runs the debug engine only (its models hold memory on purpose), not {engine!r}"
        )
    report = Report(seed, NAME)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tether-chaos-models-") as tmp:
        workdir = Path(tmp)
        server = await anyio.to_thread.run_sync(start_server, workdir / "shared")
        report.extra.update(
            memory_limit_mib=LIMIT // MiB if server.cgroup else None, models=len(MODELS), keep_alive_s=KEEP_ALIVE
        )
        try:

            async def run(trial: Trial) -> TrialResult:
                if trial.attack.worker_signal is not None:
                    return await run_worker_trial(trial, workdir)
                return await run_trial(server, trial)

            warm = Trial(seed, -1, MODEL_ATTACKS[0], "requests", 3, 1, 0.0, 8, NAME)
            await drive(report, server.target, warm, plan(seed, trials, only), run, progress)
            report.extra["missed_strikes"] = sum(r.missed for r in report.results)
            report.extra["strikes_remade"] = sum(1 for r in report.results if r.remade and not r.missed)
            report.extra.update(_counts(server))
        finally:
            await anyio.to_thread.run_sync(server.target.stop)
            if server.cgroup is not None:
                await anyio.to_thread.run_sync(_remove_tree, server.cgroup.path)
    report.wall_s = time.monotonic() - began
    return report


def _counts(server: ModelsServer) -> dict[str, int]:
    """What the shared server's scheduler did over the whole campaign (its ``/metrics`` counters; the API's
    decisions are its latest 256 only): evictions (for memory or the model count), keep-alive unloads, loads."""
    try:
        text = httpx.get(f"{server.target.url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {"evictions": -1, "unloads": -1, "loads": -1}
    counts = {"evictions": 0, "unloads": 0, "loads": 0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tether_model_evictions_total":
                reason = sample.labels.get("reason")
                key = "evictions" if reason in ("memory", "max_loaded") else "unloads" if reason == "keep_alive" else ""
            elif sample.name == "tether_model_loads_total" and sample.labels.get("outcome") == "loaded":
                key = "loads"
            else:
                continue
            if key:
                counts[key] += int(sample.value)
    return counts
