"""coordlfs bench epochs: its arithmetic, and one small real run checked by its counters."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchtools import BENCH, small_run, stopped_by_sigterm

from coordlfs.bench.children import batch_paths
from coordlfs.bench.epochs import (
    ConfigResult,
    EpochResult,
    budget_bytes,
    cache_size_for,
    summarize,
)
from coordlfs.bench.harness import (
    CLIENT_HEADROOM_PER_READER,
    DAEMON_BASE_BYTES,
    MOUNT_BYTES_PER_FILE,
    PAGE_HEADROOM_PER_READER,
    parse_make,
)
from coordlfs.errors import UserError
from coordlfs.system.mounts import mount_at
from coordlfs.testbed.dataset import Dataset, DatasetSpec


def test_budget_as_fraction_or_bytes() -> None:
    assert budget_bytes("0.5", 1000) == 500
    assert budget_bytes("1", 1000) == 1000
    assert budget_bytes("64M", 1000) == 64 << 20
    assert budget_bytes("4096", 1000) == 4096
    for bad in ("0", "-0.5", "1.5", "lots"):
        with pytest.raises(UserError):
            budget_bytes(bad, 1000)


def test_parse_make() -> None:
    assert parse_make("100:110K") == DatasetSpec(100, mean_bytes=110 << 10, sigma=0.6)
    assert parse_make("8:128M").sigma == 0  # shards: equal sizes
    for bad in ("x:1K", "0:1K", "5:huge"):
        with pytest.raises(UserError):
            parse_make(bad)


def test_cache_size_leaves_room_for_the_daemon_and_pages_in_flight() -> None:
    files = tuple((f"f{i}", 100_000) for i in range(1000))
    dataset = Dataset(Path("/x"), DatasetSpec(1000), files, reused=True)
    budget = 70_000_000
    size = cache_size_for(budget, dataset, readers_memory=1_000_000, readers=1)
    assert size == (budget - 1_000_000 - DAEMON_BASE_BYTES - PAGE_HEADROOM_PER_READER
                    - 1000 * MOUNT_BYTES_PER_FILE)
    assert cache_size_for(budget, dataset, 1_000_000, readers=2) < size
    # a client's readers get more room each: the bytes they copy out, their misses' pages
    big = 4 * budget
    assert cache_size_for(big, dataset, 1_000_000, readers=1, client=True) == (
        cache_size_for(big, dataset, 1_000_000, readers=1) - CLIENT_HEADROOM_PER_READER)
    assert cache_size_for(1000, dataset, 0, readers=1) == 0


def test_batches_follow_the_order() -> None:
    batches = batch_paths(["a", "b", "c"], Path("/m"), 2)
    assert batches == [["/m/a", "/m/b"], ["/m/c"]]


def _result(system: str, seconds: list[float], stored: list[int]) -> ConfigResult:
    epochs = [EpochResult(i + 1, s, b, b / 100, 1.0, 0.0)
              for i, (s, b) in enumerate(zip(seconds, stored, strict=True))]
    return ConfigResult(system, epochs, [])


def test_summary_is_page_cache_over_coordlfs_after_the_first_epoch() -> None:
    runs = [(_result("page cache", [9, 8, 8], [100, 80, 80]),
             _result("coordlfs", [9, 4, 4], [100, 50, 50])),
            (_result("page cache", [9, 6, 6], [100, 90, 90]),
             _result("coordlfs", [9, 4, 4], [100, 50, 50])),
            (_result("page cache", [9, 10, 10], [100, 70, 70]),
             _result("coordlfs", [9, 4, 4], [100, 50, 50]))]
    summary = summarize(runs)
    assert summary["storage_bytes_ratio"] == 1.6
    assert summary["epoch_time_ratio"] == 2.0
    assert summary["storage_bytes_ratio_runs"] == [1.6, 1.8, 1.4]
    assert summary["coordlfs_storage_fraction"] == 0.5
    assert "client_epoch_time_ratio" not in summary  # runs without the client


def test_summary_has_the_client_beside_the_mount() -> None:
    runs = [(_result("page cache", [9, 8, 8], [100, 80, 80]),
             _result("coordlfs", [9, 4, 4], [100, 50, 50]),
             _result("client", [3, 2, 2], [100, 40, 40]))] * 2
    summary = summarize(runs)
    assert summary["epoch_time_ratio"] == 2.0 and summary["first_epoch_time_ratio"] == 1.0
    assert summary["client_epoch_time_ratio"] == 4.0
    assert summary["client_first_epoch_time_ratio"] == 3.0
    assert summary["client_storage_bytes_ratio"] == 2.0
    assert summary["client_storage_fraction"] == 0.4


def test_small_run_end_to_end(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Everything fits in the budget: after the first epoch neither side reads storage."""
    daemon_logs.append(tmp_path / "work")
    report = small_run("epochs", tmp_path / "work", tmp_path / "epochs.json", "--make", "300:64K",
                       "--budget", "256M", "--throttle", "none", "--epochs", "2",
                       "--readers", "2", "--plot", str(tmp_path / "epochs.png"))
    total = report["dataset"]["bytes"]
    run = report["runs"][0]
    for system in ("page_cache", "coordlfs", "client"):
        first, second = run[system]["epochs"]
        assert first["storage_bytes"] >= total * 0.99
        assert second["storage_bytes"] <= total * 0.01
    assert run["coordlfs"]["cache_capacity_bytes"] >= total
    assert set(report["summary"]) >= {"storage_bytes_ratio", "epoch_time_ratio",
                                      "client_epoch_time_ratio", "client_first_epoch_time_ratio",
                                      "client_storage_bytes_ratio", "client_storage_fraction"}
    assert (tmp_path / "epochs.png").read_bytes()[:4] == b"\x89PNG"
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    assert not list(Path("/sys/fs/cgroup/memory").rglob("coordlfs-epochs-*"))


def test_sigterm_cleans_up_like_ctrl_c(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Stopped by SIGTERM mid-run (as a scheduler stops it): cgroups, throttle and mount go."""
    work = tmp_path / "work"
    daemon_logs.append(work)
    with stopped_by_sigterm(
            [*BENCH, "epochs", "--make", "600:64K", "--work", str(work), "--budget", "48M",
             "--readers", "2", "--throttle", "20M", "--epochs", "5"]) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "coordlfs   epoch 1" in line:  # mounted, readers in the throttled cgroup
                break
    assert mount_at(str(work / "mnt")) is None
    for controller in ("memory", "blkio"):
        assert not list(Path("/sys/fs/cgroup", controller).glob(f"coordlfs-epochs-{proc.pid}*"))
    assert not list(Path("/dev/shm").glob(f"coordlfs-testbed-{proc.pid}-*"))
