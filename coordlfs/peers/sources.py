"""Where the nodes of a cluster come from, and when they change.

A distributed job's nodes are known to whatever started it, so the mount asks it instead of
a hand-written ``--peers`` list that must be identical on every node:

- ``--peers HOST:PORT,...``: the list as given; it never changes.
- ``--peers-from slurm``: the job's allocation, ``SLURM_JOB_NODELIST`` (else
  ``SLURM_NODELIST``) in the environment ``coordlfs mount`` runs in, which its daemon
  inherits; each node at ``--listen``'s port. Expanded by ``scontrol show hostnames``
  when it runs here, else by ``expand_hostlist``. An allocation does not change, so neither
  does the list.
- ``--peers-from dns:NAME:PORT``: every address ``getaddrinfo`` gives for NAME (a
  Kubernetes headless Service lists its ready pods so), re-resolved every ``DNS_INTERVAL_S``.
- ``--peers-file FILE``: one ``HOST:PORT`` per line, re-read when it changes (polled every
  ``FILE_POLL_S``).

Every node must hash the same strings (``placement``), so nodes are kept in one canonical
order, sorted by their text, whatever order the source gave. A list read at mount that is
wrong is a one-line error; one read later that is wrong (a name that no longer resolves, a
file half-written or mistyped) keeps the last good list and logs a WARNING: a mistake in the
membership never takes the mount down, and a node that is down is skipped by the peers as
always. ``Membership.run`` follows a changing source and hands each new list to
``Peers.replace``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

import trio

from coordlfs.errors import UserError
from coordlfs.peers.placement import MAX_PEERS, Address, is_loopback, parse_address
from coordlfs.peers.server import RateLimitedLog

if TYPE_CHECKING:
    from coordlfs.peers.links import Peers

log = logging.getLogger(__name__)

#: Seconds between two resolutions of a ``dns:`` name. CoreDNS's kubernetes plugin gives
#: its answers a TTL of 5 s by default (kubeadm's Corefile sets 30 and caches as long), so
#: asking more often would mostly read a cache; asking every 5 s costs each node one lookup
#: per 5 s (a thousand nodes: 200 queries a second to a cache that serves tens of thousands).
DNS_INTERVAL_S = 5.0
#: Seconds between two looks at a ``--peers-file``. A change is applied once the file has
#: stayed the same for one look, so a file caught half-written is not taken.
FILE_POLL_S = 1.0
#: Seconds between two warnings that a name does not resolve.
WARN_INTERVAL_S = 60.0
#: The environment variables Slurm gives a job's processes (and its prolog) the nodes in.
SLURM_VARIABLES = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
#: Seconds ``scontrol show hostnames`` may take (it reads slurm.conf, no controller asked).
SCONTROL_TIMEOUT_S = 10.0
#: Bytes of a --peers-file read at most: 256 nodes take a few KB.
MAX_FILE = 1 << 20
#: Most names a Slurm node list may expand to before it is refused: far more than
#: ``MAX_PEERS``, but a typo such as ``n[1-99999999]`` must not fill memory.
MAX_EXPANDED = 1 << 16

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def canonical(nodes: Iterable[Address], what: str) -> tuple[Address, ...]:
    """The nodes sorted by their text, each once: the order every node agrees on. A name
    the resolver cannot even be asked about (an empty or 64-byte label: getaddrinfo raises
    UnicodeError, not OSError) is refused here, before anything resolves it."""
    ordered = tuple(sorted(set(nodes), key=str))
    if len(ordered) > MAX_PEERS:
        raise UserError(f"{what} names {len(ordered)} nodes; at most {MAX_PEERS}")
    for node in ordered:
        try:
            node.host.encode("idna")
        except UnicodeError:
            raise UserError(f"{what}: {node.host!r} is not a host name") from None
    return ordered


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax: ``n[01-04,07],gpu3`` is n01 n02 n03 n04 n07 gpu3. A name may
    hold several bracketed sets (``r[1-2]-n[1-3]``: every combination) but ends with one if
    it has any; a range keeps the zero padding of its first number. As Slurm does."""
    names: list[str] = []
    for item in _split_top(text):
        parts: list[list[str]] = []
        rest = item
        while "[" in rest:
            head, _, tail = rest.partition("[")
            inside, closed, rest = tail.partition("]")
            if not closed or "[" in inside:
                raise UserError(f"bad Slurm node list {text!r}: unbalanced brackets")
            parts += [[head], _expand_set(inside, text)]
        if "]" in rest:
            raise UserError(f"bad Slurm node list {text!r}: unbalanced brackets")
        if parts and rest:
            raise UserError(f"bad Slurm node list {text!r}: {rest!r} after the last bracket")
        parts.append([rest])
        count = 1
        for choices in parts:
            count *= len(choices)
        if len(names) + count > MAX_EXPANDED:
            raise UserError(f"Slurm node list {text!r} expands to more than {MAX_EXPANDED} "
                            "names")
        combos = [""]
        for choices in parts:
            combos = [done + choice for done in combos for choice in choices]
        names += combos
    if not names:
        raise UserError(f"bad Slurm node list {text!r}: no nodes")
    return names


def _split_top(text: str) -> list[str]:
    """The list's names, split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if any(not item.strip() or item != item.strip() for item in items):
        raise UserError(f"bad Slurm node list {text!r}: an empty name or spaces")
    return items


def _expand_set(inside: str, text: str) -> list[str]:
    """``01-04,07`` -> 01 02 03 04 07."""
    out: list[str] = []
    for piece in inside.split(","):
        match = _RANGE.fullmatch(piece)
        if match is None:
            raise UserError(f"bad Slurm node list {text!r}: [{inside}] is not a set of "
                            "numbers and ranges")
        low, high = match[1], match[2] or match[1]
        if int(high) < int(low):
            raise UserError(f"bad Slurm node list {text!r}: range {piece} goes down")
        if int(high) - int(low) >= MAX_EXPANDED:
            raise UserError(f"Slurm node list {text!r} expands to more than {MAX_EXPANDED} "
                            "names")
        width = len(low) if low.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return out


def slurm_nodelist(environ: Mapping[str, str]) -> tuple[str, str]:
    """The variable that holds the allocation's nodes, and its value; UserError outside a
    Slurm job."""
    for name in SLURM_VARIABLES:
        if environ.get(name, "").strip():
            return name, environ[name].strip()
    raise UserError(f"--peers-from slurm: {' and '.join(SLURM_VARIABLES)} are not set "
                    "(run in a Slurm job, its prolog or an salloc shell)")


def slurm_hostnames(nodelist: str) -> list[str]:
    """The node names of a Slurm node list: as ``scontrol show hostnames`` gives them when it
    runs here (Slurm's own parser, whatever its syntax grows), else by ``expand_hostlist``
    (scontrol missing, or without a slurm.conf to read)."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            done = subprocess.run([scontrol, "show", "hostnames", nodelist], text=True,
                                  capture_output=True, timeout=SCONTROL_TIMEOUT_S)
            names = done.stdout.split()
            if done.returncode == 0 and names and not done.stderr.strip():
                return names
            why = (done.stderr.strip().splitlines() or [f"status {done.returncode}"])[-1]
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
        log.info("scontrol show hostnames failed (%s): the node list is expanded here", why)
    return expand_hostlist(nodelist)


def slurm_nodes(port: int, environ: Mapping[str, str] = os.environ) -> tuple[Address, ...]:
    """The allocation's nodes, each at ``port``."""
    variable, nodelist = slurm_nodelist(environ)
    names = slurm_hostnames(nodelist)
    return canonical((parse_address(f"{name}:{port}", f"node in {variable}")
                      for name in names), variable)


def parse_peers_file(text: str, path: str) -> tuple[Address, ...]:
    """One ``HOST:PORT`` per line; ``#`` starts a comment, blank lines are skipped."""
    nodes = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.partition("#")[0].strip()
        if entry:
            try:
                nodes.append(parse_address(entry, "node"))
            except UserError as e:
                raise UserError(f"{path}:{number}: {e}") from None
    if not nodes:
        raise UserError(f"{path} names no node (one HOST:PORT per line)")
    return canonical(nodes, path)


def resolve_all(name: str, port: int) -> tuple[Address, ...]:
    """Every IPv4 address ``name`` resolves to, each at ``port``; its IPv6 addresses if it
    has none. One family, as ``placement.resolve`` chooses: a dual-stack Service gives each
    pod an A and an AAAA record, and a pod listed twice would be two nodes."""
    try:
        infos = socket.getaddrinfo(name, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError as e:
        raise UserError(f"cannot resolve {name}: {e.strerror or e}") from None
    except UnicodeError:
        raise UserError(f"cannot resolve {name}: not a host name") from None
    found = {Address(info[4][0], port) for info in infos if info[0] == socket.AF_INET} or \
        {Address(info[4][0], port) for info in infos if info[0] == socket.AF_INET6}
    if not found:
        raise UserError(f"cannot resolve {name}: no IPv4 or IPv6 address")
    return canonical(found, f"dns:{name}:{port}")


class PeerSource:
    """A static list of nodes; subclasses read theirs again (``poll``) every ``interval``."""

    #: seconds between two polls; None: the list never changes
    interval: float | None = None

    def __init__(self, name: str, nodes: tuple[Address, ...] = (), insecure: bool = False
                 ) -> None:
        #: where the nodes come from, for the log and the status
        self.name = name
        self.nodes = nodes
        self.insecure = insecure

    def first(self) -> tuple[Address, ...]:
        """The nodes at mount time (blocking); UserError if they cannot be had."""
        return self._checked(self.nodes)

    def poll(self) -> tuple[Address, ...] | None:
        """The nodes if the source may have changed since the last call; None if it has not,
        or if it cannot be read now (logged: the last good list stays). Blocking: run in a
        worker thread."""
        return None

    def _checked(self, nodes: tuple[Address, ...]) -> tuple[Address, ...]:
        """``--insecure`` talks to loopback only: a list naming another host is refused
        (blocking: names are resolved)."""
        if self.insecure:
            outside = [str(n) for n in nodes if not is_loopback(n)]
            if outside:
                raise UserError(f"{self.name} names {', '.join(outside)}: --insecure is "
                                "allowed on loopback addresses only; give --secret-file FILE")
        return nodes


class DnsSource(PeerSource):
    interval = DNS_INTERVAL_S

    def __init__(self, host: str, port: int, insecure: bool) -> None:
        super().__init__(f"dns:{host}:{port}", insecure=insecure)
        self.host, self.port = host, port
        self._failed = RateLimitedLog(log, logging.WARNING, WARN_INTERVAL_S)

    def first(self) -> tuple[Address, ...]:
        """A name that does not resolve yet is no error at mount: a headless Service has no
        address until its first pod is ready, which this one may be."""
        try:
            return self._read()
        except UserError as e:
            log.warning("%s: %s; this node caches alone until it resolves", self.name, e)
            return ()

    def poll(self) -> tuple[Address, ...] | None:
        """Resolved every time: a DNS answer has no mtime. A failure is logged once per
        ``WARN_INTERVAL_S`` (it repeats every poll while the DNS server is away)."""
        try:
            return self._read()
        except UserError as e:
            self._failed("%s: %s; the last good list stays", self.name, e)
            return None

    def _read(self) -> tuple[Address, ...]:
        return self._checked(resolve_all(self.host, self.port))


class FileSource(PeerSource):
    """Polled, not watched with inotify: a file of nodes is often on a shared filesystem
    (written once for every node), where inotify misses what other hosts write, and it is
    replaced by rename more often than rewritten, which a watch on the file misses too; a
    stat a second costs nothing."""

    interval = FILE_POLL_S

    def __init__(self, path: str, insecure: bool) -> None:
        super().__init__(f"file {path}", insecure=insecure)
        self.path = path
        #: the file's identity at the last look, and when its list was last read
        self._seen: tuple[int, ...] | None = None
        self._read_at: tuple[int, ...] | None = None

    def first(self) -> tuple[Address, ...]:
        self._seen = self._read_at = self._signature()
        return self._read()

    def poll(self) -> tuple[Address, ...] | None:
        """Read once the file has changed and then stayed the same for a look; a bad
        version is logged once (the next look sees the same signature)."""
        signature = self._signature()
        if signature == self._read_at:
            return None
        if signature != self._seen:  # changing now: read once it stays the same for a look
            self._seen = signature
            return None
        self._read_at = signature
        try:
            return self._read()
        except UserError as e:
            log.warning("%s; the last good list stays", e)
            return None

    def _signature(self) -> tuple[int, ...]:
        try:
            st = os.stat(self.path)
        except OSError as e:
            return (-1, e.errno or 0)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _read(self) -> tuple[Address, ...]:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                text = f.read(MAX_FILE)
        except OSError as e:
            raise UserError(f"cannot read {self.path}: {e.strerror or e}") from None
        return self._checked(parse_peers_file(text, self.path))


class PeerSettings(Protocol):
    """What of a mount's configuration (``MountConfig``, which the daemon above reads from the
    command line) says where the nodes come from."""

    @property
    def peers(self) -> tuple[str, ...]: ...

    @property
    def peers_from(self) -> str | None: ...

    @property
    def peers_file(self) -> str | None: ...

    @property
    def insecure(self) -> bool: ...


def peer_source(config: PeerSettings, listen: Address) -> PeerSource:
    """Where ``config`` says the nodes come from."""
    if config.peers_file:
        return FileSource(config.peers_file, config.insecure)
    if config.peers_from == "slurm":
        return PeerSource("slurm", slurm_nodes(listen.port), config.insecure)
    if config.peers_from:
        host, _, port = config.peers_from.removeprefix("dns:").rpartition(":")
        return DnsSource(host, int(port), config.insecure)
    nodes = tuple(parse_address(p, "peer") for p in config.peers)
    return PeerSource("--peers", canonical(nodes, "--peers"), config.insecure)


class Membership:
    """Follows a source that changes and hands each new list of nodes to the peers."""

    def __init__(self, source: PeerSource, peers: Peers) -> None:
        self.source = source
        self.peers = peers

    async def run(self) -> None:
        """Poll the source until the mount ends; resolution and file reads run in worker
        threads, so a slow DNS server or filesystem never holds up the mount's requests."""
        if self.source.interval is None:
            return
        while True:
            await trio.sleep(self.source.interval)
            try:
                await self._follow()
            except Exception:  # a bug here must not take the mount down: the list stays
                log.exception("following the nodes from %s failed", self.source.name)

    async def _follow(self) -> None:
        nodes = await trio.to_thread.run_sync(self.source.poll, abandon_on_cancel=True)
        if nodes is None or nodes == self.peers.nodes:
            return
        try:
            await self.peers.replace(nodes)
        except UserError as e:  # e.g. this node named twice
            log.warning("%s: %s; the last good list stays", self.source.name, e)
