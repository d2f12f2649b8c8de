"""How late the router's own event loop runs, and retry windows that do not count the time it did not run.

A router without CPU (a small request beside busy engines, a noisy neighbour) runs its timers late: a
connection its guard accepted at once is then judged timed out when the loop next runs, because the
timeout's callback and the connection's completion fire in the same pass and the timeout wins. Seen on the
2-core real node: the routers' loops woke over 1 s late 120 times in one test session, and a request got a
502 after every connection to a live guard "timed out" for the whole 10 s retry window.

``LoopLag.watch`` sleeps ``interval`` at a time and records how much later than asked it woke
(``gpufleet_router_event_loop_lag_seconds``), and the total: the seconds this router has not run. A
``Window`` (the unreachable-retry window of a request, the resume window of a broken stream) ends that
many seconds later, so a starved router goes on trying for as long as it was meant to try while it runs,
instead of writing off a replica for its own stall."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

from .metrics import RouterMetrics

INTERVAL_SECONDS = 0.25


class LoopLag:
    def __init__(self, metrics: RouterMetrics | None = None, interval: float = INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.metrics, self.interval, self.clock = metrics, interval, clock
        self.stalled = 0.0                 # seconds of lateness recorded
        self._asleep_since: float | None = None

    def stalled_now(self) -> float:
        """The lateness recorded, and that of the sleep in progress (the loop may run a retry before it
        runs the watcher, in the same late pass)."""
        if self._asleep_since is None:
            return self.stalled
        return self.stalled + max(0.0, self.clock() - self._asleep_since - self.interval)

    def window(self, start: float, seconds: float) -> Window:
        """``seconds`` from ``start`` (this clock's), extended by the time the loop does not run from now."""
        return Window(self, start + seconds, self.stalled_now())

    async def watch(self) -> None:
        while True:
            self._asleep_since = self.clock()
            await asyncio.sleep(self.interval)
            lag = max(0.0, self.clock() - self._asleep_since - self.interval)
            self._asleep_since = None
            self.stalled += lag
            if self.metrics is not None:
                self.metrics.loop_lag_seconds.observe(lag)


@dataclasses.dataclass(frozen=True)
class Window:
    lag: LoopLag
    end: float
    mark: float

    def allows(self, at: float) -> bool:
        """Whether ``at`` is within the window, the router's stalls since it opened added to its end."""
        return at <= self.end + (self.lag.stalled_now() - self.mark)
