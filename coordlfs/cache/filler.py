"""Copying source files into the cache's entry files, in a process of the daemon's own.

Why a process: a fill is a handful of system calls per file (open, fstat, read, create, write,
fstat, close), and from a thread of the daemon each of them hands the GIL back and forth with
the event loop, which serves every FUSE request: at 1 reader a hand-off to a fill thread was
seen to stall the loop ~150 us in cProfile (a lock's release, the thread running Python before
its next system call), and the cold miss cost the daemon ~400 us of CPU where a hit costs 80.
The filler runs those calls under its own interpreter, on the other core, while the loop only
reserves each entry and ends it.

The daemon and the filler talk over a ``SOCK_SEQPACKET`` socket pair, a datagram a message,
each a fixed header (``_REQUEST``, ``_REPLY``) and, for a request, a path:

- ``OPEN id path``: open the file beneath the source's root (``O_DIRECT`` where allowed, no
  link followed) and keep it; the reply is its fstat (``STAT``). The daemon reserves an entry
  for what it saw, then sends
- ``COPY id number``: the kept file into the entry's file ``files/<number>``, ``FILL_CHUNK``
  at a time (a ``PROGRESS`` after each chunk but the last); the reply (``DONE``) is the fstat
  after, or the errno that stopped it; or ``DROP id``: close it, nothing reserved.
- ``BEHIND id number version path``: a file whose pages a reader just brought into the page
  cache (the kernel read it from the source for them: FUSE passthrough): open it, check the
  version, ``sendfile`` it into the entry's file (no storage read for what the reader read),
  drop those pages; ``DONE``.

Requests run on ``threads`` worker threads of the filler (storage reads in flight at once).
The filler reads only beneath the source's root and writes only into the cache's ``files``
directory, both passed down as descriptors; it exits when the daemon closes its end (or dies).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import trio

from coordlfs.source.beneath import open_beneath
from coordlfs.source.source import READING, SourceReader, Version

log = logging.getLogger(__name__)

#: What a fill copies at once, and a reader of a large file waits for at most (its progress).
FILL_CHUNK = 1 << 20
#: Requests kept while the socket has no room (~150 bytes each); past it a fill fails (its
#: readers read the source), so a filler that stops taking them cannot grow the daemon.
MAX_WAITING = 1 << 16

#: the messages' kinds
OPEN, COPY, DROP, BEHIND = 1, 2, 3, 4
STAT, DONE, PROGRESS = 5, 6, 7
#: a request: id, kind, entry number, the version (ino, size, mtime, ctime); then the path
_REQUEST = struct.Struct("=IB3xqQqqq")
#: a reply: id, kind, errno (0: none), then a stat (dev, ino, mode, size, mtime, ctime), or
#: for PROGRESS the bytes copied so far in ``size``
_REPLY = struct.Struct("=IBxxxiQQIxxxxqqq")
_PATH_MAX = 4096
_DATAGRAM = _REQUEST.size + _PATH_MAX


class Stat(NamedTuple):
    """What the filler saw of a file, with ``os.stat_result``'s names: ``Version.of``,
    ``Entry.matches`` and the cache's reservations read it as they read a stat."""

    st_dev: int
    st_ino: int
    st_mode: int
    st_size: int
    st_mtime_ns: int
    st_ctime_ns: int


def file_name(number: int) -> str:
    """The name of entry ``number``'s file in the cache's ``files`` directory."""
    return f"{number:x}"


def create_file(files_fd: int, number: int) -> int:
    """A new entry's file, for writing: 0600, exclusive (a leftover of the name is removed
    first), never through a link."""
    name = file_name(number)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, 0o600, dir_fd=files_fd)
    except FileExistsError:
        os.unlink(name, dir_fd=files_fd)
        return os.open(name, flags, 0o600, dir_fd=files_fd)


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite all of ``data``. A short write is continued, so a filesystem that runs out of
    room raises ENOSPC rather than leaving a hole that reads back as zeros."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "the cache's filesystem took no bytes")
        view, offset = view[written:], offset + written


def _stat_of(st: os.stat_result) -> Stat:
    return Stat(st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# -- the daemon's side ----------------------------------------------------------------------


class Pending:
    """A request in flight: its reply (or error) for a task that waits (``wait``) or a
    callback (``then``, run on the event loop), and what a large copy reported so far."""

    __slots__ = ("done", "error", "progress", "reply", "then", "waiter")
    waiter: trio.lowlevel.Task | None

    def __init__(self, progress: Callable[[int], None] | None = None,
                 then: Callable[[Pending], None] | None = None) -> None:
        self.progress = progress
        self.then = then
        self.reply: Stat | None = None
        self.error: OSError | None = None
        self.done = False
        self.waiter = None

    async def wait(self) -> Stat:
        """The reply; cancelled (unmount), the filler's answer is ignored."""
        if not self.done:
            self.waiter = trio.lowlevel.current_task()

            def abort(_raise_cancel: object) -> trio.lowlevel.Abort:
                self.waiter = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply

    def end(self) -> None:
        self.done = True
        if self.waiter is not None:
            waiter, self.waiter = self.waiter, None
            trio.lowlevel.reschedule(waiter)  # type: ignore[arg-type]
        if self.then is not None:
            try:
                self.then(self)
            except Exception:  # run from the receiving task, which must go on
                log.exception("ending a fill failed")


class Filler:
    """The daemon's end: starts the filler process, sends requests, hands out replies.

    ``run`` receives on the event loop and starts a new filler if one exits while the mount
    is up (what it had in flight fails: those entries are given up, their readers read the
    source). A request is one ``send`` on the loop; a reply wakes the task waiting for it.
    """

    def __init__(self, root_fd: int, files_fd: int, threads: int) -> None:
        self.root_fd = root_fd
        self.files_fd = files_fd
        self.threads = max(1, threads)
        self._pending: dict[int, Pending] = {}
        #: requests the socket had no room for yet (an AF_UNIX datagram socket queues
        #: ``net.unix.max_dgram_qlen`` of them, 10 by default), sent by ``_sender``
        self._outbox: deque[bytes] = deque()
        self._more_out = trio.Event()
        self._next = 1
        self._closing = False
        self.started = 0
        self.sock, self.process = self._spawn()

    def _spawn(self) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "coordlfs.cache.filler", str(self.root_fd),
                 str(self.files_fd), str(theirs.fileno()), str(self.threads)],
                pass_fds=(self.root_fd, self.files_fd, theirs.fileno()),
                stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.started += 1
        return ours, process

    def _send(self, kind: int, pending: Pending | None = None, number: int = 0,
              version: Version | None = None, path: bytes = b"", ident: int = 0) -> int:
        if not ident:
            ident = self._next
            self._next = self._next % 0xFFFFFFFF + 1
        ino, size, mtime_ns, ctime_ns = version if version is not None else (0, 0, 0, 0)
        message = _REQUEST.pack(ident, kind, number, ino, size, mtime_ns, ctime_ns) + path
        if len(path) >= _PATH_MAX:
            raise OSError(errno.ENAMETOOLONG, "file name too long to fill")
        if len(self._outbox) >= MAX_WAITING:
            raise OSError(errno.EAGAIN, "the fill process is not taking requests")
        if self._outbox:
            self._outbox.append(message)
        else:
            try:
                self.sock.send(message)
            except BlockingIOError:
                self._outbox.append(message)
                self._more_out.set()
            except OSError as e:  # gone: ``run`` starts another
                raise OSError(e.errno or errno.EIO, "the fill process is not taking "
                              "requests") from None
        if pending is not None:
            self._pending[ident] = pending
        return ident

    def open(self, path: bytes) -> tuple[int, Pending]:
        """Ask for ``path`` opened and stat'ed; its id (for ``copy``/``drop``) and reply."""
        pending = Pending()
        return self._send(OPEN, pending, path=path), pending

    def copy(self, ident: int, number: int, progress: Callable[[int], None]) -> Pending:
        """Ask for the file opened as ``ident`` copied into entry ``number``'s file;
        ``progress`` is told of the bytes copied so far of a large one."""
        pending = Pending(progress)
        self._send(COPY, pending, number, ident=ident)
        return pending

    def drop(self, ident: int) -> None:
        """The file opened as ``ident`` is not wanted."""
        with contextlib.suppress(OSError):  # a filler gone has closed it
            self._send(DROP, ident=ident)

    def behind(self, path: bytes, number: int, version: Version,
               then: Callable[[Pending], None]) -> None:
        """Ask for ``path`` (at ``version``) copied from the page cache into entry
        ``number``'s file, its pages dropped after; ``then`` is told of the end."""
        self._send(BEHIND, Pending(then=then), number, version, path)

    async def run(self) -> None:
        """Send what waits and receive replies until unmount; a filler that exits is
        replaced."""
        while True:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sender)
                await self._receive()
                nursery.cancel_scope.cancel()
            self._outbox.clear()
            self._fail_all("the fill process exited")
            if self._closing:
                return
            log.warning("the fill process exited (status %s): starting another",
                        self.process.poll())
            await trio.sleep(1)
            self.sock.close()
            self.sock, self.process = self._spawn()

    async def _sender(self) -> None:
        while True:
            await self._more_out.wait()
            self._more_out = trio.Event()
            while self._outbox:
                try:
                    self.sock.send(self._outbox[0])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self.sock)
                    continue
                except OSError:
                    return  # gone: ``_receive`` sees it too
                self._outbox.popleft()

    async def _receive(self) -> None:
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            while True:
                try:
                    message = self.sock.recv(_REPLY.size)
                except BlockingIOError:
                    break
                except OSError:
                    return
                if not message:
                    return
                self._answer(*_REPLY.unpack(message))

    def _answer(self, ident: int, kind: int, error: int, *st: int) -> None:
        if kind == PROGRESS:
            pending = self._pending.get(ident)
            if pending is not None and pending.progress is not None:
                pending.progress(st[3])
            return
        pending = self._pending.pop(ident, None)
        if pending is None:
            return
        if error:
            pending.error = OSError(error, _MESSAGES.get(error, os.strerror(error)))
        else:
            dev, ino, mode, size, mtime_ns, ctime_ns = st
            pending.reply = Stat(dev, ino, mode, size, mtime_ns, ctime_ns)
        pending.end()

    def _fail_all(self, why: str) -> None:
        pending, self._pending = self._pending, {}
        for request in pending.values():
            request.error = OSError(errno.EIO, why)
            request.end()

    async def drained(self, seconds: float) -> None:
        """Wait, at most ``seconds``, for the requests in flight now to be answered: at
        unmount, the files just read are then complete in the cache (and in its journal)."""
        waiting = set(self._pending)
        with trio.move_on_after(seconds):
            while not waiting.isdisjoint(self._pending):
                await trio.sleep(0.01)

    def close(self) -> None:
        """At unmount: the filler ends when it sees its end closed; waited for, then killed."""
        self._closing = True
        self.sock.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def status(self) -> dict[str, int]:
        return {"pid": self.process.pid, "in_flight": len(self._pending),
                "started": self.started}


#: what a filler's errno means here, where the errno alone would mislead
_MESSAGES = {errno.ESTALE: "source file changed while being cached",
             errno.ENODATA: "source file shrank while being cached"}


# -- the filler's side -----------------------------------------------------------------------


class _Server:
    """The filler process: requests from the socket, each run on a worker thread."""

    def __init__(self, root_fd: int, files_fd: int, sock: socket.socket, threads: int) -> None:
        self.root_fd = root_fd
        self.files_fd = files_fd
        self.sock = sock
        self.pool = ThreadPoolExecutor(threads)
        self.opened: dict[int, SourceReader] = {}
        self.lock = threading.Lock()

    def serve(self) -> None:
        while True:
            message = self.sock.recv(_DATAGRAM)
            if len(message) < _REQUEST.size:
                break  # the daemon closed its end
            ident, kind, number, ino, size, mtime_ns, ctime_ns = _REQUEST.unpack_from(message)
            path = message[_REQUEST.size:]
            if kind == DROP:
                with self.lock:
                    reader = self.opened.pop(ident, None)
                if reader is not None:
                    reader.close()
            elif kind == OPEN:
                self.pool.submit(self._answering, ident, self._open, ident, path)
            elif kind == COPY:
                self.pool.submit(self._answering, ident, self._copy, ident, number)
            elif kind == BEHIND:
                version = Version(ino, size, mtime_ns, ctime_ns)
                self.pool.submit(self._answering, ident, self._behind, path, number, version)
        self.pool.shutdown(wait=True)
        for reader in self.opened.values():
            reader.close()

    def _answering(self, ident: int, work: Callable[..., tuple[int, Stat]], *args: object
                   ) -> None:
        try:
            kind, st = work(*args)
            reply = _REPLY.pack(ident, kind, 0, *st)
        except OSError as e:
            reply = _REPLY.pack(ident, DONE, e.errno or errno.EIO, 0, 0, 0, 0, 0, 0)
        except Exception as e:  # a fault of ours: the fill fails, the filler goes on
            print(f"coordlfs filler: {type(e).__name__}: {e}", file=sys.stderr)
            reply = _REPLY.pack(ident, DONE, errno.EIO, 0, 0, 0, 0, 0, 0)
        self._reply(reply)

    def _reply(self, reply: bytes) -> None:
        with contextlib.suppress(OSError):  # the daemon is gone: nothing to tell
            self.sock.send(reply)

    def _open(self, ident: int, path: bytes) -> tuple[int, Stat]:
        reader = SourceReader.opening(open_beneath, self.root_fd, path)
        try:
            st = _stat_of(reader.fstat())
        except BaseException:
            reader.close()
            raise
        with self.lock:
            self.opened[ident] = reader
        return STAT, st

    def _copy(self, ident: int, number: int) -> tuple[int, Stat]:
        with self.lock:
            reader = self.opened.pop(ident, None)
        if reader is None:
            raise OSError(errno.EBADF, "not opened")
        try:
            size = reader.fstat().st_size
            fd = create_file(self.files_fd, number)
            try:
                done = 0
                while done < size:
                    if done:
                        self._reply(_REPLY.pack(ident, PROGRESS, 0, 0, 0, 0, done, 0, 0))
                    data = reader.read_view(done, min(FILL_CHUNK, size - done))
                    if not data:
                        raise OSError(errno.ENODATA, "shrank")
                    write_all(fd, data, done)
                    done += len(data)
            finally:
                os.close(fd)
            return DONE, _stat_of(reader.fstat())
        finally:
            reader.close()

    def _behind(self, path: bytes, number: int, version: Version) -> tuple[int, Stat]:
        src = open_beneath(self.root_fd, path, READING)
        try:
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode) or Version.of(st) != version:
                raise OSError(errno.ESTALE, "changed")
            fd = create_file(self.files_fd, number)
            try:
                done = 0
                while done < version.size:
                    got = os.sendfile(fd, src, done, version.size - done)
                    if got == 0:
                        raise OSError(errno.ENODATA, "shrank")
                    done += got
            finally:
                os.close(fd)
            final = os.fstat(src)
            os.posix_fadvise(src, 0, 0, os.POSIX_FADV_DONTNEED)  # the cache has them now
            return DONE, _stat_of(final)
        finally:
            os.close(src)


def main(argv: list[str]) -> int:
    root_fd, files_fd, sock_fd, threads = (int(a) for a in argv)
    sock = socket.socket(fileno=sock_fd)
    _Server(root_fd, files_fd, sock, threads).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
