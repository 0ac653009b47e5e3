"""The no-eviction cache's entries: a row per cached file, an object only while one is in use.

A complete entry is a row of an ``EntryTable`` (about 70 bytes and its path: key, path,
version, number, flags); an ``Entry`` object is made for it when a reader, a fill or
the peer server asks (``get``), and shared by all of them while any holds it (the table
keeps a weak reference), so that dropping the entry fails it for every holder at once. An
entry being filled is an object for as long as its fill runs: readers wait on its progress.
"""

from __future__ import annotations

import os
import weakref
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import trio

from coordlfs.cache.compact import Key, Rows
from coordlfs.cache.published import Published

#: flags of a row
FILLING, SHARED, UNCHECKED = 1, 2, 4


@dataclass(slots=True, eq=False, weakref_slot=True)
class Entry:
    path: bytes
    size: int
    mtime_ns: int
    ctime_ns: int
    #: the entry's number, never reused: its file's name (``cache.file_name``)
    offset: int
    filled: int = 0
    complete: bool = False
    failed: bool = False
    #: reserved for a reader the kernel serves from the source file itself, to be copied
    #: from the pages its reads bring in when it closes (``WholeFileCache.backfill``);
    #: nobody is filling it yet
    to_backfill: bool = False
    #: Set (and replaced) each time more bytes arrive; None once the fill has ended, so that
    #: a million cached entries do not each keep an Event.
    progress: trio.Event | None = None

    def matches(self, st: os.stat_result) -> bool:
        """Whether ``st`` (of the file with this entry's key) is the version cached: the
        inode is the key, so this is the rest of ``source.Version``."""
        return (self.size, self.mtime_ns, self.ctime_ns) == (st.st_size, st.st_mtime_ns,
                                                             st.st_ctime_ns)


@dataclass(slots=True)
class Columns:
    """Complete entries as columns, one element per entry: what a checkpoint holds."""

    dev: array  # Q
    ino: array  # Q
    size: array  # q
    mtime_ns: array  # q
    ctime_ns: array  # q
    offset: array  # q
    path_len: array  # I
    paths: bytes


class KeyHolder(Protocol):
    """Told each key the table holds, as it comes and goes (the request lane must leave a
    LOOKUP of a cached file, or of one being filled, to the daemon: ``coordlfs.fs.lane_nodes``)."""

    def hold(self, key: Key) -> None: ...

    def let_go(self, key: Key) -> None: ...


class EntryTable(Rows, Mapping[Key, Entry]):
    """Entries by key, as a read-only mapping (``get``, ``values``, ``len``); changed only
    through ``add``, ``completed`` and ``remove``."""

    def __init__(self) -> None:
        self.size, self.mtime_ns, self.ctime_ns = array("q"), array("q"), array("q")
        self.offset = array("q")
        self.flags = array("B")
        super().__init__(self.size, self.mtime_ns, self.ctime_ns, self.offset, self.flags)
        self._objects: weakref.WeakValueDictionary[int, Entry] = weakref.WeakValueDictionary()
        #: entries being filled, held here until their fill ends
        self._filling: dict[int, Entry] = {}
        self._holder: KeyHolder | None = None

    def held_by(self, holder: KeyHolder) -> None:
        """Tell ``holder`` every key held now, and each as it comes and goes."""
        self._holder = holder
        for row in self.rows():
            holder.hold(self.keys.key(row))

    @property
    def filling(self) -> int:
        return len(self._filling)

    def __getitem__(self, key: Key) -> Entry:
        row = self.keys.find(key)
        if row < 0:
            raise KeyError(key)
        return self.entry(row)

    def get(self, key: Key, default: Entry | None = None) -> Entry | None:  # type: ignore[override]
        row = self.keys.find(key)
        return default if row < 0 else self.entry(row)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and self.keys.find(key) >= 0

    def __iter__(self) -> Iterator[Key]:
        return (self.keys.key(row) for row in list(self.rows()))

    def entry(self, row: int) -> Entry:
        """The object of a live row: the one in use, or a new one for a complete entry."""
        entry = self._objects.get(row)
        if entry is None:
            size = self.size[row]
            entry = Entry(self.paths.get(row), size, self.mtime_ns[row], self.ctime_ns[row],
                          self.offset[row], filled=size, complete=True)
            self._objects[row] = entry
        return entry

    def add(self, key: Key, entry: Entry) -> None:
        """A new entry for ``key``, which has none; one not complete is filling."""
        row = self.new_row(key, entry.path)
        if self._holder is not None:
            self._holder.hold(key)
        self.size[row], self.mtime_ns[row], self.ctime_ns[row] = (
            entry.size, entry.mtime_ns, entry.ctime_ns)
        self.offset[row] = entry.offset
        self.flags[row] = 0 if entry.complete else FILLING
        self._objects[row] = entry
        if not entry.complete:
            self._filling[row] = entry

    def _row_of(self, key: Key, entry: Entry) -> int:
        """The row of ``key`` if it holds ``entry`` (numbers are never reused), or -1."""
        row = self.keys.find(key)
        return row if row >= 0 and self.offset[row] == entry.offset else -1

    def completed(self, key: Key, entry: Entry) -> None:
        """The fill of ``entry`` ended with every byte in its file."""
        row = self._row_of(key, entry)
        if row >= 0:
            self.flags[row] &= ~FILLING
            self._filling.pop(row, None)

    def remove(self, key: Key, entry: Entry) -> tuple[bool, int]:
        """Take ``entry`` out of the table; whether it was in it, and its flags."""
        row = self._row_of(key, entry)
        if row < 0:
            return False, 0
        flags = self.flags[row]
        self.remove_row(row)
        return True, flags

    def remove_row(self, row: int) -> None:
        if self._holder is not None:
            self._holder.let_go(self.keys.key(row))
        self._filling.pop(row, None)
        self._objects.pop(row, None)
        self.free_row(row)

    def matches(self, row: int, st: os.stat_result) -> bool:
        """``Entry.matches``, from the row."""
        return (self.size[row], self.mtime_ns[row], self.ctime_ns[row]) == (
            st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def published(self, row: int, ino: int) -> Published:
        """What the index for clients says of the row's entry."""
        return Published(self.offset[row], self.size[row], ino, self.mtime_ns[row],
                         self.ctime_ns[row])

    def set_flag(self, key: Key, flag: int) -> None:
        row = self.keys.find(key)
        if row >= 0:
            self.flags[row] |= flag

    def shared_paths(self) -> Iterator[bytes]:
        """Paths of entries that were published (a scan of the table)."""
        flags = self.flags
        return (self.paths.get(row) for row in list(self.rows()) if flags[row] & SHARED)

    def load(self, columns: Columns) -> None:
        """Complete entries from a checkpoint, into an empty table, unchecked: the bulk of a
        warm restart, without a Python step per column per entry."""
        rows = self.bulk(columns.dev, columns.ino, columns.path_len, columns.paths)
        for mine, theirs in ((self.size, columns.size), (self.mtime_ns, columns.mtime_ns),
                             (self.ctime_ns, columns.ctime_ns), (self.offset, columns.offset)):
            mine[rows.start : rows.stop] = theirs
        self.flags[rows.start : rows.stop] = array("B", [UNCHECKED]) * len(rows)

    def columns(self) -> Columns:
        """The complete entries as columns (for a checkpoint)."""
        rows = array("i", (row for row in self.rows() if not self.flags[row] & FILLING))
        devices = self.keys.devices

        def gather(code: str, column: array) -> array:
            return array(code, map(column.__getitem__, rows))

        return Columns(array("Q", (devices[d] for d in map(self.keys.dev.__getitem__, rows))),
                       gather("Q", self.keys.ino), gather("q", self.size),
                       gather("q", self.mtime_ns), gather("q", self.ctime_ns),
                       gather("q", self.offset), gather("I", self.paths.size),
                       b"".join(map(self.paths.get, rows)))

