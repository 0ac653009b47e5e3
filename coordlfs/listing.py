"""A directory listing streamed from the source, one ``getdents64`` buffer at a time.

An open directory holds its source descriptor and the entries of one buffer (``BUFFER``
bytes of records: some two thousand names), never the whole directory: a listing of a
million names costs the daemon the same memory as one of ten. The offset each entry carries
to the kernel is the source filesystem's own seek cookie (``d_off``), so a request that does
not continue where the last one stopped (``rewinddir``, ``seekdir``, a reader whose buffer
took fewer entries than the reply held) is an ``lseek`` to that cookie, exact under
concurrent creations and removals as the source's own ``seekdir`` is.

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
import os
import stat
import struct
from typing import NamedTuple

import pyfuse3
import trio

#: Bytes of ``linux_dirent64`` records read at a time: what one open directory holds.
BUFFER = 64 << 10
#: Entries from the start of a listing that carry attributes and a lookup (READDIRPLUS proper).
ATTRIBUTED = 4096
#: ``.`` and ``..``: listed first with the mount's inode numbers (the kernel takes no lookup on
#: them) and offsets 1 and 2, as ``dir_emit_dots`` lists them in Linux filesystems, whose own
#: cookies for their entries then start above 2.
DOTS = (b".", b"..")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.getdents64.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_libc.getdents64.restype = ctypes.c_ssize_t
#: d_ino, d_off, d_reclen, d_type; the name follows, NUL-terminated
_RECORD = struct.Struct("=QqHB")


class Entry(NamedTuple):
    name: bytes
    #: the source's inode number (``d_ino``)
    ino: int
    #: the file type bits of st_mode (``d_type << 12``); 0 when the source does not say
    mode: int
    #: the source's cookie for the position after this entry: the kernel's next offset
    next: int
    #: attributes, for an entry that carries them (see ``ATTRIBUTED``), or a dot's
    st: os.stat_result | None


class Listing:
    """One open directory of the source. Its ``fill`` blocks: run it in a worker thread,
    holding ``lock`` (one buffer, so one request of the handle at a time)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        #: the device of its entries, to find the ones the kernel holds by (st_dev, d_ino)
        self.dev = os.fstat(fd).st_dev
        self.lock = trio.Lock()
        #: the buffered entries; ``entries[index]`` is the next one to reply with
        self.entries: list[Entry] = []
        self.index = 0
        #: the offset the next buffered entry (or the next fill) follows
        self.offset = 0
        #: entries read since the listing last started at offset 0
        self._read = 0
        #: the offset the descriptor reads from next
        self._at = 0
        self._buffer = ctypes.create_string_buffer(BUFFER)

    def continues_at(self, offset: int) -> bool:
        """Whether buffered entries answer a request for ``offset`` with no system call."""
        return self.index < len(self.entries) and offset == self.offset

    @property
    def end(self) -> int:
        """The offset after the last buffered entry: where the next fill reads from."""
        return self._at

    def fill(self, offset: int, names_only: bool) -> bool:
        """Buffer the entries after ``offset``, seeking there unless the descriptor is there
        already; False at the end of the directory. ``names_only``: whether entries past the
        first ``ATTRIBUTED`` may go without attributes (``NamesOnly.works``)."""
        at = offset if offset > len(DOTS) else 0  # past the dots: a source cookie
        if at != self._at:
            os.lseek(self.fd, at, os.SEEK_SET)
            self._at = at
        if offset == 0:
            self._read = 0
        self.entries, self.index, self.offset = [], 0, offset
        for after, dot in enumerate(DOTS[offset:], offset + 1):
            st = os.stat(dot, dir_fd=self.fd, follow_symlinks=False)
            self.entries.append(Entry(dot, st.st_ino, stat.S_IFDIR, after, st))
        got = _libc.getdents64(self.fd, self._buffer, BUFFER)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        attributed = not names_only or self._read < ATTRIBUTED
        data, pos = self._buffer.raw[:got], 0
        while pos < got:
            ino, self._at, length, kind = _RECORD.unpack_from(data, pos)
            name = data[pos + _RECORD.size : data.index(b"\0", pos + _RECORD.size)]
            pos += length
            if name in DOTS:
                continue  # listed first, as above
            st = None
            if attributed:
                try:
                    st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since getdents read it: as if removed before
            self.entries.append(Entry(name, ino, kind << 12, self._at, st))
        self._read += len(self.entries)
        return got > 0 or bool(self.entries)

    def took(self, entry: Entry) -> None:
        """The kernel took ``entry``: the next request continues after it."""
        self.index += 1
        self.offset = entry.next

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
        self._node_id = ctypes.c_uint64.from_address(id(self.attr) + (offset or 0))

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

    def attr_for(self, d_ino: int, mode: int) -> pyfuse3.EntryAttributes:
        """The attributes to reply with; valid until the next call (the reply copies them)."""
        attr = self.attr
        attr.st_ino = d_ino
        attr.st_mode = mode
        self._node_id.value = 0
        return attr



#: made once: finding the node id's place costs a probe
NAMES_ONLY = NamesOnly()
