"""Backfills: an entry filled, once its reader closed, from the pages that reader's
reads brought into the page cache (a passthrough open the kernel served from the source file,
a job under ``coordlfs run`` that read a miss itself).

Storage is read once, and counted once, by the reader; the cache copies the pages (``Copier``
from ``FromPages``) and drops them. One reader releases a small file every 0.2-0.4 ms, so the
files are queued and a worker thread copies a batch per hand-off: each file pays a share of
one hand-off, one journal write and one wake of the event loop instead of its own.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass

import trio

from coordlfs.cache.compact import Key
from coordlfs.cache.entries import Entry
from coordlfs.cache.files import Copier, FromPages
from coordlfs.source.source import Source
from coordlfs.source.threads import in_thread

#: Most entries one hand-off to a thread backfills: the loop's share of a
#: hand-off per file, against the wait of the batch's last file
BACKFILL_BATCH = 16
#: Seconds the backfills wait for more files before a batch is handed off, when
#: fewer than a batch are queued: only a reopen of a file just read waits for it.
BACKFILL_GATHER_S = 0.002


@dataclass(slots=True, eq=False)
class Backfill:
    """An entry to backfill its reader, and what its copy came to."""

    key: Key
    entry: Entry
    copier: Copier
    final: os.stat_result | None = None
    error: Exception | None = None


def _copy_all(batch: list[Backfill]) -> None:
    """In a worker thread: each file into its entry's file; errors are kept in the items,
    never raised."""
    for item in batch:
        try:
            item.copier.copy()
            item.final = item.copier.final
        except Exception as e:
            item.error = e
        finally:
            item.copier.close()


class BackfillQueue:
    """Entries waiting to be backfilled, and whether a task fills them."""

    def __init__(self, files_fd: int, ended: Callable[[list[Backfill]], None],
                 cancelled: Callable[[Key, Entry, None, BaseException], object]) -> None:
        self.files_fd = files_fd
        #: ends a batch's fills together (``WholeFileCache.ended_together``)
        self.ended = ended
        #: ends one fill given up (``WholeFileCache.end_fill``)
        self.cancelled = cancelled
        self._queued: list[Backfill] = []
        self.busy = False

    def add(self, key: Key, entry: Entry, source: Source, nursery: trio.Nursery,
            source_fd: int = -1) -> None:
        """Queue an entry, its source file read from ``source_fd`` (the reader's backing, if
        still open) or opened again; the copying task is started in ``nursery`` if none
        runs."""
        fd = -1
        if source_fd >= 0:
            with contextlib.suppress(OSError):
                fd = os.dup(source_fd)
        copier = Copier(self.files_fd, entry, FromPages(source, entry.path, fd))
        self._queued.append(Backfill(key, entry, copier))
        if not self.busy:
            self.busy = True
            nursery.start_soon(self._run)

    async def drained(self, seconds: float) -> None:
        """Wait, at most ``seconds``, for the queue to empty: at unmount, the files just read
        are then complete in the cache (and in its journal)."""
        with trio.move_on_after(seconds):
            while self.busy:
                await trio.sleep(0.01)

    async def _run(self) -> None:
        """Copy the queued entries a batch at a time, until none is left; each batch's
        entries end together (one journal write)."""
        batch: list[Backfill] = []
        try:
            while self._queued:
                if len(self._queued) < BACKFILL_BATCH:
                    await trio.sleep(BACKFILL_GATHER_S)
                batch, self._queued = self._queued[:BACKFILL_BATCH], self._queued[BACKFILL_BATCH:]
                await in_thread(_copy_all, batch)
                for item in batch:
                    if item.error is None:
                        item.entry.filled = item.entry.size
                self.ended(batch)
                batch = []
        finally:
            self.busy = False
            for item in batch + self._queued:  # cancelled at unmount
                item.copier.close()
                self.cancelled(item.key, item.entry, None,
                               OSError(errno.ECANCELED, "unmounted"))
            self._queued = []
