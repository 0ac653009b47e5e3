"""``coordlfs bench listing``: one tiny real run (the keys it reports, not timings)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from benchtools import defaults, small_run

from coordlfs.bench import listing
from coordlfs.errors import UserError


@pytest.mark.parametrize(("name", "value"), [("entries", 0), ("repeat", -1)])
def test_bad_counts_are_one_line_errors(name: str, value: int) -> None:
    with pytest.raises(UserError, match=f"--{name}"):
        listing.run(defaults(listing.add_arguments, **{name: value}))


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="needs root and /dev/fuse")
def test_tiny_run_reports_every_figure_and_keeps_its_directory(
        tmp_path: Path, daemon_logs: list[Path]) -> None:
    work = tmp_path / "work"
    daemon_logs.append(work / "mount.log")
    report = small_run("listing", work, tmp_path / "out.json", "--entries", "300",
                       "--repeat", "1", "--long")
    summary = report["summary"]
    for command in (*listing.COMMANDS, *listing.LONG):
        key = listing.key_of(command)
        assert summary[f"{key}_source_s"] > 0 and summary[f"{key}_mount_s"] > 0
        assert summary[f"{key}_ratio"] > 0
    assert summary["names_match"] is True
    assert summary["daemon_rss_peak_bytes"] >= summary["daemon_rss_start_bytes"] > 0
    assert summary["scan_entries_per_s_slowest_tenth"] > 0
    assert report["settings"]["entries"] == 300
    made = work / "src" / "300"
    assert sorted(os.listdir(made)) == sorted(os.fsdecode(listing.entry_name(i))
                                              for i in range(300))
