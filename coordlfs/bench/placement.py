"""Placement at scale: byte shares per node, files moved by a join or a leave, ranking cost.

No mount and no root: the product's own placement (``coordlfs.peers.placement``) over ``--paths``
paths laid out as ImageNet-21k's (``train/n01440764/n01440764_17.JPEG``, 21,841 class
folders) with log-normal sizes of mean 110 KB (sigma 0.6, as ``coordlfs.testbed.dataset``).
Exact, not sampled: every path is weighed against every node with the weights ``owner``
uses (``placement.layout``) and goes to the highest. A join moves a path exactly when the
new node's weight beats its owner's (rendezvous: never from one old node to another); a leave
moves exactly the leaving node's paths, since the highest weight among the others is
unchanged. The first ``--check`` paths are also placed with ``placement.owner`` for N-1, N
and N+1 nodes, which must agree. Chunks of paths go to ``--workers`` processes.

The ranking cost is per call of ``owner`` and ``ranking`` (a miss ranks once), beside the
function as it was before the per-node-set layouts: the same order, every node's seed hashed
again on every call.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from coordlfs.bench import harness
from coordlfs.bench.children import worker_pool
from coordlfs.bench.ratios import ratio
from coordlfs.errors import UserError
from coordlfs.peers.placement import MAX_PEERS, Address, layout, owner, ranking

#: ImageNet-21k's class folders, and file sizes as ``coordlfs.testbed.dataset`` makes them.
CLASSES = 21_841
MEAN_BYTES = 110_000
SIGMA = 0.6
#: Paths a worker places per task: sizes are drawn per chunk, so results do not depend on
#: how many workers there are.
CHUNK = 100_000
PORT = 7878


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--paths", type=int, default=10_000_000,
                        help="dataset paths placed (default 10000000)")
    parser.add_argument("--nodes", default="8,64,256",
                        help=f"node counts, comma-separated, 2 to {MAX_PEERS} (default 8,64,256)")
    parser.add_argument("--check", type=int, default=20_000,
                        help="paths also placed with placement.owner for N-1, N and N+1 "
                             "nodes (default 20000)")
    parser.add_argument("--timing-paths", type=int, default=2_000,
                        help="paths ranked for the cost per call (default 2000)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes placing paths (default: one per core)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the file sizes")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


def path_of(index: int) -> bytes:
    """The ``index``-th path: class folders in turn, numbered files within each."""
    wnid = f"n{1_440_764 + 613 * (index % CLASSES):08d}"
    return f"train/{wnid}/{wnid}_{index // CLASSES + 1}.JPEG".encode()


def node(index: int) -> Address:
    return Address(f"10.0.{index // 250}.{index % 250 + 1}", PORT)


def cluster(count: int) -> tuple[Address, ...]:
    return tuple(node(i) for i in range(count))


def reference_ranking(path: bytes, nodes: tuple[Address, ...]) -> list[Address]:
    """The ranking as ``placement`` computed it before: the timing baseline, and what
    ``ranking`` must still equal."""
    return sorted(nodes, reverse=True, key=lambda n: (xxhash.xxh64_intdigest(
        path, seed=xxhash.xxh64_intdigest(str(n).encode())), str(n)))


@dataclass(slots=True)
class Tally:
    """Files and bytes per node of ``cluster(nodes)`` (in ``placement.layout`` order), and
    those that ``cluster(nodes + 1)`` moves to its new node."""

    nodes: int
    files: list[int] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    join_files: int = 0
    join_bytes: int = 0

    def __post_init__(self) -> None:
        self.files = self.files or [0] * self.nodes
        self.bytes = self.bytes or [0] * self.nodes

    def add(self, other: Tally) -> None:
        self.files = [a + b for a, b in zip(self.files, other.files, strict=True)]
        self.bytes = [a + b for a, b in zip(self.bytes, other.bytes, strict=True)]
        self.join_files += other.join_files
        self.join_bytes += other.join_bytes


def place(task: tuple[int, int, tuple[int, ...], int]) -> list[Tally]:
    """Paths ``start`` to ``stop`` placed at each node count: one worker's chunk."""
    start, stop, counts, seed = task
    rng = random.Random(f"{seed}/{start}")
    mu = math.log(MEAN_BYTES) - SIGMA ** 2 / 2
    tallies = [Tally(n) for n in counts]
    ranked = []
    for n in counts:
        at, joiner = layout(cluster(n)), node(n)
        ranked.append((at, xxhash.xxh64_intdigest(str(joiner).encode()), str(joiner),
                       [str(a) for a in at.order]))
    for index in range(start, stop):
        path = path_of(index)
        size = round(rng.lognormvariate(mu, SIGMA))
        for tally, (at, join_seed, join_name, names) in zip(tallies, ranked, strict=True):
            weights = at.weights(path)
            top = max(weights)
            first = weights.index(top)
            tally.files[first] += 1
            tally.bytes[first] += size
            joined = xxhash.xxh64_intdigest(path, seed=join_seed)
            if joined > top or (joined == top and join_name > names[first]):
                tally.join_files += 1
                tally.join_bytes += size
    return tallies


def simulate(paths: int, counts: tuple[int, ...], workers: int, seed: int) -> list[Tally]:
    tasks = [(start, min(start + CHUNK, paths), counts, seed) for start in range(0, paths, CHUNK)]
    totals = [Tally(n) for n in counts]
    started = time.monotonic()
    with worker_pool(workers) as pool:
        for done, tallies in enumerate(pool.imap_unordered(place, tasks), 1):
            for total, tally in zip(totals, tallies, strict=True):
                total.add(tally)
            if done % max(1, len(tasks) // 10) == 0 or done == len(tasks):
                print(f"  placed {min(done * CHUNK, paths):,} of {paths:,} paths "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
    return totals


def leaver(tally: Tally) -> int:
    """The node (``layout`` order) whose leaving moves the most: the one holding most bytes."""
    return tally.bytes.index(max(tally.bytes))


def check(paths: int, counts: tuple[int, ...], seed: int) -> None:
    """The simulation's placement of the first ``paths`` paths is ``placement.owner``'s, and
    ``owner`` moves paths on a join only to the new node, on a leave only from the old."""
    for tally in place((0, paths, counts, seed)):
        nodes = cluster(tally.nodes)
        order = layout(nodes).order
        gone = order[leaver(tally)]
        grown, shrunk = cluster(tally.nodes + 1), tuple(n for n in nodes if n != gone)
        files = dict.fromkeys(order, 0)
        joined = 0
        for index in range(paths):
            path = path_of(index)
            first = owner(path, nodes)
            files[first] += 1
            after_join, after_leave = owner(path, grown), owner(path, shrunk)
            joined += after_join != first
            if after_join not in (first, grown[-1]) or (first != gone and after_leave != first):
                raise UserError(f"placement check failed at {tally.nodes} nodes: {path!r} "
                                f"moved between nodes that stayed")
        if list(files.values()) != tally.files or joined != tally.join_files:
            raise UserError(f"placement check failed at {tally.nodes} nodes: the simulation "
                            "and placement.owner place paths differently")


def cost_us(count: int, paths: int) -> dict[str, float]:
    """Microseconds per call of ``owner``, ``ranking`` and the old ranking: the best of
    seven passes over ``paths`` paths, the three taking turns, so that a busy machine slows
    them alike and the best pass shows the cost itself."""
    nodes = cluster(count)
    sample = [path_of(i * 7919) for i in range(paths)]
    calls = {"owner": owner, "ranking": ranking, "old_ranking": reference_ranking}
    passes: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(7):
        for name, rank in calls.items():
            started = time.perf_counter()
            for path in sample:
                rank(path, nodes)
            passes[name].append((time.perf_counter() - started) / paths * 1e6)
    return {f"{name}_us": round(min(times), 2) for name, times in passes.items()}


@dataclass(slots=True)
class Row:
    nodes: int
    paths: int
    bytes: int
    #: most a node's share of bytes (and of files) differs from 1/N, as a fraction of 1/N
    max_byte_share_deviation: float
    max_file_share_deviation: float
    #: the share a join moves (to the new node), and that share over the ideal 1/(N+1)
    join_moved_files: float
    join_moved_bytes: float
    join_files_vs_ideal: float
    join_bytes_vs_ideal: float
    #: the share a leave moves (the node holding most bytes leaves): its own share, so 1.0
    #: against the ideal; also against the average share 1/N
    leave_moved_bytes: float
    leave_moved_vs_ideal: float
    leave_moved_vs_average: float
    owner_us: float
    ranking_us: float
    old_ranking_us: float


def row(tally: Tally, costs: dict[str, float]) -> Row:
    n, files, size = tally.nodes, sum(tally.files), sum(tally.bytes)
    gone = tally.bytes[leaver(tally)] / size
    return Row(n, files, size,
               round(max(abs(b * n / size - 1) for b in tally.bytes), 4),
               round(max(abs(f * n / files - 1) for f in tally.files), 4),
               round(tally.join_files / files, 6), round(tally.join_bytes / size, 6),
               round(tally.join_files / files * (n + 1), 4),
               round(tally.join_bytes / size * (n + 1), 4),
               round(gone, 6), 1.0, round(gone * n, 4), **costs)


def parse_counts(text: str) -> tuple[int, ...]:
    """``--nodes``: counts of nodes, each 2 (one may leave) to the most ``--peers`` takes."""
    try:
        counts = tuple(int(item) for item in text.split(","))
    except ValueError:
        raise UserError(f"bad --nodes {text!r}: expected counts such as 8,64,256") from None
    if not all(2 <= n <= MAX_PEERS for n in counts):
        raise UserError(f"bad --nodes {text!r}: each count 2 to {MAX_PEERS}")
    return counts


def print_table(rows: list[Row]) -> None:
    print("nodes  byte share dev  file share dev  join moved/ideal  leave moved/ideal "
          "(x 1/N)  owner us  ranking us  before us  speedup")
    for r in rows:
        print(f"{r.nodes:5}  {r.max_byte_share_deviation:14.2%}  "
              f"{r.max_file_share_deviation:14.2%}  {r.join_bytes_vs_ideal:16.3f}  "
              f"{r.leave_moved_vs_ideal:11.3f} ({r.leave_moved_vs_average:.3f})  "
              f"{r.owner_us:8.1f}  {r.ranking_us:10.1f}  {r.old_ranking_us:9.1f}  "
              f"{ratio(r.old_ranking_us, r.ranking_us)}x", flush=True)


def run(args: argparse.Namespace) -> int:
    counts = parse_counts(args.nodes)
    for name in ("paths", "workers", "timing_paths"):
        if getattr(args, name) < 1:
            raise UserError(f"bad --{name.replace('_', '-')} {getattr(args, name)}: need at "
                            "least 1")
    if args.check < 0:
        raise UserError(f"bad --check {args.check}: must not be negative")
    print(f"placing {args.paths:,} paths at {', '.join(map(str, counts))} nodes with "
          f"{args.workers} workers", flush=True)
    started = time.monotonic()
    tallies = simulate(args.paths, counts, args.workers, args.seed)
    seconds = time.monotonic() - started
    check(min(args.check, args.paths), counts, args.seed)
    rows = [row(t, cost_us(t.nodes, args.timing_paths)) for t in tallies]
    print_table(rows)
    summary: dict[str, Any] = {"simulation_seconds": round(seconds, 1)}
    for r in rows:
        for key in ("max_byte_share_deviation", "join_bytes_vs_ideal", "join_files_vs_ideal",
                    "leave_moved_vs_ideal", "ranking_us", "owner_us", "old_ranking_us"):
            summary[f"{key}_{r.nodes}"] = getattr(r, key)
        summary[f"ranking_speedup_{r.nodes}"] = ratio(r.old_ranking_us, r.ranking_us)
    harness.print_summary(summary)
    harness.write_report(args.json, {"settings": harness.plain_settings(args),
                                     "rows": [asdict(r) for r in rows], "summary": summary})
    return 0
