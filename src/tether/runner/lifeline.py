"""Orphan protection, runner side: a runner never outlives its worker, and its process group never outlives it.

Three independent layers end a runner whose worker is gone, any one of them enough (``LAYERS``): ``pdeathsig`` (the
kernel kills the runner when the worker's spawning thread exits, even with the GIL held), ``lifeline`` (EOF on a pipe
whose only write end the worker holds, however it died, also under a subreaper) and ``poll`` (``getppid()`` against
the worker's pid). A **group guard** forked at bootstrap has the last word (``start_group_guard``): whichever layer
wins, the runner's cgroup and process group die with it, so an engine's helpers never survive their runner; the
layers kill the cgroup's members on their way out, never the guard. ``TETHER_DISABLE_ORPHAN_WATCHDOG=1`` disarms the
layers (never the guard), with a warning. The worker's side: docs/design.md, "No orphans".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import NoReturn

from tether import env
from tether.kernel.cgroups import MemoryCgroup, kill_cgroup_members
from tether.kernel.pids import wait_pidfds

DISABLE_ENV = env.DISABLE_ORPHAN_WATCHDOG
LAYERS = ("pdeathsig", "lifeline", "poll")
DEFAULT_POLL_INTERVAL = 0.5  # seconds; the bound is <= 1 s, the seed's watchdog used 5 s

GUARD_WAIT = 5.0  # seconds the guard waits for the cgroup's members to exit (each one already SIGKILLed)

_PR_SET_PDEATHSIG = 1

# Set once at bootstrap, for ``orphan_exit`` (which may run on any thread, even while the main thread is wedged).
_own_cgroup: MemoryCgroup | None = None  # the runner's own memory cgroup, when the worker made one
_guard: tuple[int, int | None] | None = None  # the group guard's pid and pidfd


def watchdog_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when the escape hatch is set in ``environ`` (default: this process's environment)."""
    return env.flag(DISABLE_ENV, default=False, environ=environ)


def check_layers(layers: Iterable[str]) -> tuple[str, ...]:
    """Validate a layer selection; raise ``ValueError`` naming the valid ones."""
    chosen = tuple(layers)
    unknown = [layer for layer in chosen if layer not in LAYERS]
    if unknown:
        raise ValueError(f"unknown orphan-protection layer(s) {unknown}; choose from {list(LAYERS)}")
    return chosen


def orphan_exit(reason: str) -> NoReturn:
    """Leave at once, taking along everything this runner started (engine helpers), except a live guard.

    The guard is spared so that, should the kernel's SIGKILL (pdeathsig) cut this sweep short, it still sweeps once
    the runner is gone; and it sweeps again anyway, after every exit, catching a helper forked meanwhile. Without a
    live guard, the group is killed here, this runner included.
    """
    with contextlib.suppress(OSError):  # the worker, which read our stderr, is usually gone: EPIPE is fine
        os.write(2, f"tether runner {os.getpid()}: {reason}; exiting\n".encode())
    me = os.getpid()
    guard = _guard_alive()
    if _own_cgroup is not None:
        kill_cgroup_members(_own_cgroup, spare=(me,) if guard is None else (me, guard))
        if guard is not None:
            os._exit(70)
    if os.getpgrp() == me:
        with contextlib.suppress(OSError):
            os.killpg(me, signal.SIGKILL)
    os._exit(70)


def _guard_alive() -> int | None:
    """The guard's pid while it lives (its pidfd is not readable yet), else None."""
    if _guard is None:
        return None
    pid, pidfd = _guard
    if pidfd is None:
        try:
            return pid if os.waitpid(pid, os.WNOHANG) == (0, 0) else None
        except ChildProcessError:
            return None
    return None if select.select([pidfd], [], [], 0)[0] else pid


def join_cgroup(path: str) -> MemoryCgroup | None:
    """Move this process into the memory cgroup at ``path`` before it forks anything (its guard and every helper
    then start inside it); None, with a warning on stderr, when that is not allowed."""
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as exc:
        print(
            f"tether runner {os.getpid()}: WARNING: cannot join memory cgroup {path} ({exc.strerror or exc}): "
            "a helper process that leaves the runner's process group will not be contained",
            file=sys.stderr,
            flush=True,
        )
        return None
    return MemoryCgroup.of_pid(os.getpid())


def set_pdeathsig(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent *thread* exits (the worker spawns from one
    long-lived thread); False where unsupported. It kills only the runner: its helpers are the guard's."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _watch_lifeline(fd: int, worker_pid: int) -> None:
    while True:
        try:
            data = os.read(fd, 4096)
        except InterruptedError:
            continue
        except OSError as exc:
            orphan_exit(f"lifeline to worker {worker_pid} failed ({exc})")
        if not data:
            orphan_exit(f"lifeline closed: worker {worker_pid} is gone")


def _poll_parent(worker_pid: int, interval: float) -> None:
    # against the worker's pid, not against 1: under a subreaper the new parent is not init
    while True:
        time.sleep(interval)
        parent = os.getppid()
        if parent != worker_pid:
            orphan_exit(f"parent is now {parent}, not worker {worker_pid}")


def install(
    worker_pid: int,
    lifeline_fd: int | None,
    layers: Iterable[str] = LAYERS,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    own_cgroup: MemoryCgroup | None = None,
) -> tuple[str, ...]:
    """Arm the chosen layers; return the ones armed. Call first thing in the runner, before any other thread.

    Also starts the group guard when this runner leads its own process group. ``own_cgroup`` is the memory cgroup
    the worker made for this runner alone (the runner has joined it already): the guard and the layers kill every
    process in it. When the escape hatch is set, no layer is armed and a warning is printed to stderr (the
    supervisor keeps it in the runner's output tail).
    """
    global _own_cgroup
    _own_cgroup = own_cgroup
    chosen = set(check_layers(layers))
    if watchdog_disabled():
        print(
            f"tether runner {os.getpid()}: WARNING: {DISABLE_ENV} is set: orphan protection is off and this runner "
            f"will outlive worker {worker_pid} if the worker dies; clean up with `tether orphans --reap`",
            file=sys.stderr,
            flush=True,
        )
        chosen.clear()
    armed: list[str] = []
    if "pdeathsig" in chosen and set_pdeathsig(signal.SIGKILL):
        armed.append("pdeathsig")
    # The race: had the worker died before prctl, no signal would ever come. Checked whatever layers are chosen,
    # since the lifeline and poll threads start later still.
    if chosen and os.getppid() != worker_pid:
        orphan_exit(f"worker {worker_pid} died before the runner started")
    start_group_guard()  # forks: must run while this process has a single thread
    if lifeline_fd is not None:
        if "lifeline" in chosen:
            os.set_inheritable(lifeline_fd, False)
            threading.Thread(
                target=_watch_lifeline, args=(lifeline_fd, worker_pid), name="tether-lifeline", daemon=True
            ).start()
            armed.append("lifeline")
        else:
            os.close(lifeline_fd)
    if "poll" in chosen:
        threading.Thread(
            target=_poll_parent, args=(worker_pid, max(poll_interval, 0.001)), name="tether-ppid-poll", daemon=True
        ).start()
        armed.append("poll")
    return tuple(armed)


def start_group_guard() -> int | None:
    """Fork the group guard; return its pid (None when this process does not lead its own group).

    The guard waits on the runner's pidfd and, when the runner dies for any reason, SIGKILLs every process of the
    runner's own memory cgroup (which holds the helpers that left the process group: ``setsid``, ``setpgid``, a
    double fork), waits until each has exited, then kills the group. Without a cgroup of its own, a helper that
    leaves the process group is out of reach (the supervisor logs why there is no cgroup). Forked before any thread
    exists.

    The guard holds no descriptor but the runner's pidfd (so it never keeps a pipe open), ignores SIGTERM and
    SIGINT (a stop escalates to SIGKILL for the group anyway), asks the OOM killer to spare it (it is tiny, and the
    last word), and ends by SIGKILLing the group, itself included.
    """
    global _guard
    runner = os.getpid()
    if os.getpgrp() != runner:
        return None
    pidfd: int | None = None
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(runner)
    pid = os.fork()
    if pid:
        if pidfd is not None:
            os.close(pidfd)
        guard_fd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            guard_fd = os.pidfd_open(pid)
        _guard = (pid, guard_fd)
        return pid
    try:  # the guard: never returns
        cgroup = _own_cgroup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:  # needs CAP_SYS_RESOURCE
            f.write("-1000")
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        top = os.sysconf("SC_OPEN_MAX")
        if pidfd is None:
            os.closerange(3, top)
        else:
            os.closerange(3, pidfd)
            os.closerange(pidfd + 1, top)
        if pidfd is not None:
            wait_pidfds({pidfd: runner}, None)
        else:
            while os.getppid() == runner:
                time.sleep(0.05)
        if cgroup is not None:  # helpers that left the process group are still in the runner's cgroup
            kill_cgroup_members(cgroup, spare=(os.getpid(),), wait=GUARD_WAIT)
        os.killpg(runner, signal.SIGKILL)
    finally:
        os._exit(0)
