"""Peer connections and descriptors, on real mounts over real TCP: the connection cap keeps
local reads working, slow and idle peers are disconnected, refusals are logged rate-limited,
the daemon raises its descriptor limit, and clusters work over IPv6.

Each of these failed before: ~1,000 idle peer connections under ``ulimit -n 1024`` made local
reads fail with EMFILE, a sender of a byte a second after the handshake held its connection
forever, every refused connection logged a line, and ``[::1]:PORT`` was unparsable.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import trio
import xxhash
from conftest import drop_caches
from test_peers import cluster, copies, free_port, read_files, reads, source_digests

from coordlfs.bench.nodes import connections, tcp_states
from coordlfs.peers.server import LOG_INTERVAL_S
from coordlfs.peers.wire import (
    HEADER,
    MAGIC,
    MAX_CHUNK,
    NONCE_SIZE,
    VERSION,
    Fail,
    FrameStream,
    Get,
    Kind,
    ProtocolError,
    client_handshake,
    decode_fail,
    idle_timeout,
)

#: The daemon starts with a soft limit of 256 descriptors and a hard one of 1024, as under
#: ``ulimit -Sn 256``; it must raise the soft one to 1024 and keep peers well below it.
LIMITED = ("prlimit", "--nofile=256:1024", "--")
#: Connections a crowd of peers opens: more than the daemon has descriptors.
CROWD = 1000


def _no_ipv6_loopback() -> str:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        return f"no IPv6 loopback on this machine: {e}"
    return ""


needs_ipv6 = pytest.mark.skipif(bool(_no_ipv6_loopback()), reason=_no_ipv6_loopback())


@pytest.fixture
def many_descriptors() -> None:
    """This test process holds the crowd's ends of the connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < CROWD + 200:
        pytest.skip(f"the hard descriptor limit {hard} is too low for {CROWD} connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, CROWD + 200), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def log_lines(path: Path, words: str) -> list[str]:
    """The log's lines from the peer server that hold ``words``."""
    return [line for line in path.read_text().splitlines()
            if "coordlfs.peers.server:" in line and words in line]


async def join(port: int, authenticate: bool) -> FrameStream | None:
    """One peer connection: returned open if the server admitted it (after the handshake, or
    after its HELLO when not authenticating), None if it was told BUSY and closed."""
    with trio.fail_after(10):  # a daemon out of descriptors never accepts, or says HELLO
        frames = FrameStream(await trio.open_tcp_stream("127.0.0.1", port))
    try:
        with trio.fail_after(10):
            if authenticate:
                await client_handshake(frames, b"")
                return frames
            first = await frames.receive()
            assert first is not None
            if first.kind == Kind.HELLO:
                return frames
            raise ProtocolError(f"turned us away: {decode_fail(first.payload)}")
    except ProtocolError as e:
        assert "turned us away" in str(e) and "connections open" in str(e)
        with trio.fail_after(10):  # and it hung up (reset: our AUTH came after its close)
            with contextlib.suppress(trio.BrokenResourceError):
                assert await frames.receive() is None
        await frames.aclose()
        return None


async def crowd_then_read(port: int, mountpoint: Path, names: list[str]
                          ) -> tuple[int, dict[str, str]]:
    """Open CROWD connections (authenticated first, then unauthenticated), in batches so the
    listen backlog never overflows; read every file through the mount while they are open.
    Returns how many were admitted and what the reads saw."""
    kept: list[FrameStream] = []

    async def one(authenticate: bool) -> None:
        if (frames := await join(port, authenticate)) is not None:
            kept.append(frames)

    for start in range(0, CROWD, 50):
        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(one, start < CROWD * 3 // 5)
    seen = await trio.to_thread.run_sync(read_files, mountpoint, names)
    admitted = len(kept)
    for frames in kept:
        await frames.aclose()
    return admitted, seen


def test_peer_connections_are_capped_and_local_reads_still_work(mount, tmp_path: Path,
                                                                many_descriptors) -> None:
    """Past the cap a new connection is turned away: an idle connection would make room for
    it, but none of these is idle, since none has asked anything yet (the budget's own test
    is ``test_peer_connections_stay_within_their_budget_and_close_when_idle``); one still in
    its handshake is closed for it (told BUSY) while there is one."""
    roots, sizes = copies(tmp_path, 1, files=300)
    port = free_port()
    (a,) = cluster(mount, [*roots, roots[0]], "--insecure", "--peer-timeout", "10",
                   ports=[port, free_port()], start=1, enter=LIMITED)
    limits = re.search(r"Max open files\s+(\d+)\s+(\d+)",
                       Path(f"/proc/{a.pid}/limits").read_text())
    assert limits is not None and limits.groups() == ("1024", "1024")  # soft raised to hard
    cap = a.status()["served"]["max_connections"]
    assert 0 < cap <= 1024 // 4  # most descriptors stay with local readers
    names = sorted(sizes)
    started = time.monotonic()
    admitted, seen = trio.run(crowd_then_read, port, a.mountpoint, names)
    assert seen == source_digests(roots[0], sizes)  # every local read, none EMFILE
    served = a.status()["served"]
    assert admitted == cap == served["connections"] - served["handshakes_closed"]
    assert served["turned_away"] + served["handshakes_closed"] == CROWD - cap
    assert served["evicted"] == 0
    # 936 connections were turned away: a few lines say so, not 936
    turned = log_lines(a.log, "turned away")
    assert 1 <= len(turned) <= 2 + (time.monotonic() - started) / LOG_INTERVAL_S, turned
    # once they are gone, new peers are admitted again
    deadline = time.monotonic() + 20
    while a.status()["served"]["open_connections"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert a.status()["served"]["open_connections"] == 0
    assert trio.run(join, port, True) is not None


async def slow_sender(port: int, frame: bytes) -> tuple[float, int]:
    """Authenticate, then send ``frame`` a byte every 0.2 s: (seconds from the first byte
    until the server hung up, bytes sent by then)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await client_handshake(FrameStream(stream), b"")
    sent = 0

    async def trickle() -> None:
        nonlocal sent
        for i in range(len(frame)):
            try:
                await stream.send_all(frame[i:i + 1])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            sent += 1
            await trio.sleep(0.2)

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        with trio.move_on_after(30):
            try:
                while await stream.receive_some():
                    pass
            except trio.BrokenResourceError:  # reset: closed with our bytes unread
                pass
        nursery.cancel_scope.cancel()
    await stream.aclose()
    return trio.current_time() - started, sent


async def idle_peer(port: int) -> float:
    """Authenticate and send nothing: seconds until the server hung up."""
    frames = FrameStream(await trio.open_tcp_stream("127.0.0.1", port))
    await client_handshake(frames, b"")
    features = await frames.receive()  # the server's, right after the handshake
    assert features is not None and features.request_id == 0
    started = trio.current_time()
    with trio.move_on_after(30):
        assert await frames.receive() is None
    await frames.aclose()
    return trio.current_time() - started


async def slow_and_idle(port: int, frame: bytes) -> tuple[tuple[float, int], float]:
    results: dict[str, object] = {}

    async def run(name: str, fn, *args) -> None:
        results[name] = await fn(*args)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "slow", slow_sender, port, frame)
        nursery.start_soon(run, "idle", idle_peer, port)
    return results["slow"], results["idle"]  # type: ignore[return-value]


async def not_reading(port: int, get: Get, chunks: int) -> FrameStream:
    """Authenticate, ask for 64 MiB and never read a byte of it."""
    frames = FrameStream(await trio.open_tcp_stream("127.0.0.1", port))
    await client_handshake(frames, b"")
    for i in range(64):
        start = (i % chunks) * MAX_CHUNK
        await frames.send(Kind.GET, i + 1, Get(get.path, get.size, get.mtime_ns, start,
                                               MAX_CHUNK).encode())
    return frames


def test_slow_idle_and_non_reading_peers_are_disconnected(mount, tmp_path: Path) -> None:
    roots, _sizes = copies(tmp_path, 1, files=20)
    big = roots[0] / "big.bin"
    big.write_bytes(os.urandom(4 * MAX_CHUNK))
    port = free_port()
    timeout = 0.5  # --peer-timeout: the frame timeout; the idle one is a multiple
    (a,) = cluster(mount, [*roots, roots[0]], "--insecure", "--peer-timeout", str(timeout),
                   ports=[port, free_port()], start=1)
    st = big.stat()
    get = Get(b"big.bin", st.st_size, st.st_mtime_ns, 0, MAX_CHUNK).encode()
    frame = HEADER.pack(MAGIC, VERSION, Kind.GET, 1, len(get), xxhash.xxh64_intdigest(get)) + get
    (slow_s, sent), idle_s = trio.run(slow_and_idle, port, frame)
    # the trickled frame (a byte per 0.2 s would take 13 s) is cut off after the frame timeout
    assert sent < len(frame) and slow_s < timeout + 3, (slow_s, sent)
    # the idle connection lasts the idle timeout, not forever (30 s here) and not less
    assert idle_timeout(timeout) - 1 <= idle_s < idle_timeout(timeout) + 5, idle_s
    served = a.status()["served"]
    assert served["idle_closed"] == 1 and served["refused"] >= 1

    # a peer that asks for data and does not read it holds its connection for a frame timeout
    async def stuck() -> None:
        frames = await not_reading(port, Get(b"big.bin", st.st_size, st.st_mtime_ns, 0, 1), 4)
        deadline = trio.current_time() + 20
        while trio.current_time() < deadline:
            status = await trio.to_thread.run_sync(a.status)
            if status["served"]["open_connections"] == 0:
                break
            await trio.sleep(0.1)
        await frames.aclose()

    refused = a.status()["served"]["refused"]
    trio.run(stuck)
    served = a.status()["served"]
    assert served["open_connections"] == 0 and served["refused"] == refused + 1
    assert (a.mountpoint / "big.bin").read_bytes() == big.read_bytes()  # the mount is fine
    assert "Traceback" not in a.log.read_text()


async def failed_handshakes(port: int, count: int) -> None:
    """``count`` strangers: a wrong proof, garbage, or a hang-up before authenticating."""
    for i in range(count):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        frames = FrameStream(stream)
        with trio.fail_after(10):
            hello = await frames.receive()
            assert hello is not None and hello.kind == Kind.HELLO
            if i % 3 == 0:
                await frames.send(Kind.AUTH, 0, os.urandom(NONCE_SIZE + 32))
                reply = await frames.receive()
                assert reply is not None and decode_fail(reply.payload)[0] == Fail.REFUSED
            elif i % 3 == 1:
                await stream.send_all(b"GET / HTTP/1.0\r\n\r\n" * 2)
        await trio.aclose_forcefully(stream)


def test_refused_connections_are_logged_rate_limited(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 1, files=20)
    secret = tmp_path / "secret"
    secret.write_bytes(b"the cluster's secret, long enough")
    secret.chmod(0o600)
    port = free_port()
    (a,) = cluster(mount, [*roots, roots[0]], "--secret-file", str(secret),
                   ports=[port, free_port()], start=1)
    started = time.monotonic()
    trio.run(failed_handshakes, port, 450)
    deadline = time.monotonic() + 20
    while a.status()["served"]["refused"] < 450 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert a.status()["served"]["refused"] == 450
    lines = log_lines(a.log, " refused: ")
    assert 1 <= len(lines) <= 2 + (time.monotonic() - started) / LOG_INTERVAL_S, lines
    assert not log_lines(a.log, " lost: ")  # nor one info line per stranger
    want = source_digests(roots[0], sizes)
    assert read_files(a.mountpoint, sorted(sizes)) == want


@needs_ipv6
def test_an_ipv6_loopback_cluster_reads_byte_exact(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 2)
    a, b = cluster(mount, roots, "--insecure", "--cache-size", "64M", host="::1")
    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    assert read_files(a.mountpoint, names) == want
    drop_caches()
    assert read_files(b.mountpoint, names) == want
    ra, rb = reads(a), reads(b)
    # each file from storage once, by its owner: A's misses, and B's own files, which B cached
    # serving A, hits
    assert ra["file_misses"] + rb["file_hits"] == len(names) and rb["file_misses"] == 0
    assert ra["file_peer_hits"] + rb["file_peer_hits"] == len(names)
    me, other = a.status()["peers"]["self"], b.status()["peers"]["self"]
    assert me.startswith("[::1]:") and other.startswith("[::1]:")
    link = a.status()["peers"]["links"][other]
    assert link["state"] == "up" and link["failures"] == 0 and link["bytes"] > 0


@needs_ipv6
def test_a_node_listening_on_every_address_serves_ipv6_and_ipv4_peers(mount,
                                                                      tmp_path: Path) -> None:
    """``--listen [::]:PORT`` takes IPv6 and IPv4 connections, and finds itself in --peers."""
    roots, sizes = copies(tmp_path, 2)
    secret = tmp_path / "secret"
    secret.write_bytes(b"a secret both nodes hold, 32+ bytes")
    secret.chmod(0o600)
    pa, pb = free_port("::"), free_port()
    peers = f"[::1]:{pa},127.0.0.1:{pb}"
    a = mount(roots[0], "--listen", f"[::]:{pa}", "--peers", peers, "--secret-file", str(secret))
    b = mount(roots[1], "--listen", f"127.0.0.1:{pb}", "--peers", peers, "--secret-file",
              str(secret))
    assert a.status()["peers"]["self"] == f"[::1]:{pa}"
    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    assert read_files(a.mountpoint, names) == want
    drop_caches()
    assert read_files(b.mountpoint, names) == want
    ra, rb = reads(a), reads(b)
    # each file from storage once, by its owner: A's misses, and B's own files, which B cached
    # serving A, hits
    assert ra["file_misses"] + rb["file_hits"] == len(names) and rb["file_misses"] == 0
    assert b.status()["peers"]["links"][f"[::1]:{pa}"]["bytes"] > 0
    assert a.status()["peers"]["links"][f"127.0.0.1:{pb}"]["bytes"] > 0
    with socket.create_connection(("127.0.0.1", pa), timeout=10) as s:  # IPv4 too
        assert s.recv(HEADER.size)[:4] == MAGIC


def test_idle_connections_closed_by_either_side_are_no_fault(mount, tmp_path: Path) -> None:
    """A's --peer-timeout is short: its link to B closes itself after idle_timeout(0.3)/2, and
    its server closes B's idle link (B's own limit is far longer) after idle_timeout(0.3).
    Neither close marks a peer down; the next miss reconnects. (Without the request lane,
    whose own connections would serve the misses: test_lane_peers.)"""
    roots, sizes = copies(tmp_path, 2)
    ports = [free_port(), free_port()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    nodes = [mount(root, "--listen", f"127.0.0.1:{port}", "--peers", peers, "--insecure",
                   "--peer-timeout", timeout, "--request-lane", "no")
             for root, port, timeout in zip(roots, ports, ("0.3", "5"), strict=True)]
    others = [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[0]}"]

    def links() -> list[dict]:
        return [m.status()["peers"]["links"][other] for m, other in zip(nodes, others,
                                                                          strict=True)]

    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    for part in (names[:len(names) // 2], names[len(names) // 2:]):
        before = [reads(m)["bytes_from_peers"] for m in nodes]
        for m in nodes:
            assert read_files(m.mountpoint, part) == {n: want[n] for n in part}
        assert all(link["state"] == "up" and link["failures"] == 0 for link in links())
        assert all(reads(m)["bytes_from_peers"] > b for m, b in zip(nodes, before, strict=True))
        deadline = time.monotonic() + 30  # both close after idle_timeout(0.3) = 3 s at most
        while any(link["state"] == "up" for link in links()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [link["state"] for link in links()] == ["idle", "idle"]
    assert nodes[0].status()["served"]["idle_closed"] >= 1  # B's link, closed by A's server


def test_peer_connections_stay_within_their_budget_and_close_when_idle(mount,
                                                                       tmp_path: Path) -> None:
    """Five nodes with --peer-connections 2: each asks four peers and is asked by four, so
    both its budgets are full and idle connections are closed to make room (its links' and its
    server's), yet no node ever holds more than 2 peer sockets each way (sampled from /proc
    all along), no peer is marked down (a request whose connection its server closed goes
    again) and every byte is right. Once reading stops every connection closes by itself
    within the idle timeouts.

    Before: 8 sockets per node (4 each way), none ever closed for room."""
    cap, timeout = 2, 1.0
    roots, sizes = copies(tmp_path, 5, files=200)
    ports = [free_port() for _ in roots]
    nodes = cluster(mount, roots, "--insecure", "--peer-connections", str(cap),
                    "--peer-timeout", str(timeout), ports=ports)
    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    most = [[0, 0] for _ in nodes]  # per node: most sockets seen inbound, outbound
    reading = threading.Event()

    def sample() -> None:
        while reading.is_set():
            states = tcp_states()
            for seen, m, port in zip(most, nodes, ports, strict=True):
                for i, count in enumerate(connections(m.pid, port, states)):
                    seen[i] = max(seen[i], count)
            time.sleep(0.005)

    reading.set()
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for m in nodes:  # the owners fill their caches, one node asking at a time
            assert read_files(m.mountpoint, names) == want
        drop_caches()
        with ThreadPoolExecutor(len(nodes)) as pool:  # then all at once, from the caches
            seen = list(pool.map(lambda m: read_files(m.mountpoint, names[::-1]), nodes))
    finally:
        reading.clear()
        sampler.join()
    assert seen == [want] * len(nodes)
    statuses = [m.status() for m in nodes]
    for status, (inbound, outbound) in zip(statuses, most, strict=True):
        peers, served = status["peers"], status["served"]
        assert peers["max_links"] == served["max_connections"] == cap
        assert outbound <= cap, (outbound, peers)
        # one more only for the instant a connection past a full cap is turned away
        assert inbound <= cap + (served["turned_away"] > 0), (inbound, served)
        assert all(link["failures"] == 0 for link in peers["links"].values()), \
            [(link["failures"], link["last_error"]) for link in peers["links"].values()]
    assert sum(s["peers"]["evicted_links"] for s in statuses) > 0
    assert sum(s["served"]["evicted"] for s in statuses) > 0

    deadline = time.monotonic() + idle_timeout(timeout) + 10
    while time.monotonic() < deadline:
        states = tcp_states()
        if not any(sum(connections(m.pid, port, states))
                   for m, port in zip(nodes, ports, strict=True)):
            break
        time.sleep(0.2)
    states = tcp_states()
    assert [connections(m.pid, port, states) for m, port in zip(nodes, ports, strict=True)] \
        == [(0, 0)] * len(nodes)
    for m in nodes:
        status = m.status()
        assert status["peers"]["open_links"] == status["served"]["open_connections"] == 0
        assert {link["state"] for link in status["peers"]["links"].values()} == {"idle"}


async def flood_then_join(port: int, strangers: int) -> tuple[bool, bool]:
    """``strangers`` connections that never answer the HELLO, held open, then one peer that
    authenticates: (whether it was admitted, whether it was given a file)."""
    held: list[trio.SocketStream] = []
    try:
        for _ in range(0, strangers, 50):  # in batches: the listen backlog never overflows
            async with trio.open_nursery() as nursery:
                for _ in range(50):
                    nursery.start_soon(lambda: _hold(port, held))
        frames = await join(port, True)
        if frames is None:
            return False, False
        with trio.fail_after(10):
            features = await frames.receive()  # sent after the handshake
            assert features is not None and features.request_id == 0
            await frames.send(Kind.GET, 1, Get(b"stranger-test.bin", 5000, 0, 0, 5000).encode())
            reply = await frames.receive()
        await frames.aclose()
        return True, reply is not None and reply.request_id == 1
    finally:
        for stream in held:
            await trio.aclose_forcefully(stream)


async def _hold(port: int, held: list[trio.SocketStream]) -> None:
    with trio.fail_after(10):
        held.append(await trio.open_tcp_stream("127.0.0.1", port))


def test_strangers_never_turn_an_authenticated_peer_away(mount, tmp_path: Path,
                                                         many_descriptors) -> None:
    """500 connections that never authenticate, held open (each lasts its handshake's
    timeout at most): a peer that authenticates meanwhile is admitted and answered, the
    strangers' places closed for it, oldest first. Before, they filled the cap and the
    peer was told BUSY."""
    roots, _sizes = copies(tmp_path, 1, files=20)
    port = free_port()
    (a,) = cluster(mount, [*roots, roots[0]], "--insecure", "--peer-timeout", "10",
                   ports=[port, free_port()], start=1)
    admitted, answered = trio.run(flood_then_join, port, 500)
    served = a.status()["served"]
    assert admitted and answered, served
    assert served["turned_away"] == 0 and served["handshakes_closed"] >= 500 - served[
        "max_connections"], served
