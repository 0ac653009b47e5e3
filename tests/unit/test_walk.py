"""Walks that cross mounts (``coordlfs.source.walk``): through a dataset's nested mounts, never into
a barred device (a coordlfs mount's), with no link followed. Nested tmpfs mounts stand in for
both: the barred device is a tmpfs's, so no FUSE mount is needed to see where a walk stops."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordlfs.source.source import Source
from coordlfs.source.walk import open_outside
from coordlfs.system.mounts import DevicesOfType

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Path]:
    """src/a/m1 a tmpfs holding b/m2, another tmpfs holding f; a file bind-mounted on
    src/a/bound; a link to m1's files."""
    src = tmp_path / "src"
    m1 = src / "a" / "m1"
    m1.mkdir(parents=True)
    with contextlib.ExitStack() as mounts:
        for where, how in ((m1, ["-t", "tmpfs", "coordlfs-test"]),
                           (m1 / "b" / "m2", ["-t", "tmpfs", "coordlfs-test"]),
                           (src / "a" / "bound", ["--bind", str(tmp_path / "file")])):
            if "--bind" in how:
                (tmp_path / "file").write_bytes(b"bound")
                where.write_bytes(b"under")
            else:
                where.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", *how, str(where)], check=True)
            mounts.callback(subprocess.run, ["umount", "-l", str(where)], check=False)
        (m1 / "b" / "m2" / "f").write_bytes(b"deep")
        (src / "link").symlink_to(m1)
        yield src


def read(root: int, path: bytes, barred: frozenset[int] = frozenset()) -> bytes:
    fd = open_outside(root, path, os.O_RDONLY, barred)
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


def test_nested_mounts_are_walked_through(tree: Path) -> None:
    source = Source(str(tree))
    try:
        assert read(source.root_fd, b"a/m1/b/m2/f") == b"deep"  # two mounts on the way
        assert read(source.root_fd, b"a/bound") == b"bound"  # a mount at the last name
        assert source.lstat(b"a/m1").st_dev == os.stat(tree / "a" / "m1").st_dev
        fd = source.open_dir(b"a/m1/b/m2")
        os.close(fd)
    finally:
        source.close()


@pytest.mark.parametrize(("barred_at", "path"), [
    ("a/m1", b"a/m1/b/m2/f"),  # the first mount on the way is barred
    ("a/m1/b/m2", b"a/m1/b/m2/f"),  # a mount further on
    ("a/m1/b/m2", b"a/m1/b/m2"),  # the last name
])
def test_a_walk_into_a_barred_device_is_eloop(tree: Path, barred_at: str, path: bytes) -> None:
    source = Source(str(tree))
    try:
        barred = frozenset({os.stat(tree / barred_at).st_dev})
        source.barred = barred
        for call in (source.lstat, source.open_dir, lambda p: read(source.root_fd, p, barred)):
            with pytest.raises(OSError) as error:
                call(path)
            assert error.value.errno == errno.ELOOP, call
        assert source.lstat(b"a").st_dev == os.stat(tree).st_dev  # short of it: as before
    finally:
        source.close()


def test_no_link_is_followed_on_the_way(tree: Path) -> None:
    source = Source(str(tree))
    try:
        assert source.readlink(b"link") == os.fsencode(tree / "a" / "m1")
        with pytest.raises(OSError) as error:
            source.lstat(b"link/b")
        assert error.value.errno == errno.ELOOP
        with pytest.raises(OSError) as error:
            source.readlink(b"a")
        assert error.value.errno == errno.EINVAL  # not a link, as readlink(2) says
    finally:
        source.close()



def test_the_devices_of_a_type_follow_the_mount_table(tmp_path: Path) -> None:
    """Read again when the table changes (a mount made or gone after a check), so a walk
    meets a coordlfs mount made at any time; a tmpfs stands in for one."""
    devices = DevicesOfType("tmpfs")
    where = tmp_path / "m"
    where.mkdir()
    assert os.stat("/proc").st_dev not in devices  # the table read before the mount
    subprocess.run(["mount", "-t", "tmpfs", "coordlfs-test", str(where)], check=True)
    try:
        mounted = os.stat(where).st_dev
        assert mounted in devices
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
    assert mounted not in devices
    assert os.stat(tmp_path).st_dev not in DevicesOfType("fuse.coordlfs")
