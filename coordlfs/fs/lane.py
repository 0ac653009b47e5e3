"""The request lane: opens of cached files and of small misses answered in C, without the
Python loop.

With passthrough a hit is OPEN and RELEASE at the daemon, and each costs a wake of the trio
loop and the handlers' Python (docs/design/request-path.md). ``coordlfs/lane/lane.c``, built
by ``scripts/setup`` beside its source, reads /dev/fuse in a thread of its own: it answers a
read-only OPEN of an inode whose row says "backing id B while the source file is version V"
(checked with one openat2 + fstat beneath the source's root), and the RELEASE of a handle it
made; a small miss alike, with the source file itself as the backing, handed to the daemon
at its last release for the cache (``Note``), and a small file a peer caches, fetched by the
lane on a connection of its own (``coordlfs.fs.lane_peers``) and landed on the cache's tmpfs;
every other request goes to the patched
pyfuse3's loop (``pyfuse3.use_lane``), which answers it as before.

The daemon keeps every decision: a row is offered only after an open the daemon answered
itself with a complete entry's backing (``coordlfs.fs.opens``), suspended while the daemon
decides another open of the inode, and retired when the entry goes or the inode is detached
or forgotten. The opens a row holds count as open files of the inode wherever that matters
(one backing per inode, the version the open files read). Its counts are folded into the
mount's (``fold``), as the preload library's are.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyfuse3

from coordlfs.cache.stats import Outcome, ReadCounters
from coordlfs.errors import UserError
from coordlfs.fs.lane_nodes import LaneNodes
from coordlfs.source.source import Version

log = logging.getLogger(__name__)

LIBRARY = Path(__file__).resolve().parent.parent / "lane" / "libcoordlfs-lane.so"
#: the handles the lane gives out: the inode with the top bit set (the daemon's are small)
LANE_FH = 1 << 63
#: the longest path a row takes: longer ones are walked a piece at a time by the daemon
#: (``coordlfs.source.source``), which the lane's one openat2 does not do
MAX_PATH = 1024

_i64, _u64 = ctypes.c_int64, ctypes.c_uint64
#: a row's version and the attributes its held opens show, in lane.c's order (STAT_FIELDS)
_STAT_FIELDS = ("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns", "st_atime_ns",
                "st_blocks", "st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_blksize")
_Stat = _i64 * len(_STAT_FIELDS)
_fields_of = operator.attrgetter(*_STAT_FIELDS)


class Kind(enum.IntEnum):
    """What a row answers opens with (lane.c's KIND_*)."""

    NONE = 0
    ENTRY = 1
    SOURCE = 2
    PEER = 3


class Keep(enum.IntEnum):
    """Whether the cache is handed a source row's file at its last release (lane.h's NOTE_*)."""

    #: never: the cache would not keep it (too large, no cache)
    NEVER = 0
    #: if the room takes it then, beside the files handed and not yet reserved and the
    #: headroom (decided at the first open, confirmed at the last release:
    #: ``LaneNodes.room``); a first open within the headroom is the daemon's, which reserves
    #: the file at it; else it stays a source row, decided again at its next open (a full
    #: cache's misses stay in C)
    ROOM = 1


def _stat_result(fields: _Stat) -> os.stat_result:
    """The ``os.stat_result`` a row's fields stand for (the integer seconds and the float
    times made from the nanoseconds as ``os.stat`` makes them: seconds + nanoseconds * 1e-9,
    which rounds otherwise than nanoseconds / 1e9)."""
    dev, ino, size, mtime, ctime, atime, blocks, mode, nlink, uid, gid, rdev, blksize = fields
    split = [divmod(t, 1_000_000_000) for t in (atime, mtime, ctime)]
    return os.stat_result((mode, ino, dev, nlink, uid, gid, size, *(s for s, _ in split),
                           *(s + ns * 1e-9 for s, ns in split), atime, mtime, ctime,
                           blksize, blocks, rdev))


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(LIBRARY))
    lib.lane_start.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.lane_offer.argtypes = [_u64, ctypes.c_int32, ctypes.c_char_p, ctypes.POINTER(_Stat),
                               ctypes.c_int, ctypes.c_int, ctypes.c_int]
    for name in ("lane_held", "lane_release", "lane_drop", "lane_claim"):
        getattr(lib, name).argtypes = [_u64]
        getattr(lib, name).restype = _i64
    lib.lane_suspend.argtypes = [_u64, ctypes.POINTER(ctypes.c_int32),
                                 ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
                                 ctypes.POINTER(_Stat), ctypes.c_int]
    lib.lane_suspend.restype = _i64
    lib.lane_held_stat.argtypes = [_u64, ctypes.POINTER(_Stat)]
    lib.lane_census.argtypes = [ctypes.POINTER(_i64 * 2)]
    lib.lane_enable.argtypes = [ctypes.c_int]
    lib.lane_counts.argtypes = [ctypes.POINTER(_u64 * 14)]
    lib.lane_attr_timeout.argtypes = [ctypes.c_double]
    lib.lane_peer_set.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.lane_peer_state.argtypes = [ctypes.c_int, ctypes.POINTER(_u64 * 5)]
    lib.lane_land_in.argtypes = [ctypes.c_int]
    lib.lane_copy_into.argtypes = [ctypes.c_int]
    lib.lane_note.argtypes = [ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_int),
                              ctypes.POINTER(ctypes.c_int), ctypes.POINTER(_i64 * 2),
                              ctypes.POINTER(_i64 * 5), ctypes.c_char_p, ctypes.c_size_t]
    lib.lane_note.restype = ctypes.c_ssize_t
    lib.lane_numbers.argtypes = [_i64, _i64]
    lib.lane_numbers.restype = None
    lib.lane_numbers_left.restype = _i64
    lib.lane_gauges.argtypes = [ctypes.POINTER(_i64 * 6)]
    lib.lane_source_fd.argtypes = [_u64]
    lib.lane_bufsize.restype = ctypes.c_size_t
    return lib


def why_not(mode: str, passthrough_off: str | None) -> str | None:
    """Settle ``--request-lane`` (yes, no, auto) before mounting: None to start the lane once
    mounted, else why not; ``yes`` that cannot be had is a one-line UserError."""
    if mode == "no":
        why: str | None = "off (--request-lane no)"
    elif passthrough_off is not None:
        why = "it answers passthrough opens, and passthrough is off"
    elif not hasattr(pyfuse3, "use_lane"):
        why = "pyfuse3 is an older patched build (scripts/setup rebuilds it)"
    elif not LIBRARY.exists():
        why = f"{LIBRARY.name} is not built (scripts/setup builds it)"
    else:
        why = None
    if why is not None and mode == "yes":
        raise UserError(f"--request-lane yes: {why}")
    return why


@dataclass(frozen=True, slots=True)
class Adopted:
    """Opens a row held, now the daemon's (``Lane.suspend``): what they read (``kind``), the
    backing id, for a source row the source file's descriptor (the receiver's; else -1), and
    the version the row was offered at."""

    kind: Kind
    backing: int
    fd: int
    st: os.stat_result


@dataclass(frozen=True, slots=True)
class Note:
    """A source file the lane served opens of, for the cache to keep: the inode, the
    file's path and version as the lane opened it, and its descriptor (the receiver's); with
    ``copy_into``, an unnamed file on the cache's filesystem holding its bytes of that version
    (the receiver's too), or -1 if none was made."""

    inode: int
    path: bytes
    dev: int
    version: Version
    fd: int
    copy: int = -1
    #: the entry number ``copy`` is named as (``Lane.numbers``), else -1
    number: int = -1
    #: ``copy`` registered as a backing file (``Lane.numbers``), else 0
    backing: int = 0


class Lane:
    """The lane's rows and counts, over the library's calls (each takes its mutex)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._counts = (_u64 * 14)()
        self._folded = (0, 0, 0, 0, 0, 0, 0)
        #: readable while the lane may have source files for the cache (``notes``)
        self.notes_fd: int = lib.lane_notes_fd()
        self._note = (_u64(), ctypes.c_int(), ctypes.c_int(), (_i64 * 2)(), (_i64 * 5)(),
                      ctypes.create_string_buffer(4096))
        #: buffers of the calls made per LOOKUP, allocated once (a ctypes array per call was
        #: a tenth of a LOOKUP's Python); the daemon's loop is their one caller
        self._fields = _Stat()
        self._peer = (_u64 * 5)()
        #: the nodes it numbers at the LOOKUPs it answers
        self.nodes = LaneNodes(lib)

    @classmethod
    def start(cls, source_root: int, threads: int) -> Lane:
        """Serve the mounted session (after ``pyfuse3.init``, before ``pyfuse3.main``) in
        ``threads`` threads; OSError if the library cannot be loaded or no thread started."""
        lib = _load()
        wake = lib.lane_start(pyfuse3.fuse_fd(), source_root, threads)
        if wake < 0:
            raise OSError(-wake, os.strerror(-wake))
        take = ctypes.cast(lib.lane_take, ctypes.c_void_p).value
        assert take is not None
        pyfuse3.use_lane(take, wake, lib.lane_bufsize())
        return cls(lib)

    def offer(self, inode: int, backing: int, path: bytes, st: os.stat_result) -> bool:
        """Answer read-only opens of ``inode`` with ``backing`` while its source file at
        ``path`` is the version ``st`` shows; False if the lane cannot (a path too long, opens
        of another backing held, no memory)."""
        return self._offer(inode, backing, path, st, source=False, note=Keep.NEVER)

    def offer_source(self, inode: int, path: bytes, st: os.stat_result, note: Keep) -> bool:
        """Answer read-only opens of ``inode`` with the source file itself while it is the
        version ``st`` shows (a miss the kernel reads, as passthrough_hp does); as ``note``
        says, it is handed to the daemon at its last release (``notes``), and the row goes
        once the daemon reserved its entry (``claim``)."""
        return self._offer(inode, 0, path, st, source=True, note=note)

    def offer_peer(self, inode: int, path: bytes, st: os.stat_result, slot: int) -> bool:
        """Answer read-only opens of ``inode`` with the file fetched from the peer whose
        connection is in ``slot`` (``set_peer``) at the first of them, landed here, while the
        source file is the version ``st`` shows; the row goes if the peer cannot serve it."""
        return self._offer(inode, 0, path, st, source=True, note=Keep.NEVER, peer=slot)

    def _offer(self, inode: int, backing: int, path: bytes, st: os.stat_result, source: bool,
               note: Keep, peer: int = -1) -> bool:
        if len(path) >= MAX_PATH:
            return False
        fields = self._fields
        fields[:] = _fields_of(st)
        return self._lib.lane_offer(inode, backing, path or b".", fields, source, note,
                                    peer) == 0

    def land_in(self, directory_fd: int) -> None:
        """Land the peers' files in ``directory_fd`` (the cache's tmpfs; a duplicate is kept)."""
        rc = self._lib.lane_land_in(directory_fd)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))

    def copy_into(self, directory_fd: int) -> None:
        """Copy each note's file into ``directory_fd`` (the entries' files) in a thread of the
        lane's before the daemon is handed it (``Note.copy``): the loop then only links it."""
        rc = self._lib.lane_copy_into(directory_fd)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))

    def numbers(self, first: int, count: int) -> None:
        """Hand the copier entry numbers ``first`` .. ``first + count - 1``
        (``WholeFileCache.numbers``) to name its copies as, each registered as a backing file:
        the loop then only adopts them (``Note.number``, ``Note.backing``)."""
        self._lib.lane_numbers(first, count)

    def numbers_left(self) -> int:
        """The entry numbers the copier has left to name copies as."""
        return self._lib.lane_numbers_left()

    def set_peer(self, slot: int, fd: int) -> int:
        """One more connection to the peer of ``slot``: ``fd`` (authenticated, blocking, its
        timeouts set), the lane's to close from now on; -errno (the slot's pool is full, say)
        and it stays the caller's."""
        return self._lib.lane_peer_set(slot, fd)

    def peer_state(self, slot: int) -> tuple[int, tuple[int, ...]]:
        """How many connections of ``slot`` are up, and their counts together: files
        fetched, their bytes, files the peer refused, faults (each closed one), closes by the
        peer found before a request."""
        out = self._peer
        up = self._lib.lane_peer_state(slot, out)
        return up, tuple(out)

    def suspend(self, inode: int, held_only: bool = False) -> Adopted | None:
        """No more opens of ``inode`` answered by the lane: the opens its row holds, from
        now on the daemon's, as their releases are; None if it holds none (the row goes).
        ``held_only``: a row without opens held stays as it is."""
        backing, fd, kind, fields = ctypes.c_int32(), ctypes.c_int(), ctypes.c_int(), _Stat()
        self._lib.lane_suspend(inode, ctypes.byref(backing), ctypes.byref(fd),
                               ctypes.byref(kind), fields, held_only)
        if kind.value == Kind.NONE:
            return None
        return Adopted(Kind(kind.value), backing.value, fd.value, _stat_result(fields))

    def held_stat(self, inode: int) -> tuple[Kind, os.stat_result | None]:
        """What the opens of ``inode`` the lane holds read: ``Kind.NONE`` if none; an
        entry's or a peer's file's version, as the row was offered (fixed); for a source
        file, None (it is read as it is now: ``source_stat``)."""
        raw = self._lib.lane_held_stat(inode, self._fields)
        if not raw:
            return Kind.NONE, None
        kind = Kind(raw)
        return kind, _stat_result(self._fields) if kind is not Kind.SOURCE else None

    def census(self) -> tuple[int, int]:
        """Entry rows whose opens the lane holds, and the bytes a row takes."""
        out = (_i64 * 2)()
        self._lib.lane_census(ctypes.byref(out))
        return out[0], out[1]

    def source_stat(self, inode: int) -> os.stat_result | None:
        """The source file the lane's held opens of ``inode`` read, as it is now (an fstat of
        it), None if it holds none by a source row."""
        fd = self._lib.lane_source_fd(inode)
        if fd < 0:
            return None
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def notes(self) -> Iterator[Note]:
        """The source files the lane has for the cache, taken (read ``notes_fd`` first)."""
        inode, fd, copy, named, version, path = self._note
        take, refs = self._lib.lane_note, (ctypes.byref(inode), ctypes.byref(fd),
                                           ctypes.byref(copy), ctypes.byref(named),
                                           ctypes.byref(version), path, len(path))
        while take(*refs) >= 0:  # the path ends at its NUL (.raw would copy the whole buffer)
            yield Note(inode.value, path.value, version[0], Version(*version[1:]), fd.value,
                       copy.value, named[0], named[1])

    def held(self, inode: int) -> int:
        """The opens of ``inode`` the lane answered and the kernel has not released."""
        return self._lib.lane_held(inode)

    def release(self, inode: int) -> int:
        """A release of a lane handle of ``inode`` the daemon was given: the opens left."""
        return self._lib.lane_release(inode)

    def drop(self, inode: int) -> int:
        """Remove the row of ``inode``: 0, else the opens it still holds (it stays, suspended)."""
        return self._lib.lane_drop(inode)

    def claim(self, inode: int) -> bool:
        """Whether the lane's opens of ``inode`` are reading its source file for the cache
        to be handed; if not, its source row goes (in one step: no open answered between)."""
        return self._lib.lane_claim(inode) > 0

    def attr_timeout(self, seconds: float) -> None:
        """Answer GETATTRs of inodes with rows, with attributes the kernel may keep
        ``seconds`` (the daemon's own replies' timeout, ``Freshness.timeout``)."""
        self._lib.lane_attr_timeout(seconds)

    def enable(self, on: bool) -> None:
        self._lib.lane_enable(int(on))

    def counts(self) -> tuple[int, ...]:
        """Opens of cache entries answered, their files' bytes, releases answered, opens of
        source files answered, the bytes read from storage for them (once per file read),
        their files' bytes (per open), opens of peers' files answered, their files' bytes
        (per open), GETATTRs, IOCTLs, LOOKUPs and FORGETs answered, and notes' files copied
        (``copy_into``), since the start."""
        self._lib.lane_counts(ctypes.byref(self._counts))
        return tuple(self._counts)

    def gauges(self) -> tuple[int, ...]:
        """Source files read by the lane's opens that the cache is about to be handed; rows
        kept; inodes whose opens the lane holds by a source row; of those, peers' files
        landed, and their bytes; notes' files being copied (``copy_into``)."""
        out = (_i64 * 6)()
        self._lib.lane_gauges(ctypes.byref(out))
        return tuple(out)

    def noting(self) -> int:
        return self.gauges()[0]

    def copying(self) -> int:
        return self.gauges()[5]

    def sources_held(self) -> int:
        return self.gauges()[2]

    def status(self) -> dict[str, int]:
        (opens, _, releases, source_opens, _, _, peer_opens, _, getattrs, ioctls, lookups,
         forgets, copies, named) = self.counts()
        nodes, keys, directories, _, _ = self.nodes.gauges()
        noting, rows = self.gauges()[:2]
        return {"opens": opens, "source_opens": source_opens, "peer_opens": peer_opens,
                "releases": releases, "getattrs": getattrs, "ioctls": ioctls,
                "lookups": lookups, "forgets": forgets, "copies": copies,
                "copies_named": named, "noting": noting, "rows": rows,
                "nodes": nodes, "keys_held": keys, "directories": directories}

    def fold(self, reads: ReadCounters) -> None:
        """Bring the mount's counters up to the lane's, as ``Opens`` counts its own opens
        (``stats.folds``): an entry's open a cache hit read by passthrough, a source file's a
        miss the kernel read from the source, a peer's file's a file from a peer (its bytes
        from peers are counted where they were fetched: ``LanePeers.fold``)."""
        opens, size, _, source_opens, read, opened, peer_opens, peer_opened = self.counts()[:8]
        was = self._folded
        self._folded = (opens, size, source_opens, read, opened, peer_opens, peer_opened)
        hits, hit_bytes = opens - was[0], size - was[1]
        reads.opened(Outcome.HIT, hits, hit_bytes)
        reads.passthrough_opens += hits
        reads.bytes_from_cache += hit_bytes
        reads.opened(Outcome.MISS, source_opens - was[2], opened - was[4])
        reads.source_opens += source_opens - was[2]
        reads.bytes_from_source += read - was[3]
        reads.opened(Outcome.PEER_HIT, peer_opens - was[5], peer_opened - was[6])
