"""The request lane's rows (``coordlfs/lane/lane.c``) through ``coordlfs.fs.lane``, without FUSE.

The library is loaded with ctypes, a fresh copy per test (its state is the library's statics:
a copy loaded under another name has its own), through the product's own loader
(``lane._load``) and wrapper (``Lane``). Most checks are of the row calls alone: offer, held,
suspend, release, drop. For the opens a row holds, the lane is started on a fake session: one
end of a SEQPACKET socket pair stands for /dev/fuse (the lane reads a request a message and
writes its answer to the same descriptor), so the test writes OPEN and RELEASE requests as the
kernel lays them out and sees each either answered on its end or queued for the daemon's loop
(``lane_take``, woken by the descriptor ``lane_start`` returns). That an OPEN answered so
makes the kernel read the backing is the mount tests' (tests/mount/test_request_lane.py).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import select
import shutil
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from coordlfs.fs import lane
from coordlfs.fs.lane import Keep

FUSE_GETATTR, FUSE_OPEN, FUSE_RELEASE = 3, 14, 18
FOPEN_NOFLUSH, FOPEN_PASSTHROUGH = 1 << 5, 1 << 7
#: linux/fuse.h: fuse_in_header, fuse_open_in, fuse_release_in, fuse_out_header, fuse_open_out
IN_HEADER, OPEN_IN, RELEASE_IN = "<IIQQIIIHH", "<II", "<QIIQ"
OUT_HEADER, OPEN_OUT = "<IiQ", "<QIi"
#: Seconds to wait for the lane's answer or hand-off: it takes microseconds.
WAIT_S = 10.0


@pytest.fixture
def lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    """A fresh copy of the library, loaded by ``lane._load``. Missing, the test skips, but
    fails under CI=true: the suite is where the build is gated (as for the stock pyfuse3)."""
    if not lane.LIBRARY.exists():
        why = f"{lane.LIBRARY} is not built (scripts/setup builds it, by scripts/setup-c)"
        if os.environ.get("CI") == "true":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    copy = tmp_path / "libcoordlfs-lane-copy.so"
    shutil.copyfile(lane.LIBRARY, copy)
    monkeypatch.setattr(lane, "LIBRARY", copy)
    loaded = lane._load()
    loaded.lane_take.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    loaded.lane_take.restype = ctypes.c_ssize_t
    return loaded


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A source directory: d/f.bin (4097 bytes), g.bin (10 bytes)."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.bin").write_bytes(os.urandom(4097))
    (src / "g.bin").write_bytes(os.urandom(10))
    return src


@dataclass
class Session:
    """The lane serving a fake /dev/fuse: ``ours`` is the kernel's end."""

    lib: ctypes.CDLL
    lane: lane.Lane
    ours: socket.socket
    wake: int
    buffer: ctypes.Array = field(init=False)
    unique: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.buffer = ctypes.create_string_buffer(self.lib.lane_bufsize())

    def take(self) -> bytes | None:
        """The next request queued for the daemon, None if none (the loop waits then)."""
        n = self.lib.lane_take(self.buffer, len(self.buffer))
        if n == -errno.EAGAIN:
            return None
        assert n > 0, n
        return self.buffer.raw[:n]

    def send(self, opcode: int, nodeid: int, arg: bytes) -> tuple[str, bytes]:
        """One request: ("answered", the answer's argument) or ("queued", the request as
        ``lane_take`` gave it to the daemon)."""
        assert self.take() is None, "a request was left in the queue"
        unique = next(self.unique)
        request = struct.pack(IN_HEADER, struct.calcsize(IN_HEADER) + len(arg), opcode, unique,
                              nodeid, 0, 0, 4242, 0, 0) + arg
        self.ours.send(request)
        ready, _, _ = select.select([self.ours, self.wake], [], [], WAIT_S)
        assert ready, f"neither answered nor queued after {WAIT_S} s"
        if self.ours in ready:
            answer = self.ours.recv(4096)
            length, error, answered = struct.unpack_from(OUT_HEADER, answer)
            assert (length, error, answered) == (len(answer), 0, unique)
            assert self.take() is None, "answered and queued"
            return "answered", answer[struct.calcsize(OUT_HEADER):]
        queued = self.take()
        assert queued == request
        return "queued", queued

    def open(self, nodeid: int, flags: int = os.O_RDONLY) -> tuple[str, tuple[int, int, int]]:
        """An OPEN of ``nodeid``: how it went, and (fh, open flags, backing id) if answered."""
        how, arg = self.send(FUSE_OPEN, nodeid, struct.pack(OPEN_IN, flags, 0))
        return how, struct.unpack(OPEN_OUT, arg) if how == "answered" else (0, 0, 0)

    def release(self, nodeid: int, fh: int) -> str:
        how, arg = self.send(FUSE_RELEASE, nodeid, struct.pack(RELEASE_IN, fh, 0, 0, 0))
        assert how == "queued" or arg == b""
        return how


@pytest.fixture
def session(lib: ctypes.CDLL, source: Path) -> Iterator[Session]:
    """The lane started on a fake session over ``source``; ended (its end closed, every
    reader gone) after the test."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    root = os.open(source, os.O_PATH | os.O_DIRECTORY)
    try:
        wake = lib.lane_start(theirs.fileno(), root, 2)
        assert wake >= 0, os.strerror(-wake)
    finally:
        os.close(root)
        theirs.close()  # the lane has its own descriptors
    started = Session(lib, lane.Lane(lib), ours, wake)
    try:
        yield started
    finally:
        ours.close()
        ended(started)


def ended(s: Session) -> None:
    """The session's end (its descriptor closed) reaches the daemon's loop once every
    reader has seen it: ``lane_take`` says 0."""
    while (n := s.lib.lane_take(s.buffer, len(s.buffer))) != 0:
        assert n == -errno.EAGAIN, n
        ready, _, _ = select.select([s.wake], [], [], WAIT_S)
        assert ready, f"the lane's readers did not end in {WAIT_S} s"


def offer(row_lane: lane.Lane, source: Path, inode: int, backing: int, name: str) -> bool:
    return row_lane.offer(inode, backing, name.encode(), os.lstat(source / name))


# -- the row calls alone ---------------------------------------------------------------------


def test_rows_without_opens(lib: ctypes.CDLL, source: Path) -> None:
    """With no open answered: an offered row holds none; a suspend gives nothing over and
    removes it, a held-only one leaves it; a release says 0 for a row, -1 for none; drop
    removes the row at once (a release then says -1); calls about rows never offered (before
    any was, and after) say 0, -1 or nothing."""
    rows = lane.Lane(lib)
    assert (rows.held(5), rows.suspend(5), rows.release(5), rows.drop(5)) == (0, None, -1, 0)
    assert rows.held_stat(5) == (lane.Kind.NONE, None)
    assert offer(rows, source, 5, 7, "d/f.bin")
    assert (rows.suspend(5, held_only=True), rows.release(5)) == (None, 0)
    assert (rows.held(5), rows.suspend(5), rows.release(5)) == (0, None, -1)
    assert offer(rows, source, 5, 7, "d/f.bin")  # offered again
    assert rows.held_stat(5) == (lane.Kind.NONE, None)  # no open held
    assert rows.drop(5) == 0
    assert (rows.held(5), rows.release(5), rows.drop(5)) == (0, -1, 0)
    assert (rows.held(6), rows.release(6)) == (0, -1)
    assert rows.counts()[:6] == (0, 0, 0, 0, 0, 0)


def test_a_path_too_long_is_not_offered(lib: ctypes.CDLL) -> None:
    """A path the lane's one openat2 should not walk (``lane.MAX_PATH``) gets no row."""
    rows = lane.Lane(lib)
    st = os.stat("/")
    assert not rows.offer(5, 7, b"x/" * (lane.MAX_PATH // 2), st)
    assert rows.release(5) == -1


def test_many_rows(lib: ctypes.CDLL, source: Path) -> None:
    """Thousands of rows (the table grows past its first 1024 buckets, rows move): each is
    found, with a path longer than the one it replaced too, and each goes with its drop."""
    rows = lane.Lane(lib)
    st = os.lstat(source / "g.bin")
    inodes = [n * 7919 + 2 for n in range(5000)]
    for inode in inodes:
        assert rows.offer(inode, inode % 1000 + 1, b"g.bin", st)
    for inode in inodes[::3]:
        assert rows.offer(inode, inode % 1000 + 1, b"./././g.bin", st)  # a longer path
    assert all(rows.release(inode) == 0 for inode in inodes)
    held, row_bytes = rows.census()  # a row, its path and its share of the table
    assert held == 0 and 120 <= row_bytes <= 400, row_bytes
    assert all(rows.drop(inode) == 0 for inode in inodes)
    assert all(rows.release(inode) == -1 for inode in inodes)


# -- opens, on a fake session ----------------------------------------------------------------


def test_an_offered_row_answers_read_only_opens_and_their_releases(
        session: Session, source: Path) -> None:
    """A read-only OPEN of an inode with a row is answered with the row's backing id, fh
    the inode with the top bit set, passthrough and noflush; the row holds it until the
    RELEASE of that fh, answered too. Counted: opens, their files' bytes, releases."""
    rows = session.lane
    size = os.lstat(source / "d" / "f.bin").st_size
    assert offer(rows, source, 5, 7, "d/f.bin")
    fhs = []
    for n in range(1, 4):
        how, (fh, flags, backing) = session.open(5)
        assert (how, fh, flags, backing) == ("answered", 5 | lane.LANE_FH,
                                             FOPEN_PASSTHROUGH | FOPEN_NOFLUSH, 7)
        assert rows.held(5) == n
        fhs.append(fh)
    assert rows.counts()[:6] == (3, 3 * size, 0, 0, 0, 0)
    for n, fh in enumerate(fhs, 1):
        assert session.release(5, fh) == "answered"
        assert rows.held(5) == 3 - n
    assert rows.counts()[:6] == (3, 3 * size, 3, 0, 0, 0)


def test_what_the_lane_leaves_to_the_daemon(session: Session, source: Path) -> None:
    """Queued for the daemon, as it came: an OPEN with any write flag, of an inode with no
    row, a request of another kind, a RELEASE of the daemon's own handle or of a lane handle
    whose row holds no open."""
    rows = session.lane
    assert offer(rows, source, 5, 7, "d/f.bin")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_RDONLY | os.O_APPEND,
                  os.O_WRONLY | os.O_CREAT):
        assert session.open(5, flags)[0] == "queued", flags
    assert session.open(6)[0] == "queued"
    assert session.send(FUSE_GETATTR, 5, struct.pack("<IIQ", 0, 0, 0))[0] == "queued"
    assert session.release(5, 12) == "queued"  # the daemon's fh
    assert session.release(5, 5 | lane.LANE_FH) == "queued"  # no open held
    assert rows.held(5) == 0 and rows.counts()[:6] == (0, 0, 0, 0, 0, 0)
    assert session.open(5)[0] == "answered"


@pytest.mark.parametrize("change", ["rewritten in place, same size", "rename over",
                                    "unlink", "symlink in its place", "directory a symlink"])
def test_an_open_of_a_changed_source_file_goes_to_the_daemon(session: Session, source: Path,
                                                             change: str) -> None:
    """The row stands for one version of the source file: once the file at its path is
    another (its times, its inode), gone, or reached through a symbolic link, the OPEN goes
    to the daemon; offered the new version, the lane answers again."""
    rows = session.lane
    path = source / "d" / "f.bin"
    assert offer(rows, source, 5, 7, "d/f.bin")
    assert session.open(5)[0] == "answered"
    size = path.stat().st_size
    if change == "rewritten in place, same size":
        with path.open("r+b") as f:
            f.write(os.urandom(size))
        os.utime(path, ns=(1, 1))  # whatever the clock's grain, another mtime and ctime
    elif change == "rename over":
        (source / "d" / "next").write_bytes(os.urandom(size))
        os.utime(source / "d" / "next", ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
        os.rename(source / "d" / "next", path)
    elif change == "unlink":
        path.unlink()
    elif change == "symlink in its place":
        os.rename(path, source / "d" / "moved")
        os.symlink("moved", path)
    else:
        os.rename(source / "d", source / "e")
        os.symlink("e", source / "d")
    assert session.open(5)[0] == "queued"
    assert rows.held(5) == 1  # the open it answered before holds on
    if change in ("rewritten in place, same size", "rename over"):
        assert offer(rows, source, 5, 7, "d/f.bin")  # the daemon's decision: the new version
        assert session.open(5)[0] == "answered"
        assert rows.held(5) == 2


def test_suspend(session: Session, source: Path) -> None:
    """Suspended (the daemon decides an open of the inode): no OPEN answered; the opens held
    are given over (adopted): what they read, the backing id, the version and attributes the
    row was offered with, which the lane also says while it holds them (``held_stat``). A
    RELEASE of one of them goes to the daemon, which tells the lane (``release``: the opens
    left). Offered again, the lane answers again, and takes back the releases."""
    rows = session.lane
    st = os.lstat(source / "d" / "f.bin")
    assert offer(rows, source, 5, 7, "d/f.bin")
    fh = session.open(5)[1][0]
    assert session.open(5)[0] == "answered"
    assert rows.held_stat(5) == (lane.Kind.ENTRY, st)
    assert rows.census()[0] == 1  # an inode open by passthrough the daemon has no record of
    taken = rows.suspend(5)
    assert taken == lane.Adopted(lane.Kind.ENTRY, 7, -1, st)
    assert (taken.st.st_mtime, taken.st.st_atime_ns, taken.st[8]) == (st.st_mtime, st.st_atime_ns,
                                                                      st[8])
    assert rows.held_stat(5) == (lane.Kind.NONE, None)  # the daemon's now
    assert rows.census()[0] == 0
    assert session.open(5)[0] == "queued"
    assert rows.held(5) == 2
    assert session.release(5, fh) == "queued"
    assert rows.release(5) == 1
    assert rows.suspend(5) is None  # again: nothing more to give over
    assert offer(rows, source, 5, 7, "d/f.bin")
    assert session.open(5)[0] == "answered" and rows.held(5) == 2
    assert session.release(5, fh) == "answered" and rows.held(5) == 1


def test_drop_with_opens_held(session: Session, source: Path) -> None:
    """A row dropped while opens it answered are held stays, answering no OPEN: drop says
    how many; the lane answers their RELEASEs, and the row goes at the last. Adopted by the
    daemon first (its entry gone, its inode detached), those RELEASEs go to the daemon; the
    last release says 0, and then the row goes with a drop."""
    rows = session.lane
    assert offer(rows, source, 5, 7, "d/f.bin")
    fh = session.open(5)[1][0]
    assert rows.drop(5) == 1
    assert session.open(5)[0] == "queued"
    assert session.release(5, fh) == "answered"
    assert (rows.held(5), rows.release(5)) == (0, -1)  # gone
    assert offer(rows, source, 5, 7, "d/f.bin")
    session.open(5)
    session.open(5)
    assert rows.suspend(5, held_only=True) is not None
    assert rows.drop(5) == 2
    assert rows.held(5) == 2
    assert session.open(5)[0] == "queued"
    assert rows.drop(5) == 2  # again: still held
    assert session.release(5, fh) == "queued"
    assert rows.release(5) == 1
    assert session.release(5, fh) == "queued"
    assert rows.release(5) == 0
    assert rows.release(5) == 0  # a release too many is not counted below 0
    assert rows.drop(5) == 0
    assert (rows.held(5), rows.release(5)) == (0, -1)
    assert session.open(5)[0] == "queued"


def test_another_backing_while_opens_are_held(session: Session, source: Path,
                                              lib: ctypes.CDLL) -> None:
    """The kernel gives an inode one backing at a time: while opens the lane answered are
    held, an offer of another backing is -EBUSY (and changes nothing: the row goes on
    answering with its own, if active); of the same backing it is taken (a longer path too,
    the opens kept). Once they are released, another backing is taken."""
    rows = session.lane
    st = os.lstat(source / "d" / "f.bin")
    assert offer(rows, source, 5, 7, "d/f.bin")
    fh = session.open(5)[1][0]
    assert not offer(rows, source, 5, 8, "d/f.bin")
    fields = (ctypes.c_int64 * 13)(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                   st.st_ctime_ns, st.st_atime_ns, st.st_blocks, st.st_mode,
                                   st.st_nlink, st.st_uid, st.st_gid, st.st_rdev, st.st_blksize)
    assert lib.lane_offer(5, 8, b"d/f.bin", fields, 0, 0, -1) == -errno.EBUSY
    assert session.open(5)[1][2] == 7
    rows.suspend(5)
    assert not offer(rows, source, 5, 8, "d/f.bin")
    assert session.open(5)[0] == "queued"  # still suspended: the refused offer changed nothing
    assert rows.offer(5, 7, b"./d/../d/f.bin", st)  # the same backing, a longer path
    assert rows.held(5) == 2
    assert session.open(5)[1][2] == 7
    for _ in range(3):
        assert session.release(5, fh) == "answered"
    assert rows.held(5) == 0
    assert offer(rows, source, 5, 8, "d/f.bin")
    assert session.open(5)[1][2] == 8


def test_enable(session: Session, source: Path) -> None:
    """Off (an aligned group has members), the lane answers no OPEN, but the RELEASEs of the
    opens it holds still; on again, it answers as its rows say."""
    rows = session.lane
    assert offer(rows, source, 5, 7, "d/f.bin")
    fh = session.open(5)[1][0]
    rows.enable(False)
    assert session.open(5)[0] == "queued"
    assert session.release(5, fh) == "answered"
    rows.enable(True)
    assert session.open(5)[0] == "answered"


def test_lane_start_twice_is_refused(session: Session, source: Path) -> None:
    """One session per library: a second start says EALREADY, the first serves on."""
    root = os.open(source, os.O_PATH | os.O_DIRECTORY)
    try:
        assert session.lib.lane_start(session.ours.fileno(), root, 1) == -errno.EALREADY
    finally:
        os.close(root)
    assert offer(session.lane, source, 5, 7, "d/f.bin")
    assert session.open(5)[0] == "answered"


# -- source rows (small misses) ----------------------------------------------------------------


def test_a_source_row_the_kernel_refuses_goes_to_the_daemon(session: Session,
                                                            source: Path) -> None:
    """A source row's first open registers the source file as its backing; on a session
    that is not /dev/fuse the registration fails, so the open is the daemon's, and so is
    every later one (the row answers no more): nothing is counted, nothing handed over."""
    rows = session.lane
    st = os.lstat(source / "g.bin")
    assert rows.offer_source(7, b"g.bin", st, Keep.ROOM)
    for _ in range(2):
        assert session.open(7)[0] == "queued"
    assert rows.counts()[3:6] == (0, 0, 0)
    assert rows.noting() == 0 and list(rows.notes()) == []
    assert rows.source_stat(7) is None  # it holds no open
    assert rows.suspend(7) is None  # no open to give over: the row goes


def test_source_row_calls_without_opens(lib: ctypes.CDLL, source: Path) -> None:
    """A source row offered over an entry's row with no opens replaces it (and back); a
    claim of it by a fill says it is not being read and removes it; offering it again for
    the same version leaves it as it is; held-only suspension touches nothing without
    opens."""
    rows = lane.Lane(lib)
    st = os.lstat(source / "d" / "f.bin")
    assert offer(rows, source, 5, 7, "d/f.bin")
    assert rows.offer_source(5, b"d/f.bin", st, Keep.ROOM)
    assert rows.offer_source(5, b"d/f.bin", st, Keep.NEVER)  # the same version: kept
    assert rows.suspend(5, held_only=True) is None
    assert not rows.claim(5)  # not read now: it goes
    assert (rows.held(5), rows.release(5)) == (0, -1)
    assert rows.offer_source(5, b"d/f.bin", st, Keep.ROOM)
    assert offer(rows, source, 5, 7, "d/f.bin")  # an entry's row over it
    assert rows.drop(5) == 0 and rows.release(5) == -1


def test_the_copier_starts_once_and_a_bad_directory_is_an_error(lib: ctypes.CDLL,
                                                                 tmp_path: Path) -> None:
    """``copy_into`` starts the lane's copier with the entries' directory once (a second
    call changes nothing); a descriptor that is none is an OSError (the daemon then
    backfills the notes' files itself), and nothing is being copied."""
    rows = lane.Lane(lib)
    with pytest.raises(OSError) as raised:
        rows.copy_into(-1)
    assert raised.value.errno == errno.EBADF
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        rows.copy_into(fd)
        rows.copy_into(fd)
    finally:
        os.close(fd)
    assert rows.copying() == 0 and rows.counts()[12:] == (0, 0)
