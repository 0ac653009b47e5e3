"""A misbehaving peer, run as its own process: ``python fake_peer.py PORT MODE``.

It listens on 127.0.0.1:PORT, passes the insecure handshake (except in ``silent`` and
``badauth``), then answers every GET wrongly in the way MODE says. A mount that names it in
``--peers`` must still serve every byte right from local storage.
"""

from __future__ import annotations

import sys

import trio
import xxhash

from coordlfs.peer_wire import HEADER, MAGIC, VERSION, FrameStream, Get, Kind, server_handshake


def header(kind: Kind, request_id: int, payload: bytes, checksum: int | None = None) -> bytes:
    digest = xxhash.xxh64_intdigest(payload) if checksum is None else checksum
    return HEADER.pack(MAGIC, VERSION, kind, request_id, len(payload), digest)


async def answer(stream: trio.SocketStream, mode: str) -> None:
    frames = FrameStream(stream)
    if mode == "silent":  # accepts, never speaks: the client must time out
        await trio.sleep_forever()
    await server_handshake(frames, b"badsecret" if mode == "badauth" else b"")
    while (frame := await frames.receive()) is not None:
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
