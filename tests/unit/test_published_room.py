"""The room the index publishes: clients read it live, a grown table carries it, and an
index from a daemon that does not publish it says nothing (not "no room")."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from coordlfs.published import INDEX, MIN_SLOTS, IndexReader, IndexWriter, Published


@pytest.fixture
def directory(tmp_path: Path):
    (tmp_path / "arena").write_bytes(b"x" * 65536)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield tmp_path, fd
    os.close(fd)


def test_the_room_is_read_live_and_survives_growth(directory) -> None:
    root, fd = directory
    writer = IndexWriter(fd)
    reader = IndexReader(str(root / INDEX), str(root / "arena"))
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
    reader = IndexReader(str(root / INDEX), str(root / "arena"))
    assert reader.room is None
    writer.close()
    reader.close()
