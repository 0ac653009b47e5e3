"""The MinIO cache: whole files, kept in shared memory, never evicted.

MinIO (CoorDL paper, section 4.1) caches items as they are first read until the capacity is
reached and then never replaces anything. With random-order epochs every later epoch then
gets exactly ``capacity`` bytes of hits, where an LRU cache thrashes.

Each cached file is one file in a tmpfs directory (``/dev/shm/coordlfs/...`` by default), so
the bytes live outside the daemon's heap: a restarted daemon finds them warm, and
cooperating readers on the host may later read them without a FUSE round trip. A journal
(``index.jsonl``) records which source path and version each entry holds; on start every
entry is checked against the source's size and mtime, and anything unproven is deleted.

A file is filled by a background task in chunks; readers wait only until the bytes they asked
for have arrived, so a large file streams while it is being cached.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import trio

from coordlfs.errors import UserError
from coordlfs.inodes import Key
from coordlfs.source import Source, SourceReader
from coordlfs.stats import ReadCounters

log = logging.getLogger(__name__)

#: Bytes read from the source per worker-thread call while filling an entry: large enough
#: that thread hand-offs cost nothing next to the copy, small enough to bound the per-thread
#: O_DIRECT buffers and to let a reader of a big file start early.
FILL_CHUNK = 1 << 20
JOURNAL = "index.jsonl"
#: Complete entries kept mapped for zero-copy hits (least recently read dropped first); well
#: below vm.max_map_count (65530 by default), which counts every mapping of the process.
MAX_MAPPED = 16384
_PART = ".part"


@dataclass(slots=True, eq=False)
class Entry:
    name: str
    path: bytes
    size: int
    mtime_ns: int
    filled: int = 0
    complete: bool = False
    failed: bool = False
    #: Read/write descriptor of the entry while it is being filled; -1 afterwards.
    fd: int = -1
    #: Set (and replaced) each time more bytes arrive; None once the fill has ended, so that
    #: a million cached entries do not each keep an Event.
    progress: trio.Event | None = None

    def matches(self, st: os.stat_result) -> bool:
        return self.size == st.st_size and self.mtime_ns == st.st_mtime_ns


def entry_name(key: Key) -> str:
    return f"{key[0]:x}-{key[1]:x}"


def _key_of(name: str) -> Key:
    dev, ino = name.split("-")
    return int(dev, 16), int(ino, 16)


class MinioCache:
    def __init__(self, directory: str, capacity: int, max_file_size: int,
                 counters: ReadCounters) -> None:
        self.directory = directory
        self.capacity = capacity
        self.max_file_size = max_file_size
        self.counters = counters
        self.entries: dict[Key, Entry] = {}
        self.used = 0
        #: entries being filled (the rest of ``entries`` are complete); kept, not counted,
        #: because the status is read while a million entries may be cached
        self.filling = 0
        self._views: OrderedDict[str, memoryview] = OrderedDict()
        self._journal_fd = -1
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self.dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise UserError(f"cannot use cache directory {directory}: {e.strerror}") from None
        try:
            fcntl.flock(self.dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.dir_fd)
            raise UserError(f"cache directory {directory} is in use by another coordlfs mount "
                            "(give this mount its own --cache-dir)") from None

    # -- start and stop ---------------------------------------------------------------

    def load(self, source: Source) -> int:
        """Adopt entries a previous daemon left, if they still match the source; returns count."""
        records: dict[str, dict] = {}
        try:
            with open(JOURNAL, opener=self._opener(os.O_RDONLY)) as journal:
                for line in journal:
                    try:
                        record = json.loads(line)
                        records[record["name"]] = record
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn last line after a crash
        except FileNotFoundError:
            pass
        present = {n: os.stat(n, dir_fd=self.dir_fd).st_size for n in os.listdir(self.dir_fd)
                   if n != JOURNAL}
        for name in present:
            record = records.get(name)
            if record is None or not self._adopt(source, name, record, present[name]):
                os.unlink(name, dir_fd=self.dir_fd)
        self._rewrite_journal()
        return len(self.entries)

    def _adopt(self, source: Source, name: str, record: dict, data_size: int) -> bool:
        try:
            key = _key_of(name)
            path = os.fsencode(record["path"])
            st = source.lstat(path)
        except (OSError, ValueError, KeyError):
            return False
        entry = Entry(name, path, record.get("size", -1), record.get("mtime_ns", -1),
                      filled=data_size, complete=True)
        if ((st.st_dev, st.st_ino) != key or not entry.matches(st) or data_size != entry.size
                or self.used + entry.size > self.capacity):
            return False
        self.entries[key] = entry
        self.used += entry.size
        return True

    def close(self, keep: bool) -> None:
        """Remove the cached bytes unless ``keep``; then release the directory lock."""
        self._views.clear()
        for entry in self.entries.values():
            if entry.fd >= 0:
                os.close(entry.fd)
                entry.fd = -1
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
        if not keep:
            shutil.rmtree(self.directory, ignore_errors=True)
        os.close(self.dir_fd)

    # -- lookups and fills ------------------------------------------------------------

    def lookup(self, key: Key, st: os.stat_result) -> Entry | None:
        """The entry holding this version of the file (complete or being filled), if any."""
        entry = self.entries.get(key)
        if entry is None or entry.matches(st):
            return entry
        if entry.complete:
            log.info("source file %s changed; dropping its cache entry", os.fsdecode(entry.path))
            self._release(key, entry)
        return None

    def reserve(self, key: Key, path: bytes, st: os.stat_result) -> Entry | None:
        """Claim room for a new entry, or None when MinIO's capacity (or the file limit) says no."""
        if key in self.entries or st.st_size > self.max_file_size:
            return None
        if self.used + st.st_size > self.capacity:
            return None
        name = entry_name(key)
        fd = os.open(name + _PART, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600,
                     dir_fd=self.dir_fd)
        entry = Entry(name, path, st.st_size, st.st_mtime_ns, fd=fd, progress=trio.Event())
        self.entries[key] = entry
        self.used += entry.size
        self.filling += 1
        return entry

    async def fill(self, key: Key, entry: Entry, source: Source) -> None:
        """Copy the source file into the entry; on any failure the entry is given up."""
        copier = _Copier(source, entry)
        try:
            try:
                while entry.filled < entry.size:
                    got = await trio.to_thread.run_sync(copier.step, entry.filled)
                    if got == 0:
                        raise OSError(5, "source file shrank while being cached")
                    entry.filled += got
                    self.counters.bytes_from_source += got
                    self._wake(entry)
            finally:
                copier.close()
            st = copier.final
            if st is None or not entry.matches(st):
                raise OSError(5, "source file changed while being cached")
            os.rename(entry.name + _PART, entry.name, src_dir_fd=self.dir_fd,
                      dst_dir_fd=self.dir_fd)
            self._journal(entry)
            os.close(entry.fd)
            entry.fd = -1
            entry.complete = True
        except Exception as e:  # a failed fill must never fail the mount: readers stream
            log.warning("caching %s failed: %s", os.fsdecode(entry.path), e,
                        exc_info=not isinstance(e, OSError))
            self._release(key, entry)
        except BaseException:  # cancelled at unmount
            self._release(key, entry)
            raise
        finally:
            self.filling -= 1
            self._wake(entry)

    async def wait_for(self, entry: Entry, end: int) -> bool:
        """Wait until bytes up to ``end`` are in the entry; False if the fill failed."""
        while not entry.failed and not entry.complete and entry.filled < end:
            assert entry.progress is not None  # still filling
            await entry.progress.wait()
        return not entry.failed

    def open_entry(self, entry: Entry) -> int:
        """A read-only descriptor on a complete entry."""
        return os.open(entry.name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)

    def view(self, entry: Entry) -> memoryview:
        """The bytes of a complete entry, mapped read-only and kept mapped.

        A hit then costs no syscall and no copy in the daemon: pyfuse3 hands a slice of the
        mapping to the kernel, which copies it once into the reply, as from any buffer.
        Entries are never truncated (only unlinked), so a mapping stays valid.
        """
        view = self._views.get(entry.name)
        if view is not None:
            self._views.move_to_end(entry.name)
            return view
        if entry.size == 0:
            return memoryview(b"")  # mmap refuses empty files
        fd = self.open_entry(entry)
        try:
            view = memoryview(mmap.mmap(fd, entry.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                        prot=mmap.PROT_READ))
        finally:
            os.close(fd)
        self._views[entry.name] = view
        if len(self._views) > MAX_MAPPED:
            # unmapped when the last slice of it (a reply in flight, if any) is gone
            self._views.popitem(last=False)
        return view

    # -- internals -----------------------------------------------------------------

    @staticmethod
    def _wake(entry: Entry) -> None:
        done = entry.progress
        entry.progress = None if entry.complete or entry.failed else trio.Event()
        if done is not None:
            done.set()

    def _release(self, key: Key, entry: Entry) -> None:
        # Open handles still holding the entry must not see another version under its name:
        # a failed entry sends them to the source.
        entry.complete, entry.failed = False, True
        self._views.pop(entry.name, None)
        if self.entries.get(key) is entry:
            del self.entries[key]
            self.used -= entry.size
        if entry.fd >= 0:
            os.close(entry.fd)
            entry.fd = -1
        for name in (entry.name, entry.name + _PART):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.dir_fd)

    def _opener(self, flags: int) -> Callable[[str, int], int]:
        return lambda name, _flags: os.open(name, flags, 0o600, dir_fd=self.dir_fd)

    @staticmethod
    def _record(entry: Entry) -> str:
        return json.dumps({"name": entry.name, "path": os.fsdecode(entry.path),
                           "size": entry.size, "mtime_ns": entry.mtime_ns}) + "\n"

    def _journal(self, entry: Entry) -> None:
        if self._journal_fd < 0:
            self._journal_fd = os.open(JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                                       | os.O_CLOEXEC, 0o600, dir_fd=self.dir_fd)
        os.write(self._journal_fd, self._record(entry).encode())

    def _rewrite_journal(self) -> None:
        tmp = JOURNAL + _PART
        with open(tmp, "w", opener=self._opener(os.O_WRONLY | os.O_CREAT | os.O_TRUNC)) as out:
            out.writelines(self._record(e) for e in self.entries.values())
        os.rename(tmp, JOURNAL, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)


class _Copier:
    """Copies a source file into a filling entry, one chunk per call from a worker thread.

    Opening the source, the last chunk and the final fstat share a thread call, so a small
    file (the common case) costs one thread hand-off rather than three.
    """

    def __init__(self, source: Source, entry: Entry) -> None:
        self.source = source
        self.entry = entry
        self.reader: SourceReader | None = None
        self.final: os.stat_result | None = None

    def step(self, offset: int) -> int:
        if self.reader is None:
            self.reader = self.source.open_reader(self.entry.path)
        data = self.reader.read_view(offset, min(FILL_CHUNK, self.entry.size - offset))
        os.pwrite(self.entry.fd, data, offset)
        if offset + len(data) >= self.entry.size:
            self.final = self.reader.fstat()
        return len(data)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
