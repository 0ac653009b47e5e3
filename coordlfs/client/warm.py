"""``coordlfs warm``: a mount's cache filled with files ahead of a job, in the job's order.

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
(``warm.cancel``); the files read so far stay cached.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from coordlfs.client.warm_files import Files, Listing
from coordlfs.client.warm_progress import Display, Progress
from coordlfs.control import BACKOFF_S, Control, ControlError
from coordlfs.errors import UserError
from coordlfs.protocol import spec
from coordlfs.sizes import pages, plural

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
    listing: Listing
    display: Display
    all_nodes: bool = False
    here: _Sent = field(default_factory=_Sent)
    peers: _Sent = field(default_factory=_Sent)
    #: files not sent once the cache had no room for them, and their bytes
    unfit: list[int] = field(default_factory=lambda: [0, 0])
    has_peers: bool = False

    @property
    def files(self) -> Files:
        return self.listing.files

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
        try:
            reply = self._drive()
        except KeyboardInterrupt:
            self.display.close()
            dropped = self.control.call(spec.WARM_CANCEL)["dropped"]
            here = self.control.call(spec.WARM_STATUS, timeout_s=0)["here"] or ZERO
            raise Interrupted(f"interrupted: {self._done(here)} of "
                              f"{plural(self._total_files(), 'file')} done; the mount "
                              f"dropped the {dropped} still queued "
                              "(run it again to resume)") from None
        except (UserError, BrokenPipeError):  # a bad path, or no one reads us: the rest goes
            self.display.close()
            self.control.call(spec.WARM_CANCEL)
            raise
        self.display.close()
        return self.summary(reply, time.monotonic() - start)

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
            if not sent and not here["left"]:  # the mount waits for files still being found
                time.sleep(BACKOFF_S)

    def _finished(self, here: dict[str, int], peers: dict[str, Any]) -> bool:
        self.listing.check()
        complete = self.files.complete  # before the count: a file found meanwhile is sent
        n = len(self.files.names)
        if not complete or self.here.upto < n or here["left"]:
            return False
        if not self.all_nodes:
            return True
        return self.peers.upto == n and all(
            "error" in p or not (p["left"] or p["unsent"]) for p in peers.values())

    def _top_up(self, here: dict[str, int]) -> bool:
        """Hand the mount the next files while it has fewer than ``AHEAD`` queued; returns
        whether any went."""
        names, sizes = self.files.names, self.files.sizes
        room = self._room(here)
        want = AHEAD - here["left"]
        sent = False
        while want > 0 and self.here.upto < len(names):
            places, unfit, size = [], [], 0
            end = self.here.upto
            while (end < len(names) and len(places) < min(want, CHUNK_FILES)
                   and size < CHUNK_BYTES):
                if room is not None and pages(sizes[end]) > room:
                    unfit.append(end)
                else:
                    places.append(end)
                    size += len(names[end]) + 4
                end += 1
            taken, elsewhere = (self._prefetch([names[i] for i in places]) if places
                                else (0, []))
            self.here.elsewhere += (places[p] for p in elsewhere)
            if taken < len(places):  # the mount's queue is full: the rest at the next poll
                end = places[taken]
            for i in unfit:
                if i < end:
                    self.unfit[0] += 1
                    self.unfit[1] += sizes[i]
            self.here.upto = end
            want -= taken
            sent = sent or taken > 0
            if taken < len(places):
                break
        return sent

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
        names = self.files.names
        start = self.peers.upto
        if start == len(names):
            return False
        end, size = start, 0
        while end < len(names) and end - start < CHUNK_FILES and size < CHUNK_BYTES:
            size += len(names[end]) + 4
            end += 1
        taken = self.control.call(spec.WARM_PEERS, paths=names[start:end])["queued"]
        self.peers.upto += taken
        return taken > 0

    def _total_files(self) -> int:
        return len(self.files.names) - len(self.here.elsewhere)

    def _done(self, here: dict[str, int]) -> int:
        return (here["files"] + here["cached"] + here["no_room"] + here["too_large"]
                + here["not_regular"] + here["failed"] + self.unfit[0])

    def _progress(self, here: dict[str, int]) -> Progress:
        elsewhere_bytes = sum(self.files.sizes[i] for i in self.here.elsewhere)
        return Progress(self._done(here), self._total_files(),
                        here["bytes"] + here["cached_bytes"] + here["no_room_bytes"]
                        + self.unfit[1], self.files.total_bytes - elsewhere_bytes)

    def summary(self, reply: dict[str, Any], seconds: float) -> dict[str, Any]:
        """What the warm came to: here, in all, and per peer node."""
        here = reply["here"] or ZERO
        summary = {"mount": self.files.mount, "listed_files": len(self.files.names),
                   "listed_bytes": self.files.total_bytes, **_counts(here, self.unfit),
                   "seconds": round(seconds, 3),
                   "bytes_per_s": round(here["bytes"] / seconds if seconds else 0.0),
                   "files_per_s": round(here["files"] / seconds if seconds else 0.0, 1),
                   "elsewhere": len(self.here.elsewhere), "nodes": {}}
        for address, node in reply["peers"].items():
            summary["nodes"][address] = node if "error" in node else _counts(node, [0, 0])
        return summary


def _counts(counts: dict[str, int], unfit: list[int]) -> dict[str, Any]:
    return {"files": counts["files"], "bytes": counts["bytes"],
            "already_cached": {"files": counts["cached"], "bytes": counts["cached_bytes"]},
            "did_not_fit": {"files": counts["no_room"] + unfit[0],
                            "bytes": counts["no_room_bytes"] + unfit[1]},
            "too_large": counts["too_large"], "not_regular": counts["not_regular"],
            "failed": counts["failed"]}
