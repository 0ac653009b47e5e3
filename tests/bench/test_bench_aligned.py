"""coordlfs bench aligned: its arithmetic, and one small real run checked by its counters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from benchtools import assert_one_line_errors, small_run

from coordlfs import cli
from coordlfs.bench import overhead
from coordlfs.bench.aligned import (
    RECORD_RESOLUTION_S,
    SystemResult,
    advised_delays,
    calibrate,
    summarize,
)
from coordlfs.bench.stagger import profile_from
from coordlfs.models.stagger import optimal_delay, standalone_runtime


def _result(system: str, stored: list[int], makespan: float,
            job_epochs: list[list[tuple[float, float]]] | None = None,
            delays: list[float] | None = None) -> SystemResult:
    return SystemResult(system, 2, stored, [makespan, makespan], makespan, [[0.0]],
                        job_epochs or [[(makespan, 0.0)]], delays or [0.0, 0.0])


def test_summary_is_independent_over_aligned_after_the_first_epoch() -> None:
    runs = [{2: {"page cache": _result("page cache", [100, 160, 160], 30),
                 "coordlfs": _result("coordlfs", [120, 150, 150], 20),
                 "coordlfs aligned": _result("coordlfs aligned", [100, 75, 75], 10),
                 "coordlfs staggered": _result("coordlfs staggered", [100, 75, 75], 8,
                                               delays=[0.0, 2.5])}}]
    summary = summarize(runs)
    assert summary["storage_bytes_ratio_2jobs"] == 2.0
    assert summary["page_cache_storage_ratio_2jobs"] == round(320 / 150, 3)
    assert summary["makespan_ratio_2jobs"] == 2.0
    assert summary["storage_bytes_ratio_2jobs_runs"] == [2.0]
    assert summary["staggered_makespan_ratio_2jobs"] == 1.25
    assert summary["staggered_delay_s_2jobs"] == 2.5


def test_calibration_and_the_advised_chain_of_delays() -> None:
    """10 batches an epoch: alone 3 epochs of (seconds, waited) (6, 4), (3, 1), (3, 1); started
    together each job waited 5 s in its first epoch."""
    alone = _result("coordlfs aligned", [0], 12, [[(6.0, 4.0), (3.0, 1.0), (3.0, 1.0)]])
    together = _result("coordlfs aligned", [0], 7, [[(7.0, 5.0)], [(7.0, 5.0)]])
    profile = calibrate(alone, together, 10)
    assert (profile.iterations, profile.epochs) == (10, 3)
    assert (profile.I, profile.W_cold, profile.W_warm, profile.W_concurrent) == \
        pytest.approx((0.2, 0.4, 0.1, 0.5))
    fraction, delays = advised_delays(profile, 3)
    assert fraction == optimal_delay([profile, profile]).delay
    step = fraction * standalone_runtime(profile)
    assert delays == pytest.approx((0.0, step, 2 * step))


def test_a_job_with_no_compute_still_gets_an_advised_delay() -> None:
    """``--compute-ms 0``: every epoch's time is wait within the records' 1 ms, so the time
    outside the waits measures 0. The advisor still answers, with the smallest ``I`` the
    records could hide, instead of JobProfile refusing I = 0 (a traceback, before)."""
    alone = _result("coordlfs aligned", [0], 3, [[(2.0, 2.0), (0.5, 0.5)]])
    together = _result("coordlfs aligned", [0], 3, [[(3.0, 3.0)], [(3.0, 3.0)]])
    profile = calibrate(alone, together, 10)
    assert (profile.I, profile.W_cold, profile.W_warm, profile.W_concurrent) == \
        pytest.approx((RECORD_RESOLUTION_S / 20, 0.2, 0.05, 0.3))
    fraction, delays = advised_delays(profile, 2)
    assert 0 <= fraction <= 1 and delays[0] == 0 and delays[1] >= 0


def test_bench_stagger_calibrates_a_job_with_no_compute() -> None:
    """The same for ``coordlfs bench stagger --compute-ms 0,0``: (end, seconds, waited)."""
    profile = profile_from("A", [(2.0, 2.0, 2.0), (2.5, 0.5, 0.5)], [(3.0, 3.0, 3.0)], 10)
    assert (profile.I, profile.W_cold, profile.W_warm, profile.W_concurrent) == \
        pytest.approx((RECORD_RESOLUTION_S / 20, 0.2, 0.05, 0.3))
    assert 0 <= optimal_delay([profile, profile]).delay <= 1


def _one_line_error(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize("bench", ["aligned", "epochs", "stagger"])
def test_a_dataset_of_empty_files_is_a_one_line_error(tmp_path: Path, bench: str) -> None:
    """Every figure is a share of the dataset's bytes: 0 of them divided by zero, before."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"f{i}").touch()
    result = subprocess.run([sys.executable, "-m", "coordlfs", "bench", bench, "--dir",
                             str(data), "--work", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=60)
    _one_line_error(result)
    assert "no files with data" in result.stderr


@pytest.mark.parametrize("error", [ZeroDivisionError("float division by zero"),
                                   ValueError("I must be > 0,\nnot 0.0")])
def test_the_bench_entry_turns_a_degenerate_measurement_into_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        error: Exception) -> None:
    """Whatever bench divides by a measured 0, the user sees one line, not a traceback."""
    def measure(_args: object) -> int:
        raise error

    monkeypatch.setattr(overhead, "run", measure)
    assert cli.main(["bench", "overhead"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("coordlfs: bench overhead: a measurement came out degenerate")
    assert type(error).__name__ in err


def test_small_run_end_to_end(tmp_path: Path, daemon_logs: list[Path]) -> None:
    """Two jobs, no throttle: every system reads the dataset, aligned jobs share their reads."""
    daemon_logs.append(tmp_path / "work")
    report = small_run("aligned", tmp_path / "work", tmp_path / "aligned.json",
                       "--make", "300:64K", "--jobs", "2", "--throttle", "none",
                       "--epochs", "2", "--readers", "1", "--compute-ms", "0")
    total = report["dataset"]["bytes"]
    systems = report["runs"][0]["2"]
    assert set(systems) == {"page cache", "coordlfs", "coordlfs aligned", "coordlfs staggered"}
    for system in systems.values():
        assert len(system["epoch_storage_bytes"]) == 2 and len(system["job_seconds"]) == 2
        # Every file is read from storage at least once in the first epoch.
        assert system["epoch_storage_bytes"][0] >= total * 0.99
    # Aligned jobs read each uncached file once between them, not once each.
    assert systems["coordlfs aligned"]["epoch_storage_bytes"][0] < total * 1.3
    assert "storage_bytes_ratio_2jobs" in report["summary"]
    staggered = systems["coordlfs staggered"]
    assert staggered["delays_s"][0] == 0 and staggered["delays_s"][1] >= 0
    delay = report["summary"]["staggered_delay_s_2jobs"]
    assert delay == pytest.approx(staggered["delays_s"][1], abs=1e-3)


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    assert_one_line_errors("aligned", tmp_path, ["--jobs", "two"], ["--cache", "1.5"],
                           ["--jobs", "0"])


def test_bench_stagger_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    assert_one_line_errors("stagger", tmp_path, ["--compute-ms", "x"], ["--compute-ms", "40"],
                           ["--epochs", "1"])
