"""How many output tokens a request will really use, learned online. Pure: no clock, no I/O.

Answers end at EOS (or a stop sequence) far below ``max_tokens``, and most
chat clients send no ``max_tokens`` at all, so reserving the worst case would
run the guard's ledger dry while most of vLLM's KV pool sits empty. The guard
instead keeps the recent output lengths of each (route, queue class) and
reserves, per sequence, the mean of ``min(budget, length)`` over them, with
that distribution's variance: the ledger (``kv_ledger.py``) adds one safety
margin for all requests in flight from the sum of their variances, so that
their answers *together* fit at the configured quantile. A margin per request
(each one's own 90th percentile) would promise the pool many times over: the
answers of 32 requests do not all end at their 90th percentile at once.

Until a key has ``min_samples`` finished answers the prior is the full budget
(the worst case, what FullBudget always reserves) with no variance: a
service's first replica starts conservative and loosens as it learns. Its
later replicas start from what the service learned (``seed``, from the
quantiles other replicas ``export``: ``contract/demand_prior.py``). An answer that streams
past its reservation is extended to the mean of the answers that were longer
than what has streamed, with their variance (``extension``), so the ledger
keeps tracking what requests really hold.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Hashable

MIN_SAMPLES = 16
WINDOW = 512


class _Lengths:
    """The last ``window`` lengths, kept in arrival order and sorted, with the sorted lengths'
    squares beside them: the moments of a request's reservation are two bisections and two
    slice sums, not a Python loop over the window on every admission."""

    def __init__(self, window: int):
        self.order: deque[int] = deque()
        self.sorted: list[int] = []
        self.squares: list[int] = []   # squares of ``sorted``, in the same order
        self.total = 0                 # sum of the window
        self.window = window

    def add(self, length: int) -> None:
        if len(self.order) == self.window:
            old = self.order.popleft()
            at = bisect.bisect_left(self.sorted, old)
            del self.sorted[at]
            del self.squares[at]
            self.total -= old
        self.order.append(length)
        at = bisect.bisect_right(self.sorted, length)
        self.sorted.insert(at, length)
        self.squares.insert(at, length * length)
        self.total += length

    def mean(self) -> float:
        return self.total / len(self.order)

    def moments(self, budget: int, above: int = -1) -> tuple[float, float] | None:
        """Mean and variance of min(budget, length) over the lengths greater than ``above``."""
        start = bisect.bisect_right(self.sorted, above)
        count = len(self.sorted) - start
        if count <= 0:
            return None
        # Lengths in [start, clip) stay as they are; the ones from ``clip`` on count as the budget.
        clip = max(start, bisect.bisect_right(self.sorted, budget))
        clipped = len(self.sorted) - clip
        total = sum(self.sorted[start:clip]) + budget * clipped
        squares = sum(self.squares[start:clip]) + budget * budget * clipped
        mean = total / count
        # Exact integer sums, one division each: E[x²] − E[x]², never below zero.
        return mean, max(0.0, (squares * count - total * total) / (count * count))


@dataclass(frozen=True)
class Demand:
    """Output tokens to reserve per sequence, and the variance of the answer's length around them."""
    tokens: int
    variance: float = 0.0


class OutputPredictor:
    """Recent output lengths per key → tokens to reserve per sequence."""

    def __init__(self, *, min_samples: int = MIN_SAMPLES, window: int = WINDOW):
        self.min_samples = min_samples
        self.window = window
        self._keys: dict[Hashable, _Lengths] = {}

    def samples(self, key: Hashable) -> int:
        lengths = self._keys.get(key)
        return len(lengths.order) if lengths else 0

    def learned(self, key: Hashable) -> bool:
        return self.samples(key) >= self.min_samples

    def observe(self, key: Hashable, output_tokens: int) -> None:
        """A finished answer of ``output_tokens`` per sequence."""
        lengths = self._keys.get(key)
        if lengths is None:
            lengths = self._keys[key] = _Lengths(self.window)
        lengths.add(max(0, int(output_tokens)))

    def export(self) -> dict[Hashable, list[int]]:
        """The recent lengths of every learned key, ascending."""
        return {key: list(lengths.sorted) for key, lengths in self._keys.items() if self.learned(key)}

    def seed(self, key: Hashable, lengths: list[int] | tuple[int, ...]) -> bool:
        """Start ``key`` from its service's lengths, unless it has learned it already (the few
        answers of its own it may have stay). Its own answers then push the seeded ones out of
        the window."""
        if self.learned(key) or not lengths:
            return False
        for length in lengths:
            self.observe(key, length)
        return True

    def prediction(self, key: Hashable) -> float | None:
        """The mean learned length now, or None while the key has too few samples (the prior applies)."""
        if not self.learned(key):
            return None
        return self._keys[key].mean()

    def reserve(self, key: Hashable, budget: int) -> Demand:
        """What a new request allowed ``budget`` tokens reserves: the mean of min(budget, length)
        rounded up (at least 1, at most ``budget``) and its variance; the budget while unlearned."""
        moments = self._keys[key].moments(budget) if self.learned(key) else None
        if moments is None:
            return Demand(budget)
        mean, variance = moments
        return Demand(max(1, min(budget, math.ceil(mean))), variance)

    def extension(self, key: Hashable, seen: int, budget: int) -> Demand:
        """A new reservation for an answer already ``seen`` tokens long (more than reserved).

        The mean and variance of the answers that were longer than ``seen``;
        when none were, twice what has been seen. Always more than ``seen``
        unless the budget is reached.
        """
        lengths = self._keys.get(key)
        longer = lengths.moments(budget, above=seen) if lengths and self.learned(key) else None
        if longer is None:
            return Demand(min(budget, max(seen + 1, 2 * max(1, seen))))
        mean, variance = longer
        return Demand(min(budget, max(seen + 1, math.ceil(mean))), variance)
