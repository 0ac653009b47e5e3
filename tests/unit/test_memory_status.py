"""The status's ``memory`` (``coordlfs.daemon.memory``): figures measured in this process and
the kernel, from which a memory budget is split between the cache and the mount (held to a
mount's real charge in ``tests/mount/test_memory_sizing.py``)."""

from __future__ import annotations

from coordlfs.daemon.memory import (
    MAPPING_HEAP,
    memory_status,
    rss_anon,
    slab_objects,
    source_inode_slab,
    tmpfs_file_bytes,
)


def test_the_daemon_is_its_anonymous_memory_less_its_tables() -> None:
    held = bytearray(32 << 20)  # touched: resident
    memory = memory_status(tables=(1 << 20, 2 << 20), rows=(1000, 500),
                           cached_bytes=500 * 3 * 4096, source_fstype="ext4", passthrough=True,
                           lane_row=300, lane_key=64)
    assert memory["daemon_bytes"] >= len(held)
    assert memory["itself_bytes"] == memory["daemon_bytes"] - (3 << 20)
    slabs = slab_objects(("fuse_inode", "dentry", "filp", "lsm_inode_cache",
                          "radix_tree_node", "ext4_inode_cache"))
    # the mount's inode and the source's, each with its dentry and security blob; its key held
    # in the lane
    assert memory["per_inode_bytes"] == (1049 + slabs["fuse_inode"] + slabs["ext4_inode_cache"]
                                         + 2 * (slabs["dentry"] + slabs["lsm_inode_cache"]) + 64)
    # three pages a file: one node of a page tree; the lane's row, and its key held
    assert memory["per_cached_file_bytes"] == (4194 + tmpfs_file_bytes() + slabs["radix_tree_node"]
                                               + slabs["filp"] + 300 + 64)
    without = memory_status(tables=(0, 0), rows=(0, 0), cached_bytes=0, source_fstype="ext4",
                            passthrough=False, lane_row=0)
    assert without["per_cached_file_bytes"] == tmpfs_file_bytes()  # no backing file, no tree


def test_the_entries_the_daemon_maps_are_spread_over_the_cached_files() -> None:
    """Without passthrough the daemon serves hits from mappings of the entries' files: their
    kernel objects and its heap for them are a cached file's cost, not the daemon's own."""
    args = {"tables": (0, 0), "rows": (0, 100), "cached_bytes": 100 * 4096,
            "source_fstype": "ext4", "passthrough": False, "lane_row": 0}
    unmapped, mapped = memory_status(**args), memory_status(**args, mapped=50)
    slabs = slab_objects(("filp", "vm_area_struct"))
    one = slabs["filp"] + slabs["vm_area_struct"] + MAPPING_HEAP + 8  # a page's table entry
    assert mapped["per_cached_file_bytes"] - unmapped["per_cached_file_bytes"] == round(one / 2)
    assert mapped["itself_bytes"] == mapped["daemon_bytes"] - 50 * MAPPING_HEAP
    # a large file's mapping holds a table entry per page: 270 of 1.1 MB
    large = {**args, "cached_bytes": 100 * 270 * 4096}
    grown = memory_status(**large, mapped=50)["per_cached_file_bytes"]
    assert grown - memory_status(**large)["per_cached_file_bytes"] == round(
        (one - 8 + 270 * 8) / 2)


def test_a_page_tree_node_indexes_64_pages() -> None:
    one_page = memory_status(tables=(0, 0), rows=(0, 10), cached_bytes=10 * 4096,
                             source_fstype="ext4", passthrough=False, lane_row=0)
    big = memory_status(tables=(0, 0), rows=(0, 1), cached_bytes=640 * 4096,
                        source_fstype="ext4", passthrough=False, lane_row=0)
    node = slab_objects(("radix_tree_node",))["radix_tree_node"]
    assert big["per_cached_file_bytes"] - one_page["per_cached_file_bytes"] == 10 * node


def test_the_source_inode_follows_its_filesystem() -> None:
    assert source_inode_slab("xfs") == "xfs_inode"
    assert source_inode_slab("tmpfs") == "shmem_inode_cache"
    assert source_inode_slab("somefs") == "ext4_inode_cache"  # unknown: as ext4's cost
    sizes = slab_objects(("no_such_slab",))
    assert sizes["no_such_slab"] > 0


def test_rss_anon_reads_proc() -> None:
    assert rss_anon() > 0
    assert rss_anon("/nonexistent") == 0
