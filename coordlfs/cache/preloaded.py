"""What the preload library (``coordlfs run``) tells the daemon: its counts and its misses.

A job under ``coordlfs run`` opens cached files and misses itself, without a FUSE request
(coordlfs/preload/preload.c), so the daemon hears of them only through two things in the
cache directory, which is the daemon user's alone (0700) and so reachable only by the
processes the library serves:

- ``preload.counts``: a page of counters (hits, misses, files the cache does not keep,
  opens passed on to the mount, and their bytes) that every served process adds to with
  atomic adds: exact, no system call, nothing lost when a job is killed;
- ``preload.sock``: a socket on which a process names, at its close, each miss the cache
  would keep (its path relative to the source, NUL-terminated): the daemon copies the pages the job
  just read into the cache, as it backfills after a passthrough reader. The job never waits for
  it: a full socket buffer loses a fill, never a read.

Both are made anew by each daemon (a former one's counts are not this mount's).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket
import struct
import termios
from collections.abc import Callable
from dataclasses import dataclass, fields

import trio

from coordlfs.cache.stats import Outcome, ReadCounters

log = logging.getLogger(__name__)

COUNTS = "preload.counts"
NOTICES = "preload.sock"
MAGIC = b"CLFSPRE1"
#: processes connected at once, at most (each a task and a descriptor)
CONNECTIONS = 1024
#: of which other users' processes together, at most
OTHERS = CONNECTIONS // 4
_CHUNK = 65536
#: the counters page's and the socket's modes: the daemon user's, or every user's
#: (``public``: an ``--allow-other`` mount whose other users the library serves)
_MODE = {False: 0o600, True: 0o666}
#: SO_PEERCRED: pid, uid, gid of the process at the other end
_CREDENTIALS = struct.Struct("3i")
_NAME_MAX = 4096


@dataclass(slots=True)
class PreloadCounts:
    """The preload library's counts, in the order of its counters page."""

    #: opens served from a cache entry's file, and their files' bytes
    hits: int = 0
    hit_bytes: int = 0
    #: misses opened on the source by the job, backfilled at their close
    misses: int = 0
    miss_bytes: int = 0
    #: files opened on the source that the cache does not keep (too large, no room)
    uncached: int = 0
    uncached_bytes: int = 0
    #: opens under the mount the library passed on to it (through FUSE)
    passed: int = 0


_COUNTERS = struct.Struct(f"<8s{len(fields(PreloadCounts))}Q")


class CountsPage:
    """The counters page: made empty by the daemon, added to by the served processes
    (``public``: other users' too, on an ``--allow-other`` mount: 0666)."""

    def __init__(self, dir_fd: int, public: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(COUNTS, dir_fd=dir_fd)
        fd = os.open(COUNTS, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dir_fd)
        try:
            os.fchmod(fd, _MODE[public])
            # allocated now: a store into a page tmpfs has no room for would be a SIGBUS
            os.posix_fallocate(fd, 0, mmap.PAGESIZE)
            self._map = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        _COUNTERS.pack_into(self._map, 0, MAGIC, *([0] * len(fields(PreloadCounts))))

    def read(self) -> PreloadCounts:
        return PreloadCounts(*_COUNTERS.unpack_from(self._map, 0)[1:])

    def close(self) -> None:
        self._map.close()


class Notices:
    """The socket the library names its misses on: a stream connection per process, names
    NUL-separated (a datagram socket queues only ten datagrams: a burst of closes lost
    names)."""

    def __init__(self, dir_fd: int, public: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(NOTICES, dir_fd=dir_fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # by the directory's descriptor: a cache directory's path may be longer than a
            # socket address takes
            sock.bind(f"/proc/self/fd/{dir_fd}/{NOTICES}")
            os.chmod(NOTICES, _MODE[public], dir_fd=dir_fd, follow_symlinks=False)
            sock.listen(CONNECTIONS)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        #: the processes connected now
        self._streams: set[trio.SocketStream] = set()
        #: of which other users' (``public``)
        self.others = 0

    async def run(self, fill: Callable[[bytes, bool], None]) -> None:
        """Hand each path named to ``fill`` (for ever), with whether the process naming it
        is the mount owner's (or root's), a task per connected process. Past ``CONNECTIONS``
        at once a new one is closed (its names are lost, not its reads), and other users'
        together hold ``OTHERS`` at most, so that they cannot crowd the owner's out."""
        async with trio.open_nursery() as nursery:
            while True:
                stream = await self.listener.accept()
                _pid, uid, _gid = _CREDENTIALS.unpack(stream.socket.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
                owner = uid in (0, os.geteuid())
                if len(self._streams) >= CONNECTIONS or (not owner and self.others >= OTHERS):
                    await stream.aclose()
                    continue
                self._streams.add(stream)
                self.others += not owner
                nursery.start_soon(self._serve, stream, fill, owner)

    async def _serve(self, stream: trio.SocketStream, fill: Callable[[bytes, bool], None],
                     owner: bool) -> None:
        tail = b""
        try:
            while chunk := await stream.receive_some(_CHUNK):
                *names, tail = (tail + chunk).split(b"\0")
                if len(tail) > _NAME_MAX:
                    return  # no name is that long: not the library
                for name in names:
                    if name and not name.startswith(b"/"):
                        fill(name, owner)
        except trio.BrokenResourceError:
            pass
        finally:
            self._streams.discard(stream)
            self.others -= not owner
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.aclose()

    def unread(self) -> int:
        """The connections whose names the daemon has not read yet: files closed that are
        about to be filled (a benchmark waiting for the cache to settle waits for them too;
        a name is read, and its fill reserved, in one step of the loop)."""
        waiting = 0
        for stream in self._streams:
            with contextlib.suppress(OSError):
                waiting += bool(_unread_bytes(stream.socket.fileno()))
        return waiting

    def close(self) -> None:
        self._sock.close()  # after the loop: trio's own close wants it running


def _unread_bytes(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


class Preloaded:
    """The daemon's side of the preload library for one cache directory."""

    def __init__(self, dir_fd: int, public: bool = False) -> None:
        self.counts = CountsPage(dir_fd, public)
        try:
            self.notices = Notices(dir_fd, public)
        except OSError:
            self.counts.close()
            raise
        self._folded = PreloadCounts()

    def fold(self, reads: ReadCounters) -> None:
        """Bring the mount's counters up to the page: the library's own (``preload_*``), and
        the files it opened (hits, misses) and the bytes it served added to the mount's, so
        that an epoch's totals say how it was served whoever served it."""
        now, last = self.counts.read(), self._folded
        self._folded = now
        from_source = now.miss_bytes + now.uncached_bytes
        reads.preload_hits, reads.preload_misses = now.hits, now.misses
        reads.preload_uncached, reads.preload_passed = now.uncached, now.passed
        reads.preload_bytes_from_cache = now.hit_bytes
        reads.preload_bytes_from_source = from_source
        # its passed opens: counted by the mount
        hit_bytes = now.hit_bytes - last.hit_bytes
        miss_bytes = from_source - last.miss_bytes - last.uncached_bytes
        reads.opened(Outcome.HIT, now.hits - last.hits, hit_bytes)
        reads.opened(Outcome.MISS, now.misses + now.uncached - last.misses - last.uncached,
                     miss_bytes)
        reads.bytes_from_cache += hit_bytes
        reads.bytes_from_source += miss_bytes

    def close(self) -> None:
        self.notices.close()
        self.counts.close()
