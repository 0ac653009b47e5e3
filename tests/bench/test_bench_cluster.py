"""coordlfs bench cluster: its arithmetic, and one small real run checked by its counters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from coordlfs.bench.cluster import NodeEpoch, SystemResult, summarize


def _result(system: str, storage: list[int], seconds: list[float]) -> SystemResult:
    epochs = [[NodeEpoch(s, 0.0, b // 2, 0), NodeEpoch(s / 2, 0.0, b - b // 2, 0)]
              for b, s in zip(storage, seconds, strict=True)]
    return SystemResult(system, epochs, 100)


def test_summary_is_the_cache_alone_over_peers_after_the_first_epoch() -> None:
    runs = [{"page cache": _result("page cache", [100, 90, 90], [10, 9, 9]),
             "cache": _result("cache", [100, 50, 50], [10, 6, 6]),
             "cache+peers": _result("cache+peers", [100, 10, 10], [10, 2, 2])}]
    summary = summarize(runs)
    assert summary["storage_bytes_ratio"] == 5.0
    assert summary["epoch_time_ratio"] == 3.0  # the slowest node's epoch counts
    assert summary["page_cache_epoch_time_ratio"] == 4.5
    assert summary["peers_storage_bytes_after_first_epoch"] == [20]
    zero = [{**runs[0], "cache+peers": _result("cache+peers", [100, 0, 0], [10, 2, 2])}]
    assert summarize(zero)["storage_bytes_ratio"] is None  # no storage reads: no finite ratio


#: the size of small_run's files
FILE = 64 << 10


def no_file_from_storage(nodes: list[dict]) -> bool:
    """Whether an epoch's nodes read no file's bytes from storage (the mounts' own count),
    and less than a file in all: the source's metadata this machine's reclaim took since the
    last epoch is read again (docs/design/testing.md: 4,096 bytes in one CI run)."""
    return (sum(n["data_bytes"] for n in nodes) == 0
            and sum(n["storage_bytes"] for n in nodes) < FILE)


def small_run(tmp_path: Path, daemon_logs: list[Path], *options: str) -> dict:
    """Two nodes, 300 files of 64 KB, each node caching 60%, two epochs: the JSON report."""
    daemon_logs.append(tmp_path / "work")
    out = tmp_path / "cluster.json"
    result = subprocess.run(
        [sys.executable, "-m", "coordlfs", "bench", "cluster", "--make", "300:64K",
         "--work", str(tmp_path / "work"), "--nodes", "2", "--cache", "0.6", "--throttle",
         "none", "--link", "1gbit", "--epochs", "2", "--readers", "2", "--no-throughput",
         *options, "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


def test_small_run_end_to_end(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Two nodes each caching 60%: with peers the second epoch reads no file from storage."""
    report = small_run(tmp_path, daemon_logs)
    total = report["dataset"]["bytes"]
    systems = report["runs"][0]
    assert set(systems) == {"page cache", "cache", "cache+peers"}
    peers = systems["cache+peers"]["epochs"]
    # one machine's page cache under both nodes: what one read, the other may copy from it
    assert sum(n["storage_bytes"] + n["memory_bytes"] for n in peers[0]) >= total * 0.99
    assert no_file_from_storage(peers[1])
    assert sum(n["peer_bytes"] for n in peers[1]) > 0
    alone = systems["cache"]["epochs"]
    assert sum(n["storage_bytes"] for n in alone[1]) > 0  # each node misses the other's half
    assert report["summary"]["peers_storage_bytes_after_first_epoch"][0] < FILE
    assert all(n["cpu_seconds"] > 0 for n in peers[1])
    assert report["summary"]["peers_cpu_seconds_after_first_epoch"][0] > 0


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    for args in (["--nodes", "0"], ["--cache", "2"], ["--link", "fast"], ["--nodes", "x"]):
        result = subprocess.run([sys.executable, "-m", "coordlfs", "bench", "cluster",
                                 "--work", str(tmp_path), *args],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode != 0
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_small_run_with_the_order_handed_over(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Each mount told its node's order before each epoch: the files the other node caches
    come ahead in batches, and a reader's miss finds them held."""
    report = small_run(tmp_path, daemon_logs, "--order-handed-over")
    assert report["settings"]["order_handed_over"] is True
    peers = report["runs"][0]["cache+peers"]
    assert no_file_from_storage(peers["epochs"][1])
    nodes = peers["peer_counters"]
    assert len(nodes) == 2 and all(n["served_batches"] > 0 for n in nodes)
    assert sum(n["held"]["hits"] for n in nodes) > 0
    assert all(n["held"]["reserved_bytes"] <= n["held"]["capacity_bytes"] for n in nodes)
    assert report["runs"][0]["cache"]["peer_counters"] == []
    assert "epoch_time_ratio" in report["summary"]


def test_small_run_through_the_client(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Each node's readers read through ``coordlfs.client``, the order handed over with
    ``Dataset.prefetch``: the other node's files come through the holding area, and every
    file's bytes arrive (the bench checks each node's bytes per epoch)."""
    report = small_run(tmp_path, daemon_logs, "--client")
    assert report["settings"]["client"] is True
    assert report["settings"]["order_handed_over"] is False  # implied, not set
    peers = report["runs"][0]["cache+peers"]
    assert no_file_from_storage(peers["epochs"][1])
    assert sum(n["peer_bytes"] for n in peers["epochs"][1]) > 0
    assert sum(n["held"]["hits"] for n in peers["peer_counters"]) > 0
    assert "epoch_time_ratio" in report["summary"]
