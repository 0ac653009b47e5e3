"""The preload library (C) and the client's reader (coordlfs.cache.published) hold one
definition of a fresh hit: over the same index, in the same states, both say hit or not.

The library is loaded with ctypes (not preloaded: its wrappers serve only what is called
through it) and told of a mount by hand (``coordlfs_configure``) whose mountpoint does not
exist, so an open it passes to the real call fails, and one it serves names the file it chose:
the cache entry's (a hit) or the source's (a miss).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from time import monotonic_ns

import pytest

from coordlfs.cache import published
from coordlfs.cache.preloaded import COUNTS, CountsPage
from coordlfs.cache.published import INDEX, IndexReader, IndexWriter, Published
from coordlfs.client.run import library

pytestmark = pytest.mark.skipif(library() is None,
                                reason="the preload library is not built (scripts/setup)")


@dataclass
class Bed:
    lib: ctypes.CDLL
    mountpoint: str
    cache: Path
    source: Path
    writer: IndexWriter
    reader: IndexReader
    counts: CountsPage

    def library_says(self, name: str) -> str:
        """What the library does with an open of ``name``: "hit", "miss" or "mount"."""
        fd = self.lib.open(f"{self.mountpoint}/{name}".encode(), os.O_RDONLY)
        if fd < 0:
            return "mount"
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        finally:
            self.lib.close(fd)
        return "hit" if target.startswith(str(self.cache / "files")) else "miss"

    def client_says(self, name: str) -> str:
        """The client's verdict over the same index: a fresh hit (published, the daemon
        beating, and where it cannot watch, the source's version the same), else not."""
        found = self.reader.find(name.encode())
        if found is None:
            return "not"
        if self.reader.revalidate and not found.matches(os.lstat(self.source / name)):
            return "not"
        return "hit"

    def publish(self, name: str, number: int) -> None:
        st = os.lstat(self.source / name)
        (self.cache / "files" / f"{number:x}").write_bytes((self.source / name).read_bytes())
        self.writer.publish(name.encode(), Published(number, st.st_size, st.st_ino,
                                                     st.st_mtime_ns, st.st_ctime_ns))


#: One library per test process: its mounts are added for good (up to 16).
_LIBRARY: list[ctypes.CDLL] = []


@pytest.fixture
def bed(tmp_path: Path) -> Iterator[Bed]:
    if not _LIBRARY:
        _LIBRARY.append(ctypes.CDLL(str(library()), use_errno=True))
    lib = _LIBRARY[0]
    cache, source = tmp_path / "cache", tmp_path / "source"
    (cache / "files").mkdir(parents=True)
    source.mkdir()
    for name in ("a.bin", "b.bin"):
        (source / name).write_bytes(os.urandom(5000))
    dir_fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    writer = IndexWriter(dir_fd)
    writer.set_room(1 << 30)
    counts = CountsPage(dir_fd)
    mountpoint = f"/nonexistent-coordlfs-{os.getpid()}-{tmp_path.name}"
    record = "\x1f".join([mountpoint, str(cache), str(source), str(1 << 30), "-"])
    lib.coordlfs_configure.argtypes = [ctypes.c_char_p]
    lib.open.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.coordlfs_configure(record.encode())
    reader = IndexReader(str(cache / INDEX), str(cache / "files"))
    try:
        yield Bed(lib, mountpoint, cache, source, writer, reader, counts)
    finally:
        reader.close()
        writer.close()
        counts.close()
        os.close(dir_fd)


def both(bed: Bed, name: str) -> tuple[str, str]:
    return bed.library_says(name), bed.client_says(name)


def test_a_published_file_is_a_hit_for_both_and_the_rest_a_miss(bed) -> None:
    bed.publish("a.bin", 1)
    assert both(bed, "a.bin") == ("hit", "hit")
    assert both(bed, "b.bin") == ("miss", "not")  # read from the source, backfilled


def test_a_withdrawn_file_is_no_hit_for_either(bed) -> None:
    bed.publish("a.bin", 1)
    bed.writer.withdraw(b"a.bin")
    assert both(bed, "a.bin") == ("miss", "not")


def test_a_silent_daemon_is_trusted_by_neither(bed) -> None:
    bed.publish("a.bin", 1)
    published._store(bed.writer._map, published._BEAT_AT,
                     (monotonic_ns() - int(published.STALE_AFTER_S * 1e9) - 1) | 1)
    assert both(bed, "a.bin") == ("mount", "not")  # not even a miss: the mount answers
    bed.writer.beat()
    assert both(bed, "a.bin") == ("hit", "hit")


def test_a_table_retired_for_a_larger_one_is_followed_by_both(bed) -> None:
    bed.publish("a.bin", 1)
    assert both(bed, "a.bin") == ("hit", "hit")  # both have mapped the first table
    bed.writer.reserve(published.MIN_SLOTS * 4)  # a new table; the old one retired
    assert both(bed, "a.bin") == ("hit", "hit")


def test_where_the_source_is_not_watched_a_changed_file_is_no_hit(bed) -> None:
    bed.publish("a.bin", 1)
    bed.writer.set_revalidate()
    assert both(bed, "a.bin") == ("hit", "hit")
    (bed.source / "a.bin").write_bytes(os.urandom(6000))  # another version, same path
    # to the mount, as the client's read goes: its open finds the entry stale and drops it
    assert both(bed, "a.bin") == ("mount", "not")


def test_a_file_larger_than_the_room_is_read_but_not_kept(bed) -> None:
    bed.writer.set_room(100)  # the client reads such a file from the source (direct)
    assert bed.reader.room == 100
    before = bed.counts.read()
    assert bed.library_says("b.bin") == "miss"
    after = bed.counts.read()
    assert (after.uncached - before.uncached, after.misses - before.misses) == (1, 0)


def test_the_counters_page_is_the_library_s_layout(bed) -> None:
    bed.publish("a.bin", 1)
    bed.library_says("a.bin")
    bed.library_says("b.bin")
    counted = bed.counts.read()
    assert (counted.hits, counted.hit_bytes) == (1, 5000)
    assert (counted.misses, counted.miss_bytes) == (1, 5000)
    assert (bed.cache / COUNTS).stat().st_size >= 64
