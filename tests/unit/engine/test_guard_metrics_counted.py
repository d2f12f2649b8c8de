"""The ITL histogram the relay counts into itself reads as prometheus_client's Histogram would."""
from __future__ import annotations

import bisect
import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gpufleet_engine.serving.prometheus import CountedHistogram


def _lines(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if line and "_created" not in line)


def test_counts_added_in_batches_expose_what_one_observe_per_gap_would():
    buckets = (0.001, 0.0025, 0.005, 0.01, 0.075, 0.25, 1.0)
    reference, counted = CollectorRegistry(), CollectorRegistry()
    h = Histogram("x_seconds", "Gaps.", ["class"], buckets=buckets, registry=reference)
    c = CountedHistogram("x_seconds", "Gaps.", "class", buckets, counted)
    rng = random.Random(3)
    gaps = [rng.choice([0.001, 0.075, 1.0, 2.0]) if rng.random() < 0.2 else rng.expovariate(200)
            for _ in range(1000)]
    for start in range(0, len(gaps), 128):   # a stream's gaps, added at once as the relay does
        counts, total = [0] * (len(buckets) + 1), 0.0
        for g in gaps[start:start + 128]:
            h.labels("interactive").observe(g)
            counts[bisect.bisect_left(c.bounds, g)] += 1   # a gap on a bound falls in that bucket
            total += g
        c.labels("interactive").add(counts, total)
    h.labels("batch").observe(0.005)
    one = [0] * (len(buckets) + 1)
    one[bisect.bisect_left(c.bounds, 0.005)] = 1
    c.labels("batch").add(one, 0.005)
    ours, theirs = _lines(counted), _lines(reference)
    sums = [line for line in ours if "_sum" in line]
    assert [line for line in ours if "_sum" not in line] == [line for line in theirs if "_sum" not in line]
    for line, ref in zip(sums, [line for line in theirs if "_sum" in line]):
        assert abs(float(line.rsplit(" ", 1)[1]) - float(ref.rsplit(" ", 1)[1])) < 1e-9
