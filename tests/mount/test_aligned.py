"""Seed-aligned jobs on a real mount: job processes join a group and read through the kernel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from conftest import drop_caches, make_dataset, wait_for

from coordlfs.control import Control, ControlError

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
    wait_for(lambda: m.status()["read_window"]["used_bytes"] == 0, "the read window empty")
    members = m.status()["groups"]["g"]["members"]
    assert [member["pid"] for member in members] == [a.proc.pid]
    a.stop()
    wait_for(lambda: m.status()["groups"] == {}, "every group gone")


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


#: A job that tells the mount its files and epoch, then reads one epoch in the group's order.
ORDERED_JOB = r"""
import json, os, sys, time, xxhash
from coordlfs.control import Control
from coordlfs.protocol.order import epoch_order
mount, group, files = sys.argv[1], sys.argv[2], sys.argv[3:]
control = Control(mount)
reply = control.join_group(group)
control.register_files(reply["member"], files)
control.start_epoch(reply["member"], 0)
order = [files[i] for i in epoch_order(reply["seed"], 0, len(files))]
digest = xxhash.xxh64()
for name in order:
    with open(os.path.join(mount, name), "rb") as f:
        digest.update(f.read())
    time.sleep(0.01)  # the step: the mount reads ahead meanwhile
print(json.dumps({"digest": digest.hexdigest(), "order": order}), flush=True)
"""


def test_read_ahead_follows_the_group_order_within_its_bounds(mount, tmp_path: Path) -> None:
    src, files, total = _source(tmp_path)
    m = mount(src, "--cache-size", "0", "--window-size", "64M", "--prefetch-depth", "2")
    out = subprocess.run([sys.executable, "-c", ORDERED_JOB, str(m.mountpoint), "g", *files],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["digest"] == _digest(src, result["order"])
    status = m.status()
    prefetch = status["prefetch"]
    assert prefetch["files"] > len(files) // 2  # most items were read ahead of the job
    assert 0 < prefetch["most_in_flight"] <= 2
    assert status["reads"]["bytes_from_source"] == total  # each item once: ahead, or by the job
    assert status["read_window"]["hits"] >= prefetch["files"] - 2


def test_read_ahead_fills_the_cache_while_it_has_room(mount, tmp_path: Path) -> None:
    src, files, total = _source(tmp_path)
    m = mount(src, "--cache-size", "1G", "--prefetch-depth", "4")
    out = subprocess.run([sys.executable, "-c", ORDERED_JOB, str(m.mountpoint), "g", *files],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["digest"] == _digest(src, json.loads(out.stdout)["order"])
    status = m.status()
    assert status["cache"]["bytes"] == total
    assert status["reads"]["bytes_from_source"] == total
    assert status["prefetch"]["files"] > 0 and status["read_window"]["used_bytes"] == 0


def test_bad_read_ahead_requests(mount, tmp_path: Path) -> None:
    src, files, _total = _source(tmp_path, 4)
    m = mount(src)
    control = Control(m.mountpoint)
    member = control.join_group("g")["member"]
    for args, message in (({"offset": 0, "total": 1, "paths": ["/etc/passwd"]}, "relative"),
                          ({"offset": 5, "total": 9, "paths": ["a"]}, "from offset 0"),
                          ({"offset": 0, "total": 1, "paths": ["a", "b"]}, "more than"),
                          ({"offset": 0, "total": 1, "paths": "a"}, '"paths" must be')):
        with pytest.raises(ControlError, match=message):
            control.request("group.files", member=member, **args)
    with pytest.raises(ControlError, match="no member 99"):
        control.start_epoch(99, 0)
    assert control.register_files(member, files)
    with pytest.raises(ControlError, match=f"has {len(files)} files"):
        control.request("group.files", member=member, offset=0, total=1, paths=["x"])
    assert m.status()["groups"]["g"]["files"] == len(files)
