"""Opening a file beneath a directory as a reader through the mount would reach it.

Standard library only: the daemon's fills and ``coordlfs.client`` (which must not need
trio or pyfuse3) both open source files this way; the daemon's walks of the source
(``coordlfs.source.walk``) go through ``openat2`` too.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every architecture (it postdates the split tables)
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_HOW_SIZE = ctypes.sizeof(_OpenHow)


def open_beneath(root_fd: int, path: bytes, flags: int) -> int:
    """Open ``path`` relative to ``root_fd`` without leaving it and without following any
    symlink on the way (openat2), as a reader through the mount would reach that file: the
    mount shows links as links, so a path through one is not the file it names."""
    return openat2(root_fd, path, flags | os.O_NOFOLLOW | os.O_CLOEXEC,
                   _RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)


#: the ``open_how`` of each (flags, resolve) asked for: built once, read-only after, so
#: that threads share them and a call builds nothing
_hows: dict[tuple[int, int], Any] = {}


def try_openat2(dir_fd: int, path: bytes, flags: int, resolve: int) -> int:
    """openat2(2): ``path`` relative to ``dir_fd`` opened with ``flags``, resolved under the
    RESOLVE_* rules ``resolve``; the descriptor, or minus the errno (so that a failure the
    caller expects costs no exception)."""
    how = _hows.get((flags, resolve))
    if how is None:
        how = _hows[flags, resolve] = ctypes.byref(_OpenHow(flags, 0, resolve))
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, path, how, _HOW_SIZE)
    return fd if fd >= 0 else -ctypes.get_errno()


def openat2(dir_fd: int, path: bytes, flags: int, resolve: int) -> int:
    """``try_openat2``, a failure raised as ``os.open`` raises it."""
    fd = try_openat2(dir_fd, path, flags, resolve)
    if fd < 0:
        raise OSError(-fd, os.strerror(-fd), os.fsdecode(path))
    return fd


def mode_grants(st: os.stat_result, uid: int, gids: frozenset[int], bit: int) -> bool:
    """Whether the mode grants ``bit`` (4 read, 1 search) to ``uid`` in ``gids``: the owner's
    bits for the owner, else the group's for a member, else the others', as
    ``generic_permission`` does with the modes a mount (``default_permissions``) shows."""
    if st.st_uid == uid:
        return bool(st.st_mode & (bit << 6))
    if st.st_gid in gids:
        return bool(st.st_mode & (bit << 3))
    return bool(st.st_mode & bit)
