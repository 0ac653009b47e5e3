"""What ``coordlfs warm`` fills: files on one coordlfs mount, in the order a job reads them.

Paths are given on the command line or listed in a file (one per line, ``-`` for stdin); a
directory stands for every regular file under it, walked depth first, each directory's entries
in name order: the order ImageFolder gives a tree of class folders its indices, so that
``--order seed:N`` (``epoch_order``, the shuffle of a seed-aligned group's epoch N) names
the files such a job reads, in its order. Symlinks under a directory are not followed (the
mount's fills never follow one); one given by name is resolved, and must lead to the mount
too. A path that is missing, unreadable, or on no coordlfs mount is a UserError naming it.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from coordlfs.errors import UserError
from coordlfs.protocol.client import find_mount
from coordlfs.protocol.order import SEED_LIMIT, epoch_order


@dataclass(slots=True)
class Files:
    """The files to warm: paths relative to ``mount`` and their sizes, in order. While a
    ``Listing`` runs, the lists only grow (appended to by its thread)."""

    mount: str
    names: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def reorder(self, seed: int, epoch: int) -> None:
        """Into the order a job with ``seed`` reads them in ``epoch`` (``epoch_order``)."""
        order = epoch_order(seed, epoch, len(self.names))
        self.names = [self.names[i] for i in order]
        self.sizes = [self.sizes[i] for i in order]


def parse_order(text: str) -> tuple[int, int]:
    """``seed:N`` as (seed, epoch); ValueError saying what is wrong."""
    seed, sep, epoch = text.partition(":")
    try:
        values = int(seed, 0), int(epoch)
    except ValueError:
        values = None
    if not sep or values is None or not 0 <= values[0] < SEED_LIMIT or values[1] < 0:
        raise ValueError(f"--order takes seed:N, a seed in [0, 2**64) and an epoch N >= 0, "
                         f"not {text!r}")
    return values


def listed(list_file: str) -> Iterator[str]:
    """The paths in ``list_file`` (``-``: stdin), one per line; blank lines are skipped."""
    try:
        stream = sys.stdin if list_file == "-" else open(list_file, encoding="utf-8",  # noqa: SIM115
                                                         errors="surrogateescape")
    except OSError as e:
        raise UserError(f"cannot read {list_file}: {e.strerror or e}") from None
    try:
        for line in stream:
            if path := line.rstrip("\n"):
                yield path
    finally:
        if stream is not sys.stdin:
            stream.close()


class Listing:
    """The files that ``paths``, then ``more`` (a list file's), name, each once (where first
    named), all on one mount, found in a thread of its own, so that the caller shows the
    count while they are found (a large tree takes seconds to walk through a mount) and
    Ctrl-C stops it at once. ``paths`` are checked before it starts (a bad one is an error
    before any file is warmed); what stops the thread later is raised by ``check``."""

    def __init__(self, paths: list[str], more: Iterable[str] = ()) -> None:
        more = iter(more)
        if not paths:
            first = next(more, None)
            if first is None:
                raise UserError("no paths given (name files or directories, or --from-file "
                                "LIST)")
            paths = [first]
        checked = [(given, *_resolve(given)) for given in paths]
        mount = find_mount(checked[0][1])
        if mount is None:
            raise UserError(f"{paths[0]} is not on a coordlfs mount")
        self.files = Files(mount)
        self.error: BaseException | None = None
        self._seen: set[str] = set()
        #: directory -> the coordlfs mount holding it ("": none), for the paths of a list
        self._mounts: dict[str, str] = {}
        for given, real, _st in checked:
            self._check_mount(given, real)
        self._thread = threading.Thread(target=self._run, args=(checked, more),
                                        name="coordlfs-warm-listing", daemon=True)
        self._thread.start()

    def _run(self, checked: list[tuple[str, str, os.stat_result]], more: Iterator[str]
             ) -> None:
        try:
            for given, real, st in checked:
                self._add(given, real, st)
            for given in more:
                real, st = _resolve(given)
                self._check_mount(given, real)
                self._add(given, real, st)
        except BaseException as e:  # a UserError, mostly: raised in the warm's own thread
            self.error = e

    def _check_mount(self, given: str, real: str) -> None:
        directory = os.path.dirname(real)
        mount = self._mounts.get(directory)
        if mount is None:
            mount = self._mounts[directory] = find_mount(real) or ""
        if not mount:
            raise UserError(f"{given} is not on a coordlfs mount")
        if mount != self.files.mount:
            raise UserError(f"{given} is on {mount}, not {self.files.mount}: warm one mount "
                            "at a time")

    def _add(self, given: str, real: str, st: os.stat_result) -> None:
        files = self.files
        for path, size in _files_under(given, real, st):
            name = os.path.relpath(path, files.mount)
            if name not in self._seen:
                self._seen.add(name)
                files.sizes.append(size)  # first: a reader sees a name only with its size
                files.names.append(name)

    def check(self) -> None:
        """Raise what stopped the listing, if anything did."""
        if self.error is not None:
            raise self.error

    def running(self, seconds: float) -> bool:
        """Whether the walk still runs, after waiting up to ``seconds`` for it to end."""
        self._thread.join(seconds)
        return self._thread.is_alive()

    def wait(self) -> Files:
        """All the files, once found."""
        self._thread.join()
        self.check()
        return self.files


def _resolve(given: str) -> tuple[str, os.stat_result]:
    real = os.path.realpath(given)
    try:
        st = os.stat(real)
    except OSError as e:
        raise UserError(f"{given}: {e.strerror or e}") from None
    if stat.S_ISREG(st.st_mode) and not os.access(real, os.R_OK):
        raise UserError(f"{given}: permission denied")
    return real, st


def _files_under(given: str, real: str, st: os.stat_result) -> Iterator[tuple[str, int]]:
    """(path, size) of the regular file ``real``, or of every one under the directory."""
    if stat.S_ISREG(st.st_mode):
        yield real, st.st_size
        return
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{given}: not a regular file or a directory")
    stack = [iter(_entries(real))]  # depth first, each directory in name order
    while stack:
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
        elif entry.is_dir(follow_symlinks=False):
            stack.append(iter(_entries(entry.path)))
        elif entry.is_file(follow_symlinks=False):
            try:
                yield entry.path, entry.stat(follow_symlinks=False).st_size
            except OSError as e:
                raise UserError(f"{entry.path}: {e.strerror or e}") from None


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda entry: entry.name)
    except OSError as e:
        raise UserError(f"{directory}: {e.strerror or e}") from None
