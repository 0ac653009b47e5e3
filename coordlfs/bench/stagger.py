"""The stagger advisor against reality: two aligned jobs, the second started 0-100% late.

First each job is calibrated as the paper does (section V-B): alone on a cold mount, its first
epoch gives ``I`` and ``W`` per iteration and its later epochs ``W|cached``; started together,
both give ``W|conc``. ``coordlfs.models.stagger`` then predicts the makespan for each delay and
the optimum. Then the pair really runs at delays of 0%, 10%, ..., 100% of the first job's
predicted standalone runtime, each on a fresh mount, and the measured optimum and makespans are
set beside the predicted ones. The cache holds the whole dataset, as the model assumes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordlfs.bench import harness
from coordlfs.bench.aligned import CGROUP_PREFIX, Jobs, Plan, busy_per_iteration
from coordlfs.bench.children import running
from coordlfs.errors import UserError
from coordlfs.models.stagger import JobProfile, delay_table, optimal_delay, standalone_runtime
from coordlfs.testbed.cgroup import memory_cgroup
from coordlfs.testbed.dataset import Dataset
from coordlfs.testbed.mounts import mounted
from coordlfs.testbed.storage import drop_caches

DELAYS = [d / 10 for d in range(11)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_dataset_arguments(parser, "aligned", make="3000:110K")
    parser.add_argument("--compute-ms", default="40,15", metavar="A,B",
                        help="emulated GPU time per batch of the first and second job "
                             "(default 40,15)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--readers", type=int, default=2, help="reader processes per job")
    parser.add_argument("--batch", type=int, default=32, help="files per batch (default 32)")
    harness.add_throttle_argument(parser)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


@dataclass(frozen=True, slots=True)
class Setup:
    """What every run of the pair shares: each run differs only in which jobs run, and how
    late the second starts."""

    dataset: Dataset
    work: Path
    plan: Plan
    computes: tuple[float, float]

    @property
    def batches(self) -> int:
        return -(-len(self.dataset.files) // self.plan.batch)


def run_pair(setup: Setup, which: tuple[int, ...], delays: tuple[float, ...]) \
        -> list[list[tuple[float, float, float]]]:
    """Run the jobs ``which`` (0: A, 1: B) in one aligned group on a fresh, cold mount, each
    started its delay late; per job and epoch (end since go, seconds, seconds waited)."""
    plan = Plan(len(which), setup.plan.epochs, setup.plan.readers, setup.plan.batch, 0.0,
                setup.plan.seed, setup.plan.throttle)
    name = f"{CGROUP_PREFIX}-{os.getpid()}"
    storage = setup.dataset.root if plan.throttle else None  # throttled; bytes not counted
    cache = setup.dataset.total_bytes + (64 << 20)
    with memory_cgroup(name, storage=storage, read_bps=plan.throttle) as cgroup, \
            contextlib.ExitStack() as stack:
        base = setup.work / "mnt"
        cgroup.add(stack.enter_context(mounted(setup.dataset.root, base,
                                               setup.work / "mount.log",
                                               "--cache-size", str(cache))).pid)
        jobs = stack.enter_context(running(Jobs(plan, setup.dataset, str(base),
                                                f"bench-{os.getpid()}",
                                                tuple(setup.computes[w] for w in which),
                                                delays)))
        for pid in [p.pid for p in jobs.procs] + jobs.reader_pids:
            cgroup.add(pid)
        drop_caches()
        started = time.monotonic()
        epochs, _storage = jobs.run(lambda: 0)
    return [[(at - started, seconds, waited) for at, seconds, waited in job] for job in epochs]


#: Per job and epoch: (end since go, seconds, seconds waited), as ``run_pair`` returns them.
JobEpochs = list[tuple[float, float, float]]


def profile_from(name: str, alone: JobEpochs, together: JobEpochs, batches: int) -> JobProfile:
    """One job's four numbers from its runs: ``I``, ``W`` and ``W|cached`` alone (at least
    two epochs), ``W|conc`` from its first epoch beside the other. ``I`` is never 0, even
    for a job with no compute (``busy_per_iteration``)."""
    first, later = alone[0], alone[1:]
    return JobProfile(
        name, batches, len(alone),
        I=busy_per_iteration(((s, w) for _at, s, w in alone), batches * len(alone)),
        W_cold=first[2] / batches,
        W_warm=sum(w for _at, _s, w in later) / (batches * len(later)),
        W_concurrent=together[0][2] / batches)


def calibrate(setup: Setup) -> tuple[JobProfile, JobProfile, dict[str, Any]]:
    """The paper's four numbers per job, measured (section V-B, step 1)."""
    raw: dict[str, Any] = {f"alone_{'AB'[j]}": run_pair(setup, (j,), (0.0,))[0] for j in (0, 1)}
    raw["together"] = run_pair(setup, (0, 1), (0.0, 0.0))
    a, b = (profile_from("AB"[j], raw[f"alone_{'AB'[j]}"], raw["together"][j], setup.batches)
            for j in (0, 1))
    return a, b, raw


def run(args: argparse.Namespace) -> int:
    harness.require_root("bench stagger", harness.TRAINING_NEEDS)
    try:
        computes = tuple(float(x) / 1000 for x in args.compute_ms.split(","))
    except ValueError:
        raise UserError(f"bad --compute-ms {args.compute_ms!r}: two numbers such as 40,15") \
            from None
    if len(computes) != 2 or min(computes) < 0:
        raise UserError("--compute-ms takes two non-negative numbers, A,B")
    if args.epochs < 2 or min(args.readers, args.batch) < 1:
        raise UserError("--epochs must be at least 2, --readers and --batch at least 1")
    throttle = harness.parse_throttle(args.throttle)
    work = harness.work_dir(args.work, cgroups=CGROUP_PREFIX)
    dataset = harness.load_dataset(args)
    setup = Setup(dataset, work, Plan(2, args.epochs, args.readers, args.batch, 0.0, 0,
                                      throttle), (computes[0], computes[1]))
    print(f"{harness.describe_dataset(dataset)}; compute {args.compute_ms} ms per batch; "
          f"throttle {harness.describe_throttle(throttle)}", flush=True)
    a, b, raw = calibrate(setup)
    for p in (a, b):
        print(f"  {p.name}: I {p.I * 1000:.1f} ms, W cold {p.W_cold * 1000:.1f} ms, W cached "
              f"{p.W_warm * 1000:.1f} ms, W conc {p.W_concurrent * 1000:.1f} ms per iteration",
              flush=True)
    predicted = {round(p.delay, 2): p.makespan for p in delay_table([a, b])}
    best = optimal_delay([a, b])
    standalone = standalone_runtime(a)
    measured: dict[float, float] = {}
    for delay in DELAYS:
        ends = run_pair(setup, (0, 1), (0.0, delay * standalone))
        measured[delay] = max(job[-1][0] for job in ends)
        print(f"  delay {delay:4.0%}: measured makespan {measured[delay]:6.1f} s, predicted "
              f"{predicted[delay]:6.1f} s", flush=True)
    measured_best = min(measured, key=lambda d: (measured[d], -d))
    grid_best = min(predicted, key=lambda d: (predicted[d], -d))
    summary = {
        "predicted_optimal_delay": round(best.delay, 3),
        "predicted_optimal_makespan_s": round(best.makespan, 3),
        "predicted_grid_optimal_delay": grid_best,
        "measured_optimal_delay": measured_best,
        "measured_optimal_makespan_s": round(measured[measured_best], 3),
        "delay_error_steps": round(abs(grid_best - measured_best) * 10, 3),
        "makespan_error_at_measured_optimum": round(
            abs(predicted[measured_best] - measured[measured_best]) / measured[measured_best],
            3),
        "makespan_error_max": round(max(abs(predicted[d] - measured[d]) / measured[d]
                                        for d in DELAYS), 3),
    }
    harness.print_summary(summary)
    harness.write_report(args.json, {
        "dataset": harness.dataset_record(dataset),
        "settings": {"compute_ms": args.compute_ms, "epochs": args.epochs,
                     "readers": args.readers, "batch": args.batch, "throttle": throttle},
        "profiles": {p.name: {"I": p.I, "W_cold": p.W_cold, "W_warm": p.W_warm,
                              "W_concurrent": p.W_concurrent, "iterations": p.iterations,
                              "epochs": p.epochs} for p in (a, b)},
        "calibration_runs": raw,
        "delays": [{"delay": d, "predicted_makespan_s": round(predicted[d], 3),
                    "measured_makespan_s": round(measured[d], 3)} for d in DELAYS],
        "summary": summary,
    })
    return 0
