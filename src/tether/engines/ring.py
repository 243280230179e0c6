"""A small TCP ring between the ranks of a multi-rank instance, as engines like exo's MLX ring build one.

Each rank listens on its own ``host:port`` (from load on, until close), connects to its successor
``(rank + 1) % world_size`` and accepts its predecessor, so a frame sent by rank 0 visits every rank and comes back.
Frames are length-prefixed msgpack. Every failure of a peer surfaces as ``PeerLost`` naming both ranks and the
peer's address, so tether can tell a consequence (this rank's ring broke) from its cause (the other rank died).

The listener stays open until ``close``: a rank that outlives its life (an orphan) keeps holding its port, and its
replacement fails to bind with EADDRINUSE, the seed's crash loop, which must stay reproducible. ``SO_REUSEADDR``
makes sure only a live listener blocks a restart, never a connection in TIME_WAIT. Sockets are not inherited by
child processes (Python's default), so helpers an engine execs never hold the port either.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
import threading
import time
from typing import Any, TypeVar, overload

import msgspec

from tether.engines.base import PeerLost
from tether.kernel.pids import cmdline, port_holders
from tether.protocol import RankInfo

T = TypeVar("T")

HEADER = struct.Struct("!I")  # a frame's body length
HELLO = struct.Struct("!4sII")  # magic, rank, world size: the handshake each side sends
MAGIC = b"TRNG"
MAX_FRAME = 64 << 20  # a longer length prefix is nonsense, not a frame
BACKLOG = 4
RETRY_SECONDS = 0.05  # between two attempts to reach a successor that does not listen yet
KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))  # a silent peer is lost in ~25 s


class Ring:
    """This rank's place in the ring: ``listen`` (in load), ``connect`` (in warmup), ``send``/``recv``, ``close``.

    One thread sends and receives; ``close`` may come from another one and makes a blocked ``recv`` fail at once.
    """

    def __init__(self, info: RankInfo, timeout: float) -> None:
        self.info = info
        self.timeout = timeout
        self.rank = info.rank
        self.world_size = info.world_size
        self.successor = (self.rank + 1) % self.world_size
        self.predecessor = (self.rank - 1) % self.world_size
        self._listener: socket.socket | None = None
        self._out: socket.socket | None = None  # to the successor
        self._in: socket.socket | None = None  # from the predecessor
        self._lock = threading.Lock()
        self._closed = threading.Event()

    # --- naming ---------------------------------------------------------------------------------------------

    @property
    def me(self) -> str:
        return f"rank {self.rank} of {self.world_size}"

    def peer(self, rank: int) -> str:
        """``rank 1 (127.0.0.1:47101)``"""
        return f"rank {rank} ({self.info.peers[rank]})"

    @property
    def connected(self) -> bool:
        return self._out is not None and self._in is not None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._closed.wait(timeout)

    # --- forming the ring -----------------------------------------------------------------------------------

    def listen(self) -> None:
        """Bind and listen on this rank's address; a failure is a ``RuntimeError`` (a restart may succeed once
        whatever holds the port is gone, so it must not be a load error, which tether never retries)."""
        host, port = self.info.address()
        where = self.info.peers[self.rank]
        try:
            family, kind, proto, _, address = _resolve(host, port, passive=True)
        except OSError as exc:
            raise RuntimeError(
                f"{self.me} cannot listen on {where}: the host does not resolve ({exc}): check the instance's peers"
            ) from exc
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"{self.me} cannot listen on {where}: {exc}: {_bind_advice(exc, port)}") from exc
        with self._lock:
            if self.closed:
                sock.close()
                raise RuntimeError(f"{self.me}: the ring was closed before it listened")
            self._listener = sock

    def connect(self) -> None:
        """Connect to the successor (retrying: peers start at different times) and accept the predecessor, each
        side sending its rank; all within ``timeout`` s, else ``RuntimeError`` saying who did not come."""
        if self._listener is None:
            raise RuntimeError(f"{self.me}: connect() before listen()")
        deadline = time.monotonic() + self.timeout
        out = self._dial(deadline)
        self._out = out
        _send_all(out, HELLO.pack(MAGIC, self.rank, self.world_size), deadline)
        incoming = self._accept(deadline)
        self._in = incoming
        self._check_hello(incoming, self.predecessor, deadline, "connected to this rank's port")
        _send_all(incoming, HELLO.pack(MAGIC, self.rank, self.world_size), deadline)
        self._check_hello(out, self.successor, deadline, "answered at its address")
        for sock in (out, incoming):
            sock.settimeout(self.timeout)
        if self.closed:  # closed from another thread while forming: leave nothing open
            self.close()

    def _dial(self, deadline: float) -> socket.socket:
        host, port = self.info.address(self.successor)
        last: str = "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.closed:
                break
            try:
                family, kind, proto, _, address = _resolve(host, port, passive=False)
                sock = socket.socket(family, kind, proto)
            except OSError as exc:
                last = str(exc)
                time.sleep(min(RETRY_SECONDS, max(remaining, 0)))
                continue
            try:
                sock.settimeout(min(remaining, 1.0))
                sock.connect(address)
                if sock.getsockname() == sock.getpeername():  # TCP self-connect to a port nobody listens on yet
                    raise ConnectionRefusedError(errno.ECONNREFUSED, "connected to itself (nobody listens yet)")
            except OSError as exc:
                sock.close()
                last = str(exc) or type(exc).__name__
                time.sleep(min(RETRY_SECONDS, max(deadline - time.monotonic(), 0)))
                continue
            _tune(sock)
            return sock
        raise RuntimeError(
            f"{self.me} could not reach its successor {self.peer(self.successor)} within {self.timeout:g} s "
            f"(last error: {last}): is rank {self.successor} running? It listens from its load on; raise "
            "ring_timeout if the ranks start far apart"
        )

    def _accept(self, deadline: float) -> socket.socket:
        listener = self._listener
        assert listener is not None
        listener.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            raise RuntimeError(
                f"{self.me}: its predecessor {self.peer(self.predecessor)} did not connect to "
                f"{self.info.peers[self.rank]} within {self.timeout:g} s: is rank {self.predecessor} running and "
                "warming up? Raise ring_timeout if the ranks start far apart"
            ) from None
        except OSError as exc:
            if self.closed:
                raise PeerLost(f"{self.me}: the ring was closed while it formed") from exc
            raise
        _tune(sock)
        return sock

    def _check_hello(self, sock: socket.socket, expected: int, deadline: float, what: str) -> None:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            data = self._read(sock, HELLO.size, expected, "during the handshake")
        except TimeoutError:
            raise RuntimeError(
                f"{self.me}: {self.peer(expected)} did not complete the handshake within {self.timeout:g} s"
            ) from None
        magic, rank, world_size = HELLO.unpack(data)
        if magic != MAGIC or rank != expected or world_size != self.world_size:
            who = f"rank {rank} of {world_size}" if magic == MAGIC else "something that is no tether rank"
            raise RuntimeError(
                f"{self.me} expected rank {expected} of {self.world_size} ({self.info.peers[expected]}) but {who} "
                f"{what}: do all ranks have the same peers ({', '.join(self.info.peers)})?"
            )

    # --- frames ---------------------------------------------------------------------------------------------

    def send(self, obj: Any, detail: str = "", timeout: float | None = None) -> None:
        """Send one frame to the successor; a broken connection is ``PeerLost`` (``detail``: "during step 12").
        ``timeout``: seconds the send may block (default: the ring's ``timeout``)."""
        body = msgspec.msgpack.encode(obj)
        sock = self._out
        peer = self.successor
        if sock is None:
            raise self._lost(peer, "is no longer connected (the ring is closed)", detail)
        bound = self.timeout if timeout is None else timeout
        try:
            sock.settimeout(bound)
            sock.sendall(HEADER.pack(len(body)) + body)
        except TimeoutError:
            raise self._lost(peer, f"took nothing for {bound:g} s (stuck?)", detail) from None
        except OSError as exc:
            raise self._lost(peer, _broken(exc), detail) from exc

    @overload
    def recv(self, kind: None = None, detail: str = "", *, forever: bool = False) -> Any: ...

    @overload
    def recv(self, kind: type[T], detail: str = "", *, forever: bool = False) -> T: ...

    def recv(self, kind: type[T] | None = None, detail: str = "", *, forever: bool = False) -> T | Any:
        """The next frame from the predecessor, decoded as ``kind`` (None: plain msgpack), waiting up to the ring's
        ``timeout`` (``forever``: with no bound, as a follower waits for the next step). EOF, a reset, a short or
        undecodable frame, or the wait running out is ``PeerLost``."""
        sock = self._in
        peer = self.predecessor
        if sock is None:
            raise self._lost(peer, "is no longer connected (the ring is closed)", detail)
        try:
            sock.settimeout(None if forever else self.timeout)
            (length,) = HEADER.unpack(self._read(sock, HEADER.size, peer, detail))
            if length > MAX_FRAME:
                raise self._lost(peer, f"sent a length of {length} bytes (at most {MAX_FRAME}): no ring frame", detail)
            body = self._read(sock, length, peer, detail)
        except TimeoutError:
            raise self._lost(peer, f"sent nothing for {self.timeout:g} s (stuck?)", detail) from None
        except OSError as exc:  # settimeout on a socket closed under us
            raise self._lost(peer, _broken(exc), detail) from exc
        try:
            return msgspec.msgpack.decode(body) if kind is None else msgspec.msgpack.decode(body, type=kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise self._lost(peer, f"sent a frame that is not a ring frame ({exc})", detail) from exc

    def _read(self, sock: socket.socket, n: int, peer: int, detail: str) -> bytes:
        """Exactly ``n`` bytes; ``TimeoutError`` passes through (each caller words it), the rest is ``PeerLost``."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = sock.recv_into(view[got:])
            except TimeoutError:
                raise
            except OSError as exc:
                raise self._lost(peer, _broken(exc), detail) from exc
            if k == 0:
                what = "closed its connection" if got == 0 else f"closed its connection mid-frame ({got} of {n} bytes)"
                raise self._lost(peer, what, detail)
            got += k
        return bytes(buf)

    def _lost(self, peer: int, what: str, detail: str) -> PeerLost:
        where = f" {detail}" if detail else ""
        closed = " (this rank's ring was closed)" if self.closed else ""
        return PeerLost(f"{self.me}: the ring broke: {self.peer(peer)} {what}{where}{closed}")

    # --- the end --------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut down and close every socket (idempotent, from any thread): a ``recv`` blocked in another thread
        returns at once, since shutdown wakes it where a bare close would not."""
        with self._lock:
            self._closed.set()
            socks = [s for s in (self._out, self._in, self._listener) if s is not None]
            self._out = self._in = self._listener = None
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for sock in socks:
            sock.close()


def _resolve(host: str, port: int, *, passive: bool) -> tuple[Any, ...]:
    infos = socket.getaddrinfo(
        host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE if passive else 0
    )
    return infos[0]


def _tune(sock: socket.socket) -> None:
    """No Nagle (a step is one small frame each way: delayed ACKs would add 40 ms per step), and keepalive so a
    peer whose machine vanished is noticed by a rank blocked in ``recv``."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in KEEPALIVE:
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    sock.sendall(data)


def _broken(exc: OSError) -> str:
    if isinstance(exc, ConnectionResetError):
        return f"reset its connection ({exc})"
    if isinstance(exc, BrokenPipeError):
        return f"closed its connection ({exc})"
    return f"broke its connection ({exc})"


def _bind_advice(exc: OSError, port: int) -> str:
    if exc.errno == errno.EADDRINUSE:
        holders = port_holders(port)
        who = ", ".join(f"pid {pid} ({_command(pid)})" for pid in holders[:3]) or "another process"
        return (
            f"{who} holds the port (an earlier life of this rank that is still alive?); "
            f"`ss -ltnp 'sport = :{port}'` shows it too"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return "the address is not one of this machine's: check the instance's peers"
    if exc.errno == errno.EACCES:
        return f"port {port} needs privileges to bind: choose a port above 1023"
    return "check the instance's peers and this machine's network"


def _command(pid: int) -> str:
    """A process's command line, shortened, for an error message."""
    args = cmdline(pid)
    text = " ".join(args) if args is not None else "gone"
    return text if len(text) <= 120 else text[:117] + "..."
