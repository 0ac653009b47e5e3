"""LOOKUPs and FORGETs the request lane answers (``coordlfs/lane/lookup.c``) through
``coordlfs.fs.lane_nodes``, without FUSE: the lane serves a fake session (a SEQPACKET socket
pair standing for /dev/fuse, as in test_lane_rows.py), the test writes requests as the kernel
lays them out and sees each answered on its end or queued for the daemon's loop. That the
kernel takes the answers (and opens, reads and forgets by them) is the mount tests'
(tests/mount/test_lane_lookups.py).
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import time
from pathlib import Path

from test_lane_rows import IN_HEADER, WAIT_S, Session, lib, session, source

from coordlfs import CONTROL_NAME
from coordlfs.cache.cache import FILL_CHUNK
from coordlfs.fs.lane_nodes import LANE_NODE, LaneNodes

__all__ = ["lib", "session", "source"]  # fixtures

FUSE_LOOKUP, FUSE_FORGET, FUSE_BATCH_FORGET = 1, 2, 42
#: fuse_entry_out: nodeid, generation, entry_valid, attr_valid, their nsecs, then fuse_attr
ENTRY_OUT = "<QQQQII" + "QQQQQQIIIIIIIIII"
ROOT = 1


def lookup(s: Session, parent: int, name: str) -> int | None:
    """A LOOKUP: the node the lane answered with (its attributes those of the source file
    under its own number, kept an hour), None if it was queued for the daemon."""
    how, arg = s.send(FUSE_LOOKUP, parent, name.encode() + b"\0")
    if how == "queued":
        return None
    fields = struct.unpack(ENTRY_OUT, arg)
    node, generation, entry_valid, attr_valid, ino, size = fields[:4] + fields[6:8]
    assert (generation, entry_valid, attr_valid, ino) == (0, 3600, 3600, node), fields
    return node if size else None


def raw(s: Session, opcode: int, nodeid: int, arg: bytes, queued: bool) -> bytes | None:
    """A request the lane may answer with no reply (a FORGET): what it queued for the daemon
    when ``queued`` is expected, else None once its counts say it took the request whole
    (``forgets`` went up). A BATCH_FORGET cut to the daemon's nodes raises the counts before
    it is queued: with two lane threads the count alone says nothing of the queue."""
    forgets = s.lane.counts()[11]
    request = struct.pack(IN_HEADER, struct.calcsize(IN_HEADER) + len(arg), opcode, 99, nodeid,
                          0, 0, 4242, 0, 0) + arg
    s.ours.send(request)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = s.take()
        if got is not None:
            assert queued, "queued, where the lane should have taken it"
            return got
        if not queued and s.lane.counts()[11] > forgets:
            return None
        select.select([s.wake], [], [], 0.01)
    raise AssertionError(f"not {'queued' if queued else 'taken'} after {WAIT_S} s")


def serving(s: Session, room: int = 1 << 40, keeps_nothing: bool = False,
            max_file_size: int = 64 << 20, over_max: bool = False) -> LaneNodes:
    """The lane answering LOOKUPs at the root and in ``d`` (node 7)."""
    nodes = s.lane.nodes
    s.lane.attr_timeout(3600)
    nodes.policy(True, max_file_size, over_max, FILL_CHUNK, 64 << 20, keeps_nothing,
                 CONTROL_NAME.encode())
    nodes.room(room)
    nodes.directory(ROOT, b"")
    nodes.directory(7, b"d")
    return nodes


def key_of(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def test_a_small_file_is_looked_up_in_c(session: Session, source: Path) -> None:
    """A regular file in an offered directory gets a node of the lane's numbers, the same one
    each time; everything else is the daemon's: a directory, a missing name, the control
    file's name, a directory not offered, "." and "..", and all while the lane is off."""
    nodes = serving(session)
    node = lookup(session, ROOT, "g.bin")
    assert node is not None and node & LANE_NODE
    assert lookup(session, ROOT, "g.bin") == node
    assert lookup(session, 7, "f.bin") not in (None, node)
    for parent, name in ((ROOT, "d"), (ROOT, "nope"), (ROOT, CONTROL_NAME), (8, "f.bin"),
                         (7, "."), (7, "..")):
        assert lookup(session, parent, name) is None, name
    assert nodes.gauges()[:3] == (2, 2, 2)
    session.lane.enable(False)
    assert lookup(session, ROOT, "g.bin") is None
    session.lane.enable(True)
    nodes.clear_directories()
    assert lookup(session, ROOT, "g.bin") is None
    assert session.lane.status()["lookups"] == 3


def test_a_key_the_daemon_holds_is_its_own(session: Session, source: Path) -> None:
    """A key held (an inode of the daemon's, a cache entry) is looked up by the daemon while
    any hold lasts; once let go, the lane numbers it."""
    nodes = serving(session)
    key = key_of(source / "g.bin")
    nodes.hold(key)
    nodes.hold(key)
    assert lookup(session, ROOT, "g.bin") is None
    nodes.let_go(key)
    assert lookup(session, ROOT, "g.bin") is None
    nodes.let_go(key)
    assert lookup(session, ROOT, "g.bin") is not None


def test_the_daemon_adopts_a_node_by_key_or_number(session: Session, source: Path) -> None:
    """Adopted, a node is the daemon's: its number, key, lookups, version and path given
    over, the key held (its LOOKUPs queued) until let go; then a LOOKUP numbers a new node."""
    nodes = serving(session)
    first = lookup(session, ROOT, "g.bin")
    assert lookup(session, ROOT, "g.bin") == first
    key = key_of(source / "g.bin")
    st = os.lstat(source / "g.bin")
    node = nodes.claim(key)
    assert node is not None and (node.number, node.key, node.lookups, node.path) == (
        first, key, 2, b"g.bin")
    assert (node.version.size, node.version.mtime_ns, node.version.ctime_ns) == (
        st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    assert nodes.adopt_number(first) is None and nodes.adopt(key) is None
    assert lookup(session, ROOT, "g.bin") is None
    nodes.let_go(key)
    second = lookup(session, 7, "f.bin")
    assert second is not None
    adopted = nodes.adopt_number(second)
    assert adopted is not None and adopted.path == b"d/f.bin"
    again = lookup(session, ROOT, "g.bin")
    assert again not in (None, first)
    assert [n.number for n in nodes.adopt_all()] == [again]
    assert nodes.gauges()[0] == 0


def test_forgets_of_the_lanes_nodes_are_taken_in_c(session: Session, source: Path) -> None:
    """A FORGET of a node numbered in C is taken there (no reply), the node going at its
    last lookup; a BATCH_FORGET is left to the daemon with its own nodes only (its count
    and length cut), or taken whole."""
    nodes = serving(session)
    node = lookup(session, ROOT, "g.bin")
    assert lookup(session, ROOT, "g.bin") == node and node is not None
    assert raw(session, FUSE_FORGET, node, struct.pack("<Q", 1), queued=False) is None
    assert nodes.gauges()[0] == 1
    assert raw(session, FUSE_FORGET, node, struct.pack("<Q", 1), queued=False) is None
    assert nodes.gauges()[:2] == (0, 0)  # the node and its key gone
    assert raw(session, FUSE_FORGET, 5, struct.pack("<Q", 1), queued=True)  # the daemon's
    one, other = lookup(session, ROOT, "g.bin"), lookup(session, 7, "f.bin")
    assert one is not None and other is not None
    batch = struct.pack("<II", 3, 0) + struct.pack("<QQQQQQ", one, 1, 5, 2, other, 1)
    queued = raw(session, FUSE_BATCH_FORGET, 0, batch, queued=True)
    assert queued is not None
    head = struct.calcsize(IN_HEADER)
    assert struct.unpack_from("<I", queued)[0] == len(queued) == head + 8 + 16
    assert struct.unpack_from("<IIQQ", queued, head) == (1, 0, 5, 2)
    assert nodes.gauges()[0] == 0
    both = lookup(session, ROOT, "g.bin"), lookup(session, 7, "f.bin")
    batch = struct.pack("<II", 2, 0) + struct.pack("<QQQQ", both[0], 1, both[1], 1)
    assert raw(session, FUSE_BATCH_FORGET, 0, batch, queued=False) is None
    assert nodes.gauges()[0] == 0


def test_the_cache_rule_decides_what_is_looked_up_in_c(session: Session, source: Path,
                                                        lib: ctypes.CDLL) -> None:
    """A file over a row's size is the daemon's; a small one is the lane's whatever the room
    (its row decides at its opens whether the cache takes it: a full cache's too); with a
    cache that keeps nothing, every small file is the lane's (read from the source for
    good), and so is one over ``--max-file-size`` once the daemon said such files are not
    cached (before, it is the daemon's, to say it)."""
    big = source / "big.bin"
    big.write_bytes(os.urandom(FILL_CHUNK + 1))
    serving(session)
    assert lookup(session, ROOT, "big.bin") is None
    serving(session, room=0)
    assert lookup(session, ROOT, "g.bin") is not None
    serving(session, room=0, keeps_nothing=True)
    assert lookup(session, ROOT, "g.bin") is not None
    serving(session, max_file_size=4096, over_max=True)
    assert lookup(session, 7, "f.bin") is None  # 4097 bytes
    serving(session, max_file_size=4096, over_max=False)
    assert lookup(session, 7, "f.bin") is not None


def test_a_reply_is_never_sent_for_a_torn_request(session: Session, source: Path) -> None:
    """A LOOKUP whose name has no end, and a BATCH_FORGET counting more entries than it has,
    are handed to the daemon as they came."""
    serving(session)
    how, _ = session.send(FUSE_LOOKUP, ROOT, b"g.bin")
    assert how == "queued"
    how, _ = session.send(FUSE_BATCH_FORGET, 0, struct.pack("<II", 5, 0) + b"\0" * 16)
    assert how == "queued"
