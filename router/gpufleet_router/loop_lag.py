"""How late the router's own event loop runs.

A router without CPU (a small request beside busy engines, a noisy neighbour) runs its timers late: a
connection its guard accepted at once is then judged timed out when the loop next runs, because the
timeout's callback and the connection's completion fire in the same pass and the timeout wins. Without
this reading, that looks like the replica's fault. ``watch`` sleeps ``interval`` at a time and records how
much later than asked it woke, in ``gpufleet_router_event_loop_lag_seconds``."""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from .metrics import RouterMetrics

INTERVAL_SECONDS = 0.25


async def watch(metrics: RouterMetrics, interval: float = INTERVAL_SECONDS,
                clock: Callable[[], float] = time.monotonic) -> None:
    while True:
        start = clock()
        await asyncio.sleep(interval)
        metrics.loop_lag_seconds.observe(max(0.0, clock() - start - interval))
