"""The peer holding area: files of a known order that peers cache, fetched ahead of the readers.

Without an order, each file a reader opens that a peer caches costs a round trip to that peer
at the reader's first read, and small files move at one round trip each. Given the order (the
``prefetch`` command: a job hands its coming reads to the mount), the files a peer ranked
before this node caches (or, once this node's cache has no room for them, a peer ranked after
it) are asked of their peer in order, many per request (``peer_wire.GetMany``), ``DEPTH``
requests in flight per peer, and held here in memory. A reader's first miss of such a file
takes it (``Opens.open``), or waits for the batch it is in (never asking the peer a second
time); a file whose batch was not sent yet is left to the reader, which asks for it itself.

Memory is bounded: the bytes held and in flight never exceed ``capacity``; a new batch goes
out only when a full one fits. Each held file is served once. A file is dropped unread when
the readers have passed it (its place in the order is ``LAG`` places behind the last file a
reader asked for, held or not: a file read again while the kernel still has its pages is
never asked for, and an area full of them would hold up the next batches), or when the area
has been full for ``STALE_S`` (oldest first), so an order the readers do not follow costs
peer traffic, never memory beyond the bound. A file that changed here since it was asked for
(another size or mtime) is never served from the area. A peer that leaves the cluster
(``Peers.replace``) takes its queue and its requests in flight with it; what it already sent
stays held.
"""

from __future__ import annotations

import enum
import logging
import os
import stat
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from coordlfs.peers.wire import MAX_CHUNK, GetMany

if TYPE_CHECKING:
    from coordlfs.cache.cache import WholeFileCache
    from coordlfs.peers.links import PeerLink, Peers
    from coordlfs.source.source import Source

log = logging.getLogger(__name__)

#: Bytes held and in flight at most: four requests in flight per peer and as much again
#: held, well ahead of readers that take files as fast as they come; it counts against the
#: mount's memory beside its cache. (A held file is a view of its batch's reply, which goes
#: when the last of its files has.)
CAPACITY = 8 << 20
#: GETMANY requests in flight per peer: enough to keep a link busy across round trips.
DEPTH = 4
#: A held file this many places in the order behind the last file a reader asked for was
#: passed: read from the kernel's pages (never asked of the mount), or by a reader that fetched
#: it itself. A job's loader processes read at most a few hundred places apart (readers x
#: batches ahead x batch size), so a nearer file may still be on its way to a late reader.
LAG = 512
#: Seconds the area may stay full before its oldest held file is dropped unread.
STALE_S = 10.0
#: Files waiting to be asked for, at most; more are left to the readers.
MAX_QUEUED = 1 << 17


class _State(enum.Enum):
    QUEUED = 1
    FLYING = 2
    HELD = 3
    GONE = 4  # taken, dropped or failed: no longer the area's


@dataclass(slots=True, eq=False)
class _Item:
    path: bytes
    st: os.stat_result
    link: PeerLink
    #: its place in the order handed over
    position: int
    state: _State = _State.QUEUED
    data: bytes | memoryview | None = None
    arrived: trio.Event = field(default_factory=trio.Event)

    @property
    def size(self) -> int:
        return self.st.st_size


class PeerHold:
    def __init__(self, peers: Peers, cache: WholeFileCache, source: Source,
                 capacity: int = CAPACITY, depth: int = DEPTH) -> None:
        if capacity < MAX_CHUNK:
            raise ValueError(f"a holding area of {capacity} bytes cannot take one batch")
        self.peers = peers
        self.cache = cache
        self.source = source
        self.capacity = capacity
        self.depth = depth
        #: every file of the area by path, whatever its state but GONE
        self.items: dict[bytes, _Item] = {}
        #: per peer, the files to ask it for, and the scope of the task that asks
        self._queues: dict[PeerLink, deque[_Item]] = {}
        self._feeders: dict[PeerLink, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None
        self._held: OrderedDict[bytes, _Item] = OrderedDict()
        #: bytes held or in flight
        self.reserved = 0
        self._positions = 0
        self._taken_at = 0
        self._changed = trio.Event()
        self.stats = {"queued": 0, "batches": 0, "fetched": 0, "hits": 0, "not_served": 0,
                      "dropped_unread": 0, "left_to_readers": 0}

    def prefetch(self, paths: Iterable[bytes]) -> int:
        """Queue the files of an order that a peer caches, in this order; returns how many
        were queued. Files already queued or held are not queued twice. Only those files are
        looked up in the source (inline: the order's caller has just checked them)."""
        queued = 0
        for path in paths:
            if path in self.items or len(self.items) >= MAX_QUEUED:
                continue
            before, after = self.peers.candidates(path)
            if not before and not (after and self._no_room(0)):
                continue
            try:
                st = self.source.lstat(path)
            except OSError:
                continue  # gone or unreadable: the reader will say so
            link = self._peer_for(st, before, after)
            if link is None:
                continue
            item = self.items[path] = _Item(path, st, link, self._positions)
            self._positions += 1
            self._queue(link).append(item)
            queued += 1
        self.stats["queued"] += queued
        self._poke()
        return queued

    def has_order(self) -> bool:
        """Whether files of an order are queued, on their way or held here."""
        return bool(self.items)

    def _no_room(self, size: int) -> bool:
        return self.cache.room.used + max(size, 1) > self.cache.room.capacity

    def _peer_for(self, st: os.stat_result, before: list[PeerLink],
                  after: list[PeerLink]) -> PeerLink | None:
        """The peer a reader's miss of this file would ask first, if it would ask one."""
        if not stat.S_ISREG(st.st_mode) or not 0 < st.st_size <= min(
                MAX_CHUNK, self.cache.max_file_size):
            return None
        if self.cache.lookup((st.st_dev, st.st_ino), st) is not None:
            return None
        if before:
            return before[0]
        return after[0] if after and self._no_room(st.st_size) else None

    async def take(self, path: bytes, st: os.stat_result
                   ) -> tuple[PeerLink, bytes | memoryview] | None:
        """The file's bytes and the peer they came from, if the area holds this version or
        its batch is on the way (then this waits for it, at most the peer's timeout); None
        otherwise, and the reader fetches it as it would without an order."""
        item = self.items.get(path)
        if item is None:
            return None
        self._reached(item.position)
        same = (item.size, item.st.st_mtime_ns) == (st.st_size, st.st_mtime_ns)
        if item.state == _State.FLYING and same:
            await item.arrived.wait()
        if item.state != _State.HELD or not same:
            if item.state == _State.QUEUED:
                self.stats["left_to_readers"] += 1
            self._forget(item)
            return None
        self._forget(item)
        self.stats["hits"] += 1
        assert item.data is not None
        return item.link, item.data

    def _forget(self, item: _Item) -> None:
        """The item is no longer the area's; a batch in flight releases its own bytes."""
        if self.items.get(item.path) is item:
            del self.items[item.path]
        if item.state == _State.HELD:
            del self._held[item.path]
            self.reserved -= item.size
            self._poke()
        item.state = _State.GONE
        item.arrived.set()  # a reader waiting for its batch stops waiting

    def _reached(self, position: int) -> None:
        """A reader asked for the file at ``position``, held or not: what lies far behind
        it was passed. (A file the kernel still had in its page cache is never asked for.)"""
        if position > self._taken_at:
            self._taken_at = position
            while self._held:
                oldest = next(iter(self._held.values()))
                if oldest.position >= position - LAG:
                    return
                self._drop_unread(oldest)

    def _drop_unread(self, item: _Item) -> None:
        self.stats["dropped_unread"] += 1
        self._forget(item)

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _queue(self, link: PeerLink) -> deque[_Item]:
        """``link``'s queue; a peer's first one starts the task that feeds it."""
        queue = self._queues.get(link)
        if queue is None:
            queue = self._queues[link] = deque()
            if self._nursery is not None:
                self._nursery.start_soon(self._feed, link, queue)
        return queue

    def forget_link(self, link: PeerLink) -> None:
        """The peer left the cluster: its queued files are left to the readers (who rank
        the new nodes) and its requests in flight end; files it already sent stay held."""
        scope = self._feeders.pop(link, None)
        if scope is not None:
            scope.cancel()
        for item in self._queues.pop(link, ()):
            if item.state == _State.QUEUED:
                self._forget(item)

    async def run(self) -> None:
        """Feed every peer's queue until the mount ends."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for link, queue in self._queues.items():
                nursery.start_soon(self._feed, link, queue)
            await trio.sleep_forever()

    async def _feed(self, link: PeerLink, queue: deque[_Item]) -> None:
        if self._queues.get(link) is not queue:  # the peer left before this task started
            return
        with trio.CancelScope() as self._feeders[link]:
            async with trio.open_nursery() as nursery:
                in_flight = trio.Semaphore(self.depth)
                while True:
                    await in_flight.acquire()
                    batch = await self._next_batch(queue)
                    nursery.start_soon(self._fetch, link, batch, in_flight)

    async def _next_batch(self, queue: deque[_Item]) -> list[_Item]:
        """The next files of a peer's queue that make one request, once a full request's
        bytes fit in the area; when it has stayed full for STALE_S, the oldest held files
        make room for one."""
        while True:
            while queue and (queue[0].state != _State.QUEUED
                             or queue[0].position < self._taken_at - LAG):
                item = queue.popleft()
                if item.state == _State.QUEUED:  # the readers passed it before it was asked
                    self._forget(item)
            if not queue:
                await self._changed.wait()
            elif self.reserved + MAX_CHUNK > self.capacity:
                with trio.move_on_after(STALE_S) as waited:
                    await self._changed.wait()
                while waited.cancelled_caught and self._held and (
                        self.reserved + MAX_CHUNK > self.capacity):
                    self._drop_unread(next(iter(self._held.values())))
            else:
                break
        batch: list[_Item] = []
        total = 0
        while queue and GetMany.fits(len(batch) + 1, total + queue[0].size):
            item = queue.popleft()
            if item.state == _State.QUEUED:
                item.state = _State.FLYING
                batch.append(item)
                total += item.size
        self.reserved += total
        return batch

    async def _fetch(self, link: PeerLink, batch: list[_Item], in_flight: trio.Semaphore
                     ) -> None:
        results: list[bytes | memoryview | None] = [None] * len(batch)
        try:
            self.stats["batches"] += 1
            got = await self.peers.read_many(link, [(i.path, i.st) for i in batch])
            if len(got) != len(batch):
                raise AssertionError(f"{len(got)} answers for {len(batch)} files")
            results = got
        except Exception:  # a bug here costs this batch (read as without an order), not more
            log.exception("fetching %d files from peer %s failed", len(batch), link.address)
        finally:
            for item, data in zip(batch, results, strict=True):
                if item.state == _State.FLYING and data is not None:
                    item.state, item.data = _State.HELD, data
                    self._held[item.path] = item
                    self.stats["fetched"] += 1
                else:  # not served, or no longer wanted: its bytes are free again
                    self.reserved -= item.size
                    if item.state == _State.FLYING:
                        self.stats["not_served"] += 1
                        self._forget(item)
                item.arrived.set()
            in_flight.release()
            self._poke()

    def status(self) -> dict[str, Any]:
        return {"capacity_bytes": self.capacity, "reserved_bytes": self.reserved,
                "held": len(self._held), "waiting": len(self.items) - len(self._held),
                **self.stats}
