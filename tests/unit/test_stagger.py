"""The stagger advisor against the HiPC'23 model worked by hand, its search, catalog and CLI.

Notation as in the paper: r = I + W is the seconds per iteration in a phase; t_B the delay,
t_C the catch-up time, N the iterations A has done by then, N_E the iterations per epoch.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from conftest import run_cli

from coordlfs.errors import UserError
from coordlfs.models.stagger import (
    TIE,
    JobProfile,
    Phase,
    Prediction,
    catch_up,
    closed_form,
    delay_table,
    load_catalog,
    measured_job,
    measured_values,
    optimal_delay,
    predict,
    predict_makespan,
    save_profile,
    simulate,
    standalone_runtime,
)

# Case 1: B catches up within A's first epoch; the optimum is where it does so at its very end.
# A: r_A = 0.2 + 0.3 = 0.5 cold, 0.2 + 0.05 = 0.25 cached, 0.2 + 0.6 = 0.8 concurrent.
# B: r_B|cached = 0.1 + 0.15 = 0.25, r_B|conc = 0.1 + 0.5 = 0.6. N_E = 1000, two epochs each.
A1 = JobProfile("A", iterations=1000, epochs=2, I=0.2, W_cold=0.3, W_warm=0.05, W_concurrent=0.6)
B1 = JobProfile("B", iterations=1000, epochs=2, I=0.1, W_cold=0.4, W_warm=0.15, W_concurrent=0.5)

# Case 2: the optimum is where A's and B's end times cross, inside the catch-up regime.
# A: r_A = 1.0, r_A|cached = 0.6, r_A|conc = 1.5; N_E = 100, one epoch.
# B: r_B|cached = 0.2, r_B|conc = 0.5; N_E = 100, two epochs.
A2 = JobProfile("A", iterations=100, epochs=1, I=0.5, W_cold=0.5, W_warm=0.1, W_concurrent=1.0)
B2 = JobProfile("B", iterations=100, epochs=2, I=0.15, W_cold=0.3, W_warm=0.05, W_concurrent=0.35)

# Case 3: B reads the cache slower (r_B|cached = 0.6) than A reads the repository (r_A = 0.5),
# so it never catches up (the last paragraph of section V-A).
A3 = JobProfile("A", iterations=100, epochs=1, I=0.2, W_cold=0.3, W_warm=0.05, W_concurrent=0.6)
B3 = JobProfile("B", iterations=100, epochs=1, I=0.5, W_cold=0.5, W_warm=0.1, W_concurrent=0.9)


def test_standalone_runtime_is_the_100_percent() -> None:
    # first epoch from the repository, the second from the cache: 1000*0.5 + 1000*0.25 = 750
    assert standalone_runtime(A1) == pytest.approx(750)
    assert standalone_runtime(A2) == pytest.approx(100)  # 100 * 1.0, one epoch


def test_equations_1_to_4_at_20_percent() -> None:
    t_b = 0.2 * 750  # 150 s
    # eq. 1: t_C = 150 / (1 - 0.25/0.5) = 300, N = 300 / 0.5 = 600
    assert catch_up(A1, B1, t_b) == pytest.approx((300, 600))
    # eq. 2: T_A1 = 300 + (1000-600)*0.8 = 620, T_B1 = 300 - 150 + 400*0.6 = 390
    # eq. 3: T_A = 620 + 1000*0.25 = 870, T_B = 390 + 1000*0.25 = 640, so B ends at 790
    assert closed_form(A1, B1, t_b) == pytest.approx((870, 790))
    p = predict([A1, B1], 0.2)
    assert p.start == pytest.approx(150)
    assert p.catch_up == pytest.approx(300)
    assert p.finish == pytest.approx((870, 790))
    assert p.makespan == pytest.approx(870)  # eq. 4: max(870, 640 + 150)
    assert predict_makespan([A1, B1], 0.2) == pytest.approx(870)


def test_state_machine_walks_figure_5() -> None:
    p = predict([A1, B1], 0.2)
    # SR: A alone until t_B = 150. CL: B reads A's cache until t_C = 300. CR: both on the
    # repository; B ends its first epoch at 300 + 400*0.6 = 540. CL/R: B cached, A remote until
    # 620. CL: both cached; B ends at 540 + 1000*0.25 = 790. SL: A alone on its cache until 870.
    assert [s.state for s in p.segments] == ["SR", "CL", "CR", "CL/R", "CL", "SL"]
    ends = [s.end for s in p.segments]
    assert ends == pytest.approx([150, 300, 540, 620, 790, 870])
    assert p.segments[2].phases == (Phase.SHARED, Phase.SHARED)
    assert p.segments[1].phases == (Phase.REMOTE, Phase.BEHIND)


def test_simultaneous_start() -> None:
    # t_B = 0: eq. 1 gives t_C = 0, N = 0, both on the repository from the start (CR).
    # T_A = 1000*0.8 + 1000*0.25 = 1050, T_B = 1000*0.6 + 1000*0.25 = 850
    assert catch_up(A1, B1, 0) == (0, 0)
    assert closed_form(A1, B1, 0) == pytest.approx((1050, 850))
    p = predict([A1, B1], 0)
    assert p.finish == pytest.approx((1050, 850))
    assert p.segments[0].state == "CR"


def test_no_catch_up_within_the_first_epoch() -> None:
    # 40%: t_B = 300; eq. 1 would put t_C at 600, N = 1200 > N_E = 1000: A's first epoch ends
    # first, so there are no closed forms. A runs as alone (750); B reads only the cache:
    # 2*1000*0.25 = 500, ending at 800.
    assert catch_up(A1, B1, 300) is None
    assert closed_form(A1, B1, 300) is None
    p = predict([A1, B1], 0.4)
    assert p.catch_up is None
    assert p.finish == pytest.approx((750, 800))


def test_sequential_is_100_percent() -> None:
    # the "sequential" baseline: A alone (750), then B all from the cache (500) from t = 750
    p = predict([A1, B1], 1.0)
    assert p.finish == pytest.approx((750, 1250))
    assert {s.state for s in p.segments} == {"SR", "SL"}


def test_optimum_where_b_catches_up_at_the_end_of_a_first_epoch() -> None:
    # For t_B <= 250 (N = 4 t_B <= 1000): T_A = 2t_B + (1000 - 4t_B)*0.8 + 250 = 1050 - 1.2t_B
    # and B ends at 2t_B + (1000 - 4t_B)*0.6 + 250 = 850 - 0.4t_B; beyond, T_A = 750 and B
    # ends at t_B + 500. The minimum is at t_B = 250 = 1/3 of 750: makespan 750.
    best = optimal_delay([A1, B1])
    assert best.delay == pytest.approx(1 / 3, abs=1e-5)
    assert best.makespan == pytest.approx(750, rel=1e-6)
    assert [p.makespan for p in delay_table([A1, B1])] == pytest.approx(
        [1050, 960, 870, 780, 800, 875, 950, 1025, 1100, 1175, 1250])


def test_optimum_where_the_end_times_cross() -> None:
    # t_C = t_B / (1 - 0.2/1.0) = 1.25 t_B = N, within the first epoch while t_B <= 80.
    # T_A = 1.25t + (100 - 1.25t)*1.5 = 150 - 0.625t
    # B ends at 1.25t + (100 - 1.25t)*0.5 + 100*0.2 = 70 + 0.625t
    # equal at t = 64 (64% of 100 s): makespan 110. At 64: t_C = 80, N = 80,
    # T_A1 = 80 + 20*1.5 = 110, T_B1 = 80 - 64 + 20*0.5 = 26, T_B = 26 + 100*0.2 = 46.
    assert closed_form(A2, B2, 64) == pytest.approx((110, 110))
    best = optimal_delay([A2, B2])
    assert best.delay == pytest.approx(0.64, abs=1e-5)
    assert best.makespan == pytest.approx(110, rel=1e-6)
    # the grid: 60% -> max(150 - 37.5, 70 + 37.5) = 112.5; 70% -> max(106.25, 113.75)
    assert predict_makespan([A2, B2], 0.6) == pytest.approx(112.5)
    assert predict_makespan([A2, B2], 0.7) == pytest.approx(113.75)


def test_b_slower_than_a_never_catches_up() -> None:
    # r_B|cached = 0.6 >= r_A = 0.5: no t_C. A alone: 100*0.5 = 50. At 50%: t_B = 25, B reads
    # the cache: 100*0.6 = 60, ends at 85.
    assert catch_up(A3, B3, 25) is None
    p = predict([A3, B3], 0.5)
    assert p.catch_up is None
    assert p.finish == pytest.approx((50, 85))
    # At 0 both share the repository: A 100*0.8 = 80, B 100*1.4 = 140. Just after 0, B reads
    # the cache and ends at t_B + 60: the optimum is the smallest delay, not 0 (a jump at 0).
    assert predict([A3, B3], 0).finish == pytest.approx((80, 140))
    best = optimal_delay([A3, B3])
    assert 0 < best.delay < 1e-5
    assert best.makespan == pytest.approx(60, rel=1e-6)


def test_different_batch_sizes_compare_positions_in_the_dataset() -> None:
    # B has half the iterations per epoch (batches twice as large). A's epoch from the
    # repository takes 1000*0.5 = 500 s, B's from the cache 500*0.5 = 250 s.
    # t_B = 100: t_C = 100 / (1 - 250/500) = 200, when A has read 200/500 = 40% of the dataset.
    # T_A1 = 200 + 0.6*1000*0.8 = 680; T_B1 = 200 - 100 + 0.6*500*1.2 = 460, B ends at 560.
    a = JobProfile("A", iterations=1000, epochs=1, I=0.2, W_cold=0.3, W_warm=0.05,
                   W_concurrent=0.6)
    b = JobProfile("B", iterations=500, epochs=1, I=0.2, W_cold=0.6, W_warm=0.3, W_concurrent=1.0)
    assert closed_form(a, b, 100) == pytest.approx((680, 560))
    assert simulate(a, b, 100).finish == pytest.approx((680, 560))


def _random_profile(rng: random.Random, name: str) -> JobProfile:
    """Within the paper's premise: W|cached <= W <= W|conc."""
    cold = rng.uniform(0.0, 1.0)
    return JobProfile(name, iterations=rng.choice([100, 1000, 1560]), epochs=rng.randint(1, 4),
                      I=rng.uniform(0.05, 0.5), W_cold=cold, W_warm=rng.uniform(0, cold),
                      W_concurrent=rng.uniform(cold, 2 * cold + 0.1))


def _pairs(count: int) -> list[tuple[JobProfile, JobProfile]]:
    rng = random.Random(20231218)
    return [(_random_profile(rng, "A"), _random_profile(rng, "B")) for _ in range(count)]


@pytest.mark.parametrize(("first", "second"), _pairs(200))
def test_state_machine_reproduces_the_closed_forms(first: JobProfile, second: JobProfile) -> None:
    total = standalone_runtime(first)
    for fraction in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8):
        expected = closed_form(first, second, fraction * total)
        p = predict([first, second], fraction)
        if expected is not None:
            assert p.finish == pytest.approx(expected, rel=1e-9)
            assert p.catch_up == pytest.approx(catch_up(first, second, fraction * total)[0])
        else:  # no catch-up: A runs as if alone, B only from the cache
            assert p.finish[0] == pytest.approx(total, rel=1e-9)
            cached = second.epochs * second.iterations * (second.I + second.W_warm)
            assert p.finish[1] == pytest.approx(p.start + cached, rel=1e-9)


def _grid_best(jobs: list[JobProfile], steps: int = 1000) -> tuple[Prediction, float]:
    """The fine exhaustive search (the paper's "ideal staggering", at 0.1%) and the largest
    change between neighbouring points: the most the grid can miss the true minimum by."""
    grid = [predict(jobs, i / steps) for i in range(steps + 1)]
    low = min(p.makespan for p in grid)
    best = max((p for p in grid if p.makespan <= low * (1 + TIE)), key=lambda p: p.delay)
    jump = max(abs(b.makespan - a.makespan) for a, b in itertools.pairwise(grid))
    return best, jump


@pytest.mark.parametrize(("first", "second"), [(A1, B1), (B1, A1), (A2, B2), (B2, A2), (A3, B3),
                                               (B3, A3)])
def test_binary_search_agrees_with_a_fine_grid_on_the_worked_cases(
        first: JobProfile, second: JobProfile) -> None:
    best = optimal_delay([first, second])
    grid, jump = _grid_best([first, second])
    # the search stops within 1e-6 of the best delay, so it may miss a grid point that lies
    # exactly on the optimum (64% here and there) by that much
    assert best.makespan <= grid.makespan * (1 + 1e-6)
    assert grid.makespan - best.makespan <= jump + 1e-9
    assert best.delay == pytest.approx(grid.delay, abs=2e-3)


@pytest.mark.parametrize(("first", "second"), _pairs(12))
def test_binary_search_agrees_with_a_fine_grid(first: JobProfile, second: JobProfile) -> None:
    best = optimal_delay([first, second])
    grid, jump = _grid_best([first, second])
    assert best.makespan <= grid.makespan * (1 + 1e-6)  # never worse than the grid
    assert grid.makespan - best.makespan <= jump + 1e-9  # and no better than it can be


def test_model_input_errors() -> None:
    with pytest.raises(ValueError, match="two jobs"):
        predict([A1], 0.5)
    with pytest.raises(ValueError, match="two jobs"):
        optimal_delay([A1, B1, A2])
    with pytest.raises(ValueError, match="delay"):
        predict([A1, B1], -0.1)
    with pytest.raises(ValueError, match="delay"):
        predict([A1, B1], float("nan"))


@pytest.mark.parametrize(("changes", "match"), [
    ({"name": ""}, "job name"), ({"name": "a:b"}, "job name"),
    ({"iterations": 0}, "iters"), ({"epochs": 1.5}, "epochs"), ({"iterations": True}, "iters"),
    ({"I": 0.0}, r"I \(training time"), ({"W_cold": -0.1}, "Wcold"),
    ({"W_warm": float("inf")}, "Wwarm"), ({"W_concurrent": "0.7"}, "Wconc"),
])
def test_profile_validation(changes: dict, match: str) -> None:
    fields = {"name": "x", "iterations": 10, "epochs": 1, "I": 0.1, "W_cold": 0.2,
              "W_warm": 0.0, "W_concurrent": 0.3, **changes}
    with pytest.raises(ValueError, match=match):
        JobProfile(**fields)


# The catalog.


def test_catalog_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state" / "coordlfs" / "profiles.json"
    assert load_catalog(path) == {}  # no file yet: empty
    save_profile(path, A1)
    save_profile(path, B2)
    assert load_catalog(path) == {"A": A1, "B": B2}
    assert json.loads(path.read_text())["A"] == {
        "iters": 1000, "epochs": 2, "I": 0.2, "Wcold": 0.3, "Wwarm": 0.05, "Wconc": 0.6}
    save_profile(path, B1)  # same name: replaced, A kept
    assert load_catalog(path) == {"A": A1, "B": B1}
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["profiles.json"]


def test_catalog_keeps_what_it_does_not_know(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"A": {"iters": 1000, "epochs": 2, "I": 0.2, "Wcold": 0.3,
                                      "Wwarm": 0.05, "Wconc": 0.6, "measured": "2024-01-01"}}))
    assert load_catalog(path) == {"A": A1}
    save_profile(path, B1)
    assert json.loads(path.read_text())["A"]["measured"] == "2024-01-01"


@pytest.mark.parametrize(("text", "match"), [
    ("{", "is not JSON"),
    ("[]", "must be a JSON object"),
    ('{"A": 3}', "job 'A': the record must be a JSON object"),
    ('{"A": {"iters": 10}}', "job 'A': the record lacks epochs, I, Wcold, Wwarm, Wconc"),
    ('{"A": {"iters": 10, "epochs": 1, "I": 0.1, "Wcold": -1, "Wwarm": 0, "Wconc": 0}}',
     "job 'A': Wcold"),
    ('{"A": {"iters": 1e3, "epochs": 1, "I": 0.1, "Wcold": 1, "Wwarm": 0, "Wconc": 0}}',
     "job 'A': iters"),
    ('{"A": {"iters": 10, "epochs": 1, "I": "0.1", "Wcold": 1, "Wwarm": 0, "Wconc": 0}}',
     r"job 'A': I \("),
    ('{"a:b": {"iters": 10, "epochs": 1, "I": 0.1, "Wcold": 1, "Wwarm": 0, "Wconc": 0}}',
     "job name"),
])
def test_malformed_catalog(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "profiles.json"
    path.write_text(text)
    with pytest.raises(UserError, match=match) as raised:
        load_catalog(path)
    assert "\n" not in str(raised.value)
    assert str(path) in str(raised.value)
    with pytest.raises(UserError):
        save_profile(path, A1)  # a catalog that does not parse is not overwritten
    assert path.read_text() == text


def test_unreadable_catalog(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read catalog"):
        load_catalog(tmp_path)  # a directory


# The command.

JOB_A = "A:I=0.2,Wcold=0.3,Wwarm=0.05,Wconc=0.6,iters=1000,epochs=2"
JOB_B = "B:I=0.1,Wcold=0.4,Wwarm=0.15,Wconc=0.5,iters=1000,epochs=2"


def test_cli_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "stagger.json"
    result = run_cli("stagger", "--job", JOB_A, "--job", JOB_B, "--json", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line.split() for line in lines if line.strip().split()[0].endswith("%")]
    assert [r[0] for r in rows] == [f"{p}%" for p in range(0, 101, 10)]
    assert [float(r[-1]) for r in rows][:4] == [1050.0, 960.0, 870.0, 780.0]
    assert "optimum: delay 33.3% (B starts at 250.0 s), makespan 750.0 s" in result.stdout
    data = json.loads(out.read_text())
    assert data["optimum"]["makespan_s"] == pytest.approx(750, rel=1e-6)
    assert [row["delay"] for row in data["table"]] == pytest.approx([p / 10 for p in range(11)])
    assert data["jobs"][0]["name"] == "A"


def test_cli_from_catalog_in_command_line_order(tmp_path: Path) -> None:
    catalog = tmp_path / "profiles.json"
    save_profile(catalog, B1)
    # the catalog job comes first, so it is A; epochs replaced for this run
    result = run_cli("stagger", "--catalog", str(catalog), "--from-catalog", "B:epochs=1",
                     "--job", JOB_A)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("A = B starts first; B = A starts after a delay")
    # A = B1 with one epoch: 1000 * (0.1 + 0.4) = 500 s alone
    assert "standalone runtime (500.0 s)" in result.stdout


@pytest.mark.parametrize(("args", "match"), [
    ([], "needs two jobs"),
    (["--job", JOB_A], "needs two jobs"),
    (["--job", JOB_A, "--job", JOB_B, "--job", JOB_A], "covers pairs, got 3"),
    (["--job", JOB_A, "--job", JOB_B.replace("Wconc", "Wfoo")], "unknown key 'Wfoo'"),
    (["--job", JOB_A, "--job", JOB_B.replace("Wcold=0.4", "Wcold=-0.4")], "Wcold"),
    (["--job", JOB_A, "--job", JOB_B.replace("I=0.1", "I=fast")], "I='fast' is not a number"),
    (["--job", JOB_A, "--job", JOB_B.replace("iters=1000", "iters=1e3")],
     "iters='1e3' is not a whole number"),
    (["--job", JOB_A, "--job", "B:I=0.1"], "missing iters, epochs, Wcold, Wwarm, Wconc"),
    (["--job", JOB_A, "--job", "B"], "expected NAME:KEY=VALUE"),
    (["--job", JOB_A, "--job", JOB_B + ",I=0.3"], "I given twice"),
    (["--job", JOB_A, "--from-catalog", "nobody"], "no job 'nobody' in catalog"),
    (["--job", JOB_A, "--from-catalog"], "expected at least one argument"),
    (["--job", JOB_A, "--job", JOB_B, "--bogus"], "unrecognized arguments"),
])
def test_cli_bad_arguments(tmp_path: Path, args: list[str], match: str) -> None:
    result = run_cli("stagger", "--catalog", str(tmp_path / "none.json"), *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert match in result.stderr
    assert result.stdout == ""


def test_cli_malformed_catalog(tmp_path: Path) -> None:
    catalog = tmp_path / "profiles.json"
    catalog.write_text('{"A": {"iters": 10}}')
    result = run_cli("stagger", "--catalog", str(catalog), "--from-catalog", "A", "--job", JOB_B)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"coordlfs stagger: catalog {catalog}: job 'A': the record "
                                     f"lacks epochs, I, Wcold, Wwarm, Wconc")


# -- calibration from the stall profiler's records on a real mount ----------------------------


def test_measured_values_follow_the_profiles() -> None:
    epochs = {"0": {"steps": 100, "wait_s": 50.0, "step_s": 20.0},
              "1": {"steps": 100, "wait_s": 5.0, "step_s": 20.0},
              "2": {"steps": 100, "wait_s": 7.0, "step_s": 20.0}}
    values = measured_values("a", epochs)
    assert values == {"iterations": 100, "epochs": 3, "I": 0.2, "W_cold": 0.5, "W_warm": 0.06}
    with pytest.raises(UserError, match="needs a cold first epoch and at least one warm"):
        measured_values("a", {"0": epochs["0"]})
    with pytest.raises(UserError, match="malformed profile"):
        measured_values("a", {"0": {"steps": "x"}, "1": {}})


def test_measured_job_takes_w_conc_from_a_run_beside_a_partner() -> None:
    alone = {"job": "a", "epochs": {"0": {"steps": 100, "wait_s": 50.0, "step_s": 20.0,
                                          "partners": []},
                                    "1": {"steps": 100, "wait_s": 5.0, "step_s": 20.0}}}
    beside = {"job": "a", "epochs": {"0": {"steps": 100, "wait_s": 80.0, "step_s": 20.0,
                                           "partners": ["b"]}}}
    job = measured_job("a", [alone, beside])
    assert (job.W_cold, job.W_concurrent, job.W_warm) == (0.5, 0.8, 0.05)
    assert measured_job("a:Wconc=0.3", [beside, alone]).W_concurrent == 0.3
    with pytest.raises(UserError, match="no run of 'a' alone"):
        measured_job("a", [beside])
    with pytest.raises(UserError, match="give Wconc"):
        measured_job("a", [alone])
