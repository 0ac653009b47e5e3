"""The no-eviction cache: whole files, kept in shared memory, never evicted.

The policy is the one the CoorDL paper (section 4.1) calls MinIO (minimal I/O; not the S3
server): it caches items as they are first read until the capacity is reached and then never
replaces anything. With random-order epochs every later epoch then gets exactly ``capacity``
bytes of hits, where an LRU cache thrashes.

``WholeFileCache`` is the store: its entries (rows of an ``entries.EntryTable``, about 70
bytes and the path each, not objects), the one way an entry comes in (``reserve``, against
the room, behind ``_claim`` for every fill that looks first), the one way a fill ends
(``end_fill``: journaled and complete, or given up) and the one way an entry goes
(``_release``). Its parts, each a module of its own:

- ``directory``: the cache directory, private and locked, and what is left of it at the end;
- ``files``: each entry's file (``files/<number>``), the one copier that fills them, the
  mappings of complete ones; ``backfill``: fills from a reader's pages after it closed;
- ``room``: the capacity charged whole pages, and a filesystem that ran out before it;
- ``journal``: which source path and version each entry holds, for a restart;
- ``restart``: a kept cache adopted at once and checked against the source while serving;
- ``publishing``: the index in shared memory where ``coordlfs.client`` finds complete
  entries, withdrawn the moment their source file may have changed.

A file is filled in chunks; readers wait only until the bytes they asked for have arrived, so
a large file streams while it is being cached. An entry that is dropped (its source file
changed) has its file unlinked at once: readers that opened it (a passthrough open, a
client's mapping) keep the old bytes until they close, and its memory returns then.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable

import trio

from coordlfs.cache import journal
from coordlfs.cache.backfill import Backfill, BackfillQueue
from coordlfs.cache.compact import Key
from coordlfs.cache.directory import FILES, CacheDirectory
from coordlfs.cache.entries import SHARED, Entry, EntryTable
from coordlfs.cache.files import (
    FILL_CHUNK,
    Copier,
    EntryFiles,
    FromStorage,
    create_file,
    file_name,
    link_file,
    write_all,
)
from coordlfs.cache.preloaded import Preloaded
from coordlfs.cache.public import Indexes
from coordlfs.cache.publishing import Publisher
from coordlfs.cache.restart import CHECK_WORKERS, Restart
from coordlfs.cache.room import ROOM_SLACK, Room, free_bytes, no_room
from coordlfs.cache.stats import ReadCounters
from coordlfs.sizes import format_size
from coordlfs.source.source import Source
from coordlfs.source.threads import in_thread
from coordlfs.source.watch import PublishedWatch

__all__ = ["FILES", "FILL_CHUNK", "ROOM_SLACK", "Adopted", "Entry", "WholeFileCache", "create_file",
           "file_name", "write_all"]

log = logging.getLogger(__name__)

#: A lane copy ``adopt_copy`` added, for ``adopted``: its key, entry, and the source's stat
Adopted = tuple[Key, Entry, os.stat_result]


class WholeFileCache:
    """The no-eviction policy (the CoorDL paper's MinIO): whole files, kept until unmount,
    never evicted, so that no epoch's random order can thrash what the cache holds."""

    def __init__(self, directory: str, capacity: int, max_file_size: int,
                 counters: ReadCounters, own_tmpfs: bool = False) -> None:
        self.max_file_size = max_file_size
        self.counters = counters
        self.entries = EntryTable()
        #: the next entry's number (its file's name); numbers below it have been handed out
        self.next_number = 0
        self.dir = CacheDirectory.open(directory, capacity, own_tmpfs)
        self.directory, self.dir_fd = self.dir.path, self.dir.fd
        self.files = EntryFiles(self.dir.files_fd)
        self.room = Room(capacity, self.directory, lambda: free_bytes(self.dir_fd))
        #: called with each entry dropped (``_release``), such as to drop its backing id
        self.released: list[Callable[[Key, Entry], None]] = []
        #: called with each entry completed (``_complete``) and the source's stat that showed
        #: it whole, such as to offer it to the lane
        self.completed: list[Callable[[Key, Entry, os.stat_result], None]] = []
        #: whether ``key``'s file is being read from the source by opens the cache is handed
        #: after (the request lane's misses, ``LaneRows.claim``): no entry is reserved for it
        #: then (a fill would read storage twice); else later such opens wait for the fill
        self.read_elsewhere: Callable[[Key], bool] = lambda key: False
        #: a file over ``max_file_size`` was turned away: said once (``_too_large``)
        self.too_large_said = False
        self.journal = journal.Journal(self.dir_fd, self.directory)
        self.publisher = Publisher(self.entries, self.room, self.dir_fd, self.files.fd,
                                   self.directory, self.fill_noticed)
        self.restart = Restart(self.entries, self.room, self.dir, self.journal,
                               self.publisher, self._release)
        self.backfills = BackfillQueue(self.files.fd, self.ended_together, self.end_fill)

    # -- what other wings read ---------------------------------------------------------

    @property
    def filling(self) -> int:
        """Entries being filled (the rest of ``entries`` are complete)."""
        return self.entries.filling

    @property
    def files_fd(self) -> int:
        return self.files.fd

    @property
    def index(self) -> Indexes | None:
        return self.publisher.index

    @property
    def watch(self) -> PublishedWatch | None:
        return self.publisher.watch

    @property
    def preloaded(self) -> Preloaded | None:
        return self.publisher.preloaded

    # -- start and stop ---------------------------------------------------------------

    def load(self, source: Source) -> int:
        """A checked start: adopt what a previous daemon left and check all of it against
        the source before returning (the daemon adopts, then ``check``s while serving).
        Returns the entries kept."""
        self.adopt()
        self.restart.load(source)
        return len(self.entries)

    def adopt(self) -> int:
        """Adopt the entries a previous daemon left, unchecked against the source (an open
        compares each with the source anyway; ``check`` compares the rest); returns count."""
        self.next_number = self.restart.adopt(self.next_number)
        return len(self.entries)

    async def check(self, source: Source, workers: int = CHECK_WORKERS) -> None:
        """Compare every adopted entry with the source while the mount serves
        (``restart.Restart.check``)."""
        await self.restart.check(source, workers)

    def close(self, keep: bool) -> None:
        """Remove the cached bytes unless ``keep``; then release the directory lock."""
        self.publisher.close()
        self.files.close()
        if keep:  # the next start reads it at once, with no lines to replay
            self.journal.checkpoint(self.entries.columns())
        self.journal.close()
        self.dir.close(keep)

    # -- lookups and the way in -------------------------------------------------------

    def lookup(self, key: Key, st: os.stat_result) -> Entry | None:
        """The entry holding this version of the file (complete or being filled), if any."""
        row = self.entries.keys.find(key)
        if row < 0:
            return None
        entry = self.entries.entry(row)
        if entry.matches(st):
            self.publisher.republish(key, entry, bool(self.entries.flags[row] & SHARED))
            return entry
        # one being filled too: its fill goes on into a file already gone, and fails at its
        # end, while the new version is filled meanwhile
        log.info("source file %s changed; dropping its cache entry", os.fsdecode(entry.path))
        self._release(key, entry)
        return None

    def reserve(self, key: Key, path: bytes, st: os.stat_result) -> Entry | None:
        """Claim room for a new entry, or None when the capacity (or the file limit) says no.
        Asked last whether the file is read elsewhere (``read_elsewhere``): that takes the
        request lane's row of it, which a file the cache has no room for keeps."""
        if key in self.entries or not self._takes(path, st.st_size) or self.read_elsewhere(key):
            return None
        entry = Entry(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, self.next_number,
                      progress=trio.Event())
        self._add(key, entry)
        return entry

    def _takes(self, path: bytes, size: int) -> bool:
        """Whether a new entry of ``size`` bytes has room (the caller saw its key has none)."""
        if size > self.max_file_size:
            self._too_large(path, size)
            return False
        return self.room.takes(size)

    def _add(self, key: Key, entry: Entry, numbered: bool = True, told: bool = True) -> None:
        """``entry`` in the table and the room; ``numbered``: it took the next number;
        ``told``: the room is told now (else by the caller, once for a batch)."""
        self.entries.add(key, entry)
        self.room.take(entry.size)
        if numbered:
            self.next_number += 1
        if told:
            self.room.changed()

    def never_keeps(self, path: bytes, size: int) -> bool:
        """Whether no room would ever take a new file of ``size`` at ``path`` (no cache, or
        a file over ``--max-file-size``: said once, ``_too_large``)."""
        if size > self.max_file_size:
            self._too_large(path, size)
            return True
        return not self.room.capacity

    def _too_large(self, path: bytes, size: int) -> None:
        """Say, once per mount, that files over ``--max-file-size`` are read from the source
        and never cached, naming the first and the option: an epoch over such files reads
        storage every time, and only the log can say why (per file it would flood it)."""
        if not self.too_large_said:
            self.too_large_said = True
            log.warning("%s (%s) is larger than --max-file-size (%s): it is read from the "
                        "source, not cached, as is every file over that size (said once); "
                        "remount with a larger --max-file-size to cache them",
                        os.fsdecode(path), format_size(size), format_size(self.max_file_size))

    def _claim(self, key: Key, path: bytes, st: os.stat_result) -> tuple[Entry | None, bool]:
        """The entry for this version of the file, and whether it was reserved just now
        (its fill is then the caller's to start)."""
        entry = self.lookup(key, st)
        if entry is not None:
            return entry, False
        entry = self.reserve(key, path, st)
        if entry is None:
            return None, False
        return entry, True

    # -- fills ------------------------------------------------------------------------

    def start_fill(self, key: Key, path: bytes, st: os.stat_result, source: Source,
                   nursery: trio.Nursery) -> Entry | None:
        """The entry for this version of the file, reserving it and starting its fill in
        ``nursery`` if the cache has room; None when it has none."""
        entry, new = self._claim(key, path, st)
        if new:
            nursery.start_soon(self.fill, key, entry, source)
        return entry

    async def fill_for_reader(self, key: Key, path: bytes, st: os.stat_result, source: Source,
                              nursery: trio.Nursery) -> Entry | None:
        """``start_fill`` for a reader's miss: a file of one fill step (nearly every miss) is
        filled in the reader's own task before this returns. Its step is one hand-off to a
        thread either way; a task of its own and the wake of the reader waiting for it cost
        the miss another ~15 µs of CPU. Other readers of the file wait on the entry as ever."""
        if st.st_size > FILL_CHUNK:
            return self.start_fill(key, path, st, source, nursery)
        entry, new = self._claim(key, path, st)
        if new:
            await self.fill(key, entry, source)
        return entry

    def reserve_backfill(self, key: Key, path: bytes, st: os.stat_result
                         ) -> tuple[Entry | None, bool]:
        """The entry for this version of the file, and whether it was reserved just now, for
        an opener the kernel serves from the source file itself (FUSE passthrough): then it
        is backfilled from that reader's pages when it closes (``backfill``). None when the cache
        has no room."""
        entry, new = self._claim(key, path, st)
        if new:
            entry.to_backfill = True
        return entry, new

    def backfill(self, key: Key, entry: Entry, source: Source, nursery: trio.Nursery,
                 source_fd: int = -1) -> None:
        """Backfill an entry after a reader of the source file, once, from the pages the
        reader's reads brought into the page cache (``source_fd``: the reader's backing, if
        still open), queued for a worker thread that copies a batch of files per hand-off
        (``backfills``). Storage is read once, and counted once, by the opener
        (``bytes_from_source`` of a source open)."""
        if not entry.to_backfill:
            return
        entry.to_backfill = False
        self.backfills.add(key, entry, source, nursery, source_fd)

    def fill_noticed(self, key: Key, path: bytes, st: os.stat_result, source: Source,
                     nursery: trio.Nursery, source_fd: int = -1) -> None:
        """A file someone read from the source without the daemon's reads (a job under
        ``coordlfs run``, the request lane's opens; ``source_fd``: its descriptor, if
        kept), backfilled if the cache has room."""
        entry, new = self.reserve_backfill(key, path, st)
        if entry is not None and new:
            self.backfill(key, entry, source, nursery, source_fd)

    def numbers(self, count: int) -> int:
        """``count`` entry numbers at once, the first returned: for copies named elsewhere
        (the request lane's copier names its copies so, ``adopt_copy``'s ``number``).
        Numbers are never reused; those never used are gaps, as a failed fill's."""
        first = self.next_number
        self.next_number += count
        return first

    def adopt_copy(self, key: Key, path: bytes, st: os.stat_result, fd: int,
                   number: int = -1) -> Entry | None:
        """A file read from the source without the daemon's reads and copied already (``fd``:
        in the entries' directory, by the request lane's copier, unnamed or, with ``number``
        from ``numbers``, named as that entry's file; ``st``: the source showing the version
        copied): if the cache has room, an entry at once, complete, its file named, to be
        told with its batch (``adopted``) before anything else runs. No fill ran, so none of
        a fill's ending is paid (its wake, its verdict)."""
        if (self.lookup(key, st) is not None or not self._takes(path, st.st_size)
                or self.read_elsewhere(key)):
            self.discard_copy(number, path)
            return None
        entry = Entry(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                      self.next_number if number < 0 else number, filled=st.st_size,
                      complete=True)
        if number < 0:
            try:
                link_file(self.files.fd, entry.offset, fd)
            except OSError as e:  # never added: given up as a fill is
                if no_room(e):
                    self.room.note_full(e)
                self._said(entry, e)
                return None
        self._add(key, entry, numbered=number < 0, told=False)
        return entry

    def discard_copy(self, number: int, path: bytes) -> None:
        """A copy of source file ``path`` named as entry ``number`` (``numbers``) that the
        cache does not add: its name goes (-1: it has none)."""
        if number >= 0:
            self.files.unlink(number, path)

    def adopted(self, added: list[Adopted]) -> None:
        """Copies ``adopt_copy`` added: their journal lines in one write before any is
        published or told (``completed``), with no await since they were added, so that
        nothing reported cached is missing from the journal after a crash; the room told
        once for the batch."""
        if not added:
            return
        self.journal.append_all([journal.added(key, entry) for key, entry, _ in added])
        self.room.changed()
        for key, entry, st in added:
            self._told_complete(key, entry, st)

    async def drained(self, seconds: float) -> None:
        """Wait, at most ``seconds``, for the backfills to end: at unmount, the
        files just read are then complete in the cache (and in its journal)."""
        await self.backfills.drained(seconds)

    async def fill(self, key: Key, entry: Entry, source: Source) -> None:
        """Copy the source file into the entry; on any failure the entry is given up."""
        origin = FromStorage(source, entry.path)
        copier = Copier(self.files.fd, entry, origin)
        try:
            try:
                while entry.filled < entry.size:
                    got = await in_thread(copier.step, entry.filled)
                    if got == 0:
                        raise OSError(5, "source file shrank while being cached")
                    self.arrived(entry, got)
            finally:
                copier.close()
                self.counters.fill_bytes_from_pages += origin.paged
        except Exception as e:  # a failed fill must never fail the mount: readers stream
            self._ended(key, entry, None, e)
        except BaseException as e:  # cancelled at unmount
            self.end_fill(key, entry, None, e)
            raise
        else:
            self._ended(key, entry, copier.final, None)

    def arrived(self, entry: Entry, got: int, counted: bool = True) -> None:
        """``got`` more bytes of a filling entry are in its file: its readers may go on.
        ``counted``: read from storage for the cache (a backfill's was counted)."""
        entry.filled += got
        if counted:
            self.counters.bytes_from_source += got
        self._wake(entry)

    # -- the way out of a fill --------------------------------------------------------

    def end_fill(self, key: Key, entry: Entry, final: os.stat_result | None,
                 error: BaseException | None = None) -> BaseException | None:
        """End the fill of a reserved entry, by ``fill`` or by any other filler.

        ``final`` is the source's fstat once every byte is in the file (None with the
        ``error`` that stopped the fill): the entry is complete if it still shows the version
        reserved, else it is given up (punched, its readers sent to the source). Returns why
        it was given up, or None; a full cache directory is noted here, the rest is for the
        caller to report.
        """
        try:
            error = self._verdict(key, entry, final, error)
            if error is None:
                self.journal.append(journal.added(key, entry))
                assert final is not None  # no error: the verdict saw it
                self._complete(key, entry, final)
            else:
                self._give_up(key, entry, error)
            return error
        finally:
            self._wake(entry)

    def _ended(self, key: Key, entry: Entry, final: os.stat_result | None,
               error: BaseException | None) -> None:
        """``end_fill``, and the one line a failure other than a full cache is worth."""
        self._said(entry, self.end_fill(key, entry, final, error))

    @staticmethod
    def _said(entry: Entry, error: BaseException | None) -> None:
        if error is not None and not no_room(error):
            log.warning("caching %s failed: %s", os.fsdecode(entry.path), error,
                        exc_info=not isinstance(error, OSError))

    def ended_together(self, batch: list[Backfill]) -> None:
        """``end_fill`` of a batch backfilled: the journal lines of the
        entries that are complete written at once, before any of them is (so that nothing
        reported cached is missing from the journal after a crash); the others given up."""
        errors = [self._verdict(item.key, item.entry, item.final, item.error)
                  for item in batch]
        self.journal.append_all([journal.added(item.key, item.entry)
                                 for item, error in zip(batch, errors, strict=True)
                                 if error is None])
        for item, error in zip(batch, errors, strict=True):
            try:
                if error is None:
                    assert item.final is not None  # no error: the verdict saw it
                    self._complete(item.key, item.entry, item.final)
                else:
                    self._give_up(item.key, item.entry, error)
            finally:
                self._wake(item.entry)
            self._said(item.entry, error)

    @staticmethod
    def _verdict(key: Key, entry: Entry, final: os.stat_result | None,
                 error: BaseException | None) -> BaseException | None:
        """Why a fill that ended so is given up, None if its entry is complete: every byte is
        in its file and the source still shows the version reserved."""
        if error is None and (final is None or (final.st_dev, final.st_ino) != key
                              or not entry.matches(final)):
            return OSError(errno.EIO, "source file changed while being cached")
        return error

    def _complete(self, key: Key, entry: Entry, final: os.stat_result) -> None:
        """A filled entry, journaled, is complete (the source showed its version in ``final``):
        readers, passthrough and clients take it."""
        entry.complete = True
        self.entries.completed(key, entry)
        self._told_complete(key, entry, final)

    def _told_complete(self, key: Key, entry: Entry, final: os.stat_result) -> None:
        """Clients and ``completed`` are told of a complete, journaled entry."""
        self.publisher.publish(key, entry)
        for tell in self.completed:
            tell(key, entry, final)

    def _give_up(self, key: Key, entry: Entry, error: BaseException) -> None:
        if no_room(error):
            self.room.note_full(error)  # said once, not for every file that fails meanwhile
        self._release(key, entry)

    @staticmethod
    def _wake(entry: Entry) -> None:
        done = entry.progress
        entry.progress = None if entry.complete or entry.failed else trio.Event()
        if done is not None:
            done.set()

    def _release(self, key: Key, entry: Entry) -> None:
        # Open handles still holding the entry must not read a file that goes: a failed
        # entry sends them to the source.
        was_complete = entry.complete
        entry.complete, entry.failed, entry.to_backfill = False, True, False
        removed, flags = self.entries.remove(key, entry)
        if removed:
            self.room.give_back(entry.size)
            self.room.changed()
        if was_complete:  # journaled: a restart must not adopt it
            self.journal.append(journal.dropped(key, entry))
        if flags & SHARED:  # clients find it no more; those that opened it keep its bytes
            self.publisher.withdraw(entry.path)
        self.files.remove(entry)
        for tell in self.released:
            tell(key, entry)

    # -- reads ------------------------------------------------------------------------

    async def wait_for(self, entry: Entry, end: int) -> bool:
        """Wait until bytes up to ``end`` are in the entry; False if the fill failed."""
        while not entry.failed and not entry.complete and entry.filled < end:
            assert entry.progress is not None  # still filling
            await entry.progress.wait()
        return not entry.failed

    def data(self, entry: Entry, offset: int, size: int) -> memoryview | bytes:
        """Bytes of an entry, which must have arrived (see ``wait_for``)."""
        return self.files.data(entry, offset, size)

    def entry_fd(self, entry: Entry) -> int:
        """A new read-only descriptor of the entry's file (the caller closes it): for the
        daemon's own reads, and a passthrough open's backing."""
        return self.files.open(entry)

    # -- published to clients ---------------------------------------------------------

    def share(self, source: Source, public: bool = False) -> None:
        """Publish complete entries for ``coordlfs.client`` from now on
        (``publishing.Publisher.share``)."""
        self.publisher.share(source, public)

    async def run_shared(self) -> None:
        """Withdraw published entries whose source changes, and beat."""
        await self.publisher.run()

    def shared_status(self) -> dict | None:
        """Where clients find the index and the entries' files, and what the index holds."""
        return self.publisher.status()
