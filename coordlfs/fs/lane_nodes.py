"""The nodes the request lane numbers when it answers a LOOKUP in C, as the daemon takes them
over (``coordlfs/lane/lookup.c``).

A cold miss is LOOKUP + OPEN + RELEASE; the lane answered the last two, and the LOOKUP cost the
Python loop 110-150 µs (docs/design/lookup-lane.md). So the lane answers a LOOKUP of a small
file the daemon holds nothing for, in a directory the daemon watches, itself: it numbers the
node (``LANE_NODE`` set; the inode table's own numbers never have it), offers its opens a
source row as ``LaneRows`` would, and keeps the node (key, path, version shown, lookups) until
the daemon adopts it. ``InodeTable`` adopts a node the first time it meets its number (a
request the lane handed on) or its key (an inode it makes or looks for: a fill's claim, a
listing, a watch event), and keeps it from then on as a row of its own under that number.

The lane must never number a key the daemon holds: an inode's (one inode per key: hard links,
a name dropped while its inode lived) or a cache entry's (a hit, or a fill its open must wait
for). So both tables tell it what they hold (``hold``, ``let_go``), and ``claim`` adopts or
holds in one step under the lane's mutex, so that no LOOKUP numbers a key in between.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from coordlfs.cache.compact import Key
from coordlfs.source.source import Version

log = logging.getLogger(__name__)

#: the bit of the numbers the lane gives its nodes (lookup.c's LANE_NODE)
LANE_NODE = 1 << 62
#: a node's path is a row's (``coordlfs.fs.lane.MAX_PATH``)
_PATH_CAP = 1024

_u64, _i64 = ctypes.c_uint64, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class Numbered:
    """A node the lane numbered, now the daemon's: its number, key, the kernel's lookups of
    it, the version it was shown, and its path."""

    number: int
    key: Key
    lookups: int
    version: Version
    path: bytes


class LaneNodes:
    """The lane library's nodes, keys held and directories (each call takes its mutex)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.lane_lookup_policy.argtypes = [ctypes.c_int, _i64, ctypes.c_int, _i64, _i64,
                                           ctypes.c_int, ctypes.c_char_p]
        lib.lane_room.argtypes = [_i64]
        lib.lane_hold.argtypes = [_u64, _u64, ctypes.c_int]
        lib.lane_handed.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.lane_adopt.argtypes = [ctypes.c_int, _u64, _u64, ctypes.c_int,
                                   ctypes.POINTER(_u64), ctypes.POINTER(_u64 * 2),
                                   ctypes.POINTER(_i64 * 4), ctypes.c_char_p, ctypes.c_size_t]
        lib.lane_adopt_any.argtypes = [ctypes.POINTER(_u64), ctypes.POINTER(_u64 * 2),
                                       ctypes.POINTER(_i64 * 4), ctypes.c_char_p,
                                       ctypes.c_size_t]
        lib.lane_directory.argtypes = [_u64, ctypes.c_char_p]
        lib.lane_lookup_gauges.argtypes = [ctypes.POINTER(_i64 * 5)]
        lib.lane_node_of.argtypes = [_u64, _u64]
        lib.lane_node_of.restype = _u64
        #: out buffers of an adoption, allocated once (the daemon's loop is their one caller),
        #: and the number's reference (each ``byref`` costs a call as much as the call itself)
        self._out = (_u64(), (_u64 * 2)(), (_i64 * 4)(), ctypes.create_string_buffer(_PATH_CAP))
        self._number = ctypes.byref(self._out[0])
        #: a key could not be held (``_out_of_memory``)
        self._short = False

    def policy(self, on: bool, max_file_size: int, over_max: bool, largest: int,
               headroom: int, keeps_nothing: bool, control_name: bytes) -> None:
        """Answer LOOKUPs (``on``) of files to ``largest`` bytes, their opens' rows
        ``Keep.ROOM`` (``Keep.NEVER`` if the cache ``keeps_nothing``, and above
        ``max_file_size``, or with ``over_max`` left to the daemon); a first open of a file
        the room takes only within ``headroom`` is the daemon's; ``control_name`` at the
        root is the daemon's."""
        self._lib.lane_lookup_policy(on, max_file_size, over_max, largest, headroom,
                                     keeps_nothing, control_name)

    def room(self, size: int) -> None:
        """The cache would take a file of ``size`` bytes now (``Room.changed``): the rows'
        files are handed to it while this, less the files handed and not yet reserved,
        takes them."""
        self._lib.lane_room(size)

    def handed(self, path: bytes, on: bool) -> None:
        """The file at ``path`` was handed to the fills with room promised to it (``on``), or
        its fill ended: a source row of it hands its file to the cache at its last release
        whatever the room (lane.c's ``promise``), so that a reader ahead of its fill fills
        it from the pages it read, while they are still there. Without memory for it, the
        row is kept by the room alone, as any other."""
        self._lib.lane_handed(path, on)

    def hold(self, key: Key) -> None:
        """A table of the daemon's holds ``key`` now: the lane numbers no node for it."""
        self._held(key, 1)

    def let_go(self, key: Key) -> None:
        self._held(key, -1)

    def _held(self, key: Key, delta: int) -> None:
        if self._lib.lane_hold(key[0], key[1], delta) < 0:
            self._out_of_memory()

    def _out_of_memory(self) -> None:
        """The lane could not keep a key held: it answers no LOOKUP from now on (lookup.c),
        so no key gets two inodes, and the daemon's request goes on. Said once."""
        if not self._short:
            self._short = True
            log.warning("the request lane is out of memory for keys held: LOOKUPs are the "
                        "daemon's from now on")

    def claim(self, key: Key) -> Numbered | None:
        """The node the lane numbered for ``key``, now the daemon's; else None, and the
        daemon holds the key from now on (it makes an inode of it)."""
        return self._adopt(by_key=True, key=key, hold=True)

    def adopt(self, key: Key) -> Numbered | None:
        """The node the lane numbered for ``key``, now the daemon's, if there is one."""
        return self._adopt(by_key=True, key=key, hold=False)

    def number_of(self, key: Key) -> int | None:
        """The number of the node the lane numbered for ``key`` (not adopted), if any."""
        return self._lib.lane_node_of(key[0], key[1]) or None

    def adopt_number(self, number: int) -> Numbered | None:
        """The node the lane numbered ``number``, now the daemon's, if the lane has it."""
        return self._adopt(by_key=False, key=(0, 0), hold=False, number=number)

    def adopt_all(self) -> Iterator[Numbered]:
        """Every node the lane numbered, each the daemon's as it is given."""
        _, key, out, path = self._out
        while self._lib.lane_adopt_any(self._number, key, out, path, _PATH_CAP) == 1:
            yield self._node()

    def _adopt(self, by_key: bool, key: Key, hold: bool, number: int = 0) -> Numbered | None:
        found, keys, out, path = self._out
        found.value = number
        rc = self._lib.lane_adopt(by_key, key[0], key[1], hold, self._number, keys, out, path,
                                  _PATH_CAP)
        if rc < 0:
            self._out_of_memory()
        return self._node() if rc == 1 else None

    def _node(self) -> Numbered:
        number, key, out, path = self._out
        lookups, size, mtime_ns, ctime_ns = out
        return Numbered(number.value, (key[0], key[1]), lookups,
                    Version(key[1], size, mtime_ns, ctime_ns), path.value)

    def directory(self, inode: int, path: bytes) -> None:
        """The daemon watches directory ``inode`` at ``path``: the lane may answer LOOKUPs of
        names in it (a path too long, or no memory: it does not)."""
        self._lib.lane_directory(inode, path)

    def clear_directories(self) -> None:
        """No directory's LOOKUPs answered by the lane until offered again."""
        self._lib.lane_directories_clear()

    def gauges(self) -> tuple[int, int, int, int, int]:
        """Nodes numbered and not adopted, keys held or numbered, directories offered, the
        bytes a key held takes, and the bytes of all the nodes."""
        out = (_i64 * 5)()
        self._lib.lane_lookup_gauges(ctypes.byref(out))
        return out[0], out[1], out[2], out[3], out[4]
