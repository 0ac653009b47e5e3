"""The what-if model (coordlfs.models.whatif): rates fitted from marked epochs, predictions,
advice."""

from __future__ import annotations

from typing import Any

import pytest

from coordlfs.errors import UserError
from coordlfs.models import whatif

GB = 1_000_000_000
S, C, P = 50e6, 800e6, 400e6


def _reads(storage: float, cache: float, peers: float = 0,
           opened: float | None = None) -> dict[str, int]:
    """Counters of reads from each source; the files opened were read whole unless
    ``opened`` says their size."""
    return {"bytes_from_source": int(storage), "bytes_from_cache": int(cache),
            "bytes_from_peers": int(peers), "client_bytes_from_cache": 0,
            "opened_bytes": int(storage + cache + peers if opened is None else opened)}


def marks_of(steps: list[tuple[str, float, float, float, float]]) -> list[dict[str, Any]]:
    """Marks, each followed by ``seconds`` of reads: (name, seconds, storage, cache, opened)
    per mark, the last one's reads ignored."""
    marks, now, total = [], 100.0, [0.0, 0.0, 0.0]
    for name, seconds, storage, cache, opened in steps:
        marks.append({"name": name, "time": now, "reads": _reads(total[0], total[1], 0,
                                                                 total[2])})
        now += seconds
        total = [total[0] + storage, total[1] + cache, total[2] + opened]
    return marks


def marked_run(epochs: list[tuple[float, float, float]], floor_s: float = 0.0,
               start: float = 100.0) -> list[dict[str, Any]]:
    """Marks ``epoch-1``.. and ``end`` around epochs of (storage, cache, peer) bytes, each
    taking its fetch time at S, C and P, or ``floor_s`` if longer (prep or compute)."""
    marks, now, total = [], start, [0.0, 0.0, 0.0]
    for number, (storage, cache, peers) in enumerate(epochs, 1):
        marks.append({"name": f"epoch-{number}", "time": now, "reads": _reads(*total)})
        now += max(storage / S + cache / C + peers / P, floor_s)
        total = [total[0] + storage, total[1] + cache, total[2] + peers]
    marks.append({"name": "end", "time": now, "reads": _reads(*total)})
    return marks


def status(capacity: float, profiles: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"mountpoint": "/mnt/data", "cache": {"capacity_bytes": capacity},
            "profiles": profiles or []}


def profile(step_s: float, epochs: int = 3) -> list[dict[str, Any]]:
    return [{"job": "resnet", "pid": 42,
             "epochs": {str(e): {"steps": 10, "wait_s": 1.0, "step_s": step_s, "partners": []}
                        for e in range(epochs)}}]


WINDOW = {"since": "mount", "until": "now", "seconds": 1.0, "reads": _reads(0, 0)}
#: a cold epoch, then two with half the dataset cached: a cache of 50%
HALF = [(GB, 0, 0), (GB / 2, GB / 2, 0), (GB / 2, GB / 2, 0)]


def test_rates_are_fitted_from_the_cold_and_the_warm_epochs() -> None:
    data = whatif.analyse(status(GB / 2), marked_run(HALF), WINDOW, None, cpus=4)
    rates = whatif.Rates.from_json(data["rates"])
    assert rates.dataset_bytes == GB
    assert rates.storage_bps == pytest.approx(S)
    assert rates.cache_bps == pytest.approx(C)
    assert rates.peer_bps is None
    assert [e["name"] for e in data["epochs"]] == ["epoch-1 .. epoch-2", "epoch-2 .. epoch-3",
                                                   "epoch-3 .. end"]
    # DS-Analyzer's equation 3: hits at the cache's speed, misses at the storage's
    for row in data["cache"]:
        x = row["cache_fraction"]
        assert row["epoch_s"] == pytest.approx(x * GB / C + (1 - x) * GB / S)
    assert data["now"]["cache_fraction"] == 0.5
    assert data["now"]["bound"] == "storage"


def test_without_step_times_the_job_is_assumed_fetch_bound() -> None:
    data = whatif.analyse(status(GB / 2), marked_run(HALF), WINDOW, None, cpus=4)
    assert data["now"]["stall_share"] is None and data["now"]["compute_s"] is None
    assert any("assumed fetch-bound" in note for note in data["rates"]["assumptions"])
    text = whatif.format_report(data)
    assert "assumed  no step times" in text and "advice" in text


def test_a_cache_that_removes_the_fetch_stall_is_recommended() -> None:
    # compute 12 s per epoch: at 50% fetching takes 10.6 s... at 40%, 12.5 s
    runs = marked_run(HALF, floor_s=12.0)
    data = whatif.analyse(status(0.3 * GB, profile(12.0)), runs, WINDOW, None, cpus=4)
    rates = whatif.Rates.from_json(data["rates"])
    assert rates.compute_s == 12.0
    # the warm epochs were compute-bound: left out of the fit, which the cold one alone
    # cannot split between cache and storage: the cache's speed is assumed, and said
    assert rates.storage_bps == pytest.approx(S)
    assert any("cache speed" in n for n in rates.assumptions)
    now = whatif.predict(rates, 0.3)
    assert now.bound == "storage" and now.stall_share == pytest.approx(
        1 - 12.0 / now.epoch_s)
    advice = data["recommendation"]
    assert advice.startswith("a cache of ") and "(50% of the dataset)" in advice
    assert "more CPUs would not help because the epoch is bound by reading misses" in advice
    assert whatif.predict(rates, 1.0).bound == "compute"
    assert whatif.predict(rates, 1.0).stall_share == 0


def test_a_compute_bound_job_gains_nothing_from_a_cache() -> None:
    data = whatif.analyse(status(GB / 2, profile(30.0)), marked_run(HALF, floor_s=30.0),
                          WINDOW, None, cpus=4)
    assert data["now"]["bound"] == "compute"
    assert data["recommendation"].startswith("a bigger cache would not help: the epoch is "
                                             "bound by compute")
    assert any("lower bounds" in n for n in data["rates"]["assumptions"])


def test_epochs_that_hits_do_not_shorten_are_prep_bound_and_more_cpus_help() -> None:
    # 25 s per epoch whatever the hit share (storage alone would take 20 s cold)
    data = whatif.analyse(status(GB / 2), marked_run(HALF, floor_s=25.0), WINDOW, None,
                          cpus=4)
    rates = whatif.Rates.from_json(data["rates"])
    assert rates.prep_s == pytest.approx(25.0)
    assert data["now"]["bound"] == "prep"
    by_cpus = {row["cpus"]: row["epoch_s"] for row in data["cpus"]}
    assert by_cpus[8] < by_cpus[4] < by_cpus[2]
    # prep halves to 12.5 s; storage is at least as fast as the fastest epoch read from it
    # (25 s per GB), so that half the dataset's misses take 12.5 s and the hits 0.6 s more
    assert rates.storage_bps == pytest.approx(GB / 25.0)
    assert by_cpus[8] == pytest.approx(GB / 2 / C + 12.5)
    assert "8 CPUs would cut it by" in data["recommendation"]
    assert "a bigger cache would not help" in data["recommendation"]


def test_since_takes_the_epochs_from_the_latest_mark_of_that_name() -> None:
    runs = marked_run([(GB, 0, 0), (GB, 0, 0), (GB / 2, GB / 2, 0)])
    runs[1]["name"] = "epoch-1"  # marked twice: the latest counts
    epochs = whatif.epoch_intervals(runs, "epoch-1")
    assert [e.name for e in epochs] == ["epoch-1 .. epoch-3", "epoch-3 .. end"]
    assert epochs[0].storage_bytes == GB
    with pytest.raises(UserError, match=r"no mark named 'nope' \(marks: epoch-1, epoch-3, end"):
        whatif.epoch_intervals(runs, "nope")


def test_without_two_marks_the_window_is_one_epoch() -> None:
    window = {"since": "mount", "until": "now", "seconds": 20.0, "reads": _reads(GB, 0)}
    data = whatif.analyse(status(GB / 4), [], window, None, cpus=2)
    rates = whatif.Rates.from_json(data["rates"])
    assert rates.storage_bps == pytest.approx(S)
    assert rates.cache_bps == whatif.DEFAULT_CACHE_BPS
    notes = " ".join(rates.assumptions)
    assert "whole window is taken as one epoch" in notes and "no hits were measured" in notes


def test_nothing_read_is_one_line() -> None:
    with pytest.raises(UserError, match="no reads to analyse"):
        whatif.analyse(status(GB), [], WINDOW, None, cpus=2)


def test_peers_serve_their_share_of_the_misses_at_their_speed() -> None:
    runs = marked_run([(0.6 * GB, 0, 0.4 * GB), (GB / 4, GB / 2, GB / 4),
                       (0.3 * GB, GB / 2, 0.2 * GB)])
    data = whatif.analyse(status(GB / 2), runs, WINDOW, None, cpus=2)
    rates = whatif.Rates.from_json(data["rates"])
    assert rates.peer_share == pytest.approx(0.85 / 2)
    assert rates.storage_bps == pytest.approx(S)
    assert rates.cache_bps == pytest.approx(C)
    assert rates.peer_bps == pytest.approx(P)
    assert whatif.predict(rates, 0.0).epoch_s == pytest.approx(1.15 / 2 * GB / S
                                                               + 0.85 / 2 * GB / P)
    assert "peers 381.5 MiB/s (42% of the misses)" in whatif.format_report(data)


def test_peers_at_one_share_of_the_misses_are_taken_at_storage_speed() -> None:
    runs = marked_run([(GB / 2, 0, GB / 2), (GB / 4, GB / 2, GB / 4), (GB / 4, GB / 2, GB / 4)])
    rates = whatif.Rates.from_json(whatif.analyse(status(GB / 2), runs, WINDOW, None, 2)["rates"])
    assert rates.peer_bps == rates.storage_bps == pytest.approx(1 / (1 / S + 1 / P) * 2)
    assert any("at one speed" in n for n in rates.assumptions)


def test_faster_storage_and_caches_over_the_dataset() -> None:
    data = whatif.analyse(status(2 * GB), marked_run(HALF), WINDOW, None, cpus=2)
    rates = whatif.Rates.from_json(data["rates"])
    assert rates.cache_fraction == 1.0  # a cache beyond the dataset holds all of it
    assert whatif.predict(rates, 1.5).epoch_s == pytest.approx(GB / C)
    half = whatif.predict(rates, 0.5)
    assert whatif.predict(rates, 0.5, storage_factor=2).epoch_s == pytest.approx(
        half.epoch_s - GB / 2 / S / 2)
    assert data["recommendation"].startswith("a bigger cache would not help")


def test_fit_is_non_negative() -> None:
    # more hits took longer: a negative cost per storage byte fits best, zero is allowed
    epochs = [whatif.Interval("a", 10.0, GB, 0, 0), whatif.Interval("b", 12.0, GB / 2, GB / 2, 0)]
    weights = whatif.fit_seconds_per_byte(epochs, (0, 1))
    assert all(w > 0 for w in weights.values())
    assert weights[0] == pytest.approx(1e-8)  # 10 s per GB from the cold epoch, exactly


def test_hits_that_overlapped_the_misses_are_taken_at_memory_speed() -> None:
    epochs = [whatif.Interval("cold", 20.0, GB, 0, 0),
              whatif.Interval("warm", 10.0, GB // 2, GB // 2, 0)]
    rates = whatif.measure(epochs, GB / 2, None, cpus=2)
    assert rates.storage_bps == pytest.approx(S)
    assert rates.cache_bps == whatif.MAX_BPS
    assert any("hits cost little time" in n for n in rates.assumptions)
    assert whatif.recommend(rates).startswith(
        "a cache of 953.7 MiB (100% of the dataset) would cut epoch time by at most 99% "
        "(10.1 s -> 0.100 s, hits hidden behind misses)")


def test_epochs_left_out_do_not_count() -> None:
    runs = marked_run([*HALF, (GB / 2, GB / 2, 0)])
    runs[-1]["time"] += 30.0  # the last epoch was disturbed: 30 s longer
    data = whatif.analyse(status(GB / 2), runs, WINDOW, None, cpus=2, leave_out={4})
    rates = whatif.Rates.from_json(data["rates"])
    assert len(data["epochs"]) == 4 and "epochs 4 left out (disturbed)" in rates.assumptions
    assert rates.storage_bps == pytest.approx(S) and rates.cache_bps == pytest.approx(C)


def test_only_the_intervals_jobs_marked_as_epochs_count() -> None:
    """Issue 35: "23 epoch(s)" after a few jobs marked theirs: every interval between any two
    marks counted. Only an interval from a mark named epoch-N to the next mark is an epoch."""
    runs = marks_of([("warm", 30.0, GB, 0, 0),  # a warm: fills, no epoch
                     ("a/epoch-1", GB / S, GB, 0, GB),
                     ("a/epoch-2", GB / 2 / S + GB / 2 / C, GB / 2, GB / 2, GB),
                     ("end", 60.0, 3 * GB, 0, 3 * GB),  # between jobs: anything
                     ("e1", 5.0, 0, GB, GB),  # a user's marks
                     ("e2", 1.0, 0, 0, 0),
                     ("Epoch 3", GB / 2 / S + GB / 2 / C, GB / 2, GB / 2, GB),
                     ("end", 0.0, 0, 0, 0)])
    epochs = whatif.epoch_intervals(runs, None)
    assert [e.name for e in epochs] == ["a/epoch-1 .. a/epoch-2", "a/epoch-2 .. end",
                                        "Epoch 3 .. end"]
    data = whatif.analyse(status(GB / 2), runs, WINDOW, None, cpus=4)
    rates = whatif.Rates.from_json(data["rates"])
    assert (rates.storage_bps, rates.cache_bps) == (pytest.approx(S), pytest.approx(C))
    assert whatif.format_report(data).startswith("what-if for /mnt/data: 3 epochs, dataset "
                                                 "953.7 MiB")
    one = whatif.analyse(status(GB / 2), runs[:3], WINDOW, None, cpus=4)
    assert "what-if for /mnt/data: 1 epoch, dataset" in whatif.format_report(one)


def test_the_dataset_is_the_size_of_the_files_an_epoch_opened() -> None:
    """Issue 35: a 1.2 GiB dataset was reported as 1.6 GiB: what the epochs read counted (a
    large uncached file read twice by the kernel's read-ahead and a reader, here), not the
    files' sizes."""
    runs = marks_of([("epoch-1", 1.4 * GB / S, 1.4 * GB, 0, GB),
                     ("epoch-2", 0.9 * GB / S + GB / 2 / C, 0.9 * GB, GB / 2, GB),
                     ("end", 0.0, 0, 0, 0)])
    rates = whatif.Rates.from_json(whatif.analyse(status(GB / 2), runs, WINDOW, None, 2)["rates"])
    assert rates.dataset_bytes == GB


def test_without_epoch_marks_the_window_is_one_epoch_and_says_how_to_mark() -> None:
    runs = marks_of([("e1", 20.0, GB, 0, GB), ("e2", 0.0, 0, 0, 0)])
    window = {"since": "mount", "until": "now", "seconds": 20.0, "reads": _reads(GB, 0)}
    data = whatif.analyse(status(GB / 4), runs, window, None, cpus=2)
    assert [e["name"] for e in data["epochs"]] == ["mount .. now"]
    assert any("no epoch marked (a mark named epoch-N" in n
               for n in data["rates"]["assumptions"])
