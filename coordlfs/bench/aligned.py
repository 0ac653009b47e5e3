"""Co-located jobs on one dataset: independent shuffles against a seed-aligned group.

Each job is a process with its own reader processes (its DataLoader workers) and its own
epochs, batches and ``--compute-ms`` per batch. Four systems run the same jobs under one
storage throttle and one memory budget: the page cache with independent seeds, coordlfs with
independent seeds, coordlfs with the jobs in one aligned group (shared order, read window,
read-ahead: the jobs register the file list and their epochs, as ``AlignedSampler`` does),
started together, and the aligned group staggered by the advisor (``coordlfs.models.stagger``): one
job alone on a fresh mount gives ``I``, ``W`` and ``W|cached``, the group started together
gives ``W|conc``, and job k starts k times the advised delay late.
Storage bytes are the kernel's count for the one cgroup that holds the jobs, their readers
and the daemon (``Cgroup.bytes_read``; with passthrough a reader's kernel reads a miss from
the source file itself), and the throttle caps that group; an epoch's bytes are those read
between the moments the last job finished the epoch before and this one.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from coordlfs.bench import harness
from coordlfs.bench.children import EpochMarks, Readers, batch_paths, running, stop_children
from coordlfs.bench.ratios import median, ratio
from coordlfs.errors import UserError
from coordlfs.models.stagger import JobProfile, optimal_delay, standalone_runtime
from coordlfs.protocol.client import Control
from coordlfs.protocol.order import epoch_order
from coordlfs.sizes import format_size
from coordlfs.testbed.cgroup import memory_cgroup
from coordlfs.testbed.dataset import Dataset, epoch_orders
from coordlfs.testbed.mounts import mounted
from coordlfs.testbed.storage import drop_caches

CGROUP_PREFIX = "coordlfs-aligned"
SYSTEMS = ("page cache", "coordlfs", "coordlfs aligned", "coordlfs staggered")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_dataset_arguments(parser, "aligned", make="3000:110K")
    parser.add_argument("--jobs", default="2,4", help="job counts to run (default 2,4)")
    parser.add_argument("--cache", type=float, default=0.25,
                        help="no-eviction cache as a fraction of the dataset (default 0.25)")
    parser.add_argument("--window", type=float, default=0.1,
                        help="read window as a fraction of the dataset (default 0.1)")
    harness.add_training_arguments(parser, readers=2, readers_help="reader processes per job",
                                   compute_ms=20.0)


@dataclass(frozen=True, slots=True)
class Plan:
    jobs: int
    epochs: int
    readers: int
    batch: int
    compute_s: float
    seed: int
    throttle: int | None


# -- one job ---------------------------------------------------------------------------------

def _job_main(conn: Connection, plan: Plan, index: int, dataset: Dataset, base: str,
              group: str | None, compute_s: float, delay_s: float) -> None:
    """A training job: its readers, its order (own seed, or the group's), its epochs, started
    ``delay_s`` after the others are told to go."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench stops us, without a traceback
    try:
        names = [rel for rel, _size in dataset.files]
        control, member = Control(base), None
        if group is None:
            orders = epoch_orders(dataset, plan.epochs, plan.seed * 1000 + index)
        else:  # as AlignedSampler does: join, tell the files, announce each epoch
            reply = control.join_group(group, job=f"job-{index}")
            member = reply["member"]
            control.register_files(member, names)
            orders = [[names[i] for i in epoch_order(reply["seed"], e, len(names))]
                      for e in range(plan.epochs)]
        with running(Readers(plan.readers)) as group_of_readers:
            conn.send(("pids", group_of_readers.pids))
            conn.recv()  # go
            time.sleep(delay_s)
            for number, order in enumerate(orders, 1):
                if member is not None:
                    control.start_epoch(member, number - 1)
                seconds, waited, got = group_of_readers.epoch(
                    batch_paths(order, base, plan.batch), compute_s)
                conn.send(("epoch", number, time.monotonic(), seconds, waited, got))
            conn.send(("done",))
            conn.recv()  # stop: the readers' counters are read until then
    except Exception as e:  # reported to the bench, which stops the run
        conn.send(("error", f"{e.__class__.__name__}: {e}"))


@dataclass(slots=True)
class Jobs:
    """Training jobs side by side, each a forked process with ``Readers`` of its own.

    The same shape as every bench's children (``children.running`` starts and stops them;
    storage per epoch is ``EpochMarks``, as for ``bench hpsearch``'s jobs), but its own
    messages on the pipe: a job runs its epochs by itself and reports each one (pids, then
    epoch ends, done, or an error), where readers answer one batch at a time. Forked rather
    than fresh interpreters, as hpsearch's torch jobs must be: nothing here needs torch, and
    the jobs share the dataset's names without passing them.
    """

    plan: Plan
    dataset: Dataset
    base: str
    group: str | None
    #: per job: compute seconds per batch and start delay (default: the plan's, none)
    computes: tuple[float, ...] | None = None
    delays: tuple[float, ...] | None = None
    procs: list[Any] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)
    reader_pids: list[int] = field(default_factory=list)

    def start(self) -> None:
        context = multiprocessing.get_context("fork")
        for index in range(self.plan.jobs):
            parent, child = context.Pipe()
            # not daemonic: a job has reader processes of its own
            compute = self.computes[index] if self.computes else self.plan.compute_s
            delay = self.delays[index] if self.delays else 0.0
            proc = context.Process(target=_job_main, args=(
                child, self.plan, index, self.dataset, self.base, self.group, compute, delay))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        for conn in self.conns:
            self.reader_pids += self._expect(conn, "pids")[1]

    @staticmethod
    def _expect(conn: Connection, kind: str) -> tuple:
        if not conn.poll(600):
            raise UserError("a job made no progress for 10 minutes")
        message = conn.recv()
        if message[0] == "error":
            raise UserError(f"a job failed: {message[1]}")
        if message[0] != kind:
            raise UserError(f"a job sent {message[0]!r}, expected {kind!r}")
        return message

    def run(self, storage: Callable[[], int]
            ) -> tuple[list[list[tuple[float, float, float]]], list[int]]:
        """Start every job at once. Returns, per job and epoch, (finished at on the monotonic
        clock, seconds, stall seconds), and ``storage()`` read as the last job finished each
        epoch, as bytes per epoch."""
        for conn in self.conns:
            conn.send("go")
        epochs: list[list[tuple[float, float, float]]] = [[] for _ in self.conns]
        marks = EpochMarks(storage, [0] * len(self.conns))
        running = list(self.conns)
        while running:
            ready = wait(running, timeout=600)
            if not ready:
                raise UserError("no job made progress for 10 minutes")
            for conn in ready:
                j = self.conns.index(conn)
                if len(epochs[j]) == self.plan.epochs:
                    self._expect(conn, "done")
                    running.remove(conn)
                    continue
                _kind, _n, at, seconds, waited, got = self._expect(conn, "epoch")
                if got != self.dataset.total_bytes:
                    raise UserError(f"job {j} read {got} bytes in an epoch, the dataset has "
                                    f"{self.dataset.total_bytes}")
                epochs[j].append((at, seconds, waited))
                marks.ended(j, len(epochs[j]))
        return epochs, marks.per_epoch()

    def stop(self) -> None:
        stop_children(self.conns, self.procs, "stop")


# -- one configuration ---------------------------------------------------------------------

@dataclass(slots=True)
class SystemResult:
    system: str
    jobs: int
    #: storage bytes per epoch, all jobs together
    epoch_storage_bytes: list[int]
    #: per job: seconds to finish all epochs
    job_seconds: list[float]
    makespan_s: float
    #: per job and epoch: the share of the epoch it waited for data
    stall_percent: list[list[float]]
    #: per job and epoch: (seconds, seconds waited for data)
    job_epochs: list[list[tuple[float, float]]]
    #: per job: seconds it started after the first
    delays_s: list[float]

    @property
    def later_storage(self) -> int:
        return sum(self.epoch_storage_bytes[1:])


def budget_for(dataset: Dataset, cache: int, window: int, plan: Plan) -> int:
    """The memory budget both systems get: the cache and window plus coordlfs's overhead."""
    return (cache + window + harness.DAEMON_BASE_BYTES
            + harness.MOUNT_BYTES_PER_FILE * len(dataset.files)
            + harness.PAGE_HEADROOM_PER_READER * plan.readers * plan.jobs)


def run_system(system: str, plan: Plan, dataset: Dataset, cache: int, window: int,
               work: Path, delays: tuple[float, ...] | None = None) -> SystemResult:
    name = f"{CGROUP_PREFIX}-{os.getpid()}"
    budget = budget_for(dataset, cache, window, plan)
    with memory_cgroup(name, storage=dataset.root, read_bps=plan.throttle) as cgroup, \
            contextlib.ExitStack() as stack:
        base, group = dataset.root, None
        if system != "page cache":
            base = work / "mnt"
            daemon = stack.enter_context(mounted(
                dataset.root, base, work / "mount.log", "--cache-size", str(cache),
                "--window-size", str(window))).pid
            cgroup.add(daemon)
            group = f"bench-{os.getpid()}" if system != "coordlfs" else None
        jobs = stack.enter_context(running(Jobs(plan, dataset, str(base), group,
                                                     delays=delays)))
        for pid in [p.pid for p in jobs.procs] + jobs.reader_pids:
            cgroup.add(pid)
        cgroup.set_memory_limit(budget)
        drop_caches()
        before = cgroup.bytes_read()
        started = time.monotonic()
        epochs, per_epoch = jobs.run(lambda: cgroup.bytes_read() - before)
    ends = [max(job[e][0] for job in epochs) - started for e in range(plan.epochs)]
    result = SystemResult(system, plan.jobs, per_epoch,
                          [round(job[-1][0] - started, 3) for job in epochs],
                          round(max(ends), 3),
                          [[round(100 * w / s, 1) for _at, s, w in job] for job in epochs],
                          [[(round(s, 3), round(w, 3)) for _at, s, w in job] for job in epochs],
                          list(delays or [0.0] * plan.jobs))
    print(f"  {system:16} {plan.jobs} jobs: storage per epoch "
          f"{' '.join(f'{b / dataset.total_bytes:.2f}' for b in per_epoch)} of the dataset; "
          f"jobs {' '.join(f'{s:.1f}' for s in result.job_seconds)} s, makespan "
          f"{result.makespan_s:.1f} s", flush=True)
    return result


# -- the advisor's delay -------------------------------------------------------------------

#: The resolution of the epochs' (seconds, waited) records: ``SystemResult`` rounds to 1 ms.
RECORD_RESOLUTION_S = 0.001


def busy_per_iteration(epochs: Iterable[tuple[float, float]], steps: int) -> float:
    """The model's ``I``: a job's time outside its waits, per iteration, and never 0.

    A job with no compute (``--compute-ms 0``) spends only microseconds an epoch outside its
    waits, which the 1 ms records round to nothing: ``I`` measures 0. The model needs ``I > 0``
    (a job with neither compute nor waits would take no time at all), so ``I`` is at least the
    most those records can hide, one resolution step spread over the steps. Against a wait of
    milliseconds per batch that changes no delay the advisor finds.
    """
    busy = sum(seconds - waited for seconds, waited in epochs)
    return max(busy, RECORD_RESOLUTION_S) / steps


def calibrate(alone: SystemResult, together: SystemResult, batches: int) -> JobProfile:
    """The stagger model's numbers per iteration (a batch): ``I``, ``W`` and ``W|cached`` from
    one job alone, ``W|conc`` from the first epoch of the group started together (the jobs are
    alike, so their means stand for each). ``W|cached`` here is the later epochs' wait with
    the cache this run has, not a whole cached dataset."""
    (first, *later) = alone.job_epochs[0]
    steps = batches * len(alone.job_epochs[0])
    return JobProfile(
        "job", batches, len(alone.job_epochs[0]),
        I=busy_per_iteration(alone.job_epochs[0], steps),
        W_cold=first[1] / batches,
        W_warm=sum(w for _s, w in later) / (batches * len(later)) if later else first[1] / batches,
        W_concurrent=statistics.mean(job[0][1] for job in together.job_epochs) / batches)


def advised_delays(profile: JobProfile, jobs: int) -> tuple[float, tuple[float, ...]]:
    """The advisor's delay for a pair of these jobs, as a fraction of a job's standalone run;
    job k starts k of those delays late (the model covers pairs: more jobs form a chain)."""
    fraction = optimal_delay([profile, profile]).delay
    step = fraction * standalone_runtime(profile)
    return fraction, tuple(k * step for k in range(jobs))


# -- the command ---------------------------------------------------------------------------

def summarize(runs: list[dict[int, dict[str, SystemResult]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for n in runs[0]:
        storage = [ratio(r[n]["coordlfs"].later_storage, r[n]["coordlfs aligned"].later_storage)
                   for r in runs]
        page = [ratio(r[n]["page cache"].later_storage, r[n]["coordlfs aligned"].later_storage)
                for r in runs]
        makespan = [ratio(r[n]["coordlfs"].makespan_s, r[n]["coordlfs aligned"].makespan_s)
                    for r in runs]
        staggered = [ratio(r[n]["coordlfs aligned"].makespan_s,
                            r[n]["coordlfs staggered"].makespan_s) for r in runs]
        delay = [r[n]["coordlfs staggered"].delays_s[-1] / max(1, n - 1) for r in runs]
        for key, values in ((f"storage_bytes_ratio_{n}jobs", storage),
                            (f"page_cache_storage_ratio_{n}jobs", page),
                            (f"makespan_ratio_{n}jobs", makespan),
                            (f"staggered_makespan_ratio_{n}jobs", staggered),
                            (f"staggered_delay_s_{n}jobs", delay)):
            summary[key] = median(values)
            summary[key + "_runs"] = values
    return summary


def run(args: argparse.Namespace) -> int:
    harness.require_root("bench aligned", harness.TRAINING_NEEDS)
    try:
        counts = sorted({int(n) for n in args.jobs.split(",")})
    except ValueError:
        raise UserError(f"bad --jobs {args.jobs!r}: job counts such as 2,4") from None
    if not counts or counts[0] < 1:
        raise UserError(f"bad --jobs {args.jobs!r}: job counts must be at least 1")
    harness.check_training_arguments(args)
    if not 0 < args.cache < 1 or not 0 <= args.window < 1:
        raise UserError("--cache and --window are fractions of the dataset in [0, 1)")
    throttle = harness.parse_throttle(args.throttle)
    work = harness.work_dir(args.work, cgroups=CGROUP_PREFIX)
    dataset = harness.load_dataset(args)
    cache, window = int(dataset.total_bytes * args.cache), int(dataset.total_bytes * args.window)
    print(f"{harness.describe_dataset(dataset)}; cache {format_size(cache)}, window "
          f"{format_size(window)}; throttle {harness.describe_throttle(throttle)}", flush=True)

    def plan_for(jobs: int) -> Plan:
        return Plan(jobs, args.epochs, args.readers, args.batch, args.compute_ms / 1000,
                    args.seed, throttle)

    runs: list[dict[int, dict[str, SystemResult]]] = []
    for _number in harness.repeated(args.repeat):
        by_count: dict[int, dict[str, SystemResult]] = {}
        alone = run_system("coordlfs aligned", plan_for(1), dataset, cache, window, work)
        for n in counts:
            plan = plan_for(n)
            results = by_count[n] = {}
            for system in SYSTEMS[:-1]:
                results[system] = run_system(system, plan, dataset, cache, window, work)
            profile = calibrate(alone, results["coordlfs aligned"],
                                -(-len(dataset.files) // args.batch))
            fraction, delays = advised_delays(profile, n)
            print(f"  advisor: I {profile.I * 1000:.1f} ms, W {profile.W_cold * 1000:.1f} ms, "
                  f"W|cached {profile.W_warm * 1000:.1f} ms, W|conc "
                  f"{profile.W_concurrent * 1000:.1f} ms per batch: delay {fraction:.0%} "
                  f"({delays[-1] / max(1, n - 1):.1f} s per job)", flush=True)
            results[SYSTEMS[-1]] = run_system(SYSTEMS[-1], plan, dataset, cache, window, work,
                                              delays)
        runs.append(by_count)
    summary = summarize(runs)
    harness.print_summary(summary)
    harness.write_report(args.json, {
        "dataset": harness.dataset_record(dataset),
        "cache_bytes": cache, "window_bytes": window,
        "settings": harness.plain_settings(args),
        "runs": [{str(n): {s: asdict(r) for s, r in systems.items()}
                  for n, systems in run_.items()} for run_ in runs],
        "summary": summary,
    })
    return 0
