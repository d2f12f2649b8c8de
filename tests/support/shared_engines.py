"""Engines that several test modules share, started by the first module that asks for them and stopped by
the last one that is done with them (or at the session's end, whichever comes first).

A vLLM-CPU start is about 22 s of the engine tier on two cores; two modules whose tests need the same kind
of replicas (the same flags, the same guard settings) share one start instead of paying two. A module that
asks after an early stop starts them again, so the order modules run in changes only the time, never what a
test gets."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


class SharedEngines(Generic[T]):
    """``start`` makes the engines (and what goes with them), ``stop`` stops what ``start`` made."""

    def __init__(self, start: Callable[[], Awaitable[T]], stop: Callable[[T], Awaitable[None]]):
        self._start, self._stop = start, stop
        self._running: T | None = None
        self._lock = asyncio.Lock()
        self.starts = 0   # how many times they were started: 1 when every user ran in one go

    async def get(self) -> T:
        async with self._lock:
            if self._running is None:
                self._running = await self._start()
                self.starts += 1
            return self._running

    async def release(self) -> None:
        """Stop them now: the last module that needs them is done."""
        async with self._lock:
            running, self._running = self._running, None
            if running is not None:
                await self._stop(running)


class SharedEngine(Generic[T]):
    """The same for engines started and stopped synchronously (``LocalEngine.start``/``stop``)."""

    def __init__(self, start: Callable[[], T], stop: Callable[[T], None]):
        self._start, self._stop = start, stop
        self._running: T | None = None
        self.starts = 0

    def get(self) -> T:
        if self._running is None:
            self._running = self._start()
            self.starts += 1
        return self._running

    def release(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            self._stop(running)
