"""The cache's room: what the cache's capacity still takes, and what its filesystem does.

The capacity is charged each entry's bytes rounded up to pages, as tmpfs charges them. The
filesystem beneath may have less (other users, a quota): once a write finds it full, each new
file asks ``statfs`` until there is room for all of the capacity left again. Clients read the
room from the published index and send a larger file to the source themselves, so every change
is told (``told``) at once.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable

from coordlfs.sizes import pages

#: the cache's log lines keep one name, whichever of its modules writes them
log = logging.getLogger("coordlfs.cache.cache")

#: errnos that mean the cache's filesystem has no room (a full tmpfs, a quota)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
#: Free room a full cache filesystem keeps beside the pages of a new file: the journal's lines
#: and the filesystem's own. While full, each new file asks (one statfs, next to a miss's
#: storage read).
ROOM_SLACK = 1 << 20


def no_room(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in NO_ROOM


def free_bytes(dir_fd: int) -> int:
    """What the filesystem of ``dir_fd`` has free for this user."""
    st = os.fstatvfs(dir_fd)
    return st.f_bavail * st.f_frsize


class Room:
    """The capacity, what the entries take of it, and whether the filesystem ran out."""

    def __init__(self, capacity: int, directory: str, free: Callable[[], int]) -> None:
        self.capacity = capacity
        self.directory = directory
        #: bytes free in the cache's filesystem (a statfs)
        self.free = free
        #: bytes the entries occupy: their sizes rounded up to pages
        self.used = 0
        #: the entries' own bytes (``used`` less the page rounding)
        self.data_bytes = 0
        #: the cache's filesystem ran out of room: a new entry only where it still has room
        #: for it, until it has room for all the capacity left again
        self.full = False
        #: bytes of files handed over for filling and not reserved yet (``promise``)
        self.promised = 0
        self._no_room_warned = False
        #: told the room for a new file whenever it changes (the published index's, the
        #: request lane's)
        self.told: list[Callable[[int], None]] = []

    def take(self, size: int) -> None:
        self.used += pages(size)
        self.data_bytes += size

    def give_back(self, size: int) -> None:
        self.used -= pages(size)
        self.data_bytes -= size

    def takes(self, size: int) -> bool:
        """Whether the cache's capacity and the filesystem take a new file of ``size``."""
        return self.used + pages(size) <= self.capacity and self.fits(size)

    def fits(self, size: int) -> bool:
        """Whether the cache's filesystem takes a new file of ``size``: always, unless it was
        full; then the room it has is asked for each file, since other users (or a quota) may
        give back any part of it, less than the capacity left (6 MiB of 40, say)."""
        if not self.full:
            return True
        free = self.free()
        return self.room_is_back(free) or pages(size) + ROOM_SLACK <= free

    def note_full(self, error: OSError) -> None:
        if self.full:
            return
        self.full = True
        self.changed()
        message = ("cache directory %s is full (%s): a new file is cached only where it has "
                   "room for it, until it has room for the whole cache again")
        if self._no_room_warned:
            log.info(message, self.directory, error.strerror)
        else:
            log.warning(message, self.directory, error.strerror)
            self._no_room_warned = True

    def check(self) -> None:
        """While full, the room published to clients follows the filesystem's."""
        if self.full and not self.room_is_back(self.free()):
            self.changed()

    def room_is_back(self, free: int) -> bool:
        """The cache is full no more once its filesystem has room for all of the capacity
        left: then no new file needs a check of its own."""
        if free < self.capacity - self.used + ROOM_SLACK:
            return False
        log.info("cache directory %s has room again: caching new files", self.directory)
        self.full = False
        self.changed()
        return True

    def promise(self, size: int) -> None:
        """Count ``size`` more (or, negative, fewer) bytes as promised to files a job handed
        over (``fills.FillQueue.add``) and not reserved yet."""
        self.promised = max(0, self.promised + size)
        self.changed()

    def changed(self) -> None:
        """Tell how large a new file the cache would still take: clients read a larger file from
        the source themselves (through the mount it would only be streamed)."""
        if self.told:
            room = self.available()
            for tell in self.told:
                tell(room)

    def by_capacity(self) -> int:
        """``available`` by the capacity alone: where a filesystem that ran out is asked per
        file (``fits``) when the file comes, not told ahead (the request lane's rule)."""
        return max(0, self.capacity - self.used - self.promised) // pages(1) * pages(1)

    def available(self) -> int:
        """How large a new file the cache would still take. Room promised to files handed over
        for filling is not theirs (the mount's own readers still take what comes first, as
        the cache does). In whole pages, as a file is charged: a client's ``size <= room``
        then says what ``reserve`` will (a file a few bytes under the room went through the
        mount and was not cached)."""
        room = self.capacity - self.used - self.promised
        if self.full:
            room = min(room, self.free() - ROOM_SLACK)
        return max(0, room) // pages(1) * pages(1)
