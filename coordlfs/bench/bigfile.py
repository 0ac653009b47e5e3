"""A cached large file read by fio: 1 MiB sequential and 4 KiB random reads, by 1 and more
reader processes, through tmpfs, coordlfs classic and coordlfs with FUSE passthrough, the
ratios from one run (``coordlfs bench hits``'s big file, ``--big-size``).

fio rather than Python readers: a 4 KiB pread from tmpfs costs about as much as a Python call,
so only a reader in C measures the file system and not the reader. Each run reads with
``psync`` (pread); a sequential reader reads the whole file once, a random reader
``RANDOM_BYTES`` (at most the file) at offsets fio draws without a map, so that pages are
seldom read twice. The mount's page cache of the file is dropped before every run
(``hits.evict``): the bytes come from the cache's tmpfs, through the daemon or passthrough.
"""

from __future__ import annotations

import os
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordlfs.bench.fio import fio_path, fio_report, summarize
from coordlfs.bench.ratios import ratio

#: Bytes each random reader reads (less for a smaller file).
RANDOM_BYTES = 256 << 20
#: Seconds after which fio stops a run (its ``runtime``) and the slack beyond it.
RUNTIME = 60
SLACK = 60
#: The issue's goals for a cached large file, as a share of tmpfs: per pattern.
GOALS = {"sequential": 0.9, "random": 0.8}
#: The systems measured, each compared with tmpfs.
SYSTEMS = ("tmpfs", "coordlfs", "coordlfs_pt")
LABELS = {"tmpfs": "tmpfs (the limit)", "coordlfs": "coordlfs classic",
          "coordlfs_pt": "coordlfs passthrough"}


@dataclass(frozen=True, slots=True)
class Pattern:
    name: str
    #: fio's ``rw``
    rw: str
    block: int


PATTERNS = (Pattern("sequential", "read", 1 << 20), Pattern("random", "randread", 4096))


def unavailable() -> str | None:
    """Why fio cannot run here, or None."""
    if shutil.which("fio") is None:
        return "fio not found (install the Debian package fio, or run scripts/setup)"
    return None


def key(pattern: Pattern, readers: int) -> str:
    """The summary's key of a measurement: ``sequential_1``, ``random_4``."""
    return f"{pattern.name}_{readers}"


def argv(path: str, pattern: Pattern, readers: int, size: int) -> list[str]:
    """fio's command line for ``readers`` processes reading ``path`` of ``size`` bytes."""
    each = size if pattern.rw == "read" else min(size, RANDOM_BYTES)
    return ["fio", "--output-format=json", "--readonly", f"--name={pattern.name}",
            f"--filename={fio_path(Path(path))}", f"--rw={pattern.rw}",
            f"--bs={pattern.block}", f"--size={size}", f"--io_size={each}",
            f"--numjobs={readers}", "--group_reporting", "--ioengine=psync",
            "--norandommap", "--randrepeat=0", "--invalidate=0", f"--runtime={RUNTIME}"]


def measure(path: str, pattern: Pattern, readers: int, size: int, scratch: Path) -> float:
    """One fio run; GB/s (10**9 bytes per second) of all its readers together."""
    report = fio_report(argv(path, pattern, readers, size), dict(os.environ), scratch,
                        RUNTIME + SLACK, f"fio {pattern.name} x{readers} of {path}")
    return summarize(report, pattern.name)["bw_bytes"] / 1e9


def summary(runs: dict[tuple[str, str], list[float]], why_not: dict[str, str],
            readers: tuple[int, ...]) -> dict[str, Any]:
    """Medians per system and measurement, each system's share of tmpfs and of coordlfs
    classic, and whether the goals are met (None: coordlfs passthrough could not run)."""
    keys = [key(p, n) for p in PATTERNS for n in readers]
    medians = {system: {k: statistics.median(runs[system, k]) if runs.get((system, k))
                        else None for k in keys} for system in SYSTEMS}

    def share(system: str, base: str) -> dict[str, float | None]:
        return {k: None if medians[system][k] is None or medians[base][k] is None
                else ratio(medians[system][k], medians[base][k]) for k in keys}

    vs_tmpfs = {system: share(system, "tmpfs") for system in SYSTEMS[1:]}
    passthrough = vs_tmpfs["coordlfs_pt"]
    met = None if any(passthrough[k] is None for k in keys) else all(
        passthrough[key(p, n)] >= GOALS[p.name] for p in PATTERNS for n in readers)
    return {"gb_per_s": medians, "vs_tmpfs": vs_tmpfs,
            "passthrough_vs_classic": share("coordlfs_pt", "coordlfs"),
            "goals": GOALS, "goal_met": met, "unavailable": why_not,
            "runs": {f"{system} {k}": values for (system, k), values in runs.items()}}


def format_table(result: dict[str, Any], readers: tuple[int, ...], title: str) -> str:
    """A row per system: GB/s and the share of tmpfs per pattern and reader count."""
    keys = [key(p, n) for p in PATTERNS for n in readers]
    head = f"{title:<24}" + "".join(f" | {k.replace('_', ' x'):>16}" for k in keys)
    lines = [head, f"{'':<24}" + f" | {'GB/s':>6} {'vs tmpfs':>9}" * len(keys), "-" * len(head)]
    for system in SYSTEMS:
        why = result["unavailable"].get(system)
        if why:
            lines.append(f"{LABELS[system]:<24} | n/a: {why}")
            continue
        cells = ""
        for k in keys:
            rate = result["gb_per_s"][system][k]
            share = 1.0 if system == "tmpfs" else result["vs_tmpfs"][system][k]
            cells += (f" | {rate:>6.2f} {100 * share:>8.0f}%" if rate is not None
                      and share is not None else f" | {'-':>16}")
        lines.append(f"{LABELS[system]:<24}{cells}")
    return "\n".join(lines)
