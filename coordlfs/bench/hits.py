"""Cache-hit throughput: open+read+close of small files against tmpfs and pyfuse3 baselines,
and the native client (``coordlfs.client``) beside them.

A training epoch over an image dataset is, per item, open + read to EOF + close of a ~112 KB
file. Once coordlfs holds a file, that is all its daemon does for it, so this benchmark asks
how close a cache hit gets to the best any pyfuse3 filesystem can do (``memfs``, which
answers from a dict), next to tmpfs (no FUSE at all) and a naive passthrough (no cache).

Every case reads the same files, shuffled, split among 1 and 4 reader processes (like a
DataLoader's workers), each doing os.open / os.readv to EOF / os.close. Unless a case is
"page cache warm", the files' pages are dropped from the kernel page cache first, so every
byte comes from the daemon (or, for passthrough, from disk). One large file read
sequentially in 1 MiB reads shows bulk bandwidth. Each figure is the median of ``--repeat``
runs, the cases interleaved so that a slow moment on the machine does not land on one case
only.

The client's case reads the same cached files through ``coordlfs.client.Dataset`` in reader
processes of its own, each file's bytes copied out (``bytes(view)``: what a job keeps), and is
compared with tmpfs (the issue's goal: 1.5x tmpfs's open+read+close). A fresh process pays
a minor page fault per 16 pages of the cache it touches first (the kernel maps the shared
pages on demand); its "mapping warm" case reads every file once before it is timed, as a
long-lived reader's later epochs do.

FUSE passthrough (the kernel reads the cache's file itself, only open and release reach the
daemon) is measured beside the classic path: coordlfs mounted with ``--passthrough yes`` next
to ``--passthrough no`` (today's mount where the option does not exist yet), and libfuse's own
C++ ``passthrough_hp`` over the tmpfs copy, what passthrough costs without Python. A system
that cannot run here (no patched pyfuse3, no ``passthrough_hp``, no option) is n/a with the
reason. The big file is also read by fio through tmpfs and both coordlfs mounts
(``coordlfs.bench.bigfile``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from coordlfs.bench import bigfile, harness
from coordlfs.bench.children import environment
from coordlfs.bench.passthrough import DEFAULT_HP, Unavailable, passthrough_hp
from coordlfs.bench.ratios import ratio
from coordlfs.bench.reading import copy_files, read_files
from coordlfs.client import run as run_command
from coordlfs.client.dataset import Dataset as ClientDataset
from coordlfs.daemon.daemon import READ_AHEAD_KB
from coordlfs.daemon.mounting import set_read_ahead
from coordlfs.errors import UserError
from coordlfs.sizes import format_size, parse_size, physical_memory
from coordlfs.system.private_dir import open_private
from coordlfs.testbed.dataset import Dataset, DatasetSpec, ensure_dataset
from coordlfs.testbed.logs import log_size, warn_of_logged_errors
from coordlfs.testbed.mounts import mounted, stop_daemon, uninterrupted

#: The goal from the issue: cache-served hits at 90% of the bare pyfuse3 ceiling or better.
GOAL = 0.9
#: The goal for the client: a hit copied out at 1.5x tmpfs's open+read+close.
CLIENT_GOAL = 1.5
#: Bytes per read() call: one call reads a whole small file, as a loader's f.read() does.
CHUNK = 1 << 20
#: Seconds a daemon may take to mount (memfs first loads the whole dataset into memory).
START_TIMEOUT = 300.0
#: Seconds one measured run may take before the benchmark gives up on a hung mount.
RUN_TIMEOUT = 600.0
#: What a run that took longer says.
HUNG = f"a reader took more than {RUN_TIMEOUT:.0f}s; is a mount hung?"
#: What a run whose reader failed says.
FAILED = "a reader process failed (see its traceback above)"
#: Attempts at a run before one disturbed by someone else's drop_caches is kept anyway.
TRIES = 5
#: The big file, relative to the dataset directory.
BIG = "big/big.bin"


@dataclass(frozen=True, slots=True)
class Case:
    """One row of the table: a system, and whether the kernel page cache is warm.

    A cold case first drops the page cache of the files it reads from the copies named in
    ``evict`` (the mount, and for passthrough the source on disk as well).
    """

    key: str
    label: str
    system: str
    warm: bool
    evict: tuple[str, ...] = ()


#: In the order they run, each coordlfs case right after the baseline it is compared with.
CASES = (
    # tmpfs pages are the data itself: there is no page cache to drop
    Case("tmpfs", "tmpfs (the limit)", "tmpfs", False),
    # the client maps coordlfs's cache (tmpfs) and copies each file out: nothing to drop
    Case("client", "coordlfs client, bytes copied out", "client", False),
    Case("client_warm", "coordlfs client, mapping warm", "client", True),
    Case("bare", "bare pyfuse3, from daemon (ceiling)", "memfs", False, ("memfs",)),
    # coordlfs's cache is in tmpfs, which dropping the page cache leaves alone, as it should
    Case("coordlfs_cache", "coordlfs classic, from its cache", "coordlfs", False,
         ("coordlfs",)),
    Case("hp", "passthrough_hp (libfuse, C++)", "hp", False, ("hp",)),
    Case("coordlfs_pt", "coordlfs passthrough", "coordlfs_pt", False, ("coordlfs_pt",)),
    # the same, every request answered by the Python loop (--request-lane no)
    Case("coordlfs_py", "coordlfs passthrough, no lane", "coordlfs_py", False,
         ("coordlfs_py",)),
    # readers under `coordlfs run`: the preload library opens the cache's files itself
    Case("run", "coordlfs run (preload library)", "run", False),
    Case("bare_warm", "bare pyfuse3, page cache warm", "memfs", True),
    Case("coordlfs_warm", "coordlfs classic, page cache warm", "coordlfs", True),
    Case("hp_warm", "passthrough_hp, page cache warm", "hp", True),
    Case("coordlfs_pt_warm", "coordlfs passthrough, warm", "coordlfs_pt", True),
    Case("passthrough", "naive passthrough, from disk", "passthrough", False,
         ("passthrough", "source")),
)
#: Each case is compared with the bare pyfuse3 case of the same page-cache state.
BASELINE = {False: "bare", True: "bare_warm"}
#: The issue's goals for passthrough hits with the page cache dropped: a share of tmpfs by
#: reader count (more than 4 readers: the goal of 4), and of passthrough_hp.
PASSTHROUGH_GOALS = {1: 0.16, 4: 0.22}
PASSTHROUGH_HP_GOAL = 0.9
#: The goal for the daemon's CPU per file of a passthrough hit, at most this many times
#: passthrough_hp's in the same run (issue 33, item 4).
PASSTHROUGH_CPU_GOAL = 1.3
#: The cases whose daemon CPU per file is set side by side: coordlfs's passthrough hit, the
#: C++ daemon's, and each warm.
CPU_CASES = ("coordlfs_pt", "coordlfs_py", "hp", "coordlfs_pt_warm", "hp_warm")
#: The goal for readers under ``coordlfs run``: hits at 0.9x tmpfs.
RUN_GOAL = 0.9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, default=2000,
                        help="number of small files (default 2000)")
    parser.add_argument("--size", default="112K", help="size of each small file (default 112K)")
    parser.add_argument("--big-size", default="1G",
                        help="size of the file read sequentially; 0 skips it (default 1G)")
    parser.add_argument("--readers", default="1,4",
                        help="comma-separated reader process counts (default 1,4)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs per figure; the median is reported (default 5)")
    parser.add_argument("--dir", help="dataset directory, on disk; reused when it matches "
                                      "(default: coordlfs-bench-hits in the temp directory)")
    parser.add_argument("--read-ahead-kb", type=int, metavar="KB", default=READ_AHEAD_KB,
                        help="read_ahead_kb of every FUSE mount, the baselines too (default: "
                             f"{READ_AHEAD_KB}, what coordlfs sets for itself)")
    parser.add_argument("--passthrough-hp", metavar="PATH", default=str(DEFAULT_HP),
                        help="libfuse's passthrough_hp (default: where scripts/setup builds it, "
                             f"{DEFAULT_HP})")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


# -- arguments ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """The options, checked (``settings_from``): every problem is found before anything is
    written or mounted."""

    files: int
    size: int
    big_size: int
    readers: tuple[int, ...]
    repeat: int
    directory: str
    read_ahead_kb: int
    json_path: str | None
    passthrough_hp: str = str(DEFAULT_HP)


def parse_readers(text: str) -> tuple[int, ...]:
    """``"1,4"`` -> ``(1, 4)``; anything else that is not positive integers is a UserError."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise UserError(f"bad --readers {text!r}: expected positive integers such as 1,4")
    return tuple(dict.fromkeys(counts))


def settings_from(args: argparse.Namespace) -> Settings:
    """Validated settings; every problem is a one-line UserError."""
    if args.files < 1:
        raise UserError(f"bad --files {args.files}: need at least 1")
    if args.repeat < 1:
        raise UserError(f"bad --repeat {args.repeat}: need at least 1")
    size = parse_size(args.size, "--size")
    if size < 1:
        raise UserError(f"bad --size {args.size!r}: need at least 1 byte")
    if args.read_ahead_kb < 0:
        raise UserError(f"bad --read-ahead-kb {args.read_ahead_kb}: must not be negative")
    directory = args.dir or os.path.join(tempfile.gettempdir(), "coordlfs-bench-hits")
    return Settings(args.files, size, parse_size(args.big_size, "--big-size"),
                    parse_readers(args.readers), args.repeat, os.path.abspath(directory),
                    args.read_ahead_kb, args.json, args.passthrough_hp)


def check_can_run() -> None:
    """The benchmark mounts FUSE and tunes the mounts: that needs root and /dev/fuse."""
    harness.require_root("bench hits", "mounts FUSE filesystems and sets their read-ahead "
                         "in /sys/class/bdi")
    harness.require_fuse()


# -- the dataset --------------------------------------------------------------------------


def small_files(dataset: Dataset) -> list[str]:
    """The equal small files, relative to the root every system serves."""
    return [rel for rel, _size in dataset.files if rel != BIG]


def big_file(dataset: Dataset) -> str | None:
    """The big file read sequentially, if there is one."""
    return BIG if any(rel == BIG for rel, _size in dataset.files) else None


def _big_file(directory: str, size: int) -> str:
    """One file of ``size`` random bytes, reused if it has that size; written in 64 MiB chunks
    so that a 1 GiB file needs no 1 GiB buffer."""
    path = os.path.join(directory, BIG)
    with contextlib.suppress(FileNotFoundError):
        if os.path.getsize(path) == size:
            return BIG
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".part", "wb") as f:
        for start in range(0, size, 64 << 20):
            f.write(os.urandom(min(64 << 20, size - start)))
    os.replace(path + ".part", path)
    return BIG


def prepare_dataset(directory: str, files: int, size: int, big_size: int) -> Dataset:
    """The benchmark's dataset in ``directory``: ``files`` files of exactly ``size`` bytes
    under ``small/`` (a lognormal with no spread) and, unless ``big_size`` is 0, one big file;
    reused where intact, else (re)written.

    The whole directory is mounted, so it may hold nothing but what this benchmark wrote.
    """
    # ours alone: the default is a predictable name in /tmp, where another user could have
    # made it and planted links where the dataset is written
    os.close(open_private(directory, "remove it or give another --dir").fd)
    others = set(os.listdir(directory)) - {"small", os.path.dirname(BIG)}
    if others:
        raise UserError(f"--dir {directory} holds other things than this benchmark's dataset "
                        f"({', '.join(sorted(others))}); give a new or empty directory")
    spec = DatasetSpec(files, mean_bytes=size, sigma=0.0, classes=1)
    small = ensure_dataset(os.path.join(directory, "small"), spec)
    big = ((_big_file(directory, big_size), big_size),) if big_size else ()
    return Dataset(Path(directory), spec,
                   tuple((os.path.join("small", rel), n) for rel, n in small.files) + big,
                   small.reused)


# -- mounts and daemons -------------------------------------------------------------------


#: The kernel's kind of a process CPU-time clock that counts the scheduler's runtime.
_CPUCLOCK_SCHED = 2


def evict(paths: list[str]) -> None:
    """Drop these files' pages from the kernel page cache, as memory pressure would.

    POSIX_FADV_DONTNEED on each file rather than the global /proc/sys/vm/drop_caches: the
    kernel's dentries and inodes stay (as they do under the pressure a cache is for), and
    other processes on the machine keep their caches.
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, its threads' that exited included, to the nanosecond:
    its CPU-time clock (``clock_getcpuclockid(3)``'s id, made as glibc makes it). A sum over
    the threads alive now lost the time of every worker thread that ended meanwhile (trio
    lets an idle one go after 10 s: a daemon's CPU over a run came out negative), and
    /proc/PID/stat counts in 10 ms ticks (a small run's passthrough_hp came out at 0)."""
    return time.clock_gettime((~pid << 3) | _CPUCLOCK_SCHED)


def _wait_ready(name: str, process: subprocess.Popen, log: str) -> None:
    """Wait for the daemon's first line on stdout, which it prints once the mount is live."""
    assert process.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        readable, _, _ = select.select([process.stdout], [], [], 1.0)
        if readable:
            if process.stdout.readline():
                return
            break  # EOF: it exited
    raise UserError(f"{name} did not mount: {harness.log_tail(log)}")


@contextlib.contextmanager
def baseline(kind: str, source: str, mountpoint: str, log: str) -> Iterator[int]:
    """Serve a bare pyfuse3 baseline (``coordlfs.bench.baselines``) until the block ends;
    yields its pid. It is not coordlfs, so ``coordlfs mount`` cannot start it: it runs in the
    foreground and says ``ready`` on stdout. It stops as every test and bench daemon does
    (``stop_daemon``); its own session keeps a Ctrl-C at the terminal away from it.
    Errors it logged are a warning on stderr: its log goes with the bench's directory.
    """
    offset = log_size(log)
    with open(log, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "coordlfs.bench.baselines", kind, source, mountpoint],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file,
            start_new_session=True)
    try:
        _wait_ready(kind, process, log)
        yield process.pid
    finally:
        with uninterrupted():
            stop_daemon(mountpoint, process.pid)
            process.wait()
            assert process.stdout is not None
            process.stdout.close()
            warn_of_logged_errors(log, offset, kind, kept=False)


# -- measuring ----------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    seconds: float
    files: int
    bytes: int
    #: CPU time the FUSE daemon spent during the run (None for tmpfs): what a hit costs it
    daemon_cpu_s: float | None = None

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9


class Job(Protocol):
    """The process of a job that hands its readers' order to the mount (a DataLoader's main
    process, where the sampler runs): ``lead`` before they start, ``follow`` while they read,
    told how many files they have read so far (None once none reads any more)."""

    def lead(self) -> None: ...

    def follow(self, progress: Callable[[], int | None]) -> None: ...


def _counted(paths: list[Any], done: Any, slot: int) -> Iterable[Any]:
    """``paths``, with how many of them were read in ``done[slot]`` (shared memory)."""
    for number, path in enumerate(paths):
        done[slot] = number
        yield path
    done[slot] = len(paths)


def _reader(paths: list[Any], barrier: Any, conn: Connection, client: str | None,
            warm: bool, done: Any = None, slot: int = 0) -> None:
    """One reader process: open, read to EOF into one reused buffer, close; or with
    ``client`` (a mountpoint), each file read through the client and copied out, with
    ``warm`` once before the timed pass. Reports times. With ``done`` (a job's readers), it
    starts once the job led (the barrier's second round) and counts its files there."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    buf = bytearray(CHUNK)
    dataset = ClientDataset(client) if client else None  # maps the cache: start-up, not timed
    if dataset and warm:
        copy_files(dataset, paths)
    barrier.wait()
    if done is not None:
        barrier.wait()
        paths = _counted(paths, done, slot)
    start = time.perf_counter()
    total = copy_files(dataset, paths) if dataset else read_files(paths, buf)
    end = time.perf_counter()
    if dataset:
        dataset.close()  # its counts reach the mount's status
    conn.send((start, end, total))
    conn.close()


def measure(paths: list[str], readers: int, client: str | None = None,
            warm: bool = False, job: Job | None = None,
            preload: dict[str, str] | None = None) -> Run:
    """Read ``paths`` split round-robin among ``readers`` processes started together; with
    ``client`` (a mountpoint) the paths are relative to it and read through the client (with
    ``warm``, each process reads its share once before it is timed). With ``job``, this
    process is the job's: once the readers are ready it leads, then starts and follows them.

    With ``preload`` (``coordlfs run``'s variables), the readers are new processes started
    with them (a library is preloaded at exec, never into a fork).

    The time is from the first reader's start (or the job's lead) to the last one's end
    (perf_counter is system-wide on Linux), so process start-up is not counted.
    """
    context = multiprocessing.get_context("spawn" if preload else "fork")
    barrier = context.Barrier(readers + (job is not None), timeout=START_TIMEOUT)
    done = context.RawArray("q", readers) if job else None
    encoded = paths if client else [os.fsencode(p) for p in paths]
    workers, pipes, led = [], [], []
    try:
        for i in range(readers):
            receive, send = context.Pipe(duplex=False)
            worker = context.Process(target=_reader, args=(encoded[i::readers], barrier, send,
                                                           client, warm, done, i))
            with environment(preload or {}):
                worker.start()
            send.close()
            workers.append(worker)
            pipes.append(receive)
        if job is not None:
            _join(barrier)
            led.append(time.perf_counter())
            job.lead()
            _join(barrier)
            job.follow(_progress(done, pipes))
        reports = [_receive(pipe) for pipe in pipes]
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
            worker.join()
    return Run(max(r[1] for r in reports) - min([r[0] for r in reports] + led), len(paths),
               sum(r[2] for r in reports))


def _join(barrier: Any) -> None:
    """The job's wait for its readers: a reader that died first breaks it (at its timeout)."""
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        raise UserError(FAILED) from None


def _progress(done: Any, pipes: list[Connection]) -> Callable[[], int | None]:
    """What a job is told of its readers: the files they read so far, None once every one
    reported (or died); a UserError past ``RUN_TIMEOUT``, as a reader's wait has."""
    deadline = time.monotonic() + RUN_TIMEOUT

    def progress() -> int | None:
        if all(pipe.poll() for pipe in pipes):
            return None
        if time.monotonic() > deadline:
            raise UserError(HUNG)
        return sum(done)

    return progress


def _receive(pipe: Connection) -> tuple[float, float, int]:
    if not pipe.poll(RUN_TIMEOUT):
        raise UserError(HUNG)
    try:
        return pipe.recv()
    except EOFError:
        raise UserError(FAILED) from None


# -- results ------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    """The runs of one case with one reader count (readers 0: the sequential big file)."""

    case: str
    readers: int
    runs: list[Run] = field(default_factory=list)

    @property
    def files_per_s(self) -> float:
        return statistics.median(r.files_per_s for r in self.runs)

    @property
    def gb_per_s(self) -> float:
        return statistics.median(r.gb_per_s for r in self.runs)

    @property
    def daemon_us_per_file(self) -> float | None:
        costs = [r.daemon_cpu_s / r.files * 1e6 for r in self.runs if r.daemon_cpu_s is not None]
        return statistics.median(costs) if costs else None

    def to_json(self) -> dict[str, Any]:
        return {"case": self.case, "readers": self.readers, "files_per_s": self.files_per_s,
                "gb_per_s": self.gb_per_s, "daemon_cpu_us_per_file": self.daemon_us_per_file,
                "runs": [asdict(r) for r in self.runs]}


#: summary key -> (case, the case it is compared with)
COMPARISONS = {
    "coordlfs_cache_vs_bare": ("coordlfs_cache", "bare"),
    "coordlfs_warm_vs_bare_warm": ("coordlfs_warm", "bare_warm"),
    "coordlfs_cache_vs_tmpfs": ("coordlfs_cache", "tmpfs"),
    "coordlfs_cache_vs_passthrough": ("coordlfs_cache", "passthrough"),
    "client_vs_tmpfs": ("client", "tmpfs"),
    "client_warm_vs_tmpfs": ("client_warm", "tmpfs"),
    "client_vs_coordlfs_cache": ("client", "coordlfs_cache"),
    "coordlfs_passthrough_vs_tmpfs": ("coordlfs_pt", "tmpfs"),
    "coordlfs_passthrough_vs_passthrough_hp": ("coordlfs_pt", "hp"),
    "coordlfs_no_lane_vs_passthrough_hp": ("coordlfs_py", "hp"),
    "coordlfs_passthrough_vs_classic": ("coordlfs_pt", "coordlfs_cache"),
    "coordlfs_passthrough_warm_vs_tmpfs": ("coordlfs_pt_warm", "tmpfs"),
    "coordlfs_passthrough_warm_vs_passthrough_hp_warm": ("coordlfs_pt_warm", "hp_warm"),
    "passthrough_hp_vs_tmpfs": ("hp", "tmpfs"),
    "run_vs_tmpfs": ("run", "tmpfs"),
    "run_vs_coordlfs_passthrough": ("run", "coordlfs_pt"),
}


def columns(readers: tuple[int, ...], big: bool) -> list[tuple[str, int]]:
    """(name, results key) of each measurement: the reader counts, then the big file as 0."""
    return [(str(n), n) for n in readers] + ([("sequential", 0)] if big else [])


def paired_ratio(result: Result | None, baseline: Result | None) -> float | None:
    """The median of run-by-run ratios (None where a case could not run).

    Run i of two adjacent cases was taken seconds apart, so their ratio cancels most of the
    swings in CPU speed a shared virtual machine has; the ratio of medians does not.
    """
    if result is None or baseline is None:
        return None
    pairs = zip(result.runs, baseline.runs, strict=True)
    ratios = [r.gb_per_s / b.gb_per_s for r, b in pairs if b.gb_per_s > 0]
    return statistics.median(ratios) if ratios else None


def summarize(results: dict[tuple[str, int], Result], readers: tuple[int, ...],
              big: bool) -> dict[str, Any]:
    """Ratios the issue asks for: coordlfs against bare pyfuse3 (and the others).

    Keyed by reader count (``"1"``, ``"4"``) and ``"sequential"`` for the big file. Files/s
    and GB/s give the same ratio: every case reads the same files.
    """
    cols = columns(readers, big)
    summary: dict[str, Any] = {"goal": GOAL}
    for name, (case, base) in COMPARISONS.items():
        summary[name] = {label: _ratio_of(results.get((case, key)), results.get((base, key)))
                         for label, key in cols}
    for name, case, base in (("coordlfs_cache_vs_bare_paired", "coordlfs_cache", "bare"),
                             ("client_vs_tmpfs_paired", "client", "tmpfs"),
                             ("coordlfs_passthrough_vs_passthrough_hp_paired", "coordlfs_pt",
                              "hp"),
                             ("run_vs_tmpfs_paired", "run", "tmpfs")):
        summary[name] = {label: paired_ratio(results.get((case, key)), results.get((base, key)))
                         for label, key in cols}
    hits = [summary["coordlfs_cache_vs_bare"][str(n)] for n in readers]
    summary["goal_met"] = all(r is not None and r >= GOAL for r in hits)
    summary["client_goal"] = CLIENT_GOAL
    client = [summary["client_vs_tmpfs"][str(n)] for n in readers]
    summary["client_goal_met"] = all(r is not None and r >= CLIENT_GOAL for r in client)
    warm = [summary["client_warm_vs_tmpfs"][str(n)] for n in readers]
    summary["client_warm_goal_met"] = all(r is not None and r >= CLIENT_GOAL for r in warm)
    summary["passthrough_goals"] = {"vs_tmpfs": PASSTHROUGH_GOALS,
                                    "vs_passthrough_hp": PASSTHROUGH_HP_GOAL}
    summary["passthrough_goal_met"] = _passthrough_goal_met(summary, readers)
    summary["daemon_cpu_us_per_file"] = {
        case: {label: _cpu(results.get((case, key))) for label, key in cols if key}
        for case in CPU_CASES}
    summary["passthrough_cpu_vs_passthrough_hp"] = {
        label: _cpu_ratio(results.get(("coordlfs_pt", key)), results.get(("hp", key)))
        for label, key in cols if key}
    summary["passthrough_cpu_goal"] = PASSTHROUGH_CPU_GOAL
    summary["run_goal"] = RUN_GOAL
    preloaded = [summary["run_vs_tmpfs"][str(n)] for n in readers]
    summary["run_goal_met"] = (None if any(r is None for r in preloaded)
                               else all(r >= RUN_GOAL for r in preloaded))
    return summary


def _cpu(result: Result | None) -> float | None:
    """A case's median daemon CPU µs per file, None where it could not run."""
    cost = None if result is None else result.daemon_us_per_file
    return None if cost is None else round(cost, 1)


def _cpu_ratio(result: Result | None, baseline: Result | None) -> float | None:
    """The ratio of two cases' daemon CPU per file; None where either could not run."""
    mine, theirs = _cpu(result), _cpu(baseline)
    return None if mine is None or not theirs else ratio(mine, theirs)


def _ratio_of(result: Result | None, baseline: Result | None) -> float | None:
    """The ratio of two cases' medians; None where either could not run."""
    if result is None or baseline is None:
        return None
    return ratio(result.gb_per_s, baseline.gb_per_s)


def _passthrough_goal_met(summary: dict[str, Any], readers: tuple[int, ...]) -> bool | None:
    """Passthrough hits with the page cache dropped against tmpfs and passthrough_hp; None
    where either could not run."""
    pairs = []
    for n in readers:
        goal = PASSTHROUGH_GOALS.get(n, PASSTHROUGH_GOALS[max(PASSTHROUGH_GOALS)])
        pairs += [(summary["coordlfs_passthrough_vs_tmpfs"][str(n)], goal),
                  (summary["coordlfs_passthrough_vs_passthrough_hp"][str(n)],
                   PASSTHROUGH_HP_GOAL)]
    if any(value is None for value, _goal in pairs):
        return None
    return all(value >= goal for value, goal in pairs)


def _cpu_line(summary: dict[str, Any], label: str, what: str) -> str:
    """Daemon CPU per file of a passthrough hit beside passthrough_hp's, and their ratio."""
    cpu = summary["daemon_cpu_us_per_file"]

    def us(case: str) -> str:
        return "-" if cpu[case][label] is None else f"{cpu[case][label]:.0f} µs"

    share = summary["passthrough_cpu_vs_passthrough_hp"][label]
    return (f"daemon CPU per file, {what}: coordlfs passthrough {us('coordlfs_pt')} "
            f"(warm {us('coordlfs_pt_warm')}; no lane {us('coordlfs_py')}), passthrough_hp "
            f"{us('hp')} (warm "
            f"{us('hp_warm')}): {'-' if share is None else f'{share:.2f}x'} "
            f"(goal <= {PASSTHROUGH_CPU_GOAL}x)")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


_RATE_HEAD = f"{'files/s':>8} "


def _cells(result: Result, baseline: Result, files: bool) -> str:
    share = _percent(ratio(result.gb_per_s, baseline.gb_per_s))
    rate = f"{result.files_per_s:>8,.0f} " if files else ""
    return f"{rate}{result.gb_per_s:>6.2f} {share:>7}"


def format_table(results: dict[tuple[str, int], Result], readers: tuple[int, ...],
                 big_size: int, unavailable: dict[str, str] | None = None) -> str:
    """One line per case: files/s, GB/s and the share of bare pyfuse3, per reader count; a
    case whose system could not run (``unavailable``: system -> why) says why.

    "vs bare" compares with bare pyfuse3 in the same page-cache state (dropped or warm).
    """
    top, head = f"{'':<36}", f"{'case':<36}"
    for label, key in columns(readers, big_size > 0):
        title = (f"{label} reader{'s' if key > 1 else ''}" if key
                 else f"{format_size(big_size)} sequential")
        top += f" | {title:^{23 if key else 14}}"
        head += f" | {_RATE_HEAD if key else ''}{'GB/s':>6} {'vs bare':>7}"
    lines = [top, head, "-" * len(head)]
    for case in CASES:
        line = f"{case.label:<36}"
        why = (unavailable or {}).get(case.system)
        if why:
            lines.append(f"{line} | n/a: {why}")
            continue
        for _, key in columns(readers, big_size > 0):
            line += " | " + _cells(results[case.key, key], results[BASELINE[case.warm], key],
                                   files=key > 0)
        lines.append(line)
    return "\n".join(lines)


# -- the benchmark ------------------------------------------------------------------------


@dataclass(slots=True)
class Bench:
    """The systems under test (where each one's copy of the dataset is) and the results."""

    settings: Settings
    dataset: Dataset
    roots: dict[str, str]
    #: the daemon's pid of each FUSE system
    pids: dict[str, int]
    #: the systems that could not run here, and why
    unavailable: dict[str, str]
    results: dict[tuple[str, int], Result] = field(default_factory=dict)
    #: the big file read by fio: GB/s of each run by (system, ``bigfile.key``)
    big_runs: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    #: runs taken again because the kernel's caches were dropped while they ran
    disturbed: int = 0
    #: ``coordlfs run``'s variables for the passthrough mount (``_preload``)
    preload: dict[str, str] = field(default_factory=dict)

    def paths(self, system: str, rels: list[str]) -> list[str]:
        return [os.path.join(self.roots[system], rel) for rel in rels]

    def control(self, system: str = "coordlfs") -> str:
        return os.path.join(self.roots[system], ".coordlfs")

    def once(self, case: Case, rels: list[Any], readers: int, key: int) -> None:
        """One measured run, after dropping the page cache or after warming it.

        A run during which another process dropped the kernel's caches (a test suite, say)
        measured something else: it is taken again.
        """
        client = self.roots["coordlfs"] if case.system == "client" else None
        paths = rels if client else self.paths(case.system, rels)
        for _ in range(TRIES):
            drops = harness.drop_count()
            if case.warm and not client:  # a client's reader warms its own mapping
                measure(paths, readers)
            for system in case.evict:
                evict(self.paths(system, rels))
            pid = self.pids.get(case.system)
            cpu = cpu_seconds(pid) if pid else 0.0
            run = measure(paths, readers, client, case.warm,
                          preload=self.preload if case.system == "run" else None)
            if pid:
                run.daemon_cpu_s = cpu_seconds(pid) - cpu
            if harness.drop_count() == drops:
                break
            self.disturbed += 1
            print(f"  {case.label}: another process dropped the caches; again", flush=True)
        expected = self.dataset.bytes_of(rels)
        if run.bytes != expected:
            raise UserError(f"{case.label}: read {run.bytes} bytes, expected {expected}")
        self.results.setdefault((case.key, key), Result(case.key, key)).runs.append(run)

    def repeat(self, number: int) -> None:
        """One run of every case; the cases compared with each other run back to back."""
        rng = random.Random(number)
        big = big_file(self.dataset)
        for _, key in columns(self.settings.readers, big is not None):
            if key:
                rels = small_files(self.dataset)
                rng.shuffle(rels)
            else:
                rels = [big] if big else []
            for case in CASES:
                if case.system not in self.unavailable:
                    self.once(case, rels, max(key, 1), key)
        if big and "fio" not in self.unavailable:
            self.fio_big(big)

    def fio_big(self, big: str) -> None:
        """One fio run of every pattern and reader count through every system that runs,
        the systems back to back, each mount's pages of the file dropped first."""
        size = self.dataset.bytes_of([big])
        with tempfile.TemporaryDirectory(prefix="coordlfs-bench-fio-") as scratch:
            for pattern in bigfile.PATTERNS:
                for readers in self.settings.readers:
                    for system in bigfile.SYSTEMS:
                        if system in self.unavailable:
                            continue
                        path = self.paths(system, [big])
                        if system != "tmpfs":
                            evict(path)
                        rate = bigfile.measure(path[0], pattern, readers, size, Path(scratch))
                        self.big_runs.setdefault((system, bigfile.key(pattern, readers)),
                                                 []).append(rate)

    def warm_coordlfs(self, system: str = "coordlfs") -> dict[str, Any]:
        """Read everything once through a coordlfs mount and wait until its cache holds all of
        it."""
        everything = [rel for rel, _size in self.dataset.files]
        measure(self.paths(system, everything), 1)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            status = self.status(system)
            cache = status["cache"]
            if cache["filling"] == 0 and cache["files"] >= len(everything):
                return status
            if time.monotonic() > deadline:
                raise UserError(f"coordlfs cached {cache['files']} of {len(everything)} files")
            time.sleep(0.1)

    def status(self, system: str = "coordlfs") -> dict[str, Any]:
        with open(self.control(system), "rb") as f:
            return json.loads(f.read())


def _check_memory(dataset: Dataset) -> None:
    # tmpfs copy + memfs's dict + coordlfs's three caches + page cache of the warm cases
    need = 7 * dataset.total_bytes
    if need > physical_memory():
        raise UserError(f"the dataset ({format_size(dataset.total_bytes)}) is too large for "
                        f"this machine's memory ({format_size(physical_memory())}); the "
                        f"benchmark keeps about 6 copies of it in RAM")


def _start_all(stack: contextlib.ExitStack, settings: Settings, dataset: Dataset,
               work: str) -> tuple[dict[str, str], dict[str, int], dict[str, str]]:
    """Copy the dataset to tmpfs and mount each FUSE system.

    Returns the root path of each system's copy, the pid of each FUSE daemon and why each
    system that could not start (coordlfs passthrough, passthrough_hp, fio) could not.
    """
    shm = stack.enter_context(tempfile.TemporaryDirectory(prefix="coordlfs-bench-",
                                                          dir="/dev/shm"))
    roots = {"source": dataset.root, "tmpfs": os.path.join(shm, "data")}
    print(f"copying the dataset to tmpfs ({roots['tmpfs']})", flush=True)
    shutil.copytree(dataset.root, roots["tmpfs"])
    pids: dict[str, int] = {}
    unavailable = {}
    fio = bigfile.unavailable()
    if fio:
        unavailable["fio"] = fio
    for system in ("memfs", "passthrough", "coordlfs", "coordlfs_pt", "coordlfs_py", "hp"):
        mountpoint = os.path.join(work, system)
        os.mkdir(mountpoint)
        stack.callback(os.rmdir, mountpoint)  # runs after the unmount below: an empty dir
        log = os.path.join(work, f"{system}.log")
        print(f"mounting {system} on {mountpoint}", flush=True)
        try:
            pids[system] = stack.enter_context(
                _serve(system, settings, dataset, roots, mountpoint, log, shm))
        except Unavailable as e:
            unavailable[system] = str(e)
            print(f"  {system}: n/a: {e}", flush=True)
            continue
        set_read_ahead(mountpoint, settings.read_ahead_kb)
        roots[system] = mountpoint
    pids["client"] = pids["coordlfs"]  # what a client's hit costs the daemon: nothing
    _preload(roots, pids, unavailable)
    return roots, pids, unavailable


def _preload(roots: dict[str, str], pids: dict[str, int], unavailable: dict[str, str]) -> None:
    """The ``run`` case reads the mount the default options make (passthrough where it can
    run) under ``coordlfs run``; n/a without the library."""
    mount = "coordlfs_pt" if "coordlfs_pt" in roots else "coordlfs"
    if run_command.library() is None:
        unavailable["run"] = "the preload library is not built (scripts/setup)"
        return
    roots["run"], pids["run"] = roots[mount], pids[mount]


@contextlib.contextmanager
def _serve(system: str, settings: Settings, dataset: Dataset, roots: dict[str, str],
           mountpoint: str, log: str, shm: str) -> Iterator[int]:
    """Mount one FUSE system; yields its daemon's pid. Unavailable if coordlfs passthrough or
    passthrough_hp cannot run here."""
    if system == "hp":  # over the tmpfs copy: backing files on tmpfs, as coordlfs's are
        with passthrough_hp(Path(settings.passthrough_hp), roots["tmpfs"], mountpoint,
                            Path(log)) as pid:
            yield pid
        return
    if system not in ("coordlfs", "coordlfs_pt", "coordlfs_py"):
        with baseline(system, dataset.root, mountpoint, log) as pid:
            yield pid
        return
    # Room for everything with a margin, and no per-file limit: every file a hit. The cache
    # on a tmpfs of its own in huge pages, as a root mount has it by default.
    room = str(dataset.total_bytes + (64 << 20))
    # yes: never a silent fall back to the classic path
    flags = ("--passthrough", "no" if system == "coordlfs" else "yes",
             "--request-lane", "no" if system == "coordlfs_py" else "auto")
    with contextlib.ExitStack() as stack:
        try:
            daemon = stack.enter_context(mounted(
                Path(dataset.root), Path(mountpoint), Path(log), "--cache-size", room,
                "--max-file-size", room, "--cache-tmpfs", "yes", *flags,
                cache_dir=Path(shm, f"cache-{system}")))
        except UserError as e:  # --passthrough yes where passthrough cannot run
            if system == "coordlfs":
                raise
            raise Unavailable(str(e)) from None
        yield daemon.pid


def _report(bench: Bench, reads: dict[str, dict[str, int]],
            passthrough: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON report; ``reads``: each coordlfs mount's read counters over the measured runs,
    ``passthrough``: what its status says of passthrough (its keys naming it)."""
    settings = bench.settings
    big_rel = big_file(bench.dataset)
    big = big_rel is not None
    summary = summarize(bench.results, settings.readers, big)
    big_bytes = bench.dataset.bytes_of([big_rel] if big_rel else [])
    print()
    print(format_table(bench.results, settings.readers, big_bytes, bench.unavailable))
    print()
    for label, key in columns(settings.readers, big):
        what = f"{label} reader{'s' if key > 1 else ''}" if key else "sequential"
        print(f"coordlfs from its cache, {what}: "
              f"{_percent(summary['coordlfs_cache_vs_bare'][label])} of bare pyfuse3 "
              f"(run by run: {_percent(summary['coordlfs_cache_vs_bare_paired'][label])}; "
              f"goal {_percent(GOAL)})")
        print(f"coordlfs client, bytes copied out, {what}: "
              f"{_percent(summary['client_vs_tmpfs'][label])} of tmpfs (run by run: "
              f"{_percent(summary['client_vs_tmpfs_paired'][label])}; goal "
              f"{_percent(CLIENT_GOAL)}); mapping warm: "
              f"{_percent(summary['client_warm_vs_tmpfs'][label])}")
        if key:
            print(f"coordlfs run (preload library), {what}: "
                  f"{_percent(summary['run_vs_tmpfs'][label])} of tmpfs (run by run: "
                  f"{_percent(summary['run_vs_tmpfs_paired'][label])}; goal "
                  f"{_percent(RUN_GOAL)})")
        print(f"coordlfs passthrough, {what}: "
              f"{_percent(summary['coordlfs_passthrough_vs_tmpfs'][label])} of tmpfs, "
              f"{_percent(summary['coordlfs_passthrough_vs_passthrough_hp'][label])} of "
              f"passthrough_hp (run by run: "
              f"{_percent(summary['coordlfs_passthrough_vs_passthrough_hp_paired'][label])})")
        if key:
            print(_cpu_line(summary, label, what))
    if big:
        why_not = {s: why for s, why in bench.unavailable.items() if s in bigfile.SYSTEMS}
        if "fio" in bench.unavailable:
            why_not = dict.fromkeys(bigfile.SYSTEMS, bench.unavailable["fio"])
        summary["big_file"] = bigfile.summary(bench.big_runs, why_not, settings.readers)
        print()
        print(bigfile.format_table(summary["big_file"], settings.readers,
                                   f"{format_size(big_bytes)}, fio, dropped"))
    return {
        "machine": {"cpus": os.cpu_count(), "memory_bytes": physical_memory(),
                    "kernel": platform.release(), "python": platform.python_version()},
        "settings": {**asdict(settings), "chunk": CHUNK},
        "cases": [asdict(c) for c in CASES],
        "results": [r.to_json() for r in bench.results.values()],
        "coordlfs_reads": reads["coordlfs"],
        "coordlfs_passthrough_reads": reads.get("coordlfs_pt"),
        "passthrough_status": passthrough,
        "runs_disturbed_and_retaken": bench.disturbed,
        "unavailable": bench.unavailable,
        "summary": summary,
    }


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    check_can_run()
    dataset = prepare_dataset(settings.directory, settings.files, settings.size,
                              settings.big_size)
    _check_memory(dataset)
    print(f"dataset: {settings.files} files of {format_size(settings.size)}"
          f"{f' and one of {format_size(settings.big_size)}' if settings.big_size else ''} in "
          f"{dataset.root}", flush=True)
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="coordlfs-bench-"))
        bench = Bench(settings, dataset, *_start_all(stack, settings, dataset, work))
        if "run" not in bench.unavailable:
            bench.preload = run_command.environment([bench.roots["run"]], {}) or {}
        print("filling the coordlfs caches", flush=True)
        mounts = [s for s in ("coordlfs", "coordlfs_pt", "coordlfs_py")
                  if s not in bench.unavailable]
        before = {system: bench.warm_coordlfs(system)["reads"] for system in mounts}
        for number in harness.repeated(settings.repeat):
            bench.repeat(number - 1)
        reads, passthrough = {}, {}
        for system in mounts:
            status = bench.status(system)
            reads[system] = {k: v - before[system][k] for k, v in status["reads"].items()}
            passthrough[system] = {k: v for k, v in status.items() if "passthrough" in k}
            if reads[system]["bytes_from_source"]:
                print(f"warning: {system} read {reads[system]['bytes_from_source']} bytes from "
                      "the source during the measured runs; not every read was a cache hit",
                      file=sys.stderr)
    harness.write_report(settings.json_path, _report(bench, reads, passthrough))
    return 0
