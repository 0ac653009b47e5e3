"""coordlfs bench epochs: its arithmetic, and one small real run checked by its counters."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchtools import BENCH, small_run, stopped_by_sigterm

from coordlfs.bench.children import batch_paths
from coordlfs.bench.epochs import (
    READAHEAD_BYTES,
    ConfigResult,
    EpochResult,
    Sizing,
    budget_bytes,
    cache_size_for,
    in_flight_bytes,
    measure_sizing,
    parse_stacks,
    pinned_files,
    program,
    summarize,
)
from coordlfs.bench.harness import (
    parse_make,
)
from coordlfs.errors import UserError
from coordlfs.source.source import READ_CHUNK
from coordlfs.system.mounts import mount_at
from coordlfs.testbed.dataset import Dataset, DatasetSpec, ensure_dataset
from coordlfs.testbed.mounts import Mount


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


SIZING = Sizing(itself_bytes=20_000_000, per_inode_bytes=1200, per_cached_file_bytes=1400,
                reader_bytes=1_000_000, client_reader_bytes=3_000_000, uncached_file_bytes=600,
                source_metadata_bytes=500_000, in_flight_bytes=250_000)


def test_cache_size_leaves_room_for_the_daemon_its_files_and_pages_in_flight() -> None:
    files = tuple((f"f{i}", 100_000) for i in range(1000))  # 25 pages, 102,400 B each
    dataset = Dataset(Path("/x"), DatasetSpec(1000), files, reused=True)
    budget = 70_000_000
    size = cache_size_for(budget, dataset, SIZING, readers=1)
    room = budget - 20_000_000 - 250_000 - 1_000_000 - 1000 * (1200 + 600) - 500_000
    assert size == int(room / (1 + (1400 - 600) / 102_400))
    # the files the cache holds each with its own records, the others each their page tree:
    # the budget to within a file's share of the difference
    held = size // 102_400
    used = (budget - room - 1000 * 600) + size + held * 1400 + (1000 - held) * 600
    assert used <= budget < used + 800
    assert cache_size_for(budget, dataset, SIZING, readers=2) < size
    # a client's readers get what such a reader was measured to hold instead
    big = 4 * budget
    assert cache_size_for(big, dataset, SIZING, readers=1, client=True) == int(
        (big - 20_000_000 - 250_000 - 3_000_000 - 1000 * (1200 + 600) - 500_000)
        / (1 + (1400 - 600) / 102_400))
    assert cache_size_for(1000, dataset, SIZING, readers=1) == 0


def test_pinning_takes_the_bytes_the_cache_holds_in_name_order() -> None:
    files = (("b", 5000), ("a", 4096), ("c", 1))
    dataset = Dataset(Path("/x"), DatasetSpec(3), files, reused=True)
    assert pinned_files(dataset, 4096 + 8192) == ["a", "b"]
    assert pinned_files(dataset, 4096 + 8191) == ["a"]


def test_batches_follow_the_order() -> None:
    batches = batch_paths(["a", "b", "c"], Path("/m"), 2)
    assert batches == [["/m/a", "/m/b"], ["/m/c"]]


def _result(system: str, seconds: list[float], stored: list[int]) -> ConfigResult:
    epochs = [EpochResult(i + 1, s, b, b / 100, 1.0, 0.0)
              for i, (s, b) in enumerate(zip(seconds, stored, strict=True))]
    return ConfigResult(system, epochs, [])


def _runs(*rows: dict[str, tuple[list[float], list[int]]]) -> list[dict[str, ConfigResult]]:
    return [{key: _result(key, *figures) for key, figures in row.items()} for row in rows]


def test_summary_is_page_cache_over_coordlfs_after_the_first_epoch() -> None:
    runs = _runs({"page_cache": ([9, 8, 8], [100, 80, 80]), "coordlfs": ([9, 4, 4], [100, 50, 50])},
                 {"page_cache": ([9, 6, 6], [100, 90, 90]), "coordlfs": ([9, 4, 4], [100, 50, 50])},
                 {"page_cache": ([9, 10, 10], [100, 70, 70]),
                  "coordlfs": ([9, 4, 4], [100, 50, 50])})
    summary = summarize(runs)
    assert summary["storage_bytes_ratio"] == 1.6
    assert summary["epoch_time_ratio"] == 2.0
    assert summary["storage_bytes_ratio_runs"] == [1.6, 1.8, 1.4]
    assert summary["coordlfs_storage_fraction"] == 0.5
    assert "client_epoch_time_ratio" not in summary  # runs without the client
    assert "vs_pinning_storage_bytes_ratio" not in summary  # nor pinning


def test_summary_has_pinning_the_client_and_run_beside_the_mount() -> None:
    runs = _runs({"page_cache": ([9, 8, 8], [100, 80, 80]),
                  "pinning": ([9, 5, 5], [100, 60, 60]),
                  "coordlfs": ([9, 4, 4], [100, 50, 50]),
                  "run": ([9, 2, 2], [100, 50, 50]),
                  "client": ([3, 2, 2], [100, 40, 40])}) * 2
    summary = summarize(runs)
    assert summary["epoch_time_ratio"] == 2.0 and summary["first_epoch_time_ratio"] == 1.0
    assert summary["vs_pinning_storage_bytes_ratio"] == 1.2
    assert summary["vs_pinning_epoch_time_ratio"] == 1.25
    assert summary["run_epoch_time_ratio"] == 4.0
    assert summary["run_vs_pinning_epoch_time_ratio"] == 2.5
    assert summary["client_epoch_time_ratio"] == 4.0
    assert summary["client_first_epoch_time_ratio"] == 3.0
    assert summary["client_storage_bytes_ratio"] == 2.0
    assert summary["client_storage_fraction"] == 0.4
    assert summary["pinning_storage_fraction"] == 0.6


def test_a_stack_that_failed_is_kept_with_why_and_left_out_of_the_ratios() -> None:
    runs = _runs({"page_cache": ([9, 8, 8], [100, 80, 80]), "coordlfs": ([9, 4, 4], [100, 50, 50])})
    runs[0]["juicefs"] = ConfigResult("juicefs", [], [], failed="n/a: not installed")
    runs[0]["pinning"] = ConfigResult("pinning", [], [], failed="killed for memory (1 OOM kill)")
    summary = summarize(runs)
    assert summary["juicefs_failed"] == ["n/a: not installed"]
    assert summary["pinning_failed"] == ["killed for memory (1 OOM kill)"]
    assert "vs_pinning_storage_bytes_ratio" not in summary
    assert summary["storage_bytes_ratio"] == 1.6


def test_small_run_end_to_end(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Everything fits in the budget: after the first epoch neither side reads storage."""
    daemon_logs.append(tmp_path / "work")
    report = small_run("epochs", tmp_path / "work", tmp_path / "epochs.json", "--make", "300:64K",
                       "--budget", "256M", "--throttle", "none", "--epochs", "2",
                       "--readers", "2", "--plot", str(tmp_path / "epochs.png"))
    total = report["dataset"]["bytes"]
    run = report["runs"][0]
    for system in ("page_cache", "pinning", "coordlfs", "run", "client"):
        first, second = run[system]["epochs"]
        assert first["storage_bytes"] >= total * 0.99 or system == "pinning"  # read to pin
        # each coordlfs stack's epoch ends once its fills have (``after_epoch``): the next
        # epoch never reads a file again while its backfill drops its pages
        assert second["storage_bytes"] <= total * 0.01, system
    assert run["coordlfs"]["cache_capacity_bytes"] >= total
    for peer in ("juicefs", "rclone"):  # installed: ran, or a row that says why not
        if program(peer) is None:
            assert run[peer]["failed"] == "n/a: not installed" and not run[peer]["epochs"]
        else:
            assert run[peer]["failed"] or len(run[peer]["epochs"]) == 2
    assert set(report["summary"]) >= {"storage_bytes_ratio", "epoch_time_ratio",
                                      "client_epoch_time_ratio", "client_first_epoch_time_ratio",
                                      "client_storage_bytes_ratio", "client_storage_fraction"}
    assert {"vs_pinning_storage_bytes_ratio", "vs_pinning_epoch_time_ratio"} <= set(
        report["summary"])
    # the split is the probe mount's status, as ``coordlfs stats`` states it
    probe = (tmp_path / "work" / "probe.log").read_text()
    assert "mounted on" in probe
    assert set(report["sizing"]) == {"itself_bytes", "per_inode_bytes", "per_cached_file_bytes",
                                     "reader_bytes", "client_reader_bytes",
                                     "uncached_file_bytes", "source_metadata_bytes",
                                     "in_flight_bytes"}
    assert 5 << 20 < report["sizing"]["itself_bytes"] < 200 << 20
    assert (tmp_path / "epochs.png").read_bytes()[:4] == b"\x89PNG"
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    assert not list(Path("/sys/fs/cgroup/memory").rglob("coordlfs-epochs-*"))


def test_sigterm_cleans_up_like_ctrl_c(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Stopped by SIGTERM mid-run (as a scheduler stops it): cgroups, throttle and mount go."""
    work = tmp_path / "work"
    daemon_logs.append(work)
    with stopped_by_sigterm(
            [*BENCH, "epochs", "--make", "600:64K", "--work", str(work), "--budget", "96M",
             "--readers", "2", "--throttle", "20M", "--epochs", "5"]) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "coordlfs   epoch 1" in line:  # mounted, readers in the throttled cgroup
                break
    assert mount_at(str(work / "mnt")) is None
    for controller in ("memory", "blkio"):
        assert not list(Path("/sys/fs/cgroup", controller).glob(f"coordlfs-epochs-{proc.pid}*"))
    assert not list(Path("/dev/shm").glob(f"coordlfs-testbed-{proc.pid}-*"))


def test_the_split_is_the_probe_mounts_measured_status(tmp_path: Path, monkeypatch,
                                                       daemon_logs: list[Path]) -> None:
    """The figures the budget is split by are those the probe mount's status gave after it
    looked up every file and cached some: what ``coordlfs stats`` states, not constants."""
    daemon_logs.append(tmp_path / "probe.log")
    dataset = ensure_dataset(tmp_path / "data", DatasetSpec(300, mean_bytes=20_000))
    seen: list[dict] = []
    settled = Mount.settled

    def recording(mount: Mount, seconds: float = 60.0) -> dict:
        seen.append(status := settled(mount, seconds))
        return status

    monkeypatch.setattr(Mount, "settled", recording)
    sizing = measure_sizing(dataset, tmp_path)
    (status,) = seen
    assert status["inodes"] >= 300 and status["cache"]["files"] == 256
    memory = status["memory"]
    assert (sizing.itself_bytes, sizing.per_inode_bytes, sizing.per_cached_file_bytes) == (
        memory["itself_bytes"], memory["per_inode_bytes"], memory["per_cached_file_bytes"])
    # a reader's own memory (what its read buffer took of these files), through the client
    # too: some, and less than the 16 MiB margin the client's replaced
    assert 0 < sizing.reader_bytes < 16 << 20
    assert 0 < sizing.client_reader_bytes < 16 << 20
    # the source's blocks the lookups read (the caches dropped first), and one file in flight
    # with the daemon's buffer filling it
    assert 0 < sizing.source_metadata_bytes < 16 << 20
    assert sizing.in_flight_bytes == in_flight_bytes(dataset) > READAHEAD_BYTES + READ_CHUNK
    assert mount_at(str(tmp_path / "mnt")) is None


def test_stacks_are_chosen_by_their_json_names() -> None:
    assert parse_stacks("run, page_cache") == ("page_cache", "run")  # in the order they run
    for bad in ("", "mount", "page_cache,tmpfs"):
        with pytest.raises(UserError, match="bad --stacks"):
            parse_stacks(bad)
