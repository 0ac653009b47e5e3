"""A mount restarted with --keep-cache serves at once and never a file changed meanwhile: its
entries are checked against the source in the background (and at every open)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from conftest import digests, drop_caches, random_source, run_cli, wait_for

from coordlfs.system.processes import wait_exit


def _change_three(source: Path, names: list[str]) -> int:
    """Rewrite one file in place (same size), remove one, grow one; the bytes of the two
    that are still there, which the restarted mount must read from the source."""
    (source / names[0]).write_bytes(os.urandom((source / names[0]).stat().st_size))
    (source / names[1]).unlink()
    with open(source / names[2], "ab") as f:
        f.write(b"grown")
    return (source / names[0]).stat().st_size + (source / names[2]).stat().st_size



def test_changed_files_are_read_fresh_after_a_warm_restart(mount, dataset) -> None:
    source, sizes = dataset
    names = sorted(sizes)
    m = mount(source, "--keep-cache")
    assert digests(m.mountpoint) == digests(source)
    cached = m.settled()["cache"]["files"]
    assert run_cli("umount", str(m.mountpoint)).returncode == 0
    changed_bytes = _change_three(source, names)
    again = mount(source, mountpoint=m.mountpoint, cache_dir=m.cache_dir)
    wait_for(lambda: again.status()["cache"]["files"] == cached - 3,
              "checked (the three changed entries dropped)")
    drop_caches()
    assert digests(again.mountpoint) == digests(source)
    assert again.status()["reads"]["bytes_from_source"] == changed_bytes


def test_a_killed_daemon_leaves_a_cache_the_next_mount_adopts(mount, dataset) -> None:
    source, _sizes = dataset
    m = mount(source, "--keep-cache")
    assert digests(m.mountpoint) == digests(source)
    cached = m.settled()["cache"]["files"]
    os.kill(m.pid, signal.SIGKILL)  # no checkpoint: the journal's lines are all there is
    assert wait_exit(m.pid, 15)
    assert run_cli("umount", str(m.mountpoint)).returncode == 0
    again = mount(source, mountpoint=m.mountpoint, cache_dir=m.cache_dir)
    assert again.status()["cache"]["files"] == cached
    drop_caches()
    assert digests(again.mountpoint) == digests(source)
    assert again.status()["reads"]["bytes_from_source"] == 0


def test_a_damaged_journal_starts_cold_and_still_mounts(mount, dataset) -> None:
    source, _sizes = dataset
    m = mount(source, "--keep-cache")
    assert digests(m.mountpoint) == digests(source)
    assert run_cli("umount", str(m.mountpoint)).returncode == 0
    journal = m.cache_dir / "index.jsonl"
    data = journal.read_bytes()
    journal.write_bytes(data[: len(data) // 2])  # torn: a warning, not an error (the fixture)
    again = mount(source, mountpoint=m.mountpoint, cache_dir=m.cache_dir)
    assert again.status()["cache"]["files"] == 0
    assert "damaged" in Path(again.log).read_text()
    assert digests(again.mountpoint) == digests(source)


def _read_until_gone(mountpoint: Path, names: list[str]) -> None:
    """Read the files through the mount, again and again, until its daemon is gone (a killed
    daemon's mount answers ENOTCONN): a reader whose misses are all answered in C reads them
    faster than the fills behind it end, so one pass may end before they do."""
    try:
        while True:
            for name in names:
                (mountpoint / name).read_bytes()
    except OSError:
        pass


def test_a_daemon_killed_while_filling_keeps_what_it_reported_cached(mount,
                                                                     tmp_path: Path) -> None:
    """Fills behind readers end a batch at a time (one journal write): a daemon killed while
    a reader's misses are being filled leaves every file it had reported cached in its
    journal, and the next mount adopts them all, byte-exact, none read from the source."""
    names = [f"f{i:04d}" for i in range(1500)]
    src = random_source(tmp_path, **dict.fromkeys(names, 20_000 + 17))
    m = mount(src, "--keep-cache")
    reader = threading.Thread(target=_read_until_gone, args=(m.mountpoint, names))
    reader.start()
    try:
        reported = 0
        while reported < 150 and reader.is_alive():
            reported = m.status()["cache"]["files"]
        os.kill(m.pid, signal.SIGKILL)  # what it reported last is what the journal must hold
    finally:
        reader.join(60)
    assert wait_exit(m.pid, 15)
    assert 150 <= reported < len(names), "the reader did not race the fills"
    assert run_cli("umount", str(m.mountpoint)).returncode == 0
    again = mount(src, mountpoint=m.mountpoint, cache_dir=m.cache_dir)
    assert again.status()["cache"]["files"] >= reported
    cached = again.status()["cache"]["bytes"]
    drop_caches()
    assert digests(again.mountpoint) == digests(src)
    assert again.status()["reads"]["bytes_from_source"] == sum(
        (src / n).stat().st_size for n in names) - cached
