"""The pyfuse3 ``Operations``: FUSE's requests answered over the source, inodes, opens and control.

pyfuse3 runs every handler on one trio thread, and any exception other than FUSEError kills
the whole filesystem; ``guarded`` turns such an exception into EIO for that one request and a
log line. This module answers metadata and keeps the handle table; how an open file is served
and what it holds is ``coordlfs.fs.opens``'s, its bytes its reader's (``coordlfs.fs.readers``),
apart from the cache hit, answered inline. Nothing here blocks on data: source reads run in
worker threads (see readers.py and cache.py), and only metadata calls, which the source's
dentry and inode caches answer, run inline.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pyfuse3

from coordlfs import CONTROL_NAME
from coordlfs.cache.cache import WholeFileCache
from coordlfs.cache.stats import ReadCounters
from coordlfs.fs.freshness import WATCHED_TIMEOUT, Freshness, invalidate_attributes
from coordlfs.fs.inodes import CONTROL_INODE, ROOT_INODE, InodeTable
from coordlfs.fs.lane import LANE_FH
from coordlfs.fs.listing import DOTS, Listing
from coordlfs.fs.opens import FileHandle, Opens
from coordlfs.fs.readers import AlignedReads, Readers
from coordlfs.peers.links import Peers
from coordlfs.protocol.server import ControlHandle, ControlServer
from coordlfs.source.source import Source
from coordlfs.source.threads import in_thread

log = logging.getLogger(__name__)

_CONTROL_NAME = os.fsencode(CONTROL_NAME)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def guarded(handler: F) -> F:
    """Map OSError to its errno and any other exception to EIO, so the mount stays up."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("%s failed; answering EIO", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


@dataclass(slots=True, eq=False)
class DirHandle:
    path: bytes
    #: the source directory, read a buffer at a time (``coordlfs.fs.listing``)
    listing: Listing


def _child(base: bytes, name: bytes) -> bytes:
    """The source path of ``name`` in the directory at ``base`` ('' is the root)."""
    return base + b"/" + name if base else name


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, source: Source, cache: WholeFileCache, counters: ReadCounters,
                 control: ControlServer, aligned: AlignedReads, peers: Peers,
                 revalidate_s: float) -> None:
        super().__init__()
        self.source = source
        self.cache = cache
        self.counters = counters
        self.control = control
        self.readers = Readers(source, cache, counters, peers, aligned)
        root = source.lstat(b"")
        self.inodes = InodeTable((root.st_dev, root.st_ino))
        self.opens = Opens(self.readers, self.inodes)
        self.freshness = Freshness(source, self.inodes, revalidate_s, self.changed_open)
        self._handles: dict[int, FileHandle | DirHandle | ControlHandle] = {}
        self._next_fh = 1

    def serve_by_passthrough(self, why_not: str | None) -> None:
        """Before mounting: passthrough is asked for at init (None), or why not."""
        self.opens.serve_by_passthrough(why_not)

    def init(self) -> None:
        self.opens.init()

    def passthrough_status(self) -> dict[str, Any]:
        return self.opens.passthrough_status()

    # -- attributes ---------------------------------------------------------------

    def _attr(self, inode: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        # Field by field, not a loop of setattr(getattr(...)): every lookup and listed
        # entry builds one, and the loop costs twice as much.
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = st.st_mode
        attr.st_nlink = st.st_nlink
        attr.st_uid = st.st_uid
        attr.st_gid = st.st_gid
        attr.st_rdev = st.st_rdev
        attr.st_size = st.st_size
        attr.st_blksize = st.st_blksize
        attr.st_blocks = st.st_blocks
        attr.st_atime_ns = st.st_atime_ns
        attr.st_mtime_ns = st.st_mtime_ns
        attr.st_ctime_ns = st.st_ctime_ns
        attr.st_ino = inode
        attr.entry_timeout = attr.attr_timeout = self.freshness.timeout
        return attr

    def _control_attr(self) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = CONTROL_INODE
        attr.st_mode = stat.S_IFREG | 0o666
        attr.st_nlink = 1
        attr.st_blksize = 4096
        attr.entry_timeout = attr.attr_timeout = WATCHED_TIMEOUT
        return attr

    def changed_open(self, path: bytes) -> None:
        """The source file at ``path`` changed (the watch says): open files of it that read
        its bytes as they are now (no version pinned) show its new attributes, so that what
        they read and what fstat says agree. The kernel asks ``getattr`` again."""
        for inode in self.opens.reading_now(path):
            invalidate_attributes(inode)

    def _node_path(self, inode: int) -> bytes:
        try:
            return self.inodes.path(inode)
        except KeyError:
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    @guarded
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        if parent_inode == ROOT_INODE and name == _CONTROL_NAME:
            return self._control_attr()
        if name == b".":
            path = self._node_path(parent_inode)
        elif name == b"..":
            path = self._node_path(parent_inode).rpartition(b"/")[0]
        else:
            base = self._node_path(parent_inode)
            self.freshness.watch(parent_inode, base)
            path = _child(base, name)
        try:
            st = self.source.lstat(path)
        except FileNotFoundError:
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0
            negative.entry_timeout = self.freshness.timeout
            return negative
        inode = self.opens.known(st, path)
        self.opens.looked_up(inode, st, path)
        return self._attr(inode, st)

    @guarded
    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        if inode == CONTROL_INODE:
            return self._control_attr()
        opened = self.opens.opened_stat(inode)
        if opened is not None:
            return self._attr(inode, opened)
        path = self._node_path(inode)
        st = self.source.lstat(path)
        old = self.inodes.detached(inode)
        if old is None:
            if (st.st_dev, st.st_ino) != self.inodes[inode].key:
                # another file at its path now: the kernel's walk looks the name up again
                raise pyfuse3.FUSEError(errno.ESTALE)
            return self._attr(self.opens.known(st, path), st)
        # The old version of a changed file (``Opens.renumbered``), its opens closed since: it
        # shows that version's size and times.
        attr = self._attr(inode, st)
        attr.st_size, attr.st_mtime_ns, attr.st_ctime_ns = old.size, old.mtime_ns, old.ctime_ns
        return attr

    @guarded
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
        # Shell redirection (`echo ... > .coordlfs`) truncates first: accept it, change nothing.
        if inode == CONTROL_INODE:
            return self._control_attr()
        raise pyfuse3.FUSEError(errno.EROFS)

    def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for inode, count in inode_list:
            if inode != CONTROL_INODE and self.inodes.forget(inode, count):
                self.freshness.unwatch(inode)
                self.opens.rows.forgotten(inode)

    @guarded
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return self.source.readlink(self._node_path(inode))

    @guarded
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        if mode & os.W_OK and inode != CONTROL_INODE:
            raise pyfuse3.FUSEError(errno.EROFS)
        return True

    @guarded
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = self.source.statvfs()
        data = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):
            setattr(data, name, getattr(st, name))
        return data

    @guarded
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if inode == CONTROL_INODE:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return self.source.getxattr(self._node_path(inode), name)

    @guarded
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        if inode == CONTROL_INODE:
            return []
        return self.source.listxattr(self._node_path(inode))

    # -- directories -----------------------------------------------------------------

    def _new_handle(self, handle: FileHandle | DirHandle | ControlHandle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = handle
        return fh

    @guarded
    async def opendir(self, inode: int, ctx: Any) -> int:
        path = self._node_path(inode)
        self.freshness.watch(inode, path)
        listing = await in_thread(lambda: Listing(self.source.open_dir(path),
                                                       self.source.barred))
        return self._new_handle(DirHandle(path, listing))

    @guarded
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self._handles[fh]
        assert isinstance(handle, DirHandle)
        listing = handle.listing
        attributed = functools.partial(self._reply_attributed, token, handle.path)
        async with listing.lock:
            while listing.continues_at(start_id) or await in_thread(listing.fill, start_id):
                if not listing.reply(token, attributed):
                    return  # the kernel's buffer is full
                start_id = listing.end

    def _reply_attributed(self, token: pyfuse3.ReaddirToken, base: bytes, name: bytes,
                          st: os.stat_result, after: int) -> bool:
        """Reply with an entry's attributes; the kernel then holds a lookup on it (but not on
        ``.`` and ``..``). Whether the reply had room."""
        if name in DOTS:
            return pyfuse3.readdir_reply(token, name, self._attr(self._dot_inode(st), st), after)
        path = _child(base, name)
        inode = self.opens.known(st, path)
        if not pyfuse3.readdir_reply(token, name, self._attr(inode, st), after):
            self.inodes.drop_if_unreferenced(inode)
            return False
        self.opens.looked_up(inode, st, path)
        return True

    def _dot_inode(self, st: os.stat_result) -> int:
        """The inode number ``.`` or ``..`` shows: the directory's, its parent's if the
        kernel knows it, and the root's above the root."""
        found = self.inodes.find((st.st_dev, st.st_ino))
        return found if found is not None else ROOT_INODE

    @guarded
    async def releasedir(self, fh: int) -> None:
        handle = self._handles.pop(fh)
        assert isinstance(handle, DirHandle)
        async with handle.listing.lock:
            handle.listing.close()

    # -- files ---------------------------------------------------------------------

    @guarded
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if inode == CONTROL_INODE:
            # direct_io: replies are produced per request, never cached, whatever st_size says.
            # The opener's uid decides what its requests may do (protocol.spec.Caller).
            control = ControlHandle(self.control, ctx.uid, ctx.pid)
            return pyfuse3.FileInfo(fh=self._new_handle(control),
                                    direct_io=True, keep_cache=False)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        path = self._node_path(inode)
        st = self.source.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise pyfuse3.FUSEError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL)
        if self.opens.renumbered(inode, st, path):
            raise pyfuse3.FUSEError(errno.ESTALE)
        changed = not self.inodes.shown(inode, st)
        if changed:
            # The kernel holds old attributes and maybe old pages: drop both before the reader
            # sees this open succeed (attributes only here; keep_cache=False drops the pages).
            log.info("source file %s changed; invalidating", os.fsdecode(path))
            self.inodes.seen(inode, st)
            invalidate_attributes(inode)
        handle = await self.opens.open(FileHandle(inode, path, st), ctx.pid)
        fh = self._new_handle(handle)
        if self.opens.backings is None:
            return pyfuse3.FileInfo(fh=fh, keep_cache=not changed)
        if handle.backing:
            return pyfuse3.FileInfo(fh=fh, backing_id=handle.backing, keep_cache=False,
                                    noflush=True)
        # Page-cached and passthrough opens of one inode cannot coexist (EIO): none cached.
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)

    @guarded
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        handle = self._handles[fh]
        if isinstance(handle, ControlHandle):
            return await handle.read(size)
        assert isinstance(handle, FileHandle)
        reader = handle.reader
        # the size at open, or the source file's now (it may have grown or shrunk in place)
        end = reader.size() if reader.live else handle.st.st_size
        size = max(0, min(size, end - off))
        if size == 0:
            return b""
        entry = reader.entry
        if entry is not None and entry.complete and reader.hit:  # inline: no coroutine
            data = self.cache.data(entry, off, size)
            self.counters.read_hits += 1
            self.counters.bytes_from_cache += len(data)
            return data
        self.counters.read_misses += 1
        return await reader.read(off, size)

    @guarded
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handles.get(fh)
        if not isinstance(handle, ControlHandle):
            raise pyfuse3.FUSEError(errno.EROFS)
        error = handle.write(bytes(buf))  # EINVAL malformed, EACCES refused, ENOBUFS full
        if error:
            raise pyfuse3.FUSEError(error)
        return len(buf)

    @guarded
    async def release(self, fh: int) -> None:
        if fh & LANE_FH:  # an open the request lane answered, its row no longer answering
            self.opens.rows.released(fh & ~LANE_FH)
            return
        handle = self._handles.pop(fh)
        if isinstance(handle, FileHandle):
            self.opens.release(handle)
        elif isinstance(handle, ControlHandle):
            handle.close()  # gives back the bytes it held to the control file's bound


async def _read_only(self: Operations, *args: Any) -> None:
    raise pyfuse3.FUSEError(errno.EROFS)


for _name in ("mknod", "mkdir", "unlink", "rmdir", "symlink", "rename", "link", "create",
              "setxattr", "removexattr"):
    setattr(Operations, _name, _read_only)
