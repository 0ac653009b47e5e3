"""A filling and a full cache's misses answered by the request lane, on real mounts, read
through the kernel and compared with the source by xxhash.

A no-eviction cache smaller than its dataset fills in the first epoch and is full after it:
every later epoch's misses are the files it had no room for. A small file's opens are the
lane's whatever the room (a source row ``Keep.ROOM``): its file is handed to the cache at a
last release the room takes it at, the room the daemon tells the lane at every change less
the files handed and not reserved yet; else it stays the lane's, read from the source. What is
checked: the first epoch fills the cache exactly, through the lane alone; each later epoch is
all the lane's, counted as a ``--request-lane no`` mount counts it; files handed past the
room stay the lane's; room that comes back (entries dropped) is filled again.
"""

from __future__ import annotations

import os
from pathlib import Path

from conftest import Mount
from test_lane_misses import counted_epoch, source_opens
from test_request_lane import lane_opens, lane_state, make_source, read_epoch, source_digests

from coordlfs.cache.cache import FILL_CHUNK
from coordlfs.sizes import pages

#: 24 files of 3 pages each; the cache below holds 12 of them
SMALL_SIZES = {f"d/f{n:02d}.bin": 12_000 + n for n in range(24)}
SMALL_CACHE = 12 * pages(12_100)


def answered(m: Mount) -> int:
    """Opens the lane answered so far (0 with it off)."""
    return 0 if lane_state(m) is None else lane_opens(m) + source_opens(m)


def lane_epoch(m: Mount, names: list[str], want: dict[str, str]) -> tuple[int, dict[str, int]]:
    """An epoch, byte-exact and settled: how many of its opens the lane answered, and what
    it counted."""
    at = answered(m)
    counted = counted_epoch(m, names, want)
    return answered(m) - at, counted


def test_a_filling_and_a_full_caches_misses_are_the_lanes(tmp_path: Path, mount,
                                                          needs_lane: None) -> None:
    """The first epoch's opens are all the lane's (but the directory's first LOOKUP) and
    fill the cache to its last file; each later epoch is answered in C, hits and misses, and
    counts as with ``--request-lane no``."""
    src = make_source(tmp_path, SMALL_SIZES)
    names = sorted(SMALL_SIZES)
    want = source_digests(src, names)
    counted = {}
    for mode in ("auto", "no"):
        m = mount(src, "--request-lane", mode, "--passthrough", "yes", "--cache-size",
                  str(SMALL_CACHE), mountpoint=tmp_path / f"mnt-{mode}")
        for epoch in (1, 2, 3):
            in_c, counted[mode, epoch] = lane_epoch(m, names, want)
            if mode == "auto":
                assert in_c == len(names), f"epoch {epoch}: {in_c} opens in C"
            assert m.settled()["cache"]["files"] == 12
        assert counted[mode, 2]["file_hits"] == 12, counted
    assert all(counted["auto", e] == counted["no", e] for e in (1, 2, 3)), counted


def test_room_that_comes_back_is_filled_again(tmp_path: Path, mount, needs_lane: None) -> None:
    """Two cached files shrink to a byte in the source: their entries go, and the room they
    leave takes one more file, which the lane hands over at its next last release."""
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
    in_c, _ = lane_epoch(m, names[2:], {name: want[name] for name in names[2:]})
    assert in_c == len(names) - 2
    assert m.settled()["cache"]["files"] == 13


def test_files_handed_past_the_room_stay_the_lanes(tmp_path: Path, mount,
                                                   needs_lane: None) -> None:
    """Files listed (READDIRPLUS: rows, no LOOKUP) and all held open at once are each
    promised to the cache at their first open while the room takes them beside the others:
    more than it has, or just as much. Those the room no longer takes at their release stay
    the lane's, read from the source, and the next epoch is all in C."""
    count = 10
    sizes = {f"f{n:02d}.bin": FILL_CHUNK - 4096 * n for n in range(count)}
    src = make_source(tmp_path, sizes)
    names = sorted(sizes)
    want = source_digests(src, names)
    m = mount(src, "--passthrough", "yes", "--cache-size", str(4 * FILL_CHUNK))
    assert len(os.listdir(m.mountpoint)) == count
    at = source_opens(m)
    held = [os.open(m.mountpoint / name, os.O_RDONLY) for name in names]
    try:
        read = {name: read_epoch(m, [name])[name] for name in names}
    finally:
        for fd in held:
            os.close(fd)
    assert read == want
    assert source_opens(m) - at == 2 * count, "the first epoch's opens not all the lane's"
    assert m.settled()["cache"]["files"] == 4
    in_c, counted = lane_epoch(m, names, want)
    assert in_c == count, f"{in_c} of {count} opens in C"
    assert counted["file_hits"] == 4 and counted["file_misses"] == count - 4, counted
