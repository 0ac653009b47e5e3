"""The request lane's rows, kept beside the open files: when the lane may answer an inode's
opens, and what its answered opens hold.

The lane (``coordlfs.fs.lane``) answers an OPEN only as a row says: "this inode is the cache
entry registered as backing id B" (a hit), or "this inode is read from the source file
itself" (a miss, as passthrough_hp serves it), "while the source file is version V". The rows
are written here alone, from decisions ``coordlfs.fs.opens`` made itself: an entry's offered
after a hit it served by passthrough of a complete entry's file (``offer``), at a LOOKUP of
one no open holds (``looked_up``) or when the cache completes one the kernel knows
(``completed``), a source file's at a LOOKUP of a small file the cache does not hold; taken
back while it decides another open of the inode; retired when the entry goes, the inode is
detached or forgotten.

A row keeps no state here, only the lane's (a few hundred bytes in C per cached file the
kernel knows, counted in the status's memory figures): the opens it answered, the backing
they read, the version it was offered at. Where those matter (a getattr of an inode whose
open files read a fixed version: ``pinned``, ``opened_stat``) the lane is asked. When the
daemon must decide an open of the inode (``suspend``), or the row must go while opens are
held (its entry dropped, the inode detached), the lane's opens become the daemon's open files
of the inode (``_adopt``: an ``OpenInode`` with a ``LaneRow``), their releases its own, which
retire the row at the last (``released``). A source row's backing id and descriptor are the
lane's until then, which closes them at the last release and hands the file to the cache
(``take_notes``: backfilled from the pages the reads brought in, as after the daemon's own
passthrough miss).

A peer row is a source row whose file comes from the peer ranked first for it: the lane asks
that peer at the first open, on a connection of its own (``coordlfs.fs.lane_peers``), and the
landed file is the backing, as the daemon's own ``Opens._from_peer`` lands it; a peer that
cannot serve it sends the open to the daemon, and the row goes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable
from typing import Any

import trio

from coordlfs import CONTROL_NAME
from coordlfs.cache.cache import FILL_CHUNK, Adopted, Entry
from coordlfs.cache.stats import ReadCounters
from coordlfs.fs.backing import Backing, Backings
from coordlfs.fs.inodes import InodeTable, Key
from coordlfs.fs.lane import Keep, Kind, Lane, Note
from coordlfs.fs.lane_peers import LanePeers
from coordlfs.fs.openfiles import FileHandle, LaneRow, OpenInode
from coordlfs.fs.readers import Readers
from coordlfs.source.source import Version

log = logging.getLogger(__name__)

#: Seconds the notes of source files read wait for more before they are taken: one reader
#: closes a small file every 0.5 ms, and each wake of the loop for them costs as much as
#: taking a few (measured: 5 ms took the loop's CPU per miss from ~300 to ~250 µs). A reopen
#: meanwhile is a miss the daemon serves from the source as before.
NOTES_GATHER_S = 0.005
# the notes the loop takes before it answers anything else: a reader faster than the cache's
# bookkeeping (about 100 µs a file) must not hold off status, opens and lookups for a whole pass
NOTES_BATCH = 64
#: Entry numbers handed the lane's copier at once to name its copies as (``Lane.numbers``),
#: again when a quarter is left: a few ms of copies at any rate, numbers being free
COPY_NUMBERS = 1024
#: The last of the room that the daemon reserves at each open itself, exactly (``headroom``):
#: the lane's files are reserved when the daemon takes their notes (a few ms later), and until
#: then the room clients read (to send a file through the mount or to the source) is too
#: large by them; within the headroom it must not be, so that a file a client sends through
#: the mount, up to the headroom's size, is one the cache then keeps.
NOTE_HEADROOM = 64 << 20
#: The headroom of a small cache, at least: eight fill steps (the lane's largest files),
#: several times what its opens read between two takes of their notes.
NOTE_HEADROOM_MIN = 8 * FILL_CHUNK


def headroom(capacity: int) -> int:
    """A sixteenth of the cache, from ``NOTE_HEADROOM_MIN`` to ``NOTE_HEADROOM``: a fixed 64
    MiB left most of a small cache's first epoch to the daemon's opens (the demo's 161 MiB:
    580 of its 1,450 files), each costing the loop three times a file the lane hands over."""
    return min(NOTE_HEADROOM, max(NOTE_HEADROOM_MIN, capacity // 16))


class LaneRows:
    """The rows of the open files table ``open`` (``Opens._open``: inode -> ``OpenInode``)."""

    def __init__(self, open_files: dict[int, OpenInode], inodes: InodeTable, readers: Readers,
                 backings: Callable[[], Backings | None]) -> None:
        self._open = open_files
        #: who registers backing ids now (``Opens.backings``: None once passthrough is off)
        self._backings = backings
        self.inodes = inodes
        self.readers = readers
        self.cache = readers.cache
        self._groups = readers.aligned.groups
        #: the request lane, None while off
        self.lane: Lane | None = None
        #: its connections to peers, with it
        self.lane_peers: LanePeers | None = None
        #: whether its copier copies the notes' files into the cache (``Lane.copy_into``)
        self._copies = False
        #: whether it may answer LOOKUPs (the source is watched)
        self._lookups = False
        self._groups.on_change.append(self._members_changed)

    def serve_by_lane(self, lane: Lane, lookups: bool) -> None:
        """Mounted, before serving: ``lane`` answers the hits offered to it, and with
        ``lookups`` (the source is watched) LOOKUPs of small files the daemon holds nothing
        for (``coordlfs.fs.lane_nodes``), each with its source row."""
        self.lane = lane
        self.lane_peers = LanePeers(lane, self.readers)
        self._members_changed()
        nodes, cache = lane.nodes, self.cache
        self.inodes.serve_lane_nodes(nodes)
        cache.entries.held_by(nodes)
        self._lookups = lookups
        self.readers.peers.told.append(self._lookup_policy)
        cache.room.told.append(lambda _available: self._tell_room())
        self._lookup_policy()
        if cache.room.capacity:
            try:
                lane.copy_into(cache.files_fd)
            except OSError as e:  # the notes' files are backfilled by the daemon, as before
                log.info("the request lane copies no files for the cache: %s", e.strerror or e)
            else:
                self._copies = True
                self._number_copies()

    def _number_copies(self) -> None:
        """Keep the lane's copier in entry numbers to name its copies as, and register them
        as backing files: that much of adopting a copy (``_noted``) is done in C."""
        lane = self.lane
        if lane is not None and self._copies and lane.numbers_left() < COPY_NUMBERS // 4:
            lane.numbers(self.cache.numbers(COPY_NUMBERS), COPY_NUMBERS)

    def _lookup_policy(self) -> None:
        """The lane answers LOOKUPs of small files by ``_offer_source``'s rule: not while the
        cluster has peers (one of them may hold the file: the daemon offers a peer row), nor
        of a file over ``--max-file-size`` until the daemon said once that such files are
        not cached (``WholeFileCache.never_keeps``: the log is where a user learns why)."""
        lane, cache = self.lane, self.cache
        if lane is not None:
            self._tell_room()
            lane.nodes.policy(self._lookups and not self.readers.peers.links,
                              cache.max_file_size, not cache.too_large_said, FILL_CHUNK,
                              headroom(cache.room.capacity), not cache.room.capacity,
                              CONTROL_NAME.encode())

    def _tell_room(self) -> None:
        """The cache's room changed (a reservation, an entry dropped): the lane promises a
        source row's file to the cache at its first open only while the room, less the
        files promised and not reserved yet, takes it with ``headroom`` to spare
        (within it the daemon's open reserves the file), checks again at the last release,
        and hands over a file the room that comes back takes. The room by the capacity alone
        (``Room.by_capacity``): a cache filesystem that ran out is asked per file handed
        over (``_noted``), so that its room coming back is seen as the daemon's own opens
        see it."""
        if self.lane is not None:
            self.lane.nodes.room(self.cache.room.by_capacity())

    def no_lookups(self) -> None:
        """The source is no longer watched: LOOKUPs are the daemon's (names revalidate)."""
        if self.lane is not None:
            self._lookups = False
            self._lookup_policy()
            self.lane.nodes.clear_directories()

    def watched(self, inode: int, path: bytes) -> None:
        """The daemon watches directory ``inode`` at ``path``: the lane may answer LOOKUPs of
        names in it (a change of one reaches the kernel as an invalidation, as for ours)."""
        if self.lane is not None and self._lookups:
            self.lane.nodes.directory(inode, path)

    def _members_changed(self) -> None:
        """An aligned group's members' opens are the group's to see (its window, its
        read-ahead): while there are any, every open comes to the daemon."""
        if self.lane is not None:
            self.lane.enable(not self._groups.members)

    def fold(self, reads: ReadCounters) -> None:
        """Bring the mount's counters up to the lane's (``stats.folds``): its opens, and
        the files its peer connections fetched."""
        if self.lane is not None and self.lane_peers is not None:
            self.lane.fold(reads)
            self.lane_peers.fold(reads)

    def status(self) -> dict[str, Any] | None:
        if self.lane is None or self.lane_peers is None:
            return None
        return {**self.lane.status(), "peers": self.lane_peers.status()}

    def noting(self) -> int:
        """Files the lane's opens read that the cache is about to be handed (``take_notes``)
        and has not reserved yet: fills in flight, as far as a caller waiting for them is
        concerned."""
        return 0 if self.lane is None else self.lane.noting()

    def census(self) -> tuple[int, int]:
        """Inodes whose opens the lane holds by an entry's row (the daemon has no record of
        them), and the bytes a row costs (0 without the lane): its own, the backing id it
        keeps registered (``Backings.id_bytes``)."""
        lane, backings = self.lane, self._backings()
        if lane is None or backings is None:
            return 0, 0
        held, row = lane.census()
        return held, row + backings.id_bytes()

    def nodes(self) -> tuple[int, int, int]:
        """The nodes the lane numbered and keeps (inodes the kernel knows beside the table's),
        their bytes, and what a key the lane is told is held costs (0s without the lane)."""
        if self.lane is None:
            return 0, 0, 0
        nodes, _, _, key_bytes, node_bytes = self.lane.nodes.gauges()
        return nodes, node_bytes, key_bytes

    def held(self, inode: int) -> bool:
        """Whether the lane holds opens of ``inode`` it answered, not adopted (the daemon has
        no record of them beside its own: ``census`` counts them)."""
        return self.lane is not None and self.lane.held_stat(inode)[0] is not Kind.NONE

    def suspend(self, inode: int, path: bytes) -> None:
        """The daemon decides an open of ``inode`` (at ``path``): the lane answers none
        meanwhile, and the opens it holds become the daemon's open files of the inode."""
        if self.lane is not None:
            self._adopt(self.lane, inode, path, held_only=False)

    def pinned(self, inode: int) -> os.stat_result | None:
        """The version the lane's held opens of ``inode`` read, if fixed (an entry's file, a
        peer's), as its row was offered (no open of the daemon's beside: ``OpenInode``)."""
        return None if self.lane is None else self.lane.held_stat(inode)[1]

    def source_stat(self, inode: int) -> os.stat_result | None:
        """The attributes of the file the lane's held opens of ``inode`` read (no open of the
        daemon's beside): a source file's as it is now, else the version fixed; None if it
        holds none."""
        if self.lane is None:
            return None
        kind, st = self.lane.held_stat(inode)
        return self.lane.source_stat(inode) if kind is Kind.SOURCE else st

    def adopt_at(self, path: bytes) -> None:
        """The source file at ``path`` changed (the watch says): if the lane holds opens of
        it by a source row, they become the daemon's open files (``Opens.reading_now``:
        their attributes follow the change). A change in place keeps the file's key; asked
        only while the lane holds some (an lstat per change otherwise)."""
        lane = self.lane
        if lane is None or not lane.sources_held():
            return
        try:
            st = self.readers.source.lstat(path)
        except (OSError, ValueError):
            return
        inode = self.inodes.find((st.st_dev, st.st_ino))
        if inode is not None and inode not in self._open:
            self._adopt(lane, inode, path, held_only=True)

    def _adopt(self, lane: Lane, inode: int, path: bytes, held_only: bool,
               entry: Entry | None = None) -> None:
        """The lane's row of ``inode`` no longer answers (``held_only``: if it holds opens);
        the opens it holds become the daemon's open files of the inode, read from the backing
        it gives over (an entry's: ``entry``, or the cache's of the version they read)."""
        taken = lane.suspend(inode, held_only)
        if taken is None:
            return
        st = taken.st
        if taken.kind is Kind.SOURCE:
            st = os.fstat(taken.fd)
            held = Backing(path, Version.of(st), taken.backing, None, taken.fd)
        elif taken.kind is Kind.PEER:  # the landed file: the backing id holds it
            os.close(taken.fd)
            held = Backing(path, Version.of(st), taken.backing, None, landed=True)
        else:
            held = Backing(path, Version.of(st), taken.backing,
                           entry or self.cache.lookup((st.st_dev, st.st_ino), st))
            if held.entry is None:  # not found: its id closed at the last release
                log.info("opens of inode %d read an entry the cache no longer has", inode)
        state = self._open.get(inode)
        if state is None:
            state = self._open[inode] = OpenInode((st.st_dev, st.st_ino))
        state.lane = LaneRow(lane, inode, held, st)

    def offer(self, handle: FileHandle, state: OpenInode) -> None:
        """A hit answered by passthrough of a complete entry's file: the lane may answer the
        inode's next opens alike, while the source file stays this version (the opens it
        held before, the daemon's since, are its own again)."""
        held, lane = state.backing, self.lane
        if (lane is None or held is None or held.entry is None or not held.entry.complete
                or handle.backing != held.id or not handle.reader.hit
                or handle.member is not None or self.inodes.detached(handle.inode) is not None):
            return
        if lane.offer(handle.inode, held.id, handle.path, handle.st):
            state.lane = None

    def looked_up(self, inode: int, st: os.stat_result, path: bytes) -> None:
        """The kernel was shown ``inode`` (a LOOKUP): if it is a complete cache entry no
        open holds, the lane answers its first open too. Rows go with the inodes the kernel
        forgets, so this is what keeps hits in C after the kernel dropped its dentries
        (memory pressure, drop_caches): each is looked up again before it is opened."""
        lane = self.lane
        if lane is None or not stat.S_ISREG(st.st_mode) or not self._offerable(inode):
            return
        entry = self.cache.lookup((st.st_dev, st.st_ino), st)
        if entry is None:
            self._offer_source(lane, inode, st, path)
        else:
            self._offer_entry(lane, inode, entry, st, path)

    def completed(self, key: Key, entry: Entry, st: os.stat_result) -> None:
        """The cache completed ``entry`` (a fill, a backfill at the last release), the source
        showing its version in ``st``: if the kernel knows its inode and no open holds it,
        the lane answers its next open, as after a LOOKUP; so a later epoch's first open of a
        file filled in this one is a hit in C (the kernel keeps the name: no LOOKUP comes).
        The lane checks the file at the inode's path per open, as for every row."""
        lane = self.lane
        inode = None if lane is None else self.inodes.number(key)
        if lane is not None and inode is not None and self._offerable(inode):
            # a node the lane numbered stays its own (no row of ours): the entry's path is
            # one to the file, as good for the lane's check
            path = entry.path if self.inodes.lanes(inode) else self.inodes.path(inode)
            self._offer_entry(lane, inode, entry, st, path)

    def _offerable(self, inode: int) -> bool:
        """Whether a row may be offered for ``inode``: no open holds it (rows of held inodes
        are offered by ``offer``, after the daemon's own hit), and it stands for the file as
        it is (not detached)."""
        return inode not in self._open and self.inodes.detached(inode) is None

    def _offer_entry(self, lane: Lane, inode: int, entry: Entry, st: os.stat_result,
                     path: bytes) -> None:
        """A complete entry no open holds: the lane answers the inode's opens with it."""
        backings = self._backings()
        if backings is None or not entry.complete or entry.to_backfill:
            return
        backing = backings.entry_id(entry)
        if backing:
            lane.offer(inode, backing, path, st)

    def _offer_source(self, lane: Lane, inode: int, st: os.stat_result, path: bytes) -> None:
        """A small file the cache does not hold: its opens are answered with the source file
        itself, as the daemon answers them (``Opens._choose``), and handed to the cache at a
        last release the room takes it at (``Keep.ROOM``, ``_tell_room``: while the cache
        is full, every open stays in C). Not while the mount has peers (one of them may hold it:
        ``_offer_peer``), nor for a larger file (filled as it is read) or an empty one."""
        size, cache = st.st_size, self.cache
        if not 0 < size <= FILL_CHUNK:
            return
        if self.readers.peers.links:
            self._offer_peer(lane, inode, st, path)
        elif cache.never_keeps(path, size):
            lane.offer_source(inode, path, st, Keep.NEVER)
            if size > cache.max_file_size:
                self._lookup_policy()  # said now: such files are the lane's from here on
        else:
            lane.offer_source(inode, path, st, Keep.ROOM)

    def _offer_peer(self, lane: Lane, inode: int, st: os.stat_result, path: bytes) -> None:
        """A small file a peer ranked before this node caches (``Opens._choose`` asks that
        one first too), while the lane has a connection to it: its opens are answered with the
        file fetched by the lane. Not while the holding area has an order (it may hold the
        file, fetched ahead), nor for a file this node's cache would not keep either."""
        peers, lane_peers = self.readers.peers, self.lane_peers
        hold = peers.hold
        if lane_peers is None or st.st_size > self.cache.max_file_size or (
                hold is not None and hold.has_order()):
            return
        before, _ = peers.candidates(path)
        slot = lane_peers.slot(before[0]) if before else None
        if slot is not None:
            lane.offer_peer(inode, path, st, slot)

    async def take_notes(self) -> None:
        """Hand each source file the lane's opens read to the cache, as they come."""
        lane = self.lane
        assert lane is not None
        while True:
            await trio.lowlevel.wait_readable(lane.notes_fd)
            await trio.sleep(NOTES_GATHER_S)
            with contextlib.suppress(BlockingIOError):
                os.read(lane.notes_fd, 8)
            while self.take_waiting(NOTES_BATCH):
                await trio.lowlevel.checkpoint()

    async def take_all(self, seconds: float) -> None:
        """At unmount: wait, at most ``seconds``, for the lane's copier to hand over the
        files it is copying, then take every file the lane has (``take_waiting``)."""
        if self.lane is not None:
            with trio.move_on_after(seconds):
                while self.lane.copying():
                    await trio.sleep(0.005)
        self.take_waiting()

    def take_waiting(self, most: int | None = None) -> bool:
        """Hand the cache the files the lane has for it now, at most ``most``: whether it
        stopped there (more may wait)."""
        if self.lane is None:
            return False
        added: list[Adopted] = []
        taken = 0
        self._number_copies()
        try:
            for note in self.lane.notes():
                taken += 1
                try:
                    self._noted(note, added)
                finally:
                    os.close(note.fd)
                    if note.copy >= 0:
                        os.close(note.copy)
                if taken == most:
                    return True
            return False
        finally:  # one journal write for the batch's copies
            self.cache.adopted(added)

    def _noted(self, note: Note, added: list[Adopted]) -> None:
        """Keep the file of ``note`` if it is still the version its reads read and the cache
        has room (storage was read, and counted, once, by the lane's opens): its copy made by
        the lane (``copy_into``, named and registered there if it had numbers) as its entry's
        file, to be told with the batch's in ``added``; else backfilled from the pages those
        reads brought in."""
        st = os.fstat(note.fd)
        current = st.st_dev == note.dev and Version.of(st) == note.version
        if note.copy >= 0:
            self._adopt_copy(note, st if current else None, added)
            return
        if not current:
            return
        readers = self.readers
        assert readers.nursery is not None
        # no room since (taken meanwhile): the row answers on from the source, decided
        # again at its next open (``WholeFileCache.reserve`` leaves it)
        self.cache.fill_noticed((st.st_dev, st.st_ino), note.path, st, readers.source,
                                readers.nursery, note.fd)

    def _adopt_copy(self, note: Note, st: os.stat_result | None, added: list[Adopted]) -> None:
        """The cache adds the lane's copy of ``note``'s file, of the version ``st`` shows
        (None: the file changed since, and the copy goes); the id the copier registered for
        it is kept as the entry's, or closed."""
        cache = self.cache
        entry = None
        if st is None:
            cache.discard_copy(note.number, note.path)
        else:
            key = (st.st_dev, st.st_ino)
            entry = cache.adopt_copy(key, note.path, st, note.copy, note.number)
            if entry is not None:
                added.append((key, entry, st))
        if note.backing:
            backings = self._backings()
            assert backings is not None  # passthrough is settled before the lane starts
            backings.registered(entry, note.backing, note.path)

    def claim(self, key: Key) -> bool:
        """The cache is about to reserve an entry for ``key`` (a fill, a prefetch): whether
        the lane's opens are reading its file from the source, for the cache to be handed at
        their last release (then it must not: storage would be read twice). Else its source
        row goes, so that its next open waits for the fill (a hit) instead."""
        lane = self.lane
        inode = self.inodes.number(key) if lane is not None else None
        if lane is None or inode is None or inode in self._open:
            return False  # no source row: it is offered only while no open holds the inode
        return lane.claim(inode)

    def dropped(self, key: Key, entry: Entry) -> None:
        """The cache dropped ``entry`` (of ``key``): the lane answers no more opens of it;
        opens held become the daemon's (their backing id goes at the last release)."""
        lane = self.lane
        inode = None if lane is None else self.inodes.find(key)
        if lane is not None and inode is not None:
            self._adopt(lane, inode, self.inodes.path(inode), held_only=True, entry=entry)
            lane.drop(inode)
        for inode, state in list(self._open.items()):
            row = state.lane
            if row is not None and row.backing.entry is not None \
                    and row.backing.entry.offset == entry.offset:
                self.retire(inode, state)

    def detached(self, inode: int, path: bytes) -> None:
        """``inode`` stands for an old version now (``Opens.detach``): the lane answers no
        more opens of it; those held become the daemon's."""
        if self.lane is not None:
            self._adopt(self.lane, inode, path, held_only=False)
        state = self._open.get(inode)
        if state is not None:
            self.retire(inode, state)

    def retire(self, inode: int, state: OpenInode) -> None:
        """The opens the lane held of ``inode``, adopted by the daemon, are gone, or the row
        must go: it goes now, or at the last release of those opens (``released``)."""
        row = state.lane
        if row is not None and not row.lane.drop(inode):
            state.lane = None
            if state.idle():
                del self._open[inode]

    def released(self, inode: int) -> None:
        """The kernel released an open the lane answered whose row the daemon adopted: at
        the last, the row goes, and the backing if no other open of the inode holds it."""
        state = self._open.get(inode)
        row = None if state is None else state.lane
        if row is None:
            log.warning("release of a lane handle of inode %d with no row", inode)
            return
        if row.lane.release(inode):
            return
        backings = self._backings()
        assert state is not None and backings is not None
        self.retire(inode, state)
        if state.backing is None:
            backings.let_go(row.backing)
            row.backing.close_source()

    def forgotten(self, inode: int) -> None:
        """The kernel forgot ``inode`` (it has no open file): its row goes."""
        state = self._open.get(inode)
        if state is not None:
            self.retire(inode, state)
        elif self.lane is not None:
            self.lane.drop(inode)
