"""Block devices as the kernel counts them, and its page cache dropped on purpose.

A measurement of what reaches storage starts cold (``drop_caches``) and reads the kernel's
own counters, which neither side under test can misreport: the read counter of the device
that holds a path (``/sys/block/<dev>/stat``, every reader of the device), and the device's
number, by which cgroup files (``blkio.throttle.*``) name it to throttle it.
"""

from __future__ import annotations

import os
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


def drop_caches(what: str = "3") -> None:
    """Write back, then drop the kernel's clean page cache, dentries and inodes (root only;
    ``what="1"``: the page cache alone).

    The next read of any file then comes from its device, so a measurement starts cold.
    """
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text(f"{what}\n")
    except PermissionError:
        raise UserError("dropping the page cache needs root (run as root)") from None


def drop_page_cache() -> None:
    """``drop_caches`` of the data alone: the kernel keeps the names and inodes it knows (of
    the source and of a mount alike), as a job's own later epochs would find them."""
    drop_caches("1")
