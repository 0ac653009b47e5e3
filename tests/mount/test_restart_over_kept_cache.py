"""A mount restarted with --keep-cache serves at once and never a file changed meanwhile: its
entries are checked against the source in the background (and at every open)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from conftest import digests, drop_caches, run_cli, wait_for

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
