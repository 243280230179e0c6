"""The server under attack: a ``tether serve`` child the campaign starts (and alone stops), with its own runtime
and log directories, so the campaign never touches a server or a runner it did not start."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path

from tether.kernel.pids import cmdline, live_processes
from tether.protocol import RunnerArgs


class ServeChild:
    """A ``tether serve`` child: its URL once it listens, its stderr lines as they come (waited for by pattern).

    The one harness for a server in a child process: the campaign's target builds on it, and so do the tests'.
    """

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        startup: float = 30.0,
        verbose: bool = False,
        cgroup: Path | None = None,
        reaper: bool = False,
        program: tuple[str, ...] = (sys.executable, "-m", "tether"),
        cwd: Path | None = None,
    ) -> None:
        """``reaper``: give the server a reaper (``_REAPER``) that kills it, and removes ``cgroup``, should this
        process die without stopping it (the campaign does; a test's own fixtures stop their servers). ``program``:
        the ``tether`` command to run (default: this interpreter's), in ``cwd``."""
        argv = [*program, *(("-v",) if verbose else ()), "serve", "--port", "0", *args]
        if cgroup is not None:  # the worker joins the memory cgroup before it starts (so do its runners, below it)
            argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *argv]
        self._reaper: subprocess.Popen[bytes] | None = None
        if reaper:  # started first: from the server's first moment, something outlives this process to stop it
            self._reaper = subprocess.Popen(
                [sys.executable, "-c", _REAPER],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a kill of this process's group must not take it too
            )
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        if self._reaper is not None and self._reaper.stdin is not None:
            self._reaper.stdin.write(f"{self.proc.pid} {cgroup or ''}\n".encode())
            self._reaper.stdin.flush()
        self.lines: queue.Queue[str | None] = queue.Queue()  # None: stderr closed (the server exited)
        self.seen: list[str] = []
        self._closed = False
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self.url = self.wait_for(r"listening on (http://\S+)", startup).group(1)
        except BaseException:  # it never listened: nothing of it may outlive the failure
            self.proc.kill()
            self.proc.wait()
            self._release_reaper()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _release_reaper(self) -> None:
        """The server is gone and the campaign checks what it left: the reaper leaves at once, touching nothing."""
        reaper, self._reaper = self._reaper, None
        if reaper is not None and reaper.stdin is not None:
            with contextlib.suppress(OSError):
                reaper.stdin.write(b"done")
            with contextlib.suppress(OSError):
                reaper.stdin.close()
            try:
                reaper.wait(5)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first stderr line (seen or to come) matching ``pattern``; ``AssertionError`` after ``timeout`` s, or
        as soon as the server's stderr closes without it (it exited: a refused fit need not cost the whole wait)."""
        for line in self.seen:
            if m := re.search(pattern, line):
                return m
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and (came := self._next(left)) is not None:
            if m := re.search(pattern, came):
                return m
        if self._closed:
            code = self.proc.wait()
            what = f"exited with code {code} before printing a line matching {pattern!r}"
        else:
            what = f"printed no line matching {pattern!r} within {timeout} s"
        raise AssertionError(f"tether serve (pid {self.pid}) {what}; stderr so far:\n" + "\n".join(self.seen))

    def drain(self) -> list[str]:
        """Every stderr line so far (those not waited for included)."""
        while self._next(None) is not None:
            pass
        return list(self.seen)

    def _next(self, timeout: float | None) -> str | None:
        """The next stderr line, kept in ``seen``, waiting up to ``timeout`` s (None: not at all); None when none
        came in time or stderr closed (then ``_closed``)."""
        if self._closed:
            return None
        try:
            line = self.lines.get(timeout=timeout) if timeout is not None else self.lines.get_nowait()
        except queue.Empty:
            return None
        if line is None:
            self._closed = True
            return None
        self.seen.append(line)
        return line

    def fds(self) -> int | None:
        links = self.fd_links()
        return None if links is None else len(links)

    def fd_links(self) -> dict[int, str] | None:
        """The server's fds and what each is (``/proc/PID/fd``'s links), or None once it is gone: a campaign that
        ends with more than its baseline names the ones it gained."""
        return fd_links(self.pid)

    def rss(self) -> int | None:
        return rss(self.pid)

    def runners(self) -> list[int]:
        """Live processes whose command line is a runner's naming this server as its worker, from /proc."""
        return runner_processes({self.pid})

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def stop_and_sweep(self, stop_timeout: float, gone_bound: float = 5.0, poll: float = 0.02) -> tuple[bool, int]:
        """SIGTERM and wait (``stop_timeout`` plus a margin, then SIGKILL), then wait ``gone_bound`` s for its
        runners to be gone and SIGKILL any left, whatever a figure says: (SIGKILL was needed, runners left)."""
        forced = False
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        try:
            self.proc.wait(stop_timeout + 10)
        except subprocess.TimeoutExpired:
            forced = True
            self.proc.kill()
            self.proc.wait()
        self._release_reaper()
        deadline = time.monotonic() + gone_bound
        while (left := self.runners()) and time.monotonic() < deadline:
            time.sleep(poll)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return forced, len(left)


class Target(ServeChild):
    """The campaign's server: ``tether serve --engine debug`` (or ``serve``) with a warm instance, private runtime
    and log directories (its records and logs are its own), and a bounded stop."""

    def __init__(
        self,
        workdir: Path,
        *,
        stop_timeout: float = 5.0,
        startup: float = 30.0,
        serve: tuple[str, ...] = ("--engine", "debug", "--name", "warm"),
        cgroup: Path | None = None,
        ready: str | None = r"warm ready \(runner pid",
    ) -> None:
        """``serve``: the engine, its instance and options (the batch and models targets pass their own);
        ``ready``: the stderr line that says its first instance is ready (None: do not wait for one)."""
        self.workdir = workdir
        self.runtime_dir = workdir / "runtime"
        self.log_dir = workdir / "logs"
        for path in (self.runtime_dir, self.log_dir):
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o700)
        env = dict(os.environ, TETHER_RUNTIME_DIR=str(self.runtime_dir), TETHER_LOG_DIR=str(self.log_dir))
        env.pop("TETHER_DISABLE_ORPHAN_WATCHDOG", None)
        self.stop_timeout = stop_timeout
        super().__init__(
            *serve, "--stop-timeout", str(stop_timeout), env=env, startup=startup, cgroup=cgroup, reaper=True
        )
        try:
            if ready is not None:
                self.wait_for(ready, startup)
        except BaseException:
            self.proc.kill()
            self.wait_exit()
            raise

    def stop(self) -> int | None:
        """SIGTERM, then :meth:`wait_exit`."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait_exit()

    def wait_exit(self) -> int | None:
        """The exit status within the stop bound plus a margin; None (after a SIGKILL) when it took longer."""
        try:
            return self.proc.wait(self.stop_timeout + 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        finally:
            self._release_reaper()


# A campaign killed outright (SIGKILL, a test's timeout) cannot stop the servers it started: each server has this
# reaper, reading a pipe only the campaign holds: first the server's pid and cgroup, then EOF. EOF without "done"
# means the campaign died: it SIGKILLs the worker (through a pidfd taken at start, so never a reused pid; the
# worker's runners follow it by their lifelines) and removes the worker's memory cgroup once empty.
_REAPER = """
import os, signal, sys, time
from pathlib import Path
pid, _, cgroup = sys.stdin.buffer.readline().decode().strip().partition(" ")
if not pid:
    sys.exit()
try:
    fd = os.pidfd_open(int(pid))
except OSError:
    fd = None
if sys.stdin.buffer.read().startswith(b"done"):
    sys.exit()
try:
    if fd is not None:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
except OSError:
    pass
root = Path(cgroup) if cgroup else None
deadline = time.monotonic() + 30
while root is not None and root.exists() and time.monotonic() < deadline:
    for path in [*sorted((p for p in root.glob("**/*") if p.is_dir()), reverse=True), root]:
        try:
            path.rmdir()
        except OSError:
            pass
    time.sleep(0.05)
"""


def runner_processes(workers: Collection[int]) -> list[int]:
    """Live processes whose command line is a tether runner's (runners, and their guards, which share it) naming one
    of ``workers`` as its worker, from /proc."""
    found = []
    for stat in live_processes():
        args = cmdline(stat.pid)
        runner = RunnerArgs.from_cmdline(args) if args else None
        if runner is not None and runner.worker_pid in workers:
            found.append(stat.pid)
    return found


def rss(pid: int) -> int | None:
    """Process ``pid``'s resident memory in bytes (``VmRSS``), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fd_links(pid: int) -> dict[int, str] | None:
    """Process ``pid``'s fds -> their ``/proc`` links (``pipe:[N]``, ``socket:[N]``, a path), None once it is gone."""
    directory = f"/proc/{pid}/fd"
    links = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    for name in names:
        with contextlib.suppress(OSError):
            links[int(name)] = os.readlink(f"{directory}/{name}")
    return links
