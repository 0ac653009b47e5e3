"""Watching the source's directories with inotify, for whoever must hear of its changes.

Two watch it: the filesystem's freshness (``coordlfs.fs.freshness``: the kernel's cached names and
attributes) and the cache's published index (``PublishedWatch``: what clients may read from
shared memory without asking the daemon). Both need only the source, so the watching is here,
below both; what a change means is theirs.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import trio

from coordlfs.source.source import Source, fd_path
from coordlfs.source.walk import DIRECTORY
from coordlfs.system.mounts import filesystem_type

log = logging.getLogger(__name__)

#: what a watcher knows a watched directory by
_K = TypeVar("_K")

# <sys/inotify.h>
_IN_MODIFY, IN_ATTRIB, _IN_CLOSE_WRITE = 0x2, 0x4, 0x8
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_Q_OVERFLOW, IN_IGNORED = 0x4000, 0x8000
_IN_ONLYDIR, _IN_EXCL_UNLINK = 0x01000000, 0x04000000
_EVENTS = (_IN_MODIFY | IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO
           | _IN_CREATE | _IN_DELETE)
#: (the directory is opened first, with O_NOFOLLOW, and watched by its /proc path, followed)
_WATCH_MASK = _EVENTS | _IN_ONLYDIR | _IN_EXCL_UNLINK
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
_READ_SIZE = 1 << 16
#: After a batch of events, wait this long for more before invalidating: a writer makes
#: many events per file, and each name is invalidated once per batch. What cannot wait
#: (``Watcher._at_once``: a permission change) is handled as soon as it is read.
BATCH_S = 0.05
#: One event: its watch descriptor, mask and name (empty: the watched directory itself).
Event = tuple[int, int, bytes]

#: Filesystems whose changes may come from elsewhere (other hosts, a FUSE daemon), which
#: inotify does not see.
_UNWATCHABLE = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs",
                "9p", "afs", "ocfs2", "gfs2", "beegfs", "fuse", "fuseblk", "virtiofs"}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]


def _unwatchable(fstype: str) -> bool:
    return fstype in _UNWATCHABLE or fstype.startswith("fuse.")


class Watcher(Generic[_K]):
    """One inotify instance on directories of the source, and the loop that reads it.

    Each watched directory has a key (what a subclass knows it by) and a watch descriptor.
    """

    #: seconds to wait after the first event of a batch for more
    batch_s = 0.0

    def __init__(self, source: Source) -> None:
        self.source = source
        self.events = 0
        self.fd = -1
        self.reason = ""
        self._wd_of: dict[_K, int] = {}
        self._key_of: dict[int, _K] = {}
        fstype = filesystem_type(source.path)
        if _unwatchable(fstype):
            self._give_up(f"the source is on {fstype}, where inotify misses other hosts' "
                          "changes")
            return
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            self._give_up(f"inotify: {os.strerror(ctypes.get_errno())}")

    @property
    def watching(self) -> bool:
        return self.fd >= 0

    def _give_up(self, reason: str) -> None:
        self.reason = reason
        self.close()
        self._wd_of.clear()
        self._key_of.clear()

    def _add_watch(self, path: bytes) -> int | None:
        """The watch descriptor of a source directory; None if it is gone (the caller's next
        look at the source says so). Failing otherwise gives up watching (``_give_up``)."""
        try:
            fd = self.source.open(path, DIRECTORY)
        except OSError as e:
            err = e.errno
        else:
            wd = _libc.inotify_add_watch(self.fd, fd_path(fd), _WATCH_MASK)
            err = ctypes.get_errno()
            os.close(fd)
            if wd >= 0:
                return wd
        if err not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            self._give_up(f"cannot watch {os.fsdecode(path) or '.'}: {os.strerror(err)}"
                          + (" (raise fs.inotify.max_user_watches)" if err == errno.ENOSPC
                             else ""))
        return None

    def _remember(self, key: _K, wd: int) -> None:
        self._wd_of[key] = wd
        self._key_of[wd] = key

    def _unwatch(self, key: _K) -> None:
        wd = self._wd_of.pop(key, None)
        if wd is not None:
            self._key_of.pop(wd, None)
            _libc.inotify_rm_watch(self.fd, wd)

    def _ignored(self, wd: int) -> None:
        """The kernel dropped a watch: its directory is gone, or we removed it."""
        key = self._key_of.pop(wd, None)
        if key is not None and self._wd_of.get(key) == wd:
            del self._wd_of[key]

    async def run(self) -> None:
        while self.fd >= 0:
            await trio.lowlevel.wait_readable(self.fd)
            events = self._read()
            if events and self.batch_s:
                self._guarded(self._at_once, events)
                await trio.sleep(self.batch_s)
                events += self._read()
            if events:
                self._guarded(self._handle, events)

    def _read(self) -> list[Event]:
        """The events queued now (none if another read took them)."""
        try:
            return list(self._events(os.read(self.fd, _READ_SIZE)))
        except BlockingIOError:
            return []

    @staticmethod
    def _guarded(handler: Callable[[list[Event]], None], events: list[Event]) -> None:
        try:
            handler(events)
        except Exception:  # an uncaught error here would take the mount down
            log.exception("handling changes of the source failed")

    def _at_once(self, events: list[Event]) -> None:
        """What a batching watcher does with the first events of a batch before waiting for
        the rest (all of them go to ``_handle`` after): nothing unless it says."""

    def _events(self, data: bytes) -> Iterator[Event]:
        """(watch descriptor, mask, name) of each event in what one read returned."""
        at = 0
        while at < len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, at)
            name = data[at + _EVENT.size : at + _EVENT.size + length].rstrip(b"\0")
            at += _EVENT.size + length
            self.events += 1
            yield wd, mask, name

    def _handle(self, events: list[Event]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PublishedWatch(Watcher[bytes]):
    """Watches the source for changes to files clients may find in the published index.

    Every directory from the root down to a published file is watched, on an inotify
    instance of its own (the kernel's watches come and go with its inodes; these stay while
    anything under them is published). An event naming a file or directory tells
    ``changed`` its path at once (no batching: a client trusts a published slot until the
    daemon withdraws it); a watched directory that moves or goes away is forgotten
    (``forget``), and an overflowed queue reports the root: everything may have changed.
    """

    def __init__(self, source: Source, changed: Callable[[bytes, bool], None]) -> None:
        #: called with the path of a changed name and whether it is a watched directory
        self.changed = changed
        super().__init__(source)

    def _give_up(self, reason: str) -> None:
        log.info("not watching the source for published files (%s): clients compare each "
                 "hit with the source", reason)
        super()._give_up(reason)

    @property
    def directories(self) -> int:
        return len(self._wd_of)

    def cover(self, path: bytes) -> bool:
        """Watch every directory that leads to ``path``; False if the source is not watched
        (or a directory on the way has gone). Call before checking the file's version, so
        that no change can fall between the check and the watch."""
        missing = []
        parent = path.rpartition(b"/")[0]
        while self.fd >= 0 and parent not in self._wd_of:
            missing.append(parent)
            if not parent:
                break
            parent = parent.rpartition(b"/")[0]
        for directory in reversed(missing):
            if self.fd < 0:
                break
            wd = self._add_watch(directory)
            if wd is None or wd in self._key_of:  # gone, or one directory under two paths
                return False  # (a bind mount): its events could name only one
            self._remember(directory, wd)
        return self.fd >= 0

    def forget(self, directory: bytes) -> None:
        """Stop watching a directory and those under it: their paths are no longer theirs."""
        inside = directory + b"/" if directory else b""
        for path in [p for p in self._wd_of if p == directory or p.startswith(inside)]:
            self._unwatch(path)

    def _handle(self, events: list[Event]) -> None:
        for wd, mask, name in events:
            if mask & IN_Q_OVERFLOW:
                log.warning("the source changed faster than inotify could report; "
                            "withdrawing every published file")
                self.changed(b"", True)
            elif mask & IN_IGNORED:
                self._ignored(wd)
            elif name and wd in self._key_of:
                parent = self._key_of[wd]
                path = parent + b"/" + name if parent else name
                watched = path in self._wd_of
                self.changed(path, watched)
                if watched and mask & (_IN_MOVED_FROM | _IN_MOVED_TO | _IN_DELETE):
                    self.forget(path)
