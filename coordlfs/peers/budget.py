"""How many peer connections one side of a node keeps open: a bound that does not grow with
the cluster.

Every node reads files every other node owns, so without a bound a node holds a connection
to each peer it asks and one from each peer that asks it, 2(N-1) at N nodes (510 at the
256-node cap, measured with ``coordlfs bench nodes``). A ``Budget`` bounds one direction:
while ``limit`` connections are open, a new one first closes the least recently used of
those that are idle (nothing in flight), and if none is, it is refused (the server turns
the peer away BUSY) or waits for one to become idle (a link). Room is made before the new
connection exists (a link connects, a server accepts, after it), so the descriptors held
never pass the limit. Closing an idle connection
costs its peer nothing but a reconnection (one handshake) at its next request: a client
closes only its own idle links, and a request caught on a connection its server closed
goes again once on a new one (``coordlfs.peers.links``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import trio

#: Connections each way by default (``--peer-connections``): one per peer for every peer of
#: a cluster of up to 65 nodes (every link stays open, as before), 2 x 64 sockets at most
#: beyond that, rather than up to 510. A connection costs the daemon a descriptor and about
#: 45-70 KiB (bench nodes); a reconnection one handshake, two round trips, which a node
#: asking more peers than this pays on the requests that find their link closed
#: (``docs/benchmarks/nodes.md`` measures both at 64 and 256 nodes).
DEFAULT_LIMIT = 64


class Connection(Protocol):
    """One open connection as its budget sees it."""

    @property
    def idle(self) -> bool:
        """Nothing in flight: closing it now loses no request."""
        ...

    def evict(self) -> None:
        """Close it now (synchronously): the budget needs its room."""
        ...


class Budget:
    """At most ``limit`` connections open, in order of last use."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"a budget of {limit} connections")
        self.limit = limit
        self._open: OrderedDict[Connection, None] = OrderedDict()
        self._freed = trio.Event()
        self._waiting = 0
        #: idle connections closed to make room for another
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._open)

    def room(self) -> bool:
        """Whether one more may open: at once below the limit, else after closing the least
        recently used idle connection; False when every one is busy."""
        if len(self._open) < self.limit:
            return True
        victim = next((c for c in self._open if c.idle), None)
        if victim is None:
            return False
        self.release(victim)
        self.evicted += 1
        victim.evict()
        return True

    def add(self, connection: Connection) -> None:
        """Count ``connection`` as open, in the room ``room`` made for it."""
        self._open[connection] = None

    def used(self, connection: Connection) -> None:
        """``connection`` was used now: it is the last to be closed for room."""
        if connection in self._open:
            self._open.move_to_end(connection)

    def release(self, connection: Connection) -> None:
        """``connection`` is closed (or was never opened); wakes those waiting for room."""
        if self._open.pop(connection, True) is None:
            self._freed.set()
            self._freed = trio.Event()

    def went_idle(self) -> None:
        """A connection became idle: those waiting for room may take it now."""
        if self._waiting:
            self._freed.set()
            self._freed = trio.Event()

    async def wait_for_room(self) -> None:
        """Until a connection closes or becomes idle (the caller tries ``take`` again)."""
        self._waiting += 1
        try:
            await self._freed.wait()
        finally:
            self._waiting -= 1
