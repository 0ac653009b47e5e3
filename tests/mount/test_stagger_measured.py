"""The stagger advisor calibrated from the stall profiler's records on a real mount."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

from coordlfs.control import Control


def test_measured_jobs_from_a_mount_go_into_the_catalog(mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    m = mount(src)
    control = Control(m.mountpoint)
    for epoch, wait in ((0, 50.0), (1, 5.0), (2, 5.0)):
        control.report_profile("a", epoch, 100, wait, 20.0)
    catalog = tmp_path / "profiles.json"
    result = run_cli("stagger", "--mount", str(m.mountpoint), "--measured", "a:Wconc=0.7",
                     "--job", "b:I=0.1,Wcold=0.5,Wwarm=0.05,Wconc=0.7,iters=100,epochs=3",
                     "--catalog", str(catalog))
    assert result.returncode == 0, result.stderr
    assert "optimum" in result.stdout
    saved = json.loads(catalog.read_text())["a"]
    assert saved["I"] == pytest.approx(0.2) and saved["Wcold"] == pytest.approx(0.5)
    assert saved["Wconc"] == 0.7 and saved["iters"] == 100 and saved["epochs"] == 3
    again = run_cli("stagger", "--from-catalog", "a", "--job",
                    "b:I=0.1,Wcold=0.5,Wwarm=0.05,Wconc=0.7,iters=100,epochs=3",
                    "--catalog", str(catalog))
    assert again.returncode == 0 and again.stdout == result.stdout
    alone_only = run_cli("stagger", "--mount", str(m.mountpoint), "--measured", "a", "--job",
                         "b:I=0.1,Wcold=0.5,Wwarm=0.05,Wconc=0.7,iters=100,epochs=3",
                         "--catalog", str(catalog))
    assert alone_only.returncode == 2 and "give Wconc" in alone_only.stderr
    with contextlib.ExitStack() as stack:  # a run of a beside b: its first epoch is W|conc
        pids = [stack.enter_context(subprocess.Popen(["sleep", "60"])) for _ in range(2)]
        for p in pids:
            stack.callback(p.kill)
        members = [control.join_group("g", job=job, seed=1, pid=p.pid)["member"]
                   for job, p in zip("ab", pids, strict=True)]
        for member in members:
            control.start_epoch(member, 0)
        control.report_profile("a", 0, 100, 90.0, 20.0, pid=pids[0].pid)
        measured = run_cli("stagger", "--mount", str(m.mountpoint), "--measured", "a",
                           "--job", "b:I=0.1,Wcold=0.5,Wwarm=0.05,Wconc=0.7,iters=100,epochs=3",
                           "--catalog", str(catalog))
    assert measured.returncode == 0, measured.stderr
    saved = json.loads(catalog.read_text())["a"]
    assert saved["Wconc"] == pytest.approx(0.9) and saved["Wcold"] == pytest.approx(0.5)
    for args, message in ((["--measured", "a:Wconc=x"], "is not a number"),
                          (["--measured", "zz:Wconc=1"], "no profile of job 'zz'")):
        bad = run_cli("stagger", "--mount", str(m.mountpoint), *args, "--job",
                      "b:I=0.1,Wcold=0.5,Wwarm=0.05,Wconc=0.7,iters=100,epochs=3",
                      "--catalog", str(catalog))
        assert bad.returncode == 2 and message in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
    no_mount = run_cli("stagger", "--measured", "a:Wconc=1", "--job",
                       "b:I=0.1,Wcold=0.5,Wwarm=0.05,Wconc=0.7,iters=100,epochs=3")
    assert no_mount.returncode == 2 and "--measured needs --mount" in no_mount.stderr
