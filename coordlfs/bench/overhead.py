"""Memory overhead of a mount: daemon bytes per known inode and per cached file.

The cache promises memory within the capacity plus a bounded overhead; this measures the bound.
The daemon's anonymous resident set (RssAnon) is read after mounting, after every file was
looked up (inodes) and after every file was read (cache entries). Cached bytes themselves live
in a tmpfs file each; what they occupy beyond their bytes (page rounding) is reported too,
and so is what the kernel allocates per file (FUSE inodes and dentries, from
/proc/slabinfo), which the daemon cannot shrink but a user must budget for. The cache's own
files cost the kernel memory as well: a tmpfs inode and dentry per file
(``shmem_inode_cache``, ``dentry``) and its bytes rounded up to pages (``Shmem`` in
/proc/meminfo), measured over the reads that fill the cache. Both are machine-wide counts:
another process making files meanwhile shows up in them.

``--direct`` builds the daemon's tables in this process instead, with no files and no mount
(ten million entries take minutes, not the hours a mount would), measures their RssAnon
growth the same way, and times a warm restart's adoption of them from a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from coordlfs.bench import harness
from coordlfs.cache.cache import FILES, WholeFileCache, file_name
from coordlfs.cache.entries import Entry
from coordlfs.cache.stats import ReadCounters
from coordlfs.errors import UserError
from coordlfs.fs.inodes import InodeTable
from coordlfs.sizes import pages
from coordlfs.source.source import Version
from coordlfs.testbed.mounts import mounted
from coordlfs.testbed.storage import drop_caches

#: the kernel's slab caches that grow per file the kernel holds through the mount
SLABS = ("fuse_inode", "dentry")
#: the kernel's slab caches that grow per file in the cache's tmpfs
CACHE_SLABS = ("shmem_inode_cache", "dentry")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, default=20_000, help="files to create (default 20000)")
    parser.add_argument("--size", type=int, default=4096, help="bytes per file (default 4096)")
    parser.add_argument("--direct", action="store_true",
                        help="build the daemon's tables in this process (no files, no mount)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def _rss(pid: int | str) -> int:
    """Anonymous resident bytes: the daemon's own heap, not the tmpfs pages it maps."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise UserError(f"no RssAnon for pid {pid}")


def _slabs(names: tuple[str, ...] = SLABS + CACHE_SLABS) -> dict[str, int]:
    """Bytes of the kernel's per-file slab caches (objects in use times object size)."""
    found = dict.fromkeys(names, 0)
    try:
        for line in Path("/proc/slabinfo").read_text().splitlines()[2:]:
            name, active, _total, size, *_rest = line.split()
            if name in found:
                found[name] = int(active) * int(size)
    except OSError:  # not root, or no SLUB statistics: reported as 0
        pass
    return found


def _shmem() -> int:
    """Bytes of tmpfs and shared memory pages in the machine (``Shmem`` in /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise UserError("no Shmem in /proc/meminfo")


def _cache_files(cache_dir: Path) -> tuple[int, int]:
    """The cache's entry files and the bytes tmpfs allocated for them."""
    files = list((cache_dir / FILES).iterdir())
    return len(files), sum(p.stat().st_blocks * 512 for p in files)


def _path(i: int) -> bytes:
    return b"d%d/f%d" % (i % 100, i)


def measure(files: int, size: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        src, mnt = Path(tmp, "src"), Path(tmp, "mnt")
        mnt.mkdir()
        for i in range(files):
            path = src / os.fsdecode(_path(i))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(size))
        cache_dir = Path("/dev/shm", f"coordlfs-overhead-{os.getpid()}")
        with mounted(src, mnt, Path(tmp, "log"), "--cache-size", str(2 * files * size),
                     cache_dir=cache_dir) as mount:
            pid = mount.pid
            names = [mnt / p.relative_to(src) for p in src.rglob("f*")]
            start, slabs = _rss(pid), _slabs()
            for name in names:
                os.stat(name)
            looked_up, kernel = _rss(pid), _slabs()
            known = mount.status()  # before reads: the kernel may forget inodes meanwhile
            shmem = _shmem()
            for name in names:
                with open(name, "rb") as f:
                    f.read()
            status = mount.settled()  # a file read by the kernel is copied in after its close
            cached, filled = _rss(pid), _slabs()
            shmem = _shmem() - shmem
            cache_files, allocated = _cache_files(cache_dir)
        growth = {mode: _page_cache_growth(src, mnt, Path(tmp, f"log-{mode}"), files, size, mode)
                  for mode in ("auto", "no")}
    kernel_bytes = {name: (kernel[name] - slabs[name]) / files for name in SLABS}
    cache_slabs = {name: (filled[name] - kernel[name]) / files for name in CACHE_SLABS}
    cached_bytes = status["cache"]["bytes"]
    return {
        "files": files,
        "file_bytes": size,
        "inodes": status["inodes"],
        "cached_files": status["cache"]["files"],
        "rss_start_bytes": start,
        "bytes_per_inode": (looked_up - start) / files,
        "bytes_per_cached_file": (cached - looked_up) / files,
        "bytes_per_file_together": (cached - start) / files,
        "table_bytes_per_inode": known["inode_table_bytes"] / known["inodes"],
        "table_bytes_per_cached_file": status["cache"]["table_bytes"]
        / max(1, status["cache"]["files"]),
        **{f"kernel_{name}_bytes_per_file": value for name, value in kernel_bytes.items()},
        "kernel_bytes_per_file": sum(kernel_bytes.values()),
        "tmpfs_bytes_per_file_beyond_data": (allocated - cached_bytes) / files,
        "cache_dir_files": cache_files,
        **{f"cache_kernel_{name}_bytes_per_file": v for name, v in cache_slabs.items()},
        "cache_kernel_slab_bytes_per_file": sum(cache_slabs.values()),
        "cache_kernel_shmem_bytes_per_file_beyond_data": (shmem - cached_bytes) / files,
        "cache_kernel_bytes_per_file": sum(cache_slabs.values())
        + (shmem - cached_bytes) / files,
        "page_cache_growth_per_byte_read": growth,
    }


def _page_cache() -> int:
    """Bytes of page cache outside tmpfs and shared memory (``Cached`` less ``Shmem``)."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields["Cached"] - fields["Shmem"]


def _page_cache_growth(src: Path, mnt: Path, log: Path, files: int, size: int,
                       passthrough: str) -> dict[str, object]:
    """Double caching: a mount with ``--passthrough MODE`` fills its cache with every file,
    the page cache is dropped, and every file is read through the mount again; how much the
    page cache outside tmpfs grew, per byte read (machine-wide: others' reads count too)."""
    with mounted(src, mnt, log, "--cache-size", str(2 * files * pages(size)),
                 "--passthrough", passthrough) as mount:
        names = sorted(mnt / p.relative_to(src) for p in src.rglob("f*"))
        for name in names:
            name.read_bytes()
        if mount.settled()["cache"]["files"] != files:
            raise UserError(f"--passthrough {passthrough}: not every file was cached")
        drop_caches()
        before = _page_cache()
        read = sum(len(name.read_bytes()) for name in names)
        grown = _page_cache() - before
        state = mount.status()["passthrough"]
    return {"passthrough": "on" if state["on"] else f"off: {state['why_off']}",
            "bytes_read": read, "page_cache_growth_bytes": grown, "ratio": grown / read}


def measure_direct(files: int, size: int) -> dict[str, float]:
    """The daemon's tables of ``files`` inodes and cache entries, built here, and the
    adoption of the entries from a checkpoint, as a warm restart does."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        capacity = files * pages(size)
        cache = WholeFileCache(os.path.join(tmp, "cache"), capacity, size, ReadCounters())
        start = _rss("self")
        began = time.monotonic()
        inodes = InodeTable((1, 1))
        for i in range(files):
            inode = inodes.inode_for((1, i + 2), _path(i))
            inodes.ref(inode)
            inodes[inode].version = Version(i + 2, size, i, i)
        looked_up = _rss("self")
        for i in range(files):
            cache.entries.add((1, i + 2), Entry(_path(i), size, i, i, i, filled=size,
                                                complete=True))
        cached, built = _rss("self"), time.monotonic()
        result = {
            "files": files,
            "file_bytes": size,
            "bytes_per_inode": (looked_up - start) / files,
            "bytes_per_cached_file": (cached - looked_up) / files,
            "bytes_per_file_together": (cached - start) / files,
            "table_bytes_per_inode": inodes.nbytes() / files,
            "table_bytes_per_cached_file": cache.entries.nbytes() / files,
            "build_s_per_million": (built - began) / files * 1e6,
        }
        del inodes
        for i in range(files):  # the entries' files, empty: a restart looks for their names
            os.close(os.open(file_name(i), os.O_WRONLY | os.O_CREAT, 0o600,
                             dir_fd=cache.files_fd))
        cache.close(keep=True)  # writes the checkpoint a restart reads
        written = time.monotonic()
        again = WholeFileCache(os.path.join(tmp, "cache"), capacity, size, ReadCounters())
        adopted = again.adopt()
        result.update(checkpoint_s=written - built, adopt_s=time.monotonic() - written,
                      adopted=adopted)
        again.close(keep=False)
    return result


def run(args: argparse.Namespace) -> int:
    if args.files <= 0 or args.size <= 0:
        raise UserError("--files and --size must be positive")
    result = (measure_direct if args.direct else measure)(args.files, args.size)
    where = "this process's tables" if args.direct else "daemon heap"
    print(f"per inode looked up      {result['bytes_per_inode']:.0f} bytes ({where}; "
          f"{result['table_bytes_per_inode']:.0f} in its table)")
    print(f"per cached file          {result['bytes_per_cached_file']:.0f} bytes ({where}; "
          f"{result['table_bytes_per_cached_file']:.0f} in its table; the data is in tmpfs)")
    print(f"per file, both           {result['bytes_per_file_together']:.0f} bytes")
    if args.direct:
        print(f"restart                  checkpoint written in {result['checkpoint_s']:.2f} s, "
              f"{result['adopted']} entries adopted in {result['adopt_s']:.2f} s")
        harness.write_report(args.json, result)
        return 0
    print(f"daemon heap at start     {result['rss_start_bytes'] / 2**20:.1f} MiB")
    print(f"kernel per file          {result['kernel_bytes_per_file']:.0f} bytes ("
          + ", ".join(f"{name} {result[f'kernel_{name}_bytes_per_file']:.0f}"
                      for name in SLABS) + ")")
    print(f"tmpfs beyond the data    {result['tmpfs_bytes_per_file_beyond_data']:.1f} bytes "
          f"per cached file of {args.size} bytes ({result['cache_dir_files']} files: page "
          "rounding)")
    print(f"kernel per cached file   {result['cache_kernel_bytes_per_file']:.0f} bytes ("
          + ", ".join(f"{name} {result[f'cache_kernel_{name}_bytes_per_file']:.0f}"
                      for name in CACHE_SLABS)
          + ", Shmem beyond the data "
          f"{result['cache_kernel_shmem_bytes_per_file_beyond_data']:.0f}; machine-wide counts)")
    for mode, growth in result["page_cache_growth_per_byte_read"].items():
        print(f"page cache, 2nd read     +{growth['ratio']:.1%} of the bytes read "
              f"(--passthrough {mode}: {growth['passthrough']})")
    harness.write_report(args.json, result)
    return 0
