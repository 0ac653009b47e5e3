"""Baseline pyfuse3 filesystems that ``coordlfs bench hits`` compares coordlfs against.

``memfs`` loads the whole dataset into a dict when it starts and answers every request from
memory with no syscall: the most a pyfuse3 + trio filesystem can deliver on this machine, so
coordlfs's cache hits are judged against it. ``passthrough`` keeps nothing and preads the
source on every read, inline like a naive filesystem would: what coordlfs saves.

Both mount with the same options and timeouts as coordlfs on a watched source (``keep_cache``
left at pyfuse3's default, entry and attribute timeouts of
``coordlfs.fs.freshness.WATCHED_TIMEOUT``), so the only difference measured is where the bytes
come from.

    python -m coordlfs.bench.baselines {memfs|passthrough} SOURCE MOUNTPOINT

runs in the foreground, prints ``ready`` once the mount is live and unmounts on SIGTERM or
SIGINT.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import pyfuse3
import trio

from coordlfs.fs.freshness import WATCHED_TIMEOUT

_STAT_FIELDS = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size", "st_blksize",
                "st_blocks", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")


@dataclass(slots=True)
class Node:
    path: str
    attr: pyfuse3.EntryAttributes
    #: name -> inode; empty for anything but a directory
    children: dict[bytes, int] = field(default_factory=dict)


def _attr(inode: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
    attr = pyfuse3.EntryAttributes()
    for name in _STAT_FIELDS:
        setattr(attr, name, getattr(st, name))
    attr.st_ino = inode
    attr.entry_timeout = attr.attr_timeout = WATCHED_TIMEOUT
    return attr


def scan_tree(root: str) -> dict[int, Node]:
    """Every entry under ``root`` by inode number, taken once: the dataset does not change."""
    nodes = {pyfuse3.ROOT_INODE: Node(root, _attr(pyfuse3.ROOT_INODE, os.lstat(root)))}
    pending = [pyfuse3.ROOT_INODE]
    while pending:
        parent = nodes[pending.pop()]
        with os.scandir(parent.path) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                inode = len(nodes) + pyfuse3.ROOT_INODE
                nodes[inode] = Node(entry.path, _attr(inode, entry.stat(follow_symlinks=False)))
                parent.children[os.fsencode(entry.name)] = inode
                if entry.is_dir(follow_symlinks=False):
                    pending.append(inode)
    return nodes


class TreeOperations(pyfuse3.Operations):
    """Metadata from the tree scanned at start; subclasses say where file data comes from."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, source: str) -> None:
        super().__init__()
        self.nodes = scan_tree(source)

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        inode = self.nodes[parent_inode].children.get(name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.nodes[inode].attr

    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        return self.nodes[inode].attr

    async def opendir(self, inode: int, ctx: Any) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = list(self.nodes[fh].children.items())
        for index in range(start_id, len(entries)):
            name, inode = entries[index]
            if not pyfuse3.readdir_reply(token, name, self.nodes[inode].attr, index + 1):
                break

    async def releasedir(self, fh: int) -> None:
        pass


class MemFS(TreeOperations):
    """All file data in a dict, served as zero-copy slices: the architecture's ceiling."""

    def __init__(self, source: str) -> None:
        super().__init__(source)
        self.data: dict[int, memoryview] = {}
        for inode, node in self.nodes.items():
            if not node.children and os.path.isfile(node.path):
                with open(node.path, "rb") as f:
                    self.data[inode] = memoryview(f.read())

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=inode)

    async def read(self, fh: int, off: int, size: int) -> memoryview:
        return self.data[fh][off : off + size]

    async def release(self, fh: int) -> None:
        pass


class PassthroughFS(TreeOperations):
    """Opens and preads the source for every file, blocking the one handler thread."""

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=os.open(self.nodes[inode].path, os.O_RDONLY | os.O_CLOEXEC))

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    async def release(self, fh: int) -> None:
        os.close(fh)


KINDS: dict[str, type[TreeOperations]] = {"memfs": MemFS, "passthrough": PassthroughFS}


async def _serve() -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_terminate_on_signal)
        print("ready", flush=True)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            pyfuse3.terminate()
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordlfs.bench.baselines",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    args = parser.parse_args(argv)
    source = os.path.realpath(args.source)
    operations = KINDS[args.kind](source)
    options = {"fsname=" + source, f"subtype=coordlfs-{args.kind}", "default_permissions"}
    try:
        pyfuse3.init(operations, args.mountpoint, options)
    except RuntimeError as e:
        print(f"{parser.prog}: cannot mount on {args.mountpoint}: {e}", file=sys.stderr)
        return 1
    try:
        trio.run(_serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
