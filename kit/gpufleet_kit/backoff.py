"""Pauses between tries, doubling from a first pause to a cap: the one backoff of every component.

``delay`` is the pure rule; ``Backoff`` keeps the count for one thing being retried (with optional
jitter so that many clients cut off together do not come back together); ``KeyedBackoff`` keeps one
per key (a replica, an adapter) with the time each may be tried again."""
from __future__ import annotations

import random
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)


def delay(failures: int, first: float, cap: float) -> float:
    """Seconds to wait after ``failures`` failures in a row: ``first`` after one, doubling, at most ``cap``;
    0 after none."""
    if failures <= 0:
        return 0.0
    # 2 ** n overflows a float long before n reaches a count anyone retries; the cap is reached by then.
    return min(cap, first * 2 ** min(failures - 1, 64))


class Backoff:
    """Pauses for one thing being retried: ``first`` seconds, doubling to ``cap``; with ``jitter`` j each
    pause is drawn within ±j of it (``rand`` gives [0, 1))."""

    def __init__(self, first: float = 0.5, cap: float = 30.0, jitter: float = 0.0,
                 rand: Callable[[], float] = random.random):
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        self.first, self.cap, self.jitter, self.rand = first, cap, jitter, rand
        self.failures = 0

    def next(self) -> float:
        """One more failure: the pause before the next try."""
        self.failures += 1
        pause = delay(self.failures, self.first, self.cap)
        return pause * (1 - self.jitter + 2 * self.jitter * self.rand()) if self.jitter else pause

    def reset(self) -> None:
        """A success: the next failure pauses ``first`` again."""
        self.failures = 0


class KeyedBackoff(Generic[K]):
    """Per key: how many failures in a row, and when it may be tried again (times from the caller's clock)."""

    def __init__(self, first: float, cap: float):
        self.first, self.cap = first, cap
        self._state: dict[K, tuple[int, float]] = {}   # key → (failures in a row, retry at)

    def failed(self, key: K, now: float) -> float:
        """One more failure of ``key`` at ``now``: the pause before it may be tried again."""
        failures = self._state.get(key, (0, 0.0))[0] + 1
        pause = delay(failures, self.first, self.cap)
        self._state[key] = (failures, now + pause)
        return pause

    def waiting(self, key: K, now: float) -> bool:
        """Whether ``key`` failed and its pause has not ended at ``now``."""
        state = self._state.get(key)
        return state is not None and now < state[1]

    def failures(self, key: K) -> int:
        return self._state.get(key, (0, 0.0))[0]

    def succeeded(self, key: K) -> None:
        self._state.pop(key, None)

    def forget_except(self, keys: set[K]) -> None:
        """Drop the keys that no longer exist (replicas gone), so the state does not grow."""
        for key in [k for k in self._state if k not in keys]:
            del self._state[key]
