"""What-if analysis in the style of DS-Analyzer (CoorDL paper, section 3.4 and appendix C).

A user wants to know what a bigger cache, more CPUs or faster storage would buy before paying
for them. DS-Analyzer answers from measured rates: data is fetched at an effective rate F
(hits at the cache's speed C, misses at the storage's S), prepared at P and consumed by the
GPU at G, all pipelined, so an epoch takes as long as the slowest of the three:

    fetch = hit bytes / C + miss bytes / S        (misses a peer serves: at the peers' speed)
    epoch = max(fetch, prep, compute)             stall share = (epoch - compute) / epoch

and with a no-eviction cache (a cached file is never evicted) every epoch after the first has
exactly ``min(cache / dataset, 1)`` of its bytes as hits.

The rates come from one run on the mount: the epochs are the intervals jobs marked as epochs,
each from a mark named ``epoch-N`` (``EPOCH_MARK``: as the README, the benchmarks and the
demo name them) to the next mark, whatever its name (the next epoch's, ``end``). Marks are
mount-wide and every job's, so an interval from any other mark (a job's ``end`` to the next
job's first epoch, a user's ``e1`` or ``warmed``) holds reads of no epoch: a warm, a listing,
another job's end; it is left out. Each epoch's seconds and bytes from storage, cache and
peers give one equation ``seconds = storage/S + cache/C + peers/P``; epochs with different
hit shares (the cold first epoch and the warm ones) determine S and C by least squares. Step
times come from ``coordlfs.torch.profiled`` (the compute per epoch). The dataset is the
source's size of the files an epoch opened (``opened_bytes``), not what it read. What the run
does not show is assumed and said, never guessed silently. Everything here is pure
arithmetic on the control file's JSON (``analyse``), apart from the plot.
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

from coordlfs.errors import UserError
from coordlfs.sizes import format_size, plural

#: Assumed cache speed, bytes/s, where the run cannot tell it (no hits, or every epoch at
#: one hit share): a pyfuse3 mount serves 112 KB cached files at about 7,500 files/s to 4
#: readers on this machine kind (docs/benchmarks/hits.md), about 800 MB/s.
DEFAULT_CACHE_BPS = 800e6
#: The fastest a cache or a peer is taken to be (memory bandwidth, as DS-Analyzer
#: approximates C): a fit that finds hits cost no time would otherwise predict free epochs.
MAX_BPS = 10e9
#: An epoch no longer than this times the compute per epoch was bound by compute: its time
#: says nothing about fetching.
COMPUTE_BOUND = 1.05
#: Hit shares closer than this across epochs cannot tell the cache's cost from storage's.
MIN_SHARE_SPREAD = 0.05
#: A fitted cache no faster than this share of storage's speed means cached bytes did not
#: shorten epochs: the pipeline is bound by something else (prep).
NOT_FASTER = 1.1
#: Epoch time within this of the best counts as the best (the smallest cache that gets it).
NEAR_BEST = 1.02
CACHE_FRACTIONS = tuple(i / 10 for i in range(11))
CPU_FACTORS = (0.5, 1, 2, 4)
STORAGE_FACTORS = (0.5, 1, 2, 4)
SOURCES = ("storage", "cache", "peers")
#: A mark that starts an epoch: ``epoch`` and its number, after anything that is not a letter
#: (``epoch-3``, ``epoch 3``, ``epoch_3``, ``epoch3``, ``resnet/epoch-3``, ``Epoch-3``).
EPOCH_MARK = re.compile(r"(?:^|[^a-z])epoch[-_ .:]?\d+$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Interval:
    """One epoch: the counters between two marks (or over the whole window)."""

    name: str
    seconds: float
    storage_bytes: int
    cache_bytes: int
    peer_bytes: int
    #: the source's sizes of the files it opened (``opened_bytes``): the dataset, for an
    #: epoch that reads each file once, whatever the reads cost
    opened_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.storage_bytes + self.cache_bytes + self.peer_bytes

    def by_source(self) -> tuple[int, int, int]:
        return self.storage_bytes, self.cache_bytes, self.peer_bytes


@dataclass(frozen=True, slots=True)
class Rates:
    """What the model needs, measured or assumed (``assumptions`` says which)."""

    dataset_bytes: float
    cache_bytes: float
    storage_bps: float
    cache_bps: float
    #: None: no peer served anything
    peer_bps: float | None
    #: the share of the misses (bytes) that peers served, taken to stay as measured
    peer_share: float
    #: seconds per epoch the job computed (``profiled`` step times); None without a profile
    compute_s: float | None
    #: seconds per epoch preparing at ``cpus`` CPUs; None where prep never bounded an epoch
    prep_s: float | None
    cpus: int
    assumptions: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Rates:
        """The rates as ``analyse`` wrote them (``data["rates"]``)."""
        return cls(**{**data, "assumptions": tuple(data["assumptions"])})

    @property
    def cache_fraction(self) -> float:
        return min(1.0, self.cache_bytes / self.dataset_bytes)


@dataclass(frozen=True, slots=True)
class Prediction:
    cache_fraction: float
    cpus: float
    storage_factor: float
    fetch_s: float
    prep_s: float | None
    compute_s: float | None
    epoch_s: float
    #: the share of the epoch the job waits for data; None without a compute time
    stall_share: float | None
    #: what bounds the epoch: storage, cache, peers (fetching), prep or compute
    bound: str


# -- the counters ---------------------------------------------------------------------------

def interval(name: str, seconds: float, reads: dict[str, int]) -> Interval:
    """An epoch from read counters (the difference of two marks' snapshots). A client's
    reads from shared memory are hits as much as the mount's."""
    return Interval(name, seconds, reads["bytes_from_source"],
                    reads["bytes_from_cache"] + reads.get("client_bytes_from_cache", 0),
                    reads["bytes_from_peers"], reads.get("opened_bytes", 0))


def epoch_intervals(marks: list[dict[str, Any]], since: str | None) -> list[Interval]:
    """The epochs jobs marked from the latest mark named ``since`` on (all marks without it):
    each interval from a mark ``EPOCH_MARK`` matches to the next mark. Reads before the first
    of them, after the last, and from any other mark to the next, are no epoch."""
    start = 0
    if since is not None:
        found = [i for i, mark in enumerate(marks) if mark["name"] == since]
        if not found:
            known = ", ".join(dict.fromkeys(m["name"] for m in marks)) or "none"
            raise UserError(f"no mark named {since!r} (marks: {known})")
        start = found[-1]
    chosen = marks[start:]
    return [interval(f"{a['name']} .. {b['name']}", b["time"] - a["time"],
                     {k: b["reads"][k] - a["reads"].get(k, 0) for k in b["reads"]})
            for a, b in itertools.pairwise(chosen) if EPOCH_MARK.search(a["name"])]


def compute_per_epoch(profiles: list[dict[str, Any]]) -> tuple[float | None, str | None]:
    """The median step seconds per epoch of the job profiled over the most epochs, and the
    job's name (None, None without profiles)."""
    profiled = [p for p in profiles if p["epochs"]]
    if not profiled:
        return None, None
    longest = max(profiled, key=lambda p: len(p["epochs"]))
    return (statistics.median(e["step_s"] for e in longest["epochs"].values()),
            f"{longest['job']} (pid {longest['pid']})")


# -- fitting the rates ----------------------------------------------------------------------

def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if the system is singular."""
    n = len(vector)
    rows = [[*matrix[i], vector[i]] for i in range(n)]
    scale = max(abs(v) for row in matrix for v in row) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-9 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[i][n] / rows[i][i] for i in range(n)]


def fit_seconds_per_byte(epochs: list[Interval], columns: tuple[int, ...]) -> dict[int, float]:
    """Non-negative least squares of ``seconds = sum(bytes[c] * w[c])`` over the columns
    given (indexes into ``Interval.by_source``), by trying every support: at most three
    unknowns. Of equal fits the one with more unknowns, then the earlier columns, wins."""
    best: tuple[float, dict[int, float]] = (float("inf"), {})
    gb = [[b / 1e9 for b in e.by_source()] for e in epochs]  # GB: a better-scaled system
    times = [e.seconds for e in epochs]
    for size in range(len(columns), 0, -1):
        for support in itertools.combinations(columns, size):
            normal = [[sum(row[i] * row[j] for row in gb) for j in support] for i in support]
            right = [sum(row[i] * t for row, t in zip(gb, times, strict=True)) for i in support]
            weights = _solve(normal, right)
            if weights is None or min(weights) <= 0:
                continue
            residual = sum((sum(row[c] * w for c, w in zip(support, weights, strict=True)) - t)
                           ** 2 for row, t in zip(gb, times, strict=True))
            if residual < best[0] - 1e-9 * (1 + sum(t * t for t in times)):
                best = (residual, {c: w / 1e9 for c, w in zip(support, weights, strict=True)})
    return best[1]


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if values else 0.0


def _hit_share(epoch: Interval) -> float:
    return epoch.cache_bytes / epoch.total_bytes if epoch.total_bytes else 0.0


def _lower_bounds(epochs: list[Interval]) -> dict[int, float]:
    """Seconds per byte no epoch beat: storage and peers as fast as the fastest epoch read
    from them (their speed is at least that), the cache at its assumed speed."""
    weights = {1: 1 / DEFAULT_CACHE_BPS}
    for column in (0, 2):
        per_byte = [e.seconds / e.by_source()[column] for e in epochs if e.by_source()[column]]
        if per_byte:
            weights[column] = min(per_byte)
    return weights


def _fit(epochs: list[Interval], notes: list[str]) -> tuple[dict[int, float], bool]:
    """Seconds per byte of each source, and whether the cache's was measured: only epochs
    with different hit shares tell the cache's cost from storage's."""
    if any(e.peer_bytes for e in epochs) and _spread(
            [e.peer_bytes / (e.peer_bytes + e.storage_bytes) for e in epochs
             if e.peer_bytes + e.storage_bytes]) < MIN_SHARE_SPREAD:
        notes.append("every epoch had the same share of misses from peers: peers and storage "
                     "are taken to serve misses at one speed")
        weights, cache_known = _fit([Interval(e.name, e.seconds, e.storage_bytes + e.peer_bytes,
                                              e.cache_bytes, 0) for e in epochs], notes)
        return {**weights, 2: weights.get(0, 0.0)}, cache_known
    peers = (2,) if any(e.peer_bytes for e in epochs) else ()
    hits = any(e.cache_bytes for e in epochs)
    if hits and _spread([_hit_share(e) for e in epochs]) >= MIN_SHARE_SPREAD:
        return fit_seconds_per_byte(epochs, (0, 1, *peers)), True
    notes.append(f"cache speed {format_size(DEFAULT_CACHE_BPS)}/s "
                 + ("(every epoch had the same share of hits: mark epochs with different "
                    "hit shares, such as the cold first one)" if hits
                    else "(no hits were measured)"))
    rest = [Interval(e.name, e.seconds - e.cache_bytes / DEFAULT_CACHE_BPS, e.storage_bytes, 0,
                     e.peer_bytes) for e in epochs]
    return {1: 1 / DEFAULT_CACHE_BPS,
            **fit_seconds_per_byte([e for e in rest if e.seconds > 0], (0, *peers))}, False


def measure(epochs: list[Interval], cache_bytes: float, compute_s: float | None, cpus: int,
            dataset_bytes: float | None = None, notes: tuple[str, ...] = ()) -> Rates:
    """The rates of a run from its epochs (see the module's docstring)."""
    notes_: list[str] = list(notes)
    epochs = [e for e in epochs if e.seconds > 0 and e.total_bytes > 0]
    if not epochs:
        raise UserError("no reads to analyse: read the dataset through the mount first "
                        "(and `coordlfs mark` each epoch)")
    # the files an epoch opened, at their size in the source (not what was read of them: a
    # warm's fills, a file read twice); an older daemon's marks have no such count
    dataset = (dataset_bytes or max(e.opened_bytes for e in epochs)
               or max(e.total_bytes for e in epochs))
    fetching = epochs if compute_s is None else [
        e for e in epochs if e.seconds > COMPUTE_BOUND * compute_s]
    prep_s = None
    if not fetching:
        notes_.append("every epoch took no longer than its compute: storage and peer speeds "
                      "are lower bounds (bytes over the epoch), the cache's is assumed "
                      f"{format_size(DEFAULT_CACHE_BPS)}/s")
        weights = _lower_bounds(epochs)
    else:
        weights, cache_known = _fit(fetching, notes_)
        storage_w = weights.get(0, 0.0)
        if cache_known and (storage_w == 0 or weights.get(1, 0.0) * NOT_FASTER >= storage_w):
            # cached bytes did not make epochs shorter: neither storage nor cache bound them
            prep_s = min(e.seconds for e in fetching)
            notes_.append(f"epochs took as long whatever their share of hits: the data "
                          f"pipeline is taken as bound by prep, {prep_s:.1f} s per epoch at "
                          f"{cpus} CPUs; storage and peer speeds are lower bounds, the "
                          f"cache's is assumed {format_size(DEFAULT_CACHE_BPS)}/s")
            weights = _lower_bounds(fetching)
    if not weights.get(0):
        weights[0] = 1 / MAX_BPS
        notes_.append("storage time not measurable (no misses): storage assumed as fast as "
                      "memory")
    if compute_s is None:
        notes_.append("no step times (no coordlfs.torch.profiled job): the job is assumed "
                      "fetch-bound, its compute time and stall share unknown")
    if prep_s is None:
        notes_.append(f"prep never bounded an epoch: it is assumed to keep up at {cpus} CPUs "
                      "(fewer CPUs may not)")
    fastest = 1 / MAX_BPS
    if weights.get(1, 0.0) < 1 / DEFAULT_CACHE_BPS:
        notes_.append("hits cost little time beside the misses (fitted faster than the FUSE "
                      f"path's {format_size(DEFAULT_CACHE_BPS)}/s, as when readers are served "
                      "hits while others wait for storage; at most memory speed, "
                      f"{format_size(MAX_BPS)}/s, is taken): epochs that are nearly all hits "
                      "may take longer than predicted")
    peer_bytes = sum(e.peer_bytes for e in epochs)
    misses = peer_bytes + sum(e.storage_bytes for e in epochs)
    return Rates(dataset, cache_bytes, 1 / weights[0], 1 / max(weights.get(1, 0.0), fastest),
                 1 / max(weights.get(2, 0.0), fastest) if peer_bytes else None,
                 peer_bytes / misses if misses else 0.0, compute_s, prep_s, cpus,
                 tuple(notes_))


# -- the model ------------------------------------------------------------------------------

def predict(rates: Rates, cache_fraction: float, cpus: float | None = None,
            storage_factor: float = 1.0) -> Prediction:
    """A steady-state epoch (after the first) with a cache of ``cache_fraction`` of the
    dataset, ``cpus`` CPUs for prep (prep scales with them) and storage ``storage_factor``
    times as fast."""
    cpus = rates.cpus if cpus is None else cpus
    data = rates.dataset_bytes
    hits = min(max(cache_fraction, 0.0), 1.0) * data
    misses = data - hits
    peer_share = rates.peer_share if rates.peer_bps else 0.0
    parts = {"cache": hits / rates.cache_bps,
             "storage": misses * (1 - peer_share) / (rates.storage_bps * storage_factor),
             "peers": misses * peer_share / rates.peer_bps if rates.peer_bps else 0.0}
    fetch = sum(parts.values())
    prep = None if rates.prep_s is None else rates.prep_s * rates.cpus / cpus
    stages = {max(parts, key=lambda k: parts[k]): fetch, "prep": prep or 0.0,
              "compute": rates.compute_s or 0.0}
    bound = max(stages, key=lambda k: stages[k])
    epoch = stages[bound]
    stall = None
    if rates.compute_s is not None:
        stall = (epoch - rates.compute_s) / epoch if epoch else 0.0
    return Prediction(cache_fraction, cpus, storage_factor, fetch, prep, rates.compute_s,
                      epoch, stall, bound)


def _cut(before: float, after: float) -> float:
    return 100 * (before - after) / before if before else 0.0


_WHY = {"storage": "reading misses from storage", "cache": "reading hits from the cache",
        "peers": "fetching misses from peers", "compute": "compute (the GPU step)",
        "prep": "prep"}


def recommend(rates: Rates) -> str:
    """One line: the cache that would help most, whether CPUs or storage would."""
    now = predict(rates, rates.cache_fraction)
    sweep = [predict(rates, x) for x in CACHE_FRACTIONS]
    best = min(p.epoch_s for p in sweep)
    enough = min((p for p in sweep if p.epoch_s <= best * NEAR_BEST),
                 key=lambda p: p.cache_fraction)
    parts = []
    if now.epoch_s > best * NEAR_BEST and enough.cache_fraction > rates.cache_fraction:
        size = enough.cache_fraction * rates.dataset_bytes
        # hits hidden behind the misses in the run: their own cost is unknown (see measure)
        hidden = rates.cache_bps > DEFAULT_CACHE_BPS
        parts.append(f"a cache of {format_size(size)} ({enough.cache_fraction:.0%} of the "
                     f"dataset) would cut epoch time by {'at most ' if hidden else ''}"
                     f"{_cut(now.epoch_s, enough.epoch_s):.0f}% ({_seconds(now.epoch_s)} s -> "
                     f"{_seconds(enough.epoch_s)} s"
                     f"{', hits hidden behind misses' if hidden else ''})")
    else:
        parts.append(f"a bigger cache would not help: the epoch is bound by {_WHY[now.bound]}")
    more = predict(rates, rates.cache_fraction, cpus=2 * rates.cpus)
    if now.bound == "prep" and more.epoch_s < now.epoch_s:
        parts.append(f"{2 * rates.cpus} CPUs would cut it by "
                     f"{_cut(now.epoch_s, more.epoch_s):.0f}%")
    else:
        unknown = " (prep time was not measured)" if rates.prep_s is None else ""
        parts.append(f"more CPUs would not help because the epoch is bound by "
                     f"{_WHY[now.bound]}{unknown}")
    faster = predict(rates, rates.cache_fraction, storage_factor=2)
    if faster.epoch_s < now.epoch_s * 0.98:
        parts.append(f"2x faster storage would cut it by {_cut(now.epoch_s, faster.epoch_s):.0f}%")
    return "; ".join(parts)


def analyse(status: dict[str, Any], marks: list[dict[str, Any]], window: dict[str, Any],
            since: str | None, cpus: int, leave_out: Collection[int] = ()) -> dict[str, Any]:
    """The whole analysis from a mount's status, its marks and the counters since ``since``
    (``window``: the ``stats`` reply, used when fewer than two marks follow ``since``).
    ``leave_out``: epochs (1 is the first interval) the caller knows were disturbed."""
    epochs = epoch_intervals(marks, since)
    notes: list[str] = []
    if leave_out:
        notes.append(f"epochs {', '.join(map(str, sorted(leave_out)))} left out (disturbed)")
    if not epochs:
        epochs = [interval(f"{window['since']} .. {window['until']}", window["seconds"],
                           window["reads"])]
        notes.append("no epoch marked (a mark named epoch-N, up to the next mark): the whole "
                     "window is taken as one epoch (mark each epoch with `coordlfs mark "
                     "MOUNTPOINT epoch-N`, and the end, for the cache's speed)")
    compute_s, job = compute_per_epoch(status.get("profiles", []))
    if job is not None:
        notes.append(f"compute per epoch from the step times of {job}")
    rates = measure([e for number, e in enumerate(epochs, 1) if number not in leave_out],
                    status["cache"]["capacity_bytes"], compute_s, cpus, notes=tuple(notes))
    now = rates.cache_fraction
    return {
        "mountpoint": status["mountpoint"],
        "epochs": [asdict(e) for e in epochs],
        "rates": asdict(rates),
        "now": asdict(predict(rates, now)),
        "cache": [asdict(predict(rates, x)) for x in sorted({*CACHE_FRACTIONS, now})],
        "cpus": [asdict(predict(rates, now, cpus=max(1, round(f * cpus))))
                 for f in CPU_FACTORS],
        "storage": [asdict(predict(rates, now, storage_factor=f)) for f in STORAGE_FACTORS],
        "recommendation": recommend(rates),
    }


# -- output ---------------------------------------------------------------------------------

def _seconds(value: float | None) -> str:
    """Seconds to three significant places at most, so a short epoch is not shown as 0."""
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _rows(title: str, rows: list[dict[str, Any]], label: Any) -> list[str]:
    lines = [f"{title:18} {'fetch s':>8} {'prep s':>7} {'compute s':>9} {'epoch s':>8} "
             f"{'stall':>6}  bound"]
    for row in rows:
        lines.append(f"{label(row):18} {_seconds(row['fetch_s']):>8} "
                     f"{_seconds(row['prep_s']):>7} {_seconds(row['compute_s']):>9} "
                     f"{_seconds(row['epoch_s']):>8} "
                     f"{_share(row['stall_share']):>6}  {row['bound']}")
    return lines


def format_report(data: dict[str, Any]) -> str:
    rates = data["rates"]
    dataset, now = rates["dataset_bytes"], min(1.0, rates["cache_bytes"] / rates["dataset_bytes"])
    peers = (f", peers {format_size(rates['peer_bps'])}/s ({rates['peer_share']:.0%} of the "
             "misses)" if rates["peer_bps"] else "")
    lines = [f"what-if for {data['mountpoint']}: {plural(len(data['epochs']), 'epoch')}, dataset "
             f"{format_size(dataset)}, cache {format_size(rates['cache_bytes'])} "
             f"({now:.0%})",
             f"rates    storage {format_size(rates['storage_bps'])}/s, cache "
             f"{format_size(rates['cache_bps'])}/s{peers}; compute "
             f"{_seconds(rates['compute_s'])} s, prep {_seconds(rates['prep_s'])} s per epoch"]
    lines += [f"assumed  {note}" for note in rates["assumptions"]]
    lines.append("")

    def cache_label(row: dict[str, Any]) -> str:
        mark = " *" if abs(row["cache_fraction"] - now) < 1e-9 else ""
        return f"{row['cache_fraction']:4.0%} {format_size(row['cache_fraction'] * dataset)}{mark}"

    lines += _rows("cache (* now)", data["cache"], cache_label)
    lines.append("")
    lines += _rows("CPUs", data["cpus"], lambda r: f"{r['cpus']:g}")
    lines.append("")
    lines += _rows("storage speed", data["storage"], lambda r: f"{r['storage_factor']:g}x")
    lines += ["", f"advice   {data['recommendation']}"]
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot without a display, or a one-line error naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib (pip install 'coordlfs[plot]')") from None
    return plt


def plot(path: str, data: dict[str, Any]) -> None:
    """Epoch time and stall share against cache size, at three storage speeds."""
    plt = pyplot()
    rates = Rates.from_json(data["rates"])
    xs = [i / 50 for i in range(51)]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for factor in (0.5, 1, 2):
        rows = [predict(rates, x, storage_factor=factor) for x in xs]
        left.plot([100 * x for x in xs], [r.epoch_s for r in rows], label=f"storage {factor:g}x")
        if rates.compute_s is not None:
            right.plot([100 * x for x in xs], [100 * (r.stall_share or 0) for r in rows],
                       label=f"storage {factor:g}x")
    if rates.compute_s is not None:
        left.axhline(rates.compute_s, color="grey", linestyle=":", label="compute")
    left.axvline(100 * rates.cache_fraction, color="black", linestyle="--", label="now")
    left.set(xlabel="cache, % of the dataset", ylabel="epoch seconds",
             title="Predicted epoch time (after the first)")
    left.set_ylim(bottom=0)
    left.legend()
    right.set(xlabel="cache, % of the dataset", ylabel="stall, % of the epoch",
              title="Predicted stall share" if rates.compute_s is not None
              else "Stall share unknown (no step times)")
    right.set_ylim(0, 100)
    if rates.compute_s is not None:
        right.legend()
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=100)
    except ValueError as e:  # an extension matplotlib cannot write
        raise UserError(f"cannot write {path}: {e}") from None
    finally:
        plt.close(figure)


def write_outputs(data: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    """``--json FILE`` and ``--plot FILE.png``; an unwritable path is one line."""
    try:
        if json_path:
            with open(json_path, "w") as f:
                f.write(json.dumps(data, indent=2) + "\n")
        if plot_path:
            plot(plot_path, data)
    except OSError as e:
        raise UserError(f"cannot write {e.filename or json_path}: {e.strerror or e}") from None
