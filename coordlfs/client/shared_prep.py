"""``SharedPrepLoader``: a ``DataLoader`` whose batches the jobs of a prep group share.

Concurrent hyper-parameter-search jobs over one dataset each decode and augment every item;
on a small server the CPUs do the same work N times and the GPUs wait. The jobs of a prep group
split each epoch's batches instead (the protocol is in ``coordlfs.jobs.prep``): a producer thread
claims batches from the mount, prepares them with this job's own DataLoader workers, writes each
to a file in the mount's staging area (tmpfs: its tensors' bytes as they are, ``batch_file``)
and publishes it; the loop takes every batch of the epoch once, in an order of its own, mapping
other jobs' batches (no copy through FUSE, none in the consumer) and using its own from
memory. Augmentations are fresh each epoch, as every batch is prepared anew each epoch.

Without a mount, when the mount refuses, or when this job is expelled mid-epoch (it hung), the
loader warns and prepares what is left of the epoch itself, as a plain ``DataLoader`` would:
never an error.

A dataset that names its files (``ImageFolder.samples``, or a ``files`` list) on a coordlfs
mount has them prefetched by the mount's client: the files of each batch this job claims as it
claims it (its share, no more), or of its whole order, a window ahead, when it prepares alone.
Its items read through the client when its loader does (``coordlfs.torch.pil_loader``).

``reuse=R`` (off by default) is the PerFect method: every batch is used R times, drawn at
random from a shuffle buffer of ``shuffle_buffer`` batches, so a pre-training phase needs 1/R
of the preparation; ``set_reuse(1)`` switches it off for fine-tuning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import secrets
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from coordlfs.client import batch_file
from coordlfs.client.adapters import MountFiles, mount_files, prefetching
from coordlfs.errors import UserError
from coordlfs.protocol import spec
from coordlfs.protocol.client import _ANSWERED, Control, ControlError, control_for, dataset_root
from coordlfs.protocol.order import SEED_LIMIT, batch_count, batches_of, epoch_order
from coordlfs.protocol.spec import Command


def local_order(seed: int, epoch: int, n: int) -> list[int]:
    """A job's own shuffle of ``n`` items for ``epoch``, where it has no group to share one."""
    generator = torch.Generator()
    generator.manual_seed((seed + epoch) % (1 << 63))
    return torch.randperm(n, generator=generator).tolist()


class _Claims(Sampler[list[int]]):
    """The internal DataLoader's batch sampler: each batch it yields was claimed from the
    mount, so the job's workers prepare only its share; ``ids`` follows the yielded batches
    (DataLoader delivers in sampler order)."""

    def __init__(self, link: _Link, batches: list[list[int]], first: int | None,
                 stopping: threading.Event, files: MountFiles | None) -> None:
        self.link, self.batches, self.first, self.stopping = link, batches, first, stopping
        self.files = files
        self.ids: deque[int] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        if self.first is not None:
            yield self._claimed(self.first)
        while not self.stopping.is_set():
            # at once: while this sampler waits, the batches it handed out are not staged
            batch = self.link.call(spec.PREP_CLAIM, timeout_s=0).get("batch")
            if batch is None:
                return
            yield self._claimed(batch)

    def _claimed(self, batch: int) -> list[int]:
        """The batch's items, its files handed to the mount: the DataLoader asks for batches
        ahead of its workers, so they are filled in bulk before the workers read them."""
        self.ids.append(batch)
        if self.files is not None:
            self.files.prefetch(self.batches[batch])
        return self.batches[batch]

    def __len__(self) -> int:
        return len(self.batches)


class _Channel(Control):
    """The control file held open for one thread's requests: each is one write and one read
    through FUSE, not an open, a write, two reads and a close (the client's CPU per request
    ~75 -> ~10 us, and the daemon's falls too); the mount answers a descriptor's requests
    in order. A request that fails or is interrupted closes the descriptor, so that no reply
    is left behind for the next one."""

    def __init__(self, mountpoint: str) -> None:
        super().__init__(mountpoint)
        self._fd: int | None = None

    def request(self, cmd: str, **args: Any) -> dict[str, Any]:
        line = json.dumps({"cmd": cmd, **args}).encode() + b"\n"
        if self._fd is None:
            self._fd = self._open(os.O_RDWR)
        try:
            reply = _exchange(self._fd, line)
        except OSError as e:
            self.close()
            raise ControlError(f"{self.mountpoint}: {e.strerror}") from None
        except BaseException:
            self.close()
            raise
        if not reply.get("ok"):
            raise ControlError(reply.get("error", "request failed"))
        return reply

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _exchange(fd: int, line: bytes) -> dict[str, Any]:
    """Send one request line and read its reply line."""
    try:
        os.write(fd, line)
    except OSError as e:
        if e.errno not in _ANSWERED:
            raise  # else refused or malformed: the reply says why
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise OSError(errno.EPROTO, "the control file's reply ended early")
        reply += chunk
    return json.loads(reply)


class _Link:
    """This job's membership of a prep group: one thread's requests on its behalf, on a
    control descriptor of their own (``_Channel``)."""

    def __init__(self, mountpoint: str, member: int) -> None:
        self.channel, self.member = _Channel(mountpoint), member

    def call(self, command: Command, **args: Any) -> dict[str, Any]:
        return self.channel.call(command, member=self.member, **args)

    def for_thread(self) -> _Link:
        """The membership for another thread, with its own descriptor."""
        return _Link(self.channel.mountpoint, self.member)

    def close(self) -> None:
        self.channel.close()


class SharedPrepLoader:
    """A drop-in for ``DataLoader(dataset, batch_size, shuffle=True, ...)`` whose batches are
    prepared once per epoch for every job of ``group`` on the mount holding ``path``.

    Every job of a group must give the same dataset length, ``batch_size`` and ``drop_last``.
    A job that joins while the group is in an epoch starts at the next one; the first epoch
    waits until ``min_members`` jobs joined (or the hang timeout). ``hang_timeout`` is the least
    time without a request after which the mount expels a job mid-epoch (default 30 s; it grows
    with the job's measured time per batch). Other keyword arguments go to the DataLoader that
    prepares this job's share (``pin_memory``, ``worker_init_fn``, ``prefetch_factor``...).
    """

    def __init__(self, dataset: Sized, batch_size: int = 1, *, group: str,
                 path: str | os.PathLike[str] | None = None, job: str | None = None,
                 num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
                 drop_last: bool = False, min_members: int = 1,
                 hang_timeout: float | None = None, reuse: int = 1, shuffle_buffer: int = 4,
                 **loader_args: Any) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty")
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.group_name, self.job = group, job or f"pid-{os.getpid()}"
        self.min_members, self.hang_timeout = min_members, hang_timeout
        self.loader_args = {"num_workers": num_workers, "collate_fn": collate_fn, **loader_args}
        self.set_reuse(reuse, shuffle_buffer)
        #: batches this job prepared for the group, and those it prepared alone
        self.prepared = 0
        self.prepared_alone = 0
        self._passes = 0
        self._local_seed = secrets.randbelow(SEED_LIMIT)
        self._control = control_for(path if path is not None else dataset_root(dataset),
                                    "preparing batches")
        self._files = mount_files(dataset) if self._control is not None else None
        self._link: _Link | None = None
        self._producer: _Producer | None = None
        self._rejoin = False
        self._seed = 0
        self._join()

    # -- configuration -------------------------------------------------------------------

    def set_reuse(self, reuse: int, shuffle_buffer: int | None = None) -> None:
        """Use each batch ``reuse`` times (1: off, for fine-tuning), from a shuffle buffer."""
        if reuse < 1:
            raise ValueError(f"reuse must be at least 1, not {reuse}")
        buffer = shuffle_buffer if shuffle_buffer is not None else self.shuffle_buffer
        if buffer < 1:
            raise ValueError(f"shuffle_buffer must be at least 1, not {buffer}")
        self.reuse, self.shuffle_buffer = reuse, buffer

    @property
    def shared(self) -> bool:
        """Whether this job is in a prep group right now."""
        return self._link is not None

    def __len__(self) -> int:
        return batch_count(len(self.dataset), self.batch_size, self.drop_last) * self.reuse

    # -- membership ------------------------------------------------------------------------

    def _join(self) -> None:
        if self._control is None:
            return
        args = {"group": self.group_name, "pid": os.getpid(), "job": self.job,
                "samples": len(self.dataset), "batch_size": self.batch_size,
                "drop_last": self.drop_last, "min_members": self.min_members}
        if self.hang_timeout is not None:
            args["hang_timeout_s"] = self.hang_timeout
        try:
            reply = self._control.call(spec.PREP_JOIN, **args)
        except UserError as e:
            warnings.warn(f"coordlfs: cannot join prep group {self.group_name!r} ({e}); "
                          "preparing every batch in this job", stacklevel=3)
            return
        self._link = _Link(self._control.mountpoint, reply["member"])
        self._seed = reply["seed"]

    def _leave(self) -> None:
        """Leave the group now; the next pass over the loader joins again."""
        link, self._link = self._link, None
        if link is not None:
            self._rejoin = True
            with contextlib.suppress(UserError):
                link.call(spec.PREP_LEAVE)
            link.close()

    def _drop_link(self, why: str) -> None:
        """Go on alone: expelled (leaving is then a no-op), or the mount refused what the
        group needs (a batch over the staging area); leaving at once means no other job
        waits a hang timeout for this one's claims."""
        warnings.warn(f"coordlfs: prep group {self.group_name!r}: {why}; this job prepares "
                      "the rest of the epoch itself", stacklevel=4)
        self._leave()

    def close(self) -> None:
        """Leave the group (a job that exits leaves by itself within a second)."""
        if self._producer is not None:
            self._producer.stop()
        self._leave()
        self._control = None

    def __enter__(self) -> SharedPrepLoader:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        self._passes += 1
        if self._rejoin and self._control is not None:
            self._rejoin = False
            self._join()  # left or expelled during an earlier epoch: back for this one
        batches = self._group_batches() if self.reuse == 1 else self._reused(
            self._group_batches())
        return batches

    def _reused(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Each batch ``reuse`` times, drawn at random from a buffer of ``shuffle_buffer``."""
        buffer: list[list[Any]] = []
        rng = random.Random(self._local_seed + self._passes)
        source_done = False
        while buffer or not source_done:
            while not source_done and len(buffer) < self.shuffle_buffer:
                try:
                    buffer.append([next(batches), self.reuse])
                except StopIteration:
                    source_done = True
            if not buffer:
                return
            slot = rng.randrange(len(buffer))
            entry = buffer[slot]
            entry[1] -= 1
            if entry[1] == 0:
                buffer[slot] = buffer[-1]
                buffer.pop()
            yield entry[0]

    def _group_batches(self) -> Iterator[Any]:
        link = self._link
        if link is None:
            order = local_order(self._local_seed, self._passes, len(self.dataset))
            yield from self._alone(batches_of(order, self.batch_size, self.drop_last))
            return
        try:
            epoch = self._wait_for_epoch(link)
        except ControlError as e:
            self._drop_link(str(e))
            yield from self._group_batches()
            return
        order = epoch_order(self._seed, epoch, len(self.dataset))
        batches = batches_of(order, self.batch_size, self.drop_last)
        producer = self._producer = _Producer(self, link, batches)
        used: set[int] = set()
        finished = False
        try:
            yield from self._consume(link, producer, used)
            finished = True
        except ControlError as e:
            producer.stop()
            self._drop_link(str(e))
            yield from self._alone([b for i, b in enumerate(batches) if i not in used])
        finally:
            producer.stop()
            self._producer = None
            if not finished and self._link is not None:
                # The loop stopped mid-epoch: the group must not wait for this job.
                self._leave()

    def _wait_for_epoch(self, link: _Link) -> int:
        while "epoch" not in (reply := link.call(spec.PREP_EPOCH)):
            pass  # each call waits at the mount for the epoch to start
        return int(reply["epoch"])

    def _consume(self, link: _Link, producer: _Producer, used: set[int]) -> Iterator[Any]:
        done: list[int] = []
        while True:
            producer.check()
            reply = link.call(spec.PREP_NEXT, done=done)
            done = []
            if reply.get("end"):
                return
            if reply.get("wait"):
                continue  # the mount had no batch for us within its wait
            number = reply["batch"]
            batch = producer.own.pop(number, None)
            if batch is None:
                try:
                    batch = batch_file.read(reply["path"])
                except (OSError, batch_file.BadBatchFile) as e:
                    raise ControlError(f"cannot use batch {number}: {e}") from None
            used.add(number)
            yield batch
            done = [number]

    def _alone(self, batches: list[list[int]]) -> Iterator[Any]:
        if not batches:
            return
        files = self._files
        ordered = batches if files is None else prefetching(batches, files, lambda b: b)
        loader = DataLoader(self.dataset, batch_sampler=ordered, **self.loader_args)
        for batch in loader:
            self.prepared_alone += 1
            yield batch



class StagingRefused(ControlError):
    """The mount refused to stage a batch (over the staging area or this user's share of
    it): waiting would not help, so the job prepares the rest of its epoch alone."""


class _Producer:
    """The thread that prepares this job's share of an epoch and stages it.

    It runs the job's DataLoader over batches claimed from the mount; when none is left to
    claim while other jobs still prepare theirs it keeps asking, so the share of a job that
    dies is taken over. An error (the dataset raised) is handed to the consuming loop.
    """

    def __init__(self, loader: SharedPrepLoader, link: _Link, batches: list[list[int]]) -> None:
        self.loader, self.link, self.batches = loader, link.for_thread(), batches
        self.own: dict[int, Any] = {}
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordlfs-prep", daemon=True)
        self._thread.start()

    def check(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        try:
            with contextlib.closing(self.link):
                self._produce()
        except StagingRefused as e:
            self.error = e  # the loop leaves the group and prepares the rest itself
        except ControlError:
            pass  # expelled, or the epoch ended: the consuming loop finds out by itself
        except BaseException as e:  # the loop re-raises it, as DataLoader does a worker's
            self.error = e

    def _produce(self) -> None:
        first: int | None = None
        while not self._stopping.is_set():
            claims = _Claims(self.link, self.batches, first, self._stopping, self.loader._files)
            first = None
            loader = DataLoader(self.loader.dataset, batch_sampler=claims,
                                **self.loader.loader_args)
            for batch in loader:
                self._stage(claims.ids.popleft(), batch)
                if self._stopping.is_set():
                    return
            # Nothing left to claim: wait for batches that others claimed and may not deliver.
            while not self._stopping.is_set():
                reply = self.link.call(spec.PREP_CLAIM)
                if reply.get("batch") is not None:
                    first = reply["batch"]
                    break
                if not reply.get("outstanding"):
                    return

    def _stage(self, number: int, batch: Any) -> None:
        try:
            staged = batch_file.BatchFile(batch)
        except batch_file.Unstageable as e:  # waiting would not help: as if it refused
            raise StagingRefused(f"cannot stage batch {number}: {e}") from None
        while (room := self._reserve(number, staged.size))["full"]:
            if self._stopping.is_set():
                return
        try:
            staged.write(room["path"])
        except OSError as e:  # the staging area's filesystem is full: as if it refused
            raise StagingRefused(f"cannot stage batch {number}: {e.strerror}") from None
        self.own[number] = batch
        self.link.call(spec.PREP_PUBLISH, batch=number)
        self.loader.prepared += 1

    def _reserve(self, number: int, size: int) -> dict[str, Any]:
        try:
            return self.link.call(spec.PREP_RESERVE, batch=number, bytes=size)
        except ControlError as e:
            raise StagingRefused(str(e)) from None
