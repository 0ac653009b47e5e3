"""The arithmetic of every benchmark's summary: a ratio of two figures, the median of runs.

A ratio is None where its denominator is 0 (coordlfs read nothing from storage: the ratio is
unbounded, not a number JSON can hold), and a median leaves such runs out.
"""

from __future__ import annotations

import statistics


def ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator else None


def median(values: list[float | None]) -> float | None:
    """The median of the known values, or None if there is none."""
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None
