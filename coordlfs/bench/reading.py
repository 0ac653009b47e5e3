"""How benchmark readers read: like a data loader, each file opened, read to EOF, closed; or,
for a job that opts in, through ``coordlfs.client`` with the bytes copied out."""

from __future__ import annotations

import os
from collections.abc import Iterable

from coordlfs.client.dataset import Dataset


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


def copy_files(client: Dataset, rels: Iterable[str]) -> int:
    """Read every file through the client and copy its bytes out (``bytes(view)``, what a job
    keeps: a view of the cache is only good while the file is unchanged); returns the bytes.

    A hit is a view of shared memory, so the copy is the whole cost; a miss is bytes already
    read through the mount, which ``bytes()`` returns as they are."""
    total = 0
    for rel in rels:
        total += len(bytes(client.read(rel)))
    return total
