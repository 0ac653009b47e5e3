"""One training job of ``coordlfs bench hpsearch``: a loader over the JPEGs, a sleep per batch.

    python -m coordlfs.bench.hpsearch_job --root /mnt/data --mode shared --job job-0 --jobs 2

The job is a process of its own, as each trial of a hyper-parameter search is, so its CPU
time (its own and its loader workers', from ``getrusage``) is what that trial cost. The bench
starts it in a session of its own and stops it, workers included, by the group's id. It talks
to the bench in JSON lines: ``{"event": "ready"}`` once its loader is built, after which it
waits for a line on stdin (so that all jobs start together, none paying another's torch
import), ``{"event": "epoch"}`` at each epoch's end (the bench reads the storage counter when
every job has ended one), and the result, one line, last. A job that did not see every
sample of an epoch exactly once (counted per class) fails.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader

from coordlfs.bench.jpegs import JpegFolder
from coordlfs.client.torch import SharedPrepLoader
from coordlfs.errors import UserError, exit_status
from coordlfs.protocol.order import batch_count

MODES = ("independent", "shared")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpsearch_job", description=__doc__)
    parser.add_argument("--root", required=True, help="the dataset's class folders")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--job", required=True, help="this job's name")
    parser.add_argument("--jobs", type=int, required=True,
                        help="jobs in the search (shared: the group's first epoch waits for "
                             "as many)")
    parser.add_argument("--group", default="hpsearch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--drop-pages", metavar="SOURCE",
                        help="drop each file's pages from the page cache once read, its "
                             "source's beneath the mount (SOURCE) too")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def emit(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


def cpu_seconds() -> float:
    """User and system time of this process and of its children that have been waited for
    (loader workers, once their loader has shut them down)."""
    own, children = (resource.getrusage(resource.RUSAGE_SELF),
                     resource.getrusage(resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def make_loader(args: argparse.Namespace, dataset: JpegFolder) -> Any:
    if args.mode == "independent":
        return DataLoader(dataset, batch_size=args.batch, shuffle=True,
                          num_workers=args.workers, drop_last=args.drop_last)
    return SharedPrepLoader(dataset, batch_size=args.batch, group=args.group, path=args.root,
                            job=args.job, num_workers=args.workers, drop_last=args.drop_last,
                            min_members=args.jobs)


def expected_per_class(dataset: JpegFolder, drop_last: bool) -> list[int] | None:
    """How many samples of each class an epoch holds; None where ``drop_last`` leaves out
    samples that depend on the order."""
    if drop_last:
        return None
    counts = [0] * len(dataset.classes)
    for _path, label in dataset.samples:
        counts[label] += 1
    return counts


def run_epoch(loader: Iterable[Any], classes: int, crop: int, compute_s: float
              ) -> tuple[int, list[int]]:
    """Consume one epoch, sleeping ``compute_s`` per batch; returns (samples, per class)."""
    samples, per_class = 0, torch.zeros(classes, dtype=torch.long)
    for images, labels in loader:
        if images.dtype != torch.float32 or tuple(images.shape[1:]) != (3, crop, crop):
            raise UserError(f"a batch of {images.dtype} {tuple(images.shape)}, expected "
                            f"float32 (N, 3, {crop}, {crop})")
        samples += len(labels)
        per_class += torch.bincount(labels, minlength=classes)
        if compute_s:
            time.sleep(compute_s)
    return samples, per_class.tolist()


def train(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dataset = JpegFolder(args.root, args.crop, args.drop_pages)
    n = len(dataset)
    batches = batch_count(n, args.batch, args.drop_last)
    expected = min(n, batches * args.batch)
    per_class_expected = expected_per_class(dataset, args.drop_last)
    loader = make_loader(args, dataset)
    try:
        emit({"event": "ready", "job": args.job, "samples": n})
        if not sys.stdin.readline():
            raise UserError("the bench went away before the start")
        cpu_start, started = cpu_seconds(), time.monotonic()
        samples, epoch_s = [], []
        for epoch in range(args.epochs):
            begun = time.monotonic()
            seen, per_class = run_epoch(loader, len(dataset.classes), args.crop,
                                        args.compute_ms / 1000)
            ended = time.monotonic()
            if seen != expected or per_class_expected not in (None, per_class):
                raise UserError(f"{args.job} saw {seen} samples in epoch {epoch + 1} (per "
                                f"class {per_class}), expected {expected} "
                                f"({per_class_expected})")
            samples.append(seen)
            epoch_s.append(ended - begun)  # rounded in the result, not before the rates
            emit({"event": "epoch", "job": args.job, "epoch": epoch + 1, "at": ended})
    finally:
        if args.mode == "shared":
            loader.close()  # leaves the group and joins its workers, for their CPU time
    prepared = loader.prepared if args.mode == "shared" else None
    seconds = ended - started
    emit({"event": "result", "job": args.job, "mode": args.mode, "samples": samples,
          "epoch_s": [round(t, 4) for t in epoch_s],
          "epoch_samples_per_s": [round(s / t, 2) for s, t in zip(samples, epoch_s,
                                                                   strict=True)],
          "samples_per_s": round(sum(samples) / seconds, 2), "seconds": round(seconds, 4),
          "started": started, "ended": ended, "cpu_s": round(cpu_seconds() - cpu_start, 3),
          "prepared": prepared,
          "batches_per_epoch": batches})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_status(f"hpsearch {args.job}", lambda: train(args), sigterm_interrupts=True)


if __name__ == "__main__":
    sys.exit(main())
