"""Bytes read from the block device that holds a path, from the kernel's own counters.

Benchmarks compare what reaches storage, not what readers asked for: page-cache hits and
coordlfs cache hits never touch the disk, so the device's read counter
(``/sys/block/<dev>/stat``) is the ground truth that neither side can misreport. It counts
every reader of the device; where other processes use the disk too, the per-process count
of ``/proc/PID/io`` tells what the processes under test read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from coordlfs.errors import UserError

#: Where the kernel links every block device by number (``MAJ:MIN``), partitions included.
SYS_DEV_BLOCK = Path("/sys/dev/block")

#: ``/sys/block/*/stat`` counts 512-byte sectors whatever the device's block size.
SECTOR_BYTES = 512

#: Index of "sectors read" among the whitespace-separated fields of a ``stat`` file.
_SECTORS_READ = 2


@dataclass(frozen=True, slots=True)
class BlockDevice:
    """A disk or partition as sysfs knows it."""

    name: str
    major: int
    minor: int
    sysfs: Path

    @property
    def number(self) -> str:
        """``MAJ:MIN``, as cgroup files (``blkio.throttle.*``) name a device."""
        return f"{self.major}:{self.minor}"

    @property
    def is_partition(self) -> bool:
        return (self.sysfs / "partition").exists()

    def whole_disk(self) -> BlockDevice:
        """The disk a partition is on (itself for a disk): I/O throttles apply to disks only."""
        if not self.is_partition:
            return self
        parent = self.sysfs.parent
        major, minor = _parse_number((parent / "dev").read_text())
        return BlockDevice(parent.name, major, minor, parent)

    def bytes_read(self) -> int:
        """Bytes read from this device since boot."""
        return parse_stat((self.sysfs / "stat").read_text())


def parse_stat(text: str) -> int:
    """Bytes read, from the text of a ``/sys/block/<dev>/stat`` file."""
    fields = text.split()
    if len(fields) <= _SECTORS_READ:
        raise ValueError(f"not a block device stat line: {text!r}")
    return int(fields[_SECTORS_READ]) * SECTOR_BYTES


def _parse_number(text: str) -> tuple[int, int]:
    major, minor = text.strip().split(":")
    return int(major), int(minor)


def device_by_number(major: int, minor: int) -> BlockDevice | None:
    """The block device numbered ``major:minor``, or None if there is none (tmpfs, overlay)."""
    link = SYS_DEV_BLOCK / f"{major}:{minor}"
    if not link.exists():
        return None
    sysfs = link.resolve()
    return BlockDevice(sysfs.name, major, minor, sysfs)


def block_device(path: str | os.PathLike[str]) -> BlockDevice:
    """The block device that holds ``path``; UserError where no block device does."""
    st_dev = os.stat(path).st_dev
    device = device_by_number(os.major(st_dev), os.minor(st_dev))
    if device is None:
        raise UserError(f"{path} is not on a block device (tmpfs, overlay or a network "
                        "filesystem?): reads from storage cannot be counted there; use a "
                        "directory on a disk")
    return device


def process_bytes_read(pid: int) -> int:
    """Bytes that process ``pid`` (all its threads) caused to be read from storage.

    ``read_bytes`` of ``/proc/PID/io``: counted when the kernel submits the read to a block
    device (page-cache misses with their readahead, and O_DIRECT), so unlike the device's
    counter it leaves out what other processes read meanwhile.
    """
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise ValueError(f"/proc/{pid}/io has no read_bytes (no CONFIG_TASK_IO_ACCOUNTING?)")


@dataclass(slots=True)
class ReadMeter:
    """What a counter of bytes read gained while a ``with measure_reads(...)`` block ran."""

    counter: Callable[[], int]
    start: int
    bytes: int = 0


@contextmanager
def measure_reads(counter: Callable[[], int]) -> Iterator[ReadMeter]:
    """``with measure_reads(device.bytes_read) as m: ...``; afterwards ``m.bytes`` is the gain.

    ``counter`` is any monotonic count of bytes read: ``BlockDevice.bytes_read``, or
    ``lambda: process_bytes_read(pid)``.
    """
    meter = ReadMeter(counter, counter())
    yield meter
    meter.bytes = counter() - meter.start


def drop_caches() -> None:
    """Write back, then drop the kernel's clean page cache, dentries and inodes (root only).

    The next read of any file then comes from its device, so a measurement starts cold.
    """
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except PermissionError:
        raise UserError("dropping the page cache needs root (run as root)") from None
