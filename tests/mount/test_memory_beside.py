"""Memory beside the cache (issue 34): a miss the cache keeps leaves no copy of the source's
pages behind (the cache has the bytes), and one it does not keep leaves its pages to the
kernel's LRU, which serves it again from the memory the cache leaves, as it would without
coordlfs. Residency is the kernel's own count (``fincore``: mincore of the file), for reads
through the mount (with and without FUSE passthrough) and through ``coordlfs.client``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import random_source, run_cli, wait_for

from coordlfs.client.dataset import Dataset
from coordlfs.fs import passthrough
from coordlfs.sizes import pages
from coordlfs.testbed.storage import drop_caches

SMALL = 300_000  # read by the kernel itself under passthrough (up to 1 MiB)
BIG = 3 * 1024 * 1024 + 4321  # streamed by the daemon, or filled in chunks
NAMES = ("kept.small", "kept.big", "other.small", "other.big")
#: both ways the mount can serve: the kernel from a backing file, or the daemon
WAYS = ["no", pytest.param("yes", marks=pytest.mark.skipif(
    passthrough.available() is not None, reason=f"no passthrough: {passthrough.available()}"))]


def resident(path: Path) -> int:
    """Bytes of ``path`` in the page cache, as mincore counts them."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip())


def read_whole(path: Path) -> bytes:
    with path.open("rb", buffering=0) as f:
        return f.read()


def source(tmp_path: Path) -> Path:
    """Two files of each size, on the disk (not tmpfs: its pages are the file)."""
    return random_source(tmp_path, **{"kept.small": SMALL, "kept.big": BIG,
                                      "other.small": SMALL, "other.big": BIG})


@pytest.mark.parametrize("way", WAYS)
def test_a_kept_miss_leaves_no_copy_and_another_leaves_its_pages(mount, tmp_path: Path,
                                                                 way: str) -> None:
    src = source(tmp_path)
    room = pages(SMALL) + pages(BIG)  # the kept files fill it: the others find none
    m = mount(src, "--cache-size", str(room), "--max-file-size", "8M", "--passthrough", way)
    want = {name: (src / name).read_bytes() for name in NAMES}
    drop_caches()
    for name in NAMES:  # in this order: the kept ones take all the room
        assert read_whole(m.mountpoint / name) == want[name]
    status = m.settled()
    assert status["cache"]["files"] == 2
    assert resident(src / "kept.small") == 0
    assert resident(src / "kept.big") == 0
    if way == "yes":  # the kernel's copy is the source's: the only one, left to its LRU
        assert resident(src / "other.small") == pages(SMALL)
        assert resident(src / "other.big") == pages(BIG)
    else:  # the mount's own pages hold what the daemon sent: the source's would be a second
        assert resident(src / "other.small") == 0
        assert resident(src / "other.big") == 0
        assert resident(m.mountpoint / "other.big") == pages(BIG)


@pytest.mark.parametrize("way", WAYS)
def test_the_kept_pages_serve_the_next_read_from_memory(mount, tmp_path: Path,
                                                        way: str) -> None:
    """What the LRU keeps is read again with no storage read and no cache entry."""
    src = source(tmp_path)
    m = mount(src, "--cache-size", "0", "--passthrough", way)
    drop_caches()
    want = (src / "other.big").read_bytes()
    drop_caches()
    assert read_whole(m.mountpoint / "other.big") == want
    first = m.settled()["reads"]["bytes_from_source"]
    assert read_whole(m.mountpoint / "other.big") == want
    reads = m.settled()["reads"]
    assert m.status()["cache"]["files"] == 0
    if way == "yes":  # counted as read from the source, but the kernel had it in memory
        assert resident(src / "other.big") == pages(BIG)
    else:
        assert reads["bytes_from_source"] == first  # the mount's page cache answered


def test_a_client_reads_a_file_the_cache_has_no_room_for_into_the_page_cache(
        mount, tmp_path: Path) -> None:
    src = source(tmp_path)
    m = mount(src, "--cache-size", "0")
    drop_caches()
    want = (src / "other.big").read_bytes()
    drop_caches()
    with Dataset(m.mountpoint) as client:
        assert client.read("other.big") == want
        assert client.stats["direct"] == 1
    assert resident(src / "other.big") == pages(BIG)
    assert m.status()["cache"]["files"] == 0


def _storage_read(pid: int) -> int:
    """Bytes process ``pid`` (all its threads, those ended too) had read from storage."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


@pytest.mark.parametrize("way", WAYS)
def test_a_fill_of_a_file_the_page_cache_holds_copies_its_pages(mount, tmp_path: Path,
                                                               way: str) -> None:
    """A file another process read from the source (a client's direct read, a job beside
    the mount) and the mount then fills (a prefetch): its fill copies those pages, reads no
    storage, and leaves none of them (the cache has the bytes)."""
    src = source(tmp_path)
    m = mount(src, "--max-file-size", "8M", "--passthrough", way)
    drop_caches()
    want = {name: read_whole(src / name) for name in NAMES}  # their pages, as a reader's
    before = _storage_read(m.pid)
    with Dataset(m.mountpoint) as client:
        assert client.prefetch(NAMES) == len(NAMES)
    wait_for(lambda: not ((fills := m.status()["fills"])["queued"] or fills["in_flight"]),
             "the prefetch filled")
    assert m.settled()["cache"]["files"] == len(NAMES)
    assert _storage_read(m.pid) == before
    assert m.status()["reads"]["fill_bytes_from_pages"] == sum(map(len, want.values()))
    assert [resident(src / name) for name in NAMES] == [0] * len(NAMES)
    assert "of it from pages in memory" in run_cli("stats", str(m.mountpoint)).stdout
    drop_caches()
    for name in NAMES:
        assert read_whole(m.mountpoint / name) == want[name]


def test_fincore_counts_what_a_plain_read_leaves(tmp_path: Path) -> None:
    """The check itself: a read of the source is cached by the kernel, a drop empties it."""
    src = source(tmp_path)
    drop_caches()
    assert resident(src / "other.big") == 0
    read_whole(src / "other.big")
    assert resident(src / "other.big") == pages(BIG)
