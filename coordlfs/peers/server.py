"""Serving other mounts' misses from this mount's cache.

A peer asks for a range of a file this node owns (``coordlfs.peers.placement``). The file is served
from the cache; a file not yet cached is read from local storage into the cache first, so across the
cluster each file is read from storage once, by its owner, while the owners' caches have room.
When the cache has no room, or the peer's copy of the file differs in size or mtime, the answer is
FAIL and the peer reads its own storage.

Everything a peer sends is hostile until proven otherwise: the connection must pass the
handshake within the timeout, frames are bounded and checksummed (``peer_wire``), and a path
must name a regular file inside the dataset through no symlink. A bad request is refused
alone; a broken frame or an unexpected kind closes the connection. Nothing a peer sends can
stop the mount, or take the descriptors its local readers need: connections are capped
(``connection_cap``, a ``coordlfs.peers.budget.Budget``: one more closes the oldest connection
still in its handshake, else the least recently used idle one, or, when every one is busy, is
told BUSY and closed), a handshake lasts the timeout at most, a frame that trickles in or out
slower than it closes its connection, and so does one idle for ``peer_wire.idle_timeout``.
Strangers who never authenticate thus hold places only until anyone else connects: 500 of
them had filled the cap, and a legitimate peer was told BUSY. Refusals are logged at most once per
``LOG_INTERVAL_S``, with the number of those not logged, so a stranger cannot grow the log.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import resource
import socket
import stat
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import trio
import xxhash

from coordlfs.cache.cache import Entry, WholeFileCache
from coordlfs.errors import UserError
from coordlfs.peers.budget import DEFAULT_LIMIT, Budget
from coordlfs.peers.links import Peers
from coordlfs.peers.placement import Address, resolve
from coordlfs.peers.serving import Serving
from coordlfs.peers.wire import (
    LANE_READY,
    Fail,
    FilePart,
    FrameStream,
    FrameTimeout,
    Get,
    GetMany,
    Kind,
    Part,
    ProtocolError,
    encode_fail,
    encode_files,
    encode_frame,
    idle_timeout,
    send_features,
    server_handshake,
)
from coordlfs.protocol.spec import Caller, Served
from coordlfs.source.source import Source

log = logging.getLogger(__name__)


class _Waiting(NamedTuple):
    """A range served from a cache entry, complete or still being filled."""

    entry: Entry
    request: Get


#: A reply: its kind and payload (a FILES payload in parts, ``encode_files``)
Answer = tuple[Kind, Part | list[Part]]


@dataclass(slots=True)
class _Later:
    """A request's parts, each refused or served from an entry: answered at once when every
    entry is complete, else by a task once they are. ``many``: a GETMANY, whose answers go
    out packed in one FILES frame."""

    parts: list[Answer | _Waiting]
    many: bool


@dataclass(eq=False, slots=True)
class _Served:
    """One admitted connection, as the server's ``Budget`` sees it."""

    stream: trio.SocketStream
    scope: trio.CancelScope
    frames: FrameStream | None = None
    #: authenticated, and waiting for the next frame
    waiting: bool = False
    #: requests answered, and those in progress (waiting for fills, or their replies going
    #: out)
    answered: int = 0
    busy: int = 0

    @property
    def idle(self) -> bool:
        """Closing it loses no request: waiting, with nothing in progress and no byte of a
        next request here. A connection that has not had its first request answered is never
        idle: its peer opened it to ask one (and a request asked again after a close goes on
        a new connection, which must not be closed under it in turn)."""
        return (self.waiting and not self.busy and self.answered > 0
                and self.frames is not None and not self.frames.unread)

    def evict(self) -> None:
        """Close it now: its handler wakes cancelled; the peer asks again elsewhere."""
        self.scope.cancel()
        self.stream.socket.close()

#: Requests one connection may have in progress; more wait for one to finish (the peer's
#: reads of a whole epoch must not become thousands of tasks here).
MAX_IN_PROGRESS = 32
#: Peer connections are served at most ``--peer-connections`` at once (a fixed number, not
#: one per node: ``coordlfs.peers.budget``), and never more than this share of the
#: descriptor limit: the rest is kept for what the mount's local readers open (source files,
#: the cache), which must never meet EMFILE.
DESCRIPTOR_SHARE = 4
#: Seconds between two log lines about refused connections or requests.
LOG_INTERVAL_S = 10.0
#: Seconds to wait before accepting again when the process is out of descriptors or memory.
ACCEPT_RETRY_S = 0.1
#: What ``accept`` fails with when the process is out of descriptors or memory.
ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _say_busy(stream: trio.SocketStream, why: str) -> None:
    """A FAIL BUSY written straight into the socket's buffer, which has room for it: the
    peer reads its own storage for this file (``TurnedAway``), and nothing waits here."""
    with contextlib.suppress(OSError):
        os.write(stream.socket.fileno(), encode_frame(Kind.FAIL, 0, encode_fail(Fail.BUSY, why)))


def connection_cap(wanted: int = DEFAULT_LIMIT) -> int:
    """Peer connections to serve at once: ``wanted`` (``--peer-connections``) within this
    process's soft RLIMIT_NOFILE (which the daemon raised to the hard limit when it
    started)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    share = (1 << 20 if soft == resource.RLIM_INFINITY else soft) // DESCRIPTOR_SHARE
    return max(1, min(wanted, share))


class Digests:
    """The frame checksum of each complete entry served whole, by entry number (never
    reused; a complete entry's file never changes): every epoch after the first serves the
    same files again, and the checksum of a 110 KB file is the one read of its bytes left on
    this side once ``sendfile`` moves them (11 us). Eight bytes per entry number handed
    out; 0 is "not known" (a file whose checksum is 0 is checked each time)."""

    def __init__(self) -> None:
        self._known = array("Q")

    def of(self, entry: Entry, view: memoryview) -> int:
        """The checksum of ``entry``'s whole file, ``view`` (its mapping)."""
        number = entry.offset
        if number < len(self._known) and (digest := self._known[number]):
            return digest
        digest = xxhash.xxh64_intdigest(view)
        if number >= len(self._known):
            self._known.frombytes(bytes(8 * (number + 1 - len(self._known))))
        self._known[number] = digest
        return digest


class RateLimitedLog:
    """Log at most one line per ``interval`` seconds; the next line logged says how many
    were left out, so a flood is visible in the log without filling it."""

    def __init__(self, logger: logging.Logger, level: int, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.level, self.interval, self.clock = logger, level, interval, clock
        self.suppressed = 0
        self._next = -float("inf")

    def __call__(self, message: str, *args: object) -> None:
        now = self.clock()
        if now < self._next:
            self.suppressed += 1
            return
        if self.suppressed:
            message += f" ({self.suppressed} more not logged in the last {self.interval:g} s)"
            self.suppressed = 0
        self._next = now + self.interval
        self.logger.log(self.level, message, *args)


@dataclass(slots=True)
class ServedStats:
    #: connections admitted (handshake attempted)
    connections: int = 0
    #: files asked for, alone (GET) or in batches (GETMANY)
    requests: int = 0
    batches: int = 0
    bytes: int = 0
    misses: int = 0
    stale: int = 0
    #: connections that failed the handshake, broke the protocol or a frame timeout, and
    #: refused requests
    refused: int = 0
    #: connections told BUSY and closed: ``max_connections`` were open, none of them idle
    turned_away: int = 0
    #: connections closed in their handshake (told BUSY) to make room for a newer one
    handshakes_closed: int = 0
    #: idle connections closed to make room for a new one
    evicted: int = 0
    #: authenticated connections closed after the idle timeout
    idle_closed: int = 0
    open_connections: int = 0
    max_connections: int = 0


def listen_socket(address: Address) -> socket.socket:
    """Bind now, before the mount exists, so a port in use is a one-line error at mount time.
    An IPv6 socket takes IPv4 connections too (``[::]:PORT`` listens on every address)."""
    where = resolve(address)
    sock = socket.socket(where.family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        if where.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(where.sockaddr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {address}: {e.strerror or e}") from None
    return sock


class PeerServer:
    """Serves peers on ``sock``: ``timeout`` bounds the handshake and every frame,
    ``idle_timeout(timeout)`` an authenticated connection with no frame, and at most
    ``max_connections`` are open at once."""

    def __init__(self, sock: socket.socket, secret: bytes, timeout: float, source: Source,
                 cache: WholeFileCache, max_connections: int = DEFAULT_LIMIT) -> None:
        self.sock = sock
        self.secret = secret
        self.timeout = timeout
        self.source = source
        self.cache = cache
        self.stats = ServedStats(max_connections=max_connections)
        self.budget = Budget(max_connections)
        #: the budget's connections still in their handshake, oldest first
        self._handshaking: OrderedDict[_Served, None] = OrderedDict()
        self.nursery: trio.Nursery | None = None
        #: answers a peer's WARM (``coordlfs.peers.warm.answer``); set by the daemon
        self.warm: Callable[[bytes | bytearray], Answer] | None = None
        #: the C path that serves peers' request lanes (``coordlfs.peers.serving``); set by
        #: the daemon where it can be had
        self.serving: Serving | None = None
        self._refused = RateLimitedLog(log, logging.WARNING, LOG_INTERVAL_S)
        self._digests = Digests()

    async def run(self) -> None:
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self.sock))
        async with trio.open_nursery() as nursery:
            self.nursery = nursery  # fills started for peers outlive their request
            if self.serving is not None:
                nursery.start_soon(self._tickets, self.serving)
            async with trio.open_nursery() as connections:
                while True:
                    if len(self.budget) >= self.budget.limit:  # room before a new descriptor
                        await trio.lowlevel.wait_readable(listener.socket)
                        self._room()
                    if (stream := await self._accept(listener)) is None:
                        continue
                    if self._room():
                        served = _Served(stream, trio.CancelScope())
                        self.budget.add(served)
                        self._handshaking[served] = None
                        connections.start_soon(self._connection, served)
                    else:
                        self._turn_away(stream)

    def _room(self) -> bool:
        """The budget's ``room``, but first by closing the oldest connection still in its
        handshake: a stranger's place is the first to go, an authenticated peer's idle
        connection only after."""
        if len(self.budget) >= self.budget.limit and self._handshaking:
            oldest, _ = self._handshaking.popitem(last=False)
            self.budget.release(oldest)
            self.stats.handshakes_closed += 1
            why = (f"{self.budget.limit} peer connections open, the most served at once; "
                   "closed in its handshake for a newer one")
            self._refused("peer connection from %s turned away: %s", _name(oldest.stream), why)
            _say_busy(oldest.stream, why)
            oldest.evict()
        return self.budget.room()

    async def _accept(self, listener: trio.SocketListener) -> trio.SocketStream | None:
        """The next connection; None after a pause when the process is out of descriptors
        or memory (local readers hold them: the connection waits in the backlog), logged
        rate-limited where ``trio.serve_listeners`` logs an ERROR ten times a second."""
        try:
            return await listener.accept()
        except OSError as e:
            if e.errno not in ACCEPT_RESOURCE_ERRNOS:
                raise
            self._refused("cannot accept peer connections now: %s", e.strerror or e)
            await trio.sleep(ACCEPT_RETRY_S)
            return None

    async def _connection(self, served: _Served) -> None:
        stream = served.stream
        peer = _name(stream)
        with served.scope:
            self.stats.connections += 1
            frames = served.frames = FrameStream(stream, frame_timeout=self.timeout)
            try:
                admitted = await self._admit(frames, peer)
                self._handshaking.pop(served, None)
                if admitted:
                    async with trio.open_nursery() as requests:
                        await self._serve_frames(frames, requests, peer, served)
            except Exception:  # a bug here must cost one connection, never the mount
                log.exception("peer connection from %s failed", peer)
            finally:
                self._handshaking.pop(served, None)
                self.budget.release(served)
                await trio.aclose_forcefully(stream)
        if served.scope.cancelled_caught:
            log.debug("peer connection from %s closed for a new one", peer)

    def _turn_away(self, stream: trio.SocketStream) -> None:
        """Tell a connection past the cap that this node is busy (the peer reads its own
        storage for this file) and close it at once: its one small frame goes into the new
        socket's empty buffer, so nothing waits and no descriptor is held past the cap."""
        self.stats.turned_away += 1
        busy = f"{len(self.budget)} peer connections open, the most served at once, none idle"
        self._refused("peer connection from %s turned away: %s", _name(stream), busy)
        _say_busy(stream, busy)
        stream.socket.close()

    async def _admit(self, frames: FrameStream, peer: str) -> bool:
        """The handshake, within the timeout; any failure (not only a wrong proof: also
        silence, garbage or a reset) is a refusal, logged rate-limited since a stranger
        can cause any number of them."""
        try:
            with trio.fail_after(self.timeout):
                await server_handshake(frames, self.secret)
            return True
        except trio.TooSlowError:
            reason = f"no handshake within {self.timeout:g} s"
        except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError,
                OSError) as e:
            reason = str(e) or e.__class__.__name__
        self.stats.refused += 1
        self._refused("peer connection from %s refused: %s", peer, reason)
        return False

    async def _serve_frames(self, frames: FrameStream, requests: trio.Nursery,
                            peer: str, served: _Served) -> None:
        """Read requests until the peer hangs up or stays idle; a broken or too slow frame
        ends the connection (caught here, inside the nursery, so that its requests' tasks
        stop with it)."""
        limit = trio.CapacityLimiter(MAX_IN_PROGRESS)
        idle = idle_timeout(self.timeout)
        # one scope for the connection, its deadline moved on (at most once a second) as
        # frames come: a scope of its own for every wait cost each request a few per cent
        watch = trio.CancelScope(deadline=trio.current_time() + idle)
        try:  # the features first: a client gone right after its handshake is lost, no bug
            await send_features(frames)
            with watch:
                await self._requests(frames, requests, peer, served, limit, watch, idle)
        except ProtocolError as e:
            self._broken(peer, e)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            log.info("peer connection from %s lost: %s", peer, e)
        if watch.cancelled_caught:
            self.stats.idle_closed += 1
            log.debug("peer connection from %s closed: no frame for %g s", peer, idle)
        requests.cancel_scope.cancel()

    async def _requests(self, frames: FrameStream, requests: trio.Nursery, peer: str,
                        served: _Served, limit: trio.CapacityLimiter, watch: trio.CancelScope,
                        idle: float) -> None:
        """Answer requests until the peer hangs up; ``watch``'s deadline, moved on as they
        come, closes an idle connection."""
        while True:
            served.waiting = True
            frame = await frames.receive()
            served.waiting = False
            if frame is None:
                return
            if (now := trio.current_time()) + idle > watch.deadline + 1:
                watch.deadline = now + idle
            served.answered += 1
            self.budget.used(served)
            if frame.kind in (Kind.GET, Kind.GETMANY):
                answer = self._answer_now(frame.kind, frame.payload)
                if isinstance(answer, _Later):  # a fill in progress: answer in a task
                    token = object()
                    await limit.acquire_on_behalf_of(token)
                    served.busy += 1
                    requests.start_soon(self._request, frames, frame.request_id, answer,
                                        limit, token, peer, served)
                else:
                    await _send(frames, frame.request_id, answer)
            elif frame.kind == Kind.LANE:
                await frames.send(Kind.DATA, 0, LANE_READY)
                if self._hand_over(frames):
                    return
            elif frame.kind == Kind.WARM and self.warm is not None:
                try:
                    kind, payload = self.warm(frame.payload)
                except ProtocolError as e:  # a malformed WARM: refused alone
                    kind, payload = self._refuse(e)
                await frames.send(kind, frame.request_id, payload)
            else:
                raise ProtocolError(f"unexpected {frame.kind.name} frame")

    def _hand_over(self, frames: FrameStream) -> bool:
        """A request lane's connection, served in C from now on if the C path takes it (it
        has room, and nothing of a next frame was read here: what waits in the socket is the
        C path's to read): a descriptor of its own, this one closed by the connection's
        handler."""
        if self.serving is None or frames.buffered:
            return False
        fd = os.dup(frames.stream.socket.fileno())
        if self.serving.hand(fd):
            return True
        os.close(fd)
        return False

    async def _tickets(self, serving: Serving) -> None:
        """Answer the GETs the C path hands here, as those of a connection of this loop's."""
        while True:
            await trio.lowlevel.wait_readable(serving.fd)
            for ticket, payload in serving.take():
                try:
                    answer = self._answer_now(Kind.GET, payload)
                except Exception as e:  # a bug answering one request fails that request only
                    answer = _failed(e)
                if isinstance(answer, _Later):
                    assert self.nursery is not None
                    self.nursery.start_soon(self._ticket_later, serving, ticket, answer)
                else:
                    _give(serving, ticket, answer)

    async def _ticket_later(self, serving: Serving, ticket: int, later: _Later) -> None:
        answer: Answer = (Kind.FAIL, encode_fail(Fail.ERROR, "not answered"))
        try:
            answer = await self._answered(later)
        finally:  # the C path's thread waits for it, cancelled or not
            _give(serving, ticket, answer)

    def _broken(self, peer: str, e: ProtocolError) -> None:
        self.stats.refused += 1
        self._refused("peer connection from %s closed: %s", peer, e)

    async def _request(self, frames: FrameStream, request_id: int, later: _Later,
                       limit: trio.CapacityLimiter, token: object, peer: str,
                       served: _Served) -> None:
        try:
            answer = await self._answered(later)
            # a peer that is gone is noticed by its connection handler
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError,
                                     OSError):
                await _send(frames, request_id, answer)
        except FrameTimeout as e:  # it does not read: closing ends its connection handler
            self._broken(peer, e)
            await trio.aclose_forcefully(frames.stream)
        finally:
            served.busy -= 1
            limit.release_on_behalf_of(token)

    async def _answered(self, later: _Later) -> Answer:
        """The reply once every fill it waits for has come (or failed: an entry dropped
        meanwhile has failed); a bug answering one request fails that request only."""
        try:
            for part in later.parts:
                if isinstance(part, _Waiting):
                    await self.cache.wait_for(part.entry,
                                              part.request.offset + part.request.length)
            return self._reply(later)
        except Exception as e:
            return _failed(e)

    def _answer_now(self, kind: Kind, payload: bytes | bytearray) -> Answer | _Later:
        """Everything about a request that needs no waiting, on the event loop: the answer,
        or the answers some of which wait for entries being filled. A malformed request is
        refused whole; each file of a GETMANY is answered as a GET of it would be."""
        try:
            if kind == Kind.GET:
                self.stats.requests += 1
                later = _Later([self._answer_get(Get.decode(payload))], many=False)
            else:
                files = GetMany.decode(payload).files
                self.stats.batches += 1
                self.stats.requests += len(files)
                later = _Later([self._answer_get(wanted.get()) for wanted in files], many=True)
        except ProtocolError as e:
            return self._refuse(e)
        if any(isinstance(p, _Waiting) and not p.entry.complete for p in later.parts):
            return later
        return self._reply(later)

    def _reply(self, later: _Later) -> Answer:
        """The reply once every range it serves has arrived (or its fill failed): views of
        the cache, taken with no await until the frame's checksum is (``_data``)."""
        answers = [self._filled(p) if isinstance(p, _Waiting) else p for p in later.parts]
        return (Kind.FILES, encode_files(answers)) if later.many else answers[0]

    def _refuse(self, e: ProtocolError) -> Answer:
        self.stats.refused += 1
        self._refused("refused a peer request: %s", e)
        return Kind.FAIL, encode_fail(Fail.REFUSED, str(e))

    def _answer_get(self, request: Get) -> Answer | _Waiting:
        """Why one range is not served, or the entry (complete or filling) it is served
        from. Metadata is looked up inline, as FUSE lookups are: the source's dentries are
        normally cached."""
        try:
            st = self._regular_file(request.path)
        except ProtocolError as e:
            return self._refuse(e)
        except OSError as e:
            self.stats.misses += 1
            return Kind.FAIL, encode_fail(Fail.MISS, e.strerror or str(e))
        if (st.st_size, st.st_mtime_ns) != (request.size, request.mtime_ns):
            self.stats.stale += 1
            return Kind.FAIL, encode_fail(Fail.STALE, f"here {st.st_size} bytes, mtime "
                                                      f"{st.st_mtime_ns}")
        assert self.nursery is not None
        entry = self.cache.start_fill((st.st_dev, st.st_ino), request.path, st, self.source,
                                      self.nursery)
        if entry is None:
            self.stats.misses += 1
            return Kind.FAIL, encode_fail(Fail.MISS, "not cached here")
        return _Waiting(entry, request)

    def _filled(self, waiting: _Waiting) -> Answer:
        """The answer once the range has been filled, or its fill failed."""
        entry, request = waiting
        if entry.failed:
            self.stats.misses += 1
            return Kind.FAIL, encode_fail(Fail.MISS, "caching failed here")
        return self._data(entry, request)

    def _data(self, entry: Entry, request: Get) -> Answer:
        """The cached range: of a complete entry, its file's range, sent by ``sendfile``
        (no copy through Python), its checksum taken from the cache's mapping of the same
        file; of an entry still filling, a copy. A complete entry's file never changes (one
        dropped is unlinked, and this descriptor keeps its bytes), so the checksum is that
        of the bytes sent, and the receiver checks it before it serves them."""
        self.stats.bytes += request.length
        view = self.cache.data(entry, request.offset, request.length)
        if not entry.complete or not isinstance(view, memoryview):
            return Kind.DATA, view
        digest = self._digests.of(entry, view) if request.length == entry.size else None
        return Kind.DATA, FilePart(self.cache.entry_fd(entry), request.offset, view, digest)

    def _regular_file(self, path: bytes) -> os.stat_result:
        """The file's status, if every component is inside the dataset and no symlink: the
        source's walk follows no link on the way (ELOOP), and the file itself is looked at as
        a link if it is one."""
        try:
            st = self.source.lstat(path)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            st = None
        if st is None or stat.S_ISLNK(st.st_mode):
            raise ProtocolError(f"{os.fsdecode(path)!r} goes through a symlink")
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EISDIR, "not a regular file")
        return st

    def status(self) -> dict[str, Any]:
        """The server's counts; with the C path, what it did too (``in_c``), counted among
        the server's: its files and bytes among ``requests`` and ``bytes``, its faults among
        ``refused``, its idle closes and open connections among theirs."""
        self.stats.open_connections = len(self.budget)
        self.stats.max_connections = self.budget.limit
        self.stats.evicted = self.budget.evicted
        status = asdict(self.stats)
        if self.serving is not None:
            in_c = status["in_c"] = self.serving.counts()
            for mine, its in (("requests", "files"), ("bytes", "bytes"), ("refused", "faults"),
                              ("idle_closed", "idle_closed"),
                              ("open_connections", "open_connections")):
                status[mine] += in_c[its]
        return status


async def _send(frames: FrameStream, request_id: int, answer: Answer) -> None:
    """Send a reply, then close the descriptors of the cache files it sent ranges of."""
    kind, payload = answer
    try:
        await frames.send(kind, request_id, payload)
    finally:
        for part in payload if isinstance(payload, list) else [payload]:
            if isinstance(part, FilePart):
                os.close(part.fd)


def _failed(e: Exception) -> Answer:
    """A bug answering one request: logged, and that request alone fails."""
    log.exception("answering a peer request failed")
    return Kind.FAIL, encode_fail(Fail.ERROR, str(e))


def _give(serving: Serving, ticket: int, answer: Answer) -> None:
    """The C path's GET answered (a copy of its bytes: a cache file's range mapped), the
    descriptors of cache files it served closed."""
    kind, part = answer
    assert not isinstance(part, list)  # a GET's answer is one part
    try:
        serving.answer(ticket, kind, bytes(part.view if isinstance(part, FilePart) else part))
    finally:
        if isinstance(part, FilePart):
            os.close(part.fd)


def _name(stream: trio.SocketStream) -> str:
    """The peer's address for the log; an IPv4 peer of a dual-stack (``[::]``) socket as
    IPv4, not ``[::ffff:a.b.c.d]``."""
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    mapped = getattr(ipaddress.ip_address(host), "ipv4_mapped", None)
    return str(Address(str(mapped) if mapped else host, port))


def register_commands(control: Served, peers: Peers, server: PeerServer | None) -> None:
    """``peer.list`` (the cluster as this mount sees it) and ``peer.owner`` (who caches a
    path), so a job or tool can see where its files come from. Both only report: anyone may
    run them."""

    def owner(args: dict, _caller: Caller) -> dict:
        link = peers.owner_of(os.fsencode(args["path"]))
        return {"owner": str(link.address) if link else (str(peers.me) if peers.me else None),
                "here": link is None}

    control.serve("peer.list", lambda _a, _c: {"peers": peers.status(),
                                               "served": server.status() if server else None})
    control.serve("peer.owner", owner)
