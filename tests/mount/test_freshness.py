"""The source changes while mounted: each change shows through the mount without a remount.

Each test reproduces a case where the mount once served stale names, attributes or bytes
for up to an hour (or until a remount). The kernel is told by inotify, so a change shows
within a second; the tests wait up to ``DEADLINE`` so that a busy machine cannot fail them,
which still tells an hour from a second.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import OTHER_UID, digests, run_cli

#: How long a change may take to show before the test fails (the target is 1 s).
DEADLINE = 10.0
#: How long after a chmod in the source another user may still open the file: the watcher's
#: latency (a few ms, measured in docs/design/security.md), with room for a loaded machine.
PERMISSION_WINDOW_S = 0.5


def eventually(check: Callable[[], bool], what: str) -> float:
    """Seconds until ``check()`` holds; fails the test after ``DEADLINE``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > DEADLINE:
            pytest.fail(f"{what}: not seen through the mount after {DEADLINE:.0f} s")
        time.sleep(0.02)
    return time.monotonic() - start


def exists(path: Path) -> bool:
    try:
        os.lstat(path)
        return True
    except FileNotFoundError:
        return False


def rewrite_keeping_size_and_mtime(path: Path, data: bytes) -> None:
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"A" * 5000)
    (src / "d" / "x.bin").write_bytes(os.urandom(7000))
    return src


def test_a_file_added_after_a_failed_lookup_shows(src: Path, mount) -> None:
    m = mount(src)
    new = m.mountpoint / "new.bin"
    assert not exists(new)  # the kernel now holds a negative entry
    (src / "new.bin").write_bytes(b"fresh")
    eventually(lambda: exists(new), "a new file")
    assert new.read_bytes() == b"fresh"
    assert "new.bin" in os.listdir(m.mountpoint)


def test_a_rewrite_in_place_with_size_and_mtime_put_back_is_served_new(src: Path,
                                                                        mount) -> None:
    m = mount(src)
    assert (m.mountpoint / "a.bin").read_bytes() == b"A" * 5000  # cached, and in the kernel
    rewrite_keeping_size_and_mtime(src / "a.bin", b"B" * 5000)
    eventually(lambda: (m.mountpoint / "a.bin").read_bytes() == b"B" * 5000, "a rewrite")
    assert m.settled()["cache"]["files"] == 1  # the old entry was dropped, the new one cached


def test_a_replacement_by_rename_with_size_and_mtime_put_back_is_served_new(src: Path,
                                                                             mount) -> None:
    m = mount(src)
    assert (m.mountpoint / "a.bin").read_bytes() == b"A" * 5000
    old = (src / "a.bin").stat()
    (src / "tmp").write_bytes(b"C" * 5000)
    os.utime(src / "tmp", ns=(old.st_atime_ns, old.st_mtime_ns))
    os.rename(src / "tmp", src / "a.bin")
    eventually(lambda: (m.mountpoint / "a.bin").read_bytes() == b"C" * 5000,
               "a replacement by rename")


def test_stat_shows_an_append_and_a_deletion(src: Path, mount) -> None:
    m = mount(src)
    path = m.mountpoint / "a.bin"
    assert path.stat().st_size == 5000
    with open(src / "a.bin", "ab") as f:
        f.write(b"more")
    eventually(lambda: path.stat().st_size == 5004, "an append")
    (src / "a.bin").unlink()
    eventually(lambda: not exists(path), "a deletion")


def test_a_renamed_directory_serves_its_files_under_the_new_name(src: Path, mount) -> None:
    m = mount(src)
    want = (src / "d" / "x.bin").read_bytes()
    assert (m.mountpoint / "d" / "x.bin").read_bytes() == want  # the kernel holds d and d/x
    os.rename(src / "d", src / "e")
    eventually(lambda: exists(m.mountpoint / "e" / "x.bin"), "a renamed directory")
    assert (m.mountpoint / "e" / "x.bin").read_bytes() == want
    assert os.listdir(m.mountpoint / "e") == ["x.bin"]
    assert not exists(m.mountpoint / "d")
    assert digests(m.mountpoint) == digests(src)


def test_a_source_that_cannot_be_watched_is_revalidated(src: Path, mount) -> None:
    inner = mount(src)  # a FUSE filesystem: inotify would not see changes made elsewhere
    outer = mount(inner.mountpoint, "--revalidate", "0.5")
    freshness = outer.status()["freshness"]
    assert freshness["mode"] == "revalidate" and freshness["interval_s"] == 0.5
    assert "fuse.coordlfs" in freshness["reason"]
    assert "not watching the source" in outer.log.read_text()
    assert inner.status()["freshness"]["mode"] == "watch"
    assert not exists(outer.mountpoint / "late.bin")
    (src / "late.bin").write_bytes(b"late")
    eventually(lambda: exists(outer.mountpoint / "late.bin"), "a new file (revalidated)")
    assert (outer.mountpoint / "late.bin").read_bytes() == b"late"


def test_revalidate_out_of_range_is_one_line(tmp_path: Path, src: Path) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    result = run_cli("mount", str(src), str(mp), "--revalidate", "0")
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "--revalidate" in result.stderr


def test_an_open_descriptor_keeps_its_view_and_reads_never_fail(src: Path, mount) -> None:
    m = mount(src)
    with open(m.mountpoint / "a.bin", "rb") as f:
        first = f.read(100)
        rewrite_keeping_size_and_mtime(src / "a.bin", b"D" * 5000)
        rest = f.read()
    assert first == b"A" * 100 and len(rest) == 4900
    eventually(lambda: (m.mountpoint / "a.bin").read_bytes() == b"D" * 5000, "a rewrite")
    with pytest.raises(OSError) as e:
        os.open(m.mountpoint / "a.bin", os.O_WRONLY)
    assert e.value.errno == errno.EROFS


#: A reader as ``OTHER_UID`` (the system's python: a checkout's virtualenv may be closed to
#: it): reads FILE in DIRECTORY (by its path, or by name from DIRECTORY as its working
#: directory) in a loop for SECONDS, says "reading" after its first read, and prints the
#: CLOCK_MONOTONIC start of its last read that succeeded and of its first one refused.
PERMISSION_READER = """
import os, sys, time
directory, name, how, seconds = sys.argv[1:]
if how == "cwd":
    os.chdir(directory)
path = name if how == "cwd" else os.path.join(directory, name)
until, last_read, first_refused = time.monotonic() + float(seconds), None, None
while time.monotonic() < until:
    started = time.monotonic()
    try:
        with open(path, "rb") as f:
            f.read()
    except PermissionError:
        first_refused = first_refused or started
        continue
    if last_read is None:
        print("reading", flush=True)
    last_read = started
print(last_read, first_refused, flush=True)
"""


def refused_after(directory: Path, name: str, how: str, change: Callable[[], None]) -> float:
    """Seconds from the end of ``change()`` (made while ``OTHER_UID`` reads) until the reader
    was refused for good: the start of its last read that still succeeded, after it."""
    reader = subprocess.Popen(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
         "/usr/bin/python3", "-c", PERMISSION_READER, str(directory), name, how, "3"],
        cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert reader.stdout is not None and reader.stdout.readline() == "reading\n", \
        reader.communicate()
    time.sleep(0.3)
    change()
    changed = time.monotonic()
    out, err = reader.communicate(timeout=30)
    last_read, first_refused = (None if v == "None" else float(v) for v in out.split())
    assert first_refused is not None, f"never refused ({how}): {err}"
    assert last_read is None or last_read < first_refused  # refused for good once refused
    return max(0.0, (last_read or 0.0) - changed)


@pytest.mark.parametrize(("what", "how", "mode"), [
    ("d/x.bin", "path", 0o600),  # a file closed to others
    ("d", "path", 0o700),  # a directory closed to others, walked into by path
    ("d", "cwd", 0o700),  # the same, walked from inside it (the kernel holds the directory)
])
def test_a_permission_change_reaches_other_users_at_once(
        src: Path, reachable: Path, mount, what: str, how: str, mode: int) -> None:
    """``chmod`` in the source while another user reads through an ``--allow-other`` mount:
    the kernel's cached attributes of the inode are dropped when the watcher sees the change,
    so the next open is checked against the new mode. Before, the kernel kept the old mode
    until the watcher's batch (50 ms) invalidated the name, and a reader that held the
    directory (its working directory) read on for the attribute timeout (an hour)."""
    (src / "d").chmod(0o755)
    (src / "d" / "x.bin").chmod(0o644)
    m = mount(src, "--allow-other", mountpoint=reachable / "mnt")
    window = refused_after(m.mountpoint / "d", "x.bin", how, lambda: (src / what).chmod(mode))
    print(f"{what} chmod {mode:o} ({how}): refused {window * 1000:.1f} ms after")
    assert window < PERMISSION_WINDOW_S, window
