"""A daemon's log as part of a result: the ERROR records it holds since a given point.

An error the daemon logged means the mount misbehaved even when every read came back right
(a fill given up, a request that raised and became EIO behind a fallback): a test fails on
it, a benchmark warns of it beside its figures.
"""

from __future__ import annotations

import itertools
import os
import re
import sys

#: The start of a record the daemon logged at ERROR or worse, in the format of
#: ``coordlfs.daemon.daemon.setup_logging``:
#: "2024-11-23 04:40:00,123 ERROR coordlfs.fs.operations: ...".
ERROR_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?:ERROR|CRITICAL) ",
                          re.MULTILINE)
#: The start of any record, which ends the lines (a traceback) that continue the one before.
_ANY_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ", re.MULTILINE)


def logged_errors(log: str | os.PathLike[str], offset: int = 0) -> list[str]:
    """The ERROR and CRITICAL records in a daemon's log from byte ``offset`` on, each with the
    lines that continue it (a traceback); none if there is no log."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return []
    starts = [m.start() for m in _ANY_RECORD.finditer(text)] + [len(text)]
    return [text[a:b].rstrip("\n") for a, b in itertools.pairwise(starts)
            if ERROR_RECORD.match(text, a)]


def log_size(log: str | os.PathLike[str]) -> int:
    """Where a mount's records will start in a log that earlier mounts appended to."""
    try:
        return os.path.getsize(log)
    except FileNotFoundError:
        return 0


def warn_of_logged_errors(log: str | os.PathLike[str], offset: int, name: str = "coordlfs",
                          kept: bool = True) -> None:
    """One line on stderr if the daemon logged errors since ``offset``: the figures stand,
    but the mount misbehaved while they were taken. ``kept``: the log outlives the run."""
    errors = logged_errors(log, offset)
    if errors:
        first = errors[0].splitlines()[0]
        where = f"; see {log}" if kept else ""
        print(f"warning: the {name} daemon logged {len(errors)} error(s) during the bench "
              f"(first: {first}){where}", file=sys.stderr, flush=True)
