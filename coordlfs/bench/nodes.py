"""Many nodes: N real mounts peering on loopback, each reading the whole dataset twice.

Each node is a coordlfs daemon: ``coordlfs mount`` of one shared source directory on a
mountpoint of its own, ``--listen 127.0.0.1:PORT --insecure --peers`` naming all N, with a
cache of ``--cache-share`` times its share of the dataset. Every node reads the whole
dataset in each epoch, in an order of its own; the nodes' batches are interleaved over
``--readers`` reader processes, so the nodes read side by side while taking turns for the
few cores. A reader drops each file's pages from the node's page cache after reading it
(``POSIX_FADV_DONTNEED``), so that the next epoch reaches the daemon, as it does on a node
whose memory does not hold the dataset twice.

Measured at each of ``--nodes``: bytes read from storage per epoch by the daemons and the
readers together (the count of a blkio cgroup holding them all, ``Cgroup.bytes_read``: with
passthrough a reader's kernel reads an owner's miss from the source file itself, and one
reader reads for every node), the source's pages dropped before the first epoch so that no
page cache hides a read; bytes served by peers and by the caches, and after each epoch, per
node, its
established TCP connections (its sockets in ``/proc/PID/fd`` looked up in ``/proc/net/tcp``:
inbound on its listen port, outbound to peers) and its resident memory.

``--simulated`` (say 64,256) measures one real node among N: the other N-1 are simulated in
one process (``coordlfs.bench.simnodes``), each serving the real node's misses and asking it
for its own files as fast as the real node reads, so the real node asks N-1 peers and is
asked by N-1. Its peer sockets each way are sampled all along (``SAMPLE_S``), once with the
default ``--peer-connections`` and once unbounded (``UNBOUNDED``: one connection per node
each way, as before the bound), side by side, with the connections it opened and closed for
room, the connections turned away and its peers' failures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coordlfs.bench import harness
from coordlfs.bench.children import worker_pool
from coordlfs.bench.hits import evict
from coordlfs.bench.placement import parse_counts
from coordlfs.errors import UserError
from coordlfs.peers.budget import DEFAULT_LIMIT as DEFAULT_PEER_CONNECTIONS
from coordlfs.peers.placement import MAX_PEERS
from coordlfs.protocol.order import epoch_order
from coordlfs.sizes import format_size
from coordlfs.testbed.cgroup import Cgroup, controller_root, storage_cgroup
from coordlfs.testbed.dataset import Dataset
from coordlfs.testbed.mounts import Mount, mounted, unmount_if_mounted

#: Storage gives whole blocks (a page, an O_DIRECT read): the least it can give a file.
BLOCK = 4096
CGROUP_PREFIX = "coordlfs-nodes"
ESTABLISHED = "01"
#: ``--peer-connections`` of the unbounded simulated run: more than a node of the largest
#: cluster can ask or be asked by (2 x MAX_PEERS), which is how nodes kept them before.
UNBOUNDED = 2 * MAX_PEERS
#: Seconds between two samples of the real node's sockets in a simulated run.
SAMPLE_S = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_dataset_arguments(parser, "nodes", make="1280:16K")
    parser.add_argument("--nodes", default="8,16,32,64",
                        help="node counts, comma-separated (default 8,16,32,64; none: only "
                             "--simulated)")
    parser.add_argument("--simulated", metavar="COUNTS",
                        help="node counts of one real mount among simulated nodes, "
                             "comma-separated (say 64,256): its peer connections")
    parser.add_argument("--limits", default=f"{UNBOUNDED},{DEFAULT_PEER_CONNECTIONS}",
                        help="the real mount's --peer-connections in the simulated runs, "
                             f"comma-separated (default {UNBOUNDED},{DEFAULT_PEER_CONNECTIONS}"
                             f": unbounded as before the bound, then the default)")
    parser.add_argument("--cache-share", type=float, default=4.0,
                        help="each node's cache in shares of the dataset (1/N each), at most "
                             "the dataset (default 4)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--readers", type=int, default=4,
                        help="reader processes, shared by all nodes (default 4)")
    parser.add_argument("--batch", type=int, default=16,
                        help="files a reader reads of one node before the next (default 16)")
    parser.add_argument("--peer-timeout", metavar="SECONDS",
                        help="the mounts' --peer-timeout (default: the mount's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


@dataclass(slots=True)
class NodeSample:
    """One node after an epoch: what its daemon fetched and served, its sockets and memory."""

    #: what the node read from source files for itself or a peer, by its daemon's count (data,
    #: where storage bytes also count the metadata a dropped page cache makes it read again)
    source_bytes: int
    peer_bytes: int
    cache_bytes: int
    peer_failures: int
    inbound: int
    outbound: int
    rss_bytes: int
    rss_anon_bytes: int


@dataclass(slots=True)
class Run:
    nodes: int
    cache_bytes: int
    mount_seconds: float
    #: times anyone dropped the page cache during the run (other processes: the storage
    #: bytes then include metadata read again)
    cache_drops: int
    #: per epoch: its seconds and each node's sample (counters since the epoch began)
    epoch_seconds: list[float]
    epochs: list[list[NodeSample]]
    #: per epoch: bytes the daemons and the readers read from storage, all nodes together
    storage_bytes: list[int]
    unmount_seconds: float = 0.0

    def storage(self, epoch: int) -> int:
        return self.storage_bytes[epoch]

    def source_bytes(self, epoch: int) -> int:
        return sum(n.source_bytes for n in self.epochs[epoch])

    def row(self, dataset: Dataset) -> dict[str, Any]:
        total, last = dataset.total_bytes, self.epochs[-1]
        connections = [n.inbound + n.outbound for n in last]
        later = range(1, len(self.epochs))
        return {
            "nodes": self.nodes,
            "source_bytes_epoch1_vs_dataset": round(self.source_bytes(0) / total, 4),
            "source_bytes_after_epoch1": sum(self.source_bytes(e) for e in later),
            "storage_epoch1_vs_dataset": round(self.storage(0) / total, 4),
            "storage_epoch1_vs_blocks": round(self.storage(0) / blocks(dataset), 4),
            "storage_bytes_after_epoch1": sum(self.storage(e) for e in later),
            "cache_drops": self.cache_drops,
            "peer_bytes_last_epoch_vs_dataset": round(sum(n.peer_bytes for n in last) / total,
                                                      3),
            "peer_failures": sum(n.peer_failures for n in last),
            "connections_per_node_max": max(connections),
            "connections_per_node_median": statistics.median(connections),
            "inbound_per_node_max": max(n.inbound for n in last),
            "outbound_per_node_max": max(n.outbound for n in last),
            "rss_mib_per_node_median": round(statistics.median(n.rss_bytes for n in last)
                                             / 2 ** 20, 1),
            "rss_mib_per_node_max": round(max(n.rss_bytes for n in last) / 2 ** 20, 1),
            "rss_anon_mib_per_node_median": round(
                statistics.median(n.rss_anon_bytes for n in last) / 2 ** 20, 1),
            "mount_seconds": self.mount_seconds,
            "epoch_seconds": self.epoch_seconds,
            "unmount_seconds": self.unmount_seconds,
        }


def blocks(dataset: Dataset) -> int:
    """The dataset's bytes in whole blocks: what O_DIRECT reads of each file at least."""
    return sum(math.ceil(size / BLOCK) * BLOCK for _rel, size in dataset.files)


def read_batch(paths: list[str]) -> int:
    """A reader's turn: read each file to its end, then drop its pages from the page cache."""
    got = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while chunk := os.read(fd, 1 << 20):
                got += len(chunk)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return got


def free_ports(count: int) -> list[int]:
    """``count`` loopback ports nobody listens on now, all held open until all are found."""
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]


def tcp_states() -> dict[str, tuple[int, str]]:
    """Every TCP socket of this network namespace: its inode -> (local port, state)."""
    states = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                states[fields[9]] = (int(fields[1].rsplit(":", 1)[1], 16), fields[3])
    return states


def connections(pid: int, port: int, states: dict[str, tuple[int, str]]) -> tuple[int, int]:
    """Established TCP connections of process ``pid``: (inbound on ``port``, outbound)."""
    inbound = outbound = 0
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):
            target = os.readlink(f"{fds}/{fd}")
            if target.startswith("socket:["):
                local, state = states.get(target[8:-1], (0, ""))
                if state == ESTABLISHED:
                    inbound += local == port
                    outbound += local != port
    return inbound, outbound


def memory(pid: int) -> tuple[int, int]:
    """VmRSS and RssAnon of ``pid`` in bytes."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                found[key] = int(value.split()[0]) * 1024
    return found["VmRSS"], found["RssAnon"]


def counters(mount: Mount) -> tuple[int, ...]:
    """From the daemon's status: bytes from the source, from peers and from its cache, and
    the failures of its links."""
    status = mount.status()
    reads = status["reads"]
    failures = sum(link["failures"] for link in status["peers"]["links"].values())
    return (reads["bytes_from_source"], reads["bytes_from_peers"],
            reads["bytes_from_cache"], failures)


def sample(mounts: list[Mount], ports: list[int],
           before: list[tuple[int, ...]]) -> list[NodeSample]:
    states = tcp_states()
    samples = []
    for mount, port, then in zip(mounts, ports, before, strict=True):
        now = counters(mount)
        gained = [a - b for a, b in zip(now, then, strict=True)]
        samples.append(NodeSample(*gained, *connections(mount.pid, port, states),
                                  *memory(mount.pid)))
    return samples


def batches(dataset: Dataset, mounts: list[Mount], epoch: int, seed: int,
            batch: int) -> list[list[str]]:
    """Each node's epoch in its own order, cut in batches, the nodes' batches in turn."""
    rels = [rel for rel, _size in dataset.files]
    per_node = []
    for i, mount in enumerate(mounts):
        order = [str(mount.mountpoint / rels[k])
                 for k in epoch_order(seed + i, epoch, len(rels))]
        per_node.append([order[s:s + batch] for s in range(0, len(order), batch)])
    return [node[j] for j in range(len(per_node[0])) for node in per_node]


def run_nodes(count: int, dataset: Dataset, work: Path, args: argparse.Namespace,
              cgroup: Cgroup) -> Run:
    """``count`` nodes' epochs, their daemons and readers in ``cgroup``, which counts
    storage."""
    share = dataset.total_bytes * args.cache_share / count
    largest = max(size for _rel, size in dataset.files)
    cache = int(min(dataset.total_bytes, share + largest))
    ports = free_ports(count)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    timeout = ["--peer-timeout", args.peer_timeout] if args.peer_timeout else []
    started, drops = time.monotonic(), harness.drop_count()
    with contextlib.ExitStack() as stack:
        mounts = [stack.enter_context(mounted(
            dataset.root, work / f"mnt{i}", work / f"node{i}.log", "--cache-size", str(cache),
            "--listen", f"127.0.0.1:{port}", "--peers", peers, "--insecure", *timeout))
            for i, port in enumerate(ports)]
        for mount in mounts:
            cgroup.add(mount.pid)
        result = Run(count, cache, round(time.monotonic() - started, 1), 0, [], [], [])
        print(f"{count} nodes mounted in {result.mount_seconds} s, each caching "
              f"{format_size(cache)}", flush=True)
        os.sync()  # written back, so that their pages can be dropped
        evict(dataset.paths())
        with worker_pool(args.readers, cgroup) as pool:
            for epoch in range(args.epochs):
                before, stored = [counters(m) for m in mounts], cgroup.bytes_read()
                began = time.monotonic()
                for _ in pool.imap_unordered(read_batch, batches(dataset, mounts, epoch,
                                                                 args.seed, args.batch)):
                    pass
                result.epoch_seconds.append(round(time.monotonic() - began, 1))
                result.storage_bytes.append(cgroup.bytes_read() - stored)
                result.epochs.append(sample(mounts, ports, before))
                print_epoch(result, epoch, dataset)
        result.cache_drops = harness.drop_count() - drops
        stopping = time.monotonic()
    result.unmount_seconds = round(time.monotonic() - stopping, 1)
    return result


@dataclass(slots=True)
class SimRun:
    """One real node among ``nodes`` - 1 simulated ones, with ``--peer-connections limit``."""

    nodes: int
    limit: int
    files_read: int
    epoch_seconds: list[float]
    #: the real node's established peer sockets at each sample: (inbound, outbound)
    samples: list[tuple[int, int]]
    #: its links' connections opened, and those closed to make room for another
    links_opened: int
    links_evicted: int
    #: connections it served, closed to make room, and turned away (every one busy)
    served: int
    served_evicted: int
    turned_away: int
    #: faults that marked a peer down, at the real node and at the simulated ones
    peer_failures: int
    simulated: dict[str, int]

    def row(self) -> dict[str, Any]:
        totals = [i + o for i, o in self.samples]
        per_1000 = 1000 / max(1, self.files_read)
        return {
            "nodes": self.nodes, "peer_connections": self.limit,
            "sockets_max": max(totals), "sockets_median": statistics.median(totals),
            "inbound_max": max(i for i, _o in self.samples),
            "outbound_max": max(o for _i, o in self.samples),
            "links_opened_per_1000_files": round(self.links_opened * per_1000, 1),
            "served_opened_per_1000_files": round(self.served * per_1000, 1),
            "links_evicted": self.links_evicted, "served_evicted": self.served_evicted,
            "turned_away": self.turned_away, "peer_failures": self.peer_failures,
            "simulated_failures": self.simulated["failures"],
            "simulated_asked": self.simulated["asked"],
            "simulated_served": self.simulated["served"],
            "simulated_turned_away": self.simulated["turned_away"],
            "epoch_seconds": self.epoch_seconds,
        }


class Sampler:
    """The real node's established peer sockets, every ``SAMPLE_S``, while the block runs."""

    def __init__(self, pid: int, port: int) -> None:
        self.pid, self.port = pid, port
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        """Samples until stopped, and one as it stops: a run shorter than ``SAMPLE_S`` has
        one all the same."""
        while True:
            stopping = self._stop.wait(SAMPLE_S)
            self.samples.append(connections(self.pid, self.port, tcp_states()))
            if stopping:
                return


def run_simulated(count: int, limit: int, dataset: Dataset, work: Path,
                  args: argparse.Namespace) -> SimRun:
    """The real node reads the dataset ``--epochs`` times among ``count`` - 1 simulated
    nodes, with ``--peer-connections limit``."""
    ports = free_ports(count)
    nodes = [f"127.0.0.1:{p}" for p in ports]
    largest = max(size for _rel, size in dataset.files)
    cache = int(min(dataset.total_bytes, dataset.total_bytes * args.cache_share / count
                    + largest))
    timeout = ["--peer-timeout", args.peer_timeout] if args.peer_timeout else []
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(worker_pool(args.readers))  # forked before the pipes
        simulator = stack.enter_context(subprocess.Popen(
            [sys.executable, "-m", "coordlfs.bench.simnodes", str(dataset.root), nodes[0],
             ",".join(nodes[1:])], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        stack.callback(simulator.kill)
        assert simulator.stdin is not None and simulator.stdout is not None
        if simulator.stdout.readline() != "ready\n":
            raise UserError("the simulated nodes did not start")
        mount = stack.enter_context(mounted(
            dataset.root, work / "sim-mnt", work / f"sim-{count}-{limit}.log", "--cache-size",
            str(cache), "--listen", nodes[0], "--peers", ",".join(nodes), "--insecure",
            "--peer-connections", str(limit), *timeout))
        with Sampler(mount.pid, ports[0]) as sampler:
            seconds, done = [], 0
            for epoch in range(args.epochs):
                began = time.monotonic()
                for _ in pool.imap_unordered(read_batch, batches(dataset, [mount], epoch,
                                                                 args.seed, args.batch)):
                    done = min(done + args.batch, (epoch + 1) * len(dataset.files))
                    simulator.stdin.write(f"{done}\n")
                    simulator.stdin.flush()
                seconds.append(round(time.monotonic() - began, 1))
        simulator.stdin.write("end\n")
        simulator.stdin.flush()
        simulated = json.loads(simulator.stdout.readline())
        status = mount.status()
    links = status["peers"]["links"].values()
    served = status["served"]
    run = SimRun(count, limit, done, seconds, sampler.samples,
                 sum(link["connections"] for link in links), status["peers"]["evicted_links"],
                 served["connections"], served["evicted"], served["turned_away"],
                 sum(link["failures"] for link in links), simulated)
    row = run.row()
    print(f"  {count} nodes, --peer-connections {limit}: peer sockets {row['sockets_max']} "
          f"at most ({row['inbound_max']} in, {row['outbound_max']} out), median "
          f"{row['sockets_median']}; per 1000 files read {row['links_opened_per_1000_files']} "
          f"connections opened, {row['served_opened_per_1000_files']} served; failures "
          f"{row['peer_failures']} + {row['simulated_failures']}; epochs {seconds} s",
          flush=True)
    return run


def print_epoch(result: Run, epoch: int, dataset: Dataset) -> None:
    nodes, total = result.epochs[epoch], dataset.total_bytes
    conns = [n.inbound + n.outbound for n in nodes]
    print(f"  epoch {epoch + 1}: {result.epoch_seconds[epoch]} s; storage "
          f"{result.storage(epoch) / total:.3f} of the dataset (source bytes "
          f"{result.source_bytes(epoch) / total:.3f}), peers "
          f"{sum(n.peer_bytes for n in nodes) / total:.2f}, caches "
          f"{sum(n.cache_bytes for n in nodes) / total:.2f}; connections per node "
          f"{min(conns)}-{max(conns)}; RSS per node "
          f"{statistics.median(n.rss_bytes for n in nodes) / 2 ** 20:.0f} MiB median",
          flush=True)


def print_table(rows: list[dict[str, Any]]) -> None:
    print("nodes  epoch 1 from source: bytes, storage (x blocks)  after: source, storage bytes  "
          "conns/node (in+out)  RSS/node MiB (median, max)  mount s  epochs s")
    for r in rows:
        print(f"{r['nodes']:5}  {r['source_bytes_epoch1_vs_dataset']:25.3f}, "
              f"{r['storage_epoch1_vs_blocks']:.3f}  {r['source_bytes_after_epoch1']:14}, "
              f"{r['storage_bytes_after_epoch1']}  {r['connections_per_node_max']:8} "
              f"({r['inbound_per_node_max']}+{r['outbound_per_node_max']})  "
              f"{r['rss_mib_per_node_median']:14.1f}, {r['rss_mib_per_node_max']:.1f}  "
              f"{r['mount_seconds']:7}  {r['epoch_seconds']}", flush=True)


def parse_limits(text: str) -> tuple[int, ...]:
    try:
        limits = tuple(int(item) for item in text.split(","))
    except ValueError:
        raise UserError(f"bad --limits {text!r}: expected counts such as 512,64") from None
    if not all(1 <= n <= UNBOUNDED for n in limits):
        raise UserError(f"bad --limits {text!r}: each 1 to {UNBOUNDED}")
    return limits


def print_simulated(rows: list[dict[str, Any]]) -> None:
    print("nodes  --peer-connections  peer sockets max (in+out), median  opened per 1000 files "
          "(links, served)  closed for room (links, served)  turned away  failures")
    for r in rows:
        print(f"{r['nodes']:5}  {r['peer_connections']:18}  {r['sockets_max']:8} "
              f"({r['inbound_max']}+{r['outbound_max']}), {r['sockets_median']:g}  "
              f"{r['links_opened_per_1000_files']:21}, {r['served_opened_per_1000_files']}  "
              f"{r['links_evicted']:23}, {r['served_evicted']}  {r['turned_away']:11}  "
              f"{r['peer_failures'] + r['simulated_failures']}", flush=True)


def run(args: argparse.Namespace) -> int:
    harness.require_root("bench nodes", "mounts FUSE and counts storage with a blkio cgroup")
    harness.require_fuse()
    counts = () if args.nodes == "none" else parse_counts(args.nodes)
    simulated = parse_counts(args.simulated) if args.simulated else ()
    limits = parse_limits(args.limits)
    if not counts and not simulated:
        raise UserError("--nodes none: give --simulated COUNTS")
    if counts:
        controller_root("blkio")
    for name in ("epochs", "readers", "batch"):
        if getattr(args, name) < 1:
            raise UserError(f"bad --{name} {getattr(args, name)}: need at least 1")
    if args.cache_share <= 0:
        raise UserError(f"bad --cache-share {args.cache_share}: must be positive")
    work = harness.work_dir(args.work)
    with harness.claimed(work, "bench nodes", cgroups=CGROUP_PREFIX):
        for old in [*work.glob("mnt*"), work / "sim-mnt"]:
            unmount_if_mounted(old)
        dataset = harness.load_dataset(args)
        print(f"{harness.describe_dataset(dataset)}; nodes {', '.join(map(str, counts))}; "
              f"simulated {', '.join(map(str, simulated)) or 'none'}; {args.readers} readers",
              flush=True)
        runs = []
        for n in counts:
            with storage_cgroup(f"{CGROUP_PREFIX}-{os.getpid()}", dataset.root) as cgroup:
                runs.append(run_nodes(n, dataset, work, args, cgroup))
        sims = [run_simulated(n, limit, dataset, work, args)
                for n in simulated for limit in limits]
    rows = [r.row(dataset) for r in runs]
    sim_rows = [r.row() for r in sims]
    if rows:
        print_table(rows)
    if sim_rows:
        print_simulated(sim_rows)
    summary: dict[str, Any] = {}
    for r in rows:
        for key in ("source_bytes_epoch1_vs_dataset", "source_bytes_after_epoch1",
                    "storage_epoch1_vs_blocks", "storage_bytes_after_epoch1",
                    "connections_per_node_max", "rss_mib_per_node_median"):
            summary[f"{key}_{r['nodes']}"] = r[key]
        summary[f"seconds_{r['nodes']}"] = round(r["mount_seconds"] + sum(r["epoch_seconds"])
                                                 + r["unmount_seconds"], 1)
    for r in sim_rows:
        summary[f"simulated_sockets_max_{r['nodes']}_{r['peer_connections']}"] = \
            r["sockets_max"]
    harness.print_summary(summary)
    harness.write_report(args.json, {"dataset": harness.dataset_record(dataset),
                                     "dataset_blocks": blocks(dataset),
                                     "settings": harness.plain_settings(args),
                                     "rows": rows, "runs": [asdict(r) for r in runs],
                                     "simulated": sim_rows,
                                     "simulated_runs": [asdict(r) for r in sims],
                                     "summary": summary})
    return 0
