"""Graceful drain: stop taking requests, let the accepted ones finish.

On SIGTERM Kubernetes removes the pod from the Service while the guard
drains; readiness turns false at once so no new traffic is routed here, new
requests that still arrive get 503, and everything already accepted (queued
or in flight) runs to completion within the drain timeout.
"""
from __future__ import annotations

import asyncio


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    def begin(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """True if every accepted request finished within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
