"""FUSE passthrough through the patched pyfuse3 (``scripts/setup``), on a minimal filesystem
(``passthrough_fs.py``), not the product: a file whose open registers a backing file is read
through the kernel byte-exact, by read, pread and mmap, with zero READ requests reaching the
daemon, while a file served the classic way next to it does reach it."""

from __future__ import annotations

import json
import mmap
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import force_unmount

from coordlfs.fs import passthrough

FS = Path(__file__).with_name("passthrough_fs.py")
SIZE = 3 * 1024 * 1024 + 4321  # not a whole number of pages or of FUSE reads

pytestmark = pytest.mark.skipif(passthrough.available() is not None,
                                reason=f"no FUSE passthrough: {passthrough.available()}")


def read_every_way(path: Path, data: bytes) -> None:
    """The whole file by read, 200 random 4 KiB preads, and the whole file by mmap."""
    rng = random.Random(7)
    with path.open("rb", buffering=0) as f:
        whole = f.read()
        offsets = [rng.randrange(SIZE) for _ in range(200)]
        preads = b"".join(os.pread(f.fileno(), 4096, off) for off in offsets)
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            by_mmap = bytes(mapped)
    expected = b"".join(data[off:off + 4096] for off in offsets)
    assert whole == data
    assert preads == expected
    assert by_mmap == data


def test_a_backed_file_reads_byte_exact_with_no_read_at_the_daemon(tmp_path: Path) -> None:
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    data = random.Random(1).randbytes(SIZE)
    (src / "backed.bin").write_bytes(data)
    (src / "served.daemon").write_bytes(data)
    fs = subprocess.Popen([sys.executable, str(FS), str(src), str(mnt)], stdout=subprocess.PIPE,
                          text=True, start_new_session=True)
    try:
        assert fs.stdout is not None and fs.stdout.readline() == "ready\n"
        read_every_way(mnt / "backed.bin", data)
        with (mnt / "served.daemon").open("rb") as f:
            assert f.read() == data
        fs.send_signal(signal.SIGTERM)
        out, _ = fs.communicate(timeout=30)
    finally:
        force_unmount(mnt, fs.pid)
    reads = json.loads(out)
    assert reads.get("backed.bin", 0) == 0
    assert reads["served.daemon"] > 0
