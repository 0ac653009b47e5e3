"""The cache directory: opened, locked and given back as one step each, so that a refusal at
any point leaves nothing held (the lock, the descriptors, a tmpfs of the cache's own).

Its entries' bytes are served as cached files, so the directory must be ours alone and never
reached through a link; one mount at a time uses it (an exclusive ``flock``), and a killed
daemon's index is retired before its files are touched, so that its clients stop trusting it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from dataclasses import dataclass

from coordlfs.cache import cache_tmpfs
from coordlfs.cache.published import INDEX, PUBLIC_INDEX, retire
from coordlfs.errors import UserError
from coordlfs.system.private_dir import open_private

#: the directory of the entries' files, in the cache directory
FILES = "files"
#: what a user can do about a cache directory that is not theirs alone
REMEDY = "remove it or give --cache-dir"


@dataclass(slots=True)
class CacheDirectory:
    """The cache directory held: its path (no links in it), descriptors, and whether the
    entries' files were left public by a mount that served other users."""

    path: str
    fd: int
    files_fd: int
    #: a tmpfs of the cache's own (``cache_tmpfs``): unmounted, not emptied, when the
    #: cached bytes go
    own_tmpfs: bool
    were_public: bool

    @classmethod
    def open(cls, directory: str, capacity: int, own_tmpfs: bool) -> CacheDirectory:
        """Open, lock and prepare ``directory``; a refusal is a ``UserError`` of one line."""
        directory, dir_fd = _open_dir(directory, capacity, own_tmpfs)
        own_tmpfs = own_tmpfs and cache_tmpfs.is_own(directory)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(dir_fd)
            raise UserError(f"cache directory {directory} is in use by another coordlfs mount "
                            "(give this mount its own --cache-dir)") from None
        for index in (INDEX, PUBLIC_INDEX):  # a killed daemon's clients: before its files go
            retire(dir_fd, index)
        try:
            files_fd, were_public = open_files(dir_fd, directory)
        except (OSError, UserError) as e:
            os.close(dir_fd)
            if own_tmpfs:
                cache_tmpfs.unmount_own(directory)
            if isinstance(e, OSError):
                raise UserError(f"cannot use cache directory {directory}: {e.strerror}") from None
            raise
        return cls(directory, dir_fd, files_fd, own_tmpfs, were_public)

    def close(self, keep: bool) -> None:
        """Remove the cached bytes unless ``keep``; then release the lock. The journal and
        the entries' files are closed by their owners first."""
        if not keep and not self.own_tmpfs:  # emptied while still locked
            shutil.rmtree(self.path, ignore_errors=True)
        os.close(self.fd)
        if not keep and self.own_tmpfs:
            cache_tmpfs.unmount_own(self.path)


def _open_dir(directory: str, capacity: int, own_tmpfs: bool) -> tuple[str, int]:
    """The directory made 0700 or checked to be ours alone (``private_dir``), with a tmpfs of
    its own mounted on it where asked."""
    try:
        directory, dir_fd = open_private(directory, REMEDY)
        if own_tmpfs and cache_tmpfs.mount_own(dir_fd, directory, capacity):
            os.close(dir_fd)  # the directory beneath the new tmpfs
            dir_fd = open_private(directory, REMEDY).fd
    except OSError as e:
        raise UserError(f"cannot use cache directory {directory}: {e.strerror}") from None
    return directory, dir_fd


def open_files(dir_fd: int, directory: str) -> tuple[int, bool]:
    """The entries' directory, made 0700 where absent, and whether a mount that served other
    users left it searchable (``coordlfs.cache.public``: its files may be 0444); never
    through a link, and never a directory that is not ours (its files are served as cached
    bytes). It is private again when this returns: a mount serving others opens it anew."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(FILES, 0o700, dir_fd=dir_fd)
    try:
        fd = os.open(FILES, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UserError(f"{directory}/{FILES} is not a directory: {REMEDY}") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o066:  # search only, at most: public's
        os.close(fd)
        raise UserError(f"{directory}/{FILES} is not a private directory of uid "
                        f"{os.geteuid()}'s: {REMEDY}")
    were_public = bool(st.st_mode & 0o011)
    if were_public:
        for private in (dir_fd, fd):
            os.fchmod(private, 0o700)
    return fd, were_public
