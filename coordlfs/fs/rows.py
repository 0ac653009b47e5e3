"""The request lane's rows, kept beside the open files: when the lane may answer an inode's
opens, and what its answered opens hold.

The lane (``coordlfs.fs.lane``) answers an OPEN only as a row says: "this inode is the cache
entry registered as backing id B, while the source file is version V". The rows are written
here alone, from decisions ``coordlfs.fs.opens`` made itself: offered after a hit it served
by passthrough of a complete entry's file (``offer``) or at a LOOKUP of one no open holds
(``looked_up``); suspended while it decides another open of the inode; retired when the
entry goes, the inode is detached or forgotten. A row's answered opens are open files of its
inode (``OpenInode.pinned``, ``held_backing``): a retired row lives on, answering nothing,
until the last of them is released (``released``).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable

from coordlfs.cache.cache import Entry, WholeFileCache
from coordlfs.fs.backing import Backings
from coordlfs.fs.inodes import InodeTable
from coordlfs.fs.lane import Lane
from coordlfs.fs.openfiles import FileHandle, LaneRow, OpenInode
from coordlfs.jobs.groups import Groups

log = logging.getLogger(__name__)


class LaneRows:
    """The rows of the open files table ``open`` (``Opens._open``: inode -> ``OpenInode``)."""

    def __init__(self, open_files: dict[int, OpenInode], inodes: InodeTable,
                 cache: WholeFileCache, groups: Groups,
                 backings: Callable[[], Backings | None]) -> None:
        self._open = open_files
        #: who registers backing ids now (``Opens.backings``: None once passthrough is off)
        self._backings = backings
        self.inodes = inodes
        self.cache = cache
        self._groups = groups
        #: the request lane, None while off
        self.lane: Lane | None = None
        groups.on_change.append(self._members_changed)

    def serve_by_lane(self, lane: Lane) -> None:
        """Mounted, before serving: ``lane`` answers the hits offered to it."""
        self.lane = lane
        self._members_changed()

    def _members_changed(self) -> None:
        """An aligned group's members' opens are the group's to see (its window, its
        read-ahead): while there are any, every open comes to the daemon."""
        if self.lane is not None:
            self.lane.enable(not self._groups.members)

    def status(self) -> dict[str, int] | None:
        return None if self.lane is None else self.lane.status()

    def suspend(self, inode: int) -> None:
        """The daemon decides an open of ``inode``: the lane answers none meanwhile (the
        opens it holds count on)."""
        state = self._open.get(inode)
        if state is not None and state.lane is not None and state.lane.active:
            state.lane.active = False
            state.lane.lane.suspend(inode)

    def offer(self, handle: FileHandle, state: OpenInode) -> None:
        """A hit answered by passthrough of a complete entry's file: the lane may answer the
        inode's next opens alike, while the source file stays this version."""
        held, lane = state.backing, self.lane
        if (lane is None or held is None or held.entry is None or not held.entry.complete
                or handle.backing != held.id or not handle.reader.hit
                or handle.member is not None or self.inodes.detached(handle.inode) is not None):
            return
        if lane.offer(handle.inode, held.id, handle.path, handle.st):
            state.lane = LaneRow(lane, handle.inode, held, handle.st)

    def looked_up(self, inode: int, st: os.stat_result, path: bytes) -> None:
        """The kernel was shown ``inode`` (a LOOKUP): if it is a complete cache entry no
        open holds, the lane answers its first open too. Rows go with the inodes the kernel
        forgets, so this is what keeps hits in C after the kernel dropped its dentries
        (memory pressure, drop_caches): each is looked up again before it is opened."""
        lane, backings = self.lane, self._backings()
        if lane is None or backings is None or inode in self._open \
                or not stat.S_ISREG(st.st_mode) or self.inodes.detached(inode) is not None:
            return
        key = (st.st_dev, st.st_ino)
        entry = self.cache.lookup(key, st)
        if entry is None or not entry.complete or entry.to_backfill:
            return
        backing = backings.of_entry(entry, st)
        if backing is not None and lane.offer(inode, backing.id, path, st):
            state = self._open[inode] = OpenInode(key)
            state.lane = LaneRow(lane, inode, backing, st)

    def dropped(self, entry: Entry) -> None:
        """The cache dropped ``entry``: the lane answers no more opens of it."""
        for inode, state in list(self._open.items()):
            row = state.lane
            if row is not None and row.backing.entry is not None \
                    and row.backing.entry.offset == entry.offset:
                self.retire(inode, state)

    def retire(self, inode: int, state: OpenInode) -> None:
        """The lane answers no more opens of ``inode``; its row goes now, or at the last
        release of the opens it answered (``released``)."""
        row = state.lane
        if row is None:
            return
        row.active = False
        if not row.lane.drop(inode):
            state.lane = None
            if state.idle():
                del self._open[inode]

    def released(self, inode: int) -> None:
        """The kernel released an open the lane answered whose row it no longer answers
        by (suspended while the daemon decided, or retired): at the last, the row goes, and
        the backing if no other open of the inode holds it."""
        state = self._open.get(inode)
        row = None if state is None else state.lane
        if row is None:
            log.warning("release of a lane handle of inode %d with no row", inode)
            return
        if row.lane.release(inode) or row.active:
            return
        backings = self._backings()
        assert state is not None and backings is not None
        self.retire(inode, state)
        if state.backing is None:
            backings.let_go(row.backing)

    def forgotten(self, inode: int) -> None:
        """The kernel forgot ``inode`` (it has no open file): its row goes."""
        state = self._open.get(inode)
        if state is not None:
            self.retire(inode, state)
