"""A misbehaving peer, run as its own process: ``python fake_peer.py PORT MODE``.

It listens on 127.0.0.1:PORT, passes the insecure handshake (except in ``silent`` and
``badauth``), then answers every GET wrongly in the way MODE says. A mount that names it in
``--peers`` must still serve every byte right from local storage.

The ``many-*`` modes say they serve GETMANY, answer a GET with FAIL MISS (the right length of
zeros would be a lie no protocol can see) and lie in every FILES reply: a file one byte short
(``many-badlen``), a bad checksum (``many-badsum``), one file fewer (``many-short``), or a
DATA frame instead of FILES (``many-kind``).

A ``lane-`` prefix (``lane-badsum``...) sends the features frame too, as a real peer does, so
that the request lane dials it (``coordlfs.fs.lane_peers``; its LANE answered as a real peer
answers it), then lies as the mode says.
"""

from __future__ import annotations

import sys

import trio
import xxhash

from coordlfs.peers.wire import (
    HEADER,
    LANE_READY,
    MAGIC,
    VERSION,
    Fail,
    Frame,
    FrameStream,
    Get,
    GetMany,
    Kind,
    encode_fail,
    encode_files,
    send_features,
    server_handshake,
)


def header(kind: Kind, request_id: int, payload: bytes, checksum: int | None = None) -> bytes:
    digest = xxhash.xxh64_intdigest(payload) if checksum is None else checksum
    return HEADER.pack(MAGIC, VERSION, kind, request_id, len(payload), digest)


async def answer(stream: trio.SocketStream, mode: str) -> None:
    frames = FrameStream(stream)
    if mode == "silent":  # accepts, never speaks: the client must time out
        await trio.sleep_forever()
    await server_handshake(frames, b"badsecret" if mode == "badauth" else b"")
    if mode.startswith(("many-", "lane-")):  # lane-*: says what it serves, as peers do
        await send_features(frames)
        mode = mode.removeprefix("lane-")
    while (frame := await frames.receive()) is not None:
        if frame.kind == Kind.LANE:  # a request lane's connection: ready, as peers say
            await frames.send(Kind.DATA, 0, LANE_READY)
            continue
        if mode.startswith("many-"):
            await lie_about_many(frames, frame, mode)
            continue
        request = Get.decode(frame.payload)
        good = bytes(request.length)
        if mode == "badsum":
            await stream.send_all(header(Kind.DATA, frame.request_id, good, 12345) + good)
        elif mode == "badlen":
            await frames.send(Kind.DATA, frame.request_id, good[:-1])
        elif mode == "garbage":
            await stream.send_all(b"\x00garbage that is no frame at all" * 4)
        elif mode == "midframe":
            await stream.send_all(header(Kind.DATA, frame.request_id, good) + good[:10])
            await stream.aclose()
            return
        elif mode == "hang":  # authenticated, then never answers a request
            continue
        elif mode == "trickle":  # a byte at a time, each well within the timeout
            for byte in header(Kind.DATA, frame.request_id, good) + good:
                await stream.send_all(bytes([byte]))
                await trio.sleep(0.05)


async def lie_about_many(frames: FrameStream, frame: Frame, mode: str) -> None:
    if frame.kind == Kind.GET:
        await frames.send(Kind.FAIL, frame.request_id, encode_fail(Fail.MISS, "not here"))
        return
    files = GetMany.decode(frame.payload).files
    answers: list[tuple[Kind, bytes]] = [(Kind.DATA, bytes(f.size)) for f in files]
    if mode == "many-badlen":
        answers[-1] = (Kind.DATA, answers[-1][1][:-1])
    elif mode == "many-short":
        answers.pop()
    reply = encode_files(answers)
    if mode == "many-badsum":
        await frames.stream.send_all(header(Kind.FILES, frame.request_id, reply, 12345) + reply)
    elif mode == "many-kind":
        await frames.send(Kind.DATA, frame.request_id, reply)
    else:
        await frames.send(Kind.FILES, frame.request_id, reply)


async def main(port: int, mode: str) -> None:
    async def serve(stream: trio.SocketStream) -> None:
        try:
            await answer(stream, mode)
        except Exception as e:  # a broken client is not our concern
            print(f"client: {e!r}", file=sys.stderr)
        finally:
            await trio.aclose_forcefully(stream)

    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    print("ready", flush=True)
    await trio.serve_listeners(serve, listeners)


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), sys.argv[2])
