"""How many output tokens a request will really use, learned online. Pure: no clock, no I/O.

Answers end at EOS (or a stop sequence) far below ``max_tokens``, and most
chat clients send no ``max_tokens`` at all, so reserving the worst case would
run the guard's ledger dry while most of vLLM's KV pool sits empty. The guard
instead keeps the recent output lengths of each (route, queue class) and
reserves, per sequence, ``min(budget, that distribution's quantile)``.

Until a key has ``min_samples`` finished answers the prior is the full budget
(the worst case, what FullBudget always reserves): a new replica starts
conservative and loosens as it learns. An answer that streams past its
reservation is extended to the same quantile of the answers that were at
least as long (``extension``), so the ledger keeps tracking what requests
really hold.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Hashable

MIN_SAMPLES = 16
WINDOW = 512


class _Lengths:
    """The last ``window`` lengths, kept both in arrival order and sorted."""

    def __init__(self, window: int):
        self.order: deque[int] = deque()
        self.sorted: list[int] = []
        self.window = window

    def add(self, length: int) -> None:
        if len(self.order) == self.window:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
        self.order.append(length)
        bisect.insort(self.sorted, length)

    def quantile(self, q: float, above: int = -1) -> int | None:
        """Nearest-rank ``q`` quantile of the lengths greater than ``above``; None if there are none."""
        start = bisect.bisect_right(self.sorted, above)
        count = len(self.sorted) - start
        if count <= 0:
            return None
        rank = max(1, math.ceil(q * count))
        return self.sorted[start + rank - 1]


class OutputPredictor:
    """Recent output lengths per key → tokens to reserve per sequence."""

    def __init__(self, quantile: float, *, min_samples: int = MIN_SAMPLES, window: int = WINDOW):
        if not 0 < quantile <= 1:
            raise ValueError("quantile must be in (0, 1]")
        self.quantile = quantile
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

    def prediction(self, key: Hashable) -> int | None:
        """The quantile now, or None while the key has too few samples (the prior applies)."""
        if not self.learned(key):
            return None
        return self._keys[key].quantile(self.quantile)

    def reserve(self, key: Hashable, budget: int) -> int:
        """Output tokens to reserve for a new request allowed ``budget``: at least 1, at most ``budget``."""
        predicted = self.prediction(key)
        if predicted is None:
            return budget
        return max(1, min(budget, predicted))

    def extension(self, key: Hashable, seen: int, budget: int) -> int:
        """A new reservation for an answer already ``seen`` tokens long (more than reserved).

        The quantile of the answers that were longer than ``seen``; when none
        were, twice what has been seen. Always more than ``seen`` unless the
        budget is reached.
        """
        lengths = self._keys.get(key)
        longer = lengths.quantile(self.quantile, above=seen) if lengths and self.learned(key) else None
        target = longer if longer is not None else 2 * max(1, seen)
        return min(budget, max(seen + 1, target))
