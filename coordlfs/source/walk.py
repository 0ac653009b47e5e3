"""Walking the source without ever entering a coordlfs mount.

The mount can come to lie beneath its own source: mounted there, which ``coordlfs mount``
refuses, or put there afterwards (``mount --bind MNT SRC/sub``). A walk of the daemon's that
went into it would wait for an answer only the daemon can give, while the daemon waits in
that walk: the mount would hang until ``umount -f``. Another coordlfs mount beneath the
source can close the same loop through its daemon (A serves SRC on MA, B serves MA on
SRC/mut: A's walk into SRC/mut waits on B, whose walk waits on A). So every walk from the
source's root goes with RESOLVE_NO_XDEV, which makes the kernel refuse (EXDEV) a path that
crosses any mount before it touches what is mounted there. Only such a path is walked again,
a component at a time: each mount on the way is entered with an O_PATH open (which asks a
FUSE filesystem nothing) and its device read by a statx that may not sync (which asks
nothing either); a coordlfs mount (ours or another: ``barred``) is ELOOP, and any other (a
dataset's nested mounts) is walked through. The kernel decides at the moment of the walk, so
a mount that appears at any time is caught: there is no window between a check and its use.

Symlinks are followed nowhere (RESOLVE_NO_SYMLINKS): the mount shows links as links, so no
path the kernel asks for goes through one, and a path that did would reach a file the
mount does not show there.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Container

from coordlfs.source.beneath import RESOLVE_NO_SYMLINKS, RESOLVE_NO_XDEV, try_openat2

#: how every walk resolves: no mount crossed, no link followed
RESOLVE = RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS
#: a directory on the way
DIRECTORY = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_AT_EMPTY_PATH = 0x1000
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_STATX_DONT_SYNC = 0x4000
#: struct statx: 256 bytes, stx_dev_major and stx_dev_minor at 136 and 140
_STATX_SIZE, _DEV_AT = 256, 136
_libc = ctypes.CDLL(None, use_errno=True)


def device_of(fd: int) -> int:
    """st_dev of what ``fd`` refers to, without a request to its filesystem: statx with no
    field asked for and AT_STATX_DONT_SYNC, which FUSE and NFS answer from the inode."""
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _libc.statx(fd, b"", _AT_EMPTY_PATH | _AT_SYMLINK_NOFOLLOW | _AT_STATX_DONT_SYNC, 0,
                   buf) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    major, minor = (int.from_bytes(buf[i : i + 4], "little") for i in (_DEV_AT, _DEV_AT + 4))
    return os.makedev(major, minor)


def open_outside(dir_fd: int, path: bytes, flags: int, barred: Container[int]) -> int:
    """``path`` relative to ``dir_fd`` opened with ``flags``, through any mount but one whose
    device is ``barred`` (the coordlfs mounts: ``system.mounts.coordlfs_devices``), where it
    is ELOOP.

    Where the path crosses a mount it is walked a directory at a time up to the crossing,
    past it checked, and the rest again in one call: a lookup under a dataset's nested mount
    costs a few calls more, not one per component.
    """
    fd = try_openat2(dir_fd, path, flags, RESOLVE)
    if fd >= 0:
        return fd
    if fd != -errno.EXDEV:
        raise _error(-fd, path)
    opened: list[int] = []
    try:
        at, rest = dir_fd, path
        while True:
            name, _, rest = rest.partition(b"/")
            if not rest:  # the directories on the way crossed nothing: this name does
                return _cross(at, name, flags, barred)
            fd = try_openat2(at, name, DIRECTORY, RESOLVE)
            if fd == -errno.EXDEV:
                fd = _cross(at, name, DIRECTORY, barred)
                opened.append(fd)
                fd = try_openat2(fd, rest, flags, RESOLVE)
                if fd >= 0:
                    return fd
                if fd != -errno.EXDEV:
                    raise _error(-fd, path)
                at = opened[-1]  # a mount further on
                continue
            if fd < 0:
                raise _error(-fd, path)
            opened.append(fd)
            at = fd
    finally:
        for fd in opened:
            os.close(fd)


def _cross(dir_fd: int, name: bytes, flags: int, barred: Container[int]) -> int:
    """``name`` in ``dir_fd``, into whatever is mounted on it unless that is barred: entered
    with O_PATH, which asks its filesystem nothing, and opened as ``flags`` asks once known
    not to be barred (by /proc, since a mount's root is never a symlink to keep from
    following)."""
    crossed = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    kept = False
    try:
        if device_of(crossed) in barred:
            raise OSError(errno.ELOOP, "a coordlfs mount, whose daemon may wait on this one",
                          os.fsdecode(name))
        if flags & os.O_PATH:
            kept = True
            return crossed
        return os.open(b"/proc/self/fd/%d" % crossed, flags & ~os.O_NOFOLLOW)
    finally:
        if not kept:
            os.close(crossed)


def _error(err: int, path: bytes) -> OSError:
    return OSError(err, os.strerror(err), os.fsdecode(path))
