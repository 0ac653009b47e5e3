"""Prometheus metrics of a mount (``--metrics HOST:PORT``): the status ``coordlfs stats``
shows, as Prometheus text at ``http://HOST:PORT/metrics``.

prometheus_client's HTTP server answers scrapes in threads of its own, but the trio loop owns
every counter, so a scrape never reads them from its thread: it asks the loop for one
status (``TrioToken.run_sync_soon``: the loop's own queue of callbacks from other threads)
and waits for it at most ``SNAPSHOT_TIMEOUT_S``. Every family of a scrape comes from that one
dict, so the series agree with each other (the bytes and the files of one moment) and with
``coordlfs stats``. The loop pays one status per scrape, what ``coordlfs stats`` costs it, and
nothing while nobody scrapes; a snapshot the loop refreshed on a timer would cost it always
and be up to a period stale. A loop that does not answer in time, or has stopped, makes the
scrape a 503 (Prometheus marks the target down), never a thread waiting forever, and an
error taking the status is raised in the scrape's thread, never in the loop.

The socket is bound when the daemon is assembled (``MetricsServer.bind``), before the mount
exists, so a port in use or a bad address is a one-line error of ``coordlfs mount``; the
server's threads are daemon threads, and ``close`` stops it when the daemon exits.

Whoever reaches the port can connect, and nothing they do may take what the mount's readers
need (each connection holds a thread and a descriptor): at most ``MAX_CONNECTIONS`` are served
at once; one more closes the oldest of them that has not sent its whole request yet (idle
connections held open had every scrape answered 503), or, when every one is being answered,
is answered 503 at once and closed; a connection lasts at most
``CONNECTION_TIMEOUT_S`` from its accept to the last byte of its answer, so one that sends
nothing, trickles its request or does not read the answer is closed; a request holds at most
``MAX_REQUEST_BYTES``. One request per connection (HTTP/1.0, prometheus_client's), so no idle
keep-alive connection is kept. Refusals are logged at most once per ``LOG_INTERVAL_S``, as the
peer port's, so a stranger cannot grow the log.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import http.server
import logging
import math
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from typing import Any, BinaryIO

import trio
from prometheus_client import CollectorRegistry, MetricsHandler, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from coordlfs.errors import UserError
from coordlfs.peers.placement import Address
from coordlfs.peers.server import (
    ACCEPT_RESOURCE_ERRNOS,
    ACCEPT_RETRY_S,
    LOG_INTERVAL_S,
    RateLimitedLog,
)

log = logging.getLogger(__name__)

#: Seconds a scrape waits for the loop to take the status: a scrape that times out is
#: answered 503 rather than held, well within Prometheus's default 10 s scrape timeout.
SNAPSHOT_TIMEOUT_S = 5.0
#: Connections served at once. Prometheus scrapes a target over one connection at a time, so
#: 16 leave room for a few scrapers (HA pairs, a person with curl) and their retries, while
#: 16 threads and descriptors are nothing beside what the readers need (a quarter of even a
#: 64-descriptor limit).
MAX_CONNECTIONS = 16
#: Seconds a connection may last, from its accept to the last byte of its answer: as long as
#: Prometheus's default scrape timeout, after which it has given up anyway; a scrape takes
#: about a millisecond (the status at most ``SNAPSHOT_TIMEOUT_S``). Checked every half
#: second (``serve_forever``'s poll).
CONNECTION_TIMEOUT_S = 10.0
#: Bytes of a request, its line and headers (a scrape has no body): Prometheus sends about
#: 300; http.server alone would take 64 KiB a line and 100 headers, 6 MiB a connection.
MAX_REQUEST_BYTES = 8192
#: Every series' name starts with this.
PREFIX = "coordlfs_"
#: The states of a peer link (``peers.PeerLink.state``), each a series whether or not a link
#: is in it, so that a sum by state is 0, not absent, when no link is down.
PEER_STATES = ("up", "idle", "down")

GAUGE, COUNTER = "gauge", "counter"

#: Series read from one key of a status section: (section, key, name, kind, help); section
#: "" is the status itself. A section or key the status leaves out (``served`` without
#: --listen, ``freshness.events`` when the source is not watched) gives none.
FLAT: tuple[tuple[str, str, str, str, str], ...] = (
    ("", "uptime_s", "uptime_seconds", GAUGE, "seconds since the mount started"),
    ("", "inodes", "inodes", GAUGE, "inodes the kernel knows"),
    ("", "inode_table_bytes", "inode_table_bytes", GAUGE, "memory of the inode table"),
    ("cache", "capacity_bytes", "cache_capacity_bytes", GAUGE, "bytes the cache may hold"),
    ("passthrough", "on", "passthrough_on", GAUGE,
     "1 while complete cache entries are served by FUSE passthrough (why not: the info's "
     "passthrough_off)"),
    ("passthrough", "backing_ids", "passthrough_backing_ids", GAUGE,
     "backing files registered with the kernel"),
    ("reads", "passthrough_opens", "passthrough_opens", COUNTER,
     "opens answered with a cache entry's file as backing: their reads never reach the "
     "daemon"),
    ("reads", "fill_bytes_from_pages", "fill_page_cache_bytes", COUNTER,
     "bytes fills copied from pages the page cache held already (another process had read "
     "the file), among those read from storage: storage was not read again"),
    ("reads", "source_opens", "passthrough_source_opens", COUNTER,
     "opens answered with the source file as backing (a miss, copied into the cache after, "
     "or a file no cache keeps): the kernel reads storage itself"),
    ("cache", "used_bytes", "cache_used_bytes", GAUGE, "bytes cached or reserved for fills"),
    ("cache", "files", "cache_files", GAUGE, "complete files in the cache"),
    ("cache", "filling", "cache_filling_files", GAUGE, "files being filled"),
    ("cache", "max_file_bytes", "cache_max_file_bytes", GAUGE, "largest file cached"),
    ("cache", "table_bytes", "cache_table_bytes", GAUGE, "memory of the cache's entry table"),
    ("cache", "full", "cache_directory_full", GAUGE,
     "1 while the cache directory's filesystem has no room"),
    ("shared", "published", "shared_published_files", GAUGE,
     "cache entries published to coordlfs.client processes"),
    ("shared", "withdrawn", "shared_withdrawn", COUNTER, "published entries withdrawn"),
    ("shared", "watched_directories", "shared_watched_directories", GAUGE,
     "source directories watched for published files"),
    ("peers", "changes", "peer_membership_changes", COUNTER,
     "changes of the node list (--peers-from, --peers-file)"),
    ("peers", "changed_at", "peer_membership_changed_timestamp_seconds", GAUGE,
     "when the node list was last set (Unix time)"),
    ("served", "connections", "served_connections", COUNTER, "peer connections admitted"),
    ("served", "requests", "served_requests", COUNTER, "files peers asked for"),
    ("served", "batches", "served_batches", COUNTER, "GETMANY batches peers asked for"),
    ("served", "bytes", "served_bytes", COUNTER, "bytes served to peers"),
    ("served", "misses", "served_misses", COUNTER, "peer requests for files not held"),
    ("served", "stale", "served_stale", COUNTER, "peer requests for another version"),
    ("served", "refused", "served_refused", COUNTER,
     "peer connections and requests refused (handshake, protocol, timeout)"),
    ("served", "turned_away", "served_turned_away", COUNTER,
     "peer connections turned away BUSY: the cap reached and none idle"),
    ("served", "handshakes_closed", "served_handshakes_closed", COUNTER,
     "peer connections closed in their handshake (told BUSY) to make room for a newer one"),
    ("served", "idle_closed", "served_idle_closed", COUNTER, "idle peer connections closed"),
    ("served", "evicted", "served_evicted", COUNTER,
     "idle peer connections closed to make room for a new one (--peer-connections)"),
    ("served", "open_connections", "served_open_connections", GAUGE,
     "peer connections open"),
    ("served", "max_connections", "served_max_connections", GAUGE, "peer connection cap"),
    ("served_in_c", "files", "served_in_c_files", COUNTER,
     "files sent to peers' request lanes by the C path (among served_requests)"),
    ("served_in_c", "deferred", "served_in_c_deferred", COUNTER,
     "requests the C path handed to the daemon (not cached here, another version, refused)"),
    ("served_in_c", "open_connections", "served_in_c_open_connections", GAUGE,
     "peer lane connections the C path serves (among served_open_connections)"),
    ("read_window", "capacity_bytes", "read_window_capacity_bytes", GAUGE,
     "bytes the aligned groups' read window may hold"),
    ("read_window", "used_bytes", "read_window_used_bytes", GAUGE, "bytes in the read window"),
    ("read_window", "items", "read_window_files", GAUGE, "files in the read window"),
    ("read_window", "hits", "read_window_hits", COUNTER, "files served from the read window"),
    ("read_window", "bytes_served", "read_window_served_bytes", COUNTER,
     "bytes served from the read window"),
    ("read_window", "dropped_unread", "read_window_dropped_unread", COUNTER,
     "files dropped from the read window before every member read them"),
    ("prefetch", "depth", "prefetch_depth_files", GAUGE, "aligned read-ahead depth"),
    ("prefetch", "in_flight", "prefetch_in_flight_files", GAUGE, "read-ahead fetches running"),
    ("prefetch", "files", "prefetch_files", COUNTER, "files fetched ahead of aligned readers"),
    ("prefetch", "bytes", "prefetch_bytes", COUNTER, "bytes fetched ahead of aligned readers"),
    ("fills", "depth", "fill_workers", GAUGE, "fill workers (--fill-depth)"),
    ("fills", "queued", "fill_queued_files", GAUGE, "files queued by prefetch requests"),
    ("fills", "in_flight", "fill_in_flight_files", GAUGE, "files being filled for prefetch"),
    ("fills", "files", "fill_files", COUNTER, "files filled for prefetch requests"),
    ("fills", "bytes", "fill_bytes", COUNTER, "bytes filled for prefetch requests"),
    ("staging", "capacity_bytes", "prep_staging_capacity_bytes", GAUGE,
     "bytes the prep staging area may hold"),
    ("staging", "used_bytes", "prep_staging_used_bytes", GAUGE, "bytes staged"),
    ("staging", "peak_bytes", "prep_staging_peak_bytes", GAUGE, "most bytes staged at once"),
    ("staging", "published", "prep_published_batches", COUNTER, "batches published"),
    ("staging", "released", "prep_released_batches", COUNTER,
     "batches freed once every member used them"),
    ("staging", "taken_over", "prep_taken_over_batches", COUNTER,
     "claimed batches taken over from members that left"),
    ("staging", "expelled", "prep_expelled_members", COUNTER, "hung members expelled"),
    ("staging", "full", "prep_staging_full", COUNTER, "reservations refused: staging full"),
    ("held", "capacity_bytes", "peer_hold_capacity_bytes", GAUGE,
     "bytes the peer holding area may hold"),
    ("held", "reserved_bytes", "peer_hold_reserved_bytes", GAUGE,
     "bytes held or in flight in the peer holding area"),
    ("held", "held", "peer_hold_files", GAUGE, "files held from peers for readers"),
    ("held", "waiting", "peer_hold_waiting_files", GAUGE, "files queued to fetch from peers"),
    ("held", "fetched", "peer_hold_fetched", COUNTER, "files fetched ahead from peers"),
    ("held", "hits", "peer_hold_hits", COUNTER, "reads that found their file held"),
    ("held", "dropped_unread", "peer_hold_dropped_unread", COUNTER,
     "held files dropped before a reader took them"),
    ("freshness", "watched_directories", "freshness_watched_directories", GAUGE,
     "source directories watched for the kernel's names"),
    ("freshness", "events", "freshness_events", COUNTER, "inotify events from the source"),
    ("freshness", "invalidated", "freshness_invalidated", COUNTER,
     "kernel names and attributes invalidated"),
    ("control", "held_bytes", "control_held_bytes", GAUGE,
     "bytes of replies the control file holds"),
    ("control", "waiting", "control_waiting_requests", GAUGE, "control requests waiting"),
)

#: ``reads`` counters by label value: (name, label, {value: key}, help).
READS: tuple[tuple[str, str, dict[str, str], str], ...] = (
    ("read_bytes", "from", {"cache": "bytes_from_cache", "peers": "bytes_from_peers",
                            "storage": "bytes_from_source"},
     "bytes read through the mount, by where they came from"),
    ("read_files", "from", {"cache": "file_hits", "peers": "file_peer_hits",
                            "storage": "file_misses"},
     "files opened, by what served them: the cache (hits), a peer (peer hits) or storage "
     "(misses), whoever served them (the daemon, passthrough, coordlfs.client, coordlfs run)"),
    ("read_requests", "result", {"hit": "read_hits", "miss": "read_misses"},
     "read requests the daemon answered from a complete cache entry (hit) or otherwise "
     "(miss); the kernel reads passthrough opens without them"),
    ("client_reads", "result", {"hit": "client_hits", "miss": "client_misses",
                                "direct": "client_direct"},
     "coordlfs.client reads from shared memory (hit), through the mount (miss) or from the "
     "source directly (direct: a file the cache had no room for)"),
    ("client_read_bytes", "from", {"cache": "client_bytes_from_cache",
                                   "mount": "client_bytes_from_mount",
                                   "source": "client_bytes_direct"},
     "coordlfs.client bytes from shared memory (cache), through the mount or from the source "
     "directly"),
    ("preload_opens", "result", {"hit": "preload_hits", "miss": "preload_misses",
                                 "uncached": "preload_uncached", "passed": "preload_passed"},
     "opens the preload library of `coordlfs run` answered: a cache entry's file (hit), the "
     "source file backfilled (miss) or not kept (uncached), or the mount's (passed)"),
    ("preload_open_bytes", "from", {"cache": "preload_bytes_from_cache",
                                    "storage": "preload_bytes_from_source"},
     "bytes of the files the preload library opened, by where they came from"),
)

#: A peer link's counters: (key, name, help), labelled by peer.
PEER_COUNTERS = (
    ("requests", "peer_requests", "requests sent to the peer"),
    ("bytes", "peer_read_bytes", "bytes the peer served"),
    ("files", "peer_read_files", "files the peer served"),
    ("misses", "peer_misses", "requests the peer did not hold the file for"),
    ("stale", "peer_stale", "requests the peer held another version for"),
    ("failures", "peer_failures", "faults that marked the peer down"),
)


class NoSnapshot(Exception):
    """The loop gave no status in time or has stopped: the scrape gets a 503."""


def _family(name: str, kind: str, doc: str, labels: Iterable[str] = ()) -> Metric:
    cls = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
    return cls(PREFIX + name, doc, labels=list(labels))


def _sections(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The status's sections by the names ``FLAT`` uses (a nested one at its own name)."""
    sections = {key: value for key, value in status.items() if isinstance(value, dict)}
    sections[""] = status
    sections["staging"] = status["prep"]["staging"]
    if status["peers"]["held"] is not None:
        sections["held"] = status["peers"]["held"]
    if (served := status.get("served")) and "in_c" in served:
        sections["served_in_c"] = served["in_c"]
    return sections


def _flat(status: dict[str, Any]) -> Iterator[Metric]:
    sections = _sections(status)
    for section, key, name, kind, doc in FLAT:
        if key in sections.get(section, {}):
            family = _family(name, kind, doc)
            family.add_metric([], float(sections[section][key]))
            yield family


def _reads(reads: dict[str, int]) -> Iterator[Metric]:
    for name, label, keys, doc in READS:
        family = _family(name, COUNTER, doc, [label])
        for value, key in keys.items():
            family.add_metric([value], reads[key])
        yield family


def _by_reason(name: str, doc: str, label: str, counts: dict[str, int]) -> Metric:
    family = _family(name, COUNTER, doc, [label])
    for reason, count in sorted(counts.items()):
        family.add_metric([reason], count)
    return family


def _peers(peers: dict[str, Any]) -> Iterator[Metric]:
    links = peers["links"]
    nodes = _family("peer_nodes", GAUGE, "nodes in the cluster, this one included")
    nodes.add_metric([], len(peers["nodes"]))
    yield nodes
    state = _family("peer_state", GAUGE, "1 for the state each peer link is in", ["peer", "state"])
    in_flight = _family("peer_in_flight_requests", GAUGE, "requests waiting for the peer",
                        ["peer"])
    retry = _family("peer_retry_in_seconds", GAUGE, "seconds until a down peer is retried",
                    ["peer"])
    counters = [(key, _family(name, COUNTER, doc, ["peer"])) for key, name, doc in PEER_COUNTERS]
    for address, link in sorted(links.items()):
        for each in dict.fromkeys((*PEER_STATES, link["state"])):
            state.add_metric([address, each], float(each == link["state"]))
        in_flight.add_metric([address], link["in_flight"])
        retry.add_metric([address], link["retry_in_s"])
        for key, family in counters:
            family.add_metric([address], link[key])
    yield from (state, in_flight, retry, *(family for _key, family in counters))


#: Gauges of a group, a series per group: (name, help, key in the group's status; a list
#: counts its items).
ALIGNED_GROUP = (
    ("group_members", "members of an aligned group", "members"),
    ("group_files", "files in an aligned group's order", "files"),
    ("group_epoch", "the latest epoch an aligned group started", "epoch"),
)
PREP_GROUP = (
    ("prep_group_members", "members of a prep group", "members"),
    ("prep_group_batches", "batches in each epoch of a prep group", "batches"),
)
#: The same of the epoch a prep group runs (none between epochs).
PREP_EPOCH = (
    ("prep_group_epoch", "the epoch a prep group runs", "number"),
    ("prep_group_epoch_members", "members taking part in a prep group's epoch", "members"),
    ("prep_group_unclaimed_batches", "batches of the epoch nobody prepares yet", "unclaimed"),
    ("prep_group_preparing_batches", "batches of the epoch being prepared", "preparing"),
    ("prep_group_staged_batches", "batches of the epoch staged", "staged"),
    ("prep_group_staged_bytes", "bytes of the epoch's staged batches", "staged_bytes"),
    ("prep_group_released_batches", "batches of the epoch freed once every member used them",
     "released"),
)


def _groups(spec: tuple[tuple[str, str, str], ...],
            groups: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    for name, doc, key in spec:
        family = _family(name, GAUGE, doc, ["group"])
        for group_name, group in sorted(groups.items()):
            value = group[key]
            if value is not None:  # an aligned group's files before any member sent them
                family.add_metric([group_name], len(value) if isinstance(value, list) else value)
        yield family


def families(status: dict[str, Any]) -> Iterator[Metric]:
    """The metric families of one status (``Daemon.status`` with the control file's part)."""
    peers = status["peers"]
    info = InfoMetricFamily(PREFIX.rstrip("_"), "the mount: version, source, mountpoint, "
                            "this node's peer address, where the node list comes from, why "
                            "FUSE passthrough is off")
    info.add_metric([], {"version": status["version"], "protocol": str(status["protocol"]),
                         "source": status["source"], "mountpoint": status["mountpoint"],
                         "node": peers["self"] or "", "peers_from": peers["source"],
                         "passthrough_off": status["passthrough"]["why_off"] or ""})
    yield info
    yield from _reads(status["reads"])
    yield from _flat(status)
    fills = status["fills"]
    yield _by_reason("fill_skipped", "prefetched files not filled, by reason", "reason",
                     fills["skipped"])
    yield _by_reason("fill_failures", "fills that failed, by cause", "cause", fills["failed"])
    yield from _peers(peers)
    yield from _groups(ALIGNED_GROUP, status["groups"])
    prep = status["prep"]["groups"]
    yield from _groups(PREP_GROUP, prep)
    yield from _groups(PREP_EPOCH, {name: g["epoch"] for name, g in prep.items() if g["epoch"]})


class Snapshots:
    """The status, taken on the trio loop for a scrape's thread; ``token`` is the loop's,
    set once it runs."""

    def __init__(self, status: Callable[[], dict[str, Any]],
                 timeout: float = SNAPSHOT_TIMEOUT_S) -> None:
        self.status = status
        self.timeout = timeout
        self.token: trio.lowlevel.TrioToken | None = None

    def take(self) -> dict[str, Any]:
        if self.token is None:
            raise NoSnapshot("the mount is not serving yet")
        taken: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

        def on_loop() -> None:  # an exception here would end the loop: it goes to the scrape
            try:
                taken.set_result(self.status())
            except Exception as e:
                taken.set_exception(e)

        try:
            self.token.run_sync_soon(on_loop)
        except trio.RunFinishedError:
            raise NoSnapshot("the mount is going away") from None
        try:
            return taken.result(self.timeout)
        except concurrent.futures.TimeoutError:
            raise NoSnapshot(f"the mount did not give its status in {self.timeout:g} s") from None


class StatusCollector:
    """A prometheus_client collector: every scrape's families from one snapshot."""

    def __init__(self, snapshots: Snapshots) -> None:
        self.snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        yield from families(self.snapshots.take())


#: The answer to a connection past the cap, sent without waiting and without reading its
#: request (a scraper sees why it was refused; Prometheus marks the target down).
BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Connection: close\r\n\r\n" + f"{MAX_CONNECTIONS} metrics connections open, the "
        "most served at once\n".encode())


class RequestTooLarge(Exception):
    """A request past ``MAX_REQUEST_BYTES``: its connection is closed unanswered."""


class _BoundedLines:
    """A connection's input as http.server reads it, a line at a time, with at most ``left``
    bytes in all."""

    def __init__(self, rfile: BinaryIO, left: int) -> None:
        self.rfile, self.left = rfile, left

    def readline(self, size: int = -1) -> bytes:
        if self.left <= 0:
            raise RequestTooLarge
        line = self.rfile.readline(self.left if size < 0 else min(size, self.left))
        self.left -= len(line)
        return line

    def close(self) -> None:
        self.rfile.close()


class _Handler(MetricsHandler):
    server: _Server

    def parse_request(self) -> bool:
        """The request read whole: from now on its connection is not closed for another."""
        parsed = super().parse_request()
        if parsed:
            self.server.answering(self.request)
        return parsed

    def setup(self) -> None:
        super().setup()
        self.rfile = _BoundedLines(self.rfile, MAX_REQUEST_BYTES)  # type: ignore[assignment]

    def handle(self) -> None:
        try:
            super().handle()
        except RequestTooLarge:
            self.server.refused("metrics request from %s refused: over %d bytes",
                                self.client_address[0], MAX_REQUEST_BYTES)

    def do_GET(self) -> None:
        try:
            super().do_GET()
        except NoSnapshot as e:  # the collector raised before anything was written
            log.warning("metrics scrape from %s not answered: %s", self.client_address[0], e)
            self.send_error(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
        except ConnectionError:
            raise  # the scraper went away: there is nobody to answer (``handle_error``)
        except Exception:  # a status the families do not expect: a bug of this module
            log.exception("metrics scrape from %s failed", self.client_address[0])
            self.send_error(HTTPStatus.INTERNAL_SERVER_ERROR)


@dataclasses.dataclass(slots=True)
class _Open:
    """A connection served: its scraper's address, when it must be done by, and whether its
    request was read whole (it is being answered, not closed for room)."""

    who: str
    until: float
    answering: bool = False


class _Server(http.server.ThreadingHTTPServer):
    """prometheus_client's handler on a socket bound beforehand (``bind``); a thread per
    connection, daemon threads, at most ``MAX_CONNECTIONS``, each closed after
    ``CONNECTION_TIMEOUT_S``.

    Every connection ends in ``shutdown_request`` (answered, failed or turned away), which
    forgets it before closing it; the timeout's ``shutdown`` runs under the same lock on a
    connection not yet forgotten, so it never reaches a descriptor closed and reused."""

    def __init__(self, sock: socket.socket, registry: CollectorRegistry) -> None:
        # BaseServer, not TCPServer: the socket exists; and no getfqdn (HTTPServer.server_bind),
        # whose reverse lookup could hold up a mount
        socketserver.BaseServer.__init__(self, sock.getsockname(), _Handler.factory(registry))
        self.socket = sock
        self.refused = RateLimitedLog(log, logging.WARNING, LOG_INTERVAL_S)
        self._ended = RateLimitedLog(log, logging.INFO, LOG_INTERVAL_S)
        self._lock = threading.Lock()
        #: each connection served, oldest first
        self._open: dict[socket.socket, _Open] = {}

    def get_request(self) -> tuple[socket.socket, Any]:
        """The next connection. Out of descriptors or memory (the readers hold them; the
        connection waits in the backlog), pause rather than spin on a socket that stays
        readable, since serve_forever drops the error and selects again."""
        try:
            return super().get_request()
        except OSError as e:
            if e.errno in ACCEPT_RESOURCE_ERRNOS:
                self.refused("cannot accept metrics connections now: %s", e.strerror or e)
                time.sleep(ACCEPT_RETRY_S)
            raise

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Admit a connection under the cap, closing the oldest idle one (its request not
        read whole) to make room if need be; with none idle, answer 503 and close it at
        once."""
        with self._lock:
            closed = self._close_oldest_idle() if len(self._open) >= MAX_CONNECTIONS else None
            admitted = len(self._open) < MAX_CONNECTIONS
            if admitted:
                self._open[request] = _Open(client_address[0],
                                            time.monotonic() + CONNECTION_TIMEOUT_S)
        if closed is not None:
            self.refused("metrics connection from %s closed for a newer one: idle with %d "
                         "connections open", closed, MAX_CONNECTIONS)
        if admitted:
            return True
        self.refused("metrics connection from %s turned away: %d connections open, the most "
                     "served at once", client_address[0], MAX_CONNECTIONS)
        with contextlib.suppress(OSError):  # a new socket's buffer takes it, or nothing
            request.send(BUSY, socket.MSG_DONTWAIT)
        return False

    def _close_oldest_idle(self) -> str | None:
        """With the lock held: forget the oldest connection whose request is not read whole
        and shut it (its thread wakes and ends); who it was, or None if every one is being
        answered."""
        oldest = next((sock for sock, each in self._open.items() if not each.answering), None)
        if oldest is None:
            return None
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)
        return self._open.pop(oldest).who

    def answering(self, request: Any) -> None:
        with self._lock:
            if (each := self._open.get(request)) is not None:
                each.answering = True

    def service_actions(self) -> None:
        """Close the connections past their time (serve_forever calls this between accepts
        and every half second): ``shutdown`` wakes their threads, which end."""
        now = time.monotonic()
        with self._lock:
            late = [(sock, each.who) for sock, each in self._open.items() if each.until <= now]
            for sock, _who in late:
                self._open[sock].until = math.inf
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for _sock, who in late:
            self.refused("metrics connection from %s closed: not done in %g s", who,
                         CONNECTION_TIMEOUT_S)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (the scraper went away) is a line in the log, not a
        traceback on stderr; rate-limited, since anyone can make connections fail."""
        self._ended("metrics connection from %s ended: %r", client_address[0],
                    sys.exc_info()[1])


def _bind(address: Address) -> socket.socket:
    """A listening socket on ``address``; an IPv6 one takes IPv4 too (``[::]:PORT``)."""
    try:
        family, _type, _proto, _name, where = socket.getaddrinfo(
            address.host, address.port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"cannot resolve --metrics {address}: {e.strerror}") from None
    try:
        return socket.create_server(where, family=family, dualstack_ipv6=(
            family == socket.AF_INET6 and socket.has_dualstack_ipv6()))
    except OSError as e:  # create_server's text names the address again: the errno's alone
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise UserError(f"cannot serve metrics on {address}: {reason}") from None


class MetricsServer:
    """The HTTP server of ``--metrics``: bound by ``bind``, serving from ``start`` (given the
    loop's token) until ``close``."""

    def __init__(self, sock: socket.socket, status: Callable[[], dict[str, Any]]) -> None:
        self.snapshots = Snapshots(status)
        registry = CollectorRegistry()
        registry.register(StatusCollector(self.snapshots))
        ProcessCollector(registry=registry)  # the daemon's CPU, memory and descriptors
        self.server = _Server(sock, registry)
        self._thread: threading.Thread | None = None

    @classmethod
    def bind(cls, address: Address, status: Callable[[], dict[str, Any]]) -> MetricsServer:
        return cls(_bind(address), status)

    def start(self, token: trio.lowlevel.TrioToken) -> None:
        self.snapshots.token = token
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name="coordlfs-metrics")
        self._thread.start()
        host, port = self.server.socket.getsockname()[:2]
        log.info("metrics on http://%s/metrics", Address(host, port))

    def close(self) -> None:
        if self._thread is not None:
            self.server.shutdown()  # returns once serve_forever has
            self._thread = None
        self.server.server_close()

