"""Fetching a local miss from the peer mount that caches the file.

Each remote peer is a ``PeerLink``: one kept-alive, authenticated connection (``peer_wire``)
with many requests in flight, opened on first use. One is enough: replies come back in any
order, so a large reply holds up no other request for longer than its own bytes take, and a
second connection would not receive faster on the one event loop. Any fault (refused
connection, failed handshake, a reply later than ``timeout``, a bad checksum, a wrong length,
garbage) marks the peer down: every request in flight on it gets ``None`` and the reader
reads local storage instead, so a fault costs a reader at most the timeout. A down peer is
retried after a backoff that doubles from 1 s to 30 s. A link with nothing in flight for half
the server's idle timeout (``peer_wire.idle_timeout``) closes its connection itself, before
the server would, and reconnects at the next request; a server that closes a connection
with nothing in flight is not a fault either, and one that closes it under a request (its
own budget needed the room, or it restarted) costs that request a second try on a new
connection, and only a second loss marks it down; a server with every connection busy
turns a new one away (BUSY), which sends that one file to local storage and marks nothing
down. The links of a node share a ``Budget``
(``coordlfs.peers.budget``): past its limit, a new connection first closes the least
recently used idle link, or waits for one to become idle. ``Peers`` ranks the nodes for a file
(``placement``) and keeps the counters the status shows. Files of an order handed over go many
per request (``read_many``: GETMANY to a peer that lists it) into the holding area
(``coordlfs.peers.hold``), where readers' first misses find them.

The nodes may change while the mount runs (``Peers.replace``, fed by
``coordlfs.peers.sources``): a node that joins gets a link that connects at its first
request; a node that leaves has its link retired, and whatever was in flight on it is
answered ``None``, as for a peer that went down, so its readers read local storage. Ranking
by rendezvous hashing moves only the files of the nodes that came or went.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, NoReturn, Protocol

import trio

from coordlfs.cache.stats import ReadCounters
from coordlfs.peers.budget import DEFAULT_LIMIT, Budget
from coordlfs.peers.landing import Landings
from coordlfs.peers.placement import Address, Resolved, find_self, owner, ranking, resolve
from coordlfs.peers.wire import (
    LANE_READY,
    MAX_CHUNK,
    Fail,
    FrameStream,
    Get,
    GetMany,
    Kind,
    ProtocolError,
    TurnedAway,
    Wanted,
    Warm,
    client_handshake,
    decode_fail,
    decode_features,
    decode_warm_reply,
    idle_timeout,
)

log = logging.getLogger(__name__)


class Hold(Protocol):
    """The holding area the links fill ahead of reads (``coordlfs.peers.hold.PeerHold``), as
    the links see it: it is built on them, so they know it only by what they call."""

    def prefetch(self, paths: Iterable[bytes]) -> int: ...

    async def take(self, path: bytes, st: os.stat_result
                   ) -> tuple[PeerLink, bytes | memoryview] | None: ...

    def forget_link(self, link: PeerLink) -> None: ...

    def has_order(self) -> bool: ...

    async def run(self) -> None: ...

    def status(self) -> dict[str, Any]: ...

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
#: Default seconds a peer may take to connect, authenticate or answer one request.
DEFAULT_TIMEOUT_S = 2.0
#: Why a request to a node that left the cluster fails.
LEFT = "no longer in the cluster"


class PeerDown(Exception):
    """The peer cannot serve now; the caller reads local storage."""


@dataclass(slots=True)
class PeerStats:
    requests: int = 0
    bytes: int = 0
    files: int = 0
    #: replies that the peer does not hold the file (MISS) or holds another version (STALE)
    misses: int = 0
    stale: int = 0
    failures: int = 0
    #: connections opened (the first, and one after each close), and those the peer turned
    #: away because its own connections were all busy
    connections: int = 0
    turned_away: int = 0
    last_error: str = ""


@dataclass(slots=True)
class _Pending:
    done: trio.Event
    #: when the reply is late (trio's clock): the receive task fails the link then
    deadline: float
    kind: Kind | None = None
    payload: bytes | bytearray = b""
    error: str = ""
    #: the peer closed the connection under it: it may not have seen the request
    lost: bool = False


class PeerLink:
    def __init__(self, address: Address, secret: bytes, timeout: float,
                 budget: Budget | None = None) -> None:
        self.address = address
        self.secret = secret
        self.timeout = timeout
        #: the connections this link's node may keep open; None: no bound
        self.budget = budget
        self.stats = PeerStats()
        self.nursery: trio.Nursery | None = None
        self._stream: FrameStream | None = None
        self._connecting = trio.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1
        self._backoff = 0.0
        self._down_until = 0.0
        #: what the connected peer serves beyond GET; None until its first frame came
        self._features: frozenset[bytes] | None = None
        self._first_frame = trio.Event()
        #: the node left the cluster: no request goes to it any more
        self.retired = False
        #: where the peer's name resolved to, until a connection there fails
        self._where: Resolved | None = None
        #: the receive task's scope: its deadline is the oldest request's, else the idle
        #: close's (one scope per connection, moved, rather than one per request and wait)
        self._watch: trio.CancelScope | None = None

    @property
    def state(self) -> str:
        if self._stream is not None:
            return "up"
        return "down" if self._down_until > time.monotonic() else "idle"

    @property
    def knows_features(self) -> bool:
        """Whether the connection's first frame has come: then ``serves_many`` is known."""
        return self._stream is not None and self._features is not None

    @property
    def serves_many(self) -> bool:
        """Whether the peer takes GETMANY: known from the first frame of the connection
        (``peer_wire``'s features), so False until one has come."""
        return bool(self._features and b"getmany" in self._features)

    async def get(self, request: Get) -> tuple[Kind, bytes | bytearray]:
        """Send one request and wait for its reply: (DATA, bytes) or (FAIL, payload)."""
        stream, kind, payload = await self._exchange(Kind.GET, request.encode())
        if kind == Kind.DATA and len(payload) != request.length:
            await self._lied(stream, f"sent {len(payload)} bytes for a request of "
                                     f"{request.length}")
        if kind not in (Kind.DATA, Kind.FAIL):
            await self._lied(stream, f"answered a GET with {kind.name}")
        return kind, payload

    async def get_many(self, request: GetMany) -> list[memoryview | tuple[Fail, str]]:
        """Several whole files in one round trip: per file its bytes or why not. A refusal
        of the whole request fails every file; a reply that lies about any file (another
        count, another length) marks the peer down."""
        stream, kind, payload = await self._exchange(Kind.GETMANY, request.encode())
        if kind == Kind.FAIL:
            return [decode_fail(payload)] * len(request.files)
        if kind != Kind.FILES:
            await self._lied(stream, f"answered a GETMANY with {kind.name}")
        try:
            return request.decode_reply(payload)
        except ProtocolError as e:
            await self._lied(stream, str(e))

    async def warm(self, request: Warm) -> tuple[int, dict[str, int]]:
        """Send a WARM (``coordlfs.peers.warm``): how many paths the peer took, and the
        warm's counts there. PeerDown for a peer that is down, refuses it or predates it
        (known from the connection's first frame, waited for up to the timeout)."""
        await self._connected()
        with trio.move_on_after(self.timeout):
            await self._first_frame.wait()
        if not self._features or b"warm" not in self._features:
            raise PeerDown("the peer's version does not warm")
        stream, kind, payload = await self._exchange(Kind.WARM, request.encode())
        if kind == Kind.FAIL:
            raise PeerDown(f"the peer refused: {decode_fail(payload)[1]}")
        try:
            if kind != Kind.DATA:
                raise ProtocolError(f"answered a WARM with {kind.name}")
            return decode_warm_reply(payload)
        except ProtocolError as e:
            await self._lied(stream, str(e))

    async def _exchange(self, kind: Kind, payload: bytes
                        ) -> tuple[FrameStream, Kind, bytes | bytearray]:
        """Send one request and wait for its reply, on the stream it went out on; once more
        on a new connection if the peer closed the first under it."""
        for last_try in (False, True):
            stream = await self._connected()
            request_id = self._next_id
            self._next_id = self._next_id % 0xFFFFFFFF + 1
            deadline = trio.current_time() + self.timeout
            pending = self._pending[request_id] = _Pending(trio.Event(), deadline)
            self._watch_until(deadline)
            self.stats.requests += 1
            if self.budget is not None:
                self.budget.used(self)
            try:  # the receive task answers it, or fails it once it is late
                await stream.send(kind, request_id, payload)
                await pending.done.wait()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:  # closed under it
                await self._lose(stream, f"sending failed: {_describe(e)}")
            except Exception as e:  # the send timed out, or a bug
                await self._fail(stream, f"sending failed: {_describe(e)}")
            finally:
                self._pending.pop(request_id, None)
                if not self._pending and self.budget is not None:
                    self.budget.went_idle()
            if pending.lost and not last_try:
                log.debug("peer %s: %s; asking again", self.address, pending.error)
                continue
            if pending.lost:  # twice: not a close that made room, a fault
                self._mark_down(pending.error)
            if pending.error or pending.kind is None:
                raise PeerDown(pending.error or self.stats.last_error)
            self._backoff = 0.0
            return stream, pending.kind, pending.payload
        raise AssertionError("unreachable")

    async def dial(self) -> FrameStream:
        """A new authenticated connection to the peer that is not the link's (the request
        lane's own: ``coordlfs.fs.lane_peers``), its first frame (the features) read and, to a
        server that lists ``lane``, LANE said and answered, so that the next frame on it is a
        reply. PeerDown if the peer is down or turns it away."""
        if self.retired or self._down_until > time.monotonic():
            raise PeerDown(self.stats.last_error or LEFT)
        try:
            with trio.fail_after(self.timeout):
                stream = await self._handshaken()
                try:
                    first = await stream.receive()
                    if first is None or first.kind != Kind.DATA or first.request_id != 0:
                        raise ProtocolError("no features frame after the handshake")
                    if b"lane" in decode_features(first.payload):
                        await stream.send(Kind.LANE, 0, b"")
                        ready = await stream.receive()
                        if ready is None or (ready.kind, ready.request_id,
                                             bytes(ready.payload)) != (Kind.DATA, 0, LANE_READY):
                            raise ProtocolError("LANE not answered")
                except BaseException:
                    await trio.aclose_forcefully(stream.stream)
                    raise
        except Exception as e:
            raise PeerDown(_describe(e)) from None
        return stream

    async def _handshaken(self) -> FrameStream:
        """A new connection to the peer, authenticated (closed again if that fails)."""
        stream = FrameStream(await self._open(), frame_timeout=self.timeout)
        try:
            await client_handshake(stream, self.secret)
        except BaseException:
            await trio.aclose_forcefully(stream.stream)
            raise
        return stream

    async def _lied(self, stream: FrameStream, reason: str) -> NoReturn:
        """The reply breaks the protocol: the peer goes down, its bytes are not used."""
        await self._fail(stream, reason)
        raise PeerDown(self.stats.last_error)

    async def _connected(self) -> FrameStream:
        if self._stream is not None:  # as nearly always: no lock, so no pass through trio
            return self._stream
        async with self._connecting:
            if self._stream is not None:
                return self._stream
            if self.retired:
                raise PeerDown(LEFT)
            if self._down_until > time.monotonic():
                raise PeerDown(self.stats.last_error)
            await self._room()
            try:
                return await self._connect()
            except BaseException:
                if self._stream is None and self.budget is not None:
                    self.budget.release(self)
                raise

    async def _room(self) -> None:
        """A place in the node's budget of connections, waiting at most the timeout for
        one to become idle; PeerDown (not a fault of this peer's) if none does."""
        if self.budget is None:
            return
        with trio.move_on_after(self.timeout):
            while not self.budget.room():
                await self.budget.wait_for_room()
            self.budget.add(self)
            return
        raise PeerDown(f"all {self.budget.limit} peer connections busy for "
                       f"{self.timeout:g} s")

    async def _connect(self) -> FrameStream:
        """A new authenticated connection, the link's from now on."""
        try:
            with trio.fail_after(self.timeout):
                stream = await self._handshaken()
        except TurnedAway as e:  # no room there now: this file only reads local storage
            self.stats.turned_away += 1
            log.debug("peer %s: %s", self.address, e)
            raise PeerDown(str(e)) from None
        except Exception as e:  # whatever went wrong, the reader reads local storage
            self._where = None  # the name may point elsewhere now
            self._mark_down(f"cannot connect: {_describe(e)}")
            raise PeerDown(self.stats.last_error) from None
        if self.retired:  # it left while this connected
            await trio.aclose_forcefully(stream.stream)
            raise PeerDown(LEFT)
        assert self.nursery is not None
        self._stream = stream
        self._features = None
        self._first_frame = trio.Event()
        self.stats.connections += 1
        self.nursery.start_soon(self._receive, stream)
        log.log(logging.INFO if self.stats.connections == 1 else logging.DEBUG,
                "peer %s: connected", self.address)
        return stream

    async def _open(self) -> trio.SocketStream:
        """A TCP connection to the peer. Its name is resolved (in a worker thread: a DNS
        server may be slow) at the first connection and after a failed one only: with a
        budget of connections below the node count, links reconnect often, and a lookup
        and a thread each time cost more than the connection itself."""
        if self._where is None:
            self._where = await trio.to_thread.run_sync(resolve, self.address,
                                                        abandon_on_cancel=True)
        sock = trio.socket.socket(self._where.family, socket.SOCK_STREAM)
        try:
            await sock.connect(self._where.sockaddr)
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)

    async def _receive(self, stream: FrameStream) -> None:
        """Hand each reply to the request that waits for it, until the connection fails, a
        request is late (the peer goes down) or it stays idle (then it is closed without
        marking the peer down)."""
        try:
            while True:
                with trio.CancelScope(deadline=self._next_deadline()) as self._watch:
                    await self._replies(stream)
                if not self._watch.cancelled_caught:  # the end of the stream
                    break
                if self._late():
                    await self._fail(stream, f"no reply within {self.timeout:g} s")
                    return
                if not self._pending:
                    await self._close_idle(stream, "idle")
                    return
                # a request came as the idle time ran out: watch for its reply
            if self._waiting():
                await self._lose(stream, "connection closed by the peer")
            else:
                await self._close_idle(stream, "closed by the peer while idle")
            return
        except trio.BrokenResourceError as e:  # reset: the peer closed it with bytes unread
            await self._lose(stream, _describe(e))
            return
        except Exception as e:  # whatever broke, the link goes down, never the mount
            reason = _describe(e)
        await self._fail(stream, reason)

    async def _replies(self, stream: FrameStream) -> None:
        """Hand replies over until the end of the stream or the watch's deadline."""
        while (frame := await stream.receive()) is not None:
            if frame.kind not in (Kind.DATA, Kind.FAIL, Kind.FILES):
                raise ProtocolError(f"unexpected {frame.kind.name} frame")
            if self._features is None:  # the first frame: the features, if any
                self._features = (decode_features(frame.payload) if frame.request_id == 0
                                  and frame.kind == Kind.DATA else frozenset())
                self._first_frame.set()
            pending = self._pending.get(frame.request_id)
            if pending is None:
                continue  # its reader gave up (timeout); the link is being closed anyway
            pending.kind, pending.payload = frame.kind, frame.payload
            pending.done.set()
            self._watch_again()

    def _next_deadline(self) -> float:
        """The oldest waiting request's deadline, else when an idle connection is closed
        (half the server's idle timeout: before the server would)."""
        for pending in self._pending.values():
            if not pending.done.is_set():
                return pending.deadline
        return trio.current_time() + idle_timeout(self.timeout) / 2

    def _watch_until(self, deadline: float) -> None:
        """A request was sent that is late at ``deadline``."""
        if self._watch is not None and deadline < self._watch.deadline:
            self._watch.deadline = deadline

    def _watch_again(self) -> None:
        """A reply came: watch for the next one, or, with none waiting, for the idle close
        (moved later at most once a second, not at every reply)."""
        assert self._watch is not None
        deadline = self._next_deadline()
        if deadline < self._watch.deadline or deadline > self._watch.deadline + 1:
            self._watch.deadline = deadline

    def _late(self) -> bool:
        """Whether a request waits for its reply past its deadline."""
        now = trio.current_time()
        return any(not pending.done.is_set() and pending.deadline <= now
                   for pending in self._pending.values())

    async def _close_idle(self, stream: FrameStream, why: str) -> None:
        """Close an idle connection: not a fault, the next request reconnects."""
        if self._stream is stream:
            self._detach()
            log.debug("peer %s: connection %s, closed", self.address, why)
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(stream.stream)

    async def _lose(self, stream: FrameStream, reason: str) -> None:
        """The peer closed ``stream`` under requests: they go again on a new connection."""
        await self._end(stream, reason, lost=True)

    async def _fail(self, stream: FrameStream, reason: str) -> None:
        """Close ``stream`` (if it is still the current one) and fail its requests."""
        await self._end(stream, reason, lost=False)

    async def _end(self, stream: FrameStream, reason: str, lost: bool) -> None:
        if self._stream is not stream:
            return
        self._detach()
        if not lost:
            self._mark_down(reason)
        for pending in self._pending.values():
            if not pending.done.is_set():  # one answered already keeps its answer
                pending.error, pending.lost = reason, lost
                pending.done.set()
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(stream.stream)

    def _waiting(self) -> bool:
        """Whether a request in flight still waits for its reply (one whose reply came has
        not always gone from ``_pending`` yet: its task runs after the receive task)."""
        return any(not pending.done.is_set() for pending in self._pending.values())

    def _detach(self) -> None:
        """The connection is no longer the link's: its place in the budget is free."""
        self._stream = None
        if self.budget is not None:
            self.budget.release(self)

    @property
    def idle(self) -> bool:
        """Connected with nothing in flight (``Budget``)."""
        return self._stream is not None and not self._pending

    def evict(self) -> None:
        """Close the idle connection now, for another link's room (``Budget``)."""
        stream = self._stream
        if stream is not None:
            self._stream = None
            log.debug("peer %s: idle connection closed for another peer's", self.address)
            _close_now(stream)

    def _mark_down(self, reason: str) -> None:
        self._backoff = min(MAX_BACKOFF_S, self._backoff * 2 or FIRST_BACKOFF_S)
        self._down_until = time.monotonic() + self._backoff
        self.stats.failures += 1
        self.stats.last_error = reason
        log.warning("peer %s is down for %.0f s: %s", self.address, self._backoff, reason)

    def retire(self) -> None:
        """The node left the cluster: requests in flight get None at once (their readers
        read local storage) and the connection is closed; not a fault of the peer."""
        self.retired = True
        stream = self._stream
        self._detach()
        for pending in self._pending.values():
            pending.error = LEFT
            pending.done.set()
        if stream is not None and self.nursery is not None:
            self.nursery.start_soon(trio.aclose_forcefully, stream.stream)

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "in_flight": len(self._pending),
                "retry_in_s": round(max(0.0, self._down_until - time.monotonic()), 3),
                **asdict(self.stats)}


def _close_now(stream: FrameStream) -> None:
    """Close the connection's socket without an await: its receive task wakes on the close
    (and, finding the link on another stream, ends quietly)."""
    socket = getattr(stream.stream, "socket", None)
    if socket is not None:
        socket.close()


def _describe(e: BaseException) -> str:
    if isinstance(e, trio.TooSlowError):
        return "timed out"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    causes = getattr(e.__cause__, "exceptions", ())  # trio's "all attempts ... failed"
    if causes and isinstance(causes[0], OSError) and causes[0].strerror:
        return causes[0].strerror
    return str(e) or e.__class__.__name__


class Peers:
    """The cluster as one mount sees it. With no peers every file is cached here."""

    def __init__(self, nodes: tuple[Address, ...], me: Address | None, secret: bytes,
                 timeout: float, counters: ReadCounters, listen: Address | None = None,
                 source: str = "--peers", max_links: int = DEFAULT_LIMIT) -> None:
        self.nodes = nodes
        self.me = me
        self.counters = counters
        self.secret = secret
        self.timeout = timeout
        #: where this node listens, to find itself in a new list of nodes
        self.listen = listen
        #: where the nodes come from (``coordlfs.peers.sources``), and when they last changed
        self.source = source
        self.changed_at = time.time()
        self.changes = 0
        #: told after each change of the cluster (the request lane answers LOOKUPs only
        #: while it has no peers)
        self.told: list[Callable[[], None]] = []
        #: the connections this node's links keep open at most (``--peer-connections``)
        self.budget = Budget(max_links)
        self.links = {node: PeerLink(node, secret, timeout, self.budget)
                      for node in nodes if node != me}
        #: files of a known order fetched ahead of the readers; set by the daemon
        self.hold: Hold | None = None
        #: the peers' files landed here for the kernel to read (``coordlfs.peers.landing``)
        self.landings = Landings()
        self._nursery: trio.Nursery | None = None

    async def replace(self, nodes: tuple[Address, ...]) -> None:
        """Take ``nodes`` as the cluster from now on (the same canonical order on every
        node): this node is found in them again (names resolved in a worker thread), links
        to nodes that joined connect at their first request, those to nodes that left are
        retired. Their counters go with them; the mount's ``reads`` keep the totals.
        UserError (this node named twice): nothing changes."""
        me = None if self.listen is None else await trio.to_thread.run_sync(
            find_self, self.listen, nodes, abandon_on_cancel=True)
        wanted = {node for node in nodes if node != me}
        gone = [link for address, link in self.links.items() if address not in wanted]
        joined = [node for node in nodes if node in wanted and node not in self.links]
        for link in gone:
            del self.links[link.address]
            link.retire()
            if self.hold is not None:
                self.hold.forget_link(link)
        for node in joined:
            link = self.links[node] = PeerLink(node, self.secret, self.timeout, self.budget)
            link.nursery = self._nursery
        self.nodes, self.me = nodes, me
        self.changed_at = time.time()
        self.changes += 1
        for tell in self.told:
            tell()
        log.info("%d nodes from %s: %s joined, %s left; this node is %s", len(nodes),
                 self.source, ", ".join(map(str, joined)) or "none",
                 ", ".join(str(link.address) for link in gone) or "none",
                 me or "not among them (it caches nothing for the others)")

    def owner_of(self, path: bytes) -> PeerLink | None:
        """The link to the node that caches ``path`` while it has room; None for this node."""
        if not self.links:
            return None
        node = owner(path, self.nodes)
        return None if node == self.me else self.links[node]

    def caches_here(self, path: bytes) -> bool:
        return self.owner_of(path) is None

    def candidates(self, path: bytes) -> tuple[list[PeerLink], list[PeerLink]]:
        """The peers ranked before this node for ``path`` (asked before caching it here) and
        those ranked after it (asked when this node's cache is full)."""
        if not self.links:
            return [], []
        order = ranking(path, self.nodes)
        mine = order.index(self.me) if self.me in order else len(order)
        return ([self.links[n] for n in order[:mine]],
                [self.links[n] for n in order[mine + 1:]])

    async def read(self, link: PeerLink, path: bytes, st: os.stat_result, offset: int,
                   size: int) -> bytes | bytearray | None:
        """``size`` bytes at ``offset`` from ``link``'s cache; None: it cannot serve them.
        A range of one request (a small file whole, nearly always) is its reply's payload as
        it was received, not a copy."""
        chunks: list[bytes | bytearray] = []
        for start in range(offset, offset + size, MAX_CHUNK):
            request = Get(path, st.st_size, st.st_mtime_ns, start,
                          min(MAX_CHUNK, offset + size - start))
            try:
                kind, payload = await link.get(request)
            except PeerDown:
                return None
            if kind == Kind.FAIL:
                self._not_served(link, path, *decode_fail(payload))
                return None
            chunks.append(payload)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._served(link, len(data))
        return data

    async def read_many(self, link: PeerLink,
                        files: list[tuple[bytes, os.stat_result]]
                        ) -> list[bytes | memoryview | None]:
        """Whole files (at most ``GetMany.fits`` of them) from ``link``'s cache, in one round
        trip if the peer takes GETMANY (each file a view of the one reply: the reply's memory
        goes when all its files have), else one GET each, all at once; per file its bytes or
        None (the reader asks again, or reads local storage). On a new connection the first
        file goes alone, as a GET: the connection's first frame says whether the peer takes
        GETMANY."""
        results: list[bytes | memoryview | None] = [None] * len(files)

        async def one(i: int, path: bytes, st: os.stat_result) -> None:
            results[i] = await self.read(link, path, st, 0, st.st_size)

        first = 0
        if not link.knows_features:  # a new connection: its first reply tells
            await one(0, *files[0])
            first = 1
        if not link.serves_many or first == len(files):  # an older peer (or down): GETs
            async with trio.open_nursery() as nursery:
                for i in range(first, len(files)):
                    nursery.start_soon(one, i, *files[i])
            return results
        files = files[first:]
        request = GetMany(tuple(Wanted(path, st.st_size, st.st_mtime_ns) for path, st in files))
        try:
            answers = await link.get_many(request)
        except PeerDown:
            return results
        for i, ((path, _st), answer) in enumerate(zip(files, answers, strict=True), first):
            if isinstance(answer, memoryview):
                self._served(link, len(answer))
                results[i] = answer
            else:
                self._not_served(link, path, *answer)
        return results

    def _served(self, link: PeerLink, size: int) -> None:
        link.stats.bytes += size
        self.counters.bytes_from_peers += size

    def _not_served(self, link: PeerLink, path: bytes, code: Fail, message: str) -> None:
        if code == Fail.STALE:
            link.stats.stale += 1
        else:
            link.stats.misses += 1
        log.debug("peer %s: %s %s: %s", link.address, code.name, os.fsdecode(path), message)

    def served_file(self, link: PeerLink) -> None:
        """A reader's first bytes of a file came from ``link`` (the mount counts the open:
        ``ReadCounters.opened``)."""
        link.stats.files += 1

    def prefetch(self, paths: Iterable[bytes]) -> int:
        """The order of coming reads: the files peers cache are fetched ahead into the
        holding area (``coordlfs.peers.hold``); returns how many."""
        return self.hold.prefetch(paths) if self.hold is not None else 0

    async def held(self, path: bytes, st: os.stat_result
                   ) -> tuple[PeerLink, bytes | memoryview] | None:
        """The file from the holding area, if it is there (or on its way) at this version."""
        return await self.hold.take(path, st) if self.hold is not None else None

    async def run(self) -> None:
        """Hold the nursery the links' receive loops run in, until the mount ends."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for link in self.links.values():
                link.nursery = nursery
            if self.hold is not None:
                nursery.start_soon(self.hold.run)
            await trio.sleep_forever()

    def status(self) -> dict[str, Any]:
        return {"self": str(self.me) if self.me else None,
                "nodes": [str(n) for n in self.nodes],
                "open_links": len(self.budget), "max_links": self.budget.limit,
                "evicted_links": self.budget.evicted,
                "source": self.source, "changes": self.changes,
                "changed_at": round(self.changed_at, 3),
                "links": {str(a): link.status() for a, link in self.links.items()},
                "held": self.hold.status() if self.hold is not None else None,
                "landed": self.landings.status()}
