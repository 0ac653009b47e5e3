"""Which opens FUSE passthrough serves, and the backing ids behind them.

An open of a complete cache entry is answered with the backing id of the entry's own file
(``WholeFileCache.entry_fd``): the kernel then reads that file itself and no READ of the open
reaches the daemon. An open of a file that neither MinIO nor a peer will hold (no room, too
big) is answered with the source file itself as its backing (``open_source``): the kernel
reads it as it reads any file, through its page cache, at the page cache's speed, and its pages
stay there for the kernel's LRU (a miss the cache keeps has them copied and dropped at its last
release: ``WholeFileCache.fill_behind``). An open of a peer's file is answered with the file it
landed in (``open_landed``). Every other open is direct_io, served by the readers. The
kernel's rules (Linux 6.18, measured;
docs/design/passthrough.md) shape the rest:

- an inode takes one backing at a time, and while a passthrough open of it is held, any other
  open of it (another backing id, direct_io, page-cached) fails with EIO: such opens get the
  same id (a file changed since gets a new inode instead: ``Operations._renumbered``);
- a shared mapping of a direct_io open puts the inode in cached mode, and a passthrough open
  beside it fails with EIO: while the daemon holds another open of the inode, a new one is
  direct_io too.

An entry's id is registered once and kept for later opens until the cache drops the entry
(``WholeFileCache.released``), or, if passthrough opens of it are still held then, until the
last of them is released: the kernel keeps the file for open files either way. A source
file's id lives as long as the opens of its inode that hold it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import pyfuse3

from coordlfs.cache.cache import Entry, WholeFileCache
from coordlfs.cache.compact import Key
from coordlfs.source.source import Source, Version

log = logging.getLogger(__name__)


class Backings:
    """The passthrough state of the inodes with open files, and the registered ids."""

    def __init__(self, cache: WholeFileCache, source: Source) -> None:
        self.cache = cache
        self.source = source
        #: entry number (``Entry.offset``) -> its registered backing id
        self._ids: dict[int, int] = {}
        #: inode -> the backing its passthrough opens hold, and how many. An entry is one
        #: inode's (its key's): a changed file's new version is another entry
        self._held: dict[int, Held] = {}
        #: inode -> opens of it not by passthrough (direct_io)
        self._plain: dict[int, int] = {}
        self._failed_logged = False
        cache.released.append(self._released)

    def open(self, inode: int, entry: Entry | None, st: os.stat_result) -> int:
        """The backing id to answer an open of ``inode`` (seen as ``st``) with, 0 for
        direct_io; ``entry`` is the complete entry the open would read, if any."""
        held = self._beside(inode, entry)
        if held is not None:
            return held
        if entry is None or not entry.complete:
            return self._direct(inode)
        number = entry.offset
        if number not in self._ids:
            fd = self.cache.entry_fd(entry)
            backing = self._register(fd, entry.path)
            if not backing:
                return self._direct(inode)
            self._ids[number] = backing
        self._held[inode] = Held(entry.path, Version.of(st), self._ids[number], entry)
        return self._ids[number]

    def open_source(self, inode: int, path: bytes, st: os.stat_result,
                    last_release: Callable[[int], None]) -> int:
        """The backing id to answer an open of ``inode`` (the source file ``path``, seen as
        ``st``) with when the daemon is to read none of its bytes: the source file itself, 0
        (for direct_io) if it is not that file any more. ``last_release``: called with the
        source file's descriptor when the last of the inode's opens is released, for the
        pages their reads brought in: copied into the cache (``WholeFileCache.fill_behind``)
        or dropped (``StreamReader``), as the daemon's own reads never leave any."""
        held = self._beside(inode, None)
        if held is not None:
            return held
        version = Version.of(st)
        try:
            fd = self.source.open_file(path)
        except OSError:
            return self._direct(inode)
        try:
            same = Version.of(os.fstat(fd)) == version
        except OSError:
            same = False
        if not same:  # replaced since the open's lstat: the readers stream what is there
            os.close(fd)
            return self._direct(inode)
        backing = self._register(fd, path, keep=True)
        if not backing:
            return self._direct(inode)
        self._held[inode] = Held(path, version, backing, None, fd, last_release)
        return backing

    def open_landed(self, inode: int, path: bytes, st: os.stat_result, fd: int) -> int:
        """The backing id to answer an open of ``inode`` (seen as ``st``) with when its bytes
        are a file of its own the daemon wrote (a peer's file, ``coordlfs.peers.landing``,
        whose descriptor ``fd`` stays the caller's): that file, 0 for direct_io. The id
        lives as long as the inode's opens, as a source file's does."""
        held = self._beside(inode, None)
        if held is not None:
            return held
        backing = self._register(os.dup(fd), path)
        if not backing:
            return self._direct(inode)
        self._held[inode] = Held(path, Version.of(st), backing, None, landed=True)
        return backing

    def _beside(self, inode: int, entry: Entry | None) -> int | None:
        """The answer the opens of ``inode`` the daemon holds already decide for one more:
        the id of its passthrough opens (any other answer would be EIO), or direct_io while
        a non-passthrough open is held (a shared mapping of that one would make a passthrough
        open EIO); None if no open of it is held."""
        if self._plain.get(inode):
            return self._direct(inode)
        held = self._held.get(inode)
        if held is None:
            return None
        if entry is None or held.entry is None or entry.offset != held.entry.offset:
            log.info("inode %d opened beside passthrough opens of another backing: "
                     "reads theirs", inode)
        held.opens += 1
        return held.id

    def _direct(self, inode: int) -> int:
        self._plain[inode] = self._plain.get(inode, 0) + 1
        return 0

    def held(self, inode: int) -> Held | None:
        """What the passthrough opens of ``inode`` hold, if any: the version they read, which
        a new open of the inode cannot but read too."""
        return self._held.get(inode)

    def _register(self, fd: int, path: bytes, keep: bool = False) -> int:
        """``fd``'s backing id (the kernel keeps the file), 0 if the kernel refused it (said
        once); closes ``fd`` unless told to ``keep`` it (and it was registered)."""
        try:
            backing = pyfuse3.backing_open(fd)
        except OSError as e:
            os.close(fd)
            level = logging.INFO if self._failed_logged else logging.WARNING
            self._failed_logged = True
            log.log(level, "no backing file for %s (%s): served by the daemon",
                    os.fsdecode(path), e)
            return 0
        if not keep:
            os.close(fd)
        return backing

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
        if held.opens:
            return
        del self._held[inode]
        if held.landed:
            self._close(held.id, held.path)
        elif held.source_fd >= 0:
            self._close(held.id, held.path)
            try:
                assert held.last_release is not None
                held.last_release(held.source_fd)
            finally:
                os.close(held.source_fd)
        elif held.entry is not None and held.entry.failed:  # dropped while held
            self._close(self._ids.pop(held.entry.offset), held.path)

    def _released(self, _key: Key, entry: Entry) -> None:
        if entry.offset not in self._ids:
            return
        # Held (few: the inodes with passthrough opens): closed at their last release
        if not any(held.entry is not None and held.entry.offset == entry.offset
                   for held in self._held.values()):
            self._close(self._ids.pop(entry.offset), entry.path)

    @staticmethod
    def _close(backing: int, path: bytes) -> None:
        try:
            pyfuse3.backing_close(backing)
        except OSError as e:  # the mount is going away
            log.info("backing id of %s not closed: %s", os.fsdecode(path), e)

    def status(self) -> dict[str, int]:
        return {"backing_ids": len(self._ids), "inodes_open_by_passthrough": len(self._held)}


@dataclass(slots=True)
class Held:
    """The passthrough opens of one inode: the file whose backing id they hold."""

    path: bytes
    #: the version of the file they read
    version: Version
    id: int
    #: the cache entry whose file it is, None for the source file itself
    entry: Entry | None
    #: the source file's descriptor (the backing is the source file itself), else -1
    source_fd: int = -1
    #: what becomes of a source file's pages at the last release (``open_source``)
    last_release: Callable[[int], None] | None = None
    opens: int = 1
    #: the backing is a file the daemon landed (a peer's file), closed at the last release
    landed: bool = False
