"""The peer server's C path: a peer lane's GET of a file this node has cached, answered
without the Python loop.

A file served to a peer cost this daemon about 200 µs of its loop (the frame, the request, the
source's lstat, the entry, the reply). ``serving.c``, built by ``scripts/setup`` beside this
module, answers it on a thread per connection: a GET of a whole file the cache's index holds at
the version asked (``coordlfs.cache.published``: complete entries, withdrawn the moment their
source may have changed), whose source file is still that version, is sent from the entry's
file by ``sendfile``. Only the connections of a peer's request lane come here
(``coordlfs.fs.lane_peers``: one GET at a time, whole small files; they ask with wire
``Kind.LANE``); every GET the C path does not answer is handed back as a ticket
(``Serving.take``), answered by ``PeerServer`` as any of its own (it may start a fill and wait
for it) and given back (``Serving.answer``), so the daemon keeps every decision.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from coordlfs.peers.wire import GET_HEADER, MAX_PATH

log = logging.getLogger(__name__)

LIBRARY = Path(__file__).resolve().parent / "libcoordlfs-serving.so"
#: serving.c's counters, in its order
COUNTS = ("connections", "files", "bytes", "deferred", "faults", "idle_closed")
_Counts = ctypes.c_uint64 * len(COUNTS)


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(LIBRARY))
    lib.serving_start.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_double,
                                  ctypes.c_double, ctypes.c_int]
    lib.serving_take.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p,
                                 ctypes.c_size_t]
    lib.serving_take.restype = ctypes.c_ssize_t
    lib.serving_answer.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p,
                                   ctypes.c_size_t]
    lib.serving_connection.argtypes = [ctypes.c_int]
    lib.serving_counts.argtypes = [ctypes.POINTER(_Counts)]
    lib.serving_counts.restype = ctypes.c_int64
    return lib


class Serving:
    """The C path, started once per process (its state is the library's)."""

    def __init__(self, lib: ctypes.CDLL, fd: int) -> None:
        self._lib = lib
        #: readable when GETs wait for the daemon (``take``)
        self.fd = fd
        self._buffer = ctypes.create_string_buffer(GET_HEADER.size + MAX_PATH)
        self._ticket = ctypes.c_uint64()
        self._counts = _Counts()

    @classmethod
    def start(cls, source_root: int, cache_dir: int, files_dir: int, timeout: float,
              idle: float, connections: int) -> Serving | None:
        """Serve from the cache whose directory is ``cache_dir`` (its index) and ``files_dir``,
        checking source files beneath ``source_root``; None (said once in the log) if the
        library is not built or cannot start."""
        if not LIBRARY.exists():
            log.info("peers' requests answered in Python: %s is not built (scripts/setup "
                     "builds it)", LIBRARY.name)
            return None
        lib = _load()
        fd = lib.serving_start(source_root, cache_dir, files_dir, timeout, idle, connections)
        if fd < 0:
            log.warning("peers' requests answered in Python: %s", os.strerror(-fd))
            return None
        return cls(lib, fd)

    def hand(self, fd: int) -> bool:
        """Serve the connection ``fd`` (authenticated, nothing of a next frame read) in C:
        True, and the descriptor is the library's; False (at the cap, or it cannot) and the
        caller keeps it as it was."""
        rc = self._lib.serving_connection(fd)
        if rc < 0 and rc != -errno.ENOSPC:
            log.info("a peer lane connection served in Python: %s", os.strerror(-rc))
        return rc == 0

    def take(self) -> Iterator[tuple[int, bytes]]:
        """The GETs waiting for the daemon now: each ticket and its payload."""
        while (n := self._lib.serving_take(ctypes.byref(self._ticket), self._buffer,
                                           len(self._buffer))) >= 0:
            yield self._ticket.value, self._buffer.raw[:n]

    def answer(self, ticket: int, kind: int, payload: bytes) -> None:
        """Give the reply to ``ticket``: a frame of ``kind`` carrying ``payload``."""
        rc = self._lib.serving_answer(ticket, kind, payload, len(payload))
        if rc < 0:
            log.warning("a peer's request could not be answered: %s", os.strerror(-rc))

    def counts(self) -> dict[str, int]:
        """What the C path did: connections taken, files and bytes sent, GETs handed to the
        daemon, connections closed for a fault or idle; and those open now."""
        open_now = self._lib.serving_counts(ctypes.byref(self._counts))
        return {**dict(zip(COUNTS, self._counts, strict=True)), "open_connections": open_now}
