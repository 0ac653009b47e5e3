"""The peer server's C path (``coordlfs.peers.serving``): a peer lane's GET of a file the node
has cached answered in C, every other GET handed to the daemon. Real mounts on loopback, every
byte checked by its digest; a hostile client on a real connection."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import trio
import xxhash
from conftest import wait_for
from test_lane_peers import LANE, connected, lane, lane_pair
from test_peers import cluster, copies, free_port, read_files, reads, source_digests

from coordlfs.peers.wire import (
    GET_HEADER,
    HEADER,
    LANE_READY,
    MAGIC,
    VERSION,
    Fail,
    FrameStream,
    Get,
    Kind,
    client_handshake,
    decode_fail,
    encode_frame,
)
from coordlfs.testbed.mounts import Mount


def in_c(m: Mount) -> dict[str, int]:
    return m.status()["served"]["in_c"]


def test_cached_files_are_served_in_c_the_rest_by_the_daemon(mount, tmp_path: Path) -> None:
    """B has cached none of its files when A first reads them: each GET goes to B's daemon,
    which fills and answers it. Read again, every one is answered in C. Every byte right."""
    pair = lane_pair(mount, tmp_path, cached=False)
    a, b, sizes, want, mine = pair.a, pair.b, pair.sizes, pair.want, pair.mine
    connected(a, mine[0])
    rest = mine[1:]
    assert read_files(a.mountpoint, rest) == {n: want[n] for n in rest}
    b.settled()
    first = in_c(b)
    assert first["connections"] >= 1 and first["faults"] == 0, first
    assert first["deferred"] >= len(rest) and first["files"] == 0, first
    assert lane(a)["peers"]["files"] == len(rest)
    assert read_files(a.mountpoint, rest) == {n: want[n] for n in rest}
    second = in_c(b)
    assert second["files"] == len(rest) and second["deferred"] == first["deferred"], second
    assert second["bytes"] == sum(sizes[n] for n in rest)
    assert b.status()["served"]["requests"] >= 2 * len(rest)
    assert lane(a)["peers"]["faults"] == 0
    assert reads(a)["bytes_from_peers"] == 2 * sum(sizes[n] for n in rest)
    stats = subprocess.run([sys.executable, "-m", "coordlfs", "stats", str(b.mountpoint)],
                           capture_output=True, text=True, check=True).stdout
    assert f"({len(rest)} sent in C)" in stats, stats


def test_a_file_changed_at_its_owner_is_not_served_from_its_old_copy(mount,
                                                                     tmp_path: Path) -> None:
    """B cached a file, then its source changed there (A's copy did not): A's lane asks for
    A's version; B's C path finds its source another version and hands the GET to the daemon,
    which answers STALE; A reads its own storage."""
    pair = lane_pair(mount, tmp_path)
    a, b, roots, sizes, want, mine = pair.a, pair.b, pair.roots, pair.sizes, pair.want, pair.mine
    changed = mine[1]
    (roots[1] / changed).write_bytes(os.urandom(sizes[changed] + 100))
    connected(a, mine[0])
    before, stale = in_c(b), b.status()["served"]["stale"]
    assert read_files(a.mountpoint, mine[1:]) == {n: want[n] for n in mine[1:]}
    after = in_c(b)
    assert after["files"] - before["files"] == len(mine) - 2, after
    assert after["deferred"] - before["deferred"] == 1
    # the lane's GET, and the daemon's asking again on its link: each told STALE
    assert b.status()["served"]["stale"] == stale + 2
    assert reads(a)["bytes_from_peers"] == sum(sizes[n] for n in mine[2:])


async def _lane_connection(port: int) -> FrameStream:
    """A connection to the server at ``port`` that said LANE, as a peer's request lane's."""
    frames = FrameStream(await trio.open_tcp_stream("127.0.0.1", port), frame_timeout=10)
    await client_handshake(frames, b"")
    features = await frames.receive()
    assert features is not None and b"lane" in bytes(features.payload).split()
    await frames.send(Kind.LANE, 0, b"")
    ready = await frames.receive()
    assert ready is not None and (ready.kind, bytes(ready.payload)) == (Kind.DATA, LANE_READY)
    return frames


async def _hostile(port: int, path: bytes, size: int, mtime_ns: int) -> list[object]:
    """What the C path does with a hostile client's frames, each on a new lane connection."""
    seen: list[object] = []
    with trio.fail_after(30):
        frames = await _lane_connection(port)  # a path outside the dataset: refused alone
        outside = b"../etc/passwd"  # encoded by hand: Get.encode refuses it
        await frames.send(Kind.GET, 7, GET_HEADER.pack(10, 0, 0, 10) + outside)
        reply = await frames.receive()
        assert reply is not None
        seen.append((reply.kind, reply.request_id, decode_fail(reply.payload)[0]))
        await frames.send(Kind.GET, 8, Get(path, size, mtime_ns, 0, size).encode())
        reply = await frames.receive()  # the connection still serves
        assert reply is not None
        seen.append((reply.kind, reply.request_id, xxhash.xxh64_hexdigest(reply.payload)))
        await frames.aclose()
        for frame in (  # a bad checksum; a length past any GET's; another kind
                HEADER.pack(MAGIC, VERSION, Kind.GET, 9, 40, 12345) + bytes(40),
                HEADER.pack(MAGIC, VERSION, Kind.GET, 9, 1 << 30, 0),
                encode_frame(Kind.WARM, 9, b"")):
            frames = await _lane_connection(port)
            await frames.stream.send_all(frame)
            with trio.move_on_after(10):
                seen.append(await frames.receive())  # None: closed, no reply
            await frames.aclose()
    return seen


def test_a_hostile_lane_client_is_refused_or_closed_and_the_mount_serves_on(
        mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 1)
    port = free_port()
    (b,) = cluster(mount, roots, *LANE, ports=[port])
    want = source_digests(roots[0], sizes)
    name = sorted(sizes)[0]
    assert read_files(b.mountpoint, [name]) == {name: want[name]}  # cached: the C path's
    b.settled()
    st = (roots[0] / name).stat()
    seen = trio.run(_hostile, port, name.encode(), st.st_size, st.st_mtime_ns)
    assert seen == [(Kind.FAIL, 7, Fail.REFUSED), (Kind.DATA, 8, want[name]), None, None, None]
    wait_for(lambda: in_c(b)["faults"] == 3, "three connections closed for a fault")
    counts = in_c(b)
    assert counts["files"] == 1 and counts["deferred"] == 1, counts
    wait_for(lambda: in_c(b)["open_connections"] == 0, "every connection closed")
    others = sorted(sizes)[1:]
    assert read_files(b.mountpoint, others) == {n: want[n] for n in others}


def test_without_the_c_path_the_daemon_serves_lane_connections(mount, tmp_path: Path) -> None:
    """``--request-lane no``: no C path; a LANE is answered and its connection served by the
    daemon, byte for byte."""
    roots, sizes = copies(tmp_path, 1)
    port = free_port()
    (b,) = cluster(mount, roots, "--insecure", "--request-lane", "no", ports=[port])
    want = source_digests(roots[0], sizes)
    names = sorted(sizes)[:3]

    async def ask() -> list[str]:
        frames = await _lane_connection(port)
        got = []
        for i, name in enumerate(names, 1):
            st = (roots[0] / name).stat()
            await frames.send(Kind.GET, i, Get(name.encode(), st.st_size, st.st_mtime_ns, 0,
                                               st.st_size).encode())
            reply = await frames.receive()
            assert reply is not None and reply.kind == Kind.DATA
            got.append(xxhash.xxh64_hexdigest(reply.payload))
        await frames.aclose()
        return got

    assert trio.run(ask) == [want[n] for n in names]
    assert "in_c" not in b.status()["served"]


def test_lane_connections_past_the_cap_are_served_by_the_daemon(mount, tmp_path: Path) -> None:
    """``--peer-connections 2``: the C path serves two lane connections at most; a third,
    held beside them, is served by the daemon, byte for byte."""
    roots, sizes = copies(tmp_path, 1)
    port = free_port()
    (b,) = cluster(mount, roots, *LANE, "--peer-connections", "2", ports=[port])
    want = source_digests(roots[0], sizes)
    name = sorted(sizes)[0]
    assert read_files(b.mountpoint, [name]) == {name: want[name]}
    b.settled()
    st = (roots[0] / name).stat()
    get = Get(name.encode(), st.st_size, st.st_mtime_ns, 0, st.st_size).encode()

    async def three() -> list[str]:
        held, got = [], []
        with trio.fail_after(30):
            for i in range(3):
                held.append(frames := await _lane_connection(port))
                await frames.send(Kind.GET, i + 1, get)
                reply = await frames.receive()
                assert reply is not None and reply.kind == Kind.DATA
                got.append(xxhash.xxh64_hexdigest(reply.payload))
            for frames in held:
                await frames.aclose()
        return got

    assert trio.run(three) == [want[name]] * 3
    counts = in_c(b)
    assert counts["connections"] == 2 and counts["files"] == 2, counts


def test_files_published_after_the_index_grew_are_served_in_c(mount, tmp_path: Path) -> None:
    """The daemon moves its index to a larger file past 2,048 entries (``published``): the C
    path, which mapped the first one, maps the new one and serves files published before and
    after the move."""
    root = tmp_path / "src"
    root.mkdir()
    names = [f"f{i:05d}" for i in range(2100)]
    for i, name in enumerate(names):
        (root / name).write_bytes(i.to_bytes(4, "big") * 256)
    port = free_port()
    (b,) = cluster(mount, [root], *LANE, ports=[port])

    def cache(part: list[str]) -> None:
        for name in part:
            (b.mountpoint / name).read_bytes()
        b.settled()

    async def ask(asked: list[str]) -> list[str]:
        frames = await _lane_connection(port)
        got = []
        with trio.fail_after(30):
            for i, name in enumerate(asked, 1):
                st = (root / name).stat()
                await frames.send(Kind.GET, i, Get(name.encode(), st.st_size, st.st_mtime_ns,
                                                   0, st.st_size).encode())
                reply = await frames.receive()
                assert reply is not None and reply.kind == Kind.DATA
                got.append(xxhash.xxh64_hexdigest(reply.payload))
        await frames.aclose()
        return got

    def digests(asked: list[str]) -> list[str]:
        return [xxhash.xxh64_hexdigest((root / n).read_bytes()) for n in asked]

    cache(names[:100])
    assert trio.run(ask, names[:1]) == digests(names[:1])  # the first index, mapped
    cache(names[100:])
    assert b.status()["shared"]["published"] == len(names)  # past 2,048: moved once
    asked = [names[0], names[1000], names[-1]]
    assert trio.run(ask, asked) == digests(asked)
    assert in_c(b)["files"] == 1 + len(asked) and in_c(b)["deferred"] == 0


def test_files_changing_at_their_owner_while_served_in_c_never_serve_another_version(
        mount, tmp_path: Path) -> None:
    """Four readers on A read B's files round after round while B's copies of some of them are
    rewritten (another size, another mtime): every read is A's own version, byte for byte,
    whether B's C path served it, B's daemon, or A's storage after B said STALE."""
    pair = lane_pair(mount, tmp_path)
    a, roots, sizes, want, mine = pair.a, pair.roots, pair.sizes, pair.want, pair.mine
    connected(a, mine[0])
    changing = mine[1::4]
    stop = threading.Event()

    def rewrite() -> None:
        n = 0
        while not stop.is_set():
            name = changing[n % len(changing)]
            (roots[1] / name).write_bytes(os.urandom(sizes[name] + 1 + n % 7))
            n += 1
            time.sleep(0.005)

    def read(part: list[str]) -> dict[str, str]:
        wrong = {}
        for _ in range(3):
            for name, digest in read_files(a.mountpoint, part).items():
                if digest != want[name]:
                    wrong[name] = digest
        return wrong

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            wrong = [w for w in pool.map(read, [mine[i::4] for i in range(4)]) if w]
    finally:
        stop.set()
        writer.join()
    assert wrong == []
    assert in_c(pair.b)["files"] > 0 and in_c(pair.b)["faults"] == 0
    assert lane(a)["peers"]["faults"] == 0


def test_a_lane_client_that_trickles_its_frame_is_closed_within_the_peer_timeout(
        mount, tmp_path: Path) -> None:
    """Each byte within the socket's timeout, the frame as a whole far slower: the C path
    closes the connection once the frame has taken longer than --peer-timeout (0.5 s)."""
    roots, sizes = copies(tmp_path, 1)
    port = free_port()
    (b,) = cluster(mount, roots, *LANE, "--peer-timeout", "0.5", ports=[port])
    name = sorted(sizes)[0]
    st = (roots[0] / name).stat()
    frame = encode_frame(Kind.GET, 1, Get(name.encode(), st.st_size, st.st_mtime_ns, 0,
                                          st.st_size).encode())

    async def trickle() -> float:
        frames = await _lane_connection(port)
        started = trio.current_time()
        with trio.fail_after(30):
            try:
                for byte in frame:
                    await frames.stream.send_all(bytes([byte]))
                    await trio.sleep(0.1)
                closed = await frames.receive() is None
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                closed = True
        await frames.aclose()
        assert closed
        return trio.current_time() - started

    assert trio.run(trickle) < 0.5 + 0.1 + 2.0  # the timeout, a byte's pause, a loaded machine
    wait_for(lambda: in_c(b)["faults"] == 1, "the trickling connection closed for a fault")
    assert in_c(b)["files"] == 0
