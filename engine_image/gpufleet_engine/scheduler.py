"""Admission and dispatch: who goes to vLLM now, who waits, who is told to come back.

A request is refused at once when its KV budget would cross the watermark
(waiting would only add queue time to a request that still may not fit, and
the client can retry elsewhere). Otherwise it takes a dispatch slot — at most
``max_concurrency`` requests talk to vLLM — or waits in the multi-level
queue for one, at most its class's ``maxQueueSeconds``. The KV check is
repeated at dispatch because the pool may have filled while it waited.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from .admission import Decision, KvLedger
from .contract.guard_config import QueueClass
from .contract.guard_metrics import Reason
from .queues import Entry, MultiLevelQueue, QueueFull


class Rejection(Exception):
    """The guard refuses a request; ``reason`` is the metrics label, ``status`` the HTTP status."""

    def __init__(self, reason: str, status: int, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass(eq=False)
class Grant:
    """A dispatch slot plus a KV reservation; give it back with ``Scheduler.release``."""
    cost: int
    queue_class: QueueClass
    queued_seconds: float


@dataclass(eq=False)
class _Waiter:
    cost: int
    future: asyncio.Future


class Scheduler:
    def __init__(self, ledger: KvLedger, queue: MultiLevelQueue[_Waiter], max_concurrency: int,
                 retry_after_seconds: float, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] | None = None):
        self.ledger = ledger
        self.queue = queue
        self.max_concurrency = max_concurrency
        self.retry_after = retry_after_seconds
        self._clock = clock
        self._on_change = on_change or (lambda: None)
        self.running = 0

    def kv_rejection(self, cost: int) -> Rejection:
        """The refusal for a request of ``cost`` blocks that does not fit now."""
        return self._kv_rejection(self.ledger.evaluate(cost))

    def _kv_rejection(self, d: Decision) -> Rejection:
        need = f"it needs {d.cost} blocks" if d.cost > 1 else "it needs at least one block"
        if d.cost > d.unreserved_blocks:
            why = f"only {max(0, d.unreserved_blocks)} are not promised to requests in flight"
        else:
            why = f"{d.free_blocks} are free and {d.watermark} are kept free for requests in flight"
        return Rejection(Reason.KV_WATERMARK, 429,
                         f"The KV cache is too full to admit this request now: {need}, {why}. Retry later.",
                         self.retry_after)

    async def acquire(self, cost: int, queue_class: QueueClass) -> Grant:
        arrived = self._clock()
        decision = self.ledger.evaluate(cost)
        if not decision.admitted:
            raise self._kv_rejection(decision)
        if self.running < self.max_concurrency and len(self.queue) == 0:
            grant = Grant(cost, queue_class, 0.0)
            self.ledger.try_admit(grant, cost)  # cannot fail: evaluated above, nothing ran in between
            self.running += 1
            self._on_change()
            return grant

        waiter = _Waiter(cost, asyncio.get_running_loop().create_future())
        try:
            entry = self.queue.push(waiter, queue_class.name, arrived)
        except QueueFull as e:
            raise Rejection(Reason.QUEUE_FULL, 429, f"The guard's queue is full ({e}). Retry later.",
                            self.retry_after) from None
        self._on_change()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), queue_class.max_queue_seconds)
        except asyncio.TimeoutError:
            if self._abandon(entry):
                raise Rejection(
                    Reason.QUEUE_TIMEOUT, 429,
                    f"The request waited {queue_class.max_queue_seconds:g}s, the most class "
                    f"{queue_class.name!r} may wait for a free slot. Retry later.",
                    self.retry_after) from None
            return waiter.future.result()  # dispatched in the same instant it timed out
        except asyncio.CancelledError:
            if not self._abandon(entry) and waiter.future.done() and not waiter.future.exception():
                self.release(waiter.future.result())
            raise

    def _abandon(self, entry: Entry[_Waiter]) -> bool:
        removed = self.queue.remove(entry)
        if removed:
            self._on_change()
        return removed

    def release(self, grant: Grant) -> None:
        self.ledger.release(grant)
        self.running -= 1
        self.dispatch()

    def dispatch(self) -> None:
        """Hand free slots to queued requests, best effective level first."""
        changed = False
        while self.running < self.max_concurrency:
            now = self._clock()
            entry = self.queue.pop(now)
            if entry is None:
                break
            changed = True
            waiter = entry.item
            if waiter.future.done():
                continue
            grant = Grant(waiter.cost, entry.queue_class, entry.waited(now))
            decision = self.ledger.try_admit(grant, waiter.cost)
            if not decision.admitted:
                waiter.future.set_exception(self._kv_rejection(decision))
                continue
            self.running += 1
            waiter.future.set_result(grant)
        if changed:
            self._on_change()
