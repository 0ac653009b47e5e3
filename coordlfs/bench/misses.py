"""Cold-miss throughput: files read once through a fresh mount, beside the page cache.

The first epoch of a job, and every file MinIO has no room for, is a miss: the daemon looks
the file up, opens it, reads it from storage (filling its cache) and answers. This benchmark
reads every small file of ``bench hits``'s dataset once, shuffled, split among 1 and 4 reader
processes doing os.open / os.readv to EOF / os.close, through a coordlfs mount whose cache is
empty (a new mount per run, with room for every file), and the same files straight from the
source with their pages dropped first (the page cache reading the source: the limit); then
the big file, read sequentially in 1 MiB reads, the same two ways. The source's pages are
dropped per file with POSIX_FADV_DONTNEED before each run, so the kernel's dentries and
inodes of the source stay, as they do for a dataset that was just listed, and other
processes on the machine keep their caches. It takes ``bench hits``'s options and dataset.
Figures are medians of ``--repeat`` runs, the two cases side by side in each run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coordlfs.bench import harness
from coordlfs.bench.hits import (
    Run,
    add_arguments,
    big_file,
    columns,
    cpu_seconds,
    evict,
    measure,
    prepare_dataset,
    settings_from,
    small_files,
)
from coordlfs.daemon.mounting import set_read_ahead
from coordlfs.testbed.mounts import mounted

__all__ = ["add_arguments", "run"]


def check_can_run() -> None:
    harness.require_root("bench misses", "mounts FUSE and sets the mount's read-ahead")
    harness.require_fuse()


def _cold(paths: list[str], readers: int, pid: int | None,
          read: list[str] | None = None) -> Run:
    """One run reading ``read`` (default: ``paths``) with the source's pages of ``paths``
    dropped first."""
    evict(paths)
    cpu = cpu_seconds(pid) if pid else 0.0
    run = measure(paths if read is None else read, readers)
    if pid:
        run.daemon_cpu_s = cpu_seconds(pid) - cpu
    return run


def _through_mount(source: Path, paths: list[str], rels: list[str], readers: int,
                   room: int, read_ahead_kb: int) -> Run:
    """One run through a fresh mount: every read a miss that fills the cache."""
    with tempfile.TemporaryDirectory(prefix="coordlfs-bench-misses-") as work:
        mnt = Path(work) / "mnt"
        with mounted(source, mnt, Path(work) / "coordlfs.log", "--cache-size", str(room),
                     "--max-file-size", str(room)) as mount:
            set_read_ahead(str(mnt), read_ahead_kb)
            # the source's pages only: the mount's are none yet, and dropping them would
            # open every file through it (a LOOKUP and an OPEN each) before the timed reads
            return _cold(paths, readers, mount.pid, [str(mnt / rel) for rel in rels])


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    check_can_run()
    dataset = prepare_dataset(settings.directory, settings.files, settings.size,
                              settings.big_size)
    os.sync()  # pages of a dataset just written are dirty, and no advice drops those
    source = Path(dataset.root)
    room = dataset.total_bytes + (64 << 20)
    big = big_file(dataset)
    cols = columns(settings.readers, big is not None)
    runs: dict[str, dict[int, list[Run]]] = {"source": {}, "coordlfs": {}}
    for number in harness.repeated(settings.repeat):
        for _label, key in cols:
            rels = small_files(dataset) if key else [str(big)]
            random.Random(number).shuffle(rels)
            paths = [str(source / rel) for rel in rels]
            readers = max(key, 1)
            runs["source"].setdefault(key, []).append(_cold(paths, readers, None))
            runs["coordlfs"].setdefault(key, []).append(
                _through_mount(source, paths, rels, readers, room, settings.read_ahead_kb))
    summary = _summary(runs, cols)
    harness.print_summary(summary)
    harness.write_report(settings.json_path, {
        "settings": {**asdict(settings), "readers": list(settings.readers)},
        "dataset": harness.dataset_record(dataset), "summary": summary,
        "runs": {case: {label: [asdict(r) | {"files_per_s": r.files_per_s}
                                for r in by_key[key]] for label, key in cols}
                 for case, by_key in runs.items()}})
    return 0


def _files_per_s(run: Run) -> float:
    return run.files_per_s


def _gb_per_s(run: Run) -> float:
    return run.gb_per_s


def _cpu_us_per_miss(run: Run) -> float | None:
    return None if run.daemon_cpu_s is None else run.daemon_cpu_s / run.files * 1e6


def _cpu_s_per_gb(run: Run) -> float | None:
    return None if run.daemon_cpu_s is None else run.daemon_cpu_s / (run.bytes / 1e9)


def _summary(runs: dict[str, dict[int, list[Run]]],
             cols: list[tuple[str, int]]) -> dict[str, Any]:
    """Per reader count: misses/s, the page cache's files/s, their ratio run by run and the
    daemon's CPU per miss; for the big file (``sequential``) the same in GB/s and CPU
    seconds per GB."""
    summary: dict[str, Any] = {}
    for label, key in cols:
        mine, theirs = runs["coordlfs"][key], runs["source"][key]
        unit, source_unit, rate, cpu_name, cpu = (
            ("misses_per_s", "files_per_s", _files_per_s, "cpu_us_per_miss", _cpu_us_per_miss)
            if key else ("gb_per_s", "gb_per_s", _gb_per_s, "cpu_s_per_gb", _cpu_s_per_gb))
        summary[f"{unit}_{label}"] = round(statistics.median(map(rate, mine)), 3)
        summary[f"page_cache_{source_unit}_{label}"] = round(
            statistics.median(map(rate, theirs)), 3)
        summary[f"misses_vs_page_cache_{label}"] = round(statistics.median(
            rate(a) / rate(b) for a, b in zip(mine, theirs, strict=True)), 3)
        costs = [c for c in map(cpu, mine) if c is not None]
        summary[f"daemon_{cpu_name}_{label}"] = round(statistics.median(costs), 3)
    return summary
