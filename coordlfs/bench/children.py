"""A benchmark's child processes: started for a block and stopped whatever happens in it.

Readers, training jobs and fio run as children; a benchmark that fails, or is stopped with
Ctrl-C or SIGTERM, must not leave one behind reading a mount it is about to unmount.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.pool import Pool
from typing import Any, Protocol, TypeVar

from coordlfs.bench.reading import copy_files, read_files
from coordlfs.client.dataset import Dataset as ClientDataset
from coordlfs.errors import UserError
from coordlfs.protocol.order import batches_of
from coordlfs.system.processes import group_members, process_alive
from coordlfs.testbed.cgroup import Cgroup

#: Seconds a process group gets to go after SIGTERM before SIGKILL.
STOP_WAIT_S = 10
#: where processes leave shared memory by name (``remove_left_in_shm``)
SHM = "/dev/shm"
#: Batches each reader works ahead of the trainer (DataLoader's prefetch_factor).
PREFETCH = 2


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


def worker_pool(workers: int, cgroup: Cgroup | None = None) -> Pool:
    """Forked workers that leave Ctrl-C and SIGTERM to the parent: the parent's ``with``
    terminates them (by SIGTERM, which must then end them, not raise in them), so no worker
    prints a traceback or outlives a stopped benchmark. With ``cgroup`` each worker joins it
    before its first task: what the workers read is counted there."""
    return multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker,
                                                     initargs=(cgroup,))


def _start_worker(cgroup: Cgroup | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if cgroup is not None:
        cgroup.add(os.getpid())


def stop_group(process: subprocess.Popen[Any]) -> None:
    """Stop a child started in a session of its own and every process it forked (fio's job
    processes, a training job's loader workers), by the group's id; what the group left
    running once its leader is gone (or ended) is killed too, and waited for."""
    for sig, wait in ((signal.SIGTERM, STOP_WAIT_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # a worker may outlive its leader
        os.killpg(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_WAIT_S  # gone, so that what they left can go
    while time.monotonic() < deadline and group_members(process.pid):
        time.sleep(0.01)


def remove_left_in_shm(since: float) -> None:
    """Remove the shared memory processes now gone named by their pids in ``SHM`` since
    ``since`` (``time.time()``) and left there: torch names a tensor's ``torch_<pid>_...``
    and unlinks it only once handed over (tens of ms later), so a loader worker that ends
    meanwhile (stopped with its job, or terminated by its loader's shutdown) leaves it (19 MB
    seen after suites whose jobs all ended). Only this user's regular files (the directory is
    every user's), only of processes gone (a live one may yet hand its file over)."""
    uid = os.geteuid()
    for name in os.listdir(SHM):
        parts = name.split("_")
        if len(parts) < 3 or parts[0] != "torch" or not parts[1].isdigit() \
                or process_alive(int(parts[1])):
            continue
        path = os.path.join(SHM, name)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid and st.st_ctime >= since:
                os.unlink(path)


@dataclass(slots=True)
class EpochMarks:
    """Storage bytes per epoch of jobs that run side by side: ``storage()`` is read as the
    last job ends each epoch, since jobs drift apart and an epoch's bytes are those read
    while its slowest job finished it."""

    storage: Callable[[], int]
    #: per job, the epochs it has ended
    done: list[int]
    marks: list[int] = field(default_factory=list)

    def ended(self, job: int, epoch: int) -> None:
        self.done[job] = epoch
        while len(self.marks) < min(self.done):
            self.marks.append(self.storage())

    def per_epoch(self) -> list[int]:
        return [b - a for a, b in zip([0, *self.marks], self.marks, strict=False)]


# -- readers fed batch by batch -------------------------------------------------------------

def batch_paths(order: list[str], base: str | os.PathLike[str], batch: int) -> list[list[str]]:
    """An epoch's batches of paths under ``base``, in the order, as a DataLoader cuts them."""
    paths = [os.path.join(base, rel) for rel in order]
    return [[paths[i] for i in indices]
            for indices in batches_of(list(range(len(paths))), batch, drop_last=False)]


def _reader_main(conn: Connection, client: str | None) -> None:
    """A reader process: read each batch of paths it is sent, reply with the bytes read; with
    ``client`` (a mountpoint), the paths are relative to it and read through the client, the
    bytes copied out (the client is made at the first batch: the mount may come later).

    A read that fails ends the reader with the error as its reply, for the parent to report
    in one line: no traceback, also when a bench stopped by Ctrl-C takes its mount away while
    its readers are still in a batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us, without a traceback
    buf = bytearray(1 << 20)
    dataset: ClientDataset | None = None
    conn.send("ready")
    try:
        while (batch := conn.recv()) is not None:
            try:
                if client and dataset is None:
                    dataset = ClientDataset(client)
                conn.send(copy_files(dataset, batch) if dataset else read_files(batch, buf))
            except OSError as e:
                with contextlib.suppress(OSError):
                    conn.send(f"{e.__class__.__name__}: {e}")
                return
    finally:
        if dataset is not None:
            dataset.close()  # its counts reach the mount's status


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` in this process's environment for as long as the block runs: what a
    process spawned meanwhile inherits."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


@dataclass(slots=True)
class Readers:
    """``count`` reader processes, fed batch by batch as a DataLoader feeds its workers;
    with ``client`` (a mountpoint) they read through ``coordlfs.client`` paths relative to
    it; with ``env`` (``coordlfs run``'s variables) they are new processes started with it,
    since a library is preloaded at exec, never into a fork."""

    count: int
    client: str | None = None
    env: dict[str, str] | None = None
    #: seconds a batch may take before the readers count as hung
    stall_limit_s: float = 600.0
    procs: list[Any] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)

    def start(self) -> None:
        context = multiprocessing.get_context("spawn" if self.env else "fork")
        for _ in range(self.count):
            parent, child = context.Pipe()
            proc = context.Process(target=_reader_main, args=(child, self.client),
                                   daemon=True)
            with environment(self.env or {}):
                proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        for conn in self.conns:
            if conn.recv() != "ready":
                raise UserError("a reader process failed to start")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def epoch(self, batches: list[list[str]], compute_s: float) -> tuple[float, float, int]:
        """Run one epoch; returns (seconds, seconds the trainer waited for data, bytes)."""
        try:
            return self._epoch(batches, compute_s)
        except (EOFError, OSError) as e:
            raise UserError(f"a reader process died ({e.__class__.__name__}): killed for "
                            "memory in its cgroup, or a read failed") from None

    def _epoch(self, batches: list[list[str]], compute_s: float) -> tuple[float, float, int]:
        start = time.perf_counter()
        for j in range(min(len(batches), PREFETCH * self.count)):
            self.conns[j % self.count].send(batches[j])
        waited, total = 0.0, 0
        for i in range(len(batches)):
            before = time.perf_counter()
            conn = self.conns[i % self.count]
            if not conn.poll(self.stall_limit_s):
                raise UserError(f"a reader made no progress for {self.stall_limit_s:g} s "
                                "(a hung filesystem)")
            got = conn.recv()
            if isinstance(got, str):
                raise UserError(f"a reader failed: {got}")
            total += got
            waited += time.perf_counter() - before
            ahead = i + PREFETCH * self.count
            if ahead < len(batches):
                conn.send(batches[ahead])
            if compute_s:
                time.sleep(compute_s)
        return time.perf_counter() - start, waited, total

    def stop(self) -> None:
        stop_children(self.conns, self.procs, None)
