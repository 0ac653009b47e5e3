"""Where the nodes come from (``coordlfs.peers.sources``): Slurm node lists, files of nodes,
names, their errors, and ``Peers.replace`` changing the nodes of a running mount."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from coordlfs.cache.stats import ReadCounters
from coordlfs.errors import UserError
from coordlfs.peers.hold import PeerHold
from coordlfs.peers.links import LEFT, PeerDown, Peers
from coordlfs.peers.placement import MAX_PEERS, Address, ranking
from coordlfs.peers.sources import (
    DnsSource,
    FileSource,
    canonical,
    expand_hostlist,
    parse_peers_file,
    resolve_all,
    slurm_hostnames,
    slurm_nodelist,
    slurm_nodes,
)

LISTS = {
    "n[01-04,07],gpu3": ["n01", "n02", "n03", "n04", "n07", "gpu3"],
    "node1": ["node1"],
    "a[001-3],b[8-11]": ["a001", "a002", "a003", "b8", "b9", "b10", "b11"],
    "r[1-2]-x[3-4]": ["r1-x3", "r1-x4", "r2-x3", "r2-x4"],
    "127.0.0.[1-2]": ["127.0.0.1", "127.0.0.2"],
    "login,n[1-2]x[3]": ["login", "n1x3", "n2x3"],
    "c[9,10]": ["c9", "c10"],
}


@pytest.mark.parametrize(("text", "names"), LISTS.items())
def test_slurm_node_lists_expand(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty name"), ("a,,b", "empty name"), ("a, b", "spaces"), ("n[1-2", "unbalanced"),
    ("n1-2]", "unbalanced"), ("n[[1]]", "unbalanced"), ("n[3-1]", "goes down"),
    ("n[a-b]", "not a set of numbers"), ("n[]", "not a set of numbers"),
    ("n[1-2]-ib", "'-ib' after the last bracket"), ("n[1-99999999]", "more than"),
    ("a[1-300]b[1-300]", "more than"),
])
def test_bad_slurm_node_lists_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        expand_hostlist(text)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol (slurm-client) missing")
def test_slurm_expands_lists_as_scontrol_does(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's own ``scontrol show hostnames`` (given a slurm.conf to read: it needs no
    controller for this) and the parser used without it agree."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\n"
                    "NodeName=localhost CPUs=1 State=UNKNOWN\n"
                    "PartitionName=p Nodes=localhost Default=YES\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    for text, names in LISTS.items():
        done = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True,
                              text=True, timeout=30, check=True)
        assert done.stdout.split() == names
        assert slurm_hostnames(text) == names


def test_without_a_usable_scontrol_the_parser_expands(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path, caplog) -> None:
    """An scontrol that cannot run (here: an empty slurm.conf) is not the end: the list is
    expanded here. (A missing slurm.conf makes scontrol retry for 60 s; it gets 10.)"""
    (tmp_path / "empty.conf").touch()
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "empty.conf"))
    with caplog.at_level(logging.INFO, logger="coordlfs.peers.sources"):
        assert slurm_hostnames("n[01-02]") == ["n01", "n02"]
    if shutil.which("scontrol"):
        assert "scontrol show hostnames failed" in caplog.text


def test_the_allocation_comes_from_the_environment() -> None:
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST and SLURM_NODELIST are not set"):
        slurm_nodelist({"PATH": "/bin"})
    with pytest.raises(UserError, match="are not set"):
        slurm_nodelist({"SLURM_JOB_NODELIST": " "})
    assert slurm_nodelist({"SLURM_NODELIST": "a[1-2]"}) == ("SLURM_NODELIST", "a[1-2]")
    assert slurm_nodelist({"SLURM_NODELIST": "x", "SLURM_JOB_NODELIST": "y"}) == (
        "SLURM_JOB_NODELIST", "y")
    nodes = slurm_nodes(7878, {"SLURM_JOB_NODELIST": "127.0.0.[3,1-2]"})
    assert nodes == tuple(Address(f"127.0.0.{i}", 7878) for i in (1, 2, 3))  # sorted
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
        slurm_nodes(7878, {"SLURM_JOB_NODELIST": "bad name"})


def test_files_of_nodes_are_parsed_with_comments_and_blank_lines() -> None:
    text = ("# the job's nodes\n\n  127.0.0.2:7001  # the second\n127.0.0.1:7001\n"
            "[::1]:7002\n127.0.0.1:7001\n")
    assert parse_peers_file(text, "f") == (Address("127.0.0.1", 7001),
                                           Address("127.0.0.2", 7001), Address("::1", 7002))
    with pytest.raises(UserError, match="f:3: bad node 'host': expected HOST:PORT"):
        parse_peers_file("a:1\n\nhost\n", "f")
    with pytest.raises(UserError, match="f names no node"):
        parse_peers_file("# nobody yet\n\n", "f")
    with pytest.raises(UserError, match=r"f: 'a\.\.b' is not a host name"):
        parse_peers_file("a..b:1\n", "f")
    many = "".join(f"10.0.{i // 200}.{i % 200}:1\n" for i in range(MAX_PEERS + 1))
    with pytest.raises(UserError, match=f"at most {MAX_PEERS}"):
        parse_peers_file(many, "f")


def test_nodes_are_kept_in_one_order() -> None:
    a, b, c = Address("b", 1), Address("a", 2), Address("a", 1)
    assert canonical([a, b, c, a], "x") == (c, b, a)


def write(path: Path, text: str) -> None:
    """Rewrite in place, then give the file a new mtime: a rewrite in the same clock tick
    must still be seen (the test cannot wait for the clock)."""
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_a_file_is_taken_once_it_stays_the_same_and_a_bad_one_keeps_the_last(
        tmp_path: Path, caplog) -> None:
    path = tmp_path / "nodes"
    write(path, "127.0.0.1:7001\n")
    source = FileSource(str(path), insecure=True)
    assert source.first() == (Address("127.0.0.1", 7001),)
    assert source.poll() is None  # unchanged
    write(path, "127.0.0.1:7001\n127.0.0.2:7001\n")
    assert source.poll() is None  # changed since the last look: perhaps half-written
    assert source.poll() == (Address("127.0.0.1", 7001), Address("127.0.0.2", 7001))
    assert source.poll() is None
    with caplog.at_level(logging.WARNING, logger="coordlfs.peers.sources"):
        for bad, message in [("127.0.0.1:0\n", "port 1-65535"), ("", "names no node"),
                             ("10.255.255.254:7001\n", "loopback addresses only")]:
            caplog.clear()
            write(path, bad)
            assert source.poll() is None and source.poll() is None
            assert source.poll() is None  # reported once, not at every look
            assert [r.levelno for r in caplog.records] == [logging.WARNING], bad
            assert message in caplog.text and "the last good list stays" in caplog.text
        path.unlink()
        caplog.clear()
        assert source.poll() is None and source.poll() is None
        assert "No such file" in caplog.text
    write(path, "127.0.0.3:7001\n")
    assert source.poll() is None and source.poll() == (Address("127.0.0.3", 7001),)


def test_a_bad_file_at_mount_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"cannot read .*missing: No such file"):
        FileSource(str(tmp_path / "missing"), insecure=False).first()
    (tmp_path / "nodes").write_text("127.0.0.1:1\n10.255.255.254:1\n")
    with pytest.raises(UserError, match=r"names 10.255.255.254:1: --insecure is allowed on "):
        FileSource(str(tmp_path / "nodes"), insecure=True).first()
    assert len(FileSource(str(tmp_path / "nodes"), insecure=False).first()) == 2


def test_names_resolve_to_every_address(caplog) -> None:
    nodes = resolve_all("localhost", 7001)
    assert Address("127.0.0.1", 7001) in nodes and nodes == canonical(nodes, "x")
    with pytest.raises(UserError, match=r"cannot resolve coordlfs-test\.invalid"):
        resolve_all("coordlfs-test.invalid", 7001)
    with pytest.raises(UserError, match="not a host name"):
        resolve_all("a" * 64 + ".test", 7001)
    source = DnsSource("coordlfs-test.invalid", 7001, insecure=False)
    with caplog.at_level(logging.WARNING, logger="coordlfs.peers.sources"):
        assert source.first() == ()  # a Service with no pod ready yet: alone until it has
        assert "caches alone until it resolves" in caplog.text
        caplog.clear()
        assert source.poll() is None and source.poll() is None
    assert len(caplog.records) == 1 and "the last good list stays" in caplog.text


def test_peers_replace_their_nodes_while_running() -> None:
    """Links to nodes that joined appear (connecting at their first request), links to nodes
    that left are retired: a request to one fails at once, as for a peer that is down."""
    me, b, c = (Address("127.0.0.1", p) for p in (7001, 7002, 7003))
    counters = ReadCounters()

    async def main() -> None:
        peers = Peers(canonical([me, b], "x"), me, b"", 1.0, counters, me, "file f")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peers.run)
            await trio.sleep(0)
            old = peers.links[b]
            await peers.replace(canonical([me, c], "x"))
            assert set(peers.links) == {c} and peers.me == me and peers.nodes == (me, c)
            assert old.retired and peers.links[c].nursery is not None
            with pytest.raises(PeerDown, match=LEFT):
                await old._connected()
            status = peers.status()
            assert status["source"] == "file f" and status["changes"] == 1
            assert status["nodes"] == [str(me), str(c)] and list(status["links"]) == [str(c)]
            await peers.replace((b, c))  # this node left the list: it asks, caches for none
            assert peers.me is None and set(peers.links) == {b, c}
            assert peers.candidates(b"x") == ([peers.links[n] for n in ranking(b"x", (b, c))],
                                              [])
            nursery.cancel_scope.cancel()

    trio.run(main)


class _Link:
    """A peer that takes requests and never answers (hashable, as a PeerLink is)."""


class _HungPeers:
    def __init__(self) -> None:
        self.link = _Link()

    def candidates(self, _path: bytes) -> tuple[list, list]:
        return [self.link], []

    async def read_many(self, _link: object, _files: list) -> list:
        await trio.sleep_forever()
        raise AssertionError("never answered")


def test_the_holding_area_lets_go_of_a_peer_that_left() -> None:
    """Files queued for a peer that left are left to the readers; a reader waiting for a
    batch in flight to it gets None at once, and the bytes reserved for it are free."""
    peers = _HungPeers()
    stat = SimpleNamespace(st_mode=0o100644, st_size=1000, st_mtime_ns=7, st_dev=1, st_ino=1)
    cache = SimpleNamespace(max_file_size=1 << 30,
                            room=SimpleNamespace(used=0, capacity=1 << 30),
                            lookup=lambda _key, _st: None)
    hold = PeerHold(peers, cache, SimpleNamespace(lstat=lambda _p: stat))  # type: ignore[arg-type]
    names = [f"f{i}".encode() for i in range(100)]
    got: list[object] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold.run)
            assert hold.prefetch(names) == 100
            await trio.sleep(1)
            assert hold.reserved > 0 and hold.status()["batches"] > 0  # asked, never answered

            async def take() -> None:
                got.append(await hold.take(names[0], stat))  # type: ignore[arg-type]
            nursery.start_soon(take)
            await trio.sleep(1)
            assert not got  # waiting for its batch
            hold.forget_link(peers.link)  # type: ignore[arg-type]
            await trio.sleep(1)
            assert got == [None] and hold.reserved == 0 and not hold.items
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
