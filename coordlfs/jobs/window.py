"""The group read window: items one aligned job fetched, held until its group has read them.

The cache keeps a fixed part of the dataset; the rest is read from storage every epoch. Jobs of a
seed-aligned group read that rest in the same order, so an item the leading job fetched is
about to be read by every other member. The window holds it (bytes in the daemon's memory, at
most ``capacity`` bytes in all) until each member that was in the group when it arrived has
opened it, then lets it go. When room is needed the oldest item goes first, so a member far
behind the others costs storage reads, never memory beyond the bound. A member that leaves or
dies is struck from every item's list, so it pins nothing.

Several members asking for the same item at once share one storage read: the first fetches,
the others wait for it (``claim`` and ``publish``). Members of one group read through one
kernel inode, so a member may be served from the kernel's pages (filled by another member's
read) and never ask the daemon for the bytes; closing the file then counts as having read it
(``closed``). The readers of an item pushed out unread are remembered too, so that when a
slower member fetches it again it is not held for members that already read it, which would
push out the items the slow member needs next.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import trio

from coordlfs.cache.compact import Key
from coordlfs.source.source import Version  # a held item of another version is never served

#: Items remembered as read by members while not held (see ``closed``).
MAX_NOTED = 1 << 16


@dataclass(slots=True, eq=False)
class Held:
    version: Version
    data: bytes
    #: member ids that have not read it yet
    waiting: set[int]
    #: member ids that have (the fetcher included)
    readers: set[int]


class ReadWindow:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.items: OrderedDict[Key, Held] = OrderedDict()
        #: items being fetched for a member, that other members wait for instead of fetching
        self._fetching: dict[Key, trio.Event] = {}
        self._seen: OrderedDict[Key, set[int]] = OrderedDict()
        self.hits = 0
        self.bytes_served = 0
        self.dropped_unread = 0

    def take(self, key: Key, version: Version, member: int) -> bytes | None:
        """The item's bytes if held at this version; ``member`` has then read it."""
        held = self.items.get(key)
        if held is None:
            return None
        if held.version != version:
            self._drop(key)
            return None
        held.waiting.discard(member)
        held.readers.add(member)
        if not held.waiting:
            self._drop(key)
        self.hits += 1
        self.bytes_served += len(held.data)
        return held.data

    def closed(self, key: Key, member: int) -> None:
        """``member`` read the item without the daemon's help (from the kernel's pages)."""
        held = self.items.get(key)
        if held is None:
            self._note(key, {member})
            return
        held.waiting.discard(member)
        held.readers.add(member)
        if not held.waiting:
            self._drop(key)

    def fetching(self, key: Key) -> bool:
        return key in self._fetching

    async def wait_for_fetch(self, key: Key) -> None:
        """Wait while another member is fetching this item."""
        event = self._fetching.get(key)
        if event is not None:
            await event.wait()

    def claim(self, key: Key) -> None:
        """This member fetches the item; others wait for ``publish``."""
        self._fetching.setdefault(key, trio.Event())

    def publish(self, key: Key, version: Version, data: bytes | None, fetcher: int,
                waiting: set[int]) -> None:
        """The fetch of a claimed item ended: hold ``data`` (None: it failed) for ``waiting``."""
        event = self._fetching.pop(key, None)
        waiting = waiting - self._seen.pop(key, set())
        if data is not None and waiting and len(data) <= self.capacity:
            self._drop(key)
            while self.used + len(data) > self.capacity:
                oldest = next(iter(self.items))
                self._note(oldest, self.items[oldest].readers)
                self.dropped_unread += 1
                self._drop(oldest)
            self.items[key] = Held(version, data, set(waiting), {fetcher})
            self.used += len(data)
        if event is not None:
            event.set()

    def forget_member(self, member: int) -> None:
        for key in [k for k, held in self.items.items() if member in held.waiting]:
            held = self.items[key]
            held.waiting.discard(member)
            if not held.waiting:
                self._drop(key)

    def status(self) -> dict[str, int]:
        return {"capacity_bytes": self.capacity, "used_bytes": self.used,
                "items": len(self.items), "hits": self.hits,
                "bytes_served": self.bytes_served, "dropped_unread": self.dropped_unread}

    def _note(self, key: Key, readers: set[int]) -> None:
        self._seen.setdefault(key, set()).update(readers)
        self._seen.move_to_end(key)
        if len(self._seen) > MAX_NOTED:
            self._seen.popitem(last=False)

    def _drop(self, key: Key) -> None:
        held = self.items.pop(key, None)
        if held is not None:
            self.used -= len(held.data)
