"""The requests a service's engines finished over the last minutes, from their cumulative token
counts (vLLM's per-request prompt and output token histograms). Pure.

Each read adds what every pod finished since its previous read (per-pod deltas: a pod that comes
or goes, or restarts, is no counter reset); reads older than the window fall out. ``demand``
turns the window into the planner's request distribution (``planning.live_ratio``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from ..planning.distribution import TokenStats
from ..planning.live_ratio import MeasuredDemand
from .signals import ReplicaSample, RequestTokens, quantile_from_buckets

RATIO_WINDOW_S = 300.0


@dataclasses.dataclass(frozen=True)
class TokenWindow:
    seen: tuple[tuple[str, RequestTokens], ...] = ()      # per pod cumulative counts at the last read
    reads: tuple[tuple[float, RequestTokens], ...] = ()   # (when, finished since the read before)
    since: float | None = None                             # the first read: the window is no longer than this

    def advance(self, samples: Sequence[ReplicaSample], now: float, span: float = RATIO_WINDOW_S) -> "TokenWindow":
        before = dict(self.seen)
        finished = RequestTokens()
        for s in samples:
            if s.ok and s.pod in before:  # a pod's first read is its baseline: its history is not recent
                finished = finished.plus(s.request_tokens.since(before[s.pod]))
        reads = tuple((t, r) for t, r in self.reads if now - t < span)
        if finished.requests:
            reads += ((now, finished),)
        # An unreadable pod keeps its last counts: what it finishes meanwhile counts at its next read.
        seen = tuple((s.pod, s.request_tokens) if s.ok else (s.pod, before[s.pod])
                     for s in samples if s.ok or s.pod in before)
        return TokenWindow(seen, reads, self.since if self.since is not None else now)

    def demand(self, now: float, span: float = RATIO_WINDOW_S) -> MeasuredDemand | None:
        """The requests finished in the window; None before a second read."""
        if self.since is None or now <= self.since:
            return None
        total = RequestTokens()
        for _, r in self.reads:
            total = total.plus(r)
        return MeasuredDemand(requests=total.requests, seconds=min(span, now - self.since),
                              prompt=_stats(total.prompt_buckets, total.prompt_sum, total.requests),
                              output=_stats(total.output_buckets, total.output_sum, total.requests))


def _stats(buckets, total: float, requests: float) -> TokenStats:
    mean = total / requests if requests else 0.0
    p50, p95, p99 = (quantile_from_buckets(list(buckets), q) for q in (0.5, 0.95, 0.99))
    return TokenStats(p50=mean if p50 is None else p50, p95=mean if p95 is None else p95,
                      p99=mean if p99 is None else p99, mean=mean, max=None)
