"""Batched, order-aware fills: files a job announced (``prefetch``) read into MinIO in bulk.

A job that knows its order (``coordlfs.client.Dataset.prefetch``, a sampler) hands it over on
the control file; the files are then read into the cache ahead of the job, with no FUSE
request per file. Each requester (the process that sent the order) has a queue, in its order;
``depth`` workers take files from the queues in turn, so one long order does not starve
another. A later ``prefetch`` appends to the requester's queue: an order is sent in pieces
(a request names at most ``control_spec.MAX_PREFETCH_PATHS``), and the next epoch's order
comes after the rest of this one, which the job reads first.

A worker fills a whole file in one worker-thread call (``_Fill.run``): open beneath the
source's root (never through a symlink), fstat, reserve the entry on the event loop (one
call back), read with O_DIRECT in pieces of up to ``cache.FILL_CHUNK`` into the thread's
aligned buffer, pwrite into the arena, fstat again. A small file (the common case) thus costs
one hand-off to a thread and one back, where a read through the mount costs several FUSE
requests; memory for fills in flight is at most ``depth`` buffers of ``FILL_CHUNK``. The entry
is reserved and ended through ``WholeFileCache`` like any fill, so a reader through the mount
of a file being filled waits on the same entry, and an entry the mount is already filling (or
holds) is skipped, as is a file over ``--max-file-size``, one MinIO has no room for, and one a
peer caches. Failures are counted and logged once per cause; they never fail the mount.

Who may prefetch: the mount runs with ``default_permissions``, so the kernel checks a reader's
uid and groups against each file's mode and every directory's search bit on the way. Root and
the mount's owner may name any file (the daemon, running as the owner, reads only what the
owner could). Another user (an ``--allow-other`` mount) gets the same check here, against the
uid FUSE reports and the groups in ``/proc/PID/status``; a request naming a file that user may
not read is refused whole (EACCES).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from coordlfs.cache import FILL_CHUNK, Entry, WholeFileCache, write_all
from coordlfs.control_server import Caller, ControlServer
from coordlfs.control_spec import Refused
from coordlfs.inodes import Key
from coordlfs.source import Source, SourceReader

log = logging.getLogger(__name__)

#: Files all requesters together may have queued; past it a request takes what fits and
#: says how many (``"queued"``), so the daemon's memory for orders stays bounded (~40 MB).
MAX_QUEUED = 1 << 19

_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every architecture (it postdates the split tables)
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def open_beneath(root_fd: int, path: bytes, flags: int) -> int:
    """Open ``path`` relative to ``root_fd`` without leaving it and without following any
    symlink on the way (openat2), as a reader through the mount would reach that file: the
    mount shows links as links, so a path through one is not the file it names."""
    how = _OpenHow(flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0,
                   _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, root_fd, path, ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
    return fd


def open_source(root_fd: int, path: bytes) -> SourceReader:
    """A reader of the regular file ``path``: O_DIRECT where the filesystem allows it."""
    try:
        return SourceReader(open_beneath(root_fd, path, os.O_RDONLY | os.O_DIRECT), True)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return SourceReader(open_beneath(root_fd, path, os.O_RDONLY), False)


# -- who may prefetch ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Credentials:
    """What the kernel checks a file's mode against for a reader."""

    uid: int
    gids: frozenset[int]

    @classmethod
    def of(cls, caller: Caller) -> Credentials:
        """The caller's uid (as FUSE reported it) and groups (filesystem gid and supplementary
        groups from ``/proc/PID/status``; none if the process is gone or changed uid)."""
        gids: set[int] = set()
        try:
            with open(f"/proc/{caller.pid}/status", "rb") as f:
                fields = {line.split(b":")[0]: line.split()[1:] for line in f}
            if int(fields[b"Uid"][3]) == caller.uid:
                gids = {int(fields[b"Gid"][3]), *map(int, fields.get(b"Groups", []))}
        except (OSError, ValueError, KeyError, IndexError):
            pass
        return cls(caller.uid, frozenset(gids))

    def may(self, st: os.stat_result, bit: int) -> bool:
        """Whether the mode grants ``bit`` (4 read, 1 search): the owner's bits for the owner,
        else the group's for a member, else the others', as ``generic_permission`` does."""
        if st.st_uid == self.uid:
            return bool(st.st_mode & (bit << 6))
        if st.st_gid in self.gids:
            return bool(st.st_mode & (bit << 3))
        return bool(st.st_mode & bit)


def readable(source: Source, who: Credentials, paths: list[bytes]) -> list[bytes]:
    """The paths that exist, once each is known readable by ``who`` through the mount: every
    directory from the root down searchable, the file itself readable. Refuses the request at
    the first one that is not. Runs on the event loop: one lstat per file and per directory."""
    searchable: dict[bytes, bool] = {}

    def search(directory: bytes) -> bool:
        if directory not in searchable:
            try:
                st = source.lstat(directory)
                searchable[directory] = stat.S_ISDIR(st.st_mode) and who.may(st, 1)
            except OSError:
                searchable[directory] = False
        return searchable[directory]

    found = []
    for path in paths:
        parts = path.split(b"/")
        if all(search(b"/".join(parts[:i])) for i in range(len(parts))):
            try:
                st = source.lstat(path)
            except OSError:
                continue  # gone: nothing to read, nothing to tell
            if who.may(st, 4):
                found.append(path)
                continue
        raise Refused(f"{os.fsdecode(path)}: permission denied (a prefetch may name only "
                      "files the caller can read through the mount)")
    return found


# -- the queue and its workers -------------------------------------------------------------


@dataclass(slots=True)
class _Fill:
    """One file filled by a worker thread; what it got to, for the event loop to end."""

    queue: FillQueue
    path: bytes
    key: Key | None = None
    entry: Entry | None = None
    #: bytes already handed on to waiting readers (``WholeFileCache.arrived``)
    reported: int = 0
    final: os.stat_result | None = None
    error: BaseException | None = None
    #: why the file was not filled, if it was skipped before reserving (``FillQueue.skipped``)
    skip: str = ""

    def run(self) -> None:
        """In a worker thread: the whole file, or up to an error (kept, not raised)."""
        try:
            reader = open_source(self.queue.source.root_fd, self.path)
        except OSError as e:
            self.error = e
            return
        try:
            st = reader.fstat()
            if not stat.S_ISREG(st.st_mode):
                self.skip = "not_regular"
                return
            self.key = (st.st_dev, st.st_ino)
            self.entry = trio.from_thread.run_sync(self.queue.reserve, self.key, self.path, st)
            if self.entry is not None:
                self._copy(reader, self.entry)
                self.final = reader.fstat()
        except BaseException as e:  # ended on the event loop: the entry must be given up
            self.error = e
        finally:
            reader.close()

    def _copy(self, reader: SourceReader, entry: Entry) -> None:
        arena_fd = self.queue.cache.arena_fd
        done = 0
        while done < entry.size:
            if done:  # a large file: readers of its start go on, an unmount stops it
                trio.from_thread.run_sync(self.queue.cache.arrived, entry, done - self.reported)
                self.reported = done
                trio.from_thread.check_cancelled()
            data = reader.read_view(done, min(FILL_CHUNK, entry.size - done))
            if not data:
                raise OSError(errno.EIO, "source file shrank while being cached")
            write_all(arena_fd, data, entry.offset + done)
            done += len(data)

    def end(self) -> None:
        """On the event loop: complete the entry, or give it up, and count the outcome."""
        queue = self.queue
        if self.skip:
            queue.skipped[self.skip] += 1
        if self.entry is not None and self.key is not None:
            if self.error is None:
                queue.cache.arrived(self.entry, self.entry.size - self.reported)
            self.error = queue.cache.end_fill(self.key, self.entry, self.final, self.error)
            if self.error is None:
                queue.files += 1
                queue.bytes += self.entry.size
                return
            if isinstance(self.error, OSError) and self.error.errno in (errno.ENOSPC,
                                                                        errno.EDQUOT):
                return  # the cache noted it is full
        if self.error is not None and isinstance(self.error, Exception):
            queue.failed(self.path, self.error)


@dataclass(slots=True)
class FillQueue:
    """Orders to fill, per requester, and the workers that fill them."""

    cache: WholeFileCache
    source: Source
    #: workers, each filling one file at a time; 0: off
    depth: int
    #: files a peer caches are left to their owner (``coordlfs.placement``)
    caches_here: Callable[[bytes], bool] = lambda _path: True
    #: paths still to fill, per requester (the pid that sent them), in their order
    queues: dict[int, deque[bytes]] = field(default_factory=dict)
    queued: int = 0
    in_flight: int = 0
    files: int = 0
    bytes: int = 0
    #: files not filled, by why: already cached or being filled, over the size limit, no
    #: room in MinIO, cached by a peer, not a regular file
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("cached", "too_large", "no_room", "elsewhere", "not_regular"), 0))
    #: files whose fill failed, by cause (an errno's name, or an exception's type)
    failures: dict[str, int] = field(default_factory=dict)
    _more: trio.Event = field(default_factory=trio.Event)

    def add(self, requester: int, paths: list[bytes]) -> int:
        """Queue ``paths`` after the requester's earlier ones; returns how many fit."""
        if self.depth == 0:
            return 0
        taken = paths[: max(0, MAX_QUEUED - self.queued)]
        if taken:
            self.queues.setdefault(requester, deque()).extend(taken)
            self.queued += len(taken)
            self._more.set()
        return len(taken)

    def reserve(self, key: Key, path: bytes, st: os.stat_result) -> Entry | None:
        """On the event loop, for a worker: the entry to fill, or None (counted) to skip."""
        cache = self.cache
        if cache.lookup(key, st) is not None:
            reason = "cached"
        elif st.st_size > cache.max_file_size:
            reason = "too_large"
        elif not self.caches_here(path):
            reason = "elsewhere"
        else:
            entry = cache.reserve(key, path, st)
            if entry is not None:
                cache.counters.files_from_source += 1
                return entry
            reason = "no_room"
        self.skipped[reason] += 1
        return None

    def failed(self, path: bytes, error: BaseException) -> None:
        if isinstance(error, OSError) and error.errno is not None:
            cause = errno.errorcode.get(error.errno, str(error.errno))
        else:
            cause = type(error).__name__
        first = cause not in self.failures
        self.failures[cause] = self.failures.get(cause, 0) + 1
        log.log(logging.WARNING if first else logging.DEBUG,
                "prefetching %s failed: %s%s", os.fsdecode(path), error,
                " (further files failing so are counted in the status, fills.failed)"
                if first else "", exc_info=first and not isinstance(error, OSError))

    async def run(self) -> None:
        """The workers, until cancelled (unmount); what is still queued is dropped."""
        limiter = trio.CapacityLimiter(max(1, self.depth))
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(self.depth):
                    nursery.start_soon(self._worker, limiter)
        finally:
            self.queues.clear()
            self.queued = 0

    async def _worker(self, limiter: trio.CapacityLimiter) -> None:
        while True:
            path = self._next()
            if path is None:
                await self._more.wait()
                continue
            fill = _Fill(self, path)
            self.in_flight += 1
            try:
                await trio.to_thread.run_sync(fill.run, limiter=limiter)
            finally:
                self.in_flight -= 1
                fill.end()

    def _next(self) -> bytes | None:
        """The next path, from each requester in turn."""
        for requester in self.queues:
            paths = self.queues.pop(requester)
            path = paths.popleft()
            if paths:
                self.queues[requester] = paths  # to the back of the turn
            self.queued -= 1
            return path
        self._more = trio.Event()
        return None

    def status(self) -> dict[str, Any]:
        return {"depth": self.depth, "queued": self.queued, "in_flight": self.in_flight,
                "files": self.files, "bytes": self.bytes, "skipped": dict(self.skipped),
                "failed": dict(self.failures)}


def register_commands(server: ControlServer, fills: FillQueue, source: Source) -> None:
    """``prefetch``: anyone, for the files they may read through the mount."""

    def prefetch(args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        paths = [os.fsencode(p) for p in args["paths"]]
        if not caller.privileged:
            paths = readable(source, Credentials.of(caller), paths)
        return {"queued": fills.add(caller.pid, paths)}

    server.serve("prefetch", prefetch)
