"""Order-aware prefetch: read ahead of an aligned group's leading job.

Once a group has registered its file list (``group.files``) and its members announce their
epochs (``group.epoch``), the mount knows the order every member will read next, and where the
furthest member is (``Group.lead``). The prefetcher reads the next items after the lead with
up to ``depth`` storage requests in flight, so a job that waits on storage waits on several
requests at once rather than one. An item the cache has room for is filled into the cache (as a read
would); any other small item goes into the group's read window, held for every member, but
only while the window stays under half its bound, so read-ahead never pushes out items that
followers still need and never evicts a cache entry (the cache never evicts). Readers outside
aligned groups see nothing of this.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable
from typing import Any

import trio

from coordlfs.cache.cache import WholeFileCache
from coordlfs.cache.stats import ReadCounters
from coordlfs.jobs.groups import Group, Groups
from coordlfs.jobs.window import ReadWindow
from coordlfs.source.source import Source, Version

log = logging.getLogger(__name__)

#: Positions past the lead considered on each pass.
AHEAD = 64
#: Largest file read ahead into the window; larger ones stream by the kernel's readahead.
MAX_ITEM = 1 << 20


class Prefetcher:
    def __init__(self, groups: Groups, window: ReadWindow, cache: WholeFileCache, source: Source,
                 counters: ReadCounters, depth: int,
                 caches_here: Callable[[bytes], bool] = lambda _path: True) -> None:
        self.groups = groups
        #: files a peer caches are left to their owner (``coordlfs.peers.placement``)
        self.caches_here = caches_here
        self.window = window
        self.cache = cache
        self.source = source
        self.counters = counters
        self.depth = depth
        self.in_flight = 0
        self.in_flight_bytes = 0
        self.most_in_flight = 0
        self.files = 0
        self.bytes = 0
        self._wake = trio.Event()
        #: per group: the epoch and the items already considered in it
        self._considered: dict[str, tuple[int, set[int]]] = {}

    @property
    def byte_budget(self) -> int:
        return self.window.capacity // 2

    def poke(self) -> None:
        """The lead moved (or a fetch ended): look for more to read ahead."""
        self._wake.set()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                try:
                    self._plan(nursery)
                except Exception:  # an uncaught error here would take the mount down
                    log.exception("planning read-ahead failed")

    def _plan(self, nursery: trio.Nursery) -> None:
        if self.depth == 0:
            return
        for name in [n for n in self._considered if n not in self.groups.groups]:
            del self._considered[name]  # the group is gone
        for group in list(self.groups.groups.values()):
            if not group.position_of:
                continue
            epoch, considered = self._considered.get(group.name, (-1, set()))
            if epoch != group.epoch:
                considered = set()
                self._considered[group.name] = (group.epoch, considered)
            lead = group.lead()
            for position in range(lead + 1, min(lead + 1 + AHEAD, len(group.order))):
                if self.in_flight >= self.depth:
                    return
                item = group.order[position]
                if item in considered:
                    continue
                considered.add(item)
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                nursery.start_soon(self._fetch, group, group.files[item])

    async def _fetch(self, group: Group, path: bytes) -> None:
        size = 0
        try:
            if not self.caches_here(path):
                return
            st = await trio.to_thread.run_sync(self.source.lstat, path)
            key = (st.st_dev, st.st_ino)
            if not stat.S_ISREG(st.st_mode) or self.cache.lookup(key, st) is not None \
                    or key in self.window.items or self.window.fetching(key):
                return
            entry = self.cache.reserve(key, path, st)
            if entry is not None:
                self.files += 1
                self.bytes += st.st_size
                await self.cache.fill(key, entry, self.source)
                return
            size = st.st_size
            if size > MAX_ITEM or (self.window.used + self.in_flight_bytes + size
                                   > self.byte_budget):
                size = 0
                return
            self.in_flight_bytes += size
            await self._into_window(group, key, path, Version.of(st))
        except OSError as e:  # gone or unreadable: a real read will report it
            log.debug("read-ahead of %r skipped: %s", path, e)
        except Exception:
            log.exception("read-ahead of %r failed", path)
        finally:
            self.in_flight -= 1
            self.in_flight_bytes -= size
            self.poke()

    async def _into_window(self, group: Group, key: Any, path: bytes,
                           version: Version) -> None:
        self.window.claim(key)
        data = None
        try:
            data = await trio.to_thread.run_sync(self._read, path, version.size)
            self.counters.bytes_from_source += len(data)
            self.files += 1
            self.bytes += len(data)
        finally:
            self.window.publish(key, version, data, 0, set(group.members))

    def _read(self, path: bytes, size: int) -> bytes:
        """In a worker thread: open, read and close in one hand-off."""
        reader = self.source.open_reader(path)
        try:
            return reader.pread(0, size)
        finally:
            reader.close()

    def status(self) -> dict[str, int]:
        return {"depth": self.depth, "in_flight": self.in_flight,
                "most_in_flight": self.most_in_flight, "files": self.files,
                "bytes": self.bytes}
