"""Read counters and named marks (epoch boundaries) to read statistics between."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

from coordlfs.protocol.spec import Caller, RequestError, Served


class Outcome(enum.Enum):
    """What served a file opened: the counter its open adds one to."""

    #: the cache (or an aligned group's read window: the mount's memory, not storage)
    HIT = "file_hits"
    #: the source: a file not cached (yet), read by the daemon, the kernel or the job itself
    MISS = "file_misses"
    #: a peer mount's cache
    PEER_HIT = "file_peer_hits"


@dataclass(slots=True)
class ReadCounters:
    """The mount's counters. Files are counted per open, by what served them, whoever
    served them (``opened``, their one owner); bytes where they were read; read requests as
    the daemon answered them (the kernel reads passthrough opens without asking)."""

    #: files opened, by what served them (``opened``): the daemon's opens (passthrough or
    #: not), ``coordlfs.client`` hits and direct reads, the preload library's own opens.
    #: An epoch's hits, misses and peer hits add up to the files it opened
    file_hits: int = 0
    file_misses: int = 0
    file_peer_hits: int = 0
    #: the source's sizes of the files opened, one per open: an epoch that opens each file
    #: once opened its dataset's size (what-if's dataset), whatever it read of them
    opened_bytes: int = 0
    #: read requests the daemon answered from a complete cache entry
    read_hits: int = 0
    #: read requests the daemon answered from anything else (a fill, the source, a peer)
    read_misses: int = 0
    #: bytes the mount and the preload library served from the cache (a passthrough open of
    #: an entry: its size, as if read whole; a client's: ``client_bytes_from_cache``), and
    #: bytes read from storage (fills, streams, a passthrough open of a source file)
    bytes_from_cache: int = 0
    bytes_from_source: int = 0
    #: of the bytes fills read from the source, those the page cache held already (another
    #: process had read the file): copied from its pages, storage not read again
    fill_bytes_from_pages: int = 0
    #: opens answered with a backing file (FUSE passthrough): an entry's file (the kernel
    #: reads the cache), or the source file itself (the kernel reads storage)
    passthrough_opens: int = 0
    source_opens: int = 0
    #: bytes a peer mount served from its cache
    bytes_from_peers: int = 0
    #: reads of ``coordlfs.client`` processes (``client.report``): from shared memory,
    #: and through the mount (which counts those again above, as any reader's)
    client_hits: int = 0
    client_misses: int = 0
    client_bytes_from_cache: int = 0
    client_bytes_from_mount: int = 0
    #: ... and straight from the source (misses the cache had no room for), which the
    #: mount never saw: misses, and added to ``bytes_from_source`` too
    client_direct: int = 0
    client_bytes_direct: int = 0
    #: opens the preload library of ``coordlfs run`` answered itself (``cache.preloaded``):
    #: hits from the cache's files, misses the cache backfills, files it does not keep,
    #: and opens it passed to the mount (counted above too, as any reader's); its bytes are
    #: added to ``bytes_from_cache`` and ``bytes_from_source``
    preload_hits: int = 0
    preload_misses: int = 0
    preload_uncached: int = 0
    preload_passed: int = 0
    preload_bytes_from_cache: int = 0
    preload_bytes_from_source: int = 0

    def opened(self, outcome: Outcome, files: int, size: int) -> None:
        """Count ``files`` opened, of ``size`` bytes together, served as ``outcome`` says.
        The one place files are counted: every path that serves an open calls it once per
        open, so that no file is counted twice (a backfill, a client's miss
        through the mount) or never (a passthrough open the daemon never reads)."""
        setattr(self, outcome.value, getattr(self, outcome.value) + files)
        self.opened_bytes += size

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


def difference(later: dict[str, int], earlier: dict[str, int]) -> dict[str, int]:
    return {f.name: later[f.name] - earlier[f.name] for f in fields(ReadCounters)}


@dataclass(slots=True)
class Mark:
    name: str
    time: float
    reads: dict[str, int]


class Stats:
    def __init__(self) -> None:
        self.reads = ReadCounters()
        self.started = time.time()
        self.marks: list[Mark] = []
        #: brings ``reads`` up to date with counts kept elsewhere (the preload library's
        #: page), before a mark or a window is taken
        self.folds: list[Callable[[ReadCounters], None]] = []

    def current(self) -> dict[str, int]:
        for fold in self.folds:
            fold(self.reads)
        return self.reads.snapshot()

    def mark(self, name: str) -> Mark:
        mark = Mark(name, time.time(), self.current())
        self.marks.append(mark)
        return mark

    def find(self, name: str) -> Mark:
        """The latest mark called ``name``; KeyError if there is none."""
        for mark in reversed(self.marks):
            if mark.name == name:
                return mark
        raise KeyError(name)

    def between(self, since: str | None, until: str | None) -> dict:
        """Counters between two marks (None: mount time / now); KeyError for a mark that
        does not exist, ValueError for a window that ends before it starts."""
        start = self.find(since) if since is not None else Mark("mount", self.started,
                                                                 ReadCounters().snapshot())
        end = self.find(until) if until is not None else Mark("now", time.time(),
                                                              self.current())
        if end.time < start.time:
            raise ValueError(f"mark {end.name!r} comes before {start.name!r}: a window "
                             "runs from its since to its until")
        return {
            "since": start.name,
            "until": end.name,
            "seconds": end.time - start.time,
            "reads": difference(end.reads, start.reads),
        }


def register_commands(server: Served, stats: Stats) -> None:
    """``stats`` (optionally between marks), ``mark``, ``marks`` and ``client.report`` on
    the control file. Anyone may read the counters and report a client's reads; a mark is
    mount-wide (root or the mount's owner)."""

    def stats_cmd(args: dict, _caller: Caller) -> dict:
        try:
            return {"stats": stats.between(args["since"], args["until"])}
        except KeyError as e:
            raise RequestError(f"no mark named {e.args[0]!r}") from None
        except ValueError as e:
            raise RequestError(str(e)) from None

    def mark_cmd(args: dict, _caller: Caller) -> dict:
        mark = stats.mark(args["name"])
        return {"mark": asdict(mark)}

    def client_report(args: dict, _caller: Caller) -> dict:
        reads = stats.reads
        for name, value in args.items():
            field = "client_" + name
            setattr(reads, field, getattr(reads, field) + value)
        # its misses opened through the mount, which counted them; a read is of a whole file
        reads.opened(Outcome.HIT, args["hits"], args["bytes_from_cache"])
        reads.opened(Outcome.MISS, args["direct"], args["bytes_direct"])
        reads.bytes_from_source += args["bytes_direct"]
        return {}

    server.serve("stats", stats_cmd)
    server.serve("client.report", client_report)
    server.serve("mark", mark_cmd)
    server.serve("marks", lambda _a, _c: {"marks": [asdict(m) for m in stats.marks]})
