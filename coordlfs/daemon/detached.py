"""The daemon process ``coordlfs mount`` starts in the background (``mounting.spawn_daemon``).

It gets its ``MountConfig`` as JSON on stdin, the values its parent resolved and printed, so
that no option is parsed or resolved twice, and reports on the pipe ``READY_FD`` once the mount
is live (``ok NOTE``) or why it could not mount (``error MESSAGE``)::

    python -m coordlfs.daemon.detached READY_FD SOURCE MOUNTPOINT < config.json

SOURCE and MOUNTPOINT are not read: they are there so that ``ps`` shows which daemon serves
which mount.
"""

from __future__ import annotations

import os
import sys

from coordlfs.daemon.config import MountConfig
from coordlfs.daemon.daemon import Daemon, setup_logging
from coordlfs.errors import UserError, exit_status


def main(ready_fd: int) -> int:
    config = MountConfig.from_json(sys.stdin.read())
    ready = os.fdopen(ready_fd, "w")

    def report(line: str) -> None:
        ready.write(line + "\n")
        ready.close()

    try:
        setup_logging(config.log_file, config.debug)
        Daemon(config).run(lambda note: report(f"ok {note}"))
    except UserError as e:
        if ready.closed:  # failed after the mount went live: the log says why
            raise
        report(f"error {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(exit_status("coordlfs", lambda: main(int(sys.argv[1]))))
