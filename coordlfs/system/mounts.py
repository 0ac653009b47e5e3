"""The mount table (``/proc/self/mountinfo``): what is mounted where, and by whom.

Read by the daemon (its own mount, the cache's tmpfs), by the command line and by the job side's
control client alike, so it sits below all of them and knows nothing of coordlfs's own mounts.
"""

from __future__ import annotations

import os
import re
import select
import threading
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


def filesystem_type(path: str) -> str:
    """The type of the filesystem that holds ``path``: the deepest mountpoint above it."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    for entry in mounts():
        mountpoint = entry.mountpoint
        inside = path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")
        if inside and len(mountpoint) >= len(best):
            best, kind = mountpoint, entry.fstype
    return kind


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
    return _device(found)


class DevicesOfType:
    """The devices of the mounts of one type in this mount namespace, as a container:
    ``device in devices``. For ``fuse.coordlfs``: such a mount's daemon may be waiting on the
    one that asks (``coordlfs.source.walk``), so no walk of a source enters one.

    The table is read again only when the kernel says it changed (POLLPRI on an open
    mountinfo), so a check costs one poll; checks from several threads take turns, so that
    none answers from a table older than the mount it met.
    """

    def __init__(self, fstype: str) -> None:
        self.fstype = fstype
        self._lock = threading.Lock()
        self._poll: select.poll | None = None
        self._devices: frozenset[int] = frozenset()

    def __contains__(self, device: object) -> bool:
        with self._lock:
            if self._poll is None:  # opened first: a change after it is reported
                fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
                self._poll = select.poll()
                self._poll.register(fd, select.POLLPRI)
                self._read()
            elif self._poll.poll(0):  # reported once per change, by the poll itself
                self._read()
            return device in self._devices

    def _read(self) -> None:
        self._devices = frozenset(_device(entry) for entry in mounts()
                                  if entry.fstype == self.fstype)


#: The process's one view of the coordlfs mounts (a descriptor on its mount table).
coordlfs_devices = DevicesOfType("fuse.coordlfs")


def _device(entry: MountEntry) -> int:
    major, _, minor = entry.device.partition(":")
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
