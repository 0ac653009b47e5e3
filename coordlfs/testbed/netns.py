"""A private network of several coordlfs nodes on one machine, links shaped like a cluster's.

A multi-node benchmark runs one daemon per node on this machine. For node-to-node traffic to
cross a link with a real bandwidth, each daemon's sockets must live in a network namespace of
its own, with its own address. The daemon is started as ``nsenter --net=/run/netns/NAME cmd``
(``Node.enter()``): nsenter enters *only* the network namespace, unlike ``ip netns exec``,
which also unshares the mount namespace and would hide the daemon's FUSE mount from everyone
else. So the mount is visible in the root namespace while the node's TCP goes through its veth.

What ``cluster_network`` builds, all named ``clfs<pid>...`` after the creating process:

- one namespace per node, ``clfs<pid>n<i>``, with ``lo`` up and a veth ``clfs<pid>v<i>``
  holding the node's address ``10.213.0.<i+1>/24``, its egress shaped by a tbf qdisc;
- a switch namespace ``clfs<pid>s`` holding the bridge ``clfs<pid>b`` and the veths'
  other ends ``clfs<pid>p<i>``.

The bridge is not in the root namespace on purpose: there, bridge-netfilter (br_netfilter with
``bridge-nf-call-iptables=1``) would send the bridged packets through the host's iptables
FORWARD chain, which Docker and firewalls set to DROP. A fresh namespace has no rules, so the
host's firewall neither blocks the cluster's traffic nor has to be changed. The root namespace
has no address in the cluster's subnet; debug from a node with ``nsenter --net=...``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from coordlfs.errors import UserError

log = logging.getLogger(__name__)

#: Start of every namespace and interface name; the creating pid follows, then a kind letter.
#: With a 7-digit pid (pid_max is at most 4194304) ``clfs<pid>v252`` is 15 characters, the
#: kernel's limit for an interface name.
PREFIX = "clfs"

#: Nodes get .1, .2, ...: at most 253 of them; .254 stays free (e.g. for a debugging veth).
SUBNET = "10.213.0"
MAX_NODES = 253

#: tbf lets ``burst`` bytes pass at once and refills it on timer ticks; below rate/HZ per tick
#: it cannot reach its rate (at 10gbit a 64 KiB burst gave 4.2 Gbit/s, 5 MB gave 9.6). 250 is
#: the smallest common CONFIG_HZ, so the burst suffices on kernels with faster ticks too.
HZ = 250
MIN_BURST = 64 << 10  # a whole GSO packet, which tbf would otherwise cut into segments
#: How long a packet may wait in the queue; at 100mbit that is 625 kB, enough not to drop.
LATENCY = "50ms"

_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)")
_UNIT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
         "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12}
_OWN_NAME = re.compile(rf"{PREFIX}(\d+)[a-z]\d*")


@dataclass(frozen=True)
class Node:
    name: str  #: the network namespace
    address: str  #: IPv4 address of the node, reachable from the other nodes

    def enter(self) -> list[str]:
        """Prefix for a command that must run in the node's network (mount namespace kept)."""
        return ["nsenter", f"--net=/run/netns/{self.name}"]


def _run(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        raise UserError(f"{' '.join(cmd)}: {'; '.join(e.stderr.strip().splitlines())}") from None
    except FileNotFoundError:
        raise UserError(f"{cmd[0]} not found; a cluster network needs it") from None


def rate_bits(link: str) -> int:
    """Bits per second of a tc rate such as "10gbit"; UserError before anything is made."""
    match = _RATE.fullmatch(link.lower())
    bits = int(float(match[1]) * _UNIT[match[2]]) if match else 0
    if bits <= 0:
        raise UserError(f"bad link rate {link!r}: give a tc rate such as 10gbit, 1gbit, 100mbit")
    return bits


def _alive(pid: str) -> bool:
    try:  # a killed run's process may stay a zombie until someone reaps it: dead already
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stale(name: str) -> bool:
    match = _OWN_NAME.fullmatch(name)
    return match is not None and not _alive(match[1])


def _root_links() -> list[str]:
    # "3: name@peer: <FLAGS> ..." per line
    return [line.split(": ")[1].split("@")[0] for line in _run("ip", "-o", "link").splitlines()]


def remove_stale() -> None:
    """Remove namespaces and interfaces of runs whose process is gone (killed, no teardown)."""
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    for name in filter(_stale, names):
        with contextlib.suppress(UserError):
            _run("ip", "netns", "delete", name)
    for name in filter(_stale, _root_links()):
        with contextlib.suppress(UserError):
            _run("ip", "link", "delete", name)


def check_can_run() -> None:
    """UserError naming what is missing, before a benchmark spends time on anything else."""
    if os.geteuid() != 0:
        raise UserError("a cluster network (network namespaces, veths, tc) needs root")
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            raise UserError(f"{tool} not found on PATH; a cluster network needs iproute2 "
                            "and util-linux")
    probe = f"{PREFIX}{os.getpid()}t"
    try:
        _run("ip", "netns", "add", probe)
    except UserError as e:
        raise UserError(f"cannot create a network namespace: {e}") from None
    finally:
        with contextlib.suppress(UserError):
            _run("ip", "netns", "delete", probe)


def _add_netns(name: str, made: list[str]) -> None:
    made.append(name)  # before: an interrupt may land after the kernel made it
    try:
        _run("ip", "netns", "add", name)
    except UserError:
        made.pop()  # not ours (a cluster of this process already holds the name)
        raise


def _teardown(made: list[str]) -> None:
    for name in reversed(made):
        try:
            if pids := _run("ip", "netns", "pids", name).split():
                log.warning("processes %s still run in network namespace %s: its interfaces "
                            "stay until they exit", ", ".join(pids), name)
            _run("ip", "netns", "delete", name)
        except UserError as e:
            log.warning("teardown: %s", e)
    with contextlib.suppress(UserError):
        for name in _root_links():
            match = _OWN_NAME.fullmatch(name)
            if match and int(match[1]) == os.getpid():
                try:
                    _run("ip", "link", "delete", name)
                except UserError as e:
                    log.warning("teardown: %s", e)


@contextlib.contextmanager
def cluster_network(nodes: int, link: str | None = "10gbit") -> Iterator[list[Node]]:
    """``nodes`` namespaces on one bridge, each node's egress shaped to ``link`` (None: not).

    Everything is removed on exit, whatever happened inside or half-way through creation.
    Stop the processes started in the nodes before leaving the block: a namespace (and its
    veth) lives on, nameless, while a process is in it.
    """
    if not 1 <= nodes <= MAX_NODES:
        raise UserError(f"a cluster network has 1 to {MAX_NODES} nodes, not {nodes}")
    burst = None if link is None else max(rate_bits(link) // 8 // HZ, MIN_BURST)
    remove_stale()
    prefix = f"{PREFIX}{os.getpid()}"
    switch, bridge = f"{prefix}s", f"{prefix}b"
    made: list[str] = []
    try:
        _add_netns(switch, made)
        _run("ip", "-n", switch, "link", "add", bridge, "up", "type", "bridge")
        result = []
        for i in range(nodes):
            node = Node(f"{prefix}n{i}", f"{SUBNET}.{i + 1}")
            veth, port = f"{prefix}v{i}", f"{prefix}p{i}"
            _add_netns(node.name, made)
            _run("ip", "link", "add", veth, "netns", node.name, "type", "veth",
                 "peer", "name", port, "netns", switch)
            _run("ip", "-n", switch, "link", "set", port, "master", bridge, "up")
            _run("ip", "-n", node.name, "addr", "add", f"{node.address}/24", "dev", veth)
            _run("ip", "-n", node.name, "link", "set", veth, "up")
            _run("ip", "-n", node.name, "link", "set", "lo", "up")
            if link is not None:
                _run("tc", "-n", node.name, "qdisc", "add", "dev", veth, "root", "tbf",
                     "rate", link, "burst", str(burst), "latency", LATENCY)
            result.append(node)
        yield result
    finally:
        _teardown(made)
