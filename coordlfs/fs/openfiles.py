"""The open files of the mount: a handle per open, and per inode what its open files hold.

``coordlfs.fs.opens`` decides how each open is served and keeps these; the request lane's
opens of an inode (``LaneRow``, ``coordlfs.fs.rows``) count as its open files like the
daemon's own handles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from coordlfs.fs.backing import Backing
from coordlfs.fs.inodes import Key
from coordlfs.fs.lane import Lane
from coordlfs.fs.readers import Reader
from coordlfs.jobs.groups import Member


@dataclass(slots=True, eq=False)
class FileHandle:
    inode: int
    path: bytes
    st: os.stat_result
    #: where its bytes come from (``coordlfs.fs.readers``); set at open, once the handle exists
    reader: Reader = field(init=False)
    #: the aligned-group member that opened it, if any
    member: Member | None = None
    #: the backing id its open was answered with (``coordlfs.fs.backing``); 0: none
    backing: int = 0
    #: the version its bytes are fixed to (a cache entry's file, by passthrough or kept by
    #: its reader), as stat showed it; None for bytes read from the source as they are now
    pinned: os.stat_result | None = None

    @property
    def key(self) -> Key:
        return self.st.st_dev, self.st.st_ino


@dataclass(slots=True, eq=False)
class LaneRow:
    """Opens the request lane answered (``coordlfs.fs.lane``), adopted by the daemon
    (``coordlfs.fs.rows``): open files of the inode like its own, their releases its own."""

    lane: Lane
    inode: int
    backing: Backing
    #: the version its opens read
    st: os.stat_result

    def held(self) -> int:
        return self.lane.held(self.inode)


@dataclass(slots=True, eq=False)
class OpenInode:
    """The open files of one inode: what they read decides what a new open of it may read
    (one backing per inode) and what ``getattr`` shows (one size per inode)."""

    key: Key
    handles: list[FileHandle] = field(default_factory=list)
    #: the file the daemon's passthrough opens read; None while none is held
    backing: Backing | None = None
    #: the request lane's row, whose opens read ``lane.backing``
    lane: LaneRow | None = None

    def pinned(self) -> os.stat_result | None:
        """The version the open files read, if one is fixed."""
        for handle in self.handles:
            if handle.pinned is not None:
                return handle.pinned
        row = self.lane
        if row is not None and (row.backing.entry is not None or row.backing.landed) \
                and row.held():
            return row.st  # a cache entry's file, a peer's (a source file is read as it is now)
        return None

    def held_backing(self) -> Backing | None:
        """The file the inode's passthrough opens read, the lane's among them."""
        if self.backing is None and self.lane is not None and self.lane.held():
            return self.lane.backing
        return self.backing

    def source_path(self) -> bytes | None:
        """The path of the source file the open files read as it is now (no version fixed:
        the daemon's source reads, or a passthrough of the source file itself), if they do."""
        if self.pinned() is not None:
            return None
        if self.handles:
            return self.handles[0].path
        held = self.held_backing()
        return held.path if held is not None and held.source_fd >= 0 else None

    def idle(self) -> bool:
        """No open file left, nor a lane row to answer new ones."""
        return not self.handles and self.lane is None
