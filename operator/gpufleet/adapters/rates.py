"""Requests per second for each adapter over the last minute, from the guards' counters. Pure.

Each replica's guard counts ``gpufleet_guard_adapter_requests_total{adapter,outcome}``;
the fleet loop hands the summed counts of every read (``observe``) and placement
asks for the rates (``rates``): per replica, the counter's rise over the window
divided by the window's span, summed over replicas. A counter that fell (the
guard restarted) counts from zero; a replica read only once counts nothing yet.
"""
from __future__ import annotations

import collections
from typing import Iterable, Mapping

WINDOW_S = 60.0


class AdapterRates:
    def __init__(self, window: float = WINDOW_S):
        self.window = window
        # replica → [(time, {adapter: cumulative requests})], oldest first
        self._history: dict[str, collections.deque[tuple[float, dict[str, float]]]] = {}

    def observe(self, replica: str, counts: Mapping[str, float] | Iterable[tuple[str, float]], now: float) -> None:
        history = self._history.setdefault(replica, collections.deque())
        history.append((now, dict(counts)))
        while len(history) > 1 and now - history[0][0] > self.window:
            history.popleft()

    def forget_except(self, replicas: Iterable[str]) -> None:
        """Drop the history of replicas that are gone."""
        keep = set(replicas)
        for r in [r for r in self._history if r not in keep]:
            del self._history[r]

    def rates(self) -> dict[str, float]:
        """adapter → requests per second over the window, every replica together."""
        out: dict[str, float] = {}
        for history in self._history.values():
            if len(history) < 2:
                continue
            (t0, first), (t1, last) = history[0], history[-1]
            span = t1 - t0
            if span <= 0:
                continue
            for adapter, now_count in last.items():
                before = first.get(adapter, 0.0)
                rise = now_count - before if now_count >= before else now_count  # a restart reset it
                out[adapter] = out.get(adapter, 0.0) + rise / span
        return out
