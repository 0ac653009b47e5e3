"""A full cache's misses answered by the request lane, on real mounts, read through the kernel
and compared with the source by xxhash.

A no-eviction cache smaller than its dataset is full after the first epoch, and every later
epoch's misses are the files it had no room for. Their opens are the lane's (a source row
``Keep.LATER``: read from the source, handed to the cache at a last release only if the room
has come back), not the daemon's, however the row came: offered at a LOOKUP or a listing while
the cache was full for the file, kept after a note the cache had no room for, or offered after
an open the daemon answered itself. What is checked: each later epoch is all the lane's and
counts as a ``--request-lane no`` mount's; room that comes back (entries dropped) is filled
again.
"""

from __future__ import annotations

import os
from pathlib import Path

from conftest import Mount
from test_lane_misses import counted_epoch, source_opens
from test_request_lane import lane_opens, lane_state, make_source, read_epoch, source_digests

from coordlfs.cache.cache import FILL_CHUNK
from coordlfs.fs.rows import NOTE_HEADROOM
from coordlfs.sizes import pages

#: 24 files of 3 pages each; the cache below holds 12 of them
SMALL_SIZES = {f"d/f{n:02d}.bin": 12_000 + n for n in range(24)}
SMALL_CACHE = 12 * pages(12_100)


def answered(m: Mount) -> int:
    """Opens the lane answered so far (0 with it off)."""
    return 0 if lane_state(m) is None else lane_opens(m) + source_opens(m)


def later_epoch(m: Mount, names: list[str], want: dict[str, str]) -> tuple[int, dict[str, int]]:
    """An epoch, byte-exact: how many of its opens the lane answered, and what it counted."""
    at = answered(m)
    counted = counted_epoch(m, names, want)
    return answered(m) - at, counted


def test_a_full_caches_misses_are_the_lanes(tmp_path: Path, mount, needs_lane: None) -> None:
    """The cache is within the headroom from the start, so the daemon answers the first
    epoch's opens until it is full (reserving each at its open); from then on the files it has
    no room for are the lane's: each later epoch is answered in C, hits and misses, and counts
    as with ``--request-lane no``."""
    src = make_source(tmp_path, SMALL_SIZES)
    names = sorted(SMALL_SIZES)
    want = source_digests(src, names)
    later = {}
    for mode in ("auto", "no"):
        m = mount(src, "--request-lane", mode, "--passthrough", "yes", "--cache-size",
                  str(SMALL_CACHE), mountpoint=tmp_path / f"mnt-{mode}")
        counted_epoch(m, names, want)
        assert m.settled()["cache"]["files"] == 12
        for epoch in (2, 3):
            in_c, later[mode, epoch] = later_epoch(m, names, want)
            if mode == "auto":
                assert in_c == len(names), f"epoch {epoch}: {in_c} opens in C"
            assert later[mode, epoch]["file_hits"] == 12, later[mode, epoch]
    assert later["auto", 2] == later["no", 2] and later["auto", 3] == later["no", 3], later


def test_room_that_comes_back_is_filled_again(tmp_path: Path, mount, needs_lane: None) -> None:
    """Two cached files shrink to a byte in the source: their entries go, and the room they
    leave takes one more file. The lane's rows of the files the cache was full for leave
    their next open to the daemon, which reserves one of them at its open."""
    src = make_source(tmp_path, SMALL_SIZES)
    names = sorted(SMALL_SIZES)
    m = mount(src, "--passthrough", "yes", "--cache-size", str(SMALL_CACHE))
    want = source_digests(src, names)
    counted_epoch(m, names, want)
    assert m.settled()["cache"]["files"] == 12
    for name in names[:2]:  # cached: the first twelve read
        (src / name).write_bytes(b"x")
    want = source_digests(src, names)
    assert read_epoch(m, names[:2]) == {name: want[name] for name in names[:2]}
    for _ in range(2):  # the rows step aside at a last release; the daemon's open reserves
        counted_epoch(m, names, want)
    assert m.settled()["cache"]["files"] == 13


def test_files_noted_past_the_room_stay_the_lanes(tmp_path: Path, mount,
                                                  needs_lane: None) -> None:
    """A listing offers every file's row while the cache has room for all of them (with the
    headroom), so the first epoch hands the cache more files than it can take: those it
    cannot reserve stay the lane's (read from the source), and the next epoch is all in C."""
    count = (NOTE_HEADROOM >> 20) + 6
    sizes = {f"f{n:03d}.bin": FILL_CHUNK - 4096 - n for n in range(count)}
    src = make_source(tmp_path, sizes)
    names = sorted(sizes)
    want = source_digests(src, names)
    capacity = NOTE_HEADROOM + 2 * FILL_CHUNK
    m = mount(src, "--passthrough", "yes", "--cache-size", str(capacity))
    assert len(os.listdir(m.mountpoint)) == count  # READDIRPLUS: rows, no LOOKUP
    at = source_opens(m)
    counted_epoch(m, names, want)
    assert source_opens(m) - at == count, "the first epoch's misses not all the lane's"
    cached = m.settled()["cache"]["files"]
    assert 0 < cached < count
    in_c, counted = later_epoch(m, names, want)
    assert in_c == count, f"{in_c} of {count} opens in C"
    assert counted["file_hits"] == cached and counted["file_misses"] == count - cached
