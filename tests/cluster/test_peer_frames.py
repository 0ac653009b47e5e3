"""Frames over real sockets: a large payload is received straight into a buffer of its own
(``FrameStream._payload``), and must come byte-exact whatever the segments, and a peer that
corrupts one or hangs up inside one must never hand on its bytes."""

from __future__ import annotations

import os
import random

import pytest
import trio
import trio.testing
import xxhash

from coordlfs.peers.wire import HEADER, MAGIC, MAX_CHUNK, VERSION, FrameStream, Kind, ProtocolError


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
