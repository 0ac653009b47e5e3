"""coordlfs.torch on a real mount: AlignedSampler's seed and order, its fallback, the profiler;
the loaders reading through the client, and the order the samplers hand to the mount."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import digests, drop_caches, make_dataset
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import coordlfs.torch
from coordlfs.client.adapters import close_clients, locate
from coordlfs.control import Control
from coordlfs.protocol.order import epoch_order, shard
from coordlfs.torch import AlignedSampler, SharedPrepLoader, profiled, raw_loader


class Files(Dataset):
    """An image-folder-like dataset: item i is the bytes of the i-th file, by sorted path."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.files = sorted(str(p) for p in root.rglob("*") if p.is_file())

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.files[i], "rb") as f:
            return torch.tensor(len(f.read()))


def _mounted(mount, tmp_path: Path, files: int, *options: str):
    src = tmp_path / "src"
    src.mkdir()
    make_dataset(src, files)
    return src, mount(src, *options)


def test_members_share_the_seed_and_each_epoch_is_a_new_order(mount, tmp_path: Path) -> None:
    _src, m = _mounted(mount, tmp_path, 50)
    data = Files(m.mountpoint)
    first = AlignedSampler(data, group="g", job="a")
    second = AlignedSampler(data, group="g", job="b")
    assert first.aligned and second.aligned and first.seed == second.seed
    n = len(data)
    assert list(first) == list(second) == epoch_order(first.seed, 0, n)
    assert list(first) != epoch_order(first.seed, 0, n)  # the next pass is the next epoch
    first.set_epoch(5)
    second.set_epoch(5)
    assert list(first) == list(second) == epoch_order(first.seed, 5, n)
    assert len(m.status()["groups"]["g"]["members"]) == 2
    first.close()
    second.close()
    assert m.status()["groups"] == {}


def test_distributed_split_matches_distributed_sampler(mount, tmp_path: Path) -> None:
    _src, m = _mounted(mount, tmp_path, 10)
    data = Files(m.mountpoint)
    for drop_last in (False, True):
        ranks = [AlignedSampler(data, group="g", num_replicas=4, rank=r, drop_last=drop_last)
                 for r in range(4)]
        order = epoch_order(ranks[0].seed, 0, len(data))
        for r, sampler in enumerate(ranks):
            plain = list(DistributedSampler(data, num_replicas=4, rank=r, shuffle=False,
                                            drop_last=drop_last))
            assert list(sampler) == [order[i] for i in plain] == shard(order, r, 4, drop_last)
            assert len(sampler) == len(plain)
            sampler.close()


def test_without_a_mount_it_shuffles_with_a_warning(tmp_path: Path) -> None:
    data = Files(tmp_path)  # not on a coordlfs mount: empty, fine for a sampler
    data.files = [str(i) for i in range(20)]
    with pytest.warns(UserWarning, match="not on a coordlfs mount"):
        sampler = AlignedSampler(data, group="g", seed=3)
    assert not sampler.aligned
    assert sorted(sampler) == list(range(20))
    with pytest.warns(UserWarning, match="not on a coordlfs mount"):
        assert list(AlignedSampler(data, group="g", path=None, seed=3)) == sampler.order(0)
    with pytest.warns(UserWarning, match="no path given"):
        AlignedSampler(list(range(5)), group="g")


def test_refused_group_falls_back_with_a_warning(mount, tmp_path: Path) -> None:
    _src, m = _mounted(mount, tmp_path, 5)
    with pytest.warns(UserWarning, match="cannot join group"):
        sampler = AlignedSampler(Files(m.mountpoint), group="bad\nname")
    assert not sampler.aligned and sorted(sampler) == list(range(len(sampler)))


def test_loader_workers_count_as_their_job(mount, tmp_path: Path) -> None:
    """DataLoader workers are children of the job: their reads feed the job's group window."""
    _src, m = _mounted(mount, tmp_path, 40, "--cache-size", "0")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        Control(m.mountpoint).join_group("g", job="other", pid=other.pid)
        data = Files(m.mountpoint)
        sampler = AlignedSampler(data, group="g", job="me")
        drop_caches()
        loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=2)
        total = sum(int(x) for batch in profiled(loader, job="me", epoch=0,
                                                 path=m.mountpoint) for x in batch)
        assert total == sum(os.path.getsize(f) for f in data.files)
        status = m.status()
        assert status["read_window"]["used_bytes"] == total  # held for the other job
        profile = status["profiles"][0]
        assert profile["job"] == "me" and profile["epochs"]["0"]["steps"] == -(-len(data) // 8)
        sampler.close()
    finally:
        other.kill()
        other.wait()


def test_profiler_times_waits_and_steps(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    m = mount(src)

    def slow_loader():
        for i in range(3):
            time.sleep(0.05)
            yield i

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in profiled(slow_loader(), job="j", epoch=2, path=m.mountpoint):
            time.sleep(0.02)
    epoch = m.status()["profiles"][0]["epochs"]["2"]
    assert epoch["steps"] == 3
    assert 0.15 <= epoch["wait_s"] < 1.0 and 0.06 <= epoch["step_s"] < 1.0
    assert m.status()["profiles"][0]["pid"] == os.getpid()


# -- reading through the client: loaders, and the order handed to the mount -------------------


class Named(Dataset):
    """A dataset that names its files and reads none (item i is i): what the mount holds
    after a pass was filled by prefetch alone."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.files = sorted(str(p) for p in root.rglob("*") if p.is_file())

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> int:
        return i


class RawDigests(Named):
    """Item i is the digest of the i-th file's bytes, read by ``raw_loader``."""

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        return xxhash.xxh64_hexdigest(raw_loader(self.files[i]))


@pytest.fixture
def clients(mount) -> Iterator[None]:
    """This process's clients, closed before the mounts go (they report their counts)."""
    yield
    close_clients()


def _cached(m, files: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while m.status()["cache"]["files"] < files:
        assert time.monotonic() < deadline, m.status()["cache"]
        time.sleep(0.05)


def _all_hits(data: Named) -> None:
    """Reading every file now finds each in the cache: the client counts only hits."""
    client = data_client(data)
    before = dict(client.stats)
    assert [xxhash.xxh64_hexdigest(raw_loader(f)) for f in data.files] == [
        xxhash.xxh64_hexdigest(Path(f).read_bytes()) for f in data.files]
    after = client.stats
    assert after["hits"] - before["hits"] == len(data.files)
    assert after["misses"] == before["misses"]


def data_client(data: Named):
    where = locate(data.files[0])
    assert where is not None and where.client is not None
    return where.client


def test_loaders_return_the_sources_bytes(mount, clients, tmp_path: Path) -> None:
    src, m = _mounted(mount, tmp_path, 40)
    for i, colour in enumerate(["red", "green", "blue"]):
        Image.new("RGB" if i else "L", (7 + i, 5), colour).save(src / f"image{i}.png")
    for image in sorted(src.glob("*.png")):
        want = Image.open(image).convert("RGB")
        got = coordlfs.torch.pil_loader(m.mountpoint / image.name)
        assert (got.mode, got.size, got.tobytes()) == ("RGB", want.size, want.tobytes())
    data = RawDigests(m.mountpoint)
    names = [os.path.relpath(f, m.mountpoint) for f in data.files]
    want = digests(src)
    workers = DataLoader(data, batch_size=None, num_workers=2)  # forked: a client each
    assert dict(zip(names, workers, strict=True)) == want
    reads = m.status()["reads"]  # the workers reported their counts as they exited
    assert reads["client_hits"] + reads["client_misses"] == len(want)
    before = dict(data_client(data).stats)
    assert dict(zip(names, map(data.__getitem__, range(len(data))), strict=True)) == want
    after = data_client(data).stats
    assert after["hits"] + after["misses"] - before["hits"] - before["misses"] == len(want)


def test_loaders_read_a_path_on_no_mount(tmp_path: Path) -> None:
    Image.new("RGB", (3, 2), "red").save(tmp_path / "plain.png")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert coordlfs.torch.pil_loader(tmp_path / "plain.png").tobytes() == b"\xff\0\0" * 6
        assert raw_loader(tmp_path / "plain.png") == (tmp_path / "plain.png").read_bytes()
    assert locate(tmp_path / "plain.png") is None


def test_the_samplers_order_is_prefetched(mount, clients, tmp_path: Path) -> None:
    """Iterating the sampler hands the epoch's order to the mount: the files are filled
    without being read, and reading them then is all hits. (Outside a group, so that the
    group's own read-ahead fills nothing.)"""
    _src, m = _mounted(mount, tmp_path, 60)
    data = Named(m.mountpoint)
    with pytest.warns(UserWarning, match="cannot join group"):
        sampler = AlignedSampler(data, group="bad\nname")
    assert sorted(DataLoader(data, sampler=sampler, batch_size=None)) == list(range(len(data)))
    _cached(m, len(data))
    _all_hits(data)


def test_shared_prep_prefetches_the_batches_it_claims(mount, clients, tmp_path: Path) -> None:
    _src, m = _mounted(mount, tmp_path, 60)
    data = Named(m.mountpoint)
    with SharedPrepLoader(data, batch_size=8, group="p", path=m.mountpoint) as loader:
        assert loader.shared
        assert sorted(int(i) for batch in loader for i in batch) == list(range(len(data)))
    _cached(m, len(data))
    _all_hits(data)


def test_shared_prep_alone_prefetches_its_order(mount, clients, tmp_path: Path) -> None:
    _src, m = _mounted(mount, tmp_path, 60)
    data = Named(m.mountpoint)
    with pytest.warns(UserWarning, match="cannot join prep group"):
        loader = SharedPrepLoader(data, batch_size=8, group="bad\nname", path=m.mountpoint)
    assert sorted(int(i) for batch in loader for i in batch) == list(range(len(data)))
    assert loader.prepared_alone == -(-len(data) // 8)
    _cached(m, len(data))
    _all_hits(data)
