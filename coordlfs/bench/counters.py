"""What a counter of bytes read from storage gained while a block of code ran.

Benchmarks compare what reaches storage, not what readers asked for: page-cache hits and
coordlfs cache hits never touch the disk. The counters are the kernel's: the device's
(``coordlfs.testbed.storage``, every reader of the disk) and a cgroup's
(``Cgroup.bytes_read``, only the processes under test, their children included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


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
    ``Cgroup.bytes_read``.
    """
    meter = ReadMeter(counter, counter())
    yield meter
    meter.bytes = counter() - meter.start
