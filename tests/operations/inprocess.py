"""The ``Operations`` of a mount, built as the daemon builds them and called in this process.

No kernel is involved: a test awaits the handlers itself, under ``trio.run``. The pyfuse3
calls that talk to a live session are replaced by recorders, in these tests only:
``readdir_reply`` (its token comes from the kernel) collects the entries it is given, and
``invalidate_inode`` notes the inode. The freshness watcher is not run, so no
``invalidate_entry_async`` is ever called. As with a real mount's log, an ERROR that
``guarded`` logs (and answers EIO for) fails the test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyfuse3
import pytest
import trio

from coordlfs.cache.cache import WholeFileCache
from coordlfs.cache.stats import ReadCounters
from coordlfs.fs.inodes import ROOT_INODE
from coordlfs.fs.operations import FileHandle, Operations
from coordlfs.fs.readers import AlignedReads, Reader
from coordlfs.jobs.groups import Groups
from coordlfs.jobs.prefetch import Prefetcher
from coordlfs.jobs.window import ReadWindow
from coordlfs.peers.links import Peers
from coordlfs.protocol.server import ControlServer
from coordlfs.source.source import Source

#: Reads as the kernel sends them for a file read sequentially (read_ahead_kb 1024).
CHUNK = 128 << 10
#: Seconds a test waits for a background fill to finish.
FILL_TIMEOUT_S = 10.0


@dataclass
class Kernel:
    """What the replaced pyfuse3 calls were given."""

    #: (name, inode, next offset) per readdir_reply
    listed: list[tuple[bytes, int, int]] = field(default_factory=list)
    #: replies accepted before the kernel's buffer is "full"; None: all
    room: int | None = None
    invalidated: list[int] = field(default_factory=list)

    def readdir_reply(self, _token: Any, name: bytes, attr: pyfuse3.EntryAttributes,
                      next_id: int) -> bool:
        if self.room is not None and len(self.listed) >= self.room:
            return False
        self.listed.append((name, attr.st_ino, next_id))
        return True

    def invalidate_inode(self, inode: int, attr_only: bool = False) -> None:
        self.invalidated.append(inode)


@dataclass
class Mount:
    """One mount's objects, as ``daemon.Daemon._assemble`` joins them."""

    ops: Operations
    counters: ReadCounters
    cache: WholeFileCache
    groups: Groups
    window: ReadWindow
    kernel: Kernel

    def run(self, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body`` under trio with the nursery fills start in, as the daemon serves."""

        async def serve() -> None:
            async with trio.open_nursery() as nursery:
                self.ops.readers.nursery = nursery
                await body()
                nursery.cancel_scope.cancel()

        trio.run(serve)

    def handle(self, fh: int) -> FileHandle:
        handle = self.ops._handles[fh]
        assert isinstance(handle, FileHandle)
        return handle

    def reader(self, fh: int) -> Reader:
        return self.handle(fh).reader

    async def lookup(self, path: str) -> pyfuse3.EntryAttributes:
        """Walk ``path`` from the root as the kernel does, one lookup per component."""
        inode, attr = ROOT_INODE, None
        for name in path.split("/"):
            attr = await self.ops.lookup(inode, os.fsencode(name), ctx())
            inode = attr.st_ino
        assert attr is not None
        return attr

    async def open(self, path: str, pid: int | None = None) -> int:
        attr = await self.lookup(path)
        info = await self.ops.open(attr.st_ino, os.O_RDONLY, ctx(pid))
        return info.fh

    async def read_all(self, fh: int, chunk: int = CHUNK) -> bytes:
        """The whole file, in sequential requests of ``chunk`` bytes."""
        parts, off = [], 0
        while data := await self.ops.read(fh, off, chunk):
            parts.append(bytes(data))
            off += len(data)
        return b"".join(parts)

    async def read_file(self, path: str, pid: int | None = None) -> bytes:
        """Open, read whole, release: one reader's pass over one file."""
        fh = await self.open(path, pid)
        try:
            return await self.read_all(fh)
        finally:
            await self.ops.release(fh)

    async def filled(self) -> None:
        """Wait until no fill is under way."""
        with trio.fail_after(FILL_TIMEOUT_S):
            while self.cache.filling:
                await trio.sleep(0.01)


def ctx(pid: int | None = None) -> SimpleNamespace:
    """The request context pyfuse3 passes: who asks."""
    return SimpleNamespace(uid=os.getuid(), gid=os.getgid(),
                           pid=os.getpid() if pid is None else pid)


@contextlib.contextmanager
def mounted(source: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, *,
            cache_size: int = 64 << 20, max_file_size: int | None = None,
            window_size: int = 0,
            peers: Callable[[ReadCounters], Peers] | None = None) -> Iterator[Mount]:
    """A mount's ``Operations`` over ``source``; a cluster of one unless ``peers`` makes
    the cluster (given the counters)."""
    kernel = Kernel()
    errors = Errors()
    logging.getLogger("coordlfs").addHandler(errors)
    monkeypatch.setattr(pyfuse3, "readdir_reply", kernel.readdir_reply)
    monkeypatch.setattr(pyfuse3, "invalidate_inode", kernel.invalidate_inode)
    counters = ReadCounters()
    src = Source(str(source))
    cache = WholeFileCache(str(cache_dir), cache_size,
                           cache_size if max_file_size is None else max_file_size, counters)
    try:
        cache.load(src)
        groups = Groups(alive=lambda _pid: True)
        window = ReadWindow(window_size)
        prefetcher = Prefetcher(groups, window, cache, src, counters, 0)
        cluster = peers(counters) if peers else Peers((), None, b"", 1.0, counters)
        ops = Operations(src, cache, counters, ControlServer(lambda: {}),
                         AlignedReads(groups, window, prefetcher), cluster, 1.0)
        try:
            yield Mount(ops, counters, cache, groups, window, kernel)
        finally:
            ops.freshness.close()
    finally:
        cache.close(keep=False)
        src.close()
        logging.getLogger("coordlfs").removeHandler(errors)
    assert not errors.records, f"Operations logged errors: {errors.records}"


class Errors(logging.Handler):
    """The ERROR records logged while the mount was up."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def write_files(root: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    """Files of random bytes under ``root``; their contents by name."""
    contents = {}
    for name, size in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        contents[name] = os.urandom(size)
        path.write_bytes(contents[name])
    return contents


def on_storage_only(path: Path) -> None:
    """Written out and its pages dropped, as a file no process has read lately: a fill of it
    reads storage (one of pages still in memory copies them, ``fill_bytes_from_pages``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def is_dir(attr: pyfuse3.EntryAttributes) -> bool:
    return stat.S_ISDIR(attr.st_mode)
