"""The what-if model's predicted epoch times against epochs really run at other budgets.

``coordlfs whatif`` predicts, from the rates of one run, how long an epoch would take with
another cache size (``coordlfs.models.whatif``). This checks it as appendix C of the CoorDL paper
checks DS-Analyzer (table 5): training epochs run through the mount at ONE memory budget
(``--budget``, on storage throttled so that it is the bottleneck, as ``bench epochs`` does),
each epoch marked on the mount and its stall profile reported as ``coordlfs.torch.profiled``
would; the what-if analysis of that run predicts the steady-state epoch time (epochs after
the first) at each of ``--budgets``, whose cache is what ``bench epochs`` gives a mount under
that budget; then those budgets are really run and the median of their steady-state epochs
is compared with the prediction.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coordlfs.bench import harness
from coordlfs.bench.epochs import (
    CGROUP_PREFIX,
    ConfigResult,
    Settings,
    Sizing,
    budget_bytes,
    cache_size_for,
    measure_sizing,
    run_coordlfs,
    settings_from,
)
from coordlfs.bench.ratios import median
from coordlfs.errors import UserError
from coordlfs.models import whatif
from coordlfs.protocol.client import Control
from coordlfs.sizes import format_size
from coordlfs.testbed.dataset import Dataset

#: The goal: predictions within this share of the measured epoch time.
GOAL_PERCENT = 15.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_dataset_arguments(parser, "whatif", make="6000:110K")
    parser.add_argument("--budget", default="0.5",
                        help="the budget of the run the rates are measured in: bytes (K/M/G) "
                             "or a fraction of the dataset (default 0.5)")
    parser.add_argument("--budgets", default="0.25,0.5,0.75",
                        help="budgets to predict and then run, separated by commas "
                             "(default 0.25,0.5,0.75)")
    harness.add_training_arguments(parser, readers=4, readers_help="reader processes",
                                   compute_ms=0.0)
    # three steady-state epochs to take the median of; the mount is the only stack it runs
    parser.set_defaults(epochs=4, stacks="coordlfs")


class Recorder:
    """Marks each epoch on the mount, reports each epoch's stall profile, and keeps what the
    what-if analysis reads, before the mount goes."""

    def __init__(self, mountpoint: Path, steps: int) -> None:
        self.control = Control(mountpoint)
        self.steps = steps
        self.epoch = 0
        self.analysis_input: tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]] | None \
            = None

    def before_epoch(self, _order: list[str]) -> None:
        self.epoch += 1
        self.control.mark(f"epoch-{self.epoch}")

    def finished(self, result: ConfigResult) -> None:
        self.control.mark("end")
        for epoch in result.epochs:
            waited = epoch.seconds * epoch.stall_percent / 100
            self.control.report_profile("bench-whatif", epoch.epoch, self.steps,
                                        round(waited, 6),
                                        round(epoch.seconds - waited, 6))
        self.analysis_input = (self.control.status(), self.control.marks(),
                               self.control.stats())


@dataclass(slots=True)
class Row:
    budget_text: str
    budget_bytes: int
    #: the cache the prediction assumed (the budget less the readers' and daemon's memory of
    #: the measured run) and the one the real run had
    predicted_cache_bytes: int
    measured_cache_bytes: int
    predicted_s: float
    measured_s: float
    #: None where the measured epochs took no measurable time
    error_percent: float | None
    measured_epochs_s: list[float]
    disturbed_epochs: list[int]


def disturbed_steady(result: ConfigResult) -> set[int]:
    """The epochs after the first during which another process dropped the kernel's caches,
    to be left out; none if that would leave out every one."""
    disturbed = set(result.disturbed_epochs) - {1}
    return set() if disturbed >= {e.epoch for e in result.epochs[1:]} else disturbed


def steady_seconds(result: ConfigResult) -> float:
    """The median epoch time after the first (cold) epoch, leaving out the disturbed ones."""
    left_out = disturbed_steady(result)
    later = [e.seconds for e in result.epochs[1:] if e.epoch not in left_out]
    return median(later or [result.epochs[0].seconds]) or 0.0


def parse_budgets(text: str) -> list[str]:
    budgets = [b.strip() for b in text.split(",") if b.strip()]
    if not budgets:
        raise UserError(f"bad --budgets {text!r}: give budgets separated by commas")
    return budgets


def one_run(dataset: Dataset, settings: Settings, work: Path, budgets: list[str],
            sizing: Sizing) -> dict:
    """Measure at ``settings.budget_text``, predict ``budgets``, run them."""
    calibration_budget = budget_bytes(settings.budget_text, dataset.total_bytes)
    recorder = Recorder(work / "mnt", -(-len(dataset.files) // settings.batch))
    print(f"measuring the rates at budget {format_size(calibration_budget)}", flush=True)
    calibration = run_coordlfs(dataset, calibration_budget, settings, work, sizing,
                               observer=recorder)
    if calibration.failed:
        raise UserError(f"the run measuring the rates failed: {calibration.failed}")
    assert recorder.analysis_input is not None
    analysis = whatif.analyse(*recorder.analysis_input, None, os.cpu_count() or 1,
                              leave_out=disturbed_steady(calibration))
    rates = whatif.Rates.from_json(analysis["rates"])
    print(whatif.format_report(analysis), flush=True)
    rows = []
    for text in budgets:
        budget = budget_bytes(text, dataset.total_bytes)
        cache = cache_size_for(budget, dataset, sizing, settings.readers)
        predicted = whatif.predict(rates, cache / rates.dataset_bytes).epoch_s
        print(f"budget {text} ({format_size(budget)}): cache {format_size(cache)}, predicted "
              f"{predicted:.1f} s per epoch; running it", flush=True)
        result = run_coordlfs(dataset, budget, settings, work, sizing)
        measured = steady_seconds(result)
        rows.append(Row(text, budget, cache, result.cache_capacity_bytes or 0,
                        round(predicted, 3), measured,
                        round(100 * (predicted - measured) / measured, 1) if measured else None,
                        [e.seconds for e in result.epochs], result.disturbed_epochs))
    return {"calibration": {"budget_bytes": calibration_budget,
                            "cache_capacity_bytes": calibration.cache_capacity_bytes,
                            "epochs": [asdict(e) for e in calibration.epochs],
                            "disturbed_epochs": calibration.disturbed_epochs,
                            "analysis": analysis},
            "rows": [asdict(r) for r in rows]}


def _error(row: dict[str, Any]) -> str:
    return "-" if row["error_percent"] is None else f"{row['error_percent']:+.1f}%"


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["budget   cache       predicted s  measured s  error"]
    for r in rows:
        lines.append(f"{r['budget_text']:8} {format_size(r['predicted_cache_bytes']):>10} "
                     f"{r['predicted_s']:12.1f} {r['measured_s']:11.1f} {_error(r)}")
    return "\n".join(lines)


def summarize(runs: list[dict[str, Any]], budgets: list[str]) -> dict[str, Any]:
    """Per budget, the medians over runs; the largest error against the goal."""
    per_budget = {}
    for i, text in enumerate(budgets):
        rows = [run["rows"][i] for run in runs]
        per_budget[text] = {
            "predicted_s": median([r["predicted_s"] for r in rows]),
            "measured_s": median([r["measured_s"] for r in rows]),
            "error_percent": median([r["error_percent"] for r in rows]),
        }
    worst = max(abs(b["error_percent"] or 0) for b in per_budget.values())
    return {"budgets": per_budget, "max_abs_error_percent": worst,
            "goal_percent": GOAL_PERCENT, "within_goal": worst <= GOAL_PERCENT}


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    budgets = parse_budgets(args.budgets)
    harness.require_root("bench whatif", harness.TRAINING_NEEDS)
    work = harness.work_dir(args.work, cgroups=CGROUP_PREFIX)
    dataset = harness.load_dataset(args)
    sizing = measure_sizing(dataset, work)
    for text in (settings.budget_text, *budgets):  # a bad budget fails before any run
        if not cache_size_for(budget_bytes(text, dataset.total_bytes), dataset, sizing,
                              settings.readers):
            raise UserError(f"budget {text} leaves no room for a cache beside the daemon "
                            "and the readers: give a bigger one")
    print(f"{harness.describe_dataset(dataset)}; throttle "
          f"{harness.describe_throttle(settings.throttle)}", flush=True)
    runs = [one_run(dataset, settings, work, budgets, sizing)
            for _number in harness.repeated(settings.repeat)]
    for result in runs:
        print(format_table(result["rows"]))
    summary = summarize(runs, budgets)
    print(f"largest error {summary['max_abs_error_percent']}% (goal {GOAL_PERCENT:g}%: "
          f"{'met' if summary['within_goal'] else 'missed'})")
    harness.write_report(args.json, {
        "dataset": harness.dataset_record(dataset),
        "settings": asdict(settings),
        "budgets": budgets,
        "runs": runs,
        "summary": summary,
    })
    return 0
