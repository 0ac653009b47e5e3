"""A Slurm job step of test_slurm: on its node, read the dataset through the node's coordlfs mount
(the prolog made it) and write what it read and the mount's status, or hold a file open until
the job is killed.

    slurm_job.py MOUNTPOINT-PATTERN OUT-DIR read|hold
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import digests

from coordlfs.control import Control


def main() -> None:
    pattern, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    node, job = os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_ID"]
    mountpoint = Path(pattern.replace("%j", job).replace("%n", node))
    if mode == "hold":
        with open(next(p for p in sorted(mountpoint.rglob("*")) if p.is_file()), "rb"):
            (out / f"{node}.holding").write_text(job)
            time.sleep(3600)  # until scancel kills it
        return
    found = {"job": job, "mountpoint": str(mountpoint), "digests": digests(mountpoint),
             "status": Control(mountpoint).status()}
    (out / f"{node}.json.part").write_text(json.dumps(found))
    (out / f"{node}.json.part").rename(out / f"{node}.json")


if __name__ == "__main__":
    main()
