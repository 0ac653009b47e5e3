"""The mount(8) helper, for real: `mount -t fuse.coordlfs`, fstab lines, plain umount(8)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import digests, force_unmount, make_dataset

from coordlfs.system.processes import wait_exit

MOUNT_DIR = Path(__file__).resolve().parents[2] / "mount"
HELPER = MOUNT_DIR / "mount.fuse.coordlfs"
LINK = Path("/sbin/mount.fuse.coordlfs")
MiB = 1024 * 1024

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                                reason="mount(8) of a FUSE type needs root and util-linux")


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def fstype_at(path: Path) -> str | None:
    """The fstype of the topmost mount on ``path``, from /proc/self/mountinfo."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if left.split()[4] == str(path):
                found = right.split()[0]
    return found


@pytest.fixture(scope="module")
def helper() -> Iterator[Path]:
    """/sbin/mount.fuse.coordlfs pointing at this checkout; made (and removed after) if missing."""
    created = not LINK.is_symlink() and not LINK.exists()
    if created:
        LINK.symlink_to(HELPER)
    elif LINK.resolve() != HELPER:
        pytest.skip(f"{LINK} is not this checkout's helper ({LINK.resolve()})")
    try:
        yield LINK
    finally:
        if created:
            LINK.unlink()


@dataclass
class Target:
    source: Path
    mountpoint: Path
    cache_dir: Path
    log: Path
    pid: int | None = None

    def options(self, *extra: str) -> str:
        return ",".join([f"cache_dir={self.cache_dir}", f"log={self.log}", *extra])

    def check_live(self) -> dict:
        """Assert the mount is coordlfs serving the source's bytes; record the daemon pid."""
        assert fstype_at(self.mountpoint) == "fuse.coordlfs", self.log.read_text()
        status = json.loads((self.mountpoint / ".coordlfs").read_bytes())
        self.pid = status["pid"]
        assert status["source"] == str(self.source)
        assert status["cache"]["directory"] == str(self.cache_dir)
        assert digests(self.mountpoint) == digests(self.source)
        return status

    def umount(self) -> None:
        """Plain umount(8); the mount must go and the daemon exit."""
        result = run("umount", str(self.mountpoint))
        assert result.returncode == 0, result.stderr
        assert fstype_at(self.mountpoint) is None
        if self.pid is not None:
            assert wait_exit(self.pid, 30), f"daemon {self.pid} still running after umount"


@pytest.fixture
def target(tmp_path: Path, helper: Path, daemon_logs: list[Path]) -> Iterator[Target]:
    """A source with data and an empty mountpoint; always unmounted afterwards, its log
    checked for errors (``daemon_logs``)."""
    source, mountpoint = tmp_path / "data", tmp_path / "mnt"
    source.mkdir()
    mountpoint.mkdir()
    make_dataset(source, 40)
    cache = Path("/dev/shm") / f"coordlfs-test-{uuid.uuid4().hex[:12]}"
    t = Target(source, mountpoint, cache, tmp_path / "mount.log")
    daemon_logs.append(t.log)
    try:
        yield t
    finally:
        if t.pid is None and fstype_at(mountpoint) == "fuse.coordlfs":
            with contextlib.suppress(OSError, ValueError, KeyError):
                t.pid = json.loads((mountpoint / ".coordlfs").read_bytes())["pid"]
        force_unmount(mountpoint, t.pid)
        shutil.rmtree(cache, ignore_errors=True)


def test_mount_t_and_umount(target: Target) -> None:
    result = run("mount", "-t", "fuse.coordlfs", str(target.source), str(target.mountpoint),
                 "-o", target.options("cache_size=8M"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    status = target.check_live()
    assert status["cache"]["capacity_bytes"] == 8 * MiB
    target.umount()


def test_fstab_line(target: Target, tmp_path: Path) -> None:
    fstab = tmp_path / "fstab"
    options = target.options("cache_size=8M", "max_file_size=1M", "debug", "defaults", "noauto",
                             "nofail", "_netdev", f"x-systemd.requires-mounts-for={target.source}")
    fstab.write_text(f"# a comment, then the line\n\n"
                     f"{target.source}\t{target.mountpoint}  fuse.coordlfs  {options}  0 0\n")
    result = run("mount", "--fstab", str(fstab), str(target.mountpoint))
    assert result.returncode == 0, result.stderr
    status = target.check_live()
    assert status["cache"]["capacity_bytes"] == 8 * MiB
    assert status["cache"]["max_file_bytes"] == 1 * MiB
    assert " DEBUG " in target.log.read_text()
    target.umount()


@pytest.mark.parametrize(("option", "says"), [
    ("bogus=1", "unknown option 'bogus=1'"),
    ("cache_size", "option cache_size needs a value"),
    ("keep_cache=yes", "option keep_cache takes no value"),
    ("cache_size=8Q", "bad --cache-size '8Q'"),
])
def test_bad_option_is_one_line_error(target: Target, option: str, says: str) -> None:
    result = run("mount", "-t", "fuse.coordlfs", str(target.source), str(target.mountpoint),
                 "-o", target.options(option))
    assert result.returncode != 0
    assert says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    log = target.log.read_text() if target.log.exists() else ""
    assert "Traceback" not in result.stderr + log
    assert fstype_at(target.mountpoint) is None


def test_coordlfs_mount_takes_the_same_options(target: Target) -> None:
    """What the helper passes on works without it: `coordlfs mount -o`, a flag winning."""
    result = run(sys.executable, "-m", "coordlfs", "mount", str(target.source),
                 str(target.mountpoint), "-o", target.options("cache_size=8M,nofail,debug"),
                 "--cache-size", "4M")
    assert result.returncode == 0, result.stderr
    assert target.check_live()["cache"]["capacity_bytes"] == 4 * MiB
    assert " DEBUG " in target.log.read_text()
    target.umount()


def test_options_go_to_coordlfs_as_given(helper: Path) -> None:
    """The helper passes -o through (several -o joined) and -f as --fake, -s as --sloppy;
    that the options mean their flags is tests/unit/test_options.py's."""
    options = ("listen=0.0.0.0:7878,peers=h1:7878+h2:7878,secret_file=/etc/s,peer_timeout=1,"
               "insecure")
    result = run(str(helper), "/data", "/mnt/data", "-fsv", "-o", options, "-odebug")
    assert result.returncode == 0, result.stderr
    assert f"mount /data /mnt/data -o {options},debug --sloppy --fake" in result.stderr


def test_examples_are_accepted(helper: Path) -> None:
    """The options of fstab.example and mnt-data.mount pass the helper (-f: check, do not mount)."""
    lines = [line for line in (MOUNT_DIR / "fstab.example").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) == 1
    source, mountpoint, fstype, fstab_options, _, _ = lines[0].split()
    assert fstype == "fuse.coordlfs"
    unit_text = (MOUNT_DIR / "mnt-data.mount").read_text()
    unit = dict(line.split("=", 1) for line in unit_text.splitlines()
                if "=" in line and not line.startswith("#"))
    assert unit["Type"] == "fuse.coordlfs"
    assert (unit["What"], unit["Where"]) == (source, mountpoint)
    for options in (fstab_options, unit["Options"]):
        result = run(str(helper), source, mountpoint, "-f", "-o", options)
        assert result.returncode == 0, result.stderr
