"""Memory overhead of a mount: daemon bytes per known inode and per cached file.

MinIO promises memory within the capacity plus a bounded overhead; this measures the bound.
The daemon's anonymous resident set (RssAnon) is read after mounting, after every file was
looked up (inodes) and after every file was read (cache entries). Cached bytes themselves live
in the tmpfs arena; what it allocates beyond them is reported too.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from coordlfs.bench import harness
from coordlfs.cache import ARENA
from coordlfs.errors import UserError
from coordlfs.testbed.mounts import mounted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, default=20_000, help="files to create (default 20000)")
    parser.add_argument("--size", type=int, default=4096, help="bytes per file (default 4096)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def _rss(pid: int) -> int:
    """Anonymous resident bytes: the daemon's own heap, not the tmpfs pages it maps."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise UserError(f"no RssAnon for pid {pid}")


def measure(files: int, size: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        src, mnt = Path(tmp, "src"), Path(tmp, "mnt")
        mnt.mkdir()
        for i in range(files):
            path = src / f"d{i % 100}" / f"f{i}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(size))
        cache_dir = Path("/dev/shm", f"coordlfs-overhead-{os.getpid()}")
        with mounted(src, mnt, Path(tmp, "log"), "--cache-size", str(2 * files * size),
                     cache_dir=cache_dir) as mount:
            pid = mount.pid
            names = [mnt / p.relative_to(src) for p in src.rglob("f*")]
            start = _rss(pid)
            for name in names:
                os.stat(name)
            looked_up = _rss(pid)
            for name in names:
                with open(name, "rb") as f:
                    f.read()
            cached = _rss(pid)
            status = mount.status()
            arena = os.stat(cache_dir / ARENA).st_blocks * 512
    return {
        "files": files,
        "file_bytes": size,
        "inodes": status["inodes"],
        "cached_files": status["cache"]["files"],
        "rss_start_bytes": start,
        "bytes_per_inode": (looked_up - start) / files,
        "bytes_per_cached_file": (cached - looked_up) / files,
        "arena_bytes_per_file_beyond_data": (arena - status["cache"]["used_bytes"]) / files,
    }


def run(args: argparse.Namespace) -> int:
    if args.files <= 0 or args.size <= 0:
        raise UserError("--files and --size must be positive")
    result = measure(args.files, args.size)
    print(f"daemon heap at start     {result['rss_start_bytes'] / 2**20:.1f} MiB")
    print(f"per inode looked up      {result['bytes_per_inode']:.0f} bytes")
    print(f"per cached file          {result['bytes_per_cached_file']:.0f} bytes "
          f"(daemon heap; the data is in tmpfs)")
    print(f"tmpfs beyond the data    {result['arena_bytes_per_file_beyond_data']:.1f} bytes "
          f"per cached file of {args.size} bytes (the arena packs them)")
    harness.write_report(args.json, result)
    return 0
