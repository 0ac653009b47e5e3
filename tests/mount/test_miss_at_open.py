"""Misses chosen at open (``Readers.opened``): with passthrough, a small file is read by the
kernel from the source file itself and the cache copies it behind those reads; without, a
file of one fill step is filled before the open returns and then read like a hit. Byte-exact
under concurrent readers of one file, a source rewritten while it is being filled, and with
no room at all.
Runs with passthrough on and off (``COORDLFS_TEST_PASSTHROUGH``): the counters that differ
are checked only where passthrough is on."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import xxhash
from conftest import digests, drop_caches, random_source, read_at_once


def daemon_reads(reads: dict[str, int]) -> int:
    return reads["read_hits"] + reads["read_misses"]


def test_readers_opening_one_cold_file_at_once_share_one_storage_read(mount,
                                                                      tmp_path: Path) -> None:
    src = random_source(tmp_path, image=300_000)
    data = (src / "image").read_bytes()
    m = mount(src)
    drop_caches()
    assert all(out == data for out in read_at_once(m.mountpoint / "image", 16))
    status = m.status()
    reads = status["reads"]
    assert reads["bytes_from_source"] == len(data)
    assert reads["file_hits"] + reads["file_misses"] == 16  # an open each
    if status["passthrough"]["on"]:  # every open the kernel's, from the source or the cache
        assert reads["passthrough_opens"] + reads["source_opens"] == 16
        assert daemon_reads(reads) == 0


def test_a_file_rewritten_while_it_is_filled_is_never_kept_torn(mount, tmp_path: Path) -> None:
    """A writer rewrites the file in place, as fast as it can, while readers open it through
    the mount (each open a fill or a hit); every fill that overlapped a write is given up
    (its final fstat shows another version). Once the writer stops, the mount serves the
    source's last bytes, and the entry kept for them is right."""
    src = tmp_path / "src"
    src.mkdir()
    path = src / "image"
    size = 600_000
    path.write_bytes(b"\0" * size)
    m = mount(src)
    stop = threading.Event()

    def rewrite() -> None:
        n = 0
        with open(path, "r+b", buffering=0) as f:
            while not stop.is_set():
                n += 1
                f.seek(0)
                for _ in range(6):  # in pieces: a reader may see a torn file, the cache not
                    f.write(bytes([n % 251]) * (size // 6))

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        deadline = time.monotonic() + 2
        opens = 0
        while time.monotonic() < deadline:
            (m.mountpoint / "image").read_bytes()
            opens += 1
    finally:
        stop.set()
        writer.join()
    final = os.urandom(size)
    path.write_bytes(final)
    for _ in range(3):  # the fill, then hits of the entry kept (or misses, until it is)
        assert (m.mountpoint / "image").read_bytes() == final
    assert opens > 1
    assert m.settled()["cache"]["bytes"] == size


def test_files_no_cache_keeps_are_read_byte_exact_by_many_readers(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i in range(40):
        (src / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 4}" / f"f{i}").write_bytes(os.urandom(50_000 + 997 * i))
    (src / "big").write_bytes(os.urandom(5 << 20))
    want = digests(src)
    m = mount(src, "--cache-size", "0")
    drop_caches()
    names = sorted(want)
    readers = [subprocess.Popen(["cat", *(str(m.mountpoint / n) for n in names)],
                                stdout=subprocess.PIPE) for _ in range(4)]
    expected = b"".join((src / n).read_bytes() for n in names)
    for r in readers:
        out = r.communicate()[0]
        assert xxhash.xxh64_hexdigest(out) == xxhash.xxh64_hexdigest(expected)
    assert digests(m.mountpoint) == want
    status = m.status()
    reads = status["reads"]
    assert status["cache"]["files"] == 0
    if status["passthrough"]["on"]:  # the kernel read the small source files, not the daemon
        small = len(names) - 1
        assert reads["source_opens"] >= small and reads["file_misses"] >= small
