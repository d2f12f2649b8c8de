"""The request distribution: token percentiles, arrival rates per window, and
requests and tokens in flight.

Times are handled as integer microseconds so that a request ending exactly when
another arrives is never counted twice through floating-point rounding.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from gpufleet_kit.stats import nearest_rank

PERCENTILES = (50, 95, 99)


@dataclasses.dataclass(frozen=True)
class TokenStats:
    p50: float
    p95: float
    p99: float
    mean: float
    max: float | None       # None when only a histogram was seen (Prometheus)


@dataclasses.dataclass(frozen=True)
class Traffic:
    requests: int
    span_seconds: float             # first to last arrival
    window_seconds: float           # rates are counted per window of this length
    windows: int
    rps_peak: float
    rps_trough: float
    rps_mean: float
    prompt_tokens_per_s_peak: float
    output_tokens_per_s_peak: float


@dataclasses.dataclass(frozen=True)
class Concurrency:
    requests_peak: float
    tokens_peak: float              # prompt + output tokens of the requests in flight
    method: str                     # how it was obtained, for the report


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: the smallest observed value with at least p% of
    values at or below it. Always a value that occurred (a real token count)."""
    if not 0 < p <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    return nearest_rank(values, p / 100)


def token_stats(values: Sequence[int]) -> TokenStats:
    p50, p95, p99 = (percentile(values, p) for p in PERCENTILES)
    return TokenStats(p50=p50, p95=p95, p99=p99, mean=sum(values) / len(values), max=max(values))


def _us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def traffic(starts: Sequence[float], prompt_tokens: Sequence[int], output_tokens: Sequence[int],
            window_seconds: float) -> Traffic:
    """Arrivals, prompt tokens and output tokens counted per window.

    Windows start at the first arrival. The trough leaves out the last window
    when there are several, because the log ends somewhere inside it and it
    would read low. Tokens count in the window their request arrived in.
    """
    if not starts:
        raise ValueError("traffic of no requests")
    if window_seconds <= 0:
        raise ValueError(f"window must be positive, got {window_seconds}")
    window_us = max(1, _us(window_seconds))
    starts_us = [_us(s) for s in starts]
    first = min(starts_us)
    n_windows = (max(starts_us) - first) // window_us + 1
    arrivals = [0] * n_windows
    prompt = [0] * n_windows
    output = [0] * n_windows
    for s, p, o in zip(starts_us, prompt_tokens, output_tokens):
        i = (s - first) // window_us
        arrivals[i] += 1
        prompt[i] += p
        output[i] += o
    w = window_us / 1_000_000
    complete = arrivals[:-1] if n_windows > 1 else arrivals
    return Traffic(
        requests=len(starts),
        span_seconds=(max(starts_us) - first) / 1_000_000,
        window_seconds=w,
        windows=n_windows,
        rps_peak=max(arrivals) / w,
        rps_trough=min(complete) / w,
        rps_mean=len(starts) / (n_windows * w),
        prompt_tokens_per_s_peak=max(prompt) / w,
        output_tokens_per_s_peak=max(output) / w,
    )


def concurrency(intervals: Iterable[tuple[float, float, int]], method: str) -> Concurrency:
    """Peak requests and tokens in flight from (start, duration, tokens) triples.

    A request holds [start, start + duration); one that ends at the instant
    another arrives is not counted with it. Requests and tokens peak separately.
    """
    events: list[tuple[int, int, int, int]] = []
    for start, duration, tokens in intervals:
        s = _us(start)
        e = s + _us(duration)
        # Ends sort before arrivals at the same instant (second key 0 < 1).
        events.append((s, 1, 1, tokens))
        events.append((e, 0, -1, -tokens))
    events.sort()
    in_flight = tokens = peak_requests = peak_tokens = 0
    for _, _, d_requests, d_tokens in events:
        in_flight += d_requests
        tokens += d_tokens
        peak_requests = max(peak_requests, in_flight)
        peak_tokens = max(peak_tokens, tokens)
    return Concurrency(requests_peak=peak_requests, tokens_peak=peak_tokens, method=method)


@dataclasses.dataclass(frozen=True)
class PrometheusSample:
    """A service's request distribution as read from Prometheus (gpufleet.cli.prometheus reads it)."""
    url: str
    selector: str
    window_seconds: float
    prompt: TokenStats
    output: TokenStats
    traffic: Traffic
    concurrent_requests_peak: float | None      # None when the engines export no running/waiting gauges
    e2e_latency_mean_seconds: float | None      # None without the e2e latency histogram
    queries: dict[str, str]                     # what each number came from, for the report
