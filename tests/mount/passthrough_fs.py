"""A minimal pyfuse3 filesystem that serves a tree's files by FUSE passthrough: each open
registers the source file as the backing of its inode (``pyfuse3.backing_open``, from the patch
``scripts/setup`` applies), so the kernel reads it without asking the daemon. Files named
``*.daemon`` are served the classic way (direct_io, the daemon preads), to show that READ
requests are counted at all.

    python tests/mount/passthrough_fs.py SOURCE MOUNTPOINT

prints ``ready`` once mounted; on SIGTERM it unmounts and prints the READ requests that reached
it, by file name, as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any

import pyfuse3
import trio

from coordlfs.bench.baselines import TreeOperations


class BackedFS(TreeOperations):
    def __init__(self, source: str) -> None:
        super().__init__(source)
        self.reads: Counter[str] = Counter()
        self.name_of: dict[int, str] = {}
        #: inode -> [backing id, opens]: the kernel takes one backing id per inode
        self.backing: dict[int, list[int]] = {}
        self.inode_of: dict[int, int] = {}

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        fd = os.open(self.nodes[inode].path, os.O_RDONLY | os.O_CLOEXEC)
        self.name_of[fd] = os.path.basename(self.nodes[inode].path)
        if self.nodes[inode].path.endswith(".daemon"):
            return pyfuse3.FileInfo(fh=fd, direct_io=True)
        entry = self.backing.setdefault(inode, [pyfuse3.backing_open(fd), 0])
        entry[1] += 1
        self.inode_of[fd] = inode
        # keep_cache (pyfuse3's default) would make the kernel fail the open with EIO
        return pyfuse3.FileInfo(fh=fd, backing_id=entry[0], keep_cache=False, noflush=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.reads[self.name_of[fh]] += 1
        return os.pread(fh, size, off)

    async def release(self, fh: int) -> None:
        os.close(fh)
        del self.name_of[fh]
        inode = self.inode_of.pop(fh, None)
        if inode is not None:
            self.backing[inode][1] -= 1
            if not self.backing[inode][1]:
                pyfuse3.backing_close(self.backing.pop(inode)[0])


async def serve(fs: BackedFS) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pyfuse3.main)
        print("ready", flush=True)
        with trio.open_signal_receiver(15) as signals:
            async for _ in signals:
                break
        pyfuse3.terminate()


def main() -> None:
    source, mountpoint = sys.argv[1:3]
    fs = BackedFS(os.path.realpath(source))
    pyfuse3.init(fs, mountpoint, {"fsname=passthrough-test", "default_permissions"})
    try:
        trio.run(serve, fs)
    finally:
        pyfuse3.close(unmount=True)
    print(json.dumps(fs.reads), flush=True)


if __name__ == "__main__":
    main()
