"""Seed-aligned jobs on a real mount: job processes join a group and read through the kernel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from conftest import drop_caches, make_dataset

#: A job: joins the group, then reads its files whenever told "read", printing one digest.
JOB = r"""
import json, os, sys, xxhash
from coordlfs.control import Control
mount, group, files = sys.argv[1], sys.argv[2], sys.argv[3:]
reply = Control(mount).join_group(group, job="job-%d" % os.getpid())
print(json.dumps(reply), flush=True)
for line in sys.stdin:
    if line.strip() != "read":
        break
    digest = xxhash.xxh64()
    for name in files:
        with open(os.path.join(mount, name), "rb") as f:
            digest.update(f.read())
    print(digest.hexdigest(), flush=True)
"""


class Job:
    def __init__(self, mountpoint: Path, group: str, files: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", JOB, str(mountpoint), group, *files],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.joined = json.loads(self.proc.stdout.readline())

    def start_reading(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("read\n")
        self.proc.stdin.flush()

    def digest(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def read(self) -> str:
        self.start_reading()
        return self.digest()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def jobs() -> Iterator:
    started: list[Job] = []

    def _start(mountpoint: Path, group: str, files: list[str]) -> Job:
        job = Job(mountpoint, group, files)
        started.append(job)
        return job

    yield _start
    for job in started:
        job.stop()


def _digest(root: Path, files: list[str]) -> str:
    digest = xxhash.xxh64()
    for name in files:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()


def _source(tmp_path: Path, n: int = 120) -> tuple[Path, list[str], int]:
    root = tmp_path / "data"
    root.mkdir()
    sizes = make_dataset(root, n)
    return root, sorted(sizes), sum(sizes.values())


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_aligned_jobs_read_each_item_from_storage_once(mount, jobs, tmp_path: Path) -> None:
    src, files, total = _source(tmp_path)
    m = mount(src, "--cache-size", "0", "--window-size", "64M")
    a, b = jobs(m.mountpoint, "g", files), jobs(m.mountpoint, "g", files)
    assert a.joined["seed"] == b.joined["seed"] and len(b.joined["members"]) == 2
    assert a.read() == _digest(src, files)
    status = m.status()
    assert status["reads"]["bytes_from_source"] == total
    assert status["read_window"]["used_bytes"] == total  # everything waits for b
    drop_caches()  # b must go through the daemon, not the kernel's copy of a's pages
    assert b.read() == _digest(src, files)
    status = m.status()
    assert status["reads"]["bytes_from_source"] == total
    assert status["read_window"]["used_bytes"] == 0 and status["read_window"]["items"] == 0
    assert status["read_window"]["hits"] == len(files)


def test_concurrent_aligned_jobs_share_fetches(mount, jobs, tmp_path: Path) -> None:
    src, files, total = _source(tmp_path)
    m = mount(src, "--cache-size", "0")
    group = [jobs(m.mountpoint, "g", files) for _ in range(3)]
    for job in group:
        job.start_reading()
    assert {job.digest() for job in group} == {_digest(src, files)}
    status = m.status()
    assert status["reads"]["bytes_from_source"] == total
    assert status["read_window"]["used_bytes"] == 0


def test_window_stays_within_its_bound(mount, jobs, tmp_path: Path) -> None:
    src, files, total = _source(tmp_path)
    bound = 1 << 20
    m = mount(src, "--cache-size", "0", "--window-size", str(bound))
    a, b = jobs(m.mountpoint, "g", files), jobs(m.mountpoint, "g", files)
    assert a.read() == _digest(src, files)
    held = m.status()["read_window"]
    assert 0 < held["used_bytes"] <= bound and held["dropped_unread"] > 0
    drop_caches()
    assert b.read() == _digest(src, files)
    status = m.status()
    assert total < status["reads"]["bytes_from_source"] <= 2 * total - held["used_bytes"]


def test_dead_member_does_not_pin_the_window(mount, jobs, tmp_path: Path) -> None:
    src, files, total = _source(tmp_path)
    m = mount(src, "--cache-size", "0")
    a, b = jobs(m.mountpoint, "g", files), jobs(m.mountpoint, "g", files)
    assert a.read() == _digest(src, files)
    assert m.status()["read_window"]["used_bytes"] == total
    os.kill(b.proc.pid, signal.SIGKILL)
    b.proc.wait()
    _wait_for(lambda: m.status()["read_window"]["used_bytes"] == 0)
    members = m.status()["groups"]["g"]["members"]
    assert [member["pid"] for member in members] == [a.proc.pid]
    a.stop()
    _wait_for(lambda: m.status()["groups"] == {})


def test_unaligned_readers_are_unaffected(mount, tmp_path: Path) -> None:
    src, files, total = _source(tmp_path)
    m = mount(src, "--cache-size", "0")
    assert _digest(m.mountpoint, files) == _digest(src, files)
    status = m.status()
    assert status["read_window"]["used_bytes"] == 0
    assert status["reads"]["bytes_from_source"] == total


def test_malformed_group_command_on_the_control_file(mount, tmp_path: Path) -> None:
    src, _files, _total = _source(tmp_path, 4)
    m = mount(src)
    result = subprocess.run(["bash", "-c", f"echo '{{\"cmd\": \"group.join\", \"pid\": \"x\"}}' "
                                         f"> {m.mountpoint}/.coordlfs"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "Invalid argument" in result.stderr
    fd = os.open(m.mountpoint / ".coordlfs", os.O_RDWR)
    try:
        with pytest.raises(OSError):
            os.write(fd, b'{"cmd": "group.join", "group": "g", "pid": 0}\n')
        reply = json.loads(os.read(fd, 4096))
    finally:
        os.close(fd)
    assert reply == {"ok": False, "error": '"pid" must be a process id'}
    assert m.status()["groups"] == {}
