"""The daemon's end of the fill process: a process of the daemon's own that copies source
files into the cache's entry files (``coordlfs.cache.fill_process`` is what runs in it, and
says how they talk).

Why a process: a fill is a handful of system calls per file (open, fstat, read, create, write,
fstat, close), and from a thread of the daemon each of them hands the GIL back and forth with
the event loop, which serves every FUSE request: the fill threads and the loop share one core's
worth of Python. The fill process runs those calls under its own interpreter, on the other
core, while the loop only reserves each entry and ends it: 2,000 cold 112 KB files prefetched
alone filled at 2,750-3,070 files/s with 100-105 us of the daemon's CPU a file, against
2,270-2,500 files/s and 140-150 us with worker threads (a plain Python pool copying the same
files reaches 3,160-3,340).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable

import trio

from coordlfs.cache.fill_process import (
    BEHIND,
    COPY,
    DROP,
    OPEN,
    PATH_MAX,
    PROGRESS,
    READY,
    REPLY,
    REQUEST,
    Stat,
)
from coordlfs.errors import UserError
from coordlfs.source.source import Version

log = logging.getLogger(__name__)

#: Requests kept while the socket has no room (~150 bytes each); past it a fill fails (its
#: readers read the source), so a fill process that stops taking them cannot grow the daemon.
MAX_WAITING = 1 << 16
#: How long a new fill process may take to say it serves.
START_S = 30.0


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

    def _spawn(self, wait: bool = True) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        """A new fill process, and the daemon's end of its socket; with ``wait``, once it
        said it serves (the mount's first, so that no fill waits for its start-up)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "coordlfs.cache.fill_process", str(self.root_fd),
                 str(self.files_fd), str(theirs.fileno()), str(self.threads)],
                pass_fds=(self.root_fd, self.files_fd, theirs.fileno()),
                stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.started += 1
        if wait:
            ours.settimeout(START_S)
            try:
                ready = ours.recv(REPLY.size)
            except OSError:
                ready = b""
            if len(ready) != REPLY.size or REPLY.unpack(ready)[1] != READY:
                ours.close()
                process.kill()
                raise UserError(f"the fill process did not start (exit status "
                                f"{process.wait()})")
        ours.setblocking(False)
        return ours, process

    def _send(self, kind: int, pending: Pending | None = None, number: int = 0,
              version: Version | None = None, path: bytes = b"", ident: int = 0) -> int:
        if not ident:
            ident = self._next
            self._next = self._next % 0xFFFFFFFF + 1
        ino, size, mtime_ns, ctime_ns = version if version is not None else (0, 0, 0, 0)
        message = REQUEST.pack(ident, kind, number, ino, size, mtime_ns, ctime_ns) + path
        if len(path) >= PATH_MAX:
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
            self.sock, self.process = self._spawn(wait=False)

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
                    message = self.sock.recv(REPLY.size)
                except BlockingIOError:
                    break
                except OSError:
                    return
                if not message:
                    return
                self._answer(*REPLY.unpack(message))

    def _answer(self, ident: int, kind: int, error: int, *st: int) -> None:
        if kind == READY:  # a new fill process's (``run``)
            return
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


