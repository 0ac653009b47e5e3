"""A large directory listed through a real mount: the names byte for byte, their types, the
kernel's seekdir/telldir, and no inode per entry past the attributed head."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

from coordlfs.fs import listing

ENTRIES = 20_000


def name_of(i: int) -> bytes:
    """Names of many lengths (up to NAME_MAX), some not UTF-8, some with spaces or newlines."""
    if i % 5000 == 0:
        return b"%d" % i + b"L" * (255 - len(b"%d" % i))
    return b"e%d%s%s" % (i, b"-" * (i % 50), (b"\xff", b" x", b"\n", b"")[i % 4])


def make_source(tmp_path: Path) -> tuple[Path, bytes]:
    src = tmp_path / "src"
    big = os.fsencode(src / "big")
    os.makedirs(big)
    fd = os.open(big, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(ENTRIES):
            os.close(os.open(name_of(i), os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
        os.mkdir(b"a directory", dir_fd=fd)
        os.symlink(b"e1-\xff", b"a link", dir_fd=fd)
    finally:
        os.close(fd)
    return src, big


def test_a_large_directory_lists_byte_exact_with_types_and_no_inode_per_entry(
        mount, tmp_path: Path) -> None:
    src, big = make_source(tmp_path)
    m = mount(src)
    listed = os.fsencode(m.mountpoint / "big")
    names = os.listdir(listed)
    assert len(names) == len(set(names)) == ENTRIES + 2
    assert sorted(names) == sorted(os.listdir(big))
    with os.scandir(listed) as it:
        kinds = {e.name: (e.is_dir(follow_symlinks=False), e.is_symlink(), e.inode())
                 for e in it}
    assert kinds[b"a directory"][:2] == (True, False)
    assert kinds[b"a link"][:2] == (False, True)
    assert sum(not d and not s for d, s, _ino in kinds.values()) == ENTRIES
    # the kernel holds no inode of the names listed past the head: the daemon counts few
    assert m.status()["inodes"] < ENTRIES // 2
    # an entry listed by name only has the source's d_ino, and looks up and reads as usual
    last = name_of(ENTRIES - 1)
    assert kinds[last][2] == os.lstat(os.path.join(big, last)).st_ino
    assert os.lstat(os.path.join(listed, last)).st_size == 0
    assert os.readlink(os.path.join(listed, b"a link")) == b"e1-\xff"
    # ls -f lists in the source's order (the dots first): the same lines, sorted
    out = [subprocess.run(["ls", "-f", d], capture_output=True, check=True).stdout
           for d in (listed, big)]
    assert sorted(out[0].split(b"\n")) == sorted(out[1].split(b"\n"))


def test_seekdir_back_to_a_telldir_position_resumes_there(mount, tmp_path: Path) -> None:
    """libc's telldir/seekdir through the kernel: offsets the mount gave, past the head and
    past a buffer, resume at the same entry, as in the source."""
    src, _big = make_source(tmp_path)
    m = mount(src)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.opendir.restype = ctypes.c_void_p
    libc.opendir.argtypes = (ctypes.c_char_p,)
    libc.readdir.restype = ctypes.c_void_p
    libc.readdir.argtypes = libc.telldir.argtypes = libc.closedir.argtypes = (ctypes.c_void_p,)
    libc.telldir.restype = ctypes.c_long
    libc.seekdir.argtypes = (ctypes.c_void_p, ctypes.c_long)
    name_at = 19  # struct dirent64 on x86-64 and aarch64: d_ino, d_off, d_reclen, d_type

    def read(d: int, count: int) -> list[bytes]:
        names = []
        for _ in range(count):
            entry = libc.readdir(d)
            assert entry, "the listing ended early"
            names.append(ctypes.string_at(entry + name_at))
        return names

    d = libc.opendir(os.fsencode(m.mountpoint / "big"))
    assert d
    try:
        marks = (listing.ATTRIBUTED + 1234, 17, 3 * listing.ATTRIBUTED)
        for mark in marks:
            libc.seekdir(d, 0)
            read(d, mark)
            position = libc.telldir(d)
            after = read(d, 500)
            read(d, 2000)
            libc.seekdir(d, position)
            assert read(d, 500) == after, mark
    finally:
        libc.closedir(d)
