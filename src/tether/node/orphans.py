"""Find runners that outlived their worker, show what they really hold, and reap them without hitting bystanders.

Three sources, merged: every process of this user whose command line is a tether runner's (it names its worker:
``--worker=PID``) and leads its own process group, every registry record, and every runner cgroup (named
``tether-<runner id>-<worker pid>``) of a dead worker. A runner is an **orphan** when its parent is no longer its
worker (the worker died: it was reparented to init or a subreaper). A record whose runner is gone but whose process
group still has members (helpers that escaped a runner killed without its guard) is an orphan too, and so is a dead
worker's runner cgroup that still holds processes (helpers that left the group: ``setsid``, ``setpgid``, a double
fork; only the cgroup still names them). A record naming a live process with another start time or command line is
**stale** (the pid was reused): it is reported, never acted on.

Identity, before anything is signalled: a member of a group must still be in that process group, or in that runner
cgroup, and must have started no earlier than the runner (or the cgroup). A worker counts as dead when its pid is
gone or now belongs to a process that started after the cgroup was made. Reaping signals each process through a
pidfd opened *before* its identity (start time, command line, group or cgroup) is checked, so a pid reused in
between can never be hit: TERM to every member, a grace period, then KILL; then the emptied cgroup is removed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tether import env
from tether.kernel.cgroups import MemoryCgroup, RunnerCgroup, remove_cgroup, runner_cgroups
from tether.kernel.pids import pin, proc_stat, wait_pidfds
from tether.node import stores
from tether.node.memory import ProcessMemory, process_memory
from tether.node.nvml import GpuUsage
from tether.node.registry import Registry, RunnerRecord, same_start
from tether.protocol import RunnerArgs
from tether.runner.lifeline import watchdog_disabled
from tether.units import format_bytes

log = logging.getLogger("tether.node.orphans")

AUTO_REAP_ENV = env.AUTO_REAP  # "0" turns off the reaping a starting worker does


@dataclass(frozen=True)
class Proc:
    """One process as seen during a scan."""

    pid: int
    ppid: int
    pgid: int
    start_time: float
    cmdline: tuple[str, ...]
    memory: ProcessMemory | None = None

    @property
    def command(self) -> str:
        return " ".join(self.cmdline) or "?"


@dataclass
class RunnerGroup:
    """A tether runner and what it started: its process group and its own cgroup (the runner may be gone already)."""

    pgid: int | None  # == the runner's pid; None when only the runner's cgroup is known (it names no pid)
    worker_pid: int
    runner_id: str
    started: float  # the runner's start time, seconds since the epoch
    runner: Proc | None  # None: the runner is gone, only other members of its group live on
    members: list[Proc]  # every live process of the group, the runner first
    orphan: bool
    reason: str
    record: RunnerRecord | None = None
    record_path: Path | None = None
    watchdog: bool = True
    cgroup: MemoryCgroup | None = None  # the runner's own cgroup, when it had one: it holds what left the group

    @property
    def pid(self) -> int | None:
        return self.pgid

    @property
    def label(self) -> str:
        """How messages name it: by pid, or by id and cgroup when the pid is unknown."""
        if self.pgid is not None:
            return f"runner {self.pgid}"
        where = f" (cgroup {self.cgroup.path})" if self.cgroup is not None else ""
        return f"runner {self.runner_id}{where}"

    def holds(self, pid: int) -> bool:
        """Whether ``pid`` is in this runner's process group or its own cgroup now."""
        with contextlib.suppress(ProcessLookupError):
            if self.pgid is not None and os.getpgid(pid) == self.pgid:
                return True
        return self.cgroup is not None and MemoryCgroup.of_pid(pid) == self.cgroup

    @property
    def ppid(self) -> int | None:
        return self.runner.ppid if self.runner else None

    @property
    def model(self) -> str | None:
        return self.record.model if self.record else None

    @property
    def engine(self) -> str | None:
        return self.record.engine if self.record else None

    @property
    def memory(self) -> ProcessMemory:
        return ProcessMemory.total(m.memory for m in self.members if m.memory is not None)

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.started

    def role(self, proc: Proc) -> str:
        if proc.pid == self.pgid:
            return "runner"
        if self.runner is not None and proc.ppid == self.pgid and proc.cmdline == self.runner.cmdline:
            return "guard"
        return "helper"


@dataclass(frozen=True)
class StaleRecord:
    path: Path
    pid: int | None
    why: str


@dataclass
class Scan:
    orphans: list[RunnerGroup] = field(default_factory=list)
    healthy: list[RunnerGroup] = field(default_factory=list)
    stale: list[StaleRecord] = field(default_factory=list)
    gpu: GpuUsage = field(default_factory=lambda: GpuUsage(False, "not queried"))


@dataclass
class ReapResult:
    group: RunnerGroup
    gone: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)  # (pid, why): identity no longer matches
    killed_with: str | None = None  # "SIGTERM" when the grace sufficed, else "SIGKILL"
    freed: ProcessMemory = field(default_factory=lambda: ProcessMemory(0, 0, 0, 0, 0, 0))
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.survivors


# --------------------------------------------------------------------------------------------------------------
# Scanning
# --------------------------------------------------------------------------------------------------------------


def _own_processes() -> dict[int, Proc]:
    uid = os.getuid()
    procs: dict[int, Proc] = {}
    for p in psutil.process_iter(["ppid", "cmdline", "create_time", "uids", "status"]):
        info = p.info
        if info["uids"] is None or info["uids"].real != uid or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            pgid = os.getpgid(p.pid)
        except ProcessLookupError:
            continue
        procs[p.pid] = Proc(p.pid, info["ppid"] or 0, pgid, info["create_time"] or 0.0, tuple(info["cmdline"] or ()))
    return procs


def _with_memory(proc: Proc, gpu: GpuUsage) -> Proc:
    return Proc(proc.pid, proc.ppid, proc.pgid, proc.start_time, proc.cmdline, process_memory(proc.pid, gpu))


CGROUP_START_TOLERANCE = 1.0  # seconds: psutil's start times are within 1 s (it takes a whole-second boot time)


WORKER_REUSE_MARGIN = 2.0  # seconds: a wall-clock step could shift a live worker's start past its cgroup's making


def _worker_gone(found: RunnerCgroup) -> bool:
    """Whether the worker that made a runner cgroup is dead: its pid is gone, or names a process started later."""
    stat = proc_stat(found.worker_pid)
    return stat is None or stat.state in ("Z", "X") or stat.started_at > found.created + WORKER_REUSE_MARGIN


def _same_pid_namespace(pid: int) -> bool:
    """Whether ``pid`` lives in this process's pid namespace: a container's worker names pids of its own, which
    mean other processes here, so its cgroups are never judged from outside."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
    except OSError:
        return False


def dead_workers_cgroups() -> list[RunnerCgroup]:
    """The runner cgroups whose worker is dead (each may still hold processes; see ``scan``).

    A cgroup that holds this very process is never one: a worker is never inside its runners' cgroups, so such a
    cgroup only looks like a runner's by its name (``tether-test-14929379`` matched ``tether-<runner>-<worker
    pid>``, and a starting ``tether run`` inside it reaped itself with SIGTERM)."""
    me = os.getpid()
    return [found for found in runner_cgroups() if _worker_gone(found) and me not in found.cgroup.pids()]


def scan(registry: Registry | None = None, *, memory: bool = True) -> Scan:
    """Every tether runner of this user, sorted into orphans and healthy ones, plus stale records."""
    registry = registry or Registry()
    gpu = GpuUsage.snapshot() if memory else GpuUsage(False, "not queried")
    result = Scan(gpu=gpu)
    procs = _own_processes()
    by_group: dict[int, list[Proc]] = defaultdict(list)
    for proc in procs.values():
        by_group[proc.pgid].append(proc)

    def measured(found: list[Proc]) -> list[Proc]:
        return [_with_memory(p, gpu) for p in found] if memory else found

    def members(pgid: int, since: float) -> list[Proc]:
        found = [p for p in by_group.get(pgid, []) if p.start_time >= since - 0.05]
        found.sort(key=lambda p: (p.pid != pgid, p.pid))
        return measured(found)

    # Runner cgroups of dead workers, with the processes of ours still in them (started after the cgroup was made).
    dead: dict[Path, tuple[RunnerCgroup, list[Proc]]] = {}
    for found in dead_workers_cgroups():
        inside = [procs[pid] for pid in found.cgroup.pids() if pid in procs]
        if not all(_same_pid_namespace(p.pid) for p in inside):
            continue
        inside = [p for p in inside if p.start_time >= found.created - CGROUP_START_TOLERANCE]
        dead[found.cgroup.path] = (found, sorted(inside, key=lambda p: p.pid))

    def claim(group: RunnerGroup, path: Path | None) -> None:
        """Attach a dead worker's runner cgroup to the group it belongs to, adding the members only it names."""
        if path is None or path not in dead:
            path = next(
                (
                    p
                    for p, (found, _) in dead.items()
                    if found.runner_id == group.runner_id and found.worker_pid == group.worker_pid
                ),
                None,
            )
        if path is None:
            return
        found, inside = dead.pop(path)
        group.cgroup = found.cgroup
        known = {m.pid for m in group.members}
        group.members.extend(measured([p for p in inside if p.pid not in known]))

    files = registry.records()
    records = {f.record.pid: f for f in files if f.record is not None}
    result.stale.extend(StaleRecord(f.path, None, f"unreadable record: {f.error}") for f in files if f.record is None)

    # Runners found by their command line.
    seen: set[int] = set()
    for proc in procs.values():
        args = RunnerArgs.from_cmdline(list(proc.cmdline))
        if args is None or proc.pid != proc.pgid:
            continue
        seen.add(proc.pid)
        file = records.get(proc.pid)
        record = None
        if file is not None and file.record is not None:
            if same_start(file.record.start_time, proc.start_time) and tuple(file.record.cmdline) == proc.cmdline:
                record = file.record
            else:
                result.stale.append(StaleRecord(file.path, proc.pid, "its runner is gone; the pid is another runner"))
        worker = procs.get(args.worker_pid)
        if proc.ppid == args.worker_pid:
            orphan, reason = False, f"child of worker {args.worker_pid}"
        elif worker is None:
            orphan, reason = True, f"worker {args.worker_pid} is gone; reparented to {proc.ppid}"
        else:
            orphan, reason = True, f"its parent is {proc.ppid}, not worker {args.worker_pid} (that pid was reused)"
        group = RunnerGroup(
            pgid=proc.pid,
            worker_pid=args.worker_pid,
            runner_id=args.runner_id,
            started=proc.start_time,
            runner=_with_memory(proc, gpu) if memory else proc,
            members=members(proc.pid, proc.start_time),
            orphan=orphan,
            reason=reason,
            record=record,
            record_path=file.path if record is not None and file is not None else None,
            watchdog=record.watchdog if record is not None else not _watchdog_disabled_in(proc.pid),
        )
        if orphan:
            claim(group, _record_cgroup(record))
        (result.orphans if orphan else result.healthy).append(group)

    for group in result.healthy:  # belt and braces: a cgroup holding a runner its live worker still parents is live
        for path in [path for path, (_, inside) in dead.items() if any(p.pid == group.pgid for p in inside)]:
            del dead[path]

    # Records whose runner is gone: stale, unless its group or its cgroup lives on.
    for pid, file in records.items():
        assert file.record is not None
        rec = file.record
        if pid in seen:
            continue
        live = procs.get(pid)
        if live is not None:
            result.stale.append(StaleRecord(file.path, pid, f"pid {pid} now belongs to another process"))
            continue
        group = RunnerGroup(
            pgid=rec.pgid,
            worker_pid=rec.worker_pid,
            runner_id=rec.runner_id,
            started=rec.start_time,
            runner=None,
            members=members(rec.pgid, rec.start_time),
            orphan=True,
            reason="",
            record=rec,
            record_path=file.path,
            watchdog=rec.watchdog,
        )
        claim(group, _record_cgroup(rec))
        if not group.members:
            result.stale.append(StaleRecord(file.path, pid, "the runner exited"))
            continue
        where = "its group and cgroup" if group.cgroup is not None else "its group"
        group.reason = f"runner {pid} is gone but {len(group.members)} process(es) of {where} live on"
        result.orphans.append(group)

    # Dead workers' runner cgroups that no runner or record accounts for (a worker whose records are elsewhere).
    for found, inside in dead.values():
        if not inside:
            continue
        result.orphans.append(
            RunnerGroup(
                pgid=None,
                worker_pid=found.worker_pid,
                runner_id=found.runner_id,
                started=found.created,
                runner=None,
                members=measured(inside),
                orphan=True,
                reason=(
                    f"worker {found.worker_pid} is gone but its runner cgroup {found.cgroup.path} still holds "
                    f"{len(inside)} process(es)"
                ),
                cgroup=found.cgroup,
            )
        )
    result.orphans.sort(key=lambda g: g.started)
    result.healthy.sort(key=lambda g: g.started)
    return result


def _record_cgroup(record: RunnerRecord | None) -> Path | None:
    return Path(record.cgroup) if record is not None and record.cgroup is not None else None


def _watchdog_disabled_in(pid: int) -> bool:
    try:
        return watchdog_disabled(psutil.Process(pid).environ())
    except (psutil.Error, OSError):
        return False


# --------------------------------------------------------------------------------------------------------------
# Reaping
# --------------------------------------------------------------------------------------------------------------


def _refuse(proc: Proc, group: RunnerGroup, _pid: int) -> str | None:
    return _identity_mismatch(proc, group)


def _identity_mismatch(proc: Proc, group: RunnerGroup) -> str | None:
    """Why ``proc`` is no longer the process that was scanned (None when it still is)."""
    try:
        live = psutil.Process(proc.pid)
        if not same_start(live.create_time(), proc.start_time):
            return f"pid {proc.pid} was reused (start time differs)"
        if tuple(live.cmdline()) != proc.cmdline:
            return f"pid {proc.pid} changed its command line"
        if not group.holds(proc.pid):
            where = f"process group {group.pgid}" if group.pgid is not None else ""
            if group.cgroup is not None:
                where += f"{' and ' if where else ''}cgroup {group.cgroup.path}"
            return f"pid {proc.pid} left {where}"
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None  # gone: nothing to signal, and it counts as gone
    except psutil.Error as exc:
        return f"pid {proc.pid} cannot be inspected: {exc}"
    return None


def reap(group: RunnerGroup, *, grace: float = 5.0, kill_wait: float = 5.0) -> ReapResult:
    """Stop every process of an orphaned runner group: SIGTERM, ``grace`` seconds, then SIGKILL. Bounded."""
    began = time.monotonic()
    result = ReapResult(group=group)
    pidfds: dict[int, int] = {}
    procs: dict[int, Proc] = {}

    def adopt(candidates: Iterable[Proc]) -> None:
        for proc in candidates:
            if proc.pid in procs:
                continue
            fd, why = pin(proc.pid, functools.partial(_refuse, proc, group))  # pin, then check it is ours
            if why is not None:
                result.refused.append((proc.pid, why))
                continue
            if fd is None:
                result.gone.append(proc.pid)
                continue
            pidfds[fd] = proc.pid
            procs[proc.pid] = proc

    def send(sig: int, pids: set[int]) -> None:
        for fd, pid in pidfds.items():
            if pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, sig)

    try:
        adopt(group.members)
        send(signal.SIGTERM, set(procs))
        gone = wait_pidfds(pidfds, grace)
        result.killed_with = "SIGTERM"
        # Anything forked meanwhile (a helper respawning) joins the group or the cgroup: take it too, but only while
        # a verified member still holds the group id (until then it cannot be reused), and never a new group leader
        # (a leader with the group's id that we did not verify is a reused pid, not our runner).
        if set(procs) - gone:
            in_cgroup = set(group.cgroup.pids()) if group.cgroup is not None else set()
            adopt(
                p
                for p in _own_processes().values()
                if (p.pid in in_cgroup or (p.pgid == group.pgid and p.pid != group.pgid))
                and p.start_time >= group.started - CGROUP_START_TOLERANCE
            )
        alive = set(procs) - gone
        if alive:
            result.killed_with = "SIGKILL"
            send(signal.SIGKILL, alive)
            gone |= wait_pidfds({fd: pid for fd, pid in pidfds.items() if pid in alive}, kill_wait)
    finally:
        for fd in pidfds:
            os.close(fd)
    result.gone.extend(sorted(gone))
    result.survivors = sorted(set(procs) - gone)
    result.freed = ProcessMemory.total(p.memory for p in procs.values() if p.pid in gone and p.memory is not None)
    result.seconds = time.monotonic() - began
    for pid in gone:  # our own zombies when we are their (sub)reaper; init reaps the others
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    if result.ok:
        if group.cgroup is not None:
            remove_cgroup(group.cgroup)  # empty now (an exited process has left it); else the next sweep
        if group.record_path is not None:
            with contextlib.suppress(FileNotFoundError):
                group.record_path.unlink()
    return result


def sweep_stale_cgroups() -> list[Path]:
    """Remove the empty runner cgroups of dead workers (a hard-killed worker cannot remove its own)."""
    removed = []
    for found in dead_workers_cgroups():
        if not found.cgroup.pids() and remove_cgroup(found.cgroup):
            removed.append(found.cgroup.path)
    return removed


def auto_reap_enabled() -> bool:
    return env.flag(AUTO_REAP_ENV, default=True)


def reap_all(found: Scan, registry: Registry, *, grace: float = 5.0, spare_unwatched: bool = False) -> list[ReapResult]:
    """Reap every orphan of a scan and drop its stale records; log each outcome.

    ``spare_unwatched`` leaves alone the runners started with the orphan watchdog disabled (someone wants them
    alive): what a starting worker does, as opposed to someone asking for ``--reap``.
    """
    for stale in found.stale:
        registry.discard(stale.path)
    results = []
    for group in found.orphans:
        if spare_unwatched and not group.watchdog:
            log.warning(
                "left orphaned %s alone: it was started with the orphan watchdog disabled (%s)",
                group.label,
                group.reason,
            )
            continue
        result = reap(group, grace=grace)
        results.append(result)
        if result.ok:
            log.warning(
                "reaped orphaned %s (%s; %s) with %s: freed %s (RSS %s)",
                group.label,
                group.model or group.engine or "unknown model",
                group.reason,
                result.killed_with,
                format_bytes(result.freed.footprint),
                format_bytes(result.freed.rss),
            )
        else:
            log.error("could not reap orphaned %s: %s survived SIGKILL", group.label, result.survivors)
    for path in sweep_stale_cgroups():  # after the reaping: the cgroups it emptied go too
        log.info("removed the empty cgroup %s of a dead worker", path)
    stores.sweep()  # and what outlived those runners: their prompt stores
    return results


def reap_at_start(registry: Registry | None = None, *, grace: float = 2.0) -> list[ReapResult]:
    """What a starting worker does: reap the orphans of dead workers, except those asked to live, and drop stale
    records."""
    registry = registry or Registry()
    return reap_all(scan(registry), registry, grace=grace, spare_unwatched=True)
