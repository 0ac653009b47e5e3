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

import mmap
import os
import stat
import threading

from coordlfs.errors import UserError

#: O_DIRECT needs offsets, lengths and buffers aligned to the logical block size; 4 KiB
#: covers every block device we meet.
DIRECT_ALIGN = 4096


_local = threading.local()


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


def _at(path: bytes) -> bytes:
    return path or b"."


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
        self._proc_prefix = b"/proc/self/fd/%d/" % self.root_fd

    def close(self) -> None:
        os.close(self.root_fd)

    def lstat(self, path: bytes) -> os.stat_result:
        return os.stat(_at(path), dir_fd=self.root_fd, follow_symlinks=False)

    def scan(self, path: bytes) -> list[tuple[bytes, os.stat_result]]:
        """Names and attributes of a directory's entries (it may hold many thousands)."""
        fd = os.open(_at(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.root_fd)
        try:
            entries = []
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        entries.append((os.fsencode(entry.name), entry.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue  # removed while we listed it
            return entries
        finally:
            os.close(fd)

    def readlink(self, path: bytes) -> bytes:
        return os.readlink(path, dir_fd=self.root_fd)

    def getxattr(self, path: bytes, name: bytes) -> bytes:
        # xattr calls take no dir_fd; /proc/self/fd/N/... resolves through our root descriptor.
        return os.getxattr(self._proc_prefix + path, name, follow_symlinks=False)

    def listxattr(self, path: bytes) -> list[bytes]:
        names = os.listxattr(self._proc_prefix + path, follow_symlinks=False)
        return [os.fsencode(n) for n in names]

    def statvfs(self) -> os.statvfs_result:
        return os.fstatvfs(self.root_fd)

    def open_reader(self, path: bytes) -> SourceReader:
        """Open a regular file for reading; blocking, so call it from a worker thread."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags | os.O_DIRECT, dir_fd=self.root_fd)
            direct = True
        except OSError as e:
            if e.errno != 22:  # EINVAL: this filesystem has no O_DIRECT
                raise
            fd = os.open(path, flags, dir_fd=self.root_fd)
            direct = False
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise IsADirectoryError(21, "not a regular file")
        return SourceReader(fd, direct)


class SourceReader:
    """One open source file. Its methods block: run them in worker threads."""

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd = fd
        self.direct = direct

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
