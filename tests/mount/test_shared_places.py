"""Directories the mount makes in shared places (/dev/shm): another user who makes them
first, as after a boot, must not get root's bytes, serve root wrong ones, touch root's files or
run code in root's jobs. The attacker is a real unprivileged user (``OTHER_UID``, setpriv)."""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from conftest import make_dataset, run_as_other_user, run_cli

from coordlfs.client import batch_file
from coordlfs.client.dataset import Dataset
from coordlfs.control import Control
from coordlfs.daemon.config import default_cache_dir
from coordlfs.protocol import spec
from coordlfs.testbed.mounts import unmount_if_mounted

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user: needs root")

JOB = str(Path(__file__).with_name("prep_job.py"))


def as_attacker(script: str) -> subprocess.CompletedProcess:
    """``sh -c script`` as the other user; it must succeed."""
    done = run_as_other_user(["sh", "-c", script])
    assert done.returncode == 0, done.stderr
    return done


@contextlib.contextmanager
def absent_as_after_boot(path: Path) -> Iterator[None]:
    """``path`` absent during the test, as after a boot: removed if it is an empty directory,
    else moved aside and put back after; whatever the test made there is removed."""
    aside = None
    with contextlib.suppress(OSError):  # absent, or not empty
        path.rmdir()
    if path.exists() or path.is_symlink():
        aside = path.with_name(f"{path.name}.aside-{uuid.uuid4().hex[:8]}")
        path.rename(aside)
    try:
        yield
    finally:
        if path.is_symlink():
            path.unlink()
        shutil.rmtree(path, ignore_errors=True)
        if aside is not None:
            aside.rename(path)


@contextlib.contextmanager
def mounting(source: Path, mountpoint: Path, log: Path, daemon_logs: list[Path],
             *options: str) -> Iterator[subprocess.CompletedProcess]:
    """``coordlfs mount`` as a user would run it (the cache where it goes by default unless
    ``options`` say); whatever it mounted is taken down after."""
    mountpoint.mkdir()
    daemon_logs.append(log)
    result = run_cli("mount", str(source), str(mountpoint), "--log", str(log), *options)
    try:
        yield result
    finally:
        unmount_if_mounted(mountpoint)


def assert_refused_naming(result: subprocess.CompletedProcess, path: Path) -> None:
    assert result.returncode != 0, "mounted"
    assert result.stderr.count("\n") == 1 and str(path) in result.stderr, result.stderr


def readable_by_attacker() -> bytes:
    """Every file in /dev/shm the other user can read, concatenated."""
    done = as_attacker("find /dev/shm -type f -readable -size -64M -exec cat {} + "
                       "2>/dev/null | base64 -w0")
    return base64.b64decode(done.stdout)


def leaks(secret: bytes, found: bytes) -> bool:
    return any(secret[i : i + 4096] in found for i in range(0, len(secret), 4096))


def secret_source(tmp_path: Path) -> tuple[Path, bytes]:
    src = tmp_path / "src"  # in the test's directory: nobody else may enter it
    src.mkdir()
    secret = os.urandom(256 << 10)
    (src / "secret").write_bytes(secret)
    (src / "secret").chmod(0o600)
    return src, secret


def test_a_squatted_default_cache_directory_gets_no_byte_and_serves_none(
        tmp_path: Path, daemon_logs: list[Path]) -> None:
    """The other user makes the default cache directory (mode 777) with a files directory of its own
    before root's first mount: it must read no byte of a root-only file through it, and
    nothing it writes there may be served."""
    src, secret = secret_source(tmp_path)
    cache = Path(default_cache_dir(str(src)))  # where the code under test puts it
    with absent_as_after_boot(cache.parent):
        as_attacker(f"mkdir -m 777 {cache.parent} {cache} {cache}/files")
        mnt = tmp_path / "mnt"
        with mounting(src, mnt, tmp_path / "mount.log", daemon_logs,
                      "--cache-size", "8M") as result:
            if result.returncode != 0:
                assert_refused_naming(result, cache.parent)
            else:
                assert (mnt / "secret").read_bytes() == secret
                with Dataset(str(mnt)) as ds:
                    bytes(ds.read("secret"))  # published by now: a client maps its file
                    as_attacker(f"find {cache.parent} -type f -writable -exec dd "
                                "if=/dev/zero of={} bs=64K count=4 conv=notrunc status=none \\;")
                    assert bytes(ds.read("secret")) == secret, "served the other user's bytes"
            assert not leaks(secret, readable_by_attacker()), "the other user read root's bytes"


def test_a_symlinked_files_directory_leaves_roots_file_untouched(tmp_path: Path,
                                                       daemon_logs: list[Path]) -> None:
    src, _secret = secret_source(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(os.urandom(1 << 20))
    before = xxhash.xxh64_hexdigest(victim.read_bytes())
    cache = Path(default_cache_dir(str(src)))
    with absent_as_after_boot(cache.parent):
        as_attacker(f"mkdir -m 777 {cache.parent} {cache} && ln -s {victim} {cache}/files")
        with mounting(src, tmp_path / "mnt", tmp_path / "mount.log", daemon_logs,
                      "--cache-size", "8M") as result:
            if result.returncode != 0:
                assert_refused_naming(result, cache.parent)
        assert victim.stat().st_size == 1 << 20
        assert xxhash.xxh64_hexdigest(victim.read_bytes()) == before


@contextlib.contextmanager
def in_dev_shm() -> Iterator[Path]:
    """A fresh name in /dev/shm, removed after with whatever is there."""
    path = Path("/dev/shm") / f"coordlfs-test-{uuid.uuid4().hex[:12]}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("made", ["by the other user", "writable by all", "in the other "
                                  "user's directory"])
def test_a_cache_dir_another_user_may_change_is_refused(made: str, tmp_path: Path,
                                                        daemon_logs: list[Path]) -> None:
    src, _secret = secret_source(tmp_path)
    with in_dev_shm() as path:
        cache, at_fault = path, path
        if made == "by the other user":
            as_attacker(f"mkdir -m 777 {path}")
        elif made == "writable by all":
            path.mkdir()
            path.chmod(0o777)
        else:
            as_attacker(f"mkdir -m 755 {path}")
            cache = path / "cache"
        with mounting(src, tmp_path / "mnt", tmp_path / "mount.log", daemon_logs,
                      "--cache-dir", str(cache), "--cache-size", "8M") as result:
            assert_refused_naming(result, at_fault)
            assert not cache.exists() or not any(cache.iterdir())


def test_a_cache_dir_of_ones_own_is_made_private_and_used(tmp_path: Path,
                                                          daemon_logs: list[Path]) -> None:
    src, secret = secret_source(tmp_path)
    cache = tmp_path / "made" / "for" / "cache"  # a private chain; the last three made here
    mnt = tmp_path / "mnt"
    with mounting(src, mnt, tmp_path / "mount.log", daemon_logs, "--cache-dir", str(cache),
                  "--cache-size", "8M", "--cache-tmpfs", "no") as result:
        assert result.returncode == 0, result.stderr
        assert (mnt / "secret").read_bytes() == secret
        assert Control(mnt).status()["cache"]["directory"] == str(cache)
        for made in (cache, cache.parent, cache.parent.parent):
            assert made.stat().st_mode & 0o777 == 0o700, made


def _planted_batch(marker: Path) -> bytes:
    """A batch file of the former layout (a pickled header) whose unpickling makes
    ``marker``: what a user who can write the staging area would put there."""

    class Planted:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {marker}",))

    pickled = pickle.dumps(Planted())
    return b"CLFSBAT1" + struct.pack("<Q", len(pickled)) + pickled


def test_a_squatted_staging_area_is_not_used_and_a_planted_batch_runs_nothing(
        mount, tmp_path: Path, daemon_logs: list[Path]) -> None:
    """The other user makes the staging area (mode 777) before root's mount. Root's jobs must
    not stage there; if they did, the other user could replace a staged batch with one of
    its own, and the job that maps it must not run what it holds."""
    src = tmp_path / "data"
    src.mkdir()
    make_dataset(src, 16)
    files = sum(len(names) for _, _, names in os.walk(src))  # as prep_job.py lists them
    first = mount(src)
    root = Path(first.status()["prep"]["staging"]["directory"]).parent
    assert run_cli("umount", str(first.mountpoint)).returncode == 0
    marker = tmp_path / "marker"
    planted = Path(tempfile.mkdtemp(prefix="coordlfs-test-", dir="/tmp"))
    planted.chmod(0o755)
    (planted / "batch").write_bytes(_planted_batch(marker))
    (planted / "batch").chmod(0o644)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, planted)
        stack.enter_context(absent_as_after_boot(root))
        as_attacker(f"mkdir -m 777 {root}")
        mnt = tmp_path / "mnt"
        result = stack.enter_context(mounting(src, mnt, tmp_path / "mount.log", daemon_logs,
                                              "--cache-dir", str(tmp_path / "cache")))
        if result.returncode != 0:
            assert_refused_naming(result, root)
        else:  # the area is in use: the other user goes on
            _replace_a_batch(stack, mnt, root, planted / "batch", files)
    assert not marker.exists(), "a planted batch ran code in root's job"


def _replace_a_batch(stack: contextlib.ExitStack, mnt: Path, root: Path, planted: Path,
                     files: int) -> None:
    """A producing job (prep_job.py) and this process as the consuming one: the other user
    makes the staging directories the daemon is about to make, then replaces the first batch
    this process is handed with ``planted``, which this process then reads."""
    control = Control(mnt)
    epoch_dir = root / str(control.status()["pid"]) / "1" / "0"
    as_attacker(f"mkdir -p -m 777 {epoch_dir} && chmod 777 {epoch_dir.parent} "
                f"{epoch_dir.parent.parent}")
    job = subprocess.Popen([sys.executable, JOB, str(mnt), "hp", "producer", "1",
                            "--min-members", "2", "--batch", "8"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    stack.callback(job.wait)
    stack.callback(job.kill)
    member = control.call(spec.PREP_JOIN, group="hp", pid=os.getpid(), job="consumer",
                          samples=files, batch_size=8, min_members=2)["member"]
    try:
        while "epoch" not in control.call(spec.PREP_EPOCH, member=member):
            pass
        while "path" not in (reply := control.call(spec.PREP_NEXT, member=member)):
            assert not reply.get("end"), reply
        path = Path(reply["path"])
        as_attacker(f"cp {planted} {path}.new && mv -f {path}.new {path}")
        with contextlib.suppress(Exception):
            batch_file.read(str(path))
    finally:
        control.call(spec.PREP_LEAVE, member=member)
