"""Clear answers (issue 22, item 7), on real mounts: a user who may not reach a mount is told
"permission denied" with the path, by the client and by every command that takes a
mountpoint; settings that cannot work are refused in one line with nothing mounted, those
that may surprise are warned about; an unusable HOME is one line naming the log file.

The other user is uid 65534 in a fork that dropped root (``as_user``): it runs the code
already loaded (what a command imports late is imported here first), so nothing depends on
where the checkout or the interpreter lives."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import OTHER_UID, force_unmount, run_cli
from test_control_security import as_user

from coordlfs import cli
from coordlfs.client.dataset import Dataset
from coordlfs.control import Control, ControlError
from coordlfs.models import whatif as _loaded  # noqa: F401 (cmd_whatif imports it: before the fork)
from coordlfs.system.mounts import mount_at

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A fresh directory every user may enter (pytest's tmp_path is mode 700), removed after
    (asked for before ``mount``, so after its mounts are gone)."""
    directory = Path(tempfile.mkdtemp(prefix="coordlfs-answers-", dir="/tmp"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory)


def command(*argv: str, environ: dict[str, str | None] | None = None) -> dict[str, Any]:
    """``coordlfs ARGV`` in this process (as_user's child) with ``environ`` changed (None:
    unset): its status and stderr. A traceback would end the child, failing the test."""
    for name, value in (environ or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(list(argv))
    return {"status": status, "stderr": err.getvalue()}


def open_client(root: str) -> dict[str, Any]:
    """What ``Dataset(root)`` raised."""
    try:
        Dataset(root).close()
    except PermissionError as e:
        return {"kind": "PermissionError", "control_error": isinstance(e, ControlError),
                "errno": e.errno, "filename": e.filename, "message": str(e)}
    except ControlError as e:
        return {"kind": "ControlError", "message": str(e)}
    return {"kind": None}


def one_line(result: dict[str, Any] | Any) -> str:
    stderr = result["stderr"] if isinstance(result, dict) else result.stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    return stderr


@pytest.mark.parametrize("closed", ["the mount", "its parent"])
def test_a_user_who_may_not_reach_the_mount_is_told_permission_denied(
        reachable: Path, mount, dataset, closed: str) -> None:
    """Root's mount without --allow-other (the kernel lets no one else in), or one whose
    parent directory is 0700: the client said "not on a coordlfs mount", and umount
    "entry not found in /etc/mtab"."""
    source, _sizes = dataset
    mountpoint = reachable / "closed" / "mnt"
    mountpoint.parent.mkdir()
    m = mount(source, mountpoint=mountpoint)
    barrier = mountpoint.parent if closed == "its parent" else mountpoint
    mountpoint.parent.chmod(0o700 if closed == "its parent" else 0o755)
    path = str(mountpoint)
    seen = as_user(OTHER_UID, lambda: {
        "client": open_client(path),
        "commands": [command(*argv) for argv in (["stats", path], ["mark", path, "e1"],
                                                 ["whatif", path], ["umount", path])]})
    client = seen["client"]
    assert client["kind"] == "PermissionError" and client["control_error"], client
    assert (client["errno"], client["filename"]) == (errno.EACCES, path)
    assert client["message"].startswith(f"permission denied: {path} (")
    assert str(barrier) in client["message"]
    if closed == "the mount":
        assert "coordlfs mount of uid 0, without --allow-other" in client["message"]
    for result in seen["commands"]:
        assert result["status"] == 1
        assert one_line(result).startswith(f"coordlfs: permission denied: {path}")
    assert mount_at(path) is not None and m.status()["pid"] == m.pid  # still up, root's


@pytest.mark.parametrize("home", ["/nonexistent", "/"])
def test_an_unusable_home_is_one_line_naming_the_log_file(reachable: Path, home: str) -> None:
    """nobody's HOME, /nonexistent (absent), or one it may not write: the default log file
    ~/.local/state/coordlfs/<mountpoint>.log cannot be made (it was a traceback)."""
    source, mountpoint, cache = reachable / "src", reachable / "mnt", reachable / "cache"
    source.mkdir()
    (source / "a").write_bytes(b"a")
    mountpoint.mkdir()
    os.chown(mountpoint, OTHER_UID, OTHER_UID)
    result = as_user(OTHER_UID, lambda: command(
        "mount", str(source), str(mountpoint), "--cache-size", "1M", "--cache-dir", str(cache),
        environ={"HOME": home, "XDG_STATE_HOME": None}))
    assert result["status"] == 1
    log = f"{home.rstrip('/')}/.local/state/coordlfs/{str(mountpoint).strip('/').replace('/', '-')}"
    assert one_line(result) == (f"coordlfs: cannot write the log file {log}.log: Permission "
                                "denied; give --log FILE (or --foreground, which logs to "
                                "stderr)\n")
    assert mount_at(str(mountpoint)) is None and not cache.exists()


def test_settings_that_cannot_work_are_refused_in_one_line(dataset, tmp_path: Path) -> None:
    source, _sizes = dataset
    mountpoint, cache, log = tmp_path / "mnt", tmp_path / "cache", tmp_path / "mount.log"
    mountpoint.mkdir()
    (tmp_path / "file").write_bytes(b"x")
    cases = [
        (["--cache-size", "1K"], "bad --cache-size 1K: at least 4K, one page"),
        (["-o", "cache_size=4095"], "bad --cache-size 4095: at least 4K"),
        # /proc has no room at all: the cache was shrunk to 0 B, with a warning
        (["--cache-dir", "/proc/coordlfs-none/cache"], "only 0 B free for /proc/coordlfs-none"),
        (["--log", str(tmp_path / "file" / "x.log")], f"cannot write the log file {tmp_path}"),
        (["--log", str(tmp_path)], f"cannot write the log file {tmp_path}: Is a directory"),
    ]
    for argv, says in cases:
        try:
            result = run_cli("mount", str(source), str(mountpoint), "--cache-dir", str(cache),
                             "--log", str(log), *argv)
        finally:
            mounted = mount_at(str(mountpoint)) is not None
            force_unmount(mountpoint, None)  # what a regression would leave
        assert result.returncode == 1 and not mounted, (argv, result.stdout)
        assert says in one_line(result), argv
        assert not cache.exists() and not log.exists()


def mount_cli(source: Path, mountpoint: Path, *argv: str) -> tuple[str, int]:
    """``coordlfs mount``'s stderr, and the daemon's pid."""
    result = run_cli("mount", str(source), str(mountpoint), *argv)
    assert result.returncode == 0, result.stderr
    return result.stderr, Control(mountpoint).status()["pid"]


def test_settings_that_may_surprise_are_warned_about(dataset, tmp_path: Path) -> None:
    """A non-empty mountpoint (hidden while mounted) and a file limit above the cache (such
    files can never be cached) mount, with a warning each; over the source itself, none."""
    source, _sizes = dataset
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    (mountpoint / "hidden").write_bytes(b"x")
    pid = None
    try:
        said, pid = mount_cli(source, mountpoint, "--cache-dir", str(tmp_path / "cache"),
                              "--cache-size", "8M", "--max-file-size", "1G")
        assert said.splitlines() == [
            f"coordlfs: warning: mountpoint {mountpoint} is not empty: the mount hides what it "
            "holds",
            "coordlfs: warning: --max-file-size 1.0 GiB is more than the cache (8.0 MiB): files "
            "above the cache size can never be cached; using 8.0 MiB"]
        assert sorted(os.listdir(mountpoint)) == sorted(os.listdir(source))
        assert Control(mountpoint).status()["cache"]["max_file_bytes"] == 8 << 20
    finally:
        force_unmount(mountpoint, pid)
    pid = None
    try:
        said, pid = mount_cli(source, source, "--cache-dir", str(tmp_path / "cache"),
                              "--cache-size", "8M")
        assert said == ""
    finally:
        force_unmount(source, pid)
