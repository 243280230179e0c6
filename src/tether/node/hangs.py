"""No hanging request: per-phase progress deadlines, and what a hung runner looks like when it is declared.

A runner can be alive and useless: stuck in Python, blocked in native code holding the GIL, deadlocked, stopped by
SIGSTOP. Two kinds of evidence catch each: the **heartbeat** (a runner thread beats whatever the main thread does,
unless the whole interpreter is stuck) and **progress deadlines per phase** (load, a *stall* timeout each progress
report resets; warm-up; first token; gap between tokens; acknowledgement of each task and cancel). Both are plain
arithmetic on event times, kept here free of I/O so they can be tested without processes: the supervisor feeds them
and acts on the answer. Each deadline, its default and what it catches: docs/reliability.md, "Hangs".
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import msgspec

from tether.errors import InvalidField
from tether.kernel.pids import proc_stat
from tether.protocol import Loading, RunnerStatus, WarmingUp, documented, tag_of

STACK_SIGNAL_NAME = "SIGUSR1"  # the runner registers faulthandler on it (``runner.main``)
# faulthandler's header for each thread: "Thread 0x00007f... (most recent call first):" or "Current thread 0x...".
STACK_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")
STACK_QUIET = 0.1  # seconds without new output after a stack header: the dump (written in one go) is complete
# faulthandler dumps the newest thread first and the main thread last; a runner runs as ``python -m tether.runner``,
# so the main thread's outermost frame is runpy's: once that line is out, the dump is complete (no quiet wait).
STACK_END = re.compile(r'^  File "<frozen runpy>", line \d+ in _run_module_as_main$')


Seconds = Annotated[float, documented(exclusiveMinimum=0)]


class Deadlines(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How long each phase may go without progress before the runner counts as hung (seconds).

    The defaults suit a CPU runner of a small model and a GPU runner of a big one: a phase that is legitimately
    slower (a huge model loading from network storage without progress reports, a 100k-token prompt on a CPU) needs
    a higher value, and the hang cause names the deadline to raise.
    """

    heartbeat: Seconds = 5.0  # no heartbeat: the interpreter is stopped, deadlocked or stuck holding the GIL
    load_stall: Seconds = 120.0  # loading with no progress report (reset by each report; there is no total)
    warmup: Seconds = 300.0  # warm-up, in total (one short generation, plus any kernel compilation)
    first_token: Seconds = 120.0  # a generation's start to its first token (prefill of the whole prompt)
    token_gap: Seconds = 30.0  # between two tokens of one generation
    ack: Seconds = 5.0  # a task or cancel sent to the runner and not acknowledged by its reader thread
    stacks: Seconds = 1.0  # how long to wait for a hung runner's stacks before killing it

    def __post_init__(self) -> None:
        problem = self.check()
        if problem is not None:
            raise InvalidField("deadlines", f"invalid deadlines: {problem}")

    def check(self, heartbeat_interval: float = 0.0) -> str | None:
        """Why these deadlines are invalid (with ``heartbeat_interval``, the runner's beat period), or None."""
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value <= 0:
                return f"{name} must be a positive number of seconds, got {value!r}"
        if heartbeat_interval > 0 and self.heartbeat < 2 * heartbeat_interval:
            return (
                f"heartbeat ({self.heartbeat:g} s) must be at least twice the heartbeat interval "
                f"({heartbeat_interval:g} s), or one late beat counts as a hang"
            )
        return None


@dataclass(frozen=True)
class Hang:
    """A deadline that expired: which, in which phase, after how long without progress."""

    phase: str  # load | warmup | prefill | decode | idle | shutdown | starting
    seconds: float  # time without the awaited progress when it was declared
    deadline: str  # the Deadlines field that expired ("send" when a task pipe write could not complete)
    limit: float
    detail: str  # what was awaited, in words
    task_id: str | None = None

    def summary(self, runner: str) -> str:
        return f"{runner} hung in {self.phase} for {self.seconds:.1f} s: {self.detail}"

    def hint(self) -> str:
        if self.deadline == "send":
            return "what to do: see the stacks above; a runner that stops reading its tasks is stuck"
        return (
            f"what to do: see the stacks above for where it was stuck; if this phase is legitimately this slow, "
            f"raise the '{self.deadline}' deadline (now {self.limit:g} s; `tether run --deadline "
            f"{self.deadline}=SECONDS`)"
        )


@dataclass
class _Clock:
    started: float  # when the awaited progress started being awaited
    limit: float
    phase: str
    deadline: str
    detail: str
    task_id: str | None = None

    @property
    def expires(self) -> float:
        return self.started + self.limit


_DETAILS = {
    "load_stall": "no load progress",
    "warmup": "warm-up did not finish",
    "first_token": "no first token since the generation started",
    "token_gap": "no token since the previous one",
}


class ProgressWatch:
    """Deadline bookkeeping for one runner, fed with the time of each event (pure: no clock, no I/O).

    ``next_expiry`` says when to look again, ``expired`` what has expired by then. ``on_earlier`` is called when a
    new deadline falls before ``armed`` (the time the caller sleeps until), so the caller wakes up in time for it.
    """

    def __init__(self, deadlines: Deadlines, *, heartbeat: bool) -> None:
        self.deadlines = deadlines
        self.heartbeat = heartbeat
        self.last_beat: float | None = None  # None until the runner said hello
        self.armed = math.inf
        self.on_earlier: Callable[[], None] | None = None
        self._phase: _Clock | None = None  # load stall or warmup, from the runner's status
        self._tasks: dict[str, _Clock] = {}  # generations under way: first token, then token gaps
        self._acks: dict[tuple[str, str], _Clock] = {}  # ("task" | "cancel", task id): awaiting acknowledgement
        self._status_phase = "starting"

    # --- feeding --------------------------------------------------------------------------------------------

    def beat(self, now: float) -> None:
        """A heartbeat or the hello: the interpreter runs."""
        self.last_beat = now

    def status(self, status: RunnerStatus, now: float) -> None:
        d = self.deadlines
        if isinstance(status, Loading):  # every progress report restarts the stall clock
            self._phase = self._start(now, d.load_stall, "load", "load_stall")
            self._status_phase = "load"
        elif isinstance(status, WarmingUp):
            if self._phase is None or self._phase.deadline != "warmup":
                self._phase = self._start(now, d.warmup, "warmup", "warmup")
            self._status_phase = "warmup"
        else:
            self._phase = None
            self._status_phase = {"shutting_down": "shutdown", "running": "prefill"}.get(tag_of(status), "idle")

    def sent(self, kind: str, task_id: str, now: float) -> None:
        """A task (``kind="task"``) or a cancel (``"cancel"``) was written to the runner's pipe."""
        what = (
            f"task {task_id!r} was not acknowledged"
            if kind == "task"
            else f"cancel of {task_id!r} was not acknowledged"
        )
        self._acks[(kind, task_id)] = self._start(now, self.deadlines.ack, "", "ack", what, task_id)

    def acknowledged(self, kind: str, task_id: str) -> None:
        self._acks.pop((kind, task_id), None)

    def generation_started(self, task_id: str, now: float) -> None:
        self._tasks[task_id] = self._start(now, self.deadlines.first_token, "prefill", "first_token", task_id=task_id)

    def prefilling(self, task_id: str, now: float) -> None:
        """A long prompt's prefill advanced (a chunk of ``task_id``'s prompt is in the cache): the first-token
        deadline bounds the time without progress, as ``load_stall`` does for a load, not a prompt's whole length
        beside other streams. Every generation still awaiting its first token restarts its clock: the engine
        prefills one prompt at a time, so the others are queued behind this one, not stuck (a runner that stops
        stepping still stops these reports, and the heartbeat and token-gap deadlines watch the rest)."""
        for clock in self._tasks.values():
            if clock.deadline == "first_token":
                clock.started = now

    def token(self, task_id: str, now: float) -> None:
        clock = self._tasks.get(task_id)
        if clock is None:
            return
        if clock.deadline == "token_gap":
            clock.started = now  # the per-token path: one attribute write
        else:  # the first token: from now on the (usually shorter) gap deadline applies
            self._tasks[task_id] = self._start(now, self.deadlines.token_gap, "decode", "token_gap", task_id=task_id)

    def ended(self, task_id: str) -> None:
        """A task reached its terminal status: nothing more is awaited of it."""
        self._tasks.pop(task_id, None)
        self._acks.pop(("task", task_id), None)
        self._acks.pop(("cancel", task_id), None)

    # --- reading --------------------------------------------------------------------------------------------

    @property
    def phase(self) -> str:
        """What the runner is doing, as the phase word of a hang cause: while a batch generates, "decode" once any
        of its sequences has a token (a step decodes them all), else "prefill"."""
        if self._status_phase == "prefill" and self._tasks:
            return "decode" if any(clock.phase == "decode" for clock in self._tasks.values()) else "prefill"
        return self._status_phase

    def next_expiry(self) -> float:
        """The earliest time a deadline can expire (``inf`` when nothing is awaited)."""
        soonest = math.inf
        if self.heartbeat and self.last_beat is not None:
            soonest = self.last_beat + self.deadlines.heartbeat
        for clock in self._clocks():
            soonest = min(soonest, clock.expires)
        return soonest

    def expired(self, now: float) -> Hang | None:
        """The deadline that has expired at ``now`` (the one expired longest, past its limit), or None."""
        worst: tuple[float, Hang] | None = None
        if self.heartbeat and self.last_beat is not None:
            late = now - self.last_beat - self.deadlines.heartbeat
            if late >= 0:
                hang = Hang(
                    phase=self.phase,
                    seconds=now - self.last_beat,
                    deadline="heartbeat",
                    limit=self.deadlines.heartbeat,
                    detail="no heartbeat: the runner is stopped, deadlocked or blocked in native code holding the GIL",
                )
                worst = (late, hang)
        for clock in self._clocks():
            late = now - clock.expires
            if late >= 0 and (worst is None or late > worst[0]):
                phase = clock.phase or self.phase
                worst = (
                    late,
                    Hang(phase, now - clock.started, clock.deadline, clock.limit, clock.detail, clock.task_id),
                )
        return worst[1] if worst else None

    # --- internals ------------------------------------------------------------------------------------------

    def _clocks(self) -> list[_Clock]:
        clocks = list(self._tasks.values()) + list(self._acks.values())
        if self._phase is not None:
            clocks.append(self._phase)
        return clocks

    def _start(
        self, now: float, limit: float, phase: str, deadline: str, detail: str | None = None, task_id: str | None = None
    ) -> _Clock:
        clock = _Clock(now, limit, phase, deadline, detail or _DETAILS[deadline], task_id)
        if clock.expires < self.armed and self.on_earlier is not None:
            self.on_earlier()
        return clock


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T, t, Z, ...), or None when it is gone."""
    stat = proc_stat(pid)
    return stat.state if stat is not None else None


STATE_WORDS = {
    "T": "stopped by a signal (SIGSTOP or SIGTSTP): it cannot run its stack dump until continued",
    "t": "stopped by a debugger (ptrace): it cannot run its stack dump",
    "D": "in uninterruptible sleep (a kernel call: disk, network file system, GPU driver)",
    "Z": "already dead (a zombie not yet reaped)",
}


def stack_dump_complete(dump: list[str]) -> bool:
    """Whether ``dump`` ends with the main thread's outermost frame (the last line faulthandler writes)."""
    return bool(dump) and STACK_END.match(dump[-1]) is not None


def stack_dump(lines: list[str]) -> list[str]:
    """The faulthandler dump in ``lines`` (from its first thread header on), or [] when there is none."""
    for i, line in enumerate(lines):
        if STACK_HEADER.match(line):
            return lines[i:]
    return []
