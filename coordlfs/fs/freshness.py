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

import contextlib
import errno
import logging
from collections.abc import Callable
from typing import Any

import pyfuse3

from coordlfs.fs.inodes import ROOT_INODE, InodeTable
from coordlfs.source.source import Source
from coordlfs.source.watch import BATCH_S, IN_ATTRIB, IN_IGNORED, IN_Q_OVERFLOW, Event, Watcher

log = logging.getLogger(__name__)

#: Seconds the kernel may keep entries and attributes (positive and negative) of a watched
#: source: changes reach it through invalidations, not expiry.
WATCHED_TIMEOUT = 3600.0

def invalidate_attributes(inode: int) -> None:
    """Drop the kernel's attributes of ``inode``. The kernel may have forgotten it since we
    looked (its last reader closed, its dentry went): then there is nothing to drop, where
    pyfuse3 raises ENOENT."""
    try:
        pyfuse3.invalidate_inode(inode, attr_only=True)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise


class Freshness(Watcher[int]):
    batch_s = BATCH_S

    def __init__(self, source: Source, inodes: InodeTable, revalidate_s: float,
                 changed: Callable[[bytes], None]) -> None:
        self.inodes = inodes
        self.revalidate_s = revalidate_s
        #: told the source path of every name invalidated: an open file there may show the
        #: change (``Operations.changed_open``)
        self.changed = changed
        self.invalidated = 0
        #: told when the source can no longer be watched (``timeout`` is short from then on)
        self.gave_up: list[Callable[[], None]] = []
        #: told each directory (inode, path) watched as a name in it is asked for: a change of
        #: a name in it will reach the kernel (the request lane may answer its LOOKUPs)
        self.watched: list[Callable[[int, bytes], None]] = []
        super().__init__(source)
        self.watch(ROOT_INODE, b"")

    @property
    def timeout(self) -> float:
        """Seconds the kernel may keep an entry or attributes we reply with."""
        return WATCHED_TIMEOUT if self.watching else self.revalidate_s

    def _give_up(self, reason: str) -> None:
        log.info("not watching the source (%s): names and attributes are revalidated every "
                 "%g s", reason, self.revalidate_s)
        super()._give_up(reason)
        for told in self.gave_up:
            told()

    def watch(self, inode: int, path: bytes) -> None:
        """Watch a directory the kernel is about to cache names under (idempotent).

        Called before the source is asked about a name in it, so no change can fall between
        the answer and the watch. Failing to watch one directory switches the whole mount to
        revalidation: replies from now on carry the short timeout.
        """
        if self.fd < 0:
            return
        if inode not in self._wd_of:
            wd = self._add_watch(path)
            if wd is None:
                return
            self._remember(inode, wd)
        for tell in self.watched:
            tell(inode, path)

    def unwatch(self, inode: int) -> None:
        """The kernel forgot the directory: nothing it caches depends on it any more."""
        self._unwatch(inode)

    def _at_once(self, events: list[Event]) -> None:
        """A permission change (chmod, chown: IN_ATTRIB) of a name the kernel holds, or of a
        watched directory itself, drops the kernel's attributes of its inode at once, not
        after the batch: until then its old mode is what the kernel checks another user's
        open against, and a process inside a directory (its working directory, a descriptor)
        never walks its name again, so dropping the name alone left it the old mode for the
        attribute timeout (an hour). The name itself goes with the batch."""
        for wd, mask, name in events:
            directory = self._key_of.get(wd)
            if mask & IN_ATTRIB and directory is not None:
                inode = self._inode_named(directory, name) if name else directory
                if inode is not None:
                    self._invalidate_attributes(inode)

    def _inode_named(self, parent: int, name: bytes) -> int | None:
        """The inode the kernel holds for ``name`` in directory ``parent``, if any: found by
        its source file's key (an lstat of a file just changed, in the kernel's caches)."""
        try:
            base = self.inodes.path(parent)
            st = self.source.lstat(base + b"/" + name if base else name)
        except (KeyError, OSError):  # the directory forgotten, the name gone
            return None
        return self.inodes.find((st.st_dev, st.st_ino))

    def _invalidate_attributes(self, inode: int) -> None:
        invalidate_attributes(inode)
        self.invalidated += 1

    def _handle(self, events: list[Event]) -> None:
        names: set[tuple[int, bytes]] = set()
        overflow = False
        for wd, mask, name in events:
            if mask & IN_Q_OVERFLOW:
                overflow = True
            elif mask & IN_IGNORED:
                self._ignored(wd)
            elif name and wd in self._key_of:
                names.add((self._key_of[wd], name))
        if overflow:
            log.warning("the source changed faster than inotify could report; invalidating "
                        "every name the kernel holds")
            names |= self._every_known_name()
        for parent, name in names:
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
            with contextlib.suppress(KeyError):  # the directory forgotten meanwhile
                base = self.inodes.path(parent)
                self.changed(base + b"/" + name if base else name)
        self.invalidated += len(names)

    def _every_known_name(self) -> set[tuple[int, bytes]]:
        """(parent inode, name) of every node the kernel holds whose parent it holds too:
        invalidating a directory's entry also drops all names cached beneath it."""
        self.inodes.adopt_all()  # the request lane's nodes among them
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
