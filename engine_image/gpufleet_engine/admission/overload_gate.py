"""The scheduler's overload gate and TTFT control: whether the replica is overloaded, the
dispatch limit the TTFT control (``ttft_limit.py``) holds while it is, the start bound, and the
429 for a request that would start later than the objective leaves (scheduler.py has the whole
story)."""
from __future__ import annotations

import logging
import math
from typing import Callable

from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_api.guard.guard_metrics import Reason
from gpufleet_engine.admission.grants import Grant, Rejection
from gpufleet_engine.admission.kv_ledger import KvLedger
from gpufleet_engine.admission.queues import MultiLevelQueue
from gpufleet_engine.admission.ttft_limit import TtftLimit

log = logging.getLogger("gpufleet_engine.admission.scheduler")

# The TTFT control keeps acting this long after the replica was last seen overloaded.
OVERLOAD_HOLD_SECONDS = 10.0


class OverloadGate:
    """The part of ``Scheduler`` that judges overload and the TTFT control; its state is the
    scheduler's (set in ``Scheduler.__init__``)."""
    ledger: KvLedger
    queue: MultiLevelQueue
    ttft: TtftLimit | None
    max_concurrency: int
    retry_after: float
    running: int
    starting: int
    starting_tokens: int
    _crowd: Callable[[], float]
    _arriving: Callable[[], int]
    _overloaded_at: float | None
    _acting: bool
    _clock: Callable[[], float]


    def overloaded(self) -> bool:
        """Whether more is asked of this replica than its KV pool holds at once: where vLLM alone
        would preempt, and some of it must be refused whatever the guard does.

        What the requests in flight hold is vLLM's own view (its last read,
        corrected for what the guard admitted and finished since). Asking are
        the requests queued in the guard, the clients cycling through refusals
        (retry_hint's crowd: those whose Retry-After has not run out) and the
        requests read but not parsed yet (parse_lane.py), each at the lesser
        of what a request in flight held on average over the last reads (the
        ledger's ``held_per_request``, seeded from the service on a new
        replica) and what the running requests hold each now. The replica is overloaded when
        all of it passes the pool less the watermark by more than the
        ledger's margin.
        Not the reservations: they are what each answer may grow to, and
        answers end at different times, so they sum to more than vLLM ever
        holds at once. On the realistic benchmark, at the most clients
        vLLM alone served without preempting, the reservations in flight
        filled the pool while vLLM held 40–70% of it; a gate on reservations
        opened there, at every second client refused by the watermark.
        Refusals by the TTFT control keep their clients in the crowd, so they
        hold the gate open only while those clients would overfill the pool
        anyway: at a load the pool holds, the gate closes however many
        requests the control refused."""
        if not self.ledger.known or self.running == 0:
            return False
        asking = len(self.queue) + self._crowd() + self._arriving()
        if asking < 1:
            return False  # a full pool with no one waiting is a pool well used
        held = self.ledger.held_blocks()
        # Each asking request at the lesser of what a request in flight held over the recent reads
        # and what the running ones hold now: the average outlives the traffic that made it (a
        # surge's long answers, then a burst of short ones after a lull), and the few requests of
        # a burst's first instant say little (long prompts first); under a real overload the two
        # agree.
        now_each = held / self.running
        average = self.ledger.held_per_request
        each = now_each if average is None else min(average, now_each)
        usable = self.ledger.capacity - self.ledger.watermark
        return held + asking * each > usable + self.ledger.margin()

    def _control_acts(self) -> bool:
        """Whether the TTFT control holds the limit now: only while the replica is overloaded, and
        for ``OVERLOAD_HOLD_SECONDS`` after. Below that, the guard admits what vLLM alone would
        serve, as fast as it would (the control only learns). The hold bridges the moments after
        the control cuts the limit: the requests it stops running leave the pool at once, but
        their clients join the crowd only as they come back and are refused."""
        if self.ttft is None:
            return False
        now = self._clock()
        self.ttft.recover(now)  # what an overload taught it fades with time (ttft_limit.py)
        if self.overloaded():
            if not self._acting:
                log.info("overloaded: the TTFT control acts (limit %d): %d blocks held by %d requests in "
                         "flight, %d queued, %d read and not parsed yet, %.0f clients waiting to retry; "
                         "%d usable blocks, margin %d", self.ttft.limit,
                         self.ledger.held_blocks(),
                         self.running, len(self.queue), self._arriving(), self._crowd(),
                         self.ledger.capacity - self.ledger.watermark, self.ledger.margin())
            self._overloaded_at = now
        # A replica with nothing running is not overloaded whatever happened before: what fits
        # is admitted (the hold bridges a cut limit's first moments, not an idle pool).
        acting = (self.running > 0 and self._overloaded_at is not None
                  and now - self._overloaded_at < OVERLOAD_HOLD_SECONDS)
        if self._acting and not acting:
            log.info("no longer overloaded: the TTFT control stops acting (learned limit %d)", self.ttft.limit)
        self._acting = acting
        return acting

    @property
    def limit(self) -> int:
        """Requests that may run in vLLM now: max_concurrency, or less under the TTFT control."""
        if self.ttft is None or not self._control_acts():
            return self.max_concurrency
        return min(self.max_concurrency, self.ttft.limit)

    def _started(self, grant: Grant) -> bool:
        """``grant`` is no longer starting (its first token came, or it ended); True if it was."""
        if not grant.start_tokens:
            return False
        self.starting -= 1
        self.starting_tokens -= grant.start_tokens
        grant.start_tokens = 0
        return True

    def _may_start(self, prompt_tokens: int) -> bool:
        """Whether a request of ``prompt_tokens`` may start now. However many the pool and
        max_concurrency allow, the streamed requests starting at once (dispatched, first token
        not back) hold no more prompt tokens than the engine prefills in the TTFT objective's
        engine share (``TtftLimit.start_budget`` under the control, ``loose_start_budget`` below
        overload); one may always start. A burst of arrivals (a
        batch job, a failover) would otherwise prefill together, and every one of them would
        start late. At a steady load few requests start at once and this rarely holds one back,
        and not for long; in an overload's first moment it is what shows it, as a queue."""
        if self.ttft is None or self.starting == 0:
            return True
        budget = self.ttft.start_budget if self._control_acts() else self.ttft.loose_start_budget
        return self.starting_tokens + prompt_tokens <= budget

    def _ahead(self, queue_class: QueueClass, tenant: str) -> int:
        return self.queue.ahead(queue_class, tenant)

    def _held_by_control(self, waits_with_a_slot_free: bool) -> bool:
        """Whether what keeps a request from starting is the TTFT control: its limit, below
        max_concurrency, or (a slot being free) its start bound or the queue ahead, which the
        start bound holds. At max_concurrency itself requests queue as their class allows, as
        without the control."""
        if self.running >= self.limit:
            return self.limit < self.max_concurrency
        return waits_with_a_slot_free

    def _ttft_rejection(self, queue_class: QueueClass, tenant: str, *, known_size: bool = False) -> Rejection | None:
        """The 429 for a request that would wait longer than the TTFT objective leaves, while the
        control acts (the replica is overloaded) and is what holds it. ``known_size``: the
        request was found unable to start now (else it is judged before its size is known, by
        the slots taken and the queue ahead: of its own class, its tenant's fair position)."""
        if self.ttft is None or not self._control_acts():
            return None
        level = queue_class.level
        ahead = self._ahead(queue_class, tenant)
        if not self._held_by_control(known_size or ahead > 0):
            return None
        # The queued prompt tokens matter only when the start bound holds (a slot free).
        tokens = self._queued_start_tokens(level) if self.running < self.limit else 0
        wait = self._predicted_wait(ahead, tokens)
        if wait <= self.ttft.wait_budget:
            return None
        return self._ttft_refusal(wait)

    def _predicted_wait(self, ahead: int, start_tokens_ahead: int) -> float:
        """Seconds until a request with ``ahead`` queued before it (streaming
        ``start_tokens_ahead`` prompt tokens) could start: with every slot taken, at the pace
        slots free; with a slot free, what holds it is the start bound, and it waits for the
        requests starting (and those ahead) to get their first tokens: as long as their
        prefill takes, and at least the engine's share of the objective, which the start
        bound fills. That is more than the queue's share: under the control, a request the
        start bound holds is refused, not queued."""
        assert self.ttft is not None
        if self.running >= self.limit:
            return self.ttft.predicted_wait(ahead)
        return max(self.ttft.engine_target, self.ttft.prefill_seconds(self.starting_tokens + start_tokens_ahead))

    def _queued_start_tokens(self, level: int) -> int:
        return sum(e.item.start_tokens for e in self.queue.entries() if e.queue_class.level <= level)

    def _ttft_refusal(self, wait: float) -> Rejection:
        assert self.ttft is not None
        predicted = "no slot has freed yet" if math.isinf(wait) else f"the wait to start would be {wait:.2f}s"
        return Rejection(
            Reason.TTFT_LIMIT, 429,
            f"The engine runs {self.running} requests ({self.starting} of them not started yet), as many as "
            f"start within the time-to-first-token objective ({self.ttft.objective_seconds:g}s), and "
            f"{predicted}, more than the "
            f"{self.ttft.wait_budget:.2f}s the objective leaves. Retry later.",
            self.retry_after if math.isinf(wait) else max(self.retry_after, wait))

    def _classes_at_or_above(self, level: int) -> list[QueueClass]:
        return [c for c in self.queue.classes if c.level <= level]
