"""A peer's file on the asking node: landed whole in a file of its own, its checksum checked
first, and read by the kernel (FUSE passthrough), never by the daemon; a peer that dies in the
middle of a file leaves the reader the file from local storage, never a torn one; a file
changed in the source while an open holds its peer's copy. Real mounts on loopback, real peer
processes, every byte checked by its digest."""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import time
from pathlib import Path

import xxhash
from conftest import Mount, wait_for
from test_peers import cluster, copies, free_port, node, read_files, reads, source_digests

from coordlfs.peers.placement import owner

MiB = 1 << 20

#: a peer's file lands only for passthrough: asked for, whatever the suite's default
LANDING = ("--insecure", "--passthrough", "yes", "--cache-size", "64M")


def theirs(names: list[str], ports: list[int]) -> list[str]:
    """The names the second node (``ports[1]``) caches."""
    pair = (node(ports[0]), node(ports[1]))
    return [n for n in names if owner(n.encode(), pair) == pair[1]]


def landed(m: Mount) -> dict[str, int]:
    return m.status()["peers"]["landed"]


def no_landed_file_open(m: Mount) -> None:
    """Every landed file was closed (the kernel sends the release after the reader's close)."""
    wait_for(lambda: landed(m)["open_files"] == 0 and landed(m)["open_bytes"] == 0,
             "landed files closed")


def test_peer_files_are_read_by_the_kernel_byte_exact(mount, tmp_path: Path) -> None:
    roots, sizes = copies(tmp_path, 2)
    ports = [free_port(), free_port()]
    a, _b = cluster(mount, roots, *LANDING, ports=ports)
    assert a.status()["passthrough"]["on"]
    want = source_digests(roots[0], sizes)
    mine = theirs(sorted(sizes), ports)
    assert read_files(a.mountpoint, mine) == {n: want[n] for n in mine}
    counters = reads(a)
    assert counters["file_peer_hits"] == len(mine)
    assert counters["bytes_from_peers"] == sum(sizes[n] for n in mine)
    assert counters["read_misses"] == 0  # no READ reached A's daemon: the kernel read them
    assert landed(a)["files"] == len(mine) and landed(a)["failed"] == 0
    no_landed_file_open(a)
    # a mapping, and a second open of the same file beside it (the same backing)
    first = a.mountpoint / mine[1]
    with open(first, "rb") as one, open(first, "rb") as two, \
            mmap.mmap(one.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        assert xxhash.xxh64_hexdigest(mapped) == want[mine[1]]
        assert xxhash.xxh64_hexdigest(two.read()) == want[mine[1]]
    no_landed_file_open(a)
    assert reads(a)["read_misses"] == 0


def test_a_peer_killed_in_the_middle_of_a_large_file(mount, tmp_path: Path) -> None:
    """B serves the first MiBs of a large file (fetched ahead of the reader), then dies: the
    reader gets the rest from A's storage, every byte right."""
    ports = [free_port(), free_port()]
    name = next(f"big{i}.bin" for i in range(100)
                if owner(f"big{i}.bin".encode(), (node(ports[0]), node(ports[1])))
                == node(ports[1]))
    roots = [tmp_path / "src0", tmp_path / "src1"]
    roots[0].mkdir()
    data = os.urandom(48 * MiB)
    (roots[0] / name).write_bytes(data)
    shutil.copytree(roots[0], roots[1], copy_function=shutil.copy2)
    a, b = cluster(mount, roots, "--insecure", "--peer-timeout", "1", "--cache-size", "128M",
                   "--max-file-size", "64M", ports=ports)
    assert (b.mountpoint / name).read_bytes() == data  # B caches it
    got = bytearray()
    with open(a.mountpoint / name, "rb", buffering=0) as f:
        while len(got) < 6 * MiB:
            got += f.read(MiB)
        os.kill(b.pid, signal.SIGKILL)
        started = time.monotonic()
        while chunk := f.read(MiB):
            got += chunk
    assert time.monotonic() - started < 20
    assert xxhash.xxh64_hexdigest(got) == xxhash.xxh64_hexdigest(data)
    counters = reads(a)
    assert counters["bytes_from_peers"] >= 6 * MiB
    assert 0 < counters["bytes_from_source"] <= len(data) - 6 * MiB


def test_a_peer_file_changed_in_the_source_while_held(mount, tmp_path: Path) -> None:
    """An open of a peer's file reads the version it opened to its end, whatever the source
    does meanwhile; a new open reads the new version (from the peer, which has it too)."""
    roots, sizes = copies(tmp_path, 2)
    ports = [free_port(), free_port()]
    a, _b = cluster(mount, roots, *LANDING, ports=ports)
    name = theirs(sorted(sizes), ports)[0]
    old = (roots[0] / name).read_bytes()
    new = os.urandom(len(old) + 4096)
    with open(a.mountpoint / name, "rb", buffering=0) as held:
        head = held.read(len(old) // 2)
        assert landed(a)["open_files"] == 1  # read by the kernel from the landed file
        time.sleep(0.01)  # another mtime
        (roots[0] / name).write_bytes(new)  # every node's copy changes
        shutil.copy2(roots[0] / name, roots[1] / name)
        assert head + held.read() == old
        assert os.fstat(held.fileno()).st_size == len(old)
        before = reads(a)["bytes_from_peers"]
        assert (a.mountpoint / name).read_bytes() == new
        assert reads(a)["bytes_from_peers"] == before + len(new)
    no_landed_file_open(a)
    assert (a.mountpoint / name).read_bytes() == new
