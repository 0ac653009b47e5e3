"""coordlfs bench overhead: a small real run over a mount (the daemon's and the kernel's bytes per
file, the cache's own files included), and the tables built directly."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchtools import BENCH

#: what the report said before the compact tables, and still says
KEYS = {"files", "file_bytes", "inodes", "cached_files", "rss_start_bytes", "bytes_per_inode",
        "bytes_per_cached_file", "tmpfs_bytes_per_file_beyond_data"}


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "overhead.json"
    result = subprocess.run([*BENCH, "overhead", "--json", str(out), *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "per file, both" in result.stdout
    return json.loads(out.read_text())


def test_over_a_mount_it_reports_the_daemon_and_the_kernel_per_file(tmp_path: Path) -> None:
    report = _run(tmp_path, "--files", "300")
    assert KEYS | {"bytes_per_file_together", "table_bytes_per_inode",
                   "table_bytes_per_cached_file", "kernel_bytes_per_file"} <= report.keys()
    assert report["cached_files"] == 300
    assert report["table_bytes_per_cached_file"] > 0
    # the cache's own files in the kernel: a file per entry
    assert {"cache_kernel_shmem_inode_cache_bytes_per_file", "cache_kernel_dentry_bytes_per_file",
            "cache_kernel_slab_bytes_per_file", "cache_kernel_shmem_bytes_per_file_beyond_data",
            "cache_kernel_bytes_per_file", "cache_dir_files"} <= report.keys()
    assert report["cache_dir_files"] == 300
    # double caching: the page cache's growth on a second read, with passthrough and without
    growth = report["page_cache_growth_per_byte_read"]
    assert set(growth) == {"auto", "no"} and growth["no"]["passthrough"].startswith("off")
    assert all(g["bytes_read"] == 300 * 4096 for g in growth.values())


def test_direct_builds_the_tables_and_adopts_them_as_a_restart_does(tmp_path: Path) -> None:
    report = _run(tmp_path, "--direct", "--files", "20000")
    assert report["adopted"] == 20000
    assert report["table_bytes_per_inode"] < 150 and report["table_bytes_per_cached_file"] < 150
    assert report["checkpoint_s"] >= 0 and report["adopt_s"] >= 0
