"""``coordlfs bench nodes``: four real mounts peering on loopback read 50 files twice each;
the counters of one small run, and bad options as one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from benchtools import assert_one_line_errors, small_run

from coordlfs.fs.lane_peers import POOL

#: connections one node holds to (and from) each other node at most: its link, and the request
#: lane's own pool (coordlfs.fs.lane_peers), within --peer-connections
PER_PEER = 1 + POOL

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                reason="needs root and /dev/fuse")


def test_four_nodes_read_storage_once_in_all(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Every file comes from storage once across the nodes in the first epoch, never
    after; each node holds one connection to and from each
    other node it asked or was asked by, and its request lane's; every mount is gone
    afterwards."""
    work = tmp_path / "work"
    daemon_logs.append(work)
    # a peer slower than its timeout on a busy machine would send a reader to storage: this
    # test is about where files come from, not about timeouts
    report = small_run("nodes", work, tmp_path / "nodes.json", "--nodes", "2,4", "--make",
                       "50:16K", "--readers", "2", "--peer-timeout", "60")
    rows = {r["nodes"]: r for r in report["rows"]}
    assert set(rows) == {2, 4}
    for n, row in rows.items():
        assert row["source_bytes_epoch1_vs_dataset"] == 1.0
        assert row["source_bytes_after_epoch1"] == 0 and row["peer_failures"] == 0
        # the kernel's count adds the metadata read again after another process dropped the
        # page cache (the suite's benchmarks do): only the data's part is exact
        assert row["storage_epoch1_vs_blocks"] >= 1.0
        assert row["peer_bytes_last_epoch_vs_dataset"] == pytest.approx(n - 1, abs=0.01)
        assert row["inbound_per_node_max"] <= (n - 1) * PER_PEER
        assert row["outbound_per_node_max"] <= (n - 1) * PER_PEER
        assert row["rss_mib_per_node_median"] > 0
        assert report["summary"][f"connections_per_node_max_{n}"] > 0
    assert not [line for line in Path("/proc/mounts").read_text().splitlines()
                if str(work) in line]


def test_one_node_among_simulated_ones_keeps_its_sockets_within_the_bound(
        tmp_path: Path, daemon_logs: list[Path]) -> None:
    """One real mount among 7 simulated nodes: unbounded it holds a socket each way per node
    it asked or was asked by (and its lane's own to those it asks); with --peer-connections
    2, never more than 2 each way, closing idle ones for room; every request is served either
    way (or, bounded, turned away while every connection was busy)."""
    work = tmp_path / "work"
    daemon_logs.append(work)
    report = small_run("nodes", work, tmp_path / "nodes.json", "--nodes", "none",
                       "--simulated", "8", "--limits", "512,2", "--make", "50:16K",
                       "--readers", "2", "--peer-timeout", "60")
    unbounded, bounded = report["simulated"]
    assert (unbounded["peer_connections"], bounded["peer_connections"]) == (512, 2)
    # (the simulated nodes have no lane: inbound, one link each)
    assert unbounded["inbound_max"] <= 7 and unbounded["outbound_max"] <= 7 * PER_PEER
    assert unbounded["links_evicted"] == unbounded["served_evicted"] == 0
    assert bounded["inbound_max"] <= 2 + (bounded["turned_away"] > 0)
    assert bounded["outbound_max"] <= 2 and bounded["links_evicted"] > 0
    for row in (unbounded, bounded):
        assert row["peer_failures"] == row["simulated_failures"] == 0
        assert row["simulated_asked"] == row["simulated_served"] + \
            row["simulated_turned_away"] > 0
    assert report["summary"]["simulated_sockets_max_8_2"] <= 5
    assert not [line for line in Path("/proc/mounts").read_text().splitlines()
                if str(work) in line]


def test_bad_options_are_one_line_errors(tmp_path: Path) -> None:
    assert_one_line_errors("nodes", tmp_path, ["--nodes", "1"], ["--nodes", "4,x"],
                           ["--readers", "0"], ["--cache-share", "0"], ["--nodes", "none"],
                           ["--simulated", "8", "--limits", "0"])
