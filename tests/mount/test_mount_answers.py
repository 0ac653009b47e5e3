"""Clear answers (issue 22, item 7), on real mounts: a user who may not reach a mount is told
"permission denied" with the path, by the client and by every command that takes a
mountpoint.

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
from conftest import OTHER_UID
from test_control_security import as_user

from coordlfs import cli
from coordlfs import whatif as _loaded  # noqa: F401 (cmd_whatif imports it: before the fork)
from coordlfs.client import Dataset
from coordlfs.control import ControlError
from coordlfs.mounting import mount_at

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
