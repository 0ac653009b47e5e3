"""Frames over real sockets: a large payload is received straight into a buffer of its own
(``FrameStream._payload``), and must come byte-exact whatever the segments, and a peer that
corrupts one or hangs up inside one must never hand on its bytes. The socket is read and
written with plain system calls: frames that are all there still yield to the loop, and a
closed connection never reads the file that took its descriptor's number."""

from __future__ import annotations

import os
import random

import pytest
import trio
import trio.testing
import xxhash

from coordlfs.peers.wire import (
    HEADER,
    MAGIC,
    MAX_CHUNK,
    VERSION,
    Frame,
    FrameStream,
    Kind,
    ProtocolError,
)


async def _pair() -> tuple[trio.SocketStream, FrameStream]:
    left, right = trio.socket.socketpair()
    return trio.SocketStream(left), FrameStream(trio.SocketStream(right))


def _frame(kind: Kind, request_id: int, payload: bytes, digest: int | None = None) -> bytes:
    digest = xxhash.xxh64_intdigest(payload) if digest is None else digest
    return HEADER.pack(MAGIC, VERSION, kind, request_id, len(payload), digest) + payload


def test_frames_small_and_large_come_byte_exact_in_any_segments() -> None:
    """Frames of every size back to back, sent in random pieces: a large one's first bytes
    may sit in the shared buffer behind the previous frame, its rest come in any cuts."""
    rng = random.Random(5)
    payloads = [os.urandom(n) for n in (0, 1, 100, (64 << 10) - 1, 64 << 10, 300_000,
                                        MAX_CHUNK, 7, MAX_CHUNK - 3, 5)]
    wire = b"".join(_frame(Kind.FILES, i + 1, p) for i, p in enumerate(payloads))

    async def main() -> None:
        sender, frames = await _pair()

        async def send() -> None:
            at = 0
            while at < len(wire):
                step = rng.choice((1, 21, 4096, 70_000, 1 << 20))
                await sender.send_all(wire[at:at + step])
                at += step
            await sender.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            for i, payload in enumerate(payloads):
                frame = await frames.receive()
                assert frame is not None
                assert (frame.request_id, bytes(frame.payload)) == (i + 1, payload)
            assert await frames.receive() is None
    trio.run(main)


@pytest.mark.parametrize("damage", ["checksum", "hang up"])
def test_a_large_frame_that_lies_or_stops_midway_is_refused(damage: str) -> None:
    payload = os.urandom(MAX_CHUNK)

    async def main() -> None:
        sender, frames = await _pair()
        if damage == "checksum":
            wire = _frame(Kind.FILES, 1, payload, xxhash.xxh64_intdigest(payload) ^ 1)
        else:
            wire = _frame(Kind.FILES, 1, payload)[:HEADER.size + MAX_CHUNK // 2]

        async def send() -> None:
            await sender.send_all(wire)
            if damage == "hang up":
                await sender.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            with pytest.raises(ProtocolError, match=r"checksum|closed mid-frame"):
                await frames.receive()
    trio.run(main)


@pytest.mark.parametrize("over", ["socket", "memory stream"])
def test_a_payload_in_parts_goes_out_as_one_frame(over: str) -> None:
    """A batch's reply is sent in parts (views of the cache, not joined): one frame, its
    checksum over every part, byte-exact over a socket (sendmsg, partial sends resumed)
    and over a stream with no socket."""
    parts = [memoryview(os.urandom(n)) for n in (5, 110_000, 5, 1, 5, 300_000, 5, 0, 5,
                                                 600_000)]

    async def main() -> None:
        if over == "socket":
            sender, receiver = (trio.SocketStream(s) for s in trio.socket.socketpair())
        else:
            sender, receiver = trio.testing.memory_stream_pair()
        frames = FrameStream(receiver)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(FrameStream(sender).send, Kind.FILES, 9, parts)
            frame = await frames.receive()
        assert frame is not None and frame.request_id == 9
        assert bytes(frame.payload) == b"".join(parts)
    trio.run(main)


def test_frames_sent_back_to_back_do_not_hold_the_loop() -> None:
    """A peer that has sent many frames at once is read without waiting for the socket, yet
    every frame received is a pass through the scheduler: another task runs between any two
    (a receive that never yields would make a flood of requests stop the mount's readers)."""
    count = 200

    async def main() -> None:
        sender, frames = await _pair()
        await sender.send_all(b"".join(_frame(Kind.GET, i + 1, b"x" * 50) for i in range(count)))
        ticks = 0

        async def other() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.lowlevel.checkpoint()  # let it start
            before = ticks
            for i in range(count):
                frame = await frames.receive()
                assert frame is not None and frame.request_id == i + 1
            assert ticks - before >= count - 1
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_a_closed_connection_never_reads_the_file_that_took_its_number() -> None:
    """The socket is read by its descriptor's number: once the connection is closed (a budget
    closing an idle link), a receive must fail, not read whatever file the number names now."""
    async def main() -> None:
        sender, frames = await _pair()
        number = frames.stream.socket.fileno()
        await frames.aclose()
        other = os.open("/dev/zero", os.O_RDONLY)  # the lowest free number: the socket's
        try:
            assert other == number
            with pytest.raises(trio.ClosedResourceError):
                await frames.receive()
            with pytest.raises(trio.ClosedResourceError):
                await frames.send(Kind.GET, 1, b"x")
        finally:
            os.close(other)
            await sender.aclose()
    trio.run(main)


def test_a_frame_on_its_way_in_keeps_its_connection_from_looking_idle() -> None:
    """``unread`` (what a server's budget asks before closing an idle connection) is true
    while a frame's bytes wait in the socket or the buffer, or one is being received."""
    async def main() -> None:
        sender, frames = await _pair()
        assert not frames.unread
        wire = _frame(Kind.GET, 1, b"y" * 100)
        await sender.send_all(wire[:10])
        await trio.testing.wait_all_tasks_blocked()
        assert frames.unread  # in the socket
        async with trio.open_nursery() as nursery:
            nursery.start_soon(frames.receive)
            await trio.testing.wait_all_tasks_blocked()
            assert frames.unread  # being received: its first bytes are in the buffer
            await sender.send_all(wire[10:] + wire)
        assert frames.unread  # the next frame waits in the buffer
        assert await frames.receive() == Frame(Kind.GET, 1, b"y" * 100)
        assert not frames.unread
    trio.run(main)
