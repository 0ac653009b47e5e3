"""The stagger advisor: how long to delay the second of two jobs that train on one dataset.

This is the performance model of Assogba, Nicolae and Rafique, "Optimizing the Training of
Co-Located Deep Learning Models Using Cache-Aware Staggering" (HiPC'23, section V). Two jobs A
and B read the same dataset in the same order (same shuffling seed). Started together they
fight over the repository's bandwidth; started one after the other, B reads everything from the
cache A filled but the GPUs sit idle for a whole run. In between, B starts ``t_B`` seconds after
A, reads A's cache until it catches up with A at ``t_C`` (equation 1), then both read remote data
under concurrency until the end of their first epoch (equation 2); later epochs are served from
the cache (equation 3). The makespan is ``max(T_A, t_B + T_B)`` and the advisor looks for the
delay that minimises it (equation 4) by binary search (section V-B).

The model needs four calibration numbers per job (section V-B, step 1), kept in a catalog so a
job measured once is not measured again (section V-C). Everything here except the catalog's
file access is pure: profiles in, predictions out.
"""

from __future__ import annotations

import enum
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from coordlfs.errors import UserError
from coordlfs.sizes import plural

#: Makespans within this relative distance are equal (rounding: the same end time summed over
#: different segments). Ties go to the longer delay, because the paper prefers the staggered
#: configuration when makespans match: the delayed job holds its GPU for less time (section I).
TIE = 1e-12

#: The keys of a profile on the command line and in the catalog, with the dataclass field each
#: fills and what it means in the paper's notation.
KEYS: dict[str, tuple[str, str]] = {
    "iters": ("iterations", "N_E, mini-batches per epoch"),
    "epochs": ("epochs", "E, epochs to train"),
    "I": ("I", "training time per iteration"),
    "Wcold": ("W_cold", "W, I/O wait per iteration alone with a cold cache"),
    "Wwarm": ("W_warm", "W|cached, I/O wait per iteration with the dataset cached"),
    "Wconc": ("W_concurrent", "W|conc, I/O wait per iteration while both jobs read remote data"),
}
_INTEGER_KEYS = ("iters", "epochs")


@dataclass(frozen=True, slots=True)
class JobProfile:
    """A job's calibration (section V-B step 1): times are seconds per iteration (one mini-batch).

    ``W_cold`` is the paper's ``W`` (alone, reading the repository), ``W_warm`` its ``W|cached``
    and ``W_concurrent`` its ``W|conc`` (both jobs reading the repository at once). The paper
    measures ``W|conc`` against one partner; reusing it with another is an approximation.
    """

    name: str
    iterations: int
    epochs: int
    I: float  # noqa: E741 (the paper's symbol)
    W_cold: float
    W_warm: float
    W_concurrent: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or ":" in self.name:
            raise ValueError(f"job name must be a non-empty string without ':', not {self.name!r}")
        for key, (attr, meaning) in KEYS.items():
            value = getattr(self, attr)
            if key in _INTEGER_KEYS:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{key} ({meaning}) must be a whole number >= 1, "
                                     f"not {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value < 0 or (key == "I" and value == 0):
                bound = "> 0" if key == "I" else ">= 0"
                raise ValueError(f"{key} ({meaning}) must be a number of seconds {bound}, "
                                 f"not {value!r}")

    def seconds_per_iteration(self, phase: Phase) -> float:
        """``I + W`` for the wait the phase implies: the paper's only cost per iteration."""
        wait = {Phase.REMOTE: self.W_cold, Phase.BEHIND: self.W_warm,
                Phase.SHARED: self.W_concurrent, Phase.WARM: self.W_warm}[phase]
        return self.I + wait


class Phase(enum.Enum):
    """What one job reads, which fixes its I/O wait per iteration (equations 1-3)."""

    PENDING = "pending"  # not started: before t_B for the delayed job
    REMOTE = "remote"    # uncached data, alone on the repository: I + W (eq. 1, A before t_C)
    BEHIND = "behind"    # data the other job cached: I + W|cached (eq. 1, B before t_C)
    SHARED = "shared"    # uncached data, both on the repository: I + W|conc (eq. 2)
    WARM = "warm"        # epochs 2..E, all cached: I + W|cached (eq. 3)
    DONE = "done"


_RUNNING = (Phase.REMOTE, Phase.BEHIND, Phase.SHARED, Phase.WARM)
_READS_REMOTE = (Phase.REMOTE, Phase.SHARED)


def pair_state(first: Phase, second: Phase) -> str:
    """The state of figure 5 that a pair of phases is in, to show where the time goes.

    SR: one job runs, on remote data (A before t_B). CL: both run, the delayed one on cached
    data (t_B..t_C; A still has the repository to itself). CR: both read remote data (after t_C,
    or from a simultaneous start). CL/R: one is past its first epoch and reads the cache, the
    other still reads remote data. The figure does not name a lone job on cached data (the
    other has finished); that is SL.
    """
    running = [p for p in (first, second) if p in _RUNNING]
    reads = {"R" if p in _READS_REMOTE else "L" for p in running}
    if len(running) == 1:
        return "S" + reads.pop()
    if reads == {"R"}:
        return "CR"
    if reads == {"L"} or (first is Phase.REMOTE and second is Phase.BEHIND):
        return "CL"
    return "CL/R"


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of time in one state of figure 5, with both jobs' phases."""

    start: float
    end: float
    state: str
    phases: tuple[Phase, Phase]


@dataclass(frozen=True, slots=True)
class Prediction:
    """The model's answer for one delay: when each job ends, and why (the segments)."""

    delay: float  # fraction of the first job's standalone runtime
    start: float  # t_B, seconds after the first job started
    finish: tuple[float, float]  # A's end (T_A) and B's end (t_B + T_B)
    catch_up: float | None  # t_C, or None when B never catches up with A's cache
    segments: tuple[Segment, ...]

    @property
    def makespan(self) -> float:
        """Equation 4's objective, ``M = max(T_A, T_B + t_B)``."""
        return max(self.finish)


def standalone_runtime(job: JobProfile) -> float:
    """The 100% of a delay: the job alone from a cold cache (sections IV and VI-E).

    Its first epoch reads the repository (``I + W``); later epochs hit the cache it filled
    (``I + W|cached``), as in equation 3.
    """
    return job.iterations * (job.I + job.W_cold) \
        + (job.epochs - 1) * job.iterations * (job.I + job.W_warm)


def catch_up(first: JobProfile, second: JobProfile, start: float) -> tuple[float, float] | None:
    """Equation 1: ``t_C = t_B / (1 - (W_B|cached + I_B)/(W_A + I_A))``, ``N = t_C/(W_A + I_A)``.

    B catches up only if it eats cached batches faster than A fetches remote ones, and only
    within A's first epoch (``N <= N_E``): after that everything is cached. Returns None when it
    does not. Positions are compared as fractions of an epoch, so jobs with different batch
    sizes work too; with equal ``N_E`` (the paper's case) this is exactly equation 1.
    """
    if start == 0:
        return 0.0, 0.0  # a simultaneous start: both are on the repository from the first batch
    epoch_a = first.iterations * (first.I + first.W_cold)
    epoch_b = second.iterations * (second.I + second.W_warm)
    if epoch_b >= epoch_a:
        return None
    t_c = start / (1 - epoch_b / epoch_a)
    n = t_c / (first.I + first.W_cold)
    return (t_c, n) if n <= first.iterations else None


def closed_form(first: JobProfile, second: JobProfile, start: float) -> tuple[float, float] | None:
    """Equations 2 and 3: A's end ``T_A`` and B's end ``t_B + T_B`` when B catches up (eq. 1).

    ``T_A1 = t_C + (N_E - N)(W_A|conc + I_A)``, ``T_B1 = t_C - t_B + (N_E - N)(W_B|conc + I_B)``,
    then ``N_E (W|cached + I)`` per later epoch. None where equation 1 finds no catch-up: the
    paper leaves that case to its state machine (``simulate``).
    """
    found = catch_up(first, second, start)
    if found is None:
        return None
    t_c, n = found
    left = 1 - n / first.iterations  # the share of the first epoch read under concurrency
    t_a1 = t_c + left * first.iterations * (first.I + first.W_concurrent)
    t_b1 = t_c - start + left * second.iterations * (second.I + second.W_concurrent)
    t_a = t_a1 + (first.epochs - 1) * first.iterations * (first.I + first.W_warm)
    t_b = t_b1 + (second.epochs - 1) * second.iterations * (second.I + second.W_warm)
    return t_a, start + t_b


def simulate(first: JobProfile, second: JobProfile, start: float) -> Prediction:
    """The state machine of figure 5: equations 1-3 piece by piece, valid for every delay.

    Each job runs at ``I + W`` for its phase (``Phase``); only events change a phase: B starts
    (reading A's cache, or on the repository with A if both start at 0), B catches up with A
    (both to ``W|conc``, eq. 1-2), a job ends its first epoch (to ``W|cached``, eq. 3) or its
    last. As in equation 2, a job that caught up keeps ``W|conc`` for the rest of its first
    epoch even once the other has moved on. Where B catches up within A's first epoch this
    reproduces ``closed_form``; elsewhere it gives the cases the closed forms leave out (B never
    catches up, or starts after A's first epoch).
    """
    if not (math.isfinite(start) and start >= 0):
        raise ValueError(f"the delay must be a finite number of seconds >= 0, not {start!r}")
    jobs = (first, second)
    phase = [Phase.REMOTE, Phase.PENDING]
    caught: float | None = None
    if start == 0:
        phase, caught = [Phase.SHARED, Phase.SHARED], 0.0
    done = [0.0, 0.0]  # iterations each job has finished
    finish = [0.0, 0.0]
    segments: list[Segment] = []
    t = 0.0
    while phase != [Phase.DONE, Phase.DONE]:
        events = _events(jobs, phase, done, start, t)
        step = max(0.0, min(e[0] for e in events))
        for k, job in enumerate(jobs):
            if phase[k] in _RUNNING:
                done[k] += step / job.seconds_per_iteration(phase[k])
        if step > 0:
            segments.append(Segment(t, t + step, pair_state(*phase), (phase[0], phase[1])))
        t += step
        fired = [e for e in events if e[0] <= step * (1 + 1e-12)]
        for _, what, k, goal in sorted(fired, key=lambda e: ("goal", "start", "catch").index(e[1])):
            if what == "goal":
                done[k] = goal
                if goal < jobs[k].iterations * jobs[k].epochs:
                    phase[k] = Phase.WARM
                else:
                    phase[k], finish[k] = Phase.DONE, t
            elif what == "start":
                phase[1] = Phase.BEHIND  # whatever A has read so far is cached
            else:  # "catch"
                caught = t
                if phase == [Phase.REMOTE, Phase.BEHIND]:  # unless A's first epoch just ended
                    done[1] = done[0] / first.iterations * second.iterations
                    phase = [Phase.SHARED, Phase.SHARED]
    delay = start / standalone_runtime(first)
    return Prediction(delay, start, (finish[0], finish[1]), caught, tuple(segments))


def _events(jobs: tuple[JobProfile, JobProfile], phase: list[Phase], done: list[float],
            start: float, t: float) -> list[tuple[float, str, int, float]]:
    """What may happen next in ``simulate`` at time ``t``, each as (seconds until it happens,
    what, which job, iterations done when it happens)."""
    events: list[tuple[float, str, int, float]] = []
    if phase[1] is Phase.PENDING:
        events.append((start - t, "start", 1, 0.0))
    for k, job in enumerate(jobs):
        if phase[k] in _RUNNING:
            goal = job.iterations if done[k] < job.iterations else job.iterations * job.epochs
            events.append(((goal - done[k]) * job.seconds_per_iteration(phase[k]),
                           "goal", k, goal))
    if phase == [Phase.REMOTE, Phase.BEHIND]:
        # both move through the dataset in epochs per second; B gains if it is faster
        speed = [1 / (j.iterations * j.seconds_per_iteration(p))
                 for j, p in zip(jobs, phase, strict=True)]
        if speed[1] > speed[0]:
            gap = done[0] / jobs[0].iterations - done[1] / jobs[1].iterations
            events.append((gap / (speed[1] - speed[0]), "catch", 1, 0.0))
    return events


def _pair(jobs: Sequence[JobProfile]) -> tuple[JobProfile, JobProfile]:
    if len(jobs) != 2:
        raise ValueError(f"the model covers two jobs (the paper's pairs), not {len(jobs)}")
    return jobs[0], jobs[1]


def predict(jobs: Sequence[JobProfile], delay_fraction: float) -> Prediction:
    """The second job starts after ``delay_fraction`` of the first's standalone runtime.

    The paper states delays that way (0% simultaneous, 100% one after the other, section IV),
    so a delay means the same for any pair of jobs.
    """
    first, second = _pair(jobs)
    if not (math.isfinite(delay_fraction) and delay_fraction >= 0):
        raise ValueError(f"the delay must be a fraction >= 0, not {delay_fraction!r}")
    prediction = simulate(first, second, delay_fraction * standalone_runtime(first))
    return replace(prediction, delay=delay_fraction)  # as asked, not as rounded through seconds


def predict_makespan(jobs: Sequence[JobProfile], delay_fraction: float) -> float:
    """Equation 4's ``max(T_A, T_B + t_B)`` at one delay."""
    return predict(jobs, delay_fraction).makespan


def _better(a: Prediction, b: Prediction) -> bool:
    """A shorter makespan, or a tie at a longer delay (see ``TIE``)."""
    if a.makespan < b.makespan * (1 - TIE):
        return True
    return a.makespan <= b.makespan * (1 + TIE) and a.delay > b.delay


def optimal_delay(jobs: Sequence[JobProfile], tolerance: float = 1e-6) -> Prediction:
    """Equation 4's ``argmin`` by the binary search of section V-B, over delays 0-100%.

    Each halving step predicts the makespan just either side of the midpoint and keeps the half
    it falls towards (ties: the later half). This finds the minimum because the makespan is
    convex in ``t_B > 0`` when ``W|conc >= W`` and ``W|conc >= W|cached``, as the paper
    measures: ``T_A`` and ``t_B + T_B`` are each piecewise linear with increasing slopes, and so
    is their maximum. At ``t_B = 0`` the model jumps (a simultaneous start puts both jobs on the
    repository at once, however slow B is), so 0% and 100% are compared at the end.
    """
    _pair(jobs)
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0, not {tolerance!r}")
    lo, hi = 0.0, 1.0
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        here, there = predict(jobs, mid), predict(jobs, mid + tolerance / 4)
        if there.makespan <= here.makespan * (1 + TIE):
            lo = mid
        else:
            hi = mid
    best = predict(jobs, lo)
    for edge in (hi, 0.0, 1.0):
        candidate = predict(jobs, edge)
        if _better(candidate, best):
            best = candidate
    return best


def delay_table(jobs: Sequence[JobProfile], step_percent: int = 10) -> list[Prediction]:
    """Delays 0%, 10%, ..., 100%: the grid of the paper's "ideal staggering" (section VI-B)."""
    if not 1 <= step_percent <= 100:
        raise ValueError(f"step_percent must be 1-100, not {step_percent!r}")
    return [predict(jobs, p / 100) for p in range(0, 101, step_percent)]


# The catalog (section V-C: "stored in a catalog for future reuse").


def default_catalog_path() -> Path:
    """Beside the mounts' logs, so one state directory holds everything coordlfs remembers."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state, "coordlfs", "profiles.json")


def profile_record(profile: JobProfile) -> dict[str, int | float]:
    """The catalog's record of a profile: the command line's keys, so both read the same."""
    return {key: getattr(profile, attr) for key, (attr, _) in KEYS.items()}


def profile_from_record(name: str, record: Any) -> JobProfile:
    """A profile from a catalog record; keys beyond ``KEYS`` are ignored (later additions)."""
    if not isinstance(record, dict):
        raise ValueError("the record must be a JSON object")
    missing = [key for key in KEYS if key not in record]
    if missing:
        raise ValueError(f"the record lacks {', '.join(missing)}")
    return JobProfile(name, **{attr: record[key] for key, (attr, _) in KEYS.items()})


def load_catalog(path: str | os.PathLike[str]) -> dict[str, JobProfile]:
    """Every profile in the catalog by job name; a missing file is an empty catalog."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read catalog {path}: {getattr(e, 'strerror', None) or e}") \
            from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"catalog {path} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"catalog {path} must be a JSON object of job name -> profile")
    profiles = {}
    for name, record in data.items():
        try:
            profiles[name] = profile_from_record(name, record)
        except (ValueError, TypeError) as e:
            raise UserError(f"catalog {path}: job {name!r}: {e}") from None
    return profiles


def save_profile(path: str | os.PathLike[str], profile: JobProfile) -> None:
    """Add or replace one job's record; the rest of the catalog is kept as it was.

    The file is replaced atomically, so a reader never sees half of it; a catalog that does not
    parse is left alone (UserError) rather than overwritten. Two writers at once: the last wins.
    """
    path = Path(path)
    load_catalog(path)  # refuse to overwrite a catalog we cannot read
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        data[profile.name] = profile_record(profile)
        data = dict(sorted(data.items()))  # by name; a record keeps its keys' order
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise UserError(f"cannot write catalog {path}: {e.strerror or e}") from None


def measured_values(name: str, epochs: dict[str, Any]) -> dict[str, int | float]:
    """Calibration from the stall profiler's records of one run of a job alone
    (``coordlfs.torch.profiled``, kept by the mount per epoch): ``I`` is its mean step, ``W``
    its wait per step in the first epoch (cold), ``W|cached`` in the later ones."""
    try:
        ordered = [epochs[k] for k in sorted(epochs, key=int)]
        steps = [int(e["steps"]) for e in ordered]
        waits = [float(e["wait_s"]) for e in ordered]
        busy = [float(e["step_s"]) for e in ordered]
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"job {name!r}: malformed profile from the mount ({e})") from None
    if len(ordered) < 2 or steps[0] == 0 or sum(steps[1:]) == 0:
        raise UserError(f"job {name!r}: the mount has {plural(len(ordered), 'profiled epoch')}; "
                        "the model needs a cold first epoch and at least one warm one")
    return {"iterations": steps[0], "epochs": len(ordered), "I": sum(busy) / sum(steps),
            "W_cold": waits[0] / steps[0], "W_warm": sum(waits[1:]) / sum(steps[1:])}


def _first_epoch(record: dict[str, Any]) -> dict[str, Any]:
    first = record.get("epochs", {}).get("0")
    return first if isinstance(first, dict) else {}


def measured_job(spec: str, profiles: list[dict[str, Any]]) -> JobProfile:
    """``NAME[:KEY=VALUE...]``: a job from the mount's profiles.

    The latest run whose first epoch had no partner in its group gives ``I``, ``W`` and
    ``W|cached``; the latest whose first epoch had one gives ``W|conc`` (its wait per step).
    Values given after the name replace measured ones, and ``Wconc`` must be given when the
    job never ran beside a partner.
    """
    name, _sep, rest = spec.partition(":")
    name = name.strip()
    records = [p for p in profiles if p.get("job") == name]
    if not records:
        known = ", ".join(sorted({str(p.get("job")) for p in profiles})) or "none"
        raise UserError(f"the mount has no profile of job {name!r}; it has: {known}")
    alone = [r for r in records if not _first_epoch(r).get("partners")]
    beside = [r for r in records if _first_epoch(r).get("partners")]
    if not alone:
        raise UserError(f"--measured {name}: the mount has no run of {name!r} alone (a "
                        "first epoch with no other job in its group) for I, Wcold and Wwarm")
    values: dict[str, Any] = measured_values(name, alone[-1].get("epochs", {}))
    if beside:
        first = _first_epoch(beside[-1])
        try:
            values["W_concurrent"] = float(first["wait_s"]) / int(first["steps"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise UserError(f"job {name!r}: malformed profile from the mount ({e})") from None
    values.update(parse_values(rest, f"--measured {name}") if rest.strip() else {})
    if "W_concurrent" not in values:
        raise UserError(f"--measured {name}: the mount has no run of {name!r} beside a "
                        f"partner; run one, or give Wconc as {name}:Wconc=SECONDS")
    return _build(name, values, f"--measured {name}")


# Input from the command line: NAME:KEY=VALUE,... (all keys) or, for a catalog job, overrides.


def parse_values(text: str, where: str) -> dict[str, int | float]:
    """``KEY=VALUE,...`` into profile fields, each checked as it is read."""
    values: dict[str, int | float] = {}
    for item in text.split(","):
        key, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise UserError(f"{where}: expected KEY=VALUE, not {item.strip()!r}")
        if key not in KEYS:
            raise UserError(f"{where}: unknown key {key!r} (keys: {', '.join(KEYS)})")
        attr = KEYS[key][0]
        if attr in values:
            raise UserError(f"{where}: {key} given twice")
        try:
            values[attr] = int(raw) if key in _INTEGER_KEYS else float(raw)
        except ValueError:
            kind = "a whole number" if key in _INTEGER_KEYS else "a number"
            raise UserError(f"{where}: {key}={raw!r} is not {kind}") from None
    return values


def _build(name: str, values: dict[str, Any], where: str) -> JobProfile:
    try:
        return JobProfile(name, **values)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None


def parse_job(spec: str) -> JobProfile:
    """``NAME:I=0.2,Wcold=0.5,Wwarm=0.05,Wconc=0.7,iters=1000,epochs=3`` (all keys needed)."""
    name, sep, rest = spec.partition(":")
    name = name.strip()
    if not sep or not name or not rest.strip():
        raise UserError(f"--job {spec!r}: expected NAME:KEY=VALUE,... with keys "
                        f"{', '.join(KEYS)}")
    where = f"--job {name}"
    values = parse_values(rest, where)
    missing = [key for key, (attr, _) in KEYS.items() if attr not in values]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)}")
    return _build(name, values, where)


def catalog_job(spec: str, catalog: dict[str, JobProfile], path: str | os.PathLike[str]) \
        -> JobProfile:
    """``NAME`` or ``NAME:KEY=VALUE,...``: the catalog's profile, with some values replaced.

    Replacing is how a profile is reused with a new partner: ``W|conc`` depends on the pair
    (section V-C), ``epochs`` on the run.
    """
    name, sep, rest = spec.partition(":")
    name = name.strip()
    if name not in catalog:
        known = ", ".join(sorted(catalog)) or "none"
        hint = "" if Path(path).exists() else " (no such file)"
        raise UserError(f"no job {name!r} in catalog {path}{hint}; it has: {known}")
    profile = catalog[name]
    if not sep:
        return profile
    values = {attr: getattr(profile, attr) for attr, _ in KEYS.values()}
    values.update(parse_values(rest, f"--from-catalog {name}"))
    return _build(name, values, f"--from-catalog {name}")


# Output.


def _prediction_dict(p: Prediction) -> dict[str, Any]:
    return {"delay": p.delay, "start_s": p.start, "finish_s": list(p.finish),
            "makespan_s": p.makespan, "catch_up_s": p.catch_up}


def report(jobs: Sequence[JobProfile], step_percent: int = 10) -> dict[str, Any]:
    """Everything the command prints, as JSON-ready data: the table, the optimum, and the
    optimum with the order reversed (the paper finds the order matters, section VI-G)."""
    first, second = _pair(jobs)
    return {
        "jobs": [{"name": j.name, **profile_record(j)} for j in (first, second)],
        "standalone_s": standalone_runtime(first),
        "table": [_prediction_dict(p) for p in delay_table(jobs, step_percent)],
        "optimum": _prediction_dict(optimal_delay(jobs)),
        "reversed_optimum": _prediction_dict(optimal_delay([second, first])),
    }


def format_report(data: dict[str, Any]) -> str:
    """The table a person reads: one row per delay, then the optimum."""
    a, b = (j["name"] for j in data["jobs"])
    lines = [f"A = {a} starts first; B = {b} starts after a delay, in % of A's standalone "
             f"runtime ({data['standalone_s']:.1f} s)",
             f"{'delay':>6} {'B starts (s)':>13} {'A ends (s)':>11} {'B ends (s)':>11} "
             f"{'makespan (s)':>13}"]
    for row in data["table"]:
        lines.append(f"{row['delay']:>6.0%} {row['start_s']:>13.1f} {row['finish_s'][0]:>11.1f} "
                     f"{row['finish_s'][1]:>11.1f} {row['makespan_s']:>13.1f}")
    best, other = data["optimum"], data["reversed_optimum"]
    # 0+ is not 0: just after A, B reads A's cache; with A, both fight for the repository.
    when = ("B starts just after A" if 0 < best["start_s"] < 0.05
            else f"B starts at {best['start_s']:.1f} s")
    lines.append(f"optimum: delay {best['delay']:.1%} ({when}), "
                 f"makespan {best['makespan_s']:.1f} s (A ends {best['finish_s'][0]:.1f} s, "
                 f"B ends {best['finish_s'][1]:.1f} s)")
    lines.append(f"reversed ({b} first): optimum delay {other['delay']:.1%}, "
                 f"makespan {other['makespan_s']:.1f} s")
    # The search stops within 1e-6 of the optimum, so a row only beats it by more than rounding
    # where the makespan is not convex, and the search may have found a local minimum.
    beaten = [row for row in data["table"] if row["makespan_s"] < best["makespan_s"] * (1 - 1e-4)]
    if beaten:
        lines.append(f"note: the {beaten[0]['delay']:.0%} row beats the binary search; these "
                     f"values break the model's premise (W|conc >= W and W|conc >= W|cached)")
    return "\n".join(lines)
