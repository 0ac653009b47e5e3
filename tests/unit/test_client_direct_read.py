"""The client's direct read of a miss, on a plain directory (no mount): what it reads, and
everything it leaves to the mount (None)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordlfs.client.dataset import _DirectMisses, _no_peers
from coordlfs.source.source import READ_CHUNK


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "big.bin").write_bytes(os.urandom(3 * READ_CHUNK + 123))
    (src / "small.bin").write_bytes(os.urandom(4096))
    (src / "link").symlink_to("d")
    os.mkfifo(src / "fifo")
    return src


def _reader(src: Path, max_file_size: int | None = None) -> _DirectMisses:
    return _DirectMisses(os.fsencode(src) + b"/", max_file_size)


def test_what_the_cache_has_no_room_for_is_read_and_the_rest_left_to_the_mount(
        source: Path) -> None:
    reader = _reader(source)
    big = (source / "d" / "big.bin").read_bytes()
    assert reader.read(b"d/big.bin", room=0) == big
    assert reader.read(b"small.bin", room=0) == (source / "small.bin").read_bytes()
    assert reader.read(b"small.bin", room=4096) is None  # fits: the mount caches it
    assert _reader(source, max_file_size=100).read(b"small.bin", room=4096) is not None
    for left in (b"link/big.bin", b"d", b"fifo", b"none", b"../src/small.bin"):
        assert reader.read(left, room=0) is None, left
    reader.close()


def test_a_file_the_cache_has_no_room_for_leaves_its_pages_to_the_kernel(
        source: Path, no_direct: list[int]) -> None:
    """Read buffered, never O_DIRECT (``no_direct`` would refuse it), and no advice to drop
    the pages: the kernel's LRU is the only cache that file will have."""
    reader = _reader(source)
    assert reader.read(b"d/big.bin", room=0) == (source / "d" / "big.bin").read_bytes()
    assert no_direct == []
    reader.close()


def test_a_file_changing_during_every_read_goes_to_the_mount(source: Path,
                                                             monkeypatch) -> None:
    pread = os.pread

    def touching(fd: int, size: int, offset: int) -> bytes:
        os.utime(source / "small.bin")  # a new mtime and ctime: another version
        return pread(fd, size, offset)

    monkeypatch.setattr(os, "pread", touching)
    reader = _reader(source)
    assert reader.read(b"small.bin", room=0) is None
    reader.close()


def test_only_a_mount_without_peers_reads_directly() -> None:
    assert _no_peers({"peers": {"nodes": []}})
    assert _no_peers({})  # an older mount: no peers section
    assert not _no_peers({"peers": {"nodes": ["10.0.0.1:7000", "10.0.0.2:7000"]}})
