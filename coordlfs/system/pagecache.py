"""What the kernel's page cache holds of a file.

A file the cache does not keep, read by the kernel itself by FUSE passthrough, brings its
pages in as any plain read does, and they stay there for the kernel's LRU (memory beside the
cache serves misses as the page cache would). At the last release of such a file its pages
are counted: the kernel does not tell a FUSE daemon what a passthrough open read, and the
pages it holds of the file are the best measure left (those reclaimed meanwhile are missed,
those another reader had brought in are counted). ``cachestat(2)`` (Linux 6.5) counts them
without mapping the file.
"""

from __future__ import annotations

import ctypes
import os

#: cachestat's number: one for every architecture (the unified table, from 424 on).
_CACHESTAT = 451
_libc = ctypes.CDLL(None, use_errno=True)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_PAGE = os.sysconf("SC_PAGE_SIZE")


def cached_bytes(fd: int, offset: int = 0, length: int = 0) -> int | None:
    """Bytes of the file at ``fd`` in the page cache, of ``length`` bytes from ``offset``
    (0: to its end), in whole pages (so up to a page more than the file holds); None where
    the kernel has no cachestat."""
    stat = _Stat()
    if _libc.syscall(_CACHESTAT, fd, ctypes.byref(_Range(offset, length)), ctypes.byref(stat),
                     0) < 0:
        return None
    return int(stat.nr_cache) * _PAGE


def resident(fd: int, offset: int, length: int) -> bool:
    """Whether the page cache holds every page of the file at ``fd`` from ``offset`` up to
    ``length`` bytes or its end (one system call for a file it holds none of)."""
    held = cached_bytes(fd, offset, length)
    if not held:
        return False
    end = min(offset + length, os.fstat(fd).st_size)
    # the pages the range touches, whole: cachestat counts those
    return end > offset and held >= (-(-end // _PAGE) - offset // _PAGE) * _PAGE


def held_bytes(fd: int) -> int:
    """How many bytes of the file at ``fd`` the page cache holds, at most its size (its size
    where the kernel cannot say); closes ``fd``. Blocking: 10 ms for a 768 MiB file."""
    try:
        size = os.fstat(fd).st_size
        held = cached_bytes(fd)
        return size if held is None else min(held, size)
    finally:
        os.close(fd)
