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

Reading through the mount's client (``coordlfs.client``), for torchvision-style datasets:

    dataset = ImageFolder("/mnt/data/train", loader=coordlfs.torch.pil_loader)
    dataset = DatasetFolder("/mnt/data/train", loader=coordlfs.torch.raw_loader,
                            extensions=(".jpg",))

and a sampler or loader over a dataset that names its files (``samples``, ``imgs`` or
``files``) hands each epoch's order to the mount ahead of the reads (``Dataset.prefetch``).
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

from coordlfs.client.adapters import MountFiles, mount_files, open_binary, prefetching, read_bytes
from coordlfs.client.shared_prep import SharedPrepLoader, local_order
from coordlfs.errors import UserError
from coordlfs.protocol.client import Control, control_for, dataset_root
from coordlfs.protocol.order import SEED_LIMIT, epoch_order, shard

T = TypeVar("T")

__all__ = ["AlignedSampler", "SharedPrepLoader", "pil_loader", "profiled", "raw_loader"]


def pil_loader(path: str | os.PathLike[str]) -> Any:
    """torchvision's default loader (an RGB ``PIL.Image``) with the bytes read through the
    client of the coordlfs mount holding ``path`` (plain ``open`` off a mount)."""
    from PIL import Image  # Pillow comes with torchvision; AlignedSampler's users need it not

    with open_binary(path) as f:
        return Image.open(f).convert("RGB")


def raw_loader(path: str | os.PathLike[str]) -> bytes:
    """The file's bytes, read as ``pil_loader`` reads them: a copy, since what a DataLoader
    worker returns must pickle (``coordlfs.client.Dataset.read`` gives the view without one)."""
    return bytes(read_bytes(path))


class AlignedSampler(Sampler[int]):
    """A drop-in for ``RandomSampler`` (and, with ``num_replicas``/``rank``, for the shuffling
    of ``DistributedSampler``) whose order every job of ``group`` shares.

    The seed comes from the mount's group (the first job to join picks it, or gives
    ``seed``), and each epoch's order is ``coordlfs.protocol.order.epoch_order(seed, epoch, n)``,
    so the mount's read window can hold an item one job fetched until the others read it. Without a
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
        self._files: MountFiles | None = mount_files(data_source) if self._control else None
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
        files = self._files
        if files is None or self._control is None:
            return
        if files.mount != self._control.mountpoint:
            return  # not all on this mount: the window still works, read-ahead does not
        try:
            self._control.register_files(self.member, files.paths)  # type: ignore[arg-type]
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
        order = self.order(epoch)
        if self._files is None:
            return iter(order)
        return prefetching(order, self._files, lambda i: (i,))

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
