"""The distribution on synthetic data whose answers are known."""
from __future__ import annotations

import random

import pytest

from gpufleet.planning.distribution import concurrency, percentile, token_stats, traffic

T0 = 1_750_000_000.0


def test_percentiles_of_a_known_uniform_set():
    values = list(range(1, 1001))
    random.Random(7).shuffle(values)
    stats = token_stats(values)
    # Nearest rank: p% of 1..1000 at or below the answer.
    assert (stats.p50, stats.p95, stats.p99) == (500, 950, 990)
    assert stats.mean == 500.5
    assert stats.max == 1000


def test_percentile_is_always_an_observed_value():
    assert percentile([10, 20, 30, 40], 50) == 20
    assert percentile([10, 20, 30, 40], 51) == 30
    assert percentile([7], 99) == 7
    with pytest.raises(ValueError):
        percentile([], 50)


def test_constant_load_rates():
    starts = [T0 + i / 10 for i in range(600)]           # 10 RPS for 60 s
    t = traffic(starts, [500] * 600, [100] * 600, window_seconds=1)
    assert t.windows == 60
    assert (t.rps_peak, t.rps_trough, t.rps_mean) == (10, 10, 10)
    assert t.prompt_tokens_per_s_peak == 5000
    assert t.output_tokens_per_s_peak == 1000
    assert t.span_seconds == pytest.approx(59.9)


def test_step_load_peak_and_trough():
    # 30 s at 5 RPS, then 30 s at 20 RPS, counted in 10 s windows.
    starts = [T0 + i / 5 for i in range(150)] + [T0 + 30 + i / 20 for i in range(600)]
    t = traffic(starts, [1] * 750, [1] * 750, window_seconds=10)
    assert t.windows == 6
    assert (t.rps_peak, t.rps_trough) == (20, 5)
    assert t.rps_mean == 750 / 60


def test_trough_ignores_the_partial_last_window():
    # 10 RPS for 25 s in 10 s windows: the last window holds only 5 s of log.
    starts = [T0 + i / 10 for i in range(250)]
    t = traffic(starts, [1] * 250, [1] * 250, window_seconds=10)
    assert t.windows == 3
    assert (t.rps_peak, t.rps_trough) == (10, 10)


def test_tokens_peak_in_their_own_window():
    starts = [T0, T0 + 1, T0 + 2]
    t = traffic(starts, [100, 900, 100], [50, 50, 700], window_seconds=1)
    assert t.prompt_tokens_per_s_peak == 900
    assert t.output_tokens_per_s_peak == 700


def test_constant_load_concurrency():
    # 10 RPS × 2 s = 20 in flight; 20 × (500 + 100) = 12,000 tokens.
    c = concurrency([(T0 + i / 10, 2.0, 600) for i in range(600)], method="test")
    assert c.requests_peak == 20
    assert c.tokens_peak == 12_000


def test_a_request_ending_as_another_arrives_is_not_counted_twice():
    c = concurrency([(T0, 1.0, 10), (T0 + 1.0, 1.0, 10), (T0 + 2.0, 1.0, 10)], method="test")
    assert (c.requests_peak, c.tokens_peak) == (1, 10)


def test_requests_and_tokens_peak_separately():
    # Three short requests overlap early; one huge request runs alone later.
    c = concurrency([(T0, 1, 10), (T0 + 0.1, 1, 10), (T0 + 0.2, 1, 10), (T0 + 5, 1, 5000)], method="test")
    assert c.requests_peak == 3
    assert c.tokens_peak == 5000
