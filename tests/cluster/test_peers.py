"""Partitioned caching: placement, and real mounts on loopback fetching misses from each other.

Every node is a real coordlfs daemon with its own copy of the dataset; misbehaving peers are
real processes (``fake_peer.py``); hostile requests go over real TCP to a real mount.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
import xxhash
from conftest import Mount, digests, drop_caches, force_unmount, make_dataset, run_cli

from coordlfs.control import Control
from coordlfs.daemon.config import default_cache_dir
from coordlfs.errors import UserError
from coordlfs.peers.budget import DEFAULT_LIMIT
from coordlfs.peers.placement import (
    Address,
    find_self,
    is_loopback,
    owner,
    parse_address,
    parse_peers,
    read_secret,
)
from coordlfs.peers.server import (
    LOG_INTERVAL_S,
    PeerServer,
    RateLimitedLog,
    connection_cap,
    listen_socket,
)
from coordlfs.peers.wire import (
    FEATURES,
    GET_HEADER,
    HEADER,
    MAGIC,
    VERSION,
    Fail,
    FrameStream,
    Get,
    Kind,
    client_handshake,
    decode_fail,
)
from coordlfs.protocol.order import epoch_order
from coordlfs.system.processes import process_alive
from coordlfs.testbed.netns import cluster_network

HERE = Path(__file__).parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node(port: int) -> Address:
    return Address("127.0.0.1", port)


def copies(tmp_path: Path, count: int, files: int = 120) -> tuple[list[Path], dict[str, int]]:
    """``count`` copies of one dataset, as each server of a cluster has its own."""
    first = tmp_path / "src0"
    first.mkdir()
    sizes = make_dataset(first, files)
    roots = [first]
    for i in range(1, count):
        roots.append(tmp_path / f"src{i}")
        shutil.copytree(first, roots[-1], copy_function=shutil.copy2)  # same size and mtime
    return roots, sizes


def cluster(mount: Callable[..., Mount], roots: list[Path], *options: str,
            ports: list[int] | None = None, start: int | None = None,
            host: str = "127.0.0.1", enter: tuple[str, ...] = ()) -> list[Mount]:
    """A mount per root (the first ``start`` of them), each listening on its port of
    ``host`` with every port in --peers; each started behind ``enter`` (such as prlimit)."""
    ports = ports or [free_port(host) for _ in roots]
    where = str(Address(host, 0))[:-2]  # an IPv6 host in brackets
    peers = ",".join(f"{where}:{p}" for p in ports)
    return [mount(root, "--listen", f"{where}:{port}", "--peers", peers, *options, enter=enter)
            for root, port in list(zip(roots, ports, strict=True))[:start]]


@contextlib.contextmanager
def fake_peer(port: int, mode: str) -> Iterator[None]:
    """A misbehaving peer (``fake_peer.py`` in ``mode``) on ``port`` while the block runs."""
    fake = subprocess.Popen([sys.executable, str(HERE / "fake_peer.py"), str(port), mode],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))})
    try:
        assert fake.stdout is not None and fake.stdout.readline().strip() == "ready"
        yield
    finally:
        fake.kill()
        fake.wait()


def source_digests(root: Path, sizes: dict[str, int]) -> dict[str, str]:
    """The dataset's files only (not the generator's manifest)."""
    every = digests(root)
    return {name: every[name] for name in sizes}


def read_files(mountpoint: Path, names: list[str]) -> dict[str, str]:
    return {n: xxhash.xxh64_hexdigest((mountpoint / n).read_bytes()) for n in names}


def reads(m: Mount) -> dict[str, int]:
    return m.status()["reads"]


# -- placement -------------------------------------------------------------------------------


def test_owner_is_stable_balanced_and_moves_little() -> None:
    paths = [f"class{i % 7}/img{i}.jpg".encode() for i in range(20_000)]
    two = (node(1), node(2))
    owners = [owner(p, two) for p in paths]
    assert owners == [owner(p, tuple(reversed(two))) for p in paths]  # list order is irrelevant
    share = owners.count(node(1)) / len(paths)
    assert 0.47 < share < 0.53
    three = (*two, node(3))
    moved = [a != owner(p, three) for p, a in zip(paths, owners, strict=True)]
    assert 0.30 < sum(moved) / len(paths) < 0.37  # about 1/3 move, all to the new node
    assert all(owner(p, three) == node(3) for p, m in zip(paths, moved, strict=True) if m)


@pytest.mark.parametrize(("text", "message"), [
    ("host", "expected HOST:PORT"), ("host:0", "port 1-65535"), ("host:99999", "port 1-65535"),
    (":80", "expected HOST:PORT"), ("a b:80", "expected HOST:PORT"), ("::1:80", "HOST:PORT"),
    ("::1:80", r"in brackets, as \[::1\]:7878"), ("[::1]", "expected HOST:PORT"),
    ("[host]:80", "not an IPv6 address"), ("[127.0.0.1]:80", "not an IPv6 address"),
    ("[::1:80", "expected HOST:PORT"), ("h]:80", "expected HOST:PORT"), ("[]:80", "IPv6"),
])
def test_bad_addresses_are_refused(text: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse_address(text, "peer")


@pytest.mark.parametrize(("text", "host", "port"), [
    ("[::1]:7878", "::1", 7878), ("[::]:7878", "::", 7878),
    ("[fe80::1%eth0]:7878", "fe80::1%eth0", 7878), (" [2001:db8::7]:1 ", "2001:db8::7", 1),
    ("127.0.0.1:7878", "127.0.0.1", 7878), ("host1:7878", "host1", 7878),
])
def test_addresses_ipv4_ipv6_and_names(text: str, host: str, port: int) -> None:
    """IPv6 literals in brackets (``--listen [::]:PORT`` was refused as unparsable); printed
    back as written, since placement hashes the entries' text."""
    address = parse_address(text, "peer")
    assert address == Address(host, port) and str(address) == text.strip()


def test_ipv6_loopback_and_finding_this_node() -> None:
    assert is_loopback(Address("::1", 7001)) and is_loopback(Address("127.0.0.1", 7001))
    assert not is_loopback(Address("::", 7001)) and not is_loopback(Address("2001:db8::1", 1))
    peers = parse_peers("[::1]:7001,[::1]:7002,[2001:db8::7]:7001,127.0.0.1:7003")
    assert find_self(Address("::1", 7002), peers) == Address("::1", 7002)
    assert find_self(Address("::", 7001), peers) == Address("::1", 7001)  # db8: not here
    assert find_self(Address("::", 7003), peers) == Address("127.0.0.1", 7003)  # dual-stack
    assert find_self(Address("0.0.0.0", 7001), peers) is None  # IPv4 only: not [::1]
    with pytest.raises(UserError, match="names this node twice"):
        find_self(Address("::", 7001), parse_peers("[::1]:7001,[0::1]:7001"))


def test_refusals_are_logged_at_most_once_per_interval(caplog) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("coordlfs.test"), logging.WARNING, 10.0,
                             clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="coordlfs.test"):
        for i in range(1000):
            now[0] = i * 0.05  # 1000 refusals in 50 s
            limited("refused %d", i)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and lines[0] == "refused 0"
    assert lines[1] == "refused 200 (199 more not logged in the last 10 s)"


def test_out_of_descriptors_the_server_waits_and_logs_once(caplog) -> None:
    """When local readers hold every descriptor, accept fails with EMFILE: the server retries
    (the peer waits in the backlog) and says so once, where trio's serve_listeners logged an
    ERROR ten times a second; once a descriptor is free the peer is served."""
    sock = listen_socket(Address("127.0.0.1", 0))
    server = PeerServer(sock, b"", 2.0, None, None)  # type: ignore[arg-type]  # handshake only
    client = socket.socket()
    client.settimeout(10)

    async def main() -> bytes:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            await trio.sleep(0.1)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            used = {int(fd) for fd in os.listdir("/proc/self/fd")}
            lowest_free = min(set(range(len(used) + 1)) - used)
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no new one
            try:
                client.connect(sock.getsockname())  # completed by the kernel, not accepted
                await trio.sleep(1.0)  # ten retries
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            hello = await trio.to_thread.run_sync(client.recv, HEADER.size)
            nursery.cancel_scope.cancel()
        return hello

    with caplog.at_level(logging.INFO):
        hello = trio.run(main)
    client.close()
    assert hello[:4] == MAGIC and hello[5] == Kind.HELLO
    lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, lines
    assert "Too many open files" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_connection_cap_leaves_most_descriptors_to_readers() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        assert connection_cap() == DEFAULT_LIMIT == 64  # a fixed number, whatever the nodes
        assert connection_cap(100) == 100
        assert connection_cap(4096) == 256  # at most a quarter of 1024
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard))
        assert connection_cap() == 25
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert LOG_INTERVAL_S >= 1


def test_peer_lists_and_finding_this_node() -> None:
    with pytest.raises(UserError, match="twice"):
        parse_peers("127.0.0.1:1,127.0.0.1:1")
    with pytest.raises(UserError, match="empty"):
        parse_peers(" , ")
    peers = parse_peers("127.0.0.1:7001, 127.0.0.1:7002,10.255.255.254:7001")
    assert find_self(node(7002), peers) == node(7002)
    assert find_self(Address("0.0.0.0", 7001), peers) == node(7001)  # 10.255.255.254: not here
    assert find_self(node(7003), peers) is None
    with pytest.raises(UserError, match="names this node twice"):
        find_self(Address("0.0.0.0", 7001), parse_peers("127.0.0.1:7001,localhost:7001"))


def test_secret_files_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"  0123456789abcdef0123  \n")
    path.chmod(0o600)
    assert read_secret(str(path)) == b"0123456789abcdef0123"
    path.chmod(0o640)
    with pytest.raises(UserError, match="chmod 600"):
        read_secret(str(path))
    path.chmod(0o600)
    path.write_bytes(b"short")
    with pytest.raises(UserError, match="16 to 4096 bytes"):
        read_secret(str(path))
    with pytest.raises(UserError, match="cannot read secret file"):
        read_secret(str(tmp_path / "missing"))


# -- real mounts on loopback -----------------------------------------------------------------


def test_two_mounts_serve_each_others_misses_byte_exact(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 2)
    a, b = cluster(mount, roots, "--insecure", "--cache-size", "64M")
    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    random.Random(1).shuffle(names)
    assert read_files(a.mountpoint, names) == {n: want[n] for n in names}
    drop_caches()
    assert read_files(b.mountpoint, names) == {n: want[n] for n in names}
    ra, rb = reads(a), reads(b)
    # Each file came from storage once in the whole cluster, read by its owner: A's misses,
    # and B's own files, which B cached serving A, hits.
    assert ra["file_misses"] + rb["file_hits"] == len(names) and rb["file_misses"] == 0
    assert ra["bytes_from_source"] + rb["bytes_from_source"] == sum(sizes.values())
    assert ra["file_peer_hits"] + rb["file_peer_hits"] == len(names)
    link = a.status()["peers"]["links"][f"127.0.0.1:{b.status()['peers']['self'].split(':')[1]}"]
    assert link["state"] == "up" and link["failures"] == 0 and link["bytes"] > 0
    assert b.status()["served"]["bytes"] == link["bytes"]


def test_nodes_caching_half_each_read_no_storage_after_the_first_epoch(mount,
                                                                       tmp_path: Path) -> None:
    """Two nodes, each caching its half, each reading a disjoint random half per epoch (as
    DistributedSampler does): from the second epoch on neither reads storage."""
    roots, sizes = copies(tmp_path, 2, files=200)
    cache = sum(sizes.values()) // 2 + max(sizes.values())  # half, and room for one file more
    nodes = cluster(mount, roots, "--insecure", "--cache-size", str(cache))
    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    for epoch in range(3):
        order = epoch_order(7, epoch, len(names))
        before = [reads(m) for m in nodes]
        for rank, m in enumerate(nodes):
            mine = [names[i] for i in order[rank::2]]
            assert read_files(m.mountpoint, mine) == {n: want[n] for n in mine}
        drop_caches()  # the next epoch's reads reach the daemons, not the kernel's pages
        stored = sum(reads(m)["bytes_from_source"] - b["bytes_from_source"]
                     for m, b in zip(nodes, before, strict=True))
        if epoch == 0:
            assert stored == sum(sizes.values())
        else:
            assert stored == 0, f"epoch {epoch} read {stored} bytes from storage"
    assert all(m.status()["cache"]["used_bytes"] <= cache for m in nodes)


def test_a_peer_down_at_mount_time_or_killed_mid_epoch(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 2)
    ports = [free_port(), free_port()]
    # A's cache holds a little more than its share: what B should hold goes to B once B is up.
    room = str(int(sum(sizes.values()) * 0.55))
    (a,) = cluster(mount, roots, "--insecure", "--peer-timeout", "1", "--cache-size", room,
                   ports=ports, start=1)
    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    assert read_files(a.mountpoint, names) == want  # B was never started
    link = a.status()["peers"]["links"][f"127.0.0.1:{ports[1]}"]
    assert link["failures"] >= 1 and "refused" in link["last_error"].lower()
    assert reads(a)["bytes_from_source"] == sum(sizes.values())
    assert a.status()["cache"]["used_bytes"] > 0.5 * sum(sizes.values())  # B's share too
    # B comes up late: after the backoff A uses it.
    b = mount(roots[1], "--listen", f"127.0.0.1:{ports[1]}", "--peers",
              ",".join(f"127.0.0.1:{p}" for p in ports), "--insecure")
    time.sleep(1.2)
    drop_caches()
    deadline = time.monotonic() + 40
    while reads(a)["bytes_from_peers"] == 0 and time.monotonic() < deadline:
        assert read_files(a.mountpoint, names) == want
        drop_caches()
    assert reads(a)["bytes_from_peers"] > 0
    # B is killed in the middle of an epoch: A's readers still get every byte right.
    drop_caches()
    half = len(names) // 2
    assert read_files(a.mountpoint, names[:half]) == {n: want[n] for n in names[:half]}
    os.kill(b.pid, signal.SIGKILL)
    started = time.monotonic()
    assert read_files(a.mountpoint, names[half:]) == {n: want[n] for n in names[half:]}
    assert time.monotonic() - started < 20
    status = a.status()["peers"]["links"][f"127.0.0.1:{ports[1]}"]
    assert status["state"] in ("down", "idle") and status["failures"] >= 2


@pytest.mark.parametrize("mode", ["silent", "hang", "badauth", "badsum", "badlen", "garbage",
                                  "midframe"])
def test_a_misbehaving_peer_never_fails_a_read(mount, tmp_path: Path, mode: str) -> None:
    roots, sizes = copies(tmp_path, 1)
    ports = [free_port(), free_port()]
    with fake_peer(ports[1], mode):
        (a,) = cluster(mount, [*roots, roots[0]], "--insecure", "--peer-timeout", "0.5",
                       ports=ports, start=1)
        theirs = [n for n in sorted(sizes) if owner(n.encode(), (node(ports[0]),
                                                                 node(ports[1]))) != node(ports[0])]
        want = source_digests(roots[0], sizes)
        slowest = 0.0
        for name in theirs:
            started = time.monotonic()
            assert xxhash.xxh64_hexdigest((a.mountpoint / name).read_bytes()) == want[name]
            slowest = max(slowest, time.monotonic() - started)
        assert slowest < 0.5 + 1.5  # at most the timeout, plus a loaded machine's slack
        link = a.status()["peers"]["links"][f"127.0.0.1:{ports[1]}"]
        assert link["failures"] >= 1 and link["last_error"]
        assert reads(a)["bytes_from_peers"] == 0
        assert a.status()["peers"]["landed"]["files"] == 0  # nothing of a lie lands


def test_a_peer_with_another_version_of_a_file_is_never_used(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 2)
    ports = [free_port(), free_port()]
    pair = (node(ports[0]), node(ports[1]))
    theirs = [n for n in sorted(sizes) if owner(n.encode(), pair) == pair[1]]
    changed = roots[1] / theirs[0]  # B's copy: same size, other bytes and mtime
    changed.write_bytes(bytes(len(changed.read_bytes())))
    a, _b = cluster(mount, roots, "--insecure", ports=ports)
    assert (a.mountpoint / theirs[0]).read_bytes() == (roots[0] / theirs[0]).read_bytes()
    assert (a.mountpoint / theirs[1]).read_bytes() == (roots[0] / theirs[1]).read_bytes()
    link = a.status()["peers"]["links"][str(pair[1])]
    assert link["stale"] == 1 and link["files"] == 1


def test_secrets_are_checked_both_ways(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 3)
    secrets = []
    texts = (b"one shared secret, 32 bytes long", b"another secret of a stranger!!")
    for i, text in enumerate(texts):
        secrets.append(tmp_path / f"secret{i}")
        secrets[-1].write_bytes(text)
        secrets[-1].chmod(0o600)
    ports = [free_port() for _ in range(3)]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    nodes = [mount(root, "--listen", f"127.0.0.1:{port}", "--peers", peers, "--secret-file",
                   str(secret), "--peer-timeout", "1")
             for root, port, secret in zip(roots, ports, (secrets[0], secrets[0], secrets[1]),
                                           strict=True)]
    want = source_digests(roots[0], sizes)
    assert read_files(nodes[0].mountpoint, sorted(sizes)) == want
    links = nodes[0].status()["peers"]["links"]
    assert links[f"127.0.0.1:{ports[1]}"]["bytes"] > 0  # same secret
    stranger = links[f"127.0.0.1:{ports[2]}"]
    assert stranger["bytes"] == 0 and "authentication" in stranger["last_error"]
    assert nodes[2].status()["served"]["refused"] >= 1


def _raw_get(path: bytes, size: int = 10, length: int = 1) -> bytes:
    return GET_HEADER.pack(size, 0, 0, length) + path


async def _hostile(port: int, name: Path) -> list[tuple[str, object]]:
    """Requests a stranger could send; returns what came back for each."""
    seen: list[tuple[str, object]] = []
    # 1. No handshake: a GET straight away is refused and the connection closed.
    frames = FrameStream(await trio.open_tcp_stream("127.0.0.1", port))
    hello = await frames.receive()
    assert hello is not None and hello.kind == Kind.HELLO
    await frames.send(Kind.GET, 1, _raw_get(b"x"))
    reply = await frames.receive()
    seen.append(("unauthenticated", reply and (reply.kind, decode_fail(reply.payload)[0])))
    seen.append(("then", await frames.receive()))
    await frames.aclose()
    # 2. Authenticated (the mount is --insecure), paths that leave the dataset.
    frames = FrameStream(await trio.open_tcp_stream("127.0.0.1", port))
    await client_handshake(frames, b"")
    features = await frames.receive()  # what the server serves beyond GET
    seen.append(("features", features and (features.kind, features.request_id,
                                           features.payload)))
    for i, path in enumerate((b"../secret", b"/etc/passwd", b"a\0b", b"out/passwd",
                              b"outfile", b"class0/../../x"), 1):
        await frames.send(Kind.GET, i, _raw_get(path))
        reply = await frames.receive()
        seen.append((path.decode(errors="replace"),
                     reply and (reply.kind, decode_fail(reply.payload)[0])))
    # the connection still serves a good request
    st = name.stat()
    await frames.send(Kind.GET, 99, Get(f"{name.parent.name}/{name.name}".encode(), st.st_size,
                                        st.st_mtime_ns, 0, st.st_size).encode())
    reply = await frames.receive()
    seen.append(("good", reply and reply.payload == name.read_bytes()))
    # 3. A frame that announces 4 GiB: the connection is closed, nothing allocated.
    await frames.stream.send_all(HEADER.pack(MAGIC, VERSION, Kind.GET, 5, 0xFFFFFFFF, 0))
    with trio.fail_after(5):
        seen.append(("oversized", await frames.receive()))
    await frames.aclose()
    return seen


def test_hostile_requests_are_refused_and_the_mount_stays_up(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 1)
    os.symlink("/etc", roots[0] / "out")
    os.symlink("/etc/passwd", roots[0] / "outfile")
    port = free_port()
    (a,) = cluster(mount, [*roots, roots[0]], "--insecure", ports=[port, free_port()], start=1)
    name = min(n for n in sizes if n.count("/") == 1)
    seen = dict(trio.run(_hostile, port, roots[0] / name))
    refused = (Kind.FAIL, Fail.REFUSED)
    assert seen["unauthenticated"] == refused and seen["then"] is None
    for path in ("../secret", "/etc/passwd", "a\0b", "out/passwd", "outfile", "class0/../../x"):
        assert seen[path] == refused, path
    assert seen["good"] is True and seen["oversized"] is None
    assert seen["features"] == (Kind.DATA, 0, b" ".join(FEATURES))
    served = a.status()["served"]
    assert served["refused"] >= 8 and served["connections"] == 2
    assert (a.mountpoint / "outfile").is_symlink()  # the mount still works


def test_nodes_in_their_own_network_namespaces(mount, tmp_path: Path) -> None:
    """Two nodes with their own addresses, joined by veth pairs, with a shared secret."""
    roots, sizes = copies(tmp_path, 2)
    secret = tmp_path / "secret"
    secret.write_bytes(b"a secret shared by both nodes, 40 bytes..")
    secret.chmod(0o600)
    with cluster_network(2, link="1gbit") as net:
        peers = ",".join(f"{n.address}:7878" for n in net)
        nodes = [mount(root, "--listen", f"{n.address}:7878", "--peers", peers,
                       "--secret-file", str(secret), enter=tuple(n.enter()))
                 for root, n in zip(roots, net, strict=True)]
        try:
            want = source_digests(roots[0], sizes)
            for m in nodes:
                assert read_files(m.mountpoint, sorted(sizes)) == want
            a, b = (m.status() for m in nodes)
            assert a["reads"]["file_misses"] + b["reads"]["file_hits"] == len(sizes)
            assert a["peers"]["self"] == f"{net[0].address}:7878"
            link = a["peers"]["links"][f"{net[1].address}:7878"]
            assert link["state"] == "up" and link["bytes"] == b["served"]["bytes"] > 0
            # each daemon lives in its node's network, not in ours
            ours = os.readlink("/proc/self/ns/net")
            assert len({os.readlink(f"/proc/{m.pid}/ns/net") for m in nodes} - {ours}) == 2
        finally:
            for m in nodes:  # unmount before the namespaces go
                force_unmount(m.mountpoint, m.pid)


def test_peer_commands_show_the_cluster(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 2, files=20)
    a, b = cluster(mount, roots, "--insecure")
    control = Control(a.mountpoint)
    listing = control.request("peer.list")
    me = listing["peers"]["self"]
    assert me in listing["peers"]["nodes"] and len(listing["peers"]["links"]) == 1
    owners = {control.request("peer.owner", path=n)["owner"] for n in sizes}
    assert owners == set(listing["peers"]["nodes"])
    name = sorted(sizes)[0]
    reply = control.request("peer.owner", path=name)
    assert reply["here"] == (reply["owner"] == me)
    for bad in ({"path": "/abs"}, {"path": 3}, {}):
        result = run_cli("stats", str(a.mountpoint))  # the mount stays up through each
        assert result.returncode == 0
        with pytest.raises(Exception, match="path"):
            control.request("peer.owner", **bad)
    assert "peers" in run_cli("stats", str(b.mountpoint)).stdout


def test_bad_peer_options_are_one_line_errors(tmp_path: Path) -> None:
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    weak = tmp_path / "weak"
    weak.write_bytes(b"0123456789abcdef0123")
    weak.chmod(0o644)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cases = [
        (["--peers", "127.0.0.1:7001"], "--peers needs --listen"),
        (["--listen", "127.0.0.1:7001"], "--secret-file"),
        (["--secret-file", str(weak)], "go with --listen"),
        (["--listen", "127.0.0.1:7001", "--peers", "10.0.0.1:7001", "--insecure"],
         "loopback addresses only"),
        (["--listen", "0.0.0.0:7001", "--insecure"], "loopback addresses only"),
        (["--listen", "127.0.0.1:7001", "--secret-file", str(weak)], "chmod 600"),
        (["--listen", "127.0.0.1:7001", "--secret-file", str(tmp_path / "none")],
         "cannot read secret file"),
        (["--listen", "localhost", "--insecure"], "expected HOST:PORT"),
        (["--listen", "::1:7001", "--insecure"], "an IPv6 address goes in brackets"),
        (["--listen", "[::]:7001", "--insecure"], "loopback addresses only"),
        (["--listen", "[::1]:7001", "--peers", "[::1]:7001,[2001:db8::1]:7001", "--insecure"],
         "loopback addresses only"),
        (["--listen", "127.0.0.1:7001", "--insecure", "--peer-timeout", "0"], "--peer-timeout"),
        (["--listen", "127.0.0.1:7001", "--insecure", "--peers", "127.0.0.1:7001,localhost:7001"],
         "names this node twice"),
        (["--listen", f"127.0.0.1:{port}", "--insecure"], "cannot listen on"),
    ]
    try:
        for args, message in cases:
            result = run_cli("mount", str(src), str(mnt), "--cache-size", "16M", *args)
            assert result.returncode != 0, args
            assert message in result.stderr, (args, result.stderr)
            assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
            assert not os.path.ismount(mnt)
    finally:
        busy.close()
    # the daemon that could not listen had made its cache directory: it removed it on the way out
    assert not os.path.exists(default_cache_dir(str(src)))
    assert stat.S_IMODE(weak.stat().st_mode) == 0o644
    assert process_alive(os.getpid())
