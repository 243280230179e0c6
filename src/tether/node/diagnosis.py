"""Exit status + evidence -> one cause.

The supervisor collects the evidence (the wait status from reaping, a ``RunnerException`` the runner sent before
dying, the tail of the runner's stderr, what phase it was in) and this module turns it into a single ``Cause``
with a one-line summary a person can act on, plus the evidence lines that back it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tether.node.oom import LimitStall, OomEvidence
from tether.node.spawn import ExitStatus
from tether.protocol import Cause, CauseKind, RunnerException
from tether.units import format_bytes

CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL"})
EVIDENCE_LINES = 40

GPU_OOM = "CUDA out of memory"

# Engine messages on stderr that explain a death better than its exit status does.
ENGINE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (label, re.compile(rx, re.IGNORECASE))
    for label, rx in (
        (GPU_OOM, r"CUDA out of memory|cudaMalloc failed|CUBLAS_STATUS_ALLOC_FAILED|CUDA error: out of memory"),
        ("GPU illegal memory access", r"illegal memory access|illegal address"),
        ("GPU ECC error", r"uncorrectable ECC error|\bECC error"),
        ("GPU Xid error", r"\bXid\b"),  # the driver's error report, where it reaches the process's output
        ("CUDA error", r"CUDA error"),
        ("GGML assertion", r"GGML_ASSERT"),
        ("llama.cpp error", r"llama_model_load: error|failed to load model"),
        ("NCCL error", r"NCCL error|ncclInternalError|ncclSystemError"),
        ("Metal error", r"ggml_metal.*(error|failed)|MTLCommandBuffer.*error"),
    )
)

# What an engine prints when it dies because another rank of its instance did (its connection to that rank broke):
# the death is then a consequence (``peer_lost``), and the other rank's failure the cause.
PEER_LOST_PATTERNS = tuple(
    re.compile(rx)
    for rx in (
        r"Remote RPC server crashed or returned malformed response",  # ggml-rpc: a peer died, froze or timed out
        r"ggml-rpc.*Failed to connect to",  # ggml-rpc: a peer that is not there
        r"RPC handshake failed",
    )
)


@dataclass(frozen=True)
class Evidence:
    exit: ExitStatus
    exception: RunnerException | None = None
    output_tail: Sequence[str] = ()
    phase: str | None = None
    runner: str = "runner"
    oom: OomEvidence | None = None  # gathered after a SIGKILL: the cgroup counter, kernel log lines, footprint


def engine_diagnostics(lines: Sequence[str]) -> list[tuple[str, str]]:
    """Known engine error lines as (label, line) pairs, in order."""
    found: list[tuple[str, str]] = []
    for line in lines:
        for label, rx in ENGINE_PATTERNS:
            if rx.search(line):
                found.append((label, line))
                break
    return found


def _most_specific(diags: list[tuple[str, str]]) -> str:
    """The label of the most specific engine line found (the first in ``ENGINE_PATTERNS``: "GPU illegal memory
    access" over the "CUDA error" llama.cpp's abort prints after it)."""
    order = {label: i for i, (label, _) in enumerate(ENGINE_PATTERNS)}
    return min(diags, key=lambda found: order[found[0]])[0]


def _faulthandler_stack(lines: Sequence[str]) -> list[str]:
    """What faulthandler printed for the fatal error: its header, then the crashing thread's stack first (it
    is printed last, after every other thread's), then the other threads, up to ``EVIDENCE_LINES`` lines."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Fatal Python error"):
            dump = list(lines[i:])
            for j, line in enumerate(dump):
                if line.startswith("Current thread"):
                    dump = dump[:1] + dump[j:] + dump[1:j]
                    break
            return dump[:EVIDENCE_LINES]
    return []


def diagnose(ev: Evidence) -> Cause:
    where = f" while {ev.phase}" if ev.phase else ""
    status = ev.exit
    tail = list(ev.output_tail)[-EVIDENCE_LINES:]
    diags = engine_diagnostics(ev.output_tail)
    diag_lines = [f"{label}: {line}" for label, line in diags[-5:]]

    gpu_oom = [line for label, line in diags if label == GPU_OOM]
    if gpu_oom and not (ev.exception is not None and ev.exception.memory_error):
        return _gpu_oom_cause(ev, where, gpu_oom, diag_lines, tail)
    if ev.exception is not None:
        exc = ev.exception
        if exc.load_error:
            return Cause(
                kind=CauseKind.LOAD_ERROR,
                summary=f"{ev.runner} could not load its model: {exc.message}",
                exit_code=status.code,
                phase=ev.phase,
            )
        kind = CauseKind.OUT_OF_MEMORY if exc.memory_error else CauseKind.EXCEPTION
        if exc.exc_type == "PeerLost":  # ``engines.base.PeerLost``: another rank's failure broke this one's ring
            kind = CauseKind.PEER_LOST
        what = "ran out of memory (MemoryError)" if exc.memory_error else f"raised {exc.exc_type}"
        return Cause(
            kind=kind,
            summary=f"{ev.runner} {what}{where}: {exc.message}",
            evidence=tuple(diag_lines + exc.traceback.rstrip("\n").splitlines()),
            exit_code=status.code,
            signal=status.signal_name,
            phase=ev.phase,
        )
    if status.signal is not None:
        name = status.signal_name or ""
        if ev.oom is not None and (ev.oom.killed_by_oom or ev.oom.counter_rose):
            return _oom_cause(ev, ev.oom, where, name, tail)
        lost = next((line for line in tail if any(rx.search(line) for rx in PEER_LOST_PATTERNS)), None)
        if lost is not None:
            return Cause(
                kind=CauseKind.PEER_LOST,
                summary=f"{ev.runner} lost its connection to another rank{where} and was {status.describe()}",
                evidence=(f"its engine said: {lost.strip()}", *tail[-10:]),
                signal=name,
                phase=ev.phase,
            )
        stack = _faulthandler_stack(ev.output_tail) if name in CRASH_SIGNALS else []
        if stack:
            return Cause(
                kind=CauseKind.NATIVE_CRASH,
                summary=f"{ev.runner} crashed in native code{where}: {status.describe()}",
                evidence=tuple(diag_lines + stack),
                signal=name,
                phase=ev.phase,
            )
        if diags:
            return Cause(
                kind=CauseKind.ENGINE_ERROR,
                summary=f"{ev.runner} was {status.describe()}{where} after {_most_specific(diags)}",
                evidence=tuple(diag_lines + tail[-10:]),
                signal=name,
                phase=ev.phase,
            )
        return Cause(
            kind=CauseKind.SIGNAL,
            summary=f"{ev.runner} was {status.describe()}{where}",
            evidence=tuple(tail[-10:]),
            signal=name,
            phase=ev.phase,
        )
    if status.code == 0:
        return Cause(
            kind=CauseKind.UNEXPECTED_EXIT,
            summary=f"{ev.runner} exited with code 0{where} without being asked to stop",
            evidence=tuple(diag_lines + tail[-10:]),
            exit_code=0,
            phase=ev.phase,
        )
    if diags:
        return Cause(
            kind=CauseKind.ENGINE_ERROR,
            summary=f"{ev.runner} exited with code {status.code}{where} after {_most_specific(diags)}",
            evidence=tuple(diag_lines + tail[-10:]),
            exit_code=status.code,
            phase=ev.phase,
        )
    return Cause(
        kind=CauseKind.EXIT_CODE,
        summary=f"{ev.runner} exited with code {status.code}{where}",
        evidence=tuple(tail[-10:]),
        exit_code=status.code,
        phase=ev.phase,
    )


def _gpu_oom_cause(ev: Evidence, where: str, lines: list[str], diag_lines: list[str], tail: list[str]) -> Cause:
    """A GPU allocation that failed (llama.cpp's CUDA backend says so, then fails the load or aborts): out of
    memory, of the GPU's, with the engine's lines as evidence and what to do."""
    status = ev.exit
    how = f"was {status.describe()}" if status.signal is not None else f"exited with code {status.code}"
    if ev.exception is not None:
        how = f"failed: {ev.exception.message}"
    return Cause(
        kind=CauseKind.OUT_OF_MEMORY,
        summary=f"{ev.runner} ran out of GPU memory{where} (CUDA out of memory: {lines[-1].strip()}) and {how}",
        evidence=(
            *diag_lines,
            "what to do: fewer layers on the GPU (--n-gpu-layers; auto sizes them to the free VRAM), a smaller "
            "--n-ctx or --parallel, or free the GPU's memory (nvidia-smi lists who holds it)",
            *tail[-10:],
        ),
        exit_code=status.code,
        signal=status.signal_name,
        phase=ev.phase,
    )


def stall_cause(
    runner: str, phase: str, seconds: float, detail: str, stall: LimitStall, evidence: Sequence[str] = ()
) -> Cause:
    """A runner that went silent with its own memory cgroup full: out of memory, not a deadlock. Each allocation it
    made waited on the kernel's reclaim, which holds the GIL with it, so the heartbeat stopped before (or instead of)
    an OOM kill; the supervisor then killed it."""
    silence = detail.partition(":")[0]  # "no heartbeat", without the deadlock it would otherwise suggest
    thrash = f", {stall.refaults:,} pages dropped and read back while it was silent" if stall.refaults else ""
    return Cause(
        kind=CauseKind.OUT_OF_MEMORY,
        summary=(
            f"{runner} stalled at its memory limit in {phase} for {seconds:.1f} s: it holds "
            f"{format_bytes(stall.usage)} of the {format_bytes(stall.limit)} limit{thrash}, {silence}; the kernel "
            "was reclaiming memory for it before an out-of-memory kill, and tether killed it"
        ),
        evidence=(
            *evidence,
            f"memory cgroup {stall.cgroup}: {format_bytes(stall.usage)} charged, {format_bytes(stall.held)} of it "
            f"beyond droppable file cache, limit {format_bytes(stall.limit)}; {stall.refaults:,} pages dropped and "
            "read back (workingset refaults) since the last heartbeat",
            f"what to do: raise the memory limit (now {format_bytes(stall.limit)}), or ask it to hold less "
            "(a shorter context, fewer parallel sequences, a smaller model)",
        ),
        phase=phase,
    )


def _oom_cause(ev: Evidence, oom: OomEvidence, where: str, signal_name: str, tail: list[str]) -> Cause:
    """A SIGKILL the OOM killer sent, with the numbers: last footprint, cgroup peak and limit."""
    numbers = []
    if oom.anon_at_kill is not None:
        numbers.append(f"footprint {format_bytes(oom.anon_at_kill)} when killed")
    elif oom.last_anon is not None:
        numbers.append(
            f"footprint {format_bytes(oom.last_anon)} at the last heartbeat (RSS {format_bytes(oom.last_rss)})"
        )
    if oom.peak is not None:
        numbers.append(f"cgroup peak {format_bytes(oom.peak)}")
    if oom.limit is None:
        numbers.append("no cgroup limit")
    elif oom.limit_set_on is not None:
        numbers.append(f"cgroup limit {format_bytes(oom.limit)} set on the enclosing cgroup {oom.limit_set_on}")
    else:
        numbers.append(f"cgroup limit {format_bytes(oom.limit)}")
    who = (
        "was killed by the out-of-memory killer"
        if oom.killed_by_oom
        else "was killed by SIGKILL, most likely by the out-of-memory killer (it acted in the runner's memory cgroup,"
        " which other processes share, meanwhile)"
    )
    return Cause(
        kind=CauseKind.OUT_OF_MEMORY,
        summary=f"{ev.runner} {who}{where}: {', '.join(numbers)}",
        evidence=tuple(oom.lines() + tail[-5:]),
        signal=signal_name,
        phase=ev.phase,
    )
