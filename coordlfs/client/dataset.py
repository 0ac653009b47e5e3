"""Reading a coordlfs mount at memory speed, for jobs that opt in.

    from coordlfs.client import Dataset
    with Dataset("/mnt/data") as ds:
        ds.prefetch(order)                  # fetched in bulk, in this order
        for path in order:
            buf = ds.read(path)             # bytes-like: bytes(buf) copies it out

A repeated hit costs no system call and no copy: the daemon publishes the files its cache holds in
an index in shared memory (``coordlfs.cache.published``), and the client maps that index; it
reads a cached file (each is a file of its own) at its first read in the process, maps it at
the second and keeps the mapping, so from then on ``read`` returns a read-only view of the
cached bytes. Past ``published.MAPPED_FILES`` mappings a hit is one open and read of the
cached file. A miss
goes through the mount, which fills the cache as it does for every reader (and waits for a
prefetch of the file already under way), so the next read is a hit.

A miss the cache will not hold (the cache is full: the index says how large a new file it would
still take) is read from the source directly instead: through the mount it would only be
streamed, at the price of a FUSE round trip per request. The client opens it beneath the
source's root with its own credentials, never through a symlink (the mount shows links as
links), and only if the mount would let it read the file too: the kernel checks a reader of
the mount against the modes the mount shows, the source's, without ACLs, so the client
checks the same modes of each directory on the way and of the file (``access`` on the
mount's path would say the same, but costs a FUSE lookup per file once the kernel has
dropped its dentries, as much as the read it saves); it reads with the daemon's reader of the
source (``SourceReader``, through the page cache: the cache will not hold the file, so its
pages stay with the kernel's LRU as any reader's would), which checks the file's version
after. Anything else
(a file that fits, a peer's file: a mount with peers gets every miss, an error) goes through
the mount, which gives the same bytes or the same error.

The daemon withdraws a file from the index the moment its source changes (it watches the
source); where it cannot watch the source, the index says so and the client compares the
source file's version with the cached one on each hit (one ``lstat``). The cache directory
is the daemon user's alone: a process that cannot open it (another user of an
``--allow-other`` mount) reads everything through the mount, where the kernel checks its
permissions.

A daemon that is killed or stopped withdraws nothing more, so the client trusts the index only
while the daemon beats: ``published.STALE_AFTER_S`` (2 s) after the daemon's last beat (at
most that after it died or stopped), ``read`` serves no hit more. Each read then goes where a
miss goes: through the mount (a killed daemon's answers ENOTCONN; a stopped one's waits for it
to go on) or, for a file the cache has no room for, to the source directly. Checking costs a
read of the clock, no system call. A reader whose clock is not the daemon's (another time
namespace) does not use the index at all.

A view ``read`` returns keeps the bytes it showed: when the source changes, the daemon
unlinks the cached file, and the view still shows the old version (its memory is held until
the ``Dataset`` closes and no view is left). Hits and misses are counted
(``stats``) and reported to the mount in batches and on ``close``, so that ``coordlfs
stats`` shows them.

Only the standard library and the mount's control file are needed: no torch, no daemon.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import stat
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from coordlfs.cache.published import IndexReader, Published
from coordlfs.protocol import spec as control_spec
from coordlfs.protocol.client import Control, ControlError, find_mount
from coordlfs.sizes import pages
from coordlfs.source.beneath import mode_grants, open_beneath
from coordlfs.source.source import SourceReader

#: Reads between two reports of a client's counts to the mount.
REPORT_EVERY = 10_000


@dataclass(slots=True)
class _Counts:
    hits: int = 0
    misses: int = 0
    bytes_from_cache: int = 0
    bytes_from_mount: int = 0
    #: misses read from the source directly (the cache had no room for them)
    direct: int = 0
    bytes_direct: int = 0


class _Reports:
    """A client's counts, and how much of them the mount has been told."""

    def __init__(self, control: Control) -> None:
        self.control = control
        self.total = _Counts()
        self.sent = _Counts()

    def send(self) -> None:
        delta = {k: v - getattr(self.sent, k) for k, v in asdict(self.total).items()}
        if not any(delta.values()):
            return
        self.sent = _Counts(**asdict(self.total))
        # a mount that is gone or older: the counts stay in ``stats``
        with contextlib.suppress(ControlError, OSError):
            self.control.call(control_spec.CLIENT_REPORT, **delta)

    def forked(self) -> None:
        """In a forked child: what the parent counted is the parent's to report."""
        self.sent = _Counts(**asdict(self.total))


_open_datasets: weakref.WeakSet[Dataset] = weakref.WeakSet()


def _after_fork() -> None:
    for dataset in list(_open_datasets):
        dataset._reports.forked()


os.register_at_fork(after_in_child=_after_fork)


class Dataset:
    """Files under ``root`` (a coordlfs mount, or a directory in one), by relative path."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.realpath(root)
        mount = find_mount(self.root)
        if mount is None:
            raise ControlError(f"{os.fspath(root)} is not on a coordlfs mount")
        self.mountpoint = mount
        self._control = Control(mount)
        status = self._control.share()  # the mount keeps the index this reads from now on
        inside = os.path.relpath(self.root, mount)
        self._prefix = "" if inside == "." else inside + "/"
        self._mount_dir = os.fsencode(mount) + b"/"
        self._source_dir = os.fsencode(status["source"]).rstrip(b"/") + b"/"
        self._index: IndexReader | None = None
        shared = status.get("shared") or {}
        # not this user's to read (or no index): every read goes through the mount
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            self._index = IndexReader(shared["index"], shared["files"])
        self._direct = _DirectMisses(self._source_dir, (status.get("cache") or {}).get(
            "max_file_bytes")) if self._index is not None and _no_peers(status) else None
        self._reports = _Reports(self._control)
        self._until_report = REPORT_EVERY
        self._finalizer = weakref.finalize(self, _close, self._reports, self._index,
                                           self._direct)
        _open_datasets.add(self)

    @property
    def shared(self) -> bool:
        """Whether hits come from shared memory (else every read goes through the mount)."""
        return self._index is not None

    def _name(self, path: str | os.PathLike[str]) -> bytes:
        """``path`` as the index keys it: relative to the mount's root, normalised."""
        if not isinstance(path, str):
            path = os.fsdecode(path)
        name = self._prefix + path
        if (not path or path[0] == "/" or "//" in name or "/." in name or name[0] == "."
                or name[-1] == "/"):
            name = posixpath.normpath(name)
            if not path or path[0] == "/" or name == ".." or name.startswith("../"):
                raise ValueError(f"{path!r} is not a path relative to the dataset")
        return name.encode("utf-8", "surrogateescape")

    def read(self, path: str | os.PathLike[str]) -> memoryview | bytes:
        """The file's bytes: a read-only view of the cache on a hit, else bytes read through
        the mount. The view reads zeros some seconds after the file changes in the source:
        ``bytes(buf)`` what you keep."""
        name = self._name(path)
        index = self._index
        if index is not None:
            found = index.find(name)
            if found is not None and (not index.revalidate or self._fresh(name, found)):
                data = index.view(found)
                if data is not None:
                    counts = self._reports.total
                    counts.hits += 1
                    counts.bytes_from_cache += found.size
                    self._count_read()
                    return data
            room = index.room
            # a file handed to the fills (by any process's ``prefetch``) is read through the
            # mount, which serves it from its fill, or fills it: read directly by a reader
            # ahead of the fills, it would be read from storage again by its fill
            if self._direct is not None and room is not None and not index.handed(name):
                data = self._direct.read(name, room)
                if data is not None:
                    counts = self._reports.total
                    counts.direct += 1
                    counts.bytes_direct += len(data)
                    self._count_read()
                    return data
        with open(self._mount_dir + name, "rb", buffering=0) as f:
            data = f.readall()
        counts = self._reports.total
        counts.misses += 1
        counts.bytes_from_mount += len(data)
        self._count_read()
        return data

    def _fresh(self, name: bytes, found: Published) -> bool:
        """Whether the source file still is the version cached (the mount's open checks
        the same); False sends the read to the mount, which then drops the old entry."""
        try:
            return found.matches(os.lstat(self._source_dir + name))
        except OSError:
            return False

    def _count_read(self) -> None:
        self._until_report -= 1
        if self._until_report <= 0:
            self._until_report = REPORT_EVERY
            self._reports.send()

    def open(self, path: str | os.PathLike[str]) -> ViewFile:
        """A read-only, seekable binary file over the file's bytes (for PIL, h5py, ...)."""
        return ViewFile(self.read(path))

    def prefetch(self, paths: Iterable[str | os.PathLike[str]]) -> int:
        """Hand the mount the order of reads to come: it fills the files not cached yet in
        bulk, in this order. Returns at once, with how many files the mount queued.

        Where this process may read the source (``_DirectMisses.split``), only the last files
        of the order that fit in the cache's room are handed over, with what they come to;
        the mount then leaves that room to them, so the reads of the files before them (in
        any process) find none and read the source directly."""
        index = self._index
        names = [n for n in map(self._name, paths) if index is None or index.find(n) is None]
        sizes: list[int] | None = None
        if self._direct is not None and index is not None and (room := index.room) is not None:
            names, sizes = self._direct.split(names, room)
        queued = 0
        step = control_spec.MAX_PREFETCH_PATHS
        for start in range(0, len(names), step):
            chunk = [n.decode("utf-8", "surrogateescape") for n in names[start:start + step]]
            promised = {} if sizes is None else {"bytes": sum(sizes[start:start + step])}
            queued += self._control.call(control_spec.PREFETCH, paths=chunk, **promised)["queued"]
        return queued

    @property
    def stats(self) -> dict[str, int]:
        """This process's reads: hits (from shared memory), misses (through the mount) and
        direct reads (misses the cache had no room for, from the source)."""
        return asdict(self._reports.total)

    def report(self) -> None:
        """Tell the mount the counts it has not seen yet (they go in batches, and on
        ``close``): for a benchmark that reads the mount's stats between epochs."""
        self._reports.send()

    def close(self) -> None:
        """Report the counts the mount has not seen yet and unmap the cache (views still
        held keep their mapping until they are freed)."""
        self._finalizer()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()


def _close(reports: _Reports, index: IndexReader | None, direct: _DirectMisses | None) -> None:
    reports.send()
    if index is not None:
        index.close()
    if direct is not None:
        direct.close()


def _no_peers(status: dict[str, Any]) -> bool:
    """Whether the mount caches every file itself: with peers, a miss may be a peer's to
    serve from its cache, which only the mount can ask for."""
    return not (status.get("peers") or {}).get("nodes")


class _DirectMisses:
    """Which misses this process reads from the source itself, and as whom (see the module's
    docstring): the bytes come from the daemon's own reader of the source
    (``coordlfs.source.source.SourceReader``); ``read`` returns None for whatever the mount
    must answer."""

    def __init__(self, source_dir: bytes, max_file_size: int | None) -> None:
        self.source_dir = source_dir
        #: files over it are never cached: always read directly (None: the mount did not say)
        self.max_file_size = max_file_size
        #: an O_PATH descriptor of the source's root opened as this process (None: not yet;
        #: -1: it cannot, as a user who may not reach the source: every miss goes to the mount)
        self._root: int | None = None
        #: this process's uid and groups, as the mount's kernel check sees them (``_root_fd``)
        self._uid = -1
        self._gids: frozenset[int] = frozenset()
        #: it may read and search anything (CAP_DAC_OVERRIDE or CAP_DAC_READ_SEARCH)
        self._overrides = False

    def split(self, names: list[bytes], room: int) -> tuple[list[bytes], list[int]]:
        """Of an order's misses, those to hand to the mount's fills and their sizes: the
        longest tail whose files fit in ``room`` together.

        The cache keeps whichever files come first, and which ones makes no difference to the
        hits of later epochs. Handing over the head of a cold epoch's order makes the reader
        wait on the fills for the first part and then read the rest (no room left) alone;
        handing over the tail lets the fills run ahead there while the reader reads the head
        from the source, each file still read from storage once. Each file of the tail is
        stat'ed (a cold one reads its inode, as its fill would), the head not at all; a file
        that cannot be, or is never cached, counts 0."""
        root = self._root_fd()
        if root < 0:
            return names, [0] * len(names)
        sizes: list[int] = []
        total = 0
        for cut in range(len(names), 0, -1):
            try:
                st = os.stat(names[cut - 1], dir_fd=root, follow_symlinks=False)
            except OSError:
                st = None  # the mount will say what it is
            size = 0 if st is None or not stat.S_ISREG(st.st_mode) or (
                self.max_file_size is not None and st.st_size > self.max_file_size) \
                else pages(st.st_size)  # what the cache charges for it
            total += size
            if total > room:
                return names[cut:], sizes[::-1]
            sizes.append(size)
        return names, sizes[::-1]

    def _root_fd(self) -> int:
        if self._root is not None and os.geteuid() != self._uid:
            self.close()  # a process that changed user: opened again, checked as that user
            self._root = None
        if self._root is None:
            try:
                self._root = os.open(self.source_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                self._root = -1
            # at the same time as the root, so that both are of the same credentials
            self._uid, self._gids = os.geteuid(), frozenset((os.getegid(), *os.getgroups()))
            self._overrides = _overrides_modes()
        return self._root

    def _mount_allows(self, root: int, name: bytes, st: os.stat_result) -> bool:
        """Whether the mount would let this process read the file: search on the root and
        every directory on the way, read on the file, by the modes alone (``generic_permission``
        on what the mount shows). One fstatat per directory, no FUSE request."""
        if self._overrides:
            return True
        uid, gids = self._uid, self._gids
        if not mode_grants(st, uid, gids, 4) or not mode_grants(os.fstat(root), uid, gids, 1):
            return False
        at = name.find(b"/")
        while at > 0:
            if not mode_grants(os.stat(name[:at], dir_fd=root, follow_symlinks=False), uid,
                               gids, 1):
                return False
            at = name.find(b"/", at + 1)
        return True

    def read(self, name: bytes, room: int) -> bytes | None:
        """The file's bytes if it is a regular file the cache has no room for and the mount
        would let this process read; None sends the read to the mount."""
        root = self._root_fd()
        if root < 0:
            return None
        for _attempt in range(2):  # changed during the read: once more, then the mount
            try:
                reader = SourceReader.opening(open_beneath, root, name, keep_pages=True)
            except OSError:  # a symlink on the way, gone, not this user's: the mount says
                return None
            try:
                st = reader.fstat()
                if not stat.S_ISREG(st.st_mode) or (
                        st.st_size <= room and (self.max_file_size is None
                                                or st.st_size <= self.max_file_size)):
                    return None  # the mount caches it (or shows what it is)
                if not self._mount_allows(root, name, st):
                    return None  # the mount's modes refuse it: the mount gives the error
                data = reader.read_whole(st)
                if data is not None:
                    return data
            except OSError:
                return None
            finally:
                reader.close()
        return None

    def close(self) -> None:
        if self._root is not None and self._root >= 0:
            os.close(self._root)
        self._root = -1


def _overrides_modes() -> bool:
    """Whether this process's effective capabilities skip the modes' read and search checks
    (root's, usually): CAP_DAC_OVERRIDE or CAP_DAC_READ_SEARCH."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"CapEff:"):
                    return bool(int(line.split()[1], 16) & 0b110)
    except (OSError, ValueError, IndexError):
        pass
    return False


class ViewFile(io.BufferedIOBase):
    """A read-only binary file over a buffer, without copying it (``io.BytesIO`` copies a
    view it is given)."""

    def __init__(self, data: memoryview | bytes) -> None:
        super().__init__()
        self._data = memoryview(data)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def getbuffer(self) -> memoryview:
        return self._data

    def read(self, size: int | None = -1) -> bytes:
        self._check_closed()
        end = len(self._data) if size is None or size < 0 else min(len(self._data),
                                                                     self._pos + size)
        data = bytes(self._data[self._pos : end]) if end > self._pos else b""
        self._pos = max(self._pos, end)
        return data

    read1 = read

    def readinto(self, buffer: Any) -> int:
        self._check_closed()
        target = memoryview(buffer).cast("B")
        n = max(0, min(len(target), len(self._data) - self._pos))
        target[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n

    readinto1 = readinto

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_closed()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        self._check_closed()
        return self._pos

    def _check_closed(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")

    def close(self) -> None:
        if not self.closed:
            self._data.release()
        super().close()
