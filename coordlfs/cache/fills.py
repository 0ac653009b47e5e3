"""Batched, order-aware fills: files a job announced (``prefetch``) read into the cache in bulk.

A job that knows its order (``coordlfs.client.Dataset.prefetch``, a sampler) hands it over on
the control file; the files are then read into the cache ahead of the job, with no FUSE
request per file. Each requester (the process that sent the order) has a queue, in its order;
``depth`` workers take files from the queues in turn, so one long order does not starve
another. A later ``prefetch`` appends to the requester's queue: an order is sent in pieces
(a request names at most ``control_spec.MAX_PREFETCH_PATHS``), and the next epoch's order
comes after the rest of this one, which the job reads first.

A worker fills a whole file in one worker-thread call (``_Fill.run``): open beneath the
source's root (never through a symlink), fstat, reserve the entry on the event loop (one
call back), read with O_DIRECT in pieces of up to ``files.FILL_CHUNK`` into the thread's
aligned buffer, pwrite into the entry's file, fstat again. A small file (the common case)
thus costs one hand-off to a thread and one back, where a read through the mount costs several FUSE
requests; memory for fills in flight is at most ``depth`` buffers of ``FILL_CHUNK``. The entry
is reserved and ended through ``WholeFileCache`` like any fill, so a reader through the mount
of a file being filled waits on the same entry, and an entry the mount is already filling (or
holds) is skipped, as is a file over ``--max-file-size``, one the cache has no room for, and one a
peer caches. Failures are counted and logged once per cause; they never fail the mount.

Who may prefetch: the mount runs with ``default_permissions``, so the kernel checks a reader's
uid and groups against each file's mode and every directory's search bit on the way. Root and
the mount's owner may name any file (the daemon, running as the owner, reads only what the
owner could). Another user (an ``--allow-other`` mount) gets the same check here, against the
uid FUSE reports and the groups in ``/proc/PID/status``; a request naming a file that user may
not read is refused whole (EACCES).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import trio

from coordlfs.cache.cache import Entry, WholeFileCache
from coordlfs.cache.files import Copier, FromStorage
from coordlfs.protocol.spec import WARM_COUNTS, Caller, Refused, RequestError, Served
from coordlfs.sizes import pages
from coordlfs.source.beneath import mode_grants, open_beneath
from coordlfs.source.source import Source, SourceReader

log = logging.getLogger(__name__)

#: Files all requesters together may have queued; past it a request takes what fits and
#: says how many (``"queued"``), so the daemon's memory for orders stays bounded (~40 MB).
MAX_QUEUED = 1 << 19

#: Warms whose progress is kept (``FillQueue.tallies``) at most: a finished one is forgotten
#: to make room for a new one; while all of them run, another warm is refused.
MAX_TALLIES = 64

#: Who asked for files: a local process (its pid), or a peer's warm (``coordlfs.peers.warm``).
Requester = Hashable

#: Most files a worker takes at once (``FillQueue._take``): the event loop's hand-offs to and
#: from the worker thread are shared by them, while a reader waiting for the last of them
#: waits for at most this many reads in a row.
BATCH = 8


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
        """Whether the mode grants ``bit`` (4 read, 1 search) to these credentials."""
        return mode_grants(st, self.uid, self.gids, bit)


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


@dataclass(slots=True, eq=False)
class _Fill:
    """One file of a batch: what the worker thread got to, for the event loop to end."""

    path: bytes
    requester: Requester = None
    reader: SourceReader | None = None
    st: os.stat_result | None = None
    entry: Entry | None = None
    #: bytes already handed on to waiting readers (``WholeFileCache.arrived``)
    reported: int = 0
    final: os.stat_result | None = None
    error: BaseException | None = None
    #: why the file was not filled, when skipped before reserving (``FillQueue.skipped``)
    skip: str = ""
    #: what the file was copied from, once copied (its ``paged`` bytes are counted at the end)
    origin: FromStorage | None = None
    ended: bool = False

    def open(self, root_fd: int) -> None:
        """In the worker thread: open and fstat, keeping any error."""
        try:
            self.reader = SourceReader.opening(open_beneath, root_fd, self.path)
            self.st = self.reader.fstat()
            if not stat.S_ISREG(self.st.st_mode):
                self.skip = "not_regular"
        except OSError as e:
            self.error = e

    def copy(self, cache: WholeFileCache, entry: Entry) -> None:
        """In the worker thread: the file into its entry (``files.Copier``, handed the open
        reader); a large file lets the readers of its start go on, and stops at an unmount."""
        assert self.reader is not None
        self.origin = FromStorage(None, self.path, self.reader)
        copier = Copier(cache.files_fd, entry, self.origin)
        self.reader = None  # the copier's to close

        def between(done: int) -> None:
            trio.from_thread.run_sync(cache.arrived, entry, done - self.reported)
            self.reported = done
            trio.from_thread.check_cancelled()

        try:
            copier.copy(between)
        finally:
            copier.close()
        self.final = copier.final

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


@dataclass(slots=True, eq=False)
class _Batch:
    """Files one worker fills in one worker-thread call: the loop is asked once to reserve
    them all, and told of each file as it completes, so a small file costs the event loop a
    share of one hand-off plus its own completion."""

    queue: FillQueue
    fills: list[_Fill]
    token: trio.lowlevel.TrioToken

    def run(self) -> None:
        """In a worker thread. Errors are kept in the fills, never raised."""
        queue = self.queue
        try:
            for fill in self.fills:
                fill.open(queue.source.root_fd)
            trio.from_thread.run_sync(queue.reserve_all, self.fills)
            for fill in self.fills:
                if fill.entry is not None:
                    trio.from_thread.check_cancelled()
                    try:
                        fill.copy(queue.cache, fill.entry)
                    except Exception as e:
                        fill.error = e
                    fill.close()
                    self.token.run_sync_soon(queue.end, fill)
        except BaseException as e:  # cancelled at unmount: what is not copied is given up
            for fill in self.fills:
                if fill.final is None:
                    fill.error = fill.error or e
        finally:
            for fill in self.fills:
                fill.close()


@dataclass(slots=True)
class FillQueue:
    """Orders to fill, per requester, and the workers that fill them."""

    cache: WholeFileCache
    source: Source
    #: workers, each filling one file at a time; 0: off
    depth: int
    #: files a peer caches are left to their owner (``coordlfs.peers.placement``)
    caches_here: Callable[[bytes], bool] = lambda _path: True
    #: paths still to fill, per requester, in their order
    queues: dict[Requester, deque[bytes]] = field(default_factory=dict)
    queued: int = 0
    #: files taken from the queues and not yet ended
    in_flight: int = 0
    files: int = 0
    bytes: int = 0
    #: files not filled, by why: already cached or being filled, over the size limit, no
    #: room in the cache, cached by a peer, not a regular file
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("cached", "too_large", "no_room", "elsewhere", "not_regular"), 0))
    #: files whose fill failed, by cause (an errno's name, or an exception's type)
    failures: dict[str, int] = field(default_factory=dict)
    #: per warm (a requester that said ``warm``), what its files came to (``WARM_COUNTS``),
    #: oldest first
    tallies: OrderedDict[Requester, dict[str, int]] = field(default_factory=OrderedDict)
    #: told when a warm has no file left (``warm.status`` waits for it)
    drained: Callable[[], None] = lambda: None
    #: told of each file handed over with room promised to it (True), and of each file
    #: whose fill ended or was dropped (False): the request lane's notes (``LaneNodes.handed``)
    handed: Callable[[bytes, bool], None] = lambda _path, _on: None
    _more: trio.Event = field(default_factory=trio.Event)

    def add(self, requester: Requester, paths: list[bytes], size: int = 0) -> int:
        """Queue ``paths`` after the requester's earlier ones; returns how many were taken (a
        prefix: the queue is bounded). ``size`` is what they come to, where the requester
        said (``Dataset.prefetch``): promised to them in the room clients see
        (``room.Room.promise``), so that a client's miss on a file not handed over is
        read from the source rather than taking their room."""
        taken, elsewhere = self._queue(requester, paths, None)
        if size and taken == len(paths):
            self.cache.room.promise(size)
            # marked until their fills end (``end``); a peer's are not filled here
            peers = set(elsewhere)
            here = [p for n, p in enumerate(paths) if n not in peers]
            self.cache.publisher.hand_over(here)
            for path in here:
                self.handed(path, True)
        return taken

    def warm(self, requester: Requester, paths: list[bytes]) -> tuple[int, list[int]]:
        """``add`` for a warm, whose progress is kept (``tally``); also returns the places in
        ``paths`` of the files a peer caches."""
        return self._queue(requester, paths, self._tally(requester))

    def _queue(self, requester: Requester, paths: list[bytes], tally: dict[str, int] | None
               ) -> tuple[int, list[int]]:
        """Queue what this node caches of ``paths``, in order, while the bound lets; those a
        peer caches are left to their owner, not opened here. Returns how many were taken
        and the places of those a peer caches."""
        if self.depth == 0:
            return 0, []
        queue = self.queues.get(requester, deque())
        taken, elsewhere = 0, []
        for place, path in enumerate(paths):
            if not self.caches_here(path):
                elsewhere.append(place)
            elif self.queued < MAX_QUEUED:
                queue.append(path)
                self.queued += 1
            else:
                break
            taken += 1
        self.skipped["elsewhere"] += len(elsewhere)
        if tally is not None:
            tally["elsewhere"] += len(elsewhere)
            tally["left"] += taken - len(elsewhere)
        if queue:
            self.queues[requester] = queue
            self._more.set()
        return taken, elsewhere

    def _tally(self, requester: Requester) -> dict[str, int]:
        """The warm's counts, made on its first request: a finished warm's are forgotten to
        make room (``MAX_TALLIES``); while every kept one runs, the request is refused."""
        tally = self.tallies.get(requester)
        if tally is None:
            if len(self.tallies) >= MAX_TALLIES:
                done = next((r for r, t in self.tallies.items() if not t["left"]), None)
                if done is None:
                    raise RequestError(f"{MAX_TALLIES} warms run at once: try again once "
                                       "one has ended")
                del self.tallies[done]
            tally = self.tallies[requester] = dict.fromkeys(WARM_COUNTS, 0)
        return tally

    def tally(self, requester: Requester) -> dict[str, int] | None:
        """What the requester's warm came to so far; None if it sent none (or long ago)."""
        tally = self.tallies.get(requester)
        return None if tally is None else dict(tally)

    def cancel(self, requester: Requester) -> int:
        """Drop what the requester still has queued (files in flight complete); returns how
        many files were dropped."""
        queue = self.queues.pop(requester, None)
        for path in queue or ():
            self._taken_back(path)
        dropped = len(queue) if queue is not None else 0
        self.queued -= dropped
        if (tally := self.tallies.get(requester)) is not None:
            tally["left"] -= dropped
        return dropped

    def _taken_back(self, path: bytes, published: bool = False) -> None:
        """A file handed over is no longer to be filled: its mark in the index goes (a
        filled one's went when publishing took it), and the lane no longer keeps a reader's
        copy of it regardless of the room."""
        if not published:
            self.cache.publisher.take_back(path)
        self.handed(path, False)

    def reserve_all(self, fills: list[_Fill]) -> None:
        """On the event loop, for a worker: reserve the entries to fill; the rest are
        skipped (and counted when ended)."""
        for fill in fills:
            if fill.st is not None:
                self._reserve(fill)
                # reserved now, or never: given back after the reservation, so that the room
                # clients read never shows the file's bytes free in between (a reader of the
                # order's head would send a file through the mount that is not to be cached)
                self.cache.room.promise(-pages(fill.st.st_size))

    def _reserve(self, fill: _Fill) -> None:
        cache, st = self.cache, fill.st
        assert st is not None
        if fill.skip:
            return
        key = (st.st_dev, st.st_ino)
        if cache.lookup(key, st) is not None or cache.read_elsewhere(key):
            fill.skip = "cached"  # or being read, to be cached after
        elif st.st_size > cache.max_file_size:
            fill.skip = "too_large"
        elif not self.caches_here(fill.path):
            fill.skip = "elsewhere"
        else:
            fill.entry = cache.reserve(key, fill.path, st)
            if fill.entry is None:
                fill.skip = "no_room"

    def end(self, fill: _Fill) -> None:
        """On the event loop, once per file: complete its entry or give it up, and count."""
        if fill.ended:
            return
        fill.ended = True
        self.in_flight -= 1
        try:
            outcome = self._end(fill)
            self._taken_back(fill.path, published=outcome == "files")
            if (tally := self.tallies.get(fill.requester)) is not None:
                tally["left"] -= 1
                if not tally["left"]:
                    self.drained()
                if outcome is not None:
                    tally[outcome] += 1
                    size = fill.st.st_size if fill.st is not None else 0
                    if f"{outcome}_bytes" in tally:
                        tally[f"{outcome}_bytes"] += size
                    elif outcome == "files":
                        tally["bytes"] += size
        except Exception:  # run from run_sync_soon too, where an error would end trio
            log.exception("ending the fill of %s failed", os.fsdecode(fill.path))

    def _end(self, fill: _Fill) -> str | None:
        """What came of the file (a ``WARM_COUNTS`` name), None if cancelled (unmount)."""
        if fill.skip:
            self.skipped[fill.skip] += 1
            return fill.skip
        entry, error = fill.entry, fill.error
        if entry is not None:
            assert fill.st is not None
            if error is None:
                self.cache.arrived(entry, entry.size - fill.reported)
                assert fill.origin is not None
                self.cache.counters.fill_bytes_from_pages += fill.origin.paged
            error = self.cache.end_fill((fill.st.st_dev, fill.st.st_ino), entry, fill.final,
                                        error)
            if error is None:
                self.files += 1
                self.bytes += entry.size
                return "files"
            if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
                return "no_room"  # the cache said it is full
        if not isinstance(error, Exception):
            return None
        self._failed(fill.path, error)
        return "failed"

    def _failed(self, path: bytes, error: Exception) -> None:
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
        token = trio.lowlevel.current_trio_token()
        while True:
            requester, paths = self._take()
            if not paths:
                if not self.in_flight:
                    self.cache.room.promise(-self.cache.room.promised)  # what no file ever took
                if self._more.is_set():  # a new one for every idle worker to wait on
                    self._more = trio.Event()
                await self._more.wait()
                continue
            batch = _Batch(self, [_Fill(path, requester) for path in paths], token)
            self.in_flight += len(paths)
            try:
                await trio.to_thread.run_sync(batch.run, limiter=limiter)
            finally:
                for fill in batch.fills:  # those not ended yet (skipped, failed, cancelled)
                    self.end(fill)

    def _take(self) -> tuple[Requester, list[bytes]]:
        """The next paths for a worker, and whose they are, from each requester in turn: a
        share of what is queued, up to ``BATCH``, so that every worker has some while the
        queue lasts."""
        for requester in self.queues:
            paths = self.queues.pop(requester)
            count = min(BATCH, len(paths), -(-self.queued // self.depth))
            taken = [paths.popleft() for _ in range(count)]
            if paths:
                self.queues[requester] = paths  # to the back of the turn
            self.queued -= count
            return requester, taken
        return None, []

    def status(self) -> dict[str, Any]:
        return {"depth": self.depth, "queued": self.queued, "in_flight": self.in_flight,
                "files": self.files, "bytes": self.bytes, "skipped": dict(self.skipped),
                "failed": dict(self.failures)}


def register_commands(server: Served, fills: FillQueue, source: Source,
                      from_peers: Callable[[list[bytes]], object] = lambda _paths: None
                      ) -> None:
    """``prefetch``: anyone, for the files they may read through the mount; the files peers
    cache are handed to ``from_peers`` (``Peers.prefetch``), but for a warm, which leaves
    them to their owners (``coordlfs.peers.warm``)."""

    def prefetch(args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        paths = [os.fsencode(p) for p in args["paths"]]
        if args["warm"]:  # every path keeps its place (the reply's are in it): one gone fails
            if not caller.privileged:
                readable(source, Credentials.of(caller), paths)
            queued, elsewhere = fills.warm(caller.pid, paths)
            return {"queued": queued, "elsewhere": elsewhere}
        if not caller.privileged:
            paths = readable(source, Credentials.of(caller), paths)
        from_peers(paths)
        return {"queued": fills.add(caller.pid, paths, args["bytes"])}

    server.serve("prefetch", prefetch)
