"""The cache on a tmpfs of its own, in huge pages (``--cache-tmpfs``)."""

from __future__ import annotations

from pathlib import Path

from conftest import digests, drop_caches, run_cli

from coordlfs.cache.cache_tmpfs import SOURCE
from coordlfs.client.dataset import Dataset
from coordlfs.system.mounts import mount_at


def _mount_options(directory: Path) -> list[str]:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        device, point, kind, options = line.split()[:4]
        if device == SOURCE and point == str(directory) and kind == "tmpfs":
            return options.split(",")
    return []


def test_the_cache_gets_its_own_tmpfs_in_huge_pages_and_gives_it_back(mount, dataset) -> None:
    source, sizes = dataset
    m = mount(source, "--cache-tmpfs", "yes", "--cache-size", "64M")
    options = _mount_options(m.cache_dir)
    assert "huge=within_size" in options and "mode=700" in options, options
    assert digests(m.mountpoint) == digests(source)
    m.settled()  # what the kernel read from the source is copied in after its release
    with Dataset(str(m.mountpoint)) as ds:
        assert ds.shared
        for name in sizes:
            assert bytes(ds.read(name)) == (source / name).read_bytes()
        assert ds.stats["hits"] == len(sizes)
    assert run_cli("umount", str(m.mountpoint)).returncode == 0
    assert mount_at(str(m.cache_dir)) is None and not m.cache_dir.exists()


def test_a_kept_cache_keeps_its_tmpfs_and_the_next_mount_starts_warm(mount, dataset) -> None:
    source, _ = dataset
    total = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    m = mount(source, "--cache-tmpfs", "yes", "--keep-cache")
    assert digests(m.mountpoint) == digests(source)
    assert run_cli("umount", str(m.mountpoint)).returncode == 0
    assert _mount_options(m.cache_dir), "the kept cache's tmpfs is gone"
    again = mount(source, "--cache-tmpfs", "yes", mountpoint=m.mountpoint,
                  cache_dir=m.cache_dir)
    assert again.status()["cache"]["bytes"] == total
    drop_caches()
    assert digests(again.mountpoint) == digests(source)
    assert again.status()["reads"]["bytes_from_source"] == 0
    assert run_cli("umount", str(again.mountpoint)).returncode == 0
    assert mount_at(str(m.cache_dir)) is None and not m.cache_dir.exists()


def test_a_directory_holding_files_is_used_as_it_is(mount, dataset, tmp_path: Path) -> None:
    """Mounting over a cache kept on the filesystem below would hide it and leak its memory."""
    source, _ = dataset
    cache = Path("/dev/shm") / f"coordlfs-test-kept-{tmp_path.name}"
    cache.mkdir()
    (cache / "stray").write_bytes(b"x")
    m = mount(source, "--cache-tmpfs", "yes", cache_dir=cache)
    assert mount_at(str(cache)) is None
    assert digests(m.mountpoint) == digests(source)
