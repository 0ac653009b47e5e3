"""Which node of a cluster caches which file, and who this node is among its peers.

Every node is started with the same ``--peers`` list and ranks the nodes for each file by
rendezvous (highest random weight) hashing: by ``XXH64(path, seed=XXH64(node))``, highest
first. The file lives at the first node in its ranking whose cache has room, normally the
first (its owner): a node that misses asks the nodes ranked before itself, then caches the
file itself if it has room, then asks the nodes ranked after it; a node asked for a file it
does not hold reads its own storage once and keeps it. So each file is read from storage
once in the whole cluster while the caches together have room, even when the hash gives one
node a little more than its share (``docs/architecture.md`` has the numbers that chose this
over announcing what each node cached). No metadata server and no messages are needed to
find a file, and when the list changes only the files of the nodes that came or went move:
1/N of them for one node added to N.

Nodes are named by their ``HOST:PORT`` entry exactly as written in ``--peers``, so every node
hashes the same strings whatever its own view of DNS.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from dataclasses import dataclass

import xxhash

from coordlfs.errors import UserError

#: Most peers a mount talks to: each is one connection and a line in the status.
MAX_PEERS = 256
#: The shortest and longest secrets accepted: a short one is guessable, a long one a mistake.
MIN_SECRET, MAX_SECRET = 16, 4096


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(text: str, what: str) -> Address:
    """``HOST:PORT`` (IPv4 address or name; IPv6 is not supported)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 \
            or ":" in host or any(c.isspace() for c in host):
        raise UserError(f"bad {what} {text!r}: expected HOST:PORT with a port 1-65535")
    return Address(host, int(port))


def parse_peers(text: str) -> tuple[Address, ...]:
    peers = tuple(parse_address(item, "peer") for item in text.split(",") if item.strip())
    if not peers:
        raise UserError("--peers is empty: give HOST:PORT,HOST:PORT,...")
    if len(set(peers)) != len(peers):
        raise UserError("--peers names a node twice")
    if len(peers) > MAX_PEERS:
        raise UserError(f"--peers names {len(peers)} nodes; at most {MAX_PEERS}")
    return peers


def resolve(address: Address) -> str:
    """The IPv4 address of ``address.host``; UserError if it does not resolve."""
    try:
        return socket.getaddrinfo(address.host, address.port, socket.AF_INET,
                                  socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError) as e:
        raise UserError(f"cannot resolve peer {address}: {e}") from None


def is_loopback(address: Address) -> bool:
    try:
        return ipaddress.ip_address(resolve(address)).is_loopback
    except UserError:
        return False


def _is_local(ip: str) -> bool:
    """Whether ``ip`` belongs to this host (in this network namespace): binding to it works."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
    return True


def find_self(listen: Address, peers: tuple[Address, ...]) -> Address | None:
    """The entry of ``peers`` that is this node: its port is ours and its address is the one we
    listen on (or, listening on every address, one of this host's). None: this node caches
    for nobody but itself and only asks the others."""
    listen_ip = resolve(listen)
    mine = []
    for peer in peers:
        if peer.port != listen.port:
            continue
        try:
            ip = resolve(peer)
        except UserError:
            continue  # a name that does not resolve here is another node's problem
        wildcard = ipaddress.ip_address(listen_ip).is_unspecified
        if ip == listen_ip or (wildcard and _is_local(ip)):
            mine.append(peer)
    if len(mine) > 1:
        raise UserError(f"--peers names this node twice: {', '.join(map(str, mine))}")
    return mine[0] if mine else None


def ranking(path: bytes, nodes: tuple[Address, ...]) -> list[Address]:
    """The nodes in the order they are asked to cache ``path``: highest
    ``XXH64(path, seed=XXH64(node))`` first."""
    return sorted(nodes, reverse=True, key=lambda node: (xxhash.xxh64_intdigest(
        path, seed=xxhash.xxh64_intdigest(str(node).encode())), str(node)))


def owner(path: bytes, nodes: tuple[Address, ...]) -> Address:
    """The node that caches ``path`` while it has room."""
    return ranking(path, nodes)[0]


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
