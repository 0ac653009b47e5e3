"""The mount beneath its own source: refused at mount, and a loop made later (a bind mount) is
answered ELOOP, never a hang, while the rest of the mount reads byte-exact; a dataset's own
nested mounts still read through.

A reader of a loop could hang in the kernel for good (the daemon waiting on itself), where
no signal ends it: it runs with a time limit, after which the test aborts the mount's
connection (``umount -f``) so that it ends, and fails.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from conftest import OTHER_UID, Mount, run_cli

from coordlfs.system.mounts import mount_at
from coordlfs.testbed.mounts import unmount_if_mounted
from coordlfs.testbed.slurm import free_port

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mount --bind and tmpfs need root")

#: Seconds a reader of a loop gets for its answer: ELOOP comes in milliseconds; a daemon
#: waiting on itself never answers.
ANSWER_S = 20
LOOP = os.strerror(errno.ELOOP)


@contextlib.contextmanager
def mounted_on(at: Path, *how: str) -> Iterator[None]:
    """``mount HOW AT`` (a tmpfs, a bind mount), detached after."""
    subprocess.run(["mount", *how, str(at)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(at)], check=False)


def answer(m: Mount | tuple[Mount, ...], *argv: str | Path
           ) -> subprocess.CompletedProcess[str] | None:
    """``argv`` run as ``OTHER_UID``, a reader of the mount (or mounts); None if it had no
    answer in ``ANSWER_S``, after which their connections are aborted so that the reader
    ends."""
    command = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
               *map(str, argv)]
    reader = subprocess.Popen(command, cwd="/", stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        out, err = reader.communicate(timeout=ANSWER_S)
    except subprocess.TimeoutExpired:
        for each in m if isinstance(m, tuple) else (m,):
            subprocess.run(["umount", "-f", str(each.mountpoint)], check=False)
        reader.kill()
        reader.communicate(timeout=60)
        return None
    return subprocess.CompletedProcess(command, reader.returncode, out, err)


def assert_loop(m: Mount | tuple[Mount, ...], *argv: str | Path) -> None:
    answered = answer(m, *argv)
    assert answered is not None, f"{argv}: no answer in {ANSWER_S} s (the mount hangs)"
    assert answered.returncode != 0 and LOOP in answered.stderr, answered


def same_bytes(m: Mount, names: list[str]) -> bool:
    return all(xxhash.xxh64_hexdigest((m.mountpoint / n).read_bytes())
               == xxhash.xxh64_hexdigest((m.source / n).read_bytes()) for n in names)


def test_a_mountpoint_inside_the_source_is_refused_in_one_line(dataset, tmp_path: Path,
                                                               daemon_logs: list[Path]) -> None:
    source, _ = dataset
    inside = source / "mnt"
    inside.mkdir()
    daemon_logs.append(tmp_path / "mount.log")
    result = run_cli("mount", str(source), str(inside), "--cache-dir", str(tmp_path / "cache"),
                     "--log", str(tmp_path / "mount.log"))
    try:
        assert result.returncode == 1, result
        assert result.stderr == (f"coordlfs: mountpoint {inside} is inside the source {source}: "
                                 "the mount would hold itself; mount it outside the source, or "
                                 "over the source itself\n")
        assert mount_at(str(inside)) is None
    finally:
        unmount_if_mounted(inside)


@pytest.mark.parametrize("option", ["--cache-dir", "--log", "--peers-file"])
def test_what_the_daemon_opens_by_path_while_mounted_is_refused_in_the_mountpoint(
        dataset, tmp_path: Path, daemon_logs: list[Path], option: str) -> None:
    """Clients map the cache by its path, the log is read and the peers file re-read while the
    mount is up: beneath the mountpoint, those paths show the source's files instead."""
    source, _ = dataset
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    listen = f"127.0.0.1:{free_port('127.0.0.1')}"
    paths = {"--cache-dir": tmp_path / "cache", "--log": tmp_path / "mount.log",
             option: mountpoint / "inside"}
    daemon_logs.append(paths["--log"])
    cluster = ["--listen", listen, "--insecure", "--peers-file", str(paths[option])]
    if option == "--peers-file":
        paths[option].write_text(f"{listen}\n")  # what would make it mount without the rule
    argv = [a for o in ("--cache-dir", "--log") for a in (o, str(paths[o]))]
    result = run_cli("mount", str(source), str(mountpoint), *argv,
                     *(cluster if option == "--peers-file" else []))
    try:
        assert result.returncode == 1, result
        *warnings, said = result.stderr.splitlines()  # (a peers file makes it not empty)
        assert said == (f"coordlfs: {option} {paths[option]} is inside the mountpoint "
                        f"{mountpoint}, which the mount hides while it is up; give a path "
                        "outside it")
        assert all(w.startswith("coordlfs: warning: ") for w in warnings), warnings
        assert mount_at(str(mountpoint)) is None
    finally:
        unmount_if_mounted(mountpoint)


def test_a_cache_dir_inside_the_source_is_refused_in_one_line(dataset, tmp_path: Path,
                                                             daemon_logs: list[Path]) -> None:
    """The mount would show jobs its own cache as part of the dataset (and a fill would
    change the source it reads)."""
    source, _ = dataset
    mountpoint, cache = tmp_path / "mnt", source / "cache"
    mountpoint.mkdir()
    daemon_logs.append(tmp_path / "mount.log")
    result = run_cli("mount", str(source), str(mountpoint), "--cache-dir", str(cache),
                     "--log", str(tmp_path / "mount.log"))
    try:
        assert result.returncode == 1, result
        assert result.stderr == (f"coordlfs: --cache-dir {cache} is inside the source "
                                 f"{source}, which the mount serves: jobs would read the "
                                 "cache as part of the dataset; give a path outside it\n")
        assert mount_at(str(mountpoint)) is None
        assert not cache.exists()
    finally:
        unmount_if_mounted(mountpoint)


@needs_root
def test_the_mount_bound_beneath_its_source_is_a_loop_answered_eloop(
        reachable: Path, mount, dataset) -> None:
    """``mount --bind MNT SRC/x`` puts the mount beneath its own source: a walk of the
    daemon's into SRC/x would wait for the daemon. Readers (uid 65534 here) get ELOOP at
    once, for a name first met after the bind and for one the kernel held from before (its
    walk crosses the loop on the way), and every other file reads byte-exact."""
    source, sizes = dataset
    for name in ("fresh", "held"):
        (source / name).mkdir()
    (source / "held" / "file").write_bytes(os.urandom(5000))
    m = mount(source, "--allow-other", mountpoint=reachable / "mnt")
    assert same_bytes(m, ["held/file"])  # the kernel now holds held and held/file
    with mounted_on(source / "fresh", "--bind", str(m.mountpoint)), \
            mounted_on(source / "held", "--bind", str(m.mountpoint)):
        assert_loop(m, "cat", m.mountpoint / "held" / "file")
        assert_loop(m, "ls", m.mountpoint / "fresh" / "fresh" / "fresh" / "fresh")
        assert_loop(m, "stat", m.mountpoint / "fresh")
        assert sorted(os.listdir(m.mountpoint)) == sorted(os.listdir(source))
        assert same_bytes(m, sorted(sizes))
        assert m.status()["pid"] == m.pid
    assert same_bytes(m, ["held/file"])  # the bind gone, the source shows again


@needs_root
def test_a_nested_mount_in_the_source_reads_through_and_a_loop_beneath_it_is_told(
        reachable: Path, mount, tmp_path: Path) -> None:
    """A dataset's own mounts (a tmpfs here) are walked through, deep paths and large files
    too; the mount bound inside one of them is still a loop."""
    source = tmp_path / "src"
    nested = source / "nested"
    nested.mkdir(parents=True)
    (source / "top").write_bytes(os.urandom(1000))
    with mounted_on(nested, "-t", "tmpfs", "coordlfs-test"):
        (nested / "a" / "b").mkdir(parents=True)
        (nested / "a" / "b" / "file").write_bytes(os.urandom(3 << 20))
        (nested / "loop").mkdir()
        m = mount(source, "--allow-other", mountpoint=reachable / "mnt")
        names = ["top", "nested/a/b/file"]
        assert same_bytes(m, names)
        assert sorted(os.listdir(m.mountpoint / "nested")) == ["a", "loop"]
        with mounted_on(nested / "loop", "--bind", str(m.mountpoint)):
            assert_loop(m, "ls", m.mountpoint / "nested" / "loop")
            assert_loop(m, "stat", m.mountpoint / "nested" / "loop" / "nested" / "loop" / "top")
            assert same_bytes(m, names)


@needs_root
def test_two_mounts_in_a_cycle_answer_eloop_and_serve_on(reachable: Path, mount) -> None:
    """A serves SRC on MA, B serves MA on SRC/mut: a lookup in B asks A, whose walk of SRC/mut
    would ask B, and so on, each daemon waiting on the other (``ls SRC/mut/mut/mut/mut`` hung
    both for good). A walk enters no coordlfs mount: the cycle is ELOOP at its first turn, and
    both mounts serve on."""
    src, ma = reachable / "src", reachable / "ma"
    (src / "mut").mkdir(parents=True)
    (src / "file").write_bytes(os.urandom(5000))
    a = mount(src, "--allow-other", mountpoint=ma)
    b = mount(ma, "--allow-other", mountpoint=src / "mut")
    both = (a, b)
    assert_loop(both, "ls", "-la", ma / "mut" / "mut" / "mut")  # hung both daemons
    assert_loop(both, "ls", src / "mut" / "mut" / "mut" / "mut")
    assert_loop(both, "stat", ma / "mut" / "file")
    listed = answer(both, "ls", src / "mut")
    assert listed is not None and listed.returncode == 0, listed
    assert sorted(listed.stdout.split()) == ["file", "mut"]
    assert (src / "mut" / "file").read_bytes() == (ma / "file").read_bytes()
    assert [m.status()["pid"] for m in both] == [a.pid, b.pid]
