"""The compact per-file tables (``coordlfs.cache.compact``, ``inodes``, ``entries``) against plain
dicts and the behaviour of the object-per-file tables they replaced."""

from __future__ import annotations

import gc
import os
import random

import pytest

from coordlfs.cache import compact
from coordlfs.cache.compact import Rows
from coordlfs.cache.entries import Entry, EntryTable
from coordlfs.fs.inodes import CONTROL_INODE, ROOT_INODE, InodeTable
from coordlfs.source.source import Version


def test_rows_follow_a_dict_through_adds_removes_and_path_changes(monkeypatch) -> None:
    """Random keys (several devices, 64-bit inodes), removals that shift hash clusters back,
    paths that change, and small heap segments so that compaction runs often."""
    monkeypatch.setattr(compact, "SEGMENT", 4096)
    rnd = random.Random(7)
    table = Rows()
    expected: dict[tuple[int, int], tuple[int, bytes]] = {}
    for _ in range(30_000):
        key = (rnd.choice([5, 6, 2**63]), rnd.randrange(2000) * rnd.choice([1, 2**40, 2**51]))
        row = table.keys.find(key)
        assert (row >= 0) == (key in expected)
        choice = rnd.random()
        if row < 0 and choice < 0.5:
            path = os.urandom(rnd.randrange(60))
            expected[key] = (table.new_row(key, path), path)
        elif row >= 0 and choice < 0.8:
            table.free_row(row)
            del expected[key]
        elif row >= 0:
            path = os.urandom(rnd.randrange(60))
            table.paths.put(row, path)
            expected[key] = (row, path)
    assert len(table) == len(expected)
    assert sorted(table.rows()) == sorted(row for row, _path in expected.values())
    for key, (row, path) in expected.items():
        assert table.keys.find(key) == row
        assert table.keys.key(row) == key and table.paths.get(row) == path
    # dead bytes were compacted away: the heap holds about the live paths, not all written
    live = sum(len(path) for _row, path in expected.values())
    assert table.paths.nbytes() < 3 * live + 4 * 4096


def test_bulk_rows_are_found_like_added_ones(monkeypatch) -> None:
    from array import array

    monkeypatch.setattr(compact, "SEGMENT", 100)
    paths = [b"d/%d" % i * (1 + i % 7) for i in range(500)] + [b"x" * 300]  # one > a segment
    table = Rows()
    rows = table.bulk(array("Q", [9] * len(paths)), array("Q", range(len(paths))),
                      array("I", map(len, paths)), b"".join(paths))
    for row, path in zip(rows, paths, strict=True):
        assert table.keys.find((9, row - rows.start)) == row
        assert table.paths.get(row) == path
    assert table.new_row((9, 10**6), b"later") not in rows


def test_inode_numbers_lookups_and_forget() -> None:
    table = InodeTable((1, 100))
    a = table.inode_for((1, 5), b"a")
    assert a == 3  # the first numbers are the rows': small, as before
    assert table.inode_for((1, 5), b"hardlink-to-a") == a
    assert table[a].path == b"hardlink-to-a" and table[a].key == (1, 5)
    assert table[a].version is None
    table[a].version = Version(5, 10, 20, 30)
    assert table[a].version == Version(5, 10, 20, 30)
    table.ref(a)
    table.ref(a)
    assert not table.forget(a, 1) and table[a].lookups == 1
    assert table.forget(a, 1)
    with pytest.raises(KeyError):
        table[a]
    b = table.inode_for((1, 5), b"a")
    assert b != a and b & 0xFFFFFFFF == a  # the row again, with a new generation
    assert not table.forget(a, 1)  # a stale number is ignored
    assert table.find((1, 5)) == b and table.find((1, 6)) is None
    with pytest.raises(KeyError):
        table[CONTROL_INODE]
    with pytest.raises(KeyError):
        table[1 << 40]
    assert dict(table.items()).keys() == {ROOT_INODE, b}


def test_inodes_below_a_renamed_directory_follow_it() -> None:
    table = InodeTable((1, 100))
    d = table.inode_for((1, 10), b"a/dir", is_dir=True)
    f = table.inode_for((1, 11), b"a/dir/sub/f")
    g = table.inode_for((1, 12), b"a/dirt")  # a sibling sharing the prefix, not below it
    assert table.inode_for((1, 10), b"b/moved", is_dir=True) == d
    assert table[f].path == b"b/moved/sub/f"
    assert table[g].path == b"a/dirt"


def test_inode_table_of_many_nodes_forgets_them_all() -> None:
    table = InodeTable((7, 1))
    numbers = [table.inode_for((7, 2**64 - 1 - i), b"d/%d" % i) for i in range(20_000)]
    for number in numbers:
        table.ref(number)
    assert len(table) == 20_001
    for number in numbers[::2]:
        assert table.forget(number, 1)
    assert len(table) == 10_001
    for i, number in enumerate(numbers[1::2]):
        assert table.path(number) == b"d/%d" % (2 * i + 1)
    again = [table.inode_for((7, 2**64 - 1 - i), b"e/%d" % i) for i in range(0, 20_000, 2)]
    assert not set(again) & set(numbers)


def _entry(path: bytes, offset: int, complete: bool = True) -> Entry:
    return Entry(path, 100, 1, 2, offset, filled=100 if complete else 0, complete=complete)


def test_entry_objects_are_shared_while_held_and_rows_otherwise() -> None:
    table = EntryTable()
    table.add((1, 5), _entry(b"f", 0))
    held = table.get((1, 5))
    assert held is table.get((1, 5)) and held.complete and held.size == 100
    filling = _entry(b"g", 100, complete=False)
    table.add((1, 6), filling)
    assert table.filling == 1
    del filling
    gc.collect()
    assert table.get((1, 6)).filled == 0  # a filling entry stays an object until it ends
    table.completed((1, 6), table.get((1, 6)))
    assert table.filling == 0
    assert sorted(table) == [(1, 5), (1, 6)] and len(table) == 2
    assert table.remove((1, 5), _entry(b"f", 999)) == (False, 0)  # not the entry it holds
    assert table.remove((1, 5), held)[0] and (1, 5) not in table
    columns = table.columns()
    assert list(columns.ino) == [6] and columns.paths == b"g"


def test_entry_table_memory_per_file_is_small() -> None:
    table = EntryTable()
    for i in range(50_000):
        table.add((1, i), _entry(b"train/n%08d/%08d.JPEG" % (i // 1000, i), i * 100))
    assert table.nbytes() / len(table) < 150
