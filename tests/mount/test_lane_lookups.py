"""LOOKUPs the request lane answers in C (``coordlfs/lane/lookup.c``, ``coordlfs.fs.lane_nodes``)
on real mounts, read through the kernel and compared with the source by xxhash.

A small file the daemon holds nothing for, named in a directory the daemon watches, is looked
up by the lane, which numbers its node; the daemon adopts the node when it meets its number or
key (a LOOKUP of its own, a listing, a watch event). What is checked: a cold epoch's LOOKUPs
are the lane's and the epoch counts as a ``--request-lane no`` mount's; the files cached, the
next epoch is hits in C, and after the kernel dropped the names, hits again; the kernel's
FORGETs of the lane's nodes are taken in C; two names of one file are one inode whoever looked
each up; a directory renamed in the source is followed.
"""

from __future__ import annotations

import os
from pathlib import Path

from conftest import Mount, drop_caches, wait_for
from test_lane_misses import MISS_COUNTERS
from test_request_lane import digest, lane_state, make_source, nothing_open, read_epoch

from coordlfs.cache.stats import difference

#: 24 small files in a directory (the first LOOKUP in it is the daemon's: it watches it then)
SIZES = {f"d/f{n:02d}.bin": 1000 + 977 * n for n in range(24)}
NAMES = sorted(SIZES)


def lane(m: Mount) -> dict[str, int]:
    state = lane_state(m)
    assert state is not None, "the request lane is off"
    return state


def want_of(src: Path) -> dict[str, str]:
    return {name: digest((src / name).read_bytes()) for name in NAMES}


def epoch(m: Mount, want: dict[str, str]) -> dict[str, int]:
    """An epoch read byte-exact, settled: what it counted."""
    before = m.status()["reads"]
    assert read_epoch(m, NAMES) == want
    wait_for(lambda: nothing_open(m), "every open released")
    counted = difference(m.settled()["reads"], before)
    return {k: counted[k] for k in MISS_COUNTERS}


def test_a_cold_epoch_is_looked_up_in_c_and_next_is_hits_in_c(tmp_path: Path, mount,
                                                                needs_lane: None) -> None:
    """Every LOOKUP of a cold epoch but the directory's first is the lane's, byte-exact, and
    the epoch counts as with ``--request-lane no``; each file cached, its node stays the
    lane's and its row an entry's: every open of the next epoch is a hit answered in C. Once
    the kernel dropped the names, its FORGETs take the nodes, and the LOOKUPs of cached
    files are the daemon's (their keys held): the epoch after is hits again."""
    src = make_source(tmp_path, SIZES)
    want = want_of(src)
    counted = {}
    for mode in ("auto", "no"):
        m = mount(src, "--request-lane", mode, "--passthrough", "yes",
                  mountpoint=tmp_path / f"mnt-{mode}")
        counted[mode] = epoch(m, want)
        if mode == "no":
            continue
        assert lane(m)["lookups"] >= len(NAMES) - 1, lane(m)
        assert m.status()["cache"]["files"] == len(NAMES)
        assert lane(m)["nodes"] >= len(NAMES) - 1, "the lane's nodes adopted"
        opens = lane(m)["opens"]
        assert epoch(m, want)["file_hits"] == len(NAMES)
        assert lane(m)["opens"] - opens == len(NAMES), "a hit of the next epoch not in C"
        lookups = lane(m)["lookups"]
        drop_caches()  # the names and inodes go; each is looked up again, by the daemon
        wait_for(lambda m=m: lane(m)["nodes"] == 0, "the lane's nodes forgotten")
        assert epoch(m, want)["file_hits"] == len(NAMES)
        assert lane(m)["lookups"] == lookups, "a cached file's LOOKUP answered by the lane"
    assert counted["auto"] == counted["no"], counted


def test_forgets_of_nodes_never_adopted_are_taken_in_c(tmp_path: Path, mount,
                                                       needs_lane: None) -> None:
    """With ``--cache-size 0`` nothing is cached, so nothing adopts the lane's nodes: the
    kernel's FORGETs of them (drop_caches) are taken in C, every node goes, and the next
    epoch is looked up in C again, byte-exact."""
    src = make_source(tmp_path, SIZES)
    want = want_of(src)
    m = mount(src, "--cache-size", "0", "--passthrough", "yes")
    epoch(m, want)
    assert lane(m)["nodes"] >= len(NAMES) - 1, lane(m)
    drop_caches()
    wait_for(lambda: lane(m)["nodes"] == 0, "the lane's nodes forgotten")
    assert lane(m)["forgets"] > 0
    lookups = lane(m)["lookups"]
    assert epoch(m, want)["file_misses"] == len(NAMES)
    assert lane(m)["lookups"] - lookups >= len(NAMES) - 1


def test_two_names_of_one_file_are_one_inode(tmp_path: Path, mount, needs_lane: None) -> None:
    """Hard links: a name looked up by the lane and another of the same file, looked up by
    the lane or (after the daemon adopted the node) by the daemon, show one inode number,
    and read the same bytes."""
    src = make_source(tmp_path, SIZES)
    os.link(src / NAMES[0], src / "d" / "link-a")
    os.link(src / NAMES[1], src / "d" / "link-b")
    m = mount(src, "--cache-size", "0", "--passthrough", "yes")
    first = os.stat(m.mountpoint / NAMES[0])
    assert os.stat(m.mountpoint / "d" / "link-a").st_ino == first.st_ino
    second = os.stat(m.mountpoint / NAMES[1])
    assert lane(m)["nodes"] >= 1
    # a listing is the daemon's: its entries' inodes are found by key, the lane's adopted
    listed = {entry.name: entry.inode() for entry in os.scandir(m.mountpoint / "d")}
    assert listed["link-b"] == listed[os.path.basename(NAMES[1])] == second.st_ino
    assert os.stat(m.mountpoint / "d" / "link-b").st_ino == second.st_ino
    for a, b in ((NAMES[0], "d/link-a"), (NAMES[1], "d/link-b")):
        assert (m.mountpoint / a).read_bytes() == (m.mountpoint / b).read_bytes()


def test_a_directory_renamed_in_the_source_is_followed(tmp_path: Path, mount,
                                                       needs_lane: None) -> None:
    """Files looked up by the lane, then their directory renamed in the source: the new
    name reads byte-exact, the old one is gone (the watch invalidates it)."""
    src = make_source(tmp_path, SIZES)
    want = want_of(src)
    m = mount(src, "--cache-size", "0", "--passthrough", "yes")
    epoch(m, want)
    os.rename(src / "d", src / "e")
    wait_for(lambda: not (m.mountpoint / "d").exists(), "the old name gone")
    for name in NAMES:
        moved = "e/" + name.split("/", 1)[1]
        assert digest((m.mountpoint / moved).read_bytes()) == want[name], moved
