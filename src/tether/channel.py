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

import os
import struct
import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import anyio
import msgspec

T = TypeVar("T")

_HEADER = struct.Struct("<I")
HEADER_SIZE = _HEADER.size
_pack_header = _HEADER.pack
MAX_FRAME = 64 * 1024 * 1024  # a larger length prefix is corruption, not a message
READ_SIZE = 256 * 1024


class ProtocolError(Exception):
    """The byte stream is not a valid sequence of frames: a bug or corruption, never something to wait out."""


class EndOfStream(Exception):
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
    """Turns a byte stream into messages; keeps an incomplete tail until more bytes arrive."""

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
                        "limit: the stream is corrupt"
                    )
                stop = pos + HEADER_SIZE + size
                if stop > end:
                    break
                try:
                    out.append(decode(view[pos + HEADER_SIZE : stop]))
                except msgspec.DecodeError as exc:
                    raise ProtocolError(f"frame {self.frames + len(out) + 1} is malformed: {exc}") from exc
                pos = stop
        finally:
            view.release()
        if pos:
            del buf[:pos]
        self.frames += len(out)
        return out

    def finish(self) -> None:
        """Call at end-of-stream: a partial frame left over means the writer died mid-frame or wrote garbage."""
        if self._buf:
            have = len(self._buf)
            want = _HEADER.unpack_from(self._buf, 0)[0] + HEADER_SIZE if have >= HEADER_SIZE else None
            detail = f"{have} of {want} bytes" if want is not None else f"{have} bytes of a {HEADER_SIZE}-byte header"
            raise ProtocolError(f"truncated frame at end of stream after {self.frames} frames: {detail}")


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
    """Non-blocking receiver for the supervisor side; waits in the event loop, never in a thread."""

    def __init__(self, fd: int, type_: Any) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._decoder: FrameDecoder[T] = FrameDecoder(type_)
        self.eof = False

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
        return self._decoder.feed(data)

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

    async def send(self, message: Any) -> None:
        if self.closed:
            raise BrokenPipeError("channel to the runner is closed")
        view = memoryview(self._encoder.frame(message))
        async with self._lock:
            while view:
                try:
                    n = os.write(self.fd, view)
                except BlockingIOError:
                    await anyio.wait_writable(self.fd)
                    continue
                view = view[n:]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)
