"""Where an open file's bytes come from: one reader per handle, one class per source of bytes.

A handle's reader is chosen once, at open (``coordlfs.fs.opens``): a cache entry (complete or
filling), the group window holding the file for this member, else a peer ranked before this
node, else the cache here if it has room, else a peer ranked after this node, else local storage
(``coordlfs.peers.placement``). Choosing at open lets the daemon step out of a small miss's
reads: where passthrough is on the kernel reads the source file itself
(``Reader.source_file``) and the entry is backfilled from the pages it brought in
(``BackfillReader``), and for a file nobody caches it just reads the source file; without
passthrough a file of one fill step is filled before the open returns and its reads are
answered from the entry.
A reader that cannot go on (a fill that failed, a peer that went down mid-file) hands the rest
of the file to local storage itself, so ``Operations.read`` only ever asks its handle's reader.
A new source of bytes is a new class here, never another field on the handle.

The cache hit stays inline in ``Operations.read`` (``Reader.entry``): it runs at the bare
pyfuse3 ceiling, where another coroutine per request would show. ``AlignedReads`` is what a
member of an aligned group adds to opening, streaming and closing a file.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from coordlfs.cache.cache import Entry, WholeFileCache
from coordlfs.cache.stats import Outcome, ReadCounters
from coordlfs.fs.inodes import Key
from coordlfs.jobs.groups import Groups, Member
from coordlfs.jobs.prefetch import Prefetcher
from coordlfs.jobs.window import ReadWindow
from coordlfs.peers.links import PeerLink, Peers
from coordlfs.peers.wire import MAX_CHUNK
from coordlfs.source.source import Source, SourceReader, Version
from coordlfs.source.threads import in_thread

#: Ranges of a large file from a peer (a GET each) asked for ahead of its reader: enough in
#: flight that the link does not wait a round trip between them (``PeerReader``).
AHEAD = 8
#: Files up to this size that the cache does not keep are read from the source whole, on their
#: first request, and kept by the handle until it is closed: a reader reading in small pieces
#: costs one storage read, and a request the kernel repeats (its page was reclaimed before
#: the reader copied it, common when memory is tight) costs none. Larger files stream by
#: the kernel's own readahead; the handle keeps only the last range.
STREAM_WHOLE = 1 << 20


class Handle(Protocol):
    """What a reader knows of the open file it serves (``fs.FileHandle``)."""

    path: bytes
    st: os.stat_result
    #: the aligned-group member that opened it, if any
    member: Member | None
    reader: Reader


def key_of(st: os.stat_result) -> Key:
    return st.st_dev, st.st_ino


class Reader:
    """The source of one handle's bytes, for the reads that are not cache hits."""

    #: a cache entry: once it is complete ``Operations.read`` serves it inline, as a hit
    entry: Entry | None = None
    #: the bytes are the source file's own, read as they are: the kernel may read that file
    #: itself (FUSE passthrough) instead of asking for them
    source_file: bool = False
    #: the open found the file in the cache, complete or being filled by another (a miss
    #: this open filled is not a hit: its bytes are counted as the source's, by the fill)
    hit: bool = False
    #: its bytes are the source file's as they are now, read from the descriptor its open
    #: kept: a read is cut at the file's size now (``size``), not at its size at open
    live: bool = False
    #: the whole file landed in a file of its own, which the kernel may read itself
    #: (``LandedReader``); -1 if none
    landed_fd: int = -1

    @property
    def served(self) -> Outcome:
        """What serves the open, as counted (``ReadCounters.opened``): the source, unless
        the reader says otherwise."""
        return Outcome.MISS

    @property
    def holds_bytes(self) -> bool:
        """Whether the daemon handed this handle the file's bytes itself (streamed, from a
        peer, from the group window): an aligned member that closes a file it had none of read
        it from the kernel's pages (``AlignedReads.closed``)."""
        return False

    async def read(self, off: int, size: int) -> bytes | memoryview:
        raise NotImplementedError

    def serving(self) -> None:
        """The open is answered without a backing file: the daemon serves its reads. Hold
        now what they are to read, so that whatever the source's names do meanwhile, the
        handle reads the file it opened (blocking, but no more than the open's lstat)."""

    @property
    def source_fd(self) -> int:
        """The source file's descriptor this handle reads from, -1 if none."""
        return -1

    def size(self) -> int:
        """The size of the file a ``live`` reader reads, now."""
        return os.fstat(self.source_fd).st_size

    def close(self) -> None:
        """The handle is released."""


class CacheReader(Reader):
    """A cache entry, complete or filling: a read waits for its bytes to arrive. If the fill
    fails (or the entry is dropped, the source changed) the rest streams from the source."""

    def __init__(self, cache: WholeFileCache, entry: Entry,
                 stream: Callable[[], Reader]) -> None:
        self.cache = cache
        self.entry = entry
        self._stream = stream
        self._instead: Reader | None = None
        #: the complete entry's file, kept by an open the daemon serves (``serving``)
        self._kept: KeptReader | None = None

    @property
    def served(self) -> Outcome:
        """A hit if the open found the entry complete (a fill of its own, or a backfill of
        what the kernel read from the source, is a miss)."""
        return Outcome.HIT if self.hit and self.entry.complete else Outcome.MISS

    @property
    def holds_bytes(self) -> bool:
        return self._instead is not None and self._instead.holds_bytes

    def serving(self) -> None:
        """A complete entry's file is kept open: should the cache drop the entry (its
        source changed), this handle still reads the version it opened, whole."""
        if self.entry.complete:
            self._kept = KeptReader(self.cache.entry_fd(self.entry), self.entry.size)

    async def read(self, off: int, size: int) -> bytes | memoryview:
        if self._instead is None:
            if await self.cache.wait_for(self.entry, off + size):
                return self.cache.data(self.entry, off, size)
            self._instead = self._kept if self._kept is not None else self._stream()
        return await self._instead.read(off, size)

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
        if self._instead is not None and self._instead is not self._kept:
            self._instead.close()


class KeptReader(Reader):
    """A complete entry's file, kept open by its handle after the cache dropped the entry
    (unlinked, the kernel keeps it for the descriptor): the version the handle opened."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    async def read(self, off: int, size: int) -> bytes | memoryview:
        # the cache's own memory (tmpfs): no storage behind it, so read inline
        return os.pread(self.fd, max(0, min(size, self.size - off)), off)

    def close(self) -> None:
        os.close(self.fd)


class BackfillReader(CacheReader):
    """A small miss the kernel reads from the source file itself (FUSE passthrough): its
    entry is reserved, and backfilled from the pages those reads bring in at the inode's
    last release (``Opens``, ``WholeFileCache.backfill``), when the kernel has read all
    it will. Should the daemon be asked for bytes after all (the source file could not be
    the open's backing), it backfills at once, reading the source, and the reads wait."""

    source_file = True

    def __init__(self, readers: Readers, entry: Entry, handle: Handle) -> None:
        super().__init__(readers.cache, entry, lambda: StreamReader(readers, handle))
        self.readers = readers
        self.handle = handle

    def backfill(self) -> None:
        """Fill the entry now, from the source: once, whoever asks first."""
        readers = self.readers
        assert readers.nursery is not None
        readers.cache.backfill(key_of(self.handle.st), self.entry, readers.source,
                                  readers.nursery)

    async def read(self, off: int, size: int) -> bytes | memoryview:
        self.backfill()
        return await super().read(off, size)


class RangeReader(Reader):
    """A range of the file the handle keeps in memory (a small file whole, a peer's reply),
    from ``offset`` in it: a request the kernel repeats costs nothing."""

    def __init__(self, data: bytes | memoryview = b"", offset: int = 0) -> None:
        self.data = data
        self.offset = offset

    @property
    def holds_bytes(self) -> bool:
        return bool(self.data)

    def held(self, off: int, size: int) -> memoryview | None:
        """The range if the held bytes cover it."""
        start = off - self.offset
        if start < 0 or off + size > self.offset + len(self.data):
            return None
        return memoryview(self.data)[start : start + size]

    def hold(self, data: bytes, offset: int, off: int, size: int) -> memoryview:
        """Keep ``data`` (from ``offset`` in the file) and serve the range from it; a source
        that returned fewer bytes (the file shrank) gives a short read."""
        self.data, self.offset = data, offset
        start = off - offset
        return memoryview(data)[start : start + size]


class StreamReader(RangeReader):
    """Local storage, nothing cached: a small file is read whole on its first request (once
    for an aligned group, ``AlignedReads.whole``), a larger one by ranges, keeping the last."""

    def __init__(self, readers: Readers, handle: Handle, data: bytes = b"") -> None:
        super().__init__(data)
        self.readers = readers
        self.handle = handle
        self._file: SourceReader | None = None
        # nobody keeps it: the kernel may read it itself, whatever its size (an aligned
        # member's reads go through the daemon, for the group's window and counts)
        self.source_file = not data and handle.member is None

    def serving(self) -> None:
        """Open the source file now, at the open: later names (a rename over it, an unlink,
        a symlink in its place) no longer reach it, but this descriptor does."""
        self._file = self._open()
        self.live = True

    @property
    def source_fd(self) -> int:
        return -1 if self._file is None else self._file.fd

    def _open(self) -> SourceReader:
        """The source file at the handle's path, if it is still the file opened (its key):
        else ESTALE, and the kernel looks the name up again."""
        # with passthrough this open is direct_io: the source's pages are the only copy the
        # kernel could keep (without it the mount's own page cache holds what it is sent)
        opened = self.readers.source.open_reader(self.handle.path,
                                                 keep_pages=self.readers.direct_io)
        st = opened.fstat()
        if key_of(st) != key_of(self.handle.st):
            opened.close()
            raise OSError(errno.ESTALE, "the source file was replaced")
        return opened

    async def read(self, off: int, size: int) -> bytes | memoryview:
        held = self.held(off, size)
        if held is not None:
            return held
        st = self.handle.st
        if st.st_size <= STREAM_WHOLE:
            return self.hold(await self._whole(), 0, off, size)
        return self.hold(await self.pread(off, size), off, off, size)

    async def _whole(self) -> bytes:
        def fetch() -> Awaitable[bytes]:
            return self.pread(0, st.st_size)

        st, member = self.handle.st, self.handle.member
        if member is None:
            return await fetch()
        return await self.readers.aligned.whole(member, key_of(st), Version.of(st), fetch)

    async def pread(self, off: int, size: int) -> bytes:
        """``size`` bytes at ``off`` from local storage; unless the open kept the file
        (``serving``), the first call opens it, in the same hand-off to a thread as its read."""
        data = await in_thread(self._pread, off, size)
        self.readers.counters.bytes_from_source += len(data)
        return data

    def _pread(self, off: int, size: int) -> bytes:
        if self._file is None:  # a reader that turned to the source after its open
            self._file = self._open()
        return self._file.pread(off, size)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class WindowReader(StreamReader):
    """The whole file, which the group's read window held for this member at open (only a
    file that shrank since would leave a range to stream)."""

    #: the mount's memory served it, as the cache would have: no storage read for this open
    served = Outcome.HIT

    def serving(self) -> None:
        """Nothing to open: the window handed over the bytes."""


class PeerReader(RangeReader):
    """A peer's memory, starting from the reply that chose it (a small file whole). The
    rest of a large file is fetched ``AHEAD`` ranges of a GET each ahead of the reader, so
    the link carries several at once where one at a time would wait a round trip for each
    (a reader of a large file from a peer got 0.27 of the protocol's throughput); once the
    peer fails (down, or it no longer holds this version) the rest streams from local
    storage."""

    served = Outcome.PEER_HIT

    def __init__(self, readers: Readers, handle: Handle, link: PeerLink,
                 data: bytes | memoryview, offset: int) -> None:
        super().__init__(data, offset)
        self.readers = readers
        self.handle = handle
        self.link = link
        self._local: StreamReader | None = None
        #: ranges asked for ahead, by number (offset // MAX_CHUNK)
        self._ahead: dict[int, _Ahead] = {}

    async def read(self, off: int, size: int) -> bytes | memoryview:
        if self._local is None:
            held = self.held(off, size)
            if held is not None:
                return held
            data = await self._fetched(off, size)
            if data is not None:
                return data
            self._local = StreamReader(self.readers, self.handle)
        return await self._local.read(off, size)

    async def _fetched(self, off: int, size: int) -> memoryview | None:
        """The range from the ranges asked for ahead (asking for those it needs and the
        ``AHEAD`` after them); None if the peer did not serve one."""
        first, last = off // MAX_CHUNK, (off + size - 1) // MAX_CHUNK
        for number in [n for n in self._ahead if n < first]:  # passed: not read again
            del self._ahead[number]  # one on its way is dropped when it comes
        end = -(-self.handle.st.st_size // MAX_CHUNK)
        for number in range(first, min(end, last + 1 + AHEAD)):
            if number not in self._ahead:
                self._ahead[number] = self._ask(number)
        parts = []
        for number in range(first, last + 1):
            ahead = self._ahead[number]
            await ahead.done.wait()
            if ahead.data is None:
                return None
            parts.append(ahead.data)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return self.hold(data, first * MAX_CHUNK, off, size)

    def _ask(self, number: int) -> _Ahead:
        """Start fetching range ``number`` of the file."""
        ahead = _Ahead(trio.Event())
        start = number * MAX_CHUNK
        length = min(MAX_CHUNK, self.handle.st.st_size - start)

        async def fetch() -> None:
            # never cancelled (a request cut in its send would put the link out of step):
            # one no longer wanted ends within the peer timeout, and its bytes are dropped
            try:
                ahead.data = await self.readers.peers.read(self.link, self.handle.path,
                                                           self.handle.st, start, length)
            finally:
                ahead.done.set()

        assert self.readers.nursery is not None
        self.readers.nursery.start_soon(fetch)
        return ahead

    def close(self) -> None:
        self._ahead.clear()
        if self._local is not None:
            self._local.close()


@dataclass(eq=False, slots=True)
class _Ahead:
    """A range of a large file asked of a peer ahead of its reader (``PeerReader``)."""

    done: trio.Event
    #: its bytes once they came; None if the peer did not serve them (or not yet)
    data: bytes | bytearray | None = None


class LandedReader(Reader):
    """A peer's file whole, landed in a file of its own (``coordlfs.peers.landing``) after
    its frame's checksum was checked: the open is answered with that file as its backing
    (``Opens.open``), so the kernel reads it and no READ reaches the daemon. Should
    the daemon serve the reads after all (the kernel refused the backing, or another open of
    the inode decides), they are read from that file."""

    def __init__(self, readers: Readers, fd: int, size: int) -> None:
        self.readers = readers
        self.landed_fd = fd
        self.landed_size = size

    served = Outcome.PEER_HIT

    @property
    def holds_bytes(self) -> bool:
        return True

    async def read(self, off: int, size: int) -> bytes | memoryview:
        # the cache's own memory (tmpfs): no storage behind it, so read inline
        return os.pread(self.landed_fd, max(0, min(size, self.landed_size - off)), off)

    def close(self) -> None:
        os.close(self.landed_fd)
        self.readers.peers.landings.closed(self.landed_size)


class Readers:
    """What the readers of the mount share; which reader an open gets is ``Opens.open``'s."""

    def __init__(self, source: Source, cache: WholeFileCache, counters: ReadCounters,
                 peers: Peers, aligned: AlignedReads) -> None:
        self.source = source
        self.cache = cache
        self.counters = counters
        self.peers = peers
        self.aligned = aligned
        #: Fills outlive the read that started them; set by the daemon before serving.
        self.nursery: trio.Nursery | None = None
        #: the opens the daemon serves are direct_io (FUSE passthrough on): the kernel keeps
        #: no pages of them, so a streamed source file keeps its own
        self.direct_io = False

    def cached(self, entry: Entry, handle: Handle) -> CacheReader:
        """The reader of ``entry``, streaming the rest from the source should it fail."""
        return CacheReader(self.cache, entry, lambda: StreamReader(self, handle))


class AlignedReads:
    """What a read by a member of an aligned group does beyond a plain read: ``opened``
    attributes the opening process to a member, moves the group's lead (waking the
    read-ahead) and takes the file from the read window if a member fetched it; ``whole``
    fetches a small file once for the group; ``closed`` counts a member that read the file
    from the kernel's pages. See ``coordlfs.jobs.groups`` and ``coordlfs.jobs.window`` for why."""

    def __init__(self, groups: Groups, window: ReadWindow, prefetcher: Prefetcher) -> None:
        self.groups = groups
        self.window = window
        self.prefetcher = prefetcher

    def opened(self, pid: int, path: bytes, key: Key, version: Version,
               cached: bool) -> tuple[Member | None, bytes | None]:
        """The member behind a reader (if the file is not in the cache) and the bytes the group's
        window holds for it, if any."""
        member = self.groups.member_for_reader(pid) if self.groups.members else None
        if member is None:
            return None, None
        if self.groups.note_read(member, path):
            self.prefetcher.poke()
        if cached or not self.window.capacity:
            return None, None
        return member, self.window.take(key, version, member.id)

    async def whole(self, member: Member, key: Key, version: Version,
                    fetch: Callable[[], Awaitable[bytes]]) -> bytes:
        """A small file's bytes for ``member``: the first member (or the read-ahead) fetches,
        the others wait for that fetch and take its bytes."""
        await self.window.wait_for_fetch(key)
        held = self.window.take(key, version, member.id)
        if held is not None:
            return held
        others = self.groups.others(member)
        if not others:
            return await fetch()
        self.window.claim(key)
        data = None
        try:
            data = await fetch()
        finally:
            self.window.publish(key, version, data, member.id, others)
        return data

    def closed(self, member: Member, key: Key) -> None:
        """``member`` closed a file whose bytes the kernel served: it has read it all the same."""
        self.window.closed(key, member.id)
