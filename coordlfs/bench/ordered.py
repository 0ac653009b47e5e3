"""A cold epoch whose order the job hands over first (``bench misses``'s ``ordered`` case).

A job that knows its epoch's order tells the mount, which fills the files into its cache in
that order ahead of the readers, many at once and with no FUSE request per file (``prefetch``,
``coordlfs.cache.fills``). Jobs do it two ways, and both are measured as they do it:

- reading through the mount: the job's main process (a DataLoader's, where the sampler runs)
  hands the order over ``AHEAD_FILES`` ahead of the files read, ``CHUNK_FILES`` at a time
  (``adapters.prefetching``, what ``coordlfs.torch``'s samplers do), while its reader
  processes open and read each file through the mount;
- reading through the client: the job calls ``Dataset.prefetch(order)`` once, then each
  reader process ``read``s its files with a ``Dataset`` of its own and copies them out.

The readers take the order round robin, as a DataLoader's workers take its batches; the
sampler's place is taken as the files read so far (a loader's is a few batches further).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordlfs.bench.hits import Run, measure
from coordlfs.client.adapters import MountFiles, prefetching
from coordlfs.client.dataset import Dataset
from coordlfs.errors import UserError
from coordlfs.testbed.mounts import Mount

#: How a job reads: through the mount or through the client.
WAYS = ("mount", "client")
#: Seconds between two looks of the job's process at how far its readers are: short beside
#: the time they take to read the ``AHEAD_FILES`` it keeps handed over.
POLL_S = 0.002


@dataclass(slots=True)
class OrderedRun(Run):
    #: the mount's counts after the epoch: files its fills read ahead of the readers, bytes
    #: read from storage in all (the rest at a reader's open), reads a client missed, opens
    #: the kernel served by passthrough
    mount: dict[str, int] = field(default_factory=dict)


class _Window:
    """The job through the mount: the order handed over ahead of the readers, in chunks."""

    def __init__(self, files: MountFiles) -> None:
        self._pending = prefetching(range(len(files.paths)), files, lambda i: (i,))

    def lead(self) -> None:
        next(self._pending, None)  # the first window, before the first file is read

    def follow(self, progress: Callable[[], int | None]) -> None:
        for position, _ in enumerate(self._pending, 1):
            while (read := progress()) is not None and read < position:
                time.sleep(POLL_S)
            if read is None:
                return


class _Whole:
    """The job through the client: ``Dataset.prefetch`` of the whole order, then the reads."""

    def __init__(self, client: Dataset, rels: list[str]) -> None:
        self._client, self._rels = client, rels

    def lead(self) -> None:
        self._client.prefetch(self._rels)

    def follow(self, progress: Callable[[], int | None]) -> None:
        pass


def epoch(mount: Mount, rels: list[str], readers: int, way: str) -> OrderedRun:
    """One epoch of ``rels`` (relative to the mount, in order) by ``readers`` processes
    reading ``way``, the order handed over by this process as the job's (its client opened
    before the readers fork, as a sampler's is before a DataLoader's workers)."""
    root = str(mount.mountpoint)
    with Dataset(root) as job:
        if way == "client":
            run = measure(rels, readers, root, job=_Whole(job, rels))
        else:
            files = MountFiles(root, job, rels)
            run = measure([os.path.join(root, rel) for rel in rels], readers,
                          job=_Window(files))
            if not files.enabled:
                raise UserError(f"{root} refused the order (prefetch): see the warning above")
    status = mount.status()
    reads = status["reads"]
    return OrderedRun(run.seconds, run.files, run.bytes, mount={
        "filled_ahead": status["fills"]["files"],
        "bytes_from_source": reads["bytes_from_source"],
        "client_misses": reads["client_misses"],
        "passthrough_opens": reads["passthrough_opens"]})
