"""``coordlfs bench misses``: one tiny real run (the keys it reports, not timings)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli


def test_bad_counts_are_one_line_errors(tmp_path: Path) -> None:
    result = run_cli("bench", "misses", "--files", "0", "--dir", str(tmp_path / "data"))
    assert result.returncode != 0
    assert "--files" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="needs root and /dev/fuse")
def test_tiny_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "misses.json"
    result = run_cli("bench", "misses", "--files", "40", "--size", "16K", "--big-size", "8M",
                     "--repeat", "1", "--dir", str(tmp_path / "data"), "--json", str(out),
                     timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())["summary"]
    for readers in (1, 4):
        assert summary[f"misses_per_s_{readers}"] > 0
        assert summary[f"page_cache_files_per_s_{readers}"] > 0
        assert summary[f"misses_vs_page_cache_{readers}"] > 0
        assert summary[f"daemon_cpu_us_per_miss_{readers}"] > 0
    for key in ("gb_per_s", "page_cache_gb_per_s", "misses_vs_page_cache",
                "daemon_cpu_s_per_gb"):
        assert summary[f"{key}_sequential"] > 0
    assert "misses_per_s_1" in result.stdout
