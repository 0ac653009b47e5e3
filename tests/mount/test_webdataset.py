"""webdataset (1.0.2, which opens URLs with its own gopen, not fsspec) on a real mount: the
README's ``wds.WebDataset("coordlfs:///...")`` after ``coordlfs.webdataset.register()``, every
sample as the source's tar shards hold it, each shard through the client; a plain path on the
mount, the other documented way, gives the same samples."""

from __future__ import annotations

import errno
import io
import random
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import webdataset as wds
from webdataset.gopen import gopen

import coordlfs.webdataset
from coordlfs.client.adapters import close_clients, locate

SHARDS = 3
SAMPLES_PER_SHARD = 20


def make_shards(source: Path) -> dict[str, dict[str, bytes]]:
    """Tar shards of samples (``KEY.bin``, ``KEY.cls``) under ``source/shards``; the samples
    by key, each as webdataset gives it (extension -> bytes)."""
    rng = random.Random(7)
    (source / "shards").mkdir(parents=True)
    samples: dict[str, dict[str, bytes]] = {}
    for shard in range(SHARDS):
        with tarfile.open(source / "shards" / f"train-{shard:06d}.tar", "w") as tar:
            for i in range(SAMPLES_PER_SHARD):
                key = f"s{shard}-{i:04d}"
                sample = {"bin": rng.randbytes(rng.randrange(1, 300_000)),
                          "cls": str(i % 5).encode()}
                for extension, data in sample.items():
                    info = tarfile.TarInfo(f"{key}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                samples[key] = sample
    return samples


@pytest.fixture
def shards(mount, tmp_path: Path) -> Iterator[tuple[Path, dict[str, dict[str, bytes]]]]:
    """(mountpoint, the samples); this process's clients closed before the mount goes."""
    source = tmp_path / "src"
    samples = make_shards(source)
    yield mount(source).mountpoint, samples
    close_clients()


def read_all(urls: str) -> dict[str, dict[str, bytes]]:
    return {sample["__key__"]: {k: v for k, v in sample.items() if not k.startswith("__")}
            for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False)}


def test_webdataset_reads_coordlfs_urls_through_the_client(shards) -> None:
    mountpoint, samples = shards
    coordlfs.webdataset.register()
    pattern = f"{mountpoint}/shards/train-{{000000..{SHARDS - 1:06d}}}.tar"
    assert read_all(f"coordlfs://{pattern}") == samples
    where = locate(mountpoint / "shards" / "train-000000.tar")
    assert where is not None and where.client is not None
    stats = where.client.stats
    assert stats["hits"] + stats["misses"] == SHARDS  # each shard read once, by the client
    assert read_all(pattern) == samples  # a plain path: through the kernel
    with pytest.raises(OSError) as refused:
        gopen(f"coordlfs://{mountpoint}/shards/new.tar", "wb")
    assert refused.value.errno == errno.EROFS
    with pytest.raises(ValueError, match="names an absolute path"):
        gopen("coordlfs://shards/train-000000.tar")
