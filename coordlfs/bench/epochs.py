"""Training epochs through coordlfs against the kernel page cache, under one memory budget.

The claim of coordlfs is that a training job reads less from storage and waits less through
it than through the page cache. Both sides here run the same readers (processes, like
DataLoader workers) over the same shuffled epochs, in one cgroup v1 memory group limited to
the budget B, on storage throttled by a blkio limit:

* page cache: the readers read the source directly; the kernel's LRU keeps what fits in B;
* coordlfs: the readers read the mount and the daemon joins their cgroup, so its cache
  (B minus the daemon's and the readers' own memory, printed), the daemon and the kernel's
  pages of the mount all share B;
* client: the same mount and budget, the readers read through ``coordlfs.client`` (a hit is
  a view of the cache's shared memory, copied out with ``bytes()``; a miss goes through the
  mount), and the trainer hands each epoch's order to the mount before it starts
  (``prefetch``), as ``AlignedSampler`` does.

Bytes from storage are the kernel's count for the budget's cgroup (``Cgroup.bytes_read``),
not coordlfs's: what its readers had read, and for coordlfs its daemon too (with passthrough
a miss, or a file no cache has room for, is read by the reader's kernel from the source file
itself; a client's readers read those from the source too). The throttle caps the same
group, so it holds back every side's readers alike. A trainer loop consumes the batches in
order, sleeping ``--compute-ms`` per batch for the GPU step; the time it waits for the next
batch is the stall time, as DS-Analyzer measures it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from coordlfs.bench import harness
from coordlfs.bench.children import Readers, batch_paths, running
from coordlfs.bench.ratios import median, ratio
from coordlfs.client.dataset import Dataset as ClientDataset
from coordlfs.errors import UserError
from coordlfs.sizes import format_size, parse_size
from coordlfs.testbed.cgroup import Cgroup, memory_cgroup
from coordlfs.testbed.dataset import Dataset, epoch_orders
from coordlfs.testbed.mounts import mounted
from coordlfs.testbed.storage import drop_caches

CGROUP_PREFIX = "coordlfs-epochs"
#: Seconds between samples of the storage counters, for the throughput plot.
SAMPLE_S = 0.25
PLOT_WINDOW_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_dataset_arguments(parser, "epochs", make="10000:110K")
    parser.add_argument("--budget", default="0.5",
                        help="memory budget: bytes (K/M/G) or a fraction of the dataset "
                             "(default 0.5)")
    harness.add_training_arguments(parser, readers=4, readers_help="reader processes",
                                   compute_ms=0.0)
    parser.add_argument("--plot", metavar="FILE.png",
                        help="plot storage throughput over time and bytes per epoch")


@dataclass(frozen=True, slots=True)
class Settings:
    budget_text: str
    epochs: int
    readers: int
    batch: int
    compute_ms: float
    seed: int
    throttle: int | None
    repeat: int


def settings_from(args: argparse.Namespace) -> Settings:
    harness.check_training_arguments(args)
    return Settings(args.budget, args.epochs, args.readers, args.batch, args.compute_ms,
                    args.seed, harness.parse_throttle(args.throttle), args.repeat)


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


def run_epochs(system: str, group: Readers, storage: Callable[[], int], dataset: Dataset,
               base: str | Path, settings: Settings,
               before_epoch: Callable[[list[str]], Any] | None = None) -> ConfigResult:
    """Every epoch's batches under ``base``; ``before_epoch`` is given each epoch's order
    first (the client's trainer hands it to the mount), in the epoch's time. ``storage``
    counts the bytes read from storage so far."""
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
            _seconds, waited, got = group.epoch(batches, settings.compute_ms / 1000)
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


def run_page_cache(dataset: Dataset, budget: int, settings: Settings) -> ConfigResult:
    name = f"{CGROUP_PREFIX}-{os.getpid()}"
    with running(Readers(settings.readers)) as group, _group(name, settings, dataset) as cgroup:
        for pid in group.pids:
            cgroup.add(pid)
        memory = cgroup.memory_usage()
        cgroup.set_memory_limit(budget)
        drop_caches()
        result = run_epochs("page cache", group, cgroup.bytes_read, dataset, dataset.root,
                            settings)
        result.peak_memory_bytes = cgroup.peak_memory()
    result.readers_memory_bytes = memory
    return result


def cache_size_for(budget: int, dataset: Dataset, readers_memory: int, readers: int,
                   client: bool = False) -> int:
    """What is left of the budget for cached bytes.

    The daemon's own memory grows with the files it knows (DAEMON_BYTES_PER_FILE), and the
    kernel needs a little room for pages of reads in flight (more for a client's readers)
    and its own records of each cached file (KERNEL_BYTES_PER_CACHED_FILE, charged for every
    file: the cache may hold them all). The capacity itself counts cached bytes in pages.
    """
    per_reader = harness.PAGE_HEADROOM_PER_READER + (
        harness.CLIENT_HEADROOM_PER_READER if client else 0)
    room = (budget - readers_memory - harness.DAEMON_BASE_BYTES - per_reader * readers
            - harness.MOUNT_BYTES_PER_FILE * len(dataset.files))
    return max(0, room)


class EpochObserver(Protocol):
    """Told of each epoch's start and of the result while the mount is still up (``bench
    whatif`` marks the epochs and reads the mount's rates)."""

    def before_epoch(self, order: list[str]) -> None: ...

    def finished(self, result: ConfigResult) -> None: ...


def run_coordlfs(dataset: Dataset, budget: int, settings: Settings, work: Path,
                 client: bool = False, observer: EpochObserver | None = None) -> ConfigResult:
    """Through the mount; with ``client``, through ``coordlfs.client`` with each epoch's
    order handed over first."""
    name = f"{CGROUP_PREFIX}-{os.getpid()}"
    mountpoint = work / "mnt"
    readers = Readers(settings.readers, str(mountpoint) if client else None)
    with running(readers) as group, _group(name, settings, dataset) as cgroup:
        for pid in group.pids:
            cgroup.add(pid)
        memory = cgroup.memory_usage()
        capacity = cache_size_for(budget, dataset, memory, settings.readers, client)
        print(f"  coordlfs cache {format_size(capacity)} = budget {format_size(budget)} - "
              f"readers {format_size(memory)} - daemon and page headroom", flush=True)
        with mounted(dataset.root, mountpoint, work / "mount.log",
                     "--cache-size", str(capacity)) as mount:
            cgroup.add(mount.pid)
            cgroup.set_memory_limit(budget)
            drop_caches()
            if client:
                with ClientDataset(mountpoint) as trainer:
                    result = run_epochs("client", group, cgroup.bytes_read, dataset, "",
                                        settings, trainer.prefetch)
            else:
                result = run_epochs("coordlfs", group, cgroup.bytes_read, dataset, mountpoint,
                                    settings, observer.before_epoch if observer else None)
                if observer is not None:
                    observer.finished(result)
            result.peak_memory_bytes = cgroup.peak_memory()
    result.cache_capacity_bytes = capacity
    result.readers_memory_bytes = memory
    return result


# -- summary -------------------------------------------------------------------------------

def later(result: ConfigResult, attribute: str) -> float:
    """Sum of an epoch attribute over the epochs after the first (the steady state)."""
    return sum(getattr(e, attribute) for e in result.epochs[1:])


def summarize(runs: list[tuple[ConfigResult, ...]]) -> dict[str, Any]:
    """Medians over repeated runs of page cache ÷ coordlfs (the mount, then the client where
    runs have it), epochs after the first, and the first (cold) epoch's time alone."""

    def fraction(index: int) -> float | None:
        values = [run[index].epochs[i].storage_fraction for run in runs
                  for i in range(1, len(run[index].epochs))]
        return median(values)

    summary: dict[str, Any] = {}
    for index, prefix in ((1, ""), (2, "client_")):
        if any(len(run) <= index for run in runs):
            break
        storage = [ratio(later(run[0], "storage_bytes"), later(run[index], "storage_bytes"))
                   for run in runs]
        times = [ratio(later(run[0], "seconds"), later(run[index], "seconds")) for run in runs]
        first = [ratio(run[0].epochs[0].seconds, run[index].epochs[0].seconds) for run in runs]
        summary |= {
            f"{prefix}storage_bytes_ratio": median(storage),
            f"{prefix}epoch_time_ratio": median(times),
            f"{prefix}first_epoch_time_ratio": median(first),
            f"{prefix}storage_bytes_ratio_runs": storage,
            f"{prefix}epoch_time_ratio_runs": times,
            f"{prefix}first_epoch_time_ratio_runs": first,
        }
    summary["page_cache_storage_fraction"] = fraction(0)
    summary["coordlfs_storage_fraction"] = fraction(1)
    if "client_epoch_time_ratio" in summary:
        summary["client_storage_fraction"] = fraction(2)
    return summary


def plot(path: str, runs: list[tuple[ConfigResult, ...]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib (pip install 'coordlfs[plot]')") from None
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for result in runs[0]:
        # Rates over PLOT_WINDOW_S: a throttle releases reads in bursts finer than that.
        step = max(1, round(PLOT_WINDOW_S / SAMPLE_S))
        pairs = list(zip(result.samples, result.samples[step:], strict=False))
        left.plot([t1 for _, (t1, _) in pairs],
                  [(b1 - b0) / (t1 - t0) / 1e6 for (t0, b0), (t1, b1) in pairs],
                  label=result.system)
    left.set(xlabel="seconds", ylabel="storage reads, MB/s", title="Storage read throughput")
    left.set_ylim(bottom=0)
    left.legend()
    width = 0.8 / len(runs[0])
    for k, result in enumerate(runs[0]):
        xs = [e.epoch + (k - (len(runs[0]) - 1) / 2) * width for e in result.epochs]
        right.bar(xs, [e.storage_fraction for e in result.epochs], width, label=result.system)
    right.set(xlabel="epoch", ylabel="fraction of the dataset",
              title="Bytes from storage per epoch")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


# -- the command ---------------------------------------------------------------------------

def format_table(runs: list[tuple[ConfigResult, ...]]) -> str:
    lines = ["system      epoch  seconds  from storage  files/s  stall%"]
    for result in runs[0] if len(runs) == 1 else ():
        for e in result.epochs:
            lines.append(f"{result.system:10} {e.epoch:6} {e.seconds:8.1f} "
                         f"{e.storage_fraction:12.2f} {e.files_per_s:8.0f} "
                         f"{e.stall_percent:7.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    harness.require_root("bench epochs", harness.TRAINING_NEEDS)
    work = harness.work_dir(args.work, cgroups=CGROUP_PREFIX)
    dataset = harness.load_dataset(args)
    budget = budget_bytes(settings.budget_text, dataset.total_bytes)
    print(f"{harness.describe_dataset(dataset)}; budget {format_size(budget)} "
          f"({budget / dataset.total_bytes:.0%}); throttle "
          f"{harness.describe_throttle(settings.throttle)}", flush=True)
    runs = [(run_page_cache(dataset, budget, settings),
             run_coordlfs(dataset, budget, settings, work),
             run_coordlfs(dataset, budget, settings, work, client=True))
            for _number in harness.repeated(settings.repeat)]
    # runs another process disturbed (dropped caches) are left out, unless all were
    clean = [run for run in runs if not any(r.disturbed_epochs for r in run)] or runs
    summary = summarize(clean)
    summary["runs_left_out_disturbed"] = len(runs) - len(clean)
    if settings.repeat == 1:
        print(format_table(runs))
    print(f"epochs after the first, medians of {len(clean)} run(s): page cache read "
          f"{summary['page_cache_storage_fraction']} and coordlfs "
          f"{summary['coordlfs_storage_fraction']} of the dataset per epoch; "
          f"storage_bytes_ratio {summary['storage_bytes_ratio']}, "
          f"epoch_time_ratio {summary['epoch_time_ratio']}")
    print(f"client (page cache ÷ client): first epoch's time "
          f"{summary['client_first_epoch_time_ratio']}, later epochs' time "
          f"{summary['client_epoch_time_ratio']}, storage_bytes_ratio "
          f"{summary['client_storage_bytes_ratio']} (the mount's first epoch: "
          f"{summary['first_epoch_time_ratio']})")
    harness.write_report(args.json, {
        "dataset": harness.dataset_record(dataset),
        "budget_bytes": budget,
        "settings": asdict(settings),
        "runs": [{"page_cache": asdict(pc), "coordlfs": asdict(cl), "client": asdict(client)}
                 for pc, cl, client in runs],
        "summary": summary,
    })
    if args.plot:
        plot(args.plot, runs)
    return 0
