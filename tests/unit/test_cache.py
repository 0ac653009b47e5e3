"""Unit tests of the no-eviction cache and the source reader, on real files (no FUSE)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from coordlfs.cache.cache import FILES, WholeFileCache, file_name
from coordlfs.cache.published import INDEX, IndexReader
from coordlfs.cache.publishing import CATCH_UP_SLICE
from coordlfs.cache.stats import ReadCounters
from coordlfs.errors import UserError
from coordlfs.sizes import pages
from coordlfs.source.source import Source


@pytest.fixture
def files(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i, size in enumerate((1000, 5000, 7000, 10_000_001)):
        (src / f"f{i}").write_bytes(os.urandom(size))
    return src


def _cache(tmp_path: Path, capacity: int, max_file: int = 1 << 30) -> WholeFileCache:
    return WholeFileCache(str(tmp_path / "cache"), capacity, max_file, ReadCounters())


def _fill_all(cache: WholeFileCache, source: Source, names: list[str]) -> list[bool]:
    async def go() -> list[bool]:
        done = []
        async with trio.open_nursery() as nursery:
            for name in names:
                st = source.lstat(name.encode())
                key = (st.st_dev, st.st_ino)
                entry = cache.reserve(key, name.encode(), st)
                done.append(entry is not None)
                if entry is not None:
                    nursery.start_soon(cache.fill, key, entry, source)
        return done

    return trio.run(go)


def test_source_reader_reads_every_range(files: Path) -> None:
    source = Source(str(files))
    data = (files / "f3").read_bytes()
    reader = source.open_reader(b"f3")
    for off, size in ((0, 10), (4095, 2), (4096, 4096), (12345, 100_000), (len(data) - 3, 100)):
        assert reader.pread(off, size) == data[off:off + size]
    assert reader.pread(len(data) + 10, 10) == b""
    reader.close()


def test_the_cache_fills_until_capacity_and_never_evicts(files: Path, tmp_path: Path) -> None:
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=12288)  # 3 pages: 1000 bytes take 1, 5000 take 2
    assert _fill_all(cache, source, ["f0", "f1", "f2"]) == [True, True, False]
    assert cache.room.used == 12288 and cache.counters.bytes_from_source == 6000
    for entry in cache.entries.values():
        assert entry.complete
        assert cache.data(entry, 0, entry.size) == (files / os.fsdecode(entry.path)).read_bytes()
    assert _fill_all(cache, source, ["f2"]) == [False]  # full: nothing is replaced
    cache.close(keep=False)
    assert not (tmp_path / "cache").exists()


def test_per_file_limit(files: Path, tmp_path: Path) -> None:
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=1 << 30, max_file=6000)
    assert _fill_all(cache, source, ["f1", "f2", "f3"]) == [True, False, False]
    cache.close(keep=False)


def test_restart_finds_cache_warm_and_drops_changed(files: Path, tmp_path: Path) -> None:
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=1 << 30)
    _fill_all(cache, source, ["f0", "f1", "f2", "f3"])
    cache.close(keep=True)
    (files / "f1").write_bytes(b"changed")  # new size and mtime: must not be served
    (tmp_path / "cache" / "stray.part").write_bytes(b"x")
    again = _cache(tmp_path, capacity=1 << 30)
    assert again.load(source) == 3
    assert {os.fsdecode(e.path) for e in again.entries.values()} == {"f0", "f2", "f3"}
    assert again.room.used == pages(1000) + pages(7000) + pages(10_000_001)
    assert sorted(os.listdir(tmp_path / "cache")) == ["files", "index.jsonl"]
    for entry in again.entries.values():
        assert again.data(entry, 0, entry.size) == (files / os.fsdecode(entry.path)).read_bytes()
    # f1's file, unproven, was removed: one file per entry is left
    assert sorted(os.listdir(tmp_path / "cache" / "files")) == sorted(
        file_name(e.offset) for e in again.entries.values())
    again.close(keep=False)


def test_lookup_drops_entry_of_changed_file(files: Path, tmp_path: Path) -> None:
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=1 << 30)
    _fill_all(cache, source, ["f0"])
    (files / "f0").write_bytes(b"new")
    st = source.lstat(b"f0")
    assert cache.lookup((st.st_dev, st.st_ino), st) is None
    assert cache.room.used == 0 and not cache.entries
    cache.close(keep=False)


def test_cache_directory_is_locked(tmp_path: Path) -> None:
    first = _cache(tmp_path, capacity=1)
    with pytest.raises(UserError, match="in use by another coordlfs mount"):
        _cache(tmp_path, capacity=1)
    first.close(keep=False)


def test_missing_source_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        Source(str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        Source(str(tmp_path / "file"))


def test_dropped_entry_is_never_adopted_again(files: Path, tmp_path: Path) -> None:
    """A file changed and then restored (same size and mtime) must not map to a removed file."""
    source = Source(str(files))
    original, st0 = (files / "f0").read_bytes(), os.stat(files / "f0")
    cache = _cache(tmp_path, capacity=1 << 30)
    _fill_all(cache, source, ["f0", "f1"])
    (files / "f0").write_bytes(b"new")
    st = source.lstat(b"f0")
    assert cache.lookup((st.st_dev, st.st_ino), st) is None
    cache.close(keep=True)
    (files / "f0").write_bytes(original)
    os.utime(files / "f0", ns=(st0.st_atime_ns, st0.st_mtime_ns))
    again = _cache(tmp_path, capacity=1 << 30)
    assert again.load(source) == 1
    assert [os.fsdecode(e.path) for e in again.entries.values()] == ["f1"]
    again.close(keep=False)


def test_hostile_journal_lines_are_skipped(files: Path, tmp_path: Path) -> None:
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=1 << 30)
    _fill_all(cache, source, ["f0"])
    cache.close(keep=True)
    with open(tmp_path / "cache" / "index.jsonl", "a") as journal:
        journal.write('[1, 2]\n{"key": 5}\n{"key": "1-2", "path": "f1", "size": "x"}\n'
                      '{"key": "zz", "path": "f1", "size": 1, "mtime_ns": 1, "offset": 0}\n'
                      '{"dropped": true}\n{"torn": ')
    again = _cache(tmp_path, capacity=1 << 30)
    assert again.load(source) == 1
    entry = next(iter(again.entries.values()))
    assert again.data(entry, 0, entry.size) == (files / "f0").read_bytes()
    again.close(keep=False)


def test_a_changed_file_gets_a_new_entry_file_and_the_old_one_goes(files: Path,
                                                                      tmp_path: Path) -> None:
    """Numbers are never reused: a descriptor of the old file keeps the old bytes."""
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=8192)
    assert _fill_all(cache, source, ["f2"]) == [True]  # 7000 bytes: 2 pages
    old = next(iter(cache.entries.values()))
    held = cache.entry_fd(old)
    released = []
    cache.released.append(lambda key, entry: released.append(entry.offset))
    (files / "f2").write_bytes(os.urandom(7001))
    st = source.lstat(b"f2")
    assert cache.lookup((st.st_dev, st.st_ino), st) is None and cache.room.used == 0
    assert released == [old.offset] and not os.listdir(tmp_path / "cache" / "files")
    assert _fill_all(cache, source, ["f2"]) == [True]
    new = next(iter(cache.entries.values()))
    assert new.offset != old.offset and cache.room.used == 8192
    assert cache.data(new, 0, new.size) == (files / "f2").read_bytes()
    assert len(os.pread(held, 8000, 0)) == 7000  # the old version, still readable
    os.close(held)
    cache.close(keep=False)


def _published(tmp_path: Path, name: str) -> bytes | None:
    """The bytes a client finds published under ``name``, or None."""
    reader = IndexReader(str(tmp_path / "cache" / INDEX), str(tmp_path / "cache" / FILES))
    try:
        found = reader.find(name.encode())
        if found is None:
            return None
        data = reader.view(found)
        return None if data is None else bytes(data)
    finally:
        reader.close()


def test_complete_entries_are_published_and_withdrawn_when_dropped(files: Path,
                                                                   tmp_path: Path) -> None:
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=1 << 20)
    cache.share(source)
    cache.publisher.want()  # a client reads the index
    _fill_all(cache, source, ["f0", "f1"])
    assert _published(tmp_path, "f0") == (files / "f0").read_bytes()
    assert _published(tmp_path, "f1") == (files / "f1").read_bytes()
    cache.publisher.changed(b"f0", False)  # the watch saw f0 change: withdrawn, still cached
    assert _published(tmp_path, "f0") is None and len(cache.entries) == 2
    (files / "f1").write_bytes(b"new")
    st = source.lstat(b"f1")
    assert cache.lookup((st.st_dev, st.st_ino), st) is None  # dropped: withdrawn at once,
    assert _published(tmp_path, "f1") is None
    cache.close(keep=True)
    again = _cache(tmp_path, capacity=1 << 20)  # a restart publishes what it adopts
    again.share(source)
    again.publisher.want()  # a client reads the index
    again.load(source)
    assert _published(tmp_path, "f0") == (files / "f0").read_bytes()
    assert _published(tmp_path, "f1") is None
    again.close(keep=False)


def _named_copy(cache: WholeFileCache, number: int, data: bytes) -> int:
    """A copy as the request lane's copier leaves it: an unnamed file in the entries'
    directory, named as entry ``number``'s file; its descriptor."""
    fd = os.open(Path(cache.directory) / FILES, os.O_TMPFILE | os.O_RDWR, 0o600)
    os.write(fd, data)
    os.link(f"/proc/self/fd/{fd}", file_name(number), dst_dir_fd=cache.files_fd)
    return fd


def test_a_copy_named_by_its_number_is_adopted_or_its_name_goes(files: Path,
                                                               tmp_path: Path) -> None:
    """Numbers handed out at once (``numbers``, for the lane's copier) are never handed again;
    a copy named with one becomes that entry, complete, with no link made and no other
    number taken, and is journaled: a restart finds it. A copy the cache does not add (the
    file has an entry already) and one of a file that changed (``discard_copy``) leave no
    file behind."""
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=1 << 30)
    first = cache.numbers(4)
    assert cache.numbers(1) == first + 4 and cache.next_number == first + 5
    data = (files / "f1").read_bytes()
    st = source.lstat(b"f1")
    key = (st.st_dev, st.st_ino)
    fd = _named_copy(cache, first, data)
    try:
        entry = cache.adopt_copy(key, b"f1", st, fd, first)
        assert entry is not None and entry.complete and entry.offset == first
        cache.adopted([(key, entry, st)])
        assert cache.next_number == first + 5
        again = _named_copy(cache, first + 1, data)
        try:
            assert cache.adopt_copy(key, b"f1", st, again, first + 1) is None
        finally:
            os.close(again)
        _named_copy(cache, first + 2, b"old")
        cache.discard_copy(first + 2, b"f2")
        cache.discard_copy(-1, b"f2")  # unnamed: nothing to do
    finally:
        os.close(fd)
    assert sorted(os.listdir(Path(cache.directory) / FILES)) == [file_name(first)]
    cache.close(keep=True)
    kept = _cache(tmp_path, capacity=1 << 30)
    assert kept.load(source) == 1
    got = kept.lookup(key, st)
    assert got is not None and got.offset == first
    assert (Path(kept.directory) / FILES / file_name(first)).read_bytes() == data
    kept.close(keep=False)


def test_entries_cached_before_the_index_was_wanted_are_published_a_slice_at_a_time(
        tmp_path: Path) -> None:
    """Until something wants the index, a fill publishes nothing. Once wanted, the entries
    cached before are published by ``run``'s catch-up, more of them than one slice (the loop
    serves between slices), ``backlog`` counting down to 0 and ``caught_up`` told once; an
    entry changed meanwhile is not published."""
    src = tmp_path / "src"
    src.mkdir()
    names = [f"f{i:04d}" for i in range(CATCH_UP_SLICE * 2 + 10)]
    for name in names:
        (src / name).write_bytes(name.encode() * 3)
    source = Source(str(src))
    cache = _cache(tmp_path, capacity=1 << 30)
    cache.share(source)
    assert all(_fill_all(cache, source, names))
    publisher = cache.publisher
    assert publisher.index is not None and len(publisher.index) == 0
    assert not publisher.wanted and publisher.status()["published"] == 0
    (src / names[0]).write_bytes(b"changed since")
    told: list[int] = []
    publisher.caught_up.append(lambda: told.append(publisher.backlog))
    publisher.want()
    assert publisher.backlog == len(names)
    trio.run(publisher._catch_up)
    assert told == [0] and publisher.status()["backlog"] == 0
    assert len(publisher.index) == len(names) - 1
    assert _published(tmp_path, names[0]) is None
    assert _published(tmp_path, names[-1]) == names[-1].encode() * 3
    publisher.want()  # again: nothing more to do
    assert publisher.backlog == 0
    cache.close(keep=False)
