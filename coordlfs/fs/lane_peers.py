"""The request lane's own connections to the peers: a peer's small file fetched in C.

A file a peer caches costs the daemon LOOKUP, OPEN (the request to the peer, its reply, the
landing) and RELEASE in Python: 600-1,000 µs of the asking daemon's CPU per 110 KB file, most
of it the trio loop's passes (docs/benchmarks/cluster.md). With a peer row (``LaneRows``) the
lane answers the OPEN itself: it sends the GET on a connection of its own to that peer, checks
the reply as ``coordlfs.peers.wire`` does (the request's id, DATA of the file's size, the
payload's XXH64), lands the bytes in an unnamed file on the cache's tmpfs and answers with it as
the backing, as the daemon does (``coordlfs.peers.landing``); the RELEASE closes it.

The connections are dialled and authenticated here, with the link's address, secret and
handshake (``PeerLink.dial``), then handed to the lane: blocking, with send and receive timeouts
of ``LANE_TIMEOUT_S`` at most, one request at a time. A lane thread waits for the peer while
it asks, so the timeout is short: a peer slower than that costs its connection (the lane closes
it at any fault), and the open goes to the daemon, which asks again with the link's own timeout
or reads the source. A connection found down is dialled again at the next offer of the peer's
files, at most once per ``REDIAL_S``. They are one more connection per peer on each side,
beside the link's, so the lane has them only while a connection to every peer both ways
fits the node's ``--peer-connections`` (peers at most half of it: 32 at the default 64),
which then bounds all of them together; a server's own cap counts them too.
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

#: Seconds a lane thread waits at most for a peer to take a request or send its reply.
LANE_TIMEOUT_S = 1.0
#: Seconds between two dials of a peer whose connection is down.
REDIAL_S = 1.0


class LanePeers:
    """Which lane connection is which peer's (a slot per address, kept for the mount's life:
    rows name slots), dialling them, and their counts folded into the mount's."""

    def __init__(self, lane: Lane, readers: Readers) -> None:
        self.lane = lane
        self.peers = readers.peers
        #: whose nursery dials run in (set once the mount serves)
        self._readers = readers
        lane.land_in(readers.cache.files_fd)
        self._slots: dict[Address, int] = {}
        self._dialled_at: dict[Address, float] = {}
        self._folded: dict[int, tuple[int, int, int]] = {}
        #: the lane's landed files open at the last fold, and their bytes
        self._held = (0, 0)

    def slot(self, link: PeerLink) -> int | None:
        """The slot of the lane's connection to ``link``'s peer if it is up; else None, and a
        dial starts (unless one did within ``REDIAL_S``)."""
        slot = self._slots.get(link.address)
        if slot is not None and self.lane.peer_state(slot)[0]:
            return slot
        if 2 * len(self.peers.links) > self.peers.budget.limit:
            return None  # see the module: within --peer-connections, with the links'
        now = time.monotonic()
        nursery = self._readers.nursery
        if nursery is None or now - self._dialled_at.get(link.address, -REDIAL_S) < REDIAL_S:
            return None
        if slot is None and len(self._slots) >= MAX_PEERS:
            return None  # slots are never reused; more peers than that in a mount's life
        self._dialled_at[link.address] = now
        nursery.start_soon(self._dial, link)
        return None

    async def _dial(self, link: PeerLink) -> None:
        try:
            stream = await link.dial()
        except PeerDown as e:
            log.debug("peer %s: no lane connection: %s", link.address, e)
            return
        sock = stream.stream.socket
        fd = sock.detach()  # the trio socket lets go of it; the connection stays
        raw = socket.socket(fileno=fd)
        try:
            raw.setblocking(True)
            wait = min(LANE_TIMEOUT_S, link.timeout)
            timeval = struct.pack("ll", int(wait), int(wait % 1 * 1e6))
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
        self.lane.set_peer(slot, raw.detach())

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
