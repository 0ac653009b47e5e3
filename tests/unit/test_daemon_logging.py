"""What the daemon's log says of pyfuse3's own records."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from coordlfs.daemon.daemon import RepeatedRecords, setup_logging
from coordlfs.errors import UserError


def test_a_reply_the_kernel_no_longer_waits_for_is_no_error(tmp_path: Path) -> None:
    """Found by the suite: a release the kernel sent in the background, answered just after a
    lazy unmount, logged "ERROR pyfuse3: fuse_release(): fuse_reply_* failed with No such file
    or directory" and failed the test whose teardown unmounted; and so did a name invalidation
    submitted after the session was closed. Other errors stay errors."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    log_file = tmp_path / "daemon.log"
    try:
        setup_logging(str(log_file), debug=False)
        pyfuse3_log = logging.getLogger("pyfuse3")
        pyfuse3_log.error("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
        pyfuse3_log.error("fuse_read(): fuse_reply_* failed with %s", os.strerror(errno.EIO))
        for number, gone in ((errno.EINVAL, b"late"), (errno.EIO, b"real")):
            try:  # as pyfuse3's notify thread logs a name it could not invalidate
                raise OSError(number, "fuse_lowlevel_notify_inval_entry returned")
            except OSError:
                pyfuse3_log.exception("Failed to submit invalidate_entry request for parent "
                                      "inode %d, name %s", 1, gone)
        for handler in root.handlers:
            handler.flush()
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    lines = log_file.read_text().splitlines()
    assert any(" INFO pyfuse3: fuse_release(): " in line for line in lines), lines
    assert any(" ERROR pyfuse3: fuse_read(): " in line for line in lines), lines
    # found by the suite: a source change watched just before an unmount, its invalidation
    # submitted once the session was closed (EINVAL), failed a test by its log
    assert any(" INFO pyfuse3: Failed to submit" in line and "b'late'" in line
               for line in lines), lines
    assert any(" ERROR pyfuse3: Failed to submit" in line and "b'real'" in line
               for line in lines), lines
    assert sum("Traceback" in line for line in lines) == 1, lines


def test_a_log_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    """A predictable log name in a directory others can write: a link there must not make the
    daemon (root) append to a file of the other user's choosing."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep\n")
    (tmp_path / "daemon.log").symlink_to(victim)
    with pytest.raises(UserError, match=r"cannot write the log file .*daemon.log: Too many levels"):
        setup_logging(str(tmp_path / "daemon.log"), debug=False)
    assert victim.read_bytes() == b"keep\n"


@pytest.mark.parametrize("planted", ["other user's", "second name"])
def test_a_log_file_not_ours_alone_is_refused_and_untouched(tmp_path: Path,
                                                            planted: str) -> None:
    """The same place, without a link: a file another user made there would get root's log
    (theirs to read), and a second name of a root file (a hard link) would get it appended."""
    log_file = tmp_path / "daemon.log"
    if planted == "other user's":
        log_file.write_bytes(b"keep\n")
        os.chown(log_file, 65534, 65534)
        victim = log_file
    else:
        victim = tmp_path / "victim"
        victim.write_bytes(b"keep\n")
        os.link(victim, log_file)
    with pytest.raises(UserError, match=r"cannot use the log file .*daemon.log: it (is owned "
                                        r"by uid 65534|has 2 names)"):
        setup_logging(str(log_file), debug=False)
    assert victim.read_bytes() == b"keep\n"


def _record(level: int, message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("coordlfs.cache.cache", level, __file__, 1, message, args, None)


def test_a_repeated_line_is_written_once_an_interval_with_the_count_held_back() -> None:
    now = [0.0]
    repeated = RepeatedRecords(interval=30.0, clock=lambda: now[0])
    refused = ("caching %s failed: %s", "busy", "source file changed while being cached")

    def written(level: int, message: str, *args: object) -> str | None:
        record = _record(level, message, *args)
        return record.getMessage() if repeated.filter(record) else None

    assert written(logging.WARNING, *refused) == (
        "caching busy failed: source file changed while being cached")
    for _ in range(269):
        now[0] += 0.1
        assert written(logging.WARNING, *refused) is None
    assert written(logging.WARNING, "caching %s failed: %s", "other", "changed") is not None
    assert written(logging.INFO, "source file %s changed", "busy") is not None  # a cause apart
    now[0] = 31.0
    assert written(logging.WARNING, *refused) == (
        "caching busy failed: source file changed while being cached (269 more like it held "
        "back over 31 s)")
    assert written(logging.WARNING, *refused) is None
    assert all(written(logging.ERROR, "fill of %s failed", "busy") for _ in range(3))
    assert all(written(logging.DEBUG, "looked up %s", "busy") for _ in range(3))
