"""``coordlfs.bench.children.stop_group`` on real processes: a job in a session of its own and
the worker it forked go, and what the worker left in /dev/shm under its pid goes with it (a
torch loader worker killed between creating a tensor's shared memory and unlinking it leaves
``torch_<pid>_...``), but not another user's file of such a name."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from coordlfs.bench.children import SHM, stop_group

#: a job that forks a worker; the worker leaves shared memory named by its pid, as torch
#: names it, then prints its pid and sleeps, as does the job
JOB = """
import os, sys, time
pid = os.fork()
if pid == 0:
    me = os.getpid()
    with open(f"{sys.argv[1]}/torch_{me}_4174248260_2", "wb") as f:
        f.write(b"x" * 4096)
    print(me, flush=True)
    time.sleep(600)
time.sleep(600)
"""


def test_a_stopped_groups_workers_and_their_shared_memory_go() -> None:
    job = subprocess.Popen([sys.executable, "-c", JOB, SHM], stdout=subprocess.PIPE,
                           start_new_session=True, text=True)
    assert job.stdout is not None
    worker = int(job.stdout.readline())
    mine = Path(SHM) / f"torch_{worker}_4174248260_2"
    theirs = Path(SHM) / f"torch_{worker}_1_1"
    theirs.write_bytes(b"y")
    os.chown(theirs, 65534, 65534)
    try:
        assert mine.exists()
        stop_group(job)
        assert job.returncode is not None
        for _ in range(100):  # SIGKILL is delivered, the worker then goes
            if not Path(f"/proc/{worker}").exists():
                break
            time.sleep(0.05)
        assert not Path(f"/proc/{worker}").exists()
        assert not mine.exists()
        assert theirs.exists()  # another user's: left alone
    finally:
        for path in (mine, theirs):
            path.unlink(missing_ok=True)
        job.stdout.close()
