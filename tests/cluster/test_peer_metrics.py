"""``--metrics`` of two real mounts on loopback that serve each other's misses: the per-peer
series (state, bytes, files, failures) and the served ones are the peers' status, and a
peer taken down shows as down with its failures counted."""

from __future__ import annotations

from pathlib import Path

from conftest import drop_caches, force_unmount
from test_peers import copies, free_port, read_files, source_digests

from coordlfs.testbed.scrape import Samples, scrape, value


def peer_series(samples: Samples, peer: str, link: dict) -> dict[str, tuple[float, float]]:
    """Each per-peer counter of a scrape beside the link's status."""
    return {key: (value(samples, f"coordlfs_peer_{name}_total", peer=peer), link[key])
            for key, name in (("bytes", "read_bytes"), ("files", "read_files"),
                              ("requests", "requests"), ("misses", "misses"),
                              ("stale", "stale"), ("failures", "failures"))}


def test_per_peer_series_follow_the_links(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 2, files=60)
    ports, metrics = [free_port() for _ in roots], [free_port() for _ in roots]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    a, b = (mount(root, "--listen", f"127.0.0.1:{port}", "--peers", peers, "--insecure",
                  "--cache-size", "64M", "--metrics", f"127.0.0.1:{scraped}")
            for root, port, scraped in zip(roots, ports, metrics, strict=True))
    names = sorted(sizes)
    want = source_digests(roots[0], sizes)
    assert read_files(a.mountpoint, names) == want
    drop_caches()
    assert read_files(b.mountpoint, names) == want
    b_address = f"127.0.0.1:{ports[1]}"

    samples, status = scrape(metrics[0]), a.status()
    link = status["peers"]["links"][b_address]
    assert link["state"] == "up" and link["bytes"] > 0 and link["failures"] == 0
    assert value(samples, "coordlfs_peer_state", peer=b_address, state="up") == 1
    assert value(samples, "coordlfs_peer_state", peer=b_address, state="down") == 0
    assert value(samples, "coordlfs_peer_state", peer=b_address, state="idle") == 0
    assert all(got == want for got, want in peer_series(samples, b_address, link).values())
    assert value(samples, "coordlfs_read_bytes_total", **{"from": "peers"}) == \
        status["reads"]["bytes_from_peers"]
    assert value(samples, "coordlfs_peer_nodes") == 2
    assert any(name == "coordlfs_info" and ("node", f"127.0.0.1:{ports[0]}") in labels
               for name, labels in samples)
    served = scrape(metrics[1])
    assert value(served, "coordlfs_served_bytes_total") == b.status()["served"]["bytes"] == \
        link["bytes"]

    force_unmount(b.mountpoint, b.pid)  # b goes away: a's next miss for b's files fails
    drop_caches()
    mine = {n for n in names if a.control.request("peer.owner", path=n)["here"]}
    theirs = sorted(set(names) - mine)
    assert read_files(a.mountpoint, theirs[:1]) == {theirs[0]: want[theirs[0]]}
    samples, link = scrape(metrics[0]), a.status()["peers"]["links"][b_address]
    assert link["state"] == "down" and link["failures"] >= 1
    assert value(samples, "coordlfs_peer_state", peer=b_address, state="down") == 1
    assert value(samples, "coordlfs_peer_state", peer=b_address, state="up") == 0
    assert value(samples, "coordlfs_peer_retry_in_seconds", peer=b_address) > 0
    assert all(got == want for got, want in peer_series(samples, b_address, link).values())
