"""The router's reading of its own event loop's lateness: a loop kept from running (as a router without
CPU is) shows in gpufleet_router_event_loop_lag_seconds; a free one does not."""
from __future__ import annotations

import asyncio
import time

from gpufleet_router import loop_lag
from gpufleet_router.metrics import RouterMetrics


def _samples(metrics: RouterMetrics, le: str) -> float:
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "gpufleet_router_event_loop_lag_seconds_bucket" and s.labels["le"] == le:
                return s.value
    raise AssertionError("no lag histogram")


def _count(metrics: RouterMetrics) -> float:
    return _samples(metrics, "+Inf")


async def test_a_loop_kept_from_running_is_recorded_as_late():
    metrics = RouterMetrics()
    watcher = asyncio.create_task(loop_lag.watch(metrics, interval=0.01))
    try:
        while _count(metrics) < 3:           # it runs: a few on-time wakes first
            await asyncio.sleep(0.01)
        on_time = _samples(metrics, "0.5")
        time.sleep(0.6)  # noqa: ASYNC251 (the loop gets no turn for 0.6 s, as a starved router's)
        while _count(metrics) <= on_time + 1:
            await asyncio.sleep(0.01)
    finally:
        watcher.cancel()
    late = _count(metrics) - _samples(metrics, "0.5")
    assert late >= 1, "a wake 0.6 s late was not counted above 0.5 s"
