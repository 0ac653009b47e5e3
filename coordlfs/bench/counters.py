"""Bytes a process had read from storage, from the kernel's own per-process counters.

Benchmarks compare what reaches storage, not what readers asked for: page-cache hits and
coordlfs cache hits never touch the disk. ``read_bytes`` of ``/proc/PID/io`` leaves out what
other processes read meanwhile, where the device's counter (``coordlfs.testbed.storage``)
counts every reader of the disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


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
