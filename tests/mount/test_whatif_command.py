"""coordlfs whatif on a real mount: epochs read through it and marked, a profile reported as
coordlfs.torch.profiled does; the table, --since, --json, --plot and one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from conftest import run_cli


def read_epoch(mountpoint: Path, names: list[str]) -> None:
    """Read every file to its end, then drop its pages from the kernel's cache, so that the
    next epoch's reads reach the mount (as a dataset bigger than memory makes them)."""
    for name in names:
        fd = os.open(mountpoint / name, os.O_RDONLY)
        try:
            while os.read(fd, 1 << 20):
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.fixture
def marked(mount, dataset):
    """A mount whose cache holds half the dataset, after three marked epochs; the profile of
    a job computing 0.5 s per epoch."""
    source, sizes = dataset
    m = mount(source, "--cache-size", str(sum(sizes.values()) // 2))
    names = sorted(sizes)
    for epoch in range(1, 4):
        m.control.mark(f"epoch-{epoch}")
        read_epoch(m.mountpoint, names)
        m.control.report_profile("trainer", epoch, 7, 1.0, 0.5)
    m.control.mark("end")
    return m, sum(sizes.values())


def test_whatif_predicts_from_the_marked_epochs(marked, tmp_path: Path) -> None:
    m, total = marked
    out = tmp_path / "whatif.json"
    result = run_cli("whatif", str(m.mountpoint), "--json", str(out))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert f"what-if for {m.mountpoint}: 3 epochs" in text
    for heading in ("cache (* now)", "CPUs", "storage speed", "advice   "):
        assert heading in text
    assert "compute per epoch from the step times of trainer" in text
    data = json.loads(out.read_text())
    assert data["rates"]["dataset_bytes"] == total  # the cold epoch read every byte
    assert data["rates"]["compute_s"] == 0.5
    assert data["rates"]["cache_bytes"] == total // 2
    assert [e["name"] for e in data["epochs"]] == ["epoch-1 .. epoch-2", "epoch-2 .. epoch-3",
                                                   "epoch-3 .. end"]
    assert data["epochs"][0]["storage_bytes"] == total
    assert data["epochs"][1]["cache_bytes"] > 0
    assert [row["cache_fraction"] for row in data["cache"]][::5] == [0.0, 0.5, 1.0]
    for key in ("now", "cpus", "storage", "recommendation"):
        assert data[key]
    # more cache never makes an epoch longer
    times = [row["epoch_s"] for row in data["cache"]]
    assert times == sorted(times, reverse=True)


def test_since_a_mark_and_the_plot(marked, tmp_path: Path) -> None:
    m, _total = marked
    out, png = tmp_path / "since.json", tmp_path / "whatif.png"
    args = ["whatif", str(m.mountpoint), "--since", "epoch-2", "--json", str(out)]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--plot", str(png)]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert [e["name"] for e in data["epochs"]] == ["epoch-2 .. epoch-3", "epoch-3 .. end"]
    if "--plot" in args:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_only_the_marked_epochs_and_the_files_they_opened_count(mount, dataset,
                                                                tmp_path: Path) -> None:
    """Issue 35: a warm before the job, a user's marks after it and a file over
    --max-file-size (never cached, read by the kernel in pieces) made "23 epoch(s)" and a
    dataset larger than the files. Only the intervals from an epoch-N mark count, and the
    dataset is the size of the files an epoch opened."""
    source, sizes = dataset
    (source / "big.bin").write_bytes(os.urandom(3 << 20))
    names = [*sorted(sizes), "big.bin"]
    total = sum(sizes.values()) + (3 << 20)
    m = mount(source, "--cache-size", str(sum(sizes.values()) // 2), "--max-file-size", "2M")
    m.control.mark("before-warm")
    assert run_cli("warm", str(m.mountpoint)).returncode == 0  # its fills: no epoch
    for epoch in range(1, 3):
        m.control.mark(f"epoch-{epoch}")
        read_epoch(m.mountpoint, names)
    m.control.mark("end")
    m.control.mark("e1")
    read_epoch(m.mountpoint, names[:5])
    m.control.mark("e2")
    out = tmp_path / "whatif.json"
    result = run_cli("whatif", str(m.mountpoint), "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert f"what-if for {m.mountpoint}: 2 epochs" in result.stdout
    data = json.loads(out.read_text())
    assert [e["name"] for e in data["epochs"]] == ["epoch-1 .. epoch-2", "epoch-2 .. end"]
    assert data["rates"]["dataset_bytes"] == total


def test_bad_input_is_one_line(mount, dataset, tmp_path: Path) -> None:
    source, sizes = dataset
    m = mount(source)
    not_mounted = tmp_path / "plain"
    not_mounted.mkdir()
    for args, message in (
            ([str(not_mounted)], "not a coordlfs mount"),
            ([str(m.mountpoint)], "no reads to analyse"),
            ([str(m.mountpoint), "--since", "nope"], "no mark named 'nope'")):
        result = run_cli("whatif", *args)
        assert result.returncode == 1, result.stdout
        assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    read_epoch(m.mountpoint, sorted(sizes)[:3])
    result = run_cli("whatif", str(m.mountpoint))  # no marks: the window is one epoch
    assert result.returncode == 0 and "the whole window is taken as one epoch" in result.stdout
    result = run_cli("whatif", str(m.mountpoint), "--json", str(tmp_path / "no" / "x.json"))
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert "cannot write" in result.stderr
    assert m.status()["pid"] == m.pid  # the mount stays up
