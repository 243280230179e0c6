"""One runner life as an ``Instance`` drives it: the contract (``RunnerLife``), and what every life owns alike
(``LifeTasks``: its task group, its requests in flight, its end), written once.

Three lives implement the contract side by side; none is a kind of another:

- ``tether.node.supervisor.Supervisor``: one runner process on this machine (its pipes, signals, cgroup, pidfd);
- ``tether.node.ranks.RankGroup``: one life per rank (any of the three), failing and restarting as one;
- ``tether.cluster.remote.RemoteSupervisor``: a runner hosted by a node agent, its calls and events relayed by Ray.

The drive is the same for all: enter (``async with``: the task group opens, ``start`` spawns), ``ready`` (load and
warm up), serve ``generate`` until ``wait_exit`` returns, then ``confirm_gone`` before the next life may start.
Leaving the block stops the life (shielded: a cancelled caller still stops it) and closes its task group.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

import anyio
from anyio.abc import TaskGroup

from tether.node.memory import ProcessMemory
from tether.node.tasks import CancelReply, InFlight, StopReport, TaskEvent, TaskHandle, new_id
from tether.protocol import Cause, EngineSpec, GenerateTask, RunnerStatus, Work


class RunnerLife(Protocol):
    """What an ``Instance``, the fleet and the API may ask of a runner life, whichever of the three it is."""

    @property
    def spec(self) -> EngineSpec: ...
    @property
    def runner_id(self) -> str: ...
    @property
    def name(self) -> str:
        """How logs and causes name it: runner id, engine, model (and its node or its ranks)."""

    @property
    def node(self) -> str | None:
        """The Ray node it runs on, or None on this machine."""

    @property
    def pid(self) -> int | None:
        """Its runner's pid (rank 0's for a group; on its own node for a remote life), once spawned."""

    @property
    def alive(self) -> bool: ...
    @property
    def status(self) -> RunnerStatus: ...
    @property
    def cause(self) -> Cause | None:
        """Why it ended, once it failed: the one cause every request it held ended with."""

    @property
    def stop_report(self) -> StopReport | None: ...
    @property
    def stop_timeout(self) -> float: ...
    @property
    def detection_seconds(self) -> float | None:
        """From the failure to tether's verdict on it."""

    @property
    def footprint(self) -> ProcessMemory | None:
        """Its whole process group's memory, as last sampled."""

    @property
    def cgroup(self) -> Path | None: ...
    @property
    def last_heartbeat(self) -> float | None: ...
    @property
    def output_tail(self) -> list[str]: ...
    @property
    def output_log(self) -> Path | None: ...

    async def __aenter__(self) -> Self: ...
    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None: ...
    async def ready(self) -> None:
        """Load and warm up; ``TaskFailed`` (with the cause) if it could not."""

    async def generate(self, params: Work, task_id: str | None = None) -> TaskHandle:
        """Take a request (any ``Work``); its events, ending with exactly one terminal status, arrive on the handle."""

    async def cancel(self, task_id: str) -> CancelReply: ...
    def in_flight(self) -> list[InFlight]: ...
    def generations(self) -> tuple[int, int]:
        """(running, waiting) generations."""

    async def stop(self, timeout: float | None = None) -> StopReport | None: ...
    async def wait_exit(self, timeout: float) -> None: ...
    async def wait_released(self, timeout: float) -> None:
        """Returns once the life has let go of all it held: its processes reaped and their memory freed (a process
        is reported exited before its memory is freed while anything else holds its address space)."""

    async def confirm_gone(self, timeout: float) -> None:
        """Returns once nothing of the life is left (``NotGone`` otherwise): what a replacement waits for."""

    async def measure(self) -> ProcessMemory | None:
        """Its runners' own memory now: what the fit check's estimate is compared with after load."""

    async def sample_memory(self) -> ProcessMemory | None: ...
    def add_status_listener(self, callback: Callable[[RunnerStatus], None]) -> None: ...


class LifeTasks(abc.ABC):
    """What each of the three lives owns alike: the task group its watchers and relays run in, its requests in
    flight, and the event of its end. Entering opens the group and starts the life; leaving stops it (shielded),
    lets the life release what it holds (``_release``), then closes the group, so that the caller's exception (if
    any) propagates as itself rather than wrapped in an exception group."""

    def __init__(self) -> None:
        self._tg: TaskGroup | None = None
        self._inflight: dict[str, InFlight] = {}
        self._exited = anyio.Event()
        self._released = anyio.Event()  # its group closed: every process it had reaped, their memory freed
        self._drained = anyio.Event()  # set whenever no relayed request is in flight
        self._drained.set()

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self, timeout: float | None = None) -> StopReport | None: ...

    async def _release(self) -> None:
        """After the stop, before the group closes (default: its tasks end now)."""
        self._group.cancel_scope.cancel()

    async def __aenter__(self) -> Self:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self.start()
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        with anyio.CancelScope(shield=True):
            await self.stop()
        group = self._group
        try:
            await self._release()
        finally:
            try:
                await group.__aexit__(None, None, None)
            finally:
                self._released.set()
        return None

    @property
    def _group(self) -> TaskGroup:
        assert self._tg is not None, f"use 'async with {type(self).__name__}(...)'"
        return self._tg

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        self._group.start_soon(func, *args)

    def in_flight(self) -> list[InFlight]:
        """The tasks this life is serving now, with the tokens each has produced."""
        return list(self._inflight.values())

    def generations(self) -> tuple[int, int]:
        """(running, waiting): generations in the runner's batch, and those accepted that wait for a slot."""
        running = waiting = 0
        for record in self._inflight.values():
            if isinstance(record.task, GenerateTask):
                if record.started:
                    running += 1
                else:
                    waiting += 1
        return running, waiting

    async def wait_exit(self, timeout: float) -> None:
        with anyio.fail_after(timeout):
            await self._exited.wait()

    async def wait_released(self, timeout: float) -> None:
        with anyio.fail_after(timeout):
            await self._released.wait()

    # --- relayed generations (a rank group's, a remote life's): tracked here, delivered by the life's relay ----

    def _track(self, params: Work, task_id: str | None) -> tuple[InFlight, TaskHandle]:
        """A new relayed generation: its record in flight and the handle its caller reads."""
        tid = task_id or new_id("gen")
        if tid in self._inflight:
            raise ValueError(f"duplicate task id {tid!r}: every task needs a fresh id")
        send, receive = anyio.create_memory_object_stream[TaskEvent](math.inf)
        record = InFlight(task=GenerateTask(task_id=tid, params=params), send=send)
        self._inflight[tid] = record
        self._drained = anyio.Event()
        return record, TaskHandle(tid, "generate", receive)

    def _untrack(self, task_id: str) -> InFlight | None:
        record = self._inflight.pop(task_id, None)
        if not self._inflight:
            self._drained.set()
        return record

    async def _drain(self, timeout: float) -> None:
        """Wait (bounded) until every relayed request has delivered its end."""
        with anyio.move_on_after(timeout):
            await self._drained.wait()
