"""One benchmark run at a time per work directory."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from coordlfs.errors import UserError


@contextlib.contextmanager
def exclusive(workdir: Path, what: str) -> Iterator[None]:
    """Hold ``workdir/.<what>.lock``: while we hold it, a mount found in the directory is a
    killed run's, ours to unmount."""
    fd = os.open(workdir / f".{what}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another {what} is running in {workdir}") from None
        yield
    finally:
        os.close(fd)
