"""PyTorch side: ``AlignedSampler``, the stall profiler, and ``SharedPrepLoader``.

Install with ``pip install coordlfs[torch]``. Both talk to the mount through its control file
(``coordlfs.control``); without a mount they degrade to plain PyTorch behaviour with a warning,
so a training script runs the same on a laptop.

    sampler = AlignedSampler(dataset, group="resnet-sweep", path="/mnt/data/train")
    loader = DataLoader(dataset, batch_size=256, sampler=sampler, num_workers=8)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for images, labels in profiled(loader, job="resnet-lr0.1", epoch=epoch,
                                       path="/mnt/data/train"):
            ...
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
import warnings
from collections.abc import Iterable, Iterator, Sized
from typing import Any, TypeVar

from torch.utils.data import Sampler

from coordlfs.control import Control, control_for, dataset_root
from coordlfs.errors import UserError
from coordlfs.order import SEED_LIMIT, epoch_order, shard
from coordlfs.shared_prep import SharedPrepLoader, local_order

T = TypeVar("T")

__all__ = ["AlignedSampler", "SharedPrepLoader", "profiled"]


def _dataset_files(data_source: Any) -> list[str] | None:
    """The file of each index, where the dataset says (``ImageFolder.samples``/``imgs``,
    or a ``files`` list): what lets the mount read ahead in the group's order."""
    for name in ("samples", "imgs"):
        items = getattr(data_source, name, None)
        if isinstance(items, list) and all(isinstance(i, tuple) and i for i in items):
            return [os.fspath(i[0]) for i in items]
    files = getattr(data_source, "files", None)
    if isinstance(files, list) and all(isinstance(f, str | os.PathLike) for f in files):
        return [os.fspath(f) for f in files]
    return None


class AlignedSampler(Sampler[int]):
    """A drop-in for ``RandomSampler`` (and, with ``num_replicas``/``rank``, for the shuffling
    of ``DistributedSampler``) whose order every job of ``group`` shares.

    The seed comes from the mount's group (the first job to join picks it, or gives
    ``seed``), and each epoch's order is ``coordlfs.order.epoch_order(seed, epoch, n)``, so the
    mount's read window can hold an item one job fetched until the others read it. Without a
    mount or a group the sampler shuffles as ``RandomSampler`` does (seeded by ``seed`` if
    given), with a warning, never an error. Without ``set_epoch`` each pass over the sampler is
    the next epoch, as each pass of ``RandomSampler`` is a new shuffle.
    """

    def __init__(self, data_source: Sized, group: str, path: str | os.PathLike[str] | None = None,
                 *, seed: int | None = None, job: str | None = None, num_replicas: int = 1,
                 rank: int = 0, drop_last: bool = False) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.data_source = data_source
        self.num_replicas, self.rank, self.drop_last = num_replicas, rank, drop_last
        self.epoch: int | None = None
        self._passes = 0
        self.member: int | None = None
        self._control = control_for(path if path is not None else dataset_root(data_source),
                                     "shuffling")
        self.aligned = False
        if self._control is not None:
            try:
                reply = self._control.join_group(group, job=job, seed=seed)
                self.seed, self.member, self.aligned = reply["seed"], reply["member"], True
            except UserError as e:
                warnings.warn(f"coordlfs: cannot join group {group!r} ({e}); shuffling "
                              "without it", stacklevel=2)
            else:
                self._register_files()
        if not self.aligned:
            self.seed = seed if seed is not None else secrets.randbelow(SEED_LIMIT)

    def _register_files(self) -> None:
        """Give the mount the dataset's files, if the dataset names them, for read-ahead."""
        files = _dataset_files(self.data_source)
        if files is None or len(files) != len(self.data_source) or self._control is None:
            return
        mount = os.path.realpath(self._control.mountpoint)
        relative = [os.path.relpath(os.path.realpath(f), mount) for f in files]
        if any(r.startswith("..") for r in relative):
            return  # not all on this mount: the window still works, read-ahead does not
        try:
            self._control.register_files(self.member, relative)  # type: ignore[arg-type]
        except UserError as e:
            warnings.warn(f"coordlfs: cannot register the dataset's files ({e}); no "
                          "read-ahead", stacklevel=3)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        """This rank's items for ``epoch``."""
        n = len(self.data_source)
        if self.aligned:
            full = epoch_order(self.seed, epoch, n)
        else:
            full = local_order(self.seed, epoch, n)
        if self.num_replicas == 1:
            return full
        return shard(full, self.rank, self.num_replicas, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch if self.epoch is not None else self._passes
        self._passes += 1
        if self.aligned and self._control is not None and self.member is not None:
            with contextlib.suppress(UserError):  # read-ahead is a bonus, never an error
                self._control.start_epoch(self.member, epoch)
        return iter(self.order(epoch))

    def __len__(self) -> int:
        n = len(self.data_source)
        if self.num_replicas == 1:
            return n
        if self.drop_last:
            return n // self.num_replicas
        return -(-n // self.num_replicas)

    def close(self) -> None:
        """Leave the group (a job that exits leaves by itself within a second)."""
        if self._control is not None and self.member is not None:
            with contextlib.suppress(UserError):  # the mount may be gone already
                self._control.leave_group(self.member)
            self.member = None


def profiled(loader: Iterable[T], job: str, epoch: int,
             path: str | os.PathLike[str] | None = None,
             control: Control | None = None) -> Iterator[T]:
    """Iterate ``loader`` while timing, per step, the wait for the next batch and the step.

    The wait is the time spent inside the loader's ``next`` (the data stall of DS-Analyzer);
    the step is the time the loop body took until it asked for the next batch. At the end of
    the epoch the totals go to the mount (``coordlfs stats`` shows them per job and epoch);
    two clock reads per step cost well under 1% of any real step.
    """
    control = control or control_for(path, "profiling")
    steps, wait, busy = 0, 0.0, 0.0
    clock = time.perf_counter
    iterator = iter(loader)
    mark = clock()
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            break
        got = clock()
        wait += got - mark
        yield batch
        mark = clock()
        busy += mark - got
        steps += 1
    if control is not None:
        try:
            control.report_profile(job, epoch, steps, round(wait, 6), round(busy, 6))
        except UserError as e:
            warnings.warn(f"coordlfs: cannot report the profile ({e})", stacklevel=2)
