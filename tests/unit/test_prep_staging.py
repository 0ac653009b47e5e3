"""The prep staging area's own tmpfs in huge pages (coordlfs.prep): mounted, let go at close,
and a dead daemon's unmounted by the next daemon."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordlfs import cache_tmpfs
from coordlfs.mounting import mount_at
from coordlfs.prep import Prep

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def mount_options(path: str) -> list[str]:
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[1] == os.path.realpath(path):
                return fields[3].split(",")
    return []


def test_the_staging_area_is_a_tmpfs_of_its_own_in_huge_pages(tmp_path: Path) -> None:
    prep = Prep(1 << 20, root=str(tmp_path), own_tmpfs=True)
    try:
        assert "huge=within_size" in mount_options(prep.directory)
        assert prep.status()["staging"]["huge_pages"]
    finally:
        prep.close()
    assert mount_at(prep.directory) is None and not os.path.exists(prep.directory)


def test_a_dead_daemons_tmpfs_is_unmounted(tmp_path: Path) -> None:
    stale = tmp_path / "999999999"
    cache_tmpfs.mount_own(str(stale), 1 << 20)
    try:
        (stale / "1").mkdir()
        Prep(10, root=str(tmp_path), own_tmpfs=False).close()
        assert mount_at(str(stale)) is None and not stale.exists()
    finally:
        if mount_at(str(stale)) is not None:
            cache_tmpfs.unmount_own(str(stale))


def test_without_its_own_tmpfs_the_area_says_so(tmp_path: Path) -> None:
    prep = Prep(10, root=str(tmp_path))
    assert mount_at(prep.directory) is None and not prep.status()["staging"]["huge_pages"]
    prep.close()
