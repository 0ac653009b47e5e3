"""The index of cached files the daemon publishes in shared memory, for ``coordlfs.client``.

A client that finds a file here maps the entry's file read-only (``IndexReader.view``) and
keeps the mapping: from its second read of a file, a hit costs no system call and no copy.
This module holds the layout for both sides: the daemon writes (``IndexWriter``), clients
read (``IndexReader``); it needs the standard library only, as the client does.

The index is one file in the cache directory (``published``): a header, then an
open-addressed hash table of fixed 64-byte slots, probed linearly. A slot is keyed by the
BLAKE2b-128 hash of the file's path relative to the mount's root. No path is stored: two of
n published paths share a hash with probability about n**2 / 2**129 (1e-25 for ten million
files), far below the odds of a memory error, so a hash match is taken as a path match.

A slot is written seqlock-style: its first word holds a sequence number and a state; the
writer marks the slot busy, writes the fields, then writes the word with the new state last.
A reader reads the word, the fields, and the word again, and trusts the fields only if the
two words are equal and say live. A dropped entry leaves a tombstone. When live slots and
tombstones fill half the table, the writer builds a larger table in a new file, renames it
over ``published``, and only then marks the old one retired; a reader checks the retired
flag after reading a slot, so it never trusts a slot of a table the writer has stopped
updating, and reopens ``published``. Stores reach other processes in program order on
x86-64 (TSO), the only order the seqlock relies on.

A tombstone may also be a mark (``HANDED`` for its entry number): a file a prefetch handed to
the fills and not published yet, which clients read through the mount rather than from the
source, where its fill would read it again (``IndexWriter.hand_over``). A reader that knows
no mark skips it as any tombstone; the writer keeps marks when it grows the table.

The header also says whether clients must compare a hit's version with the source
(``revalidate``): set when the daemon cannot watch the source for changes; and how large a
new file the cache would still take (``room``), so that a client reads a file that will never be
cached from the source itself instead of through the mount. The room word came later than
the rest: it has a flag bit (``_ROOM_SET``) so that a client tells a daemon that publishes
it from an older one, whose header is zeros there; an older client reads the first five
words only, so the magic stays.

A daemon that dies (SIGKILL, the OOM killer) or stops (SIGSTOP) withdraws nothing more, and
a client would go on serving what it had mapped after the source changed. So the daemon
beats: it writes its CLOCK_MONOTONIC time (one clock for every process of the machine) in
the header every ``BEAT_EVERY_S`` and at each publish, and a reader finds nothing in an
index whose beat is ``STALE_AFTER_S`` old: no hit later than that after the daemon's last
moment of life. Reading the clock costs no system call (the vDSO), so a hit still costs
none. A daemon whose loop is late costs its clients hits, not correctness: they read through
the mount meanwhile, and hit again at its next beat. The beat word, like the room, came
later and has a flag bit (``_BEAT_SET``, the lowest: no arithmetic on a hit to strip it): an
older daemon's index has no beat and is trusted as before. A reader whose clock is behind
the daemon's (another time namespace) would trust a dead daemon longer: it does not use the
index at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
from time import monotonic_ns
from typing import NamedTuple

#: The index's file name in the cache directory.
INDEX = "published"
#: The index of the entries every user may open (``coordlfs.cache.public``), beside it.
PUBLIC_INDEX = "published.public"
MAGIC = b"CLFSIDX1"
#: magic, retired, revalidate, slot count, generation, room; slots start at HEADER_SIZE
_HEADER = struct.Struct("<8sQQQQQ")
#: the words a reader checks on every hit: retired, revalidate, beat
_FLAGS = struct.Struct("<QQ24xQ")
_FLAGS_AT = 8
_ROOM_AT = 40
#: set in the room word by a daemon that publishes the room (an older one leaves it zero)
_ROOM_SET = 1 << 63
#: the beat: the daemon's CLOCK_MONOTONIC nanoseconds, with ``_BEAT_SET`` (an older daemon
#: leaves the word zero)
_BEAT_AT = 48
_BEAT_SET = 1
#: Seconds between the daemon's beats (``IndexWriter.beat``).
BEAT_EVERY_S = 0.5
#: Seconds after the daemon's last beat that its clients stop trusting the index: the bound
#: on hits after it dies or stops. Four beats: a loop busy for a second and a half does not
#: send clients to the mount.
STALE_AFTER_S = 2.0
_STALE_NS = int(STALE_AFTER_S * 1e9)
HEADER_SIZE = 64
#: word (sequence << 2 | state), hash (2 words), entry number, size, inode, mtime, ctime
SLOT = struct.Struct("<QQQQQQqq")
_WORD = struct.Struct("<Q")
#: a slot past its word: what a writer packs while the word says busy
_FIELDS = struct.Struct("<QQQQQqq")
#: a slot's word and hash: what finding a path's slot reads
_PROBE = struct.Struct("<QQQ")
#: ... and its entry number: what finding a mark reads (``_marked``)
_MARK = struct.Struct("<QQQQ")
SLOT_SIZE = SLOT.size
EMPTY, LIVE, DEAD, BUSY = 0, 1, 2, 3
#: The entry number of a tombstone that marks a file handed to the fills (``hand_over``):
#: no entry has it.
HANDED = (1 << 64) - 1
_HASH = struct.Struct("<QQ")
#: Files a client keeps mapped, at most: well below the kernel's 65,530 mappings a process
#: (``vm.max_map_count``), with room for the libraries' own.
MAPPED_FILES = 16384
#: Files a client remembers having read once, at most (a set of numbers, ~60 bytes each)
_SEEN_FILES = 1 << 20
#: The smallest table, slots: 256 KiB of index, 2,048 files before it grows.
MIN_SLOTS = 1 << 12


def _store(table: mmap.mmap, at: int, value: int) -> None:
    """One aligned 8-byte store of a word readers in other processes watch: they see the old
    value or the new, never a half. ``struct.pack_into`` zeroes its bytes before it writes
    them, so a reader could see 0 (an empty slot, no beat, no room) in between."""
    with memoryview(table) as view, view.cast("Q") as words:
        words[at >> 3] = value


def _words(table: mmap.mmap) -> memoryview:
    """``table`` as 8-byte words: one store to a word is whole (``_store``)."""
    return memoryview(table).cast("Q")


def path_hash(path: bytes) -> tuple[int, int]:
    """The slot key of a path relative to the mount's root."""
    return _HASH.unpack(hashlib.blake2b(path, digest_size=16).digest())


class Published(NamedTuple):
    """What a slot says about a cached file: where its bytes are and which version they are."""

    #: the entry's number: its file's name in the cache's ``files`` directory
    offset: int
    size: int
    ino: int
    mtime_ns: int
    ctime_ns: int

    def matches(self, st: os.stat_result) -> bool:
        return (self.ino, self.size, self.mtime_ns, self.ctime_ns) == (
            st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: what a mark of a file handed over holds, and what it becomes once taken back
_HANDED = Published(HANDED, 0, 0, 0, 0)
_TOMBSTONE = Published(0, 0, 0, 0, 0)


def _marked(table: mmap.mmap, mask: int, h1: int, h2: int) -> int:
    """The slot of ``table`` marking a hash handed over (``IndexWriter.hand_over``), or -1."""
    slot = h1 & mask
    while True:
        word, s1, s2, number = _MARK.unpack_from(table, HEADER_SIZE + slot * SLOT_SIZE)
        if word & 3 == DEAD and s1 == h1 and s2 == h2 and number == HANDED:
            return slot
        if word & 3 == EMPTY:
            return -1
        slot = (slot + 1) & mask


class IndexWriter:
    """The daemon's side: publish and withdraw complete cache entries."""

    def __init__(self, dir_fd: int, revalidate: bool = False, name: str = INDEX,
                 mode: int = 0o600) -> None:
        self.dir_fd = dir_fd
        self.revalidate = revalidate
        #: the index's file name in the cache directory, and its mode (0644 for the public
        #: index, which other users read)
        self.name, self.mode = name, mode
        #: how large a new file the cache would still take, bytes (``set_room``)
        self.room = 0
        #: live slots; a path's slot is found by probing the table, as a client does, so
        #: the daemon keeps nothing per published file (a dict of paths cost ~150 bytes each)
        self._live = 0
        self._dead = 0
        #: of the tombstones, marks of files handed over (``hand_over``)
        self._marks = 0
        self.generation = 0
        self.withdrawn = 0
        retire(dir_fd, name)  # a former daemon's index: its clients must not trust it any more
        self._map = self._create(MIN_SLOTS)
        #: the table as words, for the stores readers watch (a view made per store cost ~1
        #: µs, and a fill makes four)
        self._words = _words(self._map)
        self._mask = MIN_SLOTS - 1
        self._install()

    def __len__(self) -> int:
        return self._live

    def __contains__(self, path: bytes) -> bool:
        return self._slot(*path_hash(path)) >= 0

    def _slot(self, h1: int, h2: int) -> int:
        """The live slot of a hash, or -1."""
        slot = h1 & self._mask
        while True:
            word, s1, s2 = _PROBE.unpack_from(self._map, HEADER_SIZE + slot * SLOT_SIZE)
            if word & 3 == LIVE and s1 == h1 and s2 == h2:
                return slot
            if word & 3 == EMPTY:
                return -1
            slot = (slot + 1) & self._mask

    def reserve(self, files: int) -> None:
        """Room for ``files`` more published files without growing one doubling at a time
        (a restart publishing a million adopted entries)."""
        if (self._live + self._dead + files) * 2 > self._mask + 1:
            self._grow(self._live + files)

    def _create(self, slots: int) -> mmap.mmap:
        """A new, empty table, not yet where clients look (``_install``)."""
        self.generation += 1
        part = self.name + ".part"
        with contextlib.suppress(FileNotFoundError):  # a torn one: made anew, never reused
            os.unlink(part, dir_fd=self.dir_fd)
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     self.mode, dir_fd=self.dir_fd)
        try:
            os.fchmod(fd, self.mode)  # whatever the umask
            # Every page allocated now: a store into a page tmpfs has no room for would
            # kill the daemon with SIGBUS; this raises ENOSPC instead.
            os.posix_fallocate(fd, 0, HEADER_SIZE + slots * SLOT_SIZE)
            table = mmap.mmap(fd, HEADER_SIZE + slots * SLOT_SIZE, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        _HEADER.pack_into(table, 0, MAGIC, 0, int(self.revalidate), slots, self.generation,
                          self.room | _ROOM_SET)
        return table

    def _install(self) -> None:
        """Clients open the table just created from now on."""
        self.beat()
        os.rename(self.name + ".part", self.name, src_dir_fd=self.dir_fd,
                  dst_dir_fd=self.dir_fd)

    def set_revalidate(self) -> None:
        """From now on clients compare every hit's version with the source."""
        self.revalidate = True
        self._words[(_FLAGS_AT + 8) >> 3] = 1

    def set_room(self, room: int) -> None:
        """Clients read a file larger than ``room`` from the source, not through the mount."""
        if room != self.room:
            self.room = room
            self._words[_ROOM_AT >> 3] = room | _ROOM_SET

    def publish(self, path: bytes, found: Published) -> None:
        """Publish (or republish) a path; OSError if the index cannot grow (no room)."""
        h1, h2 = path_hash(path)
        self._withdraw(h1, h2)
        if self._marks:
            self._take_back(h1, h2)
        if (self._live + self._dead + 1) * 2 > self._mask + 1:
            self._grow(self._live + self._marks)
        slot = self._free_slot(h1)
        self._write(slot, h1, h2, found)
        self._live += 1
        self.beat()  # a daemon publishing is alive: its clients can find this at once

    def beat(self) -> None:
        """Tell clients the daemon is alive and withdrawing: they trust the index for
        ``STALE_AFTER_S`` from now."""
        self._words[_BEAT_AT >> 3] = monotonic_ns() | _BEAT_SET

    def withdraw(self, path: bytes) -> bool:
        """Make a path's slot a tombstone; whether it was published."""
        return self._withdraw(*path_hash(path))

    def number(self, path: bytes) -> int | None:
        """The entry number a path is published with, if it is."""
        slot = self._slot(*path_hash(path))
        return None if slot < 0 else SLOT.unpack_from(
            self._map, HEADER_SIZE + slot * SLOT_SIZE)[3]

    def _withdraw(self, h1: int, h2: int) -> bool:
        slot = self._slot(h1, h2)
        if slot < 0:
            return False
        self._live -= 1
        at = HEADER_SIZE + slot * SLOT_SIZE
        word = self._words[at >> 3]
        self._words[at >> 3] = ((word >> 2) + 1) << 2 | DEAD
        self._dead += 1
        self.withdrawn += 1
        return True

    def hand_over(self, path: bytes) -> None:
        """Mark a file a job handed to the fills (a prefetch) until it is published: its
        clients then read it through the mount, which serves it from its fill, not from the
        source, which its fill would read again. The mark is a tombstone with the path's
        hash and ``HANDED`` for a number, so that a reader that knows no mark (an older
        client, the C readers) skips it as any tombstone. It stays until the file is
        published or taken back: other paths' publishes leave it, a growing table keeps it."""
        h1, h2 = path_hash(path)
        if self._slot(h1, h2) >= 0 or _marked(self._map, self._mask, h1, h2) >= 0:
            return
        if (self._live + self._dead + 1) * 2 > self._mask + 1:
            self._grow(self._live + self._marks)
        slot = self._free_slot(h1)
        self._write(slot, h1, h2, _HANDED, DEAD)
        self._dead += 1
        self._marks += 1

    def take_back(self, path: bytes) -> None:
        """The file handed over will not be filled: its mark goes (a plain tombstone)."""
        if self._marks:
            self._take_back(*path_hash(path))

    def _take_back(self, h1: int, h2: int) -> None:
        slot = _marked(self._map, self._mask, h1, h2)
        if slot >= 0:
            self._write(slot, h1, h2, _TOMBSTONE, DEAD)
            self._marks -= 1

    def _free_slot(self, h1: int) -> int:
        """The first slot from ``h1``'s that is empty, or a tombstone other than a mark."""
        words, mask, slot = self._words, self._mask, h1 & self._mask
        while True:
            word = (HEADER_SIZE + slot * SLOT_SIZE) >> 3
            state = words[word] & 3
            if state == EMPTY:
                return slot
            if state == DEAD and words[word + 3] != HANDED:
                self._dead -= 1
                return slot
            slot = (slot + 1) & mask

    def _write(self, slot: int, h1: int, h2: int, found: Published, state: int = LIVE
               ) -> None:
        at = HEADER_SIZE + slot * SLOT_SIZE
        words, word = self._words, at >> 3
        sequence = (words[word] >> 2) + 1
        words[word] = sequence << 2 | BUSY
        _FIELDS.pack_into(self._map, at + 8, h1, h2, found.offset, found.size, found.ino,
                          found.mtime_ns, found.ctime_ns)
        words[word] = sequence << 2 | state  # last: the slot is complete

    def _grow(self, files: int) -> None:
        """Rebuild into a table with room for three times ``files``, without tombstones but
        the marks of files handed over."""
        slots = max(MIN_SLOTS, 1 << (files * 3 - 1).bit_length())
        old, old_words, old_slots = self._map, self._words, self._mask + 1
        table = self._create(slots)  # the old table stays in use if this fails
        self._map, self._words, self._mask = table, _words(table), slots - 1
        self._dead = self._marks = 0
        words = memoryview(old)[HEADER_SIZE : HEADER_SIZE + old_slots * SLOT_SIZE].cast("Q")
        step = SLOT_SIZE // 8
        kept = [slot for slot, word in enumerate(words[::step]) if word & 3 == LIVE
                or (word & 3 == DEAD and words[slot * step + 3] == HANDED)]
        words.release()
        for slot in kept:
            fields = SLOT.unpack_from(old, HEADER_SIZE + slot * SLOT_SIZE)
            h1, h2, state = fields[1], fields[2], fields[0] & 3
            free = h1 & self._mask  # a slot no copy took: the table has no tombstone yet
            while self._words[(HEADER_SIZE + free * SLOT_SIZE) >> 3] & 3 != EMPTY:
                free = (free + 1) & self._mask
            self._write(free, h1, h2, Published(*fields[3:]), state)
            if state == DEAD:
                self._dead += 1
                self._marks += 1
        self._install()
        old_words[_FLAGS_AT >> 3] = 1  # after the rename: readers reopen the new table
        old_words.release()
        old.close()

    def close(self) -> None:
        """Retire the index: clients stop trusting it (the files may go with the mount)."""
        self._words[_FLAGS_AT >> 3] = 1
        self._words.release()
        self._map.close()


def retire(dir_fd: int, name: str = INDEX) -> None:
    """Mark the index in a cache directory retired, if there is one."""
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if os.fstat(fd).st_size < HEADER_SIZE:
                return  # no index of ours
            with mmap.mmap(fd, HEADER_SIZE, flags=mmap.MAP_SHARED) as header:
                if header[:8] == MAGIC:
                    _store(header, _FLAGS_AT, 1)
        finally:
            os.close(fd)


class IndexReader:
    """A client's side: finds a published path's slot with no system call, and maps the
    files it finds.

    Raises OSError when the index or the files' directory cannot be opened (such as a user
    who may not read the cache directory): the caller then reads through the mount.
    """

    def __init__(self, index: str, files: str) -> None:
        self.index_path = index
        self._files = os.open(files, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        #: entry number -> its file mapped: kept, never evicted (``MAPPED_FILES`` at most)
        self._mapped: dict[int, mmap.mmap] = {}
        #: entry numbers read once (``view``): a second read maps the file
        self._seen: set[int] = set()
        try:
            self._map, self._mask, self.revalidate = self._open()
        except OSError:
            os.close(self._files)
            raise
        # Ahead of our clock (``| _BEAT_SET``: rounded as the beat is) only from a clock of
        # another time namespace, which would make a dead daemon's beat look fresh
        if _WORD.unpack_from(self._map, _BEAT_AT)[0] > monotonic_ns() | _BEAT_SET:
            self.close()
            raise OSError(f"{index} was written with a clock other than this process's")

    def view(self, found: Published) -> memoryview | bytes | None:
        """The bytes of a file ``find`` found; None if its entry went meanwhile (the caller
        reads through the mount).

        The first read of a file in this process reads it (open, pread, close: about tmpfs's
        cost, where opening and mapping it costs half as much again); the second maps it and
        keeps the mapping, and every later read is a view of it, with no system call. So a
        process that reads each file once (a DataLoader worker of one epoch) pays no mapping,
        and one that reads it again (the epochs after) reads at memory speed. Mappings are
        kept as the cache keeps files, never replaced, up to ``MAPPED_FILES``: with random-order
        epochs an evicting table would miss as often as it holds. A kept view of a file the
        daemon then drops shows the old bytes, and holds their memory until the client
        closes."""
        number = found.offset
        mapped = self._mapped.get(number)
        if mapped is not None and len(mapped) == found.size:
            return memoryview(mapped)
        try:
            fd = os.open(f"{number:x}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=self._files)
        except OSError:
            return None
        try:
            if number not in self._seen or len(self._mapped) >= MAPPED_FILES:
                if len(self._seen) < _SEEN_FILES:
                    self._seen.add(number)
                data = os.pread(fd, found.size + 1, 0)  # one more: a longer file is not it
                return data if len(data) == found.size else None
            # a mapping past the file's end would fault (SIGBUS): its size is checked first
            if found.size == 0 or os.fstat(fd).st_size != found.size:
                return b"" if found.size == 0 else None
            mapped = mmap.mmap(fd, found.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError:
            return None
        finally:
            os.close(fd)
        self._mapped[number] = mapped
        return memoryview(mapped)

    def _open(self) -> tuple[mmap.mmap, int, bool]:
        fd = os.open(self.index_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            table = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, _retired, revalidate, slots, _generation, _room = _HEADER.unpack_from(table, 0)
        if magic != MAGIC or len(table) < HEADER_SIZE + slots * SLOT_SIZE:
            table.close()
            raise OSError(f"{self.index_path} is no coordlfs index")
        return table, slots - 1, bool(revalidate)

    def find(self, path: bytes) -> Published | None:
        """The published version of ``path``, or None (not published, being changed, or
        the daemon has not beaten for ``STALE_AFTER_S``)."""
        h1, h2 = path_hash(path)
        for _attempt in range(3):  # a table retired meanwhile: look again in the new one
            table = self._map
            found = self._probe(table, h1, h2)
            retired, revalidate, beat = _FLAGS.unpack_from(table, _FLAGS_AT)
            if not retired:
                if beat and monotonic_ns() - beat >= _STALE_NS:
                    return None  # the daemon is dead or stopped: it withdraws nothing
                self.revalidate = revalidate != 0
                return found
            try:
                self._map, self._mask, self.revalidate = self._open()
            except OSError:
                return None  # the mount is going away: the caller reads through it
            table.close()
        return None

    def handed(self, path: bytes) -> bool:
        """Whether ``path`` is a file handed to the fills and not published yet
        (``IndexWriter.hand_over``): read through the mount, not from the source."""
        return _marked(self._map, self._mask, *path_hash(path)) >= 0

    @property
    def room(self) -> int | None:
        """How large a new file the cache would still take, as of now; None from a daemon that
        does not say (then every miss goes through the mount)."""
        word = _WORD.unpack_from(self._map, _ROOM_AT)[0]
        return word & ~_ROOM_SET if word & _ROOM_SET else None

    def _probe(self, table: mmap.mmap, h1: int, h2: int) -> Published | None:
        """Linear probing from the hash's slot; it ends, as the writer keeps half the table
        empty."""
        mask = self._mask
        slot = h1 & mask
        while True:
            at = HEADER_SIZE + slot * SLOT_SIZE
            fields = SLOT.unpack_from(table, at)
            state = fields[0] & 3
            if state == LIVE and fields[1] == h1 and fields[2] == h2:
                if _WORD.unpack_from(table, at)[0] != fields[0]:
                    return None  # rewritten while we read: the mount answers this one
                return Published._make(fields[3:])
            if state == EMPTY:
                return None
            slot = (slot + 1) & mask

    def close(self) -> None:
        for mapped in self._mapped.values():
            with contextlib.suppress(BufferError):  # views a user still holds: freed with them
                mapped.close()
        self._mapped.clear()
        os.close(self._files)
        self._map.close()
