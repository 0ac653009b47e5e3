"""fio against the source and a coordlfs mount: an epoch of small files, shards, stats.

fio is the tool storage people already trust, and its job files run unchanged against any
directory, so these figures can be checked with none of our code in the reading path. The
job files are in ``scripts/fio/``:

- ``epoch``: a training epoch. JOBS reader processes (a loader's workers) each read their
  share of many small files once, in a random order, every file opened, read whole in one
  read and closed;
- ``shards``: one reader per large shard file, reading it from start to end in 1 MiB reads;
- ``metadata``: a stat() of every small file, with the kernel's dentries and inodes dropped
  first (fio's ``filestat`` engine).

fio lays the files out once in ``DIR/data`` (on disk); coordlfs is mounted over that
directory with a cache that holds all of it, and one pass reads every file through the mount
so that the measured runs are cache hits. Then, for each repeat and job, the page cache is
dropped and the job runs against the source, dropped again and the job runs against the
mount: the source side reads the disk, the coordlfs side its tmpfs cache through FUSE. That
is a training job's second epoch where the page cache could not keep the dataset and
coordlfs could.

    python -m coordlfs.bench.fio [--files 2000] [--size 112K] [--jobs 4] [--shards 4]
        [--shard-size 256M] [--runtime 60] [--repeat 3] [--dir DIR] [--json FILE]

Needs root and fio. Whatever happens, fio is stopped and nothing stays mounted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coordlfs.bench import harness
from coordlfs.bench.children import stop_group
from coordlfs.bench.reading import read_files
from coordlfs.daemon.mounting import free_space
from coordlfs.errors import UserError, exit_status
from coordlfs.protocol.client import Control
from coordlfs.sizes import format_size, parse_size
from coordlfs.testbed.dataset import clear_dataset, intact, read_manifest, write_manifest
from coordlfs.testbed.mounts import mounted
from coordlfs.testbed.storage import drop_caches

DEFAULT_DIR = "/var/tmp/coordlfs-fio"
#: The job files, in the checkout this package is installed from (editable, by scripts/setup).
DEFAULT_JOB_DIR = Path(__file__).resolve().parents[2] / "scripts" / "fio"
#: Bumped when the layout made from the same settings changes, so that old files are remade.
LAYOUT_FORMAT = 1
#: Seconds beyond ``--runtime`` after which a fio run counts as hung and is stopped.
FIO_SLACK = 120
#: Seconds the warming pass may wait for coordlfs to finish filling its cache.
FILL_TIMEOUT = 300
#: The mark after the warming pass: coordlfs's read counters from here are the measured runs'.
MARK = "fio-measured"
READ_BUFFER = 1 << 20
#: The metadata job's PRERUN: drop the caches after fio's set-up stat'ed every file, so that
#: its stats are cold lookups (the same drop_caches as before every run).
DROP_CACHES_COMMAND = (f"{shlex.quote(sys.executable)} -c "
                       "'from coordlfs.testbed.storage import drop_caches; drop_caches()'")


@dataclass(frozen=True, slots=True)
class Job:
    """One job file: ``scripts/fio/<name>.fio``, whose measured fio job is also ``name``."""

    name: str
    #: "MB/s" (10**6 bytes per second, from fio's bw_bytes) or "stats/s" (fio's IOPS)
    unit: str
    #: what it does, for the table
    what: str


JOBS = (
    Job("epoch", "MB/s", "small files, random order, whole-file reads"),
    Job("shards", "MB/s", "large shards, sequential 1 MiB reads"),
    Job("metadata", "stats/s", "stat() with dentries and inodes dropped"),
)
#: The job files that lay out files (metadata stats the files of ``epoch``).
LAYOUT_JOBS = ("epoch", "shards")
TARGETS = ("source", "coordlfs")


# -- settings -----------------------------------------------------------------------------


#: (option, default, what it is) of the counts and sizes; the default's type parses a value.
OPTIONS: tuple[tuple[str, int | str, str], ...] = (
    ("--files", 2000, "small files for the epoch and metadata jobs, rounded down to a multiple "
                      "of --jobs"),
    ("--size", "112K", "size of each small file"),
    ("--jobs", 4, "reader processes of the epoch and metadata jobs, each with its own share of "
                  "the files"),
    ("--shards", 4, "shard files, one reader each"),
    ("--shard-size", "256M", "size of each shard"),
    ("--runtime", 60, "seconds after which a fio run stops even if it has not read everything"),
    ("--repeat", 3, "runs per job and target; medians are reported"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for option, default, what in OPTIONS:
        parser.add_argument(option, type=type(default), default=default,
                            help=f"{what} (default {default})")
    parser.add_argument("--dir", default=DEFAULT_DIR,
                        help=f"work directory: fio's files in DIR/data (kept for later runs), "
                             f"the mount at DIR/mnt (default {DEFAULT_DIR})")
    parser.add_argument("--job-dir", default=str(DEFAULT_JOB_DIR),
                        help="directory of the job files (default: scripts/fio of this checkout)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


@dataclass(frozen=True, slots=True)
class Settings:
    """Validated options. Files are per job, as fio's ``nrfiles`` counts them: each reader
    owns its share of the epoch, as a loader's workers split the shuffled list."""

    files_per_job: int
    size: int
    jobs: int
    shards: int
    shard_size: int
    runtime: int
    repeat: int
    directory: Path
    job_dir: Path
    json_path: str | None

    @property
    def files(self) -> int:
        return self.files_per_job * self.jobs

    @property
    def data(self) -> Path:
        """Where fio lays out the files: the source of the mount."""
        return self.directory / "data"

    @property
    def mountpoint(self) -> Path:
        return self.directory / "mnt"

    def layout(self) -> list[tuple[str, int]]:
        """(name, size) of every file, as fio names them: ``<job>.<jobnum>.<filenum>``."""
        small = [(f"epoch.{job}.{n}", self.size)
                 for job in range(self.jobs) for n in range(self.files_per_job)]
        return small + [(f"shards.{job}.0", self.shard_size) for job in range(self.shards)]

    @property
    def total_bytes(self) -> int:
        return self.files * self.size + self.shards * self.shard_size

    def manifest(self, complete: bool) -> dict[str, Any]:
        """What the data directory's manifest says once fio laid out these settings' files."""
        return {"fio_layout": LAYOUT_FORMAT, "complete": complete,
                "layout": {"files_per_job": self.files_per_job, "size": self.size,
                           "jobs": self.jobs, "shards": self.shards,
                           "shard_size": self.shard_size}}

    def environment(self, directory: Path, layout: bool = False) -> dict[str, str]:
        """The variables the job files expand, pointing them at ``directory``."""
        return {"DIR": fio_path(directory), "FILESIZE": str(self.size),
                "NRFILES": str(self.files_per_job), "JOBS": str(self.jobs),
                "SHARDSIZE": str(self.shard_size), "SHARDS": str(self.shards),
                "RUNTIME": str(self.runtime), "LAYOUT": "1" if layout else "0",
                "PRERUN": DROP_CACHES_COMMAND}


def fio_path(path: Path) -> str:
    """``path`` as fio's ``directory`` option takes it: absolute, with ``:`` escaped (fio
    splits the option on ``:`` into several directories)."""
    return str(path.resolve()).replace(":", "\\:")


def settings_from(args: argparse.Namespace) -> Settings:
    """Validated settings; every problem is a one-line UserError."""
    for name in ("jobs", "shards", "runtime", "repeat"):
        if getattr(args, name) < 1:
            raise UserError(f"bad --{name} {getattr(args, name)}: need at least 1")
    if args.files < args.jobs:
        raise UserError(f"bad --files {args.files}: need at least one per job (--jobs "
                        f"{args.jobs})")
    size = parse_size(args.size, "--size")
    shard_size = parse_size(args.shard_size, "--shard-size")
    for option, value in (("--size", size), ("--shard-size", shard_size)):
        if value < 1:
            raise UserError(f"bad {option} {value}: need at least 1 byte")
    return Settings(args.files // args.jobs, size, args.jobs, args.shards, shard_size,
                    args.runtime, args.repeat, Path(args.dir).resolve(),
                    Path(args.job_dir).resolve(), args.json)


def check_can_run(settings: Settings) -> None:
    """Root (dropping caches, mounting), fio, and the job files."""
    harness.require_root("bench fio", "drops the page cache and mounts coordlfs")
    if shutil.which("fio") is None:
        raise UserError("fio not found (install the Debian package fio, or run scripts/setup)")
    missing = [job.name for job in JOBS if not (settings.job_dir / f"{job.name}.fio").is_file()]
    if missing:
        raise UserError(f"no {', '.join(missing)} job file in {settings.job_dir}; pass "
                        "--job-dir (the checkout's scripts/fio)")


# -- running fio --------------------------------------------------------------------------


def parse_output(text: str) -> dict[str, Any]:
    """fio's JSON report from its stdout, which may start with lines of plain text (fio says
    where it saved a job's ``exec_prerun`` output there)."""
    start = re.search(r"^\{", text, re.MULTILINE)
    if start is None:
        raise UserError(f"fio printed no JSON report: {text.strip()[-300:]!r}")
    report, _end = json.JSONDecoder().raw_decode(text, start.start())
    return report


def run_fio(settings: Settings, job: str, directory: Path, scratch: Path,
            layout: bool = False) -> dict[str, Any]:
    """Run ``job``'s file against ``directory``; returns fio's JSON report.

    Measuring runs pass ``--readonly`` (fio then never writes, so it cannot harm the source
    and works on the read-only mount); layout runs only create files. fio runs in a process
    group of its own in ``scratch`` (where it writes ``exec_prerun`` output), so that an
    interrupt can stop it with its job processes, and their open files do not keep the mount
    busy.
    """
    argv = ["fio", "--output-format=json", str(settings.job_dir / f"{job}.fio")]
    if not layout:
        argv.insert(1, "--readonly")
    env = {**os.environ, **settings.environment(directory, layout)}
    return fio_report(argv, env, scratch, settings.runtime + FIO_SLACK,
                      f"fio {job} against {directory}")


def fio_report(argv: list[str], env: dict[str, str], scratch: Path, timeout: float,
               what: str) -> dict[str, Any]:
    """Run fio's ``argv`` (with ``--output-format=json``) in a process group of its own in
    ``scratch``, stopped with its job processes on a timeout or an interrupt; its JSON report,
    or a one-line UserError naming ``what``."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, cwd=scratch, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(process)
        raise UserError(f"{what} did not finish in {timeout:.0f} s") from None
    except BaseException:
        stop_group(process)
        raise
    if process.returncode != 0:
        lines = (err.strip() or out.strip()).splitlines()
        raise UserError(f"{what} failed (exit {process.returncode}): "
                        f"{lines[-1] if lines else 'no message'}")
    return parse_output(out)


def summarize(report: dict[str, Any], job: str) -> dict[str, Any]:
    """The figures of fio job ``job`` (its group) in a report: bytes, I/Os, time, rates."""
    entry = next((j for j in report.get("jobs", []) if j.get("jobname") == job), None)
    if entry is None:
        raise UserError(f"fio's report has no job {job!r}")
    if entry["error"]:
        raise UserError(f"fio job {job} failed: {os.strerror(entry['error'])}")
    read = entry["read"]
    clat = read["clat_ns"]
    percentiles = clat.get("percentile", {})
    return {
        "io_bytes": read["io_bytes"],
        "ios": read["total_ios"],
        "runtime_ms": read["runtime"],
        "bw_bytes": read["bw_bytes"],
        "iops": read["iops"],
        "clat_mean_us": round(clat["mean"] / 1000, 2),
        "clat_p50_us": round(percentiles.get("50.000000", 0) / 1000, 2),
        "clat_p99_us": round(percentiles.get("99.000000", 0) / 1000, 2),
    }


def value(job: Job, run: dict[str, Any]) -> float:
    """The run's figure in the job's unit."""
    return run["bw_bytes"] / 1e6 if job.unit == "MB/s" else run["iops"]


def expected_ios(settings: Settings, job: Job) -> int:
    """I/Os of a complete run: one per small file, or one per MiB of every shard."""
    if job.name == "shards":
        return settings.shards * -(-settings.shard_size // (1 << 20))
    return settings.files


# -- the files and the mount ----------------------------------------------------------------


def prepare_layout(settings: Settings, scratch: Path) -> bool:
    """Have fio lay out the files in ``settings.data``; returns True if they were reused.

    The directory carries a dataset manifest (``coordlfs.testbed.dataset``'s), written as
    incomplete before fio starts and complete after, so that files of other settings or of
    an interrupted run are removed and laid out again, and a directory that is not ours is
    never touched.
    """
    data = settings.data
    layout = settings.layout()
    manifest = read_manifest(data)
    if manifest == settings.manifest(True) and intact(data, layout):
        return True
    if manifest is None and data.is_dir() and any(data.iterdir()):
        raise UserError(f"{data} is not empty and holds no files of ours; choose another --dir")
    data.mkdir(parents=True, exist_ok=True)
    clear_dataset(data)
    room = free_space(str(data))
    if room < settings.total_bytes * 1.05:
        raise UserError(f"{data} has {format_size(room)} free; the files need "
                        f"{format_size(settings.total_bytes)}")
    write_manifest(data, settings.manifest(False))
    for job in LAYOUT_JOBS:
        run_fio(settings, job, data, scratch, layout=True)
    if not intact(data, layout):
        raise UserError(f"fio did not lay out the files expected in {data}")
    write_manifest(data, settings.manifest(True))
    return False


def cache_size(settings: Settings) -> int:
    """Room for every file with a margin, and at least four shards: coordlfs streams files
    larger than a quarter of its cache (``--max-file-size``'s default) without caching them."""
    return max(settings.total_bytes * 5 // 4, 4 * max(settings.shard_size, settings.size))


def warm(settings: Settings, control: Control) -> dict[str, Any]:
    """Read every file through the mount once and wait until coordlfs has cached them all;
    returns the mount's status. Anything short of that makes the coordlfs runs partly
    read the disk, which the measurement is not about: a UserError."""
    got = read_files(_paths(settings, settings.mountpoint), bytearray(READ_BUFFER))
    if got != settings.total_bytes:
        raise UserError(f"read {got} bytes through the mount, expected {settings.total_bytes}")
    deadline = time.monotonic() + FILL_TIMEOUT
    while True:
        status = control.status()
        cache = status["cache"]
        if cache["filling"] == 0 and cache["files"] >= len(settings.layout()):
            return status
        if time.monotonic() > deadline:
            raise UserError(f"coordlfs cached {cache['files']} of {len(settings.layout())} "
                            f"files ({format_size(cache['used_bytes'])})")
        time.sleep(0.1)


def _paths(settings: Settings, base: Path) -> list[str]:
    return [str(base / name) for name, _size in settings.layout()]


# -- the benchmark ------------------------------------------------------------------------


def measure(settings: Settings) -> dict[str, Any]:
    """Lay out, mount, warm, then run every job against both targets; returns the report."""
    harness.work_dir(str(settings.directory))  # made, or checked to be ours alone
    with harness.claimed(settings.directory, "bench-fio"), \
            tempfile.TemporaryDirectory(prefix="coordlfs-fio-") as scratch_dir:
        scratch = Path(scratch_dir)
        print(f"bench-fio: laying out or checking {settings.files} files of "
              f"{format_size(settings.size)} and {settings.shards} shards of "
              f"{format_size(settings.shard_size)} in {settings.data}", flush=True)
        reused = prepare_layout(settings, scratch)
        capacity = cache_size(settings)
        shm = free_space("/dev/shm")
        if shm < settings.total_bytes * 1.05:
            raise UserError(f"/dev/shm has {format_size(shm)} free; coordlfs's cache needs "
                            f"{format_size(settings.total_bytes)}")
        targets = {"source": settings.data, "coordlfs": settings.mountpoint}
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {
            (job.name, target): [] for job in JOBS for target in TARGETS}
        with mounted(settings.data, settings.mountpoint, settings.directory / "mount.log",
                     "--cache-size", str(capacity)) as mount:
            control = mount.control
            print(f"bench-fio: warming coordlfs's cache ({format_size(settings.total_bytes)})",
                  flush=True)
            status = warm(settings, control)
            control.mark(MARK)
            for number in range(settings.repeat):
                for job in JOBS:
                    for target in TARGETS:
                        drop_caches()
                        report = run_fio(settings, job.name, targets[target], scratch)
                        run = summarize(report, job.name)
                        runs[job.name, target].append(run)
                        print(f"  run {number + 1}/{settings.repeat} {job.name:8} {target:8} "
                              f"{value(job, run):12,.1f} {job.unit}", flush=True)
            reads = control.stats(since=MARK)["reads"]
            fio_version = report.get("fio version", "")
    return build_report(settings, runs, reused, status["cache"], reads, fio_version)


def build_report(settings: Settings, runs: dict[tuple[str, str], list[dict[str, Any]]],
                 reused: bool, cache: dict[str, Any], reads: dict[str, Any],
                 fio_version: str) -> dict[str, Any]:
    """The JSON report: every run, medians per job and target, and coordlfs/source ratios."""
    results = []
    summary = {}
    for job in JOBS:
        medians = {}
        for target in TARGETS:
            values = [value(job, run) for run in runs[job.name, target]]
            medians[target] = statistics.median(values)
            results.append({"job": job.name, "target": target, "unit": job.unit,
                            "median": round(medians[target], 3),
                            "complete": all(run["ios"] >= expected_ios(settings, job)
                                            for run in runs[job.name, target]),
                            "runs": runs[job.name, target]})
        ratio = medians["coordlfs"] / medians["source"] if medians["source"] else None
        summary[job.name] = {"unit": job.unit, "what": job.what,
                             "source": round(medians["source"], 3),
                             "coordlfs": round(medians["coordlfs"], 3),
                             "ratio": round(ratio, 3) if ratio is not None else None}
    return {
        "settings": {**{k: v for k, v in asdict(settings).items() if k != "json_path"},
                     "files": settings.files, "directory": str(settings.directory),
                     "job_dir": str(settings.job_dir)},
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "fio": fio_version},
        "data": {"dir": str(settings.data), "files": len(settings.layout()),
                 "bytes": settings.total_bytes, "reused": reused},
        "cache": {"capacity_bytes": cache["capacity_bytes"], "used_bytes": cache["used_bytes"]},
        "coordlfs_reads": reads,
        "results": results,
        "summary": summary,
    }


def _describe(settings: Settings, job: Job) -> str:
    if job.name == "shards":
        return f"shards: {settings.shards} x {format_size(settings.shard_size)}, 1 MiB reads"
    if job.name == "metadata":
        return f"metadata: stat of {settings.files} files, {settings.jobs} jobs, cold"
    return f"epoch: {settings.files} x {format_size(settings.size)}, {settings.jobs} jobs"


def format_table(report: dict[str, Any], settings: Settings) -> str:
    """job | unit | source | coordlfs | coordlfs/source, from the medians."""
    rows = [("job", "unit", "source", "coordlfs", "coordlfs/source")]
    for job in JOBS:
        s = report["summary"][job.name]
        ratio = f"{s['ratio']:.2f}x" if s["ratio"] is not None else "-"
        rows.append((_describe(settings, job), job.unit, f"{s['source']:,.1f}",
                     f"{s['coordlfs']:,.1f}", ratio))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for number, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:], strict=True)]
        lines.append(" | ".join(cells))
        if number == 0:
            lines.append("-+-".join("-" * width for width in widths))
    notes = [f"medians of {settings.repeat} run(s) each; page cache dropped before every run; "
             "MB/s is 10^6 bytes/s"]
    incomplete = sorted({r["job"] for r in report["results"] if not r["complete"]})
    if incomplete:
        notes.append(f"stopped by --runtime {settings.runtime} before reading everything: "
                     f"{', '.join(incomplete)}")
    from_source = report["coordlfs_reads"].get("bytes_from_source", 0)
    if from_source:
        notes.append(f"warning: coordlfs read {format_size(from_source)} from the source during "
                     "the measured runs; not every read was a cache hit")
    return "\n".join(lines + notes)


def run(args: argparse.Namespace) -> int:
    """The whole benchmark for parsed arguments (``add_arguments``); prints the table."""
    settings = settings_from(args)
    check_can_run(settings)
    report = measure(settings)
    print()
    print(format_table(report, settings))
    harness.write_report(settings.json_path, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench-fio",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return exit_status("bench-fio", lambda: run(args),
                       "interrupted; fio stopped, unmounted and cleaned up",
                       sigterm_interrupts=True)


if __name__ == "__main__":
    sys.exit(main())
