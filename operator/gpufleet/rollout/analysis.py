"""A canary step's SLO analysis: the SLI counters of a revision's replicas over the step, judged
against the service's error budget with the burn-rate arithmetic of the alerts.

Each guard counts ``gpufleet_guard_sli_events_total`` and ``gpufleet_guard_sli_good_events_total``
per ``sli`` (availability, ttft, itl, latency) and class (``ReplicaSample.sli``). Over a step, an
SLI's events are the sum over the revision's replicas of each counter's increase since the step
began (a replica that restarted counts from zero, one that started during the step from zero).
Its error ratio is ``1 - good / events``; its burn rate that ratio over the error budget
``1 - slo.availabilityPercent / 100``. An SLI with at least ``analysis.minRequests`` events is a
breach when even the low end of its error ratio's 95% confidence interval (Wilson's score interval)
burns the budget faster than ``analysis.maxBurnRate``: the canary is rolled back.

Why the interval: a canary step sees few events, and with a budget of 0.1% one bad event in 35 is a
burn rate of 28x. On the real node an ITL SLI (one event per gap between tokens) rolled back a
healthy canary on exactly that: one late gap of 35 on a loaded 2-core machine, while the stable
revision's rate over the same step was 2 in 9294. The interval asks for evidence in proportion: 1 bad
in 35 is no breach (low end 0.5%), 5 bad in 5 is (low end 57%), and 5 bad in 100 is (2.2%) against a
threshold of 14.4 x 0.1% = 1.44%.
"""
from __future__ import annotations

import dataclasses
import math
from decimal import Decimal
from typing import Iterable, Mapping

from gpufleet_api.guard.guard_metrics import SLIS

# The normal quantile of the two-sided 95% interval.
WILSON_Z = 1.96
# sli -> (events, good events), cumulative, of one replica (or summed)
Counters = Mapping[str, tuple[float, float]]


@dataclasses.dataclass(frozen=True)
class SLIResult:
    sli: str
    events: int
    good: int
    budget: float
    min_events: int
    max_burn_rate: float

    @property
    def error_ratio(self) -> float | None:
        return None if self.events <= 0 else max(0.0, self.events - self.good) / self.events

    @property
    def error_ratio_low(self) -> float | None:
        """The low end of the error ratio's 95% Wilson score interval."""
        if self.events <= 0:
            return None
        n, p, z2 = self.events, self.error_ratio or 0.0, WILSON_Z * WILSON_Z
        spread = WILSON_Z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
        return max(0.0, (p + z2 / (2 * n) - spread) / (1 + z2 / n))

    @property
    def burn_rate_low(self) -> float:
        """The burn rate of ``error_ratio_low`` (0 with no event or no budget)."""
        low = self.error_ratio_low
        return 0.0 if low is None or self.budget <= 0 else low / self.budget

    @property
    def burn_rate(self) -> float | None:
        ratio = self.error_ratio
        if ratio is None:
            return None
        return float("inf") if self.budget <= 0 and ratio > 0 else (0.0 if self.budget <= 0 else ratio / self.budget)

    @property
    def judged(self) -> bool:
        return self.events >= self.min_events

    @property
    def breach(self) -> bool:
        low = self.error_ratio_low
        if not self.judged or low is None:
            return False
        return low > 0 if self.budget <= 0 else low / self.budget > self.max_burn_rate

    def describe(self) -> str:
        burn = self.burn_rate
        return (f"{self.sli}: {self.events - self.good} of {self.events} events bad (error ratio "
                f"{self.error_ratio or 0:.4f}), burn rate {burn if burn is not None else 0:.1f}x the error budget "
                f"{self.budget:.4g}, at least {self.burn_rate_low:.1f}x with 95% confidence "
                f"(analysis.maxBurnRate {self.max_burn_rate:g})")


def budget(availability_percent: str) -> float:
    """The error budget: 1 - slo.availabilityPercent / 100."""
    return float(1 - Decimal(availability_percent) / 100)


def delta(now: Counters, before: Counters | None) -> dict[str, tuple[float, float]]:
    """One replica's increase per SLI since ``before`` (None: it started in the window; a counter
    below its earlier value: the guard restarted, counted from zero)."""
    out = {}
    for sli, (events, good) in now.items():
        was_events, was_good = (before or {}).get(sli, (0.0, 0.0))
        if events < was_events or good < was_good:
            was_events, was_good = 0.0, 0.0
        out[sli] = (events - was_events, good - was_good)
    return out


def window(now: Mapping[str, Counters], baseline: Mapping[str, Counters]) -> dict[str, tuple[float, float]]:
    """The SLIs of a set of replicas (``now``: pod -> its counters) since ``baseline`` (pod -> its
    counters when the window began), summed over the replicas."""
    total: dict[str, tuple[float, float]] = {}
    for pod, counters in now.items():
        for sli, (events, good) in delta(counters, baseline.get(pod)).items():
            e, g = total.get(sli, (0.0, 0.0))
            total[sli] = (e + events, g + good)
    return total


def judge(totals: Mapping[str, tuple[float, float]], *, availability_percent: str, min_requests: int,
          max_burn_rate: str) -> list[SLIResult]:
    """Every SLI's result over the window, in ``SLIS`` order."""
    b, most = budget(availability_percent), float(Decimal(max_burn_rate))
    return [SLIResult(sli, int(totals.get(sli, (0.0, 0.0))[0]), int(totals.get(sli, (0.0, 0.0))[1]), b,
                      min_requests, most) for sli in SLIS]


def first_breach(results: Iterable[SLIResult]) -> SLIResult | None:
    """The breaching SLI with the highest burn rate, None when all are inside the SLO."""
    breaches = [r for r in results if r.breach]
    return max(breaches, key=lambda r: r.burn_rate or 0.0) if breaches else None


def status_rows(revision: str, results: Iterable[SLIResult]) -> list[dict]:
    """``status.rollout.sli`` rows of one revision."""
    rows = []
    for r in results:
        row: dict = {"revision": revision, "sli": r.sli, "events": r.events, "goodEvents": r.good}
        burn = r.burn_rate
        if burn is not None:
            row["burnRate"] = "Inf" if burn == float("inf") else f"{burn:.2f}"
        rows.append(row)
    return rows
