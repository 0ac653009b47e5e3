"""Keeping the kernel's view of the source fresh while the source changes under the mount.

A dataset is read-mostly, so the kernel may keep names and attributes for an hour, which saves
a FUSE request per path component and per stat. To show a user who adds, replaces, renames or
deletes files the change within a second anyway, the mount watches the source with inotify:
every directory the kernel caches names under (the root, and any directory a lookup or a
listing went into) has a watch, and any event on a name in it invalidates that name's kernel
entry, positive or negative. The next path walk then asks the daemon again and gets the
source's new answer; an open checks the file's version (``source.Version``) and drops stale
pages and cache entries. A descriptor opened before the change keeps the view it opened.

Where watching cannot see every change (network and FUSE filesystems, where other hosts
write; no inotify; the watch limit reached), the kernel instead keeps names and attributes
for at most ``--revalidate`` seconds: changes are then visible after that long.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import struct
from typing import Any

import pyfuse3
import trio

from coordlfs.inodes import ROOT_INODE, InodeTable
from coordlfs.source import Source, proc_path

log = logging.getLogger(__name__)

#: Seconds the kernel may keep entries and attributes (positive and negative) of a watched
#: source: changes reach it through invalidations, not expiry.
WATCHED_TIMEOUT = 3600.0

# <sys/inotify.h>
_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x2, 0x4, 0x8
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_IN_Q_OVERFLOW, _IN_IGNORED = 0x4000, 0x8000
_IN_ONLYDIR, _IN_DONT_FOLLOW, _IN_EXCL_UNLINK = 0x01000000, 0x02000000, 0x04000000
_EVENTS = (_IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO
           | _IN_CREATE | _IN_DELETE)
_WATCH_MASK = _EVENTS | _IN_ONLYDIR | _IN_DONT_FOLLOW | _IN_EXCL_UNLINK
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
_READ_SIZE = 1 << 16
#: After a batch of events, wait this long for more before invalidating: a writer makes
#: many events per file, and each name is invalidated once per batch.
_BATCH_S = 0.05

#: Filesystems whose changes may come from elsewhere (other hosts, a FUSE daemon), which
#: inotify does not see.
_UNWATCHABLE = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs",
                "9p", "afs", "ocfs2", "gfs2", "beegfs", "fuse", "fuseblk", "virtiofs"}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]


def filesystem_type(path: str) -> str:
    """The type of the filesystem that holds ``path``, from /proc/self/mountinfo."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as info:
        for line in info:
            fields = line.split()
            mountpoint = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
            fstype = fields[fields.index("-") + 1]
            inside = path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")
            if inside and len(mountpoint) >= len(best):
                best, kind = mountpoint, fstype
    return kind


def _unwatchable(fstype: str) -> bool:
    return fstype in _UNWATCHABLE or fstype.startswith("fuse.")


class Freshness:
    def __init__(self, source: Source, inodes: InodeTable, revalidate_s: float) -> None:
        self.source = source
        self.inodes = inodes
        self.revalidate_s = revalidate_s
        self._wd_of: dict[int, int] = {}
        self._inode_of: dict[int, int] = {}
        self.events = 0
        self.invalidated = 0
        self.fd = -1
        self.reason = ""
        fstype = filesystem_type(source.path)
        if _unwatchable(fstype):
            self._give_up(f"the source is on {fstype}, where inotify misses other hosts' "
                          "changes")
            return
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            self._give_up(f"inotify: {os.strerror(ctypes.get_errno())}")
            return
        self.watch(ROOT_INODE, b"")

    @property
    def watching(self) -> bool:
        return self.fd >= 0

    @property
    def timeout(self) -> float:
        """Seconds the kernel may keep an entry or attributes we reply with."""
        return WATCHED_TIMEOUT if self.watching else self.revalidate_s

    def _give_up(self, reason: str) -> None:
        self.reason = reason
        log.info("not watching the source (%s): names and attributes are revalidated every "
                 "%g s", reason, self.revalidate_s)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._wd_of.clear()
        self._inode_of.clear()

    def watch(self, inode: int, path: bytes) -> None:
        """Watch a directory the kernel is about to cache names under (idempotent).

        Called before the source is asked about a name in it, so no change can fall between
        the answer and the watch. Failing to watch one directory switches the whole mount to
        revalidation: replies from now on carry the short timeout.
        """
        if self.fd < 0 or inode in self._wd_of:
            return
        wd = self.source.at(path, lambda dir_fd, name: _libc.inotify_add_watch(
            self.fd, proc_path(dir_fd, name), _WATCH_MASK))
        if wd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR):
                return  # gone or replaced: the lookup that follows reports it
            self._give_up(f"cannot watch {os.fsdecode(path) or '.'}: {os.strerror(err)}"
                          + (" (raise fs.inotify.max_user_watches)" if err == errno.ENOSPC
                             else ""))
            return
        self._wd_of[inode] = wd
        self._inode_of[wd] = inode

    def unwatch(self, inode: int) -> None:
        """The kernel forgot the directory: nothing it caches depends on it any more."""
        wd = self._wd_of.pop(inode, None)
        if wd is not None:
            self._inode_of.pop(wd, None)
            _libc.inotify_rm_watch(self.fd, wd)

    async def run(self) -> None:
        while self.fd >= 0:
            await trio.lowlevel.wait_readable(self.fd)
            await trio.sleep(_BATCH_S)
            try:
                data = os.read(self.fd, _READ_SIZE)
            except BlockingIOError:
                continue
            try:
                self._handle(data)
            except Exception:  # an uncaught error here would take the mount down
                log.exception("handling changes of the source failed")

    def _handle(self, data: bytes) -> None:
        names: set[tuple[int, bytes]] = set()
        overflow = False
        at = 0
        while at < len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, at)
            name = data[at + _EVENT.size : at + _EVENT.size + length].rstrip(b"\0")
            at += _EVENT.size + length
            self.events += 1
            if mask & _IN_Q_OVERFLOW:
                overflow = True
            elif mask & _IN_IGNORED:  # the directory is gone, or we removed the watch
                inode = self._inode_of.pop(wd, None)
                if inode is not None:
                    self._wd_of.pop(inode, None)
            elif name and wd in self._inode_of:
                names.add((self._inode_of[wd], name))
        if overflow:
            log.warning("the source changed faster than inotify could report; invalidating "
                        "every name the kernel holds")
            names |= self._every_known_name()
        for parent, name in names:
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
        self.invalidated += len(names)

    def _every_known_name(self) -> set[tuple[int, bytes]]:
        """(parent inode, name) of every node the kernel holds whose parent it holds too:
        invalidating a directory's entry also drops all names cached beneath it."""
        by_path = {node.path: inode for inode, node in self.inodes.items()}
        names = set()
        for _inode, node in self.inodes.items():
            parent, _slash, name = node.path.rpartition(b"/")
            if name and parent in by_path:
                names.add((by_path[parent], name))
        return names

    def summary(self) -> str:
        if self.watching:
            return "the source is watched: its changes show at once"
        return (f"the source is not watched ({self.reason}): its changes show within "
                f"{self.revalidate_s:g} s")

    def status(self) -> dict[str, Any]:
        if not self.watching:
            return {"mode": "revalidate", "interval_s": self.revalidate_s,
                    "reason": self.reason}
        return {"mode": "watch", "watched_directories": len(self._wd_of), "events": self.events,
                "invalidated": self.invalidated}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
