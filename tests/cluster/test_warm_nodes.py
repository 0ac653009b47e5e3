"""``coordlfs warm`` on a cluster (issue 25, item 3): two real mounts peering on loopback.
Each node warms only its own share of the placement; ``--all-nodes`` asks the peer to warm
its share too (WARM frames over the authenticated peer link), with a line per node; after
it, an epoch on either node reads nothing from storage; a peer that is gone is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from conftest import Mount, drop_caches, run_cli
from test_peer_batches import owned_by
from test_peers import cluster, copies, force_unmount, free_port, read_files, reads

from coordlfs.peers.wire import (
    WARM_HEADER,
    WARM_PATH,
    Fail,
    FrameStream,
    Kind,
    Warm,
    client_handshake,
    decode_fail,
    decode_warm_reply,
)

#: Seconds a warm of these small datasets may take, at most.
WARM_S = 120


def warm(m: Mount, *args: str) -> tuple[int, dict[str, Any]]:
    result = run_cli("warm", "--json", str(m.mountpoint), *args, timeout=WARM_S)
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout)


def test_each_node_warms_its_share_and_all_nodes_asks_the_peer(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 2, files=160)
    ports = [free_port(), free_port()]
    a, b = cluster(mount, roots, "--insecure", "--cache-size", "64M", ports=ports)
    names = sorted(p.relative_to(roots[0]).as_posix() for p in roots[0].rglob("*")
                   if p.is_file())  # the dataset's files and its manifest
    mine, theirs = owned_by(names, ports, 0), owned_by(names, ports, 1)
    assert mine and theirs

    code, summary = warm(a)
    assert code == 0
    assert summary["files"] == len(mine) and summary["elsewhere"] == len(theirs)
    assert summary["nodes"] == {}
    assert a.status()["cache"]["files"] == len(mine)
    assert b.status()["cache"]["files"] == 0  # A left B's share to B
    assert reads(a)["bytes_from_source"] == sum((roots[0] / n).stat().st_size for n in mine)

    code, summary = warm(a, "--all-nodes")
    assert code == 0
    assert summary["files"] == 0 and summary["already_cached"]["files"] == len(mine)
    peer = summary["nodes"][f"127.0.0.1:{ports[1]}"]
    assert peer["files"] == len(theirs)
    assert peer["bytes"] == sum((roots[0] / n).stat().st_size for n in theirs)
    assert peer["failed"] == 0 and peer["did_not_fit"]["files"] == 0
    assert b.status()["cache"]["files"] == len(theirs)
    assert reads(b)["bytes_from_source"] == peer["bytes"]

    result = run_cli("warm", str(a.mountpoint), "--all-nodes", timeout=WARM_S)
    assert result.returncode == 0, result.stderr
    assert f"node 127.0.0.1:{ports[1]}: 0 files (0 B) read into the cache, {len(theirs)}" \
        in result.stdout

    drop_caches()  # an epoch on each node: every file from a cache, none from storage
    stored = [reads(m)["bytes_from_source"] for m in (a, b)]
    for m in (a, b):
        read_files(m.mountpoint, names)
    assert [reads(m)["bytes_from_source"] for m in (a, b)] == stored
    assert sum(sizes[n] for n in theirs if n in sizes) <= reads(a)["bytes_from_peers"]

    force_unmount(b.mountpoint, b.pid)  # the peer is gone: its part fails in one line
    result = run_cli("warm", str(a.mountpoint), "--all-nodes", timeout=WARM_S)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("node ")]
    assert len(lines) == 1 and lines[0].startswith(f"node 127.0.0.1:{ports[1]}: cannot "
                                                   "connect"), result.stdout
    assert "Traceback" not in result.stderr


async def _strange_warms(port: int) -> list[tuple[Kind, int]]:
    """WARMs a stranger could send: before the handshake, then authenticated (the mount is
    --insecure) with a path out of the dataset, unknown flags, a lying count; then a good
    one. Returns each reply's kind and code (the good one's: taken files)."""
    seen = []
    frames = FrameStream(await trio.open_tcp_stream("127.0.0.1", port))
    await frames.receive()  # HELLO
    await frames.send(Kind.WARM, 1, Warm(1, (b"a",)).encode())
    reply = await frames.receive()
    assert reply is not None
    seen.append((reply.kind, decode_fail(reply.payload)[0]))
    await frames.aclose()
    frames = FrameStream(await trio.open_tcp_stream("127.0.0.1", port))
    await client_handshake(frames, b"")
    await frames.receive()  # the features
    bad = (WARM_HEADER.pack(2, 0, 1) + WARM_PATH.pack(9) + b"../secret",
           WARM_HEADER.pack(2, 8, 0), WARM_HEADER.pack(2, 0, 5) + WARM_PATH.pack(1) + b"a")
    for i, payload in enumerate([*bad, Warm(2, (b"class0",)).encode()], 2):
        await frames.send(Kind.WARM, i, payload)
        reply = await frames.receive()
        assert reply is not None and reply.request_id == i
        seen.append((reply.kind, decode_fail(reply.payload)[0] if reply.kind == Kind.FAIL
                     else decode_warm_reply(reply.payload)[0]))
    await frames.aclose()
    return seen


def test_strange_warms_are_refused_and_the_mount_stays_up(mount, tmp_path: Path) -> None:
    roots, _sizes = copies(tmp_path, 1, files=20)
    port = free_port()
    (a,) = cluster(mount, [*roots, roots[0]], "--insecure", ports=[port, free_port()], start=1)
    refused = (Kind.FAIL, Fail.REFUSED)
    assert trio.run(_strange_warms, port) == [refused] * 4 + [(Kind.DATA, 1)]
    assert a.status()["served"]["refused"] >= 4
    assert (a.mountpoint / "class0").is_dir()  # the mount serves on
