"""Batched, order-aware fills: files a job announced (``prefetch``) read into MinIO in bulk.

A job that knows its order (``coordlfs.client.Dataset.prefetch``, a sampler) hands it over on
the control file; the files are then read into the cache ahead of the job, with no FUSE
request per file. Each requester (the process that sent the order) has a queue, in its order;
``depth`` workers take files from the queues in turn, so one long order does not starve
another. A later ``prefetch`` appends to the requester's queue: an order is sent in pieces
(a request names at most ``control_spec.MAX_PREFETCH_PATHS``), and the next epoch's order
comes after the rest of this one, which the job reads first.

A worker's files are copied by the filler, the daemon's own process for fills
(``coordlfs.cache.filler``: off the daemon's GIL, which the event loop serving FUSE requests
needs): all of a worker's files are asked to be opened beneath the source's root (never
through a symlink, O_DIRECT) at once; then each, in turn, is reserved here from the fstat the
filler answers and copied there in pieces of up to ``FILL_CHUNK`` (a large file's readers go
on as each arrives), or dropped. ``depth`` workers keep as many files in flight, and the
filler has as many threads. The entry is reserved and ended through ``WholeFileCache`` like
any fill, so a reader through the mount of a file being filled waits on the same entry, and
an entry the mount is already filling (or holds) is skipped, as is a file over
``--max-file-size``, one MinIO has no room for, and one a peer caches. Failures are counted
and logged once per cause; they never fail the mount.

Who may prefetch: the mount runs with ``default_permissions``, so the kernel checks a reader's
uid and groups against each file's mode and every directory's search bit on the way. Root and
the mount's owner may name any file (the daemon, running as the owner, reads only what the
owner could). Another user (an ``--allow-other`` mount) gets the same check here, against the
uid FUSE reports and the groups in ``/proc/PID/status``; a request naming a file that user may
not read is refused whole (EACCES).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import trio

from coordlfs.cache.cache import Entry, WholeFileCache
from coordlfs.cache.fill_process import Stat
from coordlfs.cache.filler import Pending
from coordlfs.protocol.spec import WARM_COUNTS, Caller, Refused, RequestError, Served
from coordlfs.sizes import pages
from coordlfs.source.beneath import mode_grants
from coordlfs.source.source import Source

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
    """One file a worker fills: what the filler said of it, for the event loop to end."""

    path: bytes
    requester: Requester = None
    st: Stat | None = None
    entry: Entry | None = None
    #: bytes already handed on to waiting readers (``WholeFileCache.arrived``)
    reported: int = 0
    final: Stat | None = None
    error: BaseException | None = None
    #: why the file was not filled, when skipped before reserving (``FillQueue.skipped``)
    skip: str = ""
    ended: bool = False

    def progress(self, cache: WholeFileCache, done: int) -> None:
        """The filler copied ``done`` bytes of a large file: its readers may go on."""
        if self.entry is not None and done > self.reported:
            cache.arrived(self.entry, done - self.reported)
            self.reported = done


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
    #: room in MinIO, cached by a peer, not a regular file
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("cached", "too_large", "no_room", "elsewhere", "not_regular"), 0))
    #: files whose fill failed, by cause (an errno's name, or an exception's type)
    failures: dict[str, int] = field(default_factory=dict)
    #: per warm (a requester that said ``warm``), what its files came to (``WARM_COUNTS``),
    #: oldest first
    tallies: OrderedDict[Requester, dict[str, int]] = field(default_factory=OrderedDict)
    #: told when a warm has no file left (``warm.status`` waits for it)
    drained: Callable[[], None] = lambda: None
    _more: trio.Event = field(default_factory=trio.Event)

    def add(self, requester: Requester, paths: list[bytes], size: int = 0) -> int:
        """Queue ``paths`` after the requester's earlier ones; returns how many were taken (a
        prefix: the queue is bounded). ``size`` is what they come to, where the requester
        said (``Dataset.prefetch``): promised to them in the room clients see
        (``WholeFileCache.promise``), so that a client's miss on a file not handed over is
        read from the source rather than taking their room."""
        taken, _elsewhere = self._queue(requester, paths, None)
        if size and taken == len(paths):
            self.cache.promise(size)
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
        dropped = len(queue) if queue is not None else 0
        self.queued -= dropped
        if (tally := self.tallies.get(requester)) is not None:
            tally["left"] -= dropped
        return dropped

    def reserve(self, fill: _Fill) -> None:
        """For a worker, once the filler has opened the file: reserve its entry, or say why
        it is skipped (counted when ended)."""
        cache, st = self.cache, fill.st
        assert st is not None
        cache.promise(-pages(st.st_size))  # reserved now, or never
        key = (st.st_dev, st.st_ino)
        if not stat.S_ISREG(st.st_mode):
            fill.skip = "not_regular"
        elif cache.lookup(key, st) is not None:  # type: ignore[arg-type]
            fill.skip = "cached"
        elif st.st_size > cache.max_file_size:
            fill.skip = "too_large"
        elif not self.caches_here(fill.path):
            fill.skip = "elsewhere"
        else:
            fill.entry = cache.reserve(key, fill.path, st)  # type: ignore[arg-type]
            if fill.entry is None:
                fill.skip = "no_room"
            else:
                cache.counters.files_from_source += 1

    def end(self, fill: _Fill) -> None:
        """On the event loop, once per file: complete its entry or give it up, and count."""
        if fill.ended:
            return
        fill.ended = True
        self.in_flight -= 1
        try:
            outcome = self._end(fill)
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
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(self.depth):
                    nursery.start_soon(self._worker)
        finally:
            self.queues.clear()
            self.queued = 0

    async def _worker(self) -> None:
        while True:
            requester, paths = self._take()
            if not paths:
                if not self.in_flight:
                    self.cache.promise(-self.cache.promised)  # what no file ever took
                if self._more.is_set():  # a new one for every idle worker to wait on
                    self._more = trio.Event()
                await self._more.wait()
                continue
            fills = [_Fill(path, requester) for path in paths]
            self.in_flight += len(fills)
            try:
                await self._fill(fills)
            except BaseException as e:  # cancelled at unmount: what is not copied is given up
                for fill in fills:
                    if fill.final is None and fill.error is None:
                        fill.error = e
                raise
            finally:
                for fill in fills:  # those not ended yet
                    self.end(fill)

    async def _fill(self, fills: list[_Fill]) -> None:
        """A worker's files, by the filler (``coordlfs.cache.filler``): all opened at once,
        then, in turn, each reserved here and copied there, or dropped."""
        filler = self.cache.filler
        assert filler is not None, "the queue's fills need the filler"
        opened: list[tuple[int, Pending] | None] = []
        for fill in fills:
            try:
                opened.append(filler.open(fill.path))
            except OSError as e:
                fill.error = e
                opened.append(None)
        for fill, request in zip(fills, opened, strict=True):
            if request is None:
                continue
            ident, pending = request
            try:
                fill.st = await pending.wait()
            except OSError as e:
                fill.error = e
                continue
            self.reserve(fill)
            if fill.entry is None:
                filler.drop(ident)
                self.end(fill)
                continue
            try:
                copied = filler.copy(ident, fill.entry.offset,
                                     functools.partial(fill.progress, self.cache))
                fill.final = await copied.wait()
            except OSError as e:
                fill.error = e
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
        filler = self.cache.filler
        return {"depth": self.depth, "queued": self.queued, "in_flight": self.in_flight,
                "files": self.files, "bytes": self.bytes, "skipped": dict(self.skipped),
                "failed": dict(self.failures),
                "process": filler.status() if filler is not None else None}


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
