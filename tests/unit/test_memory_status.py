"""The status's ``memory`` (``coordlfs.daemon.memory``): figures measured in this process and
the kernel, from which a memory budget is split between the cache and the mount."""

from __future__ import annotations

from coordlfs.daemon.memory import memory_status, rss_anon, slab_objects


def test_the_daemon_is_its_anonymous_memory_less_its_tables() -> None:
    held = bytearray(32 << 20)  # touched: resident
    memory = memory_status(tables=(1 << 20, 2 << 20), rows=(1000, 500), file_overhead=944,
                           passthrough=True)
    assert memory["daemon_bytes"] >= len(held)
    assert memory["itself_bytes"] == memory["daemon_bytes"] - (3 << 20)
    slabs = slab_objects(("fuse_inode", "dentry", "filp"))
    assert memory["per_inode_bytes"] == 1049 + slabs["fuse_inode"] + slabs["dentry"]
    assert memory["per_cached_file_bytes"] == 4194 + 944 + slabs["filp"]
    without = memory_status(tables=(0, 0), rows=(0, 0), file_overhead=944, passthrough=False)
    assert without["per_cached_file_bytes"] == 944  # no backing file held open


def test_rss_anon_reads_proc() -> None:
    assert rss_anon() > 0
    assert rss_anon("/nonexistent") == 0
