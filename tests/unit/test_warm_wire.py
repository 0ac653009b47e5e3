"""WARM on the peer wire, and how a node answers it: round trips, the frame's bound, hostile
payloads refused whole, a node's fill queue taking a peer's warm as one of its own."""

from __future__ import annotations

import struct
from types import SimpleNamespace
from typing import Any

import pytest

from coordlfs.cache import fills
from coordlfs.cache.fills import FillQueue
from coordlfs.peers.warm import answer
from coordlfs.peers.wire import (
    MAX_PAYLOAD,
    WARM_HEADER,
    WARM_PATH,
    WARM_REPLY,
    Fail,
    Kind,
    ProtocolError,
    Warm,
    decode_fail,
    decode_warm_reply,
    encode_warm_reply,
)
from coordlfs.protocol.spec import WARM_COUNTS
from coordlfs.source.source import Source


def test_round_trips() -> None:
    for request in (Warm(1, (b"a/b", b"\xff\xfe name")), Warm(2**64 - 1), Warm(7, cancel=True)):
        assert Warm.decode(request.encode()) == request
    counts = {name: i * 1000 for i, name in enumerate(WARM_COUNTS)}
    assert decode_warm_reply(encode_warm_reply(5, counts)) == (5, counts)


def test_one_frame_takes_what_fits() -> None:
    long = [b"d/" + b"x" * 4000] * 400
    fit = Warm.fitting(long)
    assert 0 < fit < len(long)
    assert len(Warm(1, tuple(long[:fit])).encode()) <= MAX_PAYLOAD
    assert Warm.fitting([b"a"] * 70_000) == 0xFFFF  # the count's field
    with pytest.raises(ValueError, match="do not fit"):
        Warm(1, tuple(long)).encode()
    with pytest.raises(ValueError, match=r"'\.\.'"):
        Warm(1, (b"../etc/passwd",)).encode()


def _paths(*paths: bytes) -> bytes:
    return b"".join(WARM_PATH.pack(len(p)) + p for p in paths)


@pytest.mark.parametrize(("payload", "error"), [
    (b"\0" * 5, "too short"),
    (WARM_HEADER.pack(1, 2, 0), "unknown flags"),
    (WARM_HEADER.pack(1, 0, 1), "inside a path's length"),
    (WARM_HEADER.pack(1, 0, 1) + WARM_PATH.pack(10) + b"abc", "inside a path"),
    (WARM_HEADER.pack(1, 0, 1) + _paths(b"/etc/passwd"), "absolute path"),
    (WARM_HEADER.pack(1, 0, 1) + _paths(b"a/../../b"), r"'\.\.'"),
    (WARM_HEADER.pack(1, 0, 1) + _paths(b"a\0b"), "NUL"),
    (WARM_HEADER.pack(1, 0, 1) + _paths(b""), "empty path"),
    (WARM_HEADER.pack(1, 0, 0) + b"x", "past its paths"),
])
def test_hostile_warms_are_refused(payload: bytes, error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        Warm.decode(payload)


def test_a_lying_reply_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="WARM reply of"):
        decode_warm_reply(b"\0" * (WARM_REPLY.size - 1))


def _answer(queue: FillQueue, request: Warm | bytes) -> tuple[Kind, Any]:
    kind, payload = answer(queue, request if isinstance(request, bytes) else request.encode())
    return kind, decode_warm_reply(payload) if kind == Kind.DATA else decode_fail(payload)


def test_a_node_takes_a_peers_warm_as_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # no fill runs here: the cache is asked only to take back marks of files dropped
    cache = SimpleNamespace(publisher=SimpleNamespace(take_back=lambda path: None))
    queue = FillQueue(cache, Source("/"), 1)  # type: ignore[arg-type]
    queue.caches_here = lambda path: not path.startswith(b"theirs/")
    kind, (taken, counts) = _answer(queue, Warm(9, (b"a", b"theirs/b", b"c")))
    assert kind == Kind.DATA and taken == 3
    assert counts["left"] == 2 and counts["elsewhere"] == 1
    assert list(queue.queues[("peer", 9)]) == [b"a", b"c"]
    kind, (taken, counts) = _answer(queue, Warm(9))  # only how far it has come
    assert (taken, counts["left"]) == (0, 2)
    kind, (taken, counts) = _answer(queue, Warm(9, cancel=True))
    assert counts["left"] == 0 and ("peer", 9) not in queue.queues
    with pytest.raises(ProtocolError, match="flags"):  # the server refuses it
        _answer(queue, WARM_HEADER.pack(9, 4, 0))
    monkeypatch.setattr(fills, "MAX_TALLIES", 2)
    assert _answer(queue, Warm(10, (b"a",)))[0] == Kind.DATA
    assert _answer(queue, Warm(11, (b"a",)))[0] == Kind.DATA  # 9 ended: forgotten for it
    assert ("peer", 9) not in queue.tallies
    kind, (code, message) = _answer(queue, Warm(12, (b"a",)))
    assert kind == Kind.FAIL and code == Fail.BUSY and "warms run at once" in message


def test_the_reply_holds_every_count() -> None:
    assert WARM_REPLY.size == 8 * (1 + len(WARM_COUNTS))
    assert struct.calcsize(WARM_REPLY.format) == WARM_REPLY.size
