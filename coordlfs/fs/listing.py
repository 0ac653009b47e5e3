"""A directory listing streamed from the source, one ``getdents64`` buffer at a time.

An open directory holds its source descriptor and the entries of one buffer (``BUFFER``
bytes of records: some two thousand names), never the whole directory: a listing of a
million names costs the daemon the same memory as one of ten. The offset each entry carries
to the kernel is the source filesystem's own seek cookie (``d_off``, shifted past the dots'
offsets), so a request that does not continue where the last one stopped (``rewinddir``,
``seekdir``, a reader whose buffer took fewer entries than the reply held) is an ``lseek`` to
that cookie, exact under concurrent creations and removals as the source's own ``seekdir``.

pyfuse3 answers only READDIRPLUS: every entry replied with a node id makes the kernel build an
inode and a dentry and hold a lookup on it, which the daemon must count, and which needs an
``lstat`` per entry. The kernel skips that for an entry whose node id is 0 (the FUSE protocol's
"no attributes for this one"), keeping only its name, type and ``d_ino``; pyfuse3 has no way to
say so, since setting ``st_ino`` sets both the node id and ``d_ino``. ``NamesOnly`` clears the
node id in the reply's memory, at an offset found and checked at start, and without it every
entry carries attributes as before. The first ``ATTRIBUTED`` entries of a listing carry them
anyway: a directory of a few thousand files lists as it always did (its files then open
without a LOOKUP each), and only the names beyond, which would cost the kernel a kilobyte and
the daemon an inode each, stream as names.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import threading
from collections.abc import Callable, Container

import pyfuse3
import trio

#: Bytes of ``linux_dirent64`` records read at a time: what one open directory holds.
BUFFER = 64 << 10
#: Entries from the start of a listing that carry attributes and a lookup (READDIRPLUS proper).
ATTRIBUTED = 4096
#: ``.`` and ``..``: listed first with the mount's inode numbers (the kernel takes no lookup on
#: them) and offsets 1 and 2, as ``dir_emit_dots`` lists them.
DOTS = (b".", b"..")
#: The offset of an entry is the source's cookie plus this, so that no cookie (an overlayfs
#: merged directory numbers its entries 1, 2, ... with the dots among them) passes for the
#: start or a dot.
_SHIFT = len(DOTS) + 1
#: The largest offset, ext4's cookie for the end of a directory: kept as it is (the cookies
#: within ``_SHIFT`` of it become it too; a hash cookie lands there once in 2^61).
_LAST = (1 << 63) - 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.getdents64.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_libc.getdents64.restype = ctypes.c_ssize_t
#: d_ino, d_off, d_reclen, d_type; the name follows, NUL-terminated
_RECORD = struct.Struct("=QqHB")
_local = threading.local()


def _getdents(fd: int) -> bytes:
    """The next records of directory ``fd``, at most ``BUFFER`` bytes; none at its end. The
    buffer they are read into is the worker thread's, so an open directory holds only the
    entries parsed from it."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None or len(buffer) < BUFFER:
        buffer = _local.buffer = ctypes.create_string_buffer(BUFFER)
    got = _libc.getdents64(fd, buffer, BUFFER)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.string_at(buffer, got)


#: One entry: its name, the source's ``d_ino``, the file type bits of st_mode (``d_type << 12``;
#: 0 when the source does not say), the source's cookie for the position after it (the
#: kernel's next offset), and its attributes if it carries them (see ``ATTRIBUTED``; the dots
#: always do), else None. A plain tuple: a NamedTuple costs 0.7 µs more an entry.
Entry = tuple[bytes, int, int, int, os.stat_result | None]
#: Replies with an entry's attributes (name, attributes, next offset); whether it had room.
Attributed = Callable[[bytes, os.stat_result, int], bool]


class Listing:
    """One open directory of the source. Its ``fill`` blocks: run it in a worker thread.
    Hold ``lock`` from ``continues_at`` to ``reply``: a handle has one buffer."""

    def __init__(self, fd: int, barred: Container[int] = ()) -> None:
        self.fd = fd
        #: the devices of the coordlfs mounts: an entry on one (this mount, mounted beneath
        #: its source, or another) is listed by name only, so that the kernel's LOOKUP of it
        #: meets the ELOOP every walk into it meets (``coordlfs.source.walk``); asked only of
        #: an entry on a device other than its directory's, a mountpoint
        self.barred = barred
        self.device = os.fstat(fd).st_dev
        self.lock = trio.Lock()
        #: the buffered entries; ``entries[index]`` is the next one to reply with
        self.entries: list[Entry] = []
        self.index = 0
        #: the offset the next buffered entry follows
        self.offset = 0
        #: entries read since the listing last started at offset 0
        self._read = 0
        #: the offset after the last entry buffered
        self.end = 0
        #: the source's cookie the descriptor reads from next
        self._at = 0

    def continues_at(self, offset: int) -> bool:
        """Whether buffered entries answer a request for ``offset`` with no system call."""
        return self.index < len(self.entries) and offset == self.offset

    def fill(self, offset: int) -> bool:
        """Buffer the entries after ``offset``, seeking there unless the descriptor is there
        already; False at the end of the directory."""
        at = 0 if offset < _SHIFT else offset if offset == _LAST else offset - _SHIFT
        if at != self._at:
            os.lseek(self.fd, at, os.SEEK_SET)
            self._at = at
        if offset == 0:
            self._read = 0
        entries: list[Entry] = []
        self.entries, self.index, self.offset = entries, 0, offset
        for after, dot in enumerate(DOTS[offset:], offset + 1):
            st = os.stat(dot, dir_fd=self.fd, follow_symlinks=False)
            entries.append((dot, st.st_ino, stat.S_IFDIR, after, st))
        data = _getdents(self.fd)
        attributed = not NAMES_ONLY.works or self._read < ATTRIBUTED
        got, pos, record, near_last = len(data), 0, _RECORD.unpack_from, _LAST - _SHIFT
        barred, device = self.barred, self.device
        cookie, after = at, max(offset, len(DOTS))  # where it stands if no record follows
        while pos < got:
            ino, cookie, length, kind = record(data, pos)
            after = cookie + _SHIFT if cookie < near_last else _LAST
            name = data[pos + _RECORD.size : data.index(b"\0", pos + _RECORD.size)]
            pos += length
            if name in DOTS:  # (by name: some filesystems give every type as DT_UNKNOWN)
                continue  # listed first, as above
            st = None
            if attributed:
                try:
                    st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since getdents read it: as if removed before
                except OSError as e:  # a source that is itself a coordlfs mount said so
                    if e.errno != errno.ELOOP:
                        raise
                if st is None or (st.st_dev != device and st.st_dev in barred):
                    if not NAMES_ONLY.works:
                        continue
                    st = None
            entries.append((name, ino, kind << 12, after, st))
        self._at, self.end = cookie, after
        self._read += len(entries)
        return got > 0 or bool(entries)

    def reply(self, token: pyfuse3.ReaddirToken, attributed: Attributed) -> bool:
        """Reply with the buffered entries in order until the kernel's buffer is full; whether
        all went.

        An entry without attributes shows the source's inode number as its ``d_ino``: asking
        the inode table for the mount's would cost more than the rest of the entry. A stat of
        it shows the mount's, as ``ls -i`` of a mount point shows a number stat does not.
        """
        reply = pyfuse3.readdir_reply
        attr, node_id = NAMES_ONLY.attr, NAMES_ONLY.node_id
        taken = self.index
        for name, ino, mode, after, st in self.entries[taken:]:
            if st is None:  # the hot path of a huge directory: inline
                attr.st_ino = ino
                attr.st_mode = mode
                node_id.value = 0
                if not reply(token, name, attr, after):
                    break
            elif not attributed(name, st, after):
                break
            taken += 1
            self.offset = after
        self.index = taken
        return taken == len(self.entries)

    def close(self) -> None:
        os.close(self.fd)


class NamesOnly:
    """Replies that give the kernel a name, a type and a ``d_ino``, and no node: READDIR's
    answer through pyfuse3's READDIRPLUS-only ``readdir_reply``.

    ``EntryAttributes`` keeps the ``fuse_entry_param`` that libfuse copies into the reply: the
    node id first, then the generation, then a ``struct stat`` whose ``st_ino`` becomes
    ``d_ino``. The node id's place is found by writing two known values and looking for them
    side by side, and checked by clearing it and reading ``st_ino`` (which returns the node
    id) back as 0 while the stat's copy stays; if either fails, ``works`` is False and the
    caller gives attributes instead.
    """

    _PROBE_INO = 0x5EED_C0DE_1157_0001
    _PROBE_GENERATION = 0x5EED_C0DE_1157_0002

    def __init__(self) -> None:
        self.attr = pyfuse3.EntryAttributes()
        offset = self._node_id_offset(self.attr)
        self.works = offset is not None
        #: the node id replies go with: cleared after every write of ``attr.st_ino`` (a
        #: number of its own when not found: no listing then goes without attributes)
        self.node_id = (ctypes.c_uint64() if offset is None
                        else ctypes.c_uint64.from_address(id(self.attr) + offset))

    @classmethod
    def _node_id_offset(cls, attr: pyfuse3.EntryAttributes) -> int | None:
        size = type(attr).__basicsize__
        attr.st_ino, attr.generation = cls._PROBE_INO, cls._PROBE_GENERATION
        ino = struct.pack("=Q", cls._PROBE_INO)
        raw = ctypes.string_at(id(attr), size)
        offset = raw.find(ino + struct.pack("=Q", cls._PROBE_GENERATION))
        if offset < 0 or raw.count(ino) != 2:
            return None
        ctypes.c_uint64.from_address(id(attr) + offset).value = 0
        works = attr.st_ino == 0 and ino in ctypes.string_at(id(attr), size)
        attr.generation = 0
        return offset if works else None


#: made once: finding the node id's place costs a probe
NAMES_ONLY = NamesOnly()
