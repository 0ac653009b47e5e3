"""The ``coordlfs://`` fsspec filesystem on a real mount: found through its entry point, every
byte equal to the source's, listings as the mount's, and read-only."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import xxhash
from conftest import digests

from coordlfs.client.adapters import close_clients, locate
from coordlfs.fsspec_fs import CoordlfsFileSystem


@pytest.fixture
def mounted(mount, dataset) -> Iterator[tuple[Path, Path]]:
    """(source, mountpoint); this process's clients closed before the mount goes."""
    src, _sizes = dataset
    yield src, mount(src).mountpoint
    close_clients()


def url(path: Path) -> str:
    return f"coordlfs://{path}"


def test_the_entry_point_registers_the_protocol() -> None:
    assert isinstance(fsspec.filesystem("coordlfs"), CoordlfsFileSystem)


def test_every_file_reads_as_the_source_through_the_client(mounted) -> None:
    src, mnt = mounted
    want = digests(src)
    got = {}
    for relative in want:
        with fsspec.open(url(mnt / relative)) as f:
            got[relative] = xxhash.xxh64_hexdigest(f.read())
    assert got == want
    fs = fsspec.filesystem("coordlfs")
    first = sorted(want)[0]
    data = (src / first).read_bytes()
    assert fs.cat_file(url(mnt / first)) == data
    assert fs.cat_file(str(mnt / first), start=10, end=100) == data[10:100]
    with fs.open(str(mnt / first)) as f:
        f.seek(5)
        assert f.read(7) == data[5:12]
    where = locate(mnt / first)
    assert where is not None and where.client is not None
    stats = where.client.stats
    assert stats["hits"] + stats["misses"] >= len(want)  # the client served them


def test_globs_open_files_like_the_source(mounted) -> None:
    src, mnt = mounted
    files = fsspec.open_files(url(mnt) + "/*/*")
    want = digests(src)
    assert sorted(os.path.relpath(f.path, mnt) for f in files) == sorted(
        r for r in want if os.sep in r)
    for f in files:
        with f as opened:
            assert xxhash.xxh64_hexdigest(opened.read()) == want[os.path.relpath(f.path, mnt)]


def test_listing_and_info_are_the_mounts(mounted) -> None:
    _src, mnt = mounted
    fs = fsspec.filesystem("coordlfs")
    for directory in [mnt, *sorted(p for p in mnt.iterdir() if p.is_dir())]:
        listed = fs.ls(url(directory))
        assert sorted(e["name"] for e in listed) == sorted(
            str(directory / name) for name in os.listdir(directory))
        for entry in listed:
            st = os.stat(entry["name"])
            assert entry["size"] == st.st_size
            assert entry["type"] == ("directory" if os.path.isdir(entry["name"]) else "file")
            assert fs.info(entry["name"]) == entry
    assert fs.isdir(url(mnt)) and not fs.exists(url(mnt / "missing"))
    with pytest.raises(FileNotFoundError):
        fs.info(url(mnt / "missing"))


def test_writes_fail_read_only(mounted) -> None:
    src, mnt = mounted
    fs = fsspec.filesystem("coordlfs")
    some = next(p for p in mnt.rglob("*") if p.is_file())
    attempts = [
        lambda: fsspec.open(url(mnt / "new"), "wb").open(),
        lambda: fs.open(url(some), "ab"),
        lambda: fs.pipe_file(url(mnt / "new"), b"x"),
        lambda: fs.mkdir(url(mnt / "d")),
        lambda: fs.rm(url(some)),
        lambda: fs.mv(url(some), url(mnt / "moved")),
        lambda: fs.put_file(str(src / some.relative_to(mnt)), url(mnt / "put")),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as raised:
            attempt()
        assert raised.value.errno == errno.EROFS and "read-only" in str(raised.value)
    assert some.exists() and not (mnt / "new").exists()


def test_a_path_on_no_mount_reads_as_a_local_file(tmp_path: Path) -> None:
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"local bytes")
    with fsspec.open(url(plain)) as f:
        assert f.read() == b"local bytes"
    assert locate(plain) is None
