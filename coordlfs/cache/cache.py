"""The MinIO cache: whole files, kept in shared memory, never evicted.

MinIO (CoorDL paper, section 4.1) caches items as they are first read until the capacity is
reached and then never replaces anything. With random-order epochs every later epoch then
gets exactly ``capacity`` bytes of hits, where an LRU cache thrashes.

Each cached file is a file of its own in the ``files`` directory of a tmpfs directory
(``/dev/shm/coordlfs-<uid>/...`` by default), named by the entry's number (``Entry.offset``,
handed out by a counter and never reused, so a name never shows another file's bytes). The
bytes live outside the daemon's heap, a restarted daemon finds them warm, and the kernel can
serve a file by FUSE passthrough (``coordlfs.fs.backing``), which takes a whole file as its
backing: no slice of a shared file would do. What a file of its own costs is counted: the
capacity is charged each entry's bytes rounded up to pages (2 KiB per file on average, 2% of
a cache of 110 KB images), and the kernel's inode and dentry per file (about 1 KB) are
reported beside it (``file_overhead``). An entry that is dropped (its source file changed)
has its file unlinked at once: readers that opened it (a passthrough open, a client's
mapping) keep the old bytes until they close, and its memory returns then.

A journal (``coordlfs.cache.journal``: a binary checkpoint, then a line per change) records
which source path and version each entry holds. A restart adopts the entries whose files
are there, unchecked, and serves at once: an open compares the file's version with the
entry's anyway (the inode is the key; size, mtime and ctime must match), so a changed file is
never served, and a sweep in worker threads (``check``) compares every adopted entry with
the source in the background, drops those of changed or removed files and publishes the rest
for clients. A file no adopted entry names is unlinked at once.

Entries are rows of an ``entries.EntryTable`` (about 70 bytes and the path each), not objects.

A file is filled by a background task in chunks; readers wait only until the bytes they asked
for have arrived, so a large file streams while it is being cached.

Complete entries are also published (``share``) in an index in shared memory
(``coordlfs.cache.published``), where ``coordlfs.client`` finds them and maps their files
itself. A published entry is withdrawn the moment its source file may have changed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import shutil
import stat
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import trio

from coordlfs.cache import cache_tmpfs, journal, preloaded
from coordlfs.cache.compact import Key
from coordlfs.cache.entries import SHARED, UNCHECKED, Entry, EntryTable
from coordlfs.cache.journal import JOURNAL
from coordlfs.cache.public import Indexes
from coordlfs.cache.published import BEAT_EVERY_S, INDEX, PUBLIC_INDEX, Published, retire
from coordlfs.cache.stats import ReadCounters
from coordlfs.errors import UserError
from coordlfs.sizes import format_size, pages
from coordlfs.source.source import Source, SourceReader
from coordlfs.source.threads import in_thread
from coordlfs.source.watch import PublishedWatch
from coordlfs.system.private_dir import open_private

log = logging.getLogger(__name__)

#: Bytes read from the source per worker-thread call while filling an entry: large enough
#: that thread hand-offs cost nothing next to the copy, small enough to bound the per-thread
#: O_DIRECT buffers and to let a reader of a big file start early.
FILL_CHUNK = 1 << 20
#: Most entries one hand-off to a thread fills behind their readers (``fill_behind``): the
#: loop's share of a hand-off per file, against the wait of the batch's last file
BEHIND_BATCH = 16
#: Seconds the fills behind readers wait for more files before a batch is handed off, when
#: fewer than a batch are queued: one reader releases a small file every 0.2-0.4 ms, so a
#: batch gathers several, and each pays a share of one hand-off, one journal write and one
#: wake of the loop instead of its own. Only a reopen of a file just read waits for it.
BEHIND_GATHER_S = 0.002
#: the directory of the entries' files, in the cache directory
FILES = "files"
#: what a user can do about a cache directory that is not theirs alone
_REMEDY = "remove it or give --cache-dir"
#: Adopted entries one worker thread compares with the source per hand-off, and the worker
#: threads that do (a cold source waits on its disk for each lstat; a warm one on the GIL).
#: What the event loop does per batch (about 5 ms) holds up the mount's requests that long,
#: and all batches together take at most ``_CHECK_SHARE`` of its time.
CHECK_BATCH = 512
CHECK_WORKERS = 2
_CHECK_SLICE = 32
_CHECK_SHARE = 0.25
_CHECK_PAUSE_S = 0.0005
#: errnos that mean the cache's filesystem has no room (a full tmpfs, a quota)
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
#: Free room a full cache filesystem keeps beside the pages of a new file: the journal's lines
#: and the filesystem's own. While full, each new file asks (one statfs, next to a miss's
#: storage read).
ROOM_SLACK = 1 << 20
#: Complete entries the daemon keeps mapped for its own reads (``data``, without passthrough):
#: a hit is then a slice of a mapping, no system call and no copy in the daemon (a pread of
#: the file cost a 112 KB hit 30% of the ceiling's files/s). Least recently read unmapped.
_MAPPED_FILES = 16384
#: What the kernel keeps per file on tmpfs beside its pages, where /proc/slabinfo cannot be
#: read: a shmem inode (752 B) and a dentry (192 B), measured on Linux 6.18
_FILE_OVERHEAD = 752 + 192


def _no_room(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in _NO_ROOM


def file_name(number: int) -> str:
    """The name of entry ``number``'s file in ``FILES``."""
    return f"{number:x}"


def file_overhead() -> int:
    """Bytes the kernel keeps per tmpfs file besides its pages (inode and dentry)."""
    sizes = {}
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/slabinfo") as slabinfo:
        for line in slabinfo:
            fields = line.split()
            if fields[0] in ("shmem_inode_cache", "dentry"):
                sizes[fields[0]] = int(fields[3])
    return sum(sizes.values()) if len(sizes) == 2 else _FILE_OVERHEAD


def _unmap(mapped: mmap.mmap) -> None:
    """Unmap now, or, while a slice of it is still referenced (a peer's reply being sent),
    when the last one is freed."""
    with contextlib.suppress(BufferError):
        mapped.close()


def _open_files(dir_fd: int, directory: str) -> tuple[int, bool]:
    """The entries' directory, made 0700 where absent, and whether a mount that served other
    users left it searchable (``coordlfs.cache.public``: its files may be 0444); never
    through a link, and never a directory that is not ours (its files are served as cached
    bytes). It is private again when this returns: a mount serving others opens it anew."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(FILES, 0o700, dir_fd=dir_fd)
    try:
        fd = os.open(FILES, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UserError(f"{directory}/{FILES} is not a directory: {_REMEDY}") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o066:  # search only, at most: public's
        os.close(fd)
        raise UserError(f"{directory}/{FILES} is not a private directory of uid "
                        f"{os.geteuid()}'s: {_REMEDY}")
    were_public = bool(st.st_mode & 0o011)
    if were_public:
        for private in (dir_fd, fd):
            os.fchmod(private, 0o700)
    return fd, were_public


def create_file(files_fd: int, number: int) -> int:
    """A new entry's file, for writing: 0600, exclusive (a leftover of the name is removed
    first), never through a link."""
    name = file_name(number)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, 0o600, dir_fd=files_fd)
    except FileExistsError:
        os.unlink(name, dir_fd=files_fd)
        return os.open(name, flags, 0o600, dir_fd=files_fd)


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite all of ``data``. A short write is continued, so a filesystem that runs out of
    room raises ENOSPC rather than leaving a hole that reads back as zeros."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "the cache's filesystem took no bytes")
        view, offset = view[written:], offset + written


class WholeFileCache:
    """MinIO's policy (the CoorDL paper): whole files, kept until unmount, never evicted, so
    that no epoch's random order can thrash what the cache holds."""

    def __init__(self, directory: str, capacity: int, max_file_size: int,
                 counters: ReadCounters, own_tmpfs: bool = False) -> None:
        self.capacity = capacity
        self.max_file_size = max_file_size
        self.counters = counters
        self.entries = EntryTable()
        #: bytes the entries occupy: their sizes rounded up to pages
        self.used = 0
        #: the entries' own bytes (``used`` less the page rounding)
        self.data_bytes = 0
        #: the next entry's number (its file's name); numbers below it have been handed out
        self.next_number = 0
        try:
            # made 0700 or checked to be ours alone (``private_dir``); its path has no links
            directory, self.dir_fd = open_private(directory, _REMEDY)
            self.directory = directory
            if own_tmpfs and cache_tmpfs.mount_own(self.dir_fd, directory, capacity):
                os.close(self.dir_fd)  # the directory beneath the new tmpfs
                self.dir_fd = open_private(directory, _REMEDY).fd
        except OSError as e:
            raise UserError(f"cannot use cache directory {directory}: {e.strerror}") from None
        #: the directory is a tmpfs of the cache's own (``cache_tmpfs``): unmounted, not
        #: emptied, when the cached bytes go
        self.own_tmpfs = own_tmpfs and cache_tmpfs.is_own(directory)
        try:
            fcntl.flock(self.dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.dir_fd)
            raise UserError(f"cache directory {directory} is in use by another coordlfs mount "
                            "(give this mount its own --cache-dir)") from None
        for index in (INDEX, PUBLIC_INDEX):  # a killed daemon's clients: before its files go
            retire(self.dir_fd, index)
        try:
            self.files_fd, self._were_public = _open_files(self.dir_fd, directory)
        except (OSError, UserError) as e:
            os.close(self.dir_fd)
            if self.own_tmpfs:
                cache_tmpfs.unmount_own(directory)
            if isinstance(e, OSError):
                raise UserError(f"cannot use cache directory {directory}: {e.strerror}") from None
            raise
        #: entry number -> its file mapped, for ``data`` (least recently read first)
        self._mapped: OrderedDict[int, mmap.mmap] = OrderedDict()
        #: entries to fill behind their readers (``fill_behind``), and whether a task does
        self._behind: list[_Behind] = []
        self._filling_behind = False
        #: called with each entry dropped (``_release``), such as to drop its backing id
        self.released: list[Callable[[Key, Entry], None]] = []
        #: kernel bytes per entry file beside its pages (``file_overhead``)
        self.file_overhead = file_overhead()
        #: the cache's filesystem ran out of room: a new entry only where it still has room
        #: for it, until it has room for all the capacity left again
        self.full = False
        #: bytes of files handed over for filling and not reserved yet (``promise``)
        self.promised = 0
        self._no_room_warned = False
        #: a file over ``max_file_size`` was turned away: said once (``_too_large``)
        self._too_large_said = False
        self.journal = journal.Journal(self.dir_fd, directory)
        #: changes the watch reported: a check that saw one meanwhile re-checks to publish
        self._changes = 0
        #: the index for clients and the watch that withdraws from it (``share``)
        self.index: Indexes | None = None
        self.watch: PublishedWatch | None = None
        self._source: Source | None = None
        self._index_full_logged = False
        #: what ``coordlfs run``'s preload library tells this daemon (``share``)
        self.preloaded: preloaded.Preloaded | None = None

    # -- start and stop ---------------------------------------------------------------

    @property
    def filling(self) -> int:
        """Entries being filled (the rest of ``entries`` are complete)."""
        return self.entries.filling

    def load(self, source: Source) -> int:
        """A checked start: adopt what a previous daemon left and check all of it against
        the source before returning (the daemon adopts, then ``check``s while serving).
        Returns the entries kept."""
        self.adopt()
        unchecked = self._unchecked()
        for first in range(0, len(unchecked), CHECK_BATCH):
            checking = self._checking(unchecked[first : first + CHECK_BATCH])
            self._checked(checking, _lstat_all(source, checking), self._changes)
        return len(self.entries)

    def adopt(self) -> int:
        """Adopt the entries a previous daemon left, unchecked against the source (an open
        compares each with the source anyway; ``check`` compares the rest); returns count.

        Only what the journal proves is kept: entries whose files are there, within the
        capacity. Every other file is unlinked.
        """
        columns, lines = journal.read(self.dir_fd)
        if columns is not None:
            self.entries.load(columns)
        replay = journal.Replay()
        for line in lines:
            replay.line(line)
        clean = columns is not None and not replay.lines
        self._replayed(replay)
        for name in os.listdir(self.dir_fd):  # a torn journal rewrite, or an older layout
            if name not in (FILES, JOURNAL, INDEX, PUBLIC_INDEX, preloaded.COUNTS,
                            preloaded.NOTICES):
                os.unlink(name, dir_fd=self.dir_fd)
        files = set(os.listdir(self.files_fd))
        numbers, sizes = self.entries.offset, self.entries.size
        for row in sorted(self.entries.rows(), key=numbers.__getitem__):
            name = file_name(numbers[row])
            if name not in files or self.used + pages(sizes[row]) > self.capacity:
                self.entries.remove_row(row)
                clean = False
                continue
            files.remove(name)
            if self._were_public:  # published to others again only if they still may read it
                os.chmod(name, 0o600, dir_fd=self.files_fd, follow_symlinks=False)
            self.used += pages(sizes[row])
            self.data_bytes += sizes[row]
            self.next_number = numbers[row] + 1
        for name in files:
            os.unlink(name, dir_fd=self.files_fd)
        self._room_changed()
        if not clean:
            self.journal.checkpoint(self.entries.columns())
        if self.index is not None:
            self.index.reserve(len(self.entries))
        return len(self.entries)

    def _replayed(self, replay: journal.Replay) -> None:
        """Apply the change lines after the checkpoint: entries replaced or dropped leave,
        the entries the lines end with come in (unchecked, as the checkpoint's)."""
        entries = self.entries
        for key in replay.replaced():
            row = entries.keys.find(key)
            if row >= 0:
                entries.remove_row(row)
        for key, offset in replay.drops.items():
            row = entries.keys.find(key)
            if row >= 0 and entries.offset[row] == offset:
                entries.remove_row(row)
        entries.load(replay.columns())

    # -- checks of adopted entries -----------------------------------------------------

    def _unchecked(self) -> array:
        flags = self.entries.flags
        return array("i", (row for row in self.entries.rows() if flags[row] & UNCHECKED))

    async def check(self, source: Source, workers: int = CHECK_WORKERS) -> None:
        """Compare every adopted entry with the source, in worker threads, while the mount
        serves: drop those whose file changed or went (their room returns to the cache),
        publish the rest for clients."""
        unchecked = self._unchecked()
        if not unchecked:
            return
        started, dropped = time.monotonic(), 0
        batches = iter(range(0, len(unchecked), CHECK_BATCH))

        async def worker() -> None:
            nonlocal dropped
            try:
                for first in batches:
                    began = time.monotonic()
                    checking = self._checking(unchecked[first : first + CHECK_BATCH])
                    changes = self._changes
                    spent = time.monotonic() - began
                    stats = await in_thread(_lstat_all, source, checking)
                    began = time.monotonic()
                    dropped += self._checked(checking, stats, changes)
                    spent += time.monotonic() - began
                    # the mount's requests first: the check takes a share of the loop's time
                    await trio.sleep(spent * (workers / _CHECK_SHARE - 1))
            except Exception:  # the mount stays up: an open still checks each entry it serves
                log.warning("checking adopted cache entries failed; the rest are checked as "
                            "they are opened", exc_info=True)

        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(worker)
        log.info("checked %d adopted cache entries against the source in %.1f s: %d dropped",
                 len(unchecked), time.monotonic() - started, dropped)

    def _checking(self, rows: array) -> list[Checking]:
        """The rows still unchecked, their directories watched first: a change between the
        watch and the check cannot go unseen."""
        entries, checking = self.entries, []
        for row in rows:
            if entries.live(row) and entries.flags[row] & UNCHECKED:
                path = entries.paths.get(row)
                checking.append(Checking(row, entries.keys.key(row), path, entries.offset[row],
                                         self._cover(path)))
        return checking

    def _checked(self, checking: list[Checking],
                 stats: list[os.stat_result | None], changes: int) -> int:
        """Settle the rows ``_lstat_all`` compared: drop a changed file's entry, publish the
        rest; returns how many were dropped. If the watch reported a change meanwhile, the
        stat may predate it: those are published only after a check of their own
        (``_publish``)."""
        entries, dropped = self.entries, 0
        for (row, key, path, offset, publishable), st in zip(checking, stats, strict=True):
            if entries.keys.find(key) != row or entries.offset[row] != offset:
                continue  # dropped meanwhile (an open saw it change)
            entries.flags[row] &= ~UNCHECKED
            if st is None or (st.st_dev, st.st_ino) != key or not entries.matches(row, st):
                log.info("source file %s changed; dropping its cache entry", os.fsdecode(path))
                self._release(key, entries.entry(row))
                dropped += 1
            elif not publishable:
                continue
            elif changes != self._changes:
                self._publish(key, entries.entry(row))
            else:
                self._index(key, path, entries.published(row, st.st_ino), st.st_mode)
        return dropped

    def close(self, keep: bool) -> None:
        """Remove the cached bytes unless ``keep``; then release the directory lock."""
        if self.preloaded is not None:
            self.preloaded.close()
        if self.index is not None:
            self.index.close()
        if self.watch is not None:
            self.watch.close()
        while self._mapped:
            _unmap(self._mapped.popitem()[1])
        os.close(self.files_fd)
        if keep:  # the next start reads it at once, with no lines to replay
            self.journal.checkpoint(self.entries.columns())
        self.journal.close()
        if not keep and not self.own_tmpfs:  # emptied while still locked
            shutil.rmtree(self.directory, ignore_errors=True)
        os.close(self.dir_fd)
        if not keep and self.own_tmpfs:
            cache_tmpfs.unmount_own(self.directory)

    # -- lookups and fills ------------------------------------------------------------

    def lookup(self, key: Key, st: os.stat_result) -> Entry | None:
        """The entry holding this version of the file (complete or being filled), if any."""
        row = self.entries.keys.find(key)
        if row < 0:
            return None
        entry = self.entries.entry(row)
        if entry.matches(st):
            # Published and nothing ever withdrawn: no need to look in the index (a hash)
            if (entry.complete and self.index is not None
                    and (self.index.withdrawn or not self.entries.flags[row] & SHARED)
                    and entry.path not in self.index):
                self._publish(key, entry)  # withdrawn for a change that changed nothing
            return entry
        # one being filled too: its fill goes on into a file already gone, and fails at its
        # end, while the new version is filled meanwhile
        log.info("source file %s changed; dropping its cache entry", os.fsdecode(entry.path))
        self._release(key, entry)
        return None

    def reserve(self, key: Key, path: bytes, st: os.stat_result) -> Entry | None:
        """Claim room for a new entry, or None when MinIO's capacity (or the file limit) says no."""
        if key in self.entries:
            return None
        if st.st_size > self.max_file_size:
            self._too_large(path, st.st_size)
            return None
        if self.used + pages(st.st_size) > self.capacity or not self._fits(st.st_size):
            return None
        entry = Entry(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, self.next_number,
                      progress=trio.Event())
        self.entries.add(key, entry)
        self.used += pages(entry.size)
        self.data_bytes += entry.size
        self.next_number += 1
        self._room_changed()
        return entry

    def _too_large(self, path: bytes, size: int) -> None:
        """Say, once per mount, that files over ``--max-file-size`` are read from the source
        and never cached, naming the first and the option: an epoch over such files reads
        storage every time, and only the log can say why (per file it would flood it)."""
        if not self._too_large_said:
            self._too_large_said = True
            log.warning("%s (%s) is larger than --max-file-size (%s): it is read from the "
                        "source, not cached, as is every file over that size (said once); "
                        "remount with a larger --max-file-size to cache them",
                        os.fsdecode(path), format_size(size), format_size(self.max_file_size))

    def start_fill(self, key: Key, path: bytes, st: os.stat_result, source: Source,
                   nursery: trio.Nursery) -> Entry | None:
        """The entry for this version of the file, reserving it and starting its fill in
        ``nursery`` if MinIO has room; None when it has none."""
        entry, new = self._claim(key, path, st)
        if new:
            nursery.start_soon(self.fill, key, entry, source)
        return entry

    def reserve_behind(self, key: Key, path: bytes, st: os.stat_result
                       ) -> tuple[Entry | None, bool]:
        """The entry for this version of the file, and whether it was reserved just now, for
        an opener the kernel serves from the source file itself (FUSE passthrough): then it
        is ``behind`` that reader, filled when it closes (``fill_behind``). None when MinIO
        has no room."""
        entry, new = self._claim(key, path, st)
        if new:
            entry.behind = True
        return entry, new

    def fill_behind(self, key: Key, entry: Entry, source: Source, nursery: trio.Nursery,
                    source_fd: int = -1) -> None:
        """Fill an entry ``behind`` a reader of the source file, once, from the pages the
        reader's reads brought into the page cache (``source_fd``: the reader's backing, if
        still open): queued for a worker thread that copies a batch of files per hand-off
        (``_copy_behind``), so that the event loop only reserves and ends each. Storage is
        read once, and counted once, by the opener (``bytes_from_source`` of a source open);
        the pages are dropped once copied (the cache has them)."""
        if not entry.behind:
            return
        entry.behind = False
        fd = -1
        if source_fd >= 0:
            with contextlib.suppress(OSError):
                fd = os.dup(source_fd)
        self._behind.append(_Behind(key, entry, fd))
        if not self._filling_behind:
            self._filling_behind = True
            nursery.start_soon(self._fill_behind, source)

    async def drained(self, seconds: float) -> None:
        """Wait, at most ``seconds``, for the fills behind readers to end: at unmount, the
        files just read are then complete in the cache (and in its journal)."""
        with trio.move_on_after(seconds):
            while self._filling_behind:
                await trio.sleep(0.01)

    async def _fill_behind(self, source: Source) -> None:
        """Copy the queued entries a batch at a time, until none is left; each batch's
        entries end together (``_ended_together``: one journal write)."""
        batch: list[_Behind] = []
        try:
            while self._behind:
                if len(self._behind) < BEHIND_BATCH:
                    await trio.sleep(BEHIND_GATHER_S)
                batch, self._behind = self._behind[:BEHIND_BATCH], self._behind[BEHIND_BATCH:]
                await in_thread(_copy_behind, batch, source, self.files_fd)
                for item in batch:
                    if item.error is None:
                        item.entry.filled = item.entry.size
                self._ended_together(batch)
                batch = []
        finally:
            self._filling_behind = False
            for item in batch + self._behind:  # cancelled at unmount
                item.close()
                self.end_fill(item.key, item.entry, None, OSError(errno.ECANCELED, "unmounted"))
            self._behind = []

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

    async def fill(self, key: Key, entry: Entry, source: Source) -> None:
        """Copy the source file into the entry; on any failure the entry is given up."""
        copier = _Copier(source, entry, self.files_fd)
        try:
            try:
                while entry.filled < entry.size:
                    got = await in_thread(copier.step, entry.filled)
                    if got == 0:
                        raise OSError(5, "source file shrank while being cached")
                    self.arrived(entry, got)
            finally:
                copier.close()
        except Exception as e:  # a failed fill must never fail the mount: readers stream
            self._ended(key, entry, None, e)
        except BaseException as e:  # cancelled at unmount
            self.end_fill(key, entry, None, e)
            raise
        else:
            self._ended(key, entry, copier.final, None)

    def _ended(self, key: Key, entry: Entry, final: os.stat_result | None,
               error: BaseException | None) -> None:
        """``end_fill``, and the one line a failure other than a full cache is worth."""
        self._said(entry, self.end_fill(key, entry, final, error))

    @staticmethod
    def _said(entry: Entry, error: BaseException | None) -> None:
        if error is not None and not _no_room(error):
            log.warning("caching %s failed: %s", os.fsdecode(entry.path), error,
                        exc_info=not isinstance(error, OSError))

    def _ended_together(self, batch: list[_Behind]) -> None:
        """``end_fill`` of a batch filled behind its readers: the journal lines of the
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
                    self._complete(item.key, item.entry)
                else:
                    self._give_up(item.key, item.entry, error)
            finally:
                self._wake(item.entry)
            self._said(item.entry, error)

    def arrived(self, entry: Entry, got: int, counted: bool = True) -> None:
        """``got`` more bytes of a filling entry are in its file: its readers may go on.
        ``counted``: read from storage for the cache (not behind a reader counted already)."""
        entry.filled += got
        if counted:
            self.counters.bytes_from_source += got
        self._wake(entry)

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
                self._complete(key, entry)
            else:
                self._give_up(key, entry, error)
            return error
        finally:
            self._wake(entry)

    @staticmethod
    def _verdict(key: Key, entry: Entry, final: os.stat_result | None,
                 error: BaseException | None) -> BaseException | None:
        """Why a fill that ended so is given up, None if its entry is complete: every byte is
        in its file and the source still shows the version reserved."""
        if error is None and (final is None or (final.st_dev, final.st_ino) != key
                              or not entry.matches(final)):
            return OSError(errno.EIO, "source file changed while being cached")
        return error

    def _complete(self, key: Key, entry: Entry) -> None:
        """A filled entry, journaled, is complete: readers, passthrough and clients take it."""
        entry.complete = True
        self.entries.completed(key, entry)
        self._publish(key, entry)

    def _give_up(self, key: Key, entry: Entry, error: BaseException) -> None:
        if _no_room(error):
            self._note_full(error)  # said once, not for every file that fails meanwhile
        self._release(key, entry)

    async def wait_for(self, entry: Entry, end: int) -> bool:
        """Wait until bytes up to ``end`` are in the entry; False if the fill failed."""
        while not entry.failed and not entry.complete and entry.filled < end:
            assert entry.progress is not None  # still filling
            await entry.progress.wait()
        return not entry.failed

    def data(self, entry: Entry, offset: int, size: int) -> memoryview | bytes:
        """Bytes of an entry, which must have arrived (see ``wait_for``): a slice of its
        file's mapping once it is complete (pyfuse3 hands it to the kernel, which copies it
        once into the reply), else a pread of the file being filled."""
        size = min(size, entry.size - offset)
        if size <= 0:
            return b""
        if not entry.complete:
            fd = self.entry_fd(entry)
            try:
                data = os.pread(fd, size, offset)
            finally:
                os.close(fd)
            if len(data) != size:  # the file is ours alone: only a fault makes it short
                raise OSError(errno.EIO, f"cache file of {os.fsdecode(entry.path)} is short")
            return data
        mapped = self._mapped.get(entry.offset)
        if mapped is None:
            fd = self.entry_fd(entry)
            try:  # its size is the entry's: complete files never change
                mapped = mmap.mmap(fd, entry.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                   prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._mapped[entry.offset] = mapped
            if len(self._mapped) > _MAPPED_FILES:
                _unmap(self._mapped.popitem(last=False)[1])
        else:
            self._mapped.move_to_end(entry.offset)
        return memoryview(mapped)[offset : offset + size]

    def entry_fd(self, entry: Entry) -> int:
        """A new read-only descriptor of the entry's file (the caller closes it): for the
        daemon's own reads, and a passthrough open's backing."""
        return os.open(file_name(entry.offset), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=self.files_fd)

    # -- published to clients ----------------------------------------------------------

    def share(self, source: Source, public: bool = False) -> None:
        """Publish complete entries for ``coordlfs.client`` from now on, and watch ``source``
        to withdraw them when their files change (``run_shared`` reads the watch); with
        ``public`` (an ``--allow-other`` mount), those every user may read to every user
        (``coordlfs.cache.public``)."""
        watch = PublishedWatch(source, self._changed)
        try:
            self.index = Indexes(self.dir_fd, self.files_fd, not watch.watching,
                                 source.lstat if public else None)
        except OSError as e:
            watch.close()
            log.warning("cannot publish cached files for coordlfs.client in %s (%s): clients "
                        "read through the mount", self.directory, e.strerror or e)
            return
        self._source, self.watch = source, watch
        try:
            self.preloaded = preloaded.Preloaded(self.dir_fd, public)
        except OSError as e:
            log.warning("cannot serve `coordlfs run` jobs from %s (%s): they read through "
                        "the mount", self.directory, e.strerror or e)
        self._room_changed()

    def _publish(self, key: Key, entry: Entry) -> None:
        """Publish a complete entry if its source file still is the version it holds.

        The watch comes first and the version check after it, so that a change between the
        two cannot go unseen. The fill's own fstat does not do for the check: it came before
        the watch (an event meanwhile withdrew nothing yet published), and it saw the open
        file, not what the path names now. Where the source cannot be watched, clients
        compare each hit with the source themselves (the index's ``revalidate``).
        """
        if not self._cover(entry.path):
            return
        assert self._source is not None
        try:
            st = self._source.lstat(entry.path)
        except (OSError, ValueError):
            return
        if (st.st_dev, st.st_ino) == key and entry.matches(st):
            self._index(key, entry.path, Published(entry.offset, entry.size, st.st_ino,
                                                   entry.mtime_ns, entry.ctime_ns),
                        st.st_mode)

    def _cover(self, path: bytes) -> bool:
        """Watch the directories leading to ``path``, before its version is checked; whether
        a check from now on may publish it."""
        if self.index is None or self.watch is None or self._source is None:
            return False
        covered = self.watch.cover(path)
        if not self.watch.watching:
            if not self.index.revalidate:
                self.index.set_revalidate()
            return True
        return covered

    def _index(self, key: Key, path: bytes, found: Published, mode: int) -> None:
        """Publish an entry whose version (and ``mode``) was just seen in the source, after
        its directories were watched."""
        assert self.index is not None
        try:
            self.index.publish(path, found, mode)
        except OSError as e:  # no room to grow the index: clients read this one through us
            if not self._index_full_logged:
                log.warning("the index for coordlfs.client cannot grow (%s): files cached "
                            "from now on are read by clients through the mount",
                            e.strerror or e)
                self._index_full_logged = True
            return
        self.entries.set_flag(key, SHARED)

    def _withdraw(self, path: bytes) -> None:
        if self.index is not None:
            self.index.withdraw(path)

    def _changed(self, path: bytes, directory: bool) -> None:
        """The watch saw a change to ``path`` (a file, or a directory and all beneath it)."""
        self._changes += 1
        self._withdraw(path)
        if directory and self.index is not None:
            self.index.changed_directory()
        if directory:
            inside = path + b"/" if path else b""
            for published in [p for p in self.entries.shared_paths() if p.startswith(inside)]:
                self._withdraw(published)

    async def run_shared(self) -> None:
        """Withdraw published entries whose source changes, and beat, so that clients stop
        trusting the index soon after this loop stops."""
        if self.watch is None:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.watch.run)
            nursery.start_soon(self._beat)
            if self.preloaded is not None:
                nursery.start_soon(self.preloaded.notices.run,
                                   functools.partial(self._noticed, nursery))
            while True:
                await trio.sleep(1.0)
                self._check_room()  # clients send no misses to notice it

    def _noticed(self, nursery: trio.Nursery, path: bytes, owner: bool) -> None:
        """A job under ``coordlfs run`` read ``path`` from the source and closed it: the
        pages it read are copied into the cache, as behind a passthrough reader. Its storage
        read was counted by the job (``Preloaded.fold``). Another user than the mount's
        (``owner`` False) has only files every user may read filled: naming others would
        fill the cache with what it may not read."""
        assert self._source is not None and self.index is not None
        try:
            st = self._source.lstat(path)
        except (OSError, ValueError):
            return  # gone, or not beneath the source: nothing to fill
        if not stat.S_ISREG(st.st_mode) or not (owner or self.index.open_to_all(path,
                                                                                 st.st_mode)):
            return
        key = (st.st_dev, st.st_ino)
        entry, new = self.reserve_behind(key, path, st)
        if entry is not None and new:
            self.fill_behind(key, entry, self._source, nursery)

    async def _beat(self) -> None:
        """In the loop that withdraws changed files: a loop that stops beats no more."""
        assert self.index is not None
        while True:
            self.index.beat()
            await trio.sleep(BEAT_EVERY_S)

    def shared_status(self) -> dict | None:
        """Where clients find the index and the entries' files, and what the index holds."""
        if self.index is None or self.watch is None:
            return None
        return {
            "index": os.path.join(self.directory, INDEX),
            "files": os.path.join(self.directory, FILES),
            "mode": "revalidate" if self.index.revalidate else "watch",
            "published": len(self.index),
            "withdrawn": self.index.withdrawn,
            # other users' (``--allow-other``): the entries every user may read
            "public_index": (os.path.join(self.directory, PUBLIC_INDEX)
                             if self.index.public is not None else None),
            "published_to_all": 0 if self.index.public is None else len(self.index.public),
            "watched_directories": self.watch.directories,
        }

    # -- a full filesystem -------------------------------------------------------------

    def _note_full(self, error: OSError) -> None:
        if self.full:
            return
        self.full = True
        self._room_changed()
        message = ("cache directory %s is full (%s): a new file is cached only where it has "
                   "room for it, until it has room for the whole cache again")
        if self._no_room_warned:
            log.info(message, self.directory, error.strerror)
        else:
            log.warning(message, self.directory, error.strerror)
            self._no_room_warned = True

    def _free(self) -> int:
        st = os.fstatvfs(self.dir_fd)
        return st.f_bavail * st.f_frsize

    def _fits(self, size: int) -> bool:
        """Whether the cache's filesystem takes a new file of ``size``: always, unless it was
        full; then the room it has is asked for each file, since other users (or a quota) may
        give back any part of it, less than the capacity left (6 MiB of 40, say)."""
        if not self.full:
            return True
        free = self._free()
        return self._room_is_back(free) or pages(size) + ROOM_SLACK <= free

    def _check_room(self) -> None:
        """While full, the room published to clients follows the filesystem's."""
        if self.full and not self._room_is_back(self._free()):
            self._room_changed()

    def _room_is_back(self, free: int) -> bool:
        """The cache is full no more once its filesystem has room for all of the capacity
        left: then no new file needs a check of its own."""
        if free < self.capacity - self.used + ROOM_SLACK:
            return False
        log.info("cache directory %s has room again: caching new files", self.directory)
        self.full = False
        self._room_changed()
        return True

    # -- internals -----------------------------------------------------------------

    def promise(self, size: int) -> None:
        """Count ``size`` more (or, negative, fewer) bytes as promised to files a job handed
        over (``fills.FillQueue.add``) and not reserved yet."""
        self.promised = max(0, self.promised + size)
        self._room_changed()

    def _room_changed(self) -> None:
        """Publish how large a new file MinIO would still take: clients read a larger file
        from the source themselves (through the mount it would only be streamed). Room
        promised to files handed over for filling is not theirs (the mount's own readers
        still take what comes first, as MinIO does)."""
        if self.index is not None:
            room = self.capacity - self.used - self.promised
            if self.full:
                room = min(room, self._free() - ROOM_SLACK)
            # in whole pages, as a file is charged: a client's ``size <= room`` then says
            # what ``reserve`` will (a file a few bytes under the room went through the mount
            # and was not cached)
            self.index.set_room(max(0, room) // pages(1) * pages(1))

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
        entry.complete, entry.failed, entry.behind = False, True, False
        removed, flags = self.entries.remove(key, entry)
        if removed:
            self.used -= pages(entry.size)
            self.data_bytes -= entry.size
            self._room_changed()
        if was_complete:  # journaled: a restart must not adopt it
            self.journal.append(journal.dropped(key, entry))
        if flags & SHARED:  # clients find it no more; those that opened it keep its bytes
            self._withdraw(entry.path)
        mapped = self._mapped.pop(entry.offset, None)
        if mapped is not None:
            _unmap(mapped)
        try:
            os.unlink(file_name(entry.offset), dir_fd=self.files_fd)
        except FileNotFoundError:
            pass  # a fill that failed before its first byte
        except OSError as e:
            log.warning("cannot remove the cache file of %s: %s", os.fsdecode(entry.path), e)
        for tell in self.released:
            tell(key, entry)


class Checking(NamedTuple):
    """An adopted entry being checked against the source."""

    row: int
    key: Key
    path: bytes
    offset: int
    #: its directories are watched: the check may publish it
    publishable: bool


def _lstat_all(source: Source, checking: list[Checking]) -> list[os.stat_result | None]:
    """The source's lstat of each path (None where it has gone): a worker thread's part of
    ``WholeFileCache.check``.

    A thread that runs Python keeps the GIL from the event loop's thread for up to the switch
    interval (5 ms) each time that thread wakes for a request: four requests a file made the
    mount's reads twenty times slower during a check. So a pause, long enough for a waiting
    thread to take the GIL, every ``_CHECK_SLICE`` paths."""
    stats: list[os.stat_result | None] = []
    for done, (_row, _key, path, _offset, _publishable) in enumerate(checking):
        if done % _CHECK_SLICE == _CHECK_SLICE - 1:
            time.sleep(_CHECK_PAUSE_S)
        try:
            stats.append(source.lstat(path))
        except (OSError, ValueError):
            stats.append(None)
    return stats


@dataclass(slots=True, eq=False)
class _Behind:
    """An entry to fill behind its reader: the source file's descriptor if the reader's was
    kept (else -1: opened again), and what the copy came to."""

    key: Key
    entry: Entry
    fd: int
    final: os.stat_result | None = None
    error: Exception | None = None

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _copy_behind(batch: list[_Behind], source: Source, files_fd: int) -> None:
    """In a worker thread: each file into its entry's file, the kernel copying from the page
    cache (``sendfile``: what the reader read is there, the rest is read), its pages dropped
    after; errors are kept in the items, never raised."""
    for item in batch:
        out = -1
        try:
            if item.fd < 0:
                item.fd = source.open_file(item.entry.path)
            if not stat.S_ISREG(os.fstat(item.fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            out = create_file(files_fd, item.entry.offset)
            size, done = item.entry.size, 0
            while done < size:
                got = os.sendfile(out, item.fd, done, size - done)
                if got == 0:
                    raise OSError(errno.EIO, "source file shrank while being cached")
                done += got
            item.final = os.fstat(item.fd)
            os.posix_fadvise(item.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except Exception as e:
            item.error = e
        finally:
            item.close()
            if out >= 0:
                os.close(out)


class _Copier:
    """Copies a source file into a filling entry's file, one chunk per call from a worker
    thread.

    Opening the source and the entry's file, the last chunk, the final fstat and the closes
    share a thread call, so a small file (the common case) costs one thread hand-off rather
    than three, and the event loop's thread makes no system call for it (each would wait for
    the GIL behind the fill threads').
    """

    def __init__(self, source: Source, entry: Entry, files_fd: int) -> None:
        self.source = source
        self.entry = entry
        self.files_fd = files_fd
        self.reader: SourceReader | None = None
        self.fd = -1
        self.final: os.stat_result | None = None

    def step(self, offset: int) -> int:
        if self.reader is None:
            self.reader = self.source.open_reader(self.entry.path)
            self.fd = create_file(self.files_fd, self.entry.offset)
        data = self.reader.read_view(offset, min(FILL_CHUNK, self.entry.size - offset))
        write_all(self.fd, data, offset)
        if offset + len(data) >= self.entry.size:
            self.final = self.reader.fstat()
            self.close()
        return len(data)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
