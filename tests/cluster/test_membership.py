"""Membership from the engine, with real daemons: nodes from a file rewritten while the mounts
run, from a name resolved for real by getaddrinfo (network namespaces, whose /etc/hosts
``ip netns exec`` replaces), and from a Slurm node list in the environment."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import Mount, drop_caches, run_cli
from test_peers import (
    copies,
    fake_peer,
    free_port,
    node,
    read_files,
    reads,
    source_digests,
)

from coordlfs.peers.placement import Address, owner
from coordlfs.system.mounts import mount_at
from coordlfs.system.processes import process_alive
from coordlfs.testbed.netns import Node, check_can_run, cluster_network

#: Seconds a change of membership may take to reach a mount: a few polls of the file (one a
#: second, applied once it stays the same for one) or of the name (every 5 s), on a busy
#: machine.
CHANGE_TIMEOUT = 30


def wait_nodes(status: Callable[[], dict[str, Any]], nodes: tuple[Address, ...]) -> None:
    want = sorted(map(str, nodes))
    deadline = time.monotonic() + CHANGE_TIMEOUT
    while (have := status()["peers"]["nodes"]) != want:
        assert time.monotonic() < deadline, f"nodes {have}, expected {want}"
        time.sleep(0.1)


def link_files(status: dict[str, Any], address: Address) -> int:
    return status["peers"]["links"][str(address)]["files"]


def write_nodes(path: Path, nodes: tuple[Address, ...], in_place: bool) -> None:
    """As an orchestrator would: a new file renamed over the old one, or the old one
    rewritten (which a reader may catch half-written)."""
    text = "# nodes of the job\n" + "".join(f"{n}\n" for n in nodes)
    if in_place:
        with open(path, "w") as f:
            f.write(text)
        return
    new = path.with_suffix(".new")
    new.write_text(text)
    os.replace(new, path)


@contextlib.contextmanager
def reading_all_along(m: Mount, names: list[str], want: dict[str, str]) -> Iterator[list[str]]:
    """Read every file through ``m`` over and over while the block runs; the names read
    wrong (none, if every byte stays right while the membership changes)."""
    wrong: list[str] = []
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            got = read_files(m.mountpoint, names)
            wrong.extend(n for n in names if got[n] != want[n])

    reader = threading.Thread(target=loop)
    reader.start()
    try:
        yield wrong
    finally:
        done.set()
        reader.join()


def test_a_file_of_nodes_adds_and_removes_nodes_without_a_remount(mount,
                                                                    tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 3)
    ports = [free_port() for _ in roots]
    a_, b_, c_ = (node(p) for p in ports)
    listed = tmp_path / "nodes"
    write_nodes(listed, (a_, b_), in_place=False)
    a, b, c = (mount(root, "--listen", str(node(port)), "--peers-file", str(listed),
                     "--insecure", "--cache-size", "64M")
               for root, port in zip(roots, ports, strict=True))
    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    assert a.status()["peers"]["source"] == f"file {listed}"
    assert c.status()["peers"]["self"] is None  # not listed yet: it asks, caches for none

    # Two nodes: A's misses of B's files come from B.
    assert read_files(a.mountpoint, names) == want
    two, three = (a_, b_), (a_, b_, c_)
    assert reads(a)["files_from_peers"] == sum(owner(n.encode(), two) == b_ for n in names)

    # C joins: A uses it without a remount, and only C's share of the files moved to it.
    write_nodes(listed, three, in_place=False)
    for m in (a, b, c):
        wait_nodes(m.status, three)
    assert c.status()["peers"]["self"] == str(c_) and a.status()["peers"]["changes"] == 1
    shown = run_cli("stats", str(a.mountpoint)).stdout
    assert f"this node {a_}, 3 nodes from file {listed} (1 change, as of " in shown
    moved = [n for n in names if owner(n.encode(), three) != owner(n.encode(), two)]
    assert all(owner(n.encode(), three) == c_ for n in moved)
    assert 0.15 < len(moved) / len(names) < 0.55  # about a third (4 sigma either way)
    before = a.status()
    drop_caches()
    assert read_files(a.mountpoint, names) == want
    after = a.status()
    # A cached its own files; of B's, those that moved now come from C, the rest from B
    from_b = [n for n in names if owner(n.encode(), two) == b_]
    assert link_files(after, c_) == sum(n in moved for n in from_b) > 0
    assert link_files(after, b_) - link_files(before, b_) == sum(n not in moved for n in from_b)

    # B leaves while A reads: every byte stays right, and B is asked nothing more.
    with reading_all_along(a, names, want) as wrong:
        write_nodes(listed, (a_, c_), in_place=True)
        wait_nodes(a.status, (a_, c_))
        assert list(a.status()["peers"]["links"]) == [str(c_)]
    assert not wrong
    served_by_b = b.status()["served"]["requests"]
    drop_caches()
    assert read_files(a.mountpoint, names) == want
    assert b.status()["served"]["requests"] == served_by_b
    # a file that is bad for a while keeps the last good list
    listed.write_text("not a node\n")
    deadline = time.monotonic() + CHANGE_TIMEOUT
    while "bad node 'not a node'" not in a.log.read_text():
        assert time.monotonic() < deadline, "the bad file was not reported"
        time.sleep(0.1)
    assert a.status()["peers"]["nodes"] == sorted(map(str, (a_, c_)))


def test_a_read_waiting_on_a_node_that_leaves_reads_storage_at_once(mount,
                                                                     tmp_path: Path) -> None:
    """A peer that has taken a request and never answers (a hung process) is removed from
    the list: the reader waiting on it reads local storage at once, not after the timeout."""
    roots, sizes = copies(tmp_path, 1)
    ports = [free_port(), free_port()]
    me, hung = node(ports[0]), node(ports[1])
    listed = tmp_path / "nodes"
    write_nodes(listed, (me, hung), in_place=False)
    want = source_digests(roots[0], sizes)
    theirs = next(n for n in sorted(sizes) if owner(n.encode(), (me, hung)) == hung)
    with fake_peer(ports[1], "hang"):
        a = mount(roots[0], "--listen", str(me), "--peers-file", str(listed), "--insecure",
                  "--peer-timeout", "60")
        got: dict[str, str] = {}
        reader = threading.Thread(target=lambda: got.update(read_files(a.mountpoint,
                                                                       [theirs])))
        reader.start()
        deadline = time.monotonic() + CHANGE_TIMEOUT
        while not a.status()["peers"]["links"][str(hung)]["in_flight"]:
            assert time.monotonic() < deadline, "the read never reached the peer"
            time.sleep(0.05)
        write_nodes(listed, (me,), in_place=False)
        reader.join(timeout=CHANGE_TIMEOUT)  # half the peer timeout
        assert not reader.is_alive() and got == {theirs: want[theirs]}
    assert a.status()["peers"]["links"] == {} and reads(a)["files_from_source"] == 1


# -- names resolved for real ------------------------------------------------------------------

NAME = "coordlfs-peers.test"
PORT = 7878
#: Reads every file named on the command line under a root, prints their digests as JSON:
#: run inside a daemon's mount namespace, where its mount is.
READER = ("import json, pathlib, sys, xxhash; root = pathlib.Path(sys.argv[1]); "
          "print(json.dumps({n: xxhash.xxh64_hexdigest((root / n).read_bytes()) "
          "for n in sys.argv[2:]}))")


@dataclass
class Namespaced:
    """A daemon run with ``ip netns exec``: in its node's network, with the node's
    /etc/netns/NODE/hosts as /etc/hosts, and in a mount namespace of its own (where its
    mount is seen, so it is read from there)."""

    process: subprocess.Popen[str]
    mountpoint: Path
    log: Path

    def inside(self, *argv: str) -> str:
        return subprocess.run(["nsenter", "-t", str(self.process.pid), "-m", *argv],
                              check=True, capture_output=True, text=True, timeout=60).stdout

    def status(self) -> dict[str, Any]:
        return json.loads(self.inside("cat", str(self.mountpoint / ".coordlfs")))

    def read(self, names: list[str]) -> dict[str, str]:
        return json.loads(self.inside(sys.executable, "-c", READER, str(self.mountpoint),
                                      *names))


def write_hosts(nodes: list[Node], listed: list[Node]) -> None:
    """Every node resolves NAME to the addresses of ``listed``, and to an IPv6 address that
    is no node (as a dual-stack Service's AAAA records: a name with IPv4 addresses gives
    those only). Rewritten in place: ``ip netns exec`` bind-mounted the file itself over
    /etc/hosts."""
    text = "127.0.0.1 localhost\nfd00::99 " + NAME + "\n" + "".join(
        f"{n.address} {NAME}\n" for n in listed)
    for n in nodes:
        with open(Path("/etc/netns") / n.name / "hosts", "w") as f:
            f.write(text)


@contextlib.contextmanager
def hosts_files(nodes: list[Node]) -> Iterator[None]:
    made = [Path("/etc/netns") / n.name for n in nodes]
    try:
        for directory in made:
            directory.mkdir(parents=True)
        yield
    finally:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)
        with contextlib.suppress(OSError):  # others' namespaces may have theirs there
            Path("/etc/netns").rmdir()


@contextlib.contextmanager
def namespaced(n: Node, source: Path, tmp_path: Path, secret: Path,
               daemon_logs: list[Path]) -> Iterator[Namespaced]:
    """``coordlfs mount -f`` in node ``n``, with peers from ``dns:NAME:PORT``; stopped by
    pid on the way out (its mount goes with its mount namespace)."""
    mountpoint, log = tmp_path / f"mnt-{n.name}", tmp_path / f"{n.name}.log"
    cache = Path("/dev/shm") / f"coordlfs-test-{uuid.uuid4().hex[:12]}"
    mountpoint.mkdir()
    daemon_logs.append(log)
    process = subprocess.Popen(
        ["ip", "netns", "exec", n.name, sys.executable, "-m", "coordlfs", "mount",
         str(source), str(mountpoint), "-f", "--log", str(log), "--cache-dir", str(cache),
         "--cache-size", "64M", "--listen", f"{n.address}:{PORT}",
         "--peers-from", f"dns:{NAME}:{PORT}", "--secret-file", str(secret)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # "coordlfs: mounted ...", or EOF if it failed
        if "mounted" not in line:
            process.wait(timeout=30)
            pytest.fail(f"mount in {n.name} failed: {line}{process.stderr.read()}")
        yield Namespaced(process, mountpoint, log)
    finally:
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            if process.poll() is None:
                process.send_signal(sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=wait)
        shutil.rmtree(cache, ignore_errors=True)


def test_a_name_resolved_again_adds_and_removes_nodes(tmp_path: Path,
                                                       daemon_logs: list[Path]) -> None:
    if os.geteuid() != 0 or shutil.which("nsenter") is None:
        pytest.skip("network namespaces and nsenter need root and util-linux")
    check_can_run()
    roots, sizes = copies(tmp_path, 3)
    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    secret = tmp_path / "secret"
    secret.write_bytes(b"a shared secret of the test, 32b")
    secret.chmod(0o600)
    with cluster_network(3, link=None) as net, hosts_files(net), contextlib.ExitStack() as up:
        write_hosts(net, net[:2])
        a, b, c = (up.enter_context(namespaced(n, root, tmp_path, secret, daemon_logs))
                   for n, root in zip(net, roots, strict=True))
        addresses = tuple(Address(n.address, PORT) for n in net)
        two, three = addresses[:2], addresses
        status = a.status()
        assert status["peers"]["source"] == f"dns:{NAME}:{PORT}"
        assert status["peers"]["nodes"] == sorted(map(str, two))
        assert a.read(names) == want
        assert a.status()["reads"]["files_from_peers"] == sum(
            owner(n.encode(), two) == two[1] for n in names)

        write_hosts(net, net)  # C's pod became ready
        for m in (a, b, c):
            wait_nodes(m.status, three)
        assert c.status()["peers"]["self"] == str(three[2])
        drop_caches()
        assert a.read(names) == want
        moved = [n for n in names if owner(n.encode(), two) == two[1]
                 and owner(n.encode(), three) == three[2]]
        assert link_files(a.status(), three[2]) == len(moved) > 0

        write_hosts(net, [net[0], net[2]])  # B's went away
        wait_nodes(a.status, (three[0], three[2]))
        served_by_b = b.status()["served"]["requests"]
        drop_caches()
        assert a.read(names) == want
        assert b.status()["served"]["requests"] == served_by_b
        assert list(a.status()["peers"]["links"]) == [str(three[2])]
        up.close()  # the daemons leave the namespaces before they go
    assert not [m for m in (a, b, c) if process_alive(m.process.pid)]


# -- Slurm ------------------------------------------------------------------------------------


def slurm_conf(tmp_path: Path) -> Path:
    """The least slurm.conf ``scontrol show hostnames`` reads (no controller is asked)."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\n"
                    "NodeName=localhost CPUs=1 State=UNKNOWN\n"
                    "PartitionName=p Nodes=localhost Default=YES\n")
    return conf


def test_the_allocation_from_the_environment(mount, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes of an allocation, 127.0.0.1 and 127.0.0.2, at --listen's port; the list
    expanded by Slurm's scontrol (given a slurm.conf, as on a cluster's node)."""
    roots, sizes = copies(tmp_path, 2)
    port = free_port()
    monkeypatch.setenv("SLURM_JOB_NODELIST", "127.0.0.[1-2]")
    monkeypatch.setenv("SLURM_CONF", str(slurm_conf(tmp_path)))
    a, b = (mount(root, "--listen", f"127.0.0.{i}:{port}", "--peers-from", "slurm",
                  "--insecure") for i, root in enumerate(roots, 1))
    nodes = (Address("127.0.0.1", port), Address("127.0.0.2", port))
    for m, me in zip((a, b), nodes, strict=True):
        peers = m.status()["peers"]
        assert peers["source"] == "slurm" and peers["self"] == str(me)
        assert peers["nodes"] == list(map(str, nodes))
    names = sorted(sizes)
    assert read_files(a.mountpoint, names) == source_digests(roots[0], sizes)
    assert reads(a)["files_from_peers"] == sum(owner(n.encode(), nodes) == nodes[1]
                                               for n in names)


def test_outside_a_slurm_job_the_mount_is_a_one_line_error(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    source, mountpoint = tmp_path / "src", tmp_path / "mnt"
    source.mkdir()
    mountpoint.mkdir()
    done = run_cli("mount", str(source), str(mountpoint), "--listen",
                   f"127.0.0.1:{free_port()}", "--peers-from", "slurm", "--insecure",
                   "--cache-dir", str(tmp_path / "cache"))
    assert done.returncode == 1 and mount_at(str(mountpoint)) is None
    assert done.stderr.strip().splitlines() == [
        "coordlfs: --peers-from slurm: SLURM_JOB_NODELIST and SLURM_NODELIST are not set "
        "(run in a Slurm job, its prolog or an salloc shell)"]
    assert not (tmp_path / "cache").exists()
