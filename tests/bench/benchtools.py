"""What the benchmark tests do alike: a bench's default options, a small real run, a run
stopped the way a scheduler stops a job, and bad options that must be one-line errors."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BENCH = [sys.executable, "-m", "coordlfs", "bench"]


def defaults(add_arguments: Callable[[argparse.ArgumentParser], None],
             **overrides: object) -> argparse.Namespace:
    """A bench's options as parsed from nothing, with ``overrides`` set after parsing."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def small_run(name: str, work: Path, out: Path, *args: str) -> dict[str, Any]:
    """``coordlfs bench NAME --work WORK --json OUT ARGS``, which must succeed; its report."""
    result = subprocess.run([*BENCH, name, "--work", str(work), "--json", str(out), *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


@contextlib.contextmanager
def stopped_by_sigterm(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    """Run ``argv``; once the block has waited for the moment, SIGTERM it, as a scheduler
    stops a job. It must end as after Ctrl-C: status 130, "interrupted", no traceback."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and "interrupted" in err, err
    assert "Traceback" not in err


def assert_one_line_errors(name: str, work: Path, *bad: list[str]) -> None:
    """Each of the ``bad`` option lists makes ``coordlfs bench NAME`` fail in one line."""
    for args in bad:
        result = subprocess.run([*BENCH, name, "--work", str(work), *args],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode != 0
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
