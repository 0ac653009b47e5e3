"""Temporary cgroup v1 groups: a memory budget, and a disk's reads counted and throttled.

The page-cache baseline of a benchmark needs "a dataset larger than memory" on a machine with
plenty of it: ``memory.limit_in_bytes`` caps the page cache charged to the processes in a
memory cgroup, so the kernel's LRU thrashes as it would on a loaded server.
``blkio.throttle.read_bps_device`` makes a fast disk behave like a slow one, and
``blkio.throttle.io_service_bytes`` counts what the group's processes read from it. All are
real kernel mechanisms, not mocks.

A blkio group is where a benchmark counts and throttles storage, both sides alike: the kernel
charges a read to the group of the task that submits it, so the group's count has the reads
of a FUSE passthrough open (the reader's kernel reads its backing file, not the daemon), of a
job's DataLoader workers (a fork starts in its parent's groups) and of processes gone since,
which the per-process counters (``/proc/PID/io``) of the pids a benchmark knows miss.

A group is made under the cgroup the calling process is in (so a harness's own accounting
still covers it) and is always removed on exit: its processes go back where they came from,
then the directory is removed.

    with memory_cgroup("coordlfs-bench-1", limit_bytes=256 << 20, pid=reader.pid) as group:
        ...
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from coordlfs.errors import UserError
from coordlfs.testbed.storage import BlockDevice, block_device

#: Where cgroup v1 hierarchies are mounted, one directory per controller.
CGROUP_V1 = Path("/sys/fs/cgroup")

#: How long removal waits for exiting processes to leave the group.
REMOVE_WAIT = 5.0


def controller_root(controller: str) -> Path:
    """The mounted cgroup v1 hierarchy of ``controller``; UserError if there is none."""
    root = CGROUP_V1 / controller
    if not (root / "cgroup.procs").is_file():
        raise UserError(f"the cgroup v1 {controller} controller is not mounted at {root} "
                        "(a cgroup v2-only system?); benchmarks need it for memory budgets and "
                        "storage counts")
    return root


def cgroup_of(pid: int | str, controller: str) -> Path:
    """The directory of the cgroup that ``pid`` is in for ``controller``."""
    root = controller_root(controller)
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                own = root / path.lstrip("/")
                return own if own.is_dir() else root  # a cgroup namespace hides the path
    return root


def _write(path: Path, value: str) -> None:
    # cgroup files take one value per write() call; write_text makes exactly one.
    path.write_text(value + "\n")


def _pids(directory: Path) -> list[int]:
    return [int(line) for line in (directory / "cgroup.procs").read_text().split()]


class Cgroup:
    """One group, present in one or more controller hierarchies under the same name."""

    def __init__(self, name: str, directories: dict[str, Path]) -> None:
        self.name = name
        self.directories = directories
        self._origins: dict[tuple[str, int], Path] = {}
        #: the disk whose reads the group counts (``watch_reads``)
        self.disk: BlockDevice | None = None

    @property
    def memory(self) -> Path:
        return self.directories["memory"]

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group, remembering where it was."""
        for controller, directory in self.directories.items():
            self._origins.setdefault((controller, pid), cgroup_of(pid, controller))
            _write(directory / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        return _pids(next(iter(self.directories.values())))

    @contextmanager
    def inside(self) -> Iterator[None]:
        """This process in the group for the block, back where it was after: what it starts
        meanwhile (a daemon, and every process that one forks) is the group's from its first
        page, as a service started in its own cgroup is; this process's own pages charged
        before stay where they were (cgroup v1 moves no charge)."""
        me = os.getpid()
        self.add(me)
        try:
            yield
        finally:
            for controller, directory in self.directories.items():
                home = self._origins.pop((controller, me), directory.parent)
                _write(home / "cgroup.procs", str(me))

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed for its memory limit so far."""
        for line in (self.memory / "memory.oom_control").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
        return 0

    def memory_usage(self) -> int:
        """Bytes charged to the group: its processes' memory and the page cache they filled."""
        return int((self.memory / "memory.usage_in_bytes").read_text())

    def memory_held(self) -> int:
        """Bytes charged to the group beside its file pages: anonymous memory, tmpfs pages and
        the kernel's objects (inodes, dentries, open files): what a mount's files cost it,
        unlike the page cache, which the kernel drops when the group is at its limit."""
        stat = self._stat()
        kernel = int((self.memory / "memory.kmem.usage_in_bytes").read_text())
        return stat["rss"] + stat["shmem"] + kernel

    def file_pages(self) -> int:
        """Bytes of file pages charged to the group (its page cache less tmpfs's): what the
        kernel may drop at the group's limit."""
        stat = self._stat()
        return stat["cache"] - stat["shmem"]

    def _stat(self) -> dict[str, int]:
        """The group's own ``memory.stat`` (not its children's ``total_`` lines)."""
        return {name: int(value) for name, value in (
            line.split() for line in (self.memory / "memory.stat").read_text().splitlines()
            if not line.startswith("total_"))}

    def peak_memory(self) -> int:
        return int((self.memory / "memory.max_usage_in_bytes").read_text())

    def memory_limit(self) -> int:
        return int((self.memory / "memory.limit_in_bytes").read_text())

    def set_memory_limit(self, limit_bytes: int) -> None:
        _write(self.memory / "memory.limit_in_bytes", str(limit_bytes))

    def watch_reads(self, path: str | os.PathLike[str], bytes_per_second: int | None) -> None:
        """Count (``bytes_read``) the group's reads from the disk holding ``path`` and, with
        ``bytes_per_second``, cap them (needs the blkio controller).

        Without a cap the rule written is 0, none: it still switches the kernel's throttling
        on for the disk, without which Linux 6.10 and later count nothing there (a disk no
        group ever had a rule for: a machine just booted).
        """
        disk = block_device(path).whole_disk()
        _write(self.directories["blkio"] / "blkio.throttle.read_bps_device",
               f"{disk.number} {bytes_per_second or 0}")
        self.disk = disk

    def bytes_read(self) -> int:
        """Bytes read from the disk for the group's processes since it was made: those of
        processes since gone or moved out, and of children they forked, included.

        ``blkio.throttle.io_service_bytes``: counted as reads are submitted to the disk
        (page-cache misses with their readahead, O_DIRECT), as ``/proc/PID/io`` counts them.
        """
        if self.disk is None:
            raise ValueError(f"cgroup {self.name} counts no disk's reads")
        stats = self.directories["blkio"] / "blkio.throttle.io_service_bytes"
        for line in stats.read_text().splitlines():
            fields = line.split()
            if fields[:2] == [self.disk.number, "Read"]:
                return int(fields[2])
        return 0  # no read yet

    def remove(self) -> None:
        """Move every process back (to where it came from, else to the parent), then rmdir."""
        for controller, directory in self.directories.items():
            if not directory.is_dir():
                continue
            deadline = time.monotonic() + REMOVE_WAIT
            while True:
                for pid in _pids(directory):
                    home = self._origins.get((controller, pid), directory.parent)
                    if not home.is_dir():
                        home = directory.parent
                    with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                        _write(home / "cgroup.procs", str(pid))
                try:
                    directory.rmdir()
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise UserError(f"cannot remove cgroup {directory}: {e.strerror}; "
                                        f"remove it with: rmdir {directory}") from None
                    time.sleep(0.05)


def remove_stale(prefix: str) -> list[Path]:
    """Remove empty groups named ``<prefix>-<pid>[-...]`` whose process ``pid`` is gone.

    A run killed with SIGKILL cannot remove its groups; naming them after the creating
    process lets a later run recognise and remove them. Returns the directories removed.
    """
    removed = []
    for controller in ("memory", "blkio"):
        if not (CGROUP_V1 / controller / "cgroup.procs").is_file():
            continue
        for directory in cgroup_of("self", controller).glob(f"{prefix}-*"):
            pid = directory.name[len(prefix) + 1:].split("-")[0]
            if not pid.isdigit() or os.path.exists(f"/proc/{pid}") or _pids(directory):
                continue
            with contextlib.suppress(OSError):
                directory.rmdir()
                removed.append(directory)
    return removed


def _make(name: str, controllers: list[str]) -> Cgroup:
    if os.geteuid() != 0:
        raise UserError("creating a cgroup (a memory budget or storage counter for the "
                        "benchmark) needs root")
    directories = {c: cgroup_of("self", c) / name for c in controllers}
    group = Cgroup(name, directories)
    try:
        for directory in directories.values():
            if directory.is_dir():
                if _pids(directory):
                    raise UserError(f"cgroup {directory} exists and holds processes "
                                    f"{_pids(directory)}: is another benchmark running?")
                directory.rmdir()  # left empty by a run that was killed
            directory.mkdir()
    except OSError as e:
        group.remove()
        raise UserError(f"cannot create cgroup {name}: {e.strerror}") from None
    return group


@contextmanager
def _group(name: str, controllers: list[str], storage: str | os.PathLike[str] | None,
           read_bps: int | None) -> Iterator[Cgroup]:
    """A new group ``name`` in ``controllers``, watching ``storage``'s reads (blkio), removed
    on exit whatever happened inside."""
    if read_bps is not None and storage is None:
        raise ValueError("read_bps needs storage: the disk to throttle")
    group = _make(name, controllers)
    try:
        if storage is not None:
            group.watch_reads(storage, read_bps)
        yield group
    finally:
        group.remove()


@contextmanager
def memory_cgroup(name: str, limit_bytes: int | None = None, pid: int | None = None, *,
                  storage: str | os.PathLike[str] | None = None,
                  read_bps: int | None = None) -> Iterator[Cgroup]:
    """A new memory cgroup ``name`` limited to ``limit_bytes`` (None: no limit), holding ``pid``.

    With ``storage`` (a path) the group also gets a blkio twin that counts its reads from the
    disk holding it (``Cgroup.bytes_read``) and, with ``read_bps``, caps them to that many
    bytes per second. The group is removed on exit, whatever happened inside.
    """
    controllers = ["memory"] if storage is None else ["memory", "blkio"]
    with _group(name, controllers, storage, read_bps) as group:
        if limit_bytes is not None:
            group.set_memory_limit(limit_bytes)
        if pid is not None:
            group.add(pid)
        yield group


@contextmanager
def storage_cgroup(name: str, storage: str | os.PathLike[str],
                   read_bps: int | None = None) -> Iterator[Cgroup]:
    """A new blkio cgroup ``name`` alone: counts its processes' reads from the disk holding
    ``storage`` and, with ``read_bps``, caps them, whatever memory groups they are in (a
    reader with a memory budget of its own beside a daemon with none). Removed on exit."""
    with _group(name, ["blkio"], storage, read_bps) as group:
        yield group
