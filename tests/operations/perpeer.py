"""CPU per file a peer serves, by side and by step, with no kernel: where a peer's file costs.

Node B is a ``PeerServer`` over a no-eviction cache of its own, run in a process of its own by this
script (``--serve``), as the daemon builds it. Node A is a mount's ``Operations`` built
in-process (``inprocess.mounted``) with B as its only peer, every file owned by B. After a pass
that fills B's cache, each measured pass reads every file once:

- ``mount``: as one reader through the kernel: lookup, open, reads to EOF (and the EOF read a
  direct_io open costs), release, forget; A's handlers' wall time per request, A's CPU per
  file (the process's, worker threads included) and B's (``/proc/PID/stat``);
- ``protocol``: ``Peers.read`` of each whole file, alone: the peer protocol's share of A's CPU;
- ``tcp``: the same bytes sent by B and received by A over plain TCP, one request line and
  one reply per file (B: ``sendall``; A: ``recv_into`` a buffer): the floor that Python,
  the system calls and loopback TCP set.

    .venv/bin/python tests/operations/perpeer.py --files 3000 --size 110K [--profile a|b]

The pyfuse3 loop's own cost per request (about 25-30 us, BRIEF) comes on top of the mount
pass's handlers, once per request. ``--profile a`` prints the cProfile of A's mount pass,
``--profile b`` that of B while it serves the measured passes.

``--mounts`` measures the whole instead: two real mounts (``coordlfs mount``, each listening
on loopback with both in ``--peers``); this process reads every file through A, after a
pass through B that fills B's cache and one through A; per pass, the CPU per file of A's
daemon, B's daemon and this reader (kernel included: a read through FUSE waits on the
daemon).

    .venv/bin/python tests/operations/perpeer.py --mounts --files 2000 --passes 4
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import trio
from inprocess import CHUNK, Mount, ctx, mounted

from coordlfs.cache.cache import WholeFileCache
from coordlfs.cache.stats import ReadCounters
from coordlfs.fs.inodes import ROOT_INODE
from coordlfs.peers.links import Peers
from coordlfs.peers.placement import Address, owner
from coordlfs.peers.server import PeerServer, listen_socket
from coordlfs.sizes import parse_size
from coordlfs.source.source import Source
from coordlfs.testbed.mounts import mounted as real_mount

TICK = os.sysconf("SC_CLK_TCK")


class Steps(trio.abc.Instrument):
    """Passes through trio's scheduler: task steps, and waits for I/O (each an epoll_wait),
    counted; the CPU a peer file costs follows them closely and they are not noisy."""

    def __init__(self) -> None:
        self.steps = self.waits = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1

    def before_io_wait(self, timeout: float) -> None:
        self.waits += 1


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


# -- node B ------------------------------------------------------------------------------------

def serve(port: int, source: str, cache_dir: str, profile: bool, tcp_port: int) -> None:
    """B: a peer server on ``port`` and a plain TCP file server on ``tcp_port``, until stdin
    closes; ``profile`` line on stdin starts the profiler (printed at the end)."""
    src = Source(source)
    cache = WholeFileCache(cache_dir, 64 << 30, 64 << 30, ReadCounters())
    server = PeerServer(listen_socket(Address("127.0.0.1", port)), b"", 5.0, src, cache)
    profiler = cProfile.Profile(time.thread_time) if profile else None
    steps = Steps()

    async def commands() -> None:
        """``profile``: start the profiler; ``mark``: print the scheduler counts so far."""
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buffered = b""
        while chunk := await stdin.receive_some():
            buffered += chunk
            while b"\n" in buffered:
                line, _, buffered = buffered.partition(b"\n")
                if line == b"profile" and profiler is not None:
                    profiler.enable()
                elif line == b"mark":
                    print(steps.steps, steps.waits, flush=True)

    async def main() -> None:
        trio.lowlevel.add_instrument(steps)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            nursery.start_soon(tcp_files, tcp_port, source)
            print("ready", flush=True)
            await commands()
            nursery.cancel_scope.cancel()

    trio.run(main)
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    cache.close(keep=False)


async def tcp_files(port: int, source: str) -> None:
    """One line per file asked (its path), answered with its bytes, with the fewest passes
    through trio (non-blocking system calls, a wait only when one would block): the floor
    that Python, trio and loopback TCP set under the peer protocol."""
    listener = (await trio.open_tcp_listeners(port, host="127.0.0.1"))[0]
    root = Path(source)

    async def one(stream: trio.SocketStream) -> None:
        sock = stream.socket
        cache: dict[bytes, bytes] = {}
        buffered = b""
        while True:
            try:
                chunk = os.read(sock.fileno(), 4096)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            if not chunk:
                return
            buffered += chunk
            while b"\n" in buffered:
                line, _, buffered = buffered.partition(b"\n")
                if line not in cache:
                    cache[line] = (root / os.fsdecode(line)).read_bytes()
                await write_all(sock, cache[line])

    await trio.serve_listeners(one, [listener])


async def write_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(sock.fileno(), view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


# -- node A ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Side:
    """B's process, seen from A: its CPU and scheduler passes between two marks."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self._at = self._now()

    def _now(self) -> tuple[float, int, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("mark\n")
        self.proc.stdin.flush()
        steps, waits = map(int, self.proc.stdout.readline().split())
        return cpu_of(self.proc.pid), steps, waits

    def lap(self) -> tuple[float, int, int]:
        now = self._now()
        spent = (now[0] - self._at[0], now[1] - self._at[1], now[2] - self._at[2])
        self._at = now
        return spent


async def mount_pass(mount: Mount, names: list[bytes], timings: dict[str, list[float]]) -> None:
    ops = mount.ops
    for name in names:
        t0 = time.perf_counter_ns()
        attr = await ops.lookup(ROOT_INODE, name, ctx())
        t1 = time.perf_counter_ns()
        info = await ops.open(attr.st_ino, os.O_RDONLY, ctx())
        t2 = time.perf_counter_ns()
        reads = [*range(0, attr.st_size, CHUNK)]
        if info.direct_io:  # the kernel asks once more, at EOF
            reads.append(attr.st_size)
        for off in reads:
            start = time.perf_counter_ns()
            await ops.read(info.fh, off, CHUNK)
            timings["read" if off < attr.st_size else "read EOF"].append(
                (time.perf_counter_ns() - start) / 1e3)
        t3 = time.perf_counter_ns()
        await ops.release(info.fh)
        ops.forget([(attr.st_ino, 1)])
        t4 = time.perf_counter_ns()
        timings["lookup"].append((t1 - t0) / 1e3)
        timings["open"].append((t2 - t1) / 1e3)
        timings["release+forget"].append((t4 - t3) / 1e3)
        timings["requests"].append(3 + len(reads))


async def protocol_pass(peers: Peers, source: Path, names: list[bytes]) -> None:
    link = next(iter(peers.links.values()))
    for name in names:
        st = os.lstat(source / os.fsdecode(name))
        data = await peers.read(link, name, st, 0, st.st_size)
        assert data is not None and len(data) == st.st_size


async def tcp_pass(port: int, source: Path, names: list[bytes]) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    sock = stream.socket
    buf = bytearray(1 << 20)
    with memoryview(buf) as view:
        for name in names:
            size = os.lstat(source / os.fsdecode(name)).st_size
            await write_all(sock, name + b"\n")
            got = 0
            while got < size:
                try:
                    got += os.readv(sock.fileno(), [view[got:size]])
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(sock)
    await stream.aclose()


def measure(args: argparse.Namespace, source: Path, names: list[bytes], nodes: tuple[Address, ...],
            b: Side, profile_b: Any) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {}
    with pytest.MonkeyPatch.context() as monkeypatch, \
            tempfile.TemporaryDirectory(dir="/dev/shm") as cache_dir, \
            mounted(source, Path(cache_dir) / "c", monkeypatch, cache_size=64 << 30,
                    peers=lambda c: Peers(nodes, nodes[0], b"", 5.0, c)) as mount:
        peers = mount.ops.readers.peers

        async def body() -> None:
            steps = Steps()
            trio.lowlevel.add_instrument(steps)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run)
                await trio.sleep(0)
                await protocol_pass(peers, source, names)  # B fills its cache
                await tcp_pass(args.tcp_port, source, names)
                if profile_b is not None:
                    profile_b()
                for kind in [k for _ in range(args.passes_each) for k in args.passes]:
                    timings: dict[str, list[float]] = defaultdict(list)
                    profiler = cProfile.Profile(time.thread_time) if args.profile == "a" and \
                        kind == args.profile_pass else None
                    b.lap()
                    a_steps, a_waits = steps.steps, steps.waits
                    start, cpu = time.perf_counter(), time.process_time()
                    if profiler:
                        profiler.enable()
                    if kind == "mount":
                        await mount_pass(mount, names, timings)
                    elif kind == "protocol":
                        await protocol_pass(peers, source, names)
                    else:
                        await tcp_pass(args.tcp_port, source, names)
                    if profiler:
                        profiler.disable()
                        pstats.Stats(profiler, stream=sys.stderr).sort_stats(
                            "tottime").print_stats(35)
                    n = len(names)
                    row = {name: round(statistics.median(v), 1) for name, v in timings.items()}
                    row["wall_us"] = round((time.perf_counter() - start) / n * 1e6, 1)
                    row["a_cpu_us"] = round((time.process_time() - cpu) / n * 1e6, 1)
                    b_cpu, b_steps, b_waits = b.lap()
                    row["b_cpu_us"] = round(b_cpu / n * 1e6, 1)
                    row["a_steps"] = round((steps.steps - a_steps) / n, 2)
                    row["a_waits"] = round((steps.waits - a_waits) / n, 2)
                    row["b_steps"] = round(b_steps / n, 2)
                    row["b_waits"] = round(b_waits / n, 2)
                    results.setdefault(kind, []).append(row)
                nursery.cancel_scope.cancel()

        mount.run(body)
    return results


def read_through(mountpoint: Path, names: list[bytes], buf: bytearray) -> None:
    for name in names:
        fd = os.open(mountpoint / os.fsdecode(name), os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)


def measure_mounts(args: argparse.Namespace, source: Path, names: list[bytes],
                   nodes: tuple[Address, ...]) -> list[dict[str, float]]:
    """Real mounts A and B; per measured pass: CPU per file of each daemon and the reader."""
    peers = ",".join(map(str, nodes))
    buf = bytearray(1 << 20)
    rows = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as work, contextlib.ExitStack() as stack:
        a, b = (stack.enter_context(real_mount(
            source, Path(work) / f"mnt{i}", Path(work) / f"node{i}.log", "--cache-size",
            str(len(names) * parse_size(args.size) * 2), "--listen", str(node), "--peers",
            peers, "--insecure")) for i, node in enumerate(nodes))
        read_through(b.mountpoint, names, buf)  # B caches them
        read_through(a.mountpoint, names, buf)
        for _ in range(args.passes_each):
            a_cpu, b_cpu = cpu_of(a.pid), cpu_of(b.pid)
            start, cpu = time.perf_counter(), time.process_time()
            read_through(a.mountpoint, names, buf)
            n = len(names)
            rows.append({"wall_us": round((time.perf_counter() - start) / n * 1e6, 1),
                         "a_daemon_cpu_us": round((cpu_of(a.pid) - a_cpu) / n * 1e6, 1),
                         "b_daemon_cpu_us": round((cpu_of(b.pid) - b_cpu) / n * 1e6, 1),
                         "reader_cpu_us": round((time.process_time() - cpu) / n * 1e6, 1)})
        if a.status()["reads"]["bytes_from_source"]:
            raise SystemExit("A read files from storage: not a measure of peers")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--size", default="110K")
    parser.add_argument("--dir", default="/var/tmp/coordlfs-perpeer",
                        help="the source directory, reused when it matches")
    parser.add_argument("--repeat", type=int, default=3, help="runs, each with a new node B")
    parser.add_argument("--passes", type=int, default=3, dest="passes_each",
                        help="measured passes of each kind per run, interleaved; CPU per file "
                             "is the least over all passes (another process's load only adds "
                             "to it), the rest the median")
    parser.add_argument("--profile", choices=("a", "b"))
    parser.add_argument("--profile-pass", default="mount", choices=("mount", "protocol"))
    parser.add_argument("--mounts", action="store_true",
                        help="two real mounts instead, the whole cost per file")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--serve", nargs=4, metavar=("PORT", "SOURCE", "CACHE", "TCP_PORT"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--serve-profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        port, source, cache_dir, tcp_port = args.serve
        serve(int(port), source, cache_dir, args.serve_profile, int(tcp_port))
        return 0
    args.passes = ["mount", "protocol", "tcp"]
    size = parse_size(args.size)
    source = Path(args.dir)
    source.mkdir(parents=True, exist_ok=True)
    nodes = (Address("127.0.0.1", free_port()), Address("127.0.0.1", free_port()))
    args.tcp_port = free_port()
    names = []
    for i in range(args.files * 3):
        if len(names) == args.files:
            break
        name = b"f%05d" % i
        path = source / os.fsdecode(name)
        if not path.exists() or path.stat().st_size != size:
            path.write_bytes(os.urandom(size))
        if owner(name, nodes) == nodes[1]:
            names.append(name)
    if args.mounts:
        rows = [row for _ in range(args.repeat)
                for row in measure_mounts(args, source, names, nodes)]
        summary = {name: min(row[name] for row in rows) for name in rows[0]}
        print("mounts   " + "  ".join(f"{name} {value:g}" for name, value in summary.items()))
        if args.json:
            Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
        return 0
    runs = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as b_cache:
            command = [sys.executable, __file__, "--serve", str(nodes[1].port), str(source),
                       f"{b_cache}/c", str(args.tcp_port)]
            if args.profile == "b":
                command.append("--serve-profile")
            with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True) as proc:
                assert proc.stdout is not None and proc.stdin is not None
                try:
                    assert proc.stdout.readline() == "ready\n"
                    stdin = proc.stdin

                    def profile_b(stdin: Any = stdin) -> None:
                        stdin.write("profile\n")
                        stdin.flush()

                    runs.append(measure(args, source, names, nodes, Side(proc),
                                        profile_b if args.profile == "b" else None))
                finally:
                    proc.stdin.close()
                    proc.wait(30)
    summary = {kind: {name: (min if name.endswith("_cpu_us") else statistics.median)(
                          row[name] for run in runs for row in run[kind])
                      for name in runs[0][kind][0]} for kind in runs[0]}
    for kind, row in summary.items():
        print(f"{kind:8s} " + "  ".join(f"{name} {value:g}" for name, value in row.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
