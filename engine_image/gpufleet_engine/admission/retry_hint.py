"""How long a refused client should wait: Retry-After sized to the crowd. Pure.

A fixed hint (1 s) under heavy overload brings every refused client back
every second: at 128 clients and ~10 admissions a second that is ~120
refusals a second, each costing the guard (and, on a CPU host, the engine it
shares cores with) parsing and bookkeeping for nothing.

The guard estimates the crowd cycling through refusals with Little's law,
N ≈ refusal rate × mean hint, and tells the next refused client to come back
after N / (k × admission rate): with k = 6 about six attempts arrive per
opening, so freed blocks wait ~1/(6 × admission rate) for the next one
(k = 3 left them idle ~7% of a request's time on the 64-block bench), while
the refusal rate settles near k × the admission rate instead of growing
with the crowd. The hint never goes below the configured
``retryAfterSeconds`` nor above ``maximum`` (OpenAI's clients ignore hints
over 60 s).

``crowd()`` counts the same crowd instead, for the TTFT control's overload
gate (``Scheduler.overloaded``): each refused client until its hint runs out.
The estimate lags the refusals by seconds, and held that gate open after the
overload had ended; the count, sizing the hints, made them longer in the
fixed-length overload benchmark (goodput 88% of vLLM at 6 clients against
110% with the estimate, one run each), where every answer takes its whole
budget and a slot left idle between a finish and the next retry is lost.
"""
from __future__ import annotations

import heapq
import math
import time
from typing import Callable


class DecayingCounter:
    """Events per second over roughly the last ``tau`` seconds."""

    def __init__(self, tau: float):
        self.tau = tau
        self.value = 0.0
        self.at: float | None = None

    def _decay(self, now: float) -> None:
        if self.at is not None:
            self.value *= math.exp(-max(0.0, now - self.at) / self.tau)
        self.at = now

    def add(self, now: float, amount: float = 1.0) -> None:
        self._decay(now)
        self.value += amount

    def rate(self, now: float) -> float:
        self._decay(now)
        return self.value / self.tau


class RetryAdvisor:
    def __init__(self, base: float, *, maximum: float = 30.0, oversubscription: float = 6.0,
                 window: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.base = base
        self.maximum = max(base, maximum)
        self.k = oversubscription
        self._clock = clock
        self._admitted = DecayingCounter(window)
        self._refused = DecayingCounter(window)
        self._hint_sum = DecayingCounter(window)   # sum of hints given, decayed like the refusals
        self._waiting: list[float] = []   # a heap: when each refused client's Retry-After runs out

    def admitted(self) -> None:
        self._admitted.add(self._clock())

    def hint(self) -> float:
        """The Retry-After for a refusal now (does not record one)."""
        now = self._clock()
        refusals = self._refused.rate(now)
        if refusals <= 0:
            return self.base
        admissions = self._admitted.rate(now)
        if admissions <= 1e-3:
            # Nothing finishes (long requests hold the pool): back off harder each time, twice
            # the mean hint of late.
            return min(self.maximum, max(self.base, 2 * self._hint_sum.rate(now) / refusals))
        # The crowd by Little's law (refusal rate × mean hint, both decayed alike), not the
        # count: it sizes the hint to the crowd's pace of return rather than to the instant.
        return min(self.maximum, max(self.base, self._hint_sum.rate(now) / (self.k * admissions)))

    def crowd(self) -> float:
        """Refused clients waiting to retry now: those whose Retry-After has not run out. Counted,
        not estimated: a rate over seconds lags the refusals' end by those seconds, and would
        count clients long after they came back (the TTFT control reads this, Scheduler.overloaded)."""
        now = self._clock()
        while self._waiting and self._waiting[0] <= now:
            heapq.heappop(self._waiting)
        return float(len(self._waiting))

    def refused(self) -> float:
        """Record a refusal and return the hint to send with it."""
        value = self.hint()
        now = self._clock()
        self._refused.add(now)
        self._hint_sum.add(now, value)
        heapq.heappush(self._waiting, now + value)
        return value
