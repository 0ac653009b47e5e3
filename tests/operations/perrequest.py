"""Microseconds per FUSE request, per handler, on the miss and hit paths, with no kernel.

Builds a mount's ``Operations`` in-process (``inprocess.mounted``) over a directory of small
files and calls the handlers as the kernel calls them for one reader's open + read to EOF +
close of each file: lookup, open, read, release, forget; a first pass misses (a cache fill
runs, its worker thread included in the read's time), a second one hits, a third (with
``--stream``, a mount with no cache room) streams from the source. Each handler's time is
the median over files of its wall time per request; ``file`` is the wall time and ``cpu``
the process's CPU time (worker threads included) per file of the pass.

    .venv/bin/python tests/operations/perrequest.py --files 2000 --size 112K [--profile]

The source must be on a disk (O_DIRECT fills, as in a real mount); the default is a
directory under /var/tmp. ``--profile`` prints the cProfile of the miss pass.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from inprocess import CHUNK, Mount, ctx, mounted

from coordlfs.fs.inodes import ROOT_INODE
from coordlfs.sizes import parse_size

Timings = dict[str, list[float]]


async def timed(timings: Timings, name: str, call: Callable[[], Awaitable[Any]]) -> Any:
    start = time.perf_counter_ns()
    result = await call()
    timings[name].append((time.perf_counter_ns() - start) / 1e3)
    return result


async def one_pass(mount: Mount, names: list[bytes], timings: Timings, kind: str) -> None:
    """Each file as one reader reads it through the kernel: lookup, open, reads, release,
    forget (the kernel forgets when its dentry goes; here at once, so every lookup is new)."""
    ops = mount.ops
    for name in names:
        attr = await timed(timings, "lookup", lambda n=name: ops.lookup(ROOT_INODE, n, ctx()))
        inode = attr.st_ino
        await timed(timings, "getattr", lambda i=inode: ops.getattr(i, ctx()))
        info = await timed(timings, "open", lambda i=inode: ops.open(i, os.O_RDONLY, ctx()))
        for off in range(0, attr.st_size, CHUNK):  # the kernel asks nothing past the end
            await timed(timings, f"read {kind}", lambda o=off, f=info.fh: ops.read(f, o, CHUNK))
        await timed(timings, "release", lambda f=info.fh: ops.release(f))
        start = time.perf_counter_ns()
        ops.forget([(inode, 1)])
        timings["forget"].append((time.perf_counter_ns() - start) / 1e3)


def measure(source: Path, cache_dir: Path, names: list[bytes], passes: list[str],
            cache_size: int, profile: bool) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    with pytest.MonkeyPatch.context() as monkeypatch, \
            mounted(source, cache_dir, monkeypatch, cache_size=cache_size) as mount:
        for kind in passes:
            timings: Timings = defaultdict(list)
            profiler = cProfile.Profile() if profile and kind == "miss" else None

            async def body(kind: str = kind, timings: Timings = timings,
                           profiler: cProfile.Profile | None = profiler) -> None:
                if profiler:
                    profiler.enable()
                start, cpu = time.perf_counter(), time.process_time()
                await one_pass(mount, names, timings, kind)
                timings["file"].append((time.perf_counter() - start) / len(names) * 1e6)
                timings["cpu"].append((time.process_time() - cpu) / len(names) * 1e6)
                if profiler:
                    profiler.disable()

            mount.run(body)
            if profiler:
                pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
                pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
            results[kind] = {name: round(statistics.median(values), 2)
                             for name, values in timings.items()}
            results[kind]["files_per_s"] = round(1e6 / results[kind]["file"])
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", default="112K")
    parser.add_argument("--dir", default="/var/tmp/coordlfs-perrequest",
                        help="the source directory, on a disk; reused when it matches")
    parser.add_argument("--repeat", type=int, default=3, help="mounts, each with fresh passes")
    parser.add_argument("--stream", action="store_true", help="also a mount with no cache")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    size = parse_size(args.size)
    source = Path(args.dir)
    source.mkdir(parents=True, exist_ok=True)
    names = [b"f%05d" % i for i in range(args.files)]
    for name in names:
        path = source / os.fsdecode(name)
        if not path.exists() or path.stat().st_size != size:
            path.write_bytes(os.urandom(size))
    runs = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as cache_dir:
            runs.append(measure(source, Path(cache_dir) / "c", names, ["miss", "hit"],
                                64 << 30, args.profile))
        if args.stream:
            with tempfile.TemporaryDirectory(dir="/dev/shm") as cache_dir:
                runs[-1].update(measure(source, Path(cache_dir) / "c", names, ["stream"], 0,
                                        False))
    summary = {kind: {name: statistics.median(run[kind][name] for run in runs)
                      for name in runs[0][kind]} for kind in runs[0]}
    for kind, row in summary.items():
        print(f"{kind:7s} " + "  ".join(f"{name} {value:g}" for name, value in row.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
