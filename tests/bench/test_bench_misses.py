"""``coordlfs bench misses``: one tiny real run (the keys it reports, not timings)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli

from coordlfs.bench.passthrough import DEFAULT_HP

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                reason="needs root and /dev/fuse")


@pytest.mark.parametrize("option", [("--files", "0"), ("--cases", "cold,warm")])
def test_bad_options_are_one_line_errors(tmp_path: Path, option: tuple[str, str]) -> None:
    result = run_cli("bench", "misses", *option, "--dir", str(tmp_path / "data"))
    assert result.returncode != 0
    assert option[0] in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data").exists()


@needs_root
def test_tiny_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "misses.json"
    result = run_cli("bench", "misses", "--files", "40", "--size", "16K", "--big-size", "8M",
                     "--repeat", "1", "--dir", str(tmp_path / "data"), "--json", str(out),
                     timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    summary = report["summary"]
    for readers in (1, 4):
        assert summary[f"misses_per_s_{readers}"] > 0
        assert summary[f"page_cache_files_per_s_{readers}"] > 0
        assert summary[f"misses_vs_page_cache_{readers}"] > 0
        assert summary[f"daemon_cpu_us_per_miss_{readers}"] > 0
        # a miss beside one without its fill, and passthrough_hp's, in the same run
        assert summary[f"daemon_cpu_us_per_miss_without_fill_{readers}"] > 0
        assert f"fill_vs_kernel_copy_{readers}" in summary
        if os.access(DEFAULT_HP, os.X_OK):
            assert summary[f"hp_cpu_us_per_file_{readers}"] > 0
            assert summary[f"misses_vs_hp_{readers}"] > 0
        for way in ("mount", "client"):
            assert summary[f"ordered_{way}_files_per_s_{readers}"] > 0
            assert summary[f"ordered_{way}_vs_page_cache_{readers}"] > 0
            assert summary[f"ordered_{way}_daemon_cpu_us_per_file_{readers}"] > 0
    for key in ("gb_per_s", "page_cache_gb_per_s", "misses_vs_page_cache",
                "daemon_cpu_s_per_gb"):
        assert summary[f"{key}_sequential"] > 0
    assert summary["kernel_copy_us_per_file"] > 0
    assert summary["fill_cpu_goal"] == 1.3 and summary["hp_goal"] == 0.9
    assert summary["ordered_goals"] == {"mount": 0.7, "client": 0.9}
    assert set(summary["ordered_goals_met"]) == {"mount", "client"}
    assert "misses_per_s_1" in result.stdout and "ordered_client_vs_page_cache_4" in result.stdout
    for way in ("mount", "client"):
        for readers in ("1", "4"):
            (one,) = report["runs"][f"ordered_{way}"][readers]
            # each file read from storage once, whether its fill or its reader got there first
            assert one["files"] == 40 and one["mount"]["bytes_from_source"] == one["bytes"]
            assert 0 <= one["mount"]["filled_ahead"] <= 40
    # the order was handed over: the fills read files ahead of the readers
    assert any(runs[0]["mount"]["filled_ahead"] > 0
               for case, by_readers in report["runs"].items() if case.startswith("ordered_")
               for runs in by_readers.values())


@needs_root
def test_cases_picks_the_ordered_epoch_alone(tmp_path: Path) -> None:
    out = tmp_path / "misses.json"
    result = run_cli("bench", "misses", "--cases", "ordered", "--files", "12", "--size", "8K",
                     "--big-size", "1M", "--readers", "2", "--repeat", "2",
                     "--dir", str(tmp_path / "data"), "--json", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["ordered_mount_vs_page_cache_2"] > 0
    assert summary["ordered_client_vs_page_cache_2"] > 0
    # no cold misses, and no big file: it has no order to hand over
    assert not any(k.startswith("misses_") or k.endswith("_sequential") for k in summary)
    assert set(report["runs"]) == {"source", "ordered_mount", "ordered_client"}
    assert all(len(runs["2"]) == 2 for runs in report["runs"].values())
