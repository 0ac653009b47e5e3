"""The entries' files, ``files/<number>``, and the one copy that writes them.

A file per entry, not a slice of a shared one: FUSE passthrough takes a whole file as its
backing, a client maps one file per entry, and a dropped entry's memory returns once its last
reader closes. Its name is the entry's number (``Entry.offset``, never reused), so a name never
shows another file's bytes.

Every fill writes its entry's file through ``Copier``, whichever way in it came: a reader's
miss or a peer's request a chunk per hand-off to a worker thread, the batched fills and the
backfills a whole file per thread call. Only where the bytes come from differs:
storage read ``O_DIRECT`` (``FromStorage``), or the page cache a reader's reads filled
(``FromPages``, by ``sendfile``, its pages dropped after). The one exception is a file the
request lane's opens read: the lane's copier makes that copy in C (an unnamed file here), and
the daemon only names it (``link_file``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, TypeVar

from coordlfs.cache.entries import Entry
from coordlfs.source.source import Source, SourceReader

#: the cache's log lines keep one name, whichever of its modules writes them
log = logging.getLogger("coordlfs.cache.cache")

_T = TypeVar("_T")

#: Bytes read from the source per worker-thread call while filling an entry: large enough
#: that thread hand-offs cost nothing next to the copy, small enough to bound the per-thread
#: O_DIRECT buffers and to let a reader of a big file start early.
FILL_CHUNK = 1 << 20
#: Complete entries the daemon keeps mapped for its own reads (``data``, without passthrough):
#: a hit is then a slice of a mapping, no system call and no copy in the daemon (a pread of
#: the file cost a 112 KB hit 30% of the ceiling's files/s). Least recently read unmapped.
MAPPED_FILES = 16384
def file_name(number: int) -> str:
    """The name of entry ``number``'s file in ``FILES``."""
    return f"{number:x}"


def _named(files_fd: int, number: int, make: Callable[[str], _T]) -> _T:
    """``make(name)`` of entry ``number``'s file, exclusively: a leftover of the name (a
    crash's, before its journal line) is removed first."""
    name = file_name(number)
    try:
        return make(name)
    except FileExistsError:
        os.unlink(name, dir_fd=files_fd)
        return make(name)


def create_file(files_fd: int, number: int) -> int:
    """A new entry's file, for writing: 0600, exclusive, never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return _named(files_fd, number, lambda name: os.open(name, flags, 0o600, dir_fd=files_fd))


def link_file(files_fd: int, number: int, fd: int) -> None:
    """Name ``fd``, an unnamed file in the entries' directory (``O_TMPFILE``, 0600: the
    request lane's copies), as entry ``number``'s file, exclusively."""
    _named(files_fd, number, lambda name: os.link(f"/proc/self/fd/{fd}", name,
                                                  dst_dir_fd=files_fd, follow_symlinks=True))


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite all of ``data``. A short write is continued, so a filesystem that runs out of
    room raises ENOSPC rather than leaving a hole that reads back as zeros."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "the cache's filesystem took no bytes")
        view, offset = view[written:], offset + written


# -- the copy ------------------------------------------------------------------------------


class Origin(Protocol):
    """Where a copy's bytes come from: opened on the copy's first step (in its thread)."""

    #: most bytes one step copies
    chunk: int

    def open(self) -> None: ...
    def copy(self, out: int, offset: int, count: int) -> int: ...
    def fstat(self) -> os.stat_result: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


class FromStorage:
    """Storage read ``O_DIRECT`` in chunks (``SourceReader``): no page of it kept twice."""

    chunk = FILL_CHUNK

    def __init__(self, source: Source | None, path: bytes,
                 reader: SourceReader | None = None) -> None:
        self.source, self.path, self.reader = source, path, reader
        #: bytes the page cache held already (``SourceReader.paged``), once closed
        self.paged = 0

    def open(self) -> None:
        if self.reader is None:
            assert self.source is not None
            self.reader = self.source.open_reader(self.path)

    def copy(self, out: int, offset: int, count: int) -> int:
        assert self.reader is not None
        data = self.reader.read_view(offset, count)
        write_all(out, data, offset)
        return len(data)

    def fstat(self) -> os.stat_result:
        assert self.reader is not None
        return self.reader.fstat()

    def finish(self) -> None:
        pass

    def close(self) -> None:
        if self.reader is not None:
            self.paged += self.reader.paged
            self.reader.close()
            self.reader = None


class FromPages:
    """The page cache a reader's reads filled, copied by the kernel (``sendfile``: what was
    not read is read now) and dropped once copied (the cache has the bytes). ``fd``: the
    reader's descriptor if it was kept (else -1: opened again)."""

    chunk = sys.maxsize  # the rest of the file per call: the kernel splits it

    def __init__(self, source: Source, path: bytes, fd: int = -1) -> None:
        self.source, self.path, self.fd = source, path, fd

    def open(self) -> None:
        if self.fd < 0:
            self.fd = self.source.open_file(self.path)
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")

    def copy(self, out: int, offset: int, count: int) -> int:
        return os.sendfile(out, self.fd, offset, count)

    def fstat(self) -> os.stat_result:
        return os.fstat(self.fd)

    def finish(self) -> None:
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class Copier:
    """Copies a source file into a filling entry's file: a step per worker-thread call, or
    the whole file in one (``copy``).

    Opening the source and the entry's file, the last chunk, the final fstat and the closes
    share a step, so a small file (the common case) costs one thread hand-off rather than
    three, and the event loop's thread makes no system call for it (each would wait for the
    GIL behind the fill threads'). ``final`` is the source's fstat once every byte is in.
    """

    def __init__(self, files_fd: int, entry: Entry, origin: Origin) -> None:
        self.files_fd = files_fd
        self.entry = entry
        self.origin = origin
        self.out = -1
        self.final: os.stat_result | None = None

    def step(self, offset: int) -> int:
        """Copy the chunk at ``offset``; returns its length (0: the source ended early)."""
        if self.out < 0:
            self.origin.open()
            self.out = create_file(self.files_fd, self.entry.offset)
        count = min(self.origin.chunk, self.entry.size - offset)
        got = self.origin.copy(self.out, offset, count) if count > 0 else 0
        if offset + got >= self.entry.size:
            self.final = self.origin.fstat()
            self.origin.finish()
            self.close()
        return got

    def copy(self, between: Callable[[int], None] | None = None) -> None:
        """The whole file, in this thread; ``between(done)`` before each chunk after the
        first (a large file's readers told, an unmount noticed). Raises what stopped it."""
        done = 0
        while True:
            got = self.step(done)
            done += got
            if done >= self.entry.size:
                return
            if got == 0:
                raise OSError(errno.EIO, "source file shrank while being cached")
            if between is not None:
                between(done)

    def close(self) -> None:
        self.origin.close()
        if self.out >= 0:
            fd, self.out = self.out, -1
            os.close(fd)


# -- the files ----------------------------------------------------------------------------


def _unmap(mapped: mmap.mmap) -> None:
    """Unmap now, or, while a slice of it is still referenced (a peer's reply being sent),
    when the last one is freed."""
    with contextlib.suppress(BufferError):
        mapped.close()


class EntryFiles:
    """The directory of the entries' files, and the complete ones the daemon keeps mapped
    for its own reads (least recently read first)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._mapped: OrderedDict[int, mmap.mmap] = OrderedDict()

    def mapped(self) -> int:
        """How many entries are mapped now (each costs the daemon memory: ``daemon.memory``)."""
        return len(self._mapped)

    def open(self, entry: Entry) -> int:
        """A new read-only descriptor of the entry's file (the caller closes it): for the
        daemon's own reads, and a passthrough open's backing."""
        return os.open(file_name(entry.offset), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=self.fd)

    def data(self, entry: Entry, offset: int, size: int) -> memoryview | bytes:
        """Bytes of an entry, which must have arrived: a slice of its file's mapping once it
        is complete (pyfuse3 hands it to the kernel, which copies it once into the reply),
        else a pread of the file being filled."""
        size = min(size, entry.size - offset)
        if size <= 0:
            return b""
        if not entry.complete:
            fd = self.open(entry)
            try:
                data = os.pread(fd, size, offset)
            finally:
                os.close(fd)
            if len(data) != size:  # the file is ours alone: only a fault makes it short
                raise OSError(errno.EIO, f"cache file of {os.fsdecode(entry.path)} is short")
            return data
        mapped = self._mapped.get(entry.offset)
        if mapped is None:
            fd = self.open(entry)
            try:  # its size is the entry's: complete files never change
                mapped = mmap.mmap(fd, entry.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                   prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._mapped[entry.offset] = mapped
            if len(self._mapped) > MAPPED_FILES:
                _unmap(self._mapped.popitem(last=False)[1])
        else:
            self._mapped.move_to_end(entry.offset)
        return memoryview(mapped)[offset : offset + size]

    def remove(self, entry: Entry) -> None:
        """Unmap and unlink a dropped entry's file: readers that opened it keep its bytes."""
        mapped = self._mapped.pop(entry.offset, None)
        if mapped is not None:
            _unmap(mapped)
        self.unlink(entry.offset, entry.path)

    def unlink(self, number: int, path: bytes) -> None:
        """Unlink entry ``number``'s file (a copy of source file ``path``, for the log)."""
        try:
            os.unlink(file_name(number), dir_fd=self.fd)
        except FileNotFoundError:
            pass  # a fill that failed before its first byte
        except OSError as e:
            log.warning("cannot remove the cache file of %s: %s", os.fsdecode(path), e)

    def close(self) -> None:
        while self._mapped:
            _unmap(self._mapped.popitem()[1])
        os.close(self.fd)
