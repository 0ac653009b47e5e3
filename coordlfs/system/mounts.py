"""The mount table (``/proc/self/mountinfo``): what is mounted where, and by whom.

Read by the daemon (its own mount, the cache's tmpfs), by the command line and by the job side's
control client alike, so it sits below all of them and knows nothing of coordlfs's own mounts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(slots=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    #: "major:minor" of the mounted filesystem; for FUSE also the name of its bdi in /sys
    device: str = ""
    #: the filesystem's own options (FUSE: ``user_id=``, ``allow_other``)
    options: tuple[str, ...] = ()

    @property
    def owner(self) -> int | None:
        """The uid that mounted a FUSE filesystem: it (or root) alone may unmount it, and
        without ``allow_other`` the kernel lets no one else in."""
        for option in self.options:
            if option.startswith("user_id="):
                return int(option[8:])
        return None


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts() -> list[MountEntry]:
    entries = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            entries.append(MountEntry(_unescape(fields[4]), rest[0], _unescape(rest[1]),
                                      fields[2], tuple(rest[2].split(","))))
    return entries


def mount_at(path: str) -> MountEntry | None:
    """The topmost mount whose mountpoint is exactly ``path``."""
    return _topmost(os.path.realpath(path))


def _topmost(mountpoint: str) -> MountEntry | None:
    """The last listed (the topmost) mount at ``mountpoint``, a real path, from the table
    alone."""
    found = None
    for entry in mounts():
        if entry.mountpoint == mountpoint:
            found = entry
    return found


def device_mounted_at(mountpoint: str) -> int | None:
    """The device of the topmost coordlfs mount at ``mountpoint`` (a real path), from the mount
    table alone: a stat would ask that mount's daemon, which may be the caller, not serving
    yet."""
    found = _topmost(mountpoint)
    if found is None or found.fstype != "fuse.coordlfs":
        return None
    major, _, minor = found.device.partition(":")
    return os.makedev(int(major), int(minor))


def mount_holding(path: str) -> MountEntry | None:
    """The mount ``path`` is on, from the mount table alone, without a walk up that stats
    each directory (which a directory this user may not enter would cut short). Of the
    mounts on the way the last listed is on top: it was mounted over, or inside, the rest."""
    real = os.path.realpath(path)
    found = None
    for entry in mounts():
        if within(real, entry.mountpoint):
            found = entry
    return found


def within(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or beneath it (both absolute, normalised)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")
