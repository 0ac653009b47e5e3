"""What a read by a member of an aligned group does beyond a plain read.

Kept out of ``fs.Operations`` so that it stays a thin map of FUSE requests: ``opened`` attributes
the opening process to a member, moves the group's lead (waking the read-ahead) and takes the
file from the read window if a member fetched it; ``whole`` fetches a small file once for the
group; ``closed`` counts a member that read the file from the kernel's pages. See
``coordlfs.groups`` and ``coordlfs.window`` for why.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from coordlfs.groups import Groups, Member
from coordlfs.inodes import Key
from coordlfs.prefetch import Prefetcher
from coordlfs.source import Version
from coordlfs.window import ReadWindow


class AlignedReads:
    def __init__(self, groups: Groups, window: ReadWindow, prefetcher: Prefetcher) -> None:
        self.groups = groups
        self.window = window
        self.prefetcher = prefetcher

    def opened(self, pid: int, path: bytes, key: Key, version: Version,
               cached: bool) -> tuple[Member | None, bytes | None]:
        """The member behind a reader (if the file is not in MinIO) and the bytes the group's
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
