"""A real coordlfs mount for a test or a benchmark: mounted with the ``coordlfs`` command,
always unmounted, its daemon always gone.

Mounts go through the CLI, as a user's do, so that a test checks and a benchmark measures
what a user gets. The client runs in a session of its own: a Ctrl-C meant for the test or
the benchmark must not stop it half-way while its daemon goes on mounting; on the way out we
wait for it, then take down whatever it mounted (``stop_daemon``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordlfs.cache import cache_tmpfs
from coordlfs.daemon.mounting import unmount
from coordlfs.errors import UserError
from coordlfs.protocol.client import Control, ControlError
from coordlfs.system.mounts import mount_at
from coordlfs.system.processes import process_alive, wait_exit
from coordlfs.testbed.logs import log_size, warn_of_logged_errors

#: The cache directory of a mount given none, named after the process that mounted it.
CACHE_DIR = "coordlfs-testbed-{}-{}"
#: Seconds to wait for ``coordlfs mount``.
CLI_TIMEOUT = 120
#: Signals that stop a daemon after its unmount, and the seconds each gets: none at first,
#: so that a daemon that exits by itself completes its log and its shutdown.
STOP_STEPS = ((None, 5.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0))


@dataclass
class Mount:
    source: Path
    mountpoint: Path
    cache_dir: Path
    log: Path
    pid: int

    @property
    def control(self) -> Control:
        return Control(self.mountpoint)

    def status(self) -> dict[str, Any]:
        return json.loads((self.mountpoint / ".coordlfs").read_bytes())

    def settled(self, seconds: float = 60.0) -> dict[str, Any]:
        return settled(self.control, seconds)


def settled(control: Control, seconds: float = 60.0) -> dict[str, Any]:
    """The mount's status once no entry is being filled. A file the kernel read from the
    source (FUSE passthrough) is copied into the cache after its last close, and the kernel
    sends that close to the daemon after the reader's ``close`` has returned: what a reader
    just read is in the cache a moment later, not at once (a benchmark counting an epoch's
    storage reads waits for them, so that they count in the epoch that caused them)."""
    deadline = time.monotonic() + seconds
    while (status := control.status())["cache"]["filling"]:
        if time.monotonic() > deadline:
            raise UserError(f"fills still in flight after {seconds:.0f} s: "
                            f"{status['cache']['filling']}")
        time.sleep(0.01)
    return status


def stop_daemon(mountpoint: str | os.PathLike[str], pid: int | None) -> None:
    """Lazy unmount, then SIGTERM, then SIGKILL: whatever state the mount was left in.

    Every FUSE daemon of the tests and benchmarks (coordlfs and the bench's bare pyfuse3
    baselines) goes this way. Lazy, because a reader still holding a file would make a plain
    unmount fail and leave the mount behind.
    """
    with contextlib.suppress(UserError):  # not mounted (any more), or not ours to unmount
        unmount(os.fspath(mountpoint), None, lazy=True)
    if pid is None:
        return
    for sig, wait in STOP_STEPS:
        if not process_alive(pid):
            return
        if sig is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
        wait_exit(pid, wait)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM while cleaning up: a second Ctrl-C must not leave a mount.
    (Signal handlers belong to the main thread; elsewhere there is nothing to ignore.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _wait(client: subprocess.Popen[str]) -> int:
    try:
        return client.wait(timeout=CLI_TIMEOUT)
    except subprocess.TimeoutExpired:
        client.kill()
        client.wait()
        raise UserError(f"coordlfs mount did not return in {CLI_TIMEOUT} s") from None


@contextlib.contextmanager
def mounted(source: Path, mountpoint: Path, log: Path, *options: str,
            cache_dir: Path | None = None, enter: Sequence[str] = ()) -> Iterator[Mount]:
    """``coordlfs mount source mountpoint --log log OPTIONS``, run after ``enter`` (such as
    nsenter into a node's network); unmounted, its daemon stopped and its cache directory
    (default: a fresh one in /dev/shm, ``CACHE_DIR``) removed on exit. A failed mount is a
    UserError with the client's message. Errors the daemon logged meanwhile are a warning on
    stderr."""
    cache = cache_dir or Path("/dev/shm") / CACHE_DIR.format(os.getpid(), uuid.uuid4().hex[:12])
    mountpoint.mkdir(exist_ok=True)
    taken = mount_at(str(mountpoint)) is not None  # someone else's: coordlfs mount refuses
    offset = log_size(log)
    pid = None
    with tempfile.TemporaryFile("w+") as err:
        client = subprocess.Popen(
            [*enter, sys.executable, "-m", "coordlfs", "mount", str(source), str(mountpoint),
             "--cache-dir", str(cache), "--log", str(log), *_default_passthrough(options),
             *options],
            stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True)
        try:
            if _wait(client) != 0:
                err.seek(0)
                raise UserError(f"coordlfs mount failed: {err.read().strip()} (log: {log})")
            pid = Control(mountpoint).status()["pid"]
            yield Mount(source, mountpoint, cache, log, pid)
        finally:
            with uninterrupted():
                if client.poll() is None:
                    _wait(client)
                if pid is not None or not taken:
                    stop_daemon(mountpoint, pid)
                remove_cache(cache)
                warn_of_logged_errors(log, offset)


def _default_passthrough(options: Sequence[str]) -> list[str]:
    """``--passthrough $COORDLFS_TEST_PASSTHROUGH`` unless the options name it: a suite run
    with it set to no and to auto checks every test both ways (the daemon's default is auto)."""
    chosen = os.environ.get(PASSTHROUGH_ENV)
    if not chosen or any(o.startswith("--passthrough") for o in options):
        return []
    return ["--passthrough", chosen]


#: The environment variable that sets the mounts' ``--passthrough`` (``_default_passthrough``).
PASSTHROUGH_ENV = "COORDLFS_TEST_PASSTHROUGH"


def remove_cache(cache: Path) -> None:
    """A cache directory a mount left (``--keep-cache``), on a tmpfs of its own or not."""
    if cache_tmpfs.is_own(str(cache)):
        cache_tmpfs.unmount_own(str(cache))
    shutil.rmtree(cache, ignore_errors=True)


def unmount_if_mounted(mountpoint: Path) -> None:
    """Take down whatever coordlfs mount is at ``mountpoint``: one a killed run left."""
    entry = mount_at(str(mountpoint))
    if entry is None or entry.fstype != "fuse.coordlfs":
        return
    try:
        pid = Control(mountpoint).status()["pid"]
    except (ControlError, OSError, ValueError, KeyError):
        pid = None  # a dead daemon: unmount anyway
    stop_daemon(mountpoint, pid)
