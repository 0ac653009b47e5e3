"""Hyper-parameter search: N jobs pre-processing the same JPEGs, each its own or shared.

The jobs of a search train on one dataset at once, and each fetches, decodes and augments
every item itself: N times the CPU of one job, on a server whose cores the search shares.
Here N jobs (``coordlfs.bench.hpsearch_job``, each a process with ``--workers`` loader
workers and a ``--compute-ms`` sleep per batch for the GPU step) read generated JPEGs
(``coordlfs.bench.jpegs``: decode, random resized crop, flip, normalise) through one coordlfs
mount, in two modes:

* independent: each job has a plain ``DataLoader(shuffle=True)``;
* shared: each job has a ``coordlfs.torch.SharedPrepLoader`` in one group, so each batch of
  an epoch is prepared by one job of the group and every job trains on it.

and two regimes, each configuration on a fresh mount:

* memory: the cache holds the whole dataset, which is read once through the mount first
  (warm); no throttle. Pre-processing is all the work: the prep-bound case.
* storage: the cache holds ``--cache`` of the dataset, its source is read through a blkio
  throttle (``--throttle``) that holds the daemon and the jobs with their loader workers
  (with passthrough a worker's kernel reads a miss from the source file itself), the images'
  pages are dropped from the page cache before the jobs start, and the jobs drop each file's
  pages once read (``POSIX_FADV_DONTNEED``, the mount's and the source file's, which holds
  them where the kernel read a miss by passthrough), as a dataset larger than memory would
  leave them: otherwise the kernel would serve every epoch after the first from the mount's pages,
  whatever the cache size.

Measured, per job: samples per second over its epochs (from the common start to its last
batch) and per epoch; the CPU time of the job and its loader workers from the start to its
end (``getrusage`` of itself and its waited-for children, so the torch import before the
start is left out); for shared jobs the batches each prepared. Per configuration: the
makespan (the start to the last job's last batch) and the storage bytes of each epoch: the
kernel's count for the blkio cgroup of the daemon and the jobs (``Cgroup.bytes_read``; the
workers a job forks at each epoch start in its group) between the moments the last job ended
the epoch before and this one (independent jobs drift apart, so an epoch's bytes are those
read while its slowest job finished it). The table shows the median job, the sum of CPU time,
and the storage bytes per epoch after the first (the steady state). Ratios: throughput
shared ÷ independent (median job's samples/s), prep CPU independent ÷ shared (total CPU s),
storage independent ÷ shared (bytes per epoch after the first); medians over ``--repeat``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from coordlfs.bench import harness
from coordlfs.bench.children import EpochMarks, remove_left_in_shm, running, stop_group
from coordlfs.bench.hits import evict
from coordlfs.bench.ratios import median, ratio
from coordlfs.bench.reading import read_files
from coordlfs.errors import UserError
from coordlfs.protocol.order import batch_count
from coordlfs.sizes import format_size
from coordlfs.testbed.cgroup import controller_root, storage_cgroup
from coordlfs.testbed.dataset import Dataset
from coordlfs.testbed.mounts import mounted
from coordlfs.testbed.storage import block_device

CGROUP_PREFIX = "coordlfs-hpsearch"
REGIMES = ("memory", "storage")
MODES = ("independent", "shared")
#: The group every shared job of a configuration joins (each configuration has a fresh mount).
GROUP = "hpsearch"
#: Seconds without a line from any job (the torch import, an epoch) before the bench gives up.
PROGRESS_TIMEOUT = 600
#: Seconds a job that sent its result gets to exit (leaving its group, joining its workers).
EXIT_TIMEOUT = 60

T = TypeVar("T")


# -- arguments -------------------------------------------------------------------------------

def _typed(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a parser that raises UserError: a bad value is one line, status 2."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__
    return convert


def parse_make(text: str) -> tuple[int, int, int]:
    """``N:WxH`` such as ``2000:320x240``: (files, width, height)."""
    count, _, size = text.partition(":")
    width, _, height = size.lower().partition("x")
    try:
        values = int(count), int(width), int(height)
    except ValueError:
        raise UserError(f"expected N:WxH such as 2000:320x240, not {text!r}") from None
    if min(values) < 1:
        raise UserError(f"count, width and height must be positive in {text!r}")
    return values


def parse_counts(text: str) -> list[int]:
    """Job counts such as ``2,4``."""
    try:
        counts = sorted({int(n) for n in text.split(",")})
    except ValueError:
        raise UserError(f"expected job counts such as 2,4, not {text!r}") from None
    if counts[0] < 1:
        raise UserError(f"job counts must be at least 1, not {text!r}")
    return counts


def _names(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse_names(text: str) -> list[str]:
        names = list(dict.fromkeys(n.strip() for n in text.split(",")))
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise UserError(f"expected some of {','.join(choices)}, not {text!r}")
        return [c for c in choices if c in names]
    return parse_names


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse_count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UserError(f"expected a whole number, not {text!r}") from None
        if value < minimum:
            raise UserError(f"must be at least {minimum}, not {value}")
        return value
    return parse_count


def _number(what: str, valid: Callable[[float], bool], bounds: str) -> Callable[[str], float]:
    def parse_number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UserError(f"expected {what}, not {text!r}") from None
        if not valid(value):
            raise UserError(f"{what} must be {bounds}, not {value:g}")
        return value
    return parse_number


parse_fraction = _number("a fraction of the dataset", lambda v: 0 < v <= 1, "in (0, 1]")
parse_milliseconds = _number("milliseconds", lambda v: v >= 0, "0 or more")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--make", type=_typed(parse_make), default="2000:320x240",
                        metavar="N:WxH",
                        help="generate N JPEGs of W x H pixels (default 2000:320x240)")
    parser.add_argument("--work", default="/var/tmp/coordlfs-hpsearch",
                        help="work directory on disk for generated images and the mount")
    parser.add_argument("--jobs", type=_typed(parse_counts), default="2,4",
                        help="job counts to run (default 2,4)")
    parser.add_argument("--regimes", type=_typed(_names(REGIMES)), default="memory,storage",
                        help="memory (cache holds the dataset, warm) and/or storage (cache "
                             "holds --cache of it, throttled reads) (default both)")
    parser.add_argument("--modes", type=_typed(_names(MODES)), default="independent,shared",
                        help="independent (a DataLoader each) and/or shared (one "
                             "SharedPrepLoader group) (default both)")
    parser.add_argument("--cache", type=_typed(parse_fraction), default=0.5,
                        help="storage regime: cache as a fraction of the dataset (default 0.5)")
    parser.add_argument("--throttle", type=_typed(harness.parse_throttle), default="50M",
                        help="storage regime: storage read limit per second, or none "
                             "(default 50M)")
    parser.add_argument("--epochs", type=_typed(_at_least(1)), default=2,
                        help="epochs per job (default 2)")
    parser.add_argument("--batch", type=_typed(_at_least(1)), default=32,
                        help="images per batch (default 32)")
    parser.add_argument("--workers", type=_typed(_at_least(0)), default=1,
                        help="loader worker processes per job (default 1)")
    parser.add_argument("--compute-ms", type=_typed(parse_milliseconds), default=20.0,
                        help="emulated GPU time per batch (default 20)")
    parser.add_argument("--crop", type=_typed(_at_least(1)), default=224,
                        help="side of the cropped images (default 224)")
    parser.add_argument("--drop-last", action="store_true",
                        help="drop each epoch's last, partial batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jobs' shuffles")
    parser.add_argument("--repeat", type=_typed(_at_least(1)), default=1,
                        help="runs; medians are reported")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


@dataclass(frozen=True, slots=True)
class Settings:
    jobs: list[int]
    regimes: list[str]
    modes: list[str]
    cache: float
    throttle: int | None
    epochs: int
    batch: int
    workers: int
    compute_ms: float
    crop: int
    drop_last: bool
    seed: int
    repeat: int


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(args.jobs, args.regimes, args.modes, args.cache, args.throttle,
                    args.epochs, args.batch, args.workers, args.compute_ms, args.crop,
                    args.drop_last, args.seed, args.repeat)


# -- the jobs ----------------------------------------------------------------------------------

def job_argv(settings: Settings, mode: str, count: int, index: int, root: Path,
             drop_pages: Path | None) -> list[str]:
    """The command line of job ``index`` of ``count``; each job shuffles with its own seed
    and, with ``drop_pages`` (the source beneath the mount), drops each file's pages."""
    argv = [sys.executable, "-m", "coordlfs.bench.hpsearch_job", "--root", str(root),
            "--mode", mode, "--job", f"job-{index}", "--jobs", str(count), "--group", GROUP,
            "--epochs", str(settings.epochs), "--batch", str(settings.batch),
            "--workers", str(settings.workers), "--compute-ms", str(settings.compute_ms),
            "--crop", str(settings.crop), "--seed", str(settings.seed * 1000 + index)]
    if settings.drop_last:
        argv.append("--drop-last")
    if drop_pages is not None:
        argv += ["--drop-pages", str(drop_pages)]
    return argv


def _forward(index: int, stream: IO[str], events: queue.Queue) -> None:
    """Put each JSON line a job prints on ``events``; None at its end."""
    for line in stream:
        with contextlib.suppress(ValueError):  # a library's stray output is no event
            events.put((index, json.loads(line)))
    events.put((index, None))


@dataclass(slots=True)
class Jobs:
    """The job processes of one configuration, each in a session of its own (a Ctrl-C at the
    terminal is the bench's to handle; it stops them, workers included, by group id).

    Fresh interpreters (``coordlfs.bench.hpsearch_job``), not forks like ``aligned.Jobs``:
    a job imports torch and forks DataLoader workers, which must not inherit the bench's
    threads; and a job is a program of its own that speaks JSON lines, so that it can be run
    and debugged alone. Storage per epoch is ``EpochMarks``, as for aligned jobs."""

    argvs: list[list[str]]
    logs: list[Path]
    processes: list[subprocess.Popen[str]] = field(default_factory=list)
    events: queue.Queue = field(default_factory=queue.Queue)
    #: when they started (``time.time()``), a second early: file times are the kernel's
    #: coarse clock (``remove_left_in_shm``)
    since: float = 0.0

    def start(self) -> None:
        self.since = time.time() - 1
        for index, (argv, log) in enumerate(zip(self.argvs, self.logs, strict=True)):
            with open(log, "w") as stderr:
                process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=stderr, text=True, start_new_session=True)
            self.processes.append(process)
            assert process.stdout is not None
            threading.Thread(target=_forward, args=(index, process.stdout, self.events),
                             daemon=True).start()

    def next_event(self) -> tuple[int, dict[str, Any] | None]:
        """The next line of any job, as (job index, event); None when its output ended."""
        try:
            return self.events.get(timeout=PROGRESS_TIMEOUT)
        except queue.Empty:
            raise UserError(f"no job made progress for {PROGRESS_TIMEOUT} s") from None

    def failure(self, index: int) -> UserError:
        """Job ``index`` stopped talking: its exit status and the last line it wrote."""
        process = self.processes[index]
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)
        lines = self.logs[index].read_text(errors="replace").strip().splitlines()
        return UserError(f"job-{index} failed (exit {process.returncode}): "
                         f"{lines[-1] if lines else 'no message'} (log: {self.logs[index]})")

    def wait_ready(self) -> None:
        ready = 0
        while ready < len(self.processes):
            index, event = self.next_event()
            if event is None:
                raise self.failure(index)
            ready += event.get("event") == "ready"

    def go(self) -> float:
        """Start every job's first epoch; returns the time on the monotonic clock."""
        started = time.monotonic()
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        return started

    def collect(self, storage: Callable[[], int]) -> tuple[list[dict[str, Any]], list[int]]:
        """Every job's result, and the storage bytes of each epoch (``EpochMarks``)."""
        results: list[dict[str, Any] | None] = [None] * len(self.processes)
        marks = EpochMarks(storage, [0] * len(self.processes))
        while any(r is None for r in results):
            index, event = self.next_event()
            if event is None:
                if results[index] is None:  # a job's output ends after its result
                    raise self.failure(index)
            elif event.get("event") == "epoch":
                marks.ended(index, event["epoch"])
            elif event.get("event") == "result":
                results[index] = event
        for index, process in enumerate(self.processes):
            try:
                process.wait(EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise UserError(f"job-{index} did not exit {EXIT_TIMEOUT} s after its "
                                "result") from None
        return [r for r in results if r is not None], marks.per_epoch()

    def stop(self) -> None:
        """Stop every job with its group (what a job that ended left running in it goes too),
        then remove the shared memory its workers left (``remove_left_in_shm``)."""
        for process in self.processes:
            stop_group(process)
            for stream in (process.stdin, process.stdout):
                with contextlib.suppress(OSError):
                    if stream is not None:
                        stream.close()
        if self.processes:
            remove_left_in_shm(self.since)


# -- one configuration -----------------------------------------------------------------------

@dataclass(slots=True)
class ConfigResult:
    regime: str
    mode: str
    jobs: int
    run: int
    cache_bytes: int
    makespan_s: float
    #: storage bytes per epoch, all jobs together
    epoch_storage_bytes: list[int]
    #: each job's result line (``coordlfs.bench.hpsearch_job``)
    job_results: list[dict[str, Any]]

    @property
    def samples_per_s(self) -> float:
        """The median job's samples per second."""
        return statistics.median(r["samples_per_s"] for r in self.job_results)

    @property
    def cpu_s(self) -> float:
        return sum(r["cpu_s"] for r in self.job_results)

    @property
    def storage_per_epoch(self) -> float:
        """Storage bytes per epoch after the first (the steady state), or of the only one."""
        later = self.epoch_storage_bytes[1:] or self.epoch_storage_bytes
        return statistics.mean(later) if later else 0.0

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_s": round(self.samples_per_s, 2),
                "cpu_s": round(self.cpu_s, 3), "storage_per_epoch": self.storage_per_epoch}


def check_counts(result: ConfigResult, settings: Settings, samples: int) -> None:
    """Every job saw every sample of every epoch (each job also checks, per class); shared
    jobs prepared each batch of each epoch once between them."""
    batches = batch_count(samples, settings.batch, settings.drop_last)
    expected = min(samples, batches * settings.batch)
    for job in result.job_results:
        if job["samples"] != [expected] * settings.epochs:
            raise UserError(f"{job['job']} saw {job['samples']} samples per epoch, expected "
                            f"{expected} in each of {settings.epochs}")
    if result.mode == "shared":
        prepared = [job["prepared"] for job in result.job_results]
        if sum(prepared) != batches * settings.epochs:
            raise UserError(f"shared jobs prepared {prepared} batches, expected "
                            f"{batches * settings.epochs} between them")


def run_config(images: Dataset, settings: Settings, regime: str, mode: str, count: int,
               number: int, work: Path) -> ConfigResult:
    total = images.total_bytes
    cache = total if regime == "memory" else int(total * settings.cache)
    mountpoint = work / "mnt"
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(mounted(images.root, mountpoint, work / "mount.log",
                                             "--cache-size", str(cache))).pid
        if regime == "memory":
            read_files(images.paths(mountpoint), bytearray(1 << 20))
        cgroup = stack.enter_context(storage_cgroup(
            f"{CGROUP_PREFIX}-{os.getpid()}", images.root,
            settings.throttle if regime == "storage" else None))
        cgroup.add(daemon)
        logs = [work / "logs" / f"job-{i}.log" for i in range(count)]
        argvs = [job_argv(settings, mode, count, i, mountpoint,
                          images.root if regime == "storage" else None)
                 for i in range(count)]
        jobs = stack.enter_context(running(Jobs(argvs, logs)))
        for process in jobs.processes:  # before "go": the loader workers come after
            cgroup.add(process.pid)
        jobs.wait_ready()
        if regime == "storage":  # the images' pages (written back first), not the jobs' code
            os.sync()
            evict(images.paths())
        before = cgroup.bytes_read()
        started = jobs.go()
        job_results, per_epoch = jobs.collect(lambda: cgroup.bytes_read() - before)
    result = ConfigResult(regime, mode, count, number, cache,
                          round(max(r["ended"] for r in job_results) - started, 3),
                          per_epoch, job_results)
    check_counts(result, settings, len(images.files))
    print(f"  {regime:8} {count} jobs {mode:12}: {result.samples_per_s:7.1f} samples/s per "
          f"job (median), makespan {result.makespan_s:.1f} s, CPU {result.cpu_s:.1f} s, "
          f"storage per epoch "
          f"{' '.join(f'{b / total:.2f}' for b in per_epoch)} of the dataset", flush=True)
    return result


# -- summary -------------------------------------------------------------------------------

def summarize(results: list[ConfigResult]) -> dict[str, Any]:
    """Per regime and job count, medians over runs of shared against independent; the
    memory regime's figures (the prep-bound case) also at the top level."""
    summary: dict[str, Any] = {}
    by_key = {(r.regime, r.jobs, r.mode, r.run): r for r in results}
    for regime in dict.fromkeys(r.regime for r in results):
        figures: dict[str, Any] = {}
        for n in sorted({r.jobs for r in results if r.regime == regime}):
            pairs = [(by_key[regime, n, "independent", run], by_key[regime, n, "shared", run])
                     for run in sorted({r.run for r in results})
                     if (regime, n, "independent", run) in by_key
                     and (regime, n, "shared", run) in by_key]
            for key, values in (
                    (f"throughput_ratio_{n}jobs",
                     [ratio(sh.samples_per_s, ind.samples_per_s) for ind, sh in pairs]),
                    (f"prep_cpu_ratio_{n}jobs", [ratio(ind.cpu_s, sh.cpu_s) for ind, sh in pairs]),
                    (f"storage_bytes_ratio_{n}jobs",
                     [ratio(ind.storage_per_epoch, sh.storage_per_epoch) for ind, sh in pairs])):
                figures[key] = median(values)
                figures[key + "_runs"] = values
        summary[regime] = figures
    if "memory" in summary:
        summary.update({k: v for k, v in summary["memory"].items()
                        if k.startswith(("throughput_ratio", "prep_cpu_ratio"))
                        and not k.endswith("_runs")})
    return summary


def format_table(results: list[ConfigResult]) -> str:
    """One line per (regime, jobs, mode): medians over runs."""
    lines = ["regime   jobs  mode          samples/s/job  makespan s    CPU s  storage/epoch"]
    groups: dict[tuple[str, int, str], list[ConfigResult]] = {}
    for r in results:
        groups.setdefault((r.regime, r.jobs, r.mode), []).append(r)
    for (regime, n, mode), runs in groups.items():
        lines.append(
            f"{regime:8} {n:4}  {mode:12} "
            f"{statistics.median(r.samples_per_s for r in runs):14.1f} "
            f"{statistics.median(r.makespan_s for r in runs):11.1f} "
            f"{statistics.median(r.cpu_s for r in runs):8.1f} "
            f"{format_size(statistics.median(r.storage_per_epoch for r in runs)):>14}")
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------

def check_can_run(settings: Settings) -> None:
    """Root, Pillow and torch, the cgroup controller that counts and throttles storage, and
    the shared loader."""
    harness.require_root("bench hpsearch", "mounts FUSE, drops the page cache, counts and "
                         "throttles storage with a blkio cgroup")
    missing = [package for module, package in (("PIL", "Pillow"), ("torch", "torch"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise UserError(f"bench hpsearch needs {' and '.join(missing)}: pip install "
                        "'coordlfs[images,torch]'")
    controller_root("blkio")
    shared_prep = importlib.util.find_spec("coordlfs.client.shared_prep")
    if "shared" in settings.modes and shared_prep is None:
        raise UserError("the shared mode needs coordlfs.torch.SharedPrepLoader "
                        "(coordlfs/client/shared_prep.py), not in this installation; run with "
                        "--modes independent")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    check_can_run(settings)
    from coordlfs.bench.jpegs import ImageSpec, ensure_jpegs  # Pillow and torch: checked

    work = harness.work_dir(args.work)
    (work / "logs").mkdir(exist_ok=True)
    block_device(work)  # the count and the throttle need one under the images
    with harness.claimed(work, "hpsearch", cgroups=CGROUP_PREFIX):
        files, width, height = args.make
        print(f"images in {work / 'images'}: making or checking {files} JPEGs of "
              f"{width}x{height}", flush=True)
        images = ensure_jpegs(work / "images", ImageSpec(files, width, height))
        storage = (f"; storage regime: cache {settings.cache:g} of the dataset, throttle "
                   f"{harness.describe_throttle(settings.throttle)}"
                   if "storage" in settings.regimes else "")
        print(f"dataset: {len(images.files)} JPEGs, {format_size(images.total_bytes)} "
              f"({'reused' if images.reused else 'new'}); jobs "
              f"{','.join(map(str, settings.jobs))}, {settings.workers} worker(s) each, batch "
              f"{settings.batch}, {settings.compute_ms:g} ms per batch{storage}", flush=True)
        results = []
        for number in harness.repeated(settings.repeat):
            for regime in settings.regimes:
                for count in settings.jobs:
                    for mode in settings.modes:
                        results.append(run_config(images, settings, regime, mode, count,
                                                  number, work))
    summary = summarize(results)
    print(format_table(results))
    for regime in settings.regimes:
        for n in settings.jobs:
            figures = summary[regime]
            print(f"{regime}, {n} jobs: throughput_ratio {figures[f'throughput_ratio_{n}jobs']} "
                  f"(shared ÷ independent samples/s per job), prep_cpu_ratio "
                  f"{figures[f'prep_cpu_ratio_{n}jobs']} (independent ÷ shared CPU s), "
                  f"storage_bytes_ratio {figures[f'storage_bytes_ratio_{n}jobs']}")
    harness.write_report(args.json, {
        "dataset": {**harness.dataset_record(images), "width": width, "height": height},
        "settings": asdict(settings),
        "runs": [r.record() for r in results],
        "summary": summary,
    })
    return 0
