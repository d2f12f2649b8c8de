"""How long a service takes to get its first replica ready, as this router has seen it (pure).

A request for a service with no replica that can take it is held while one
starts (server.py). A cold start is measured from the first such request to
the first replica eligible for it; the median of the recent ones tells a
held request that times out when to come back."""
from __future__ import annotations

import statistics
from collections import deque

DEFAULT_COLD_START_SECONDS = 60.0   # before any was measured: an engine loading weights onto a GPU
KEPT = 16


class ColdStarts:
    def __init__(self, default_seconds: float = DEFAULT_COLD_START_SECONDS, keep: int = KEPT):
        self.default_seconds = default_seconds
        self._seen: deque[float] = deque(maxlen=keep)

    def record(self, seconds: float) -> None:
        self._seen.append(max(0.0, seconds))

    @property
    def measured(self) -> int:
        return len(self._seen)

    def expected(self) -> float:
        return statistics.median(self._seen) if self._seen else self.default_seconds

    def retry_after(self, waited: float) -> float:
        """Seconds until a replica is expected, for a client that has waited ``waited`` (at least 1)."""
        return max(1.0, self.expected() - waited)
