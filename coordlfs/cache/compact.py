"""Per-file state in rows of machine words, for tables of millions of files.

An object per cached file and per known inode, each with a tuple key of two ints, a bytes
path and a dict slot each way, cost the daemon about 1,000 bytes per file: 10 GB at ten
million files.
The tables built on ``Rows`` keep a row per file instead: numbers in ``array`` columns
indexed by the row number, the path packed with others in a ``PathHeap``, and the file's key
``(st_dev, st_ino)`` found through a ``KeyMap``, open-addressed hash tables of row numbers.
A row costs its bytes (about 80, and its path's); a lookup costs a few more Python steps
than a dict's.

Nothing here pauses for long at any size: the hash tables are sharded, so one grows at a
time (a thousandth of the rows), and the path heap compacts one segment at a time.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterator
from itertools import accumulate, repeat
from operator import add, and_

Key = tuple[int, int]

#: Hash tables per ``KeyMap``; each grows alone, so a resize re-inserts 1/1024 of the rows.
_SHARDS = 1 << 10
_M32 = (1 << 32) - 1
#: Bytes of paths per heap segment: what one compaction copies at most.
SEGMENT = 1 << 20
_EMPTY = -1


class KeyMap:
    """Rows by ``(st_dev, st_ino)``. Devices are numbered in the order met (a source spans a
    few); each row's device number and inode number are columns; row numbers sit in
    ``_SHARDS`` open-addressed tables probed linearly, at most two thirds full, from which a
    removal shifts its cluster back (no tombstones)."""

    def __init__(self) -> None:
        self._devices: dict[int, int] = {}
        #: st_dev by device number
        self.devices: list[int] = []
        self.dev = array("I")
        self.ino = array("Q")
        self._tables = [array("i", [_EMPTY]) * 8 for _ in range(_SHARDS)]
        self._counts = [0] * _SHARDS

    @property
    def columns(self) -> tuple[array, ...]:
        return self.dev, self.ino

    def _hash(self, row: int) -> int:
        """The hash of a row's key, as ``find`` computes it from the key."""
        return hash((self.devices[self.dev[row]], self.ino[row]))

    def key(self, row: int) -> Key:
        return self.devices[self.dev[row]], self.ino[row]

    def find(self, key: Key) -> int:
        """The row of ``key``, or -1."""
        dev = self._devices.get(key[0])
        if dev is None:
            return -1
        ino = key[1]
        h = hash(key)  # the tuple's: mixed well (xxHash's rounds) and at C speed
        table = self._tables[h & (_SHARDS - 1)]
        mask = len(table) - 1
        slot = (h >> 10) & mask
        inos, devs = self.ino, self.dev
        while True:
            row = table[slot]
            if row == _EMPTY:
                return -1
            if inos[row] == ino and devs[row] == dev:
                return row
            slot = (slot + 1) & mask

    def add(self, row: int, key: Key) -> None:
        """Make ``row`` the row of ``key``, which has none."""
        dev = self._devices.get(key[0])
        if dev is None:
            dev = self._devices[key[0]] = len(self.devices)
            self.devices.append(key[0])
        self.dev[row], self.ino[row] = dev, key[1]
        h = hash(key)
        shard = h & (_SHARDS - 1)
        if (self._counts[shard] + 1) * 3 > len(self._tables[shard]) * 2:
            self._resize(shard, len(self._tables[shard]) * 2)
        self._place(self._tables[shard], h, row)
        self._counts[shard] += 1

    def add_many(self, rows: range, devs: array, inos: array) -> None:
        """``add`` for many rows of distinct keys at once (a load), with what can be done
        per column done in C: a million keys take about a second, not three."""
        for dev in set(devs):
            if dev not in self._devices:
                self._devices[dev] = len(self.devices)
                self.devices.append(dev)
        self.dev[rows.start : rows.stop] = array("I", map(self._devices.__getitem__, devs))
        self.ino[rows.start : rows.stop] = inos
        hashes = list(map(hash, zip(devs, inos, strict=True)))
        for shard, count in Counter(map(and_, hashes, repeat(_SHARDS - 1))).items():
            self._counts[shard] += count
            size = len(self._tables[shard])
            while self._counts[shard] * 3 > size * 2:
                size *= 2
            if size > len(self._tables[shard]):
                self._resize(shard, size)
        tables = self._tables
        masks = [len(table) - 1 for table in tables]
        for row, h in zip(rows, hashes, strict=True):
            shard = h & (_SHARDS - 1)
            table, mask = tables[shard], masks[shard]
            slot = (h >> 10) & mask
            while table[slot] != _EMPTY:
                slot = (slot + 1) & mask
            table[slot] = row

    @staticmethod
    def _place(table: array, h: int, row: int) -> None:
        mask = len(table) - 1
        slot = (h >> 10) & mask
        while table[slot] != _EMPTY:
            slot = (slot + 1) & mask
        table[slot] = row

    def _resize(self, shard: int, size: int) -> None:
        old = self._tables[shard]
        table = self._tables[shard] = array("i", [_EMPTY]) * size
        for row in old:
            if row != _EMPTY:
                self._place(table, self._hash(row), row)

    def remove(self, row: int) -> None:
        h = self._hash(row)
        shard = h & (_SHARDS - 1)
        table = self._tables[shard]
        mask = len(table) - 1
        slot = (h >> 10) & mask
        while table[slot] != row:
            slot = (slot + 1) & mask
        table[slot] = _EMPTY
        self._counts[shard] -= 1
        hole, slot = slot, (slot + 1) & mask
        while (moved := table[slot]) != _EMPTY:
            home = (self._hash(moved) >> 10) & mask
            # ``moved`` may fill the hole unless its home lies cyclically in (hole, slot]
            if (hole < slot and not hole < home <= slot) or (
                    hole > slot and slot < home <= hole):
                table[hole], table[slot] = moved, _EMPTY
                hole = slot
            slot = (slot + 1) & mask

    def nbytes(self) -> int:
        return sum(t.itemsize * len(t) for t in self._tables)


class PathHeap:
    """Each row's path, packed end to end in segments of about ``SEGMENT`` bytes.

    A path that changes or goes leaves dead bytes in its segment; once they are half of a
    segment no longer appended to, its live paths move to the current segment and it is
    freed. So dead bytes stay below about half, and no compaction copies more than a
    segment (a bytes object per path would cost some 40 bytes more than its length).
    """

    def __init__(self) -> None:
        #: per row: segment << 32 | offset, or -1 without a path
        self.loc = array("q")
        self.size = array("I")
        self._segments: list[bytearray] = []
        #: per segment: the rows whose paths were appended to it, in order
        self._owners: list[array] = []
        self._dead: list[int] = []
        self._spare: list[int] = []
        self._current = -1

    @property
    def columns(self) -> tuple[array, ...]:
        return self.loc, self.size

    def get(self, row: int) -> bytes:
        loc = self.loc[row]
        start = loc & _M32
        return bytes(self._segments[loc >> 32][start : start + self.size[row]])

    def equals(self, row: int, path: bytes) -> bool:
        """``get(row) == path``, with one copy fewer."""
        if self.size[row] != len(path):
            return False
        loc = self.loc[row]
        start = loc & _M32
        return self._segments[loc >> 32][start : start + len(path)] == path

    def put(self, row: int, path: bytes) -> None:
        if self.loc[row] >= 0:
            self.drop(row)
        current = self._current
        if current < 0 or len(self._segments[current]) + len(path) > SEGMENT:
            current = self._next_segment()
        data = self._segments[current]
        self.loc[row], self.size[row] = current << 32 | len(data), len(path)
        data += path
        self._owners[current].append(row)

    def drop(self, row: int) -> None:
        loc = self.loc[row]
        if loc < 0:
            return
        self.loc[row] = -1
        segment = loc >> 32
        self._dead[segment] += self.size[row]
        if segment != self._current:
            self._compact_if_half_dead(segment)

    def _next_segment(self) -> int:
        former = self._current
        if self._spare:
            self._current = self._spare.pop()
        else:
            self._current = len(self._segments)
            self._segments.append(bytearray())
            self._owners.append(array("i"))
            self._dead.append(0)
        if former >= 0:
            self._compact_if_half_dead(former)
        return self._current

    def _compact_if_half_dead(self, segment: int) -> None:
        if self._dead[segment] * 2 <= len(self._segments[segment]):
            return
        data, owners = self._segments[segment], self._owners[segment]
        self._segments[segment], self._owners[segment] = bytearray(), array("i")
        self._dead[segment] = 0
        for row in owners:  # a row met again after it moved is no longer in this segment
            loc = self.loc[row]
            if loc >= 0 and loc >> 32 == segment:
                start = loc & _M32
                self.loc[row] = -1
                self.put(row, bytes(data[start : start + self.size[row]]))
        self._spare.append(segment)

    def bulk(self, rows: range, lengths: array, paths: bytes) -> None:
        """The paths of ``rows``: ``paths`` end to end, ``lengths`` bytes each (a load)."""
        offsets = array("q", accumulate(lengths, initial=0))
        view = memoryview(paths)
        first = 0
        while first < len(lengths):
            end = max(first + 1, bisect_right(offsets, offsets[first] + SEGMENT, first + 1) - 1)
            segment, base = self._next_segment(), offsets[first]
            data = self._segments[segment]
            start = segment << 32 | len(data)
            data += view[base : offsets[end]]
            self._owners[segment].extend(rows[first:end])
            self.loc[rows[first] : rows[first] + end - first] = array(
                "q", map(add, offsets[first:end], repeat(start - base)))
            first = end
        self.size[rows.start : rows.stop] = lengths

    def nbytes(self) -> int:
        return sum(len(s) + o.itemsize * len(o) for s, o in zip(self._segments, self._owners,
                                                                 strict=True))


class Rows:
    """A table of files: a row each, its key in ``keys``, its path in ``paths``, and the
    columns a subclass adds; freed rows are reused. Rows below ``reserved`` are never
    handed out (their numbers mean something else to the subclass)."""

    def __init__(self, *extra: array, reserved: int = 0) -> None:
        self.keys = KeyMap()
        self.paths = PathHeap()
        self._columns = (*self.keys.columns, *self.paths.columns, *extra)
        self._free = array("i")
        self.count = 0
        self._grow(reserved)
        self._free = array("i")

    def __len__(self) -> int:
        return self.count

    def _grow(self, rows: int) -> None:
        """``rows`` more free rows, the lowest handed out first."""
        end = len(self.paths.loc)
        for column in self._columns:
            column.frombytes(bytes(column.itemsize * rows))
        self.paths.loc[end:] = array("q", [-1]) * rows
        self._free.extend(range(end + rows - 1, end - 1, -1))

    def bulk(self, devs: array, inos: array, lengths: array, paths: bytes) -> range:
        """New rows for many files of distinct keys at once (a load): keys and paths as
        columns."""
        start = len(self.paths.loc)
        rows = range(start, start + len(lengths))
        for column in self._columns:
            column.frombytes(bytes(column.itemsize * len(rows)))
        self.paths.bulk(rows, lengths, paths)
        self.keys.add_many(rows, devs, inos)
        self.count += len(rows)
        return rows

    def new_row(self, key: Key, path: bytes) -> int:
        if not self._free:
            self._grow(max(8, len(self.paths.loc) >> 4))
        row = self._free.pop()
        self.claim(row, key, path)
        return row

    def claim(self, row: int, key: Key, path: bytes) -> None:
        """Make a free row (one of the reserved ones too) the row of ``key``."""
        self.keys.add(row, key)
        self.paths.put(row, path)
        self.count += 1

    def free_row(self, row: int, keyed: bool = True) -> None:
        """Free ``row``; ``keyed`` False: its key was taken out of ``keys`` already."""
        if keyed:
            self.keys.remove(row)
        self.paths.drop(row)
        self._free.append(row)
        self.count -= 1

    def live(self, row: int) -> bool:
        return 0 <= row < len(self.paths.loc) and self.paths.loc[row] >= 0

    def rows(self) -> Iterator[int]:
        """Every live row (a scan of the table)."""
        loc = self.paths.loc
        return (row for row in range(len(loc)) if loc[row] >= 0)

    def nbytes(self) -> int:
        """Bytes the table holds: its columns, hash tables and paths."""
        return (sum(c.itemsize * c.buffer_info()[1] for c in (*self._columns, self._free))
                + self.keys.nbytes() + self.paths.nbytes())
