"""The passthrough systems benchmarks set side by side: coordlfs with and without FUSE
passthrough (``coordlfs mount --passthrough yes|no``), and libfuse's C++ example
``passthrough_hp``, which ``scripts/setup`` builds from the libfuse source the daemon links
(3.17) into the venv's private prefix.

A system that cannot run here is no error: the benchmark shows it as n/a with the reason
(``Unavailable``) and measures the rest.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from coordlfs.bench.harness import log_tail
from coordlfs.system.mounts import mount_at
from coordlfs.testbed.mounts import stop_daemon, uninterrupted

#: Where ``scripts/setup`` installs it: the private libfuse prefix of the venv running us.
DEFAULT_HP = Path(sys.prefix) / "libfuse" / "bin" / "passthrough_hp"
#: In the foreground, so that its pid is the daemon's; everything else at its defaults, which
#: are its best for reading cached files: passthrough on, attributes and entries cached
#: (``--nocache`` would add a lookup per open that coordlfs does not make), libfuse's worker
#: threads. ``--direct-io`` would turn passthrough off.
HP_FLAGS = ("--foreground",)
#: Seconds passthrough_hp may take to appear in the mount table.
HP_START_TIMEOUT = 30.0


class Unavailable(Exception):
    """A system that cannot run on this machine or tree; the message says why."""


@contextlib.contextmanager
def passthrough_hp(binary: Path, source: str, mountpoint: str, log: Path) -> Iterator[int]:
    """Serve ``source`` with passthrough_hp at ``mountpoint`` until the block ends; yields its
    pid. Unavailable if there is no binary or it does not mount; stopped as every bench daemon
    is (``stop_daemon``), in a session of its own so that a Ctrl-C at the terminal is ours."""
    if not os.access(binary, os.X_OK):
        raise Unavailable(f"no passthrough_hp at {binary} (scripts/setup builds it)")
    with open(log, "ab") as out:
        process = subprocess.Popen([str(binary), *HP_FLAGS, source, mountpoint],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + HP_START_TIMEOUT
        while mount_at(mountpoint) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise Unavailable(f"passthrough_hp did not mount: {log_tail(str(log))}")
            time.sleep(0.05)
        yield process.pid
    finally:
        with uninterrupted():
            stop_daemon(mountpoint, process.pid)
            process.wait()
