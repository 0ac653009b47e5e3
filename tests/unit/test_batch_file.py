"""coordlfs.batch_file: staged batches round-trip, are mapped without a copy, and odd tensors
fall back to torch.save."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from coordlfs import batch_file  # noqa: E402

Pair = collections.namedtuple("Pair", "items label")


def staged(tmp_path: Path, batch: object) -> tuple[batch_file.BatchFile, str]:
    path = str(tmp_path / "0-1.pt")
    laid = batch_file.BatchFile(batch)
    laid.write(path)
    return laid, path


def test_a_batch_round_trips_with_its_types_and_dtypes(tmp_path: Path) -> None:
    images = torch.randn(4, 3, 5, 5)
    batch = {"images": images, "again": images, "mask": torch.tensor([True, False]),
             "half": torch.randn(3).bfloat16(), "scalar": torch.tensor(7),
             "empty": torch.empty(0, 3), "pair": Pair(torch.arange(5), "text"),
             "strided": torch.randn(4, 6).t(), "complex": torch.randn(2, dtype=torch.complex64),
             "plain": [1, 2.5, None]}
    laid, path = staged(tmp_path, batch)
    assert os.path.getsize(path) == laid.size
    back = batch_file.read(path)
    assert back.keys() == batch.keys()
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    assert type(back["pair"]) is Pair and back["pair"].label == "text"
    assert torch.equal(back["pair"].items, torch.arange(5))
    assert back["plain"] == [1, 2.5, None]


def test_the_file_is_the_tensor_bytes_mapped_without_a_copy(tmp_path: Path) -> None:
    """A 1 MiB tensor is stored once, as its bytes, and read back as a view of the file's
    mapping; a consumer's change in place stays in its own pages."""
    images = torch.arange(1 << 18, dtype=torch.float32)
    laid, path = staged(tmp_path, (images, images))
    assert laid.size < images.numel() * 4 + 4096
    with open(path, "rb") as f:
        assert f.read(len(batch_file.MAGIC)) == batch_file.MAGIC
        f.seek(laid.size - 4)
        assert f.read(4) == images[-1:].numpy().tobytes()
    first, second = batch_file.read(path)
    assert first.data_ptr() == second.data_ptr()  # one mapping, one copy of the bytes
    first += 1
    assert torch.equal(batch_file.read(path)[0], images)


def test_a_batch_with_autograd_or_sparse_tensors_is_saved_by_torch(tmp_path: Path) -> None:
    for odd in (torch.randn(3, requires_grad=True), torch.eye(3).to_sparse()):
        laid, path = staged(tmp_path, {"odd": odd, "label": torch.arange(2)})
        assert not open(path, "rb").read(8).startswith(batch_file.MAGIC)
        assert os.path.getsize(path) <= laid.size
        back = batch_file.read(path)
        assert torch.equal(back["odd"].detach().to_dense(), odd.detach().to_dense())
        assert torch.equal(back["label"], torch.arange(2))


def test_a_batch_of_no_tensors_round_trips(tmp_path: Path) -> None:
    _laid, path = staged(tmp_path, ["a", 1])
    assert batch_file.read(path) == ["a", 1]
