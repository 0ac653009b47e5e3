"""Inode numbers for source files, keyed by the source's (st_dev, st_ino).

Keying by (dev, ino) makes hard links one inode, as in libfuse's passthrough_hp. We hand out
our own numbers rather than the source's st_ino, because a source spanning several devices
could repeat st_ino values. A node lives while the kernel holds lookups on it (FUSE lookup
counts); ``forget`` drops it.

The kernel may hold millions of inodes, so a node is a row of a ``compact.Rows`` table
(about 75 bytes and its path), not an object: the inode number is the row number, with
the row's generation in the high 32 bits, so a row reused after a forget gets a number never
shown before and no map from numbers to rows is needed. ``table[inode]`` is a ``Node``, a
view of the row for the moment it is used.

With the request lane, a LOOKUP of a small file the daemon knows nothing of may be answered in
C (``coordlfs.fs.lane_nodes``): the lane numbers that node itself, with ``LANE_NODE`` set
(our own generations stay below that bit), and the table adopts it as a row of its own under
that number the first time it meets the number or the key. The table tells the lane the keys
it holds, so that the lane never numbers a key that has an inode here.

A key has one inode at a time, and mostly an inode is its key's for life. The exception is a
file changed while open files read a fixed version of it (``detach``): the kernel gives an
inode one backing file and one size, so the new version needs a new inode, and the old one
lives on, found by its number only, until the kernel forgets it.
"""

from __future__ import annotations

import os
import sys
from array import array
from collections.abc import Iterator

from coordlfs.cache.compact import Key, Rows
from coordlfs.fs.lane_nodes import LANE_NODE, LaneNodes, Numbered
from coordlfs.source.source import Version

ROOT_INODE = 1
CONTROL_INODE = 2
_FIRST_FREE = 3
_ROW = (1 << 32) - 1
#: a row's generations, below the lane's nodes' bit (``LANE_NODE``)
_LAST_GENERATION = (1 << 30) - 1
#: the two ints of an adopted node's number in ``InodeTable._adopted``: the number (above
#: 2**62) and its row
_ADOPTED_INTS = sys.getsizeof(1 << 62) + sys.getsizeof(1 << 20)
#: no version shown to the kernel yet (``Node.version`` None)
_UNSEEN = -1

__all__ = ["CONTROL_INODE", "ROOT_INODE", "InodeTable", "Key", "Node"]


class Node:
    """One node of an ``InodeTable``: valid until the table changes it."""

    __slots__ = ("_row", "_table")

    def __init__(self, table: InodeTable, row: int) -> None:
        self._table, self._row = table, row

    @property
    def key(self) -> Key:
        return self._table.keys.key(self._row)

    @property
    def path(self) -> bytes:
        """A path that reached this inode (the latest; with hard links any of them will do)."""
        return self._table.paths.get(self._row)

    @property
    def lookups(self) -> int:
        return self._table.lookups[self._row]

    @property
    def version(self) -> Version | None:
        """The version last shown to the kernel, to notice a source file that changed."""
        return self._table.version(self._row)

    @version.setter
    def version(self, version: Version) -> None:
        self._table.set_version(self._row, version)


class InodeTable(Rows):
    def __init__(self, root_key: Key) -> None:
        self.lookups = array("q")
        self._generation = array("I")
        #: the version last shown (its inode is the key's): size -1 for none yet
        self._size, self._mtime, self._ctime = array("q"), array("q"), array("q")
        #: a row's number if the request lane gave it (0: the row's own)
        self._number = array("Q")
        super().__init__(self.lookups, self._generation, self._size, self._mtime, self._ctime,
                         self._number, reserved=_FIRST_FREE)
        #: the lane's nodes adopted: number -> row
        self._adopted: dict[int, int] = {}
        #: the request lane's nodes, while it answers LOOKUPs (``serve_lane_nodes``)
        self.lane_nodes: LaneNodes | None = None
        #: rows whose key was given a new inode (``detach``): found by number only
        self._detached: set[int] = set()
        self.claim(ROOT_INODE, root_key, b"")
        self._size[ROOT_INODE] = _UNSEEN
        self.lookups[ROOT_INODE] = 1

    def serve_lane_nodes(self, nodes: LaneNodes) -> None:
        """The request lane answers LOOKUPs from now on: it is told every key held here."""
        self.lane_nodes = nodes
        for row in self.rows():
            if row not in self._detached:
                nodes.hold(self.keys.key(row))

    def nbytes(self) -> int:
        """With the numbers of the lane's nodes adopted (a dict entry and two ints each)."""
        return (super().nbytes() + sys.getsizeof(self._adopted)
                + len(self._adopted) * _ADOPTED_INTS)

    def _row(self, inode: int) -> int:
        """The row of a live inode number; KeyError for any other."""
        if inode & LANE_NODE:
            return self._lane_row(inode)
        row = inode & _ROW
        try:
            if self.paths.loc[row] >= 0 and self._generation[row] == inode >> 32:
                return row  # (the control inode's row is never live)
        except IndexError:
            pass
        raise KeyError(inode)

    def _lane_row(self, inode: int) -> int:
        """The row of a node the lane numbered: adopted now if it was not yet."""
        row = self._adopted.get(inode)
        if row is not None:
            return row
        node = None if self.lane_nodes is None else self.lane_nodes.adopt_number(inode)
        if node is None:
            raise KeyError(inode)
        return self._take(node)

    def _take(self, node: Numbered) -> int:
        """A row for a node the lane numbered, now ours (the lane let the key be held)."""
        row = self.new_row(node.key, node.path)
        self.lookups[row] = node.lookups
        self.set_version(row, node.version)
        self._number[row] = node.number
        self._adopted[node.number] = row
        return row

    def adopt_all(self) -> None:
        """Every node the lane numbered becomes a row (a scan of the table follows)."""
        if self.lane_nodes is not None:
            for node in self.lane_nodes.adopt_all():
                self._take(node)

    def _inode(self, row: int) -> int:
        return self._number[row] or self._generation[row] << 32 | row

    def __getitem__(self, inode: int) -> Node:
        return Node(self, self._row(inode))

    def items(self) -> Iterator[tuple[int, Node]]:
        return ((self._inode(row), Node(self, row)) for row in self.rows())

    def path(self, inode: int) -> bytes:
        """``self[inode].path``, without the view."""
        return self.paths.get(self._row(inode))

    def lanes(self, inode: int) -> bool:
        """Whether ``inode`` is a node the lane numbered and keeps (not adopted)."""
        return bool(inode & LANE_NODE) and inode not in self._adopted

    def number(self, key: Key) -> int | None:
        """The inode the kernel knows ``key`` by: ours, or the number of the lane's node for
        it, left the lane's (``find`` adopts it)."""
        row = self.keys.find(key)
        if row >= 0:
            return self._inode(row)
        return None if self.lane_nodes is None else self.lane_nodes.number_of(key)

    def find(self, key: Key) -> int | None:
        row = self.keys.find(key)
        if row < 0 and self.lane_nodes is not None:
            node = self.lane_nodes.adopt(key)
            row = -1 if node is None else self._take(node)
        return None if row < 0 else self._inode(row)

    def inode_for(self, key: Key, path: bytes, is_dir: bool = False) -> int:
        """The inode of ``key``, creating it with no lookups yet; remembers ``path``.

        A directory met under a new path was renamed in the source: the kernel may still hold
        nodes beneath it, which must be found under the new path too.
        """
        row = self.keys.find(key)
        if row < 0:
            node = None if self.lane_nodes is None else self.lane_nodes.claim(key)
            if node is not None:
                row = self._take(node)
            else:
                row = self.new_row(key, path)
                self.lookups[row] = 0
                self._size[row] = _UNSEEN
                return self._inode(row)
        if not self.paths.equals(row, path):
            if is_dir and row != ROOT_INODE:
                self._moved(self.paths.get(row), path)
            self.paths.put(row, path)
        return self._inode(row)

    def _moved(self, old: bytes, new: bytes) -> None:
        """Rewrite the paths below directory ``old``: rare, so a scan of the table."""
        prefix = old + b"/"
        if self.lane_nodes is not None:  # its directories' paths, its nodes' (taken first)
            self.lane_nodes.clear_directories()
            self.adopt_all()
        for row in list(self.rows()):
            path = self.paths.get(row)
            if path.startswith(prefix):
                self.paths.put(row, new + path[len(old) :])

    def detach(self, inode: int, version: Version) -> None:
        """Give the inode's key a new inode at its next ``inode_for``: this one stands for
        ``version`` of the file (what its open files read) until the kernel forgets it."""
        row = self._row(inode)
        self.keys.remove(row)  # its key columns stay: ``Node.key`` still answers
        if self.lane_nodes is not None:
            self.lane_nodes.let_go(self.keys.key(row))
        self._detached.add(row)
        self.set_version(row, version)

    def detached(self, inode: int) -> Version | None:
        """The version a detached inode stands for; None for an inode that is its key's (the
        lane's nodes, not adopted, among them)."""
        if self.lanes(inode):
            return None
        row = self._row(inode)
        return self.version(row) if row in self._detached else None

    def version(self, row: int) -> Version | None:
        size = self._size[row]
        if size == _UNSEEN:
            return None
        return Version(self.keys.ino[row], size, self._mtime[row], self._ctime[row])

    def set_version(self, row: int, version: Version) -> None:
        """Note the version the kernel is shown; its inode is the row's key's."""
        self._size[row], self._mtime[row], self._ctime[row] = (
            version.size, version.mtime_ns, version.ctime_ns)

    def seen(self, inode: int, st: os.stat_result) -> None:
        """``self[inode].version = Version.of(st)``, without the view or the version."""
        row = self._row(inode)
        self._size[row], self._mtime[row], self._ctime[row] = (
            st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def shown(self, inode: int, st: os.stat_result) -> bool:
        """Whether ``st`` is the version last shown to the kernel (``self[inode].version ==
        Version.of(st)``, without the view or the version). A detached inode shows its version
        for good (its open files read it): nothing newer is ever shown on it."""
        row = self._row(inode)
        if row in self._detached:
            return True
        return (self._size[row] == st.st_size and self._mtime[row] == st.st_mtime_ns
                and self._ctime[row] == st.st_ctime_ns and self.keys.ino[row] == st.st_ino)

    def ref(self, inode: int) -> None:
        self.lookups[self._row(inode)] += 1

    def forget(self, inode: int, count: int) -> bool:
        """Whether the node is gone now."""
        try:
            row = self._row(inode)
        except KeyError:
            return False
        if row == ROOT_INODE:
            return False
        self.lookups[row] -= count
        if self.lookups[row] <= 0:
            self._drop(row)
            return True
        return False

    def drop_if_unreferenced(self, inode: int) -> None:
        row = self._row(inode)
        if row != ROOT_INODE and self.lookups[row] == 0:
            self._drop(row)

    def drop(self, inode: int) -> None:
        self._drop(self._row(inode))

    def _drop(self, row: int) -> None:
        keyed = row not in self._detached
        self._detached.discard(row)
        if keyed and self.lane_nodes is not None:
            self.lane_nodes.let_go(self.keys.key(row))
        if self._number[row]:
            del self._adopted[self._number[row]]
            self._number[row] = 0
        self.free_row(row, keyed)
        if self._generation[row] < _LAST_GENERATION:
            self._generation[row] += 1  # the next node in this row gets a new number
        else:  # four billion nodes in one row: retire it rather than repeat a number
            self._free.pop()
