"""Shared test fixtures: real mounts in subprocesses, always unmounted, and sample datasets."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import xxhash

from coordlfs.errors import UserError
from coordlfs.fs import lane, passthrough
from coordlfs.testbed.dataset import DatasetSpec, ensure_dataset
from coordlfs.testbed.logs import logged_errors
from coordlfs.testbed.mounts import Mount, mounted, unmount_if_mounted
from coordlfs.testbed.mounts import stop_daemon as force_unmount
from coordlfs.testbed.storage import drop_caches

#: Tests import these from here.
__all__ = ["Mount", "drop_caches", "force_unmount"]

COORDLFS = [sys.executable, "-m", "coordlfs"]

# A suite started in the background by a shell without job control (``scripts/test &``)
# inherits SIGINT ignored, and so would every command it starts: Python installs no
# KeyboardInterrupt handler then, and the tests that stop a command with SIGINT (as Ctrl-C
# does) saw it run on to exit 0. A handler here is reset to the default in each child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def run_cli(*args: str, timeout: float = 60, enter: tuple[str, ...] = (),
            **kwargs) -> subprocess.CompletedProcess:
    """``coordlfs ARGS``, prefixed by ``enter`` (such as nsenter into a node's network)."""
    return subprocess.run([*enter, *COORDLFS, *args], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


#: Records shown when a test fails for its daemons' errors: enough to see what went wrong.
SHOWN_ERRORS = 5


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "expect_log_errors(pattern=None): the test makes a daemon log ERROR records "
        "on purpose (only those matching the regular expression, if given); without it an "
        "ERROR in a daemon's log fails the test")


def _unexpected(errors: list[str], marker: pytest.Mark | None) -> list[str]:
    if marker is None:
        return errors
    if not marker.args:
        return []
    return [e for e in errors if not re.search(marker.args[0], e.splitlines()[0])]


@pytest.fixture(autouse=True)
def daemon_logs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """The daemon's log is part of the result: after the test (its mounts are gone by then),
    an ERROR record in the log of a daemon it started fails it, unless it is marked
    ``expect_log_errors``.

    A test appends the logs of the daemons it starts (a directory: every ``*.log`` in it).
    Daemons mounted without ``--log`` log under ``$XDG_STATE_HOME``, which points at a fresh
    directory per test, checked too: no test writes to the real ~/.local/state.
    """
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    logs: list[Path] = [state / "coordlfs"]
    yield logs
    files = [f for log in logs for f in (sorted(log.glob("*.log")) if log.is_dir() else [log])]
    found = [(f, e) for f in files for e in _unexpected(
        logged_errors(f), request.node.get_closest_marker("expect_log_errors"))]
    if found:
        shown = "\n".join(f"{f}:\n{e}" for f, e in found[:SHOWN_ERRORS])
        pytest.fail(f"a daemon logged {len(found)} unexpected ERROR record(s) (a test that "
                    f"expects them is marked expect_log_errors):\n{shown}", pytrace=False)


#: Who a test runs something as when it needs a user other than root: nobody.
OTHER_UID = 65534


@contextlib.contextmanager
def reachable_by_anyone(*files: Path) -> Iterator[list[Path]]:
    """Executable copies of ``files`` in a fresh directory every user can enter, removed after.

    A test that runs something as another user must not depend on where the checkout lives:
    a clone under /root or in a ``mktemp -d`` directory (mode 700) cannot be entered by that
    user (bash exits 126, "Permission denied"), and neither can pytest's ``tmp_path``
    (/tmp/pytest-of-root is mode 700). /tmp itself is open to all (mode 1777).
    """
    directory = Path(tempfile.mkdtemp(prefix="coordlfs-test-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        copies = [directory / f.name for f in files]
        for original, copy in zip(files, copies, strict=True):
            shutil.copyfile(original, copy)
            copy.chmod(0o755)
        yield copies
    finally:
        shutil.rmtree(directory)


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory every user can enter, for a mountpoint ``OTHER_UID`` reads through (pytest's
    ``tmp_path`` is closed to it); removed once the mounts in it are down (set up before the
    ``mount`` fixture, so torn down after it)."""
    directory = Path(tempfile.mkdtemp(prefix="coordlfs-test-", dir="/tmp"))
    directory.chmod(0o755)
    yield directory
    unmount_if_mounted(directory / "mnt")  # should a test have failed before its fixture ran
    shutil.rmtree(directory)


def run_as_other_user(argv: Sequence[str | os.PathLike[str]],
                      timeout: float = 30) -> subprocess.CompletedProcess:
    """``argv`` as ``OTHER_UID`` with no supplementary groups (the caller must be root).

    It starts in /, not in the test's directory: a working directory the user cannot enter
    makes bash print "getcwd: cannot access parent directories" on stderr.
    """
    return subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}",
                           "--clear-groups", *map(str, argv)], cwd="/", capture_output=True,
                          text=True, timeout=timeout)


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 30.0) -> None:
    """Poll ``condition`` until it holds: for what the kernel or the daemon does in the
    background (FORGETs after drop_caches, a drained window), with a deadline far above the
    usual time, so a loaded machine is slow, not failing."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {seconds} s"
        time.sleep(0.05)


def make_dataset(root: Path, files: int, seed: int = 0) -> dict[str, int]:
    """Image-sized files in class folders (coordlfs.testbed.dataset); relative path -> size."""
    return dict(ensure_dataset(root, DatasetSpec(files, classes=4, seed=seed)).files)


def random_source(tmp_path: Path, **sizes: int) -> Path:
    """A source directory ``tmp_path/src`` holding one file of random bytes per keyword."""
    src = tmp_path / "src"
    src.mkdir()
    for name, size in sizes.items():
        with open(src / name, "wb") as f:
            for start in range(0, size, 1 << 24):  # in pieces: a 200 MiB file needs no 200 MiB
                f.write(os.urandom(min(1 << 24, size - start)))
    return src


def read_at_once(path: Path, readers: int) -> list[bytes]:
    """``path`` read whole by ``readers`` processes (``cat``) started together."""
    procs = [subprocess.Popen(["cat", str(path)], stdout=subprocess.PIPE)
             for _ in range(readers)]
    return [p.communicate()[0] for p in procs]


def read_all(fd: int) -> bytes:
    """The descriptor read from its start to EOF, by read(2)."""
    os.lseek(fd, 0, os.SEEK_SET)
    pieces = []
    while piece := os.read(fd, 1 << 17):
        pieces.append(piece)
    return b"".join(pieces)


def daemons_of(mountpoint: Path) -> list[int]:
    """The pids of coordlfs daemons started for ``mountpoint`` (it is in their command line:
    ``coordlfs.daemon.detached``)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if b"coordlfs.daemon.detached" in argv and os.fsencode(mountpoint) in argv:
            found.append(int(proc.name))
    return found


def digests(root: Path) -> dict[str, str]:
    """xxhash of every regular file under ``root``, by relative path."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = xxhash.xxh64_hexdigest(path.read_bytes())
    return out


@pytest.fixture
def mount(tmp_path: Path, daemon_logs: list[Path]) -> Iterator:
    """Factory: ``mount(source, *options)`` mounts coordlfs for real (``testbed.mounts``)
    and returns a Mount; after the test every mount is taken down, its daemon stopped, and
    each log is checked for errors (``daemon_logs``)."""
    with contextlib.ExitStack() as stack:
        made = itertools.count()

        def _mount(source: Path, *options: str, mountpoint: Path | None = None,
                   cache_dir: Path | None = None, enter: tuple[str, ...] = ()) -> Mount:
            n = next(made)
            log = tmp_path / f"mount{n}.log"
            daemon_logs.append(log)
            try:
                return stack.enter_context(mounted(
                    source, mountpoint or tmp_path / f"mnt{n}", log, *options,
                    cache_dir=cache_dir, enter=enter))
            except UserError as e:
                pytest.fail(f"{e}\n{log.read_text() if log.exists() else ''}")

        yield _mount


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    root = tmp_path / "data"
    root.mkdir()
    return root, make_dataset(root, 200)


@pytest.fixture
def no_direct(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A filesystem whose reads refuse O_DIRECT (EINVAL) though its open took it, as some
    network filesystems do for an alignment not theirs; the ``posix_fadvise`` advice given,
    in order."""
    preadv, advised = os.preadv, []

    def refusing(fd: int, buffers: list, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refusing)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, size, advice:
                        advised.append(advice))
    return advised


def _lane_missing() -> str | None:
    """Why the lane cannot be had here (passthrough is its precondition), else None."""
    why = passthrough.available()
    if why is not None:
        return f"no FUSE passthrough: {why}"
    return lane.why_not("auto", None)


@pytest.fixture
def needs_lane() -> None:
    """Skip without the lane; but where passthrough is there, under CI=true a lane missing
    (its library not built, an older pyfuse3) is a failure, as for the other optional
    builds: the suite is where they are gated."""
    why = _lane_missing()
    if why is None:
        return
    if os.environ.get("CI") == "true" and passthrough.available() is None:
        pytest.fail(f"the request lane is not available: {why}", pytrace=False)
    pytest.skip(f"the request lane is not available: {why}")
