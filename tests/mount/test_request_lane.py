"""The request lane (``coordlfs/lane/lane.c``, ``coordlfs.fs.lane``, ``coordlfs.fs.rows``) on
real mounts, read through the kernel and compared with the source by xxhash: cache hits whose
OPEN and RELEASE a thread of the daemon answers in C once the daemon offered their inodes'
rows (docs/design/request-path.md).

Each test reads epochs: the first misses (the files filled into the cache), the second hits the
daemon answers itself (offering each inode's row), the third and later hits the lane answers.
What is checked: the lane's answers are counted as the daemon's own hits would be (the same
counters as a mount with ``--request-lane no``); a source file changed right after the lane
answered it is read new by the very next open, while a handle the lane opened before the
change keeps its version whole; a handle the lane opened outlives its cache entry with no error
and its backing id goes with its last close; ``--request-lane`` yes/no; an aligned group's
members turn the lane off while they exist; many readers at once, and a clean unmount; rows
offered again at LOOKUP after the kernel forgot the inodes. The rows' calls alone, and the
lane's answers on a fake session, are tests/unit/test_lane_rows.py's.
"""

from __future__ import annotations

import errno
import itertools
import json
import mmap
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from conftest import Mount, daemons_of, drop_caches, force_unmount, read_all, run_cli, wait_for

from coordlfs.cache.stats import difference
from coordlfs.system.mounts import mount_at
from coordlfs.system.processes import process_alive

#: The files of a source: sizes that are not whole pages, small ones (a miss the kernel reads
#: from the source itself, backfilled at its close) and one over a fill step (filled by the
#: daemon while its first open reads it, direct_io), some in a directory.
SIZES = {"a.bin": 4097, "b.bin": 112 * 1024 + 17, "c.bin": 300 * 1024 + 5, "d.bin": 1,
         "e.bin": 777 * 1024 + 3, "big.bin": 1536 * 1024 + 4321,
         "sub/f.bin": 65 * 1024 + 9, "sub/g.bin": 200 * 1024 + 1, "sub/deeper/h.bin": 8191}
#: The counters an open answered by passthrough of a cache entry adds to.
HIT_COUNTERS = ("file_hits", "passthrough_opens", "bytes_from_cache", "opened_bytes")


def make_source(tmp_path: Path, sizes: dict[str, int] = SIZES, seed: int = 1) -> Path:
    """``tmp_path/src`` holding a file of seeded random bytes per name in ``sizes``."""
    src = tmp_path / "src"
    rng = random.Random(seed)
    for name, size in sizes.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
    return src


def digest(data: bytes) -> str:
    return xxhash.xxh64_hexdigest(data)


def source_digests(src: Path, names: list[str]) -> dict[str, str]:
    return {name: digest((src / name).read_bytes()) for name in names}


def read_epoch(m: Mount, names: list[str]) -> dict[str, str]:
    """Each file opened once through the mount and read whole by read(2): its digest."""
    out = {}
    for name in names:
        fd = os.open(m.mountpoint / name, os.O_RDONLY)
        try:
            out[name] = digest(read_all(fd))
        finally:
            os.close(fd)
    return out




def lane_state(m: Mount) -> dict[str, int] | None:
    return m.status()["passthrough"]["lane"]


def lane_opens(m: Mount) -> int:
    state = lane_state(m)
    assert state is not None, "the request lane is off"
    return state["opens"]


def epochs_to_rows(m: Mount, names: list[str], want: dict[str, str]) -> None:
    """The first epoch (misses: the files filled into the cache, complete once settled) and
    the second (hits the daemon answers itself, offering each inode's row), byte-exact."""
    assert read_epoch(m, names) == want, "epoch 1 (misses)"
    wait_for(lambda: m.settled()["cache"]["files"] == len(names), "every file cached")
    assert read_epoch(m, names) == want, "epoch 2 (the daemon's hits)"
    m.settled()

def lane_served(tmp: Path, mount, *args: str, **where: Path) -> tuple[Path, list[str],
                                                                     dict[str, str], Mount]:
    """A source of ``SIZES`` mounted by passthrough with ``args``, read until the daemon
    offered its rows (``epochs_to_rows``): the source, its names, their digests, the mount."""
    src = make_source(tmp)
    names = sorted(SIZES)
    want = source_digests(src, names)
    m = mount(src, "--passthrough", "yes", *args, **where)
    epochs_to_rows(m, names, want)
    return src, names, want, m


def nothing_open(m: Mount) -> bool:
    """No inode held by a passthrough open (the lane's included): every close released."""
    return m.status()["passthrough"]["inodes_open_by_passthrough"] == 0


def released_all(m: Mount) -> bool:
    """The lane's answered opens all released (RELEASE comes after close, asynchronously)."""
    state = lane_state(m)
    return state is not None and state["opens"] + state["source_opens"] == state["releases"]


# -- 1. the lane answers, counted as the daemon's hits ---------------------------------------


def three_epochs(m: Mount, names: list[str], want: dict[str, str]) -> list[dict[str, int]]:
    """Epochs 1 (misses), 2 (the daemon's hits) and 3, byte-exact: what each counted. With the
    lane, every open of epoch 3 is its answer, and released by it."""
    lane_on = lane_state(m) is not None
    marks = [m.status()["reads"]]
    assert read_epoch(m, names) == want, "epoch 1 (misses)"
    wait_for(lambda: m.settled()["cache"]["files"] == len(names), "every file cached")
    marks.append(m.status()["reads"])
    assert read_epoch(m, names) == want, "epoch 2 (the daemon's hits)"
    m.settled()
    marks.append(m.status()["reads"])
    at = lane_opens(m) if lane_on else 0
    assert read_epoch(m, names) == want, "epoch 3"
    marks.append(m.status()["reads"])
    if lane_on:
        assert lane_opens(m) - at == len(names), "epoch 3 not all the lane's"
        wait_for(lambda: released_all(m), "the lane's opens released")
    return [difference(later, earlier) for earlier, later in itertools.pairwise(marks)]


def test_the_third_epoch_is_answered_by_the_lane_and_counted_as_hits(
        tmp_path: Path, mount, needs_lane: None) -> None:
    """Epoch 1 misses, epoch 2 the daemon's hits (rows offered), epoch 3 the lane's: every
    one of its N opens answered in C, every file byte-exact. The mount's counters of each
    epoch are those of a mount with ``--request-lane no`` reading the same epochs: the lane's
    opens count as cache hits by passthrough, with their files' bytes from the cache. Stats
    show the lane's counts. An open for writing is left to the daemon (EROFS), and the lane
    answers the next read-only open."""
    src = make_source(tmp_path)
    names = sorted(SIZES)
    want = source_digests(src, names)
    total = sum(SIZES.values())
    counted = {}
    for mode in ("auto", "no"):
        m = mount(src, "--request-lane", mode, "--passthrough", "yes",
                  mountpoint=tmp_path / f"mnt-{mode}")
        assert (lane_state(m) is None) == (mode == "no")
        counted[mode] = three_epochs(m, names, want)
        third = counted[mode][2]
        assert {k: third[k] for k in HIT_COUNTERS} == {
            "file_hits": len(names), "passthrough_opens": len(names),
            "bytes_from_cache": total, "opened_bytes": total}, (mode, third)
        assert third["file_misses"] == third["read_hits"] == third["read_misses"] == 0, third
        if mode == "auto":
            assert ("request lane on: hits, small misses and their lookups are answered in C"
                    in m.log.read_text())
            state = lane_state(m)
            assert state is not None
            stats = run_cli("stats", "--json", str(m.mountpoint))
            assert json.loads(stats.stdout)["passthrough"]["lane"] == state, stats
            assert (f"; {state['opens'] + state['source_opens']} of them answered in C by the "
                    "request lane"
                    in run_cli("stats", str(m.mountpoint)).stdout)
            # an open for writing is the daemon's to refuse; the row answers on
            for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_APPEND):
                with pytest.raises(OSError) as refused:
                    os.close(os.open(m.mountpoint / names[0], flags))
                assert refused.value.errno == errno.EROFS, flags
            assert lane_opens(m) == state["opens"]
            assert read_epoch(m, names[:1]) == {names[0]: want[names[0]]}
            assert lane_opens(m) == state["opens"] + 1
        force_unmount(m.mountpoint, m.pid)
    for epoch, (with_lane, without) in enumerate(zip(counted["auto"], counted["no"],
                                                     strict=True), 1):
        assert with_lane == without, f"epoch {epoch}: counted otherwise with the lane"


# -- 2. freshness: a new open after a change, and a handle held across it ---------------------

#: A child that maps the descriptor it is given, ``st_size`` bytes: the size and their hash
#: (a SIGBUS is the child's death, seen as such, not the test's).
MAP_CHILD = """
import mmap, os, sys, xxhash
fd = int(sys.argv[1])
size = os.fstat(fd).st_size
with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
    print(size, xxhash.xxh64_hexdigest(mapped[:]))
"""


def mapped_by_child(fd: int) -> tuple[int, str]:
    child = subprocess.run([sys.executable, "-c", MAP_CHILD, str(fd)], pass_fds=(fd,),
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, f"the mapping's reader died: {child.returncode} {child.stderr}"
    size, hashed = child.stdout.split()
    return int(size), hashed


def check_whole(fd: int, want: bytes) -> None:
    """``fd`` shows ``want`` whole: fstat's size, read, 200 random preads, a mapping of
    st_size bytes in a child, a mapping here."""
    assert os.fstat(fd).st_size == len(want)
    assert read_all(fd) == want
    rng = random.Random(len(want))
    for off in (rng.randrange(len(want)) for _ in range(200)):
        assert os.pread(fd, 4096, off) == want[off:off + 4096]
    assert os.pread(fd, 4096, len(want)) == b""
    assert mapped_by_child(fd) == (len(want), digest(want))
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
        assert mapped[:] == want
    assert os.fstat(fd).st_size == len(want)


def change_source(path: Path, how: str) -> bytes:
    """Rewrite the source file: in place with as many new bytes (its inode, size and name
    stay: only mtime and ctime tell), in place longer (truncated and rewritten), or a longer
    file renamed over it. The new bytes."""
    size = path.stat().st_size
    if how == "in place, same size":
        new = os.urandom(size)
        with path.open("r+b") as f:
            f.write(new)
    elif how == "in place, longer":
        new = os.urandom(size + 5000)
        with path.open("wb") as f:  # O_TRUNC: the same inode, its bytes replaced
            f.write(new)
    else:
        new = os.urandom(size + 5000)
        (path.parent / "next").write_bytes(new)
        os.rename(path.parent / "next", path)
    return new


def open_read(path: Path) -> tuple[bytes, int]:
    """``path`` opened, read whole, its fstat size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_all(fd), os.fstat(fd).st_size
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", ["c.bin", "big.bin"])
@pytest.mark.parametrize("how", ["in place, same size", "rename over, longer"])
def test_a_file_changed_right_after_the_lane_answered_it(tmp_path: Path, mount,
                                                          needs_lane: None, how: str,
                                                          name: str) -> None:
    """The lane answered every open of epoch 3 and one held after it; then the source file
    changes. The very next open through the mount reads the new bytes (the lane checks the
    source's version at every open, no waiting for the watch), and the lane does not answer
    it; the handle the lane opened before the change reads the old version whole, by read,
    pread and mappings of its size, and fstat shows the old size (after a change in place a
    reopen of its inode through /proc/self/fd too). Afterwards every file is
    byte-exact, and the new version is answered by the lane too once the daemon has offered
    its row."""
    src, names, want, m = lane_served(tmp_path, mount)
    old = (src / name).read_bytes()
    before = lane_opens(m)
    assert read_epoch(m, names) == want, "epoch 3"
    held = os.open(m.mountpoint / name, os.O_RDONLY)
    try:
        assert lane_opens(m) - before == len(names) + 1, "epoch 3 and the held open"
        new = change_source(src / name, how)
        at = lane_opens(m)
        assert open_read(m.mountpoint / name) == (new, len(new)), "the next open"
        assert lane_opens(m) == at, "the lane answered an open of a changed file"
        check_whole(held, old)
        assert open_read(m.mountpoint / name) == (new, len(new))
        if how.startswith("in place"):  # its inode stands for the old version now
            again = os.open(f"/proc/self/fd/{held}", os.O_RDONLY)  # a reopen of that inode
            try:
                check_whole(again, old)
            finally:
                os.close(again)
        check_whole(held, old)
    finally:
        os.close(held)
    wait_for(lambda: nothing_open(m), "every open released")
    want[name] = digest(new)
    m.settled()
    assert read_epoch(m, names) == want, "epoch 4"  # the new version cached: a daemon's hit
    m.settled()
    at = lane_opens(m)
    assert read_epoch(m, names) == want, "epoch 5"
    assert lane_opens(m) - at == len(names), "epoch 5 not all the lane's"
    assert "with no row" not in m.log.read_text()


# -- 3. a held open outlives its cache entry -------------------------------------------------


def ids_and_files(m: Mount) -> tuple[int, int]:
    """The mount's backing ids and cached files."""
    status = m.status()
    return status["passthrough"]["backing_ids"], status["cache"]["files"]


def held_through_a_drop(m: Mount, name: str, how: str, held_first: bool
                        ) -> list[tuple[int, int]]:
    """``name`` held open while its source changes and the next opens read the new version
    (its entry dropped, the new one cached and hit), then reopened through /proc/self/fd
    (the daemon's open, beside the held one); the two closed, the held one first or last,
    each read whole before: the old version. The backing ids and files at each step: held,
    changed, everything closed."""
    src = m.source
    old = (src / name).read_bytes()
    lane_on = lane_state(m) is not None
    at = lane_opens(m) if lane_on else 0
    steps = []
    opened = [os.open(m.mountpoint / name, os.O_RDONLY)]
    try:
        if lane_on:
            assert lane_opens(m) - at == 1, "the held open was not the lane's"
        steps.append(ids_and_files(m))
        new = change_source(src / name, how)
        assert open_read(m.mountpoint / name) == (new, len(new)), "the next open"
        m.settled()  # the new version filled (backfilled at the close just made)
        assert open_read(m.mountpoint / name) == (new, len(new)), "its hit"
        wait_for(lambda: m.status()["passthrough"]["inodes_open_by_passthrough"] == 1,
                 "only the held open left")
        steps.append(ids_and_files(m))
        check_whole(opened[0], old)
        opened.append(os.open(f"/proc/self/fd/{opened[0]}", os.O_RDONLY))
        if not held_first:
            opened.reverse()
        while opened:
            check_whole(opened[0], old)
            os.close(opened.pop(0))
    finally:
        for fd in opened:
            os.close(fd)
    wait_for(lambda: nothing_open(m), "every open released")
    steps.append(ids_and_files(m))
    return steps


@pytest.mark.parametrize("held_first", [True, False], ids=["held closed first",
                                                          "reopen closed first"])
@pytest.mark.parametrize("how", ["in place, same size", "in place, longer"])
def test_a_held_open_outlives_its_dropped_entry(tmp_path: Path, mount, needs_lane: None,
                                                 how: str, held_first: bool) -> None:
    """A file held open (by the lane, or by the daemon with ``--request-lane no``) while its
    source changes and the cache drops its entry (the next open meets the new version), then
    closed: no ERROR in the daemon's log (the test's log check), the held handle reads the
    old version whole to the end, and so does a reopen of its inode through /proc/self/fd
    (an open the daemon answers beside the held one), whichever is closed first; the mount's
    backing ids go back down once everything is closed: step by step the same as without
    the lane. (A file renamed over keeps its old key's entry, so its id, with or
    without the lane: not a drop.)"""
    name = "e.bin"
    seen = {}
    for mode in ("auto", "no"):
        src, names, want, m = lane_served(tmp_path / mode, mount, "--request-lane", mode,
                                          mountpoint=tmp_path / f"mnt-{mode}")
        seen[mode] = held_through_a_drop(m, name, how, held_first)
        want[name] = digest((src / name).read_bytes())
        assert read_epoch(m, names) == want
        m.settled()
        log = m.log.read_text()
        assert "with no row" not in log
        assert f"source file {name} changed; dropping its cache entry" in log
        force_unmount(m.mountpoint, m.pid)
    assert seen["auto"] == seen["no"]
    # the old entry's id kept while held, beside the new version's; closed, only the latter
    assert [ids for ids, _files in seen["auto"]] == [len(SIZES), len(SIZES) + 1,
                                                     len(SIZES)], seen


# -- 4. --request-lane yes and no --------------------------------------------------------------




def test_yes_without_passthrough_is_refused(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """``--request-lane yes --passthrough no``: the lane answers passthrough opens only, so
    the mount is refused in one line naming why, with a non-zero exit, leaving no mount, no
    daemon and no cache directory."""
    src = make_source(tmp_path, {"f.bin": 4096})
    log = tmp_path / "mount.log"
    daemon_logs.append(log)
    mnt, cache = tmp_path / "mnt", Path("/dev/shm") / f"coordlfs-test-lane-{os.getpid()}"
    mnt.mkdir()
    try:
        out = run_cli("mount", str(src), str(mnt), "--cache-dir", str(cache), "--log", str(log),
                      "--passthrough", "no", "--request-lane", "yes")
        assert out.returncode != 0, out
        assert out.stderr.splitlines() == [
            "coordlfs: --request-lane yes: it answers passthrough opens, and passthrough "
            "is off"], out
        assert mount_at(str(mnt)) is None and not cache.exists()
        wait_for(lambda: not daemons_of(mnt), "gone: the daemon that refused")
    finally:
        force_unmount(mnt, None)


def test_no_leaves_the_lane_off(tmp_path: Path, mount, needs_lane: None) -> None:
    """``--request-lane no`` with passthrough on: the status's lane is None (stats say it is
    off), the log says "request lane off" once (INFO, as asked), and hits are the daemon's
    passthrough opens, byte-exact."""
    src = make_source(tmp_path)
    names = sorted(SIZES)
    want = source_digests(src, names)
    m = mount(src, "--passthrough", "yes", "--request-lane", "no")
    state = m.status()["passthrough"]
    assert state["on"] and state["lane"] is None, state
    epochs_to_rows(m, names, want)
    before = m.status()["reads"]
    assert read_epoch(m, names) == want
    reads = difference(m.status()["reads"], before)
    assert reads["passthrough_opens"] == reads["file_hits"] == len(names), reads
    assert m.status()["passthrough"]["lane"] is None
    logged = [line for line in m.log.read_text().splitlines() if "request lane" in line]
    assert len(logged) == 1 and " INFO " in logged[0], logged
    assert logged[0].endswith("request lane off: off (--request-lane no)"), logged
    stats = json.loads(run_cli("stats", "--json", str(m.mountpoint)).stdout)
    assert stats["passthrough"]["lane"] is None, stats["passthrough"]
    assert "from the source; request lane off" in run_cli("stats", str(m.mountpoint)).stdout


# -- 5. an aligned group's members see every open ---------------------------------------------

#: A member of group g: joins, tells the group its files and epoch 0, reads every file once
#: (each open moves its position in the group's order: what the group must see), prints
#: their digests and its position once done, leaves.
MEMBER = r"""
import json, os, sys, xxhash
from coordlfs.control import Control
mount, names = sys.argv[1], sys.argv[2:]
control = Control(mount)
member = control.join_group("g")["member"]
control.register_files(member, names)
control.start_epoch(member, 0)
out = {}
for name in names:
    with open(os.path.join(mount, name), "rb") as f:
        out[name] = xxhash.xxh64_hexdigest(f.read())
me = [m for m in control.status()["groups"]["g"]["members"] if m["id"] == member]
control.leave_group(member)
print(json.dumps({"digests": out, "position": me[0]["position"]}))
"""


def test_a_group_member_turns_the_lane_off_while_it_exists(tmp_path: Path, mount,
                                                          needs_lane: None) -> None:
    """While an aligned group has a member (a process of its own: the test's opens are not
    the member's), every open comes to the daemon: the lane answers none, and reads are
    byte-exact hits by passthrough; a second member's own opens move its position in the
    group's order to the last file (what the lane's answers would hide from the group), and
    read byte-exact. Once the members leave, the lane answers every open again. The same after
    a member whose process died is reaped."""
    _src, names, want, m = lane_served(tmp_path, mount)
    at = lane_opens(m)
    assert read_epoch(m, names) == want
    assert lane_opens(m) - at == len(names), "the lane answers before the member joins"
    member_process = subprocess.Popen(["sleep", "600"])
    try:
        member = m.control.join_group("g", pid=member_process.pid)["member"]
        at = lane_opens(m)
        assert read_epoch(m, names) == want, "with a member"
        assert lane_opens(m) == at, "the lane answered an open while a member exists"
        m.settled()
        at, before = lane_opens(m), m.status()["reads"]
        out = subprocess.run([sys.executable, "-c", MEMBER, str(m.mountpoint), *names],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["digests"] == want, "the member's own reads"
        assert result["position"] == len(names) - 1, "the group did not see every open"
        reads = difference(m.status()["reads"], before)
        assert reads["file_hits"] == reads["passthrough_opens"] == len(names), reads
        assert lane_opens(m) == at, "the lane answered a member's open"
        for epoch in range(2):
            at, before = lane_opens(m), m.status()["reads"]
            assert read_epoch(m, names) == want, f"epoch {epoch} with a member"
            assert lane_opens(m) == at, "the lane answered an open while a member exists"
            reads = difference(m.status()["reads"], before)
            assert reads["file_hits"] == reads["passthrough_opens"] == len(names), reads
            m.settled()
        m.control.leave_group(member)
        assert m.status()["groups"] == {}
        at = lane_opens(m)
        assert read_epoch(m, names) == want
        assert lane_opens(m) - at == len(names), "the lane does not answer after the leave"
        # a member whose process dies: reaped by the daemon's sweep (every second), then the
        # lane answers again
        m.control.join_group("g", pid=member_process.pid)
        at = lane_opens(m)
        assert read_epoch(m, names) == want
        assert lane_opens(m) == at, "the lane answered an open while a member exists"
    finally:
        member_process.kill()
        member_process.wait()
    wait_for(lambda: m.status()["groups"] == {}, "the dead member reaped")
    at = lane_opens(m)
    assert read_epoch(m, names) == want
    assert lane_opens(m) - at == len(names), "the lane does not answer after the reap"


# -- 6. many readers at once, and a clean unmount ----------------------------------------------

#: A reader: every file read whole twice through the mount, in its own order; the digests of
#: each round, as JSON.
READER = r"""
import json, os, random, sys, xxhash
mount, seed, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rounds = []
for round_ in range(2):
    order = list(names)
    random.Random(seed * 2 + round_).shuffle(order)
    got = {}
    for name in order:
        with open(os.path.join(mount, name), "rb", buffering=0) as f:
            got[name] = xxhash.xxh64_hexdigest(f.read())
    rounds.append(got)
print(json.dumps(rounds))
"""
READERS = 4
#: Seconds an unmount of an idle mount may take, daemon exit included: far above the usual
#: fraction of a second, far below the 30 s ``coordlfs umount`` waits.
QUICK_UNMOUNT_S = 10.0


@pytest.mark.parametrize("threads", [1, 2])
def test_many_readers_at_once_then_a_clean_unmount(tmp_path: Path, mount, needs_lane: None,
                                                   threads: int) -> None:
    """Four processes at once each read every file twice (their own orders) on a mount whose
    rows were offered: every read byte-exact, every open the lane's (lane.opens grows by the
    opens made, and the releases follow), counted as hits. Then ``coordlfs umount`` returns
    at once, the daemon exits, the mount and its cache are gone, the lane's threads with it."""
    src = make_source(tmp_path)
    names = sorted(SIZES)
    want = source_digests(src, names)
    m = mount(src, "--passthrough", "yes", "--request-lane", "yes",
              "--lane-threads", str(threads))
    epochs_to_rows(m, names, want)
    at, before = lane_state(m), m.status()["reads"]
    assert at is not None
    readers = [subprocess.Popen([sys.executable, "-c", READER, str(m.mountpoint), str(seed),
                                 *names], stdout=subprocess.PIPE, text=True)
               for seed in range(READERS)]
    outs = [reader.communicate(timeout=120)[0] for reader in readers]
    assert [reader.returncode for reader in readers] == [0] * READERS
    for out in outs:
        assert json.loads(out) == [want, want]
    opens = READERS * 2 * len(names)
    assert lane_opens(m) - at["opens"] == opens, "not every open the lane's"
    wait_for(lambda: released_all(m), "the lane's opens released")
    reads = difference(m.status()["reads"], before)
    assert reads["file_hits"] == reads["passthrough_opens"] == opens, reads
    assert reads["bytes_from_cache"] == READERS * 2 * sum(SIZES.values()), reads
    stats = json.loads(run_cli("stats", "--json", str(m.mountpoint)).stdout)
    # (each read of the status opens the control file: an isatty ioctl more each)
    assert {**stats["passthrough"]["lane"], "ioctls": 0} == {**lane_state(m), "ioctls": 0}
    started = time.monotonic()
    out = run_cli("umount", str(m.mountpoint))
    took = time.monotonic() - started
    assert out.returncode == 0, out
    assert took < QUICK_UNMOUNT_S, f"coordlfs umount took {took:.1f} s"
    assert not process_alive(m.pid), "the daemon is still running"
    assert mount_at(str(m.mountpoint)) is None and not m.cache_dir.exists()
    assert f"unmounted {m.mountpoint}" in m.log.read_text()


# -- rows offered at LOOKUP ---------------------------------------------------------------------


def test_rows_come_back_at_lookup_after_the_kernel_forgot_the_inodes(
        tmp_path: Path, mount, needs_lane: None) -> None:
    """Rows go with the inodes the kernel forgets (drop_caches here, memory pressure in
    life); the next walk looks each name up again, and the daemon offers the row of a
    complete entry's inode there: the very next epoch is the lane's, byte-exact."""
    _src, names, want, m = lane_served(tmp_path, mount)
    wait_for(lambda: nothing_open(m), "every open released")
    known = m.status()["inodes"]
    drop_caches()  # the kernel forgets the files' inodes (FORGET comes after, in batches)
    wait_for(lambda: m.status()["inodes"] <= known - len(names), "the files' inodes forgotten")
    at = lane_opens(m)
    assert read_epoch(m, names) == want
    assert lane_opens(m) - at == len(names), "the epoch after the forgets not all the lane's"


def test_a_file_cached_after_its_last_release_is_a_hit_in_c_at_its_next_open(
        tmp_path: Path, mount, needs_lane: None) -> None:
    """A small file read once (a miss) is cached after its last release; the kernel keeps
    its name, so no LOOKUP comes before its next open: the row is offered when the cache
    completes the entry (``LaneRows.completed``), and the next epoch's opens are all the
    lane's, byte-exact, counted as hits. The daemon keeps nothing of its own per row."""
    small = {name: size for name, size in SIZES.items() if size <= 1 << 20}
    src = make_source(tmp_path, small)
    names = sorted(small)
    want = source_digests(src, names)
    m = mount(src, "--passthrough", "yes")
    for name in names:
        os.lstat(m.mountpoint / name)  # the names the kernel keeps, before the epoch
    assert read_epoch(m, names) == want
    wait_for(lambda: m.settled()["cache"]["files"] == len(names), "every file cached")
    wait_for(lambda: nothing_open(m), "every open released")
    at, hits = lane_opens(m), m.status()["reads"]["file_hits"]
    assert read_epoch(m, names) == want
    assert lane_opens(m) - at == len(names), "a file cached after its release not the lane's"
    assert m.status()["reads"]["file_hits"] - hits == len(names)
    assert m.status()["passthrough"]["lane"]["rows"] >= len(names)


def test_rows_follow_a_directory_renamed_in_the_source(tmp_path: Path, mount,
                                                       needs_lane: None) -> None:
    """A directory renamed in the source (the files in it unchanged: same inode, size and
    times): the rows of the files beneath still name the old paths, so the lane leaves
    their next opens to the daemon, which finds them under the new path and offers the rows
    again with it (a longer path: the row's memory replaced, the open the lane answered
    before and still held kept in its count); from then on the lane answers them, and the
    held open's release too."""
    src, names, want, m = lane_served(tmp_path, mount)
    at = lane_opens(m)
    held = os.open(m.mountpoint / "sub" / "f.bin", os.O_RDONLY)
    try:
        assert lane_opens(m) == at + 1, "the held open not the lane's"
        os.rename(src / "sub", src / "sub-renamed-to-a-longer-name")
        moved = [name.replace("sub/", "sub-renamed-to-a-longer-name/", 1) for name in names]
        want = {new: want[old] for old, new in zip(names, moved, strict=True)}
        under = sum(name.startswith("sub/") for name in names)
        at = lane_opens(m)
        assert read_epoch(m, moved) == want
        assert lane_opens(m) - at == len(names) - under, "rows of the old paths answered"
        at = lane_opens(m)
        assert read_epoch(m, moved) == want
        assert lane_opens(m) - at == len(names), "the rows did not follow the new paths"
        check_whole(held, (src / "sub-renamed-to-a-longer-name" / "f.bin").read_bytes())
    finally:
        os.close(held)
    wait_for(lambda: released_all(m), "every open the lane answered released by it")
