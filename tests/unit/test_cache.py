"""Unit tests of the MinIO cache and the source reader, on real files (no FUSE)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from coordlfs.cache.cache import WholeFileCache
from coordlfs.cache.published import INDEX, IndexReader
from coordlfs.cache.stats import ReadCounters
from coordlfs.errors import UserError
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


def test_minio_fills_until_capacity_and_never_evicts(files: Path, tmp_path: Path) -> None:
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=9000)
    assert _fill_all(cache, source, ["f0", "f1", "f2"]) == [True, True, False]
    assert cache.used == 6000 and cache.counters.bytes_from_source == 6000
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
    assert again.used == 1000 + 7000 + 10_000_001
    assert sorted(os.listdir(tmp_path / "cache")) == ["arena", "index.jsonl"]
    for entry in again.entries.values():
        assert again.data(entry, 0, entry.size) == (files / os.fsdecode(entry.path)).read_bytes()
    # f1's bytes, unproven, were punched out: the arena holds only the three entries' pages
    assert os.stat(tmp_path / "cache" / "arena").st_blocks * 512 < again.used + 4 * 4096
    again.close(keep=False)


def test_lookup_drops_entry_of_changed_file(files: Path, tmp_path: Path) -> None:
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=1 << 30)
    _fill_all(cache, source, ["f0"])
    (files / "f0").write_bytes(b"new")
    st = source.lstat(b"f0")
    assert cache.lookup((st.st_dev, st.st_ino), st) is None
    assert cache.used == 0 and not cache.entries
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
    """A file changed and then restored (same size and mtime) must not map to punched pages."""
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


def test_arena_offsets_bound_new_entries(files: Path, tmp_path: Path) -> None:
    """Offsets of dropped entries are not reused: once they run out, files are streamed."""
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=8192)  # arena of 16 KiB
    assert _fill_all(cache, source, ["f2"]) == [True]  # 7000 bytes
    (files / "f2").write_bytes(os.urandom(7001))
    st = source.lstat(b"f2")
    assert cache.lookup((st.st_dev, st.st_ino), st) is None and cache.used == 0
    assert _fill_all(cache, source, ["f2"]) == [True]  # offsets 7000..14001
    (files / "f2").write_bytes(os.urandom(3000))
    st = source.lstat(b"f2")
    assert cache.lookup((st.st_dev, st.st_ino), st) is None and cache.used == 0
    assert _fill_all(cache, source, ["f2"]) == [False]  # room in capacity, not in the arena
    assert cache.used == 0 and cache.end == 14001
    cache.close(keep=False)


def _published(tmp_path: Path, name: str) -> bytes | None:
    """The bytes a client finds published under ``name``, or None."""
    reader = IndexReader(str(tmp_path / "cache" / INDEX), str(tmp_path / "cache" / "arena"))
    try:
        found = reader.find(name.encode())
        return None if found is None else bytes(reader.arena[found.offset:][:found.size])
    finally:
        reader.close()


def test_complete_entries_are_published_and_withdrawn_when_dropped(files: Path,
                                                                   tmp_path: Path) -> None:
    source = Source(str(files))
    cache = _cache(tmp_path, capacity=1 << 20)
    cache.share(source)
    _fill_all(cache, source, ["f0", "f1"])
    assert _published(tmp_path, "f0") == (files / "f0").read_bytes()
    assert _published(tmp_path, "f1") == (files / "f1").read_bytes()
    cache._changed(b"f0", False)  # the watch saw f0 change: withdrawn, still cached
    assert _published(tmp_path, "f0") is None and len(cache.entries) == 2
    (files / "f1").write_bytes(b"new")
    st = source.lstat(b"f1")
    assert cache.lookup((st.st_dev, st.st_ino), st) is None  # dropped: withdrawn at once,
    assert _published(tmp_path, "f1") is None
    assert cache.shared_status()["punches_waiting"] == 1  # its pages punched later
    cache.punch_late(float("inf"))
    assert cache.shared_status()["punches_waiting"] == 0
    cache.close(keep=True)
    again = _cache(tmp_path, capacity=1 << 20)  # a restart publishes what it adopts
    again.share(source)
    again.load(source)
    assert _published(tmp_path, "f0") == (files / "f0").read_bytes()
    assert _published(tmp_path, "f1") is None
    again.close(keep=False)
