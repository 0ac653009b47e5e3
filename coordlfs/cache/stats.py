"""Read counters and named marks (epoch boundaries) to read statistics between."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

from coordlfs.protocol.spec import Caller, RequestError, Served


@dataclass(slots=True)
class ReadCounters:
    #: read requests answered from a complete cache entry
    cache_hits: int = 0
    #: read requests that had to wait for the source (filling or streaming)
    misses: int = 0
    bytes_from_cache: int = 0
    bytes_from_source: int = 0
    #: files opened through the mount whose entry was complete in the cache (one per open)
    files_from_cache: int = 0
    #: opens answered with a backing file (FUSE passthrough): their reads never reach the
    #: daemon, so they count as no hits (``cache_hits`` + ``misses``: the daemon's reads);
    #: the file's size is added to ``bytes_from_cache``, as if read whole
    passthrough_opens: int = 0
    #: opens answered with the source file itself as backing (a file neither MinIO nor a
    #: peer keeps): the kernel reads storage itself; counted as the file read whole from the
    #: source (``files_from_source``, ``bytes_from_source``)
    source_opens: int = 0
    #: files whose bytes were fetched from the source (one per fill, one per streaming open)
    files_from_source: int = 0
    #: bytes and files (per open) that a peer mount served from its cache
    bytes_from_peers: int = 0
    files_from_peers: int = 0
    #: reads of ``coordlfs.client`` processes (``client.report``): from shared memory,
    #: and through the mount (which counts those again above, as any reader's)
    client_hits: int = 0
    client_misses: int = 0
    client_bytes_from_cache: int = 0
    client_bytes_from_mount: int = 0
    #: ... and straight from the source (misses the cache had no room for), which the
    #: mount never saw: added to ``files_from_source`` and ``bytes_from_source`` too
    client_direct: int = 0
    client_bytes_direct: int = 0
    #: opens the preload library of ``coordlfs run`` answered itself (``cache.preloaded``):
    #: hits from the cache's files, misses the cache fills behind, files it does not keep,
    #: and opens it passed to the mount (counted above too, as any reader's); its hits are
    #: added to ``files_from_cache`` and ``bytes_from_cache``, the rest to ``*_from_source``
    preload_hits: int = 0
    preload_misses: int = 0
    preload_uncached: int = 0
    preload_passed: int = 0
    preload_bytes_from_cache: int = 0
    preload_bytes_from_source: int = 0

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
        reads.files_from_source += args["direct"]
        reads.bytes_from_source += args["bytes_direct"]
        return {}

    server.serve("stats", stats_cmd)
    server.serve("client.report", client_report)
    server.serve("mark", mark_cmd)
    server.serve("marks", lambda _a, _c: {"marks": [asdict(m) for m in stats.marks]})
