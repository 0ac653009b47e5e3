"""SharedPrepLoader on a real mount: jobs are real processes (tests/mount/prep_job.py) that read the
mount's files in DataLoader workers and share their batches through the staging area."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import make_dataset, run_cli

from coordlfs.client.shared_prep import _Channel
from coordlfs.control import Control, ControlError
from coordlfs.protocol import spec
from coordlfs.torch import SharedPrepLoader

JOB = str(Path(__file__).with_name("prep_job.py"))


@pytest.fixture
def mounted(mount, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    make_dataset(src, 60)
    # every file the jobs' dataset lists (the generator's manifest too), by path
    sizes = {p: p.stat().st_size for p in src.rglob("*") if p.is_file()}

    def _mounted(*options: str):
        return mount(src, *options), sizes

    return _mounted


class Jobs:
    """Job processes, each in its own session; killed by pid whatever the test did."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, mountpoint: Path, group: str, job: str, epochs: int, *args: str):
        proc = subprocess.Popen([sys.executable, JOB, str(mountpoint), group, job, str(epochs),
                                 *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        self.procs.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen, timeout: float = 90) -> list[dict]:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err
        assert out.rstrip().endswith("done"), out + err
        return [json.loads(line) for line in out.splitlines() if line.startswith('{"epoch"')]

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                kill_job(proc)


@pytest.fixture
def jobs():
    made = Jobs()
    yield made
    made.stop_all()


def items_of(epoch: dict) -> list[int]:
    return [i for batch in epoch["batches"] for i in batch["items"]]


def assert_clean(m) -> None:
    status = m.status()["prep"]
    assert status["groups"] == {} and status["staging"]["used_bytes"] == 0
    directory = status["staging"]["directory"]
    assert not os.path.exists(directory) or os.listdir(directory) == []


def test_jobs_share_every_batch_exactly_once_per_epoch(mounted, jobs) -> None:
    m, sizes = mounted()
    n, epochs = len(sizes), 3
    procs = [jobs.start(m.mountpoint, "hp", f"job{k}", epochs, "--min-members", "3",
                        "--workers", "1", "--batch", "8") for k in range(3)]
    results = [jobs.finish(p) for p in procs]
    per_epoch_batches = -(-n // 8)
    for result in results:
        assert [e["epoch"] for e in result] == list(range(epochs))
        for epoch in result:
            assert sorted(items_of(epoch)) == list(range(n))  # every item once
            assert len(epoch["batches"]) == per_epoch_batches
            assert sum(b["bytes"] for b in epoch["batches"]) == sum(sizes.values())
            assert epoch["shared"] and epoch["prepared_alone"] == 0
    # every job saw the same batches (the same augmentation values) in an epoch...
    for e in range(epochs):
        keys = [sorted(tuple(b["augment"]) for b in r[e]["batches"]) for r in results]
        assert keys[0] == keys[1] == keys[2]
    # ...fresh ones each epoch, and each batch was prepared once for the group
    first = {a for b in results[0][0]["batches"] for a in b["augment"]}
    second = {a for b in results[0][1]["batches"] for a in b["augment"]}
    assert not first & second
    assert sum(r[-1]["prepared"] for r in results) == per_epoch_batches * epochs
    staging = m.status()["prep"]["staging"]
    assert staging["published"] == staging["released"] == per_epoch_batches * epochs
    assert_clean(m)


def test_jobs_reading_through_the_client_share_every_item(mounted, jobs) -> None:
    """Items read through the client (coordlfs.torch.raw_loader in the jobs' workers): each
    once per epoch for the group, every byte there, and the workers' counts at the mount."""
    m, sizes = mounted()
    n, epochs = len(sizes), 2
    procs = [jobs.start(m.mountpoint, "hp", f"job{k}", epochs, "--min-members", "2",
                        "--batch", "8", "--client") for k in range(2)]
    results = [jobs.finish(p) for p in procs]
    for result in results:
        for epoch in result:
            assert sorted(items_of(epoch)) == list(range(n))
            assert sum(b["bytes"] for b in epoch["batches"]) == sum(sizes.values())
            assert epoch["shared"] and epoch["prepared_alone"] == 0
    reads = m.status()["reads"]
    assert reads["client_hits"] + reads["client_misses"] == n * epochs  # prepared once each
    assert reads["client_hits"] >= n  # the second epoch at least: all cached by then
    assert_clean(m)


def test_a_killed_member_is_taken_over_and_nothing_is_left(mounted, jobs) -> None:
    m, sizes = mounted()
    n = len(sizes)
    victim = jobs.start(m.mountpoint, "hp", "victim", 3, "--min-members", "3", "--batch", "4",
                        "--step-ms", "20")
    others = [jobs.start(m.mountpoint, "hp", f"job{k}", 3, "--min-members", "3", "--batch",
                         "4", "--step-ms", "5") for k in range(2)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until the epoch is under way
        group = m.status()["prep"]["groups"].get("hp")
        if group and group["epoch"] and group["epoch"]["released"] >= 2:
            break
        time.sleep(0.02)
    else:
        pytest.fail("the group never got going")
    kill_job(victim)
    for proc in others:
        for epoch in jobs.finish(proc):
            assert Counter(items_of(epoch)) == Counter(range(n))
    assert_clean(m)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL to a job's process group, and the shared memory torch leaves behind for
    processes killed outright (``/dev/shm/torch_PID_*``) removed."""
    group = _process_group(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in group:
        for leftover in Path("/dev/shm").glob(f"torch_{pid}_*"):
            leftover.unlink(missing_ok=True)


def _process_group(pgid: int) -> list[int]:
    """The pids of a process group (a job and its DataLoader workers)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


def test_a_hung_member_is_expelled_and_finishes_alone(mounted, jobs) -> None:
    m, sizes = mounted()
    n = len(sizes)
    args = ("--min-members", "2", "--batch", "4", "--hang-timeout", "1")
    hung = jobs.start(m.mountpoint, "hp", "hung", 2, *args, "--stop-after", "3")
    fine = jobs.start(m.mountpoint, "hp", "fine", 2, *args, "--step-ms", "10")
    for epoch in jobs.finish(fine):
        assert Counter(items_of(epoch)) == Counter(range(n))
    assert m.status()["prep"]["staging"]["expelled"] == 1
    os.kill(hung.pid, signal.SIGCONT)
    result = jobs.finish(hung)
    assert Counter(items_of(result[0])) == Counter(range(n))  # finished its epoch alone
    assert result[0]["prepared_alone"] > 0
    assert Counter(items_of(result[1])) == Counter(range(n))
    assert_clean(m)


def test_the_staging_bound_holds(mounted, jobs) -> None:
    m, sizes = mounted("--staging-size", "700")  # two batches of 4 items (320 bytes each)
    procs = [jobs.start(m.mountpoint, "hp", f"job{k}", 2, "--min-members", "2", "--batch", "4",
                        "--step-ms", str(5 * k)) for k in range(2)]
    for proc in procs:
        for epoch in jobs.finish(proc):
            assert sorted(items_of(epoch)) == list(range(len(sizes)))
    staging = m.status()["prep"]["staging"]
    assert staging["full"] > 0  # producers did wait
    assert 0 < staging["peak_bytes"] <= 700
    assert_clean(m)
    shown = run_cli("stats", str(m.mountpoint))
    assert shown.returncode == 0 and f"{staging['published']} batches published" in shown.stdout


def test_reuse_yields_each_batch_r_times(mounted, jobs) -> None:
    m, sizes = mounted()
    result = jobs.finish(jobs.start(m.mountpoint, "hp", "solo", 1, "--batch", "8", "--reuse",
                                    "3"))
    batches = result[0]["batches"]
    assert len(batches) == 3 * -(-len(sizes) // 8)
    assert Counter(items_of(result[0])) == Counter({i: 3 for i in range(len(sizes))})
    assert result[0]["prepared"] == -(-len(sizes) // 8)


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return i


def test_without_a_mount_it_loads_alone_with_a_warning(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="not on a coordlfs mount"):
        loader = SharedPrepLoader(Numbers(), batch_size=4, group="g", path=tmp_path)
    assert not loader.shared and len(loader) == 3
    for _ in range(2):
        assert sorted(int(i) for batch in loader for i in batch) == list(range(10))
    assert loader.prepared == 0 and loader.prepared_alone == 6


def test_a_refused_join_loads_alone_with_a_warning(mounted) -> None:
    m, _sizes = mounted()
    with pytest.warns(UserWarning, match="cannot join prep group"):
        loader = SharedPrepLoader(Numbers(), batch_size=4, group="bad\nname", path=m.mountpoint)
    assert not loader.shared
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not every epoch
        for _ in range(2):
            assert sorted(int(i) for batch in loader for i in batch) == list(range(10))


def test_a_batch_no_batch_file_can_carry_is_prepared_alone_with_a_warning(mounted) -> None:
    """A sparse batch has no plain bytes to stage (and is never pickled): the job leaves the
    group and prepares the epoch itself, every item once."""
    m, _sizes = mounted()
    loader = SharedPrepLoader(Numbers(), batch_size=4, group="odd", path=m.mountpoint,
                              collate_fn=lambda items: torch.tensor(items).to_sparse())
    assert loader.shared
    with pytest.warns(UserWarning, match=r"cannot stage batch \d+: it holds a "
                      r"torch.sparse_coo tensor; this job prepares the rest"):
        items = sorted(int(i) for batch in loader for i in batch.to_dense())
    assert items == list(range(10)) and loader.prepared_alone == 3
    assert_clean(m)


def test_malformed_prep_commands_leave_the_mount_up(mounted) -> None:
    m, _sizes = mounted()
    ctl = Control(m.mountpoint)
    for request in ({"cmd": "prep.join", "group": "g", "pid": os.getpid(), "samples": -1,
                     "batch_size": 1},
                    {"cmd": "prep.next", "member": 12345},
                    {"cmd": "prep.reserve", "member": "x", "batch": 0, "bytes": 1}):
        with pytest.raises(ControlError):
            ctl.request(**request)
    fd = os.open(m.mountpoint / ".coordlfs", os.O_RDWR)
    try:
        with pytest.raises(OSError) as refused:
            os.write(fd, b'{"cmd": "prep.publish", "member": 1, "batch": "zero"}\n')
        assert refused.value.errno == 22
        assert b'"batch\\" must be an integer' in os.read(fd, 4096)
    finally:
        os.close(fd)
    assert ctl.status()["prep"]["groups"] == {}


def test_bad_staging_size_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    for size in ("0", "lots", "-5M"):
        result = run_cli("mount", str(tmp_path), str(tmp_path / "mnt"), "--staging-size", size)
        assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1
        assert "staging-size" in result.stderr and "Traceback" not in result.stderr


def test_a_waiting_request_blocks_only_its_reader(mounted) -> None:
    """``prep.epoch`` waits in the mount (no polling) until the group can start: meanwhile the
    mount answers other requests and reads; the second member's ask answers both at once."""
    m, sizes = mounted()
    control = m.control
    join = {"group": "g", "pid": os.getpid(), "samples": 4, "batch_size": 2, "min_members": 2}
    first = control.call(spec.PREP_JOIN, **join)["member"]
    answers: list[tuple[dict, float]] = []
    start = time.monotonic()
    waiter = threading.Thread(target=lambda: answers.append(
        (control.call(spec.PREP_EPOCH, member=first, timeout_s=5), time.monotonic() - start)))
    waiter.start()
    time.sleep(0.3)
    assert control.status()["control"]["waiting"] == 1
    path, size = next(iter(sizes.items()))
    assert len((m.mountpoint / path.relative_to(m.source)).read_bytes()) == size
    second = control.call(spec.PREP_JOIN, **join)["member"]
    assert control.call(spec.PREP_EPOCH, member=second)["epoch"] == 0
    waiter.join(timeout=5)
    (reply, seconds), = answers
    assert reply["epoch"] == 0 and 0.3 <= seconds < 2
    assert control.status()["control"]["waiting"] == 0


def test_a_channel_keeps_its_descriptor_across_requests_and_refusals(mounted) -> None:
    """The loader's requests go over one descriptor each thread (a write and a read each); a
    refused request's message comes back and the descriptor still serves; one interrupted
    mid-request is closed, so no stale reply answers the next."""
    m, _sizes = mounted()
    channel = _Channel(str(m.mountpoint))
    try:
        assert channel.call(spec.PREP_LIST)["groups"] == {}
        fd = channel._fd
        with pytest.raises(ControlError, match="no prep member 12345"):
            channel.call(spec.PREP_LEAVE, member=12345)
        assert channel.call(spec.PREP_LIST)["ok"] and channel._fd == fd
        with mock.patch("coordlfs.client.shared_prep.os.read", side_effect=KeyboardInterrupt), \
                pytest.raises(KeyboardInterrupt):
            channel.call(spec.PREP_LIST)
        assert channel._fd is None
        assert channel.call(spec.PREP_LIST)["groups"] == {}
    finally:
        channel.close()
