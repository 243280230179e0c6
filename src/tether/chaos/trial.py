"""One trial: make the fault where the plan says, drive the streams, then check every promise from outside.

Every request the trial sends must end exactly once, within its bound, in an outcome its fault allows: complete,
cancelled, failed with the cause kind the fault implies (the API's error code), rejected with ``503`` (while the
instance restarts), or cut (the worker itself was killed). A stream that just stops is *lost*; one that outlives
its bound is *hung*. Afterwards no process of the trial may be left (its runners, their helpers: looked up in
``/proc`` and in the runner cgroups), nor a runner record, and the instance must be ready again, or failed where
its restart policy says.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from tether.chaos.plan import Trial
from tether.chaos.target import Target
from tether.kernel.cgroups import RunnerCgroup, runner_cgroups
from tether.kernel.pids import alive

REQUEST_BOUND = 20.0  # seconds any request may take, whatever the fault (the hang deadlines are 1-2 s)
STATE_BOUND = 40.0  # seconds for an instance to reach the state its fault implies (a real one, on loaded cores)
GONE_BOUND = 5.0  # seconds for every process of a trial to be gone once it ended
DEADLINES = {"heartbeat": 1.5, "load_stall": 1.5, "warmup": 3.0, "first_token": 3.0, "token_gap": 1.5, "ack": 3.0}
OPTIONS = {"load_steps": 10, "load_step_seconds": 0.01, "token_seconds": 0.0005}


@dataclass
class Outcome:
    """How one request ended, as the client saw it."""

    kind: str  # complete | cancelled | failed | rejected | cut | disconnected | lost | hung | unexpected
    cause: str | None = None  # the cause kind of a failure (the error's code)
    status: int | None = None
    detail: str = ""
    retry_after: bool = False
    prompt: str = ""  # what it asked (the batch target compares its text with the prompt's solo run)
    text: str = ""  # what it received before it ended
    finish: str | None = None  # a completed stream's finish reason
    tokens: int | None = None  # a completed stream's completion tokens (when it asked for usage)
    index: int = 0  # which stream of the trial it was
    request_id: str | None = None
    deltas: int = 0  # content events received
    resumed: int = 0  # a completed stream's resumes on a new runner (its usage says, when it asked for usage)
    longest_gap: float = 0.0  # the longest wait between two of its content events, s (a resume's pause)


@dataclass
class TrialResult:
    trial: Trial
    outcomes: list[Outcome] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # each broken invariant, in words
    hung: int = 0
    orphans: int = 0
    misclassified: int = 0
    lost: int = 0
    seconds: float = 0.0
    missed: bool = False  # the attack's moment never came (a race the trial lost): it kept its promises unattacked
    remade: int = 0  # rounds of extra requests the trial made for a moment that had not come (models target)

    @property
    def ok(self) -> bool:
        return not self.problems

    def broke(self, counter: str, problem: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        self.problems.append(problem)


@dataclass(frozen=True)
class Setup:
    """What a target's trials run on: the engine and options of every instance a trial creates, the prompts of its
    streams (stream ``i`` asks ``prompts[i % len]``), fields every stream adds (greedy sampling, a seed), and the
    solo texts its streams must reproduce (None: texts are not compared). The default is the single target's."""

    engine: str = "debug"
    options: dict[str, Any] = field(default_factory=lambda: dict(OPTIONS))
    deadlines: dict[str, float] = field(default_factory=lambda: dict(DEADLINES))
    prompts: tuple[str, ...] = ("chaos",)
    sampling: dict[str, Any] = field(default_factory=dict)
    solo: Solo | None = None
    refused_prompt: str = ""  # a prompt the engine refuses alone (longer than the context): a per-sequence error
    request_bound: float = REQUEST_BOUND  # what a request may take: a real engine's 16 streams take longer
    model: str | None = None  # the GGUF every instance loads (None: the engine's default)


class Solo:
    """Each prompt's text when run alone (greedy, fixed seed) on an instance nothing else uses, asked once and
    cached: the text every stream of that prompt in a batch must reproduce (a prefix of it, when cut short)."""

    def __init__(self, url: str, model: str, tokens: int, sampling: dict[str, Any]) -> None:
        self.url, self.model, self.tokens, self.sampling = url, model, tokens, sampling
        self.texts: dict[str, Outcome] = {}

    async def text(self, prompt: str) -> Outcome:
        if prompt not in self.texts:
            async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(REQUEST_BOUND)) as client:
                streams = Streams(client, self.model, self.tokens, prompts=(prompt,), sampling=self.sampling)
                await streams.one()
            if streams.outcomes[0].kind != "complete":
                raise RuntimeError(f"the solo run of {prompt!r} did not complete: {_show(streams.outcomes[0])}")
            self.texts[prompt] = streams.outcomes[0]
        return self.texts[prompt]


class Streams:
    """The trial's streaming requests: their outcomes, the ids they got, and an event at the first token."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        model: str,
        tokens: int,
        *,
        prompts: tuple[str, ...] = ("chaos",),
        sampling: dict[str, Any] | None = None,
        bound: float = REQUEST_BOUND,
    ) -> None:
        self.client = client
        self.bound = bound
        self.model = model
        self.tokens = tokens
        self.prompts = prompts
        self.sampling = sampling or {}
        self.outcomes: list[Outcome] = []
        self.first = anyio.Event()
        self.ids: list[str] = []
        self.deltas: dict[str, int] = {}  # request id -> content events received so far
        self._last: dict[str, float] = {}  # request id -> when its last content event came
        self.gaps: dict[str, float] = {}  # request id -> the longest wait between two of its content events

    async def one(
        self, *, disconnect: bool = False, on_start: Any = None, index: int = 0, prompt: str | None = None
    ) -> None:
        prompt = prompt if prompt is not None else self.prompts[index % len(self.prompts)]
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.tokens,
            "stream": True,
            "stream_options": {"include_usage": True},  # its tokens, and whether it was resumed
            **self.sampling,
        }
        outcome: Outcome
        text: list[str] = []
        try:
            with anyio.fail_after(self.bound):
                async with self.client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        outcome = _refused(response.status_code, await response.aread(), response.headers)
                    else:
                        outcome = await self._read(response, disconnect, on_start, text)
        except TimeoutError:
            outcome = Outcome("hung", detail=f"no end within {self.bound:g} s")
        except httpx.TransportError as exc:
            outcome = Outcome("cut", detail=f"{type(exc).__name__}: {exc}")
        outcome.prompt, outcome.text, outcome.index = prompt, "".join(text), index
        rid = outcome.request_id
        if rid is not None:
            outcome.deltas = self.deltas.get(rid, 0)
            outcome.longest_gap = self.gaps.get(rid, 0.0)
        self.outcomes.append(outcome)

    def outcomes_of(self, index: int) -> list[Outcome]:
        return [o for o in self.outcomes if o.index == index]

    async def _read(self, response: httpx.Response, disconnect: bool, on_start: Any, text: list[str]) -> Outcome:
        seen = False
        finish: str | None = None
        tokens: int | None = None
        resumed = 0
        rid: str | None = None
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return Outcome("complete", status=200, finish=finish, tokens=tokens, request_id=rid, resumed=resumed)
            event = json.loads(data)
            if "error" in event:
                code = event["error"].get("code")
                if code == "cancelled":
                    return Outcome("cancelled", status=200, request_id=rid)
                detail = event["error"].get("message", "")
                return Outcome("failed", cause=code, status=200, detail=detail, request_id=rid)
            rid = event.get("id", rid)
            for choice in event.get("choices") or ():
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
                if rid is not None:
                    self.deltas[rid] = self.deltas.get(rid, 0) + 1
                    now = time.monotonic()
                    if rid in self._last:
                        self.gaps[rid] = max(self.gaps.get(rid, 0.0), now - self._last[rid])
                    self._last[rid] = now
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
                resumed = int(event["usage"].get("resumed") or 0)
            if not seen:
                seen = True
                self.ids.append(event["id"])
                self.first.set()
                if on_start is not None:
                    await on_start(event["id"])
                if disconnect:
                    return Outcome("disconnected", status=200, request_id=rid)
        return Outcome("lost", status=200, detail="the stream ended with neither [DONE] nor an error event")

    async def run(
        self, n: int, *, disconnect: set[int] | None = None, on_start: Any = None, starters: set[int] | None = None
    ) -> None:
        """``n`` streams at once (stream ``i`` asks prompt ``i``); those in ``disconnect`` leave at their first
        token, and ``on_start(request_id)`` runs at the first token of every stream (or of those in ``starters``)."""
        async with anyio.create_task_group() as tg:
            for i in range(n):
                start = on_start if starters is None or i in starters else None
                tg.start_soon(
                    functools.partial(self.one, disconnect=i in (disconnect or set()), on_start=start, index=i)
                )


def _refused(status: int, body: bytes, headers: httpx.Headers) -> Outcome:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return Outcome("unexpected", status=status, detail=body[:200].decode(errors="replace"))
    code = error.get("code")
    if status == 503:
        cause = (error.get("cause") or {}).get("kind") if isinstance(error.get("cause"), dict) else None
        detail = error.get("message", "")
        return Outcome("rejected", cause=cause, status=status, detail=detail, retry_after="retry-after" in headers)
    if status == 409 and code == "cancelled":
        return Outcome("cancelled", status=status)
    if status == 500 and isinstance(error.get("cause"), dict):
        return Outcome("failed", cause=code, status=status, detail=error.get("message", ""))
    if status == 400 and code == "engine_refused":  # the engine refused this request alone (its context, ...)
        return Outcome("refused", cause=code, status=status, detail=error.get("message", ""))
    return Outcome("unexpected", status=status, detail=f"{code}: {error.get('message', '')}")


async def _instance(client: httpx.AsyncClient, iid: str) -> dict[str, Any] | None:
    response = await client.get(f"/v1/instances/{iid}")
    return response.json() if response.status_code == 200 else None


async def _wait_instance(client: httpx.AsyncClient, iid: str, done: Any, bound: float) -> dict[str, Any] | None:
    """Re-read the instance (the API has no push channel) until ``done(instance)``; None after ``bound`` s."""
    with anyio.move_on_after(bound):
        while True:
            inst = await _instance(client, iid)
            if inst is not None and done(inst):
                return inst
            await anyio.sleep(0.005)
    return None


def _runner_pid(inst: dict[str, Any] | None) -> int | None:
    runner = (inst or {}).get("runner") or {}
    pid = runner.get("pid")
    return pid if isinstance(pid, int) else None


def _kill(pid: int | None, name: str | None) -> None:
    if pid is not None and name is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, getattr(signal, name))


def _config(trial: Trial, iid: str, setup: Setup | None = None) -> dict[str, Any]:
    attack, phase = trial.attack, trial.phase
    faults = []
    if attack.engine_fault is not None:
        fault = dict(attack.engine_fault)
        if phase == "loading":
            fault["phase"] = "load"
        elif phase == "warming_up":
            fault["phase"] = "warmup"
        elif phase == "idle":
            fault.update(phase="idle", seconds=0.05 + trial.delay)
        else:
            fault.update(phase="generate", after_tokens=trial.after_tokens)
        faults.append(fault)
    # A fault made by the engine at load, warm-up or idle strikes every life again: without restarts the instance
    # must end failed with its cause. Elsewhere one failure, then the instance must serve again.
    never = attack.engine_fault is not None and phase in ("loading", "warming_up", "idle") and attack.expect
    restart = {  # (a backoff trial's streams are not resumed: a resume restarts at once, with no backoff to see)
        "mode": "never" if never else "on-failure",
        "initial_backoff": 1.0 if phase == "backoff" else 0.05,
        "max_backoff": 1.0,
        "jitter": 0.0,
        "crash_loop_failures": 100,
    }
    setup = setup or Setup()
    config: dict[str, Any] = {
        "id": iid,
        "engine": setup.engine,
        "options": {**setup.options, **attack.options},
        "restart": restart,
        "deadlines": setup.deadlines,
        "max_queue": 256,
        "resume": phase != "backoff",
    }
    if setup.model is not None:
        config["model"] = setup.model
    if faults:
        config["faults"] = faults
    if attack.memory_limit is not None:
        config["memory_limit"] = attack.memory_limit
    return config


async def run_on(target: Target, trial: Trial, setup: Setup | None = None) -> TrialResult:
    """A trial against the campaign's shared server: its own instance, created, attacked, checked, deleted."""
    setup = setup or Setup()
    result = TrialResult(trial)
    began = time.monotonic()
    iid = f"t{trial.index}"
    attack, phase = trial.attack, trial.phase
    async with httpx.AsyncClient(base_url=target.url, timeout=httpx.Timeout(setup.request_bound)) as client:
        created = await client.post("/v1/instances", json=_config(trial, iid, setup))
        if created.status_code != 201:
            result.broke("misclassified", f"the instance was refused: {created.status_code} {created.text[:200]}")
            return result
        bound = setup.request_bound
        streams = Streams(client, iid, trial.tokens, prompts=setup.prompts, sampling=setup.sampling, bound=bound)
        refused = Streams(client, iid, trial.tokens, sampling=setup.sampling, bound=bound)  # seq_error's request
        expect = attack.expect.value if attack.expect is not None else None
        rng = random.Random(f"{trial.seed}:{trial.index}:moments")
        deleted = False

        if phase in ("loading", "warming_up", "idle") and attack.engine_fault is not None:
            final = await _wait_instance(
                client,
                iid,
                lambda i: i["state"] in ("failed", "ready") and (expect is None or i["state"] == "failed"),
                STATE_BOUND,
            )
            if expect is None:  # a flood, not a failure: the instance serves
                if phase == "idle":
                    await anyio.sleep(trial.delay + 0.1)  # the fault fires from a timer after the warm-up
                await streams.run(trial.streams)
                _expect_outcomes(result, streams.outcomes, {"complete"}, None)
            _expect_instance(result, final, expect)
        elif phase in ("loading", "idle") and attack.outside_signal is not None:
            wanted = "loading" if phase == "loading" else "ready"
            inst = await _wait_instance(
                client, iid, lambda i: ((i.get("runner") or {}).get("status")) == wanted, STATE_BOUND
            )
            await anyio.sleep(trial.delay)
            _kill(_runner_pid(inst), attack.outside_signal)
            final = await _wait_instance(client, iid, lambda i: bool(i["history"]) and i["ready"], STATE_BOUND)
            _expect_instance(result, final, expect)
        else:
            await _wait_instance(client, iid, lambda i: i["ready"], STATE_BOUND)
            inst = await _instance(client, iid)
            pid = _runner_pid(inst)

            async def strike() -> None:
                await streams.first.wait()
                await anyio.sleep(trial.delay)
                _kill(pid, attack.outside_signal)

            cancelled_at: dict[str, int] = {}  # request id -> its content events when its cancel was answered

            async def cancel(request_id: str) -> None:
                for _ in range(rng.randint(1, 3)):  # a storm: duplicates too
                    await client.post(f"/v1/requests/{request_id}/cancel")
                cancelled_at[request_id] = streams.deltas.get(request_id, 0)

            async def delete() -> None:
                nonlocal deleted
                await streams.first.wait()
                await anyio.sleep(trial.delay)
                deleted = True
                await client.delete(f"/v1/instances/{iid}")

            if phase == "backoff":
                async with anyio.create_task_group() as tg:
                    tg.start_soon(strike)
                    await streams.run(1)
                await _wait_instance(client, iid, lambda i: i["state"] == "restarting", STATE_BOUND)
                await streams.run(trial.streams)  # while it waits to restart: refused, told when to retry
                _expect_outcomes(result, streams.outcomes[:1], {"complete", "failed"}, expect)
                for outcome in streams.outcomes[1:]:
                    if outcome.kind != "rejected" or not outcome.retry_after:
                        result.broke("misclassified", f"during the backoff a request ended {_show(outcome)}")
                final = await _wait_instance(client, iid, lambda i: i["ready"], STATE_BOUND)
                _expect_instance(result, final, expect)
            else:
                on_start = cancel if attack.client in ("cancel_storm", "seq_cancel") or phase == "cancel" else None
                victim = rng.randrange(trial.streams)  # the one stream a per-sequence fault hits
                disconnect = (
                    set(rng.sample(range(trial.streams), max(1, trial.streams // 2)))
                    if attack.client == "disconnect"
                    else {victim}
                    if attack.client == "seq_disconnect"
                    else None
                )

                async def refuse() -> None:  # one request the engine refuses alone, while the batch runs
                    await streams.first.wait()
                    await anyio.sleep(trial.delay)
                    await refused.one(prompt=setup.refused_prompt)

                async with anyio.create_task_group() as tg:
                    if attack.outside_signal is not None:
                        tg.start_soon(strike)
                    if phase == "stop":
                        tg.start_soon(delete)
                    if attack.client == "seq_error":
                        tg.start_soon(refuse)
                    starters = {victim} if attack.client == "seq_cancel" else None
                    await streams.run(trial.streams, disconnect=disconnect, on_start=on_start, starters=starters)
                allowed = _allowed(trial)
                if attack.client in ("seq_cancel", "seq_disconnect"):
                    hit = streams.outcomes_of(victim)
                    others = [o for o in streams.outcomes if o.index != victim]
                    _expect_outcomes(result, others, {"complete"}, None)
                    _expect_outcomes(result, hit, allowed, None)
                    if attack.client == "seq_cancel":
                        _expect_cancel_heeded(result, hit, cancelled_at, trial.tokens)
                else:
                    _expect_outcomes(result, streams.outcomes, allowed, expect)
                _expect_outcomes(result, refused.outcomes, {"refused", "failed"}, None)
                if not deleted:
                    if attack.client is not None:  # the runner must be free again: nothing left in flight
                        idle = await _wait_instance(
                            client, iid, lambda i: i["queue"]["in_flight"] == 0 and i["ready"], STATE_BOUND
                        )
                        if idle is None:
                            result.broke("hung", "requests stayed in flight after their clients left")
                        follow = Streams(client, iid, 4)
                        await follow.one()
                        _expect_outcomes(result, follow.outcomes, {"complete"}, None)
                    else:
                        final = await _wait_instance(
                            client, iid, lambda i: i["ready"] and (expect is None or bool(i["history"])), STATE_BOUND
                        )
                        _expect_instance(result, final, expect, strict=attack.engine_fault is not None)
        inst = await _instance(client, iid)
        pids = list((inst or {}).get("pids", []))
        if not deleted:
            await client.delete(f"/v1/instances/{iid}")
        else:
            pids = sorted(set(pids) | set(_pids_from_records(target, iid)))
        result.outcomes = streams.outcomes + refused.outcomes
    if setup.solo is not None:
        await expect_solo_texts(result, streams.outcomes, setup.solo, trial.tokens)
    _check_gone(result, target, iid, pids)
    result.seconds = time.monotonic() - began
    return result


def _pids_from_records(target: Target, iid: str) -> list[int]:
    """The runner pids the server's records name for instance ``iid`` (its runners are ``<iid>-<life>``)."""
    pids = []
    for path in target.runtime_dir.glob("runner-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(path.read_text())
            if str(record["runner_id"]).startswith(f"{iid}-"):
                pids.append(int(record["pid"]))
    return pids


def _allowed(trial: Trial) -> set[str]:
    attack, phase = trial.attack, trial.phase
    if attack.client == "seq_cancel":  # the victim's: a cancel may lose the race with its last token
        return {"complete", "cancelled"}
    if attack.client == "seq_disconnect":
        return {"disconnected"}
    if attack.client == "seq_error":
        return {"complete"}
    if attack.client == "disconnect":
        return {"complete", "disconnected"}
    if attack.client == "cancel_storm":
        return {"complete", "cancelled"}
    if phase == "cancel":
        return {"complete", "cancelled", "failed", "rejected"}  # rejected: it arrived after the kill
    if phase == "stop":
        return {"complete", "cancelled", "failed", "rejected"}
    if attack.expect is None:
        return {"complete"}
    # A request that arrives once the runner is dead is refused (503, retry later); one admitted before resumes on
    # the next life (the instance's fault strikes a request once, not its resume) or fails with the cause and why it
    # could not resume. A signal from outside may land after a stream finished.
    return {"complete", "failed", "rejected"}


def _expect_cancel_heeded(
    result: TrialResult, outcomes: list[Outcome], cancelled_at: dict[str, int], tokens: int
) -> None:
    """A stream whose cancel was answered may finish the tokens already on their way, not the rest of its budget:
    one that completes more than half its budget after the answer was never cancelled."""
    slack = max(8, tokens // 2)
    for outcome in outcomes:
        at = cancelled_at.get(outcome.request_id or "")
        if outcome.kind == "complete" and at is not None and outcome.deltas - at > slack:
            result.broke(
                "hung",
                f"stream {outcome.index} completed {outcome.deltas - at} tokens after its cancel was answered "
                f"(at most {slack} may be on their way): the cancel was not heeded",
            )


async def expect_solo_texts(result: TrialResult, outcomes: list[Outcome], solo: Solo, tokens: int) -> None:
    """Every stream's text is its prompt's solo text: whole when it completed (as many tokens as asked, or the
    solo's own end), a prefix of it when it was cut short (failed, cancelled, disconnected): no sequence of a
    batch may see another's tokens, or lose or repeat its own, whatever struck its neighbours."""
    for outcome in outcomes:
        if not outcome.prompt or outcome.kind in ("rejected", "hung", "unexpected"):
            continue
        alone = await solo.text(outcome.prompt)
        if outcome.kind != "complete":
            wrong = not alone.text.startswith(outcome.text)
        elif alone.finish != "length" and (alone.tokens or 0) <= tokens:  # it ends on its own before the budget
            wrong = outcome.text != alone.text
        else:
            wrong = not alone.text.startswith(outcome.text) or outcome.finish != "length"
            wrong = wrong or (outcome.tokens is not None and outcome.tokens != tokens)
        if wrong:
            result.broke(
                "misclassified",
                f"stream {outcome.index} ({outcome.kind}, {outcome.tokens} tokens, {outcome.finish}) differs from its "
                f"solo run ({alone.tokens} tokens, {alone.finish}): got {outcome.text[:80]!r}, alone "
                f"{alone.text[:80]!r}",
            )


def _show(outcome: Outcome) -> str:
    cause = f" ({outcome.cause})" if outcome.cause else ""
    detail = f": {outcome.detail[:160]}" if outcome.detail else ""
    return f"{outcome.kind}{cause}{detail}"


def _expect_outcomes(
    result: TrialResult, outcomes: list[Outcome], allowed: set[str], expect: str | None, *, resume: bool = True
) -> None:
    """Each outcome is allowed, a failure has the attack's cause and, where the instance resumes, says why this one
    did not (``resume``: the trial's instance has it on; a backoff or stop trial's failures are not resumes')."""
    for outcome in outcomes:
        if outcome.kind == "hung":
            result.broke("hung", f"a request hung: {_show(outcome)}")
        elif outcome.kind == "lost":
            result.broke("lost", f"a request was lost: {_show(outcome)}")
        elif outcome.kind not in allowed:
            result.broke("misclassified", f"a request ended {_show(outcome)}; allowed: {', '.join(sorted(allowed))}")
        elif (
            outcome.kind == "failed" and expect is not None and outcome.cause != expect and result.trial.phase != "stop"
        ):
            result.broke(
                "misclassified", f"a request failed with {outcome.cause}, not {expect}: {outcome.detail[:200]}"
            )
        elif (
            outcome.kind == "failed"
            and outcome.cause == expect
            and resume
            and result.trial.phase not in ("backoff", "stop")
            and not _says_why_not(outcome.detail)
        ):
            result.broke("misclassified", f"a request failed without saying why it did not resume: {_show(outcome)}")


def _says_why_not(detail: str) -> bool:
    """A request its runner's death failed says why it did not resume, or that it killed its runner itself."""
    return "not resumed" in detail or "runner died" in detail


def _expect_instance(
    result: TrialResult, inst: dict[str, Any] | None, expect: str | None, *, strict: bool = True
) -> None:
    """The instance reached the state its fault implies, and its first failure carries the implied cause."""
    if inst is None:
        result.broke("hung", f"the instance did not reach its expected state within {STATE_BOUND:g} s")
        return
    history = inst.get("history") or []
    if expect is None:
        if history:
            result.broke("misclassified", f"no failure expected, got {history[0]['cause']['kind']}")
        return
    if not history:
        if strict:
            result.broke("misclassified", f"expected a {expect} failure, the instance has none")
        return
    got = history[0]["cause"]["kind"]
    if got != expect:
        result.broke("misclassified", f"the instance failed with {got}, not {expect}: {history[0]['cause']['summary']}")


def _cgroups_of(worker: int | Collection[int], prefix: str) -> list[RunnerCgroup]:
    """The runner cgroups of ``worker`` (a pid, or several: a cluster's node agents) whose runner id starts with
    ``prefix``."""
    workers = {worker} if isinstance(worker, int) else set(worker)
    return [c for c in runner_cgroups() if c.worker_pid in workers and c.runner_id.startswith(prefix)]


def _still_there(
    pids: list[int], worker: int | Collection[int], prefix: str, bound: float
) -> tuple[list[int], list[int]]:
    """(runners of ``pids`` still alive, processes still in their cgroups) once every one is gone or ``bound``
    seconds have passed: a process may take a moment to exit after its SIGKILL, never longer than that."""
    deadline = time.monotonic() + bound
    while True:
        left = [pid for pid in pids if alive(pid)]
        held = sorted({pid for c in _cgroups_of(worker, prefix) for pid in c.cgroup.pids()})
        if not (left or held) or time.monotonic() > deadline:
            return left, held
        time.sleep(0.01)


def _check_gone(
    result: TrialResult,
    target: Target,
    iid: str,
    pids: list[int],
    bound: float = GONE_BOUND,
    *,
    workers: Collection[int] | None = None,
    records: Path | None = None,
) -> None:
    """No process of the trial left (its runners, and in their cgroups their helpers), nor a record of them, once
    ``bound`` seconds have passed for the last ones to exit. Whose runners they were: ``target``'s worker, unless
    ``workers`` (a cluster's node agents) and ``records`` (the directory they keep records in) say otherwise."""
    deadline = time.monotonic() + bound
    owners: Collection[int] = workers if workers is not None else (target.pid,)
    kept = records if records is not None else target.runtime_dir
    left, held = _still_there(pids, owners, f"{iid}-", bound)
    while True:  # then the cgroups themselves and the records, within what is left of the same bound
        cgroups = _cgroups_of(owners, f"{iid}-")
        on_file = [pid for pid in pids if (kept / f"runner-{pid}.json").exists()]
        if not (cgroups or on_file) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if left or held:
        result.broke("orphans", f"processes left after the trial: runners {left}, in their cgroups {held}")
    elif cgroups:
        result.problems.append(f"runner cgroups left after the trial: {[str(c.cgroup.path) for c in cgroups]}")
    if on_file:
        result.problems.append(f"runner records left after the trial: {on_file}")


async def run_alone(
    trial: Trial,
    workdir: Path,
    setup: Setup | None = None,
    serve: tuple[str, ...] = ("--engine", "debug", "--name", "warm"),
) -> TrialResult:
    """A worker attack: a server of its own, killed (or stopped) by the signal, then everything checked."""
    setup = setup or Setup()
    result = TrialResult(trial)
    began = time.monotonic()
    attack, phase = trial.attack, trial.phase
    sig = getattr(signal, attack.worker_signal or "SIGKILL")
    with tempfile.TemporaryDirectory(dir=workdir, prefix=f"worker-{trial.index}-") as tmp:
        target = await anyio.to_thread.run_sync(functools.partial(Target, Path(tmp), serve=serve, startup=60.0))
        runners: list[int] = target.runners()
        struck = False
        try:
            bound = setup.request_bound
            async with httpx.AsyncClient(base_url=target.url, timeout=httpx.Timeout(bound)) as client:
                streams = Streams(
                    client, "warm", trial.tokens, prompts=setup.prompts, sampling=setup.sampling, bound=bound
                )
                iid = "warm"
                if phase == "loading":
                    iid = f"t{trial.index}"
                    config = _config(trial, iid, setup)
                    config["options"]["load_steps"] = 50  # a load of 0.5 s: the signal lands in it
                    await client.post("/v1/instances", json=config)
                    await _wait_instance(client, iid, lambda i: (i.get("runner") or {}).get("status") == "loading", 10)
                runners = sorted(set(runners) | set(target.runners()))

                async def strike() -> None:
                    nonlocal struck
                    if phase == "generating":
                        await streams.first.wait()
                    await anyio.sleep(trial.delay)
                    struck = True
                    target.signal(sig)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(strike)
                    if phase == "generating":
                        await streams.run(trial.streams)
                # SIGTERM: a request the shutdown's bound ends before its answer started (waiting for a batch slot)
                # is refused, 503 shutting_down with Retry-After; one mid-answer fails with that cause.
                allowed = {"complete", "cut"} if sig == signal.SIGKILL else {"complete", "cut", "failed", "cancelled"}
                if sig == signal.SIGTERM:
                    allowed.add("rejected")
                _expect_outcomes(result, streams.outcomes, allowed, None)
                if sig == signal.SIGTERM:
                    _expect_shutdown_refusals(result, streams.outcomes)
                result.outcomes = streams.outcomes
                if setup.solo is not None:
                    await expect_solo_texts(result, streams.outcomes, setup.solo, trial.tokens)
        finally:
            if not struck:  # the trial broke off before its strike: make it now, then wait
                target.signal(sig)
            code = await anyio.to_thread.run_sync(target.wait_exit)
        if sig == signal.SIGTERM and code != 0:
            result.broke("hung", f"the worker did not stop cleanly on SIGTERM within its bound (exit {code})")
        # The same bound as every trial's: runners and whatever their cgroups hold, gone within GONE_BOUND.
        left, held = await anyio.to_thread.run_sync(_still_there, runners, target.pid, "", GONE_BOUND)
        if left or held:
            result.broke("orphans", f"the worker's runners outlived it: {left}, in their cgroups {held}")
        leftovers = await anyio.to_thread.run_sync(_reap, target)
        if sig == signal.SIGTERM and leftovers:
            result.problems.append(f"a clean stop left {leftovers}")
    result.seconds = time.monotonic() - began
    return result


def _expect_shutdown_refusals(result: TrialResult, outcomes: list[Outcome]) -> None:
    """On SIGTERM a refused request is the shutdown's: 503 saying it is shutting down, with Retry-After."""
    for outcome in outcomes:
        if outcome.kind == "rejected" and not (outcome.retry_after and "shutting down" in outcome.detail):
            result.broke("misclassified", f"on SIGTERM a request was refused, not by the shutdown: {_show(outcome)}")


def _reap(target: Target) -> list[str]:
    """After a dead worker: ``tether orphans --reap`` (the public way) clears its records and runner cgroups; what
    it found is returned (nothing alive may be among it: that was checked above)."""
    env = dict(os.environ, TETHER_RUNTIME_DIR=str(target.runtime_dir))
    out = subprocess.run(
        [sys.executable, "-m", "tether", "orphans", "--reap", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    try:
        report = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [f"tether orphans failed: {out.stderr[-300:]}"]
    found = [f"orphan {g['pid']}" for g in report.get("orphans", [])]
    found += [f"record {s['path']}" for s in report.get("stale_records", [])]
    return found
