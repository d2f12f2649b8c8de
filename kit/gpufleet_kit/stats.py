"""Percentiles of observed values: the one implementation every component and benchmark uses."""
from __future__ import annotations

import math
from typing import Sequence


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1): the smallest observed value with at least ``q`` of the
    values at or below it, so always a value that occurred (p99 of 50 samples is the largest, not an
    interpolation below it). ValueError on no values or ``q`` outside (0, 1]."""
    if not values:
        raise ValueError("a percentile of no values")
    if not 0 < q <= 1:
        raise ValueError(f"the quantile must be in (0, 1], got {q}")
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]
