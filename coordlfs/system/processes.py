"""Other processes, known by pid: alive or gone, their parents, and those holding a directory.

Below the CLI, the daemon's memberships and the tests alike, which all outlive or watch
processes that are not their children.
"""

from __future__ import annotations

import contextlib
import os
import time

from coordlfs.system.mounts import within


def wait_exit(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` has exited; False on timeout. A zombie counts as exited: the
    daemon is not our child, so we cannot reap it."""
    deadline = time.monotonic() + timeout
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: the state, the parent's pid..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] != "Z"
    except FileNotFoundError:
        return False


def parent_pid(pid: int) -> int | None:
    try:
        return int(_stat(pid)[1])
    except (OSError, ValueError, IndexError):
        return None


def group_members(pgid: int) -> set[int]:
    """The live processes of group ``pgid`` now (zombies, already gone, left out)."""
    members = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):  # gone meanwhile
                fields = _stat(int(name))
                if int(fields[2]) == pgid and fields[0] != "Z":
                    members.add(int(name))
    return members


def process_uids(pid: int) -> tuple[int, int] | None:
    """The real and effective uid of a process, or None if it is gone.

    From ``/proc/PID/status``, not the owner of ``/proc/PID``: a process that changed its
    uid without exec is not dumpable, and its ``/proc`` entries then belong to root.
    """
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    real, effective = line.split()[1:3]
                    return int(real), int(effective)
    except (OSError, ValueError):
        return None
    return None


#: What a process may hold a directory by, as ``/proc/PID`` shows it, and the words for it.
_HOLDS = (("cwd", "its working directory"), ("root", "its root directory"),
          ("exe", "its program"))


def holders(directory: str, exclude: tuple[int, ...] = ()) -> list[tuple[int, str, str]]:
    """Processes that keep ``directory`` (a real path) busy, as ``fuser -m`` finds them: by
    their working or root directory, their program, an open descriptor or a mapped file
    beneath it; (pid, command name, how), by pid. Only what ``/proc`` lets this user see:
    another user's processes are found by root alone. Paths are read, never followed, so a
    look does not wait on the mount."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in exclude:
            how = _holds(int(name), directory)
            if how is not None:
                found.append((int(name), _command(int(name)), how))
    return sorted(found)


def _holds(pid: int, directory: str) -> str | None:
    """How ``pid`` holds ``directory``, or None."""
    for link, words in _HOLDS:
        if _beneath(_link(f"/proc/{pid}/{link}"), directory):
            return words
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if _beneath(_link(f"/proc/{pid}/fd/{fd}"), directory):
                return "an open file"
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and _beneath(fields[5].rstrip("\n"), directory):
                return "a mapped file"
    return None


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # gone, or not ours to see
        return ""


def _beneath(path: str, directory: str) -> bool:
    """``/proc`` marks a path removed since it was opened; it still names where it was."""
    return within(path.removesuffix(" (deleted)"), directory)


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"
