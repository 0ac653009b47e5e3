"""A benchmark's jobs stopped on real processes: ``children.stop_group`` ends a job in a
session of its own and the worker it forked; ``hpsearch.Jobs.stop`` then removes what workers
now gone left in /dev/shm under their pids (a torch loader worker that ends between creating
a tensor's shared memory and unlinking it leaves ``torch_<pid>_...``, 19 MB), whether its job
was stopped or ended by itself, but not a file of another user, of a live process, or from
before the jobs started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from coordlfs.bench.children import SHM, stop_group
from coordlfs.bench.hpsearch import Jobs
from coordlfs.system.processes import process_alive

#: a job that forks a worker; the worker leaves shared memory named by its pid, as torch
#: names it, says its pid and sleeps (argv[2] "stay") or ends (else), as does the job
JOB = """
import json, os, sys, time
pid = os.fork()
if pid == 0:
    me = os.getpid()
    with open(f"{sys.argv[1]}/torch_{me}_4174248260_2", "wb") as f:
        f.write(b"x" * 4096)
    print(json.dumps({"worker": me}), flush=True)
    if sys.argv[2] == "stay":
        time.sleep(600)
    os._exit(0)
os.waitpid(pid, 0) if sys.argv[2] != "stay" else time.sleep(600)
"""


def _gone(pid: int) -> bool:
    for _ in range(200):  # SIGKILL is delivered, then the process goes
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_stopped_groups_worker_goes() -> None:
    job = subprocess.Popen([sys.executable, "-c", JOB, SHM, "stay"], stdout=subprocess.PIPE,
                           start_new_session=True, text=True)
    assert job.stdout is not None
    worker = json.loads(job.stdout.readline())["worker"]
    try:
        stop_group(job)
        assert job.returncode is not None
        assert _gone(worker)
    finally:
        Path(SHM, f"torch_{worker}_4174248260_2").unlink(missing_ok=True)
        job.stdout.close()


def _last_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _workers(jobs: Jobs) -> list[int]:
    """Each job's worker pid, in job order: the "end" job's output may end (an event of
    None) before the other job's worker speaks."""
    workers: dict[int, int] = {}
    while len(workers) < 2:
        index, event = jobs.next_event()
        if event is not None:
            workers[index] = event["worker"]
    return [workers[0], workers[1]]


def test_jobs_leave_no_shared_memory_of_their_workers(tmp_path: Path) -> None:
    before = Path(SHM, f"torch_{_last_pid()}_1_1")  # a dead process's, from before the jobs
    before.write_bytes(b"b")
    time.sleep(1.1)  # the jobs' start is a second later than the file's time
    jobs = Jobs([[sys.executable, "-c", JOB, SHM, mode] for mode in ("stay", "end")],
                [tmp_path / "stay.log", tmp_path / "end.log"])
    live = Path(SHM, f"torch_{os.getpid()}_1_1")  # a live process's
    live.write_bytes(b"l")
    left: list[Path] = []
    try:
        jobs.start()
        workers = _workers(jobs)
        left = [Path(SHM, f"torch_{w}_4174248260_2") for w in workers]
        theirs = Path(SHM, f"torch_{workers[1]}_2_2")  # another user's
        theirs.write_bytes(b"t")
        os.chown(theirs, 65534, 65534)
        left.append(theirs)
        assert jobs.processes[1].wait(30) == 0  # the "end" job ended by itself
        assert all(path.exists() for path in left)
        jobs.stop()
        assert all(_gone(w) for w in workers)
        assert not left[0].exists() and not left[1].exists()
        assert theirs.exists() and live.exists() and before.exists()
    finally:
        jobs.stop()  # again, harmless: a failed assertion above leaves no job running
        for path in (before, live, *left):
            path.unlink(missing_ok=True)
