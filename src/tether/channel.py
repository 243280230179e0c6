"""Framed, lossless IPC over inherited pipes.

A frame is a 4-byte little-endian payload length followed by a msgpack payload (a tagged msgspec struct).

Why this is lossless: the writer side calls ``os.write`` for every frame with no user-space buffer or feeder
thread in between, so once ``send`` returns the frame sits in the kernel's pipe buffer. The kernel keeps that
buffer readable after the writer exits or is SIGKILLed; the reader drains it before it reports end-of-stream.
(A ``multiprocessing.Queue`` hands frames to a feeder thread first, and whatever that thread has not flushed
when the process dies is gone.)

Why there is no thread hop: the async reader waits for readability in the event loop itself and decodes every
complete frame of a read in one go, so many events cost one wakeup.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import anyio
import msgspec

from tether.errors import TetherError

T = TypeVar("T")

_HEADER = struct.Struct("<I")
HEADER_SIZE = _HEADER.size
_pack_header = _HEADER.pack
MAX_FRAME = 64 * 1024 * 1024  # a larger length prefix is corruption, not a message
READ_SIZE = 256 * 1024
PARTIAL_FRAME_STALL = 2.0  # seconds an incomplete frame may wait while more bytes arrive (see ``AsyncReceiver``)
GROWTH_SUSPECT = 0.2  # seconds: a whole frame is written in microseconds; one still growing after this is suspect


class ProtocolError(TetherError):
    """The byte stream is not a valid sequence of frames: a bug or corruption, never something to wait out.

    ``evidence`` holds what was seen (the offending bytes, in hex).
    """

    def __init__(self, message: str, evidence: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.evidence = evidence


def _hex(data: bytes | bytearray, limit: int = 32) -> str:
    shown = bytes(data[:limit])
    return shown.hex(" ") + (f" ... ({len(data)} bytes)" if len(data) > limit else "")


# Every message is a msgspec tagged struct, which msgpack encodes as a map whose first key is the tag field: a frame
# that does not begin so is garbage, and is refused at once rather than waited for (its length may be plausible).
_TAG_KEY = msgspec.msgpack.encode("type")
_MAP_KEY_AT = {**{marker: 1 for marker in range(0x80, 0x90)}, 0xDE: 3, 0xDF: 5}  # fixmap, map16, map32


class EndOfStream(TetherError):
    """The writer closed its end and every complete frame has been delivered."""


class FrameEncoder:
    """Encodes messages into frames (length prefix + msgpack payload)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def frame(self, message: Any) -> bytes:
        # encode() + a 4-byte prefix is ~2x cheaper than encode_into() a fresh bytearray (which reallocates)
        # followed by a bytes() copy; the concatenation copies a small payload once.
        payload = self._encoder.encode(message)
        size = len(payload)
        if size > MAX_FRAME:
            raise ValueError(f"message of {size} bytes exceeds the {MAX_FRAME}-byte frame limit")
        return _pack_header(size) + payload


class FrameDecoder(Generic[T]):
    """Turns a byte stream into messages; keeps an incomplete tail until more bytes arrive.

    A tail that cannot be the start of a message (its payload is not a tagged map) is a ``ProtocolError`` at once.
    """

    def __init__(self, type_: Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)
        self._buf = bytearray()
        self.frames = 0

    def feed(self, data: bytes) -> list[T]:
        buf = self._buf
        buf += data
        out: list[T] = []
        pos = 0
        end = len(buf)
        view = memoryview(buf)
        decode = self._decoder.decode
        try:
            while end - pos >= HEADER_SIZE:
                (size,) = _HEADER.unpack_from(buf, pos)
                if size > MAX_FRAME:
                    raise ProtocolError(
                        f"frame {self.frames + len(out) + 1} declares {size} bytes, over the {MAX_FRAME}-byte "
                        "limit: the stream is corrupt",
                        (f"bytes: {_hex(buf[pos:])}",),
                    )
                stop = pos + HEADER_SIZE + size
                if stop > end:
                    self._check_start(buf, pos, size, self.frames + len(out) + 1)
                    break
                try:
                    out.append(decode(view[pos + HEADER_SIZE : stop]))
                except msgspec.DecodeError as exc:
                    raise ProtocolError(
                        f"frame {self.frames + len(out) + 1} is malformed: {exc}",
                        (f"frame: {_hex(buf[pos:stop])}",),
                    ) from exc
                pos = stop
        finally:
            view.release()
        if pos:
            del buf[:pos]
        self.frames += len(out)
        return out

    @staticmethod
    def _check_start(buf: bytearray, pos: int, size: int, number: int) -> None:
        payload = pos + HEADER_SIZE
        if len(buf) == payload:
            return
        key_at = _MAP_KEY_AT.get(buf[payload])
        have = buf[payload + (key_at or 0) : payload + (key_at or 0) + len(_TAG_KEY)]
        if key_at is None or (len(have) == len(_TAG_KEY) and have != _TAG_KEY) or size < (key_at + len(_TAG_KEY)):
            raise ProtocolError(
                f"frame {number} declares {size} bytes but its payload does not begin like any message (a map "
                "keyed by its type): this is not a frame the other side wrote, but garbage on the pipe",
                (f"bytes: {_hex(buf[pos:])}",),
            )

    def partial(self) -> tuple[int, int] | None:
        """(bytes declared, bytes held) of the incomplete frame waiting for the rest; None when there is none."""
        have = len(self._buf)
        if have < HEADER_SIZE:
            return None if have == 0 else (HEADER_SIZE, have)
        return _HEADER.unpack_from(self._buf, 0)[0] + HEADER_SIZE, have

    def held(self) -> bytes:
        """The bytes of the incomplete frame (evidence)."""
        return bytes(self._buf)

    def finish(self) -> None:
        """Call at end-of-stream: a partial frame left over means the writer died mid-frame or wrote garbage."""
        if self._buf:
            have = len(self._buf)
            want = _HEADER.unpack_from(self._buf, 0)[0] + HEADER_SIZE if have >= HEADER_SIZE else None
            detail = f"{have} of {want} bytes" if want is not None else f"{have} bytes of a {HEADER_SIZE}-byte header"
            raise ProtocolError(
                f"truncated frame at end of stream after {self.frames} frames: {detail}",
                (f"bytes: {_hex(self._buf)}",),
            )


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Blocking write of every byte (a pipe write can return short when interrupted)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class SyncSender:
    """Thread-safe sender for the runner side: several threads (task loop, heartbeat) share one pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._frame = FrameEncoder().frame  # msgspec encoders are thread-safe; framing happens outside the lock
        self._lock = threading.Lock()
        self._acquire = self._lock.acquire  # bound once: cheaper than `with` on the per-token path
        self._release = self._lock.release

    def send(self, message: Any) -> None:
        frame = self._frame(message)
        self._acquire()
        try:
            n = os.write(self.fd, frame)  # one syscall in the common case; a short write finishes below
            if n != len(frame):
                write_all(self.fd, memoryview(frame)[n:])
        finally:
            self._release()

    def send_many(self, messages: list[Any]) -> None:
        """Several messages in one write (a batch step's chunks): one syscall, and the reader wakes once."""
        if not messages:
            return
        data = b"".join(map(self._frame, messages))
        self._acquire()
        try:
            write_all(self.fd, memoryview(data))
        finally:
            self._release()

    def close(self) -> None:
        with self._lock:
            os.close(self.fd)


class SyncReceiver(Generic[T]):
    """Blocking receiver for the runner side (its reader thread)."""

    def __init__(self, fd: int, type_: Any) -> None:
        self.fd = fd
        self._decoder: FrameDecoder[T] = FrameDecoder(type_)

    def __iter__(self) -> Iterator[T]:
        while True:
            data = os.read(self.fd, READ_SIZE)
            if not data:
                self._decoder.finish()
                return
            yield from self._decoder.feed(data)


class AsyncReceiver(Generic[T]):
    """Non-blocking receiver for the supervisor side; waits in the event loop, never in a thread.

    A writer sends each frame whole, so an incomplete frame is finished within moments by the bytes that follow.
    One still incomplete when more bytes arrive ``stall`` seconds after it began is not a frame at all (garbage
    whose length prefix looked plausible): a ``ProtocolError``, not a wait that would swallow every later message.
    """

    def __init__(self, fd: int, type_: Any, *, stall: float = PARTIAL_FRAME_STALL) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._decoder: FrameDecoder[T] = FrameDecoder(type_)
        self.eof = False
        self.stall = stall
        self._partial_since: float | None = None  # when the incomplete frame now held began to arrive
        self._partial_reads = 0  # reads that added to it

    def _read_available(self) -> list[T] | None:
        """Decode what can be read now; None when nothing is available yet. Raises EndOfStream after EOF."""
        if self.eof:
            raise EndOfStream
        try:
            data = os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return None
        if not data:
            self.eof = True
            self._decoder.finish()
            raise EndOfStream
        frames = self._decoder.feed(data)
        now = time.monotonic()
        if self._decoder.partial() is None:
            self._partial_since = None
        elif frames or self._partial_since is None:
            self._partial_since, self._partial_reads = now, 1  # a new frame began in this read
        else:
            self._partial_reads += 1
            if now - self._partial_since > self.stall:
                raise self.stalled(now)
        return frames

    def garbage_suspected(self) -> bool:
        """Whether an incomplete frame is held that later bytes kept growing without completing it (for a caller
        about to blame silence on the writer: its messages may be stuck behind garbage)."""
        since = self._partial_since
        return since is not None and self._partial_reads > 1 and time.monotonic() - since > GROWTH_SUSPECT

    def stalled(self, now: float | None = None) -> ProtocolError:
        """The error for the incomplete frame held now (see the class docstring)."""
        declared, have = self._decoder.partial() or (0, 0)
        age = (time.monotonic() if now is None else now) - (self._partial_since or 0.0)
        return ProtocolError(
            f"frame {self._decoder.frames + 1} declares {declared} bytes but only {have} arrived in {age:.1f} s "
            "while later bytes kept coming: a writer sends each frame whole, so this is garbage on the pipe (every "
            "message after it would have been swallowed)",
            (f"bytes: {_hex(self._decoder.held())}",),
        )

    async def receive_batch(self) -> list[T]:
        """Every complete message available now (waiting until there is at least one byte)."""
        while True:
            batch = self._read_available()
            if batch is None:
                await anyio.wait_readable(self.fd)
            elif batch:
                return batch

    def drain_nowait(self) -> list[T]:
        """Everything the writer left in the pipe, without waiting: for use once the writer process is dead.

        Stops at EOF or when the pipe is empty (a surviving grandchild could hold a copy of the write end; what
        the dead runner wrote is already all in the pipe).
        """
        out: list[T] = []
        while True:
            try:
                batch = self._read_available()
            except EndOfStream:
                return out
            if batch is None:
                return out
            out.extend(batch)

    def close(self) -> None:
        os.close(self.fd)


class AsyncSender:
    """Non-blocking sender for the supervisor side; a lock keeps frames whole when several tasks send."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._encoder = FrameEncoder()
        self._lock = anyio.Lock()
        self.closed = False

    def frame(self, message: Any) -> bytes:
        """``message`` as a frame; ``ValueError`` when it cannot travel (a value msgpack cannot carry, too large)."""
        try:
            return self._encoder.frame(message)
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:
            raise ValueError(f"cannot encode {type(message).__name__}: {exc}") from exc

    async def send(self, message: Any) -> None:
        await self.send_frame(self.frame(message))

    async def send_frame(self, frame: bytes) -> None:
        """Write a frame made by ``frame`` (whole: concurrent senders never interleave).

        ``BrokenPipeError`` once the channel is closed, also for a sender that was waiting (for the lock, or for
        room in the pipe) when it closed: its descriptor is gone, and its number may already name another file.
        """
        view = memoryview(frame)
        async with self._lock:
            while view:
                if self.closed:
                    raise BrokenPipeError("channel to the runner is closed")
                try:
                    n = os.write(self.fd, view)
                except BlockingIOError:
                    try:
                        await anyio.wait_writable(self.fd)
                    except anyio.ClosedResourceError:  # closed while waiting (``close`` warned the waiters)
                        raise BrokenPipeError("channel to the runner is closed") from None
                    continue
                view = view[n:]

    def close(self) -> None:
        """Close the channel; senders waiting on it get ``BrokenPipeError`` (call from the event loop)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(RuntimeError):  # no event loop (a sync caller): nobody can be waiting
                anyio.notify_closing(self.fd)
            os.close(self.fd)
