"""A directory of ours in a shared place (``/dev/shm``, ``/tmp``): made, or checked, then
used through its descriptor.

``/dev/shm`` is writable by every user and our names in it are predictable. Another user who
makes our directory before we do (mode 777, after a boot) would read the bytes we put there,
put their own where we read, or leave a symbolic link where we write (to a file of root's,
truncated). So a directory of ours is made exclusively (``mkdir``, mode 700) where it is
absent, and one that exists is used only when it is ours: owned by us, writable by nobody
else, not a symbolic link. Its ancestors must be owned by root or by us and writable by
others only when sticky (OpenSSH's rule for ``authorized_keys``), so that nobody else can
rename it away and put their own in its place: clients and jobs open its files by path.

The walk opens each name relative to the directory before it, without following links, and
checks what it opened: what is checked is what is used. A symbolic link among the ancestors
(``/var/run``) is followed only when root or we own it, and the path handed back has none.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import NamedTuple

from coordlfs.errors import UserError

#: symbolic links followed among the ancestors before giving up, as the kernel does
MAX_LINKS = 40
_ANCESTOR = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_OURS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class PrivateDir(NamedTuple):
    #: the directory's path, with no symbolic link in it
    path: str
    #: the directory, opened read-only (for ``dir_fd``, ``flock``, ``fstatvfs``)
    fd: int


def open_private(path: str, remedy: str) -> PrivateDir:
    """Make ``path`` (mode 700, and any missing ancestor) or check that it is ours, and open it.

    A check that fails is a UserError of one line naming the directory at fault, the reason
    and ``remedy`` (what the user can do: "remove it or give --cache-dir").
    """
    wanted = os.path.abspath(path)
    for _link in range(MAX_LINKS + 1):
        found = _walk(wanted, os.geteuid(), remedy)
        if isinstance(found, PrivateDir):
            return found
        wanted = found
    raise UserError(f"{path}: more than {MAX_LINKS} symbolic links: {remedy}")


def _walk(path: str, euid: int, remedy: str) -> PrivateDir | str:
    """The directory at ``path``, or the path to walk instead (an ancestor was a link)."""
    *ancestors, last = [name for name in path.split("/") if name] or [""]
    if not last:
        raise UserError(f"/ cannot be a directory of coordlfs's own: {remedy}")
    here = "/"
    fd = os.open(here, _ANCESTOR)
    try:
        _check_ancestor(os.fstat(fd), here, euid, remedy)
        for i, name in enumerate(ancestors):
            where = os.path.join(here, name)
            child = _open_ancestor(fd, name)
            st = os.fstat(child)
            if stat.S_ISLNK(st.st_mode):
                os.close(child)
                if st.st_uid not in (0, euid):
                    raise UserError(f"{where} is a symbolic link owned by uid {st.st_uid}: "
                                    f"{remedy}")
                # the directory holding it passed: only root or we can change the link
                target = os.readlink(name, dir_fd=fd)
                return os.path.abspath(os.path.join(here, target, *ancestors[i + 1 :], last))
            os.close(fd)
            fd = child
            if not stat.S_ISDIR(st.st_mode):
                raise UserError(f"{where} is not a directory: {remedy}")
            _check_ancestor(st, where, euid, remedy)
            here = where
        where = os.path.join(here, last)
        ours = _open_ours(fd, last, where, remedy)
    finally:
        os.close(fd)
    try:
        _check_ours(os.fstat(ours), where, euid, remedy)
    except BaseException:
        os.close(ours)
        raise
    return PrivateDir(where, ours)


def _open_ancestor(parent: int, name: str) -> int:
    """``name`` in ``parent``, made (mode 700) if absent; a link is opened as itself."""
    while True:
        try:
            return os.open(name, _ANCESTOR, dir_fd=parent)
        except FileNotFoundError:
            _make(parent, name)


def _open_ours(parent: int, name: str, where: str, remedy: str) -> int:
    """``name`` in ``parent``, made (mode 700) if absent; never through a link."""
    while True:
        try:
            return os.open(name, _OURS, dir_fd=parent)
        except FileNotFoundError:
            _make(parent, name)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            link = stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
            what = "a symbolic link" if link else "not a directory"
            raise UserError(f"{where} is {what}: {remedy}") from None


def _make(parent: int, name: str) -> None:
    # made meanwhile by someone else: then opened and checked like any that existed
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent)


def _check_ancestor(st: os.stat_result, where: str, euid: int, remedy: str) -> None:
    if st.st_uid not in (0, euid):
        owners = "0" if euid == 0 else f"root or {euid}"
        raise UserError(f"{where} is owned by uid {st.st_uid}, not {owners}: {remedy}")
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        raise UserError(f"{where} is writable by others and not sticky (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}): {remedy}")


def _check_ours(st: os.stat_result, where: str, euid: int, remedy: str) -> None:
    if st.st_uid != euid:
        raise UserError(f"{where} is owned by uid {st.st_uid}, not {euid}: {remedy}")
    if st.st_mode & _OTHERS_WRITE:
        raise UserError(f"{where} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                        f"{remedy}")
