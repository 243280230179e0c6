"""The ranks target: 2- and 3-rank instances on one machine, one rank struck mid-stream: debug rings, or the default
model split over ranks on llama.cpp (``--engine llama.cpp``: ggml's RPC backend between the rank processes).

Each trial strikes a random rank (SIGKILL; SIGSTOP past the hang deadlines; an OOM kill, debug rings only, since a
real rank runs out of memory only on a prompt long enough for its layers' scratch; a held port, bound by the campaign
between the failure and the replacement) and checks, beside the single campaign's checks, what multi-rank instances
promise: one failure with one cause naming the struck rank (``_expect_cause``); no replacement rank before every
process of the earlier life is gone (``Watcher.early_starts``); the same ports again, a held one refused naming its
holder (``_expect_held``). What each attack and check means to a user: docs/chaos.md, "Targets".
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import random
import re
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from tether.chaos import cluster
from tether.chaos.campaign import Report, drive
from tether.chaos.plan import WARM_UP, Attack, Only, Trial, engine_plan
from tether.chaos.target import Target, fd_links, rss
from tether.chaos.trial import (
    DEADLINES,
    REQUEST_BOUND,
    Streams,
    TrialResult,
    _check_gone,
    _expect_outcomes,
    _instance,
    _show,
    _wait_instance,
)
from tether.kernel.pids import holds_listener, proc_stat
from tether.kernel.ports import RankPorts
from tether.protocol import CauseKind, RunnerArgs

NAME = "ranks"
CLUSTER_NAME = "cluster-ranks"  # the same trials with each rank on its own node of a Ray cluster
ENGINES = ("debug", "llama.cpp")
WORLDS = (2, 3)
STREAMS = (1, 2, 4)  # parallel 2: with 4, two wait in rank 0's queue
STATE_BOUND = 40.0  # seconds for a ring of 3 to start again on two shared cores
POLL = 0.005  # the watcher's period
MEMORY_LIMIT = 96 << 20  # each rank's own cgroup: the oom fault fills it
MiB = 1 << 20
PORT_BASE = 30000  # pinned ports, apart from the tests' 26000-29999 and below the ephemeral range (32768)
OPTIONS = {"load_steps": 3, "load_step_seconds": 0.01, "token_seconds": 0.01, "parallel": 2, "helpers": 1}
HELPER_KINDS = ("exec", "setsid")  # setsid: out of the rank's process group, only its cgroup holds the helper
# A stopped rank must be found by its own heartbeat, before rank 0's token_gap sees the ring stall: token_gap is
# longer than the heartbeat deadline, so the cause is the stopped rank's.
RANK_DEADLINES = {**DEADLINES, "warmup": 20.0, "load_stall": 10.0, "first_token": 6.0, "token_gap": 4.0}

RANK_ATTACKS: tuple[Attack, ...] = (
    Attack("sigkill", CauseKind.SIGNAL, ("generating",), outside_signal="SIGKILL"),
    Attack("sigstop", CauseKind.HANG, ("generating",), outside_signal="SIGSTOP"),
    Attack("oom", CauseKind.OUT_OF_MEMORY, ("generating",), engine_fault={"kind": "oom"}, memory_limit=MEMORY_LIMIT),
    Attack("held_port", CauseKind.SIGNAL, ("generating",), outside_signal="SIGKILL"),
)
REAL_ATTACKS = tuple(a for a in RANK_ATTACKS if a.engine_fault is None)  # the real engine takes no injected fault
# The default model over 2 or 3 ranks sharing two cores: one thread each, greedy, short answers (a real token is
# ~10x a debug one here); deadlines as the ring's, with time for a first token behind a queue of 2.
REAL_OPTIONS = {"n_ctx": 1024, "parallel": 2, "n_threads": 1, "prompt_cache": False}
REAL_TOKENS = 24
REAL_DEADLINES = {**RANK_DEADLINES, "load_stall": 20.0, "first_token": 10.0, "token_gap": 5.0}


@dataclass(frozen=True)
class Draw:
    """A trial's own choices beside the plan's: how many ranks, which one is struck, whose port is held, and the
    kind of its ranks' helper."""

    world: int
    victim: int
    held: int
    helper_kind: str


def draws(trial: Trial, engine: str = "debug") -> Draw:
    """The trial's ranks, victim, held port and helper kind. On llama.cpp the held port is one of an RPC server's
    (ranks 1..): rank 0 dials them and listens on nothing, so a stranger on its address stops no life."""
    rng = random.Random(f"{trial.seed}:{trial.index}:{NAME}:ranks")
    world = rng.choice(WORLDS)
    victim = rng.randrange(world)
    held = rng.randrange(world) if engine == "debug" else rng.randrange(1, world)
    return Draw(world, victim, held, rng.choice(HELPER_KINDS))


def plan(seed: int, trials: int, only: Only = None, engine: str = "debug", target: str = NAME) -> list[Trial]:
    """The trials of ``target`` (``ranks``, or ``cluster-ranks``: the same attacks, their own draws and replay)."""
    attacks = RANK_ATTACKS if engine == "debug" else REAL_ATTACKS
    return engine_plan(
        seed,
        trials,
        only,
        target=target,
        attacks=attacks,
        streams_choice=STREAMS,
        engine=engine,
        real_tokens=REAL_TOKENS,
    )


# --------------------------------------------------------------------------------------------------------------
# The watcher: every process of the instance, from /proc
# --------------------------------------------------------------------------------------------------------------


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


_TICK = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass
class Seen:
    """One process of the instance: a rank's runner, its guard (a fork sharing its command line) or a helper."""

    pid: int
    role: str  # runner | guard | helper
    runner_id: str  # the rank's runner id, ``<iid>-<life>.rank<k>`` (a helper's: its runner's)
    life: int
    rank: int
    start_ticks: int
    started: float  # seconds since boot (to a clock tick, rounded down)
    last_alive: float  # the last moment (seconds since boot) it was seen alive: it was alive then or later
    gone: float | None = None


_RUNNER_ID = re.compile(r"^(?P<iid>.+)-(?P<life>\d+)\.rank(?P<rank>\d+)$")


class Watcher(threading.Thread):
    """Polls /proc every ``POLL`` s for the processes of instance ``iid`` of ``workers`` (the worker, or on a
    cluster every node agent: each spawns its node's ranks): each rank's runner (by its command line), its guard,
    and its helpers (children of a runner, or members of its cgroup); records when each started and the last moment
    it was alive."""

    def __init__(self, workers: Collection[int], iid: str) -> None:
        super().__init__(daemon=True, name=f"chaos-ranks-{iid}")
        self.workers = frozenset(workers)
        self.iid = iid
        self.seen: dict[int, Seen] = {}
        self._ignored: set[int] = set()
        self._pending: dict[int, float] = {}  # forked, not yet exec'd (or not yet in its cgroup): looked at again
        self._halt = threading.Event()
        self._lock = threading.Lock()
        owners = "|".join(str(w) for w in sorted(self.workers))
        self._cgroup = re.compile(rf"tether-(?P<runner>{re.escape(iid)}-\d+\.rank\d+)-(?:{owners})\b")
        self._ignored.update(int(e) for e in os.listdir("/proc") if e.isdigit())  # what ran before the trial

    def run(self) -> None:
        while not self._halt.wait(POLL):
            self.poll()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.poll()

    def processes(self) -> list[Seen]:
        with self._lock:
            return list(self.seen.values())

    def poll(self) -> None:
        with self._lock:
            for seen in self.seen.values():
                if seen.gone is None:
                    now = _boottime()  # taken before the read: if alive, it was alive at ``now`` or later
                    stat = proc_stat(seen.pid)
                    if stat is not None and stat.start_ticks == seen.start_ticks and stat.state not in ("Z", "X"):
                        seen.last_alive = now
                    else:
                        seen.gone = now
            fresh = [int(e) for e in os.listdir("/proc") if e.isdigit()]
            for pid in fresh:
                if pid not in self.seen and pid not in self._ignored:
                    self._classify(pid)

    def _classify(self, pid: int) -> None:
        now = _boottime()
        stat = proc_stat(pid)
        if stat is None or stat.state in ("Z", "X"):
            self._pending.pop(pid, None)
            self._ignored.add(pid)
            return
        args = _cmdline(pid)
        runner = RunnerArgs.from_cmdline(args) if args else None
        owner: str | None = None
        role = "helper"
        if runner is not None and runner.worker_pid in self.workers and _RUNNER_ID.match(runner.runner_id):
            match = _RUNNER_ID.match(runner.runner_id)
            if match is not None and match["iid"] == self.iid:
                leads = stat.pgid == pid and stat.ppid in self.workers  # a fork of it (its guard) shares its args
                owner, role = runner.runner_id, "runner" if leads else "guard"
        elif runner is None:
            parent = self.seen.get(stat.ppid)
            if parent is not None:
                owner = parent.runner_id
            elif (match := self._cgroup.search(_read(f"/proc/{pid}/cgroup"))) is not None:
                owner = match["runner"]
        if owner is None:
            young = stat.ppid in self.workers or stat.ppid in self.seen
            first = self._pending.setdefault(pid, now)
            if not young or now - first > 2.0:
                self._pending.pop(pid, None)
                self._ignored.add(pid)
            return
        self._pending.pop(pid, None)
        m = _RUNNER_ID.match(owner)
        assert m is not None
        started = stat.started_since_boot
        self.seen[pid] = Seen(pid, role, owner, int(m["life"]), int(m["rank"]), stat.start_ticks, started, now)

    def early_starts(self) -> list[str]:
        """Every replacement rank that started before a process of an earlier life was last seen alive."""
        found = []
        procs = self.processes()
        for new in procs:
            if new.role != "runner":
                continue
            started_by = new.started + _TICK  # its start, rounded up: it started at this moment or before
            for old in procs:
                if old.life < new.life and old.last_alive > started_by:
                    found.append(
                        f"rank {new.rank} of life {new.life} (pid {new.pid}) started {old.last_alive - new.started:.3f}"
                        f" s before {old.role} pid {old.pid} of rank {old.rank}, life {old.life}, was last seen alive"
                    )
        return found


def _cmdline(pid: int) -> list[str] | None:
    raw = _read(f"/proc/{pid}/cmdline")
    return raw.removesuffix("\0").split("\0") if raw else None


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------------------
# One trial
# --------------------------------------------------------------------------------------------------------------


@dataclass
class RankFigures:
    """What the campaign counts over its trials, beside the invariants."""

    replacements: int = 0  # replacement lives whose start was checked against their predecessors' end
    held_refusals: int = 0  # lives refused while the campaign held a port
    held_missed: int = 0  # held_port trials where the campaign could not take the port in time (no check made)
    detections: list[float] = field(default_factory=list)  # failure detection, s (the history's detected_in)


def _config(trial: Trial, iid: str, d: Draw, ports: tuple[int, ...], engine: str) -> dict[str, Any]:
    attack = trial.attack
    held = attack.name == "held_port"
    real = engine != "debug"
    config: dict[str, Any] = {
        "id": iid,
        "engine": engine,
        "ranks": d.world,
        "ports": list(ports),
        "options": dict(REAL_OPTIONS) if real else {**OPTIONS, "helper_kind": d.helper_kind},
        "restart": {
            "initial_backoff": 1.0 if held else 0.05,  # held: time to take the port between failure and restart
            "max_backoff": 1.0,
            "jitter": 0.0,
            "crash_loop_failures": 100,
        },
        "deadlines": REAL_DEADLINES if real else RANK_DEADLINES,
        "max_queue": 64,
        "resume": not held,  # a resume restarts the group at once: no time to take the port
    }
    if attack.engine_fault is not None:  # every life's requests reach it: the follow-up asks fewer tokens
        fault = {**attack.engine_fault, "phase": "generate", "after_tokens": trial.after_tokens, "rank": d.victim}
        config["faults"] = [fault]
    if attack.memory_limit is not None:
        config["memory_limit"] = attack.memory_limit
    return config


class Stranger:
    """A listening socket of the campaign's on a rank's port: what a stray process does to a replacement."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.port = port
        self.host = host  # the rank's own address (on a cluster, its node's)
        self.sock: socket.socket | None = None

    def take(self) -> bool:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT left by the ring must not stop it
        try:
            sock.bind((self.host, self.port))
            sock.listen(1)
        except OSError:
            sock.close()
            return False
        self.sock = sock
        return True

    def release(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


async def run_trial(
    target: Target,
    trial: Trial,
    ports: RankPorts,
    figures: RankFigures,
    engine: str = "debug",
    *,
    agents_dir: Path | None = None,
) -> TrialResult:
    """A trial on the shared server: its ring created, struck, checked, deleted, and everything of it gone. On a
    cluster (``agents_dir``: where its node agents keep records; ``target`` is a ``tether serve --ray`` coordinator)
    its ranks run on distinct nodes, each a child of that node's agent, and once the ring is deleted nothing may run
    on any node that the API does not show."""
    result = TrialResult(trial)
    began = time.monotonic()
    d = draws(trial, engine)
    iid = f"r{trial.index}"
    pinned = ports.allocate(iid, d.world)
    stranger = Stranger(pinned[d.held])
    watcher: Watcher | None = None
    try:
        async with httpx.AsyncClient(base_url=target.url, timeout=httpx.Timeout(REQUEST_BOUND)) as client:
            owners = await _owners(client, target, agents_dir)
            if owners is None:
                result.broke("hung", f"the cluster did not have {cluster.NODES} live nodes within {STATE_BOUND:g} s")
                return result
            workers, records = owners
            watcher = Watcher(workers, iid)
            watcher.start()
            created = await client.post("/v1/instances", json=_config(trial, iid, d, pinned, engine))
            if created.status_code != 201:
                result.broke("misclassified", f"the instance was refused: {created.status_code} {created.text[:300]}")
                return result
            first = await _wait_instance(client, iid, lambda i: i["ready"], STATE_BOUND)
            if first is None:
                result.broke("hung", f"the {d.world}-rank instance was not ready within {STATE_BOUND:g} s")
            else:
                await _attack(result, client, trial, d, first, stranger, figures, engine)
            inst = await _instance(client, iid)
            asked = time.monotonic()
            await client.delete(f"/v1/instances/{iid}")
            stopped_in = time.monotonic() - asked
            if stopped_in > 2 * target.stop_timeout + 2.0:  # rank 0 within its stop bound, then the others at once
                result.broke("hung", f"deleting the {d.world}-rank instance took {stopped_in:.1f} s")
            pids = sorted({s.pid for s in watcher.processes()} | set((inst or {}).get("pids", [])))
            gone = functools.partial(_check_gone, result, target, iid, pids, workers=workers, records=records)
            await anyio.to_thread.run_sync(gone)
            if agents_dir is not None:  # what runs on every node is what the API shows (the coordinator's own instance)
                after = await cluster.view(client)
                result.problems += [f"after the trial: {problem}" for problem in cluster.strays(after, set(workers))]
    finally:
        stranger.release()
        if watcher is not None:
            await anyio.to_thread.run_sync(watcher.stop)
        ports.release(iid)
    assert watcher is not None  # made before anything that returns early without it
    for problem in watcher.early_starts():
        result.broke("orphans", f"a replacement started before the old life was gone: {problem}")
    figures.replacements += len({(s.life, s.rank) for s in watcher.processes() if s.role == "runner" and s.life > 1})
    result.seconds = time.monotonic() - began
    return result


def _agents_now(target: Target) -> dict[int, tuple[int | None, int | None]]:
    """Each live node agent's RSS (bytes) and open fds now, by pid."""
    data = httpx.get(f"{target.url}/v1/instances", timeout=10).json()
    now = {}
    for pid in cluster.live_agents(data).values():
        links = fd_links(pid)
        now[pid] = (rss(pid), None if links is None else len(links))
    return now


def _agent_growth(
    before: dict[int, tuple[int | None, int | None]], after: dict[int, tuple[int | None, int | None]]
) -> dict[str, Any]:
    """The node agents' growth over the trials, each against itself (the most any grew): a figure, not a check,
    since an agent is a Ray worker whose own connections come and go as Ray sees fit."""
    rss_growth = [(a[0] - b[0]) / MiB for p, b in before.items() if (a := after.get(p)) and a[0] and b[0]]
    fd_growth = [
        a[1] - b[1] for p, b in before.items() if (a := after.get(p)) and a[1] is not None and b[1] is not None
    ]
    return {
        "agents": len(before),
        "agent_rss_growth_max_mib": round(max(rss_growth), 2) if rss_growth else None,
        "agent_fds_growth_max": max(fd_growth) if fd_growth else None,
    }


async def _owners(
    client: httpx.AsyncClient, target: Target, agents_dir: Path | None
) -> tuple[frozenset[int], Path] | None:
    """Whose children the ranks are and where their records are kept: the worker's own, or on a cluster every live
    node agent's, keeping records in ``agents_dir`` (each node was started with it as ``TETHER_RUNTIME_DIR``). None
    when the cluster has not its nodes back within ``STATE_BOUND``."""
    if agents_dir is None:
        return frozenset({target.pid}), target.runtime_dir
    data = await cluster.wait_view(client, cluster.settled, STATE_BOUND)
    if data is None:
        return None
    return frozenset(cluster.live_agents(data).values()), agents_dir


async def _attack(
    result: TrialResult,
    client: httpx.AsyncClient,
    trial: Trial,
    d: Draw,
    first: dict[str, Any],
    stranger: Stranger,
    figures: RankFigures,
    engine: str = "debug",
) -> None:
    """Strike rank ``d.victim`` mid-stream, then check the failure, the replacement, its ports and its service."""
    attack = trial.attack
    iid = first["id"]
    expect = attack.expect.value if attack.expect is not None else None
    ranks = first["ranks"] or []
    addresses = [r["address"] for r in ranks]
    old = {r["pid"] for r in ranks}
    victim = ranks[d.victim]["pid"] if len(ranks) == d.world else None
    if victim is None or len(addresses) != d.world:
        result.broke("misclassified", f"the instance shows {len(ranks)} ranks, not {d.world}: {ranks}")
        return
    streams = Streams(client, iid, trial.tokens)
    if attack.expect is None:  # the warm-up: no fault, every stream completes on the ring
        await streams.run(trial.streams)
        _expect_outcomes(result, streams.outcomes, {"complete"}, None)
        result.outcomes = streams.outcomes
        return

    async def strike() -> None:
        await streams.first.wait()
        await anyio.sleep(trial.delay)
        if attack.outside_signal is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, getattr(signal, attack.outside_signal))

    async with anyio.create_task_group() as tg:
        tg.start_soon(strike)
        await streams.run(trial.streams)
    result.outcomes = streams.outcomes  # counted even when a later check ends the trial early
    _expect_outcomes(
        result, streams.outcomes, {"complete", "failed", "rejected"}, expect, resume=attack.name != "held_port"
    )
    named = f"rank {d.victim} of {d.world}"
    for outcome in streams.outcomes:
        if outcome.kind == "failed" and named not in outcome.detail:
            result.broke("misclassified", f"a request failed without naming {named}: {_show(outcome)}")
        if outcome.kind == "rejected" and outcome.cause not in (expect, None):
            result.broke("misclassified", f"a request was refused with {outcome.cause}, not {expect}: {_show(outcome)}")
    struck = any(o.kind == "failed" or o.resumed for o in streams.outcomes)
    if not struck and attack.engine_fault is not None:
        result.broke(
            "misclassified", f"the {attack.name} fault of {named} failed or resumed no request: {_outcomes(streams)}"
        )

    host, _, held_at = addresses[d.held].rpartition(":")
    port = int(held_at)
    stranger.host = host
    refusals = 0
    if attack.name == "held_port":
        failed = await _wait_instance(client, iid, lambda i: bool(i["history"]), STATE_BOUND)
        if failed is None:
            result.broke("hung", f"the struck life did not end within {STATE_BOUND:g} s")
            return
        taken = False
        with anyio.move_on_after(STATE_BOUND):  # the old rank's listener goes with it: then the port is free
            while not (taken := stranger.take()):
                inst = await _instance(client, iid)
                if inst is not None and inst["ready"]:
                    break
                await anyio.sleep(0.005)
        if not taken:
            figures.held_missed += 1  # the replacement listened before the campaign could take the port
        else:
            refused = await _wait_instance(client, iid, lambda i: len(i["history"]) > 1 or i["ready"], STATE_BOUND)
            if refused is None:
                result.broke("hung", f"with port {port} held, no replacement was refused within {STATE_BOUND:g} s")
            elif refused["ready"] and len(refused["history"]) == 1:
                result.broke("misclassified", f"a replacement became ready while port {port} was held by another")
            refusals = 1
        stranger.release()

    final = await _wait_instance(
        client, iid, lambda i: (i["ready"] and bool(i["history"])) or i["state"] == "failed", STATE_BOUND
    )
    if final is None:
        result.broke("hung", f"the instance did not serve again within {STATE_BOUND:g} s of the failure")
        return
    if final["state"] == "failed":
        result.broke("misclassified", f"the instance gave up: {final.get('reason')}")
        return
    history = final["history"]
    _expect_cause(result, history[0]["cause"], d.victim, d.world, expect, attack)
    if history[0].get("detected_in") is not None:
        figures.detections.append(float(history[0]["detected_in"]))
    later = history[1:]
    if attack.name != "held_port" and later:
        causes = "; ".join(h["cause"]["summary"][:120] for h in later)
        result.broke("misclassified", f"one failure, {len(history)} failed lives: {causes}")
    for life in later:  # each a life refused while the port was held (and only those)
        _expect_held(result, life["cause"], d.held, d.world, port, os.getpid())
    figures.held_refusals += len(later) if refusals else 0
    if sum(final["failures"].values()) != len(history):
        result.problems.append(f"failures by kind {final['failures']} do not add up to the {len(history)} in history")
    now = final["ranks"] or []
    if [r["address"] for r in now] != addresses:
        result.broke("misclassified", f"the replacement's ranks moved: {addresses} -> {[r['address'] for r in now]}")
    stale = sorted(old.intersection(r["pid"] for r in now))
    if stale:
        result.broke("orphans", f"ranks of the struck life still serve in the replacement: pids {stale}")
    # Every rank of a ring listens (the ring's links); on llama.cpp only the RPC servers, ranks 1.. (rank 0 dials
    # them: its address is shown but nothing listens on it)
    for r in now if engine == "debug" else now[1:]:
        at = int(r["address"].rpartition(":")[2])
        if not await anyio.to_thread.run_sync(holds_listener, r["pid"], at):
            result.problems.append(f"rank {r['rank']} (pid {r['pid']}) of the replacement does not listen on {at}")
    follow = Streams(client, iid, min(trial.after_tokens, 4) if attack.engine_fault else 4)
    await follow.one()
    _expect_outcomes(result, follow.outcomes, {"complete"}, None)
    result.outcomes = streams.outcomes + follow.outcomes


def _outcomes(streams: Streams) -> str:
    return ", ".join(_show(o) for o in streams.outcomes)


def _expect_cause(
    result: TrialResult, cause: dict[str, Any], rank: int, world: int, expect: str | None, attack: Attack
) -> None:
    """The struck life's one cause: the struck rank's, of the attack's kind, the others its consequences."""
    named = f"rank {rank} of {world}"
    wrong = []
    if cause.get("rank") != rank:
        wrong.append(f"rank {cause.get('rank')}")
    if cause.get("kind") != expect:
        wrong.append(f"kind {cause.get('kind')}")
    if not cause.get("summary", "").startswith(named):
        wrong.append("a summary not starting with it")
    if attack.outside_signal == "SIGKILL" and cause.get("signal") != "SIGKILL":
        wrong.append(f"signal {cause.get('signal')}")
    consequences = [e for e in cause.get("evidence", []) if e.startswith("rank ") and "(a consequence)" in e]
    if len(consequences) != world - 1:
        wrong.append(f"{len(consequences)} other ranks as consequences, not {world - 1}")
    if wrong:
        result.broke(
            "misclassified",
            f"the {attack.name} of {named} failed the instance with {', '.join(wrong)}: "
            f"{cause.get('summary', '')[:240]}",
        )


def _expect_held(result: TrialResult, cause: dict[str, Any], rank: int, world: int, port: int, holder: int) -> None:
    """A life refused by a held port: an ordinary (retried) failure of that rank naming the port and its holder."""
    summary = cause.get("summary", "")
    wanted = (f"rank {rank} of {world}", f":{port}", "Address already in use", f"pid {holder}")
    missing = [w for w in wanted if w not in summary]
    if cause.get("rank") != rank or missing:
        result.broke(
            "misclassified",
            f"with port {port} held by pid {holder}, a life failed as rank {cause.get('rank')}"
            f"{' without ' + ', '.join(repr(m) for m in missing) if missing else ''}: {summary[:300]}",
        )


# --------------------------------------------------------------------------------------------------------------
# The campaign
# --------------------------------------------------------------------------------------------------------------


async def run_campaign(
    seed: int,
    trials: int,
    *,
    only: Only = None,
    progress: Callable[[TrialResult], None] | None = None,
    engine: str = "debug",
    on_cluster: bool = False,
    ray: cluster.RayCluster | None = None,
) -> Report:
    """The ranks campaign ``seed`` (or only its trial ``only``); its server (and cluster) are stopped before it
    returns. ``on_cluster``: the same trials on a local Ray cluster (``chaos.cluster.RayCluster``: 3 nodes) under a
    ``tether serve --ray`` coordinator, each rank on its own node; on ``ray`` when given (one started with a
    ``runtime_dir`` for its nodes' records, left running)."""
    if engine not in ENGINES:
        raise ValueError(f"the ranks target runs the {' or '.join(ENGINES)} engine, not {engine!r}")
    if on_cluster and importlib.util.find_spec("ray") is None:
        raise ValueError(
            f"the {CLUSTER_NAME} target needs Ray: install tether's ray extra (pip install '.[ray]' in the checkout)"
        )
    where = {"nodes": cluster.NODES} if on_cluster else {}
    name = CLUSTER_NAME if on_cluster else NAME
    report = Report(seed, name, {"engine": engine, **where})
    began = time.monotonic()
    figures = RankFigures()
    ports = RankPorts(base=PORT_BASE + (os.getpid() % 700) * 3, span=600)
    with tempfile.TemporaryDirectory(prefix="tether-chaos-ranks-") as tmp:
        shared = Path(tmp) / "shared"
        agents_dir = None
        if on_cluster:  # the node agents' records
            agents_dir = Path(tmp) / "agents-runtime" if ray is None else ray.runtime_dir
            if agents_dir is None:
                raise ValueError("the cluster given to the ranks campaign keeps its nodes' records nowhere known")
        async with contextlib.AsyncExitStack() as stack:
            nodes = await stack.enter_async_context(cluster.ray_cluster(ray, agents_dir)) if on_cluster else None
            if nodes is not None:
                target = await anyio.to_thread.run_sync(cluster.coordinator, shared, nodes.address)
            else:
                target = await anyio.to_thread.run_sync(functools.partial(Target, shared, startup=60.0))
            agents: dict[int, tuple[int | None, int | None]] = {}  # on a cluster: agent pid -> (RSS, fds) after warm-up
            try:

                async def run(trial: Trial) -> TrialResult:
                    if on_cluster and trial.index >= 0 and not agents:
                        agents.update(await anyio.to_thread.run_sync(_agents_now, target))
                    return await run_trial(target, trial, ports, figures, engine, agents_dir=agents_dir)

                warm = Trial(seed, -1, WARM_UP, "generating", 2, 1, 0.0, 8, name)  # a ring, no fault
                await drive(report, target, warm, plan(seed, trials, only, engine, name), run, progress)
                if agents:
                    report.extra.update(_agent_growth(agents, await anyio.to_thread.run_sync(_agents_now, target)))
            finally:
                await anyio.to_thread.run_sync(target.stop)
    detections = sorted(figures.detections)
    report.extra.update(
        replacements_checked=figures.replacements,
        held_port_refusals=figures.held_refusals,
        held_port_missed=figures.held_missed,
        detection_p50_s=round(detections[len(detections) // 2], 3) if detections else None,
        detection_max_s=round(detections[-1], 3) if detections else None,
    )
    report.wall_s = time.monotonic() - began
    return report
