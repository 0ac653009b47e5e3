"""The mount's process: assemble source, cache and control, mount, serve until unmounted."""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import pyfuse3
import trio

from coordlfs import PROTOCOL_VERSION, __version__
from coordlfs.cache import public
from coordlfs.cache.cache import WholeFileCache
from coordlfs.cache.fills import FillQueue
from coordlfs.cache.fills import register_commands as register_fill_commands
from coordlfs.cache.held import register_commands as register_held_commands
from coordlfs.cache.publishing import register_commands as register_share_command
from coordlfs.cache.stats import Stats, register_commands
from coordlfs.daemon.config import SHM_ROOT, MountConfig
from coordlfs.daemon.memory import memory_status, tmpfs_file_bytes
from coordlfs.daemon.metrics import MetricsServer
from coordlfs.daemon.mounting import open_log, set_read_ahead
from coordlfs.errors import UserError
from coordlfs.fs import lane, passthrough
from coordlfs.fs.inodes import ROOT_INODE
from coordlfs.fs.operations import Operations
from coordlfs.fs.readers import AlignedReads
from coordlfs.jobs.groups import Groups
from coordlfs.jobs.groups import register_commands as register_group_commands
from coordlfs.jobs.prefetch import Prefetcher
from coordlfs.jobs.prep import Prep
from coordlfs.jobs.prep import register_commands as register_prep_commands
from coordlfs.jobs.window import ReadWindow
from coordlfs.peers.hold import PeerHold
from coordlfs.peers.links import Peers
from coordlfs.peers.placement import find_self, parse_address, read_secret
from coordlfs.peers.server import PeerServer, connection_cap, listen_socket
from coordlfs.peers.server import register_commands as register_peer_commands
from coordlfs.peers.serving import Serving
from coordlfs.peers.sources import Membership, peer_source
from coordlfs.peers.warm import WarmRelays
from coordlfs.peers.warm import answer as answer_warm
from coordlfs.peers.warm import register_commands as register_warm_commands
from coordlfs.peers.wire import idle_timeout
from coordlfs.protocol.server import ControlServer
from coordlfs.source.source import Source
from coordlfs.system.mounts import device_mounted_at, filesystem_type

log = logging.getLogger("coordlfs")

#: At unmount, how long the backfills (files just read) may take to complete.
DRAIN_S = 10.0

#: Kernel read-ahead of the mount, KiB: at 1024 sequential reads arrive as 1 MiB requests
#: (the most FUSE asks for here) instead of 128 KiB ones, and a GiB read costs the daemon
#: about half the CPU (docs/benchmarks/hits.md). Small files are read whole either way.
READ_AHEAD_KB = 1024
#: Seconds between checks that group members are still alive.
REAP_INTERVAL_S = 1.0
#: Seconds during which a repeated log line (same logger, level and text) is held back after
#: it was written once: a file rewritten all the time refused its fill ~270 times a second.
REPEAT_INTERVAL_S = 30.0
#: Repeated lines remembered; past it those whose interval is over are forgotten.
_REPEATS_KEPT = 4096


class DroppedReplies(logging.Filter):
    """pyfuse3 logs an ERROR when the kernel refuses a reply with ENOENT, but that only means
    the kernel no longer waits for it: the request was interrupted (a reader killed mid-read)
    or the mount is going away (a release the kernel sent in the background, answered after a
    lazy unmount). Likewise a name invalidation (a watched source change) its thread submits
    once the session is closed (EINVAL: there is no session left to tell). Such a record is
    kept, as INFO, without its traceback."""

    _ENOENT = os.strerror(errno.ENOENT)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR:
            return True
        refused = (record.msg.endswith("fuse_reply_* failed with %s") and record.args
                   and record.args[-1] == self._ENOENT)
        error = record.exc_info[1] if record.exc_info else None
        closed = (record.msg.startswith("Failed to submit invalidate_entry request")
                  and isinstance(error, OSError) and error.errno == errno.EINVAL)
        if refused or closed:
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


@dataclasses.dataclass(slots=True)
class _Written:
    """When a repeated line was last written, and how many like it were held back since."""

    at: float
    held: int = 0


class RepeatedRecords(logging.Filter):
    """One line per ``interval`` for each repeated INFO or WARNING message (its logger, level
    and text: a cause and a file), the next one after it carrying the count held back
    meanwhile. An ERROR is never held back, and neither is DEBUG: whoever asked for it
    wants every line. A handler's filter, so it sees what every logger propagates."""

    def __init__(self, interval: float = REPEAT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval, self.clock = interval, clock
        #: (logger, level, text) -> when its line was last written
        self._written: dict[tuple[str, int, str], _Written] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not logging.INFO <= record.levelno < logging.ERROR:
            return True
        now, text = self.clock(), record.getMessage()
        key = (record.name, record.levelno, text)
        written = self._written.get(key)
        if written is not None and now - written.at < self.interval:
            written.held += 1
            return False
        if written is not None and written.held:
            record.msg = (f"{text} ({written.held} more like it held back over "
                          f"{now - written.at:.0f} s)")
            record.args = None
        if len(self._written) >= _REPEATS_KEPT:
            self._written = {k: v for k, v in self._written.items()
                             if now - v.at < self.interval}
        self._written[key] = _Written(now)
        return True


def setup_logging(log_file: str | None, debug: bool) -> None:
    handler = logging.StreamHandler(open_log(os.path.abspath(log_file)) if log_file
                                    else sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RepeatedRecords())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    pyfuse3_log = logging.getLogger("pyfuse3")
    if not any(isinstance(f, DroppedReplies) for f in pyfuse3_log.filters):
        pyfuse3_log.addFilter(DroppedReplies())


def _tune_read_ahead(mountpoint: str) -> None:
    try:
        set_read_ahead(mountpoint, READ_AHEAD_KB)
    except (OSError, UserError) as e:  # not root: the kernel default stays, reads still work
        log.info("read-ahead of %s stays at the kernel default: %s", mountpoint, e)


def raise_descriptor_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard limit: every file a local reader has open
    and every peer connection holds a descriptor here, and the soft default (often 1024)
    would make readers meet EMFILE long before the machine runs short. Peer connections are
    capped at a share of it (``peer_server.connection_cap``), so the rest stays theirs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as e:  # a hard limit the kernel will not grant
            log.warning("descriptor limit stays at %d (hard %d): %s", soft, hard, e)
            return
    log.info("descriptor limit %d", hard)


class Daemon:
    def __init__(self, config: MountConfig) -> None:
        raise_descriptor_limit()
        self.config = config
        self.stats = Stats()
        self.metrics: MetricsServer | None = None
        self.source = Source(config.source)
        #: its inodes' slab is part of what each file looked up costs (``memory_status``)
        self.source_fstype = filesystem_type(config.source)
        self.cache = WholeFileCache(config.cache_dir, config.cache_size, config.max_file_size,
                                    self.stats.reads, own_tmpfs=config.cache_tmpfs)
        try:
            self.cache.share(self.source, public=config.allow_other)
            if config.allow_other:  # the other users the preload library serves
                public.open_parent(self.cache.dir_fd, SHM_ROOT.format(uid=os.geteuid()))
            if self.cache.preloaded is not None:
                self.stats.folds.append(self.cache.preloaded.fold)
            self._assemble(config)
        except BaseException:  # e.g. the peer port is taken: no cache directory left behind
            self._close()
            raise

    def _assemble(self, config: MountConfig) -> None:
        self.control = ControlServer(self.status)
        if config.metrics:  # bound now: a port in use is an error before the mount exists
            self.metrics = MetricsServer.bind(parse_address(config.metrics, "--metrics"),
                                              self.control.snapshot)
        register_commands(self.control, self.stats)
        self.groups = Groups()
        self.window = ReadWindow(config.window_size)
        self.groups.on_leave.append(lambda member: self.window.forget_member(member.id))
        register_group_commands(self.control, self.groups)
        self.prep = Prep(config.staging_size)
        register_prep_commands(self.control, self.prep)
        self.peers, self.server = self._cluster(config)
        if self.server is not None:  # peers may come later (coordlfs.peers.sources)
            self.peers.hold = PeerHold(self.peers, self.cache, self.source)
        register_peer_commands(self.control, self.peers, self.server)
        self.prefetcher = Prefetcher(self.groups, self.window, self.cache, self.source,
                                     self.stats.reads, config.prefetch_depth,
                                     self.peers.caches_here)
        self.fills = FillQueue(self.cache, self.source, config.fill_depth,
                               self.peers.caches_here)
        register_fill_commands(self.control, self.fills, self.source, self.peers.prefetch)
        register_held_commands(self.control, self.cache, self.source)
        register_share_command(self.control, self.cache.publisher)
        if self.server is not None and self.server.serving is not None:
            self.cache.publisher.want()  # the peers' C path reads the index
        self.warms = WarmRelays(self.peers)
        register_warm_commands(self.control, self.fills, self.warms)
        if self.server is not None:
            self.server.warm = functools.partial(answer_warm, self.fills)
        self.ops = Operations(self.source, self.cache, self.stats.reads, self.control,
                              AlignedReads(self.groups, self.window, self.prefetcher),
                              self.peers, config.revalidate_s)

    def _cluster(self, config: MountConfig) -> tuple[Peers, PeerServer | None]:
        """The peers and the server for them; with no --listen, a cluster of one."""
        secret = read_secret(config.secret_file) if config.secret_file else b""
        if config.listen is None:
            return Peers((), None, secret, config.peer_timeout, self.stats.reads), None
        listen = parse_address(config.listen, "--listen")
        source = peer_source(config, listen)
        nodes = source.first()
        me = find_self(listen, nodes)
        log.info("%d nodes from %s; this node is %s", len(nodes), source.name,
                 me or "not among them")
        if nodes and me is None:
            log.warning("%s is not among the nodes from %s: this node caches nothing for the "
                        "others", listen, source.name)
        server = PeerServer(listen_socket(listen), secret, config.peer_timeout, self.source,
                            self.cache, connection_cap(config.peer_connections))
        if config.request_lane != "no":  # peers' request lanes served in C too
            server.serving = Serving.start(
                self.source.root_fd, self.cache.dir_fd, self.cache.files_fd,
                config.peer_timeout, idle_timeout(config.peer_timeout), server.budget.limit)
        peers = Peers(nodes, me, secret, config.peer_timeout, self.stats.reads, listen,
                      source.name, config.peer_connections)
        self.membership = Membership(source, peers)
        return peers, server

    def status(self) -> dict[str, Any]:
        cache = self.cache
        # inodes the kernel knows beside the table's, and a key's cost in the lane
        lane_nodes, lane_bytes, lane_key = self.ops.opens.rows.nodes()
        return {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "source": self.source.path,
            "mountpoint": self.config.mountpoint,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.stats.started, 3),
            "cache": {
                "capacity_bytes": cache.room.capacity,
                "used_bytes": cache.room.used,
                "bytes": cache.room.data_bytes,
                "files": len(cache.entries) - cache.filling,
                "kernel_bytes_per_file": tmpfs_file_bytes(),
                # the lane's misses the cache is about to be handed are fills in flight,
                # as are those ``coordlfs run``'s processes named and it has not read yet
                "filling": cache.filling + self.ops.opens.rows.noting() + (
                    cache.preloaded.notices.unread() if cache.preloaded else 0),
                "max_file_bytes": cache.max_file_size,
                "directory": cache.directory,
                "full": cache.room.full,
                "table_bytes": cache.entries.nbytes(),
            },
            "reads": self.stats.current(),
            "passthrough": self.ops.passthrough_status(),
            "shared": cache.shared_status(),
            "peers": self.peers.status(),
            "served": self.server.status() if self.server else None,
            "read_window": self.window.status(),
            "prefetch": self.prefetcher.status(),
            "fills": self.fills.status(),
            "prep": self.prep.status(),
            "inodes": len(self.ops.inodes) + lane_nodes,
            "inode_table_bytes": self.ops.inodes.nbytes(),
            "memory": memory_status(
                tables=(self.ops.inodes.nbytes() + lane_bytes, cache.entries.nbytes()),
                rows=(len(self.ops.inodes) + lane_nodes, len(cache.entries)),
                cached_bytes=cache.room.used,
                source_fstype=self.source_fstype,
                passthrough=self.ops.opens.backings is not None,
                lane_row=self.ops.opens.rows.census()[1],
                lane_key=lane_key, mapped=cache.files.mapped()),
            "freshness": self.ops.freshness.status(),
            "marks": [m.name for m in self.stats.marks],
            **self.groups.status(),
        }

    def run(self, ready: Callable[[str], None]) -> None:
        """Mount and serve until unmounted; ``ready`` is told, once the mount is live, how
        changes of the source reach it."""
        try:
            warm = self.cache.adopt()  # checked against the source while serving
            log.info("source %s, cache %s: %d bytes of %d in %d warm entries",
                     self.source.path, self.cache.directory, self.cache.room.used,
                     self.cache.room.capacity, warm)
            why_not = passthrough.chosen(self.config.passthrough)
            if why_not is not None:  # on or not is known at the kernel's INIT (ops.init)
                log.log(logging.INFO if self.config.passthrough == "no" else logging.WARNING,
                        "FUSE passthrough off: %s", why_not)
            self.ops.serve_by_passthrough(why_not)
            no_lane = lane.why_not(self.config.request_lane, why_not)
            options = {"fsname=" + self.source.path, "subtype=coordlfs", "default_permissions"}
            if self.config.allow_other:
                options.add("allow_other")
            try:
                pyfuse3.init(self.ops, self.config.mountpoint, options)
            except RuntimeError as e:
                raise UserError(f"cannot mount on {self.config.mountpoint}: {e}") from None
            log.info("mounted on %s", self.config.mountpoint)
            self._start_lane(no_lane)
            # no walk of the source enters the mount just made (coordlfs.source.walk)
            if device_mounted_at(self.config.mountpoint) is None:
                log.warning("%s is not in the mount table: a loop through the mount beneath "
                            "its source would not be told", self.config.mountpoint)
            try:
                trio.run(self._serve, ready)
            finally:
                pyfuse3.close(unmount=True)
                log.info("unmounted %s", self.config.mountpoint)
        finally:
            self.ops.freshness.close()
            self._close()
            self.prep.close()

    def _start_lane(self, why_not: str | None) -> None:
        """The request lane, mounted and before serving, unless ``why_not`` (said once)."""
        if why_not is None:
            try:
                started = lane.Lane.start(self.source.root_fd, self.config.lane_threads)
            except OSError as e:
                why_not = f"it did not start: {e}"
            else:
                rows, freshness = self.ops.opens.rows, self.ops.freshness
                rows.serve_by_lane(started, lookups=freshness.watching)
                self.fills.handed = started.nodes.handed
                started.attr_timeout(freshness.timeout)
                freshness.gave_up.append(lambda: started.attr_timeout(freshness.timeout))
                freshness.gave_up.append(rows.no_lookups)
                freshness.watched.append(rows.watched)
                rows.watched(ROOT_INODE, b"")
                self.stats.folds.append(rows.fold)
                log.info("request lane on: hits, small misses and their lookups are answered in C")
                return
        log.log(logging.INFO if self.config.request_lane == "no" else logging.WARNING,
                "request lane off: %s", why_not)

    def _close(self) -> None:
        """Release what ``__init__`` took first: the cache (and its directory, unless
        ``--keep-cache``) and the source; the metrics server first, which reads them."""
        if self.metrics is not None:
            self.metrics.close()
        self.cache.close(keep=self.config.keep_cache)
        self.source.close()

    async def _serve(self, ready: Callable[[str], None]) -> None:
        async with trio.open_nursery() as nursery:
            self.ops.readers.nursery = nursery
            nursery.start_soon(self._terminate_on_signal)
            nursery.start_soon(self._reap_members)
            nursery.start_soon(self.prefetcher.run)
            nursery.start_soon(self.fills.run)
            nursery.start_soon(self.peers.run)
            nursery.start_soon(self.warms.run)
            nursery.start_soon(self.ops.freshness.run)
            if self.ops.opens.rows.lane is not None:
                nursery.start_soon(self.ops.opens.rows.take_notes)
            nursery.start_soon(self.cache.run_shared)
            nursery.start_soon(self.cache.check, self.source)
            if self.server is not None:
                nursery.start_soon(self.server.run)
                nursery.start_soon(self.membership.run)
            nursery.start_soon(functools.partial(
                trio.to_thread.run_sync, _tune_read_ahead, self.config.mountpoint,
                abandon_on_cancel=True))
            if self.metrics is not None:
                self.metrics.start(trio.lowlevel.current_trio_token())
            ready(self.ops.freshness.summary())
            await pyfuse3.main()
            await self.ops.opens.rows.take_all(DRAIN_S)
            await self.cache.drained(DRAIN_S)
            nursery.cancel_scope.cancel()

    async def _reap_members(self) -> None:
        while True:
            await trio.sleep(REAP_INTERVAL_S)
            try:
                for member in self.groups.reap():
                    log.info("member %d (%s, pid %d) of group %s is gone", member.id,
                             member.job, member.pid, member.group)
                self.prep.tick()
            except Exception:  # an uncaught error here would take the mount down
                log.exception("reaping group members failed")

    async def _terminate_on_signal(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                log.info("%s: unmounting", signal.Signals(signum).name)
                self.control.close()  # requests waiting for their answer get it now
                pyfuse3.terminate()
                return
