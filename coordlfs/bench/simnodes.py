"""The other N-1 nodes of a cluster, simulated in one process, around one real mount.

``bench nodes --simulated`` measures what N nodes cost one real node in peer connections
without running N daemons (256 would not fit two cores): the real mount names N nodes in
``--peers``; this process listens on the other N-1 addresses and is each of those nodes to
it, both ways:

- as servers: each answers the real node's GET and GETMANY requests for any file of the
  dataset, from memory, over the peer protocol (``coordlfs.peers.wire``), so every miss of the
  real node that a simulated node owns is served as a peer serves it;
- as clients: each asks the real node, through a ``PeerLink`` of its own (the code under test,
  with its idle close), for the files the real node owns, as the other nodes of a symmetric
  cluster read: N-1 requests for every N files the real node's readers read, each from a
  simulated node drawn at random (as the others' reads reach it), at most ``IN_FLIGHT`` at
  once. The bench feeds the
  real node's progress (files read so far) on standard input, one count a line, then ``end``.

Then it prints one JSON line: requests made, how many the real node served, and the
connections the simulated clients opened to it.

    python -m coordlfs.bench.simnodes DATASET REAL_HOST:PORT HOST:PORT[,HOST:PORT...]
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
from pathlib import Path

import trio

from coordlfs.peers.links import PeerDown, PeerLink
from coordlfs.peers.placement import Address, owner, parse_address
from coordlfs.peers.wire import (
    Fail,
    FrameStream,
    Get,
    GetMany,
    Kind,
    ProtocolError,
    encode_fail,
    encode_files,
    send_features,
    server_handshake,
)

#: Requests of the simulated clients in flight at once: a few nodes reading at the same time.
IN_FLIGHT = 8
#: Seconds a simulated client waits for the real node (its --peer-timeout's default).
TIMEOUT_S = 2.0


class Files:
    """The dataset in memory, by path relative to its root, with each file's status."""

    def __init__(self, root: Path) -> None:
        self.bytes: dict[bytes, bytes] = {}
        self.stat: dict[bytes, os.stat_result] = {}
        for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
            rel = os.fsencode(path.relative_to(root))
            self.bytes[rel] = path.read_bytes()
            self.stat[rel] = path.stat()

    def answer(self, request: Get) -> tuple[Kind, bytes]:
        data = self.bytes.get(request.path)
        if data is None or len(data) != request.size:
            return Kind.FAIL, encode_fail(Fail.MISS, "not here")
        return Kind.DATA, data[request.offset:request.offset + request.length]


async def serve(stream: trio.SocketStream, files: Files) -> None:
    """One connection of the real node to a simulated one."""
    frames = FrameStream(stream)
    try:
        await server_handshake(frames, b"")
        await send_features(frames)
        while (frame := await frames.receive()) is not None:
            if frame.kind == Kind.GET:
                kind, data = files.answer(Get.decode(frame.payload))
                await frames.send(kind, frame.request_id, data)
                continue
            many = GetMany.decode(frame.payload)
            await frames.send(Kind.FILES, frame.request_id,
                              encode_files([files.answer(f.get()) for f in many.files]))
    except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        await trio.aclose_forcefully(stream)


class Clients:
    """The simulated nodes asking the real one, paced by its progress."""

    def __init__(self, real: Address, nodes: tuple[Address, ...], files: Files,
                 nursery: trio.Nursery) -> None:
        self.mine = [path for path in files.bytes if owner(path, nodes) == real]
        self.files = files
        self.links = [PeerLink(real, b"", TIMEOUT_S) for node in nodes if node != real]
        for link in self.links:
            link.nursery = nursery
        self._random = random.Random(0)
        self.ratio = (len(nodes) - 1) / len(nodes)
        self.asked = self.served = 0
        self._target = 0
        self._progress = trio.Event()
        self._in_flight = trio.Semaphore(IN_FLIGHT)

    def progressed(self, files_read: int) -> None:
        self._target = int(files_read * self.ratio)
        self._progress.set()
        self._progress = trio.Event()

    async def run(self) -> None:
        if not self.mine:  # the real node owns nothing: nothing to ask it
            await trio.sleep_forever()
        async with trio.open_nursery() as nursery:
            while True:
                while self.asked >= self._target:
                    await self._progress.wait()
                await self._in_flight.acquire()
                link = self._random.choice(self.links)
                path = self.mine[self.asked % len(self.mine)]
                self.asked += 1
                nursery.start_soon(self._ask, link, path)

    async def finished(self) -> None:
        """Until the requests in flight have their answers (no new one starts meanwhile)."""
        for _ in range(IN_FLIGHT):
            await self._in_flight.acquire()

    async def _ask(self, link: PeerLink, path: bytes) -> None:
        try:
            st = self.files.stat[path]
            kind, _data = await link.get(Get(path, st.st_size, st.st_mtime_ns, 0, st.st_size))
            self.served += kind == Kind.DATA
        except PeerDown:
            pass
        finally:
            self._in_flight.release()

    def report(self) -> dict[str, int]:
        return {"asked": self.asked, "served": self.served,
                "connections": sum(link.stats.connections for link in self.links),
                "failures": sum(link.stats.failures for link in self.links),
                "turned_away": sum(link.stats.turned_away for link in self.links)}


async def main(root: Path, real: Address, simulated: list[Address]) -> None:
    files = Files(root)
    nodes = tuple(sorted({real, *simulated}, key=str))
    listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(sock))
                 for sock in map(_listen, simulated)]
    async with trio.open_nursery() as nursery:
        clients = Clients(real, nodes, files, nursery)
        for listener in listeners:
            nursery.start_soon(trio.serve_listeners, lambda s: serve(s, files), [listener])
        nursery.start_soon(clients.run)
        print("ready", flush=True)
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buffered = b""
        while chunk := await stdin.receive_some():
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            if b"end" in lines:
                break
            if lines:
                clients.progressed(int(lines[-1]))
        await clients.finished()
        print(json.dumps(clients.report()), flush=True)
        nursery.cancel_scope.cancel()


def _listen(address: Address) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address.host, address.port))
    sock.listen(128)
    return sock


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), parse_address(sys.argv[2], "real node"),
             [parse_address(a, "simulated node") for a in sys.argv[3].split(",")])
