"""Real faults, performed in the calling process, so the supervisor is rehearsed against the genuine article.

Every fault here does the actual thing a broken engine does: a real invalid memory read (SIGSEGV), a real
``abort()``, real resident memory until the kernel's OOM killer fires, a real native deadlock with the GIL
held. Simulations (raising a signal, sleeping "as if" hung) would let a supervisor pass tests it fails in
production.

``trigger`` performs one fault; ``faults_for`` decides which faults of a spec or request fire at a given
point; ``fire`` does both. Several faults never return: ``exit``, ``segv``, ``abort``, ``oom``, ``hang``,
``hang_gil``, ``stall_at_limit``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterable

import msgspec

from tether.kernel.cgroups import MemoryCgroup
from tether.protocol import Fault, FaultPhase

events_fd: int | None = None  # the runner's events pipe, set at bootstrap (for "garbage")
OOM_CHUNK_BYTES = 64 << 20  # allocation step for "oom": big enough to be quick, small enough to overshoot little
STALL_CHUNK_BYTES = 1 << 20  # allocation step for "stall_at_limit"
STALL_MARGIN_BYTES = 2 << 20  # "stall_at_limit" stops this far under the limit (the kernel never OOM-kills it)

# Faults after which the process is gone or never makes progress again.
FATAL_KINDS = frozenset(
    {"raise", "exit", "segv", "abort", "sigkill", "memory_error", "oom", "hang", "hang_gil", "stall_at_limit"}
)


def faults_for(faults: Iterable[Fault], phase: FaultPhase, tokens_done: int = 0) -> list[Fault]:
    """The faults that fire now, in declaration order.

    In the generate phase ``tokens_done`` is the number of tokens already produced: a fault fires when it
    equals ``after_tokens``, except ``slow`` which applies to every token from ``after_tokens`` on. In the
    load and warmup phases ``after_tokens`` is ignored and ``tokens_done`` is the step index: one-shot faults
    fire at step 0 and ``slow`` fires at every step (so a slow load fault slows each load step).
    """
    selected = []
    for fault in faults:
        if fault.phase != phase:
            continue
        at = fault.after_tokens if phase == "generate" else 0
        if (tokens_done >= at) if fault.kind == "slow" else (tokens_done == at):
            selected.append(fault)
    return selected


def fire(faults: Iterable[Fault], phase: FaultPhase, tokens_done: int = 0) -> None:
    """Trigger every fault ``faults_for`` selects."""
    for fault in faults_for(faults, phase, tokens_done):
        trigger(fault)


def trigger(fault: Fault) -> None:
    """Perform ``fault`` for real in this process.

    Returns only for ``slow``, ``stderr_flood``, ``ignore_sigterm`` and ``garbage``; ``raise`` and ``memory_error``
    raise.
    """
    handler = _HANDLERS.get(fault.kind)
    if handler is None:  # msgspec validates kinds on decode; a hand-built Fault could still be wrong
        raise ValueError(f"unknown fault kind {fault.kind!r}: choose one of {', '.join(sorted(_HANDLERS))}")
    handler(fault)


# ----------------------------------------------------------------------------------------------------------
# One function per fault
# ------------------------------------------------------------------------------------------------------------


def _raise(fault: Fault) -> None:
    """An unexpected engine exception: the runner must ship the traceback before it dies."""
    raise RuntimeError(
        f"injected fault 'raise' (phase={fault.phase}, after_tokens={fault.after_tokens}): "
        "the engine raised an unexpected exception"
    )


def _request_error(fault: Fault) -> None:
    """A request the engine cannot serve, found mid-generation: it fails alone, the runner serves on."""
    from tether.engines.base import RequestError  # the engines import this module: import at use

    raise RequestError(
        f"injected fault 'request_error' after {fault.after_tokens} tokens: the engine refused this request"
    )


def _exit(fault: Fault) -> None:
    """A hard exit that skips Python cleanup, as native code calling ``exit()`` does. Code 0 proves that an
    unrequested clean-looking exit is still reported as a death."""
    _flush_std_streams()
    os._exit(fault.code)


def _segv(fault: Fault) -> None:
    """A genuine read of address 0: the kernel delivers SIGSEGV and faulthandler (if enabled) prints the
    stack. ``string_at(0)`` calls ``strlen(NULL)`` in C; ``faulthandler._sigsegv`` would only raise the
    signal.
    """
    _flush_std_streams()
    ctypes.string_at(0)
    raise AssertionError("reading address 0 did not crash")  # unreachable on any sane platform


def _abort(fault: Fault) -> None:
    """``abort()`` is what a failed C assertion (GGML_ASSERT, CUDA errors) ends in: SIGABRT."""
    _flush_std_streams()
    os.abort()


def _sigkill(fault: Fault) -> None:
    """SIGKILL to ourselves right after the last write: nothing sent may be lost, nothing cleans up."""
    _flush_std_streams()
    os.kill(os.getpid(), signal.SIGKILL)


def _memory_error(fault: Fault) -> None:
    """What Python raises when malloc fails: the runner must report it as out-of-memory, not as an error."""
    raise MemoryError(f"injected fault 'memory_error' (phase={fault.phase}): an allocation failed")


def _oom(fault: Fault) -> None:
    """Grow resident memory until the kernel (or the cgroup limit) OOM-kills us with SIGKILL.

    ``b"\\x01" * n`` memsets every byte, so each chunk is really resident rather than lazily mapped zero
    pages (``bytearray(n)`` uses calloc and would not count). If the allocator refuses first (overcommit off,
    RLIMIT_AS), Python raises MemoryError, which is also an out-of-memory death.
    """
    _flush_std_streams()
    hog: list[bytes] = []
    while True:
        hog.append(b"\x01" * OOM_CHUNK_BYTES)


def _stall_at_limit(fault: Fault) -> None:
    """Thrash at the limit that binds this process's memory cgroup, silent: what a runner the kernel keeps reclaiming
    for looks like from outside while the OOM killer is slow to come, as a loaded machine showed on the cluster.

    Its cgroup holds a quarter of the limit in clean file cache (a fresh runner's cgroup holds the cache of every
    module it read), resident memory fills it to just under the limit, then a forked child of the runner's group
    keeps allocating over the limit, so the kernel drops file pages, and reading them back, so it drops more (the
    cgroup's workingset refaults rise), while this process blocks holding the GIL (no heartbeat). Needs a
    limit, and a disk-backed temporary directory (tmpfs pages cannot be dropped)."""
    cgroup = MemoryCgroup.of_pid(os.getpid())
    binding = cgroup.binding_limit() if cgroup is not None else None
    if binding is None:
        raise RuntimeError("injected fault 'stall_at_limit' needs a memory limit on the runner's cgroup")
    limit, where = binding
    bound = MemoryCgroup.at(where)
    with tempfile.TemporaryFile() as cache:  # unlinked: its pages go with the last process holding it
        chunk = b"\x02" * STALL_CHUNK_BYTES
        for _ in range(limit // 4 // STALL_CHUNK_BYTES):
            cache.write(chunk)
        cache.flush()
        os.fsync(cache.fileno())  # clean pages: droppable at once, as a module's cache is
        hog: list[bytes] = []
        while (bound.usage() or limit) < limit - STALL_MARGIN_BYTES:
            hog.append(b"\x01" * STALL_CHUNK_BYTES)  # memset: resident, not lazily mapped zero pages
        if os.fork() == 0:
            try:
                _thrash(cache.fileno(), limit // 4)
            finally:
                os._exit(1)  # never back into the runner's code
        _hang_gil(fault)


def _thrash(fd: int, size: int) -> None:
    """Allocate over the limit (the kernel drops file pages to make room), free it, read the file back: forever."""
    while True:
        room = b"\x01" * (2 * STALL_MARGIN_BYTES)
        del room
        for offset in range(0, size, STALL_CHUNK_BYTES):
            os.pread(fd, STALL_CHUNK_BYTES, offset)


def _hang(fault: Fault) -> None:
    """Loop forever in Python. The GIL is released between iterations, so other threads (the heartbeat) keep
    running: only a progress deadline can catch this hang. Sleeps instead of spinning to spare the CPU."""
    while True:
        time.sleep(0.01)


def _hang_gil(fault: Fault) -> None:
    """Deadlock in native code while holding the GIL, like a stuck CUDA call or collective.

    Functions called through ``ctypes.PyDLL`` keep the GIL, so no other Python thread (the heartbeat included)
    runs again. Locking the same non-recursive pthread mutex twice blocks forever and, unlike ``sleep()``, is
    not woken by signals, so Python-level signal handlers never run either; only SIGKILL (or a signal whose
    default action kills) ends the process. Falls back to ``sleep()`` through PyDLL if the relock returns.
    """
    _flush_std_streams()
    libc = ctypes.PyDLL(None)  # the process's global symbols: libc (and libpthread where separate)
    mutex = ctypes.create_string_buffer(256)  # larger than pthread_mutex_t on every platform
    try:
        libc.pthread_mutex_init(mutex, None)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # blocks forever holding the GIL
    except AttributeError:
        pass
    libc_path = ctypes.util.find_library("c")
    sleeper = ctypes.PyDLL(libc_path) if libc_path else libc
    while True:
        sleeper.sleep(3600)


def _slow(fault: Fault) -> None:
    """A slow step (token, load step): exercises time-to-first-token and inter-token deadlines."""
    time.sleep(fault.seconds)


def _stderr_flood(fault: Fault) -> None:
    """Lots of stderr: the supervisor must drain it (a full pipe would block us) and keep a bounded tail."""
    write = sys.stderr.write
    for start in range(0, fault.lines, 1000):
        write(
            "".join(f"stderr flood line {i + 1}/{fault.lines}\n" for i in range(start, min(start + 1000, fault.lines)))
        )
    sys.stderr.flush()


def _ignore_sigterm(fault: Fault) -> None:
    """Ignore SIGTERM from now on, so a stop must escalate to SIGKILL.

    ``signal.signal`` only works in the main thread; from any other thread the disposition (which is
    process-wide anyway) is set through libc ``signal()`` directly, bypassing Python's check.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal.restype = ctypes.c_void_p
    sig_err = ctypes.c_void_p(-1).value
    if libc.signal(int(signal.SIGTERM), int(signal.SIG_IGN)) == sig_err:
        raise OSError(ctypes.get_errno(), "signal(SIGTERM, SIG_IGN) failed")


def _garbage(fault: Fault) -> None:
    """Bytes on the events pipe that are no frame, as a native library writing to the wrong descriptor leaves: a
    length prefix declaring ``size`` bytes, then a few bytes (which look like the start of a message with ``mimic``).
    The runner carries on, so its later messages arrive behind them and are swallowed into the frame that never
    completes, unless the reader sees through it."""
    if events_fd is None:
        raise RuntimeError("the 'garbage' fault needs the runner's events pipe (it runs only inside a runner)")
    body = msgspec.msgpack.encode({"type": "heartbeat"})[:-1] if fault.mimic else b"\x00\x13\x37 not a frame"
    os.write(events_fd, struct.pack("<I", fault.size) + body)


def _flush_std_streams() -> None:
    """Flush Python's stdio buffers before a death that skips cleanup, so nothing written so far is lost."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


_HANDLERS = {
    "raise": _raise,
    "request_error": _request_error,
    "exit": _exit,
    "sigkill": _sigkill,
    "segv": _segv,
    "abort": _abort,
    "memory_error": _memory_error,
    "oom": _oom,
    "hang": _hang,
    "hang_gil": _hang_gil,
    "stall_at_limit": _stall_at_limit,
    "slow": _slow,
    "stderr_flood": _stderr_flood,
    "ignore_sigterm": _ignore_sigterm,
    "garbage": _garbage,
}
