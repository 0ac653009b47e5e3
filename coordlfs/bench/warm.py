"""Warming a dataset cold: ``coordlfs warm`` against ``cat`` and ``vmtouch -t``.

Before a job, a dataset can be read once so that the job's first epoch finds it in memory:
the page cache's own way is to read every file (``cat`` of all of them into /dev/null, one
process for many files through ``xargs``) or to touch their pages (``vmtouch -t``, packaged
by Debian); coordlfs's is ``coordlfs warm MOUNT``, which fills the mount's cache in bulk
(no FUSE request per file). This benchmark runs the three side by side on the demo's dataset
(``coordlfs.bench.demo``'s, made or reused in its directory), each cold: a fresh mount with
room for everything for the warm (mounted first, so that only the warm is timed), the kernel's
caches dropped (page cache, dentries and inodes) right before each. A run times the whole
command as a user would wait for it (its start-up and, for the warm, its listing of the
mount included); the rate is the dataset's bytes over that time. Figures are medians of
``--repeat`` runs, the three alternated in each; ratios are taken run by run. The goal
(issue 25): ``coordlfs warm`` at least 0.8x ``cat``'s rate.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from coordlfs.bench import harness
from coordlfs.bench.demo import DEFAULT_DIR, prepare
from coordlfs.errors import UserError
from coordlfs.sizes import format_size
from coordlfs.testbed.mounts import mounted
from coordlfs.testbed.storage import drop_caches

#: The ways compared, in the order each run takes them.
WAYS = ("cat", "vmtouch", "coordlfs")
#: Seconds one way may take before the run is given up.
TIMEOUT_S = 3600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, default=3000,
                        help="files in the demo's dataset (default 3000, about 330 MB)")
    parser.add_argument("--work", default=DEFAULT_DIR,
                        help=f"work directory on a disk, the demo's by default, whose dataset "
                             f"is reused ({DEFAULT_DIR})")
    parser.add_argument("--seed", type=int, default=0, help="the dataset's seed (default 0)")
    parser.add_argument("--repeat", type=int, default=3, help="runs; medians are reported "
                                                              "(default 3)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


def run(args: argparse.Namespace) -> int:
    if args.files < 2 or args.repeat < 1:
        raise UserError("bench warm: --files must be at least 2 and --repeat at least 1")
    harness.require_root("bench warm", "drops the kernel's caches and mounts FUSE")
    harness.require_fuse()
    vmtouch = shutil.which("vmtouch")
    if vmtouch is None:
        print("bench warm: vmtouch not found (scripts/setup installs it); compared with cat "
              "only", flush=True)
    workdir = harness.work_dir(args.work)
    with harness.claimed(workdir, "bench warm"):
        dataset = prepare(args, workdir)
        print(harness.describe_dataset(dataset), flush=True)
        paths = [str(dataset.root / rel) for rel, _size in dataset.files]
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
        for _number in harness.repeated(args.repeat):
            runs["cat"].append(_timed(["xargs", "-0", "cat"], "\0".join(paths)))
            if vmtouch is not None:
                runs["vmtouch"].append(_timed([vmtouch, "-t", "-q", str(dataset.root)], None))
            runs["coordlfs"].append(_warm(dataset.root, workdir, dataset.total_bytes))
    summary = _summary(runs, dataset.total_bytes)
    harness.print_summary(summary)
    harness.write_report(args.json, {
        "settings": harness.plain_settings(args), "dataset": harness.dataset_record(dataset),
        "summary": summary, "runs": runs})
    return 0


def _timed(argv: list[str], stdin: str | None) -> dict[str, Any]:
    """Run ``argv`` cold (stdout to /dev/null); its wall seconds."""
    drop_caches()
    start = time.perf_counter()
    result = subprocess.run(argv, input=stdin, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise UserError(f"bench warm: {argv[0]} failed: {result.stderr.strip()[:200]}")
    return {"seconds": round(seconds, 4)}


def _warm(source: Path, workdir: Path, total: int) -> dict[str, Any]:
    """``coordlfs warm`` of a fresh mount of ``source``, cold; its wall seconds, its own
    summary, and what the cache holds after it."""
    with tempfile.TemporaryDirectory(prefix="coordlfs-bench-warm-", dir=workdir) as work:
        log = Path(work) / "coordlfs.log"
        with mounted(source, Path(work) / "mnt", log, "--cache-size",
                     str(total + (64 << 20))) as mount:
            drop_caches()
            start = time.perf_counter()
            result = subprocess.run(
                [sys.executable, "-m", "coordlfs", "warm", "--json", str(mount.mountpoint)],
                capture_output=True, text=True, timeout=TIMEOUT_S)
            seconds = time.perf_counter() - start
            if result.returncode != 0:
                raise UserError(f"bench warm: coordlfs warm failed: {result.stderr.strip()} "
                                f"(log: {harness.log_tail(str(log))})")
            cache = mount.status()["cache"]
    return {"seconds": round(seconds, 4), "warm": json.loads(result.stdout),
            "cached_files": cache["files"], "cached_bytes": cache["bytes"]}


def _summary(runs: dict[str, list[dict[str, Any]]], total: int) -> dict[str, Any]:
    """Per way its median rate (MB/s of the dataset's bytes) and seconds; the warm's rate
    against each other way's, as the median of the runs' ratios."""
    summary: dict[str, Any] = {}
    rates = {way: [total / r["seconds"] for r in done] for way, done in runs.items() if done}
    for way, rate in rates.items():
        summary[f"{way}_mb_per_s"] = round(statistics.median(rate) / 1e6, 1)
        summary[f"{way}_seconds"] = round(statistics.median(
            r["seconds"] for r in runs[way]), 3)
    for other in ("cat", "vmtouch"):
        if other in rates:
            summary[f"warm_vs_{other}"] = round(statistics.median(
                a / b for a, b in zip(rates["coordlfs"], rates[other], strict=True)), 3)
    summary["warm_cached_all"] = all(r["cached_bytes"] >= total for r in runs["coordlfs"])
    summary["dataset"] = format_size(total)
    return summary
