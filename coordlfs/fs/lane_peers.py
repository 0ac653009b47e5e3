"""The request lane's own connections to the peers: a peer's small file fetched in C.

A file a peer caches costs the daemon LOOKUP, OPEN (the request to the peer, its reply, the
landing) and RELEASE in Python: 700-900 µs of the asking daemon's CPU per 110 KB file, most of
it the trio loop's passes (docs/benchmarks/cluster.md). With a peer row (``LaneRows``) the
lane answers the OPEN itself, on a fetcher thread of its own (the threads that read /dev/fuse
go on meanwhile): it sends the GET on a connection of its own to that peer, checks the reply as
``coordlfs.peers.wire`` does (the request's id, DATA of the file's size, the payload's XXH64),
lands the bytes in an unnamed file on the cache's tmpfs and answers with it as the backing, as
the daemon does (``coordlfs.peers.landing``); the RELEASE closes it.

The connections are dialled and authenticated here, with the link's address, secret and
handshake (``PeerLink.dial``), then handed to the lane: blocking, with send and receive
timeouts of the peer timeout, one request at a time each, up to ``POOL`` per peer so that
several fetches overlap. Any fault closes one (the open goes to the daemon, which asks again on
its link or reads the source), and so does a close by the peer (its idle timeout) found before
a request; more are dialled at the next offers of the peer's files, after a failed dial at most
once per ``REDIAL_S``. They are connections beside the links, so the lane has them only as far
as a link and its pool to every peer fit the node's ``--peer-connections``: the pool shrinks
with more peers and is none past half the limit (32 peers at the default 64); a server's own
cap counts them too.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

from coordlfs.cache.stats import ReadCounters
from coordlfs.fs.lane import Lane
from coordlfs.fs.readers import Readers
from coordlfs.peers.links import PeerDown, PeerLink
from coordlfs.peers.placement import MAX_PEERS, Address

log = logging.getLogger(__name__)

#: Connections per peer at most (lane.c's PEER_POOL).
POOL = 4
#: Seconds after a failed dial before the next one to the same peer.
REDIAL_S = 1.0


class LanePeers:
    """Which lane connections are which peer's (a slot per address, kept for the mount's
    life: rows name slots), dialling them, and their counts folded into the mount's."""

    def __init__(self, lane: Lane, readers: Readers) -> None:
        self.lane = lane
        self.peers = readers.peers
        #: whose nursery dials run in (set once the mount serves)
        self._readers = readers
        lane.land_in(readers.cache.files_fd)
        self._slots: dict[Address, int] = {}
        self._dialling: set[Address] = set()
        self._failed_at: dict[Address, float] = {}
        self._folded: dict[int, tuple[int, int, int]] = {}
        #: the lane's landed files open at the last fold, and their bytes
        self._held: tuple[int, ...] = (0, 0)

    def pool(self) -> int:
        """Connections per peer the budget leaves the lane: a link and the pool to every
        peer within ``--peer-connections``."""
        peers = max(1, len(self.peers.links))
        return min(POOL, self.peers.budget.limit // peers - 1)

    def slot(self, link: PeerLink) -> int | None:
        """The slot of the lane's connections to ``link``'s peer if one is up, else None;
        another is dialled while the pool has room (one dial at a time per peer)."""
        slot = self._slots.get(link.address)
        up = 0 if slot is None else self.lane.peer_state(slot)[0]
        pool = self.pool()
        if up < pool and link.address not in self._dialling and (
                slot is not None or len(self._slots) < MAX_PEERS):  # slots are never reused
            nursery = self._readers.nursery
            failed = self._failed_at.get(link.address)
            if nursery is not None and (failed is None or
                                        time.monotonic() - failed >= REDIAL_S):
                self._dialling.add(link.address)
                nursery.start_soon(self._dial, link)
        return slot if up and pool >= 1 else None

    async def _dial(self, link: PeerLink) -> None:
        try:
            stream = await link.dial()
        except PeerDown as e:
            self._failed_at[link.address] = time.monotonic()
            log.debug("peer %s: no lane connection: %s", link.address, e)
            return
        finally:
            self._dialling.discard(link.address)
        self._failed_at.pop(link.address, None)
        raw = socket.socket(fileno=stream.stream.socket.detach())  # the trio socket lets go
        try:
            raw.setblocking(True)
            timeval = struct.pack("ll", int(link.timeout), int(link.timeout % 1 * 1e6))
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        except OSError as e:
            raw.close()
            log.debug("peer %s: no lane connection: %s", link.address, e)
            return
        if link.retired:  # it left while this dialled
            raw.close()
            return
        slot = self._slots.setdefault(link.address, len(self._slots))
        if self.lane.set_peer(slot, raw.fileno()) < 0:  # its pool is full
            raw.close()
        else:
            raw.detach()

    def fold(self, reads: ReadCounters) -> None:
        """The files the lane fetched since the last fold, into the mount's bytes from peers,
        the links' counts and the landings' (its landed files open now among theirs). (Its
        opens are counted by ``Lane.fold``.)"""
        landings = self.peers.landings
        held = self.lane.gauges()[3:5]
        landings.open_files += held[0] - self._held[0]
        landings.open_bytes += held[1] - self._held[1]
        self._held = held
        links = {link.address: link for link in self.peers.links.values()}
        for address, slot in self._slots.items():
            files, size, refused = self.lane.peer_state(slot)[1][:3]
            was = self._folded.get(slot, (0, 0, 0))
            self._folded[slot] = (files, size, refused)
            reads.bytes_from_peers += size - was[1]
            landings.files += files - was[0]
            landings.bytes += size - was[1]
            link = links.get(address)
            if link is not None:
                link.stats.files += files - was[0]
                link.stats.bytes += size - was[1]
                link.stats.misses += refused - was[2]

    def status(self) -> dict[str, int]:
        """The lane's connections to peers now up, and what they did in all."""
        totals = [0] * 5
        up = 0
        for slot in self._slots.values():
            on, counts = self.lane.peer_state(slot)
            up += on
            totals = [a + b for a, b in zip(totals, counts, strict=True)]
        return {"connections": up, **dict(zip(("files", "bytes", "refused", "faults",
                                               "closed_by_peer"), totals, strict=True))}
