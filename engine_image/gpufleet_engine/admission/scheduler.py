"""Admission and dispatch: who goes to vLLM now, who waits, who is told to come back.

A request that does not fit the KV pool now is refused at once (waiting
would only add queue time to a request that still may not fit, and the
client can retry elsewhere) — except where priority is at stake: when
requests of a lower-priority class (a higher level) hold the blocks it
lacks, and it is big (more than twice the mean reservation running, so more
than one completion must free blocks for it), it waits for them, at most its
class's ``maxQueueSeconds``, and nothing of its level or lower is admitted
ahead of it meanwhile. A stream of small background requests therefore
cannot keep a large interactive one out by grabbing every block that frees;
the background requests it waits for are already running and finish. Only
the first such request of a level waits (the others of that level get 429 at
once), so the queue stays short.

The lowest class has no one below it, so the same rule could leave it
refused forever while higher classes keep the pool full. A class refused for
``agingSeconds`` without one admission is starving: its next request may wait
for blocks that any running request holds, and it enters the queue as if it
had waited since the class's first refusal, so aging promotes it past the
newcomers of higher classes within (level − 1) × agingSeconds.

A request that fits takes a dispatch slot — at most ``max_concurrency``
requests talk to vLLM, fewer while the TTFT control (``ttft_limit.py``) finds
that more would start too late — or waits in the multi-level queue for one, at most
its class's ``maxQueueSeconds``. The queue is served best effective level
first (aging promotes waiting requests, so no class starves), and its head
is never overtaken: when the head waits for blocks, the requests behind it
wait too. The KV check is repeated at dispatch because the pool may have
filled while a request waited. Under the TTFT control a request waits for a
slot only as long as the objective leaves room for: when the wait predicted
from the queue ahead of it and the pace at which slots free is longer, it
gets 429 at once; and a request the start bound holds (a slot free, but the
requests starting already hold the prompt tokens the engine starts in time)
gets 429 too, since it would wait about the engine's share of the objective.

Inside a class the queue shares fairly between tenants (queues.py): the
scheduler charges a request's tenant its prompt tokens when it is dispatched
(or, sent ahead of its parse, when the parse settles it), and its answer
tokens as the exchange counts them (``charge_answer``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_api.guard.guard_metrics import Reason
from gpufleet_api.tenants.declaration import UNKNOWN_TENANT
from gpufleet_engine.admission.grants import Grant, Rejection
from gpufleet_engine.admission.kv_ledger import Decision, KvLedger
from gpufleet_engine.admission.overload_gate import OVERLOAD_HOLD_SECONDS, OverloadGate
from gpufleet_engine.admission.queues import Entry, MultiLevelQueue, QueueFull
from gpufleet_engine.admission.ttft_limit import TtftLimit

log = logging.getLogger("gpufleet_engine.admission.scheduler")

# A request waits for blocks held by lower classes only when it needs more than
# this many times the mean reservation of the running requests.
BIG_REQUEST_FACTOR = 2

__all__ = ["OVERLOAD_HOLD_SECONDS", "Grant", "Rejection", "Scheduler"]


@dataclass(eq=False)
class _Waiter:
    cost: int
    variance: float
    start_tokens: int
    future: asyncio.Future
    tenant: str
    prompt_tokens: int
    arrived: float = 0.0   # when this request came (its queue entry may count from its class's first refusal)


class Scheduler(OverloadGate):
    def __init__(self, ledger: KvLedger, queue: MultiLevelQueue[_Waiter], max_concurrency: int,
                 retry_after_seconds: float, clock: Callable[[], float] = time.monotonic,
                 aging_seconds: float = 5.0,
                 ttft: TtftLimit | None = None, crowd: Callable[[], float] | None = None,
                 arriving: Callable[[], int] | None = None):
        self.ledger = ledger
        self.ttft = ttft
        # Clients cycling through refusals, waiting to retry (retry_hint.RetryAdvisor.crowd).
        self._crowd = crowd or (lambda: 0.0)
        # Requests read and waiting to be parsed (parse_lane.ParseLane.waiting).
        self._arriving = arriving or (lambda: 0)
        self._overloaded_at: float | None = None
        self._acting = False
        self.queue = queue
        self.max_concurrency = max_concurrency
        self.retry_after = retry_after_seconds
        self._clock = clock
        self.running = 0
        # Streamed requests dispatched whose first token has not come back yet, and their prompt tokens.
        self.starting = 0
        self.starting_tokens = 0
        self._held_by_level: dict[int, int] = {}  # blocks reserved by running requests, by class level
        self.aging_seconds = aging_seconds
        # Per class: when its refusals began, if none of its requests was admitted since.
        self._refused_since: dict[str, float] = {}
        self._start_held = False

    def first_token(self, grant: Grant, now: float, prompt_tokens: int) -> None:
        """A streamed request's first chunk arrived: a sample for the TTFT control, and one
        request fewer starting."""
        started = self._started(grant)
        if self.ttft is not None:
            if started:
                self.ttft.started(now - grant.dispatched_at, grant.start_set_tokens)
            before = self.ttft.limit
            self.ttft.observe(now - grant.dispatched_at, prompt_tokens, grant.running_at_dispatch,
                              acting=self._control_acts(), now=now)
            if started or self.ttft.limit > before:
                self.dispatch()

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

    def _may_wait_for_blocks(self, d: Decision, level: int, *, queued: bool = False,
                             starving: bool = False) -> bool:
        """Whether running requests of lower priority (a level above ``level``; any level when the
        class is starving) hold the blocks ``d`` lacks. A newcomer also needs the queue free of
        requests of its level or better: they go first, and it would only stand in line for the
        same blocks."""
        if not queued and any(self.queue.depth(c.name) for c in self._classes_at_or_above(level)):
            return False
        if not starving and not self._big(d.cost):
            return False
        room = min(d.unreserved_blocks, d.free_blocks - d.watermark)
        lacking = d.cost - room
        lower = sum(blocks for lvl, blocks in self._held_by_level.items() if lvl > level or starving)
        return 0 < lacking <= lower and d.cost <= self.ledger.capacity

    def _big(self, cost: int) -> bool:
        """Larger than twice the mean reservation running: more than one request's completion
        frees. Smaller requests get in on a retry, and a wait would only add to their TTFT."""
        held = sum(self._held_by_level.values())
        return self.running > 0 and cost * self.running > BIG_REQUEST_FACTOR * held

    def _starving(self, queue_class: QueueClass, now: float) -> bool:
        since = self._refused_since.get(queue_class.name)
        return since is not None and now - since >= self.aging_seconds

    def early_refusal(self, queue_class: QueueClass, waited: float = 0.0,
                      tenant: str = UNKNOWN_TENANT) -> Rejection | None:
        """The 429 for a request of ``queue_class`` when not even one block could be admitted and
        waiting could not help, or the TTFT control would refuse it whatever its size, so the
        caller can refuse before parsing the body; else None. ``waited``: seconds it already
        waited in the guard (in line to be parsed): under the control, past the objective's
        queue share it is refused, as it would be in the queue."""
        now = self._clock()
        if self.ttft is not None and waited > self.ttft.wait_budget and self._control_acts():
            return self._ttft_refusal(waited)
        slow = self._ttft_rejection(queue_class, tenant)
        if slow is not None:
            return slow
        d = self.ledger.evaluate(1)
        if d.admitted or self._starving(queue_class, now):
            return None
        if any(blocks > 0 for lvl, blocks in self._held_by_level.items() if lvl > queue_class.level):
            return None
        self._refused_since.setdefault(queue_class.name, now)
        return self._kv_rejection(d)

    def _grant(self, cost: int, variance: float, start_tokens: int, queue_class: QueueClass,
               queued_seconds: float, tenant: str, prompt_tokens: int) -> Grant:
        grant = Grant(cost, queue_class, queued_seconds, self._clock(), self.running + 1, start_tokens,
                      tenant=tenant)
        if prompt_tokens:
            self.queue.charge(queue_class.name, tenant, prompt_tokens=prompt_tokens)
        if start_tokens:
            self.starting += 1
            self.starting_tokens += start_tokens
            grant.start_set_tokens = self.starting_tokens
        self.ledger.try_admit(grant, cost, variance)  # evaluated just before, nothing ran in between
        self.running += 1
        level = queue_class.level
        self._held_by_level[level] = self._held_by_level.get(level, 0) + cost
        self._refused_since.pop(queue_class.name, None)
        return grant

    def extend(self, grant: Grant, blocks: int, variance: float | None = None) -> None:
        """A running request's answer outgrew its reservation by ``blocks``; ``variance``: around
        the new reservation."""
        self.ledger.extend(grant, blocks, variance)
        if blocks <= 0:
            return
        grant.cost += blocks
        level = grant.queue_class.level
        self._held_by_level[level] = self._held_by_level.get(level, 0) + blocks

    def charge_answer(self, grant: Grant, tokens: int) -> None:
        """``tokens`` more of ``grant``'s answer were counted: service its tenant received."""
        self.queue.charge(grant.queue_class.name, grant.tenant, answer_tokens=tokens)

    def grant_ahead(self, bound: int, queue_class: QueueClass, bound_start_tokens: int,
                    tenant: str = UNKNOWN_TENANT) -> Grant | None:
        """A grant of ``bound`` blocks at once, for a request not parsed yet whose cost and prompt
        tokens are at most ``bound`` and ``bound_start_tokens`` (``Guard._send_ahead``), or None.
        Only on a replica far from full: nothing queued, a slot free, no TTFT control acting, and
        room for another request of ``bound`` after it, so that holding the bound for the moment
        the parse takes refuses no one who would have fitted. ``settle`` gives it its real size."""
        if (len(self.queue) or self.running >= self.limit or self._control_acts()
                or not self._may_start(bound_start_tokens)
                or not self.ledger.evaluate(2 * bound).admitted):
            return None
        self.queue.passed(queue_class.name, tenant)
        return self._grant(bound, 0.0, 0, queue_class, 0.0, tenant, 0)

    def settle(self, grant: Grant, cost: int, variance: float, start_tokens: int, prompt_tokens: int = 0) -> bool:
        """``grant`` (from ``grant_ahead``) measured: ``cost`` blocks, ``variance`` around them,
        ``start_tokens`` and ``prompt_tokens`` as ``acquire`` takes them. False, and nothing changed,
        when it needs more than it holds and the pool has no room for the rest: release it and admit
        it anew."""
        extra = cost - grant.cost
        if extra > 0 and not self.ledger.evaluate(extra, variance).admitted:
            return False
        self.ledger.resize(grant, cost, variance)
        level = grant.queue_class.level
        self._held_by_level[level] = self._held_by_level.get(level, 0) + extra
        grant.cost = cost
        if prompt_tokens:
            self.queue.charge(grant.queue_class.name, grant.tenant, prompt_tokens=prompt_tokens)
        if start_tokens:
            self.starting += 1
            self.starting_tokens += start_tokens
            grant.start_tokens = start_tokens
            grant.start_set_tokens = self.starting_tokens
        if extra < 0 and len(self.queue):
            self.dispatch()  # what the bound held beyond its real size may let a queued request in
        return True

    async def acquire(self, cost: int, queue_class: QueueClass, variance: float = 0.0,
                      start_tokens: int = 0, tenant: str = UNKNOWN_TENANT, prompt_tokens: int = 0) -> Grant:
        """A grant for a request of ``cost`` blocks (``variance`` blocks² around them);
        ``start_tokens``: its prompt tokens, if it streams (its first token will be reported,
        ``first_token``); 0 if it does not. ``tenant``: its key in its class's fair lane, charged
        ``prompt_tokens`` when it is dispatched."""
        arrived = self._clock()
        decision = self.ledger.evaluate(cost, variance)
        starving = self._starving(queue_class, arrived)
        if not decision.admitted and not self._may_wait_for_blocks(decision, queue_class.level,
                                                                  starving=starving):
            self._refused_since.setdefault(queue_class.name, arrived)
            raise self._kv_rejection(decision)
        if (decision.admitted and self.running < self.limit and self._may_start(start_tokens)
                and len(self.queue) == 0):
            self.queue.passed(queue_class.name, tenant)
            return self._grant(cost, variance, start_tokens, queue_class, 0.0, tenant, prompt_tokens)
        if decision.admitted:
            slow = self._ttft_rejection(queue_class, tenant, known_size=True)
            if slow is not None:
                raise slow
        if starving:
            # Aging counts from the class's first refusal: it has waited that long, in retries.
            arrived = self._refused_since[queue_class.name]

        waiter = _Waiter(cost, variance, start_tokens, asyncio.get_running_loop().create_future(), tenant,
                         prompt_tokens, self._clock())
        try:
            entry = self.queue.push(waiter, queue_class.name, arrived, tenant)
        except QueueFull as e:
            raise Rejection(Reason.QUEUE_FULL, 429, f"The guard's queue is full ({e}). Retry later.",
                            self.retry_after) from None
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), queue_class.max_queue_seconds)
        except asyncio.TimeoutError:
            if self._abandon(entry):
                raise Rejection(
                    Reason.QUEUE_TIMEOUT, 429,
                    f"The request waited {queue_class.max_queue_seconds:g}s, the most class "
                    f"{queue_class.name!r} may wait for a free slot or KV blocks. Retry later.",
                    self.retry_after) from None
            return waiter.future.result()  # dispatched in the same instant it timed out
        except asyncio.CancelledError:
            if not self._abandon(entry) and waiter.future.done() and not waiter.future.exception():
                self.release(waiter.future.result())
            raise

    def _abandon(self, entry: Entry[_Waiter]) -> bool:
        removed = self.queue.remove(entry)
        if removed:
            self.dispatch()  # a head that gave up no longer holds back the requests behind it
        return removed

    def release(self, grant: Grant) -> None:
        if self.ttft is not None:
            self.ttft.released(self._clock(), busy=self.running >= self.limit or len(self.queue) > 0)
        self.ledger.release(grant)
        self.running -= 1
        self._started(grant)
        level = grant.queue_class.level
        self._held_by_level[level] = self._held_by_level.get(level, 0) - grant.cost
        self.dispatch()

    def dispatch(self) -> None:
        """Hand free slots and blocks to queued requests, best effective level first.

        The head of the queue is never overtaken: when it lacks blocks that
        lower-priority running requests hold, it keeps its place and everything
        behind it waits for the next release; when waiting cannot help, it is
        refused and the next one is tried."""
        self._start_held = False  # whether the start bound holds the head of the queue
        while self.running < self.limit:
            now = self._clock()
            entry = self.queue.peek(now)
            if entry is None:
                break
            waiter = entry.item
            if waiter.future.done():
                self.queue.pop(now)
                continue
            decision = self.ledger.evaluate(waiter.cost, waiter.variance)
            if not decision.admitted:
                if self._may_wait_for_blocks(decision, self.queue.effective_level(entry, now), queued=True,
                                             starving=self._starving(entry.queue_class, now)):
                    break  # the blocks it lacks are held by requests that finish
                self.queue.pop(now)
                self._refused_since.setdefault(entry.queue_class.name, now)
                waiter.future.set_exception(self._kv_rejection(decision))
                continue
            if not self._may_start(waiter.start_tokens):
                self._start_held = True
                break  # a request starting returns its first token soon: the head waits for it
            self.queue.pop(now)
            # The wait reported (the queue histogram, the admission span) is this request's own: its entry's
            # age counts from its class's first refusal when aging promoted it.
            waiter.future.set_result(self._grant(waiter.cost, waiter.variance, waiter.start_tokens,
                                                 entry.queue_class, now - waiter.arrived, waiter.tenant,
                                                 waiter.prompt_tokens))
        self._shed_late()

    def _shed_late(self) -> None:
        """Under the TTFT control, refuse the queued requests that would wait longer than the
        objective leaves (the newcomers are refused on arrival; these were queued before the
        control acted, e.g. in a burst's first moment)."""
        if (self.ttft is None or len(self.queue) == 0 or not self._control_acts()
                or not self._held_by_control(self._start_held)):
            return
        now = self._clock()
        kept = kept_tokens = 0
        for entry in self.queue.ordered(now, lambda waiter: waiter.prompt_tokens):
            wait = self._predicted_wait(kept, kept_tokens)
            if wait <= self.ttft.wait_budget:
                kept += 1
                kept_tokens += entry.item.start_tokens
                continue
            self.queue.remove(entry)
            if not entry.item.future.done():
                entry.item.future.set_exception(self._ttft_refusal(wait))
