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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from coordlfs.control import find_mount
from coordlfs.errors import UserError
from coordlfs.protocol.order import SEED_LIMIT, epoch_order


@dataclass(slots=True)
class Files:
    """The files to warm: paths relative to ``mount`` and their sizes, in order."""

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


def collect(paths: Iterable[str]) -> Files:
    """The files ``paths`` name, each once (where first named), on one coordlfs mount."""
    files: Files | None = None
    seen: set[str] = set()
    for given in paths:
        real, st = _resolve(given)
        mount = find_mount(real)
        if mount is None:
            raise UserError(f"{given} is not on a coordlfs mount")
        if files is None:
            files = Files(mount)
        elif mount != files.mount:
            raise UserError(f"{given} is on {mount}, not {files.mount}: warm one mount at a "
                            "time")
        for path, size in _files_under(given, real, st):
            name = os.path.relpath(path, mount)
            if name not in seen:
                seen.add(name)
                files.names.append(name)
                files.sizes.append(size)
    if files is None:
        raise UserError("no paths given (name files or directories, or --from-file LIST)")
    return files


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
