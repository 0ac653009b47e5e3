"""coordlfs.client on a real mount: every byte it returns equals the source, hits come from
shared memory, a changed file is served new (watched and revalidated sources), and a user
who may not read the cache directory gets the same bytes through the mount."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import xxhash
from conftest import OTHER_UID, digests, force_unmount, run_cli
from test_control_security import as_user
from test_freshness import eventually

from coordlfs import CONTROL_NAME
from coordlfs.client.dataset import Dataset
from coordlfs.protocol.client import Control


def client_digests(ds: Dataset, names: list[str]) -> dict[str, str]:
    return {name: xxhash.xxh64_hexdigest(bytes(ds.read(name))) for name in names}


def withdrawn(m) -> int:
    return m.status()["shared"]["withdrawn"]


def every_file(source: Path) -> tuple[list[str], dict[str, str], int]:
    """Names, digests and total size of every file in a dataset (its manifest included)."""
    expected = digests(source)
    return sorted(expected), expected, sum((source / n).stat().st_size for n in expected)


def test_every_byte_the_client_returns_equals_the_source(mount, dataset) -> None:
    source, _sizes = dataset
    names, expected, total = every_file(source)
    m = mount(source)
    with Dataset(m.mountpoint) as ds:
        assert ds.shared
        assert client_digests(ds, names) == expected  # misses: through the mount, which fills
        first = ds.stats
        assert first["misses"] == len(names)
        eventually(lambda: m.status()["shared"]["published"] == len(names), "all published")
        assert client_digests(ds, names) == expected  # hits: from shared memory
        second = ds.stats
        assert second["hits"] == len(names)
        assert second["bytes_from_cache"] == total
        view = ds.read(names[0])
        assert isinstance(view, memoryview) and view.readonly
        with ds.open(names[0]) as f:  # a file object over the same bytes
            assert f.read(10) == bytes(view[:10])
            f.seek(-5, os.SEEK_END)
            assert f.read() == bytes(view[-5:])
    reads = m.status()["reads"]  # reported on close
    assert reads["client_hits"] == len(names) + 2
    assert reads["client_misses"] == len(names)
    assert reads["client_bytes_from_mount"] == total
    shown = run_cli("stats", str(m.mountpoint)).stdout
    assert f"clients  {len(names) + 2} hits" in shown


def test_the_index_is_kept_from_the_first_client_on(mount, dataset) -> None:
    """A mount no client has asked keeps no index (an epoch through it publishes nothing:
    that would cost every fill a walk of the source); the first client's ``share`` publishes
    what was cached before it answers, and the files cached after are published as they
    complete, so that the client reads all of them from shared memory."""
    source, _sizes = dataset
    names, expected, _ = every_file(source)
    first, later = names[: len(names) // 2], names[len(names) // 2 :]
    m = mount(source)
    assert {n: digests_of(m.mountpoint, n) for n in first} == {n: expected[n] for n in first}
    # the kernel's RELEASEs, and the fills after them, come after the reader's closes
    eventually(lambda: m.settled()["cache"]["files"] == len(first), "the first half cached")
    status = m.status()
    assert (status["shared"]["wanted"], status["shared"]["published"]) == (False, 0)
    shared = Control(m.mountpoint).share(timeout_s=5)["shared"]
    assert (shared["wanted"], shared["backlog"], shared["published"]) == (True, 0, len(first))
    with Dataset(m.mountpoint) as ds:
        assert client_digests(ds, later) == {n: expected[n] for n in later}  # misses
        eventually(lambda: m.status()["shared"]["published"] == len(names), "all published")
        assert client_digests(ds, names) == expected
        assert ds.stats["hits"] == len(names)


def test_a_mount_bound_read_only_serves_the_client_through_the_mount(mount, dataset,
                                                                      tmp_path: Path) -> None:
    """Bound read-only (as a container's volume may be), the mount refuses the control file's
    read-write open, so the client cannot ask for the index (``share``): it still opens, with
    the status a read gives, and every byte it returns equals the source."""
    source, _sizes = dataset
    names, expected, _ = every_file(source)
    m = mount(source)
    bound = tmp_path / "bound"
    bound.mkdir()
    subprocess.run(["mount", "--bind", str(m.mountpoint), str(bound)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(bound)], check=True)
        with pytest.raises(OSError):
            os.open(bound / CONTROL_NAME, os.O_RDWR)
        with Dataset(bound) as ds:
            assert client_digests(ds, names) == expected
    finally:
        subprocess.run(["umount", "-l", str(bound)], check=False)


def digests_of(mountpoint: Path, name: str) -> str:
    """The file read through the mount, as its xxhash digest."""
    return xxhash.xxh64_hexdigest((mountpoint / name).read_bytes())


def test_prefetched_files_are_hits(mount, dataset) -> None:
    source, _sizes = dataset
    names, expected, _total = every_file(source)
    m = mount(source)
    with Dataset(m.mountpoint) as ds:
        assert ds.prefetch(names) == len(names)
        eventually(lambda: m.status()["shared"]["published"] == len(names), "all prefetched")
        assert ds.prefetch(names) == 0  # all published: nothing to ask for
        assert client_digests(ds, names) == expected
        assert ds.stats["hits"] == len(names) and ds.stats["misses"] == 0


def test_a_dataset_inside_the_mount_and_paths_that_leave_it(mount, dataset) -> None:
    source, sizes = dataset
    m = mount(source)
    name = sorted(sizes)[0]
    folder, _slash, file = name.partition("/")
    with Dataset(m.mountpoint / folder) as ds:
        data = (source / name).read_bytes()
        assert bytes(ds.read(file)) == data
        assert bytes(ds.read(f"./{file}")) == data
        assert bytes(ds.read(f"../{folder}//{file}")) == data
        for bad in ("/etc/hostname", "../..", "../../x", ""):
            with pytest.raises(ValueError):
                ds.read(bad)


def test_a_file_changed_while_cached_is_served_new(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(5000))
    (src / "b.bin").write_bytes(os.urandom(6000))
    (src / "d" / "x.bin").write_bytes(os.urandom(7000))
    names = ["a.bin", "b.bin", "d/x.bin"]
    m = mount(src)
    with Dataset(m.mountpoint) as ds:
        client_digests(ds, names)
        eventually(lambda: m.status()["shared"]["published"] == 3, "all published")
        assert client_digests(ds, names) == digests(src) and ds.stats["hits"] == 3

        with open(src / "a.bin", "r+b") as f:  # rewritten in place, same size
            f.write(os.urandom(5000))
        replacement = tmp_path / "b.new"  # replaced by a rename
        replacement.write_bytes(os.urandom(6000))
        os.rename(replacement, src / "b.bin")
        os.rename(src / "d", src / "e")  # a directory renamed: its files are not there
        (src / "d").mkdir()
        (src / "d" / "x.bin").write_bytes(b"another file under the old name")
        eventually(lambda: withdrawn(m) >= 3, "the changed files withdrawn")
        assert client_digests(ds, ["a.bin", "b.bin", "d/x.bin", "e/x.bin"]) == digests(src)


def test_a_source_that_cannot_be_watched_is_checked_on_each_hit(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(5000))
    inner = mount(src)
    outer = mount(inner.mountpoint, "--revalidate", "600")  # a FUSE source: not watched
    assert outer.status()["shared"]["mode"] == "revalidate"
    with Dataset(outer.mountpoint) as ds:
        ds.read("a.bin")
        eventually(lambda: outer.status()["shared"]["published"] == 1, "published")
        assert bytes(ds.read("a.bin")) == (src / "a.bin").read_bytes()
        assert ds.stats["hits"] == 1
        new = os.urandom(5000)
        with open(src / "a.bin", "r+b") as f:
            f.write(new)
        st = os.stat(src / "a.bin")
        eventually(lambda: os.stat(inner.mountpoint / "a.bin").st_mtime_ns == st.st_mtime_ns,
                   "the change seen through the outer mount's source")
        assert bytes(ds.read("a.bin")) == new  # no waiting for --revalidate's 600 s
        # the client saw the change (the outer mount is not told for 600 s): it read through
        # the mount, whose open dropped the old entry
        assert ds.stats["misses"] == 2 and withdrawn(outer) == 1


def _read_as_another_user(mountpoint: str, names: list[str]) -> dict:
    with Dataset(mountpoint) as ds:
        found = client_digests(ds, names)
        return {"shared": ds.shared, "digests": found, "stats": ds.stats}


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_a_reader_who_may_not_read_the_cache_gets_the_bytes_through_the_mount(
        mount, dataset) -> None:
    source, _sizes = dataset
    names, expected, _total = every_file(source)
    reachable = Path(tempfile.mkdtemp(prefix="coordlfs-client-", dir="/tmp"))
    reachable.chmod(0o755)
    mountpoint = reachable / "mnt"
    try:
        m = mount(source, "--allow-other", mountpoint=mountpoint)
        with Dataset(mountpoint) as ds:  # root's reads publish every file
            client_digests(ds, names)
        eventually(lambda: m.status()["shared"]["published"] == len(names), "all published")
        seen = as_user(OTHER_UID, lambda: _read_as_another_user(str(mountpoint), names))
        assert not seen["shared"]
        assert seen["digests"] == expected
        assert seen["stats"]["misses"] == len(names) and seen["stats"]["hits"] == 0
        force_unmount(mountpoint, m.pid)
    finally:
        force_unmount(mountpoint, None)
        shutil.rmtree(reachable, ignore_errors=True)


def test_the_client_loads_neither_torch_nor_the_daemon() -> None:
    probe = ("import sys\nimport coordlfs.client\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'trio', 'pyfuse3', 'numpy')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
