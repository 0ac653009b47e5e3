"""coordlfs.client.batch_file: staged batches round-trip, are mapped without a copy; what a batch
file cannot carry is refused when it is written, and a file planted where batches are read is
refused without running anything."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from coordlfs.client import batch_file  # noqa: E402

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


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("odd", [
    lambda: torch.randn(3, requires_grad=True), lambda: torch.eye(3).to_sparse(),
    lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
    lambda: torch.nn.Parameter(torch.randn(2)), lambda: collections.OrderedDict(a=1),
    lambda: {1.5: "float key"}, object], ids=["grad", "sparse", "quantized", "subclass",
                                           "OrderedDict", "float key", "object"])
def test_a_batch_a_file_cannot_carry_is_unstageable(odd) -> None:
    """Odd tensors and other objects have no layout of plain bytes and no JSON form: the job
    that prepared the batch prepares alone (``shared_prep``), it is never pickled."""
    with pytest.raises(batch_file.Unstageable, match="it holds"):
        batch_file.BatchFile({"odd": odd(), "label": torch.arange(2)})


def test_values_json_has_no_form_for_round_trip(tmp_path: Path) -> None:
    batch = {"floats": [float("inf"), float("-inf"), -0.0, 1e-310], "bytes": b"\x00\xff",
             7: ("f", "nan"), "big": 1 << 70, "text": "\ud800 é"}
    back = batch_file.read(staged(tmp_path, batch)[1])
    assert back == batch and str(back["floats"][2]) == "-0.0"
    (tmp_path / "nan").mkdir()
    nan = batch_file.read(staged(tmp_path / "nan", [float("nan")])[1])
    assert nan[0] != nan[0]


class _Planted:
    """What a pickle runs when it is loaded: a command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return (os.system, (self.command,))


def _planted_files(tmp_path: Path, marker: Path) -> dict[str, Path]:
    """Files another user could put where a batch is read, each running ``touch marker`` if
    it were unpickled, or naming what is no named tuple."""
    touch = f"touch {marker}"
    pickled = pickle.dumps(_Planted(touch))
    files = {"a pickled header": b"CLFSBAT1" + struct.pack("<Q", len(pickled)) + pickled,
             "a torch.save file": _saved(_Planted(touch))}
    for name, header in {
            "a function as a named tuple": ["n", "os", "system", touch],
            "a class as a named tuple": ["n", "subprocess", "Popen", ["l", "touch", str(marker)]],
            "an unknown tag": ["x", touch],
            "a tensor past the end": ["T", 0]}.items():
        text = json.dumps({"batch": header, "tensors": [[0, "float32", [1 << 20]]]}).encode()
        files[name] = batch_file.MAGIC + struct.pack("<Q", len(text)) + text
    paths = {}
    for name, data in files.items():
        paths[name] = tmp_path / name.replace(" ", "-")
        paths[name].write_bytes(data)
    return paths


def _saved(obj: object) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def test_a_planted_file_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    for name, path in _planted_files(tmp_path, marker).items():
        try:
            batch_file.read(str(path))
        except Exception as e:  # which one is asserted below, after the marker
            error: Exception | None = e
        else:
            error = None
        assert not marker.exists(), f"{name} ran code"
        assert isinstance(error, batch_file.BadBatchFile), (name, error)


def test_a_batch_file_of_another_user_or_through_a_link_is_refused(tmp_path: Path) -> None:
    _laid, path = staged(tmp_path, [torch.arange(3)])
    link = tmp_path / "link.pt"
    link.symlink_to(path)
    with pytest.raises(OSError, match="symbolic links"):
        batch_file.read(str(link))
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        with pytest.raises(batch_file.BadBatchFile, match="not a file of uid"):
            batch_file.read(path)


def test_a_batch_file_is_never_written_over_an_existing_file_or_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    laid = batch_file.BatchFile([torch.arange(3)])
    (tmp_path / "link.pt").symlink_to(victim)
    for taken in (victim, tmp_path / "link.pt"):
        with pytest.raises(FileExistsError):
            laid.write(str(taken))
    assert victim.read_bytes() == b"keep"


def test_a_batch_of_no_tensors_round_trips(tmp_path: Path) -> None:
    _laid, path = staged(tmp_path, ["a", 1])
    assert batch_file.read(path) == ["a", 1]
