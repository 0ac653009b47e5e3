"""The fill queue without a mount: its bounds and turns, a reader waiting on a file it fills,
who may prefetch what, and opening beneath the source's root."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import trio

from coordlfs.cache import fills
from coordlfs.cache.cache import FILL_CHUNK, WholeFileCache
from coordlfs.cache.fills import BATCH, Credentials, FillQueue, readable
from coordlfs.cache.stats import ReadCounters
from coordlfs.protocol.spec import Refused
from coordlfs.sizes import pages
from coordlfs.source.beneath import open_beneath
from coordlfs.source.source import Source

NOBODY = 65534


def queue(depth: int = 2) -> FillQueue:
    cache: Any = None  # adding and taking never touch the cache
    return FillQueue(cache, Source("/"), depth)


def test_all_that_is_queued_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fills, "MAX_QUEUED", 10)
    q = queue()
    assert q.add(1, [b"a"] * 6) == 6
    assert q.add(2, [b"b"] * 6) == 4  # what fits, and the reply says so
    assert q.add(1, [b"c"]) == 0
    assert q.queued == 10


def test_depth_zero_takes_nothing() -> None:
    assert queue(depth=0).add(1, [b"a"]) == 0


def test_requesters_take_turns_in_their_own_order() -> None:
    q = queue(depth=1)
    q.add(1, [b"a%d" % i for i in range(2 * BATCH)])
    q.add(2, [b"b0"])
    assert q._take() == (1, [b"a%d" % i for i in range(BATCH)])
    assert q._take() == (2, [b"b0"])
    assert q._take() == (1, [b"a%d" % i for i in range(BATCH, 2 * BATCH)])
    assert q._take() == (None, []) and q.queued == 0


def test_a_short_queue_is_shared_among_the_workers() -> None:
    q = queue(depth=4)
    q.add(1, [b"x"] * 8)
    # each take is a share of what is left, so that idle workers find some too
    assert [len(q._take()[1]) for _ in range(7)] == [2, 2, 1, 1, 1, 1, 0]


@pytest.mark.parametrize(("uid", "gids", "mode", "allowed"), [
    (0, (), 0o400, True),        # st_uid is 0 below: root's own file, owner bits
    (0, (), 0o044, False),       # the owner gets the owner's bits only
    (NOBODY, (0,), 0o040, True),
    (NOBODY, (0,), 0o404, False),  # a member gets the group's bits only
    (NOBODY, (), 0o004, True),
    (NOBODY, (), 0o440, False),
])
def test_the_mode_bits_the_kernel_checks(uid: int, gids: tuple[int, ...], mode: int,
                                         allowed: bool) -> None:
    st = os.stat_result((mode, 0, 0, 1, 0, 0, 0, 0, 0, 0))
    assert Credentials(uid, frozenset(gids)).may(st, 4) is allowed


@pytest.fixture
def tree(tmp_path: Path) -> Source:
    """A source with a readable file, an unreadable one, a directory nobody else may enter
    and a symlink to a directory."""
    (tmp_path / "open").write_bytes(b"o")
    (tmp_path / "secret").write_bytes(b"s")
    (tmp_path / "secret").chmod(0o600)
    (tmp_path / "closed").mkdir()
    (tmp_path / "closed" / "x").write_bytes(b"x")
    (tmp_path / "closed").chmod(0o700)
    (tmp_path / "link").symlink_to(".")
    tmp_path.chmod(0o755)
    return Source(str(tmp_path))


def test_another_user_may_name_only_files_it_can_read(tree: Source) -> None:
    st = os.stat(tree.path)
    someone = Credentials(st.st_uid + 1 if st.st_uid != NOBODY else 1, frozenset())
    assert readable(tree, someone, [b"open", b"gone", b"open"]) == [b"open", b"open"]
    for refused in (b"secret", b"closed/x", b"link/open"):
        with pytest.raises(Refused, match="permission denied"):
            readable(tree, someone, [b"open", refused])
    owner = Credentials(st.st_uid, frozenset())
    assert readable(tree, owner, [b"secret", b"closed/x"]) == [b"secret", b"closed/x"]


@pytest.mark.parametrize(("path", "code"), [
    (b"link/open", errno.ELOOP), (b"link", errno.ELOOP), (b"../etc/passwd", errno.EXDEV),
    (b"/etc/passwd", errno.EXDEV),
])
def test_opening_beneath_the_root_follows_no_link_and_never_leaves(tree: Source, path: bytes,
                                                                   code: int) -> None:
    with pytest.raises(OSError) as caught:
        open_beneath(tree.root_fd, path, os.O_RDONLY)
    assert caught.value.errno == code
    os.close(open_beneath(tree.root_fd, b"open", os.O_RDONLY))


def test_a_reader_waits_on_the_entry_the_queue_fills(tmp_path: Path) -> None:
    """A reader of a file the queue is filling (as through the mount: ``lookup`` finds the
    entry) gets its start before the end has arrived, and the bytes are the source's."""
    (tmp_path / "src").mkdir()
    data = os.urandom(5 * FILL_CHUNK + 123)
    (tmp_path / "src" / "big").write_bytes(data)
    st = os.stat(tmp_path / "src" / "big")
    source = Source(str(tmp_path / "src"))
    cache = WholeFileCache(str(tmp_path / "cache"), 64 << 20, 64 << 20, ReadCounters())
    q = FillQueue(cache, source, 1)

    async def read() -> bool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(q.run)
            q.add(1, [b"big"])
            while (entry := cache.lookup((st.st_dev, st.st_ino), st)) is None:
                await trio.sleep(0.001)
            assert await cache.wait_for(entry, FILL_CHUNK)
            early = not entry.complete
            assert bytes(cache.data(entry, 0, FILL_CHUNK)) == data[:FILL_CHUNK]
            assert await cache.wait_for(entry, len(data))
            assert bytes(cache.data(entry, 0, len(data))) == data
            while q.in_flight:
                await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        return early

    try:
        assert trio.run(read)
        assert (q.files, q.bytes) == (1, len(data))
        assert cache.counters.bytes_from_source == len(data)
    finally:
        cache.close(keep=False)
        source.close()


def test_the_room_clients_read_never_shows_a_promised_file_free(tmp_path: Path) -> None:
    """A prefetched file's promised room is given back only after its entry took it: the
    room told to clients (the index's) never grows while the queue reserves, so a reader
    of the order's head never finds room for a file meanwhile (it sent such a file through
    the mount, test_client_direct's tail test, 2 runs in 10)."""
    (tmp_path / "src").mkdir()
    for name in ("a", "b"):
        (tmp_path / "src" / name).write_bytes(os.urandom(300_000))
    source = Source(str(tmp_path / "src"))
    cache = WholeFileCache(str(tmp_path / "cache"), 1 << 20, 1 << 20, ReadCounters())
    told: list[int] = []
    cache.room.told.append(told.append)
    q = FillQueue(cache, source, 1)
    try:
        q.add(1, [b"a", b"b"], size=sum(pages(300_000) for _ in "ab"))
        room = cache.room.available()
        batch = [fills._Fill(path) for path in (b"a", b"b")]
        for fill in batch:
            fill.st = os.stat(tmp_path / "src" / os.fsdecode(fill.path))
        told.clear()
        q.reserve_all(batch)
        assert all(fill.entry is not None for fill in batch)
        assert told and max(told) <= room and told[-1] == room
    finally:
        cache.close(keep=False)
        source.close()
