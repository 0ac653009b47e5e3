"""Integration tests: a real coordlfs mount in a subprocess, read through the kernel."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import xxhash
from conftest import (
    digests,
    drop_caches,
    force_unmount,
    random_source,
    read_at_once,
    run_cli,
    wait_for,
)

from coordlfs.client.dataset import Dataset
from coordlfs.control import Control, ControlError
from coordlfs.fs import passthrough as passthrough_support
from coordlfs.system.processes import wait_exit

needs_passthrough = pytest.mark.skipif(
    passthrough_support.available() is not None,
    reason=f"no FUSE passthrough: {passthrough_support.available()}")


def read_file(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def test_every_byte_matches_the_source(mount, dataset) -> None:
    source, _sizes = dataset
    m = mount(source, "--cache-size", "10M")
    assert digests(m.mountpoint) == digests(source)
    drop_caches()  # second pass: cached files from the cache, the rest streamed again
    assert digests(m.mountpoint) == digests(source)
    status = m.status()
    assert 0 < status["cache"]["used_bytes"] <= 10 << 20
    reads = status["reads"]  # files counted per open, whoever read them
    assert reads["file_hits"] > 0 and reads["file_misses"] > 0


def test_three_shuffled_epochs_read_only_the_uncached_rest(mount, dataset) -> None:
    source, sizes = dataset
    total = sum(sizes.values())
    capacity = total // 2
    m = mount(source, "--cache-size", str(capacity))
    ctl = Control(m.mountpoint)
    rng = random.Random(1)
    names = sorted(sizes)
    for epoch in range(3):
        drop_caches()
        used_before = m.status()["cache"]["bytes"]
        ctl.mark(f"start{epoch}")
        rng.shuffle(names)
        for name in names:
            assert len(read_file(m.mountpoint / name)) == sizes[name]
        window = ctl.stats(since=f"start{epoch}")["reads"]
        used = m.status()["cache"]["bytes"]
        assert used <= capacity
        if epoch == 0:
            assert window["bytes_from_source"] == total
        else:
            assert window["bytes_from_source"] == total - used_before
            # with passthrough, a cached file's size is counted at its open
            assert window["bytes_from_cache"] == used_before
    assert m.status()["cache"]["used_bytes"] > capacity * 0.9


def test_names_links_and_attributes(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    deep = src / "a" / "b c" / "dé"
    deep.mkdir(parents=True)
    (deep / "naïve file.txt").write_bytes(b"payload")
    odd = os.fsencode(str(src)) + b"/latin1-\xe9\xff"
    with open(odd, "wb") as f:
        f.write(b"bytes name")
    os.symlink("a/b c/dé/naïve file.txt", src / "rel-link")
    os.symlink("/etc/hostname", src / "abs-link")
    os.link(deep / "naïve file.txt", src / "hard")
    os.setxattr(src / "hard", "user.label", b"cat")
    m = mount(src)
    mp = m.mountpoint
    assert (mp / "a/b c/dé/naïve file.txt").read_bytes() == b"payload"
    assert open(os.fsencode(str(mp)) + b"/latin1-\xe9\xff", "rb").read() == b"bytes name"
    assert os.readlink(mp / "rel-link") == "a/b c/dé/naïve file.txt"
    assert (mp / "rel-link").read_bytes() == b"payload"
    assert os.readlink(mp / "abs-link") == "/etc/hostname"
    assert os.lstat(mp / "abs-link").st_mode & 0o170000 == 0o120000
    hard, orig = os.stat(mp / "hard"), os.stat(mp / "a/b c/dé/naïve file.txt")
    assert hard.st_ino == orig.st_ino and hard.st_nlink == 2
    assert os.getxattr(mp / "hard", "user.label") == b"cat"
    assert "user.label" in os.listxattr(mp / "hard")
    with pytest.raises(OSError) as info:
        os.getxattr(mp / "hard", "user.nothing")
    assert info.value.errno == errno.ENODATA
    src_st, mnt_st = os.stat(src / "hard"), os.stat(mp / "hard")
    for field in ("st_size", "st_mode", "st_uid", "st_gid", "st_mtime_ns"):
        assert getattr(src_st, field) == getattr(mnt_st, field)
    assert sorted(os.listdir(mp)) == sorted(os.listdir(src))
    assert os.statvfs(mp).f_blocks == os.statvfs(src).f_blocks
    assert not (mp / "missing").exists()
    assert not (mp / "missing").exists()  # negative entry, cached


def test_large_directory(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    big = src / "big"
    big.mkdir(parents=True)
    for i in range(10_000):
        (big / f"entry {i:05d}").write_bytes(str(i).encode())
    m = mount(src)
    listed = os.listdir(m.mountpoint / "big")
    assert len(listed) == 10_000 and set(listed) == set(os.listdir(big))
    with os.scandir(m.mountpoint / "big") as it:
        sizes = {e.name: e.stat().st_size for e in it}
    assert sizes["entry 09999"] == 4
    assert (m.mountpoint / "big" / "entry 04321").read_bytes() == b"4321"


def test_control_entry_is_hidden_but_reachable(mount, dataset) -> None:
    source, _ = dataset
    m = mount(source, "--cache-size", "4M")
    assert ".coordlfs" not in os.listdir(m.mountpoint)
    status = json.loads((m.mountpoint / ".coordlfs").read_bytes())
    assert status["protocol"] == 1 and status["pid"] == m.pid
    assert status["source"] == str(source) and status["mountpoint"] == str(m.mountpoint)
    assert set(status["cache"]) >= {"capacity_bytes", "used_bytes", "files"}
    assert set(status["reads"]) == {
        "file_hits", "file_misses", "file_peer_hits", "opened_bytes", "read_hits", "read_misses",
        "bytes_from_cache", "bytes_from_source", "bytes_from_peers", "passthrough_opens",
        "source_opens", "client_hits", "client_misses", "client_bytes_from_cache",
        "client_bytes_from_mount", "client_direct", "client_bytes_direct", "preload_hits",
        "preload_misses", "preload_uncached", "preload_passed", "preload_bytes_from_cache",
        "preload_bytes_from_source", "fill_bytes_from_pages"}
    assert status["cache"]["capacity_bytes"] == 4 << 20


def test_control_requests_and_errors(mount, dataset) -> None:
    source, sizes = dataset
    m = mount(source)
    ctl = Control(m.mountpoint)
    ctl.mark("epoch-1")
    name = sorted(sizes)[0]
    read_file(m.mountpoint / name)
    assert ctl.stats(since="epoch-1")["reads"]["bytes_from_source"] == sizes[name]
    assert [mk["name"] for mk in ctl.marks()] == ["epoch-1"]
    with pytest.raises(ControlError, match="unknown command"):
        ctl.request("explode")
    with pytest.raises(ControlError, match="no mark named"):
        ctl.stats(since="never")
    # Raw protocol: a malformed request fails the write with EINVAL, and the reply says why.
    fd = os.open(m.mountpoint / ".coordlfs", os.O_RDWR)
    with pytest.raises(OSError) as info:
        os.write(fd, b"{not json\n")
    assert info.value.errno == errno.EINVAL
    assert "not JSON" in json.loads(os.read(fd, 1 << 16))["error"]
    os.write(fd, b'{"cmd": "status", "id": "x"}\n')
    reply = json.loads(os.read(fd, 1 << 16))
    assert reply["ok"] and reply["id"] == "x"
    os.close(fd)
    # Shell style: `echo ... > .coordlfs` truncates then writes.
    shell = subprocess.run(["sh", "-c", f"echo '{{\"cmd\":\"mark\",\"name\":\"sh\"}}' > "
                            f"'{m.mountpoint}/.coordlfs'"], capture_output=True, text=True)
    assert shell.returncode == 0, shell.stderr
    assert m.status()["marks"] == ["epoch-1", "sh"]
    assert digests(m.mountpoint) == digests(source)  # the mount stayed up and correct


def test_writes_get_erofs_and_source_is_untouched(mount, dataset) -> None:
    source, sizes = dataset
    before = digests(source)
    m = mount(source)
    name = m.mountpoint / sorted(sizes)[0]
    attempts = [
        lambda: open(name, "r+b"),
        lambda: open(name, "ab"),
        lambda: open(m.mountpoint / "new", "wb"),
        lambda: os.truncate(name, 0),
        lambda: os.unlink(name),
        lambda: os.mkdir(m.mountpoint / "d"),
        lambda: os.rename(name, m.mountpoint / "moved"),
        lambda: os.symlink("x", m.mountpoint / "l"),
        lambda: os.link(name, m.mountpoint / "l2"),
        lambda: os.chmod(name, 0o777),
        lambda: os.setxattr(name, "user.x", b"1"),
        lambda: os.utime(name),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS
    assert digests(source) == before
    assert digests(m.mountpoint) == before


def test_mmap_and_o_direct_readers(mount, tmp_path: Path) -> None:
    src = random_source(tmp_path, blob=3 * 1024 * 1024 + 123)
    data = (src / "blob").read_bytes()
    m = mount(src)
    with open(m.mountpoint / "blob", "rb") as f, \
            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert xxhash.xxh64_hexdigest(mm[:]) == xxhash.xxh64_hexdigest(data)
        assert mm[1_000_000:1_000_010] == data[1_000_000:1_000_010]
    fd = os.open(m.mountpoint / "blob", os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 1 << 20)
    got = bytearray()
    while n := os.readv(fd, [buf]):
        got += buf[:n]
    os.close(fd)
    assert bytes(got) == data


def test_changed_source_file_is_served_fresh(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"old contents")
    m = mount(src)
    assert (m.mountpoint / "f").read_bytes() == b"old contents"  # now cached, kernel too
    (src / "f").write_bytes(b"new and longer contents")
    assert (m.mountpoint / "f").read_bytes() == b"new and longer contents"
    (src / "f").write_bytes(b"short")
    assert (m.mountpoint / "f").read_bytes() == b"short"
    os.utime(src / "f", ns=(1, 1))  # same size, other mtime, other bytes
    with open(src / "f", "r+b") as f:
        f.write(b"SHORT")
    os.utime(src / "f", ns=(2, 2))
    assert (m.mountpoint / "f").read_bytes() == b"SHORT"
    assert m.status()["cache"]["bytes"] == 5


def test_concurrent_misses_fetch_once(mount, tmp_path: Path) -> None:
    src = random_source(tmp_path, shared=32 << 20)
    data = (src / "shared").read_bytes()
    m = mount(src)
    drop_caches()
    assert all(out == data for out in read_at_once(m.mountpoint / "shared", 4))
    reads = m.status()["reads"]
    assert reads["bytes_from_source"] == len(data)
    assert reads["file_hits"] + reads["file_misses"] == 4  # an open each, whatever served it


def test_large_file_streams_without_being_read_whole(mount, tmp_path: Path) -> None:
    src = random_source(tmp_path, shard=200 << 20)
    m = mount(src, "--cache-size", "64M")
    drop_caches()
    with open(m.mountpoint / "shard", "rb") as f:
        head = f.read(1 << 20)
    # read by the daemon, or by the kernel from the source file (passthrough: counted at the
    # last release, which the kernel sends after close returned, as the source's pages then:
    # so the source is read here only after that, 18 MiB counted when it came first)
    wait_for(lambda: m.status()["reads"]["bytes_from_source"] > 0, "the head counted")
    reads = m.status()["reads"]
    assert reads["bytes_from_source"] < 16 << 20  # the head only, plus kernel read-ahead
    assert head == (src / "shard").read_bytes()[: 1 << 20]
    assert m.status()["cache"]["used_bytes"] == 0
    assert xxhash.xxh64_hexdigest(read_file(m.mountpoint / "shard")) == \
        xxhash.xxh64_hexdigest((src / "shard").read_bytes())


def test_small_streamed_file_costs_one_storage_read(mount, tmp_path: Path) -> None:
    """With no cache room, a small file is read from storage once per open, however it is read
    and however often the kernel drops its pages and asks again."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(300_000)
    (src / "image").write_bytes(data)
    m = mount(src, "--cache-size", "0")
    fd = os.open(m.mountpoint / "image", os.O_RDONLY)
    try:
        pieces = []
        for off in range(0, len(data), 4096):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # force the kernel to ask again
            pieces.append(os.pread(fd, 4096, off))
    finally:
        os.close(fd)
    assert b"".join(pieces) == data
    reads = m.status()["reads"]
    assert reads["file_misses"] == 1
    assert reads["bytes_from_source"] == len(data)
    # the daemon served every request again from what it read, or the kernel read the source
    assert reads["read_misses"] > 1 or reads["source_opens"] == 1


def test_restart_over_same_source_is_warm_and_unmount_removes_cache(mount, dataset) -> None:
    source, _sizes = dataset
    total = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    m = mount(source, "--keep-cache")
    assert digests(m.mountpoint) == digests(source)
    assert run_cli("umount", str(m.mountpoint)).returncode == 0
    assert (m.cache_dir / "index.jsonl").exists()
    again = mount(source, mountpoint=m.mountpoint, cache_dir=m.cache_dir)
    assert again.status()["cache"]["bytes"] == total
    drop_caches()
    assert digests(again.mountpoint) == digests(source)
    assert again.status()["reads"]["bytes_from_source"] == 0
    assert run_cli("umount", str(again.mountpoint)).returncode == 0
    assert not m.cache_dir.exists()


def test_mount_over_the_source_itself(mount, dataset) -> None:
    source, _ = dataset
    expected = digests(source)
    m = mount(source, mountpoint=source)
    assert m.status()["source"] == str(source)
    assert digests(source) == expected  # now read through the mount
    assert run_cli("umount", str(source)).returncode == 0
    assert digests(source) == expected


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_unmounts_cleanly(mount, dataset, signum: int) -> None:
    source, _ = dataset
    m = mount(source, "--allow-other")
    assert "allow_other" in Path("/proc/self/mountinfo").read_text()
    os.kill(m.pid, signum)
    assert wait_exit(m.pid, 15)
    assert str(m.mountpoint) not in Path("/proc/self/mountinfo").read_text()
    assert not m.cache_dir.exists()


def test_umount_waits_for_daemon_and_refuses_busy(mount, dataset) -> None:
    source, sizes = dataset
    m = mount(source)
    busy = open(m.mountpoint / sorted(sizes)[0], "rb")
    result = run_cli("umount", str(m.mountpoint))
    assert result.returncode == 1 and "busy" in result.stderr
    assert result.stderr.count("\n") == 1
    busy.close()
    assert run_cli("umount", str(m.mountpoint)).returncode == 0
    assert wait_exit(m.pid, 0)  # umount returned only after the daemon exited


def test_bad_input_gets_one_line_errors(mount, dataset, tmp_path: Path) -> None:
    source, _ = dataset
    (tmp_path / "mp").mkdir()
    (tmp_path / "file").write_text("x")
    cases = [
        (["mount", str(tmp_path / "nope"), str(tmp_path / "mp")], "does not exist"),
        (["mount", str(tmp_path / "file"), str(tmp_path / "mp")], "not a directory"),
        (["mount", str(source), str(tmp_path / "missing")], "does not exist"),
        (["mount", str(source), str(tmp_path / "mp"), "--cache-size=-1G"], "bad --cache-size"),
        (["mount", str(source), str(tmp_path / "mp"), "--cache-size", "lots"], "bad --cache-size"),
        (["mount", str(source), str(tmp_path / "mp"), "--bogus"], "unrecognized arguments"),
        (["mount", str(source)], "required"),
        (["frobnicate"], "invalid choice"),
        (["stats", str(tmp_path / "mp")], "not a coordlfs mount"),
        (["umount", str(tmp_path / "mp")], "not a coordlfs mount"),
    ]
    for args, message in cases:
        result = run_cli(*args)
        assert result.returncode != 0, args
        assert message in result.stderr, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    m = mount(source)
    result = run_cli("mount", str(source), str(m.mountpoint))
    assert result.returncode == 1 and "in use" in result.stderr
    assert result.stderr.count("\n") == 1
    assert m.status()["pid"] == m.pid  # still up


def test_stats_command(mount, dataset) -> None:
    source, sizes = dataset
    m = mount(source, "--cache-size", "1G")
    for name in sizes:
        read_file(m.mountpoint / name)
    table = run_cli("stats", str(m.mountpoint))
    assert table.returncode == 0 and "% from cache" in table.stdout
    data = json.loads(run_cli("stats", str(m.mountpoint), "--json").stdout)
    assert data["cache"]["bytes"] == sum(sizes.values())
    assert run_cli("mark", str(m.mountpoint), "e2").returncode == 0
    since = json.loads(run_cli("stats", str(m.mountpoint), "--json", "--since", "e2").stdout)
    assert since["reads"]["bytes_from_source"] == 0


@pytest.mark.parametrize("passthrough", [pytest.param("yes", marks=needs_passthrough), "no"])
def test_stats_count_each_file_opened_by_what_served_it(mount, dataset, passthrough) -> None:
    """After a warm, an epoch over the whole mount counts each file once: a hit whether the
    kernel (passthrough) or the daemon served it, a miss for the one file over
    --max-file-size; and an epoch through coordlfs.client the same (issue 35: such an epoch
    showed "0 hits, 1536 misses", counting the daemon's reads of the one uncached file)."""
    source, _ = dataset
    (source / "big.bin").write_bytes(os.urandom(3 << 20))
    names = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
    m = mount(source, "--passthrough", passthrough, "--max-file-size", "2M")
    assert run_cli("warm", str(m.mountpoint)).returncode == 0
    ctl = Control(m.mountpoint)
    ctl.mark("e1")
    for name in names:
        read_file(m.mountpoint / name)
    ctl.mark("e2")
    with Dataset(m.mountpoint) as ds:  # its counts reported as it closes
        for name in names:
            ds.read(name)
    ctl.mark("e3")
    hits = len(names) - 1
    for since, until in (("e1", "e2"), ("e2", "e3")):
        reads = ctl.stats(since=since, until=until)["reads"]
        assert (reads["file_hits"], reads["file_misses"], reads["file_peer_hits"]) == \
            (hits, 1, 0), (since, reads)
    table = run_cli("stats", str(m.mountpoint), "--since", "e1", "--until", "e2").stdout
    assert (f"files    {len(names)} opened: {hits} hits (cache), 1 miss (source), 0 peer hits"
            in table), table


def test_default_cache_size_is_printed(dataset, tmp_path: Path) -> None:
    source, _ = dataset
    mp = tmp_path / "mp"
    mp.mkdir()
    result = run_cli("mount", str(source), str(mp), "--cache-dir", str(tmp_path / "cache"))
    try:
        assert result.returncode == 0, result.stderr
        assert "default: 50% of RAM" in result.stdout
        assert Control(mp).status()["cache"]["capacity_bytes"] > 0
    finally:
        force_unmount(mp, Control(mp).status()["pid"] if result.returncode == 0 else None)


def test_lookup_counts_and_forget(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(2000):
        (src / "d" / f"f{i}").write_bytes(b"x")
    m = mount(src)
    for name in os.listdir(m.mountpoint / "d"):
        os.stat(m.mountpoint / "d" / name)
    assert m.status()["inodes"] >= 2001
    drop_caches()  # the kernel evicts its inodes and sends FORGET for each, in the background
    wait_for(lambda: m.status()["inodes"] < 100, "forgotten")
    assert digests(m.mountpoint) == digests(src)  # and looks them up again


def test_hits_are_answered_while_slow_misses_are_pending(mount, tmp_path: Path) -> None:
    """A real slow disk: the daemon's reads are throttled to 1 MiB/s by a blkio cgroup."""
    from coordlfs.testbed.cgroup import memory_cgroup

    src = random_source(tmp_path, hot=256 << 10, slow=6 << 20)
    m = mount(src, "--cache-size", "64M", "--max-file-size", "64M")
    read_file(m.mountpoint / "hot")  # cached before the disk becomes slow
    with memory_cgroup(f"coordlfs-test-{m.pid}", pid=m.pid, storage=src, read_bps=1 << 20):
        drop_caches()
        slow = subprocess.Popen(["cat", str(m.mountpoint / "slow")], stdout=subprocess.PIPE)
        time.sleep(0.5)
        started = time.monotonic()
        assert read_file(m.mountpoint / "hot") == (src / "hot").read_bytes()
        hit_seconds = time.monotonic() - started
        assert slow.poll() is None  # the miss (about 6 s at 1 MiB/s) is still pending
        assert hit_seconds < 1.0, hit_seconds
        assert m.status()["cache"]["filling"] == 1
        out, _ = slow.communicate(timeout=60)
    assert out == (src / "slow").read_bytes()


def test_dead_daemon_is_reported_and_unmountable(mount, dataset) -> None:
    source, _ = dataset
    m = mount(source)
    os.kill(m.pid, signal.SIGKILL)
    assert wait_exit(m.pid, 15)
    result = run_cli("mount", str(source), str(m.mountpoint))
    assert result.returncode == 1 and "dead FUSE mount" in result.stderr
    assert result.stderr.count("\n") == 1
    assert run_cli("umount", str(m.mountpoint)).returncode == 0
    assert str(m.mountpoint) not in Path("/proc/self/mountinfo").read_text()
    again = mount(source, mountpoint=m.mountpoint, cache_dir=m.cache_dir)  # the lock was freed
    assert digests(again.mountpoint) == digests(source)
