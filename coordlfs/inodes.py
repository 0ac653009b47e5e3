"""Inode numbers for source files, keyed by the source's (st_dev, st_ino).

Keying by (dev, ino) makes hard links one inode, as in libfuse's passthrough_hp. We hand out
our own numbers rather than the source's st_ino, because a source spanning several devices
could repeat st_ino values. A node lives while the kernel holds lookups on it (FUSE lookup
counts); ``forget`` drops it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from coordlfs.source import Version

ROOT_INODE = 1
CONTROL_INODE = 2
_FIRST_FREE = 3

Key = tuple[int, int]


@dataclass(slots=True)
class Node:
    key: Key
    #: A path that reached this inode (the latest; with hard links any of them will do).
    path: bytes
    lookups: int = 0
    #: the version last shown to the kernel, to notice a source file that changed
    version: Version | None = None


class InodeTable:
    def __init__(self, root_key: Key) -> None:
        self._nodes: dict[int, Node] = {ROOT_INODE: Node(root_key, b"", lookups=1)}
        self._by_key: dict[Key, int] = {root_key: ROOT_INODE}
        self._next = _FIRST_FREE

    def __len__(self) -> int:
        return len(self._nodes)

    def __getitem__(self, inode: int) -> Node:
        return self._nodes[inode]

    def items(self) -> Iterator[tuple[int, Node]]:
        return iter(self._nodes.items())

    def find(self, key: Key) -> int | None:
        return self._by_key.get(key)

    def inode_for(self, key: Key, path: bytes, is_dir: bool = False) -> int:
        """The inode of ``key``, creating it with no lookups yet; remembers ``path``.

        A directory met under a new path was renamed in the source: the kernel may still hold
        nodes beneath it, which must be found under the new path too.
        """
        inode = self._by_key.get(key)
        if inode is None:
            inode = self._next
            self._next += 1
            self._by_key[key] = inode
            self._nodes[inode] = Node(key, path)
            return inode
        node = self._nodes[inode]
        if node.path != path:
            if is_dir and inode != ROOT_INODE:
                self._moved(node.path, path)
            node.path = path
        return inode

    def _moved(self, old: bytes, new: bytes) -> None:
        """Rewrite the paths below directory ``old``: rare, so a scan of the table."""
        prefix = old + b"/"
        for node in self._nodes.values():
            if node.path.startswith(prefix):
                node.path = new + node.path[len(old) :]

    def ref(self, inode: int) -> None:
        self._nodes[inode].lookups += 1

    def forget(self, inode: int, count: int) -> bool:
        """Whether the node is gone now."""
        node = self._nodes.get(inode)
        if node is None or inode == ROOT_INODE:
            return False
        node.lookups -= count
        if node.lookups <= 0:
            self.drop(inode)
            return True
        return False

    def drop_if_unreferenced(self, inode: int) -> None:
        if inode != ROOT_INODE and self._nodes[inode].lookups == 0:
            self.drop(inode)

    def drop(self, inode: int) -> None:
        node = self._nodes.pop(inode)
        del self._by_key[node.key]
