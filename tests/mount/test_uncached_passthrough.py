"""A file the cache will not keep is read by the kernel from the source file itself, whatever
its size (issue 33, item 3): above ``--max-file-size``, beside a full cache, with
``--cache-size 0``. No READ of it reaches the daemon, by read, pread or mmap, from one reader
or several at once; every byte is the source's; what the kernel read is counted at the last
release (the page cache's share of the file, all of it for a file read whole), and its pages
stay with the kernel's LRU, as no cache keeps them (issue 34). Held opens across changes of
such a file: ``tests/mount/test_held_opens.py`` ("streamed", "uncached")."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import xxhash
from conftest import Mount, random_source, wait_for
from test_passthrough_mount import daemon_reads, needs_passthrough, read_every_way

from coordlfs.cache.stats import difference

#: Over STREAM_WHOLE (the daemon would stream it) and not a whole number of pages.
SIZE = 3 * 1024 * 1024 + 4321
#: Why the cache does not keep ``big.bin``: the mount's options, and what is read first.
WHY = {"above --max-file-size": (["--max-file-size", "1M"], []),
       "the cache full": (["--cache-size", "5M", "--max-file-size", "4M"], ["filler.bin"]),
       "--cache-size 0": (["--cache-size", "0"], [])}


def resident(path: Path) -> int:
    """Bytes of ``path`` in the page cache (fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip())


def drop_pages(path: Path) -> None:
    """The source file's pages dropped: what the mount reads of it, the kernel reads."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@needs_passthrough
@pytest.mark.parametrize("why", list(WHY))
@pytest.mark.parametrize("readers", [1, 4])
def test_a_file_not_kept_is_read_by_the_kernel(tmp_path: Path, mount, why: str,
                                               readers: int) -> None:
    options, first = WHY[why]
    src = random_source(tmp_path, **{"big.bin": SIZE, "filler.bin": 3 << 20})
    want = xxhash.xxh64_hexdigest((src / "big.bin").read_bytes())
    m: Mount = mount(src, "--passthrough", "yes", *options)
    for name in first:
        assert (m.mountpoint / name).read_bytes() == (src / name).read_bytes()
        wait_for(lambda: m.settled()["cache"]["files"] == 1, "filled")
    drop_pages(src / "big.bin")
    before, reads = m.status()["reads"], daemon_reads(m)
    held = os.open(m.mountpoint / "big.bin", os.O_RDONLY)  # one span of opens: counted once
    try:
        with ThreadPoolExecutor(readers) as pool:
            got = list(pool.map(lambda _: read_every_way(m.mountpoint / "big.bin"),
                                range(readers)))
    finally:
        os.close(held)
    assert got == [want] * readers
    assert daemon_reads(m) == reads, "the daemon served reads of a passthrough open"
    # at the last release: the file counted once (read whole); its pages stay with the
    # kernel's LRU, as no cache keeps them (issue 34)
    wait_for(lambda: difference(m.status()["reads"], before)["bytes_from_source"] == SIZE,
             "the file counted, read whole")
    assert resident(src / "big.bin") >= SIZE, "the source's pages were dropped"
    counted = difference(m.status()["reads"], before)
    assert counted["source_opens"] == readers + 1 and counted["passthrough_opens"] == 0, counted
    assert m.status()["cache"]["files"] == len(first)
