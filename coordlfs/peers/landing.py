"""Where a peer's file lands on the asking node: a file of its own, for the kernel to read.

A file a peer sent (its frame's checksum already checked: ``peer_wire``) is written into an
unnamed file (``O_TMPFILE``) in the cache's directory of entries, on the cache's tmpfs, and the
open that asked for it is answered with that file as its backing (FUSE passthrough,
``coordlfs.fs.backing``): the reader then reads it at the kernel's speed, and no READ of it
reaches the daemon (two requests of the four a peer's file cost, and most of the asking
daemon's CPU for it). The file has no name, so nothing is left behind by a daemon that dies,
and it is not a cache entry: the file is the peer's to cache (``coordlfs.peers.placement``),
and it goes when the last open it backs is released (the kernel keeps it until then).

Its pages are memory of the node's beside the cache (charged, like the cache's own files, to
the daemon's memory cgroup), for as long as the file is open: a reader's open files at most.
``Landings`` counts them for the status.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from coordlfs.cache.cache import write_all
from coordlfs.peers.wire import Buffer


@dataclass(slots=True)
class Landings:
    """The peers' files landed on this node: now (open) and in all."""

    files: int = 0
    bytes: int = 0
    open_files: int = 0
    open_bytes: int = 0
    #: files that could not land (the cache's filesystem full, say): served from memory
    failed: int = 0

    def land(self, directory_fd: int, data: Buffer) -> int:
        """A new unnamed file in ``directory_fd`` holding ``data``, open for reading (and
        writing: ``O_TMPFILE`` takes no read-only open); the caller closes it, and says so
        (``closed``). OSError if the filesystem cannot take it."""
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600,
                         dir_fd=directory_fd)
        except OSError:
            self.failed += 1
            raise
        try:
            write_all(fd, data, 0)
        except BaseException:
            os.close(fd)
            self.failed += 1
            raise
        self.files += 1
        self.bytes += len(data)
        self.open_files += 1
        self.open_bytes += len(data)
        return fd

    def closed(self, size: int) -> None:
        """A landed file of ``size`` bytes was closed by its reader."""
        self.open_files -= 1
        self.open_bytes -= size

    def status(self) -> dict[str, int]:
        return asdict(self)
