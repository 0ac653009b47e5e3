"""A restart over a kept cache: what a previous daemon left is adopted at once, unchecked, and
checked against the source while the mount serves.

Only what the journal proves is kept: entries whose files are there, within the capacity;
every other file is unlinked. Serving them unchecked is safe because an open compares the
file's version with the entry's anyway (the inode is the key; size, mtime and ctime must
match), so a changed file is never served; the sweep (``check``) drops the entries of changed
or removed files, returning their room, and publishes the rest for clients. It runs in worker
threads, a share of the event loop's time at most, so the mount's requests come first.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from collections.abc import Callable
from typing import NamedTuple

import trio

from coordlfs.cache import journal, preloaded
from coordlfs.cache.compact import Key
from coordlfs.cache.directory import FILES, CacheDirectory
from coordlfs.cache.entries import UNCHECKED, Entry, EntryTable
from coordlfs.cache.files import file_name
from coordlfs.cache.journal import JOURNAL
from coordlfs.cache.published import INDEX, PUBLIC_INDEX
from coordlfs.cache.publishing import Publisher
from coordlfs.cache.room import Room
from coordlfs.sizes import pages
from coordlfs.source.source import Source
from coordlfs.source.threads import in_thread

#: the cache's log lines keep one name, whichever of its modules writes them
log = logging.getLogger("coordlfs.cache.cache")

#: Adopted entries one worker thread compares with the source per hand-off, and the worker
#: threads that do (a cold source waits on its disk for each lstat; a warm one on the GIL).
#: What the event loop does per batch (about 5 ms) holds up the mount's requests that long,
#: and all batches together take at most ``_CHECK_SHARE`` of its time.
CHECK_BATCH = 512
CHECK_WORKERS = 2
_CHECK_SLICE = 32
_CHECK_SHARE = 0.25
_CHECK_PAUSE_S = 0.0005


class Checking(NamedTuple):
    """An adopted entry being checked against the source."""

    row: int
    key: Key
    path: bytes
    offset: int
    #: its directories are watched: the check may publish it
    publishable: bool


class Restart:
    """Adoption and check of a kept cache, over the parts of the cache they change."""

    def __init__(self, entries: EntryTable, room: Room, directory: CacheDirectory,
                 journal_: journal.Journal, publisher: Publisher,
                 release: Callable[[Key, Entry], None]) -> None:
        self.entries = entries
        self.room = room
        self.directory = directory
        self.journal = journal_
        self.publisher = publisher
        #: drops an entry whose file changed (``WholeFileCache._release``)
        self.release = release

    def adopt(self, next_number: int) -> int:
        """Adopt the entries a previous daemon left, unchecked; returns the next entry's
        number (one past the last adopted)."""
        dir_fd, files_fd = self.directory.fd, self.directory.files_fd
        columns, lines = journal.read(dir_fd)
        if columns is not None:
            self.entries.load(columns)
        replay = journal.Replay()
        for line in lines:
            replay.line(line)
        clean = columns is not None and not replay.lines
        self._replayed(replay)
        for name in os.listdir(dir_fd):  # a torn journal rewrite, or an older layout
            if name not in (FILES, JOURNAL, INDEX, PUBLIC_INDEX, preloaded.COUNTS,
                            preloaded.NOTICES):
                os.unlink(name, dir_fd=dir_fd)
        files = set(os.listdir(files_fd))
        numbers, sizes = self.entries.offset, self.entries.size
        for row in sorted(self.entries.rows(), key=numbers.__getitem__):
            name = file_name(numbers[row])
            if name not in files or self.room.used + pages(sizes[row]) > self.room.capacity:
                self.entries.remove_row(row)
                clean = False
                continue
            files.remove(name)
            if self.directory.were_public:  # published to others again only if they may
                os.chmod(name, 0o600, dir_fd=files_fd, follow_symlinks=False)
            self.room.take(sizes[row])
            next_number = numbers[row] + 1
        for name in files:
            os.unlink(name, dir_fd=files_fd)
        self.room.changed()
        if not clean:
            self.journal.checkpoint(self.entries.columns())
        self.publisher.reserve(len(self.entries))
        return next_number

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

    def load(self, source: Source) -> None:
        """Check every adopted entry against the source before returning."""
        unchecked = self.unchecked()
        for first in range(0, len(unchecked), CHECK_BATCH):
            checking = self.checking(unchecked[first : first + CHECK_BATCH])
            self.checked(checking, lstat_all(source, checking), self.publisher.changes)

    def unchecked(self) -> array:
        flags = self.entries.flags
        return array("i", (row for row in self.entries.rows() if flags[row] & UNCHECKED))

    async def check(self, source: Source, workers: int = CHECK_WORKERS) -> None:
        """Compare every adopted entry with the source, in worker threads, while the mount
        serves: drop those whose file changed or went (their room returns to the cache),
        publish the rest for clients."""
        unchecked = self.unchecked()
        if not unchecked:
            return
        started, dropped = time.monotonic(), 0
        batches = iter(range(0, len(unchecked), CHECK_BATCH))

        async def worker() -> None:
            nonlocal dropped
            try:
                for first in batches:
                    began = time.monotonic()
                    checking = self.checking(unchecked[first : first + CHECK_BATCH])
                    changes = self.publisher.changes
                    spent = time.monotonic() - began
                    stats = await in_thread(lstat_all, source, checking)
                    began = time.monotonic()
                    dropped += self.checked(checking, stats, changes)
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

    def checking(self, rows: array) -> list[Checking]:
        """The rows still unchecked, their directories watched first: a change between the
        watch and the check cannot go unseen."""
        entries, checking = self.entries, []
        for row in rows:
            if entries.live(row) and entries.flags[row] & UNCHECKED:
                path = entries.paths.get(row)
                checking.append(Checking(row, entries.keys.key(row), path, entries.offset[row],
                                         self.publisher.cover(path)))
        return checking

    def checked(self, checking: list[Checking],
                stats: list[os.stat_result | None], changes: int) -> int:
        """Settle the rows ``lstat_all`` compared: drop a changed file's entry, publish the
        rest; returns how many were dropped. If the watch reported a change meanwhile, the
        stat may predate it: those are published only after a check of their own
        (``Publisher.publish``)."""
        entries, dropped = self.entries, 0
        for (row, key, path, offset, publishable), st in zip(checking, stats, strict=True):
            if entries.keys.find(key) != row or entries.offset[row] != offset:
                continue  # dropped meanwhile (an open saw it change)
            entries.flags[row] &= ~UNCHECKED
            if st is None or (st.st_dev, st.st_ino) != key or not entries.matches(row, st):
                log.info("source file %s changed; dropping its cache entry", os.fsdecode(path))
                self.release(key, entries.entry(row))
                dropped += 1
            elif not publishable:
                continue
            elif changes != self.publisher.changes:
                self.publisher.publish(key, entries.entry(row))
            else:
                self.publisher.add(key, path, entries.published(row, st.st_ino), st.st_mode)
        return dropped


def lstat_all(source: Source, checking: list[Checking]) -> list[os.stat_result | None]:
    """The source's lstat of each path (None where it has gone): a worker thread's part of
    ``Restart.check``.

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
