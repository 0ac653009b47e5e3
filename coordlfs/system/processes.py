"""Other processes, known by pid: alive or gone, and their parents.

Below the CLI, the daemon's memberships and the tests alike, which all outlive or watch
processes that are not their children.
"""

from __future__ import annotations

import time


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
