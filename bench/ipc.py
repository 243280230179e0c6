"""IPC benchmark: runner -> supervisor events/s and per-event latency, tether channel vs the seed's pattern.

tether: a child interpreter (subprocess + pass_fds, never fork from the async parent) sends ``Chunk`` events
through ``SyncSender`` (one ``os.write`` per frame) and exits with ``os._exit`` right after its last write; the
parent reads them with ``AsyncReceiver.receive_batch()`` inside ``anyio.run``.

baseline (the seed system): a spawn-context child puts the same ``Chunk`` objects on a ``multiprocessing.Queue``;
the parent's async side fetches each one with ``await anyio.to_thread.run_sync(queue.get)``.

Both children announce themselves with one "ready" event and then wait for a go signal, so interpreter start-up
is never timed: throughput is measured from "go" to the last event received by the parent. Latency uses events
stamped with ``time.monotonic_ns()`` in the child (CLOCK_MONOTONIC is system-wide on Linux, so the difference to
the parent's receive time is valid across processes), paced so that queueing does not dominate: the default gap
is 1 ms because the baseline needs ~130-250 µs per event here, so at 200 µs its "latency" is mostly a queue.

Run: ``.venv/bin/python bench/ipc.py [--quick]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import os
import pickle
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from benchstats import emit
from tether.channel import AsyncReceiver, EndOfStream, SyncSender
from tether.protocol import Chunk

TASK_ID = "gen-bench"
TOKEN = " the"  # a typical one-token text delta
READY_ID = "ready"
CHILD_MODE = "_tether_child"  # argv[1] of the tether child (this same file, run as a fresh interpreter)
START_TIMEOUT = 30.0  # seconds for a child interpreter to start and say it is ready
SPIN_NS = 60_000  # pacing: sleep (GIL released) until this close to the deadline, then spin


# --------------------------------------------------------------------------------------------------------------
# Child side (runs in the spawned processes)
# --------------------------------------------------------------------------------------------------------------


def _pace(deadline_ns: int) -> None:
    """Wait until ``deadline_ns`` (perf_counter_ns).

    Sleeping first releases the GIL the way an engine computing in native code does, so the baseline's
    ``multiprocessing.Queue`` feeder thread can run between sends (a pure busy-wait would starve it for the
    5 ms GIL switch interval and make the baseline look worse than it is); spinning the rest keeps the
    pacing precise despite timer slack.
    """
    remaining = deadline_ns - time.perf_counter_ns()
    if remaining > SPIN_NS:
        time.sleep((remaining - SPIN_NS) / 1e9)
    while time.perf_counter_ns() < deadline_ns:
        pass


def _send_events(send: Callable[[Chunk], None], n: int, pace_ns: int) -> None:
    """The runner's hot loop: build one Chunk per token (as runner.generate does) and send it."""
    now = time.monotonic_ns
    if not pace_ns:
        for _ in range(n):
            send(Chunk(task_id=TASK_ID, text=TOKEN, sent_ns=now()))
        return
    clock = time.perf_counter_ns
    for _ in range(n):
        send(Chunk(task_id=TASK_ID, text=TOKEN, sent_ns=now()))
        _pace(clock() + pace_ns)


def _tether_child(argv: list[str]) -> None:
    """argv: events_fd go_fd n pace_ns. Exits with os._exit right after the last write: nothing is flushed."""
    events_fd, go_fd, n, pace_ns = (int(a) for a in argv)
    sender = SyncSender(events_fd)
    sender.send(Chunk(task_id=READY_ID, text=""))
    if os.read(go_fd, 1) != b"g":  # EOF: the parent gave up (or died)
        os._exit(3)
    _send_events(sender.send, n, pace_ns)
    os._exit(0)


def _baseline_child(q: Any, go: Any, n: int, pace_ns: int, hard_exit: bool) -> None:
    """Seed pattern: put each event on a multiprocessing.Queue (a feeder thread pickles and writes it)."""
    q.put(Chunk(task_id=READY_ID, text=""))
    if not go.wait(START_TIMEOUT):
        os._exit(3)
    _send_events(q.put, n, pace_ns)
    if hard_exit:  # what a crash right after the last put looks like: the feeder thread never flushes
        os._exit(0)
    # a normal return joins the feeder thread at exit, so everything put is delivered


# --------------------------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One measurement: events received, seconds from go to the last event, per-event latencies (ns)."""

    sent: int
    received: int = 0
    seconds: float = 0.0
    latencies_ns: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.received / self.seconds if self.seconds > 0 else 0.0

    def check_lossless(self, what: str) -> None:
        if self.received != self.sent:
            raise RuntimeError(f"{what}: received {self.received} of {self.sent} events: the channel lost events")


def _percentile_us(samples_ns: list[int], q: float) -> float:
    """Nearest-rank percentile in microseconds."""
    ordered = sorted(samples_ns)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] / 1000.0


def _kill_popen(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


async def tether_once(n: int, pace_ns: int, timeout: float) -> Run:
    """One tether run: spawn the child, wait for its ready event, say go, read until end-of-stream."""
    events_r, events_w = os.pipe()
    go_r, go_w = os.pipe()
    argv = [sys.executable, os.path.abspath(__file__), CHILD_MODE, str(events_w), str(go_r), str(n), str(pace_ns)]
    try:
        proc = subprocess.Popen(argv, pass_fds=(events_w, go_r), stdin=subprocess.DEVNULL)
    finally:
        os.close(events_w)
        os.close(go_r)
    receiver: AsyncReceiver[Chunk] = AsyncReceiver(events_r, Chunk)
    run = Run(sent=n)
    latencies = run.latencies_ns
    received = 0
    try:
        with anyio.fail_after(START_TIMEOUT):
            ready = await receiver.receive_batch()
        if len(ready) != 1 or ready[0].task_id != READY_ID:
            raise RuntimeError(f"tether child: expected one ready event, got {ready!r}")
        with anyio.fail_after(timeout):
            start = time.perf_counter()
            os.write(go_w, b"g")
            last = start
            while True:
                try:
                    batch = await receiver.receive_batch()
                except EndOfStream:
                    break
                if pace_ns:
                    now_ns = time.monotonic_ns()
                    latencies.extend(now_ns - event.sent_ns for event in batch)
                received += len(batch)
                last = time.perf_counter()
        run.received, run.seconds = received, last - start
        returncode = await anyio.to_thread.run_sync(functools.partial(proc.wait, timeout=10))
        if returncode != 0:
            raise RuntimeError(f"tether child exited with code {returncode}")
    finally:
        _kill_popen(proc)
        os.close(go_w)
        receiver.close()
    run.check_lossless("tether")
    return run


async def _baseline_ready(q: Any, proc: Any) -> Chunk:
    """The child's ready event; a child that dies while starting is reported at once, not after a timeout."""
    deadline = time.monotonic() + START_TIMEOUT
    poll = functools.partial(q.get, timeout=0.1)
    while True:
        try:
            return await anyio.to_thread.run_sync(poll)
        except queue.Empty:
            if proc.exitcode is not None:
                raise RuntimeError(f"baseline child exited with code {proc.exitcode} before it was ready") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"baseline child not ready within {START_TIMEOUT:.0f} s") from None


async def baseline_once(n: int, pace_ns: int, timeout: float, hard_exit: bool = False) -> Run:
    """One baseline run: spawn-context child, mp.Queue, one thread hop per event in the parent."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    go = ctx.Event()
    proc = ctx.Process(target=_baseline_child, args=(q, go, n, pace_ns, hard_exit), daemon=True)
    proc.start()
    # Exactly the seed's hop: to_thread.run_sync(queue.get). (A get(timeout=...) would be bounded by itself but
    # costs ~10% more per event: Connection.poll builds a selector each call.) abandon_on_cancel lets fail_after
    # fire while a thread is blocked in get; _unblock_getter then releases that thread.
    get = functools.partial(anyio.to_thread.run_sync, q.get, abandon_on_cancel=True)
    run = Run(sent=n)
    latencies = run.latencies_ns
    received = 0
    finished = False
    try:
        ready = await _baseline_ready(q, proc)
        if ready.task_id != READY_ID:
            raise RuntimeError(f"baseline child: expected the ready event, got {ready!r}")
        with anyio.fail_after(timeout):
            start = time.perf_counter()
            go.set()
            last = start
            if hard_exit:  # count what survives: wait for the exit, then drain with a short bound
                await anyio.to_thread.run_sync(proc.join, timeout)
                drain = functools.partial(q.get, timeout=0.2)
                with contextlib.suppress(queue.Empty):
                    while received < n:
                        await anyio.to_thread.run_sync(drain)
                        received += 1
            else:
                for _ in range(n):
                    event = await get()
                    if pace_ns:
                        latencies.append(time.monotonic_ns() - event.sent_ns)
                    received += 1
                last = time.perf_counter()
        run.received, run.seconds = received, last - start
        await anyio.to_thread.run_sync(proc.join, 10)
        if proc.exitcode != 0:
            raise RuntimeError(f"baseline child exited with code {proc.exitcode}")
        finished = True
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if not finished:
            _unblock_getter(q)
        q.close()
    if not hard_exit:
        run.check_lossless("baseline")
    return run


def _unblock_getter(q: Any) -> None:
    """Release a worker thread left blocked in ``q.get`` (anyio's workers are not daemons: exit would hang).

    Writes one pickled None straight into the queue's pipe. Not via ``q.put``: that goes through the queue's
    cross-process write lock, which a child killed inside ``put`` can leave held forever (seen here: the put
    wedged the interpreter's exit). Non-blocking: a full pipe means no getter can be blocked anyway.
    """
    conn = q._writer  # the parent's write end of the queue's pipe; no public API for this
    os.set_blocking(conn.fileno(), False)  # the child is dead by now, so sharing the flag is harmless
    with contextlib.suppress(OSError):
        conn.send_bytes(pickle.dumps(None))


async def supervisor_once(max_tokens: int, timeout: float) -> Run:
    """One generation through the real Supervisor + debug engine: chunks/s, debug engine cost included."""
    from tether.node.supervisor import Supervisor
    from tether.protocol import EngineSpec, GenerateParams, TaskState

    spec = EngineSpec(engine="debug", options={"load_steps": 1, "load_step_seconds": 0.0, "token_seconds": 0.0})
    run = Run(sent=max_tokens)
    with anyio.fail_after(START_TIMEOUT + timeout):
        async with Supervisor(spec) as sup:
            await sup.ready()
            start = time.perf_counter()
            handle = await sup.generate(GenerateParams(prompt="benchmark the channel", max_tokens=max_tokens))
            chunks = tokens = 0
            async for event in handle:
                if isinstance(event, Chunk):
                    chunks += 1
                    tokens += event.tokens
            run.seconds = time.perf_counter() - start
            run.received = chunks
            final = handle.final
            if final is None or final.state is not TaskState.COMPLETE:
                raise RuntimeError(f"generation did not complete: {final!r}")
    if tokens != max_tokens:
        raise RuntimeError(f"supervisor: {tokens} tokens in {chunks} chunks, expected {max_tokens}")
    return run


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _fmt_rate(value: float | None) -> str:
    return "skipped" if value is None else f"{value:,.0f}/s"


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    repeats = args.repeats
    pace_ns = int(args.pace_us * 1000)
    timeout = args.timeout

    tether_tput = [await tether_once(args.events, 0, timeout) for _ in range(repeats)]
    base_tput = [await baseline_once(args.baseline_events, 0, timeout) for _ in range(repeats)]
    tether_lat = [await tether_once(args.latency_events, pace_ns, timeout) for _ in range(repeats)]
    base_lat = [await baseline_once(args.latency_events, pace_ns, timeout) for _ in range(repeats)]
    crash = await baseline_once(args.crash_events, 0, timeout, hard_exit=True)

    sup_rate: float | None = None
    sup_note = ""
    try:
        sup = [await supervisor_once(args.supervisor_tokens, timeout) for _ in range(repeats)]
        sup_rate = _median([r.rate for r in sup])
    except Exception as exc:  # the debug engine is written concurrently: a broken one is a note, not a failure
        sup_note = f"skipped: {type(exc).__name__}: {exc}"

    result: dict[str, Any] = {
        "bench": "ipc",
        "tether_events_per_s": round(_median([r.rate for r in tether_tput])),
        "baseline_events_per_s": round(_median([r.rate for r in base_tput])),
        "tether_p50_us": round(_median([_percentile_us(r.latencies_ns, 0.50) for r in tether_lat]), 1),
        "tether_p99_us": round(_median([_percentile_us(r.latencies_ns, 0.99) for r in tether_lat]), 1),
        "baseline_p50_us": round(_median([_percentile_us(r.latencies_ns, 0.50) for r in base_lat]), 1),
        "baseline_p99_us": round(_median([_percentile_us(r.latencies_ns, 0.99) for r in base_lat]), 1),
        "tether_supervisor_events_per_s": None if sup_rate is None else round(sup_rate),
        "lossless": True,  # every tether/baseline run above checked received == sent (it raises otherwise)
        "baseline_hard_exit_delivered": crash.received,
        "baseline_hard_exit_sent": crash.sent,
        "pace_us": args.pace_us,
        "n": args.events,
        "baseline_n": args.baseline_events,
        "latency_n": args.latency_events,
        "supervisor_tokens": args.supervisor_tokens,
        "repeats": repeats,
    }
    base = result["baseline_events_per_s"]
    result["ratio"] = round(result["tether_events_per_s"] / base, 1) if base else None

    rows = [
        ("throughput (median events/s)", _fmt_rate(result["tether_events_per_s"]), _fmt_rate(base)),
        ("  events per run", f"{args.events:,}", f"{args.baseline_events:,}"),
        ("  runs (events/s)", _rates(tether_tput), _rates(base_tput)),
        ("latency p50 (µs)", f"{result['tether_p50_us']:.1f}", f"{result['baseline_p50_us']:.1f}"),
        ("latency p99 (µs)", f"{result['tether_p99_us']:.1f}", f"{result['baseline_p99_us']:.1f}"),
        ("  latency events per run", f"{args.latency_events:,} @ {args.pace_us:g} µs", "same"),
        ("lossless (received == sent)", "yes, child os._exit after last write", "yes, child exits normally"),
        (
            "child os._exit after last send",
            "all delivered (above)",
            f"{crash.received:,} of {crash.sent:,} delivered",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    col = max(max(len(r[1]) for r in rows), len("tether channel"))
    print(f"IPC runner -> supervisor, {repeats} repeats, medians")
    print(f"{'':<{width}}  {'tether channel':<{col}}  baseline (mp.Queue + to_thread per event)")
    for label, t, b in rows:
        print(f"{label:<{width}}  {t:<{col}}  {b}")
    print(f"ratio tether/baseline throughput: {result['ratio']}x")
    sup_line = _fmt_rate(sup_rate) if sup_rate is not None else sup_note
    print(
        f"tether end-to-end (Supervisor + debug engine, {args.supervisor_tokens:,} tokens, one chunk per token; "
        f"includes the debug engine's per-token cost and the runner loop): {sup_line}"
    )
    return result


def _rates(runs: list[Run]) -> str:
    return ", ".join(f"{r.rate / 1000:,.1f}k" for r in runs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD_MODE]:
        _tether_child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000, help="tether throughput events per run")
    parser.add_argument("--baseline-events", type=int, default=20_000, help="baseline throughput events per run")
    parser.add_argument("--latency-events", type=int, default=2_000, help="paced events per latency run")
    parser.add_argument("--supervisor-tokens", type=int, default=100_000, help="tokens in the end-to-end run")
    parser.add_argument("--crash-events", type=int, default=2_000, help="baseline events before a hard exit")
    parser.add_argument("--pace-us", type=float, default=1000.0, help="gap between latency events (µs)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0, help="bound on each measurement (s)")
    parser.add_argument("--quick", action="store_true", help="small numbers: runs in a few seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.events, args.baseline_events, args.latency_events = 20_000, 2_000, 200
        args.supervisor_tokens, args.crash_events, args.repeats = 5_000, 500, 1
    result = anyio.run(bench, args)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
