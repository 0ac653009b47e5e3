"""``coordlfs bench placement``: the ranking still equals the one it replaced, one tiny run
(the figures it reports and their invariants), bad options as one-line errors."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

from benchtools import BENCH

from coordlfs.bench.placement import path_of, place, reference_ranking
from coordlfs.peers.placement import Address, owner, ranking


def test_ranking_and_owner_equal_the_function_they_replaced() -> None:
    """Same answers for many node sets (more than the layouts kept, each a fresh tuple, some
    asked twice), whatever the list order: nodes of either version agree on every owner."""
    rng = random.Random(7)
    sets = [tuple({Address(f"10.{rng.randint(0, 3)}.0.{rng.randint(1, 60)}",
                           rng.choice((7878, 80))) for _ in range(rng.randint(1, 40))})
            for _ in range(40)]
    for nodes in sets + sets[:5]:
        shuffled = tuple(rng.sample(nodes, len(nodes)))
        for index in rng.sample(range(1_000_000), 20):
            path = path_of(index)
            expected = reference_ranking(path, nodes)
            assert ranking(path, nodes) == ranking(path, shuffled) == expected
            assert owner(path, nodes) == owner(path, shuffled) == expected[0]


def test_a_join_moves_paths_only_to_the_new_node() -> None:
    (tally,) = place((0, 5_000, (4,), 0))
    assert sum(tally.files) == 5_000 and all(f > 0 for f in tally.files)
    assert 0.7 < tally.join_files / 5_000 * 5 < 1.3


def test_tiny_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "placement.json"
    result = subprocess.run([*BENCH, "placement", "--paths", "3000", "--nodes", "2,8",
                             "--check", "3000", "--timing-paths", "20", "--workers", "2",
                             "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    rows = {r["nodes"]: r for r in report["rows"]}
    assert set(rows) == {2, 8} and all(r["paths"] == 3000 for r in rows.values())
    for n, r in rows.items():
        assert r["leave_moved_vs_ideal"] == 1.0
        assert 0.7 < r["join_files_vs_ideal"] < 1.3
        assert r["max_byte_share_deviation"] < 0.5
        assert min(r["owner_us"], r["ranking_us"], r["old_ranking_us"]) > 0
        for key in ("max_byte_share_deviation", "join_bytes_vs_ideal", "ranking_us",
                    "ranking_speedup"):
            assert f"{key}_{n}" in report["summary"]
    assert "join moved/ideal" in result.stdout


def test_bad_options_are_one_line_errors() -> None:
    for args in (["--nodes", "1"], ["--nodes", "8,x"], ["--nodes", "300"], ["--paths", "0"],
                 ["--check", "-1"], ["--workers", "0"]):
        result = subprocess.run([*BENCH, "placement", *args], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode != 0
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
