"""The one reader of the source (``SourceReader``), as the daemon's fills and the client use
it: every range and the whole file alike with O_DIRECT and on a filesystem that refuses it at
a read, the pages of a buffered read dropped, those of a file the cache does not keep left to
the kernel, a file the page cache holds read from it (storage not read twice), and a FIFO
opened without blocking."""

from __future__ import annotations

import ctypes
import fcntl
import os
import stat
from pathlib import Path

import pytest

from coordlfs.source.beneath import open_beneath
from coordlfs.source.source import READ_CHUNK, SourceReader
from coordlfs.system.pagecache import cached_bytes, resident

DATA = os.urandom(2 * READ_CHUNK + 5000)


def _cold(path: Path) -> None:
    """Written out and its pages dropped: its next read goes to storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert cached_bytes(fd) == 0
    finally:
        os.close(fd)


@pytest.fixture
def root(tmp_path: Path):
    (tmp_path / "big.bin").write_bytes(DATA)
    _cold(tmp_path / "big.bin")
    (tmp_path / "empty").write_bytes(b"")
    os.mkfifo(tmp_path / "fifo")
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    yield tmp_path, fd
    os.close(fd)


def _ranges(reader: SourceReader, data: bytes) -> None:
    for off, size in ((0, 10), (4095, 2), (READ_CHUNK - 7, 9000), (len(data) - 3, 100)):
        assert bytes(reader.read_view(off, size)) == data[off:off + size]
    assert reader.pread(len(data) + 10, 10) == b""  # past the end: a short read, empty
    assert reader.read_whole(reader.fstat()) == data


def test_every_range_and_the_whole_file_read_direct(root) -> None:
    _path, fd = root
    reader = SourceReader.opening(open_beneath, fd, b"big.bin")
    assert reader.direct  # ext4 and tmpfs both take O_DIRECT
    _ranges(reader, DATA)
    assert reader.direct and cached_bytes(reader.fd) == 0  # no page of it kept
    empty = SourceReader.opening(open_beneath, fd, b"empty")
    assert empty.read_whole(empty.fstat()) == b""
    empty.close()
    reader.close()


def _mapping_of(address: int) -> str:
    """The line of /proc/self/maps holding ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return line
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_direct_reads_buffer_is_the_daemons_own_memory_not_shared(root) -> None:
    """The buffer O_DIRECT reads land in is private anonymous memory, which the daemon's
    status counts (``RssAnon``): a shared one is tmpfs memory (shmem) no figure counted, 1 MiB
    per thread reading, and a mount sized by the figures was killed for memory."""
    _path, fd = root
    reader = SourceReader.opening(open_beneath, fd, b"big.bin")
    try:
        view = reader.read_view(0, 10)
        assert isinstance(view, memoryview) and bytes(view) == DATA[:10]
        address = ctypes.addressof(ctypes.c_char.from_buffer(view.obj))
        perms = _mapping_of(address).split()[1]
        assert perms.endswith("p"), _mapping_of(address)
    finally:
        reader.close()


def test_a_read_refusing_o_direct_goes_on_buffered_and_drops_its_pages(root,
                                                                       no_direct) -> None:
    _path, fd = root
    data = DATA
    reader = SourceReader.opening(open_beneath, fd, b"big.bin")
    assert bytes(reader.read_view(100, 5000)) == data[100:5100]
    assert not reader.direct and not fcntl.fcntl(reader.fd, fcntl.F_GETFL) & os.O_DIRECT
    assert no_direct == [os.POSIX_FADV_DONTNEED]
    no_direct.clear()
    assert reader.read_whole(reader.fstat()) == data
    assert no_direct == [os.POSIX_FADV_DONTNEED]  # once for the whole file
    reader.close()


def test_a_file_the_cache_does_not_keep_is_read_buffered_and_its_pages_kept(root,
                                                                           no_direct) -> None:
    _path, fd = root
    reader = SourceReader.opening(open_beneath, fd, b"big.bin", keep_pages=True)
    assert not reader.direct and not fcntl.fcntl(reader.fd, fcntl.F_GETFL) & os.O_DIRECT
    _ranges(reader, DATA)
    assert no_direct == []  # never told to drop them
    reader.close()


def test_a_file_the_page_cache_holds_is_read_from_it_and_its_pages_dropped(root) -> None:
    """Another process read the file (a client's direct read before the mount's fill of it):
    the fill copies the pages, storage is not read again, and none stay (the cache has it)."""
    path, fd = root
    assert (path / "big.bin").read_bytes() == DATA
    reader = SourceReader.opening(open_beneath, fd, b"big.bin")
    assert reader.direct
    assert bytes(reader.read_view(0, READ_CHUNK)) == DATA[:READ_CHUNK]
    assert reader.paged == READ_CHUNK and cached_bytes(reader.fd, 0, READ_CHUNK) == 0
    assert reader.direct and fcntl.fcntl(reader.fd, fcntl.F_GETFL) & os.O_DIRECT  # set again
    assert bytes(reader.read_view(READ_CHUNK, 2 * READ_CHUNK)) == DATA[READ_CHUNK:]
    assert reader.paged == len(DATA) and cached_bytes(reader.fd) == 0
    reader.close()


def test_a_file_partly_in_the_page_cache_is_read_direct(root) -> None:
    """A chunk of which the page cache lacks a page reads storage O_DIRECT, as a cold one."""
    path, fd = root
    with open(path / "big.bin", "rb") as f:
        assert f.read(8192) == DATA[:8192]  # and the kernel's read-ahead past it, perhaps
        os.posix_fadvise(f.fileno(), 4096, 0, os.POSIX_FADV_DONTNEED)
    reader = SourceReader.opening(open_beneath, fd, b"big.bin")
    assert resident(reader.fd, 0, 10) and not resident(reader.fd, 4095, 2)  # pages 0 and 1
    assert bytes(reader.read_view(0, READ_CHUNK)) == DATA[:READ_CHUNK]
    assert reader.paged == 0
    reader.close()


def test_a_file_of_another_size_than_its_fstat_said_reads_as_changed(root) -> None:
    path, fd = root
    reader = SourceReader.opening(open_beneath, fd, b"big.bin")
    st = reader.fstat()
    os.truncate(path / "big.bin", st.st_size - 1)
    assert reader.read_whole(st) is None
    reader.close()


def test_a_fifo_opens_without_blocking_and_shows_what_it_is(root) -> None:
    _path, fd = root
    # no writer: without O_NONBLOCK the open would wait for one for good
    reader = SourceReader.opening(open_beneath, fd, b"fifo")
    assert stat.S_ISFIFO(reader.fstat().st_mode)
    reader.close()
