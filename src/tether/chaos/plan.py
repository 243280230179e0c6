"""What a campaign attacks, when, and what each attack must end in: drawn from a seed, one trial at a time.

Each trial is drawn from ``random.Random(f"{seed}:{index}")`` alone, so trial K of seed S is the same trial
whether the campaign runs 1 or 1,000 of them: a failure replays with ``tether chaos --seed S --only K``.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tether.protocol import CauseKind

# Where in a runner's life a fault strikes. "generating" strikes after a random number of tokens of one of the
# streams in flight (1, 8 or 64 of them: all but one wait in the runner's queue); "cancel" strikes while every
# stream is being cancelled; "stop" while the instance is being deleted; "backoff" right after a first failure,
# while the instance waits to restart.
PHASES = ("loading", "warming_up", "idle", "generating", "cancel", "stop", "backoff")
STREAMS = (1, 8, 64)


@dataclass(frozen=True)
class Attack:
    """One kind of fault: how it is made, and what it must end in.

    ``engine_fault`` is a debug-engine fault (``tether.protocol.Fault`` fields) the runner performs for real;
    ``outside_signal`` a signal the campaign sends the runner from outside; ``worker_signal`` one it sends the
    worker itself. ``expect`` is the cause kind every request the failure ends must carry (None: the requests
    complete, the fault is not a failure). ``phases`` says where it can strike.
    """

    name: str
    expect: CauseKind | None
    phases: tuple[str, ...]
    engine_fault: dict[str, Any] | None = None
    outside_signal: str | None = None
    worker_signal: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # engine options the attack needs
    memory_limit: int | None = None
    client: str | None = None  # "disconnect" or "cancel_storm": the attack is the client's


RUNNER_PHASES = ("loading", "warming_up", "idle", "generating")
ENGINE_PHASES = ("loading", "warming_up", "generating")  # where engine code runs (an exception needs it)
ANY_PHASE = ("loading", "warming_up", "idle", "generating", "cancel", "stop", "backoff")

ATTACKS: tuple[Attack, ...] = (
    Attack("sigkill", CauseKind.SIGNAL, ANY_PHASE, outside_signal="SIGKILL"),
    Attack("segv", CauseKind.NATIVE_CRASH, RUNNER_PHASES, engine_fault={"kind": "segv"}),
    Attack("abort", CauseKind.NATIVE_CRASH, RUNNER_PHASES, engine_fault={"kind": "abort"}),
    Attack("exit3", CauseKind.EXIT_CODE, RUNNER_PHASES, engine_fault={"kind": "exit", "code": 3}),
    Attack("exit0", CauseKind.UNEXPECTED_EXIT, RUNNER_PHASES, engine_fault={"kind": "exit", "code": 0}),
    Attack("exception", CauseKind.EXCEPTION, ENGINE_PHASES, engine_fault={"kind": "raise"}),
    Attack("memory_error", CauseKind.OUT_OF_MEMORY, ENGINE_PHASES, engine_fault={"kind": "memory_error"}),
    Attack("oom", CauseKind.OUT_OF_MEMORY, RUNNER_PHASES, engine_fault={"kind": "oom"}, memory_limit=96 << 20),
    Attack("hang", CauseKind.HANG, ENGINE_PHASES, engine_fault={"kind": "hang"}),
    Attack("hang_gil", CauseKind.HANG, RUNNER_PHASES, engine_fault={"kind": "hang_gil"}),
    Attack("sigstop", CauseKind.HANG, ("loading", "idle", "generating"), outside_signal="SIGSTOP"),
    Attack("stderr_flood", None, RUNNER_PHASES, engine_fault={"kind": "stderr_flood", "lines": 20_000}),
    Attack("garbage", CauseKind.PROTOCOL_ERROR, RUNNER_PHASES, engine_fault={"kind": "garbage", "size": 1 << 20}),
    Attack(
        "setsid_helpers",
        CauseKind.SIGNAL,
        ("loading", "idle", "generating"),
        outside_signal="SIGKILL",
        options={"helpers": 2, "helper_kind": "setsid,double_fork"},
    ),
    Attack("worker_sigkill", None, ("loading", "idle", "generating"), worker_signal="SIGKILL"),
    Attack("worker_sigterm", None, ("loading", "idle", "generating"), worker_signal="SIGTERM"),
    Attack("disconnect", None, ("generating",), client="disconnect"),
    Attack("cancel_storm", None, ("generating",), client="cancel_storm"),
)
BY_NAME = {attack.name: attack for attack in ATTACKS}
WARM_UP = Attack("warm-up", None, ("generating",))  # no fault: the campaign's first trial, before the baselines


@dataclass(frozen=True)
class Trial:
    """One drawn trial: an attack, where it strikes, how many streams are in flight, and its random moments."""

    seed: int
    index: int
    attack: Attack
    phase: str
    streams: int
    after_tokens: int  # generating: the fault strikes after this many tokens of the stream it hits
    delay: float  # a random moment within the phase, in seconds (idle, loading, outside signals)
    tokens: int  # max_tokens of every stream
    target: str = "single"  # the campaign's target (``tether.chaos.targets``): part of the trial's seed
    replay_args: str = ""  # what else the replay command needs (``--engine llama.cpp``)

    @property
    def label(self) -> str:
        return f"{self.attack.name}@{self.phase}x{self.streams}"

    def replay(self) -> str:
        target = f" --target {self.target}" if self.target != "single" else ""
        extra = f" {self.replay_args}" if self.replay_args else ""
        return f"tether chaos{target}{extra} --seed {self.seed} --only {self.index}"


def trial_rng(seed: int, index: int, target: str = "single") -> random.Random:
    """The one source of a trial's randomness: ``seed:index`` (and the target's name, but for ``single``, whose
    trials predate targets and keep their seeds)."""
    return random.Random(f"{seed}:{index}" if target == "single" else f"{seed}:{index}:{target}")


def draw(
    seed: int,
    index: int,
    attacks: tuple[Attack, ...] = ATTACKS,
    *,
    target: str = "single",
    streams_choice: tuple[int, ...] = STREAMS,
    replay_args: str = "",
) -> Trial:
    """Trial ``index`` of the campaign ``seed`` (of ``target``, among ``attacks``)."""
    rng = trial_rng(seed, index, target)
    attack = rng.choice(attacks)
    phase = rng.choice(attack.phases)
    streams = rng.choice(streams_choice) if phase in ("generating", "cancel", "stop", "backoff") else 1
    if attack.worker_signal is not None and streams == 64:
        streams = 8  # a worker per trial: keep the hard-killed ones cheap
    tokens = rng.randint(24, 64)
    return Trial(
        seed=seed,
        index=index,
        attack=attack,
        phase=phase,
        streams=streams,
        after_tokens=rng.randint(1, tokens // 2),
        delay=rng.uniform(0.0, 0.05),
        tokens=tokens,
        target=target,
        replay_args=replay_args,
    )


Only = int | Sequence[int] | None  # which trials of a seed to run: one, several (a replay of a report's failures), all


def indices(trials: int, only: Only) -> list[int]:
    """The trial indices a campaign runs: ``only`` (one or several), else ``0 .. trials - 1``."""
    if only is None:
        return list(range(trials))
    return [only] if isinstance(only, int) else list(only)


def plan(seed: int, trials: int, only: Only = None) -> list[Trial]:
    return [draw(seed, i) for i in indices(trials, only)]


def engine_plan(
    seed: int,
    trials: int,
    only: Only,
    *,
    target: str,
    attacks: tuple[Attack, ...],
    streams_choice: tuple[int, ...],
    engine: str = "debug",
    real_tokens: int = 0,
) -> list[Trial]:
    """A target's trials on ``engine`` (or only trial ``only``): on a real engine, its replay names the engine and
    each stream asks at most ``real_tokens`` (a real token costs ~10 debug ones here); ``attacks`` are the ones that
    engine can take."""
    extra = "" if engine == "debug" else f"--engine {engine}"
    pick = functools.partial(draw, attacks=attacks, target=target, streams_choice=streams_choice, replay_args=extra)
    drawn = [pick(seed, i) for i in indices(trials, only)]
    if engine == "debug":
        return drawn
    return [
        dataclasses.replace(t, tokens=min(t.tokens, real_tokens), after_tokens=min(t.after_tokens, real_tokens // 2))
        for t in drawn
    ]
