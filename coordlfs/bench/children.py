"""A benchmark's child processes: started for a block and stopped whatever happens in it.

Readers, training jobs and fio run as children; a benchmark that fails, or is stopped with
Ctrl-C or SIGTERM, must not leave one behind reading a mount it is about to unmount.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

#: Seconds a process group gets to go after SIGTERM before SIGKILL.
STOP_WAIT_S = 10


class Children(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


C = TypeVar("C", bound=Children)


@contextlib.contextmanager
def running(children: C) -> Iterator[C]:
    """``children`` started for the block and stopped after it, even when it fails."""
    try:
        children.start()
        yield children
    finally:
        children.stop()


def stop_children(conns: list[Connection], procs: list[Any], farewell: Any) -> None:
    """Send each child ``farewell``, give it 5 s to exit, then kill it."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(farewell)
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def stop_group(process: subprocess.Popen[str]) -> None:
    """Stop a child started in a session of its own and every process it forked (fio's job
    processes, a training job's loader workers), by the group's id."""
    for sig, wait in ((signal.SIGTERM, STOP_WAIT_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
