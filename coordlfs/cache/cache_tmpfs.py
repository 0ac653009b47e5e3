"""A tmpfs of the cache's own, in huge pages.

On a tmpfs mounted ``huge=within_size`` (like ``/dev/shm`` usually is not) the arena is held in
2 MiB folios, so a process of ``coordlfs.client`` maps a cached file with one page fault where
4 KiB pages cost about two per 112 KB file: a fresh reader process (a DataLoader worker)
otherwise pays as much for its first read of a file as tmpfs does for a whole open and read.
Mounting needs root; where it cannot be done the cache stays where it is, only slower for
fresh client processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os

from coordlfs.system.mounts import mount_at

log = logging.getLogger(__name__)

#: Room beside the cache's capacity on its tmpfs: the published index and the journal, and
#: the pages entries share at their ends.
MARGIN = 64 << 20
#: the name /proc/mounts shows for the tmpfs
SOURCE = "coordlfs-cache"
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def mount_own(dir_fd: int, directory: str, capacity: int) -> bool:
    """Mount a tmpfs in huge pages on the directory ``dir_fd`` (at ``directory``), sized for
    ``capacity``; True if it did (the caller opens the new tmpfs). ``is_own`` tells afterwards
    whether it is one, whoever mounted it. A directory that is already a mount point (this
    cache's tmpfs, kept by ``--keep-cache``) is used as it is, and so is one that holds files
    (a cache kept on the tmpfs below: hiding it would leak its memory)."""
    if mount_at(directory) is not None or os.listdir(dir_fd):
        return False
    size = capacity + max(MARGIN, capacity // 50)
    options = f"size={size},mode=0700,huge=within_size".encode()
    # on the directory the descriptor holds, the one that was checked, not on a path
    if _libc.mount(SOURCE.encode(), f"/proc/self/fd/{dir_fd}".encode(), b"tmpfs",
                   _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options) != 0:
        err = ctypes.get_errno()
        log.info("cache stays on %s's filesystem (a tmpfs of its own in huge pages: %s)",
                 directory, os.strerror(err))
        return False
    return True


def unmount_own(directory: str) -> None:
    """Let go of the cache's tmpfs (its memory with it, once nothing maps it) and remove the
    directory."""
    if _libc.umount2(os.fsencode(directory), _MNT_DETACH) != 0:
        log.warning("cannot unmount the cache's tmpfs %s: %s", directory,
                    os.strerror(ctypes.get_errno()))
        return
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def is_own(directory: str) -> bool:
    """Whether ``directory`` is a tmpfs mounted by ``mount_own`` (this run's or a kept one)."""
    entry = mount_at(directory)
    return entry is not None and entry.fstype == "tmpfs" and entry.source == SOURCE
