"""Graceful drain: leave the Service, then stop taking requests, and let the accepted ones finish.

On SIGTERM Kubernetes marks the pod's endpoint terminating, but kube-proxy on
every node and every client's pooled keep-alive connections keep sending
requests here for a while. So the drain has two steps:

1. For ``accept_seconds`` (5 s: the usual endpoint propagation time) the guard
   still admits requests as usual, while readiness is false and every response
   carries ``Connection: close``, so clients reconnect through the Service to
   a replica that stays.
2. After that, requests that still arrive get 503 with Retry-After.

Everything accepted (queued or in flight) runs to completion within the
drain timeout. The preStop hook waits for both steps.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

ENDPOINT_GRACE_SECONDS = 5.0


class Drain:
    def __init__(self, accept_seconds: float = ENDPOINT_GRACE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.draining = False
        self.active = 0
        self.accept_seconds = accept_seconds
        self._clock = clock
        self._began: float | None = None
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
        if not self.draining:
            self.draining = True
            self._began = self._clock()

    @property
    def refusing(self) -> bool:
        """Past the endpoint grace: new requests are refused."""
        return self._began is not None and self._clock() - self._began >= self.accept_seconds

    async def wait_idle(self, timeout: float) -> bool:
        """True if the grace passed and every accepted request finished within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.refusing:
            if loop.time() >= deadline:
                return self.active == 0
            await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return False
        return True
