"""``coordlfs warm`` on real mounts (issue 25, item 3): the cache filled in the order given
(a list, or a seed's epoch), up to its capacity with what did not fit said in one line, a
second run reading nothing it has, Ctrl-C dropping the rest at the mount, the progress bar
on a terminal, an epoch after a warm without a miss, and a one-line error for every bad
path or argument."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    COORDLFS,
    OTHER_UID,
    Mount,
    drop_caches,
    force_unmount,
    make_dataset,
    run_cli,
)
from test_control_security import as_user

from coordlfs import cli
from coordlfs.client import warm  # noqa: F401  (loaded for _cli, which cli loads lazily)
from coordlfs.protocol.order import epoch_order
from coordlfs.sizes import format_size, pages
from coordlfs.testbed.cgroup import memory_cgroup

#: Seconds a warm of these small datasets may take, at most.
WARM_S = 120


def walked(root: Path) -> list[str]:
    """The files under ``root`` in the order warm walks them: depth first, by name (the
    generated names hold no character that sorts before "/", so a sort of the paths)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def warm_json(*args: str, **kwargs: Any) -> dict[str, Any]:
    result = run_cli("warm", "--json", *args, timeout=WARM_S, **kwargs)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def greedy(order: list[str], sizes: dict[str, int], capacity: int) -> list[str]:
    """What the cache holds after filling ``order`` one file at a time: each that still fits."""
    used, kept = 0, []
    for name in order:
        if used + pages(sizes[name]) <= capacity:
            used += pages(sizes[name])
            kept.append(name)
    return kept


def reads(m: Mount) -> dict[str, int]:
    return m.status()["reads"]


def read_all(m: Mount, names: list[str]) -> None:
    for name in names:
        (m.mountpoint / name).read_bytes()


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """200 image-sized files in class folders, and the generator's manifest."""
    root = tmp_path / "data"
    root.mkdir()
    make_dataset(root, 200)
    return root, {name: (root / name).stat().st_size for name in walked(root)}


@pytest.mark.parametrize("order", ["seed", "list"])
def test_the_cache_fills_in_the_order_given_up_to_its_capacity(mount, source, tmp_path: Path,
                                                               order: str) -> None:
    """One fill worker, a cache for about a third: what it holds is exactly what filling the
    files one by one in the order given keeps (a seed's epoch of the walked tree, or a list in
    reverse), and the rest is said not to fit."""
    root, sizes = source
    capacity = sum(pages(s) for s in sizes.values()) // 3
    m = mount(root, "--cache-size", str(capacity), "--fill-depth", "1")
    names = walked(root)
    if order == "seed":
        wanted = [names[i] for i in epoch_order(12345, 2, len(names))]
        summary = warm_json(str(m.mountpoint), "--order", "12345:2")
    else:
        wanted = names[::-1]
        listing = tmp_path / "list"
        listing.write_text("".join(f"{m.mountpoint / n}\n" for n in wanted))
        summary = warm_json("--from-file", str(listing))
    kept = greedy(wanted, sizes, capacity)
    rest = [n for n in names if n not in kept]
    assert summary["files"] == len(kept)
    assert summary["bytes"] == sum(sizes[n] for n in kept)
    assert summary["did_not_fit"] == {"files": len(rest),
                                      "bytes": sum(sizes[n] for n in rest)}
    assert summary["listed_files"] == len(names) and summary["failed"] == 0
    status = m.status()
    assert status["cache"]["files"] == len(kept)
    assert status["cache"]["used_bytes"] == sum(pages(sizes[n]) for n in kept)
    before = reads(m)
    read_all(m, kept)
    between = reads(m)
    assert between["file_misses"] == before["file_misses"]  # every one was cached
    assert between["file_hits"] - before["file_hits"] == len(kept)
    read_all(m, rest)  # not cached: read by the daemon, or by the kernel from the source
    assert reads(m)["file_misses"] - between["file_misses"] == len(rest)


def test_a_full_cache_says_in_one_line_what_did_not_fit(mount, source) -> None:
    root, sizes = source
    capacity = sum(pages(s) for s in sizes.values()) // 2
    m = mount(root, "--cache-size", str(capacity), "--fill-depth", "1")
    result = run_cli("warm", str(m.mountpoint), timeout=WARM_S)
    assert result.returncode == 0, result.stderr
    kept = greedy(walked(root), sizes, capacity)
    full = [line for line in result.stdout.splitlines() if "did not fit" in line]
    assert full == [f"cache full: {len(sizes) - len(kept)} files "
                    f"({format_size(sum(sizes.values()) - sum(sizes[n] for n in kept))}) did "
                    "not fit"]
    assert result.stdout.splitlines()[0].startswith(f"warmed {len(kept)} files")


def test_a_second_run_reads_nothing_it_has_and_the_epoch_after_has_no_miss(mount,
                                                                           source) -> None:
    root, sizes = source
    m = mount(root, "--cache-size", "64M")
    first = warm_json(str(m.mountpoint / "class0"), str(m.mountpoint))
    assert first["files"] == len(sizes) and first["bytes"] == sum(sizes.values())
    assert first["already_cached"] == {"files": 0, "bytes": 0}
    stored = reads(m)
    assert stored["bytes_from_source"] == sum(sizes.values())
    assert stored["file_hits"] + stored["file_misses"] == 0  # a warm opens no file
    again = warm_json(str(m.mountpoint))
    assert again["files"] == 0
    assert again["already_cached"] == {"files": len(sizes), "bytes": sum(sizes.values())}
    assert reads(m)["bytes_from_source"] == stored["bytes_from_source"]  # read nothing
    drop_caches()  # the epoch's reads reach the mount, not the kernel's pages
    names = walked(root)
    read_all(m, [names[i] for i in epoch_order(7, 0, len(names))])
    after = reads(m)
    # each file a hit, whether the kernel (passthrough) or the daemon served it
    assert (after["file_hits"], after["file_misses"]) == (len(sizes), 0)
    assert after["bytes_from_source"] == stored["bytes_from_source"]


def _warm_on_terminal(mountpoint: Path) -> str:
    """What ``coordlfs warm MOUNTPOINT`` wrote on a pseudo-terminal; it must succeed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command on the terminal, never back into pytest
        try:
            os.execv(sys.executable, [*COORDLFS, "warm", str(mountpoint)])
        finally:
            os._exit(127)
    output = _read_terminal(fd)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, output
    return output


def test_the_progress_bar_on_a_terminal(mount, source) -> None:
    """Through a pseudo-terminal: tqdm's bar, with files, bytes, rate and time left."""
    root, sizes = source
    m = mount(root, "--cache-size", "64M")
    output = _warm_on_terminal(m.mountpoint)
    bar = [line for line in re.split(r"[\r\n]+", output) if line.startswith("warm:")][-1]
    n = len(sizes)
    assert bar.startswith("warm: 100%|"), output
    assert f"{n}/{n} files" in bar and "B/s]" in bar and "<00:00" in bar, bar
    assert f"warmed {n} files" in output


def _read_terminal(fd: int) -> str:
    """Everything the child writes to the terminal until it closes it."""
    chunks = []
    deadline = time.monotonic() + WARM_S
    try:
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 1)[0]:
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError as e:  # EIO: the child's side is closed
                    if e.errno != errno.EIO:
                        raise
                    break
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def test_ctrl_c_drops_the_rest_and_a_second_run_resumes(mount, source, tmp_path: Path) -> None:
    """The daemon's reads throttled to 1 MB/s (a cgroup), so the warm is still running when
    its first progress line comes: SIGINT stops it with one line and status 130, the mount
    drops what was queued, and a second run (unthrottled) reads only the rest."""
    root, sizes = source
    m = mount(root, "--cache-size", "64M", "--fill-depth", "1")
    drop_caches()  # nothing of the source in the page cache: every read goes to the disk
    with memory_cgroup(f"coordlfs-test-warm-{os.getpid()}", pid=m.pid, read_bps=1 << 20,
                       storage=root):
        proc = subprocess.Popen([*COORDLFS, "warm", str(m.mountpoint)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # a progress line: the warm is under way
            while line.startswith("warm: walking, "):  # the count while walking comes first
                line = proc.stdout.readline()
            assert line.startswith("warm: ") and " s left" in line, line
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=WARM_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 130, err
        assert len(err.splitlines()) == 1 and "interrupted" in err and "Traceback" not in err
        assert "run it again to resume" in err
        last = [line, *out.splitlines()][-1]  # the numbers at Ctrl-C are the last shown
        shown = re.match(r"warm: (\d+)/(\d+ files), ([^/]+)/([^,]+),", last)
        assert shown is not None, last
        done, total, done_bytes, total_bytes = shown.groups()
        assert f"interrupted: {done} of {total} done ({done_bytes} of {total_bytes});" in err
        assert total == f"{len(sizes)} files"  # the total never grew: walked first
        fills = m.status()["fills"]
        assert fills["queued"] == 0  # the rest was dropped, only files in flight go on
        deadline = time.monotonic() + WARM_S
        while m.status()["fills"]["in_flight"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    done = m.status()["cache"]["files"]
    assert 0 < done < len(sizes)
    again = warm_json(str(m.mountpoint))
    assert again["already_cached"]["files"] == done
    assert again["files"] == len(sizes) - done
    after = m.status()
    assert after["cache"]["files"] == len(sizes)
    assert after["reads"]["bytes_from_source"] == sum(sizes.values())  # each file read once


def test_bad_paths_and_arguments_are_one_line_errors(mount, source, tmp_path: Path) -> None:
    root, _sizes = source
    m = mount(root)
    other = mount(root)
    fifo = root / "fifo"
    os.mkfifo(fifo)
    cases = [
        ([str(tmp_path)], "is not on a coordlfs mount"),
        ([str(m.mountpoint / "missing")], "No such file or directory"),
        ([str(m.mountpoint / "fifo")], "not a regular file or a directory"),
        ([str(m.mountpoint / "class0"), str(other.mountpoint / "class1")],
         "warm one mount at a time"),
        ([], "no paths given"),
        (["--from-file", str(tmp_path / "nolist")], "cannot read"),
        ([str(m.mountpoint), "--order", "12"], "--order takes seed:N"),
        ([str(m.mountpoint), "--order", "1:-1"], "--order takes seed:N"),
        ([str(m.mountpoint), "--order", f"{1 << 64}:0"], "--order takes seed:N"),
        ([str(m.mountpoint), "--bogus"], "unrecognized arguments"),
    ]
    for args, message in cases:
        result = run_cli("warm", *args)
        assert result.returncode != 0, args
        assert len(result.stderr.splitlines()) == 1, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert m.status()["fills"]["files"] == 0  # nothing was warmed
    listing = tmp_path / "list"
    listing.write_text(f"{m.mountpoint / 'class0'}\n\n{m.mountpoint / 'missing'}\n")
    result = run_cli("warm", "--from-file", "-", input=listing.read_text())
    assert result.returncode == 1 and "missing: No such file or directory" in result.stderr


def _cli(args: list[str]) -> tuple[int, str, str]:
    """``coordlfs ARGS`` in this process (its modules loaded already: a child that dropped
    root may not read the checkout), its status and what it said on stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = cli.main(args)
    return code, out.getvalue(), err.getvalue()


def test_files_another_user_may_not_read_are_refused_in_one_line(mount, source) -> None:
    """On an --allow-other mount, at a mountpoint every user can reach (pytest's tmp_path is
    root's alone), a user may warm only what it may read: a file named or one found under a
    directory is refused in one line, and nothing is warmed."""
    root, _sizes = source
    secret = root / "class1" / "secret"
    secret.write_bytes(b"s" * 1000)
    secret.chmod(0o600)
    reachable = Path(tempfile.mkdtemp(prefix="coordlfs-warm-", dir="/tmp"))
    reachable.chmod(0o755)
    try:
        m = mount(root, "--allow-other", mountpoint=reachable / "mnt")
        for path, message in ((m.mountpoint / "class1" / "secret", "secret: permission denied"),
                              (m.mountpoint / "class1", "permission denied")):
            code, _out, err = as_user(OTHER_UID, lambda p=path: _cli(["warm", str(p)]))
            assert code == 1 and message in err and len(err.splitlines()) == 1, err
        assert m.status()["fills"]["files"] == 0
        force_unmount(m.mountpoint, m.pid)  # before the directory goes (the fixture's is later)
    finally:
        force_unmount(reachable / "mnt", None)
        shutil.rmtree(reachable, ignore_errors=True)


def test_a_warm_that_caches_nothing_says_why_and_fails(mount, tmp_path: Path) -> None:
    """The only file asked for is over --max-file-size: status 1 and the reason in one line,
    naming the option; with --json too (the summary on stdout all the same)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big").write_bytes(os.urandom(300_000))
    m = mount(src, "--cache-size", "1M", "--max-file-size", "100K")
    result = run_cli("warm", str(m.mountpoint / "big"), timeout=WARM_S)
    assert result.returncode == 1, result
    assert result.stderr == ("coordlfs warm: nothing was cached: 1 file over the mount's "
                             "--max-file-size (100.0 KiB); remount with a larger "
                             "--max-file-size to cache them\n")
    assert "1 file over the mount's --max-file-size, not cached" in result.stdout
    result = run_cli("warm", "--json", str(m.mountpoint), timeout=WARM_S)
    assert result.returncode == 1 and "nothing was cached" in result.stderr
    summary = json.loads(result.stdout)
    assert summary["too_large"] == 1 and summary["max_file_bytes"] == 100 << 10
    assert m.status()["fills"]["files"] == 0  # not even sent: the mount read nothing
    (src / "small").write_bytes(b"s" * 1000)
    assert run_cli("warm", str(m.mountpoint), timeout=WARM_S).returncode == 0  # one of two
    empty = src / "empty"
    empty.mkdir()
    result = run_cli("warm", str(m.mountpoint / "empty"), timeout=WARM_S)
    assert result.returncode == 1
    assert result.stderr == "coordlfs warm: nothing was cached: no files under the paths given\n"


def test_check_says_how_much_is_cached_and_fills_nothing(mount, source) -> None:
    """Half a class warmed: --check gives files, bytes and percent of what was named, for the
    mount's owner and, through the control file, for any user who may read the files (who
    may not read the cache's own directory); it reads nothing into the cache."""
    root, sizes = source
    reachable = Path(tempfile.mkdtemp(prefix="coordlfs-check-", dir="/tmp"))
    reachable.chmod(0o755)
    try:
        m = mount(root, "--allow-other", mountpoint=reachable / "mnt")
        names = [n for n in walked(root) if n.startswith("class1/")]
        warmed = names[: len(names) // 2]
        listing = reachable / "list"
        listing.write_text("".join(f"{m.mountpoint / n}\n" for n in warmed))
        warm_json("--from-file", str(listing))
        m.settled()
        before = m.status()
        held = sum(sizes[n] for n in warmed)
        total = sum(sizes[n] for n in names)
        want = {"mount": str(m.mountpoint), "files": len(names), "bytes": total,
                "cached_files": len(warmed), "cached_bytes": held,
                "percent": round(100 * held / total, 1)}
        result = run_cli("warm", "--check", "--json", str(m.mountpoint / "class1"))
        assert result.returncode == 0 and json.loads(result.stdout) == want, result
        text = run_cli("warm", "--check", str(m.mountpoint / "class1")).stdout
        assert text == (f"cached: {len(warmed)} of {len(names)} files, {format_size(held)} of "
                        f"{format_size(total)} ({want['percent']:.1f}% of the bytes) in the "
                        f"cache of {m.mountpoint}\n")
        code, out, err = as_user(OTHER_UID, lambda: _cli(
            ["warm", "--check", "--json", str(m.mountpoint / "class1")]))
        assert code == 0 and json.loads(out) == want, err
        after = m.status()
        assert after["fills"]["files"] == before["fills"]["files"]  # it filled nothing
        assert after["cache"]["files"] == len(warmed)
        assert after["reads"]["bytes_from_source"] == before["reads"]["bytes_from_source"]
        force_unmount(m.mountpoint, m.pid)  # before the directory goes (the fixture's is later)
    finally:
        force_unmount(reachable / "mnt", None)
        shutil.rmtree(reachable, ignore_errors=True)


def test_the_bar_counts_while_walking_and_its_total_is_what_it_reads(mount, source) -> None:
    """On a terminal: the count of files found comes first; then the bar, whose total leaves
    out the file over --max-file-size it never reads, ends at 100% with every file it read."""
    root, sizes = source
    (root / "zz-big").write_bytes(os.urandom(3 << 20))
    m = mount(root, "--cache-size", "64M", "--max-file-size", "1M")
    output = _warm_on_terminal(m.mountpoint)
    lines = [line.removeprefix("\x1b[K") for line in re.split(r"[\r\n]+", output)]
    found = [line for line in lines if line.startswith("warm: walking, ")]
    assert found and found[-1].startswith(f"warm: walking, {len(sizes) + 1} files ("), output
    bar = [line for line in lines if line.startswith("warm:") and "%|" in line][-1]
    n = len(sizes)
    assert bar.startswith("warm: 100%|") and f"{n}/{n} files" in bar, bar
    assert "1 file over the mount's --max-file-size, not cached" in output
