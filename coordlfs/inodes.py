"""Inode numbers for source files, keyed by the source's (st_dev, st_ino).

Keying by (dev, ino) makes hard links one inode, as in libfuse's passthrough_hp. We hand out
our own numbers rather than the source's st_ino, because a source spanning several devices
could repeat st_ino values. A node lives while the kernel holds lookups on it (FUSE lookup
counts); ``forget`` drops it.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    #: (size, mtime_ns) last shown to the kernel, to notice a source file that changed.
    version: tuple[int, int] = (-1, -1)


class InodeTable:
    def __init__(self, root_key: Key) -> None:
        self._nodes: dict[int, Node] = {ROOT_INODE: Node(root_key, b"", lookups=1)}
        self._by_key: dict[Key, int] = {root_key: ROOT_INODE}
        self._next = _FIRST_FREE

    def __len__(self) -> int:
        return len(self._nodes)

    def __getitem__(self, inode: int) -> Node:
        return self._nodes[inode]

    def inode_for(self, key: Key, path: bytes) -> int:
        """The inode of ``key``, creating it with no lookups yet; remembers ``path``."""
        inode = self._by_key.get(key)
        if inode is None:
            inode = self._next
            self._next += 1
            self._by_key[key] = inode
            self._nodes[inode] = Node(key, path)
        else:
            self._nodes[inode].path = path
        return inode

    def ref(self, inode: int) -> None:
        self._nodes[inode].lookups += 1

    def forget(self, inode: int, count: int) -> None:
        node = self._nodes.get(inode)
        if node is None or inode == ROOT_INODE:
            return
        node.lookups -= count
        if node.lookups <= 0:
            self.drop(inode)

    def drop_if_unreferenced(self, inode: int) -> None:
        if inode != ROOT_INODE and self._nodes[inode].lookups == 0:
            self.drop(inode)

    def drop(self, inode: int) -> None:
        node = self._nodes.pop(inode)
        del self._by_key[node.key]
