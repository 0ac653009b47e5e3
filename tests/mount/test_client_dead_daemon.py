"""coordlfs.client after its daemon dies or stops: it maps the cache still, but a daemon that
no longer runs cannot withdraw a file whose source changes, so within ``STALE_AFTER_S`` of
its last moment the client serves no hit more: it reads through the mount (a killed
daemon's answers ENOTCONN) or, where its direct-read rules allow, from the source."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import pytest
from test_freshness import eventually

from coordlfs.cache.published import STALE_AFTER_S
from coordlfs.client.dataset import Dataset
from coordlfs.system.processes import wait_exit

#: A file of it fits a cache of ``SMALL_CACHE`` once, and is larger than what is left after.
SIZE = 700_000
SMALL_CACHE = ("--cache-size", "1M", "--max-file-size", "1M")


def _cached(m, ds: Dataset, name: str, old: bytes) -> None:
    """Read ``name`` until it is a hit, also after an idle spell past the bound: the
    daemon's beat keeps a live daemon's index trusted."""
    assert bytes(ds.read(name)) == old
    eventually(lambda: m.status()["shared"]["published"] == 1, "published")
    time.sleep(STALE_AFTER_S + 0.5)

    def a_hit() -> bool:
        hits = ds.stats["hits"]
        return bytes(ds.read(name)) == old and ds.stats["hits"] == hits + 1

    eventually(a_hit, "a hit after an idle spell longer than the bound")


def _past_the_bound(since: float) -> None:
    """Sleep until ``STALE_AFTER_S`` after ``since`` (a time.monotonic() taken after the
    daemon's last beat can have happened)."""
    time.sleep(max(0.0, since + STALE_AFTER_S - time.monotonic()))


def test_a_killed_daemons_client_reads_through_the_dead_mount(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    old = os.urandom(SIZE)
    (src / "a.bin").write_bytes(old)
    m = mount(src)  # torn down lazily after: the fixture unmounts a dead mount too
    with Dataset(m.mountpoint) as ds:
        _cached(m, ds, "a.bin", old)
        os.kill(m.pid, signal.SIGKILL)
        assert wait_exit(m.pid, 15)
        dead = time.monotonic()
        (src / "a.bin").write_bytes(os.urandom(SIZE))  # in place: same inode, same size
        _past_the_bound(dead)
        with pytest.raises(OSError) as raised:  # never the old bytes
            ds.read("a.bin")
        assert raised.value.errno == errno.ENOTCONN


def test_a_stopped_daemons_client_reads_the_source_where_it_may(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    old = os.urandom(SIZE)
    (src / "a.bin").write_bytes(old)
    m = mount(src, *SMALL_CACHE)
    with Dataset(m.mountpoint) as ds:
        _cached(m, ds, "a.bin", old)  # the room left is less than its size
        os.kill(m.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            new = os.urandom(SIZE)
            (src / "a.bin").write_bytes(new)
            _past_the_bound(stopped)
            direct = ds.stats["direct"]
            assert bytes(ds.read("a.bin")) == new  # from the source: the mount would wait
            assert ds.stats["direct"] == direct + 1
        finally:
            os.kill(m.pid, signal.SIGCONT)  # before the close reports through the mount
