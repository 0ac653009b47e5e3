"""The pieces of ``scripts/demo``: datasets, read counters, cgroups, and one tiny real run."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import force_unmount

from coordlfs.bench import demo
from coordlfs.bench.counters import measure_reads
from coordlfs.errors import UserError
from coordlfs.system.mounts import mount_at
from coordlfs.testbed import cgroup as cgroup_mod
from coordlfs.testbed import storage
from coordlfs.testbed.cgroup import Cgroup, cgroup_of, memory_cgroup, remove_stale, storage_cgroup
from coordlfs.testbed.dataset import MANIFEST, DatasetSpec, ensure_dataset, file_contents
from coordlfs.testbed.storage import block_device, parse_stat

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root")


def _on_block_device(path: Path) -> bool:
    try:
        block_device(path)
    except UserError:
        return False
    return True


def _has_cgroup_v1(controller: str) -> bool:
    return (Path("/sys/fs/cgroup") / controller / "cgroup.procs").is_file()


# -- dataset ----------------------------------------------------------------------------------

def test_verdict_says_where_each_side_wins() -> None:
    def epochs(*pairs: tuple[float, int]) -> list[dict]:
        return [{"epoch": i, "seconds": s, "storage_bytes": b}
                for i, (s, b) in enumerate(pairs, 1)]

    page_cache = epochs((1.0, 100), (1.0, 80), (1.0, 80))
    client = epochs((2.0, 100), (0.5, 50), (0.4, 50))
    assert demo.verdict("client", client, page_cache) == (
        "The client beats the page cache on time in epochs 2-3 and loses in epoch 1 (2.00, "
        "0.50, 0.40 s against 1.00, 1.00, 1.00 s); it reads less from storage in epochs 2-3 "
        "and more in no epoch.")


def test_layout_is_deterministic_with_a_realistic_spread() -> None:
    spec = DatasetSpec(files=3000, seed=1)
    layout = spec.layout()
    assert layout == DatasetSpec(files=3000, seed=1).layout()
    assert layout != DatasetSpec(files=3000, seed=2).layout()
    sizes = sorted(size for _rel, size in layout)
    mean = sum(sizes) / len(sizes)
    assert 0.9 * spec.mean_bytes < mean < 1.1 * spec.mean_bytes
    assert sizes[0] < 0.4 * mean and sizes[-1] > 2.5 * mean  # a lognormal's long tail
    assert sizes[len(sizes) // 2] < mean  # median below mean
    classes = {rel.split("/")[0] for rel, _size in layout}
    assert classes == {f"class{i}" for i in range(10)}


def test_bad_spec_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError):
        ensure_dataset(tmp_path / "d", DatasetSpec(files=0))


def test_dataset_is_written_then_reused_then_remade(tmp_path: Path) -> None:
    root = tmp_path / "data"
    spec = DatasetSpec(files=25, mean_bytes=20_000, classes=3)
    made = ensure_dataset(root, spec)
    assert not made.reused
    assert made.total_bytes == sum(size for _rel, size in spec.layout())
    for rel, size in made.files:
        assert (root / rel).read_bytes() == file_contents(spec, rel, size)
    assert json.loads((root / MANIFEST).read_text())["complete"] is True

    first = (root / made.files[0][0]).stat().st_mtime_ns
    again = ensure_dataset(root, spec)
    assert again.reused and again.files == made.files
    assert (root / made.files[0][0]).stat().st_mtime_ns == first

    (root / made.files[3][0]).write_bytes(b"short")  # damaged: remade
    assert not ensure_dataset(root, spec).reused
    assert (root / made.files[3][0]).stat().st_size == made.files[3][1]

    other = ensure_dataset(root, DatasetSpec(files=5, mean_bytes=20_000, classes=3, seed=9))
    assert not other.reused
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert files == {rel for rel, _size in other.files} | {MANIFEST}
    assert other.paths("/mnt/x")[0] == os.path.join("/mnt/x", other.files[0][0])


def test_dataset_never_overwrites_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(UserError, match="not empty"):
        ensure_dataset(tmp_path, DatasetSpec(files=3))
    assert (tmp_path / "mine.txt").read_text() == "precious"


# -- counters ---------------------------------------------------------------------------------

def test_parse_stat() -> None:
    line = "   31868     7428  2025602    10084     4725     9577   657312     1702        0\n"
    assert parse_stat(line) == 2025602 * 512
    with pytest.raises(ValueError):
        parse_stat("1 2")


def test_partition_resolves_to_its_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = tmp_path / "devices" / "vdb"
    part = disk / "vdb1"
    part.mkdir(parents=True)
    (disk / "dev").write_text("252:0\n")
    (disk / "stat").write_text("1 0 100 0 0 0 0 0 0 0 0\n")
    (part / "dev").write_text("252:1\n")
    (part / "partition").write_text("1\n")
    (part / "stat").write_text("1 0 40 0 0 0 0 0 0 0 0\n")
    links = tmp_path / "dev-block"
    links.mkdir()
    (links / "252:1").symlink_to(part)
    monkeypatch.setattr(storage, "SYS_DEV_BLOCK", links)

    device = storage.device_by_number(252, 1)
    assert device is not None and device.name == "vdb1" and device.is_partition
    assert device.bytes_read() == 40 * 512
    whole = device.whole_disk()
    assert (whole.name, whole.number, whole.bytes_read()) == ("vdb", "252:0", 100 * 512)
    assert storage.device_by_number(252, 7) is None


def test_tmpfs_is_not_a_block_device() -> None:
    if not _on_block_device(Path("/")) or _on_block_device(Path("/dev/shm")):
        pytest.skip("needs / on a disk and /dev/shm on tmpfs")
    with pytest.raises(UserError, match="not on a block device"):
        block_device("/dev/shm")


def _uncached(path: Path, size: int) -> None:
    """A file of ``size`` random bytes, on the disk and out of the page cache."""
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def test_reading_an_uncached_file_counts(tmp_path: Path) -> None:
    if not _on_block_device(tmp_path):
        pytest.skip("tmp_path is not on a block device")
    path = tmp_path / "blob"
    size = 8 << 20
    _uncached(path, size)
    device = block_device(tmp_path)
    with measure_reads(device.bytes_read) as disk:
        assert len(path.read_bytes()) == size
    assert disk.bytes >= size  # other processes may add to it, never subtract


# -- cgroups ----------------------------------------------------------------------------------

needs_cgroups = pytest.mark.skipif(
    not (ROOT and _has_cgroup_v1("memory") and _has_cgroup_v1("blkio")),
    reason="needs root and cgroup v1 memory and blkio controllers")


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@needs_cgroups
def test_memory_cgroup_holds_the_pid_and_is_removed(sleeper: subprocess.Popen) -> None:
    origin = cgroup_of(sleeper.pid, "memory")
    name = f"coordlfs-test-{os.getpid()}"
    with memory_cgroup(name, 64 << 20, sleeper.pid) as group:
        assert group.memory.is_dir() and group.memory.parent == cgroup_of("self", "memory")
        assert group.memory_limit() == 64 << 20
        assert group.pids() == [sleeper.pid]
        assert cgroup_of(sleeper.pid, "memory") == group.memory
        assert group.memory_usage() >= 0
    assert not group.memory.exists()
    assert cgroup_of(sleeper.pid, "memory") == origin


@needs_cgroups
def test_cgroup_is_removed_on_error_and_throttle_is_set(sleeper: subprocess.Popen,
                                                        tmp_path: Path) -> None:
    if not _on_block_device(tmp_path):
        pytest.skip("tmp_path is not on a block device")
    disk = block_device(tmp_path).whole_disk()
    with pytest.raises(RuntimeError, match="boom"), \
            memory_cgroup(f"coordlfs-test-{os.getpid()}", None, sleeper.pid,
                          storage=tmp_path, read_bps=50 << 20) as group:
        throttle = (group.directories["blkio"] / "blkio.throttle.read_bps_device").read_text()
        assert f"{disk.number} {50 << 20}" in throttle
        assert cgroup_of(sleeper.pid, "blkio") == group.directories["blkio"]
        raise RuntimeError("boom")
    assert not any(d.exists() for d in group.directories.values())
    assert cgroup_of(sleeper.pid, "blkio") != group.directories["blkio"]


#: Waits for a line, then reads its first argument in a child it forks, then the others.
FORKING_READER = """
import os, sys
sys.stdin.readline()
if os.fork() == 0:
    open(sys.argv[1], "rb").read()
    os._exit(0)
os.wait()
for path in sys.argv[2:]:
    open(path, "rb").read()
"""


def _read_in(group: Cgroup, paths: list[Path]) -> None:
    """``paths`` read by a process in ``group`` (the first by a child it forks)."""
    reader = subprocess.Popen([sys.executable, "-c", FORKING_READER, *map(str, paths)],
                              stdin=subprocess.PIPE, text=True)
    try:
        group.add(reader.pid)
        reader.communicate("go\n", timeout=60)
    finally:
        reader.kill()
        reader.wait()
    assert reader.returncode == 0


@needs_cgroups
def test_a_storage_group_counts_its_processes_children_and_no_one_else(tmp_path: Path) -> None:
    """A reader's kernel reads (a FUSE passthrough open's backing file, a DataLoader
    worker's files) are the reader's, which the daemon's own count never saw."""
    if not _on_block_device(tmp_path):
        pytest.skip("tmp_path is not on a block device")
    forked, own, outside = tmp_path / "forked", tmp_path / "own", tmp_path / "outside"
    for path, size in ((forked, 4 << 20), (own, 2 << 20), (outside, 32 << 20)):
        _uncached(path, size)
    with storage_cgroup(f"coordlfs-test-{os.getpid()}", tmp_path) as group, \
            measure_reads(group.bytes_read) as counted:
        assert len(outside.read_bytes()) == 32 << 20  # by this process, not in the group
        _read_in(group, [forked, own])
    # both files (and a little metadata, or a library page someone's drop_caches evicted);
    # never the 32 MiB read outside the group
    assert 6 << 20 <= counted.bytes < 22 << 20


#: ioctls of /dev/loop-control (linux/loop.h)
LOOP_CTL_ADD, LOOP_CTL_REMOVE = 0x4C80, 0x4C81


@contextlib.contextmanager
def _new_loop_device(image: Path) -> Iterator[str]:
    """A loop device made for the caller (a disk no throttle rule ever touched: a freed one
    keeps its state), backed by ``image``, detached and removed afterwards."""
    with open("/dev/loop-control", "rb") as control:
        index = fcntl.ioctl(control, LOOP_CTL_ADD, -1)  # any free number
        device = f"/dev/loop{index}"
        try:
            subprocess.run(["losetup", device, str(image)], check=True)
            try:
                yield device
            finally:
                subprocess.run(["losetup", "-d", device], check=True)
        finally:
            for _ in range(100):  # busy while the detach completes (udev probes it)
                try:
                    fcntl.ioctl(control, LOOP_CTL_REMOVE, index)
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                fcntl.ioctl(control, LOOP_CTL_REMOVE, index)  # its error, raised this time


@needs_cgroups
@pytest.mark.skipif(not (shutil.which("losetup") and shutil.which("mkfs.ext4")
                         and os.path.exists("/dev/loop-control")),
                    reason="needs loop devices, losetup and mkfs.ext4")
def test_reads_are_counted_on_a_disk_no_group_ever_throttled(tmp_path: Path) -> None:
    """Linux 6.10 and later count a group's reads only on a disk that some group had a
    throttle rule for, which a machine just booted has none of: a group that counts writes
    a rule of none. A loop device made for the test is such a disk."""
    image, mountpoint = tmp_path / "disk.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    with _new_loop_device(image) as loop:
        mountpoint.mkdir()
        subprocess.run(["mount", loop, str(mountpoint)], check=True)
        try:
            _uncached(mountpoint / "data", 8 << 20)
            with storage_cgroup(f"coordlfs-test-{os.getpid()}", mountpoint) as group, \
                    measure_reads(group.bytes_read) as counted:
                rules = group.directories["blkio"] / "blkio.throttle.read_bps_device"
                assert rules.read_text() == ""  # 0: no cap
                _read_in(group, [mountpoint / "data"])
            assert counted.bytes >= 8 << 20
        finally:
            subprocess.run(["umount", str(mountpoint)], check=True)


@needs_cgroups
def test_stale_groups_of_dead_processes_are_removed() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    parent = cgroup_of("self", "memory")
    dead, alive = parent / f"coordlfs-stale-{gone.pid}", parent / f"coordlfs-stale-{os.getpid()}"
    dead.mkdir()
    alive.mkdir()
    try:
        assert remove_stale("coordlfs-stale") == [dead]
        assert alive.is_dir() and not dead.exists()
    finally:
        for group in (dead, alive):
            if group.exists():
                group.rmdir()


def test_cgroup_errors_are_user_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroup_mod, "CGROUP_V1", tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(UserError, match="memory controller is not mounted"), \
            memory_cgroup("x", 1 << 20):
        pass
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="needs root"), memory_cgroup("x", 1 << 20):
        pass


# -- the demo, for real -----------------------------------------------------------------------

needs_demo = pytest.mark.skipif(
    not (ROOT and _has_cgroup_v1("memory") and os.path.exists("/dev/fuse")),
    reason="needs root, cgroup v1 memory and /dev/fuse")


def _demo(workdir: Path, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "coordlfs.bench.demo", "--dir", str(workdir),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)


def _left_behind(workdir: Path, pid: int) -> list[str]:
    """Mounts and cgroups the demo (process ``pid``) left; cleans them up for the next test."""
    left = []
    entry = mount_at(str(workdir / "mnt"))
    if entry is not None and entry.fstype.startswith("fuse"):
        left.append(f"mount {entry.mountpoint}")
        force_unmount(workdir / "mnt", None)
    own = cgroup_of("self", "memory")
    for group in own.glob(f"coordlfs-demo-{pid}*"):
        left.append(f"cgroup {group}")
        group.rmdir()
    return left


@needs_demo
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    if not _on_block_device(tmp_path):
        pytest.skip("tmp_path is not on a block device")
    out = tmp_path / "demo.json"
    proc = _demo(workdir, "--files", "100", "--epochs", "3", "--json", str(out))
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        left = _left_behind(workdir, proc.pid)
    assert proc.returncode == 0, stderr
    assert not left
    assert "epochs 2-3: coordlfs read" in stdout

    report = json.loads(out.read_text())
    total = report["dataset"]["bytes"]
    assert report["dataset"]["files"] == 100
    assert report["memory_budget_bytes"] == total // 2
    ours, theirs = report["coordlfs"], report["page_cache"]
    assert [e["epoch"] for e in ours["epochs"]] == [1, 2, 3] == [e["epoch"] for e in
                                                                 theirs["epochs"]]
    for e in ours["epochs"] + theirs["epochs"]:
        assert set(e) == {"epoch", "storage_bytes", "device_bytes", "seconds", "source_bytes",
                          "cache_used_bytes", "passthrough_opens", "source_opens",
                          "daemon_reads"}
        assert e["seconds"] > 0
    assert ours["cache_capacity_bytes"] == total // 2
    used = ours["cache_used_bytes"]
    assert 0 < used <= ours["cache_capacity_bytes"]
    first, second, third = ours["epochs"]
    assert first["source_bytes"] == total
    assert second["source_bytes"] == total - used == third["source_bytes"]
    assert first["cache_used_bytes"] == used  # full after one epoch, never evicted
    # What the daemon and the reader's kernel read from the disk is the source bytes,
    # rounded up to whole blocks.
    assert second["source_bytes"] <= second["storage_bytes"] < second["source_bytes"] + (2 << 20)
    assert theirs["epochs"][0]["storage_bytes"] >= 0.95 * total
    # which path served the mount: the table says, per epoch
    assert f"mount: FUSE passthrough {ours['passthrough']}" in stdout
    assert "kernel " in stdout and " opens (cache + source), daemon " in stdout
    if ours["passthrough"] == "on":  # the cached half opened by passthrough from epoch 2,
        # every file of the first and the rest of the others from the source by the kernel
        assert all(e["passthrough_opens"] > 0 for e in (second, third))
        assert first["source_opens"] == 100 and first["daemon_reads"] == 0
    else:
        assert first["daemon_reads"] > 0
    assert isinstance(report["later_epochs_ratio"], float)
    # the client: a fresh mount, the same orders, each epoch's bytes and time
    client = report["client"]
    assert [e["epoch"] for e in client["epochs"]] == [1, 2, 3]
    for e in client["epochs"]:
        assert set(e) == set(ours["epochs"][0]) and e["seconds"] > 0
    assert client["cache_capacity_bytes"] == total // 2
    assert 0 < client["cache_used_bytes"] <= total // 2
    assert client["epochs"][0]["source_bytes"] >= total // 2
    assert len(report["client_time_ratios"]) == 3
    assert isinstance(report["client_later_epochs_ratio"], float)
    assert "The mount beats the page cache on time in" in stdout
    assert "The client beats the page cache on time in" in stdout
    # readers under `coordlfs run`: the job reads every miss itself, the cache backfills
    run = report["run"]
    assert [e["epoch"] for e in run["epochs"]] == [1, 2, 3]
    assert run["epochs"][0]["source_bytes"] == total
    assert 0 < run["cache_used_bytes"] <= total // 2
    assert all(e["source_bytes"] < total for e in run["epochs"][1:])
    assert len(report["run_time_ratios"]) == 3
    assert "The mount under `coordlfs run` beats the page cache on time in" in stdout
    # the same on a slow source: the disk throttled, the page cache, the mount and the run
    slow = report["slow"]
    assert slow["read_bps"] == 50 << 20
    for side in ("page_cache", "coordlfs", "run"):
        assert [e["epoch"] for e in slow[side]["epochs"]] == [1, 2, 3]
    assert "client" not in slow
    assert "on a slow source: the disk at 50.0 MiB/s:" in stdout
    assert "On a source at 50.0 MiB/s, a job under `coordlfs run` ran at" in stdout
    assert "coordlfs wins where storage bounds an epoch" in stdout


@needs_demo
def test_demo_cleans_up_when_interrupted(tmp_path: Path) -> None:
    if not _on_block_device(tmp_path):
        pytest.skip("tmp_path is not on a block device")
    workdir = tmp_path / "demo"
    proc = _demo(workdir, "--files", "400", "--epochs", "4")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "coordlfs epoch 1/" in line:  # mounted, reader in its cgroup
                proc.send_signal(signal.SIGINT)
                break
        _stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
        left = _left_behind(workdir, proc.pid)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert not left
    assert not list(Path("/dev/shm").glob(f"coordlfs-testbed-{proc.pid}-*"))
