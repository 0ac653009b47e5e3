"""coordlfs.client reads misses the cache has no room for from the source itself: the same
bytes as the source, counted; a symlink on the way, a file the mount's modes refuse and a
mount with peers send the read through the mount, which answers as it always did."""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import OTHER_UID, drop_caches, force_unmount, run_cli, wait_for
from test_client import client_digests, every_file
from test_control_security import as_user

from coordlfs.cache.published import IndexReader
from coordlfs.client.dataset import Dataset
from coordlfs.control import Control, ControlError
from coordlfs.testbed.cgroup import memory_cgroup

#: A cache of a few dataset files (~110 KB each): nearly every miss has no room.
SMALL_CACHE = "1M"


def test_misses_the_cache_has_no_room_for_are_read_from_the_source(mount, dataset) -> None:
    source, _sizes = dataset
    names, expected, total = every_file(source)
    m = mount(source, "--cache-size", SMALL_CACHE)
    with Dataset(m.mountpoint) as ds:
        assert client_digests(ds, names) == expected
        first = ds.stats
        # a miss read by the kernel is backfilled at its RELEASE, which comes after the close
        # returned: counted cached once no fill is left (11 misses for 10 cached under load)
        wait_for(lambda: m.status()["cache"]["filling"] == 0, "the misses cached")
        cached = m.status()["cache"]["files"]
        # through the mount: only files that fitted, and each of them it cached
        assert 0 < first["misses"] <= cached
        assert first["direct"] == len(names) - first["misses"] > 0
        assert first["bytes_direct"] + first["bytes_from_mount"] == total
        assert client_digests(ds, names) == expected  # again: hits and direct reads
        second = ds.stats
        assert second["hits"] - first["hits"] == cached
        assert second["misses"] == first["misses"]
    reads = m.status()["reads"]
    assert reads["client_direct"] == second["direct"]
    assert reads["client_bytes_direct"] == second["bytes_direct"]
    # each file of each pass counted once: a hit from shared memory, a miss through the mount
    # or from the source directly
    assert reads["file_hits"] + reads["file_misses"] == 2 * len(names)
    assert reads["file_hits"] == second["hits"]
    # the mount's bytes from the source hold the clients' direct reads
    assert reads["bytes_from_source"] == total + second["bytes_direct"] - first["bytes_direct"]
    shown = run_cli("stats", str(m.mountpoint)).stdout
    assert f"{second['direct']} (" in shown and "from the source directly" in shown


def _big_source(tmp_path: Path) -> Path:
    """Files larger than SMALL_CACHE: no read of them is ever cached."""
    src = tmp_path / "src"
    (src / "real").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(3 << 20))
    (src / "real" / "x.bin").write_bytes(os.urandom(2 << 20 | 77))
    (src / "link").symlink_to("real")
    return src


def test_a_file_changed_after_a_direct_read_reads_new(mount, tmp_path: Path) -> None:
    src = _big_source(tmp_path)
    m = mount(src, "--cache-size", SMALL_CACHE)
    with Dataset(m.mountpoint) as ds:
        assert bytes(ds.read("a.bin")) == (src / "a.bin").read_bytes()
        new = os.urandom(3 << 20)
        with open(src / "a.bin", "r+b") as f:  # in place, same size
            f.write(new)
        assert bytes(ds.read("a.bin")) == new
        replacement = tmp_path / "a.new"
        replacement.write_bytes(b"shorter")
        os.rename(replacement, src / "a.bin")
        assert bytes(ds.read("a.bin")) == b"shorter"  # fits the cache: through the mount
        assert ds.stats["direct"] == 2 and ds.stats["misses"] == 1


def test_a_path_through_a_symlink_goes_through_the_mount(mount, tmp_path: Path) -> None:
    src = _big_source(tmp_path)
    m = mount(src, "--cache-size", SMALL_CACHE)
    with Dataset(m.mountpoint) as ds:
        data = (src / "real" / "x.bin").read_bytes()
        assert bytes(ds.read("link/x.bin")) == data  # the mount shows the link: it follows
        assert ds.stats["direct"] == 0 and ds.stats["misses"] == 1
        assert bytes(ds.read("real/x.bin")) == data
        assert ds.stats["direct"] == 1
        with pytest.raises(FileNotFoundError):
            ds.read("real/none.bin")
        with pytest.raises(IsADirectoryError):
            ds.read("real")


def test_a_mount_with_peers_never_reads_directly(mount, tmp_path: Path) -> None:
    from test_metrics import free_port

    src = _big_source(tmp_path)
    listen, absent = free_port(), free_port()
    m = mount(src, "--cache-size", SMALL_CACHE, "--insecure", "--listen",
              f"127.0.0.1:{listen}", "--peers", f"127.0.0.1:{listen},127.0.0.1:{absent}")
    with Dataset(m.mountpoint) as ds:
        assert bytes(ds.read("a.bin")) == (src / "a.bin").read_bytes()
        assert bytes(ds.read("real/x.bin")) == (src / "real" / "x.bin").read_bytes()
        assert ds.stats["direct"] == 0 and ds.stats["misses"] == 2


# -- another user ---------------------------------------------------------------------------

_ACL_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_NO_ID = 0xFFFFFFFF


def _grant_by_acl(path: Path, uid: int, bits: int) -> None:
    """Owner rwx, named user ``uid`` ``bits``, nobody else (the mask shows as the group's
    bits: not the others')."""
    entries = [(_USER_OBJ, 7, _NO_ID), (_USER, bits, uid), (_GROUP_OBJ, 0, _NO_ID),
               (_MASK, bits, _NO_ID), (_OTHER, 0, _NO_ID)]
    value = struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)
    os.setxattr(path, "system.posix_acl_access", value)


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="coordlfs-direct-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _read_each(mountpoint: str, names: list[str]) -> dict:
    """As another user: each file's bytes' length or the error's name, and the counts."""
    with Dataset(mountpoint) as ds:
        return _results(ds, names)


def _results(ds: Dataset, names: list[str]) -> dict:
    results: dict[str, int | str] = {}
    for name in names:
        try:
            results[name] = len(bytes(ds.read(name)))
        except OSError as e:
            results[name] = type(e).__name__
    return {"shared": ds.shared, "results": results, "stats": ds.stats}


def _mount_direct(name: str) -> str:
    try:
        with open(name, "rb") as f:
            return str(len(f.read()))
    except OSError as e:
        return type(e).__name__


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_user_gets_what_the_mount_gives(mount, reachable: Path) -> None:
    """The other user may map the index here (the cache directory opened to them), so the
    client would read directly: a file the source refuses them, one an ACL grants them but
    the mount's modes refuse (the mount shows modes, not ACLs), and one in a directory an
    ACL lets them search but the mount's modes do not, all get the mount's EACCES; a file
    they may read comes directly."""
    src = reachable / "src"
    src.mkdir()
    src.chmod(0o755)
    files = {"open.bin": 0o644, "closed.bin": 0o600, "acl.bin": 0o600}
    for name, mode in files.items():
        (src / name).write_bytes(os.urandom(2 << 20))
        (src / name).chmod(mode)
    _grant_by_acl(src / "acl.bin", OTHER_UID, 4)
    (src / "dir").mkdir(mode=0o700)
    (src / "dir" / "in.bin").write_bytes(os.urandom(2 << 20))
    (src / "dir" / "in.bin").chmod(0o644)
    _grant_by_acl(src / "dir", OTHER_UID, 5)
    files["dir/in.bin"] = 0o644
    cache = reachable / "cache"
    mountpoint = reachable / "mnt"
    try:
        m = mount(src, "--allow-other", "--cache-size", SMALL_CACHE, mountpoint=mountpoint,
                  cache_dir=cache)
        cache.chmod(0o755)
        (cache / "published").chmod(0o644)
        (cache / "files").chmod(0o755)
        names = sorted(files)
        by_mount = as_user(OTHER_UID, lambda: [_mount_direct(str(mountpoint / n))
                                               for n in names])
        assert by_mount == ["PermissionError", "PermissionError", "PermissionError",
                            str(2 << 20)]
        seen = as_user(OTHER_UID, lambda: _read_each(str(mountpoint), names))
        assert seen["shared"]
        assert seen["results"] == {"acl.bin": "PermissionError",
                                   "closed.bin": "PermissionError",
                                   "dir/in.bin": "PermissionError", "open.bin": 2 << 20}
        assert seen["stats"]["direct"] == 1
        with Dataset(mountpoint) as ds:  # root's: reads everything directly
            assert ds.read("acl.bin") and ds.stats["direct"] == 1
            # a forked child that became another user: checked as that user
            inherited = as_user(OTHER_UID, lambda: _results(ds, names))
        assert inherited["results"] == seen["results"]
        force_unmount(mountpoint, m.pid)
    finally:
        force_unmount(mountpoint, None)


def test_reports_of_direct_reads_are_checked(mount, dataset) -> None:
    source, _sizes = dataset
    m = mount(source)
    control = Control(m.mountpoint)
    for bad in (-1, "3", True, 1 << 61):
        with pytest.raises(ControlError, match=r'"direct" must be (an integer|a count)'):
            control.request("client.report", hits=0, misses=0, bytes_from_cache=0,
                            bytes_from_mount=0, direct=bad)
    # an older client's report, without them
    control.request("client.report", hits=1, misses=0, bytes_from_cache=5, bytes_from_mount=0)
    control.request("client.report", hits=0, misses=0, bytes_from_cache=0,
                    bytes_from_mount=0, direct=2, bytes_direct=7)
    reads = m.status()["reads"]
    assert (reads["client_hits"], reads["client_direct"], reads["client_bytes_direct"]) == (1, 2, 7)
    assert (reads["file_hits"], reads["file_misses"], reads["bytes_from_source"]) == (1, 2, 7)


def test_a_prefetch_hands_over_the_tail_that_fits_and_the_head_is_read_directly(
        mount, dataset) -> None:
    """With room for part of a cold order, the fills take its last files (their room is
    promised to them) while a reader reads the first ones from the source: of the first
    ones, through the mount go only files that fit in what the tail leaves, less than one
    file (and of the tail, those the reader gets to before their fills: they are marked);
    the cache ends up holding the whole tail."""
    source, _sizes = dataset
    names, expected, total = every_file(source)
    m = mount(source, "--cache-size", str(total // 2))
    # one hands the order over, another reads (a sampler and a DataLoader's worker)
    with Dataset(m.mountpoint) as planner, Dataset(m.mountpoint) as ds:
        queued = planner.prefetch(names)
        assert 0 < queued < len(names)
        assert client_digests(ds, names) == expected
        first = ds.stats
        head = names[:len(names) - queued]
        head_bytes = sum((source / n).stat().st_size for n in head)
        largest = max((source / n).stat().st_size for n in names)
        assert head_bytes - first["bytes_direct"] < largest  # the head's through the mount
        assert len(head) - first["misses"] <= first["direct"] <= len(head)
        deadline = time.monotonic() + 30
        while (fills := m.status()["fills"])["queued"] or fills["in_flight"]:
            assert time.monotonic() < deadline, fills
            time.sleep(0.05)
        assert m.status()["cache"]["files"] >= queued
        assert client_digests(ds, names) == expected  # the tail hits, the head is direct
        assert ds.stats["hits"] - first["hits"] >= queued


def _noting(m) -> int:
    """Files the request lane's opens read and has not handed to the cache yet (none
    without the lane: passthrough off, ``--request-lane no``)."""
    return (m.status()["passthrough"].get("lane") or {}).get("noting", 0)


def test_files_handed_over_are_never_read_directly(mount, dataset) -> None:
    """A reader that gets to files of the tail handed over before their fills do reads them
    through the mount, which serves them from their fill (or fills them itself): read
    directly, they were read from storage by the reader and again by their fill (the demo's
    client read 1.02-1.10 of its dataset in a cold epoch). The index marks them, so this
    holds for a reader other than the process that handed them over (a DataLoader's worker
    and its sampler). The daemon's reads are throttled to 1 MB/s, so the fills are still at
    the tail's first files when the reader, reading the tail backwards, starts at its last.
    The files the reader gets to first are handed to the cache from its own reads at once:
    the page cache may not keep them until their fills come (this machine pages cold memory
    out within seconds, which made this test fail one run in two), so the test drops it
    after the reader's first ten files, seconds before the fills get to them."""
    source, _sizes = dataset
    names, expected, total = every_file(source)
    m = mount(source, "--cache-size", str(total // 2))
    drop_caches()
    with memory_cgroup(f"coordlfs-test-handed-{os.getpid()}", pid=m.pid, read_bps=1 << 20,
                       storage=source):
        with Dataset(m.mountpoint) as planner, Dataset(m.mountpoint) as ds:
            queued = planner.prefetch(names)
            assert 0 < queued < len(names)
            head, tail = names[:-queued], names[-queued:]
            digests = client_digests(ds, tail[:-11:-1])
            wait_for(lambda: not _noting(m), "the reads handed to the cache")
            drop_caches()  # what reclaim may do before the fills come
            assert digests | client_digests(ds, tail[-11::-1] + head) == expected
            stats = ds.stats
        wait_for(lambda: not ((fills := m.status()["fills"])["queued"] or fills["in_flight"]),
                 "the fills done", 120)
    assert stats["direct"] <= len(head)  # only the head may be read from the source
    shared = m.status()["shared"]
    index = IndexReader(shared["index"], shared["files"])
    try:  # the fills ended: no file is marked any more
        assert not [n for n in names if index.handed(n.encode())]
    finally:
        index.close()
    reads = m.status()["reads"]
    # every file read from storage once: by the reader, or by the mount's opens and fills
    assert reads["bytes_from_source"] - reads["fill_bytes_from_pages"] == total
