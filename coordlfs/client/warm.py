"""``coordlfs warm``: a mount's cache filled with files ahead of a job, in the job's order.

The paths are walked first (``walk``: a count while walking), so that the progress shown
after has a total that does not grow: the files it will read, not those it never will (over
the mount's ``--max-file-size``: not even sent) nor those left to peers. ``check`` (``warm
--check``) only asks the mount which of the files it holds (``cached``) and fills nothing.

The files (``warm_files``) go to the mount as a warm: ``prefetch`` with ``warm``, whose fill
workers read them into the cache in this order, skipping those cached already (a second run
resumes: it reads nothing it has), those a peer caches (left to their node, which warms its
own share: ``--all-nodes`` asks the peers through the mount, ``warm.peers``), and those the
cache has no room for. At most ``AHEAD`` files are queued at the mount at a time, topped up
as it drains, so that the daemon's memory for the list stays small and other jobs' orders
still find room in its queue; each request carries at most ``CHUNK_FILES`` paths. Progress is
the mount's own count of the warm's files (``warm.status``), asked every ``POLL_S`` (the
mount answers at once when the warm drains). Once the cache has no room and the mount has no
peers, files larger than the room left are not sent: they are counted as not fitting.

Ctrl-C (or SIGTERM) drops the warm's files still queued at the mount and on the peers
(``warm.cancel``); the files read so far stay cached, and the message gives the numbers the
progress last showed. A warm that cached none of its files (nor found them cached) says why
(``nothing_cached``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from coordlfs.client.warm_files import Files, Listing
from coordlfs.client.warm_progress import Display, Progress
from coordlfs.errors import UserError
from coordlfs.protocol import spec
from coordlfs.protocol.client import BACKOFF_S, Control, ControlError
from coordlfs.sizes import format_size, pages, plural

#: Files queued at the mount at a time, at most.
AHEAD = 1 << 14
#: Paths per request at most, and bytes of paths: a request line stays far below the control
#: file's 1 MiB bound whatever the names' length.
CHUNK_FILES = 4096
CHUNK_BYTES = 256 << 10
#: Seconds between two questions to the mount about the warm's progress.
POLL_S = 0.2

ZERO = dict.fromkeys(spec.WARM_COUNTS, 0)


class Interrupted(Exception):
    """Ctrl-C stopped the warm: the message says how far it came and what was dropped."""


def walk(listing: Listing, display: Display) -> Files:
    """Every file the listing names, once found, with a count shown while walking."""
    files = listing.files
    try:
        while listing.running(POLL_S):
            display.found(len(files.names), files.total_bytes)
    except KeyboardInterrupt:
        display.close()
        raise Interrupted(f"interrupted while walking: {plural(len(files.names), 'file')} "
                          "found, none warmed") from None
    display.found(len(files.names), files.total_bytes)
    return listing.wait()


def check(control: Control, files: Files) -> dict[str, Any]:
    """How much of ``files`` the mount's cache holds now (``cached``): fills nothing."""
    held = []
    for start, end in _chunks(files.names, 0):
        try:
            places = control.call(spec.CACHED, paths=files.names[start:end])["cached"]
        except ControlError as e:
            raise UserError(f"{files.mount} cannot tell what it caches ({e}): remount it "
                            "with this version") from None
        held += (start + place for place in places)
    cached_bytes = sum(files.sizes[i] for i in held)
    total = files.total_bytes
    return {"mount": files.mount, "files": len(files.names), "bytes": total,
            "cached_files": len(held), "cached_bytes": cached_bytes,
            "percent": round(100 * cached_bytes / total, 1) if total else None}


def _chunks(names: list[str], start: int) -> Iterator[tuple[int, int]]:
    """``names`` from ``start`` on, as (start, end) of requests of at most ``CHUNK_FILES``
    paths and about ``CHUNK_BYTES`` of them."""
    while start < len(names):
        end, size = start, 0
        while end < len(names) and end - start < CHUNK_FILES and size < CHUNK_BYTES:
            size += len(names[end]) + 4
            end += 1
        yield start, end
        start = end


def nothing_cached(summary: dict[str, Any]) -> str | None:
    """Why none of a warm's files is cached, here or on a peer (nor was before), or None
    when some are: the warm then did nothing a job could use."""
    nodes = [summary, *(n for n in summary["nodes"].values() if "error" not in n)]
    if summary["elsewhere"] or any(n["files"] or n["already_cached"]["files"] for n in nodes):
        return None
    if not summary["listed_files"]:
        return "no files under the paths given"
    reasons = []
    if summary["too_large"]:
        reasons.append(f"{plural(summary['too_large'], 'file')} over the mount's "
                       f"--max-file-size ({format_size(summary['max_file_bytes'])}); remount "
                       "with a larger --max-file-size to cache them")
    if summary["did_not_fit"]["files"]:
        reasons.append(f"{plural(summary['did_not_fit']['files'], 'file')} did not fit: "
                       "the cache is full")
    if summary["failed"]:
        reasons.append(f"{plural(summary['failed'], 'file')} failed (the mount's log says "
                       "why)")
    if summary["not_regular"]:
        reasons.append(f"{plural(summary['not_regular'], 'file')} not regular")
    return "; ".join(reasons) or "the mount took none of them"


@dataclass(slots=True)
class _Sent:
    """How far the list went to the mount (here) or to its peers."""

    #: files of the list handed over so far
    upto: int = 0
    #: places of files left to a peer (``prefetch``'s ``elsewhere``)
    elsewhere: list[int] = field(default_factory=list)


@dataclass(slots=True)
class WarmRun:
    control: Control
    files: Files
    display: Display
    all_nodes: bool = False
    here: _Sent = field(default_factory=_Sent)
    peers: _Sent = field(default_factory=_Sent)
    #: files not sent, and their bytes: once the cache had no room for them ("unfit"), and
    #: over the mount's --max-file-size ("too_large")
    unsent: dict[str, list[int]] = field(
        default_factory=lambda: {"unfit": [0, 0], "too_large": [0, 0]})
    has_peers: bool = False
    #: the mount's --max-file-size (its status' ``max_file_bytes``), and the files over it
    #: with their bytes: never read, so in no total
    max_file: int = 0
    over: tuple[int, int] = (0, 0)

    def run(self) -> dict[str, Any]:
        """Warm every file; returns the summary (``summary``)."""
        start = time.monotonic()
        try:
            status = self.control.status()
            self.control.call(spec.WARM_STATUS, timeout_s=0)
        except ControlError as e:
            raise UserError(f"{self.files.mount} cannot warm ({e}): it predates coordlfs "
                            "warm; remount it with this version") from None
        self.has_peers = bool(status["peers"]["links"])
        self.max_file = status["cache"]["max_file_bytes"]
        over = [size for size in self.files.sizes if size > self.max_file]
        self.over = len(over), sum(over)
        try:
            reply = self._drive()
        except KeyboardInterrupt:
            dropped = self.control.call(spec.WARM_CANCEL)["dropped"]
            self.display.close()
            raise Interrupted(f"interrupted: {self._shown()}; the mount dropped the "
                              f"{dropped} still queued (run it again to resume)") from None
        except (UserError, BrokenPipeError):  # a bad path, or no one reads us: the rest goes
            self.control.call(spec.WARM_CANCEL)
            self.display.close()
            raise
        self.display.close()
        return self.summary(reply, time.monotonic() - start)

    def _shown(self) -> str:
        """How far the progress said the warm had come (where none was shown: nothing)."""
        shown = self.display.shown or self._progress(ZERO)
        return (f"{shown.files} of {plural(shown.total_files, 'file')} done "
                f"({format_size(shown.bytes)} of {format_size(shown.total_bytes)})")

    def _drive(self) -> dict[str, Any]:
        """Send, poll and show until the mount (and the peers, if asked) have done every
        file; returns the last ``warm.status``."""
        while True:
            reply = self.control.call(spec.WARM_STATUS, timeout_s=POLL_S)
            here = reply["here"] or ZERO
            sent = self._top_up(here)
            if self.all_nodes:
                sent |= self._forward()
            self.display.show(self._progress(here))
            if not sent and self._finished(here, reply["peers"]):
                return reply
            if not sent and not here["left"]:  # the peers' warms go on: the mount waits not
                time.sleep(BACKOFF_S)

    def _finished(self, here: dict[str, int], peers: dict[str, Any]) -> bool:
        n = len(self.files.names)
        if self.here.upto < n or here["left"]:
            return False
        if not self.all_nodes:
            return True
        return self.peers.upto == n and all(
            "error" in p or not (p["left"] or p["unsent"]) for p in peers.values())

    def _top_up(self, here: dict[str, int]) -> bool:
        """Hand the mount the next files while it has fewer than ``AHEAD`` queued; returns
        whether any went."""
        names = self.files.names
        room = self._room(here)
        want = AHEAD - here["left"]
        sent = False
        while want > 0 and self.here.upto < len(names):
            places, unsent, size = [], [], 0
            end = self.here.upto
            while (end < len(names) and len(places) < min(want, CHUNK_FILES)
                   and size < CHUNK_BYTES):
                why = self._unsent(end, room)
                if why is not None:
                    unsent.append((end, why))
                else:
                    places.append(end)
                    size += len(names[end]) + 4
                end += 1
            taken, elsewhere = (self._prefetch([names[i] for i in places]) if places
                                else (0, []))
            self.here.elsewhere += (places[p] for p in elsewhere)
            if taken < len(places):  # the mount's queue is full: the rest at the next poll
                end = places[taken]
            self._count_unsent([(i, why) for i, why in unsent if i < end])
            self.here.upto = end
            want -= taken
            sent = sent or taken > 0
            if taken < len(places):
                break
        return sent

    def _unsent(self, i: int, room: int | None) -> str | None:
        """Why file ``i`` is not sent (a key of ``unsent``), or None: it goes."""
        size = self.files.sizes[i]
        if size > self.max_file:
            return "too_large"
        if room is not None and pages(size) > room:
            return "unfit"
        return None

    def _count_unsent(self, unsent: list[tuple[int, str]]) -> None:
        for i, why in unsent:
            self.unsent[why][0] += 1
            self.unsent[why][1] += self.files.sizes[i]

    def _prefetch(self, paths: list[str]) -> tuple[int, list[int]]:
        reply = self.control.call(spec.PREFETCH, paths=paths, warm=True)
        return reply["queued"], reply["elsewhere"]

    def _room(self, here: dict[str, int]) -> int | None:
        """Bytes the cache still has room for, once it turned files away for want of it
        (and the mount has no peers, to which files it has no room for may belong)."""
        if not here["no_room"] or self.has_peers:
            return None
        cache = self.control.status()["cache"]
        return cache["capacity_bytes"] - cache["used_bytes"]

    def _forward(self) -> bool:
        """Hand the peers (through the mount) the next files; returns whether any went."""
        chunk = next(_chunks(self.files.names, self.peers.upto), None)
        if chunk is None:
            return False
        taken = self.control.call(spec.WARM_PEERS,
                                  paths=self.files.names[chunk[0]:chunk[1]])["queued"]
        self.peers.upto += taken
        return taken > 0

    def _progress(self, here: dict[str, int]) -> Progress:
        """Files and bytes done of those the warm reads here: not those it never will (over
        --max-file-size, left to a peer), which are in no total."""
        sizes, elsewhere = self.files.sizes, self.here.elsewhere
        unfit = self.unsent["unfit"]
        return Progress(
            here["files"] + here["cached"] + here["no_room"] + here["too_large"]
            + here["not_regular"] + here["failed"] + unfit[0],
            len(sizes) - len(elsewhere) - self.over[0],
            here["bytes"] + here["cached_bytes"] + here["no_room_bytes"] + unfit[1],
            self.files.total_bytes - sum(sizes[i] for i in elsewhere) - self.over[1])

    def summary(self, reply: dict[str, Any], seconds: float) -> dict[str, Any]:
        """What the warm came to: here, in all, and per peer node."""
        here = reply["here"] or ZERO
        summary = {"mount": self.files.mount, "listed_files": len(self.files.names),
                   "listed_bytes": self.files.total_bytes,
                   **_counts(here, self.unsent["unfit"], self.unsent["too_large"][0]),
                   "max_file_bytes": self.max_file, "seconds": round(seconds, 3),
                   "bytes_per_s": round(here["bytes"] / seconds if seconds else 0.0),
                   "files_per_s": round(here["files"] / seconds if seconds else 0.0, 1),
                   "elsewhere": len(self.here.elsewhere), "nodes": {}}
        for address, node in reply["peers"].items():
            summary["nodes"][address] = node if "error" in node else _counts(node, [0, 0], 0)
        return summary


def _counts(counts: dict[str, int], unfit: list[int], too_large: int) -> dict[str, Any]:
    return {"files": counts["files"], "bytes": counts["bytes"],
            "already_cached": {"files": counts["cached"], "bytes": counts["cached_bytes"]},
            "did_not_fit": {"files": counts["no_room"] + unfit[0],
                            "bytes": counts["no_room_bytes"] + unfit[1]},
            "too_large": counts["too_large"] + too_large, "not_regular": counts["not_regular"],
            "failed": counts["failed"]}
