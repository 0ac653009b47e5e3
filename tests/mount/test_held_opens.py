"""A descriptor opened through the mount behaves as one opened on the source while the source
changes under it (issue 30): after a rename over it, an unlink, a rename away or a symlink put
in its place it keeps reading the bytes of the file it opened, by read, pread and mmap, and
fstat reports that file's size; after a rewrite in place (same inode) what it reads and what
fstat says agree, one version whole. A mapping of ``st_size`` bytes is read in a child process,
so that a SIGBUS is seen as the child's death, not the test's.

Each kind of open is tried: a file the cache holds (read by passthrough where it is on), a small
miss opened before anything read it (the source file itself as backing where passthrough is
on), a file above ``--max-file-size`` and one a mount with no cache serves (either read by
the kernel from the source file itself where passthrough is on, else streamed by the daemon).
The whole module runs with passthrough on or off through ``COORDLFS_TEST_PASSTHROUGH``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from conftest import Mount, read_all, wait_for

#: Sizes that are not a whole number of pages or of FUSE reads.
SIZES = {"cached": 1536 * 1024 + 4321, "miss": 200 * 1024 + 777,
         "streamed": 3 * 1024 * 1024 + 1234, "uncached": 1536 * 1024 + 999}
#: The mount caches files up to this size: the streamed file is above it.
MAX_FILE_SIZE = "2M"
CHANGES = ["rename over", "rewrite with O_TRUNC", "unlink", "rename away", "symlink"]
#: What a change leaves at the name: a file with new bytes, or nothing readable.
NEW_BYTES = {"rename over", "rewrite with O_TRUNC"}

#: The child that maps the descriptor it is given: st_size bytes, then their hash.
MAP_CHILD = """
import mmap, os, sys, xxhash
fd = int(sys.argv[1])
size = os.fstat(fd).st_size
with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
    print(size, xxhash.xxh64_hexdigest(mapped[:]))
"""


def change(src: Path, name: str, how: str) -> bytes | None:
    """Change ``src/name`` as ``how`` says; the bytes now at the name, if a file is there. A
    new version is longer than the old one, so a size tells which one a reader sees."""
    path = src / name
    new = os.urandom(path.stat().st_size + 5000)
    if how == "rename over":
        (src / "next").write_bytes(new)
        os.rename(src / "next", path)
    elif how == "rewrite with O_TRUNC":
        with path.open("wb") as f:  # O_TRUNC: the same inode, its bytes replaced
            f.write(new)
    elif how == "unlink":
        path.unlink()
    elif how == "rename away":
        os.rename(path, src / "moved")
    else:
        (src / "other").write_bytes(new)
        os.symlink("other", src / "link")
        os.rename(src / "link", path)
    return new if how in NEW_BYTES else None




def whole_version(fd: int) -> bytes | None:
    """The bytes read, if fstat's size is theirs."""
    size = os.fstat(fd).st_size
    data = read_all(fd)
    return data if len(data) == size else None


def mapped_by_child(fd: int) -> tuple[int, str]:
    """(st_size, hash of st_size mapped bytes) as a child process sees the descriptor."""
    child = subprocess.run([sys.executable, "-c", MAP_CHILD, str(fd)], pass_fds=(fd,),
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, f"the mapping's reader died: {child.returncode} {child.stderr}"
    size, digest = child.stdout.split()
    return int(size), digest


def check_held(fd: int, versions: list[bytes]) -> bytes:
    """The held descriptor shows one of ``versions`` whole: fstat's size is its size, and
    read, 200 random preads and a mapping of st_size bytes give its bytes. The version."""
    size = os.fstat(fd).st_size
    shown = [v for v in versions if len(v) == size]
    assert shown, f"fstat says {size} bytes, no version opened has that many"
    want = shown[0]
    assert read_all(fd) == want
    rng = random.Random(size)
    for off in (rng.randrange(size) for _ in range(200)):
        assert os.pread(fd, 4096, off) == want[off:off + 4096]
    assert mapped_by_child(fd) == (size, xxhash.xxh64_hexdigest(want))
    assert os.fstat(fd).st_size == size
    return want


@pytest.fixture
def opened(tmp_path: Path, mount, request: pytest.FixtureRequest
           ) -> Iterator[tuple[Mount, str, bytes]]:
    """(the mount, a file's name, its bytes), for the kind of open ``request.param`` names:
    cached (read once, complete in the cache), a miss (never read), streamed (too big to
    cache) or uncached (a mount with no cache: ``--cache-size 0``)."""
    kind = request.param
    src = tmp_path / "src"
    src.mkdir()
    old = random.Random(kind).randbytes(SIZES[kind])
    (src / "f.bin").write_bytes(old)
    m = mount(src, *(["--cache-size", "0"] if kind == "uncached"
                     else ["--max-file-size", MAX_FILE_SIZE]))
    if kind == "cached":
        assert (m.mountpoint / "f.bin").read_bytes() == old
        wait_for(lambda: m.settled()["cache"]["files"] == 1, "cached")
    yield m, "f.bin", old


@pytest.mark.parametrize("how", CHANGES)
@pytest.mark.parametrize("opened", list(SIZES), indirect=True)
def test_a_held_open_reads_the_file_it_opened(opened: tuple[Mount, str, bytes],
                                              how: str) -> None:
    m, name, old = opened
    path = m.mountpoint / name
    fd = os.open(path, os.O_RDONLY)
    try:
        new = change(m.source, name, how)
        # A file replaced (another inode) leaves the descriptor its own; one rewritten in
        # place (its inode) may show either version, but whole: one read from the source file
        # as it is now shows the new one once the watch saw the change, with no lookup
        versions = [old, new] if how == "rewrite with O_TRUNC" and new else [old]
        if how == "rewrite with O_TRUNC":
            wait_for(lambda: whole_version(fd) in versions, "one version whole")
        check_held(fd, versions)
        if new is not None:  # new opens by path read the new bytes meanwhile
            wait_for(lambda: path.read_bytes() == new, "the new version through the mount")
        else:
            wait_for(lambda: not path.is_file() or path.is_symlink(), "the name gone")
        check_held(fd, versions)
    finally:
        os.close(fd)
    if new is not None:
        assert path.read_bytes() == new
