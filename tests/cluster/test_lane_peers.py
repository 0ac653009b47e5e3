"""The request lane's peer rows (``coordlfs.fs.lane_peers``): a small file another node caches,
asked of that peer by the lane on a connection of its own and landed in C, the open answered
without the daemon's loop; a GETATTR of it and the IOCTL of every Python open answered there
too. Real mounts on loopback, real lying peers (``fake_peer.py``), every byte checked by its
digest; the daemon's own path (the lane declining) serves whatever the lane cannot."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash
from conftest import Mount, drop_caches, wait_for
from test_peer_landing import landed, no_landed_file_open, theirs
from test_peers import cluster, copies, fake_peer, free_port, read_files, reads, source_digests

#: the lane and passthrough asked for, whatever the suite's defaults
LANE = ("--insecure", "--passthrough", "yes", "--request-lane", "yes", "--cache-size", "64M")


def lane(m: Mount) -> dict:
    return m.status()["passthrough"]["lane"]


def connected(a: Mount, name: str) -> None:
    """A LOOKUP of a peer's file (a stat) makes A dial the lane's connection to that peer;
    the files looked up after it are the lane's."""
    os.stat(a.mountpoint / name)
    wait_for(lambda: lane(a)["peers"]["connections"] >= 1, "the lane's peer connection")


@dataclass(frozen=True)
class Pair:
    """Two lane mounts over copies of one dataset: A asks, B caches ``mine`` (B's files)."""

    a: Mount
    b: Mount
    roots: list[Path]
    sizes: dict[str, int]
    want: dict[str, str]
    mine: list[str]


def lane_pair(mount, tmp_path: Path, cached: bool = True) -> Pair:
    """A ``Pair``; with ``cached``, B has read (and cached) its files."""
    roots, sizes = copies(tmp_path, 2)
    ports = [free_port(), free_port()]
    a, b = cluster(mount, roots, *LANE, ports=ports)
    pair = Pair(a, b, roots, sizes, source_digests(roots[0], sizes),
                theirs(sorted(sizes), ports))
    if cached:
        assert read_files(b.mountpoint, pair.mine) == {n: pair.want[n] for n in pair.mine}
        b.settled()
    return pair


def test_peer_files_answered_by_the_lane_byte_exact(mount, tmp_path: Path) -> None:
    pair = lane_pair(mount, tmp_path)
    a, roots, sizes, want, mine = pair.a, pair.roots, pair.sizes, pair.want, pair.mine
    connected(a, mine[0])
    rest, before, was = mine[1:], reads(a), lane(a)
    assert read_files(a.mountpoint, rest) == {n: want[n] for n in rest}
    now, counters = lane(a), reads(a)
    assert now["peer_opens"] - was["peer_opens"] == len(rest), now
    assert now["peers"]["files"] == len(rest) and now["peers"]["faults"] == 0, now
    assert counters["file_peer_hits"] - before["file_peer_hits"] == len(rest)
    assert counters["bytes_from_peers"] - before["bytes_from_peers"] == sum(
        sizes[n] for n in rest)
    assert counters["read_misses"] == before["read_misses"]  # no READ reached the daemon
    assert landed(a)["files"] >= len(rest)
    no_landed_file_open(a)
    # their attributes once read (the kernel asks again after a passthrough read): the
    # lane's answer is the source file's, as the daemon's
    getattrs = lane(a)["getattrs"]
    for name in rest[:5]:
        mounted, source = os.stat(a.mountpoint / name), os.stat(roots[0] / name)
        assert [getattr(mounted, f) for f in ("st_mode", "st_size", "st_mtime_ns", "st_uid",
                                               "st_gid", "st_nlink")] == \
            [getattr(source, f) for f in ("st_mode", "st_size", "st_mtime_ns", "st_uid",
                                          "st_gid", "st_nlink")]
    assert lane(a)["getattrs"] > getattrs
    # a second open beside a held one shares its landed file; an ioctl is refused as the
    # daemon refused it (no ioctl: libfuse's ENOSYS, which the kernel gives as ENOTTY)
    ioctls = lane(a)["ioctls"]
    with open(a.mountpoint / rest[0], "rb") as one, open(a.mountpoint / rest[0], "rb") as two:
        assert xxhash.xxh64_hexdigest(one.read()) == xxhash.xxh64_hexdigest(two.read()) \
            == want[rest[0]]
        assert landed(a)["open_files"] == 1
        assert not os.isatty(one.fileno())
        with pytest.raises(OSError) as refused:
            fcntl.ioctl(one.fileno(), termios.TCGETS, bytes(64))
        assert refused.value.errno == errno.ENOTTY
    assert lane(a)["ioctls"] > ioctls
    no_landed_file_open(a)


@pytest.mark.parametrize("mode", ["lane-badsum", "lane-badlen", "lane-midframe", "lane-hang",
                                  "lane-garbage", "lane-trickle"])
def test_a_lying_peer_never_fails_a_read_by_the_lane(mount, tmp_path: Path, mode: str) -> None:
    """The peer says it serves, then lies to the lane's request: the lane lands nothing,
    closes its connection and leaves the open to the daemon, which reads local storage."""
    roots, sizes = copies(tmp_path, 1)
    ports = [free_port(), free_port()]
    with fake_peer(ports[1], mode):
        (a,) = cluster(mount, [*roots, roots[0]], *LANE, "--peer-timeout", "0.5",
                       ports=ports, start=1)
        names = theirs(sorted(sizes), ports)
        want = source_digests(roots[0], sizes)
        connected(a, names[0])
        slowest = 0.0
        for name in names[1:]:
            started = time.monotonic()
            assert xxhash.xxh64_hexdigest((a.mountpoint / name).read_bytes()) == want[name]
            slowest = max(slowest, time.monotonic() - started)
        # the lane's wait (the peer timeout), then the daemon's, plus a loaded machine's slack
        assert slowest < 0.5 + 0.5 + 1.5
        peers = lane(a)["peers"]
        assert peers["faults"] >= 1 and peers["files"] == 0, peers
        assert reads(a)["bytes_from_peers"] == 0
        assert landed(a)["files"] == 0  # nothing of a lie lands


def test_a_lane_connection_the_peer_closed_is_dialled_again(mount, tmp_path: Path) -> None:
    """B's server closes A's idle lane connections (B's --peer-timeout 0.3: idle after 3 s):
    A's lane finds them closed before its next request (no fault), the daemon serves that
    open, and the next files are the lane's again on a new connection."""
    roots, sizes = copies(tmp_path, 2, files=200)
    ports = [free_port(), free_port()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    a, b = (mount(root, "--listen", f"127.0.0.1:{port}", "--peers", peers, *LANE, *options)
            for root, port, options in zip(roots, ports, ((), ("--peer-timeout", "0.3")),
                                           strict=True))
    want = source_digests(roots[0], sizes)
    mine = theirs(sorted(sizes), ports)
    assert read_files(b.mountpoint, mine) == {n: want[n] for n in mine}
    b.settled()
    connected(a, mine[0])
    first, second, third = mine[1:20], mine[20:40], mine[40:]
    assert read_files(a.mountpoint, first) == {n: want[n] for n in first}
    # B serves the lane's connections in C, each on its own idle timer: all of them closed
    up = lane(a)["peers"]["connections"]
    wait_for(lambda: b.status()["served"]["in_c"]["idle_closed"] >= up,
             "B closing the idle connections")
    assert read_files(a.mountpoint, second) == {n: want[n] for n in second}
    wait_for(lambda: lane(a)["peers"]["connections"] >= 1, "the lane's connections again")
    files = lane(a)["peers"]["files"]
    assert read_files(a.mountpoint, third) == {n: want[n] for n in third}
    peers = lane(a)["peers"]
    assert peers["closed_by_peer"] >= 1 and peers["faults"] == 0, peers
    assert peers["files"] > files
    assert reads(a)["bytes_from_peers"] == sum(sizes[n] for n in mine[1:])
    link = a.status()["peers"]["links"][f"127.0.0.1:{ports[1]}"]
    assert link["failures"] == 0


def test_a_peer_file_held_by_the_lane_survives_its_source_changing(mount,
                                                                    tmp_path: Path) -> None:
    """An open the lane answered with a peer's file reads the version it opened to its end,
    whatever the source does meanwhile; a new open reads the new version; an unchanged file
    opened after it is still the lane's."""
    pair = lane_pair(mount, tmp_path)
    a, roots, mine = pair.a, pair.roots, pair.mine
    connected(a, mine[0])
    name = mine[1]
    old = (roots[0] / name).read_bytes()
    new = os.urandom(len(old) + 4096)
    opens = lane(a)["peer_opens"]
    with open(a.mountpoint / name, "rb", buffering=0) as held:
        assert lane(a)["peer_opens"] == opens + 1
        head = held.read(len(old) // 2)
        time.sleep(0.01)  # another mtime
        (roots[0] / name).write_bytes(new)  # every node's copy changes
        shutil.copy2(roots[0] / name, roots[1] / name)
        assert head + held.read() == old
        assert os.fstat(held.fileno()).st_size == len(old)
        assert (a.mountpoint / name).read_bytes() == new
    no_landed_file_open(a)
    assert (a.mountpoint / name).read_bytes() == new
    drop_caches()
    want = pair.want
    assert read_files(a.mountpoint, mine[2:6]) == {n: want[n] for n in mine[2:6]}
    assert lane(a)["peer_opens"] >= opens + 5
