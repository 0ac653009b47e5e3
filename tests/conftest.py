"""Shared test fixtures: real mounts in subprocesses, always unmounted, and sample datasets."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

from coordlfs.bench.counters import drop_caches  # noqa: F401 (tests import it from here)
from coordlfs.bench.dataset import DatasetSpec, ensure_dataset
from coordlfs.bench.mounts import logged_errors
from coordlfs.mounting import mount_at
from coordlfs.processes import process_alive, wait_exit

COORDLFS = [sys.executable, "-m", "coordlfs"]


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


def run_as_other_user(argv: Sequence[str | os.PathLike[str]],
                      timeout: float = 30) -> subprocess.CompletedProcess:
    """``argv`` as ``OTHER_UID`` with no supplementary groups (the caller must be root).

    It starts in /, not in the test's directory: a working directory the user cannot enter
    makes bash print "getcwd: cannot access parent directories" on stderr.
    """
    return subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}",
                           "--clear-groups", *map(str, argv)], cwd="/", capture_output=True,
                          text=True, timeout=timeout)


def make_dataset(root: Path, files: int, seed: int = 0) -> dict[str, int]:
    """Image-sized files in class folders (coordlfs.bench.dataset); relative path -> size."""
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


def digests(root: Path) -> dict[str, str]:
    """xxhash of every regular file under ``root``, by relative path."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = xxhash.xxh64_hexdigest(path.read_bytes())
    return out


@dataclass
class Mount:
    source: Path
    mountpoint: Path
    cache_dir: Path
    log: Path
    pid: int

    def status(self) -> dict:
        return json.loads((self.mountpoint / ".coordlfs").read_bytes())


def force_unmount(mountpoint: Path, pid: int | None) -> None:
    """Lazy unmount, then SIGTERM, then SIGKILL: whatever state the test left the mount in.

    An unmounted daemon gets a few seconds to exit by itself first, so that its log is
    complete (and its shutdown not cut short) when the test's logs are read.
    """
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    if pid is None:
        return
    for sig, wait in ((None, 5.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if not process_alive(pid):
            return
        if sig is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
        wait_exit(pid, wait)


@pytest.fixture
def mount(tmp_path: Path, daemon_logs: list[Path]) -> Iterator:
    """Factory: ``mount(source, *options)`` mounts coordlfs for real and returns a Mount.

    Each mount's log is checked for errors after the test (``daemon_logs``)."""
    made: list[Mount] = []
    tried: list[Path] = []
    cache_dirs: list[Path] = []

    def _mount(source: Path, *options: str, mountpoint: Path | None = None,
               cache_dir: Path | None = None, enter: tuple[str, ...] = ()) -> Mount:
        n = len(made)
        mp = mountpoint or tmp_path / f"mnt{n}"
        mp.mkdir(exist_ok=True)
        cache = cache_dir or Path("/dev/shm") / f"coordlfs-test-{uuid.uuid4().hex[:12]}"
        cache_dirs.append(cache)
        log = tmp_path / f"mount{n}.log"
        daemon_logs.append(log)
        tried.append(mp)
        result = run_cli("mount", str(source), str(mp), "--cache-dir", str(cache),
                         "--log", str(log), *options, enter=enter)
        assert result.returncode == 0, result.stderr + (log.read_text() if log.exists() else "")
        status = json.loads((mp / ".coordlfs").read_bytes())
        m = Mount(source, mp, cache, log, status["pid"])
        made.append(m)
        return m

    yield _mount
    for m in made:
        force_unmount(m.mountpoint, m.pid)
    for mp in tried:  # a mount that failed half-way (a timeout) may have left its daemon
        if mount_at(str(mp)) is not None:
            force_unmount(mp, None)
    for cache in cache_dirs:
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    root = tmp_path / "data"
    root.mkdir()
    return root, make_dataset(root, 200)
