"""Read-only access to the dataset directory, always relative to a root descriptor.

The root is opened with O_PATH before the mount exists, so mounting over the source itself
(``coordlfs mount /data /data``) still reaches the real files underneath. Paths handed to
this module are relative byte strings (``b""`` is the root) and are never followed through
symlinks: the FUSE layer shows links as links.

Data reads avoid double caching: the cache already holds what we keep, so reading the source
must not also fill the source's page cache. We use O_DIRECT where the filesystem allows it
and otherwise drop the pages we read with posix_fadvise(DONTNEED).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from coordlfs.errors import UserError

#: O_DIRECT needs offsets, lengths and buffers aligned to the logical block size; 4 KiB
#: covers every block device we meet.
DIRECT_ALIGN = 4096


#: Paths at least this long are walked a piece at a time (``Source.at``): a path
#: handed to one system call must be shorter than PATH_MAX (4096), but a dataset may nest
#: deeper, and through the mount the kernel never sends whole paths.
_WALK_AT = 3840
_WALK_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_local = threading.local()
T = TypeVar("T")


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
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _aligned_buffer(size: int) -> mmap.mmap:
    """This thread's page-aligned buffer for O_DIRECT, grown on demand.

    Mapping and unmapping a buffer per read costs more CPU than the read itself in a
    multi-threaded daemon (page faults, TLB shootdowns), so each worker thread keeps one;
    reads are at most a fill chunk, which bounds the buffer.
    """
    buf = getattr(_local, "buffer", None)
    if buf is None or len(buf) < size:
        if buf is not None:
            buf.close()
        buf = _local.buffer = mmap.mmap(-1, max(size, 256 << 10))
    return buf


def proc_path(dir_fd: int, name: bytes) -> bytes:
    """A path for the calls that take no dir_fd (xattrs, inotify): ``name`` in ``dir_fd``
    through /proc; like ``name`` relative to ``dir_fd``, it must not be followed at its end."""
    return b"/proc/self/fd/%d/%s" % (dir_fd, name)


class Source:
    """The dataset directory, opened once."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
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

    def at(self, path: bytes, call: Callable[[int, bytes], T]) -> T:
        """``call(dir_fd, name)`` with a directory descriptor and a name in it that reach
        ``path``, never through a symlink at the end of ``name``.

        Short paths (nearly all, and the hot ones: lookup, getattr, open) go straight to the
        root descriptor. A longer one is walked a piece of at most ``_WALK_AT`` bytes at a
        time with ``openat``, so a tree nested past PATH_MAX reads as it does in the source.
        """
        if len(path) < _WALK_AT:
            return call(self.root_fd, path or b".")
        opened: list[int] = []
        try:
            fd, rest = self.root_fd, path
            while len(rest) >= _WALK_AT:
                cut = rest.rfind(b"/", 0, _WALK_AT)
                if cut <= 0:
                    raise OSError(errno.ENAMETOOLONG, "file name too long")
                fd = os.open(rest[:cut], _WALK_FLAGS, dir_fd=fd)
                opened.append(fd)
                rest = rest[cut + 1 :]
            return call(fd, rest)
        finally:
            for fd in opened:
                os.close(fd)

    def lstat(self, path: bytes) -> os.stat_result:
        if len(path) < _WALK_AT:  # ``at``'s short path, inline: every lookup and open asks
            return os.stat(path or b".", dir_fd=self.root_fd, follow_symlinks=False)
        return self.at(path, lambda dir_fd, name: os.stat(name, dir_fd=dir_fd,
                                                          follow_symlinks=False))

    def open_dir(self, path: bytes) -> int:
        """A descriptor of a directory, for ``coordlfs.listing`` to read a buffer at a time."""
        return self.at(path, lambda dir_fd, name: os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd))

    def readlink(self, path: bytes) -> bytes:
        return self.at(path, lambda dir_fd, name: os.readlink(name, dir_fd=dir_fd))

    def getxattr(self, path: bytes, name: bytes) -> bytes:
        return self.at(path, lambda dir_fd, at: os.getxattr(proc_path(dir_fd, at), name,
                                                            follow_symlinks=False))

    def listxattr(self, path: bytes) -> list[bytes]:
        names = self.at(path, lambda dir_fd, at: os.listxattr(proc_path(dir_fd, at),
                                                              follow_symlinks=False))
        return [os.fsencode(n) for n in names]

    def statvfs(self) -> os.statvfs_result:
        return os.fstatvfs(self.root_fd)

    def open_reader(self, path: bytes) -> SourceReader:
        """Open a regular file for reading; blocking, so call it from a worker thread."""
        reader = self.at(path, lambda dir_fd, name: SourceReader.opening(
            lambda flags: os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)))
        if not stat.S_ISREG(reader.fstat().st_mode):
            reader.close()
            raise IsADirectoryError(21, "not a regular file")
        return reader


class SourceReader:
    """One open source file. Its methods block: run them in worker threads."""

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd = fd
        self.direct = direct

    @classmethod
    def opening(cls, open_fd: Callable[[int], int]) -> SourceReader:
        """A reader of the descriptor ``open_fd(flags)`` returns, opened with O_DIRECT where
        the filesystem allows it (else ``read_view`` drops the pages it read)."""
        try:
            return cls(open_fd(os.O_RDONLY | os.O_DIRECT), True)
        except OSError as e:
            if e.errno != errno.EINVAL:  # this filesystem has no O_DIRECT
                raise
        return cls(open_fd(os.O_RDONLY), False)

    def fstat(self) -> os.stat_result:
        return os.fstat(self.fd)

    def pread(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset``, without leaving them in the page cache."""
        return bytes(self.read_view(offset, size))

    def read_view(self, offset: int, size: int) -> memoryview | bytes:
        """Like ``pread``, but may return a view of this thread's buffer, valid until the
        thread's next read: saves a copy when the bytes go straight on (into the cache)."""
        if not self.direct:
            data = os.pread(self.fd, size, offset)
            os.posix_fadvise(self.fd, offset, len(data), os.POSIX_FADV_DONTNEED)
            return data
        start = offset - offset % DIRECT_ALIGN
        end = -(-(offset + size) // DIRECT_ALIGN) * DIRECT_ALIGN
        buf = _aligned_buffer(end - start)
        got = os.preadv(self.fd, [memoryview(buf)[: end - start]], start)
        skip = offset - start
        return memoryview(buf)[skip : max(skip, min(got, skip + size))]

    def close(self) -> None:
        os.close(self.fd)
