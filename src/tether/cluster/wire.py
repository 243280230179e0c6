"""The heartbeat path between the coordinator and each node agent: a TCP connection of tether's own, beside Ray.

Why not Ray's calls: a silently dead node is declared dead by Ray's GCS health check only after 5 failed checks of
3 s each, and a SIGSTOPped coordinator answers nothing but looks alive to Ray. Over this path both sides beat every
``interval`` seconds; the coordinator declares an agent lost after ``lost_after`` seconds of silence (or at once
when its connection closes), and an agent stops its runners after ``lease`` seconds without its coordinator.

Agents also report here what the coordinator shows and places by: node memory as tether measures it and each
runner's status and footprint (one beat carries them all, so reports cost no Ray call).

Frames are a 4-byte big-endian length then a msgpack message (tagged structs).
"""

from __future__ import annotations

import struct

import msgspec
from anyio.abc import ByteStream

from tether.node.memory import ProcessMemory
from tether.protocol import Cause, RunnerStatus

MAX_FRAME = 16 << 20
_LENGTH = struct.Struct(">I")


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """An agent's first frame: which node it serves and its process."""

    node_id: str
    pid: int
    host: str
    token: str  # the coordinator's secret, handed to its agents through Ray: no one else may pose as an agent


class RunnerReport(msgspec.Struct, frozen=True):
    """One runner hosted by an agent, as of a beat."""

    runner_id: str
    pid: int | None
    status: RunnerStatus
    footprint: ProcessMemory | None
    cgroup: str | None = None
    log: str | None = None


class NodeReport(msgspec.Struct, frozen=True):
    """A node's memory as tether measures it (cgroup-aware, reclaimable cache counted free) and where it comes from."""

    available: int
    source: str
    host_total: int
    cgroup_limit: int | None = None


class Beat(msgspec.Struct, tag="beat", frozen=True):
    """Proof of life. From an agent it carries its node's memory and its runners; from the coordinator, nothing."""

    seq: int
    node: NodeReport | None = None
    runners: tuple[RunnerReport, ...] = ()
    fenced: bool = False


class Fenced(msgspec.Struct, tag="fenced", frozen=True):
    """An agent stopped its runners itself: its coordinator was silent longer than its lease."""

    reason: str
    stopped: tuple[str, ...]  # runner ids
    causes: tuple[Cause, ...] = ()


Message = Hello | Beat | Fenced
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def frame(message: Message) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


class Reader:
    """Whole messages out of a byte stream, however TCP splits them."""

    def __init__(self, stream: ByteStream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    async def receive(self) -> Message:
        """The next message; ``anyio.EndOfStream`` (or a broken-resource error) when the peer is gone."""
        while True:
            if len(self._buffer) >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(self._buffer)
                if length > MAX_FRAME:
                    raise ValueError(f"heartbeat frame of {length} bytes (limit {MAX_FRAME}): not a tether peer")
                if len(self._buffer) >= _LENGTH.size + length:
                    body = bytes(self._buffer[_LENGTH.size : _LENGTH.size + length])
                    del self._buffer[: _LENGTH.size + length]
                    return _decoder.decode(body)
            self._buffer += await self.stream.receive()
