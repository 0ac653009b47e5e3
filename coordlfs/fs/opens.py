"""One owner per open file: how an open is served, and what it holds until its release.

How an open is served is one decision (``Opens.open``), made once: the reader for the bytes
the daemon is asked for (``coordlfs.fs.readers``), then, with FUSE passthrough, the backing
file the kernel reads instead (``coordlfs.fs.backing``). The reader comes first because
choosing it is what reserves the cache entry or brings a peer's file, which the backing then
is; the backing is what the inode's other opens leave possible (the kernel's rules:
docs/design/passthrough.md).

The open files of one inode share one ``OpenInode``, as libfuse's passthrough_hp keeps one
``Inode`` with its descriptor, backing id and open count: their handles and the backing their
passthrough opens hold. A small miss the kernel reads from the source file itself is
backfilled (filled after the kernel read it): only at the inode's last release is there
nothing more to read, so that is when the pages are handed to the cache
(``WholeFileCache.backfill``). Each open is counted once, here, by what serves it.
"""

from __future__ import annotations

import logging
import os
import stat

from coordlfs.cache.cache import FILL_CHUNK, Entry, WholeFileCache
from coordlfs.fs import passthrough
from coordlfs.fs.backing import Backing, Backings
from coordlfs.fs.inodes import InodeTable, Key
from coordlfs.fs.openfiles import FileHandle, OpenInode
from coordlfs.fs.readers import (
    STREAM_WHOLE,
    BackfillReader,
    CacheReader,
    LandedReader,
    PeerReader,
    Reader,
    Readers,
    StreamReader,
    WindowReader,
)
from coordlfs.fs.rows import LaneRows
from coordlfs.peers.links import PeerLink
from coordlfs.source.source import Version
from coordlfs.source.threads import in_thread
from coordlfs.system.pagecache import held_bytes

log = logging.getLogger(__name__)


class Opens:
    """The open files of the mount, by inode, and the passthrough switch they are served by."""

    def __init__(self, readers: Readers, inodes: InodeTable) -> None:
        self.readers = readers
        self.cache: WholeFileCache = readers.cache
        self.counters = readers.counters
        self.inodes = inodes
        self._open: dict[int, OpenInode] = {}
        #: who registers backing ids while passthrough is on; None while it is off
        self.backings: Backings | None = None
        #: why passthrough is off, None while it is on
        self.passthrough_off: str | None = "not asked for"
        #: the request lane's rows: the inodes whose opens it answers in C
        self.rows = LaneRows(self._open, inodes, readers, lambda: self.backings)
        self.cache.released.append(self._dropped)
        self.cache.completed.append(self.rows.completed)
        self.cache.read_elsewhere = self.rows.claim

    # -- the passthrough switch ---------------------------------------------------------

    def serve_by_passthrough(self, why_not: str | None) -> None:
        """Before mounting: passthrough is asked for at init (None), or why not."""
        self.passthrough_off = why_not
        self._switch(Backings(self.cache, self.readers.source) if why_not is None else None)

    def init(self) -> None:
        """After the kernel's INIT: it may not have granted the passthrough asked for."""
        if self.backings is None:
            return
        self.passthrough_off = passthrough.granted()
        if self.passthrough_off is None:
            log.info("FUSE passthrough on: complete cache entries are read by the kernel")
        else:
            self._switch(None)
            log.warning("FUSE passthrough off: %s", self.passthrough_off)

    def _switch(self, backings: Backings | None) -> None:
        self.backings = backings
        # with passthrough, opens the daemon serves are direct_io: the kernel keeps no pages
        # of them, so a streamed source file's own pages are the only copy worth keeping
        self.readers.direct_io = backings is not None

    def passthrough_status(self) -> dict:
        backings = self.backings
        if backings is None:
            return {"on": False, "why_off": self.passthrough_off}
        held = sum(1 for state in self._open.values() if state.held_backing() is not None)
        held += self.rows.census()[0] - sum(1 for inode, state in self._open.items()
                                            if state.lane is None and self.rows.held(inode))
        return {"on": True, "why_off": self.passthrough_off, **backings.status(held),
                "lane": self.rows.status()}

    # -- an open, decided ---------------------------------------------------------------

    async def open(self, handle: FileHandle, pid: int) -> FileHandle:
        """Serve a new open of a regular file by ``pid``: its reader, counted (every open the
        daemon answers passes here once), then its backing, then what it holds."""
        self.rows.suspend(handle.inode, handle.path)
        handle.reader = reader = await self._reader(handle, pid)
        self.counters.opened(reader.served, 1, handle.st.st_size)
        state = self._open.get(handle.inode)
        if state is None:
            state = OpenInode(handle.key)
        if self.backings is not None:
            handle.backing = self._backing(handle, state)
        state.handles.append(handle)
        self._open[handle.inode] = state
        try:
            self._hold(handle, state)
        except BaseException:
            self._let_go(handle, state)
            raise
        self.rows.offer(handle, state)
        return handle

    async def _reader(self, handle: FileHandle, pid: int) -> Reader:
        """Where the bytes come from, first found first: the cache entry, the group window,
        then (``_choose``) a peer or the cache here; sets the handle's member."""
        st, key = handle.st, handle.key
        entry = self.cache.lookup(key, st)
        handle.member, window = self.readers.aligned.opened(
            pid, handle.path, key, Version.of(st), cached=entry is not None)
        if entry is not None:
            return await self._found(entry, handle)
        if window is not None:
            return WindowReader(self.readers, handle, window)
        if not st.st_size:
            return StreamReader(self.readers, handle)
        return await self._choose(handle)

    async def _found(self, entry: Entry, handle: FileHandle) -> CacheReader:
        """The reader of an entry the open found in the cache: a hit."""
        if entry.to_backfill:  # another's open, read by the kernel from the source: read as it is
            reader: CacheReader = BackfillReader(self.readers, entry, handle)
        else:
            if not entry.complete and entry.size <= FILL_CHUNK:
                # another's fill (a prefetch, another reader) of one step: done soon, and then
                # this open is a hit the kernel may read itself
                await self.cache.wait_for(entry, entry.size)
            reader = self.readers.cached(entry, handle)
        reader.hit = True
        return reader

    async def _choose(self, handle: FileHandle) -> Reader:
        """The bytes a peer sent ahead (``coordlfs.peers.hold``), else a peer ranked before
        this node for the file, else the cache here if it has room (backfilled when the
        kernel reads the source itself), else a peer ranked after this node, else local
        storage."""
        path, st, readers = handle.path, handle.st, self.readers
        held = await readers.peers.held(path, st)  # fetched ahead: the order was handed over
        if held is not None:
            readers.peers.served_file(held[0])
            return self._from_peer(handle, held[0], held[1])
        before, after = (readers.peers.candidates(path) if st.st_size <= self.cache.max_file_size
                         else ([], []))
        peer = await self._from_peers(handle, before)
        if peer is not None:
            return peer
        assert readers.nursery is not None
        if self.backings is not None and st.st_size <= FILL_CHUNK and handle.member is None:
            entry, new = self.cache.reserve_backfill(handle.key, path, st)
            if entry is not None and not new:  # another's, reserved while peers were asked
                return await self._found(entry, handle)
            if entry is not None:
                return BackfillReader(readers, entry, handle)
        else:
            entry = await self.cache.fill_for_reader(handle.key, path, st, readers.source,
                                                     readers.nursery)
            if entry is not None:
                return readers.cached(entry, handle)
        peer = await self._from_peers(handle, after)
        return peer if peer is not None else StreamReader(readers, handle)

    async def _from_peers(self, handle: FileHandle, links: list[PeerLink]) -> Reader | None:
        """A reader on the first of ``links`` that serves the file's start (a small file
        whole)."""
        size = min(handle.st.st_size, STREAM_WHOLE)
        for link in links:
            data = await self.readers.peers.read(link, handle.path, handle.st, 0, size)
            if data is not None:
                self.readers.peers.served_file(link)
                return self._from_peer(handle, link, data)
        return None

    def _from_peer(self, handle: FileHandle, link: PeerLink,
                   data: bytes | memoryview) -> Reader:
        """The reader of a peer's reply (the file's start): the whole file, where the kernel
        may read it itself, landed for it (``LandedReader``); else held in memory."""
        readers = self.readers
        if self.backings is not None and handle.member is None and len(data) == handle.st.st_size:
            try:
                fd = readers.peers.landings.land(self.cache.files_fd, data)
            except OSError as e:  # the cache's filesystem is full, say: served from memory
                log.debug("a peer's file not landed: %s", e)
            else:
                return LandedReader(readers, fd, len(data))
        return PeerReader(readers, handle, link, data, 0)

    def _backing(self, handle: FileHandle, state: OpenInode) -> int:
        """The backing id to answer the open with, 0 for direct_io. The kernel reads a backing
        file without a word to us: its bytes are counted as the file read whole, from the
        cache or from the source (a source file the daemon would read whole; a larger one at
        its last release; a miss filled at open counted its bytes as it filled). An aligned
        member reads through the daemon (the window, the group's counts)."""
        reader, st, counters = handle.reader, handle.st, self.counters
        landed = reader.landed_fd >= 0  # a peer's file: counted as from peers when it came
        source = not landed and handle.member is None and reader.source_file
        entry = reader.entry if not (landed or source) and handle.member is None else None
        backing = self._beside(handle.inode, state, entry)
        if backing is None:
            backing = self._new_backing(handle, state, landed, source, entry)
        if not backing or landed:
            return backing
        if source:
            counters.source_opens += 1
            # a hit: another's open of the same reserved entry, counted; a larger file
            # counts what the kernel read of it at its last release
            if not reader.hit and st.st_size <= STREAM_WHOLE:
                counters.bytes_from_source += st.st_size
        else:
            counters.passthrough_opens += 1
            if reader.hit:
                counters.bytes_from_cache += st.st_size
        return backing

    def _beside(self, inode: int, state: OpenInode, entry: Entry | None) -> int | None:
        """The answer the open files of ``inode`` decide already: the id of its passthrough
        opens (any other answer would be EIO), or direct_io while one the daemon serves is
        held (a shared mapping of that one would make a passthrough open EIO); None if none
        is. The request lane's opens may be all there is: no handle of the daemon's."""
        if any(not other.backing for other in state.handles):
            return 0
        held = state.held_backing()
        if held is None:
            return None
        state.backing = held  # the daemon's opens join the lane's
        theirs = None if held.entry is None else held.entry.offset
        if (None if entry is None else entry.offset) != theirs:  # both None: the source
            log.info("inode %d opened beside passthrough opens of another backing: "
                     "reads theirs", inode)
        return held.id

    def _new_backing(self, handle: FileHandle, state: OpenInode, landed: bool, source: bool,
                     entry: Entry | None) -> int:
        """The first passthrough open of the inode: the file the kernel is to read, if it
        takes it (0 for direct_io)."""
        backings, reader = self.backings, handle.reader
        assert backings is not None
        if landed:
            held = backings.of_landed(handle.path, handle.st, reader.landed_fd)
        elif source:
            held = backings.of_source(handle.path, handle.st)
            if held is not None and isinstance(reader, BackfillReader):
                held.backfill = reader.entry
        elif entry is not None and entry.complete:
            held = backings.of_entry(entry, handle.st)
        else:
            held = None
        state.backing = held
        return 0 if held is None else held.id

    def _hold(self, handle: FileHandle, state: OpenInode) -> None:
        """Make the open hold the file it opened, as a descriptor of the source does: the
        cache entry's file of a fixed version (``FileHandle.pinned``: its backing, or kept
        by the reader), or the source file itself, opened now for the daemon's reads."""
        if handle.backing:  # read by the kernel
            assert state.backing is not None
            if state.backing.entry is not None:
                handle.pinned = state.pinned() or handle.st
            return
        handle.reader.serving()
        entry = handle.reader.entry
        if entry is not None and entry.complete:
            handle.pinned = handle.st

    # -- releases -----------------------------------------------------------------------

    def release(self, handle: FileHandle) -> None:
        """The kernel released ``handle``."""
        if handle.member is not None and not handle.reader.holds_bytes:
            self.readers.aligned.closed(handle.member, handle.key)
        self._let_go(handle, self._open[handle.inode])

    def _let_go(self, handle: FileHandle, state: OpenInode) -> None:
        """What an open of a file holds goes: its reader's, its backing's at the inode's
        last passthrough release."""
        if handle in state.handles:
            state.handles.remove(handle)
        if state.idle() and self._open.get(handle.inode) is state:
            del self._open[handle.inode]
        reader = handle.reader
        reader.close()
        held = state.backing
        if isinstance(reader, BackfillReader) and (held is None or held.backfill is not
                                                   reader.entry):
            # no backing hands its entry to the cache at its last release (direct_io, or an
            # open answered with another's backing: a reopen of an inode held at an older
            # version): the fill reads the source now, else the entry stays reserved for good
            reader.backfill()
        if handle.backing and held is not None and not any(h.backing for h in state.handles):
            state.backing = None
            assert self.backings is not None
            if state.lane is None or not state.lane.held():  # else at the lane's last release
                self.backings.let_go(held)
            if held.source_fd >= 0:
                try:
                    self._after_kernel_read(state.key, held)
                finally:
                    held.close_source()
                if held.backfill is None and state.key not in self.cache.entries:
                    # not the cache's (it was full, say): the lane's from now, by its room
                    # (an entry of the key is left alone: of another version, not this one's)
                    self.rows.looked_up(handle.inode, handle.st, handle.path)

    def _after_kernel_read(self, key: Key, held: Backing) -> None:
        """The kernel read the source file itself, the daemon saw none of it: the pages it
        brought in are copied into the cache (backfilled), or, for a file no cache keeps,
        left to the kernel's LRU, a file the daemon would read whole counted whole at its
        open and a larger one counting what the page cache holds of it (a worker thread)."""
        nursery = self.readers.nursery
        assert nursery is not None
        if held.backfill is not None:
            self.cache.backfill(key, held.backfill, self.readers.source, nursery,
                                   held.source_fd)
        elif held.version.size > STREAM_WHOLE:
            nursery.start_soon(self._count_held, os.dup(held.source_fd))

    async def _count_held(self, fd: int) -> None:
        self.counters.bytes_from_source += await in_thread(held_bytes, fd)

    def _dropped(self, key: Key, entry: Entry) -> None:
        """The cache dropped ``entry``: the lane answers no more opens of it; its backing id
        goes now, or at the last release of the opens that read it."""
        if self.backings is None:
            return
        self.rows.dropped(key, entry)
        held = False
        for state in self._open.values():
            backing = state.held_backing()
            if backing is not None and backing.entry is not None \
                    and backing.entry.offset == entry.offset:
                held = True
        self.backings.dropped(entry, held)

    # -- the kernel's view of an inode with open files -----------------------------------

    def known(self, st: os.stat_result, path: bytes) -> int:
        """The inode for a source stat result, noting the version the kernel now sees.

        An inode whose open files read a fixed version (``FileHandle.pinned``) must never be
        shown another: the kernel would take the new size over the old bytes (a mapping of
        it dies of SIGBUS). So a changed file gets a new inode, and the old one stays the
        old version's for its open files (``InodeTable.detach``)."""
        key, is_dir = (st.st_dev, st.st_ino), stat.S_ISDIR(st.st_mode)
        inode = self.inodes.inode_for(key, path, is_dir)
        pinned = None if is_dir else self.pinned(inode)
        if pinned is not None and Version.of(pinned) != Version.of(st):
            self.detach(inode, Version.of(pinned), path)
            inode = self.inodes.inode_for(key, path, is_dir)
        self.inodes.seen(inode, st)
        return inode

    def looked_up(self, inode: int, st: os.stat_result, path: bytes) -> None:
        """The kernel holds a lookup of ``inode`` now (a LOOKUP, an entry of READDIRPLUS) and
        may open it next without another: counted, and offered to the request lane."""
        self.inodes.ref(inode)
        self.rows.looked_up(inode, st, path)

    def pinned(self, inode: int) -> os.stat_result | None:
        """The version the open files of ``inode`` read, if one is fixed."""
        state = self._open.get(inode)
        return self.rows.pinned(inode) if state is None else state.pinned()

    def reading_now(self, path: bytes) -> list[int]:
        """The inodes whose open files read the source file at ``path`` as it is now (no
        version fixed): what they read and what fstat says must follow its changes, the
        request lane's among them (``LaneRows.adopt_at``)."""
        self.rows.adopt_at(path)
        return [inode for inode, state in self._open.items() if state.source_path() == path]

    def opened_stat(self, inode: int) -> os.stat_result | None:
        """The attributes of the file the open files of ``inode`` read, whatever its path
        names now (another file, a link, nothing): the version they are fixed to, else the
        source file they hold, as it is now (a rewrite in place shows at once, as it reads);
        None if none is open."""
        state = self._open.get(inode)
        if state is None:  # the lane's opens of a source file, if it holds some
            return self.rows.source_stat(inode)
        pinned = state.pinned()
        if pinned is not None:
            return pinned
        held = state.held_backing()
        if held is not None and held.source_fd >= 0:
            return os.fstat(held.source_fd)
        if not state.handles:  # a lane row with no open held
            return None
        for handle in state.handles:
            if handle.reader.source_fd >= 0:
                return os.fstat(handle.reader.source_fd)
        return state.handles[0].st  # a peer's bytes, the window's: the version opened

    def renumbered(self, inode: int, st: os.stat_result, path: bytes) -> bool:
        """Whether ``inode`` is not the file at its path any more: another file is there
        (a lookup finds that one's inode), or the file changed since the version its open
        files read, and its key got a new inode for that (``InodeTable.detach``).

        An ESTALE answer makes the kernel walk the path again with LOOKUP_REVAL
        (``do_filp_open``); FUSE's revalidation then looks the name up, meets the right
        inode, and opens that. The kernel gives an inode one backing at a time (a new open
        of an inode held by passthrough must read the old version: another backing id or
        direct_io is EIO), and an inode shows one size: so the old inode lives on for its
        open files, shown as their version (``getattr``), until the kernel forgets it.
        """
        if self.inodes.detached(inode) is not None:
            return False  # a reopen of that very inode (/proc/self/fd): it reads theirs
        if (st.st_dev, st.st_ino) != self.inodes[inode].key:
            return True
        self.rows.suspend(inode, path)  # the lane's opens of it are the daemon's to weigh
        state = self._open.get(inode)
        pinned = None if state is None else state.pinned()
        held = None if state is None else state.held_backing()
        version = (Version.of(pinned) if pinned is not None
                   else held.version if held is not None else None)
        if version is None or version == Version.of(st):
            return False
        self.detach(inode, version, path)
        return True

    def detach(self, inode: int, version: Version, path: bytes) -> None:
        """The file changed while open files of ``inode`` read ``version`` of it: new opens
        get a new inode, the old one stands for ``version``."""
        log.info("source file %s changed while open: new opens get a new inode",
                 os.fsdecode(path))
        self.rows.detached(inode, path)
        self.inodes.detach(inode, version)
