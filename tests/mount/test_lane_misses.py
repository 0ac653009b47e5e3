"""Small misses the request lane answers (its source rows, ``coordlfs.fs.rows``) on real
mounts, read through the kernel and compared with the source by xxhash.

A small file the cache does not hold is offered to the lane at its LOOKUP: the lane opens the
source file at the first OPEN, registers it as the backing the kernel reads, and at the last
RELEASE closes the id and hands the file to the daemon, which copies the pages the reads
brought in into the cache (docs/design/request-path.md). What is checked: an epoch of misses is
all the lane's, byte-exact, counted as a mount with ``--request-lane no`` counts its misses,
and cached for the next epoch; with no cache to keep files, every epoch is the lane's and
nothing is kept; a file changed between its LOOKUP and its OPEN is read new; an open the
daemon decides while the lane holds opens of the inode joins them (the lane's backing becomes
the daemon's), and once all are closed no backing id or descriptor is left.
"""

from __future__ import annotations

import os
from pathlib import Path

from conftest import Mount, read_all, run_cli, wait_for
from test_request_lane import (
    SIZES,
    change_source,
    digest,
    lane_state,
    make_source,
    nothing_open,
    read_epoch,
    released_all,
    source_digests,
)

from coordlfs.cache.cache import FILES, FILL_CHUNK
from coordlfs.cache.stats import difference
from coordlfs.client import Dataset

#: The counters an epoch of misses adds to, whoever answers its opens.
MISS_COUNTERS = ("file_hits", "file_misses", "source_opens", "passthrough_opens",
                 "bytes_from_source", "bytes_from_cache", "opened_bytes")
#: The files the lane answers: small ones (one over a fill step is the daemon's, filled as
#: it is read)
SMALL = sorted(name for name, size in SIZES.items() if size <= FILL_CHUNK)


def source_opens(m: Mount) -> int:
    state = lane_state(m)
    assert state is not None, "the request lane is off"
    return state["source_opens"]


def source_files_open(m: Mount) -> list[str]:
    """The source's files the daemon holds descriptors of."""
    fds = Path(f"/proc/{m.pid}/fd")
    held = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith(f"{m.source}/"):
            held.append(target)
    return sorted(held)


def entry_files(m: Mount) -> int:
    """The files in the cache's entries' directory (a copy the cache did not keep leaves
    none)."""
    return len(os.listdir(Path(m.status()["cache"]["directory"]) / FILES))


def counted_epoch(m: Mount, names: list[str], want: dict[str, str]) -> dict[str, int]:
    """An epoch read byte-exact, settled (its files handed to the cache): what it counted."""
    before = m.status()["reads"]
    assert read_epoch(m, names) == want
    wait_for(lambda: lane_state(m) is None or released_all(m), "the lane's opens released")
    after = m.settled()["reads"]
    counted = difference(after, before)
    return {k: counted[k] for k in MISS_COUNTERS}


def test_an_epoch_of_misses_is_the_lanes_and_is_cached(tmp_path: Path, mount,
                                                        needs_lane: None) -> None:
    """Every small file's first open is answered by the lane, byte-exact; the epoch counts as
    a ``--request-lane no`` mount's does (misses read by the kernel from the source, their
    bytes from the source); each file is then in the cache (copied there by the lane's
    copier), and the next epoch is hits."""
    src = make_source(tmp_path)
    want = source_digests(src, SMALL)
    counted = {}
    for mode in ("auto", "no"):
        m = mount(src, "--request-lane", mode, "--passthrough", "yes",
                  mountpoint=tmp_path / f"mnt-{mode}")
        at = source_opens(m) if mode == "auto" else 0
        counted[mode] = counted_epoch(m, SMALL, want)
        if mode == "auto":
            assert source_opens(m) - at == len(SMALL), "the misses were not all the lane's"
            state = lane_state(m)
            assert state["copies"] == state["copies_named"] == len(SMALL), state
        status = m.settled()
        assert status["cache"]["files"] == len(SMALL), status["cache"]
        if mode == "auto":  # each copy named and registered by the copier: the entry's
            assert status["passthrough"]["backing_ids"] == len(SMALL), status["passthrough"]
        assert entry_files(m) == len(SMALL)
        second = counted_epoch(m, SMALL, want)
        assert second["file_hits"] == len(SMALL) and second["file_misses"] == 0, second
    total = sum(SIZES[name] for name in SMALL)
    assert counted["auto"] == counted["no"] == {
        "file_hits": 0, "file_misses": len(SMALL), "source_opens": len(SMALL),
        "passthrough_opens": 0, "bytes_from_source": total, "bytes_from_cache": 0,
        "opened_bytes": total}, counted


def test_without_a_cache_every_epoch_is_the_lanes(tmp_path: Path, mount,
                                                   needs_lane: None) -> None:
    """With ``--cache-size 0`` a small file is read from the source at every open: the lane
    answers them all, epoch after epoch, and nothing is cached or waited for."""
    src = make_source(tmp_path)
    want = source_digests(src, SMALL)
    m = mount(src, "--cache-size", "0", "--passthrough", "yes")
    for epoch in range(3):
        at = source_opens(m)
        counted = counted_epoch(m, SMALL, want)
        assert source_opens(m) - at == len(SMALL), f"epoch {epoch + 1}"
        assert counted["file_misses"] == len(SMALL), counted
    status = m.settled()
    assert status["cache"]["files"] == 0 and status["cache"]["filling"] == 0, status["cache"]


def test_a_file_changed_between_lookup_and_open_is_read_new(tmp_path: Path, mount,
                                                            needs_lane: None) -> None:
    """The lane's row is offered at LOOKUP (a stat through the mount) for the version seen
    then; changed in place before the open, the file is read new, and so is its next open
    from the cache."""
    src = make_source(tmp_path)
    m = mount(src, "--passthrough", "yes")
    for name, how in (("b.bin", "in place, same size"), ("a.bin", "in place, longer"),
                      ("sub/f.bin", "rename over, longer")):
        (m.mountpoint / name).stat()  # the LOOKUP: its row offered
        new = change_source(src / name, how)
        for _ in range(2):
            fd = os.open(m.mountpoint / name, os.O_RDONLY)
            try:
                assert digest(read_all(fd)) == digest(new), name
                assert os.fstat(fd).st_size == len(new)
            finally:
                os.close(fd)
            m.settled()


def test_an_open_the_daemon_decides_joins_the_lanes(tmp_path: Path, mount,
                                                     needs_lane: None) -> None:
    """A file held open by the lane's answer, changed in place, then reopened through
    /proc/self/fd: the lane no longer answers that version, the daemon does, with the backing
    the lane's opens read (the kernel's one backing per inode). Both read the file as the
    source holds it (a source file read by the kernel is read as it is now), whichever is
    closed first; then no backing id and no descriptor of the source are left."""
    src = make_source(tmp_path)
    m = mount(src, "--passthrough", "yes")
    fds_before = source_files_open(m)
    for first in (0, 1):
        name = ("b.bin", "c.bin")[first]
        at = source_opens(m)
        opened = [os.open(m.mountpoint / name, os.O_RDONLY)]
        try:
            assert source_opens(m) - at == 1, "the held open was not the lane's"
            new = change_source(src / name, "in place, same size")
            opened.append(os.open(f"/proc/self/fd/{opened[0]}", os.O_RDONLY))
            assert source_opens(m) - at == 1, "the reopen was the lane's"
            for fd in opened:
                assert read_all(fd) == new
            os.close(opened.pop(first))
            assert read_all(opened[0]) == new
        finally:
            for fd in opened:
                os.close(fd)
        wait_for(lambda: nothing_open(m), "every open released")
        status = m.settled()
        # no inode held; the ids kept are the complete entries' (each file backfilled here
        # is offered to the lane with its entry's id, kept for later hits)
        assert status["passthrough"]["inodes_open_by_passthrough"] == 0, status["passthrough"]
        assert status["passthrough"]["backing_ids"] <= first + 1, status["passthrough"]
    wait_for(lambda: source_files_open(m) == fds_before,
             "the daemon's descriptors of source files back to what they were")
    assert "with no row" not in m.log.read_text()


def test_files_read_just_before_an_unmount_are_kept(tmp_path: Path, mount,
                                                    needs_lane: None) -> None:
    """The lane hands its files to the cache a few ms after their last close; an unmount
    right after the reads still keeps every one of them (the daemon takes what the lane has
    before it drains its fills), and the next mount over the kept cache serves them as
    hits."""
    src = make_source(tmp_path)
    want = source_digests(src, SMALL)
    m = mount(src, "--passthrough", "yes", "--keep-cache")
    assert read_epoch(m, SMALL) == want
    assert run_cli("umount", str(m.mountpoint)).returncode == 0  # at once
    again = mount(src, "--passthrough", "yes", mountpoint=m.mountpoint, cache_dir=m.cache_dir)
    assert again.settled()["cache"]["files"] == len(SMALL)
    assert read_epoch(again, SMALL) == want
    assert again.status()["reads"]["file_hits"] == len(SMALL)


def test_files_listed_then_opened_are_the_lanes(tmp_path: Path, mount,
                                                needs_lane: None) -> None:
    """A job that lists its dataset first (ImageFolder's scandir) opens each file with no
    LOOKUP: the kernel holds the names READDIRPLUS gave it. Their rows are offered as they
    are listed, so the first epoch's misses are the lane's."""
    src = make_source(tmp_path)
    names = sorted(name for name in SMALL if "/" not in name)
    want = source_digests(src, names)
    m = mount(src, "--passthrough", "yes")
    listed = {entry.name for entry in os.scandir(m.mountpoint) if entry.is_file()}
    assert listed == set(names) | {"big.bin"}
    assert lane_state(m)["rows"] == len(names)  # the small files, none of them looked up
    at = source_opens(m)
    counted = counted_epoch(m, names, want)
    assert source_opens(m) - at == len(names), "the listed files' misses were not the lane's"
    assert counted["file_misses"] == len(names), counted


def test_a_prefetch_right_after_a_read_reads_storage_once(tmp_path: Path, mount,
                                                          needs_lane: None) -> None:
    """Files the lane's opens just read, handed over before the daemon took them: a
    ``prefetch`` of them at once fills none of them again (counted as cached), and each is
    read from storage once, by its reader."""
    src = make_source(tmp_path)
    want = source_digests(src, SMALL)
    m = mount(src, "--passthrough", "yes")
    with Dataset(m.mountpoint) as ds:
        assert read_epoch(m, SMALL) == want
        ds.prefetch(SMALL)
        status = m.settled()
    assert status["cache"]["files"] == len(SMALL), status["cache"]
    total = sum(SIZES[name] for name in SMALL)
    assert status["reads"]["bytes_from_source"] == total, status["reads"]
    assert read_epoch(m, SMALL) == want
