"""The mount beneath its own source: a mountpoint inside the source is refused at mount, and
so is what the daemon opens by path while mounted inside the mountpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

from coordlfs.mounting import mount_at
from coordlfs.testbed.mounts import unmount_if_mounted
from coordlfs.testbed.slurm import free_port


def test_a_mountpoint_inside_the_source_is_refused_in_one_line(dataset, tmp_path: Path,
                                                               daemon_logs: list[Path]) -> None:
    source, _ = dataset
    inside = source / "mnt"
    inside.mkdir()
    daemon_logs.append(tmp_path / "mount.log")
    result = run_cli("mount", str(source), str(inside), "--cache-dir", str(tmp_path / "cache"),
                     "--log", str(tmp_path / "mount.log"))
    try:
        assert result.returncode == 1, result
        assert result.stderr == (f"coordlfs: mountpoint {inside} is inside the source {source}: "
                                 "the mount would hold itself; mount it outside the source, or "
                                 "over the source itself\n")
        assert mount_at(str(inside)) is None
    finally:
        unmount_if_mounted(inside)


@pytest.mark.parametrize("option", ["--cache-dir", "--log", "--peers-file"])
def test_what_the_daemon_opens_by_path_while_mounted_is_refused_in_the_mountpoint(
        dataset, tmp_path: Path, daemon_logs: list[Path], option: str) -> None:
    """Clients map the cache by its path, the log is read and the peers file re-read while the
    mount is up: beneath the mountpoint, those paths show the source's files instead."""
    source, _ = dataset
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    listen = f"127.0.0.1:{free_port('127.0.0.1')}"
    paths = {"--cache-dir": tmp_path / "cache", "--log": tmp_path / "mount.log",
             option: mountpoint / "inside"}
    daemon_logs.append(paths["--log"])
    cluster = ["--listen", listen, "--insecure", "--peers-file", str(paths[option])]
    if option == "--peers-file":
        paths[option].write_text(f"{listen}\n")  # what would make it mount without the rule
    argv = [a for o in ("--cache-dir", "--log") for a in (o, str(paths[o]))]
    result = run_cli("mount", str(source), str(mountpoint), *argv,
                     *(cluster if option == "--peers-file" else []))
    try:
        assert result.returncode == 1, result
        *warnings, said = result.stderr.splitlines()  # (a peers file makes it not empty)
        assert said == (f"coordlfs: {option} {paths[option]} is inside the mountpoint "
                        f"{mountpoint}, which the mount hides while it is up; give a path "
                        "outside it")
        assert all(w.startswith("coordlfs: warning: ") for w in warnings), warnings
        assert mount_at(str(mountpoint)) is None
    finally:
        unmount_if_mounted(mountpoint)
