"""``coordlfs warm`` on a cluster (issue 25, item 3): two real mounts peering on loopback.
Each node warms only its own share of the placement; ``--all-nodes`` asks the peer to warm
its share too (WARM frames over the authenticated peer link), with a line per node; after
it, an epoch on either node reads nothing from storage; a peer that is gone is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import Mount, drop_caches, run_cli
from test_peer_batches import owned_by
from test_peers import cluster, copies, force_unmount, free_port, read_files, reads

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
    assert reads(a)["files_from_source"] == len(mine)

    code, summary = warm(a, "--all-nodes")
    assert code == 0
    assert summary["files"] == 0 and summary["already_cached"]["files"] == len(mine)
    peer = summary["nodes"][f"127.0.0.1:{ports[1]}"]
    assert peer["files"] == len(theirs)
    assert peer["bytes"] == sum((roots[0] / n).stat().st_size for n in theirs)
    assert peer["failed"] == 0 and peer["did_not_fit"]["files"] == 0
    assert b.status()["cache"]["files"] == len(theirs)
    assert reads(b)["files_from_source"] == len(theirs)

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
