"""The cache's filesystem fills up under a mount: every byte still right, never EIO."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import digests, drop_caches

from coordlfs.testbed.dataset import DatasetSpec, ensure_dataset


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs of its own, so that the test can fill it without touching /dev/shm."""
    with tmpfs_of(tmp_path / "small", "64M") as where:
        yield where


@contextlib.contextmanager
def tmpfs_of(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``where`` (made), detached after."""
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "coordlfs-test", str(where)],
                   check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill_up(path: Path) -> None:
    """Write ``path`` until its filesystem has not one more page to give."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 16, 4096):
            block = b"\xa5" * chunk
            while True:
                try:
                    if f.write(block) < chunk:
                        break
                except OSError as e:
                    assert e.errno == errno.ENOSPC
                    break


def read_all(root: Path) -> dict[str, str]:
    """Digests of every file, each read whole through the mount: any EIO fails the test."""
    return digests(root)


def test_a_full_cache_filesystem_never_serves_wrong_bytes(tmp_path: Path, mount,
                                                           small_tmpfs: Path) -> None:
    src = tmp_path / "data"
    spec = DatasetSpec(600, mean_bytes=50_000, classes=4)
    files = [path for path, _size in ensure_dataset(src, spec).files]
    want = digests(src)
    m = mount(src, "--cache-size", "48M", cache_dir=small_tmpfs / "c")
    for name in files[:150]:
        (m.mountpoint / name).read_bytes()
    assert m.settled()["cache"]["files"] == 150

    filler = small_tmpfs / "filler"
    fill_up(filler)
    drop_caches()
    assert read_all(m.mountpoint) == want  # fills fail; the readers get the source's bytes
    status = m.status()["cache"]
    assert status["full"] is True
    cached_while_full = status["files"]
    assert 150 <= cached_while_full < len(files)

    filler.unlink()
    drop_caches()
    assert read_all(m.mountpoint) == want  # nothing half-filled was kept as complete
    drop_caches()
    assert read_all(m.mountpoint) == want
    status = m.status()["cache"]
    assert status["full"] is False  # space came back: caching goes on
    assert status["files"] > cached_while_full
    log = m.log.read_text()
    assert log.count("is full") == 1, log
    assert " ERROR " not in log


def test_the_cache_size_is_clamped_below_the_free_space(tmp_path: Path, mount,
                                                        small_tmpfs: Path) -> None:
    src = tmp_path / "data"
    ensure_dataset(src, DatasetSpec(10, classes=1))
    m = mount(src, "--cache-size", "1G", cache_dir=small_tmpfs / "c")
    capacity = m.status()["cache"]["capacity_bytes"]
    free = os.statvfs(small_tmpfs)
    assert capacity < free.f_blocks * free.f_frsize  # a margin for the journal and more


def test_a_full_cache_fills_again_into_room_that_returns(tmp_path: Path, mount) -> None:
    """After one ENOSPC, room smaller than the cache's capacity (6 MiB of a 40 MiB
    filesystem) is used again: each new file is checked against the room there is."""
    src = tmp_path / "data"
    spec = DatasetSpec(400, mean_bytes=50_000, classes=4)
    files = [path for path, _size in ensure_dataset(src, spec).files]
    want = digests(src)
    with tmpfs_of(tmp_path / "small", "40M") as small:
        m = mount(src, "--cache-size", "1G", cache_dir=small / "c")
        for name in files[:100]:
            (m.mountpoint / name).read_bytes()
        filler = small / "filler"
        fill_up(filler)
        drop_caches()
        assert read_all(m.mountpoint) == want
        assert m.status()["cache"]["full"] is True
        cached_while_full = m.status()["cache"]["files"]

        os.truncate(filler, filler.stat().st_size - (6 << 20))
        drop_caches()
        assert read_all(m.mountpoint) == want
        drop_caches()
        assert read_all(m.mountpoint) == want
        status = m.status()["cache"]
        assert status["files"] >= cached_while_full + 60, (cached_while_full, status)
        assert os.statvfs(small).f_bavail * os.statvfs(small).f_frsize < 2 << 20
        log = m.log.read_text()
        assert log.count("is full") == 1, log
