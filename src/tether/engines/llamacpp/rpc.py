"""ggml's RPC backend through ctypes: how the ranks of a multi-rank llama.cpp instance share one model's layers.

Runs inside runner processes. A rank above 0 serves its CPU as an RPC device (``Server``); rank 0 registers every
peer's device (``add_servers``) before it loads the model, and llama.cpp then places the last layers on them
(``estimate.layer_plan`` says which). llama-cpp-python accepts ``rpc_servers`` and ignores it, so this goes through
ggml's C API. What ggml leaves out, this module adds, each for a promise: the same ggml as llama.cpp's (``ggml``), a
held port an error naming its holder (``check_port_free``), no listening socket outliving its rank
(``mark_sockets_cloexec``), a silent peer an error rather than an endless wait (``bound_peer_sockets``). The RPC port
has no authentication: every rank listens on its own address only (127.0.0.1 on one machine, the node's IP on a
cluster), never on all interfaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

from tether.kernel.pids import cmdline, holds_listener, port_holders

GGML_BACKEND_DEVICE_TYPE_CPU = 0
LISTEN_WAIT = 10.0  # seconds a server may take from its start to listening
CLOEXEC_SWEEP = 0.5  # seconds between two sweeps marking new sockets close-on-exec
KEEPALIVE = (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3))
PEER_LOST_LINE = "Remote RPC server crashed or returned malformed response"  # ggml-rpc's abort when a peer fails

_lib: Any = None


def ggml() -> Any:
    """The ggml that llama.cpp uses, with the prototypes this module calls. ``libggml.so.0`` is opened by its
    versioned name, the file ``libllama.so`` links: the wheel ships ``libggml.so`` as a copy, not a link, and opening
    it would load a second ggml whose registrations llama.cpp never sees (its log then claims "offloaded" while every
    layer stays local)."""
    global _lib
    if _lib is not None:
        return _lib
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml.so.0"))
    p = ctypes.c_void_p
    for name, restype, argtypes in (
        ("ggml_backend_reg_by_name", p, [ctypes.c_char_p]),
        ("ggml_backend_reg_get_proc_address", p, [p, ctypes.c_char_p]),
        ("ggml_backend_register", None, [p]),
        ("ggml_backend_dev_by_type", p, [ctypes.c_int]),
        ("ggml_backend_reg_dev_count", ctypes.c_size_t, [p]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    _lib = lib
    return lib


def _rpc_function(name: str, restype: Any, argtypes: list[Any]) -> Any:
    lib = ggml()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise RuntimeError(
            "this llama-cpp-python was built without ggml's RPC backend (GGML_RPC), which multi-rank llama.cpp "
            "instances need: run `make install`, which rebuilds it with -DGGML_RPC=ON"
        )
    address = lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    if not address:
        raise RuntimeError(f"ggml's RPC backend has no {name}: this llama.cpp version is not the one tether expects")
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


def supported() -> bool:
    """Whether the installed llama.cpp has the RPC backend."""
    try:
        return bool(ggml().ggml_backend_reg_by_name(b"RPC"))
    except (ImportError, OSError):
        return False


# --- ranks above 0 ---------------------------------------------------------------------------------------------


class Server:
    """This rank's CPU as an RPC device on ``host:port``: ``start`` (returns once it listens), ``wait`` (until the
    server ends, which it does only by failing). There is no stop: the server ends with its process."""

    def __init__(self, host: str, port: int, n_threads: int, who: str) -> None:
        self.host, self.port, self.n_threads, self.who = host, port, n_threads, who
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        check_port_free(self.host, self.port, self.who)
        start_server = _rpc_function(
            "ggml_backend_rpc_start_server",
            None,
            [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)],
        )
        device = ggml().ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
        if not device:
            raise RuntimeError(f"{self.who}: ggml has no CPU device to serve")
        devices = (ctypes.c_void_p * 1)(device)
        endpoint = self.endpoint.encode()

        def serve() -> None:
            try:  # ctypes releases the GIL for the call: heartbeats and the task loop go on
                start_server(endpoint, None, self.n_threads, 1, devices)
            finally:
                self._ended.set()

        self._thread = threading.Thread(target=serve, name="tether-rpc-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + LISTEN_WAIT
        while not _listening(self.port):
            if self._ended.wait(0.01):
                raise RuntimeError(self._failure())
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.who}: the RPC server did not listen on {self.endpoint} in {LISTEN_WAIT} s")
        mark_sockets_cloexec()
        threading.Thread(target=self._sweep, name="tether-rpc-cloexec", daemon=True).start()

    def wait(self) -> None:
        """Block while the server serves; raise when it ends (ggml's server returns only when it fails)."""
        self._ended.wait()
        raise RuntimeError(self._failure())

    def _sweep(self) -> None:
        while not self._ended.wait(CLOEXEC_SWEEP):
            mark_sockets_cloexec()

    def _failure(self) -> str:
        holders = _holders(self.port)
        if holders:
            return f"{self.who} cannot serve on {self.endpoint}: {holders} holds the port (Address already in use)"
        return (
            f"{self.who}: ggml's RPC server on {self.endpoint} stopped serving (its stdout/stderr tail says why: "
            "'Failed to create server socket' when the address is not this machine's or the port is taken)"
        )


def check_port_free(host: str, port: int, who: str) -> None:
    """``RuntimeError`` naming the holder when ``host:port`` cannot be bound (Address already in use), checked before
    the server starts: ggml only prints "Failed to create server socket" and returns. A restart may succeed once the
    holder is gone."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ggml binds: TIME_WAIT is no holder
        try:
            probe.bind((host, port))
        except OSError as exc:
            holders = _holders(port)
            held = f": {holders} holds it" if holders else ""
            raise RuntimeError(
                f"{who} cannot listen on {host}:{port}: {exc.strerror or exc}{held}; an earlier life of this rank "
                f"still alive? `ss -ltnp 'sport = :{port}'` shows it"
            ) from exc


def _holders(port: int) -> str:
    pids = [pid for pid in port_holders(port) if pid != os.getpid()]
    return ", ".join(f"pid {pid} ({_command(pid)})" for pid in pids[:3])


def _command(pid: int) -> str:
    args = cmdline(pid)
    text = " ".join(args) if args is not None else "gone"
    return text if len(text) <= 120 else text[:117] + "..."


def _listening(port: int) -> bool:
    return holds_listener(os.getpid(), port)


def mark_sockets_cloexec() -> None:
    """Set ``FD_CLOEXEC`` on every socket this process holds. ggml creates its sockets without ``SOCK_CLOEXEC``, so a
    program the rank execs would inherit the listener and keep the port after the rank is killed (a crash loop for
    its replacement). ``Server`` calls this once it listens, and every ``CLOEXEC_SWEEP`` s for the connections it
    accepts; a child that forks without exec'ing is the cgroup kill's (``tether.kernel.cgroups``)."""
    import fcntl

    for fd in _socket_fds():
        with contextlib.suppress(OSError):
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
            if not flags & fcntl.FD_CLOEXEC:
                fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)


def _socket_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:["):
                fds.append(int(name))
    return fds


# --- rank 0 ----------------------------------------------------------------------------------------------------


def wait_listening(endpoints: list[str], timeout: float, who: str) -> None:
    """Wait until every peer accepts connections (they start their servers while rank 0 starts), so that ggml's
    connect, which aborts the process at once when refused, finds them; ``RuntimeError`` naming those that do not."""
    deadline = time.monotonic() + timeout
    waiting = list(endpoints)
    last = ""
    while waiting:
        endpoint = waiting[0]
        host, _, port = endpoint.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                pass  # ggml's server takes this as a client that left at once, and accepts the next
            waiting.pop(0)
            continue
        except OSError as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{who}: its peer's RPC server at {endpoint} did not accept a connection within {timeout:g} s "
                f"(last error: {last}): is that rank running? It listens from its load on"
            )
        time.sleep(0.02)


def add_servers(endpoints: list[str]) -> None:
    """Register every peer's RPC device, in rank order, before the model loads (llama.cpp puts RPC devices first)."""
    add_server = _rpc_function("ggml_backend_rpc_add_server", ctypes.c_void_p, [ctypes.c_char_p])
    lib = ggml()
    for endpoint in endpoints:
        reg = add_server(endpoint.encode())
        if not reg:
            raise RuntimeError(f"ggml's RPC backend refused the server {endpoint}")
        lib.ggml_backend_register(reg)


def bound_peer_sockets(endpoints: list[str], timeout: float) -> int:
    """Bound every connection of this process to a peer in ``endpoints``: a peer silent for ``timeout`` s aborts this
    rank. Returns how many connections were bounded. ggml's client sockets have no timeout, so a frozen peer would
    hang rank 0 forever: after load this sets ``SO_RCVTIMEO``/``SO_SNDTIMEO``, ``TCP_USER_TIMEOUT`` and keepalive on
    them; ggml then aborts with ``PEER_LOST_LINE``, which tether reads as a consequence (``peer_lost``) of the peer's
    failure."""
    peers = set()
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        with contextlib.suppress(OSError):
            peers.add((socket.gethostbyname(host), int(port)))
    whole = int(timeout)
    timeval = struct.pack("ll", whole, int((timeout - whole) * 1e6))
    bounded = 0
    for fd in _socket_fds():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            try:
                if sock.family != socket.AF_INET or sock.getpeername() not in peers:
                    continue
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for name, value in KEEPALIVE:
                    option = getattr(socket, name, None)
                    if option is not None:
                        sock.setsockopt(socket.IPPROTO_TCP, option, value)
                user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
                if user_timeout is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, user_timeout, int(timeout * 1000))
                bounded += 1
            except OSError:
                continue
    mark_sockets_cloexec()
    return bounded
