"""The leader-election loop: one Lease, one leader among the operator's replicas.

Runs the ``leadership`` state machine against the API server through its own
client (renewals never queue behind the operator's reconciles), watches the
Lease so a candidate sees each renewal as it happens and takes over the moment
it lapses, and reports every change: a log line, the
``gpufleet_operator_leader`` gauge, ``gpufleet_operator_leader_transitions_total``
and an Event on the Lease. Requests of the leader never wait beyond its renew
deadline, so a partitioned leader notices in time and stops acting.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import random
import time
from typing import Awaitable, Callable

from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig
from gpufleet_kit.kube.errors import ApiError, Conflict, Unreachable

from ..metrics import OperatorMetrics
from .lease_store import LeaseStore
from .records import Change, Leadership, LeaseRecord, Timing

log = logging.getLogger(__name__)
COMPONENT = "gpufleet-operator"
# What a Lease request can fail with: the API server's answer, or no answer (the kit's translation of the
# transport's errors); OSError for a socket the transport did not wrap.
REQUEST_FAILURES = (ApiError, Unreachable, OSError)


def wall_now() -> str:
    """A Lease's MicroTime."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, config: KubeConfig, namespace: str, name: str, identity: str, timing: Timing,
                 metrics: OperatorMetrics, *, clock: Callable[[], float] = time.monotonic):
        self.kube = KubeClient(config, timeout=timing.renew_deadline)
        self.store = LeaseStore(self.kube, namespace, name)
        self.machine = Leadership(identity, timing)
        self.metrics = metrics
        self._clock = clock
        self._wake = asyncio.Event()
        self._leading = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._last_contact: float | None = None
        self._reread = True  # the leader renews from its last write unless that may be stale
        self.last_error: str | None = None
        # Called with True when this replica starts leading and False when it stops.
        self.on_change: Callable[[bool], Awaitable[None] | None] | None = None
        metrics.leader.set(0)

    @property
    def identity(self) -> str:
        return self.machine.identity

    @property
    def lease(self) -> str:
        return f"{self.store.namespace}/{self.store.name}"

    # --- what the rest of the operator asks ------------------------------------

    def acting_for(self) -> float:
        """Seconds this replica may still write for (the client's write fence)."""
        return self.machine.acting_for(self._clock())

    def may_act(self) -> bool:
        return self.machine.may_act(self._clock())

    async def wait_leading(self) -> None:
        while not self.may_act():
            if self._leading.is_set():
                await asyncio.sleep(0.05)  # lapsed on the clock: the loop is about to step down
            else:
                await self._leading.wait()

    def able_to_lead(self) -> bool:
        """Readiness: the Lease was read or written within a lease duration."""
        return self._last_contact is not None and \
            self._clock() - self._last_contact < self.machine.timing.lease_duration

    # --- the loop ----------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name="gpufleet-leader-election"),
                       asyncio.create_task(self._watch(), name="gpufleet-lease-watch")]

    async def _run(self) -> None:
        log.info("leader election: %s is a candidate for Lease %s (lease %gs, renew deadline %gs, retry %gs)",
                 self.identity, self.lease, self.machine.timing.lease_duration,
                 self.machine.timing.renew_deadline, self.machine.timing.retry_period)
        while True:
            try:
                await self._attempt()
            except Exception:
                log.exception("leader election: attempt crashed; trying again")
            now = self._clock()
            delay = self.machine.next_attempt_in(now, random.random())
            if self.machine.leading:
                delay = min(delay, self.machine.acting_for(now))
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(delay, 0.01))
            await self._report(self.machine.check(self._clock()))

    def _request_timeout(self) -> float:
        # The leader's requests end at its deadline: a hung renewal must not keep it acting.
        now = self._clock()
        if self.machine.leading:
            return max(0.05, self.machine.acting_for(now))
        return self.machine.timing.renew_deadline

    async def _attempt(self) -> None:
        try:
            record = None if self._reread or not self.machine.leading else self.machine.record
            if record is None:
                timeout = self._request_timeout()  # asyncio's timeouts are exact; aiohttp's are rounded up
                record = await asyncio.wait_for(self.store.read(timeout=timeout), timeout)
                self._last_contact = self._clock()
            write = self.machine.next_write(record, self._clock(), wall_now())
            if write is None:
                return
            sent = self._clock()
            timeout = self._request_timeout()
            stored = await asyncio.wait_for(self.store.create(write.record, timeout=timeout) if write.create
                                            else self.store.update(write.record, timeout=timeout), timeout)
            self._last_contact = self._clock()
            self._reread = False
            self.last_error = None
            await self._report(self.machine.written(write, stored, sent), stored.transitions)
        except REQUEST_FAILURES as e:
            self._reread = True
            if isinstance(e, Conflict):  # another candidate wrote first: the API answers
                self._last_contact = self._clock()
            self.last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            log.debug("leader election: %s", self.last_error)
            await self._report(self.machine.write_failed(self._clock()))

    async def _watch(self) -> None:
        """See each renewal as it happens, so a candidate's clock starts on time."""
        while True:
            try:
                async for record in self.store.watch():
                    self._last_contact = self._clock()
                    if record is not None and record.holder == self.identity:
                        continue  # our own renewal: the loop knows it (a late event could be an older one)
                    self.machine.observe(record, self._clock())
                    self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the loop's reads are the backstop: try again soon
                log.debug("leader election: lease watch ended: %s", e)
            await asyncio.sleep(self.machine.timing.retry_period)

    async def _report(self, change: Change | None, transitions: int | None = None) -> None:
        if change is None:
            return
        leading = change == "acquired"
        self.metrics.leader.set(1 if leading else 0)
        self.metrics.leader_transitions.labels(change).inc()
        if leading:
            self._leading.set()
            message = f"{self.identity} became leader"
            log.info("leader election: %s became leader of Lease %s (transitions: %s)", self.identity,
                     self.lease, transitions)
        else:
            self._leading.clear()
            why = "released the lease" if change == "released" else \
                f"stopped leading: no renewal within {self.machine.timing.renew_deadline:g}s " \
                f"({self.last_error or 'no answer'})"
            message = f"{self.identity} {why}"
            log.warning("leader election: %s (Lease %s)", message, self.lease)
        if self.on_change is not None:
            try:
                result = self.on_change(leading)
                if result is not None:
                    await result
            except Exception:
                log.exception("leader election: reacting to the change crashed")
        # Best effort: a partitioned replica cannot record its own loss (the successor's Event shows it).
        post = self.kube.event(self.store.involved, reason="LeaderElection", message=message,
                               type_="Normal" if change != "lost" else "Warning", component=COMPONENT)
        try:
            await asyncio.wait_for(post, self.machine.timing.retry_period)
        except REQUEST_FAILURES as e:
            log.info("leader election: could not record the event (%s): %s", message, e)

    async def stop(self) -> None:
        """Stop acting, then hand the Lease over so a candidate takes it at once."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        was_leading = self.machine.leading
        record = self.machine.release(wall_now())
        if was_leading:
            await self._report("released")
        if record is not None:
            try:
                if await self._release(record):
                    log.info("leader election: %s released Lease %s", self.identity, self.lease)
            except REQUEST_FAILURES as e:
                log.warning("leader election: could not release Lease %s: %s", self.lease, e)
        await self.kube.close()

    async def _release(self, record: LeaseRecord) -> bool:
        """Write the released ``record``; False when the Lease turned out not to be ours any more."""
        timeout = self.machine.timing.retry_period
        try:
            await self.store.update(record, timeout=timeout)
            return True
        except Conflict:
            # A renewal that the stop cancelled in flight can have been stored all the same: the Lease is
            # still ours, at a newer resourceVersion than the one held here. Release that version.
            fresh = await self.store.read(timeout=timeout)
            if fresh is None or fresh.holder != self.identity:
                return False
            self.machine.observe(fresh, self._clock())
            again = self.machine.release(wall_now())
            assert again is not None  # the record just read names this replica
            await self.store.update(again, timeout=timeout)
            return True
