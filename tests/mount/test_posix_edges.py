"""POSIX edges that tools meet: ``.`` and ``..`` in listings, trees deeper than PATH_MAX."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import xxhash

#: 50 directories of 100-byte names: 5,050 bytes of path, more than PATH_MAX (4,096).
DEPTH, NAME = 50, "n" * 99


def ls(*args: str | Path) -> str:
    return subprocess.run(["ls", *map(str, args)], check=True, capture_output=True,
                          text=True, env={"LC_ALL": "C", "PATH": os.environ["PATH"]}).stdout


def test_listings_hold_dot_and_dotdot_as_in_the_source(dataset, mount) -> None:
    src, _files = dataset
    m = mount(src)
    assert ls("-a1", m.mountpoint).split("\n")[:2] == [".", ".."]
    assert ls("-a1", m.mountpoint / "class0") == ls("-a1", src / "class0")
    # `ls -la` of a directory below the root: same total, same lines (inode numbers aside)
    assert ls("-la", m.mountpoint / "class0") == ls("-la", src / "class0")
    assert sorted(os.listdir(m.mountpoint)) == sorted(os.listdir(src))  # no . or .. there


def make_deep(root: Path) -> bytes:
    """DEPTH nested directories with a file at the bottom, made with directory descriptors
    (the whole path is too long for one call); returns the file's bytes."""
    data = os.urandom(20_000)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(DEPTH):
            name = f"{level % 10}{NAME}"
            os.mkdir(name, dir_fd=fd)
            below = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        out = os.open("bottom.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        try:
            assert os.write(out, data) == len(data)
            os.setxattr(out, "user.tag", b"deep")
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return data


def read_deep(root: Path) -> bytes:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(DEPTH):
            below = os.open(f"{level % 10}{NAME}", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        out = os.open("bottom.bin", os.O_RDONLY, dir_fd=fd)
        try:
            assert os.getxattr(out, "user.tag") == b"deep"  # xattrs reach it too
            return os.read(out, 1 << 20)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def tar_digest(root: Path) -> str:
    """xxhash of a tar of ``deep`` under ``root``: names, attributes and every byte."""
    tar = subprocess.run(["tar", "cf", "-", "--sort=name", "-C", str(root), "deep"],
                         capture_output=True, check=True)
    return xxhash.xxh64_hexdigest(tar.stdout)


def test_a_tree_deeper_than_path_max_reads_as_in_the_source(tmp_path: Path, mount) -> None:
    src = tmp_path / "src"
    (src / "deep").mkdir(parents=True)
    data = make_deep(src / "deep")
    m = mount(src)
    assert read_deep(m.mountpoint / "deep") == data
    assert tar_digest(m.mountpoint) == tar_digest(src)
    status = m.status()
    assert status["reads"]["file_misses"] >= 1
