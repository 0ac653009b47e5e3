"""Peer wire format: framing, handshake and payloads, over loopback TCP where it matters."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
import xxhash

from coordlfs.peers.wire import (
    FILES_ENTRY,
    GET_HEADER,
    HEADER,
    MAGIC,
    MANY_FILE,
    MANY_HEADER,
    MAX_CHUNK,
    MAX_FAIL_MESSAGE,
    MAX_FILES,
    MAX_PAYLOAD,
    VERSION,
    AuthError,
    Fail,
    Frame,
    FrameStream,
    FrameTimeout,
    Get,
    GetMany,
    IdleTimeout,
    Kind,
    ProtocolError,
    Wanted,
    client_handshake,
    decode_fail,
    decode_features,
    encode_fail,
    encode_files,
    idle_timeout,
    server_handshake,
)

SECRET = b"correct horse battery staple, 32+ bytes of shared secret"


def run(main: Callable[[], Awaitable[Any]], timeout: float = 5) -> Any:
    """Run a trio test body; a hang fails the test instead of stalling the suite."""
    async def guarded() -> Any:
        with trio.fail_after(timeout):
            return await main()
    return trio.run(guarded)


class Recording(trio.abc.Stream):
    """A stream that keeps a copy of every byte written through it."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.sent = bytearray()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """Both ends of a real loopback TCP connection: (client, server)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    try:
        client = await trio.testing.open_stream_to_socket_listener(listeners[0])
        server = await listeners[0].accept()
    finally:
        for listener in listeners:
            await listener.aclose()
    return client, server


async def both(server: Callable[[], Awaitable[Any]],
               client: Callable[[], Awaitable[Any]]) -> tuple[Any, Any]:
    """Run both sides concurrently; each side's result or exception, (server, client)."""
    results: dict[str, Any] = {}

    async def side(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            results[name] = await fn()
        except Exception as e:
            results[name] = e

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "server", server)
        nursery.start_soon(side, "client", client)
    return results["server"], results["client"]


async def frames_in(data: bytes) -> list[Frame]:
    """Parse captured bytes back into frames."""
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(data)
    await a.aclose()
    fs, frames = FrameStream(b), []
    while (frame := await fs.receive()) is not None:
        frames.append(frame)
    return frames


def header(kind: int = Kind.DATA, length: int = 0, digest: int | None = None,
           magic: bytes = MAGIC, version: int = VERSION, payload: bytes = b"") -> bytes:
    if digest is None:
        digest = xxhash.xxh64_intdigest(payload)
    return HEADER.pack(magic, version, kind, 7, length, digest)


# --- framing -----------------------------------------------------------------------------

def test_round_trip_over_tcp():
    payloads = [b"", b"x", bytes(range(256)) * (MAX_PAYLOAD // 256)]
    assert len(payloads[2]) == MAX_PAYLOAD

    async def main():
        client, server = await tcp_pair()
        sender, receiver = FrameStream(client), FrameStream(server)

        async def send_all():
            for i, payload in enumerate(payloads):
                await sender.send(Kind.DATA, i, payload)
            await sender.send(Kind.GET, (1 << 32) - 1, memoryview(b""))
            await sender.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all)
            for i, payload in enumerate(payloads):
                assert await receiver.receive() == Frame(Kind.DATA, i, payload)
            assert await receiver.receive() == Frame(Kind.GET, (1 << 32) - 1, b"")
            assert await receiver.receive() is None
        await receiver.aclose()
    run(main)


def test_send_refuses_oversized_payload_and_bad_request_id():
    async def main():
        a, _ = trio.testing.memory_stream_pair()
        fs = FrameStream(a)
        with pytest.raises(ValueError, match="exceeds"):
            await fs.send(Kind.DATA, 1, bytes(MAX_PAYLOAD + 1))
        with pytest.raises(ValueError, match="request id"):
            await fs.send(Kind.DATA, 1 << 32, b"")
    run(main)


def test_concurrent_senders_never_interleave():
    def payload(i: int) -> bytes:
        return bytes([i]) * (100_000 + 997 * i)  # large: each send_all takes several writes

    async def main():
        client, server = await tcp_pair()
        sender, receiver = FrameStream(client), FrameStream(server)
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(sender.send, Kind.DATA, i, payload(i))
            seen = set()
            for _ in range(50):
                frame = await receiver.receive()
                assert frame is not None and frame.payload == payload(frame.request_id)
                seen.add(frame.request_id)
        assert seen == set(range(50))
        await sender.aclose()
        assert await receiver.receive() is None
        await receiver.aclose()
    run(main)


def test_frames_split_and_coalesced_across_reads():
    frame_bytes = header(Kind.DATA, 5, payload=b"hello") + b"hello"

    async def main():
        a, b = trio.testing.memory_stream_pair()
        fs = FrameStream(b)

        async def trickle():
            await a.send_all(frame_bytes * 2)  # two frames in one read
            for i in range(len(frame_bytes)):  # then one frame a byte at a time
                await a.send_all(frame_bytes[i:i + 1])
                await trio.sleep(0)
            await a.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            for _ in range(3):
                assert await fs.receive() == Frame(Kind.DATA, 7, b"hello")
            assert await fs.receive() is None
    run(main)


async def receive_raw(data: bytes, close: bool) -> Frame | None:
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(data)
    if close:
        await a.aclose()
    return await FrameStream(b).receive()


@pytest.mark.parametrize(("data", "close", "error"), [
    (header(Kind.DATA, 3, digest=12345) + b"abc", False, "checksum mismatch"),
    (header(magic=b"HTTP"), False, "bad magic"),
    (header(version=2), False, "unsupported protocol version 2"),
    (header(kind=0), False, "unknown frame kind 0"),
    (header(kind=max(Kind) + 1), False, f"unknown frame kind {max(Kind) + 1}"),
    # only the header: the error must come without waiting for the payload
    (header(length=MAX_PAYLOAD + 1), False, "more than"),
    (header(length=0xFFFFFFFF), False, "more than"),
    (header()[:10], True, "closed mid-frame"),
    (header(Kind.DATA, 10, payload=b"0123456789") + b"01234", True, "closed mid-frame"),
], ids=["checksum", "magic", "version", "kind-0", "kind-unknown", "oversized", "max-u32",
        "eof-mid-header", "eof-mid-payload"])
def test_malformed_frames(data: bytes, close: bool, error: str):
    async def main():
        with trio.fail_after(1), pytest.raises(ProtocolError, match=error):
            await receive_raw(data, close)
    run(main)


def test_clean_eof_is_none():
    async def main():
        assert await receive_raw(b"", True) is None
        a, b = trio.testing.memory_stream_pair()
        await FrameStream(a).send(Kind.DATA, 3)
        await a.aclose()
        fs = FrameStream(b)
        assert await fs.receive() == Frame(Kind.DATA, 3, b"")
        assert await fs.receive() is None
    run(main)


# --- time limits ---------------------------------------------------------------------------

def test_a_frame_trickled_in_slower_than_the_frame_timeout_is_refused():
    """After the handshake a sender of one byte a second held the connection forever."""
    frame_bytes = header(Kind.GET, 0)

    async def main():
        client, server = await tcp_pair()
        fs = FrameStream(server, frame_timeout=0.3)

        async def trickle():
            for i in range(len(frame_bytes)):  # 22 bytes at 0.1 s: 2.2 s, far past 0.3 s
                await client.send_all(frame_bytes[i:i + 1])
                await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            started = trio.current_time()
            with pytest.raises(FrameTimeout, match=r"more than 0\.3 s"):
                await fs.receive()
            assert trio.current_time() - started < 1.5  # well before the frame was complete
            nursery.cancel_scope.cancel()
        await client.aclose()
        await server.aclose()
    run(main)


def test_a_quiet_stream_is_idle_and_a_prompt_frame_is_not():
    async def main():
        client, server = await tcp_pair()
        sender, fs = FrameStream(client), FrameStream(server, frame_timeout=0.3)
        with pytest.raises(IdleTimeout):
            await fs.receive(idle_timeout=0.2)
        await sender.send(Kind.GET, 5)  # idle for long, then a whole frame: no timeout
        assert await fs.receive(idle_timeout=0.2) == Frame(Kind.GET, 5, b"")
        await sender.aclose()
        assert await fs.receive(idle_timeout=0.2) is None
        await fs.aclose()
    run(main)
    assert idle_timeout(2.0) > 2.0 * 5  # idle is many frame timeouts: a pause is no fault


def test_sending_to_a_peer_that_does_not_read_times_out():
    async def main():
        client, server = await tcp_pair()
        fs = FrameStream(server, frame_timeout=0.3)
        with pytest.raises(FrameTimeout, match="to take a DATA frame"):
            for i in range(256):  # 256 MiB: far more than the sockets' buffers hold
                await fs.send(Kind.DATA, i, bytes(MAX_CHUNK))
        await client.aclose()
        await server.aclose()
    run(main, timeout=20)


def test_a_busy_server_is_a_clear_error_for_the_client():
    async def main():
        client, server = await tcp_pair()
        await FrameStream(server).send(Kind.FAIL, 0, encode_fail(Fail.BUSY, "64 open"))
        with pytest.raises(ProtocolError, match="turned us away: 64 open"):
            await client_handshake(FrameStream(client), SECRET)
        await client.aclose()
        await server.aclose()
    run(main)


# --- handshake ---------------------------------------------------------------------------

async def handshake(server_secret: bytes, client_secret: bytes
                    ) -> tuple[Any, Any, Recording, Recording]:
    """A handshake over loopback TCP; each side's outcome and everything each side sent."""
    client, server = await tcp_pair()
    client_rec, server_rec = Recording(client), Recording(server)
    server_fs, client_fs = FrameStream(server_rec), FrameStream(client_rec)
    outcome = await both(lambda: server_handshake(server_fs, server_secret),
                         lambda: client_handshake(client_fs, client_secret))
    if outcome == (None, None):  # the connection is usable afterwards
        await client_fs.send(Kind.GET, 1)
        assert await server_fs.receive() == Frame(Kind.GET, 1, b"")
        await server_fs.send(Kind.DATA, 1)
        assert await client_fs.receive() == Frame(Kind.DATA, 1, b"")
    await client_fs.aclose()
    await server_fs.aclose()
    return *outcome, server_rec, client_rec


@pytest.mark.parametrize("secret", [SECRET, b""], ids=["secret", "insecure"])
def test_handshake_succeeds(secret: bytes):
    async def main():
        server_result, client_result, server_rec, client_rec = await handshake(secret, secret)
        assert server_result is None and client_result is None
        server_frames = await frames_in(bytes(server_rec.sent))
        client_frames = await frames_in(bytes(client_rec.sent))
        assert [f.kind for f in server_frames] == [Kind.HELLO, Kind.WELCOME, Kind.DATA]
        assert [f.kind for f in client_frames] == [Kind.AUTH, Kind.GET]
    run(main)


def test_wrong_secret_fails_both_sides_and_server_sends_fail():
    async def main():
        server_result, client_result, server_rec, _ = await handshake(SECRET, b"guess")
        assert isinstance(server_result, AuthError)
        assert isinstance(client_result, AuthError)
        assert "authentication failed" in str(client_result)
        last = (await frames_in(bytes(server_rec.sent)))[-1]
        assert last.kind == Kind.FAIL
        assert decode_fail(last.payload) == (Fail.REFUSED, "authentication failed")
    run(main)


@pytest.mark.parametrize(("server_secret", "client_secret"), [(SECRET, b""), (b"", SECRET)],
                         ids=["client-insecure", "server-insecure"])
def test_secret_against_no_secret_fails(server_secret: bytes, client_secret: bytes):
    async def main():
        server_result, client_result, _, _ = await handshake(server_secret, client_secret)
        assert isinstance(server_result, AuthError)
        assert isinstance(client_result, AuthError)
    run(main)


def test_secret_never_written_to_the_socket():
    async def main():
        for server_secret, client_secret in [(SECRET, SECRET), (SECRET, SECRET + b"!")]:
            _, _, server_rec, client_rec = await handshake(server_secret, client_secret)
            for sent in (server_rec.sent, client_rec.sent):
                assert sent and SECRET not in sent and SECRET[:16] not in sent
    run(main)


def test_client_rejects_server_with_wrong_proof():
    async def main():
        client, server = await tcp_pair()
        impostor = FrameStream(server)

        async def fake_server() -> None:
            await impostor.send(Kind.HELLO, 0, bytes(32))
            frame = await impostor.receive()
            assert frame is not None and frame.kind == Kind.AUTH
            await impostor.send(Kind.WELCOME, 0, bytes(32))

        _, client_result = await both(fake_server, lambda: client_handshake(FrameStream(client),
                                                                            SECRET))
        assert isinstance(client_result, AuthError)
        await client.aclose()
        await server.aclose()
    run(main)


def test_get_before_auth_is_refused():
    async def main():
        client, server = await tcp_pair()
        rogue = FrameStream(client)

        async def rogue_client() -> Frame | None:
            hello = await rogue.receive()
            assert hello is not None and hello.kind == Kind.HELLO
            await rogue.send(Kind.GET, 1, Get(b"a/b.jpg", 100, 0, 0, 100).encode())
            return await rogue.receive()

        server_result, reply = await both(lambda: server_handshake(FrameStream(server), SECRET),
                                          rogue_client)
        assert isinstance(server_result, AuthError)
        assert reply is not None and reply.kind == Kind.FAIL and reply.request_id == 1
        assert decode_fail(reply.payload)[0] == Fail.REFUSED
        await client.aclose()
        await server.aclose()
    run(main)


def test_client_closing_before_auth_is_an_auth_error():
    async def main():
        client, server = await tcp_pair()
        await client.aclose()
        with pytest.raises(AuthError):
            await server_handshake(FrameStream(server), SECRET)
        await server.aclose()
    run(main)


# --- payloads ----------------------------------------------------------------------------

def test_get_round_trip_with_non_utf8_path():
    get = Get(b"train/\xff\xfe caf\xe9/img 01.jpg", size=5 << 20, mtime_ns=-1_234_567_891,
              offset=4 << 20, length=MAX_CHUNK)
    payload = get.encode()
    assert Get.decode(payload) == get
    assert Get.decode(memoryview(payload)) == get
    edge = Get(b"a" * 4096, size=10, mtime_ns=0, offset=9, length=1)
    assert Get.decode(edge.encode()) == edge


@pytest.mark.parametrize(("path", "size", "offset", "length", "error"), [
    (b"", 10, 0, 1, "empty path"),
    (b"a" * 4097, 10, 0, 1, "longer than"),
    (b"a\0b", 10, 0, 1, "NUL"),
    (b"/etc/passwd", 10, 0, 1, "absolute"),
    (b"..", 10, 0, 1, "component"),
    (b"../x", 10, 0, 1, "component"),
    (b"a/../../x", 10, 0, 1, "component"),
    (b"a/..", 10, 0, 1, "component"),
    (b".", 10, 0, 1, "component"),
    (b"./a", 10, 0, 1, "component"),
    (b"a/./b", 10, 0, 1, "component"),
    (b"a//b", 10, 0, 1, "component"),
    (b"a/", 10, 0, 1, "component"),
    (b"a", 10, 0, 0, "length 0"),
    (b"a", 4 * MAX_CHUNK, 0, MAX_CHUNK + 1, "length"),
    (b"a", 10, 5, 6, "beyond file size"),
    (b"a", 10, 11, 1, "beyond file size"),
])
def test_get_hostile_requests(path: bytes, size: int, offset: int, length: int, error: str):
    payload = GET_HEADER.pack(size, 0, offset, length) + path
    with pytest.raises(ProtocolError, match=error):
        Get.decode(payload)
    with pytest.raises(ValueError, match=error):
        Get(path, size, 0, offset, length).encode()


def test_get_short_payload():
    with pytest.raises(ProtocolError, match="too short"):
        Get.decode(GET_HEADER.pack(10, 0, 0, 1)[:-1])
    with pytest.raises(ValueError, match="out of range"):
        Get(b"a", 1 << 64, 0, 0, 1).encode()


def test_fail_round_trip():
    for code in Fail:
        assert decode_fail(encode_fail(code, f"{code.name}: ünïcode ✓")) == (
            code, f"{code.name}: ünïcode ✓")
    assert decode_fail(bytes([Fail.ERROR]) + b"bad \xff byte") == (Fail.ERROR, "bad \ufffd byte")


def test_fail_truncates_long_messages():
    assert encode_fail(Fail.MISS, "x" * 500) == bytes([Fail.MISS]) + b"x" * 200
    payload = encode_fail(Fail.BUSY, "é" * 150)  # 300 bytes: cut between characters
    assert len(payload) == 1 + 200
    assert decode_fail(payload) == (Fail.BUSY, "é" * 100)
    payload = encode_fail(Fail.BUSY, "a" + "é" * 150)  # a cut inside a character drops it
    assert len(payload) == 1 + 199
    assert decode_fail(payload) == (Fail.BUSY, "a" + "é" * 99)


def test_fail_unknown_code():
    with pytest.raises(ProtocolError, match="unknown FAIL code 99"):
        decode_fail(bytes([99]) + b"what")
    with pytest.raises(ProtocolError, match="empty"):
        decode_fail(b"")


# --- GETMANY and FILES ------------------------------------------------------------------

def many(*files: tuple[bytes, int]) -> GetMany:
    return GetMany(tuple(Wanted(path, size, -5) for path, size in files))


def raw_many(*files: tuple[bytes, int], count: int | None = None) -> bytes:
    """A GETMANY payload as a hostile client may write it, unchecked."""
    parts = [MANY_HEADER.pack(len(files) if count is None else count)]
    for path, size in files:
        parts += [MANY_FILE.pack(size, 0, len(path)), path]
    return b"".join(parts)


def test_getmany_round_trip_and_its_bounds():
    request = many((b"a/\xff.jpg", 1), (b"b" * 4096, 1000), (b"c", MAX_CHUNK - 1001))
    assert GetMany.decode(request.encode()) == request
    assert GetMany.decode(memoryview(request.encode())) == request
    full = many(*[(f"f{i}".encode(), MAX_CHUNK // MAX_FILES) for i in range(MAX_FILES)])
    assert GetMany.decode(full.encode()) == full
    assert len(full.encode()) <= MAX_PAYLOAD
    assert GetMany.fits(MAX_FILES, MAX_CHUNK) and not GetMany.fits(MAX_FILES + 1, 10)
    assert not GetMany.fits(2, MAX_CHUNK + 1)
    assert request.files[1].get() == Get(b"b" * 4096, 1000, -5, 0, 1000)


@pytest.mark.parametrize(("payload", "error"), [
    (b"", "too short"),
    (b"\x00", "too short"),
    (raw_many(), "0 files"),
    (raw_many(*[(b"a", 1)] * (MAX_FILES + 1)), f"{MAX_FILES + 1} files"),
    (raw_many((b"a", 1), count=2), "inside a file's header"),
    (raw_many((b"a", 1))[:-1], "inside a path"),
    (raw_many((b"a", 1)) + b"x", "past its files"),
    (raw_many((b"a", MAX_CHUNK), (b"b", 1)), "bytes in all"),
    (raw_many((b"a", 0)), "length 0"),
    (raw_many((b"a", 1), (b"../etc/passwd", 1)), "component"),
    (raw_many((b"/etc/passwd", 1)), "absolute"),
    (raw_many((b"a\0b", 1)), "NUL"),
    (raw_many((b"", 1)), "empty path"),
    (raw_many((b"a" * 4097, 1)), "longer than"),
    (MANY_HEADER.pack(1) + MANY_FILE.pack(1, 0, 65535) + b"a" * 100, "inside a path"),
])
def test_getmany_hostile_requests(payload: bytes, error: str):
    with pytest.raises(ProtocolError, match=error):
        GetMany.decode(payload)


def test_getmany_encode_refuses_what_decode_would():
    for bad in (many(), many(*[(b"a", 1)] * (MAX_FILES + 1)), many((b"../x", 1)),
                many((b"a", MAX_CHUNK), (b"b", 1)), many((b"a", 0))):
        with pytest.raises(ValueError):
            bad.encode()
    with pytest.raises(ValueError, match="out of range"):
        GetMany((Wanted(b"a", 1, 1 << 63),)).encode()


def _files(answers: list) -> bytes:
    """A FILES reply's payload in one piece, as it arrives (``encode_files`` gives its parts)."""
    return b"".join(encode_files(answers))


def test_files_reply_round_trip_with_failures_among_data():
    request = many((b"a", 3), (b"b", 2), (b"c", 4))
    reply = _files([(Kind.DATA, b"abc"), (Kind.FAIL, encode_fail(Fail.STALE, "older")),
                          (Kind.DATA, memoryview(b"wxyz"))])
    assert request.decode_reply(reply) == [b"abc", (Fail.STALE, "older"), b"wxyz"]


def test_the_largest_files_reply_fits_one_frame():
    request = many(*[(f"f{i}".encode(), MAX_CHUNK // MAX_FILES) for i in range(MAX_FILES)])
    worst = _files([(Kind.DATA, bytes(MAX_CHUNK // MAX_FILES))] * (MAX_FILES - 1)
                         + [(Kind.FAIL, encode_fail(Fail.ERROR, "x" * 500))])
    assert len(worst) <= MAX_PAYLOAD
    assert MAX_FILES * (FILES_ENTRY.size + MAX_FAIL_MESSAGE) + MAX_CHUNK <= MAX_PAYLOAD
    assert request.decode_reply(worst)[-1] == (Fail.ERROR, "x" * 200)


@pytest.mark.parametrize(("reply", "error"), [
    (_files([(Kind.DATA, b"abc")]), "ends before file 2"),
    (_files([(Kind.DATA, b"abc"), (Kind.DATA, b"toolong")]), "sent 7 bytes"),
    (_files([(Kind.DATA, b"ab"), (Kind.DATA, b"xy")]), "sent 2 bytes"),
    (_files([(Kind.DATA, b"abc"), (Kind.DATA, b"xy")]) + b"!", "past its files"),
    (_files([(Kind.DATA, b"abc")]) + FILES_ENTRY.pack(0, 5) + b"xy", "inside a file"),
    (_files([(Kind.DATA, b"abc")]) + FILES_ENTRY.pack(99, 1) + b"x", "FAIL code 99"),
])
def test_a_lying_files_reply_is_a_protocol_error(reply: bytes, error: str):
    with pytest.raises(ProtocolError, match=error):
        many((b"a", 3), (b"b", 2)).decode_reply(reply)


def test_features_frame_is_a_reply_to_no_request():
    assert decode_features(b"getmany") == {b"getmany"}
    assert decode_features(b"getmany  future\n") == {b"getmany", b"future"}
    assert decode_features(b"") == frozenset()
