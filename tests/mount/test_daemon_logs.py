"""The daemon's log is part of the result: its ERROR records fail a test unless it expects them."""

from __future__ import annotations

import collections
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordlfs.testbed.logs import log_size, logged_errors, warn_of_logged_errors

LOG = """\
2024-11-23 04:40:00,100 INFO coordlfs: mounted /src on /mnt
2024-11-23 04:40:01,200 ERROR coordlfs.fs.operations: read of a failed
Traceback (most recent call last):
  File "fs.py", line 1, in read
OSError: [Errno 5] Input/output error
2024-11-23 04:40:02,300 WARNING coordlfs.peers.links: peer 10.0.0.2 refused; an ERROR in a message
2024-11-23 04:40:03,400 CRITICAL coordlfs: giving up
2024-11-23 04:40:04,500 INFO coordlfs: unmounted
"""


def test_error_records_come_with_their_traceback(tmp_path: Path) -> None:
    log = tmp_path / "mount.log"
    log.write_text(LOG)
    errors = logged_errors(log)
    assert [e.splitlines()[0][24:] for e in errors] == [
        "ERROR coordlfs.fs.operations: read of a failed", "CRITICAL coordlfs: giving up"]
    assert errors[0].endswith("OSError: [Errno 5] Input/output error")
    assert logged_errors(tmp_path / "none.log") == []


def test_only_the_records_after_an_offset_count(tmp_path: Path) -> None:
    """A bench appends every mount to one log: each mount answers for its own records."""
    log = tmp_path / "mount.log"
    log.write_text(LOG)
    offset = log_size(log)
    assert logged_errors(log, offset) == []
    with open(log, "a") as f:
        f.write("2024-11-23 05:00:00,000 ERROR coordlfs.cache.cache: fill of b failed\n")
    assert [e[24:] for e in logged_errors(log, offset)] == \
        ["ERROR coordlfs.cache.cache: fill of b failed"]


def test_a_bench_warns_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "mount.log"
    warn_of_logged_errors(log, 0)
    assert capsys.readouterr().err == ""
    log.write_text(LOG)
    warn_of_logged_errors(log, 0)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: the coordlfs daemon logged 2 error")
    assert "read of a failed" in err and str(log) in err


TEST_FILE = '''
import pytest

RECORD = "2024-11-23 04:40:01,200 ERROR coordlfs.fs.operations: read of a failed\\n"


def _log(tmp_path, daemon_logs):
    log = tmp_path / "mount.log"
    log.write_text(RECORD)
    daemon_logs.append(log)


def test_unexpected(tmp_path, daemon_logs):
    _log(tmp_path, daemon_logs)


@pytest.mark.expect_log_errors
def test_expected(tmp_path, daemon_logs):
    _log(tmp_path, daemon_logs)


@pytest.mark.expect_log_errors("read of .* failed")
def test_expected_by_pattern(tmp_path, daemon_logs):
    _log(tmp_path, daemon_logs)


@pytest.mark.expect_log_errors("peer")
def test_other_than_expected(tmp_path, daemon_logs):
    _log(tmp_path, daemon_logs)


def test_default_log_directory(daemon_logs):
    """A daemon mounted without --log writes under $XDG_STATE_HOME, which is checked."""
    import os
    from pathlib import Path

    state = Path(os.environ["XDG_STATE_HOME"], "coordlfs")
    state.mkdir()
    (state / "mnt.log").write_text(RECORD)
'''


def test_the_suite_fails_a_test_whose_daemon_logged_an_unexpected_error(tmp_path: Path) -> None:
    """The rule itself, in a pytest of its own with this suite's conftest."""
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_logs.py").write_text(TEST_FILE)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-p", "no:warnings",
                             "-rfE", str(tmp_path / "test_logs.py")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    out = result.stdout
    assert "5 passed, 3 errors" in out, out  # each test's body passes, its log fails it
    failed = {line.split("::")[1].split()[0] for line in out.splitlines()
              if line.startswith("ERROR test_logs.py::")}
    assert failed == {"test_unexpected", "test_other_than_expected",
                      "test_default_log_directory"}, out
    # counted in the reports only: the short summary repeats them in full under CI=true
    reports = out.split("short test summary info")[0]
    assert reports.count("a daemon logged 1 unexpected ERROR record(s)") == 3, out
    assert "ERROR coordlfs.fs.operations: read of a failed" in out


def test_a_file_changing_again_and_again_is_warned_about_once_an_interval(
        tmp_path: Path, mount) -> None:
    """Each fill of a file rewritten all the time is refused (the source changed under it):
    said once, not once a refused fill (which came to ~270 lines a second); so is each
    line about its changes (INFO, ~1,100 a second)."""
    src = tmp_path / "src"
    src.mkdir()
    busy = src / "busy"
    busy.write_bytes(os.urandom(1 << 20))
    m = mount(src)
    deadline = time.monotonic() + 3
    writer = os.open(busy, os.O_WRONLY)
    try:
        while time.monotonic() < deadline:
            os.pwrite(writer, os.urandom(4096), random.randrange(0, 1 << 20, 4096))
            (m.mountpoint / "busy").read_bytes()
    finally:
        os.close(writer)
    said = collections.Counter(line.split(" ", 2)[2] for line in m.log.read_text().splitlines()
                               if "busy" in line)
    assert said and all(n == 1 for n in said.values()), said  # (the WARNING with passthrough)
