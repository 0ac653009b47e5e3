"""An order handed over (``prefetch``): the files peers cache are fetched in batches (GETMANY)
into the holding area ahead of the readers, on real mounts over loopback, with misbehaving
peers as real processes (``fake_peer.py``); and the holding area's bounds, in-process."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from conftest import Mount
from test_peers import (
    cluster,
    copies,
    fake_peer,
    free_port,
    node,
    read_files,
    reads,
    source_digests,
)

from coordlfs.control import Control
from coordlfs.peers import hold as peer_hold
from coordlfs.peers.hold import PeerHold
from coordlfs.peers.placement import owner
from coordlfs.peers.wire import MAX_CHUNK
from coordlfs.protocol import spec as control_spec


def hand_over(m: Mount, names: list[str]) -> dict:
    """Hand the order to ``m`` and wait until every file it queued for peers has come (or
    failed); returns the holding area's status."""
    Control(m.mountpoint).call(control_spec.PREFETCH, paths=names)
    deadline = time.monotonic() + 30
    while (held := m.status()["peers"]["held"])["waiting"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held["waiting"] == 0, held
    return held


def owned_by(names: list[str], ports: list[int], which: int) -> list[str]:
    nodes = tuple(node(p) for p in ports)
    return [n for n in names if owner(n.encode(), nodes) == nodes[which]]


def test_an_order_handed_over_comes_in_batches_byte_exact(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 2, files=100)
    ports = [free_port(), free_port()]
    a, b = cluster(mount, roots, "--insecure", "--cache-size", "64M", ports=ports)
    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    theirs = owned_by(names, ports, 1)
    assert sum(sizes[n] for n in theirs) < peer_hold.CAPACITY  # all of it fits the area
    first, rest = theirs[0], [n for n in names if n != theirs[0]]
    assert read_files(a.mountpoint, [first]) == {first: want[first]}  # the link is up
    held = hand_over(a, rest)
    assert held["queued"] == held["fetched"] == len(theirs) - 1 and held["not_served"] == 0
    assert held["reserved_bytes"] == sum(sizes[n] for n in theirs[1:])
    assert read_files(a.mountpoint, rest) == {n: want[n] for n in rest}
    held = a.status()["peers"]["held"]
    assert held["hits"] == len(theirs) - 1
    assert held["reserved_bytes"] == 0 and held["held"] == 0  # each file served once
    served = b.status()["served"]
    assert served["batches"] <= len(theirs) // 2  # many files per request
    assert served["requests"] == len(theirs)
    assert reads(a)["file_peer_hits"] == len(theirs)
    link = a.status()["peers"]["links"][f"127.0.0.1:{ports[1]}"]
    assert link["failures"] == 0 and link["bytes"] == sum(sizes[n] for n in theirs)


def test_files_a_batch_cannot_serve_fail_alone(mount, tmp_path: Path) -> None:
    """On B, one of its files changed (STALE), one is gone (MISS), one is a symlink
    (REFUSED): A reads those from its own storage, every other file of the batches from B."""
    roots, sizes = copies(tmp_path, 2, files=100)
    ports = [free_port(), free_port()]
    names = sorted(sizes)
    theirs = owned_by(names, ports, 1)
    # all of it fits the area: a full area makes its batches wait (the ports decide the split,
    # and 160 files overflowed it now and then)
    assert sum(sizes[n] for n in theirs) < peer_hold.CAPACITY
    stale, gone, linked = theirs[1:4]
    os.utime(roots[1] / stale, ns=(1, 1))
    os.unlink(roots[1] / gone)
    os.rename(roots[1] / linked, roots[1] / (linked + ".real"))
    os.symlink(Path(linked).name + ".real", roots[1] / linked)
    a, b = cluster(mount, roots, "--insecure", "--cache-size", "64M", ports=ports)
    want = source_digests(roots[0], sizes)
    assert read_files(a.mountpoint, theirs[:1]) == {theirs[0]: want[theirs[0]]}
    rest = [n for n in names if n != theirs[0]]
    held = hand_over(a, rest)
    assert held["not_served"] == 3 and held["fetched"] == len(theirs) - 4
    assert read_files(a.mountpoint, rest) == {n: want[n] for n in rest}
    served = b.status()["served"]
    assert served["stale"] >= 1 and served["misses"] >= 1 and served["refused"] >= 1
    link = a.status()["peers"]["links"][f"127.0.0.1:{ports[1]}"]
    assert link["failures"] == 0 and link["state"] == "up"
    assert reads(a)["file_peer_hits"] == len(theirs) - 3


@pytest.mark.parametrize("mode", ["many-badlen", "many-badsum", "many-short", "many-kind"])
def test_a_peer_lying_in_a_batch_never_yields_wrong_bytes(mount, tmp_path: Path,
                                                         mode: str) -> None:
    roots, sizes = copies(tmp_path, 1)
    ports = [free_port(), free_port()]
    with fake_peer(ports[1], mode):
        (a,) = cluster(mount, [*roots, roots[0]], "--insecure", "--peer-timeout", "0.5",
                       ports=ports, start=1)
        names = sorted(sizes)
        want = source_digests(roots[0], sizes)
        theirs = owned_by(names, ports, 1)
        # a GET answered MISS: the link is up and knows the fake serves GETMANY
        assert read_files(a.mountpoint, theirs[:1]) == {theirs[0]: want[theirs[0]]}
        held = hand_over(a, names[1:])
        assert held["fetched"] == 0 and held["not_served"] > 0
        assert read_files(a.mountpoint, names) == want
        link = a.status()["peers"]["links"][f"127.0.0.1:{ports[1]}"]
        assert link["failures"] >= 1 and link["last_error"]
        assert reads(a)["bytes_from_peers"] == 0


# -- the holding area's bounds, in-process ---------------------------------------------------

FILE = 100_000


class FakeLink:
    address = "peer"


class FakePeers:
    """One peer that holds every file (its bytes: the path repeated), answering after 10 ms;
    it checks the holding area's bound at every request."""

    def __init__(self) -> None:
        self.link = FakeLink()
        self.links = {"peer": self.link}
        self.hold: PeerHold | None = None
        self.most_reserved = 0
        self.asked: list[bytes] = []

    def candidates(self, _path: bytes) -> tuple[list, list]:
        return [self.link], []

    async def read_many(self, _link, files: list) -> list[bytes | None]:
        assert self.hold is not None
        self.most_reserved = max(self.most_reserved, self.hold.reserved)
        self.asked += [path for path, _st in files]
        await trio.sleep(0.01)
        return [content(path) for path, _st in files]


def content(path: bytes) -> bytes:
    return (path * (FILE // len(path) + 1))[:FILE]


def stat_of(path: bytes) -> SimpleNamespace:
    return SimpleNamespace(st_mode=0o100644, st_size=FILE, st_mtime_ns=7, st_dev=1,
                           st_ino=hash(path))


def holding_area(capacity: int) -> tuple[PeerHold, FakePeers]:
    peers = FakePeers()
    cache = SimpleNamespace(max_file_size=1 << 30,
                            room=SimpleNamespace(used=0, capacity=1 << 30),
                            lookup=lambda _key, _st: None)
    source = SimpleNamespace(lstat=stat_of)
    hold = peers.hold = PeerHold(peers, cache, source, capacity=capacity)  # type: ignore[arg-type]
    return hold, peers


def paths(first: int, count: int) -> list[bytes]:
    return [f"c/{i:05}.jpg".encode() for i in range(first, first + count)]


def test_the_holding_area_stays_within_its_bound_and_serves_each_file_once() -> None:
    async def main() -> None:
        hold, peers = holding_area(capacity=3 * MAX_CHUNK)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold.run)
            assert hold.prefetch(paths(0, 100)) == 100
            assert hold.prefetch(paths(50, 60)) == 10  # queued ones are not queued twice
            await trio.sleep(1)
            assert hold.reserved <= hold.capacity and len(peers.asked) < 110  # it waits
            for path in paths(0, 110):  # a reader slower than the peer
                await trio.sleep(0.05)
                got = await hold.take(path, stat_of(path))
                assert got is not None and got[1] == content(path)
                assert await hold.take(path, stat_of(path)) is None  # served once
            assert hold.reserved == 0 and not hold.items
            assert peers.most_reserved <= hold.capacity
            assert peers.asked == paths(0, 110)  # in the order handed over
            changed = paths(200, 1)[0]
            hold.prefetch([changed])
            await trio.sleep(1)
            other = SimpleNamespace(**{**vars(stat_of(changed)), "st_mtime_ns": 8})
            assert await hold.take(changed, other) is None  # another version: never served
            assert hold.reserved == 0
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_files_the_readers_pass_or_never_read_are_dropped(monkeypatch) -> None:
    monkeypatch.setattr(peer_hold, "LAG", 20)

    async def main() -> None:
        hold, peers = holding_area(capacity=2 * MAX_CHUNK)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold.run)
            hold.prefetch(paths(0, 200))
            await trio.sleep(1)
            held = hold.status()["held"]
            assert 0 < held < 200
            # the readers jump ahead: what they passed goes, the rest is fetched
            far = paths(0, 200)[held - 1]
            assert await hold.take(far, stat_of(far)) is not None
            assert hold.stats["dropped_unread"] >= held - 1 - 20
            # nobody reads any more: the full area sheds its oldest after STALE_S
            await trio.sleep(peer_hold.STALE_S * 30)
            assert hold.reserved <= hold.capacity and peers.most_reserved <= hold.capacity
            assert len(peers.asked) == 200 or hold.status()["waiting"] == 0
            assert hold.stats["dropped_unread"] > held
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_files_the_readers_had_in_the_kernels_pages_do_not_hold_up_the_next() -> None:
    """Held files nobody asks for (read again from the kernel's pages, never from the mount)
    fill the area; once a reader asks for a later file they go at once, not after STALE_S,
    and the batches after them come."""

    async def main() -> None:
        hold, peers = holding_area(capacity=2 * MAX_CHUNK)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold.run)
            order = paths(0, 2 * peer_hold.LAG)
            hold.prefetch(order)
            await trio.sleep(1)
            held = hold.status()["held"]
            assert 0 < held < 100 and hold.reserved + MAX_CHUNK > hold.capacity
            batches = hold.stats["batches"]
            skipped = order[held + peer_hold.LAG]  # queued: the reader fetches it itself
            assert await hold.take(skipped, stat_of(skipped)) is None
            await trio.sleep(peer_hold.STALE_S / 10)
            assert hold.stats["dropped_unread"] == held and hold.stats["batches"] > batches
            later = order[held]  # a late reader's: still within LAG of the skipped file
            got = await hold.take(later, stat_of(later))
            assert got is not None and got[1] == content(later)
            assert hold.reserved <= hold.capacity and peers.most_reserved <= hold.capacity
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
