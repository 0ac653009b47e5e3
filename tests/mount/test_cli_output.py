"""What the command line says on real mounts (issue 35): no traceback when whoever reads its
output stops (it ends by SIGPIPE, as ``cat`` does), one line for a successful unmount, the
processes that hold a busy one, and counts with their nouns in the right number."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import subprocess
from pathlib import Path

from conftest import COORDLFS, force_unmount, random_source, run_cli

from coordlfs.control import Control
from coordlfs.system.processes import wait_exit


def closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """``coordlfs ARGS`` writing to a pipe nobody reads any more (``| head -1`` once head
    has its line)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([*COORDLFS, *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def _map(path: Path) -> int:
    """``path`` mapped, its descriptor closed: held by the mapping alone (Python's own
    ``mmap.mmap`` keeps a descriptor open beside its mapping)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, path.stat().st_size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    return address


def test_a_closed_pipe_ends_every_command_quietly(mount, dataset) -> None:
    source, _sizes = dataset
    m = mount(source)
    for args in (["stats", str(m.mountpoint), "--json"], ["stats", str(m.mountpoint)],
                 ["warm", str(m.mountpoint / "class0")], ["--help"], ["bench", "--help"]):
        result = closed_pipe(*args)
        assert result.returncode in (-signal.SIGPIPE, 0), (args, result.stderr)
        assert result.stderr == "", (args, result.stderr)
    assert closed_pipe("stats", str(m.mountpoint)).returncode == -signal.SIGPIPE


def test_umount_says_one_line_and_names_who_holds_a_busy_mount(mount, dataset) -> None:
    source, sizes = dataset
    m = mount(source)
    first, second = (m.mountpoint / name for name in sorted(sizes)[:2])
    opened = open(first, "rb")  # held open across the unmount
    mapped = _map(second)
    sleeper = subprocess.Popen(["sleep", "600"], cwd=first.parent)
    try:
        result = run_cli("umount", str(m.mountpoint))
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert f"{m.mountpoint} is busy: held by " in result.stderr
        me = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
        assert f"pid {os.getpid()} ({me}, an open file)" in result.stderr, result.stderr
        assert f"pid {sleeper.pid} (sleep, its working directory)" in result.stderr
        opened.close()
        result = run_cli("umount", str(m.mountpoint))
        assert f"pid {os.getpid()} ({me}, a mapped file)" in result.stderr, result.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
        _libc.munmap(mapped, second.stat().st_size)
        opened.close()
    result = run_cli("umount", str(m.mountpoint))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"coordlfs: unmounted {m.mountpoint}\n" and result.stderr == ""
    assert wait_exit(m.pid, 0)


def test_counts_take_the_number_of_their_noun(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "only").write_bytes(b"x" * 1000)
    m = mount(src)
    (m.mountpoint / "only").read_bytes()
    m.settled()
    table = run_cli("stats", str(m.mountpoint)).stdout
    assert "1 file (0 filling)" in table and "1 files" not in table, table
    warm = run_cli("warm", str(m.mountpoint)).stdout
    assert warm.startswith("warmed 0 files"), warm


def test_the_mount_says_its_max_file_size_and_logs_the_first_file_over_it_once(
        tmp_path: Path, daemon_logs: list[Path]) -> None:
    """The first line states the limit (a default said to be one); of two files over it,
    each read twice, the log says once that such files are not cached, naming the option."""
    src = random_source(tmp_path, small=10_000, big=300_000, bigger=400_000)
    mp, log = tmp_path / "mp", tmp_path / "mount.log"
    mp.mkdir()
    daemon_logs.append(log)
    result = run_cli("mount", str(src), str(mp), "--cache-size", "1M", "--max-file-size",
                     "100K", "--cache-dir", str(tmp_path / "cache"), "--log", str(log))
    try:
        assert result.returncode == 0, result.stderr
        assert ", cache 1.0 MiB in " in result.stdout
        assert "; files over 100.0 KiB are not cached (--max-file-size);" in result.stdout
        for name in ("small", "big", "bigger", "big", "bigger"):
            assert (mp / name).read_bytes() == (src / name).read_bytes()
        said = [line for line in log.read_text().splitlines() if "--max-file-size" in line]
        assert len(said) == 1 and " WARNING " in said[0], said
        assert "big (293.0 KiB) is larger than --max-file-size (100.0 KiB)" in said[0]
        assert "remount with a larger --max-file-size" in said[0]
    finally:
        force_unmount(mp, Control(mp).status()["pid"] if result.returncode == 0 else None)
    again = run_cli("mount", str(src), str(mp), "--cache-size", "1M", "--cache-dir",
                    str(tmp_path / "cache"), "--log", str(log))
    try:
        assert again.returncode == 0, again.stderr
        assert ("files over 256.0 KiB are not cached (--max-file-size, default: a quarter of "
                "the cache)") in again.stdout
    finally:
        force_unmount(mp, Control(mp).status()["pid"] if again.returncode == 0 else None)


def test_stats_json_between_marks_is_the_window_at_the_top(mount, dataset) -> None:
    """``--since`` puts the window's counters at the top level and the cumulative ones under
    "total"; ``--until`` closes a window, so an epoch between two marks reads the same later."""
    source, sizes = dataset
    names = sorted(sizes)
    m = mount(source, "--cache-size", "64M")

    def read(part: list[str]) -> None:
        for name in part:
            (m.mountpoint / name).read_bytes()
        m.settled()

    def stats(*args: str) -> dict:
        result = run_cli("stats", str(m.mountpoint), "--json", *args)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    read(names[:10])
    assert run_cli("mark", str(m.mountpoint), "e1").returncode == 0
    read(names[10:30])
    assert run_cli("mark", str(m.mountpoint), "e2").returncode == 0
    read(names[30:35])
    since = stats("--since", "e1")
    assert since["reads"]["file_misses"] == 25
    assert since["total"]["reads"]["file_misses"] == 35
    assert since["window"]["since"] == "e1" and since["window"]["until"] == "now"
    epoch = stats("--since", "e1", "--until", "e2")
    assert epoch["reads"]["file_misses"] == 20
    assert epoch["reads"]["bytes_from_source"] == sum(sizes[n] for n in names[10:30])
    assert epoch["window"]["until"] == "e2" and epoch["window"]["seconds"] > 0
    read(names[35:40])
    assert stats("--since", "e1", "--until", "e2")["reads"] == epoch["reads"]  # closed
    assert stats("--until", "e1")["reads"]["file_misses"] == 10  # from the mount on
    assert "window" not in stats() and "total" not in stats()  # no window: as before
    table = run_cli("stats", str(m.mountpoint), "--since", "e1", "--until", "e2").stdout
    assert "between  e1 .. e2" in table
    assert "files    20 opened: 0 hits (cache), 20 misses (source)" in table
    wrong = run_cli("stats", str(m.mountpoint), "--since", "e2", "--until", "e1")
    assert wrong.returncode == 1 and wrong.stderr == ("coordlfs: mark 'e1' comes before 'e2': "
                                                      "a window runs from its since to its "
                                                      "until\n")
