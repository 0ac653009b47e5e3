"""The fill process itself: what runs in the process of the daemon's own that copies source
files into the cache's entry files (``coordlfs.cache.filler`` is the daemon's end of it, and
says why it is a process).

Standard library and ``coordlfs.source`` only, so that it starts in ~40 ms (trio alone would
take 150): ``python -m coordlfs.cache.fill_process ROOT_FD FILES_FD SOCKET_FD THREADS``, the
descriptors passed down by the daemon. The daemon and the process talk over a
``SOCK_SEQPACKET`` socket pair, a datagram a message, each a fixed header (``REQUEST``,
``REPLY``) and, for a request, a path:

- ``READY``: sent once by the process when it serves.
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

Requests run on ``THREADS`` worker threads (storage reads in flight at once). The process
reads only beneath the source's root and writes only into the cache's ``files`` directory;
it exits when the daemon closes its end (or dies).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from coordlfs.source.beneath import open_beneath
from coordlfs.source.source import READING, SourceReader, Version

#: What a fill copies at once, and a reader of a large file waits for at most (its progress).
FILL_CHUNK = 1 << 20

#: the messages' kinds
OPEN, COPY, DROP, BEHIND = 1, 2, 3, 4
STAT, DONE, PROGRESS, READY = 5, 6, 7, 8
#: a request: id, kind, entry number, the version (ino, size, mtime, ctime); then the path
REQUEST = struct.Struct("=IB3xqQqqq")
#: a reply: id, kind, errno (0: none), then a stat (dev, ino, mode, size, mtime, ctime), or
#: for PROGRESS the bytes copied so far in ``size``
REPLY = struct.Struct("=IBxxxiQQIxxxxqqq")
PATH_MAX = 4096
_DATAGRAM = REQUEST.size + PATH_MAX


class Stat(NamedTuple):
    """What the fill process saw of a file, with ``os.stat_result``'s names: ``Version.of``,
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
        self._reply(REPLY.pack(0, READY, 0, 0, 0, 0, 0, 0, 0))
        while True:
            message = self.sock.recv(_DATAGRAM)
            if len(message) < REQUEST.size:
                break  # the daemon closed its end
            ident, kind, number, ino, size, mtime_ns, ctime_ns = REQUEST.unpack_from(message)
            path = message[REQUEST.size:]
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
            reply = REPLY.pack(ident, kind, 0, *st)
        except OSError as e:
            reply = REPLY.pack(ident, DONE, e.errno or errno.EIO, 0, 0, 0, 0, 0, 0)
        except Exception as e:  # a fault of ours: the fill fails, the filler goes on
            print(f"coordlfs filler: {type(e).__name__}: {e}", file=sys.stderr)
            reply = REPLY.pack(ident, DONE, errno.EIO, 0, 0, 0, 0, 0, 0)
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
                        self._reply(REPLY.pack(ident, PROGRESS, 0, 0, 0, 0, done, 0, 0))
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
