"""Partitioned caching: N nodes, each reading a disjoint 1/N of the dataset per epoch.

Each node has its own copy of the dataset (as each server of a cluster has its own disk),
its own storage throttle and memory budget (a cgroup), its own reader processes and, for
coordlfs, its own mount whose daemon lives in the node's network namespace
(``coordlfs.testbed.netns``) behind a link shaped with tc. Every epoch the nodes read the shares
``DistributedSampler`` would give them (``epoch_order(seed, epoch)[rank::N]``) at the same
time, and the epoch ends when the slowest node finishes, as synchronous training does. Three
systems: the page cache; ``cache``, the no-eviction cache alone (each node caches what it
reads); ``cache+peers`` (a miss is fetched from the node that caches the file). Storage
bytes per node are the kernel's count for the node's cgroup (``Cgroup.bytes_read``), which
its throttle caps: its readers, and for coordlfs its daemon too (with passthrough a reader's
kernel reads a miss from the source file itself, as a client's reader does).

A second part measures the peer path's throughput on an unshaped loopback link: a large file
that one mount caches read through the other mount, and the same bytes fetched with the
peer protocol alone, beside plain TCP between two processes.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio

from coordlfs.bench import harness
from coordlfs.bench.aligned import Plan as JobPlan
from coordlfs.bench.aligned import budget_for
from coordlfs.bench.children import Readers, batch_paths, running
from coordlfs.bench.ratios import median, ratio
from coordlfs.client.dataset import Dataset as ClientDataset
from coordlfs.daemon.config import DEFAULT_FILL_DEPTH
from coordlfs.errors import UserError
from coordlfs.peers import hold as peer_hold
from coordlfs.peers.links import PeerLink
from coordlfs.peers.placement import Address, owner
from coordlfs.peers.wire import MAX_CHUNK, Get, Kind
from coordlfs.protocol.client import Control
from coordlfs.protocol.order import epoch_order
from coordlfs.protocol.spec import MAX_PREFETCH_PATHS, PREFETCH
from coordlfs.sizes import format_size, pages
from coordlfs.testbed.cgroup import Cgroup, memory_cgroup
from coordlfs.testbed.dataset import Dataset
from coordlfs.testbed.mounts import mounted, settled
from coordlfs.testbed.netns import Node, cluster_network, rate_bits
from coordlfs.testbed.netns import check_can_run as check_netns
from coordlfs.testbed.netns import remove_stale as remove_stale_network
from coordlfs.testbed.storage import drop_caches

CGROUP_PREFIX = "coordlfs-cluster"
SYSTEMS = ("page cache", "cache", "cache+peers")
PORT = 7878
#: The size of the file read in the throughput part, and GETs in flight for it.
THROUGHPUT_BYTES = 512 << 20
DEPTH = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_dataset_arguments(parser, "cluster", make="10000:110K")
    parser.add_argument("--nodes", type=int, default=2, help="nodes (default 2)")
    parser.add_argument("--cache", type=float, default=0.5,
                        help="each node's cache as a fraction of the dataset, in the whole "
                             "pages the cache charges (default 0.5)")
    parser.add_argument("--link", default="10gbit",
                        help="tc rate of each node's link (default 10gbit; none: unshaped)")
    parser.add_argument("--no-throughput", dest="throughput", action="store_false",
                        help="skip the loopback throughput part")
    parser.add_argument("--order-handed-over", action="store_true",
                        help="before each epoch, hand each node's order to its mount "
                             "(prefetch), as a job that knows it does")
    parser.add_argument("--client", action="store_true",
                        help="each node's readers read through coordlfs.client (a hit from "
                             "shared memory, the bytes copied out) and each epoch's order is "
                             "handed over with Dataset.prefetch; implies --order-handed-over")
    harness.add_training_arguments(parser, readers=4, readers_help="reader processes per node",
                                   compute_ms=0.0)


@dataclass(slots=True)
class NodeEpoch:
    seconds: float
    stall_percent: float
    storage_bytes: int
    peer_bytes: int
    #: CPU time of the node's readers and daemon (a busy machine stretches seconds, not this)
    cpu_seconds: float = 0.0
    #: ... of its daemon alone, and the files its readers got from peers
    daemon_cpu_seconds: float = 0.0
    peer_files: int = 0
    #: of ``storage_bytes``, the files' bytes the mount read from the source (its own count:
    #: fills, streams, files the kernel read from the source by passthrough); the rest is
    #: the source's metadata (directories, inodes) and files other than the dataset's
    data_bytes: int = 0
    #: the files' bytes its fills copied from pages already in memory (``reads.
    #: fill_bytes_from_pages``): the nodes here share one page cache, so a file one node read
    #: from storage may fill the other's cache from memory, where two machines would read it
    #: twice
    memory_bytes: int = 0


@dataclass(slots=True)
class SystemResult:
    system: str
    #: per epoch, per node
    epochs: list[list[NodeEpoch]]
    cache_bytes: int
    #: per node at the end, for coordlfs with peers: the holding area's counters and the
    #: batches (GETMANY) it served
    peer_counters: list[dict[str, Any]] = field(default_factory=list)

    def epoch_seconds(self, epoch: int) -> float:
        """An epoch of synchronous training lasts as long as its slowest node."""
        return max(n.seconds for n in self.epochs[epoch])

    def storage(self, epoch: int) -> int:
        return sum(n.storage_bytes for n in self.epochs[epoch])

    @property
    def later_storage(self) -> int:
        return sum(self.storage(e) for e in range(1, len(self.epochs)))

    @property
    def later_data(self) -> int:
        """Of ``later_storage``, the dataset's bytes the mounts read (the rest: metadata)."""
        return sum(n.data_bytes for epoch in self.epochs[1:] for n in epoch)

    @property
    def later_cpu(self) -> float:
        """CPU seconds of every node's readers and daemon after the first epoch."""
        return round(sum(n.cpu_seconds for epoch in self.epochs[1:] for n in epoch), 3)

    @property
    def later_seconds(self) -> float:
        return sum(self.epoch_seconds(e) for e in range(1, len(self.epochs)))

    @property
    def peer_file_cpu_us(self) -> float | None:
        """Microseconds of every daemon's CPU after the first epoch per file the nodes got
        from peers: the asking daemon's and the serving daemon's, and the CPU of the hits
        beside them (each node caching 1/N, a node's reads are mostly from peers and hits);
        None without files from peers."""
        files = sum(n.peer_files for epoch in self.epochs[1:] for n in epoch)
        cpu = sum(n.daemon_cpu_seconds for epoch in self.epochs[1:] for n in epoch)
        return round(cpu / files * 1e6, 1) if files else None


@dataclass(frozen=True, slots=True)
class Plan:
    nodes: int
    #: what each node runs: one training job of ``bench aligned``
    job: JobPlan
    link: str | None
    cache: int
    #: whether each mount is told the order of its node's reads before each epoch
    order_handed_over: bool = False
    #: whether coordlfs's readers read through ``coordlfs.client`` (which hands the order
    #: over with ``Dataset.prefetch``)
    client: bool = False


def node_copies(dataset: Dataset, work: Path, nodes: int) -> list[Path]:
    """The dataset for node 0, and a copy with the same sizes and mtimes for each other node."""
    roots = [dataset.root]
    for i in range(1, nodes):
        copy = work / f"node{i}"
        if not (copy / ".complete").exists():
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(dataset.root, copy, copy_function=shutil.copy2)
            (copy / ".complete").touch()
        roots.append(copy)
    return roots


def _secret(work: Path) -> Path:
    path = work / "secret"
    if not path.exists():
        path.write_bytes(os.urandom(24).hex().encode())
    path.chmod(0o600)
    return path


def run_system(system: str, plan: Plan, dataset: Dataset, roots: list[Path],
               work: Path) -> SystemResult:
    names = [rel for rel, _size in dataset.files]
    sizes = dict(dataset.files)
    # a node's budget is that of one job of ``readers`` in ``bench aligned``; with the order
    # handed over, every system gets the memory the mount then holds beside its cache: the
    # peer holding area, the replies in flight to and from the peer (a MiB each), and the
    # fills in flight (a MiB each), twice over for the allocator's slack
    extra = 2 * (peer_hold.CAPACITY + 2 * peer_hold.DEPTH * MAX_CHUNK
                 + DEFAULT_FILL_DEPTH * MAX_CHUNK) if plan.order_handed_over else 0
    # client readers copy the bytes out: every system gets their headroom, as in bench epochs
    extra += harness.CLIENT_HEADROOM_PER_READER * plan.job.readers if plan.client else 0
    budget = budget_for(dataset, plan.cache, extra, plan.job)
    with contextlib.ExitStack() as stack:
        net: list[Node] | None = None
        if system == "cache+peers":
            net = stack.enter_context(cluster_network(plan.nodes, plan.link))
        groups: list[Readers] = []
        cgroups: list[Cgroup] = []
        # per node, the processes whose CPU time counts: its readers, its daemon
        busy: list[list[int]] = []
        controls: list[Control | None] = []
        bases: list[str | Path] = []
        tellers: list[Teller | None] = []
        client = plan.client and system != "page cache"
        for i, root in enumerate(roots):
            cgroup = stack.enter_context(memory_cgroup(
                f"{CGROUP_PREFIX}-{os.getpid()}-{i}", storage=root, read_bps=plan.job.throttle))
            cgroups.append(cgroup)
            base = work / f"mnt{i}"
            group = stack.enter_context(running(Readers(plan.job.readers,
                                                        str(base) if client else None)))
            for pid in group.pids:
                cgroup.add(pid)
            groups.append(group)
            if system == "page cache":
                busy.append(group.pids)
                controls.append(None)
                bases.append(root)
                tellers.append(None)
            else:
                options: list[str] = ["--window-size", "0"]
                enter: list[str] = []
                if net is not None:
                    peers = ",".join(f"{n.address}:{PORT}" for n in net)
                    options += ["--listen", f"{net[i].address}:{PORT}", "--peers", peers,
                                "--secret-file", str(_secret(work))]
                    enter = net[i].enter()
                mount = stack.enter_context(mounted(
                    root, base, work / f"mount{i}.log", "--cache-size", str(plan.cache),
                    *options, enter=enter))
                daemon, control = mount.pid, mount.control
                cgroup.add(daemon)
                busy.append([daemon, *group.pids])
                controls.append(control)
                bases.append("" if client else base)
                tellers.append(_teller(stack, base, control, plan))
            cgroup.set_memory_limit(budget)
        drop_caches()
        epochs = []
        with ThreadPoolExecutor(plan.nodes) as pool:
            for epoch in range(plan.job.epochs):
                order = epoch_order(plan.job.seed, epoch, len(names))
                before = [_counters(cgroup, pids, control) for cgroup, pids, control
                          in zip(cgroups, busy, controls, strict=True)]
                shares = [[names[k] for k in order[i::plan.nodes]] for i in range(plan.nodes)]
                futures = [pool.submit(node_epoch, groups[i], bases[i], shares[i], plan,
                                       tellers[i])
                           for i in range(plan.nodes)]
                done = [f.result() for f in futures]
                _check_bytes(system, epoch, done, shares, sizes)
                for control in controls:  # the backfills this epoch's reads count in it
                    if control is not None:
                        settled(control)
                after = [_counters(cgroup, pids, control) for cgroup, pids, control
                         in zip(cgroups, busy, controls, strict=True)]
                epochs.append([NodeEpoch(round(seconds, 3), round(100 * waited / seconds, 1),
                                         a.storage - b.storage, a.peer_bytes - b.peer_bytes,
                                         round(a.cpu - b.cpu, 3),
                                         round(a.daemon_cpu - b.daemon_cpu, 3),
                                         a.peer_files - b.peer_files, a.data - b.data,
                                         a.memory - b.memory)
                               for (seconds, waited, _got), a, b in zip(done, after, before,
                                                                         strict=True)])
                _print_epoch(system, epoch, epochs[-1], dataset)
        counters = [_peer_counters(control) for control in controls if net is not None]
    return SystemResult(system, epochs, plan.cache, counters)


def _check_bytes(system: str, epoch: int, done: list[tuple[float, float, int]],
                 shares: list[list[str]], sizes: dict[str, int]) -> None:
    """Every node's readers got every byte of their share."""
    for node, ((_seconds, _waited, got), share) in enumerate(zip(done, shares, strict=True)):
        if got != (want := sum(sizes[name] for name in share)):
            raise UserError(f"{system}: node {node} read {got} bytes in epoch {epoch + 1}, "
                            f"its share has {want}")


def _peer_counters(control: Control | None) -> dict[str, Any]:
    assert control is not None
    status = control.status()
    return {"held": status["peers"]["held"], "served_batches": status["served"]["batches"],
            "served_files": status["served"]["requests"]}


Teller = Callable[[list[str]], object]


def _teller(stack: contextlib.ExitStack, base: Path, control: Control, plan: Plan
            ) -> Teller | None:
    """How a node's job hands its order to the mount, if it does: the client's
    ``Dataset.prefetch``, or the ``prefetch`` command in pieces."""
    if plan.client:
        return stack.enter_context(ClientDataset(base)).prefetch
    if not plan.order_handed_over:
        return None

    def tell(share: list[str]) -> None:
        for start in range(0, len(share), MAX_PREFETCH_PATHS):
            control.call(PREFETCH, paths=share[start:start + MAX_PREFETCH_PATHS])

    return tell


def node_epoch(readers: Readers, base: str | Path, share: list[str], plan: Plan,
               tell: Teller | None) -> tuple[float, float, int]:
    """One node's epoch: (seconds, seconds waiting for data, bytes). A job that knows its
    order hands it over first (``tell``); the time that takes counts as waiting. ``base``
    is empty for client readers, which name files relative to the mount."""
    started = time.perf_counter()
    if tell is not None:
        tell(share)
    telling = time.perf_counter() - started
    seconds, waited, got = readers.epoch(batch_paths(share, base, plan.job.batch),
                                         plan.job.compute_s)
    return seconds + telling, waited + telling, got


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, its exited threads included (``/proc/PID/stat``): the
    per-thread schedstat sum of ``bench.hits`` loses a thread's time when it exits (the
    daemon's idle worker threads go after 10 s), and an epoch came out negative."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class _Sample:
    """A node's counters at one moment."""

    #: bytes its group read from storage, and of the dataset's files by its mount
    storage: int
    data: int
    peer_bytes: int
    peer_files: int
    #: CPU seconds of its readers and daemon, and of its daemon alone
    cpu: float
    daemon_cpu: float
    #: bytes its fills copied from pages already in memory
    memory: int


def _counters(cgroup: Cgroup, busy: list[int], control: Control | None) -> _Sample:
    """A node's counters now; ``busy``: its processes, its daemon first if it has one."""
    reads = control.status()["reads"] if control else {}
    cpus = [cpu_seconds(pid) for pid in busy]
    return _Sample(cgroup.bytes_read(), reads.get("bytes_from_source", 0),
                   reads.get("bytes_from_peers", 0),
                   reads.get("file_peer_hits", 0), sum(cpus), cpus[0] if control else 0.0,
                   reads.get("fill_bytes_from_pages", 0))


def _print_epoch(system: str, epoch: int, nodes: list[NodeEpoch], dataset: Dataset) -> None:
    total = dataset.total_bytes
    print(f"  {system:12} epoch {epoch + 1}: "
          f"{max(n.seconds for n in nodes):6.1f} s, CPU "
          f"{' '.join(f'{n.cpu_seconds:.1f}' for n in nodes)} s; storage "
          f"{' '.join(f'{n.storage_bytes / total:.3f}' for n in nodes)}, peers "
          f"{' '.join(f'{n.peer_bytes / total:.3f}' for n in nodes)} of the dataset per node",
          flush=True)


# -- throughput on loopback --------------------------------------------------------------------

def _tcp_sink(port_conn: Any, total: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_conn.send(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            buf = bytearray(MAX_CHUNK)
            got = 0
            while got < total and (n := conn.recv_into(buf)):
                got += n
        port_conn.send(got)


def raw_tcp_throughput(total: int) -> float:
    """Bytes per second of plain TCP between this process and another on loopback."""
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    proc = context.Process(target=_tcp_sink, args=(child, total), daemon=True)
    proc.start()
    try:
        port = parent.recv()
        chunk = os.urandom(MAX_CHUNK)
        with socket.create_connection(("127.0.0.1", port)) as s:
            started = time.perf_counter()
            for _ in range(total // MAX_CHUNK):
                s.sendall(chunk)
            s.shutdown(socket.SHUT_WR)
            if parent.recv() != total:
                raise UserError("the TCP sink received fewer bytes than sent")
            return total / (time.perf_counter() - started)
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()


async def _protocol_fetch(address: Address, path: bytes, st: os.stat_result) -> float:
    link = PeerLink(address, b"", timeout=30)
    async with trio.open_nursery() as nursery:
        link.nursery = nursery
        offsets = iter(range(0, st.st_size, MAX_CHUNK))
        started = time.perf_counter()

        async def worker() -> None:
            for offset in offsets:
                kind, _data = await link.get(Get(path, st.st_size, st.st_mtime_ns, offset,
                                                 min(MAX_CHUNK, st.st_size - offset)))
                if kind != Kind.DATA:
                    raise UserError("the peer did not serve the file")

        async with trio.open_nursery() as workers:
            for _ in range(DEPTH):
                workers.start_soon(worker)
        seconds = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return st.st_size / seconds


def throughput(work: Path) -> dict[str, float]:
    """Peer fetch throughput through the mount and with the protocol alone, and raw TCP."""
    ports = [_free_port(), _free_port()]
    nodes = (Address("127.0.0.1", ports[0]), Address("127.0.0.1", ports[1]))
    roots = [work / "tp0", work / "tp1"]
    name = next(f"big-{i}.bin" for i in range(1000)
                if owner(f"big-{i}.bin".encode(), nodes) == nodes[1])
    for root in roots:
        root.mkdir(exist_ok=True)
    if not (roots[0] / name).exists():
        with open(roots[0] / name, "wb") as f:
            for _ in range(THROUGHPUT_BYTES // MAX_CHUNK):
                f.write(os.urandom(MAX_CHUNK))
    for old in roots[1].iterdir():
        old.unlink()
    shutil.copy2(roots[0] / name, roots[1] / name)
    peers = ",".join(map(str, nodes))
    cache = 2 * THROUGHPUT_BYTES
    with contextlib.ExitStack() as stack:
        for i, root in enumerate(roots):
            stack.enter_context(mounted(
                root, work / f"tpmnt{i}", work / f"tp{i}.log", "--cache-size", str(cache),
                "--listen",
                str(nodes[i]), "--peers", peers, "--insecure", "--max-file-size", str(cache)))
        (work / "tpmnt1" / name).read_bytes()  # node 1 caches it
        drop_caches()
        started = time.perf_counter()
        with open(work / "tpmnt0" / name, "rb") as f:
            while f.read(MAX_CHUNK):
                pass
        through_mount = THROUGHPUT_BYTES / (time.perf_counter() - started)
        if Control(work / "tpmnt0").status()["reads"]["bytes_from_peers"] < THROUGHPUT_BYTES:
            raise UserError("the throughput file was not read from the peer")
        protocol = trio.run(_protocol_fetch, nodes[1], name.encode(), (roots[1] / name).stat())
    raw = raw_tcp_throughput(THROUGHPUT_BYTES)
    result = {"mount_bytes_per_s": round(through_mount), "protocol_bytes_per_s": round(protocol),
              "raw_tcp_bytes_per_s": round(raw),
              "mount_vs_raw": round(through_mount / raw, 3),
              "protocol_vs_raw": round(protocol / raw, 3)}
    print(f"loopback: through the mount {through_mount / 1e9:.2f} GB/s, peer protocol "
          f"{protocol / 1e9:.2f} GB/s, raw TCP {raw / 1e9:.2f} GB/s", flush=True)
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the command -------------------------------------------------------------------------------

def summarize(runs: list[dict[str, SystemResult]]) -> dict[str, Any]:
    storage = [ratio(r["cache"].later_storage, r["cache+peers"].later_storage) for r in runs]
    seconds = [ratio(r["cache"].later_seconds, r["cache+peers"].later_seconds) for r in runs]
    page = [ratio(r["page cache"].later_seconds, r["cache+peers"].later_seconds) for r in runs]
    per_file = [r["cache+peers"].peer_file_cpu_us for r in runs]
    return {
        "storage_bytes_ratio": median(storage),
        "storage_bytes_ratio_runs": storage,
        "peers_storage_bytes_after_first_epoch": [r["cache+peers"].later_storage for r in runs],
        # of those, the files' bytes the mounts read; the rest is metadata
        "peers_data_bytes_after_first_epoch": [r["cache+peers"].later_data for r in runs],
        "cache_storage_bytes_after_first_epoch": [r["cache"].later_storage for r in runs],
        "epoch_time_ratio": median(seconds),
        "epoch_time_ratio_runs": seconds,
        # beside the ratio: what a file from a peer costs the daemons (hits beside included)
        "daemon_cpu_us_per_peer_file": median(per_file),
        "daemon_cpu_us_per_peer_file_runs": per_file,
        "page_cache_epoch_time_ratio": median(page),
        "peers_cpu_seconds_after_first_epoch": [r["cache+peers"].later_cpu for r in runs],
        "cache_cpu_seconds_after_first_epoch": [r["cache"].later_cpu for r in runs],
    }


def run(args: argparse.Namespace) -> int:
    harness.require_root("bench cluster", harness.TRAINING_NEEDS)
    check_netns()
    if not 1 <= args.nodes <= 16:
        raise UserError(f"bad --nodes {args.nodes}: 1 to 16")
    harness.check_training_arguments(args)
    if not 0 < args.cache <= 1:
        raise UserError("--cache is a fraction of the dataset in (0, 1]")
    link = None if args.link == "none" else args.link
    if link is not None:
        rate_bits(link)
    throttle = harness.parse_throttle(args.throttle)
    work = harness.work_dir(args.work, cgroups=CGROUP_PREFIX)
    remove_stale_network()
    dataset = harness.load_dataset(args)
    roots = node_copies(dataset, work, args.nodes)
    # the cache charges each file in whole pages (2% more than its bytes for 110 KB files): two
    # caches of half the dataset's bytes could not hold it all, and a share of every epoch
    # after the first came from storage however the peers did
    cache = int(sum(pages(size) for _rel, size in dataset.files) * args.cache)
    plan = Plan(args.nodes, JobPlan(1, args.epochs, args.readers, args.batch,
                                    args.compute_ms / 1000, args.seed, throttle), link, cache,
                args.order_handed_over or args.client, args.client)
    print(f"{harness.describe_dataset(dataset)}; {args.nodes} nodes, each caching "
          f"{format_size(cache)}; link {link or 'unshaped'}; throttle "
          f"{harness.describe_throttle(throttle)} per node"
          f"{'; the order handed over' if plan.order_handed_over else ''}"
          f"{'; coordlfs read through coordlfs.client' if plan.client else ''}", flush=True)
    runs = [{s: run_system(s, plan, dataset, roots, work) for s in SYSTEMS}
            for _number in harness.repeated(args.repeat)]
    summary = summarize(runs)
    loopback = throughput(work) if args.throughput else None
    harness.print_summary(summary)
    harness.write_report(args.json, {
        "dataset": harness.dataset_record(dataset),
        "settings": harness.plain_settings(args),
        "cache_bytes_per_node": cache,
        "runs": [{s: asdict(r) for s, r in run_.items()} for run_ in runs],
        "summary": summary,
        "loopback_throughput": loopback,
    })
    return 0
