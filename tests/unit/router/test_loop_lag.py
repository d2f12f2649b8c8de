"""The router's reading of its own event loop's lateness: a loop kept from running (as a router without
CPU is) shows in gpufleet_router_event_loop_lag_seconds, and the retry windows do not count that time."""
from __future__ import annotations

import asyncio
import time

from gpufleet_router.loop_lag import LoopLag
from gpufleet_router.metrics import RouterMetrics


def _bucket(metrics: RouterMetrics, le: str) -> float:
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "gpufleet_router_event_loop_lag_seconds_bucket" and s.labels["le"] == le:
                return s.value
    raise AssertionError("no lag histogram")


async def _until_wakes(metrics: RouterMetrics, count: float) -> None:
    while _bucket(metrics, "+Inf") < count:
        await asyncio.sleep(0.01)


async def test_a_loop_kept_from_running_is_recorded_as_late_and_a_window_is_extended_by_it():
    metrics = RouterMetrics()
    lag = LoopLag(metrics, interval=0.01)
    watcher = asyncio.create_task(lag.watch())
    try:
        await _until_wakes(metrics, 3)          # it runs: a few on-time wakes first
        on_time = _bucket(metrics, "+Inf")
        start = time.monotonic()
        window = lag.window(start, 0.3)
        time.sleep(0.6)  # noqa: ASYNC251 (the loop gets no turn for 0.6 s, as a starved router's)
        # Before the watcher has run again, the stall in progress already counts.
        assert window.allows(time.monotonic()), "a window of 0.3 s closed during the router's own 0.6 s stall"
        assert not window.allows(time.monotonic() + 1.0)
        await _until_wakes(metrics, on_time + 1)
    finally:
        watcher.cancel()
    assert _bucket(metrics, "+Inf") - _bucket(metrics, "0.5") >= 1, "a wake 0.6 s late was not counted above 0.5 s"
    assert lag.stalled >= 0.5


def test_without_stalls_a_window_is_its_nominal_length():
    now = [100.0]
    lag = LoopLag(clock=lambda: now[0])
    window = lag.window(100.0, 10)
    assert window.allows(110.0) and not window.allows(110.01)
