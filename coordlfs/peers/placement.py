"""Which node of a cluster caches which file, and who this node is among its peers.

Every node is started with the same ``--peers`` list and ranks the nodes for each file by
rendezvous (highest random weight) hashing: by ``XXH64(path, seed=XXH64(node))``, highest
first. The file lives at the first node in its ranking whose cache has room, normally the
first (its owner): a node that misses asks the nodes ranked before itself, then caches the
file itself if it has room, then asks the nodes ranked after it; a node asked for a file it
does not hold reads its own storage once and keeps it. So each file is read from storage
once in the whole cluster while the caches together have room, even when the hash gives one
node a little more than its share (``docs/design/peers.md`` has the numbers that chose this
over announcing what each node cached). No metadata server and no messages are needed to
find a file, and when the list changes only the files of the nodes that came or went move:
1/N of them for one node added to N.

A miss ranks the nodes once, so the ranking must stay cheap at a few hundred nodes: the
nodes' seeds and their tie-break order are worked out once per node set (``Layout``, found
by the tuple's identity, since hashing a tuple of 256 addresses costs more than ranking),
leaving one C-level XXH64 call per node and a sort (``coordlfs bench placement``: 39 µs for
256 nodes, against 131 µs when every call hashed every node's name again). The function is
unchanged, so nodes of different versions still agree on every file's owner.

Nodes are named by their ``HOST:PORT`` entry exactly as written in ``--peers``, so every node
hashes the same strings whatever its own view of DNS. An IPv6 address is written in brackets,
``[::1]:7878`` or ``[fe80::1%eth0]:7878``; a name is resolved to its IPv4 address when it has
one, else to its IPv6 address, the same way for listening and for connecting.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from dataclasses import dataclass
from itertools import repeat

import xxhash

from coordlfs.errors import UserError

#: Most peers a mount talks to: each is one connection and a line in the status.
MAX_PEERS = 256
#: The shortest and longest secrets accepted: a short one is guessable, a long one a mistake.
MIN_SECRET, MAX_SECRET = 16, 4096


@dataclass(frozen=True, slots=True)
class Address:
    """A node as written in ``--listen``/``--peers``; an IPv6 ``host`` is kept without its
    brackets and printed with them, so ``str`` gives back the entry as written."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str, what: str) -> Address:
    """``HOST:PORT``: an IPv4 address or a name, or an IPv6 address in brackets
    (``[::1]:7878``, ``[::]:7878``, ``[fe80::1%eth0]:7878``)."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    expected = f"bad {what} {text!r}: expected HOST:PORT with a port 1-65535"
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(expected)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not _is_ipv6(host):
            raise UserError(f"bad {what} {text!r}: [{host}] is not an IPv6 address")
    elif ":" in host:
        raise UserError(f"{expected}; an IPv6 address goes in brackets, as [::1]:7878")
    elif "[" in host or "]" in host or any(c.isspace() for c in host):
        raise UserError(expected)
    return Address(host, int(port))


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def parse_peers(text: str) -> tuple[Address, ...]:
    peers = tuple(parse_address(item, "peer") for item in text.split(",") if item.strip())
    if not peers:
        raise UserError("--peers is empty: give HOST:PORT,HOST:PORT,...")
    if len(set(peers)) != len(peers):
        raise UserError("--peers names a node twice")
    if len(peers) > MAX_PEERS:
        raise UserError(f"--peers names {len(peers)} nodes; at most {MAX_PEERS}")
    return peers


@dataclass(frozen=True, slots=True)
class Resolved:
    """An address as ``getaddrinfo`` gives it: the socket family and the address to bind or
    connect to (for IPv6 with its flow info and scope, which a link-local address needs)."""

    family: socket.AddressFamily
    sockaddr: tuple

    @property
    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        return ipaddress.ip_address(self.sockaddr[0])

    @property
    def host(self) -> str:
        """The address as a string ``getaddrinfo`` takes back: a link-local IPv6 address
        keeps its scope as ``%N``."""
        scope = self.sockaddr[3] if len(self.sockaddr) == 4 else 0
        return f"{self.sockaddr[0]}%{scope}" if scope else self.sockaddr[0]

    def with_port(self, port: int) -> tuple:
        return (self.sockaddr[0], port, *self.sockaddr[2:])


def resolve(address: Address) -> Resolved:
    """Where ``address`` is: an IP literal as written, a name's IPv4 address if it has one,
    else its IPv6 address (so listening and connecting agree on the family); UserError if it
    does not resolve."""
    try:
        infos = socket.getaddrinfo(address.host, address.port, socket.AF_UNSPEC,
                                   socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # UnicodeError: a label empty or too long
        raise UserError(f"cannot resolve peer {address}: {e}") from None
    found = [info for info in infos if info[0] == socket.AF_INET] or \
        [info for info in infos if info[0] == socket.AF_INET6]
    if not found:
        raise UserError(f"cannot resolve peer {address}: no IPv4 or IPv6 address")
    return Resolved(found[0][0], found[0][4])


def is_loopback(address: Address) -> bool:
    try:
        ip = resolve(address).ip
    except UserError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def _is_local(where: Resolved) -> bool:
    """Whether ``where`` belongs to this host (in this network namespace): binding to it works."""
    with socket.socket(where.family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind(where.with_port(0))
        except OSError:
            return False
    return True


def _answers_at(listen: Resolved, peer: Resolved) -> bool:
    """Whether a socket bound to ``listen`` takes connections made to ``peer`` (same port):
    the same address, or a wildcard of the same family, or ``::`` (which takes IPv4 too,
    since the listening socket is made dual-stack) and an address of this host."""
    if peer.host == listen.host:
        return True
    if not listen.ip.is_unspecified:
        return False
    return (peer.family == listen.family or listen.family == socket.AF_INET6) and \
        _is_local(peer)


def find_self(listen: Address, peers: tuple[Address, ...]) -> Address | None:
    """The entry of ``peers`` that is this node: its port is ours and its address is the one we
    listen on (or, listening on every address, one of this host's). None: this node caches
    for nobody but itself and only asks the others."""
    where = resolve(listen)
    mine = []
    for peer in peers:
        if peer.port != listen.port:
            continue
        try:
            there = resolve(peer)
        except UserError:
            continue  # a name that does not resolve here is another node's problem
        if _answers_at(where, there):
            mine.append(peer)
    if len(mine) > 1:
        raise UserError(f"--peers names this node twice: {', '.join(map(str, mine))}")
    return mine[0] if mine else None


@dataclass(frozen=True, slots=True)
class Layout:
    """What ranking a file among ``nodes`` needs beyond the path, worked out once per node
    set: the nodes in tie-break order (their names, highest first) and each one's seed."""

    nodes: tuple[Address, ...]
    order: tuple[Address, ...]
    seeds: tuple[int, ...]

    @classmethod
    def of(cls, nodes: tuple[Address, ...]) -> Layout:
        order = tuple(sorted(nodes, key=str, reverse=True))
        return cls(nodes, order, tuple(xxhash.xxh64_intdigest(str(node).encode())
                                       for node in order))

    def weights(self, path: bytes) -> list[int]:
        """``XXH64(path, seed)`` for each node of ``order``."""
        return list(map(xxhash.xxh64_intdigest, repeat(path), self.seeds))


#: Layouts of the node sets ranked lately, by ``id`` of the tuple (each holds its tuple, so
#: the id is not reused while it is here): a mount ranks over the same tuple for every file.
_layouts: dict[int, Layout] = {}
_MAX_LAYOUTS = 8


def layout(nodes: tuple[Address, ...]) -> Layout:
    found = _layouts.get(id(nodes))
    if found is not None and found.nodes is nodes:
        return found
    made = Layout.of(nodes)
    if len(_layouts) >= _MAX_LAYOUTS:
        _layouts.clear()  # node sets change rarely; one call, safe beside another thread's
    _layouts[id(nodes)] = made
    return made


def ranking(path: bytes, nodes: tuple[Address, ...]) -> list[Address]:
    """The nodes in the order they are asked to cache ``path``: highest
    ``XXH64(path, seed=XXH64(node))`` first, a tie broken by the higher name (the sort is
    stable and ``order`` is by name, highest first)."""
    at = layout(nodes)
    weights, order = at.weights(path), at.order
    return [order[i] for i in sorted(range(len(weights)), key=weights.__getitem__, reverse=True)]


def owner(path: bytes, nodes: tuple[Address, ...]) -> Address:
    """The node that caches ``path`` while it has room: the first of its ranking, found
    without sorting (``index`` takes the first of equal weights, as the ranking does)."""
    at = layout(nodes)
    weights = at.weights(path)
    return at.order[weights.index(max(weights))]


def read_secret(path: str) -> bytes:
    """The shared secret: the file's bytes without surrounding whitespace. A file others can
    read is refused, as ssh refuses an open private key: the secret is all that keeps a
    stranger from reading the dataset through the peer port."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            secret = f.read(MAX_SECRET + 1).strip()
    except OSError as e:
        raise UserError(f"cannot read secret file {path}: {e.strerror or e}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"secret file {path} is open to other users: chmod 600 {path}")
    if not MIN_SECRET <= len(secret) <= MAX_SECRET:
        raise UserError(f"secret file {path} must hold {MIN_SECRET} to {MAX_SECRET} bytes "
                        f"(it has {len(secret)}); e.g. head -c 32 /dev/urandom | base64 > {path}")
    return secret
