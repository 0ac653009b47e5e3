"""Keeping the index clients read true: complete entries published, withdrawn the moment their
source file may have changed, and a heartbeat so that clients stop trusting an index whose
daemon is gone.

The index itself (its layout, writer and reader) is ``published``; the private and the public
one together are ``public.Indexes``. What is decided here is when an entry may be published:
only after the directories leading to its file are watched and its version is seen in the
source after that, so that no change between the two goes unseen. Where the source cannot be
watched, clients compare each hit with the source themselves (the index's ``revalidate``).

It also serves what ``coordlfs run``'s preload library tells the daemon (``preloaded``): a
job's process that read a miss from the source names it at its close, and the file is filled
from the pages it read (backfilled, as after a passthrough reader).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import stat
from collections.abc import Callable
from typing import Any

import trio

from coordlfs.cache import preloaded
from coordlfs.cache.compact import Key
from coordlfs.cache.directory import FILES
from coordlfs.cache.entries import FILLING, SHARED, UNCHECKED, Entry, EntryTable
from coordlfs.cache.public import Indexes
from coordlfs.cache.published import BEAT_EVERY_S, INDEX, PUBLIC_INDEX, Published
from coordlfs.cache.room import Room
from coordlfs.protocol.server import ControlServer
from coordlfs.protocol.spec import Caller
from coordlfs.source.source import Source
from coordlfs.source.watch import PublishedWatch

#: the cache's log lines keep one name, whichever of its modules writes them
log = logging.getLogger("coordlfs.cache.cache")

#: entries ``Publisher._catch_up`` publishes between two turns of the loop (~20 µs each)
CATCH_UP_SLICE = 256

#: backfills an entry a reader the preload library reported read (``Publisher.noticed``)
FillNoticed = Callable[[Key, bytes, os.stat_result, Source, trio.Nursery], None]


class Publisher:
    """The cache's entries as clients see them: nothing is published until ``share``."""

    def __init__(self, entries: EntryTable, room: Room, dir_fd: int, files_fd: int,
                 directory: str, fill_noticed: FillNoticed) -> None:
        self.entries = entries
        self.room = room
        self.dir_fd, self.files_fd, self.directory = dir_fd, files_fd, directory
        self.fill_noticed = fill_noticed
        #: the index for clients and the watch that withdraws from it (``share``)
        self.index: Indexes | None = None
        self.watch: PublishedWatch | None = None
        self.source: Source | None = None
        #: changes the watch reported: a check that saw one meanwhile re-checks to publish
        self.changes = 0
        self._index_full_logged = False
        #: what ``coordlfs run``'s preload library tells this daemon (``share``)
        self.preloaded: preloaded.Preloaded | None = None
        #: whether anything reads the index: nothing is written to it until a client asks
        #: where it is or the peer server's C path reads it (``want``). Unread, it would cost
        #: each fill a walk of the source and a write (a third of a lane miss's loop).
        self.wanted = False
        self._wanted = trio.Event()
        #: entries complete before the index was wanted, still to publish (``_catch_up``)
        self.backlog = 0
        #: told when the backlog is published (the control file's waiting ``share``)
        self.caught_up: list[Callable[[], None]] = []

    def share(self, source: Source, public: bool = False) -> None:
        """Publish complete entries for ``coordlfs.client`` from now on, and watch ``source``
        to withdraw them when their files change (``run`` reads the watch); with ``public``
        (an ``--allow-other`` mount), those every user may read to every user
        (``coordlfs.cache.public``)."""
        watch = PublishedWatch(source, self.changed)
        try:
            self.index = Indexes(self.dir_fd, self.files_fd, not watch.watching,
                                 source.lstat if public else None)
        except OSError as e:
            watch.close()
            log.warning("cannot publish cached files for coordlfs.client in %s (%s): clients "
                        "read through the mount", self.directory, e.strerror or e)
            return
        self.source, self.watch = source, watch
        try:
            self.preloaded = preloaded.Preloaded(self.dir_fd, public)
        except OSError as e:
            log.warning("cannot serve `coordlfs run` jobs from %s (%s): they read through "
                        "the mount", self.directory, e.strerror or e)
        self.room.told.append(self.index.set_room)
        self.room.changed()

    def want(self) -> None:
        """Something reads the index from now on: entries are published as they complete,
        and those completed before are published by ``run`` (``backlog``)."""
        if self.index is not None and not self.wanted:
            self.wanted = True
            self.backlog = max(0, len(self.entries) - self.entries.filling)
            self._wanted.set()

    def publish(self, key: Key, entry: Entry) -> None:
        """Publish a complete entry if its source file still is the version it holds, once
        the index is wanted.

        The watch comes first and the version check after it, so that a change between the
        two cannot go unseen. The fill's own fstat does not do for the check: it came before
        the watch (an event meanwhile withdrew nothing yet published), and it saw the open
        file, not what the path names now.
        """
        if not self.wanted or not self.cover(entry.path):
            return
        assert self.source is not None
        try:
            st = self.source.lstat(entry.path)
        except (OSError, ValueError):
            return
        if (st.st_dev, st.st_ino) == key and entry.matches(st):
            self.add(key, entry.path, Published(entry.offset, entry.size, st.st_ino,
                                                entry.mtime_ns, entry.ctime_ns), st.st_mode)

    def republish(self, key: Key, entry: Entry, shared: bool) -> None:
        """A complete entry found again: published anew if a change withdrew it that changed
        nothing. While nothing was ever withdrawn, its flag says it is there (no hash)."""
        if (entry.complete and self.wanted and self.index is not None
                and (self.index.withdrawn or not shared) and entry.path not in self.index):
            self.publish(key, entry)

    def cover(self, path: bytes) -> bool:
        """Watch the directories leading to ``path``, before its version is checked; whether
        a check from now on may publish it."""
        if self.index is None or self.watch is None or self.source is None:
            return False
        covered = self.watch.cover(path)
        if not self.watch.watching:
            if not self.index.revalidate:
                self.index.set_revalidate()
            return True
        return covered

    def add(self, key: Key, path: bytes, found: Published, mode: int) -> None:
        """Publish an entry whose version (and ``mode``) was just seen in the source, after
        its directories were watched."""
        assert self.index is not None
        if not self.wanted:
            return
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

    def reserve(self, entries: int) -> None:
        """Make room in the index for ``entries`` at once (those a restart adopted)."""
        if self.index is not None:
            self.index.reserve(entries)

    def withdraw(self, path: bytes) -> None:
        if self.index is not None:
            self.index.withdraw(path)

    def hand_over(self, paths: list[bytes]) -> None:
        """Files a job handed to the fills: its clients read them through the mount until
        they are published (``IndexWriter.hand_over``)."""
        if self.index is not None:
            with contextlib.suppress(OSError):  # no room to grow: read as before
                for path in paths:
                    self.index.hand_over(path)

    def take_back(self, path: bytes) -> None:
        """A file handed over has been filled, or will not be: its mark goes."""
        if self.index is not None:
            self.index.take_back(path)

    def changed(self, path: bytes, directory: bool) -> None:
        """The watch saw a change to ``path`` (a file, or a directory and all beneath it)."""
        self.changes += 1
        self.withdraw(path)
        if directory and self.index is not None:
            self.index.changed_directory()
        if directory:
            inside = path + b"/" if path else b""
            for published in [p for p in self.entries.shared_paths() if p.startswith(inside)]:
                self.withdraw(published)

    async def run(self) -> None:
        """Withdraw published entries whose source changes, and beat, so that clients stop
        trusting the index soon after this loop stops."""
        if self.watch is None:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.watch.run)
            nursery.start_soon(self._beat)
            if self.preloaded is not None:
                nursery.start_soon(self.preloaded.notices.run,
                                   functools.partial(self.noticed, nursery))
            nursery.start_soon(self._catch_up)
            while True:
                await trio.sleep(1.0)
                self.room.check()  # clients send no misses to notice it

    def noticed(self, nursery: trio.Nursery, path: bytes, owner: bool) -> None:
        """A job under ``coordlfs run`` read ``path`` from the source and closed it: the
        pages it read are copied into the cache (backfilled, as after a passthrough reader).
        Its storage read was counted by the job (``Preloaded.fold``). Another user than the mount's
        (``owner`` False) has only files every user may read filled: naming others would
        fill the cache with what it may not read."""
        assert self.source is not None and self.index is not None
        try:
            st = self.source.lstat(path)
        except (OSError, ValueError):
            return  # gone, or not beneath the source: nothing to fill
        if not stat.S_ISREG(st.st_mode) or not (owner or self.index.open_to_all(path,
                                                                                 st.st_mode)):
            return
        self.fill_noticed((st.st_dev, st.st_ino), path, st, self.source, nursery)

    async def _catch_up(self) -> None:
        """Once the index is wanted, publish the entries completed before, a slice at a time
        (the loop serves between), each as a fill's end would (``publish``); then tell
        ``caught_up``."""
        await self._wanted.wait()
        entries = self.entries
        rows = list(entries.rows())
        for start in range(0, len(rows), CATCH_UP_SLICE):
            for row in rows[start : start + CATCH_UP_SLICE]:
                if entries.live(row) and not entries.flags[row] & (FILLING | SHARED | UNCHECKED):
                    self.publish(entries.keys.key(row), entries.entry(row))
            self.backlog = max(0, len(rows) - start - CATCH_UP_SLICE)
            await trio.lowlevel.checkpoint()
        self.backlog = 0
        for tell in self.caught_up:
            tell()

    async def _beat(self) -> None:
        """In the loop that withdraws changed files: a loop that stops beats no more."""
        assert self.index is not None
        while True:
            self.index.beat()
            await trio.sleep(BEAT_EVERY_S)

    def status(self) -> dict | None:
        """Where clients find the index and the entries' files, and what the index holds."""
        if self.index is None or self.watch is None:
            return None
        return {
            "index": os.path.join(self.directory, INDEX),
            "files": os.path.join(self.directory, FILES),
            "mode": "revalidate" if self.index.revalidate else "watch",
            "wanted": self.wanted,
            "backlog": self.backlog,
            "published": len(self.index),
            "withdrawn": self.index.withdrawn,
            # other users' (``--allow-other``): the entries every user may read
            "public_index": (os.path.join(self.directory, PUBLIC_INDEX)
                             if self.index.public is not None else None),
            "published_to_all": 0 if self.index.public is None else len(self.index.public),
            "watched_directories": self.watch.directories,
        }

    def close(self) -> None:
        if self.preloaded is not None:
            self.preloaded.close()
        if self.index is not None:
            self.index.close()
        if self.watch is not None:
            self.watch.close()


def register_commands(server: ControlServer, publisher: Publisher) -> None:
    """``share``: a client keeps the index wanted, and waits for what was cached before."""

    def share(_args: dict[str, Any], _caller: Caller) -> dict[str, Any]:
        publisher.want()
        return {"status": server.snapshot(), "backlog": publisher.backlog}

    server.serve("share", share)
    publisher.caught_up.append(server.notify)
