"""The room the cache publishes for clients follows what the cache would still take: it shrinks
with each reservation, grows back when an entry is dropped, is at most what the cache's
filesystem has free while it is full, and a restart publishes what its adopted entries leave.
It is published in whole pages, as files are charged, so that a client's ``size <= room`` says
what the cache's reservation will."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio

from coordlfs.cache.cache import ROOM_SLACK, WholeFileCache
from coordlfs.cache.published import INDEX, IndexReader
from coordlfs.cache.stats import ReadCounters
from coordlfs.sizes import pages
from coordlfs.source.source import Source

CAPACITY = 20_000
PAGE = pages(1)


def _whole(size: int) -> int:
    return size // PAGE * PAGE


def _room(tmp_path: Path) -> int | None:
    reader = IndexReader(str(tmp_path / "cache" / INDEX), str(tmp_path / "cache" / "files"))
    try:
        return reader.room
    finally:
        reader.close()


def _fill(cache: WholeFileCache, source: Source, name: bytes) -> None:
    async def go() -> None:
        st = source.lstat(name)
        key = (st.st_dev, st.st_ino)
        entry = cache.reserve(key, name, st)
        assert entry is not None
        await cache.fill(key, entry, source)

    trio.run(go)


def test_the_room_follows_reservations_drops_and_a_full_filesystem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(3000))
    (src / "b").write_bytes(os.urandom(5000))
    source = Source(str(src))
    cache = WholeFileCache(str(tmp_path / "cache"), CAPACITY, 1 << 20, ReadCounters())
    cache.share(source)
    cache.publisher.want()  # a client reads the index
    assert _room(tmp_path) == _whole(CAPACITY)
    _fill(cache, source, b"a")
    _fill(cache, source, b"b")
    assert _room(tmp_path) == _whole(CAPACITY - pages(3000) - pages(5000))
    (src / "a").write_bytes(b"changed")
    st = source.lstat(b"a")
    assert cache.lookup((st.st_dev, st.st_ino), st) is None  # dropped: its room is back
    assert _room(tmp_path) == _whole(CAPACITY - pages(5000))
    free = ROOM_SLACK + 4096
    monkeypatch.setattr(cache.room, "free", lambda: free)  # what statfs would say
    cache.room.note_full(OSError(errno.ENOSPC, "No space left on device"))
    assert cache.room.full and _room(tmp_path) == 4096
    assert cache.room.fits(4096) and not cache.room.fits(4097)  # each new file checked
    free = ROOM_SLACK + CAPACITY
    cache.room.check()  # the cache's filesystem has room: noticed
    assert not cache.room.full and _room(tmp_path) == _whole(CAPACITY - pages(5000))
    cache.close(keep=True)
    again = WholeFileCache(str(tmp_path / "cache"), CAPACITY, 1 << 20, ReadCounters())
    again.share(source)
    again.publisher.want()  # a client reads the index
    again.adopt()
    assert _room(tmp_path) == _whole(CAPACITY - pages(5000))
    again.close(keep=False)


@pytest.mark.parametrize("more", [0, 1])
@pytest.mark.parametrize("capacity", [20_000, 5 * 4096, 4095])
def test_a_file_the_room_says_fits_is_reserved_and_one_byte_more_is_not(
        tmp_path: Path, capacity: int, more: int) -> None:
    """The client (and the preload library) send a file through the mount when its size is
    at most the room: it must then be cached, not read through the mount for nothing."""
    src = tmp_path / "src"
    src.mkdir()
    source = Source(str(src))
    cache = WholeFileCache(str(tmp_path / "cache"), capacity, 1 << 20, ReadCounters())
    cache.share(source)
    cache.publisher.want()  # a client reads the index
    room = _room(tmp_path)
    assert room is not None
    (src / "f").write_bytes(os.urandom(room + more))
    st = source.lstat(b"f")
    entry = cache.reserve((st.st_dev, st.st_ino), b"f", st)
    assert (entry is not None) == (more == 0), (capacity, room)
    cache.close(keep=False)
