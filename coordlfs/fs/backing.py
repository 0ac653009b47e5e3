"""The backing ids FUSE passthrough serves opens by, registered with the kernel.

Which open gets which backing is decided with its reader (``coordlfs.fs.opens``); this module
registers the files. A complete cache entry's own file (``WholeFileCache.entry_fd``) is
registered once and its id kept for later opens until the cache drops the entry, or, if
opens of it are still held then, until the last of them is released: the kernel keeps the
file for open files either way, and a hit then costs no registration. A source file the
kernel is to read itself (a small miss, backfilled at its last release; a file no cache
keeps) and a peer's file landed on the cache's tmpfs are registered per inode, for as long as
its opens: a source file changes, and a landed file is that inode's alone.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import pyfuse3

from coordlfs.cache.cache import Entry, WholeFileCache
from coordlfs.source.source import Source, Version

log = logging.getLogger(__name__)

#: a Python int of an entry's number or a backing id
_INT_BYTES = sys.getsizeof(1 << 20)


@dataclass(slots=True)
class Backing:
    """The file an inode's passthrough opens read, by its backing id."""

    path: bytes
    #: the version of the file they read
    version: Version
    id: int
    #: the cache entry whose file it is, None for the source file itself
    entry: Entry | None
    #: the source file's descriptor (the backing is the source file itself), else -1
    source_fd: int = -1
    #: the backing is a file the daemon landed (a peer's file), closed at the last release
    landed: bool = False
    #: the entry reserved for the source file's bytes, backfilled at the last release from
    #: the pages the kernel's reads brought in; None for a file no cache keeps
    backfill: Entry | None = None

    def close_source(self) -> None:
        """The source file's descriptor goes (the kernel keeps its file for open files)."""
        if self.source_fd >= 0:
            fd, self.source_fd = self.source_fd, -1
            os.close(fd)


class Backings:
    """The registered backing ids: the entries' kept ones, and registering the others."""

    def __init__(self, cache: WholeFileCache, source: Source) -> None:
        self.cache = cache
        self.source = source
        #: entry number (``Entry.offset``) -> its registered backing id
        self._ids: dict[int, int] = {}
        self._failed_logged = False

    def of_entry(self, entry: Entry, st: os.stat_result) -> Backing | None:
        """The complete ``entry``'s file (the open saw ``st``), None if the kernel refused it."""
        backing = self.entry_id(entry)
        return Backing(entry.path, Version.of(st), backing, entry) if backing else None

    def entry_id(self, entry: Entry) -> int:
        """The complete ``entry``'s backing id, registered now if it is not yet (kept until
        the cache drops the entry); 0 if the kernel refused it."""
        number = entry.offset
        backing = self._ids.get(number)
        if backing is None:
            backing = self._register(self.cache.entry_fd(entry), entry.path)
            if not backing:
                return 0
            self._ids[number] = backing
        return backing

    def registered(self, entry: Entry | None, backing: int, path: bytes) -> None:
        """An id the request lane's copier registered for its copy of source file ``path``
        (``Note.backing``): kept as ``entry``'s, or closed if the cache did not add the copy
        (``entry`` None)."""
        if entry is None:
            self._close(backing, path)
        else:
            self._ids[entry.offset] = backing

    def id_bytes(self) -> int:
        """What an entry's kept id costs: its share of the table here, the entry's number and
        its id, and the kernel's record of it (a ``fuse_backing``, from kmalloc-64; the file
        it holds is the open backing file ``coordlfs.daemon.memory`` counts)."""
        return sys.getsizeof(self._ids) // max(1, len(self._ids)) + 2 * _INT_BYTES + 64

    def of_source(self, path: bytes, st: os.stat_result) -> Backing | None:
        """The source file ``path`` itself, kept open, if it is still the file ``st`` shows
        (else the daemon's readers stream what is there) and the kernel takes it."""
        version = Version.of(st)
        try:
            fd = self.source.open_file(path)
        except OSError:
            return None
        try:
            same = Version.of(os.fstat(fd)) == version
        except OSError:
            same = False
        if not same:  # replaced since the open's lstat
            os.close(fd)
            return None
        backing = self._register(fd, path, keep=True)
        if not backing:
            return None
        return Backing(path, version, backing, None, fd)

    def of_landed(self, path: bytes, st: os.stat_result, fd: int) -> Backing | None:
        """A file of its own the daemon wrote (a peer's file, ``coordlfs.peers.landing``,
        whose descriptor ``fd`` stays the caller's), if the kernel takes it."""
        backing = self._register(os.dup(fd), path)
        if not backing:
            return None
        return Backing(path, Version.of(st), backing, None, landed=True)

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

    def let_go(self, backing: Backing) -> None:
        """The last open that read ``backing`` is released: its id goes, unless it is an
        entry's the cache still holds (later opens take it again). A source file's
        descriptor stays the caller's, for the pages the kernel read."""
        if backing.landed or backing.entry is None:  # a landed file's, a source file's
            self._close(backing.id, backing.path)
        elif backing.entry is not None and backing.entry.failed:  # dropped while held
            self._close(self._ids.pop(backing.entry.offset), backing.path)

    def dropped(self, entry: Entry, held: bool) -> None:
        """The cache dropped ``entry``: its id goes now unless open files still read it
        (``held``; then at their last release)."""
        if entry.offset in self._ids and not held:
            self._close(self._ids.pop(entry.offset), entry.path)

    @staticmethod
    def _close(backing: int, path: bytes) -> None:
        try:
            pyfuse3.backing_close(backing)
        except OSError as e:  # the mount is going away
            log.info("backing id of %s not closed: %s", os.fsdecode(path), e)

    def status(self, inodes_held: int) -> dict[str, int]:
        return {"backing_ids": len(self._ids), "inodes_open_by_passthrough": inodes_held}
