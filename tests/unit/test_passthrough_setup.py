"""What ``scripts/setup`` leaves in the venv: after a passthrough build it stamped, the pyfuse3
the venv imports is the patched one, linked to the libfuse built in the venv (by rpath, with
nothing set at run time); the probe then finds nothing missing on pyfuse3's side; and libfuse's
passthrough_hp, built from the same source, runs on that libfuse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyfuse3
import pytest

from coordlfs.fs import passthrough

STAMP = Path(sys.prefix) / ".pyfuse3-passthrough"

built = pytest.mark.skipif(not STAMP.exists(),
                           reason="setup built no patched pyfuse3 here (its one line says why)")


@built
def test_the_venv_imports_the_patched_pyfuse3_and_its_libfuse() -> None:
    assert callable(pyfuse3.backing_open) and callable(pyfuse3.backing_close)
    info = pyfuse3.FileInfo(backing_id=7, noflush=True)
    assert (info.backing_id, info.noflush) == (7, True)
    maps = Path("/proc/self/maps").read_text().splitlines()
    libfuse = {Path(line.split()[-1]).parent for line in maps if "/libfuse3.so" in line}
    assert libfuse == {Path(sys.prefix).resolve() / "libfuse/lib"}


@built
def test_the_probe_finds_the_patched_pyfuse3() -> None:
    assert "pyfuse3" not in (passthrough.available() or "")


HP = Path(sys.prefix) / "libfuse" / "bin" / "passthrough_hp"


@pytest.mark.skipif(not HP.exists(),
                    reason="setup built no passthrough_hp here (its one line says why)")
def test_passthrough_hp_runs_on_the_libfuse_built_beside_it() -> None:
    help_text = subprocess.run([HP, "--help"], capture_output=True, text=True, check=True)
    assert "--nopassthrough" in help_text.stdout + help_text.stderr
    linked = subprocess.run(["ldd", HP], capture_output=True, text=True, check=True).stdout
    libfuse = [line.split("=>")[1].split()[0] for line in linked.splitlines() if "libfuse3" in line]
    assert [Path(p).resolve().parent for p in libfuse] == [HP.resolve().parent.parent / "lib"]
