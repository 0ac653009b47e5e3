"""Cluster networks on real namespaces, veths, a bridge and tbf: reachability, shaping, clean-up."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest

from coordlfs.errors import UserError
from coordlfs.testbed import netns
from coordlfs.testbed.netns import Node, check_can_run, cluster_network, rate_bits, remove_stale

try:
    check_can_run()
    CANNOT_RUN = ""
except UserError as e:
    CANNOT_RUN = str(e)

needs_netns = pytest.mark.skipif(bool(CANNOT_RUN), reason=CANNOT_RUN)

# Both print a line when done; the server also when it listens, so the client never races it.
SERVER = """
import hashlib, socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
print("ready", flush=True)
c, peer = s.accept()
start, h, n = time.monotonic(), hashlib.sha256(), 0
while data := c.recv(1 << 20):
    h.update(data)
    n += len(data)
print(peer[0], n, h.hexdigest(), time.monotonic() - start, flush=True)
"""
CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
block, n = memoryview(bytes(range(256)) * 4096), int(sys.argv[3])
for start in range(0, n, len(block)):
    c.sendall(block[:n - start])
c.close()
"""
BLOCK = bytes(range(256)) * 4096


def payload_digest(nbytes: int) -> str:
    h = hashlib.sha256()
    for start in range(0, nbytes, len(BLOCK)):
        h.update(BLOCK[:nbytes - start])
    return h.hexdigest()


def transfer(src: Node, dst: Node, nbytes: int, port: int = 5001) -> tuple[str, int, str, float]:
    """Send ``nbytes`` from a client in ``src`` to a server in ``dst``: the server's
    (peer address, bytes received, sha256, seconds from accept to end of stream)."""
    server = subprocess.Popen([*dst.enter(), sys.executable, "-c", SERVER, dst.address,
                               str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        assert server.stdout.readline() == "ready\n"
        subprocess.run([*src.enter(), sys.executable, "-c", CLIENT, dst.address, str(port),
                        str(nbytes)], check=True, timeout=60)
        out, _ = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    peer, received, digest, seconds = out.split()
    return peer, int(received), digest, float(seconds)


def tx_bytes(node: Node) -> int:
    """Bytes sent by the node's interfaces other than lo."""
    links = json.loads(subprocess.run(["ip", "-n", node.name, "-j", "-s", "link"], check=True,
                                      capture_output=True, text=True).stdout)
    return sum(link["stats64"]["tx"]["bytes"] for link in links if link["ifname"] != "lo")


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.splitlines()]


def leftovers() -> list[str]:
    """Namespaces and root-namespace interfaces of this process's cluster networks."""
    own = f"{netns.PREFIX}{os.getpid()}"
    out = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True)
    links = [line.split(": ")[1].split("@")[0] for line in out.stdout.splitlines()]
    return [name for name in namespaces() + links if name.startswith(own)]


def test_rate_bits_reads_tc_rates() -> None:
    assert rate_bits("10gbit") == 10**10
    assert rate_bits("100mbit") == 10**8
    assert rate_bits("1.5Gbit") == 15 * 10**8
    assert rate_bits("125mbps") == 10**9


def test_node_enters_only_the_network_namespace() -> None:
    assert Node("clfs1n0", "10.213.0.1").enter() == ["nsenter", "--net=/run/netns/clfs1n0"]


@needs_netns
@pytest.mark.parametrize("count", [2, 3])
def test_nodes_reach_each_other_through_their_namespaces(count: int) -> None:
    with cluster_network(count) as nodes:
        assert [node.address for node in nodes] == [f"10.213.0.{i + 1}" for i in range(count)]
        assert len({node.name for node in nodes}) == count
        for node in nodes:
            assert node.name in namespaces()
            addresses = subprocess.run(["ip", "-n", node.name, "-o", "addr"], check=True,
                                       capture_output=True, text=True).stdout
            assert f" {node.address}/24 " in addresses
            with socket.socket() as s, pytest.raises(OSError):  # not an address of ours
                s.bind((node.address, 0))
        for i, src in enumerate(nodes):  # around the ring
            dst = nodes[(i + 1) % count]
            before = tx_bytes(src)
            assert transfer(src, dst, 3 << 20)[:3] == (src.address, 3 << 20,
                                                         payload_digest(3 << 20))
            assert tx_bytes(src) - before >= 3 << 20  # left through the node's veth
    assert leftovers() == []


@needs_netns
def test_nsenter_keeps_the_mount_namespace() -> None:
    with cluster_network(1, link=None) as [node]:
        def inside(path: str) -> str:
            return subprocess.run([*node.enter(), "readlink", path], check=True,
                                  capture_output=True, text=True).stdout.strip()
        assert inside("/proc/self/ns/mnt") == os.readlink("/proc/self/ns/mnt")
        assert inside("/proc/self/ns/net") != os.readlink("/proc/self/ns/net")


@needs_netns
def test_bridge_is_outside_the_root_namespace_firewall() -> None:
    # With br_netfilter loaded, a bridge in the root namespace would pass its packets through
    # the host's FORWARD chain; the cluster's bridge is in a namespace without rules.
    own = f"{netns.PREFIX}{os.getpid()}"
    with cluster_network(2, link=None) as nodes:
        assert sorted(leftovers()) == sorted([node.name for node in nodes] + [f"{own}s"])
        bridges = subprocess.run(["ip", "-n", f"{own}s", "-o", "link", "show", "type", "bridge"],
                                 check=True, capture_output=True, text=True).stdout
        assert f" {own}b: " in bridges
        assert transfer(nodes[0], nodes[1], 1000)[1] == 1000


@needs_netns
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_teardown_when_the_body_raises(error: type[BaseException]) -> None:
    with pytest.raises(error), cluster_network(2):
        assert len(leftovers()) == 3
        raise error
    assert leftovers() == []


@needs_netns
def test_teardown_when_creation_fails_half_way() -> None:
    # A well-formed rate that tc refuses (above 2**64 bit/s): the first node is made, then tc
    # fails; everything made so far goes.
    with pytest.raises(UserError, match="tc -n"), cluster_network(2, link="99999999tbit"):
        pass
    assert leftovers() == []


@needs_netns
def test_shaping_limits_the_rate() -> None:
    nbytes = 20_000_000  # 1.6 s at 100 Mbit/s
    with cluster_network(2, link="100mbit") as (a, b):
        seconds = transfer(a, b, nbytes)[3]
    assert seconds >= 1.2
    with cluster_network(2, link=None) as (a, b):
        assert transfer(a, b, nbytes)[3] < 0.6
    assert leftovers() == []


@needs_netns
@pytest.mark.parametrize("link", ["fast", "10", "-1gbit", "", "0gbit", "10 gbit"])
def test_bad_link_is_a_user_error(link: str) -> None:
    with pytest.raises(UserError, match="bad link rate"), cluster_network(2, link=link):
        pass
    assert leftovers() == []


@needs_netns
def test_bad_node_count_is_a_user_error() -> None:
    for count in (0, 254):
        with pytest.raises(UserError, match="nodes"), cluster_network(count):
            pass
    assert leftovers() == []


@needs_netns
def test_remove_stale_removes_dead_runs_only() -> None:
    dead = f"{netns.PREFIX}9999999"  # above any pid_max (4194304 at most)
    try:
        subprocess.run(["ip", "netns", "add", f"{dead}n0"], check=True)
        subprocess.run(["ip", "link", "add", f"{dead}v0", "type", "veth", "peer", "name",
                        f"{dead}p0"], check=True)
        with cluster_network(1, link=None) as [node]:  # removes stale objects on entry
            assert f"{dead}n0" not in namespaces()
            subprocess.run(["ip", "netns", "add", f"{dead}n1"], check=True)
            remove_stale()
            assert f"{dead}n1" not in namespaces()
            assert node.name in namespaces()  # its pid is alive: ours
        links = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True,
                               text=True).stdout
        assert f"{dead}v0" not in links and f"{dead}p0" not in links
    finally:
        for cmd in (["ip", "netns", "delete", f"{dead}n0"], ["ip", "netns", "delete", f"{dead}n1"],
                    ["ip", "link", "delete", f"{dead}v0"]):
            subprocess.run(cmd, capture_output=True)
