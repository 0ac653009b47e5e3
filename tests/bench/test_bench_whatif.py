"""coordlfs bench whatif: one small real run (the report's keys, not its seconds), its
summary's arithmetic, and bad options as one-line errors."""

from __future__ import annotations

from pathlib import Path

from benchtools import assert_one_line_errors, small_run

from coordlfs.bench.epochs import ConfigResult, EpochResult
from coordlfs.bench.whatif import steady_seconds, summarize


def _cgroups() -> set[Path]:
    return set(Path("/sys/fs/cgroup/memory").rglob("coordlfs-epochs-*"))


def test_small_run_end_to_end(tmp_path: Path, daemon_logs: list[Path]) -> None:
    daemon_logs.append(tmp_path / "work")
    before = _cgroups()  # another benchmark's, running beside this test
    report = small_run("whatif", tmp_path / "work", tmp_path / "whatif.json", "--make",
                       "200:50K", "--readers", "2", "--budget", "70M", "--budgets", "66M,74M",
                       "--throttle", "none", "--epochs", "2")
    assert set(report) == {"dataset", "settings", "budgets", "runs", "summary"}
    assert report["budgets"] == ["66M", "74M"]
    run = report["runs"][0]
    calibration = run["calibration"]
    assert {"budget_bytes", "cache_capacity_bytes", "epochs", "analysis"} <= set(calibration)
    analysis = calibration["analysis"]
    assert [e["name"] for e in analysis["epochs"]] == ["epoch-1 .. epoch-2", "epoch-2 .. end"]
    assert analysis["rates"]["compute_s"] is not None  # the profile reported each epoch
    assert analysis["recommendation"]
    assert [r["budget_text"] for r in run["rows"]] == ["66M", "74M"]
    for row in run["rows"]:
        assert {"predicted_s", "measured_s", "error_percent", "predicted_cache_bytes",
                "measured_cache_bytes", "measured_epochs_s"} <= set(row)
        assert row["predicted_cache_bytes"] > 0 and len(row["measured_epochs_s"]) == 2
    assert set(report["summary"]) == {"budgets", "max_abs_error_percent", "goal_percent",
                                      "within_goal"}
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    assert _cgroups() <= before


def test_summary_takes_medians_per_budget() -> None:
    def row(predicted: float, measured: float) -> dict:
        return {"predicted_s": predicted, "measured_s": measured,
                "error_percent": round(100 * (predicted - measured) / measured, 1)}

    runs = [{"rows": [row(9, 10), row(5, 4)]}, {"rows": [row(11, 10), row(5, 5)]},
            {"rows": [row(10, 10), row(6, 5)]}]
    summary = summarize(runs, ["0.25", "0.75"])
    assert summary["budgets"]["0.25"] == {"predicted_s": 10, "measured_s": 10,
                                          "error_percent": 0.0}
    assert summary["budgets"]["0.75"]["error_percent"] == 20.0
    assert summary["max_abs_error_percent"] == 20.0 and not summary["within_goal"]


def test_steady_state_is_the_median_after_the_first_epoch_undisturbed() -> None:
    def result(seconds: list[float], disturbed: list[int]) -> ConfigResult:
        epochs = [EpochResult(i + 1, s, 0, 0.0, 1.0, 0.0) for i, s in enumerate(seconds)]
        return ConfigResult("coordlfs", epochs, [], disturbed_epochs=disturbed)

    assert steady_seconds(result([20, 8, 9, 30], [])) == 9
    assert steady_seconds(result([20, 8, 9, 30], [4])) == 8.5  # epoch 4: caches dropped
    assert steady_seconds(result([20, 8, 9], [2, 3])) == 8.5  # all disturbed: all count
    assert steady_seconds(result([20], [])) == 20


def test_bad_options_are_one_line(tmp_path: Path) -> None:
    assert_one_line_errors("whatif", tmp_path / "work",
                           ["--budgets", ",", "--make", "10:1K"],
                           ["--budget", "1M", "--make", "10:1K"],
                           ["--budgets", "0.5,lots", "--make", "10:1K"])
