"""What every benchmark does around its measurement, written once.

A benchmark checks it may run (root), makes its work directory and removes what a killed
run left there (its cgroups), takes its dataset (``--dir``, or one made with ``--make``),
runs ``--repeat`` times and writes its report (``--json``). The training replays
(``epochs``, ``aligned``, ``stagger``, ``cluster``) also share their options and the memory a
mount needs beside its cache. Each benchmark module keeps only what it measures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coordlfs.bench.locking import exclusive
from coordlfs.errors import UserError
from coordlfs.sizes import format_size, parse_size
from coordlfs.system.private_dir import open_private
from coordlfs.testbed.cgroup import remove_stale
from coordlfs.testbed.dataset import Dataset, DatasetSpec, ensure_dataset
from coordlfs.testbed.mounts import unmount_if_mounted

#: What a training replay does that needs root.
TRAINING_NEEDS = "drops the page cache, makes memory and blkio cgroups and mounts FUSE"

#: Daemon memory the cache must leave room for, from ``coordlfs bench overhead``: about 0.5
#: KiB per inode and 1.1 KiB per cached file, so 2 KiB per file is safe; plus a fixed part.
#: The fixed part grew with the batched fills and the published index (issue 13): a cold
#: epoch of 10,000 files through a mount peaked at 46 MiB anonymous memory (26 MiB beyond the
#: per-file part) and 3 MiB of index beside the arena, and under a budget's pressure the
#: daemon held 64 MiB; with 8 MiB, ``bench epochs --budget 0.5`` had the daemon killed.
DAEMON_BYTES_PER_FILE = 2048
DAEMON_BASE_BYTES = 48 << 20
#: Kernel memory per cached file, charged to the daemon's cgroup beside the cached pages:
#: each entry is a tmpfs file (an inode and a dentry, 944 bytes measured on Linux 6.18), and
#: with passthrough the backing file the kernel keeps open for it (a struct file: the filp
#: slab grew 193 bytes per cached file opened by passthrough, 4,000 files; and the backing's
#: own small record).
KERNEL_BYTES_PER_CACHED_FILE = 1280
#: What a mount costs per file of its dataset beside the cached bytes: daemon and kernel
MOUNT_BYTES_PER_FILE = DAEMON_BYTES_PER_FILE + KERNEL_BYTES_PER_CACHED_FILE
#: Room per reader for the kernel's pages of reads in flight and the source's metadata, above
#: the cache, in ``bench aligned``'s budget (both systems get it). 1.1 GiB, budget 50%, 4
#: readers, arena cache: with 4 MiB per reader, epochs 2 and 3 read 0.61 / 0.59 of the
#: dataset (0.55 expected from the capacity), and the daemon's process read 20% more from
#: storage than the file bytes it fetched (the source's metadata, reclaimed and read again);
#: 6 MiB read exactly the uncached rest (0.558), as did 8. ``bench epochs`` splits its budget
#: by measured figures instead: the source's blocks its lookups read (3.6 MiB at 10,000
#: files) and each reader's largest file in flight (``epochs.Sizing``, 2026-11-29).
PAGE_HEADROOM_PER_READER = 6 << 20
#: More room per reader that reads through ``coordlfs.client`` in ``bench cluster``, which
#: adds it to every system's budget alike (so it favours none). ``bench epochs`` splits the
#: mount's budget by what such a reader was measured to hold instead
#: (``epochs.Sizing.client_reader_bytes``: 2-3 MiB, 2026-11-29).
CLIENT_HEADROOM_PER_READER = 16 << 20


def require_root(name: str, needs: str) -> None:
    """``name`` (such as "bench epochs") needs root because it ``needs``: one line if not."""
    if os.geteuid() != 0:
        raise UserError(f"{name} needs root: it {needs}")


def require_fuse() -> None:
    """This machine can mount FUSE filesystems: /dev/fuse and fusermount3; one line if not."""
    if not os.path.exists("/dev/fuse"):
        raise UserError("/dev/fuse does not exist: this machine cannot mount FUSE filesystems")
    if shutil.which("fusermount3") is None:
        raise UserError("fusermount3 not found (install the fuse3 package)")


def work_dir(path: str, cgroups: str | None = None) -> Path:
    """The work directory, made (0700) if missing, else ours alone (``private_dir``: the
    defaults are predictable names in /var/tmp, where another user could have made it and
    planted links where the run writes its dataset); a killed run's cgroups named
    ``cgroups-<pid>`` removed first, since only a later run can."""
    found = open_private(path, "remove it or give another work directory")
    os.close(found.fd)
    work = Path(found.path)
    if cgroups is not None:
        remove_stale(cgroups)
    return work


@contextlib.contextmanager
def claimed(work: Path, what: str, cgroups: str | None = None) -> Iterator[None]:
    """Hold ``work`` for one run of ``what`` at a time; what a killed run left in it (its mount
    at ``work/mnt``, its cgroups named ``cgroups-<pid>``) is ours to take down first."""
    with exclusive(work, what):
        unmount_if_mounted(work / "mnt")
        if cgroups is not None:
            remove_stale(cgroups)
        yield


def repeated(count: int) -> Iterator[int]:
    """Run numbers 1..count, each announced, for the ``--repeat`` runs medians are taken of."""
    for number in range(1, count + 1):
        print(f"run {number} of {count}", flush=True)
        yield number


def drop_count() -> int:
    """How often anyone wrote /proc/sys/vm/drop_caches since boot: a measurement during
    which another process (a test suite) dropped the caches measured something else."""
    with open("/proc/vmstat") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("drop_"))


def print_summary(summary: dict[str, Any]) -> None:
    """The summary's figures, one ``key value`` a line (the per-run lists stay in the JSON)."""
    for key, value in summary.items():
        if not key.endswith("_runs"):
            print(f"{key} {value}")


def log_tail(log: str, lines: int = 5) -> str:
    """The last lines of a daemon's log on one line, for a one-line error ("" if unreadable)."""
    try:
        with open(log, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:])
    except OSError:
        return ""


def write_report(path: str | None, report: dict[str, Any]) -> None:
    """``--json``: the report, if a file was asked for."""
    if path:
        Path(path).write_text(json.dumps(report, indent=1) + "\n")


def plain_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options as given, for a report: the scalar ones."""
    return {k: v for k, v in vars(args).items() if isinstance(v, int | float | str | None)}


def describe_dataset(dataset: Dataset) -> str:
    return f"dataset {dataset.root}: {len(dataset.files)} files, " \
           f"{format_size(dataset.total_bytes)}"


def dataset_record(dataset: Dataset) -> dict[str, Any]:
    return {"root": str(dataset.root), "files": len(dataset.files),
            "bytes": dataset.total_bytes}


def describe_throttle(throttle: int | None) -> str:
    return f"{format_size(throttle)}/s" if throttle else "none"


# -- the training replays' options and dataset ---------------------------------------------

def add_dataset_arguments(parser: argparse.ArgumentParser, name: str, make: str) -> None:
    """``--dir`` or ``--make N:SIZE`` (default ``make``) in ``--work`` (/var/tmp/coordlfs-NAME)."""
    parser.add_argument("--dir", help="an existing dataset directory (default: generate one "
                                      "with --make in the work directory)")
    parser.add_argument("--make", default=make, metavar="N:SIZE",
                        help=f"generate N files of mean SIZE (lognormal spread below 1M, equal "
                             f"shard files from 1M up; default {make})")
    parser.add_argument("--work", default=f"/var/tmp/coordlfs-{name}",
                        help="work directory on disk for generated data and the mount")


def add_training_arguments(parser: argparse.ArgumentParser, readers: int, readers_help: str,
                           compute_ms: float) -> None:
    """The options every training replay shares (``epochs``, ``aligned``, ``cluster``)."""
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--readers", type=int, default=readers,
                        help=f"{readers_help} (default {readers})")
    parser.add_argument("--batch", type=int, default=32, help="files per batch (default 32)")
    parser.add_argument("--compute-ms", type=float, default=compute_ms,
                        help=f"emulated GPU time per batch (default {compute_ms:g}; 0: read as "
                             "fast as possible)")
    parser.add_argument("--seed", type=int, default=0)
    add_throttle_argument(parser)
    parser.add_argument("--repeat", type=int, default=1, help="runs; medians are reported")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


def add_throttle_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--throttle", default="50M",
                        help="storage read limit per second, or none (default 50M)")


def check_training_arguments(args: argparse.Namespace) -> None:
    for name in ("epochs", "readers", "batch", "repeat"):
        if getattr(args, name) < 1:
            raise UserError(f"bad --{name} {getattr(args, name)}: need at least 1")
    if args.compute_ms < 0:
        raise UserError(f"bad --compute-ms {args.compute_ms}: must not be negative")


def parse_throttle(text: str) -> int | None:
    """``--throttle``: storage read bytes per second, or None for ``none``."""
    if text == "none":
        return None
    rate = parse_size(text, "--throttle")
    if rate == 0:
        raise UserError("bad --throttle 0: give a rate, or none")
    return rate


def parse_make(text: str) -> DatasetSpec:
    count, _, size = text.partition(":")
    try:
        files = int(count)
    except ValueError:
        raise UserError(f"bad --make {text!r}: expected N:SIZE such as 10000:110K") from None
    mean = parse_size(size or "110K", "--make size")
    spec = DatasetSpec(files, mean_bytes=mean, sigma=0.6 if mean < (1 << 20) else 0.0)
    spec.check()
    return spec


def load_dataset(args: argparse.Namespace) -> Dataset:
    """``--dir`` as it is, or the dataset of ``--make`` in ``--work``, made or reused."""
    if args.dir:
        root = Path(args.dir)
        if not root.is_dir():
            raise UserError(f"dataset {args.dir} is not a directory")
        files = tuple(sorted((str(p.relative_to(root)), p.stat().st_size)
                             for p in root.rglob("*") if p.is_file() and not p.is_symlink()))
        if not any(size for _rel, size in files):  # every figure is a share of its bytes
            raise UserError(f"dataset {args.dir} has no files with data")
        return Dataset(root.resolve(), DatasetSpec(len(files)), files, reused=True)
    return ensure_dataset(Path(args.work) / "dataset", parse_make(args.make))
