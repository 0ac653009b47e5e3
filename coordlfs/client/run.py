"""``coordlfs run``: a command whose opens of cached files need no FUSE round trip.

The command runs with the preload library (``coordlfs/preload/preload.c``, built by
``scripts/setup``) in ``LD_PRELOAD``, told by ``COORDLFS_MOUNTS`` where each mount's cache,
index and source are, so that it opens a hit's cache file and a miss's source file itself
(the library's header says what it takes and what it leaves to the mount). Children inherit
both variables, so DataLoader workers and shells started by the command are served too; a
static binary, or a program that clears its environment, simply reads through the mount.

The command replaces this process (``exec``): its exit status and the signals sent to it are
its own, with nothing in between.
"""

from __future__ import annotations

import os
import queue
import shlex
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from coordlfs.errors import UserError
from coordlfs.protocol.client import Control, ControlError
from coordlfs.system.mounts import mount_at, mounts

#: The library, built beside its source by ``scripts/setup`` (``COORDLFS_PRELOAD_LIBRARY``
#: names another build).
LIBRARY = Path(__file__).resolve().parent.parent / "preload" / "libcoordlfs-preload.so"
#: Separators of ``COORDLFS_MOUNTS``: records, fields (ASCII RS and US, never in a path we
#: take)
_RECORD, _FIELD = "\x1e", "\x1f"
#: Seconds the mounts have to say where their caches are.
STATUS_WAIT_S = 5.0
FSTYPE = "fuse.coordlfs"


def library() -> Path | None:
    """The preload library to use, None if it is not built."""
    named = os.environ.get("COORDLFS_PRELOAD_LIBRARY")
    path = Path(named) if named else LIBRARY
    return path if path.is_file() else None


def mount_record(mountpoint: str, status: dict) -> str | None:
    """The library's record of one mount: mountpoint, cache directory, source, largest
    file the cache keeps, flags ("p": peers, whose misses only the mount may ask for); None
    where the mount publishes no index (nothing for the library to serve)."""
    shared = status.get("shared") or {}
    index, source = shared.get("index"), status.get("source")
    if not index or not source:
        return None
    max_file = (status.get("cache") or {}).get("max_file_bytes") or 0
    flags = "p" if (status.get("peers") or {}).get("nodes") else "-"
    fields = [mountpoint, os.path.dirname(index), source, str(max_file), flags]
    if any(_RECORD in f or _FIELD in f for f in fields):
        return None
    return _FIELD.join(fields)


def statuses(mountpoints: list[str]) -> dict[str, dict]:
    """Each mount's status, asked of all at once in threads of their own, as the client the
    preload library is (``Control.share``: the mount keeps its index from now on): a mount
    whose daemon is stopped or waiting on another would hang the command; one that has not
    answered within ``STATUS_WAIT_S`` is left out, and said so."""
    answers: queue.Queue[tuple[str, dict]] = queue.Queue()

    def ask(mountpoint: str) -> None:
        try:
            answers.put((mountpoint, Control(mountpoint).share(STATUS_WAIT_S / 2)))
        except (ControlError, OSError, ValueError):  # not this user's: nothing to serve
            answers.put((mountpoint, {}))

    for mountpoint in mountpoints:
        threading.Thread(target=ask, args=(mountpoint,), daemon=True).start()
    found: dict[str, dict] = {}
    deadline = time.monotonic() + STATUS_WAIT_S
    for _ in mountpoints:
        try:
            mountpoint, status = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        found[mountpoint] = status
    for mountpoint in mountpoints:
        if mountpoint not in found:
            print(f"coordlfs run: {mountpoint} did not answer; its files are read through "
                  "the mount", file=sys.stderr)
    return {mountpoint: status for mountpoint, status in found.items() if status}


def coordlfs_mounts(named: Iterable[str]) -> list[str]:
    """The mountpoints to serve: those named (each must be a coordlfs mount), else every
    coordlfs mount of the table."""
    named = list(named)
    if not named:
        return [entry.mountpoint for entry in mounts() if entry.fstype == FSTYPE]
    found = []
    for path in named:
        entry = mount_at(path)
        if entry is None or entry.fstype != FSTYPE:
            raise UserError(f"{path} is not a coordlfs mount")
        found.append(entry.mountpoint)
    return found


def environment(named: Iterable[str], base: dict[str, str]) -> dict[str, str] | None:
    """``base`` with the library preloaded for the mounts, or None without the library."""
    lib = library()
    if lib is None:
        return None
    found = statuses(coordlfs_mounts(named))
    records = [r for r in (mount_record(m, s) for m, s in found.items()) if r is not None]
    env = dict(base)
    preload = [str(lib), *(p for p in base.get("LD_PRELOAD", "").split(":")
                           if p and p != str(lib))]
    env["LD_PRELOAD"] = ":".join(preload)
    env["COORDLFS_MOUNTS"] = _RECORD.join(records)
    return env


def print_env(named: Iterable[str], style: str) -> int:
    """The variables, for a script (``sh``: ``export NAME='value'``, to ``eval``) or a Slurm
    TaskProlog (``slurm``: ``export NAME=value`` lines, taken literally by slurmstepd)."""
    env = environment(named, {})
    if env is None:
        raise UserError("the preload library is not built (scripts/setup builds it)")
    for name in ("LD_PRELOAD", "COORDLFS_MOUNTS"):
        value = env[name] if style == "slurm" else shlex.quote(env[name])
        print(f"export {name}={value}")
    return 0


def run(named: Iterable[str], command: list[str]) -> int:
    """Replace this process with ``command``, preloaded; plainly if the library is not
    built (said in one line)."""
    if not command:
        raise UserError("no command to run: coordlfs run [--mount MNT]... -- CMD [ARGS...]")
    env = environment(named, dict(os.environ))
    if env is None:
        print("coordlfs run: the preload library is not built (scripts/setup builds it); "
              "running the command through the mount", file=sys.stderr)
        env = dict(os.environ)
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:  # as a shell says it: 127 not found, 126 not runnable
        print(f"coordlfs run: {command[0]}: {e.strerror}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126
    return 0  # not reached: exec replaced the process
