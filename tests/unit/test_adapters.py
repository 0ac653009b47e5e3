"""coordlfs.client.adapters without a mount: the window an order is handed over in, a mount that
refuses prefetch, and which datasets name their files."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from coordlfs.client import adapters
from coordlfs.client.adapters import MountFiles, dataset_files, mount_files, prefetching
from coordlfs.control import ControlError


class Recorder:
    """A client that records what it is asked to prefetch, and when."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[int, list[str]]] = []
        self.read_so_far = 0
        self.refuse = refuse

    def prefetch(self, paths: list[str]) -> None:
        self.calls.append((self.read_so_far, paths))
        if self.refuse:
            raise ControlError("unknown command 'prefetch'")


def test_the_order_goes_ahead_of_the_reader_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapters, "AHEAD_FILES", 8)
    monkeypatch.setattr(adapters, "CHUNK_FILES", 3)
    client = Recorder()
    files = MountFiles("/mnt", client, [f"f{i}" for i in range(20)])  # type: ignore[arg-type]
    order = list(reversed(range(20)))
    for element in prefetching(order, files, lambda i: (i,)):
        assert element == order[client.read_so_far]
        client.read_so_far += 1
    handed = [path for _at, paths in client.calls for path in paths]
    assert handed == [f"f{i}" for i in order]  # each once, in the reader's order
    assert all(len(paths) <= 3 for _at, paths in client.calls)
    sent = 0
    for at, paths in client.calls:
        sent += len(paths)
        assert sent - at <= 8 + 2  # never more than the window (and a chunk's rounding) ahead


def test_batches_count_their_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapters, "AHEAD_FILES", 4)
    monkeypatch.setattr(adapters, "CHUNK_FILES", 4)
    client = Recorder()
    files = MountFiles("/mnt", client, [f"f{i}" for i in range(9)])  # type: ignore[arg-type]
    batches = [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert list(prefetching(batches, files, lambda b: b)) == batches
    assert [paths for _at, paths in client.calls] == [
        ["f0", "f1", "f2", "f3"], ["f4", "f5", "f6", "f7"], ["f8"]]


def test_a_mount_that_refuses_is_warned_about_once() -> None:
    client = Recorder(refuse=True)
    files = MountFiles("/mnt", client, ["a", "b"])  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="does not prefetch"):
        assert list(prefetching([0, 1], files, lambda i: (i,))) == [0, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        files.prefetch([0])
        assert list(prefetching([1, 0], files, lambda i: (i,))) == [1, 0]
    assert len(client.calls) == 1


def test_without_a_client_nothing_is_handed_over() -> None:
    files = MountFiles("/mnt", None, ["a"])
    assert not files.enabled
    assert list(prefetching([0], files, lambda i: (i,))) == [0]


class Folder:
    def __init__(self, **attributes: object) -> None:
        self.__dict__.update(attributes)
        self.n = 2

    def __len__(self) -> int:
        return self.n


def test_which_datasets_name_their_files(tmp_path: Path) -> None:
    samples = [(str(tmp_path / "a.jpg"), 0), (str(tmp_path / "b.jpg"), 1)]
    assert dataset_files(Folder(samples=samples)) == [s[0] for s in samples]
    assert dataset_files(Folder(imgs=samples)) == [s[0] for s in samples]
    assert dataset_files(Folder(files=[tmp_path / "a", "b"])) == [str(tmp_path / "a"), "b"]
    assert dataset_files(Folder(files=[1, 2])) is None
    assert dataset_files(Folder()) is None
    assert mount_files(Folder(samples=samples)) is None  # not on a coordlfs mount
    short = Folder(files=["a"])
    assert mount_files(short) is None  # not a file per index
