"""The framed channel: lossless across every way a writer can end, and loud about corrupt streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import anyio
import msgspec
import pytest

from tether.channel import (
    HEADER_SIZE,
    MAX_FRAME,
    AsyncReceiver,
    AsyncSender,
    EndOfStream,
    FrameDecoder,
    FrameEncoder,
    ProtocolError,
    SyncReceiver,
)
from tether.protocol import (
    ChatMessage,
    Chunk,
    DetokenizeParams,
    EmbedParams,
    Event,
    GenerateParams,
    GenerateTask,
    TokenizeParams,
    ToRunner,
)

pytestmark = pytest.mark.timeout(60)

WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from tether.channel import SyncSender
    from tether.protocol import Chunk
    fd, n, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sender = SyncSender(fd)
    for i in range(n):
        sender.send(Chunk(task_id="t", text=f"token {i} " + "x" * (i % 50), tokens=1))
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(int(how))
    """
)


async def _read_all_from_writer(n: int, how: str) -> tuple[list[Event], int]:
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(w), str(n), how], pass_fds=(w,))
    os.close(w)
    receiver: AsyncReceiver[Event] = AsyncReceiver(r, Event)
    events: list[Event] = []
    with anyio.fail_after(30):
        try:
            while True:
                events.extend(await receiver.receive_batch())
        except EndOfStream:
            pass
    receiver.close()
    return events, proc.wait(timeout=10)


@pytest.mark.anyio
@pytest.mark.parametrize(("how", "returncode"), [("0", 0), ("3", 3), ("sigkill", -signal.SIGKILL)])
async def test_every_message_arrives_before_end_of_stream(how: str, returncode: int) -> None:
    """N frames (far more than a pipe buffer holds), then exit 0 / exit 3 / SIGKILL: all N arrive, in order."""
    n = 20_000
    events, code = await _read_all_from_writer(n, how)
    assert code == returncode
    assert len(events) == n
    assert all(isinstance(e, Chunk) for e in events)
    assert [e.text.split()[1] for e in events[:3]] == ["0", "1", "2"]  # type: ignore[union-attr]
    assert events[-1].text.startswith(f"token {n - 1} ")  # type: ignore[union-attr]


def test_frames_split_at_any_byte_boundary_decode_identically() -> None:
    encoder = FrameEncoder()
    messages = [Chunk(task_id=f"t{i}", text="é" * i, tokens=i) for i in range(50)]
    stream = b"".join(encoder.frame(m) for m in messages)
    for step in (1, 3, 7, 64, len(stream)):
        decoder: FrameDecoder[Event] = FrameDecoder(Event)
        out: list[Event] = []
        for i in range(0, len(stream), step):
            out.extend(decoder.feed(stream[i : i + step]))
        decoder.finish()
        assert out == messages


def test_malformed_payload_is_a_protocol_error() -> None:
    decoder: FrameDecoder[Event] = FrameDecoder(Event)
    payload = msgspec.msgpack.encode({"type": "no-such-event"})
    with pytest.raises(ProtocolError, match="frame 1 is malformed"):
        decoder.feed(len(payload).to_bytes(HEADER_SIZE, "little") + payload)


def test_each_kind_of_request_crosses_the_pipe_as_itself() -> None:
    """A generation, an embedding and the tokenizer's two questions decode as the type they were sent as (their tag
    says which), every field intact; a request's field that its kind does not have is a protocol error."""
    chat = (ChatMessage("user", "hi"),)
    works = [
        GenerateParams(prompt="x", echo=True, max_tokens=0, logprobs=2),
        EmbedParams(messages=chat, fit_context=True),
        TokenizeParams(messages=chat, add_special=False),
        DetokenizeParams(ids=(1, 2, 3)),
    ]
    tasks = [GenerateTask(f"t{i}", work) for i, work in enumerate(works)]
    decoder: FrameDecoder[ToRunner] = FrameDecoder(ToRunner)
    assert decoder.feed(b"".join(FrameEncoder().frame(task) for task in tasks)) == tasks
    stray = {"type": "generate", "task_id": "t", "params": {"type": "embed", "prompt": "x", "max_tokens": 1}}
    payload = msgspec.msgpack.encode(stray)
    with pytest.raises(ProtocolError, match=r"frame 5 is malformed: .*unknown field `max_tokens` - at `\$.params`"):
        decoder.feed(len(payload).to_bytes(HEADER_SIZE, "little") + payload)


def test_oversized_length_prefix_is_a_protocol_error_not_a_wait() -> None:
    decoder: FrameDecoder[Event] = FrameDecoder(Event)
    with pytest.raises(ProtocolError, match="over the"):
        decoder.feed((MAX_FRAME + 1).to_bytes(HEADER_SIZE, "little") + b"\x00")


@pytest.mark.anyio
async def test_truncated_frame_at_end_of_stream_is_a_protocol_error() -> None:
    r, w = os.pipe()
    frame = FrameEncoder().frame(Chunk(task_id="t", text="hello"))
    os.write(w, frame + frame[: len(frame) - 2])  # one whole frame, then a writer dying mid-frame
    os.close(w)
    receiver: AsyncReceiver[Event] = AsyncReceiver(r, Event)
    with anyio.fail_after(5):
        assert await receiver.receive_batch() == [Chunk(task_id="t", text="hello")]
        with pytest.raises(ProtocolError, match="truncated frame at end of stream after 1 frames"):
            await receiver.receive_batch()
    receiver.close()


@pytest.mark.anyio
async def test_async_sender_to_sync_receiver_handles_frames_larger_than_the_pipe() -> None:
    """A prompt bigger than the pipe buffer goes through whole (partial writes are resumed)."""
    r, w = os.pipe()
    sender = AsyncSender(w)
    big = GenerateTask(task_id="big", params=GenerateParams(prompt="word " * 100_000))
    received: list[ToRunner] = []

    def read() -> None:
        for message in SyncReceiver[ToRunner](r, ToRunner):
            received.append(message)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, read)
            await sender.send(big)
            await sender.send(big.__class__(task_id="small", params=GenerateParams(prompt="hi")))
            sender.close()
    os.close(r)
    assert [m.task_id for m in received] == ["big", "small"]
    assert received[0] == big


@pytest.mark.anyio
@pytest.mark.timeout(10)
async def test_senders_waiting_when_the_channel_closes_get_broken_pipe_not_a_write_to_a_closed_fd() -> None:
    """Found by the fault campaign: a task sent while the runner died waited (for the lock, or for room in the pipe),
    then wrote to the closed descriptor: the API answered 500 "OSError: [Errno 9] Bad file descriptor", and the number
    could by then have named another runner's pipe. Every waiting sender now gets ``BrokenPipeError``."""
    read_fd, write_fd = os.pipe()
    sender = AsyncSender(write_fd)
    big = sender.frame(GenerateTask(task_id="t", params=GenerateParams(prompt="x" * (1 << 20))))  # > a pipe
    outcomes: list[str] = []

    async def send() -> None:
        try:
            await sender.send_frame(big)
        except BrokenPipeError:
            outcomes.append("broken pipe")
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")

    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send)  # fills the pipe, then waits for room
                tg.start_soon(send)  # waits for the lock
                await anyio.wait_all_tasks_blocked()
                sender.close()
        assert outcomes == ["broken pipe", "broken pipe"]
    finally:
        os.close(read_fd)
