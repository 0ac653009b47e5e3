"""Listing a huge directory: ``ls`` through a mount beside ``ls`` of the source.

A directory of ``--entries`` empty files (ImageNet-like names) is made once in the work
directory and kept for later runs. Each run times, as a user runs them, ``ls DIR``, ``ls -f
DIR`` and ``find DIR`` (and ``ls -l DIR`` with ``--long``), output to /dev/null, on the
source and through a coordlfs mount of it, side by side (their order alternating from run to
run); figures are medians of ``--repeat`` runs and the mount/source ratios. Warm by default:
an untimed listing of each first, so the source's directory blocks are cached and the daemon
has started; ``--cold`` drops the caches before every timed command instead. While the mount
lists, the daemon's anonymous memory (RssAnon) is sampled: its peak above the start shows
what a listing holds. One more pass through the mount with os.scandir checks the names
byte for byte against the source's and times each tenth of the directory (a steady rate
keeps the slowest tenth near the fastest).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import stat
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coordlfs.bench import harness
from coordlfs.bench.overhead import _rss as rss_anon
from coordlfs.errors import UserError
from coordlfs.testbed.mounts import mounted
from coordlfs.testbed.storage import drop_caches

#: name -> argv before the directory
COMMANDS = {"ls": ["ls"], "ls -f": ["ls", "-f"], "find": ["find"]}
LONG = {"ls -l": ["ls", "-l"]}
#: Seconds between samples of the daemon's memory while it lists.
SAMPLE_S = 0.02
TENTHS = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--entries", type=int, default=1_000_000,
                        help="entries in the directory (default 1000000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs to take medians of (3)")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page, dentry and inode caches before every timed command")
    parser.add_argument("--long", action="store_true", help="also time ls -l")
    parser.add_argument("--work", default="/var/tmp/coordlfs-listing",
                        help="work directory: the directory made, the mount (default "
                             "/var/tmp/coordlfs-listing)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def entry_name(i: int) -> bytes:
    return b"n%08d_%d.JPEG" % (i // 1300, i % 1300)


def make_directory(work: Path, entries: int) -> Path:
    """``work/src/<entries>``, made unless a complete one is there (its marker beside it)."""
    directory = work / "src" / str(entries)
    done = work / "src" / f"{entries}.complete"
    if done.exists():
        return directory
    print(f"making {entries} entries in {directory}", flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(entries):
            with contextlib.suppress(FileExistsError):  # a killed run's
                os.mknod(entry_name(i), stat.S_IFREG | 0o644, dir_fd=fd)
    finally:
        os.close(fd)
    done.touch()
    return directory


def key_of(command: str) -> str:
    """The report's name of a command: "ls -f" -> "ls_f"."""
    return command.replace(" -", "_")


def timed(argv: list[str], directory: Path) -> float:
    """Seconds ``argv directory > /dev/null`` took."""
    start = time.perf_counter()
    subprocess.run([*argv, str(directory)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


@contextlib.contextmanager
def peak_rss(pid: int) -> Iterator[list[int]]:
    """The daemon's RssAnon at the start and its peak while the block runs: [start, peak]."""
    seen = [rss_anon(pid)] * 2
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_S):
            seen[1] = max(seen[1], rss_anon(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join()
        seen[1] = max(seen[1], rss_anon(pid))


def scan_tenths(directory: Path, entries: int) -> tuple[list[bytes], list[float]]:
    """The names os.scandir lists and entries per second in each tenth of the listing."""
    names: list[bytes] = []
    marks = [time.perf_counter()]
    step = max(1, entries // TENTHS)
    with os.scandir(os.fsencode(directory)) as it:
        for entry in it:
            names.append(entry.name)
            if len(names) % step == 0:
                marks.append(time.perf_counter())
    return names, [step / (b - a) for a, b in itertools.pairwise(marks) if b > a]


def side_by_side(commands: dict[str, list[str]], sides: dict[str, Path], number: int,
                 cold: bool, times: dict[str, dict[str, list[float]]]) -> None:
    """Run ``number``: each command on both sides, in an order that alternates by run."""
    order = ("source", "mount") if number % 2 else ("mount", "source")
    for name, argv in commands.items():
        for side in order:
            if cold:
                drop_caches()
            times.setdefault(name, {"source": [], "mount": []})[side].append(
                timed(argv, sides[side]))


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    source = make_directory(work, args.entries)
    long = LONG if args.long else {}
    times: dict[str, dict[str, list[float]]] = {}
    # each of ours counts twice (drop_pagecache, drop_slab)
    drops = harness.drop_count() + (len(COMMANDS | long) * 2 * args.repeat * 2 if args.cold
                                    else 0)
    with mounted(source.parent, work / "mnt", work / "mount.log", "--cache-size", "64M") as m:
        listed = m.mountpoint / source.name
        sides = {"source": source, "mount": listed}
        if not args.cold:
            for directory in sides.values():
                timed(["ls", "-f"], directory)
        with peak_rss(m.pid) as rss:  # before ls -l, whose stats make the kernel hold inodes
            for number in harness.repeated(args.repeat):
                side_by_side(COMMANDS, sides, number, args.cold, times)
        names, rates = scan_tenths(listed, args.entries)
        for number in range(1, args.repeat + 1) if long else ():
            side_by_side(long, sides, number, args.cold, times)
    if sorted(names) != sorted(os.listdir(os.fsencode(source))):
        raise UserError("bench listing: the mount listed other names than the source")
    summary: dict[str, Any] = {}
    for name, runs in times.items():
        key = key_of(name)
        source_s, mount_s = (statistics.median(runs[s]) for s in ("source", "mount"))
        summary[f"{key}_source_s"] = round(source_s, 3)
        summary[f"{key}_mount_s"] = round(mount_s, 3)
        summary[f"{key}_ratio"] = round(mount_s / source_s, 2)
        summary[f"{key}_source_runs"], summary[f"{key}_mount_runs"] = runs["source"], runs["mount"]
    summary.update({
        "daemon_rss_start_bytes": rss[0],
        "daemon_rss_peak_bytes": rss[1],
        "daemon_rss_growth_bytes_per_entry": round((rss[1] - rss[0]) / args.entries, 2),
        "scan_entries_per_s_slowest_tenth": round(min(rates)),
        "scan_entries_per_s_fastest_tenth": round(max(rates)),
        "scan_rate_steadiness": round(min(rates) / max(rates), 2),
        "names_match": True,
        "caches_dropped_by_others": harness.drop_count() - drops,
    })
    return summary


def run(args: argparse.Namespace) -> int:
    if args.entries <= 0 or args.repeat <= 0:
        raise UserError("--entries and --repeat must be positive")
    harness.require_root("bench listing", "mounts FUSE" + (" and drops caches" if args.cold
                                                          else ""))
    harness.require_fuse()
    work = harness.work_dir(args.work)
    with harness.claimed(work, "bench listing"):
        summary = measure(args, work)
    cache_state = "cold (caches dropped before each command)" if args.cold else "warm"
    print(f"{args.entries} entries, {cache_state}, medians of {args.repeat}; "
          f"locale {os.environ.get('LC_ALL') or os.environ.get('LANG') or 'unset'}")
    print(f"{'command':8} {'source s':>9} {'mount s':>9} {'ratio':>6}")
    for name in COMMANDS | (LONG if args.long else {}):
        key = key_of(name)
        print(f"{name:8} {summary[f'{key}_source_s']:9.3f} {summary[f'{key}_mount_s']:9.3f} "
              f"{summary[f'{key}_ratio']:6.2f}")
    print(f"daemon RssAnon {summary['daemon_rss_start_bytes'] / 2**20:.1f} MiB at start, "
          f"peak {summary['daemon_rss_peak_bytes'] / 2**20:.1f} MiB while listing")
    print(f"os.scandir through the mount: {summary['scan_entries_per_s_slowest_tenth']} to "
          f"{summary['scan_entries_per_s_fastest_tenth']} entries/s per tenth")
    harness.write_report(args.json, {"settings": harness.plain_settings(args),
                                     "locale": os.environ.get("LC_ALL") or os.environ.get("LANG"),
                                     "summary": summary})
    return 0
