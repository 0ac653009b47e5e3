"""Wire format between coordlfs peers: framing, mutual authentication, request payloads.

A mount fetches a cache miss from the peer that caches the file over one kept-alive TCP
connection per peer, with many requests in flight; replies carry the request's id, so
they may come back in any order. Every message is one frame, a 22-byte header in network
byte order followed by the payload::

    offset  size  field
    0       4     magic b"CLFP"
    4       1     version (1)
    5       1     kind (Kind)
    6       4     request id (u32), echoed by the reply
    10      4     payload length (u32, at most MAX_PAYLOAD)
    14      8     XXH64 (seed 0) of the payload
    22      n     payload

A header that announces more than MAX_PAYLOAD is refused before its payload is read, so a
hostile peer cannot make us allocate. Payloads by kind: GET is ``!QqQI`` (source file size,
mtime_ns, offset, length <= MAX_CHUNK) followed by the path, raw POSIX bytes relative to
the dataset root; DATA is the bytes of the range; FAIL is one code byte (Fail) and a UTF-8
message of at most 200 bytes.

GETMANY asks for up to MAX_FILES whole files of at most MAX_CHUNK bytes in all, so that a
known order of small files moves at the link's speed rather than one round trip per file:
``!H`` count, then per file ``!QqH`` (size >= 1, mtime_ns, path length) and the path, each
path as a GET's. Its reply is one FILES frame: per file, in the request's order, ``!BI``
(0 and the file's bytes, exactly its size; or a Fail code and a message of at most 200
bytes), so a file that cannot be served (MISS, STALE, a symlink REFUSED) fails alone. A
GETMANY that is malformed as a whole is answered FAIL REFUSED, as a bad GET is.

WARM asks a peer to fill its cache with files of a warm (``coordlfs warm --all-nodes``; the
peer queues those it caches in its fill queue, as ``prefetch`` would) and says how far that
warm has come there: ``!QBH`` (the warm's token, flags: 1 cancel, the count of paths), then
per path ``!H`` (its length) and the path, each as a GET's; no paths asks only how far it has
come, cancel drops what the peer still has queued of it. Its reply is a DATA frame of
``WARM_REPLY``: how many of the paths were taken, then the warm's counts there, in the order
of ``coordlfs.protocol.spec.WARM_COUNTS``. A malformed WARM is answered FAIL REFUSED; one the
peer cannot take now (too many warms at once), FAIL BUSY.

LANE (request id 0, no payload) says the connection is a request lane's
(``coordlfs.fs.lane_peers``): from now on one GET at a time, each of a whole file. The server
answers DATA with request id 0 (``LANE_READY``) when nothing of a next frame has come, and may
then serve the connection on a path of its own (``coordlfs.peers.serving``); the client sends
its first GET only after that reply, and LANE only to a server that lists ``lane``.

Features, without a new version: a server that knows GETMANY sends, right after WELCOME, a
DATA frame with request id 0 (never a request's id) whose payload lists what it serves
(``FEATURES``, space-separated). A client of version 1 before GETMANY ignores it (a reply
to no request); a new client sends GETMANY only on a connection whose first frame after the
handshake was that list, so it never sends an old server a kind it does not know (an old
server closes the connection on an unknown kind). ``VERSION`` changes only for a change an
old peer cannot ignore; both sides then refuse each other's frames, which reads local storage.

Handshake (every frame with request id 0), proving both ways that the other side holds
the shared secret without ever sending it; ``|`` is concatenation, HMAC is HMAC-SHA256::

    server -> client  HELLO    server_nonce (32 random bytes)
    client -> server  AUTH     client_nonce (32 random bytes)
                               | HMAC(secret, b"coordlfs-client\\0" | server_nonce | client_nonce)
    server -> client  WELCOME  HMAC(secret, b"coordlfs-server\\0" | client_nonce | server_nonce)
                      or FAIL  REFUSED "authentication failed", and the server hangs up

Fresh nonces on both sides defeat replay, and the distinct labels stop one side's proof
from being reflected as the other's. An insecure pair simply uses ``secret=b""`` on both
sides; a side with a secret and one without fail each other's handshake. A server that has
no room for another connection sends FAIL BUSY instead of HELLO and hangs up; one that closes
a connection still in its handshake for a newer one sends FAIL BUSY in place of WELCOME. Either
is ``TurnedAway``: not a fault of the peer's.

Time limits: a frame, once its first byte has come (or, sending, once it starts to go out),
must be complete within the stream's ``frame_timeout`` (the mount's ``--peer-timeout``), so a
peer that trickles bytes or stops reading holds nothing for long; and a connection on which
no frame starts for ``idle_timeout(peer_timeout)`` is closed by the server (clients close
theirs at half that, first).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import hashlib
import hmac
import math
import os
import secrets
import socket
import struct
import sys
import termios
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import trio
import xxhash

from coordlfs.protocol.spec import WARM_COUNTS

#: What a frame's payload, or a part of it, may be.
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class FilePart:
    """A part of a payload that is a range of a file (a complete cache entry's): sent by
    ``sendfile``, the kernel moving the file's pages to the socket with no copy through
    Python. ``view`` is the same bytes mapped (the cache's mapping of the file), which the
    frame's checksum is taken from before the first await; the file must not change (a
    complete entry's never does: a dropped one is unlinked, never rewritten)."""

    fd: int
    offset: int
    view: memoryview
    #: the checksum of ``view``, if known (a frame of this part alone is sent with it)
    digest: int | None = None

    def __len__(self) -> int:
        return len(self.view)


#: A part of a payload as ``FrameStream.send`` takes it.
Part = Buffer | FilePart

MAGIC = b"CLFP"
VERSION = 1
HEADER = struct.Struct("!4sBBIIQ")
#: The most data one GET may ask for.
MAX_CHUNK = 1 << 20
#: The largest payload a frame may carry: a full chunk plus room for a GET's path.
MAX_PAYLOAD = MAX_CHUNK + 4096
GET_HEADER = struct.Struct("!QqQI")
MAX_PATH = 4096
MAX_FAIL_MESSAGE = 200
#: Files one GETMANY may ask for: their replies' headers and failure messages fit beside a
#: full chunk of data in one frame.
MAX_FILES = 16
MANY_HEADER = struct.Struct("!H")
MANY_FILE = struct.Struct("!QqH")
FILES_ENTRY = struct.Struct("!BI")
WARM_HEADER = struct.Struct("!QBH")
WARM_PATH = struct.Struct("!H")
#: WARM's flag that drops what the peer still has queued of the warm
WARM_CANCEL = 1
#: A WARM's reply: paths taken, then ``WARM_COUNTS``.
WARM_REPLY = struct.Struct(f"!Q{len(WARM_COUNTS)}Q")
#: What this side serves beyond GET, sent after WELCOME (see the module's docstring).
FEATURES = (b"getmany", b"warm", b"lane")
#: The server's reply to LANE.
LANE_READY = b"lane"
NONCE_SIZE = 32
#: Bytes a frame's header is read with: a request or a failure comes whole in one read, and
#: no more than this of a large payload is copied on its way into the payload's own buffer.
_BUFFER_SIZE = 4096
#: Parts one ``writev`` may take, well below any IOV_MAX; a frame in more is joined.
_MAX_PARTS = 256
#: A connection idle this many peer timeouts is closed by the server: long enough that a
#: job's pauses between reads (an evaluation, a checkpoint) rarely cost a reconnection (one
#: round trip), short enough that dead or idle peers do not hold descriptors for long.
IDLE_TIMEOUTS = 10


def idle_timeout(peer_timeout: float) -> float:
    """Seconds the server keeps an authenticated connection on which no frame starts."""
    return IDLE_TIMEOUTS * peer_timeout


class Kind(enum.IntEnum):
    HELLO = 1
    AUTH = 2
    WELCOME = 3
    GET = 4
    DATA = 5
    FAIL = 6
    GETMANY = 7
    FILES = 8
    WARM = 9
    LANE = 10


class Fail(enum.IntEnum):
    MISS = 1  # the peer does not cache the file (any more)
    STALE = 2  # the peer's file has another size or mtime
    REFUSED = 3  # hostile or unauthenticated request
    ERROR = 4  # the peer failed reading
    BUSY = 5


class ProtocolError(Exception):
    """The other side sent malformed or hostile bytes; the connection is beyond repair."""


class AuthError(ProtocolError):
    """The other side could not prove it holds the secret."""


class TurnedAway(ProtocolError):
    """The server has no room for another connection now (BUSY): not a fault of it."""


class FrameTimeout(ProtocolError):
    """A frame took longer than the frame timeout to arrive or to go out: the peer trickles
    bytes or does not read. Part of a frame may have passed, so the stream is out of step."""


class IdleTimeout(Exception):
    """No frame started within the idle timeout; the stream is still in step."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    request_id: int
    #: a large payload is the buffer it was received into (``FrameStream._payload``)
    payload: bytes | bytearray


class _Late(Exception):
    """Waiting for the socket outlasted the deadline; the caller says which one."""


class FrameStream:
    """Frames over a trio stream: any number of tasks may send, but only one may receive
    at a time (the connection's reader task), since frames are cut from a shared buffer.

    Over a socket (every connection between peers) the bytes are read and written with
    plain non-blocking system calls, waiting for the socket (``trio.lowlevel``) only when one
    would block: a frame that is there costs its system calls and no pass through trio's
    scheduler, where every call of trio's socket methods cost one (``docs/benchmarks/
    cluster.md``: a quarter of the peer protocol's CPU on each side). A receive that did
    not have to wait yields once all the same, so a peer that sends frames back to back cannot
    hold the loop. Headers and small frames come through a small buffer, a payload larger
    than what is buffered straight into a buffer of its own, which becomes the frame's
    payload: no other copy. Any other stream (tests' memory streams) goes through its own
    ``receive_some`` and ``send_all``.

    After a ProtocolError (a FrameTimeout too) the stream is out of step with the peer:
    close it. ``frame_timeout`` bounds each frame once it has started, both ways.
    """

    def __init__(self, stream: trio.abc.Stream, frame_timeout: float = math.inf) -> None:
        self.stream = stream
        self.frame_timeout = frame_timeout
        #: the trio socket under ``stream``, if it is one (its descriptor is read directly)
        self._socket = getattr(stream, "socket", None)
        self._buffer = bytearray(_BUFFER_SIZE)
        self._view = memoryview(self._buffer)
        #: the buffered bytes not yet cut into frames: ``_buffer[_start:_end]``
        self._start = self._end = 0
        #: a receive waited for the socket (passed through the scheduler); one is cutting a frame
        self._waited = self._in_frame = False
        self._send_lock = trio.Lock()

    async def send(self, kind: Kind, request_id: int,
                   payload: Part | Sequence[Part] = b"") -> None:
        """Send one frame, never interleaved with another's bytes. The payload may come in
        parts (a batch's files, views of the cache, ranges of the cache's files): the
        checksum is taken over them before the first await, and they go out as they are
        (buffers in one ``sendmsg``, file ranges by ``sendfile``) where the stream is a
        socket, rather than copied behind its header."""
        parts = [payload] if isinstance(payload, Part) else list(payload)
        length = sum(map(len, parts))
        if length > MAX_PAYLOAD:
            raise ValueError(f"payload of {length} bytes exceeds {MAX_PAYLOAD}")
        if not 0 <= request_id < 1 << 32:
            raise ValueError(f"request id {request_id} out of range")
        parts.insert(0, HEADER.pack(MAGIC, VERSION, kind, request_id, length,
                                    _digest(parts)))
        if len(parts) > _MAX_PARTS:
            parts = [_joined(parts)]
        try:  # taken at once unless another send waits for the socket: no await then
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            await self._send_parts(parts, trio.current_time() + self.frame_timeout)
        except _Late:
            raise FrameTimeout(f"the peer took more than {self.frame_timeout:g} s to take a "
                               f"{Kind(kind).name} frame of {length} bytes") from None
        finally:
            self._send_lock.release()

    async def _send_parts(self, parts: list[Part], deadline: float) -> None:
        if self._socket is None:
            with trio.move_on_at(deadline) as scope:
                await self.stream.send_all(_joined(parts))
            if scope.cancelled_caught:
                raise _Late
            return
        runs = _runs(parts)
        for i, run in enumerate(runs):
            more = i + 1 < len(runs)  # the header does not go out alone
            try:
                if isinstance(run, FilePart):
                    await self._send_file(run, deadline)
                else:
                    await self._send_buffers(run, more, deadline)
            except OSError as e:  # as SocketStream.send_all says it
                raise trio.BrokenResourceError(f"socket connection broken: {e}") from e

    async def _send_buffers(self, views: list[memoryview], more: bool, deadline: float) -> None:
        """Buffers in one ``sendmsg`` (continued where the socket took part of them), with
        MSG_MORE when a file's range follows, so that the two leave as one segment."""
        flags = socket.MSG_MORE if more else 0
        while views:
            try:
                sent = self._stdlib_socket().sendmsg(views, (), flags)
            except BlockingIOError:
                await self._wait(trio.lowlevel.wait_writable, deadline)
                continue
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    async def _send_file(self, part: FilePart, deadline: float) -> None:
        """A file's range by ``sendfile``: its pages go to the socket, not through Python."""
        offset, end = part.offset, part.offset + len(part.view)
        while offset < end:
            try:
                sent = os.sendfile(self._fd(), part.fd, offset, end - offset)
            except BlockingIOError:
                await self._wait(trio.lowlevel.wait_writable, deadline)
                continue
            if not sent:  # the file is shorter than its view said: the frame is torn
                raise OSError(errno.EIO, "a file sent ended early")
            offset += sent

    def _stdlib_socket(self) -> socket.socket:
        """The standard library's socket under the trio socket (``sendmsg`` with flags,
        without trio's pass through the scheduler); ClosedResourceError once closed."""
        self._fd()
        return self._socket._sock  # trio keeps it there, as its own methods use it

    async def receive(self, idle_timeout: float = math.inf) -> Frame | None:
        """The next frame, or None when the peer closed the connection between frames.
        IdleTimeout if no byte of it comes within ``idle_timeout``; FrameTimeout if, once its
        first byte is here, the rest takes longer than the frame timeout."""
        self._waited = False
        if self._start == self._end:
            self._start = self._end = 0
            try:
                self._end = await self._read(self._view, trio.current_time() + idle_timeout)
            except _Late:
                raise IdleTimeout(f"no frame for {idle_timeout:g} s") from None
            if not self._end:
                return None
        self._in_frame = True
        try:
            if not self._waited:  # no pass through the scheduler yet: one now, for the others
                await trio.lowlevel.cancel_shielded_checkpoint()
            return await self._frame(trio.current_time() + self.frame_timeout)
        except _Late:
            raise FrameTimeout(f"a frame took more than {self.frame_timeout:g} s to "
                               "arrive") from None
        finally:
            self._in_frame = False

    async def _frame(self, deadline: float) -> Frame:
        """Cut one whole frame from the stream, its first byte already buffered."""
        while self._end - self._start < HEADER.size:
            if self._end == len(self._buffer):  # the header's start is at the buffer's end
                self._buffer[:self._end - self._start] = bytes(self._view[self._start:self._end])
                self._start, self._end = 0, self._end - self._start
            got = await self._read(self._view[self._end:], deadline)
            if not got:
                raise ProtocolError("connection closed mid-frame")
            self._end += got
        magic, version, kind, request_id, length, digest = HEADER.unpack_from(self._buffer,
                                                                             self._start)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}, not a coordlfs peer")
        if version != VERSION:
            raise ProtocolError(f"unsupported protocol version {version}")
        if kind not in Kind._value2member_map_:
            raise ProtocolError(f"unknown frame kind {kind}")
        if length > MAX_PAYLOAD:  # before reading: never allocate what a peer announces
            raise ProtocolError(f"frame announces {length} bytes, more than {MAX_PAYLOAD}")
        self._start += HEADER.size
        payload = await self._payload(length, deadline)
        if xxhash.xxh64_intdigest(payload) != digest:
            raise ProtocolError(f"checksum mismatch in {Kind(kind).name} frame {request_id}")
        return Frame(Kind(kind), request_id, payload)

    async def _payload(self, length: int, deadline: float) -> bytes | bytearray:
        """The frame's payload, its header already cut: a copy of the buffered bytes if it is
        all there, else a buffer of its size that the rest is read straight into."""
        have = self._end - self._start
        if length <= have:
            payload = bytes(self._view[self._start:self._start + length])
            self._start += length
            return payload
        buffer = bytearray(length)
        with memoryview(buffer) as view:
            view[:have] = self._view[self._start:self._end]
            self._start = self._end = 0
            while have < length:
                got = await self._read(view[have:], deadline)
                if not got:
                    raise ProtocolError("connection closed mid-frame")
                have += got
        return buffer

    async def _read(self, view: memoryview, deadline: float) -> int:
        """Bytes into ``view``: what is there, at least one (waiting until ``deadline``
        for it); 0 at the end of the stream."""
        if self._socket is None:
            with trio.move_on_at(deadline) as scope:
                data = await self.stream.receive_some(len(view))
            if scope.cancelled_caught:
                raise _Late
            self._waited = True
            view[:len(data)] = data
            return len(data)
        while True:
            try:
                return os.readv(self._fd(), [view])
            except BlockingIOError:
                await self._wait(trio.lowlevel.wait_readable, deadline)
            except OSError as e:  # a reset
                raise trio.BrokenResourceError(f"socket connection broken: {e}") from e

    @property
    def buffered(self) -> bool:
        """Whether bytes of a frame were read from the socket and not yet handed out: being
        received, or buffered here."""
        return self._in_frame or self._start != self._end

    @property
    def unread(self) -> bool:
        """Whether a frame is on its way in: being received, buffered, or waiting in the
        socket."""
        if self.buffered:
            return True
        fd = -1 if self._socket is None else self._socket.fileno()
        if fd < 0:
            return False
        return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, bytes(4)), sys.byteorder) > 0

    def _fd(self) -> int:
        """The socket's descriptor, taken right before each system call: a closed socket's
        number may already name another file."""
        fd = self._socket.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("the connection was closed")
        return fd

    async def _wait(self, wait: Callable[[Any], Awaitable[None]], deadline: float) -> None:
        """Until the socket is ready for what ``wait`` waits for, or ``_Late`` after
        ``deadline``; a socket closed meanwhile raises ClosedResourceError."""
        self._waited = True
        if deadline == math.inf:
            await wait(self._socket)
            return
        with trio.move_on_at(deadline):
            await wait(self._socket)
            return
        raise _Late

    async def aclose(self) -> None:
        await self.stream.aclose()


def _digest(parts: list[Part]) -> int:
    """The checksum of a payload in parts: known already for a file's range sent alone."""
    if len(parts) == 1 and isinstance(parts[0], FilePart) and parts[0].digest is not None:
        return parts[0].digest
    digest = xxhash.xxh64()
    for part in parts:
        digest.update(part.view if isinstance(part, FilePart) else part)
    return digest.intdigest()


def _joined(parts: list[Part]) -> bytes:
    """The parts as one buffer (a stream that is not a socket, or too many parts)."""
    return b"".join(part.view if isinstance(part, FilePart) else part for part in parts)


def _runs(parts: list[Part]) -> list[list[memoryview] | FilePart]:
    """The parts cut into what goes out by one call each: file ranges alone, the buffers
    between them together (at most ``_MAX_PARTS``); empty buffers dropped."""
    runs: list[list[memoryview] | FilePart] = []
    for part in parts:
        if isinstance(part, FilePart):
            runs.append(part)
        elif len(part):
            if not runs or isinstance(runs[-1], FilePart):
                runs.append([])
            last = runs[-1]
            assert isinstance(last, list)
            last.append(memoryview(part))
    return runs


def encode_frame(kind: Kind, request_id: int, payload: bytes) -> bytes:
    """One whole small frame, for a sender that must not wait (a server turning a connection
    away writes it straight into the new socket)."""
    return HEADER.pack(MAGIC, VERSION, kind, request_id, len(payload),
                       xxhash.xxh64_intdigest(payload)) + payload


def _proof(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


async def server_handshake(fs: FrameStream, secret: bytes) -> None:
    """Admit a client only once it proves it holds ``secret``; raises AuthError otherwise
    (after telling the client why). Wrap in ``trio.fail_after``: a silent client would
    otherwise hold the connection forever."""
    server_nonce = secrets.token_bytes(NONCE_SIZE)
    await fs.send(Kind.HELLO, 0, server_nonce)
    frame = await fs.receive()
    if frame is None:
        raise AuthError("connection closed before authenticating")
    if frame.kind != Kind.AUTH or len(frame.payload) != NONCE_SIZE + 32:
        await _refuse(fs, frame.request_id, f"expected AUTH, got {frame.kind.name}")
    client_nonce, proof = frame.payload[:NONCE_SIZE], frame.payload[NONCE_SIZE:]
    expected = _proof(secret, b"coordlfs-client\0", server_nonce, client_nonce)
    if not hmac.compare_digest(proof, expected):
        await _refuse(fs, 0, "authentication failed")
    await fs.send(Kind.WELCOME, 0, _proof(secret, b"coordlfs-server\0", client_nonce,
                                          server_nonce))


async def _refuse(fs: FrameStream, request_id: int, message: str) -> NoReturn:
    """Tell the client why before hanging up; it may already be gone."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await fs.send(Kind.FAIL, request_id, encode_fail(Fail.REFUSED, message))
    raise AuthError(message)


async def client_handshake(fs: FrameStream, secret: bytes) -> None:
    """Prove we hold ``secret`` and require the server to prove it too, so a client never
    sends requests to (or trusts data from) an impostor. Raises AuthError on failure;
    wrap in ``trio.fail_after``, a silent server would otherwise hang us."""
    frame = await fs.receive()
    if frame is not None and frame.kind == Kind.FAIL:  # BUSY: it has no room for us now
        raise TurnedAway(f"peer turned us away: {decode_fail(frame.payload)[1]}")
    if frame is None or frame.kind != Kind.HELLO or len(frame.payload) != NONCE_SIZE:
        raise ProtocolError("peer did not start the handshake with HELLO")
    server_nonce, client_nonce = frame.payload, secrets.token_bytes(NONCE_SIZE)
    await fs.send(Kind.AUTH, 0, client_nonce + _proof(secret, b"coordlfs-client\0",
                                                      server_nonce, client_nonce))
    frame = await fs.receive()
    if frame is not None and frame.kind == Kind.FAIL:
        code, message = decode_fail(frame.payload)
        if code == Fail.BUSY:  # closed in its handshake to make room for a newer one
            raise TurnedAway(f"peer turned us away: {message}")
        raise AuthError(f"peer refused us: {message}")
    expected = _proof(secret, b"coordlfs-server\0", client_nonce, server_nonce)
    if frame is None or frame.kind != Kind.WELCOME or not hmac.compare_digest(
            frame.payload, expected):
        raise AuthError("peer could not prove it holds the secret")


async def send_features(fs: FrameStream) -> None:
    """Tell a client just admitted what this server serves beyond GET."""
    await fs.send(Kind.DATA, 0, b" ".join(FEATURES))


def decode_features(payload: bytes | bytearray) -> frozenset[bytes]:
    return frozenset(bytes(payload).split())


def _path_problem(path: bytes) -> str | None:
    if not path:
        return "empty path"
    if len(path) > MAX_PATH:
        return f"path of {len(path)} bytes, longer than {MAX_PATH}"
    if b"\0" in path:
        return f"NUL byte in path {path[:100]!r}"
    if path.startswith(b"/"):
        return f"absolute path {path[:100]!r}"
    if any(part in (b"", b".", b"..") for part in path.split(b"/")):
        return f"empty, '.' or '..' component in path {path[:100]!r}"
    return None


def _get_problem(path: bytes, size: int, offset: int, length: int) -> str | None:
    if problem := _path_problem(path):
        return problem
    if not 0 < length <= MAX_CHUNK:
        return f"length {length} not in 1..{MAX_CHUNK}"
    if offset < 0 or offset + length > size:
        return f"range {offset}+{length} beyond file size {size}"
    return None


@dataclass(frozen=True, slots=True)
class Get:
    """Ask for one range of a file; size and mtime let the peer refuse (STALE) a copy of
    another version than the one the requester's source has."""

    path: bytes
    size: int
    mtime_ns: int
    offset: int
    length: int

    def encode(self) -> bytes:
        if problem := _get_problem(self.path, self.size, self.offset, self.length):
            raise ValueError(problem)
        try:
            header = GET_HEADER.pack(self.size, self.mtime_ns, self.offset, self.length)
        except struct.error as e:
            raise ValueError(f"GET field out of range: {e}") from None
        return header + self.path

    @classmethod
    def decode(cls, payload: bytes | memoryview) -> Get:
        if len(payload) < GET_HEADER.size:
            raise ProtocolError(f"GET payload of {len(payload)} bytes is too short")
        size, mtime_ns, offset, length = GET_HEADER.unpack_from(payload)
        path = bytes(payload[GET_HEADER.size:])
        if problem := _get_problem(path, size, offset, length):
            raise ProtocolError(f"bad GET: {problem}")
        return cls(path, size, mtime_ns, offset, length)


def encode_fail(code: Fail, message: str) -> bytes:
    """A FAIL payload; the message is cut to 200 bytes on a character boundary."""
    text = message.encode(errors="replace")[:MAX_FAIL_MESSAGE].decode(errors="ignore").encode()
    return bytes([code]) + text


def decode_fail(payload: bytes | memoryview) -> tuple[Fail, str]:
    if not payload:
        raise ProtocolError("empty FAIL payload")
    if payload[0] not in Fail._value2member_map_:
        raise ProtocolError(f"unknown FAIL code {payload[0]}")
    return Fail(payload[0]), bytes(payload[1:]).decode(errors="replace")


@dataclass(frozen=True, slots=True)
class Wanted:
    """One whole file of a GETMANY, at the version the requester's source has."""

    path: bytes
    size: int
    mtime_ns: int

    def get(self) -> Get:
        """The file as one GET: what the server checks and answers for it."""
        return Get(self.path, self.size, self.mtime_ns, 0, self.size)


def _many_problem(files: tuple[Wanted, ...]) -> str | None:
    if not 0 < len(files) <= MAX_FILES:
        return f"{len(files)} files, not 1..{MAX_FILES}"
    total = sum(f.size for f in files)
    if total > MAX_CHUNK:
        return f"{total} bytes in all, more than {MAX_CHUNK}"
    for f in files:
        if problem := _get_problem(f.path, f.size, 0, f.size):
            return problem
    return None


@dataclass(frozen=True, slots=True)
class GetMany:
    """Ask for several whole small files at once; each is checked and answered as a GET of
    the whole file would be, and fails alone."""

    files: tuple[Wanted, ...]

    @staticmethod
    def fits(count: int, total: int) -> bool:
        """Whether ``count`` files of ``total`` bytes make one request."""
        return count <= MAX_FILES and total <= MAX_CHUNK

    def encode(self) -> bytes:
        if problem := _many_problem(self.files):
            raise ValueError(problem)
        parts = [MANY_HEADER.pack(len(self.files))]
        try:
            for f in self.files:
                parts += [MANY_FILE.pack(f.size, f.mtime_ns, len(f.path)), f.path]
        except struct.error as e:
            raise ValueError(f"GETMANY field out of range: {e}") from None
        return b"".join(parts)

    @classmethod
    def decode(cls, payload: bytes | memoryview) -> GetMany:
        view = memoryview(payload)
        if len(view) < MANY_HEADER.size:
            raise ProtocolError(f"GETMANY payload of {len(view)} bytes is too short")
        (count,) = MANY_HEADER.unpack_from(view)
        if not 0 < count <= MAX_FILES:
            raise ProtocolError(f"bad GETMANY: {count} files, not 1..{MAX_FILES}")
        at, files = MANY_HEADER.size, []
        for _ in range(count):
            if len(view) < at + MANY_FILE.size:
                raise ProtocolError("GETMANY payload ends inside a file's header")
            size, mtime_ns, length = MANY_FILE.unpack_from(view, at)
            at += MANY_FILE.size
            if len(view) < at + length:
                raise ProtocolError("GETMANY payload ends inside a path")
            files.append(Wanted(bytes(view[at:at + length]), size, mtime_ns))
            at += length
        if at != len(view):
            raise ProtocolError(f"GETMANY payload has {len(view) - at} bytes past its files")
        request = cls(tuple(files))
        if problem := _many_problem(request.files):
            raise ProtocolError(f"bad GETMANY: {problem}")
        return request

    def decode_reply(self, payload: bytes | bytearray) -> list[memoryview | tuple[Fail, str]]:
        """Per file, in order: its bytes (a view of ``payload``, not a copy), or why it was
        not served. A reply with another count of files, or a file of another length, is a
        ProtocolError: a peer that lies about a file is not trusted with the others."""
        view, at, answers = memoryview(payload), 0, []
        for f in self.files:
            if len(view) < at + FILES_ENTRY.size:
                raise ProtocolError(f"FILES reply ends before file {len(answers) + 1} of "
                                    f"{len(self.files)}")
            code, length = FILES_ENTRY.unpack_from(view, at)
            at += FILES_ENTRY.size
            if len(view) < at + length:
                raise ProtocolError("FILES reply ends inside a file")
            body = view[at:at + length]
            at += length
            if code == 0:
                if length != f.size:
                    raise ProtocolError(f"sent {length} bytes for a file of {f.size}")
                answers.append(body)
            else:
                answers.append(decode_fail(bytes([code]) + body))
        if at != len(view):
            raise ProtocolError(f"FILES reply has {len(view) - at} bytes past its files")
        return answers


def encode_files(answers: list[tuple[Kind, Part]]) -> list[Part]:
    """A FILES payload, in parts (``FrameStream.send`` sends them without joining them),
    from each file's answer as a GET would have it: DATA and its bytes (or its range of a
    cache file), or FAIL and its payload (code and message)."""
    parts: list[Part] = []
    for kind, payload in answers:
        if kind == Kind.DATA:
            parts += [FILES_ENTRY.pack(0, len(payload)), payload]
        else:
            parts += [FILES_ENTRY.pack(payload[0], len(payload) - 1), payload[1:]]
    return parts


@dataclass(frozen=True, slots=True)
class Warm:
    """Ask a peer to warm files (``paths``, those it caches) for the warm ``token`` of the
    asking node, or only how far it has come (no paths), or to drop what it still has queued
    of it (``cancel``)."""

    token: int
    paths: tuple[bytes, ...] = ()
    cancel: bool = False

    @staticmethod
    def fitting(paths: Sequence[bytes]) -> int:
        """How many of ``paths``, from the first, one WARM frame carries."""
        room, count = MAX_PAYLOAD - WARM_HEADER.size, 0
        for path in paths:
            room -= WARM_PATH.size + len(path)
            if room < 0 or count == 0xFFFF:
                break
            count += 1
        return count

    def encode(self) -> bytes:
        for path in self.paths:
            if problem := _path_problem(path):
                raise ValueError(problem)
        if self.fitting(self.paths) != len(self.paths):
            raise ValueError(f"{len(self.paths)} paths do not fit one WARM frame")
        try:
            parts = [WARM_HEADER.pack(self.token, WARM_CANCEL if self.cancel else 0,
                                      len(self.paths))]
        except struct.error as e:
            raise ValueError(f"WARM field out of range: {e}") from None
        for path in self.paths:
            parts += [WARM_PATH.pack(len(path)), path]
        return b"".join(parts)

    @classmethod
    def decode(cls, payload: bytes | bytearray) -> Warm:
        view = memoryview(payload)
        if len(view) < WARM_HEADER.size:
            raise ProtocolError(f"WARM payload of {len(view)} bytes is too short")
        token, flags, count = WARM_HEADER.unpack_from(view)
        if flags & ~WARM_CANCEL:
            raise ProtocolError(f"bad WARM: unknown flags {flags:#x}")
        at, paths = WARM_HEADER.size, []
        for _ in range(count):
            if len(view) < at + WARM_PATH.size:
                raise ProtocolError("WARM payload ends inside a path's length")
            (length,) = WARM_PATH.unpack_from(view, at)
            at += WARM_PATH.size
            if len(view) < at + length:
                raise ProtocolError("WARM payload ends inside a path")
            path = bytes(view[at:at + length])
            if problem := _path_problem(path):
                raise ProtocolError(f"bad WARM: {problem}")
            paths.append(path)
            at += length
        if at != len(view):
            raise ProtocolError(f"WARM payload has {len(view) - at} bytes past its paths")
        return cls(token, tuple(paths), bool(flags & WARM_CANCEL))


def encode_warm_reply(taken: int, counts: dict[str, int]) -> bytes:
    return WARM_REPLY.pack(taken, *(counts[name] for name in WARM_COUNTS))


def decode_warm_reply(payload: bytes | bytearray) -> tuple[int, dict[str, int]]:
    """How many paths the peer took, and the warm's counts there."""
    if len(payload) != WARM_REPLY.size:
        raise ProtocolError(f"WARM reply of {len(payload)} bytes, not {WARM_REPLY.size}")
    taken, *counts = WARM_REPLY.unpack(payload)
    return taken, dict(zip(WARM_COUNTS, counts, strict=True))
