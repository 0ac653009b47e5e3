"""A coordlfs mount for a benchmark: mounted with the ``coordlfs`` command, always unmounted.

Benchmarks mount through the CLI, as a user does, so they measure what a user gets. Every
subprocess runs in its own session: a Ctrl-C meant for the benchmark must not kill a mount
or an unmount half-way; the benchmark then unmounts what was mounted.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from coordlfs.control import Control
from coordlfs.errors import UserError
from coordlfs.mounting import mount_at

#: Seconds to wait for ``coordlfs mount`` / ``umount``.
CLI_TIMEOUT = 120

#: The start of a record the daemon logged at ERROR or worse, in the format of
#: ``coordlfs.daemon.setup_logging``: "2024-11-23 04:40:00,123 ERROR coordlfs.fs: ...".
ERROR_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?:ERROR|CRITICAL) ",
                          re.MULTILINE)
#: The start of any record, which ends the lines (a traceback) that continue the one before.
_ANY_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ", re.MULTILINE)


def logged_errors(log: str | os.PathLike[str], offset: int = 0) -> list[str]:
    """The ERROR and CRITICAL records in a daemon's log from byte ``offset`` on, each with the
    lines that continue it (a traceback); none if there is no log.

    The daemon's log is part of a result: an error it logged means the mount misbehaved even
    when every read came back right (a fill given up, a request that raised).
    """
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return []
    starts = [m.start() for m in _ANY_RECORD.finditer(text)] + [len(text)]
    return [text[a:b].rstrip("\n") for a, b in itertools.pairwise(starts)
            if ERROR_RECORD.match(text, a)]


def log_size(log: str | os.PathLike[str]) -> int:
    """Where a mount's records will start in a log that earlier mounts appended to."""
    try:
        return os.path.getsize(log)
    except FileNotFoundError:
        return 0


def warn_of_logged_errors(log: str | os.PathLike[str], offset: int, name: str = "coordlfs",
                          kept: bool = True) -> None:
    """One line on stderr if the daemon logged errors since ``offset``: the figures stand,
    but the mount misbehaved while they were taken. ``kept``: the log outlives the bench."""
    errors = logged_errors(log, offset)
    if errors:
        first = errors[0].splitlines()[0]
        where = f"; see {log}" if kept else ""
        print(f"warning: the {name} daemon logged {len(errors)} error(s) during the bench "
              f"(first: {first}){where}", file=sys.stderr, flush=True)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordlfs", *args], capture_output=True,
                          text=True, timeout=CLI_TIMEOUT, start_new_session=True)


def unmount_if_mounted(mountpoint: Path) -> None:
    """``coordlfs umount`` whatever coordlfs mount is at ``mountpoint``, lazily if it is busy."""
    entry = mount_at(str(mountpoint))
    if entry is None or entry.fstype != "fuse.coordlfs":
        return
    result = _cli("umount", str(mountpoint))
    if result.returncode != 0:
        result = _cli("umount", "--lazy", str(mountpoint))
    if result.returncode != 0:
        raise UserError(f"cannot unmount {mountpoint}: {result.stderr.strip()}")


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM while cleaning up: a second Ctrl-C must not leave a mount."""
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def coordlfs_mount(source: Path, mountpoint: Path, cache_size: int, log: Path,
                   *options: str, enter: Sequence[str] = ()) -> Iterator[Control]:
    """Mount ``source`` with the ``coordlfs`` command (and ``options``), run after ``enter``
    (such as nsenter into a node's network); unmount and drop the cache on exit."""
    cache_dir = Path("/dev/shm") / f"coordlfs-bench-{os.getpid()}-{mountpoint.name}"
    mountpoint.mkdir(exist_ok=True)
    offset = log_size(log)
    with tempfile.TemporaryFile("w+") as err:
        # Own session, so an interrupt cannot stop the client while its daemon goes on
        # mounting: on the way out we wait for it, then unmount what it mounted.
        client = subprocess.Popen(
            [*enter, sys.executable, "-m", "coordlfs", "mount", str(source), str(mountpoint),
             "--cache-size", str(cache_size), "--cache-dir", str(cache_dir), "--log", str(log),
             *options],
            stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True)
        try:
            if client.wait(timeout=CLI_TIMEOUT) != 0:
                err.seek(0)
                raise UserError(f"coordlfs mount failed: {err.read().strip()} (log: {log})")
            yield Control(mountpoint)
        finally:
            with _uninterrupted():
                try:
                    client.wait(timeout=CLI_TIMEOUT)
                except subprocess.TimeoutExpired:
                    client.kill()
                    client.wait()
                unmount_if_mounted(mountpoint)
                shutil.rmtree(cache_dir, ignore_errors=True)
                warn_of_logged_errors(log, offset)


# -- epochs --------------------------------------------------------------------------------
