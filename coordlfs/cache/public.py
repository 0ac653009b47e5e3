"""The indexes the cache publishes to, and the entries every user may open themselves.

The cache directory is the daemon user's (0700), so only that user's processes (and root's)
find cached files in its index (``coordlfs.client``, ``coordlfs run``'s preload library);
every other user reads through the mount. On an ``--allow-other`` mount other users are
expected, and the preload library can serve them too, but only with what they could read
through the mount anyway, judged by modes alone and conservatively: a file every user may
read (o+r) beneath directories every user may search (o+x), from the source's root down.
Such an entry's file is made 0444 and published in a second index, ``published.public``
(0644) that holds nothing else: the private index would tell another user the sizes and dates
of files in directories closed to them. The rest stays 0600, and its opens go through the
mount, where the kernel checks owners and groups.

A change in the source (the watch's events, a chmod among them) withdraws an entry from both
indexes; its file is made 0600 first, so that a user who knows its number cannot open it any
more. The window is the watch's latency, as for the kernel's cached attributes of the mount
(docs/design/security.md). The cache directory, its ``files`` directory and the default
cache directory's per-user parent are made searchable (0711): nothing can be listed, numbers
must be guessed, and only public files open.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable

from coordlfs.cache.published import PUBLIC_INDEX, IndexWriter, Published

#: Search for every user on the directories leading to public files.
SEARCHABLE = 0o711


class Indexes:
    """The private index and, on an ``--allow-other`` mount, the public one: what the cache
    publishes to, withdraws from, beats and tells its room."""

    def __init__(self, dir_fd: int, files_fd: int, revalidate: bool,
                 lstat: Callable[[bytes], os.stat_result] | None = None) -> None:
        """``lstat`` (the source's, by relative path): set on an ``--allow-other`` mount,
        where entries every user may read are published to them too."""
        self.private = IndexWriter(dir_fd, revalidate)
        self.public: IndexWriter | None = None
        self._files_fd = files_fd
        self._lstat = lstat
        #: directory -> whether every user may search it and every one above it
        self._searchable: dict[bytes, bool] = {}
        if lstat is not None:
            self.public = IndexWriter(dir_fd, revalidate, PUBLIC_INDEX, 0o644)
            for fd in (dir_fd, files_fd):
                os.fchmod(fd, SEARCHABLE)

    def __len__(self) -> int:
        return len(self.private)

    def __contains__(self, path: bytes) -> bool:
        return path in self.private

    @property
    def revalidate(self) -> bool:
        return self.private.revalidate

    @property
    def withdrawn(self) -> int:
        return self.private.withdrawn

    def _each(self) -> list[IndexWriter]:
        return [self.private] if self.public is None else [self.private, self.public]

    def publish(self, path: bytes, found: Published, mode: int) -> None:
        """Publish an entry (``mode``: its source file's); to every user too if the modes
        open it to all. OSError if an index cannot grow."""
        self.private.publish(path, found)
        if self.public is not None and self.open_to_all(path, mode):
            os.chmod(f"{found.offset:x}", 0o444, dir_fd=self._files_fd, follow_symlinks=False)
            self.public.publish(path, found)

    def withdraw(self, path: bytes) -> None:
        """Withdraw a path from every index; its file is closed to other users first."""
        if self.public is not None:
            number = self.public.number(path)
            if number is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.chmod(f"{number:x}", 0o600, dir_fd=self._files_fd,
                             follow_symlinks=False)
                self.public.withdraw(path)
        self.private.withdraw(path)

    def hand_over(self, path: bytes) -> None:
        """Mark a file handed to the fills (``IndexWriter.hand_over``) for this user's
        clients: only they read files directly (other users' find no index they may open
        and read through the mount; the preload library reads no marks)."""
        self.private.hand_over(path)

    def take_back(self, path: bytes) -> None:
        self.private.take_back(path)

    def changed_directory(self) -> None:
        """A directory's modes may have changed: judge them again."""
        self._searchable.clear()

    def open_to_all(self, path: bytes, mode: int) -> bool:
        """Whether every user may read the file ``path`` of ``mode`` through the mount, by the
        modes alone (False where other users are not served: no ``--allow-other``)."""
        return self.public is not None and bool(mode & stat.S_IROTH) and self._open_to_all(path)

    def _open_to_all(self, path: bytes) -> bool:
        """Whether every directory from the source's root to ``path`` is searchable by all."""
        parent = path.rpartition(b"/")[0]
        known = self._searchable.get(parent)
        if known is None:
            assert self._lstat is not None
            try:
                here = bool(self._lstat(parent).st_mode & stat.S_IXOTH)
            except (OSError, ValueError):
                here = False
            known = here and (not parent or self._open_to_all(parent))
            self._searchable[parent] = known
        return known

    def reserve(self, files: int) -> None:
        for index in self._each():
            index.reserve(files)

    def set_revalidate(self) -> None:
        for index in self._each():
            index.set_revalidate()

    def set_room(self, room: int) -> None:
        for index in self._each():
            index.set_room(room)

    def beat(self) -> None:
        for index in self._each():
            index.beat()

    def close(self) -> None:
        for index in self._each():
            index.close()


def open_parent(dir_fd: int, default_parent: str) -> None:
    """Make the default cache directory's per-user parent searchable by all (0711), if the
    cache directory is in it: public files beneath it are reached through it. Never another
    directory: one the user named is theirs to open."""
    with contextlib.suppress(OSError):
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=dir_fd)
        try:
            st, named = os.fstat(parent), os.stat(default_parent, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == (named.st_dev, named.st_ino) \
                    and st.st_uid == os.geteuid():
                os.fchmod(parent, SEARCHABLE)
        finally:
            os.close(parent)
