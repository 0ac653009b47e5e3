"""Cold-miss throughput: small files read once through a fresh mount, beside the page cache.

The first epoch of a job, and every file MinIO has no room for, is a miss: the daemon looks
the file up, opens it, reads it from storage (filling its cache) and answers. This benchmark
reads every small file of ``bench hits``'s dataset once, shuffled, split among 1 and 4 reader
processes doing os.open / os.readv to EOF / os.close, through a coordlfs mount whose cache is
empty (a new mount per run, with room for every file), and the same files straight from the
source with their pages dropped first (the page cache reading the source: the limit). The
source's pages are dropped per file with POSIX_FADV_DONTNEED before each run, so the kernel's
dentries and inodes of the source stay, as they do for a dataset that was just listed, and
other processes on the machine keep their caches. Figures are medians of ``--repeat`` runs,
the two cases side by side in each run.
"""

from __future__ import annotations

import argparse
import contextlib
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
    check_can_run,
    cpu_seconds,
    evict,
    measure,
    parse_readers,
    prepare_dataset,
    small_files,
)
from coordlfs.errors import UserError
from coordlfs.sizes import parse_size
from coordlfs.testbed.mounts import mounted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, default=2000,
                        help="number of small files (default 2000)")
    parser.add_argument("--size", default="112K", help="size of each small file (default 112K)")
    parser.add_argument("--readers", default="1,4",
                        help="comma-separated reader process counts (default 1,4)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs per figure; the median is reported (default 5)")
    parser.add_argument("--dir", help="dataset directory, on disk; the same as bench hits' "
                                      "(default: coordlfs-bench-hits in the temp directory)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def _cold(paths: list[str], readers: int, pid: int | None) -> Run:
    """One run with the source's pages of ``paths`` dropped first."""
    evict(paths)
    cpu = cpu_seconds(pid) if pid else 0.0
    run = measure(paths, readers)
    if pid:
        run.daemon_cpu_s = cpu_seconds(pid) - cpu
    return run


def _through_mount(source: Path, paths: list[str], rels: list[str], readers: int,
                   room: int) -> Run:
    """One run through a fresh mount: every read a miss that fills the cache."""
    with tempfile.TemporaryDirectory(prefix="coordlfs-bench-misses-") as work:
        mnt = Path(work) / "mnt"
        with mounted(source, mnt, Path(work) / "coordlfs.log", "--cache-size", str(room),
                     "--max-file-size", str(room)) as mount:
            evict(paths)
            return _cold([str(mnt / rel) for rel in rels], readers, mount.pid)


def run(args: argparse.Namespace) -> int:
    check_can_run()
    readers = parse_readers(args.readers)
    if args.files < 1 or args.repeat < 1:
        raise UserError("bad --files or --repeat: need at least 1")
    size = parse_size(args.size, "--size")
    directory = os.path.abspath(args.dir or os.path.join(tempfile.gettempdir(),
                                                         "coordlfs-bench-hits"))
    dataset = prepare_dataset(directory, args.files, size, 0)
    source = Path(dataset.root)
    room = dataset.total_bytes + (64 << 20)
    runs: dict[str, dict[int, list[Run]]] = {"source": {}, "coordlfs": {}}
    for number in harness.repeated(args.repeat):
        for count in readers:
            rels = small_files(dataset)
            random.Random(number).shuffle(rels)
            paths = [str(source / rel) for rel in rels]
            runs["source"].setdefault(count, []).append(_cold(paths, count, None))
            runs["coordlfs"].setdefault(count, []).append(
                _through_mount(source, paths, rels, count, room))
    summary = _summary(runs, readers)
    harness.print_summary(summary)
    harness.write_report(args.json, {
        "settings": {**harness.plain_settings(args), "readers": list(readers)},
        "dataset": harness.dataset_record(dataset), "summary": summary,
        "runs": {case: {str(n): [asdict(r) | {"files_per_s": r.files_per_s} for r in rs]
                        for n, rs in by_readers.items()}
                 for case, by_readers in runs.items()}})
    return 0


def _summary(runs: dict[str, dict[int, list[Run]]], readers: tuple[int, ...]) -> dict[str, Any]:
    """Per reader count: misses/s, the page cache's files/s, their ratio run by run, and the
    daemon's CPU per miss."""
    summary: dict[str, Any] = {}
    for count in readers:
        mine, theirs = runs["coordlfs"][count], runs["source"][count]
        summary[f"misses_per_s_{count}"] = round(statistics.median(r.files_per_s for r in mine))
        summary[f"page_cache_files_per_s_{count}"] = round(
            statistics.median(r.files_per_s for r in theirs))
        summary[f"misses_vs_page_cache_{count}"] = round(statistics.median(
            a.files_per_s / b.files_per_s for a, b in zip(mine, theirs, strict=True)), 3)
        with contextlib.suppress(statistics.StatisticsError):
            summary[f"daemon_cpu_us_per_miss_{count}"] = round(statistics.median(
                r.daemon_cpu_s / r.files * 1e6 for r in mine if r.daemon_cpu_s is not None))
    return summary
