"""coordlfs bench hpsearch: the JPEGs and their pipeline, its arithmetic, and small real runs
checked by their counts."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from benchtools import stopped_by_sigterm
from PIL import Image

from coordlfs.bench import build_parser, jpegs
from coordlfs.bench.hpsearch import (
    ConfigResult,
    check_can_run,
    format_table,
    parse_counts,
    parse_make,
    settings_from,
    summarize,
)
from coordlfs.bench.jpegs import (
    MEAN,
    STD,
    ImageSpec,
    JpegFolder,
    crop_box,
    ensure_jpegs,
    to_tensor,
)
from coordlfs.errors import UserError
from coordlfs.system.mounts import mount_at
from coordlfs.testbed.cgroup import cgroup_of

BENCH = [sys.executable, "-m", "coordlfs", "bench", "hpsearch"]


def _contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


def test_generation_is_deterministic_and_reused(tmp_path: Path) -> None:
    spec = ImageSpec(24, 96, 72, classes=4)
    first = ensure_jpegs(tmp_path / "a", spec)
    again = ensure_jpegs(tmp_path / "b", spec)
    assert not first.reused and _contents(tmp_path / "a") == _contents(tmp_path / "b")
    assert first.files == again.files and len(first.files) == 24
    assert first.files[5][0] == "class001/img00005.jpg"
    sizes = [size for _rel, size in first.files]
    assert len(set(sizes)) > 1 and min(sizes) > 1000  # noise: not flat, compressible images
    with Image.open(tmp_path / "a" / first.files[0][0]) as image:
        assert (image.format, image.size, image.mode) == ("JPEG", (96, 72), "RGB")
    mtime = (tmp_path / "a" / first.files[0][0]).stat().st_mtime_ns
    reused = ensure_jpegs(tmp_path / "a", spec)
    assert reused.reused and reused.files == first.files
    assert (tmp_path / "a" / first.files[0][0]).stat().st_mtime_ns == mtime
    other = ensure_jpegs(tmp_path / "c", ImageSpec(24, 96, 72, classes=4, seed=1))
    assert _contents(tmp_path / "c") != _contents(tmp_path / "a") and not other.reused
    (tmp_path / "a" / first.files[3][0]).write_bytes(b"cut")  # damaged: remade
    remade = ensure_jpegs(tmp_path / "a", spec)
    assert not remade.reused and _contents(tmp_path / "a") == _contents(tmp_path / "b")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a dataset")
    with pytest.raises(UserError, match="not empty"):
        ensure_jpegs(tmp_path / "mine", spec)


def test_crop_boxes_stay_inside_the_image() -> None:
    random.seed(7)
    for width, height in ((320, 240), (96, 72), (1, 1), (1000, 10), (10, 1000), (224, 224)):
        for _ in range(300):
            left, top, right, bottom = crop_box(width, height)
            assert 0 <= left < right <= width and 0 <= top < bottom <= height
            w, h = right - left, bottom - top
            if (w, h) != (width, height) and min(width, height) > 20:
                assert 0.07 * width * height <= w * h  # the scale's lower end, rounded
                assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1  # the ratio, rounded
    # A strip too thin for any allowed ratio: the centred box of the nearest one.
    assert crop_box(1000, 10) == (493, 0, 506, 10)


def test_to_tensor_is_normalised_chw() -> None:
    image = Image.new("RGB", (5, 3), (255, 0, 0))
    image.putpixel((4, 2), (0, 0, 255))
    tensor = to_tensor(image)
    assert tensor.shape == (3, 3, 5) and tensor.dtype == torch.float32
    assert tensor[0, 0, 0].item() == pytest.approx((1 - MEAN[0]) / STD[0])
    assert tensor[1, 0, 0].item() == pytest.approx(-MEAN[1] / STD[1])
    assert tensor[2, 2, 4].item() == pytest.approx((1 - MEAN[2]) / STD[2])


def test_items_are_cropped_flipped_and_labelled(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ensure_jpegs(tmp_path / "data", ImageSpec(12, 96, 72, classes=3))
    data = JpegFolder(tmp_path / "data", crop=64, drop_pages=str(tmp_path / "data"))
    assert data.classes == ["class000", "class001", "class002"] and len(data) == 12
    assert data.files == [path for path, _label in data.samples]
    assert [label for _path, label in data.samples] == [0] * 4 + [1] * 4 + [2] * 4
    random.seed(3)
    for index in range(len(data)):
        image, label = data[index]
        assert image.shape == (3, 64, 64) and image.dtype == torch.float32
        assert label == data.samples[index][1]
    # The same crop, flipped or not: the flipped item is the other mirrored.
    monkeypatch.setattr(jpegs, "crop_box", lambda width, height: (10, 5, 60, 55))
    monkeypatch.setattr(random, "random", lambda: 0.9)
    plain, _ = data[0]
    monkeypatch.setattr(random, "random", lambda: 0.1)
    flipped, _ = data[0]
    assert torch.equal(flipped, plain.flip(-1)) and not torch.equal(flipped, plain)


def test_parsing_arguments() -> None:
    assert parse_make("2000:320x240") == (2000, 320, 240)
    assert parse_counts("4,2,2") == [2, 4]
    for bad in ("2000", "2000:320", "0:320x240", "x:1x1"):
        with pytest.raises(UserError):
            parse_make(bad)
    for bad in ("two", "0,2", ""):
        with pytest.raises(UserError):
            parse_counts(bad)


def _config(regime: str, mode: str, n: int, rates: list[float], cpu: list[float],
            stored: list[int], run: int = 1) -> ConfigResult:
    jobs = [{"job": f"job-{i}", "samples_per_s": rate, "cpu_s": c, "samples": [100, 100],
             "prepared": None} for i, (rate, c) in enumerate(zip(rates, cpu, strict=True))]
    return ConfigResult(regime, mode, n, run, 1000, 10.0, stored, jobs)


def test_summary_is_shared_over_independent_per_regime() -> None:
    results = [
        _config("memory", "independent", 2, [100, 120], [30, 34], [0, 0]),
        _config("memory", "shared", 2, [190, 210], [16, 16], [0, 0]),
        _config("memory", "independent", 4, [50, 60, 70, 80], [20] * 4, [0, 0]),
        _config("memory", "shared", 4, [130, 130, 130, 130], [5] * 4, [0, 0]),
        _config("storage", "independent", 2, [40, 40], [10, 10], [1000, 1000, 1200]),
        _config("storage", "shared", 2, [60, 60], [8, 8], [1000, 500, 500]),
        _config("storage", "independent", 2, [40, 40], [10, 10], [1000, 1000, 1000], run=2),
        _config("storage", "shared", 2, [80, 80], [10, 10], [1000, 500, 500], run=2),
    ]
    summary = summarize(results)
    memory, storage = summary["memory"], summary["storage"]
    assert memory["throughput_ratio_2jobs"] == round(200 / 110, 3)
    assert memory["prep_cpu_ratio_2jobs"] == round(64 / 32, 3)
    assert memory["throughput_ratio_4jobs"] == round(130 / 65, 3)
    assert memory["prep_cpu_ratio_4jobs"] == 4.0
    assert memory["storage_bytes_ratio_2jobs"] is None  # nothing read from storage
    assert storage["throughput_ratio_2jobs_runs"] == [1.5, 2.0]
    assert storage["throughput_ratio_2jobs"] == 1.75
    assert storage["prep_cpu_ratio_2jobs_runs"] == [1.25, 1.0]
    assert storage["storage_bytes_ratio_2jobs_runs"] == [2.2, 2.0]  # epochs after the first
    assert summary["throughput_ratio_2jobs"] == memory["throughput_ratio_2jobs"]
    assert summary["prep_cpu_ratio_4jobs"] == 4.0
    assert "storage_bytes_ratio_2jobs" not in summary
    table = format_table(results)
    assert len(table.splitlines()) == 7 and "storage" in table.splitlines()[-1]
    # Without the memory regime there is no top-level figure; without both modes no ratio.
    assert "throughput_ratio_2jobs" not in summarize(results[4:])
    assert summarize(results[:1])["memory"]["throughput_ratio_2jobs"] is None


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    for args in (["--jobs", "two"], ["--jobs", "0"], ["--cache", "1.5"], ["--make", "10:ax2"],
                 ["--regimes", "disk"], ["--modes", "both"], ["--epochs", "0"],
                 ["--throttle", "0"], ["--compute-ms", "-1"], ["--workers", "-1"]):
        result = subprocess.run([*BENCH, "--work", str(tmp_path), *args],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_missing_packages_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_from(build_parser().parse_args(["hpsearch"]))
    real = importlib.util.find_spec
    for missing, named in (("PIL", "Pillow"), ("torch", "torch"),
                           ("coordlfs.client.shared_prep", "SharedPrepLoader")):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, m=missing: None if name == m else real(name, *a))
        with pytest.raises(UserError, match=named):
            check_can_run(settings)


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line names ``text`` (jobs and their workers name the work
    directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def _check_clean(work: Path, pid: int | None = None) -> None:
    """No mount, no cgroup (of bench ``pid``, or of any), no cache directory, no job left."""
    assert mount_at(str(work / "mnt")) is None
    name = f"coordlfs-hpsearch-{pid if pid is not None else ''}*"
    for controller in ("memory", "blkio"):
        assert not list(cgroup_of("self", controller).glob(name))
    if pid is not None:
        assert not list(Path("/dev/shm").glob(f"coordlfs-testbed-{pid}-*"))
    for _ in range(50):  # a worker may outlive its job by a moment
        if not _processes_naming(str(work)):
            break
        time.sleep(0.1)
    assert not _processes_naming(str(work))


def test_small_run_end_to_end(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Two jobs, warm cache, both modes: every job sees every sample of every epoch, and the
    shared jobs prepare each batch once between them."""
    out, work = tmp_path / "hpsearch.json", tmp_path / "work"
    daemon_logs.append(work)
    result = subprocess.run(
        [*BENCH, "--make", "120:96x72", "--work", str(work), "--jobs", "2", "--epochs", "2",
         "--regimes", "memory", "--compute-ms", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["dataset"]["files"] == 120
    runs = {run["mode"]: run for run in report["runs"]}
    assert set(runs) == {"independent", "shared"}
    for run in runs.values():
        assert run["regime"] == "memory" and run["jobs"] == 2
        assert len(run["epoch_storage_bytes"]) == 2
        assert run["cache_bytes"] == report["dataset"]["bytes"]
        for job in run["job_results"]:
            assert job["samples"] == [120, 120] and job["batches_per_epoch"] == 4
            assert job["cpu_s"] > 0 and len(job["epoch_s"]) == 2
    assert sum(job["prepared"] for job in runs["shared"]["job_results"]) == 4 * 2
    assert all(job["prepared"] is None for job in runs["independent"]["job_results"])
    summary = report["summary"]
    assert summary["throughput_ratio_2jobs"] == summary["memory"]["throughput_ratio_2jobs"]
    assert summary["prep_cpu_ratio_2jobs"] is not None
    _check_clean(work)


def test_storage_regime_reads_the_uncached_part_again(tmp_path: Path,
                                                      daemon_logs: list[Path]) -> None:
    """Half the dataset cached, reads throttled: after the first epoch the independent jobs
    read the uncached half once each, the shared jobs once between them."""
    out, work = tmp_path / "hpsearch.json", tmp_path / "work"
    daemon_logs.append(work)
    result = subprocess.run(
        [*BENCH, "--make", "200:320x240", "--work", str(work), "--jobs", "2", "--epochs", "2",
         "--regimes", "storage", "--throttle", "20M", "--compute-ms", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    total = report["dataset"]["bytes"]
    runs = {run["mode"]: run for run in report["runs"]}
    for run in runs.values():
        assert run["cache_bytes"] == total // 2
        assert run["epoch_storage_bytes"][0] >= total * 0.99
    independent = runs["independent"]["epoch_storage_bytes"][1]
    shared = runs["shared"]["epoch_storage_bytes"][1]
    assert total * 0.4 <= shared <= total * 0.7
    assert total * 0.8 <= independent <= total * 1.3
    assert report["summary"]["storage"]["storage_bytes_ratio_2jobs"] > 1.4
    _check_clean(work)


def test_sigterm_stops_the_jobs_and_cleans_up(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Stopped by SIGTERM while its jobs train (as a scheduler stops it): jobs, their
    workers, throttle and mount all go."""
    work = tmp_path / "work"
    daemon_logs.append(work)
    with stopped_by_sigterm(
            [*BENCH, "--make", "200:160x120", "--work", str(work), "--jobs", "2",
             "--epochs", "50", "--regimes", "storage", "--modes", "independent",
             "--throttle", "20M"]) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("run 1"):
                break
        throttled = cgroup_of("self", "blkio") / f"coordlfs-hpsearch-{proc.pid}"
        for _ in range(1200):  # mounted and throttled; then the jobs start
            if throttled.is_dir():
                break
            time.sleep(0.05)
        time.sleep(6)  # the torch import, then some batches
    _check_clean(work, proc.pid)
