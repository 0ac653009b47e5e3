"""``coordlfs bench uncached``: one tiny real run (the report's keys, not its timings), and bad
options as one-line errors."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from benchtools import assert_one_line_errors, small_run

from coordlfs.bench.uncached import SYSTEMS
from coordlfs.fs import passthrough


def test_bad_options_are_one_line_errors(tmp_path: Path) -> None:
    assert_one_line_errors("uncached", tmp_path / "work", ["--size", "4K"], ["--repeat", "0"],
                           ["--readers", "x"], ["--why", "nothing"],
                           ["--seconds", "0"])


@pytest.mark.skipif(os.geteuid() != 0 or passthrough.available() is not None
                    or shutil.which("fio") is None,
                    reason="needs root, FUSE passthrough and fio")
def test_tiny_run_reports_every_figure(tmp_path: Path, daemon_logs: list[Path]) -> None:
    daemon_logs.append(tmp_path / "work")
    report = small_run("uncached", tmp_path / "work", tmp_path / "uncached.json",
                       "--size", "8M", "--readers", "1,2", "--repeat", "2", "--why", "no-cache",
                       "--seconds", "1")
    summary = report["summary"]
    assert set(summary["cells"]) == {"sequential_1", "sequential_2", "random_1", "random_2"}
    for cell in summary["cells"].values():
        assert set(cell) == set(SYSTEMS)
        assert all(len(c["runs_gb_per_s"]) == 2 and c["gb_per_s"] > 0 for c in cell.values())
        assert cell["source"]["vs_source"] == 1.0 and cell["source"]["daemon_cpu_s"] is None
        assert cell["coordlfs"]["daemon_cpu_s"] > 0
    assert isinstance(summary["goal_met"], bool)
