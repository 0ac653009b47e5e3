"""Opening a file beneath a directory as a reader through the mount would reach it.

Standard library only: the daemon's fills and ``coordlfs.client`` (which must not need
trio or pyfuse3) both open source files this way.
"""

from __future__ import annotations

import ctypes
import os

_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every architecture (it postdates the split tables)
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def open_beneath(root_fd: int, path: bytes, flags: int) -> int:
    """Open ``path`` relative to ``root_fd`` without leaving it and without following any
    symlink on the way (openat2), as a reader through the mount would reach that file: the
    mount shows links as links, so a path through one is not the file it names."""
    how = _OpenHow(flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0,
                   _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, root_fd, path, ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
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
