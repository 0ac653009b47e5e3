"""How benchmark readers read: like a data loader, each file opened, read to EOF, closed."""

from __future__ import annotations

import os
from collections.abc import Iterable


def read_files(paths: Iterable[str | bytes], buf: bytearray) -> int:
    """Read every file whole into ``buf`` (reused, so the reader's memory stays constant);
    returns the bytes read."""
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while got := os.readv(fd, [buf]):
                total += got
        finally:
            os.close(fd)
    return total
