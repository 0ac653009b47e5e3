"""The published index: what the daemon writes, a client finds, and nothing it withdrew."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest

from coordlfs.cache import published
from coordlfs.cache.published import (
    INDEX,
    MIN_SLOTS,
    STALE_AFTER_S,
    IndexReader,
    IndexWriter,
    Published,
)


@pytest.fixture
def directory(tmp_path: Path):
    (tmp_path / "files").mkdir()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield tmp_path, fd
    os.close(fd)


def _version(n: int) -> Published:
    return Published(offset=n * 8, size=8, ino=1000 + n, mtime_ns=n, ctime_ns=-n)


def test_a_published_path_is_found_and_a_withdrawn_one_is_not(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    writer.publish(b"train/a/x.jpg", _version(1))
    writer.publish(b"train/a/y.jpg", _version(2))
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    assert reader.find(b"train/a/x.jpg") == _version(1)
    assert reader.find(b"train/a/y.jpg") == _version(2)
    assert reader.find(b"train/a/z.jpg") is None
    writer.withdraw(b"train/a/x.jpg")
    assert reader.find(b"train/a/x.jpg") is None
    assert reader.find(b"train/a/y.jpg") == _version(2)
    writer.publish(b"train/a/x.jpg", _version(3))  # republished: the new version only
    assert reader.find(b"train/a/x.jpg") == _version(3)
    assert not reader.revalidate
    writer.set_revalidate()
    reader.find(b"train/a/x.jpg")
    assert reader.revalidate
    reader.close()
    writer.close()


def test_a_growing_index_is_found_by_a_reader_of_the_old_table(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    paths = [f"d{n % 7}/f{n}".encode() for n in range(MIN_SLOTS)]  # past half: it grows
    for n, path in enumerate(paths):
        writer.publish(path, _version(n % 100))
    for n in range(0, MIN_SLOTS // 2, 3):  # withdrawn ones leave tombstones
        writer.withdraw(paths[n])
    assert writer.generation > 1
    for n, path in enumerate(paths):
        expected = None if n < MIN_SLOTS // 2 and n % 3 == 0 else _version(n % 100)
        assert reader.find(path) == expected
    reader.close()
    writer.close()


def test_a_file_handed_over_is_marked_until_published_or_taken_back(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    paths = [b"train/a/x.jpg", b"train/a/y.jpg", b"train/a/z.jpg"]
    for path in paths:
        writer.hand_over(path)
    writer.hand_over(paths[0])  # twice: one mark
    assert [reader.find(p) for p in paths] == [None] * 3  # a mark is no hit
    assert all(reader.handed(p) for p in paths) and not reader.handed(b"train/a/w.jpg")
    writer.publish(paths[0], _version(1))
    writer.take_back(paths[1])
    assert reader.find(paths[0]) == _version(1)
    assert [reader.handed(p) for p in paths] == [False, False, True]
    writer.hand_over(paths[0])  # published: nothing to mark
    assert not reader.handed(paths[0]) and len(writer) == 1
    reader.close()
    writer.close()


def test_marks_survive_growth_and_tombstones_do_not(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    handed = [f"h/{n}".encode() for n in range(MIN_SLOTS // 4)]
    for path in handed:
        writer.hand_over(path)
    for path in handed[::2]:
        writer.take_back(path)
    published_ = [f"p/{n}".encode() for n in range(MIN_SLOTS)]
    for n, path in enumerate(published_):
        writer.publish(path, _version(n % 100))
    assert writer.generation > 1
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    assert [reader.handed(p) for p in handed] == [n % 2 == 1 for n in range(len(handed))]
    assert all(reader.find(p) == _version(n % 100) for n, p in enumerate(published_))
    reader.close()
    writer.close()


def test_a_retired_index_is_never_trusted(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    writer.publish(b"a", _version(1))
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    writer.close()  # the mount went away
    assert reader.find(b"a") is None
    second = IndexWriter(fd)  # a new daemon's index, empty until it publishes
    assert reader.find(b"a") is None
    second.publish(b"a", _version(2))
    assert reader.find(b"a") == _version(2)
    IndexWriter(fd).close()  # a third retires the second's
    assert reader.find(b"a") is None
    reader.close()
    second.close()


def test_a_found_file_is_read_then_mapped_and_checked(directory, monkeypatch) -> None:
    """A file's first read reads it, the second maps it, later ones are views of that
    mapping; a slot whose file is gone or of another size is no hit; a mapped file keeps the
    bytes it showed after the daemon unlinks it; past MAPPED_FILES a hit is read, not mapped."""
    root, fd = directory
    files = root / "files"
    for n in (1, 2, 3):
        (files / f"{n:x}").write_bytes(bytes([n]) * 8)
    (files / "4").write_bytes(b"longer file")
    writer = IndexWriter(fd)
    for n in (1, 2, 3, 4, 5):
        writer.publish(b"f%d" % n, Published(offset=n, size=8, ino=n, mtime_ns=0, ctime_ns=0))
    reader = IndexReader(str(root / INDEX), str(files))
    monkeypatch.setattr(published, "MAPPED_FILES", 2)

    def reads() -> list[bytes | memoryview | None]:
        return [reader.view(reader.find(b"f%d" % n)) for n in (1, 2, 3)]

    first, second, third = reads(), reads(), reads()
    for views in (first, second, third):
        assert [bytes(v) for v in views] == [b"\x01" * 8, b"\x02" * 8, b"\x03" * 8]
    assert [type(v) for v in first] == [bytes, bytes, bytes]
    assert [type(v) for v in second] == [memoryview, memoryview, bytes]  # two maps at most
    assert [type(v) for v in third] == [memoryview, memoryview, bytes]
    for _ in range(2):  # read, then (mapping) checked
        assert reader.view(reader.find(b"f4")) is None  # another size: not this entry's file
        assert reader.view(reader.find(b"f5")) is None  # gone
    (files / "1").unlink()
    assert bytes(reader.view(reader.find(b"f1"))) == b"\x01" * 8  # mapped: kept
    reader.close()
    assert bytes(second[0]) == b"\x01" * 8  # a view the user holds outlives the reader
    writer.close()


def test_no_index_is_an_oserror(tmp_path: Path) -> None:
    (tmp_path / "files").mkdir()
    with pytest.raises(OSError):
        IndexReader(str(tmp_path / INDEX), str(tmp_path / "arena"))


# -- the room: clients read it live, a grown table carries it, and an index from a daemon
# that does not publish it says nothing (not "no room")


def test_the_room_is_read_live_and_survives_growth(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    assert reader.room == 0
    writer.set_room(5 << 20)
    assert reader.room == 5 << 20
    for n in range(MIN_SLOTS):  # grows past the first table
        writer.publish(b"f%d" % n, Published(0, 1, n, 0, 0))
    assert reader.find(b"f0") is not None  # reopens the new table
    assert reader.room == 5 << 20
    writer.set_room(0)
    assert reader.room == 0
    writer.close()
    reader.close()


def test_an_index_without_the_room_says_none(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    writer.set_room(123)
    with open(root / INDEX, "r+b") as f, mmap.mmap(f.fileno(), 64) as header:
        header[40:48] = bytes(8)  # as an older daemon leaves it
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    assert reader.room is None
    writer.close()
    reader.close()


# -- the beat: a daemon that stops beating (killed, stopped) is not trusted past the bound;
# an index from a daemon that does not beat is trusted as before


def _set_beat(root: Path, word: int) -> None:
    with open(root / INDEX, "r+b") as f, mmap.mmap(f.fileno(), 64) as header:
        header[48:56] = word.to_bytes(8, "little")


def _beat_at(seconds_ago: float) -> int:
    return (time.monotonic_ns() - int(seconds_ago * 1e9)) | 1


def test_an_index_whose_daemon_stopped_beating_is_not_trusted(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    writer.publish(b"a", _version(1))
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    assert reader.find(b"a") == _version(1)
    _set_beat(root, _beat_at(STALE_AFTER_S + 0.1))  # the daemon's last beat, too long ago
    assert reader.find(b"a") is None
    writer.beat()  # alive again (SIGCONT): trusted again
    assert reader.find(b"a") == _version(1)
    _set_beat(root, _beat_at(STALE_AFTER_S / 2))  # late, within the bound
    assert reader.find(b"a") == _version(1)
    reader.close()
    writer.close()


def test_a_new_table_is_installed_with_a_beat(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    writer.publish(b"a", _version(1))
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    _set_beat(root, _beat_at(STALE_AFTER_S + 0.1))
    assert reader.find(b"a") is None
    writer.reserve(MIN_SLOTS)  # grown with no publish (a restart adopting many files)
    assert writer.generation > 1
    assert reader.find(b"a") == _version(1)  # the new table's beat is of now
    reader.close()
    writer.close()


def test_a_reader_whose_clock_is_behind_the_daemons_does_not_use_the_index(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    _set_beat(root, _beat_at(-60))  # a daemon in another time namespace: its beat looks fresh
    with pytest.raises(OSError):
        IndexReader(str(root / INDEX), str(root / "files"))
    writer.beat()
    IndexReader(str(root / INDEX), str(root / "files")).close()
    writer.close()


def test_an_index_without_the_beat_is_trusted_as_before(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    writer.publish(b"a", _version(1))
    _set_beat(root, 0)  # as an older daemon leaves it
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    assert reader.find(b"a") == _version(1)
    reader.close()
    writer.close()


def test_a_reader_never_sees_a_word_half_written(directory) -> None:
    """The room, the beat and a slot's word change while clients in other processes read
    them: each store is whole (struct's pack_into zeroed a word before writing it, and a
    reader saw no room or no beat: a hit sent through the mount)."""
    root, fd = directory
    writer = IndexWriter(fd)
    writer.publish(b"a", _version(1))
    writer.set_room(1)
    reader = IndexReader(str(root / INDEX), str(root / "files"))
    pid = os.fork()
    if pid == 0:  # the writer in a process of its own, as the daemon is
        status = 1
        try:
            for n in range(200_000):
                writer.set_room(n % 7 + 1)
                writer.beat()
            status = 0
        finally:
            os._exit(status)
    torn = 0
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        torn += reader.room in (0, None) or reader.find(b"a") is None
    reader.close()
    writer.close()
    assert torn == 0
