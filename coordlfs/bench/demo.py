"""Demo: bytes read from storage and time per epoch: the kernel page cache, coordlfs's mount,
coordlfs's native client and a job under ``coordlfs run``, on the disk as it is and on a slow
source (the disk throttled to ``--slow-bps``, a network filesystem's rate).

A training job reads its whole dataset every epoch in a new random order. When the dataset is
twice the memory available, the kernel's LRU page cache evicts most items before their next
use and re-reads ~0.8 of the dataset per epoch; coordlfs caches whole files until full and
never evicts, so every later epoch reads only ``dataset - cache`` (~0.5): the minimum.

Both sides read the same files in the same shuffled orders, from a reader process whose memory
cgroup holds half the dataset (plus the reader's own small footprint, measured). coordlfs gets
``--cache-size`` = half the dataset, and the kernel's page cache is dropped before each of its
epochs so that only coordlfs's own cache can save reads. The same mount is read twice: with
open/read/close (an unmodified job), then by a fresh mount through ``coordlfs.client``, the
reader handing each epoch's order to the mount first (``prefetch``) and copying each file's
bytes out (``bytes()``).

Bytes from storage are what the processes under test had the kernel read from the disk, the
count of a blkio cgroup that holds them (``Cgroup.bytes_read``: the reader for the page
cache; for coordlfs the daemon and the reader, whose kernel reads a miss or a file the cache
has no room for from the source file itself, the backing of its passthrough open, as its
client does), so that other processes using the disk do not blur the numbers; the disk's own
sector counter (``/sys/block/<dev>/stat``) goes into the JSON beside it. With ``--throttle``
that group is throttled, on both sides alike. Either way the dataset must be on a disk, not
on tmpfs.

    python -m coordlfs.bench.demo [--files N] [--dir DIR] [--epochs 3] [--slow-bps 50M]
                                  [--json FILE]

Needs root (dropping caches, cgroups). Whatever happens, the mount and the cgroups it made
are gone when it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coordlfs.bench import harness
from coordlfs.bench.counters import measure_reads
from coordlfs.bench.reading import copy_files, read_files
from coordlfs.client import run as run_command
from coordlfs.client.dataset import Dataset as ClientDataset
from coordlfs.daemon.mounting import free_space
from coordlfs.errors import UserError, exit_status
from coordlfs.protocol.client import Control
from coordlfs.sizes import format_size, parse_size
from coordlfs.testbed.cgroup import Cgroup, memory_cgroup, storage_cgroup
from coordlfs.testbed.dataset import Dataset, DatasetSpec, ensure_dataset, epoch_orders
from coordlfs.testbed.mounts import mounted
from coordlfs.testbed.storage import BlockDevice, block_device, drop_caches, drop_page_cache

DEFAULT_DIR = "/var/tmp/coordlfs-demo"
#: Our cgroups are ``<prefix>-<pid>[-storage]``, so that a later run can remove a killed run's.
CGROUP_PREFIX = "coordlfs-demo"
#: Reads go into one preallocated buffer, so the reader's memory (charged to its cgroup next to
#: the page cache under test) stays the same from the measurement of its footprint to the end.
READ_BUFFER = 1 << 20


# -- the reader process --------------------------------------------------------------------

def serve_reader(client: str | None = None) -> None:
    """Body of the reader process: per stdin line ``{"paths": [...]}``, read them, reply.

    Each file is opened, read to EOF and closed, as a data loader does; with ``client`` (a
    mountpoint) the paths are relative to it, handed to the mount as the order to come
    (``prefetch``), then read through the client and copied out. The reply is ``{"seconds":
    s, "bytes": n}``; ``"dry": true`` only parses the request, so that the footprint of
    handling an epoch can be measured before any file is read.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us, without a traceback
    buf = bytearray(READ_BUFFER)
    for i in range(0, READ_BUFFER, 4096):
        buf[i] = 1  # fault the pages in before we report ready, like the rest of start-up
    dataset = ClientDataset(client) if client else None
    _reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        total = 0
        if request.get("dry"):
            pass
        elif dataset is not None:
            dataset.prefetch(request["paths"])
            total = copy_files(dataset, request["paths"])
            dataset.report()  # its direct reads in the mount's count of the epoch
        else:
            total = read_files(request["paths"], buf)
        _reply({"seconds": time.perf_counter() - start, "bytes": total})
    if dataset is not None:
        dataset.close()


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Reader:
    """A reader process of its own, so a cgroup can hold exactly it and the page cache it fills.

    The constructor returns once the process has started up, so that what it allocated and
    loaded to get there is not charged to the cgroup it is moved into afterwards. A fresh
    interpreter, not a fork like ``children.Readers``: its footprint is measured and charged
    to the budget, and a fork would carry the bench's own memory with it. Hence also JSON
    lines on its stdin and stdout rather than a multiprocessing pipe.
    """

    def __init__(self, client: str | None = None, env: dict[str, str] | None = None) -> None:
        code = f"from coordlfs.bench.demo import serve_reader; serve_reader({client!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        try:
            self._receive()
        except BaseException:
            self.close(kill=True)
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise UserError(f"the reader process exited (status {self.proc.wait()}); "
                            "killed for memory in its cgroup, or a read failed (see above)")
        return json.loads(line)

    def read(self, paths: list[str], dry: bool = False) -> tuple[float, int]:
        """Read every file in ``paths``; returns (seconds, bytes read)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"paths": paths, "dry": dry}) + "\n")
        self.proc.stdin.flush()
        reply = self._receive()
        return reply["seconds"], reply["bytes"]

    def close(self, kill: bool = False) -> None:
        """Stop the reader: at once with ``kill`` (an error or Ctrl-C), else at the next EOF."""
        if kill:
            self.proc.kill()
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()  # EOF: the reader returns
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(kill=exc_type is not None)  # mid-epoch, it would hold the mount busy


@contextlib.contextmanager
def budgeted_reader(name: str, budget: int, sample: list[str], storage: Path | None = None,
                    read_bps: int | None = None, client: str | None = None,
                    env: dict[str, str] | None = None) -> Iterator[tuple[Reader, int, Cgroup]]:
    """A reader in a memory cgroup of ``budget`` bytes plus its own footprint, measured.

    Yields (reader, footprint in bytes, its cgroup). ``sample`` is an epoch's path list:
    handling one is part of the footprint. With ``storage`` the group counts its reads from
    the disk holding it, throttled to ``read_bps``; with ``client`` it reads through the
    client; ``env``: its environment (``coordlfs run``'s).
    """
    with Reader(client, env) as reader, memory_cgroup(name, None, reader.pid, storage=storage,
                                                 read_bps=read_bps) as group:
        reader.read(sample, dry=True)
        footprint = group.memory_usage()
        group.set_memory_limit(budget + footprint)
        yield reader, footprint, group


# -- epochs --------------------------------------------------------------------------------

@dataclass(slots=True)
class Epoch:
    epoch: int
    #: bytes the processes under test read from storage (their blkio cgroup's count)
    storage_bytes: int
    #: bytes read from the whole disk meanwhile (its sectors-read counter), others' reads too
    device_bytes: int
    seconds: float
    #: coordlfs only: bytes it fetched from the source, by its own counter
    source_bytes: int | None = None
    #: coordlfs only: bytes in its cache at the end of the epoch
    cache_used_bytes: int | None = None
    #: coordlfs only: opens the kernel served by passthrough (from the cache, from the source
    #: files), and reads the daemon served (cache hits, misses)
    passthrough_opens: int | None = None
    source_opens: int | None = None
    daemon_reads: int | None = None


@dataclass(slots=True)
class Storage:
    """Where bytes from storage are counted: the disk, and the group of the processes that
    read from it.

    On a quiet machine the two agree; where other processes use the disk, the group's own
    count still tells what the reading under test cost.
    """

    device: BlockDevice
    group: Cgroup


def read_epochs(label: str, reader: Reader, dataset: Dataset, orders: list[list[str]],
                base: str | Path, storage: Storage, before_epoch: Callable[[], None] | None = None,
                control: Control | None = None) -> list[Epoch]:
    """Read every epoch's order under ``base``, counting the reads from storage per epoch.

    With ``control`` (a coordlfs mount), each epoch starts with a mark, and coordlfs's own
    count of bytes from the source and its cache fill are recorded too.
    """
    results = []
    for number, order in enumerate(orders, 1):
        if before_epoch is not None:
            before_epoch()
        mark = f"epoch-{number}"
        if control is not None:
            control.mark(mark)
        with measure_reads(storage.device.bytes_read) as disk, \
                measure_reads(storage.group.bytes_read) as ours:
            seconds, got = reader.read([os.path.join(base, rel) for rel in order])
        if got != dataset.total_bytes:
            raise UserError(f"{label}: read {got} bytes in epoch {number}, but the dataset has "
                            f"{dataset.total_bytes}")
        epoch = Epoch(number, ours.bytes, disk.bytes, round(seconds, 3))
        if control is not None:
            reads = control.stats(since=mark)["reads"]
            epoch.source_bytes = reads["bytes_from_source"]
            epoch.passthrough_opens = reads.get("passthrough_opens", 0)
            epoch.source_opens = reads.get("source_opens", 0)
            epoch.daemon_reads = reads["read_hits"] + reads["read_misses"]
            epoch.cache_used_bytes = control.status()["cache"]["bytes"]
        print(f"  {label} epoch {number}/{len(orders)}: {format_size(ours.bytes)} from "
              f"storage, {seconds:.1f} s", flush=True)
        results.append(epoch)
    return results


# -- the demo ------------------------------------------------------------------------------

def run_page_cache(dataset: Dataset, orders: list[list[str]], budget: int,
                   device: BlockDevice, read_bps: int | None) -> tuple[list[Epoch], int]:
    """The baseline: read the source directly, the kernel's page cache capped at ``budget``.

    Caches are dropped once, before the first epoch; after that the page cache keeps what
    its LRU keeps. Returns the epochs and the reader's footprint.
    """
    print("page cache (reader in a memory cgroup, caches dropped once):", flush=True)
    drop_caches()
    sample = dataset.paths()
    with budgeted_reader(f"{CGROUP_PREFIX}-{os.getpid()}", budget, sample, dataset.root,
                         read_bps) as (reader, footprint, group):
        return read_epochs("page cache", reader, dataset, orders, dataset.root,
                           Storage(device, group)), footprint


#: The slow source's rate, bytes per second: a network filesystem's, an HDD's.
SLOW_BPS = 50 << 20
#: The report's key for each way of reading coordlfs.
SIDES = {"mount": "coordlfs", "client": "client", "run": "run"}
#: How a coordlfs side reads the mount: (label, what the progress line says).
WAYS = {"mount": ("coordlfs", "same reader and "),
        "client": ("client", "reading through coordlfs.client, each epoch's order prefetched; "),
        "run": ("coordlfs run", "same reader under `coordlfs run` (the preload library); ")}


def run_coordlfs(dataset: Dataset, orders: list[list[str]], budget: int, device: BlockDevice,
                 read_bps: int | None, workdir: Path,
                 way: str = "mount") -> tuple[list[Epoch], int, dict[str, Any]]:
    """coordlfs with ``--cache-size budget``; the same reader, limit and orders, each ``way``
    through a fresh mount: ``mount`` (open/read/close through FUSE), ``client`` (through
    the client) or ``run`` (the reader under ``coordlfs run``).

    The kernel's page cache is dropped before each epoch, so that only coordlfs's cache can
    save reads (the data alone: the names and inodes the kernel knows stay, of the mount as
    of the source for the page cache's epochs). The daemon and the reader (its kernel reads
    the misses from the source file) are counted, and with ``read_bps`` throttled, in one
    blkio group, whose memory groups differ: the budget is the reader's page cache, the
    cache the daemon's. Returns the epochs, the reader's footprint and the mount's status
    at the end.
    """
    label, how = WAYS[way]
    print(f"{label} ({how}limit, page cache dropped before each epoch):", flush=True)
    mountpoint = workdir / "mnt"
    with contextlib.ExitStack() as stack:
        mount = stack.enter_context(mounted(dataset.root, mountpoint, workdir / "mount.log",
                                            "--cache-size", str(budget)))
        control = mount.control
        storage = stack.enter_context(storage_cgroup(f"{CGROUP_PREFIX}-{os.getpid()}-storage",
                                                     dataset.root, read_bps))
        storage.add(mount.pid)
        client = way == "client"
        base = "" if client else mountpoint  # the client's paths are relative to the mount
        env = (run_command.environment([str(mountpoint)], dict(os.environ)) if way == "run"
               else None)
        reader, footprint, _budget = stack.enter_context(budgeted_reader(
            f"{CGROUP_PREFIX}-{os.getpid()}", budget, dataset.paths(base),
            client=str(mountpoint) if client else None, env=env))
        storage.add(reader.pid)
        epochs = read_epochs(label, reader, dataset, orders, base, Storage(device, storage),
                             before_epoch=drop_page_cache, control=control)
        return epochs, footprint, control.status()


def prepare(args: argparse.Namespace, workdir: Path) -> Dataset:
    """Check there is room, then make the dataset or reuse the one already there."""
    spec = DatasetSpec(files=args.files, seed=args.seed)
    need = sum(size for _rel, size in spec.layout())
    room = free_space(str(workdir))
    if not (workdir / "dataset").is_dir() and room < need * 1.1:
        raise UserError(f"{workdir} has {format_size(room)} free; the dataset needs "
                        f"{format_size(need)}")
    print(f"coordlfs demo: making or checking {args.files} files in {workdir / 'dataset'}",
          flush=True)
    return ensure_dataset(workdir / "dataset", spec)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole demo; returns the report that ``--json`` writes: the comparison on the disk
    as it is (or at ``--read-bps``) at the top, and under ``slow`` the same, but for the
    client, on the disk throttled to ``--slow-bps`` (a network filesystem's rate)."""
    harness.require_root("the demo", "drops the page cache and makes memory cgroups")
    workdir = harness.work_dir(args.dir)
    device = block_device(workdir)
    with harness.claimed(workdir, "demo", cgroups=CGROUP_PREFIX):
        dataset = prepare(args, workdir)
        budget = dataset.total_bytes // 2
        print(f"dataset: {len(dataset.files)} files, {format_size(dataset.total_bytes)} "
              f"({'reused' if dataset.reused else 'new'}); memory: {format_size(budget)} for "
              f"the page cache, --cache-size {format_size(budget)} for coordlfs; storage: "
              f"{device.name}", flush=True)
        orders = epoch_orders(dataset, args.epochs, args.seed)
        report = {"dataset": {"root": str(dataset.root), "files": len(dataset.files),
                              "bytes": dataset.total_bytes, "reused": dataset.reused,
                              "spec": asdict(dataset.spec)},
                  "device": device.name,
                  "memory_budget_bytes": budget,
                  **compare(dataset, orders, budget, device, args.read_bps, workdir,
                            ("mount", "client", "run"))}
        if args.slow_bps:
            print(f"the same on a slow source: {device.name} throttled to "
                  f"{format_size(args.slow_bps)}/s", flush=True)
            report["slow"] = compare(dataset, orders, budget, device, args.slow_bps, workdir,
                                     ("mount", "run"))
    return report


def compare(dataset: Dataset, orders: list[list[str]], budget: int, device: BlockDevice,
            read_bps: int | None, workdir: Path, ways: tuple[str, ...]) -> dict[str, Any]:
    """The page cache and each way of reading coordlfs (``WAYS``), on storage read at
    ``read_bps`` (None: as it is): their epochs and ratios, as the report holds them."""
    page_cache, pc_footprint = run_page_cache(dataset, orders, budget, device, read_bps)
    part: dict[str, Any] = {"read_bps": read_bps,
                            "page_cache": {"reader_footprint_bytes": pc_footprint,
                                           "epochs": [asdict(e) for e in page_cache]}}
    for way in ways:
        if way == "run" and run_command.library() is None:
            continue
        epochs, footprint, status = run_coordlfs(dataset, orders, budget, device, read_bps,
                                                 workdir, way=way)
        side = SIDES[way]
        part[side] = {"cache_capacity_bytes": status["cache"]["capacity_bytes"],
                      "cache_used_bytes": epochs[-1].cache_used_bytes,
                      "reader_footprint_bytes": footprint,
                      "epochs": [asdict(e) for e in epochs]}
        if way == "mount":
            part[side]["passthrough"] = _passthrough(status)
        prefix = "" if way == "mount" else f"{side}_"
        part[f"{prefix}later_epochs_ratio"] = _later_ratio(page_cache, epochs)
        part[f"{prefix}time_ratios"] = [round(c.seconds / p.seconds, 3)
                                        for p, c in zip(page_cache, epochs, strict=True)]
    return part


def _passthrough(status: dict[str, Any]) -> str:
    """Which path served the mount's cached files: "on", or why it was off."""
    state = status.get("passthrough") or {}
    return "on" if state.get("on") else f"off: {state.get('why_off') or 'not in this version'}"


def _later_ratio(page_cache: list[Epoch], ours: list[Epoch]) -> float | None:
    """coordlfs's bytes from storage over the page cache's, after the first epoch."""
    theirs = sum(e.storage_bytes for e in page_cache[1:])
    mine = sum(e.storage_bytes for e in ours[1:])
    return round(mine / theirs, 4) if theirs else None


def _epochs(numbers: list[int]) -> str:
    """``[1, 2, 3]`` -> "epochs 1-3", ``[2]`` -> "epoch 2", ``[1, 3]`` -> "epochs 1, 3"."""
    if not numbers:
        return "no epoch"
    if len(numbers) == 1:
        return f"epoch {numbers[0]}"
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"epochs {numbers[0]}-{numbers[-1]}"
    return "epochs " + ", ".join(map(str, numbers))


def verdict(name: str, mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    """One plain sentence: where ``name`` wins and loses against the page cache, in time and
    in bytes from storage (within 1% is as much)."""
    pairs = list(zip(mine, theirs, strict=True))
    faster = [m["epoch"] for m, t in pairs if m["seconds"] < t["seconds"]]
    slower = [m["epoch"] for m, t in pairs if m["seconds"] >= t["seconds"]]
    less = [m["epoch"] for m, t in pairs if m["storage_bytes"] < 0.99 * t["storage_bytes"]]
    more = [m["epoch"] for m, t in pairs if m["storage_bytes"] > 1.01 * t["storage_bytes"]]
    times = ", ".join(f"{m['seconds']:.2f}" for m in mine)
    page = ", ".join(f"{t['seconds']:.2f}" for t in theirs)
    return (f"The {name} beats the page cache on time in {_epochs(faster)} and loses in "
            f"{_epochs(slower)} ({times} s against {page} s); it reads less from storage in "
            f"{_epochs(less)} and more in {_epochs(more)}.")


def _served_by(epoch: dict[str, Any]) -> str:
    """Who served an epoch's reads through the mount: the kernel by passthrough (opens), the
    daemon (READ requests)."""
    opens, reads = epoch.get("passthrough_opens"), epoch.get("daemon_reads")
    if opens is None or reads is None:
        return "-"
    return (f"kernel {opens} + {epoch.get('source_opens') or 0} opens (cache + source), "
            f"daemon {reads} reads")


def format_report(report: dict[str, Any]) -> str:
    """Each storage's table and sentences (``format_comparison``), then in plain words
    when coordlfs wins, by how much, and what it costs on fast local storage."""
    lines = [format_comparison(report, report, "the disk as it is" if not report["read_bps"]
                               else f"the disk at {format_size(report['read_bps'])}/s")]
    if "slow" in report:
        lines += ["", format_comparison(
            report, report["slow"],
            f"a slow source: the disk at {format_size(report['slow']['read_bps'])}/s")]
    lines += ["", *conclusion(report)]
    return "\n".join(lines)


def format_comparison(report: dict[str, Any], part: dict[str, Any], storage: str) -> str:
    """One storage's side-by-side table (bytes from storage and seconds per epoch), the
    ratio for the epochs after the first, and a sentence per coordlfs side on who wins
    where."""
    total = report["dataset"]["bytes"]

    def cell(e: dict[str, Any]) -> str:
        return f"{format_size(e['storage_bytes']):>10} ({e['storage_bytes'] / total:.2f})" \
               f" {e['seconds']:6.2f} s"

    sides = [side for side in ("coordlfs", "client", "run") if side in part]
    titles = {"coordlfs": "coordlfs mount: ditto     ", "client": "coordlfs client: ditto    ",
              "run": "coordlfs run: ditto       "}
    lines = [f"on {storage}:",
             "epoch | page cache: from storage, time | "
             + " | ".join(titles[side] for side in sides) + " | mount served by",
             "------+--------------------------------+" + "+".join(["-" * 27] * len(sides))
             + "+----------------"]
    for number, theirs in enumerate(part["page_cache"]["epochs"]):
        cells = " | ".join(cell(part[side]["epochs"][number]) for side in sides)
        lines.append(f"{theirs['epoch']:5d} |     {cell(theirs)} | {cells} | "
                     f"{_served_by(part['coordlfs']['epochs'][number])}")
    lines.append(f"mount: FUSE passthrough {part['coordlfs']['passthrough']}")
    ratio = part["later_epochs_ratio"]
    epochs = len(part["coordlfs"]["epochs"])
    if ratio is not None:
        later = "epoch 2" if epochs == 2 else f"epochs 2-{epochs}"
        pc = [e["storage_bytes"] / total for e in part["page_cache"]["epochs"][1:]]
        cl = [e["storage_bytes"] / total for e in part["coordlfs"]["epochs"][1:]]
        lines.append(f"{later}: coordlfs read {ratio:.2f}x the bytes the page cache read from "
                     f"storage ({sum(cl) / len(cl):.2f} vs {sum(pc) / len(pc):.2f} of the "
                     "dataset per epoch)")
    names = {"coordlfs": "mount", "client": "client", "run": "mount under `coordlfs run`"}
    for side in sides:
        lines.append(verdict(names[side], part[side]["epochs"], part["page_cache"]["epochs"]))
    epochs_all = part["page_cache"]["epochs"] + [
        e for side in sides for e in part[side]["epochs"]]
    others = sum(e["device_bytes"] - e["storage_bytes"] for e in epochs_all)
    if others > 0.05 * total * len(epochs_all):
        lines.append(f"note: {report['device']} served {format_size(others)} more to other "
                     "processes meanwhile; the table counts the demo's own reads only "
                     "(its blkio cgroups)")
    return "\n".join(lines)


def conclusion(report: dict[str, Any]) -> list[str]:
    """When coordlfs wins, by how much, and what it costs, in plain words: the epochs after
    the first (the cache's) and the first (its cost), of the fastest way it was read."""
    lines = []
    parts = [("On the disk as it is", report)] + (
        [(f"On a source at {format_size(report['slow']['read_bps'])}/s", report["slow"])]
        if "slow" in report else [])
    for where, part in parts:
        side = "run" if "run" in part else "coordlfs"
        how = "under `coordlfs run`" if side == "run" else "through the mount"
        theirs, mine = part["page_cache"]["epochs"], part[side]["epochs"]
        later = (sum(t["seconds"] for t in theirs[1:]) / sum(m["seconds"] for m in mine[1:])
                 if len(mine) > 1 else None)
        fewer = part[f"{'' if side == 'coordlfs' else side + '_'}later_epochs_ratio"]
        first = mine[0]["seconds"] / theirs[0]["seconds"]
        if later is not None and fewer:
            gain = (f"{later:.2f}x the page cache's speed in the epochs after the first"
                    if later >= 1 else f"{1 / later:.2f}x slower than the page cache in the "
                    "epochs after the first")
            lines.append(f"{where}, a job {how} ran at {gain}, reading {1 / fewer:.2f}x fewer "
                         f"bytes from storage; its first epoch took {first:.2f}x the page "
                         "cache's time.")
    lines.append("coordlfs wins where storage bounds an epoch: what its cache saves is reads. "
                 "On fast local storage the CPU bounds it, and the cost is what the daemon's "
                 "filling takes from the job (the first epoch) and, through the mount, a FUSE "
                 "round trip per file: `coordlfs run` avoids the round trip.")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m coordlfs.bench.demo",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=3000,
                        help="files in the sample dataset (default 3000, about 330 MB)")
    parser.add_argument("--dir", default=DEFAULT_DIR,
                        help=f"work directory on a disk, not tmpfs (default {DEFAULT_DIR})")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per side (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="dataset and shuffle seed")
    parser.add_argument("--read-bps", metavar="SIZE", type=lambda s: parse_size(s, "--read-bps"),
                        help="throttle disk reads to SIZE per second (e.g. 50M, an HDD)")
    parser.add_argument("--slow-bps", metavar="SIZE", default=SLOW_BPS,
                        type=lambda s: parse_size(s, "--slow-bps"),
                        help="also compare on a slow source: the disk throttled to SIZE per "
                             f"second, a network filesystem's rate (default {SLOW_BPS >> 20}M"
                             "; 0: not)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.files < 2 or args.epochs < 1:
        print("coordlfs demo: --files must be at least 2 and --epochs at least 1",
              file=sys.stderr)
        return 2

    def body() -> int:
        report = run(args)
        print()
        print(format_report(report))
        harness.write_report(args.json, report)
        return 0

    return exit_status("coordlfs demo", body, "interrupted; unmounted and cleaned up",
                       sigterm_interrupts=True)


if __name__ == "__main__":
    sys.exit(main())
