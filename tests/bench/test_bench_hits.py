"""``coordlfs bench hits``: its pieces, and one tiny real run (the keys it reports, not timings)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from benchtools import defaults
from conftest import run_cli

from coordlfs.bench import bigfile, hits, passthrough
from coordlfs.bench.hits import Result, Run
from coordlfs.errors import UserError


def _args(**overrides: object) -> argparse.Namespace:
    return defaults(hits.add_arguments, **overrides)


# -- arguments ------------------------------------------------------------------------------


def test_readers_parse_and_deduplicate() -> None:
    assert hits.parse_readers("1,4") == (1, 4)
    assert hits.parse_readers("4,1,4") == (4, 1)


@pytest.mark.parametrize("text", ["", "0", "1,-2", "one", "1,,4"])
def test_bad_readers_are_one_line_errors(text: str) -> None:
    with pytest.raises(UserError, match="--readers"):
        hits.parse_readers(text)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("files", 0, "--files"),
    ("repeat", 0, "--repeat"),
    ("size", "0", "--size"),
    ("size", "lots", "--size"),
    ("big_size", "-1G", "--big-size"),
    ("read_ahead_kb", -1, "--read-ahead-kb"),
])
def test_bad_settings_are_one_line_errors(name: str, value: object, message: str) -> None:
    with pytest.raises(UserError, match=message):
        hits.settings_from(_args(**{name: value}))


def test_defaults_match_the_issue() -> None:
    settings = hits.settings_from(_args())
    assert (settings.files, settings.size, settings.readers) == (2000, 112 << 10, (1, 4))
    assert settings.big_size == 1 << 30


def test_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="root"):
        hits.check_can_run()


# -- the dataset ----------------------------------------------------------------------------


def test_dataset_is_made_with_exact_sizes_then_reused(tmp_path: Path) -> None:
    directory = str(tmp_path / "ds")
    dataset = hits.prepare_dataset(directory, 5, 1000, 3000)
    small, big_rel = hits.small_files(dataset), hits.big_file(dataset)
    assert len(small) == 5
    for rel in small:
        assert os.path.getsize(os.path.join(directory, rel)) == 1000
    assert big_rel is not None
    big = os.path.join(directory, big_rel)
    assert os.path.getsize(big) == 3000
    assert dataset.total_bytes == 5 * 1000 + 3000
    assert dataset.bytes_of([big_rel, small[0]]) == 4000

    before = {rel: os.stat(os.path.join(directory, rel)).st_mtime_ns
              for rel in (*small, big_rel)}
    again = hits.prepare_dataset(directory, 5, 1000, 3000)
    assert (again.root, again.files, again.reused) == (dataset.root, dataset.files, True)
    assert before == {rel: os.stat(os.path.join(directory, rel)).st_mtime_ns
                      for rel in (*small, big_rel)}


def test_dataset_is_remade_when_the_sizes_change(tmp_path: Path) -> None:
    directory = str(tmp_path / "ds")
    hits.prepare_dataset(directory, 3, 1000, 3000)
    dataset = hits.prepare_dataset(directory, 4, 2000, 5000)
    assert [os.path.getsize(os.path.join(directory, r))
            for r in hits.small_files(dataset)] == [2000] * 4
    assert os.path.getsize(os.path.join(directory, hits.BIG)) == 5000
    assert hits.big_file(dataset) == hits.BIG


def test_dataset_refuses_a_directory_with_other_things(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(UserError, match=r"precious\.txt"):
        hits.prepare_dataset(str(tmp_path), 2, 100, 0)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_no_big_file_when_its_size_is_zero(tmp_path: Path) -> None:
    dataset = hits.prepare_dataset(str(tmp_path / "ds"), 2, 100, 0)
    assert hits.big_file(dataset) is None
    assert not (tmp_path / "ds" / "big").exists()


# -- measuring ------------------------------------------------------------------------------


def test_readers_split_the_files_and_read_every_byte(tmp_path: Path) -> None:
    paths = []
    for i in range(7):
        path = tmp_path / f"f{i}"
        path.write_bytes(b"x" * (1000 + i))
        paths.append(str(path))
    hits.evict(paths)  # harmless on any filesystem
    run = hits.measure(paths, 3)
    assert run.files == 7
    assert run.bytes == sum(1000 + i for i in range(7))
    assert run.seconds > 0


# -- results --------------------------------------------------------------------------------


def _result(case: str, readers: int, *files_per_s: float) -> Result:
    """Runs over 1000 files of 1 MB, so that GB/s is files/s / 1000."""
    return Result(case, readers, [Run(1000 / f, 1000, 10**9) for f in files_per_s])


def _results(bare: tuple[float, ...], cache: tuple[float, ...]) -> dict:
    results = {}
    for readers in (1, 4, 0):
        for case in hits.CASES:
            speeds = {"bare": bare, "coordlfs_cache": cache}.get(case.key, (1000.0,) * len(bare))
            results[case.key, readers] = _result(case.key, readers, *speeds)
    return results


def test_summary_ratios_are_medians_over_medians() -> None:
    summary = hits.summarize(_results((4000, 5000, 3000), (3600, 900, 4500)), (1, 4), True)
    # medians 4000 and 3600 (not the mean of the ratios)
    assert summary["coordlfs_cache_vs_bare"] == {"1": pytest.approx(0.9), "4": pytest.approx(0.9),
                                                 "sequential": pytest.approx(0.9)}
    # run by run: 0.9, 0.18, 1.5 -> median 0.9
    assert summary["coordlfs_cache_vs_bare_paired"]["1"] == pytest.approx(0.9)
    assert summary["coordlfs_cache_vs_tmpfs"]["4"] == pytest.approx(3.6)
    assert summary["goal"] == hits.GOAL
    assert summary["goal_met"] is True
    # the client's speeds are 1000 files/s, as are tmpfs's
    assert summary["client_vs_tmpfs"]["1"] == pytest.approx(1.0)
    assert summary["client_goal_met"] is False


def test_goal_is_missed_below_ninety_percent() -> None:
    summary = hits.summarize(_results((4000,), (3500,)), (1, 4), False)
    assert summary["coordlfs_cache_vs_bare"] == {"1": pytest.approx(0.875),
                                                 "4": pytest.approx(0.875)}
    assert "sequential" not in summary["coordlfs_warm_vs_bare_warm"]
    assert summary["goal_met"] is False


def test_ratio_without_a_baseline_is_none() -> None:
    assert hits.ratio(5.0, 0.0) is None


def test_table_has_a_row_per_case_and_shares_of_bare() -> None:
    table = hits.format_table(_results((4000,), (3600,)), (1, 4), 1 << 30)
    lines = table.splitlines()
    assert len(lines) == 3 + len(hits.CASES)
    assert "1.0 GiB sequential" in lines[0]
    row = next(line for line in lines if line.startswith("coordlfs classic, from its cache"))
    assert "3,600" in row and "90%" in row


def test_a_system_that_cannot_run_is_na_with_why_in_table_and_summary() -> None:
    results = {k: r for k, r in _results((4000,), (3600,)).items()
               if k[0] not in ("coordlfs_pt", "coordlfs_pt_warm", "coordlfs_py")}
    why = "no --passthrough option"
    table = hits.format_table(results, (1, 4), 0, {"coordlfs_pt": why, "coordlfs_py": why})
    rows = [line for line in table.splitlines() if line.startswith("coordlfs passthrough")]
    assert len(rows) == 3 and all(f"n/a: {why}" in row for row in rows)
    summary = hits.summarize(results, (1, 4), False)
    assert summary["coordlfs_passthrough_vs_tmpfs"] == {"1": None, "4": None}
    assert summary["coordlfs_passthrough_vs_passthrough_hp_paired"] == {"1": None, "4": None}
    assert summary["passthrough_goal_met"] is None
    assert summary["passthrough_hp_vs_tmpfs"]["1"] == pytest.approx(1.0)


def test_passthrough_goals_are_shares_of_tmpfs_and_of_passthrough_hp() -> None:
    results = _results((4000,), (3600,))
    for readers, speed in ((1, 170.0), (4, 230.0)):  # tmpfs and passthrough_hp at 1000
        results["coordlfs_pt", readers] = _result("coordlfs_pt", readers, speed)
    summary = hits.summarize(results, (1, 4), False)
    assert summary["coordlfs_passthrough_vs_tmpfs"] == {"1": 0.17, "4": 0.23}
    assert summary["passthrough_goal_met"] is False  # 0.17 of passthrough_hp, not 0.9
    for key in ("tmpfs", "hp"):
        for readers in (1, 4):
            results[key, readers] = _result(key, readers, 180.0)
    assert hits.summarize(results, (1, 4), False)["passthrough_goal_met"] is True


# -- the passthrough systems and the big file ------------------------------------------------


def test_passthrough_hp_missing_is_unavailable_with_why(tmp_path: Path) -> None:
    binary = tmp_path / "passthrough_hp"
    with pytest.raises(passthrough.Unavailable, match=f"no passthrough_hp at {binary}"), \
            passthrough.passthrough_hp(binary, str(tmp_path), str(tmp_path), tmp_path / "log"):
        pass


def test_fio_reads_the_big_file_whole_or_randomly_capped() -> None:
    sequential, random_ = bigfile.PATTERNS
    argv = bigfile.argv("/m:nt/big", sequential, 4, 3 << 30)
    assert {"--readonly", "--rw=read", "--bs=1048576", "--numjobs=4", "--ioengine=psync",
            f"--io_size={3 << 30}", "--filename=/m\\:nt/big"} <= set(argv)
    argv = bigfile.argv("/big", random_, 1, 3 << 30)
    assert {"--rw=randread", "--bs=4096", "--norandommap",
            f"--io_size={bigfile.RANDOM_BYTES}"} <= set(argv)
    assert f"--io_size={1 << 20}" in bigfile.argv("/big", random_, 1, 1 << 20)


def test_big_file_summary_shares_of_tmpfs_and_goals() -> None:
    runs = {}
    for key, tmpfs, classic, through in (("sequential_1", 4.0, 2.0, 3.8),
                                         ("random_1", 2.0, 0.1, 1.7)):
        runs["tmpfs", key], runs["coordlfs", key] = [tmpfs, 9.0, tmpfs], [classic]
        runs["coordlfs_pt", key] = [through]
    result = bigfile.summary(runs, {}, (1,))  # medians: tmpfs's 9.0 is an outlier
    assert result["vs_tmpfs"]["coordlfs"] == {"sequential_1": 0.5, "random_1": 0.05}
    assert result["passthrough_vs_classic"]["random_1"] == 17.0
    assert result["goal_met"] is True  # 0.95 >= 0.9 sequential, 0.85 >= 0.8 random
    runs["coordlfs_pt", "random_1"] = [1.5]
    assert bigfile.summary(runs, {}, (1,))["goal_met"] is False
    runs["coordlfs_pt", "random_1"] = [1.7]
    table = bigfile.format_table(result, (1,), "1 GiB")
    assert "coordlfs passthrough" in table and "n/a" not in table
    del runs["coordlfs_pt", "random_1"], runs["coordlfs_pt", "sequential_1"]
    result = bigfile.summary(runs, {"coordlfs_pt": "why not"}, (1,))
    assert result["goal_met"] is None
    assert result["gb_per_s"]["coordlfs_pt"] == {"sequential_1": None, "random_1": None}
    assert "coordlfs passthrough     | n/a: why not" in bigfile.format_table(result, (1,), "x")


# -- a real run ------------------------------------------------------------------------------


def _leftovers() -> set[str]:
    """Mounts, tmpfs copies and daemons of hits benchmarks (another may run meanwhile)."""
    with open("/proc/self/mountinfo") as f:
        found = {line for line in f if "coordlfs-bench-" in line}
    found |= {str(p) for p in Path("/dev/shm").glob("coordlfs-bench-*")}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"coordlfs.bench.baselines" in cmdline or b"coordlfs-bench-" in cmdline:
            found.add(pid)
    return found


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="needs root and /dev/fuse")
def test_tiny_run_reports_every_figure_and_cleans_up(tmp_path: Path) -> None:
    before = _leftovers()
    out = tmp_path / "hits.json"
    result = run_cli("bench", "hits", "--files", "50", "--size", "112K", "--big-size", "8M",
                     "--repeat", "1", "--dir", str(tmp_path / "data"), "--json", str(out),
                     timeout=120)
    assert result.returncode == 0, result.stderr
    assert "daemon logged" not in result.stderr  # its logs go with its directory: it warns
    assert "coordlfs classic, from its cache" in result.stdout
    report = json.loads(out.read_text())
    assert {"machine", "settings", "cases", "results", "coordlfs_reads", "summary",
            "unavailable"} <= set(report)
    summary = report["summary"]
    for key in (*hits.COMPARISONS, "coordlfs_cache_vs_bare_paired", "client_vs_tmpfs_paired",
                "coordlfs_passthrough_vs_passthrough_hp_paired"):
        assert set(summary[key]) == {"1", "4", "sequential"}
    assert isinstance(summary["goal_met"], bool)
    assert isinstance(summary["client_goal_met"], bool)
    assert isinstance(summary["client_warm_goal_met"], bool)
    assert "coordlfs client, bytes copied out" in result.stdout
    # a system that cannot run here (coordlfs passthrough before the option exists, no
    # passthrough_hp built) is n/a and says why; every other case ran
    unavailable = report["unavailable"]
    assert set(unavailable) <= {"coordlfs_pt", "hp", "fio"}
    assert all(why.strip() for why in unavailable.values())
    for system in ("coordlfs_pt", "hp"):
        if system in unavailable:
            assert f"n/a: {unavailable[system]}" in result.stdout
    cases = {(r["case"], r["readers"]) for r in report["results"]}
    assert cases == {(c.key, n) for c in hits.CASES for n in (1, 4, 0)
                     if c.system not in unavailable}
    assert summary["passthrough_goal_met"] in (True, False, None)
    big = summary["big_file"]
    keys = {"sequential_1", "sequential_4", "random_1", "random_4"}
    assert set(big["gb_per_s"]) == {"tmpfs", "coordlfs", "coordlfs_pt"}
    assert all(set(rates) == keys for rates in big["gb_per_s"].values())
    assert set(big["vs_tmpfs"]) == {"coordlfs", "coordlfs_pt"}
    assert ("coordlfs_pt" in big["unavailable"]) == bool({"coordlfs_pt", "fio"} & set(unavailable))
    for system, rates in big["gb_per_s"].items():
        ran = system not in big["unavailable"]
        assert all((rate is not None and rate > 0) == ran for rate in rates.values())
    assert all(r["files_per_s"] > 0 and len(r["runs"]) == 1 for r in report["results"])
    # every measured coordlfs read was a hit, the client's from shared memory: 50 small
    # files with 1 and 4 readers, and the big file (more if a run was disturbed and retaken)
    assert report["coordlfs_reads"]["bytes_from_source"] == 0
    assert report["coordlfs_reads"]["client_hits"] >= (50 * 2 + 1) * 3  # warm: read twice
    assert report["coordlfs_reads"]["client_misses"] == 0
    assert _leftovers() <= before


def test_daemon_cpu_per_file_of_passthrough_is_set_beside_passthrough_hps() -> None:
    results = _results((4000,), (3600,))
    for case, cpu_s in (("coordlfs_pt", 0.084), ("hp", 0.042)):  # 1000 files a run
        for readers in (1, 4):
            results[case, readers].runs[0].daemon_cpu_s = cpu_s
    summary = hits.summarize(results, (1, 4), False)
    assert summary["daemon_cpu_us_per_file"]["coordlfs_pt"] == {"1": 84.0, "4": 84.0}
    assert summary["daemon_cpu_us_per_file"]["hp"] == {"1": 42.0, "4": 42.0}
    assert summary["daemon_cpu_us_per_file"]["hp_warm"] == {"1": None, "4": None}
    assert summary["passthrough_cpu_vs_passthrough_hp"] == {"1": 2.0, "4": 2.0}
    assert summary["passthrough_cpu_goal"] == hits.PASSTHROUGH_CPU_GOAL
    line = hits._cpu_line(summary, "1", "1 reader")
    assert "coordlfs passthrough 84 µs" in line and "passthrough_hp 42 µs" in line
    assert "2.00x (goal <= 1.3x)" in line
