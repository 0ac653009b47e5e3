"""``coordlfs bench warm``: one tiny real run (the report's keys, not its timings), and bad
options as one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from benchtools import assert_one_line_errors, small_run


def test_bad_options_are_one_line_errors(tmp_path: Path) -> None:
    assert_one_line_errors("warm", tmp_path / "work", ["--files", "1"], ["--repeat", "0"],
                           ["--files", "x"])


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="needs root and /dev/fuse")
def test_tiny_run_reports_every_figure(tmp_path: Path, daemon_logs: list[Path]) -> None:
    daemon_logs.append(tmp_path / "work")
    report = small_run("warm", tmp_path / "work", tmp_path / "warm.json", "--files", "40",
                       "--repeat", "2")
    assert set(report) == {"settings", "dataset", "summary", "runs"}
    summary = report["summary"]
    for way in ("cat", "vmtouch", "coordlfs"):
        assert summary[f"{way}_mb_per_s"] > 0 and len(report["runs"][way]) == 2
    assert summary["warm_vs_cat"] > 0 and summary["warm_vs_vmtouch"] > 0
    assert summary["warm_cached_all"] is True
    warm = report["runs"]["coordlfs"][0]["warm"]
    assert warm["files"] == report["dataset"]["files"] + 1  # and the dataset's manifest
