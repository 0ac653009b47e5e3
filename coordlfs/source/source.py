"""Read-only access to the dataset directory, always relative to a root descriptor.

The root is opened with O_PATH before the mount exists, so mounting over the source itself
(``coordlfs mount /data /data``) still reaches the real files underneath. Paths handed to
this module are relative byte strings (``b""`` is the root) and are never followed through
symlinks: the FUSE layer shows links as links. No walk enters a coordlfs mount (this one,
should it come to lie beneath the source, or another, whose daemon may wait on this one:
``coordlfs.source.walk``).

Data reads avoid double caching: the cache already holds what we keep, so reading the source
for it must not also fill the source's page cache. We use O_DIRECT where the filesystem allows
it and otherwise drop the pages we read with posix_fadvise(DONTNEED). A file the cache does not
keep is read through the page cache and its pages left there (``keep_pages``): the kernel's LRU
then serves it again from whatever memory the cache leaves, as it would without coordlfs.
``SourceReader`` is the one
reader of the source's bytes: the daemon's fills and streamed reads and ``coordlfs.client``'s
direct reads (of misses the cache has no room for) all go through it, so this module and what
it imports are standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import operator
import os
import stat
import threading
from collections.abc import Callable, Container, Iterator
from typing import Any, NamedTuple

from coordlfs.errors import UserError
from coordlfs.source.walk import DIRECTORY, open_outside
from coordlfs.system.mounts import coordlfs_devices
from coordlfs.system.pagecache import resident

#: O_DIRECT needs offsets, lengths and buffers aligned to the logical block size; 4 KiB
#: covers every block device we meet.
DIRECT_ALIGN = 4096
#: The most one read of ``SourceReader.read_whole`` asks for (a thread's buffer grows to it).
READ_CHUNK = 1 << 20


#: Paths at least this long are walked a piece at a time (``Source.open``): a path
#: handed to one system call must be shorter than PATH_MAX (4096), but a dataset may nest
#: deeper, and through the mount the kernel never sends whole paths.
_WALK_AT = 3840
#: what ``lstat``, ``readlink`` and the xattr calls open: the file itself, a link as a link
_ITSELF = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
#: what ``SourceReader.opening`` opens a file with, O_DIRECT aside
_READING = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW | os.O_CLOEXEC
_READING_DIRECT = _READING | os.O_DIRECT

_local = threading.local()


class Version(NamedTuple):
    """What identifies one version of a source file. A rewrite in place changes the ctime
    even when the writer puts size and mtime back, and a replacement by rename changes the
    inode, so no change can pass as none (size and mtime alone miss both)."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Version:
        # the fields taken in C, past the generated ``__new__`` (a version is taken per open
        # and per fill): 0.27 us against 0.36
        return tuple.__new__(cls, _version_of(st))


#: a ``Version``'s fields of a stat result, as a plain tuple
_version_of = operator.attrgetter("st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")


def _aligned_buffer(size: int) -> memoryview:
    """This thread's page-aligned buffer for O_DIRECT, grown on demand.

    Mapping and unmapping a buffer per read costs more CPU than the read itself in a
    multi-threaded daemon (page faults, TLB shootdowns), so each thread keeps one, of
    ``READ_CHUNK`` from the start (a page is touched only when a read fills it); reads are at
    most a fill chunk or ``READ_CHUNK``, which bounds it. A buffer outgrown is only let go: a
    view of it handed out may still be held, and its mapping goes with the last view.

    Private: Python maps ``-1`` shared by default, which is tmpfs memory (``shmem``), not
    the daemon's anonymous memory its status counts (``coordlfs.daemon.memory``): four
    readers' fills held 4 MiB that no figure had, and a mount sized by those figures was
    killed for memory.
    """
    buf = getattr(_local, "buffer", None)
    if buf is None or len(buf) < size:
        buf = _local.buffer = memoryview(mmap.mmap(-1, max(size, READ_CHUNK),
                                                   flags=mmap.MAP_PRIVATE))
    return buf


def fd_path(fd: int) -> bytes:
    """A path for the calls that take no descriptor (xattrs, inotify): what ``fd`` refers
    to, through /proc, followed there (to a link itself when ``fd`` is of a link)."""
    return b"/proc/self/fd/%d" % fd


class Source:
    """The dataset directory, opened once."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        #: the devices no walk enters: the coordlfs mounts, this one's among them
        self.barred: Container[int] = coordlfs_devices
        try:
            self.root_fd = os.open(self.path, os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            raise UserError(f"source {path} does not exist") from None
        except NotADirectoryError:
            raise UserError(f"source {path} is not a directory") from None
        except OSError as e:
            raise UserError(f"cannot open source {path}: {e.strerror}") from None

    def close(self) -> None:
        os.close(self.root_fd)

    def open(self, path: bytes, flags: int) -> int:
        """A descriptor of ``path`` opened with ``flags``, never through a symlink and never
        into a coordlfs mount (``coordlfs.source.walk``: ELOOP there).

        Short paths (nearly all, and the hot ones: lookup, getattr, open) go straight from
        the root descriptor. A longer one is walked a piece of at most ``_WALK_AT`` bytes at
        a time, so a tree nested past PATH_MAX reads as it does in the source.
        """
        barred = self.barred
        if len(path) < _WALK_AT:
            return open_outside(self.root_fd, path or b".", flags, barred)
        opened: list[int] = []
        try:
            fd, rest = self.root_fd, path
            while len(rest) >= _WALK_AT:
                cut = rest.rfind(b"/", 0, _WALK_AT)
                if cut <= 0:
                    raise OSError(errno.ENAMETOOLONG, "file name too long")
                fd = open_outside(fd, rest[:cut], DIRECTORY, barred)
                opened.append(fd)
                rest = rest[cut + 1 :]
            return open_outside(fd, rest, flags, barred)
        finally:
            for fd in opened:
                os.close(fd)

    @contextlib.contextmanager
    def itself(self, path: bytes) -> Iterator[int]:
        """An O_PATH descriptor of ``path`` (a link as the link), closed after."""
        fd = self.open(path, _ITSELF)
        try:
            yield fd
        finally:
            os.close(fd)

    def lstat(self, path: bytes) -> os.stat_result:
        fd = self.open(path, _ITSELF)  # inline, not ``itself``: every lookup and open asks
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def open_dir(self, path: bytes) -> int:
        """A descriptor of a directory, for ``coordlfs.fs.listing`` to read a buffer at a time."""
        return self.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def readlink(self, path: bytes) -> bytes:
        with self.itself(path) as fd:
            try:
                return os.readlink(b"", dir_fd=fd)
            except FileNotFoundError:  # what readlinkat(fd, "") says of a file not a link
                raise OSError(errno.EINVAL, "not a symbolic link") from None

    def getxattr(self, path: bytes, name: bytes) -> bytes:
        with self.itself(path) as fd:
            return os.getxattr(fd_path(fd), name)

    def listxattr(self, path: bytes) -> list[bytes]:
        with self.itself(path) as fd:
            return [os.fsencode(n) for n in os.listxattr(fd_path(fd))]

    def statvfs(self) -> os.statvfs_result:
        return os.fstatvfs(self.root_fd)

    def open_file(self, path: bytes) -> int:
        """A descriptor of ``path`` for reading through the page cache, as any reader of the
        source would: a backing file the kernel reads itself (FUSE passthrough), or a fill
        copying the pages such a read brings in. The caller checks what it opened."""
        return self.open(path, _READING)

    def open_reader(self, path: bytes, keep_pages: bool = False) -> SourceReader:
        """Open a regular file for reading; blocking, so call it from a worker thread.
        ``keep_pages``: the cache does not keep it, so its pages stay with the kernel."""
        reader = SourceReader.opening(self.open, path, keep_pages=keep_pages)
        if not stat.S_ISREG(reader.fstat().st_mode):
            reader.close()
            raise IsADirectoryError(21, "not a regular file")
        return reader


class SourceReader:
    """One open source file: the one reader of the source, for the daemon (its fills read
    ``read_view`` chunks into the cache, a reader of the mount may wait on the first ones;
    its streamed reads ``pread``) and for ``coordlfs.client`` (a miss the cache has no room
    for, read whole: ``read_whole``).

    A file the cache keeps is read without filling the page cache (its bytes will be in the
    cache: a second copy would only push other files out): opened with O_DIRECT where the
    filesystem allows it, read through this thread's aligned buffer; where the filesystem
    refuses O_DIRECT, at the open or at a read (EINVAL: its alignment is not ours), read
    buffered and the pages read dropped. So is a chunk whose pages the page cache holds
    already (another process read the file: a client's direct read of a file the mount
    fills after, a job reading the source beside the mount): the copy comes from them,
    storage is not read twice, and the pages go once the cache has the bytes. A file the
    cache does not keep (``keep_pages``) is read buffered and its pages left to the kernel's
    LRU, the only copy there will be. Standard library only, and its methods block: the
    daemon runs them in worker threads.
    """

    __slots__ = ("direct", "drop", "fd", "paged")

    def __init__(self, fd: int, direct: bool, drop: bool = True) -> None:
        self.fd = fd
        self.direct = direct
        #: pages read buffered are dropped after (the cache keeps the file)
        self.drop = drop
        #: bytes read from pages the page cache held already (``_from_pages``), not storage
        self.paged = 0

    @classmethod
    def opening(cls, open_fd: Callable[..., int], *args: Any,
                keep_pages: bool = False) -> SourceReader:
        """A reader of the descriptor ``open_fd(*args, flags)`` returns (``open_beneath``,
        ``Source.open``); ``keep_pages`` for a file the cache does not keep. O_NONBLOCK so
        that a FIFO in the source does not block the open (``fstat`` then says what it is,
        and nobody reads it); for a regular file it changes nothing."""
        if keep_pages:
            return cls(open_fd(*args, _READING), False, drop=False)
        try:
            return cls(open_fd(*args, _READING_DIRECT), True)
        except OSError as e:
            if e.errno != errno.EINVAL:  # this filesystem has no O_DIRECT
                raise
        return cls(open_fd(*args, _READING), False)

    def fstat(self) -> os.stat_result:
        return os.fstat(self.fd)

    def pread(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (left in the page cache only with ``keep_pages``)."""
        return bytes(self.read_view(offset, size))

    def read_view(self, offset: int, size: int) -> memoryview | bytes:
        """Like ``pread``, but may return a view of this thread's buffer, valid until the
        thread's next read: saves a copy when the bytes go straight on (into the cache)."""
        data = self._read(offset, size)
        if self.drop and not self.direct:
            os.posix_fadvise(self.fd, offset, len(data), os.POSIX_FADV_DONTNEED)
        return data

    def read_whole(self, st: os.stat_result) -> bytes | None:
        """The whole file, ``st`` being its ``fstat`` before; None if it changed meanwhile
        (another version after, or not ``st.st_size`` bytes), for the caller to retry or
        send elsewhere. Pieces of up to ``READ_CHUNK``, each asking a page past the size
        expected, so that EOF shows as a short read with no call more."""
        size = st.st_size
        pieces: list[bytes] = []
        offset = 0
        while True:
            want = min(READ_CHUNK, size - offset + 1)
            piece = self._read(offset, want)
            pieces.append(bytes(piece))
            offset += len(piece)
            if len(piece) < want:
                break
        if self.drop and not self.direct:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if offset != size or _version_of(os.fstat(self.fd)) != _version_of(st):
            return None
        return b"".join(pieces)

    def _read(self, offset: int, size: int) -> memoryview | bytes:
        """Up to ``size`` bytes at ``offset``: O_DIRECT reads the aligned blocks around them
        into this thread's buffer (a view of it is returned); a read O_DIRECT refuses
        (EINVAL) turns the descriptor buffered for good and is read again."""
        if self.direct and resident(self.fd, offset, size):
            return self._from_pages(offset, size)
        while self.direct:
            skip = offset % DIRECT_ALIGN
            length = -(-(skip + size) // DIRECT_ALIGN) * DIRECT_ALIGN
            buf = _aligned_buffer(length)
            try:
                got = os.preadv(self.fd, [buf[:length]], offset - skip)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._buffered()
                continue
            return buf[skip : min(got, skip + size)] if got > skip else b""
        return os.pread(self.fd, size, offset)

    def _buffered(self) -> None:
        """Read through the page cache from now on (its pages still dropped after a read)."""
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False

    def _from_pages(self, offset: int, size: int) -> bytes:
        """A chunk the page cache holds, read from it (O_DIRECT would read storage again),
        then dropped (the cache has the bytes): counted in ``paged``."""
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        try:
            data = os.pread(self.fd, size, offset)
        finally:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags)
        os.posix_fadvise(self.fd, offset, len(data), os.POSIX_FADV_DONTNEED)
        self.paged += len(data)
        return data

    def close(self) -> None:
        os.close(self.fd)
