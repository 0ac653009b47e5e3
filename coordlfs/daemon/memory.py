"""What the mount costs in memory beside its cached bytes, measured while it runs.

A cache sized to a memory budget (a cgroup's limit, a node's RAM) must leave room for the
daemon itself and for what each file costs it: a cache sized by margins either leaves memory
idle or gets the daemon killed. So the status says (``coordlfs stats``, and the benchmarks size
their caches from it, ``coordlfs.bench.epochs.Sizing``):

- ``itself_bytes``: the daemon's anonymous memory (``RssAnon``: its heap, thread stacks and
  buffers, not the cache's tmpfs pages it maps) less its per-file tables: what it needs with
  no file known;
- ``per_inode_bytes``: a file the kernel has looked up through the mount: the daemon's inode
  table row and the kernel's FUSE inode and dentry (``/proc/slabinfo`` object sizes);
- ``per_cached_file_bytes``: a cached file beside its pages: the cache's table row, and the
  kernel's tmpfs inode and dentry and, with passthrough, the open backing file (a ``filp``).

The tables' figures are their bytes per row now; the kernel's, the slab objects' sizes (the
fallbacks measured on Linux 6.18 where slabinfo cannot be read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

#: slab object sizes measured on Linux 6.18, for a kernel that hides /proc/slabinfo
_SLAB_FALLBACK = {"fuse_inode": 896, "dentry": 192, "filp": 256}


def rss_anon(status: str = "/proc/self/status") -> int:
    """This process's resident anonymous memory, in bytes (0 if the kernel does not say)."""
    with contextlib.suppress(OSError), open(status) as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def slab_objects(names: Iterable[str]) -> dict[str, int]:
    """The object size of each named slab cache, from ``/proc/slabinfo`` (root only) or the
    sizes measured here."""
    wanted = set(names)
    sizes = {name: _SLAB_FALLBACK[name] for name in wanted}
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/slabinfo") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] in wanted:
                sizes[fields[0]] = int(fields[3])
    return sizes


def memory_status(*, tables: tuple[int, int], rows: tuple[int, int], file_overhead: int,
                  passthrough: bool) -> dict[str, Any]:
    """The status's ``memory``: ``tables`` and ``rows`` are the (inode table, cache table)
    bytes and rows; ``file_overhead`` the kernel's bytes per tmpfs file (the cache's)."""
    (inode_bytes, entry_bytes), (inodes, entries) = tables, rows
    slabs = slab_objects(("fuse_inode", "dentry", "filp"))
    daemon = rss_anon()
    return {
        "daemon_bytes": daemon,
        "itself_bytes": max(0, daemon - inode_bytes - entry_bytes),
        "per_inode_bytes": round(inode_bytes / max(1, inodes))
        + slabs["fuse_inode"] + slabs["dentry"],
        "per_cached_file_bytes": round(entry_bytes / max(1, entries)) + file_overhead
        + (slabs["filp"] if passthrough else 0),
    }
