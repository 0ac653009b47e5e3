"""A large file the cache will not keep, read through the mount beside the source read directly.

A file above ``--max-file-size`` (or any file of a mount with ``--cache-size 0``) is never
cached: with FUSE passthrough the open is answered with the source file itself as its backing
and the kernel reads it as it reads the source (issue 33, item 3); without it the daemon
streams it (``coordlfs.fs.readers.StreamReader``). fio reads the file (1 MiB sequential and 4
KiB random reads, ``psync``, as ``coordlfs.bench.bigfile`` does) from the source directly,
through coordlfs with passthrough and through coordlfs classic (``--passthrough no``), one
after the other in each repeat (their order rotated run by run), each cold: the file's pages
are dropped before every run (``POSIX_FADV_DONTNEED`` on the source file and on the mounts'
file, not the machine's whole page cache). Random runs read for ``SECONDS`` (and sequential
ones when warm); a cold sequential run reads the file once. On a virtual machine the host
caches the disk too, and a run right after another read the file faster (seen here: 500 ->
2,200 MB/s over six alternated cold reads): so before every run the whole file is read once
with ``O_DIRECT`` (past the page cache), and each run starts from the same state, the disk's
cache warm and the page cache cold. With ``--warm`` the file is in the page cache instead (read
once through the source before every run, each mount's own pages dropped): the disk out of the
figures, what is left is the read path itself. Ratios are taken run by run against the source
read in the same repeat, and their medians reported, with the daemon's CPU time per run. The
goal: coordlfs with passthrough >= 0.9x the source in every pattern and reader count.

    coordlfs bench uncached [--size 768M] [--readers 1,4] [--why max-file-size|no-cache]
        [--warm] [--seconds 5] [--repeat 3] [--work DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coordlfs.bench import bigfile, harness
from coordlfs.bench.fio import fio_report
from coordlfs.bench.fio import summarize as summarize_fio
from coordlfs.bench.hits import cpu_seconds, evict, parse_readers
from coordlfs.errors import UserError
from coordlfs.sizes import format_size, parse_size
from coordlfs.testbed.mounts import mounted

DEFAULT_WORK = "/var/tmp/coordlfs-uncached"
#: The systems, each read the same way; "source" is the file read directly.
SYSTEMS = ("source", "coordlfs_pt", "coordlfs")
LABELS = {"source": "source (direct)", "coordlfs_pt": "coordlfs passthrough",
          "coordlfs": "coordlfs classic"}
#: The goal for coordlfs with passthrough, as a share of the source read directly.
GOAL = 0.9
#: Why the cache does not keep the file: the mount's options for it.
WHY = {"max-file-size": ("--cache-size", "256M", "--max-file-size", "64M"),
       "no-cache": ("--cache-size", "0")}
#: Seconds a timed fio run reads by default (random reads; sequential ones too when warm).
SECONDS = 5
#: Bytes written at a time when the file is made, and read at a time to level each run.
WRITE_CHUNK = 16 << 20
LEVEL_CHUNK = 8 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="768M", help="the file's size (default 768M)")
    parser.add_argument("--readers", default="1,4",
                        help="reader processes, comma-separated (default 1,4)")
    parser.add_argument("--why", choices=list(WHY), default="max-file-size",
                        help="why the cache does not keep it: above --max-file-size (the "
                             "default) or a mount with --cache-size 0")
    parser.add_argument("--warm", action="store_true",
                        help="read with the file in the page cache (default: cold, the disk's "
                             "cache warm)")
    parser.add_argument("--seconds", type=int, default=SECONDS,
                        help=f"seconds of each random run, and of each sequential run when "
                             f"warm (default {SECONDS})")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of every system; medians are reported (default 3)")
    parser.add_argument("--work", default=DEFAULT_WORK,
                        help=f"work directory on disk, for the file and the mounts "
                             f"(default {DEFAULT_WORK})")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


def run(args: argparse.Namespace) -> int:
    size = parse_size(args.size, "--size")
    readers = parse_readers(args.readers)
    if size < 1 << 20 or args.repeat < 1 or args.seconds < 1:
        raise UserError("bench uncached: --size must be at least 1M, --repeat and --seconds "
                        "at least 1")
    harness.require_root("bench uncached", "mounts FUSE with passthrough")
    harness.require_fuse()
    why = bigfile.unavailable()
    if why is not None:
        raise UserError(f"bench uncached: {why}")
    work = harness.work_dir(args.work)
    with harness.claimed(work, "bench uncached"):
        source = _the_file(work / "source", size)
        print(f"file {source}: {format_size(size)}, not cached ({args.why}); readers "
              f"{','.join(map(str, readers))}; {'warm' if args.warm else 'cold'}", flush=True)
        with _mounts(work, source.parent, WHY[args.why]) as mounts:
            runs = _measure(mounts, source, size, readers, args.repeat, work,
                            args.seconds if args.warm else 0, args.seconds)
    summary = summarize(runs, readers)
    print(format_table(summary, readers))
    print(f"goal: coordlfs passthrough >= {GOAL}x the source everywhere: "
          f"{'met' if summary['goal_met'] else 'missed'}")
    harness.write_report(args.json, {"settings": harness.plain_settings(args),
                                     "load_average": os.getloadavg(),
                                     "file_bytes": size, "summary": summary})
    return 0


def _the_file(directory: Path, size: int) -> Path:
    """``directory/big.bin`` of ``size`` random bytes, made unless it is there already."""
    directory.mkdir(exist_ok=True)
    path = directory / "big.bin"
    if not path.exists() or path.stat().st_size != size:
        with open(path, "wb") as f:
            for start in range(0, size, WRITE_CHUNK):
                f.write(os.urandom(min(WRITE_CHUNK, size - start)))
    return path


@contextlib.contextmanager
def _mounts(work: Path, source: Path, options: tuple[str, ...]
            ) -> Iterator[dict[str, tuple[Path, int | None]]]:
    """Each system's directory and its daemon's pid (None: the source read directly), with
    both coordlfs mounts up until the block ends."""
    found: dict[str, tuple[Path, int | None]] = {"source": (source, None)}
    with contextlib.ExitStack() as stack:
        for system, flag in (("coordlfs_pt", "yes"), ("coordlfs", "no")):
            mount = stack.enter_context(mounted(
                source, work / f"mnt-{system}", work / f"{system}.log", *options,
                "--passthrough", flag))
            found[system] = (mount.mountpoint, mount.pid)
        yield found


def _measure(mounts: dict[str, tuple[Path, int | None]], source: Path, size: int,
             readers: tuple[int, ...], repeat: int, scratch: Path, sequential_s: int,
             random_s: int) -> list[dict[str, dict[str, Any]]]:
    """Per repeat, per measurement key: each system's GB/s and daemon CPU seconds. A
    sequential run reads for ``sequential_s`` seconds, or once through the file if 0 (cold:
    the page cache is warm after a pass)."""
    runs = []
    for number in harness.repeated(repeat):
        order = SYSTEMS[number % len(SYSTEMS):] + SYSTEMS[:number % len(SYSTEMS)]
        run: dict[str, dict[str, Any]] = {}
        for pattern in bigfile.PATTERNS:
            for count in readers:
                cell = run.setdefault(bigfile.key(pattern, count), {})
                for system in order:
                    directory, pid = mounts[system]
                    _level(source, [str(mounts[s][0] / source.name) for s in SYSTEMS],
                           warm=sequential_s > 0)
                    cpu = cpu_seconds(pid) if pid is not None else 0.0
                    rate = _fio(str(directory / source.name), pattern, count, size, scratch,
                                sequential_s if pattern.rw == "read" else random_s)
                    cell[system] = {"gb_per_s": rate, "daemon_cpu_s": None if pid is None
                                    else round(cpu_seconds(pid) - cpu, 4)}
        runs.append(run)
    return runs


def _fio(path: str, pattern: bigfile.Pattern, readers: int, size: int, scratch: Path,
         seconds: int) -> float:
    """One fio run of ``bigfile``'s (GB/s of all readers); for ``seconds`` whatever it reads,
    unless 0, so that a fast run is not over before the scheduler has been fair to it and a
    slow one (4 KiB random reads through the daemon, 10 MB/s) is not a minute long."""
    # No hint: fio's posix_fadvise (RANDOM: no read-ahead) reaches the source file read
    # directly, but through passthrough only the FUSE file, never its backing (Linux 6.18):
    # with it the two would not read alike
    argv = [*bigfile.argv(path, pattern, readers, size), "--fadvise_hint=0"]
    if seconds:
        argv += ["--time_based", f"--runtime={seconds}"]
    report = fio_report(argv, dict(os.environ), scratch, bigfile.RUNTIME + bigfile.SLACK,
                        f"fio {pattern.name} x{readers} of {path}")
    return summarize_fio(report, pattern.name)["bw_bytes"] / 1e9


def _level(source: Path, paths: list[str], warm: bool) -> None:
    """The same start for every run: ``source`` read whole past the page cache (``O_DIRECT``:
    whatever the disk or the host caches of it is warm), then the file's pages dropped at
    each of ``paths`` (the source's, and each mount's own); ``warm``: then read whole into
    the page cache, through the source."""
    _read_whole(source, os.O_DIRECT)
    evict(paths)
    if warm:
        _read_whole(source, 0)


def _read_whole(source: Path, flags: int) -> None:
    fd = os.open(source, os.O_RDONLY | flags)
    try:
        buffer = mmap.mmap(-1, LEVEL_CHUNK)
        with buffer:
            while os.readv(fd, [buffer]) == LEVEL_CHUNK:
                pass
    finally:
        os.close(fd)


def summarize(runs: list[dict[str, dict[str, Any]]], readers: tuple[int, ...]
              ) -> dict[str, Any]:
    """Per key and system: the median GB/s, the median of the run-by-run ratios to the source
    and the median daemon CPU seconds; whether passthrough met the goal everywhere."""
    keys = [bigfile.key(p, n) for p in bigfile.PATTERNS for n in readers]
    cells: dict[str, dict[str, Any]] = {}
    for k in keys:
        cells[k] = {}
        for system in SYSTEMS:
            measured = [run[k][system] for run in runs]
            cells[k][system] = {
                "gb_per_s": round(statistics.median(m["gb_per_s"] for m in measured), 4),
                "vs_source": round(statistics.median(
                    m["gb_per_s"] / run[k]["source"]["gb_per_s"]
                    for m, run in zip(measured, runs, strict=True)), 3),
                "daemon_cpu_s": None if system == "source" else round(statistics.median(
                    m["daemon_cpu_s"] for m in measured), 4),
                "runs_gb_per_s": [round(m["gb_per_s"], 4) for m in measured]}
    met = all(cells[k]["coordlfs_pt"]["vs_source"] >= GOAL for k in keys)
    return {"cells": cells, "goal": GOAL, "goal_met": met}


def format_table(summary: dict[str, Any], readers: tuple[int, ...]) -> str:
    """A row per system: MB/s and the share of the source per pattern and reader count, and
    the daemon's CPU seconds per run."""
    keys = [bigfile.key(p, n) for p in bigfile.PATTERNS for n in readers]
    head = f"{'':<22}" + "".join(f" | {k.replace('_', ' x'):>22}" for k in keys)
    lines = [head, f"{'':<22}" + f" | {'MB/s':>7} {'x src':>6} {'cpu s':>7}" * len(keys),
             "-" * len(head)]
    for system in SYSTEMS:
        row = f"{LABELS[system]:<22}"
        for k in keys:
            cell = summary["cells"][k][system]
            cpu = "-" if cell["daemon_cpu_s"] is None else f"{cell['daemon_cpu_s']:.2f}"
            row += f" | {1000 * cell['gb_per_s']:>7.1f} {cell['vs_source']:>6.2f} {cpu:>7}"
        lines.append(row)
    return "\n".join(lines)
