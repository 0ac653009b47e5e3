"""Which opens FUSE passthrough serves, and the backing ids behind them.

An open of a complete cache entry is answered with the backing id of the entry's own file
(``WholeFileCache.entry_fd``): the kernel then reads that file itself and no READ of the open
reaches the daemon. Every other open is direct_io, served by the readers. The kernel's rules
(Linux 6.18, measured; docs/design/passthrough.md) shape the rest:

- an inode takes one backing at a time, and while a passthrough open of it is held, any other
  open of it (another backing id, direct_io, page-cached) fails with EIO: such opens get the
  same id (a file changed since gets a new inode instead: ``Operations._renumbered``);
- a shared mapping of a direct_io open puts the inode in cached mode, and a passthrough open
  beside it fails with EIO: while the daemon holds another open of the inode, a new one is
  direct_io too.

An id is registered once per entry and kept for later opens until the cache drops the entry
(``WholeFileCache.released``), or, if passthrough opens of it are still held then, until the
last of them is released: the kernel keeps the file for open files either way.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import pyfuse3

from coordlfs.cache.cache import Entry, WholeFileCache
from coordlfs.cache.compact import Key

log = logging.getLogger(__name__)


class Backings:
    """The passthrough state of the inodes with open files, and the registered ids."""

    def __init__(self, cache: WholeFileCache) -> None:
        self.cache = cache
        #: entry number (``Entry.offset``) -> its registered backing id
        self._ids: dict[int, int] = {}
        #: inode -> the entry whose id its passthrough opens hold, and how many. An entry is
        #: one inode's (its key's): a changed file's new version is another entry
        self._held: dict[int, _Held] = {}
        #: inode -> opens of it not by passthrough (direct_io)
        self._plain: dict[int, int] = {}
        self._failed_logged = False
        cache.released.append(self._released)

    def open(self, inode: int, entry: Entry | None) -> int:
        """The backing id to answer an open of ``inode`` with, 0 for direct_io; ``entry`` is
        the complete entry the open would read, if any."""
        held = self._held.get(inode)
        if held is not None:  # any other answer would be EIO
            if entry is None or entry.offset != held.entry.offset:
                log.info("inode %d opened beside passthrough opens of another version: "
                         "reads theirs", inode)
            held.opens += 1
            return self._ids[held.entry.offset]
        if entry is None or not entry.complete or self._plain.get(inode):
            self._plain[inode] = self._plain.get(inode, 0) + 1
            return 0
        if entry.offset not in self._ids:
            try:
                self._ids[entry.offset] = self._register(entry)
            except OSError as e:
                self._plain[inode] = self._plain.get(inode, 0) + 1
                level = logging.INFO if self._failed_logged else logging.WARNING
                self._failed_logged = True
                log.log(level, "no backing file for %s (%s): served by the daemon",
                        os.fsdecode(entry.path), e)
                return 0
        self._held[inode] = _Held(entry)
        return self._ids[entry.offset]

    def held(self, inode: int) -> Entry | None:
        """The entry whose backing id the passthrough opens of ``inode`` hold, if any: the
        version they read, which a new open of the inode cannot but read too."""
        held = self._held.get(inode)
        return None if held is None else held.entry

    def _register(self, entry: Entry) -> int:
        fd = self.cache.entry_fd(entry)
        try:
            return pyfuse3.backing_open(fd)
        finally:
            os.close(fd)

    def close(self, inode: int, backing: int) -> None:
        """An open of ``inode`` answered with ``backing`` (0: direct_io) is released."""
        if not backing:
            left = self._plain[inode] - 1
            if left:
                self._plain[inode] = left
            else:
                del self._plain[inode]
            return
        held = self._held[inode]
        held.opens -= 1
        if not held.opens:
            del self._held[inode]
            if held.entry.failed:  # dropped by the cache while held (``_released``)
                self._drop(held.entry.offset)

    def _released(self, _key: Key, entry: Entry) -> None:
        if entry.offset not in self._ids:
            return
        # Held (few: the inodes with passthrough opens): closed at their last release
        if not any(held.entry.offset == entry.offset for held in self._held.values()):
            self._drop(entry.offset)

    def _drop(self, number: int) -> None:
        try:
            pyfuse3.backing_close(self._ids.pop(number))
        except OSError as e:  # the mount is going away
            log.info("backing id of entry %d not closed: %s", number, e)

    def status(self) -> dict[str, int]:
        return {"backing_ids": len(self._ids), "inodes_open_by_passthrough": len(self._held)}


@dataclass(slots=True)
class _Held:
    """The passthrough opens of one inode: the entry whose backing id they hold."""

    entry: Entry
    opens: int = 1
