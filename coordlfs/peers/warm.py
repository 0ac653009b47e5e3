"""``coordlfs warm`` across a cluster: each node warms its own share of the placement, and a
warm started on one node may ask every peer to warm theirs.

On one node a warm is a ``prefetch`` with ``warm``: the files this node caches are queued in
its fill queue (``coordlfs.cache.fills``) and the caller's progress is kept there; those a peer
caches are left to it. ``warm.peers`` hands the same files to this node's ``WarmRelays``: each
file goes to the peer that caches it (``Peers.owner_of``), never to the others, so a list
crosses the network once in all, whatever the cluster's size. Per peer, a task sends them in
WARM frames (``peer_wire.Warm``) over the peer's authenticated link, at most ``AHEAD`` files
left there at a time, and polls the peer's counts every ``POLL_S`` until it has done them.
The peer queues them in its own fill queue as a warm of its own, named by the asking warm's
``token`` (``answer``), and replies with its counts; its bounds (``fills.MAX_QUEUED``,
``fills.MAX_TALLIES``) hold for peers' warms as for its own readers.

Memory: a relay holds at most ``MAX_HELD`` files not yet taken by their peer (``warm.peers``
takes what fits and says how many); at most ``MAX_RELAYS`` relays are kept, a finished one
forgotten first. A peer that is down, refuses, or predates WARM ends its part of the warm with
the reason (``error`` in ``warm.status``): a warm is run again, not retried for ever.
``warm.cancel`` drops the caller's files still queued here, in its relay, and on the peers.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import trio

from coordlfs.cache.fills import FillQueue
from coordlfs.peers.links import PeerDown, PeerLink, Peers
from coordlfs.peers.wire import Fail, Kind, Warm, encode_fail, encode_warm_reply
from coordlfs.protocol.spec import WARM_COUNTS, Caller, RequestError, Served

log = logging.getLogger(__name__)

#: Files one relay holds that their peers have not taken yet; ``warm.peers`` takes at most
#: what fits (the caller sends the rest later, as it does to ``prefetch``).
MAX_HELD = 1 << 16
#: Files a peer may have left of a warm before more are sent to it: enough for its fill
#: workers to stay busy between two polls, few enough that a cancelled warm leaves little.
AHEAD = 1 << 13
#: Seconds between two polls of a peer's counts while it has files left.
POLL_S = 0.25
#: Relays kept at most (one per caller); a finished one is forgotten to make room.
MAX_RELAYS = 16


@dataclass(slots=True, eq=False)
class _Share:
    """One peer's part of one warm: files not sent yet, and its counts as it last said."""

    link: PeerLink
    paths: deque[bytes] = field(default_factory=deque)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WARM_COUNTS, 0))
    error: str = ""
    more: trio.Event = field(default_factory=trio.Event)
    #: a task feeds the peer (``WarmRelays._feed``); none once the share is done
    feeding: bool = False

    @property
    def done(self) -> bool:
        return bool(self.error) or (not self.paths and not self.counts["left"])

    def status(self) -> dict[str, Any]:
        return {"error": self.error} if self.error else {**self.counts,
                                                          "unsent": len(self.paths)}


@dataclass(slots=True, eq=False)
class Relay:
    """One caller's warm on the peers."""

    token: int
    shares: dict[PeerLink, _Share] = field(default_factory=dict)
    cancelled: bool = False

    @property
    def held(self) -> int:
        return sum(len(share.paths) for share in self.shares.values())

    @property
    def done(self) -> bool:
        return all(share.done for share in self.shares.values())


class WarmRelays:
    """Every caller's relay, and the tasks that feed the peers."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers
        self.relays: OrderedDict[int, Relay] = OrderedDict()
        self._nursery: trio.Nursery | None = None

    def forward(self, caller: int, paths: list[bytes]) -> int:
        """Hand each file a peer caches to that peer's share of the caller's relay, in
        order, while the relay has room; returns how many of ``paths`` were taken."""
        relay = self._relay(caller)
        room = MAX_HELD - relay.held
        taken = 0
        for path in paths:
            link = self.peers.owner_of(path)
            if link is not None:
                if room == 0:
                    break
                share = relay.shares.setdefault(link, _Share(link))
                if not share.error:  # a peer that failed is asked no more
                    share.paths.append(path)
                    share.more.set()
                    room -= 1
                    if not share.feeding:
                        share.feeding = True
                        assert self._nursery is not None
                        self._nursery.start_soon(self._feed, relay, share)
            taken += 1
        return taken

    def _relay(self, caller: int) -> Relay:
        relay = self.relays.get(caller)
        if relay is None or relay.cancelled:
            if len(self.relays) >= MAX_RELAYS:
                done = next((c for c, r in self.relays.items() if r.done or r.cancelled), None)
                if done is None:
                    raise RequestError(f"{MAX_RELAYS} warms on the peers run at once: try "
                                       "again once one has ended")
                del self.relays[done]
            relay = self.relays[caller] = Relay(secrets.randbits(64))
        return relay

    def cancel(self, caller: int) -> int:
        """Drop the caller's files not sent yet; its peers drop what they have queued of
        it. Returns how many files were dropped here."""
        relay = self.relays.get(caller)
        if relay is None or relay.cancelled:
            return 0
        relay.cancelled = True
        dropped = relay.held
        for share in relay.shares.values():
            share.paths.clear()
            share.more.set()
        return dropped

    def status(self, caller: int) -> dict[str, Any]:
        relay = self.relays.get(caller)
        if relay is None:
            return {}
        return {str(link.address): share.status() for link, share in relay.shares.items()}

    async def run(self) -> None:
        """Hold the nursery the peers' feeds run in, until the mount ends."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await trio.sleep_forever()

    async def _feed(self, relay: Relay, share: _Share) -> None:
        """Send the share's files to its peer, ``AHEAD`` left there at a time, and poll its
        counts until it has done them (more files start a new feed). A cancel is passed on
        to the peer; a peer that fails ends the share."""
        try:
            while not relay.cancelled and not share.done:
                count = Warm.fitting(share.paths) if share.counts["left"] < AHEAD else 0
                sending = tuple(itertools.islice(share.paths, count))
                taken, share.counts = await share.link.warm(Warm(relay.token, sending))
                for _ in range(taken):
                    share.paths.popleft()
                if taken < len(sending) or not sending:  # the peer is busy: ask again later
                    await _pause(share, POLL_S)
            if relay.cancelled:
                _taken, share.counts = await share.link.warm(Warm(relay.token, cancel=True))
        except PeerDown as e:
            share.error = str(e)
            share.paths.clear()
            log.warning("warm on peer %s ended: %s", share.link.address, e)
        finally:
            share.feeding = False


async def _pause(share: _Share, seconds: float) -> None:
    """Until more files come for the share, a cancel, or ``seconds`` passed."""
    with trio.move_on_after(seconds):
        await share.more.wait()
    share.more = trio.Event()


def answer(fills: FillQueue, payload: bytes | bytearray) -> tuple[Kind, bytes]:
    """A peer's WARM, on the peer server: queue the files this node caches as a warm of the
    asking node's, or drop it, and reply with its counts here. ProtocolError for a malformed
    one (the server refuses it, as a bad GET)."""
    request = Warm.decode(payload)
    warm = ("peer", request.token)
    taken = 0
    try:
        if request.cancel:
            fills.cancel(warm)
        elif request.paths:
            taken, _elsewhere = fills.warm(warm, list(request.paths))
    except RequestError as e:  # too many warms at once
        return Kind.FAIL, encode_fail(Fail.BUSY, str(e))
    counts = fills.tally(warm) or dict.fromkeys(WARM_COUNTS, 0)
    return Kind.DATA, encode_warm_reply(taken, counts)


def register_commands(server: Served, fills: FillQueue, relays: WarmRelays) -> None:
    """``warm.status`` and ``warm.cancel``: the caller's own warm, here and on the peers;
    ``warm.peers``: mount-wide (it fills other nodes' caches)."""

    def status(_args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return {"here": fills.tally(caller.pid), "peers": relays.status(caller.pid)}

    def cancel(_args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return {"dropped": fills.cancel(caller.pid) + relays.cancel(caller.pid)}

    def forward(args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return {"queued": relays.forward(caller.pid, [p.encode("utf-8", "surrogateescape")
                                                     for p in args["paths"]])}

    fills.drained = server.notify
    server.serve("warm.status", status)
    server.serve("warm.cancel", cancel)
    server.serve("warm.peers", forward)
