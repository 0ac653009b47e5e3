"""What the adapters share (``coordlfs.torch``'s loaders and samplers, the fsspec filesystem):
reading a path through the client of the coordlfs mount that holds it, and handing a known
order to that mount ahead of its reader.

A loader is given absolute paths (``ImageFolder.samples``), one at a time, in every DataLoader
worker; so the mount holding a path is looked up once per directory and the client
(``coordlfs.client.Dataset``) opened once per mount and process. A forked worker opens its own
(a client's counts are per process), and each process's clients report their counts as it
exits. A path on no coordlfs mount is read with plain ``open``: the same code runs on a laptop.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import posixpath
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from typing import IO, Any, NamedTuple, TypeVar

from coordlfs.client.dataset import Dataset
from coordlfs.errors import UserError
from coordlfs.protocol.client import find_mount

T = TypeVar("T")

#: Files handed to the mount ahead of the reader: enough for the daemon to fill in bulk,
#: few enough that the order's tail does not evict what the job reads next.
AHEAD_FILES = 1024
#: Files per ``prefetch`` request (one control round trip each).
CHUNK_FILES = 256

_lock = threading.Lock()
#: mountpoint -> this process's client of it
_clients: dict[str, Dataset] = {}


class Location(NamedTuple):
    """Where a coordlfs mount holds a path; ``client`` is None where the mount gave none
    (reads then go through the mount's path)."""

    mount: str
    client: Dataset | None
    relative: str


#: directory as given -> where its mount holds it, or None
_directories: dict[str, Location | None] = {}


def _forget() -> None:
    """In a forked child: the parent's clients and counts are not this process's."""
    global _lock
    _lock = threading.Lock()
    _clients.clear()
    _directories.clear()


os.register_at_fork(after_in_child=_forget)


def close_clients() -> None:
    """Close this process's clients (each reports its counts to its mount)."""
    with _lock:
        clients = list(_clients.values())
        _clients.clear()
        _directories.clear()
    for client in clients:
        with contextlib.suppress(UserError, OSError):  # the mount may be gone already
            client.close()


def _client(mount: str) -> Dataset | None:
    with _lock:
        client = _clients.get(mount)
        if client is not None:
            return client
        try:
            client = Dataset(mount)
        except UserError as e:
            warnings.warn(f"coordlfs: no client for {mount} ({e}); reading through the mount",
                          stacklevel=4)
            return None
        if not _clients:
            # A DataLoader worker leaves through multiprocessing, which skips atexit but runs
            # its finalizers (as does any process at exit): the counts reach the mount.
            multiprocessing.util.Finalize(None, close_clients, exitpriority=10)
        _clients[mount] = client
        return client


def _directory(directory: str) -> Location | None:
    real = os.path.realpath(directory or ".")
    mount = find_mount(real)
    if mount is None:
        return None
    relative = os.path.relpath(real, mount)
    return Location(mount, _client(mount), "" if relative == "." else relative)


def locate(path: str | os.PathLike[str]) -> Location | None:
    """Where a coordlfs mount holds ``path`` (the path relative to the mount), or None."""
    directory, name = os.path.split(os.fspath(path))
    try:
        where = _directories[directory]
    except KeyError:
        where = _directories[directory] = _directory(directory)
    if where is None:
        return None
    return where._replace(relative=posixpath.join(where.relative, name) if where.relative
                          else name)


def read_bytes(path: str | os.PathLike[str]) -> bytes | memoryview:
    """The whole file: through the client where a coordlfs mount holds it."""
    where = locate(path)
    if where is None or where.client is None:
        with open(path, "rb") as f:
            return f.read()
    return where.client.read(where.relative)


def open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    """A read-only binary file object: through the client where a coordlfs mount holds it."""
    where = locate(path)
    if where is None or where.client is None:
        return open(path, "rb")
    return where.client.open(where.relative)


def dataset_files(data_source: Any) -> list[str] | None:
    """The file of each index, where the dataset says (``ImageFolder.samples``/``imgs``,
    or a ``files`` list): what lets the mount read ahead in the job's order."""
    for name in ("samples", "imgs"):
        items = getattr(data_source, name, None)
        if isinstance(items, list) and all(isinstance(i, tuple) and i for i in items):
            return [os.fspath(i[0]) for i in items]
    files = getattr(data_source, "files", None)
    if isinstance(files, list) and all(isinstance(f, str | os.PathLike) for f in files):
        return [os.fspath(f) for f in files]
    return None


@dataclass
class MountFiles:
    """A dataset's files, all on one coordlfs mount: the mount, its client, each index's path
    relative to the mount, and whether the mount still takes prefetch requests."""

    mount: str
    client: Dataset | None
    paths: list[str]
    enabled: bool = field(init=False)

    def __post_init__(self) -> None:
        self.enabled = self.client is not None

    def prefetch(self, indices: Iterable[int]) -> None:
        """Hand the files of ``indices`` to the mount, in this order; a mount that refuses
        (one from before ``prefetch``) is warned about once and asked no more: prefetching
        is a bonus, never an error."""
        client = self.client
        if not self.enabled or client is None:
            return
        paths = [self.paths[i] for i in indices]
        if not paths:
            return
        try:
            client.prefetch(paths)
        except UserError as e:
            self.enabled = False
            warnings.warn(f"coordlfs: the mount does not prefetch ({e}); reading without it",
                          stacklevel=3)


def mount_files(data_source: Sized) -> MountFiles | None:
    """The dataset's files on its coordlfs mount, or None when the dataset names no file for
    each index, or they are not all on one coordlfs mount."""
    files = dataset_files(data_source)
    if not files or len(files) != len(data_source):
        return None
    located = [locate(f) for f in files]
    first = located[0]
    if first is None or any(where is None or where.mount != first.mount for where in located):
        return None
    paths = [where.relative for where in located]  # type: ignore[union-attr]
    return MountFiles(first.mount, first.client, paths)


def prefetching(order: Sequence[T], files: MountFiles,
                items_of: Callable[[T], Sequence[int]]) -> Iterator[T]:
    """Yield ``order`` while its files go to the mount ``AHEAD_FILES`` ahead of the reader,
    ``CHUNK_FILES`` at a time (``items_of`` gives the dataset indices of one element)."""
    sent = 0  # elements of order whose files were handed over
    ahead = 0  # files handed over and not yet yielded
    for element in order:
        while files.enabled and sent < len(order) and ahead < AHEAD_FILES:
            chunk: list[int] = []
            while sent < len(order) and len(chunk) < CHUNK_FILES:
                chunk.extend(items_of(order[sent]))
                sent += 1
            files.prefetch(chunk)
            ahead += len(chunk)
        yield element
        ahead -= len(items_of(element))

