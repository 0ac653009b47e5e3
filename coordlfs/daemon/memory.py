"""What the mount costs in memory beside its cached bytes, measured while it runs.

A cache sized to a memory budget (a cgroup's limit, a node's RAM) must leave room for the
daemon itself and for what each file costs it: a cache sized by margins either leaves memory
idle or gets the daemon killed. So the status says (``coordlfs stats``, and the benchmarks size
their caches from it, ``coordlfs.bench.epochs.Sizing``):

- ``itself_bytes``: the daemon's anonymous memory (``RssAnon``: its heap, thread stacks and
  buffers, not the cache's tmpfs pages it maps) less its per-file tables: what it needs with
  no file known;
- ``per_inode_bytes``: a file the kernel has looked up through the mount: the daemon's inode
  table row, the kernel's FUSE inode and dentry, and the source file's own inode and dentry,
  which the daemon's lookup reads in (charged to the daemon's cgroup: on ext4 they are more
  than half of the kernel's share; a budget split without them got the mount of a 60,000-file
  dataset killed for memory);
- ``per_cached_file_bytes``: a cached file beside its pages: the cache's table row, the
  kernel's tmpfs inode and dentry, the tree nodes indexing its pages (one per 64 pages) and,
  with passthrough, the open backing file (a ``filp``) and, with the request lane, its row
  and the backing id it keeps (``LaneRows.census``: every cached file the kernel knows has
  one once it was filled or hit); without passthrough, the daemon's mapping of the files it
  serves (``files.EntryFiles``: at most ``MAPPED_FILES``), its share spread over every
  cached file: a ``filp`` and a ``vm_area_struct`` in the kernel, the mapping's object and
  its table slot in the daemon's heap (``MAPPING_HEAP``, taken out of ``itself_bytes``) and
  its page-table entries.

With the request lane each inode and each cached file also holds its key in the lane
(``lane_key``: the lane numbers no node for a key the daemon holds, ``coordlfs.fs.lane_nodes``).

Every inode also carries a security blob (``lsm_inode_cache``). The tables' figures are their
bytes per row now; the kernel's, the slab objects' shares of their slabs' pages from
``/proc/slabinfo`` (as measured on Linux 6.18 where it cannot be read).
``tests/mount/test_memory_sizing.py`` holds the figures to what a mount's cgroup is charged.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Iterable
from typing import Any

#: slab objects' shares of their slabs' pages measured on Linux 6.18, for a kernel that hides
#: /proc/slabinfo (a source filesystem whose inodes are not known here is taken to cost what
#: ext4's do)
_SLAB_FALLBACK = {"fuse_inode": 910, "dentry": 195, "filp": 195, "shmem_inode_cache": 780,
                  "lsm_inode_cache": 32, "radix_tree_node": 585, "ext4_inode_cache": 1170,
                  "vm_area_struct": 195}
#: the slab of a source filesystem's inodes, by the filesystem's type
_SOURCE_INODES = {"ext2": "ext4_inode_cache", "ext3": "ext4_inode_cache",
                  "ext4": "ext4_inode_cache", "xfs": "xfs_inode", "btrfs": "btrfs_inode",
                  "tmpfs": "shmem_inode_cache", "f2fs": "f2fs_inode_cache",
                  "nfs": "nfs_inode_cache", "nfs4": "nfs_inode_cache", "overlay": "ovl_inode"}
#: pages a node of a file's page tree indexes (an xarray node's slots)
_PAGES_PER_NODE = 64
#: the daemon's heap per entry it keeps mapped (the ``mmap`` object, its ``OrderedDict`` slot,
#: malloc's share): RssAnon grew 483 B per mapping of 4,000 (Python 3.11, 2026-11-29)
MAPPING_HEAP = 480
#: a mapped page's page-table entry: VmPTE grew 23 B per mapping of 4,000 three-page files;
#: a 1.1 MB file's mapping costs 270 of them (the daemon of a mount of 2,000 such files held
#: 2.4 MB of page tables, which a figure of 24 B per mapping left out)
_PTE_BYTES = 8


def rss_anon(status: str = "/proc/self/status") -> int:
    """This process's resident anonymous memory, in bytes (0 if the kernel does not say)."""
    with contextlib.suppress(OSError), open(status) as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def slab_objects(names: Iterable[str]) -> dict[str, int]:
    """What an object of each named slab cache costs: its share of its slab's pages (the
    object and the slab's slack), from ``/proc/slabinfo`` (root only) or as measured here."""
    wanted = set(names)
    sizes = {name: _SLAB_FALLBACK.get(name, _SLAB_FALLBACK["ext4_inode_cache"])
             for name in wanted}
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/slabinfo") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] in wanted:  # name active total size per-slab pages
                sizes[fields[0]] = int(fields[5]) * mmap.PAGESIZE // int(fields[4])
    return sizes


def source_inode_slab(fstype: str) -> str:
    """The slab cache holding the inodes of a source on a filesystem of type ``fstype``."""
    return _SOURCE_INODES.get(fstype, "ext4_inode_cache")


_TMPFS_FILE = ("shmem_inode_cache", "lsm_inode_cache", "dentry")


def tmpfs_file_bytes(slabs: dict[str, int] | None = None) -> int:
    """What the kernel keeps per tmpfs file besides its pages and their tree: its inode, its
    security blob and its dentry (from ``slabs`` when the caller read them already)."""
    slabs = slabs or slab_objects(_TMPFS_FILE)
    return sum(slabs[name] for name in _TMPFS_FILE)


def page_tree_bytes(mean_pages: float, slabs: dict[str, int] | None = None) -> int:
    """What the kernel keeps to index a file of ``mean_pages`` pages: its page tree's nodes
    (none for a single page), as long as the file has pages, or shadows of reclaimed ones."""
    nodes = math.ceil(mean_pages / _PAGES_PER_NODE) if mean_pages > 1 else 0
    return nodes * (slabs or slab_objects(("radix_tree_node",)))["radix_tree_node"]


def memory_status(*, tables: tuple[int, int], rows: tuple[int, int], cached_bytes: int,
                  source_fstype: str, passthrough: bool, lane_row: int,
                  lane_key: int = 0, mapped: int = 0) -> dict[str, Any]:
    """The status's ``memory``: ``tables`` and ``rows`` are the (inode table, cache table)
    bytes and rows, ``cached_bytes`` the cache's pages in bytes (their mean per file gives
    the files' page trees), ``source_fstype`` the type of the source's filesystem,
    ``lane_row`` what a row of the request lane costs, ``lane_key`` a key it is told is
    held (0 without it) and ``mapped`` the entries the daemon keeps mapped."""
    (inode_bytes, entry_bytes), (inodes, entries) = tables, rows
    source = source_inode_slab(source_fstype)
    slabs = slab_objects(("fuse_inode", "filp", "radix_tree_node", "vm_area_struct", source,
                          *_TMPFS_FILE))
    mean_pages = cached_bytes / mmap.PAGESIZE / max(1, entries)
    mappings = mapped * (slabs["filp"] + slabs["vm_area_struct"] + MAPPING_HEAP
                         + _PTE_BYTES * max(1, round(mean_pages)))
    inode_kernel = slabs["dentry"] + slabs["lsm_inode_cache"]  # one file's name and blob
    tree = page_tree_bytes(mean_pages, slabs)
    daemon = rss_anon()
    return {
        "daemon_bytes": daemon,
        "itself_bytes": max(0, daemon - inode_bytes - entry_bytes - mapped * MAPPING_HEAP),
        "per_inode_bytes": round(inode_bytes / max(1, inodes)) + slabs["fuse_inode"]
        + slabs[source] + 2 * inode_kernel + lane_key,
        "per_cached_file_bytes": round(entry_bytes / max(1, entries)) + tmpfs_file_bytes(slabs)
        + tree + (slabs["filp"] if passthrough else 0) + lane_row
        + lane_key + round(mappings / max(1, entries)),
    }
