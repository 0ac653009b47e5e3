"""A training job for the prep-sharing tests: a SharedPrepLoader over the mount's files.

    python prep_job.py MOUNTPOINT GROUP JOB EPOCHS [--batch N] [--workers N] [--min-members N]
                       [--step-ms MS] [--reuse R] [--hang-timeout S] [--stop-after N] [--client]

Each item is (index, a fresh random number, the file's size), so a test can check that every
job saw every batch of every epoch exactly once, that augmentations differ between epochs, and
that the bytes came through the mount (through its client, ``coordlfs.torch.raw_loader``, with
``--client``). One JSON line per epoch on stdout, then "done".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
from torch.utils.data import Dataset

from coordlfs.torch import SharedPrepLoader, raw_loader


class Files(Dataset):
    def __init__(self, root: str, client: bool) -> None:
        self.root, self.client = root, client
        self.files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[int, float, int]:
        if self.client:
            return i, random.random(), len(raw_loader(self.files[i]))
        with open(self.files[i], "rb") as f:
            size = len(f.read())
        return i, random.random(), size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mountpoint")
    parser.add_argument("group")
    parser.add_argument("job")
    parser.add_argument("epochs", type=int)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--min-members", type=int, default=1)
    parser.add_argument("--step-ms", type=float, default=0)
    parser.add_argument("--reuse", type=int, default=1)
    parser.add_argument("--hang-timeout", type=float)
    parser.add_argument("--stop-after", type=int, help="stop (SIGSTOP self) after N batches")
    parser.add_argument("--client", action="store_true", help="read through the client")
    args = parser.parse_args()
    data = Files(args.mountpoint, args.client)
    loader = SharedPrepLoader(data, batch_size=args.batch, group=args.group,
                              path=args.mountpoint, job=args.job, num_workers=args.workers,
                              min_members=args.min_members, hang_timeout=args.hang_timeout,
                              reuse=args.reuse)
    seen = 0
    for epoch in range(args.epochs):
        batches = []
        for index, augment, size in loader:
            batches.append({"items": index.tolist(), "augment": augment.tolist(),
                            "bytes": int(size.sum())})
            seen += 1
            if args.stop_after is not None and seen == args.stop_after:
                print(json.dumps({"stopping": True}), flush=True)
                os.kill(os.getpid(), 19)  # SIGSTOP: hang, as a stuck job would
            time.sleep(args.step_ms / 1000)
        print(json.dumps({"epoch": epoch, "batches": batches, "prepared": loader.prepared,
                          "prepared_alone": loader.prepared_alone,
                          "shared": loader.shared}), flush=True)
    loader.close()
    print("done", flush=True)
    torch.set_num_threads(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
