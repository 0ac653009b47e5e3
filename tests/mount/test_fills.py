"""Batched, order-aware fills on a real mount (issue 13, item 3): a job hands its order over
with ``prefetch``, the mount reads the files into its cache in bulk, and every read through
the mount is then a hit; the storage is read once per file, bytes equal the source's; bad
paths, symlinks and files the caller may not read are refused, and the mount stays up."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Mount, digests, force_unmount, random_source
from test_control_security import as_user, ask

from coordlfs.control import ControlError
from coordlfs.protocol.spec import MAX_PREFETCH_PATHS

#: Seconds the queue may take to drain in these small tests.
DRAIN_S = 60.0


def drained(m: Mount) -> dict[str, Any]:
    """The mount's status once the fill queue has nothing queued or in flight."""
    deadline = time.monotonic() + DRAIN_S
    while True:
        status = m.status()
        if status["fills"]["queued"] == 0 and status["fills"]["in_flight"] == 0:
            return status
        assert time.monotonic() < deadline, status["fills"]
        time.sleep(0.02)


def shuffled(files: dict[str, int], seed: int = 1) -> list[str]:
    order = sorted(files)
    random.Random(seed).shuffle(order)
    return order


def test_prefetched_order_is_read_from_the_cache(mount, dataset) -> None:
    root, files = dataset
    m = mount(root)
    order = shuffled(files)
    assert m.control.request("prefetch", paths=order)["queued"] == len(order)
    status = drained(m)
    assert status["fills"]["files"] == len(files)
    assert status["fills"]["bytes"] == sum(files.values())
    assert not status["fills"]["failed"]
    for rel in order:  # the whole epoch through the mount: all hits
        (m.mountpoint / rel).read_bytes()
    reads = m.status()["reads"]
    assert (reads["file_hits"], reads["file_misses"]) == (len(files), 0)
    assert reads["bytes_from_source"] == sum(files.values())
    assert digests(m.mountpoint) == digests(root)


def test_readers_wait_on_files_being_filled(mount, dataset) -> None:
    """A reader right behind the queue (the order sent, then read at once) shares the fills
    under way: every file is still read from storage once."""
    root, files = dataset
    m = mount(root, "--fill-depth", "2")
    order = shuffled(files, seed=2)
    m.control.request("prefetch", paths=order)
    source = digests(root)  # the dataset's files and its manifest, not prefetched
    assert digests(m.mountpoint) == source
    status = drained(m)
    # storage read once per file
    assert status["reads"]["bytes_from_source"] == sum((root / n).stat().st_size for n in source)
    fills = status["fills"]
    assert fills["files"] + fills["skipped"]["cached"] == len(files)  # the rest the readers had


def test_a_later_prefetch_appends_and_cached_files_are_skipped(mount, dataset) -> None:
    root, files = dataset
    m = mount(root)
    order = shuffled(files)
    half = len(order) // 2
    m.control.request("prefetch", paths=order[:half])
    m.control.request("prefetch", paths=order)  # the next epoch, after the rest of this one
    status = drained(m)
    assert status["fills"]["files"] == len(files)
    assert status["fills"]["skipped"]["cached"] == half
    assert status["reads"]["bytes_from_source"] == sum(files.values())


def test_files_that_cannot_be_cached_are_skipped(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "small").write_bytes(b"s" * 1000)
    (src / "big").write_bytes(b"b" * 300_000)
    (src / "d" / "x").write_bytes(b"x" * 10)
    os.symlink("small", src / "link")
    os.symlink("d", src / "dirlink")
    m = mount(src, "--max-file-size", "100K")
    reply = m.control.request("prefetch", paths=["small", "big", "d", "link", "dirlink/x",
                                                 "missing"])
    assert reply["queued"] == 6
    fills = drained(m)["fills"]
    assert fills["files"] == 1
    assert fills["skipped"]["too_large"] == 1
    assert fills["skipped"]["not_regular"] == 1  # the directory
    # a symlink is never followed, at the end or on the way, as the mount shows links as links
    assert fills["failed"] == {"ELOOP": 2, "ENOENT": 1}
    assert (m.mountpoint / "small").read_bytes() == b"s" * 1000


def test_a_fifo_in_the_source_is_skipped_without_blocking_a_worker(mount,
                                                                   tmp_path: Path) -> None:
    """The fill opens a FIFO without waiting for a writer (it waited for good, holding a fill
    worker: the queue never drained), sees what it is and skips it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "small").write_bytes(b"s" * 1000)
    os.mkfifo(src / "fifo")
    m = mount(src, "--fill-depth", "1")
    try:
        assert m.control.request("prefetch", paths=["fifo", "small"])["queued"] == 2
        fills = drained(m)["fills"]
        assert fills["files"] == 1
        assert fills["skipped"]["not_regular"] == 1
        assert not fills["failed"]
        assert (m.mountpoint / "small").read_bytes() == b"s" * 1000
    finally:  # a fill blocked in the open is let go, so that the unmount does not hang
        with contextlib.suppress(OSError):  # ENXIO: no reader has it open
            os.close(os.open(src / "fifo", os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("paths", [
    ["../outside"], ["/etc/passwd"], ["a//b"], ["a/./b"], ["a/../b"], [""], ["a/"],
    "class0", [1], ["\ud800"], ["x"] * (MAX_PREFETCH_PATHS + 1), [".coordlfs"],
], ids=["dotdot", "absolute", "empty-part", "dot", "inner-dotdot", "empty", "trailing-slash",
        "not-a-list", "not-a-string", "lone-surrogate", "too-many", "control-file"])
def test_bad_paths_are_refused_and_the_mount_stays_up(mount, dataset, paths: Any) -> None:
    root, _files = dataset
    m = mount(root)
    code, reply = ask(str(m.mountpoint / ".coordlfs"), {"cmd": "prefetch", "paths": paths})
    assert code == errno.EINVAL
    assert not reply["ok"] and "paths" in reply["error"]
    assert m.status()["fills"]["queued"] == 0


def test_fill_depth_from_o_and_flags(mount, dataset) -> None:
    root, files = dataset
    assert mount(root, "-o", "fill_depth=3").status()["fills"]["depth"] == 3
    off = mount(root, "-o", "fill_depth=3", "--fill-depth", "0")  # the flag wins
    assert off.status()["fills"]["depth"] == 0
    assert off.control.request("prefetch", paths=sorted(files))["queued"] == 0


# -- another user (an --allow-other mount) ---------------------------------------------------


@pytest.fixture
def shared(mount, tmp_path: Path) -> Iterator[Mount]:
    """A mount every user can reach, of a source with a file anyone may read, one only root
    may read, and one in a directory only root may enter."""
    src = tmp_path / "src"
    (src / "private").mkdir(parents=True)
    for rel, mode in (("open", 0o644), ("secret", 0o600), ("private/x", 0o644)):
        (src / rel).write_bytes(rel.encode())
        (src / rel).chmod(mode)
    (src / "private").chmod(0o700)
    reachable = Path(tempfile.mkdtemp(prefix="coordlfs-fills-", dir="/tmp"))
    reachable.chmod(0o755)
    try:
        m = mount(src, "--allow-other", mountpoint=reachable / "mnt")
        yield m
        force_unmount(m.mountpoint, m.pid)
    finally:
        force_unmount(reachable / "mnt", None)
        shutil.rmtree(reachable, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_user_prefetches_only_what_it_may_read(shared: Mount) -> None:
    control = str(shared.mountpoint / ".coordlfs")
    uid = 65534

    def session() -> dict[str, Any]:
        return {what: ask(control, {"cmd": "prefetch", "paths": paths})
                for what, paths in (("open", ["open", "gone"]), ("secret", ["open", "secret"]),
                                    ("private", ["private/x"]))}

    out = as_user(uid, session)
    assert out["open"] == [0, {"ok": True, "queued": 1}]  # a file that is gone is left out
    for refused in ("secret", "private"):
        code, reply = out[refused]
        assert code == errno.EACCES and "permission denied" in reply["error"], out
    status = drained(shared)
    assert status["fills"]["files"] == 1  # nothing of a refused request was queued
    # root (and the owner) may name any file
    assert shared.control.request("prefetch", paths=["secret", "private/x"])["queued"] == 2
    assert drained(shared)["fills"]["files"] == 3


def test_the_control_client_reports_a_refusal(mount, dataset) -> None:
    root, _files = dataset
    m = mount(root)
    with pytest.raises(ControlError, match="relative to the mount"):
        m.control.request("prefetch", paths=["/etc/shadow"])


def test_an_unmount_cancels_the_queue(mount, tmp_path: Path) -> None:
    """Unmounting while a large file and a long order are being filled ends at once and
    cleanly (the fixture fails the test on any ERROR the daemon logged)."""
    src = random_source(tmp_path, big=256 << 20)
    m = mount(src, "--fill-depth", "1")
    m.control.request("prefetch", paths=["big"] + ["gone"] * 10_000)
    deadline = time.monotonic() + DRAIN_S
    while m.status()["fills"]["in_flight"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    start = time.monotonic()
    force_unmount(m.mountpoint, m.pid)
    assert time.monotonic() - start < 10
