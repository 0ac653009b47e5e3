"""``scripts/bench-fio`` (``coordlfs.bench.fio``): its pieces, and one tiny real run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from benchtools import defaults
from conftest import force_unmount, reachable_by_anyone, run_as_other_user

from coordlfs.bench import fio
from coordlfs.errors import UserError
from coordlfs.system.mounts import mount_at


def _settings(**overrides: object) -> fio.Settings:
    return fio.settings_from(defaults(fio.add_arguments, **overrides))


# -- arguments ------------------------------------------------------------------------------


def test_defaults_match_the_issue() -> None:
    settings = _settings()
    assert (settings.files, settings.size, settings.jobs) == (2000, 112 << 10, 4)
    assert (settings.shards, settings.shard_size) == (4, 256 << 20)
    assert settings.job_dir == Path(__file__).resolve().parents[2] / "scripts" / "fio"


def test_files_are_rounded_down_to_whole_shares() -> None:
    settings = _settings(files=50, jobs=4)
    assert (settings.files_per_job, settings.files) == (12, 48)
    names = [name for name, _size in settings.layout()]
    assert names[:2] == ["epoch.0.0", "epoch.0.1"] and names[-1] == "shards.3.0"
    assert len(names) == 48 + 4


@pytest.mark.parametrize(("name", "value", "message"), [
    ("jobs", 0, "--jobs"),
    ("files", 3, "--files"),
    ("shards", 0, "--shards"),
    ("repeat", 0, "--repeat"),
    ("runtime", 0, "--runtime"),
    ("size", "0", "--size"),
    ("shard_size", "lots", "--shard-size"),
])
def test_bad_settings_are_one_line_errors(name: str, value: object, message: str) -> None:
    with pytest.raises(UserError, match=message):
        _settings(**{name: value})


def test_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="root"):
        fio.check_can_run(_settings())


def test_needs_fio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with pytest.raises(UserError, match="fio not found"):
        fio.check_can_run(_settings())


def test_the_wrapper_refuses_non_root_in_one_line() -> None:
    """As root, a copy runs as nobody: the checkout may live where nobody cannot enter."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench-fio"
    if os.geteuid() == 0:
        with reachable_by_anyone(script) as (copy,):
            result = run_as_other_user([copy])
    else:
        result = subprocess.run([str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "bench-fio: must run as root (it drops the page cache and mounts coordlfs)"]


def test_job_files_get_absolute_directories_with_colons_escaped(tmp_path: Path) -> None:
    env = _settings(files=8, jobs=2).environment(tmp_path / "a:b", layout=True)
    assert env["DIR"] == str(tmp_path) + "/a\\:b"
    assert (env["NRFILES"], env["JOBS"], env["LAYOUT"]) == ("4", "2", "1")
    assert env["FILESIZE"] == str(112 << 10)


# -- fio's output ---------------------------------------------------------------------------


def _fio_job(name: str, bw: int, iops: float, ios: int, error: int = 0) -> dict:
    return {"jobname": name, "error": error,
            "read": {"io_bytes": bw, "total_ios": ios, "runtime": 1000, "bw_bytes": bw,
                     "iops": iops, "clat_ns": {"mean": 2000.0, "percentile": {
                         "50.000000": 1000, "99.000000": 9000}}}}


def test_report_is_found_after_fio_s_plain_text_lines() -> None:
    report = {"fio version": "fio-3.33", "jobs": [_fio_job("metadata", 10, 5.0, 10)]}
    text = ("drop-caches : Saving output of prerun in drop-caches.prerun.txt\n"
            + json.dumps(report, indent=2) + "\n")
    assert fio.parse_output(text) == report
    with pytest.raises(UserError, match="no JSON"):
        fio.parse_output("fio: job global dropped\n")


def test_summary_picks_the_measured_job_and_its_unit() -> None:
    report = {"jobs": [_fio_job("drop-caches", 4096, 1.0, 1),
                       _fio_job("metadata", 2_000_000, 2500.0, 2000)]}
    run = fio.summarize(report, "metadata")
    assert (run["ios"], run["iops"], run["clat_mean_us"], run["clat_p99_us"]) == \
        (2000, 2500.0, 2.0, 9.0)
    metadata, epoch = fio.JOBS[2], fio.JOBS[0]
    assert fio.value(metadata, run) == 2500.0
    assert fio.value(epoch, run) == 2.0  # MB/s: 10**6 bytes per second
    with pytest.raises(UserError, match="no job 'epoch'"):
        fio.summarize(report, "epoch")
    with pytest.raises(UserError, match="failed"):
        fio.summarize({"jobs": [_fio_job("epoch", 0, 0, 0, error=30)]}, "epoch")


def test_table_has_medians_ratios_and_notes() -> None:
    settings = _settings(files=8, jobs=2, shards=1, repeat=3)
    runs = {}
    for job in fio.JOBS:
        for target, scale in (("source", 1), ("coordlfs", 2)):
            full = fio.expected_ios(settings, job)
            runs[job.name, target] = [fio.summarize({"jobs": [_fio_job(
                job.name, bw * scale * 10**6, bw * scale * 1.0, full)]}, job.name)
                for bw in (10, 30, 20)]
    runs["shards", "source"][0]["ios"] = 1  # stopped by --runtime
    cache = {"capacity_bytes": 1, "used_bytes": 1}
    report = fio.build_report(settings, runs, True, cache, {"bytes_from_source": 0}, "fio-3.33")
    assert report["summary"]["epoch"] == {"unit": "MB/s", "what": fio.JOBS[0].what,
                                          "source": 20.0, "coordlfs": 40.0, "ratio": 2.0}
    assert report["summary"]["metadata"]["source"] == 20.0
    json.dumps(report)  # all of it serialises
    table = fio.format_table(report, settings).splitlines()
    assert table[0].split(" | ")[0].strip() == "job"
    assert "2.00x" in table[2] and "40.0" in table[2]
    assert any("before reading everything: shards" in line for line in table)


# -- a real run ------------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse")
                    or shutil.which("fio") is None, reason="needs root, /dev/fuse and fio")
def test_tiny_run_measures_every_job_on_both_sides_and_cleans_up(
        tmp_path: Path, daemon_logs: list[Path]) -> None:
    work, out = tmp_path / "work", tmp_path / "fio.json"
    daemon_logs.append(work)
    argv = [sys.executable, "-m", "coordlfs.bench.fio", "--dir", str(work), "--files", "50",
            "--size", "16K", "--jobs", "2", "--shards", "1", "--shard-size", "4M",
            "--runtime", "2", "--repeat", "1", "--json", str(out)]
    runner = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = runner.communicate(timeout=120)
        left_mounted = mount_at(str(work / "mnt"))
    finally:
        if runner.poll() is None:  # stuck: let it clean up as for Ctrl-C, then insist
            runner.send_signal(signal.SIGTERM)
            try:
                runner.wait(30)
            except subprocess.TimeoutExpired:
                runner.kill()
                runner.wait()
        if mount_at(str(work / "mnt")) is not None:
            force_unmount(work / "mnt", None)
        for leftover in Path("/dev/shm").glob(f"coordlfs-testbed-{runner.pid}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    assert runner.returncode == 0, stderr
    assert left_mounted is None
    assert not list(Path("/dev/shm").glob(f"coordlfs-testbed-{runner.pid}-*"))
    assert "coordlfs/source" in stdout
    report = json.loads(out.read_text())
    measured = {(r["job"], r["target"]): r for r in report["results"]}
    assert set(measured) == {(job.name, t) for job in fio.JOBS for t in fio.TARGETS}
    for result in measured.values():
        assert result["median"] > 0 and len(result["runs"]) == 1
        assert result["complete"]
    assert report["coordlfs_reads"]["bytes_from_source"] == 0  # every measured read a hit
    assert report["data"]["files"] == 51
