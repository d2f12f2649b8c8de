"""Dispatch: concurrency cap, queue order, queue timeouts, KV refusals."""
from __future__ import annotations

import asyncio
from typing import Callable

import pytest

from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_engine.admission.kv_ledger import KvLedger, KvSnapshot
from gpufleet_engine.admission.queues import MultiLevelQueue
from gpufleet_engine.admission.scheduler import Rejection, Scheduler
from tests.support.waiting import wait_for

L1 = QueueClass("interactive", 1, 2.0)
L2 = QueueClass("standard", 2, 10.0)
L3 = QueueClass("background", 3, 0.3)


def scheduler(max_concurrency: int = 1, blocks: int = 64, max_length: int = 10, aging: float = 5.0,
              classes=(L1, L2, L3)) -> Scheduler:
    ledger = KvLedger(15)
    ledger.observe(KvSnapshot(blocks, 0))
    return Scheduler(ledger, MultiLevelQueue(classes, aging, max_length), max_concurrency, 1.0,
                     aging_seconds=aging)


async def queued(s: Scheduler, n: int) -> None:
    """Until ``n`` requests wait in the queue (their tasks ran up to the point of waiting)."""
    await wait_for(lambda: len(s.queue) == n, timeout=2, interval=0, what=f"{n} requests queued")


async def test_within_the_cap_requests_go_straight_through():
    s = scheduler(max_concurrency=2)
    a = await s.acquire(5, L2)
    b = await s.acquire(5, L2)
    assert s.running == 2 and a.queued_seconds == 0 and b.queued_seconds == 0


async def test_queued_interactive_requests_overtake_queued_background_ones():
    s = scheduler(max_concurrency=1)
    first = await s.acquire(1, L2)
    order = []

    async def ask(name, cls):
        grant = await s.acquire(1, cls)
        order.append(name)
        s.release(grant)

    bg = asyncio.create_task(ask("background", QueueClass("background", 3, 5.0)))
    await queued(s, 1)
    fg = asyncio.create_task(ask("interactive", L1))
    await queued(s, 2)
    s.release(first)
    await asyncio.gather(bg, fg)
    assert order == ["interactive", "background"]


async def test_a_request_waiting_past_its_class_limit_gets_429_with_retry_after():
    s = scheduler(max_concurrency=1)
    await s.acquire(1, L2)
    with pytest.raises(Rejection) as e:
        await s.acquire(1, L3)                   # background may wait 0.3 s: the wait is the behaviour
    assert e.value.reason == "queue_timeout" and e.value.status == 429 and e.value.retry_after == 1.0
    assert len(s.queue) == 0


async def test_a_full_queue_refuses_at_once():
    s = scheduler(max_concurrency=1, max_length=1)
    await s.acquire(1, L2)
    waiting = asyncio.create_task(s.acquire(1, L2))
    await queued(s, 1)
    with pytest.raises(Rejection) as e:
        await s.acquire(1, L1)
    assert e.value.reason == "queue_full" and e.value.status == 429
    waiting.cancel()


async def test_kv_refusal_is_immediate_even_with_free_slots():
    s = scheduler(max_concurrency=8, blocks=64)
    for _ in range(5):
        await s.acquire(10, L2)
    with pytest.raises(Rejection) as e:
        await s.acquire(10, L2)                  # same class: waiting would not make room
    assert e.value.reason == "kv_watermark" and e.value.status == 429
    assert "needs 10 blocks, 14 are free and 10 are kept free" in e.value.message
    assert len(s.queue) == 0


async def test_kv_is_checked_again_when_a_queued_request_gets_its_slot():
    s = scheduler(max_concurrency=1, blocks=64)
    first = await s.acquire(10, L2)
    waiting = asyncio.create_task(s.acquire(30, L2))  # fits now (64-10-30 >= 10)
    await queued(s, 1)
    s.ledger.observe(KvSnapshot(64, 40))              # others filled the pool meanwhile
    s.release(first)
    with pytest.raises(Rejection) as e:
        await waiting
    assert e.value.reason == "kv_watermark"
    assert s.running == 0


async def test_a_client_that_gives_up_while_queued_leaves_no_trace():
    s = scheduler(max_concurrency=1)
    first = await s.acquire(1, L2)
    waiting = asyncio.create_task(s.acquire(1, L2))
    await queued(s, 1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(s.queue) == 0
    s.release(first)
    assert s.running == 0 and s.ledger.reserved_blocks == 0


async def test_release_hands_the_slot_and_blocks_back():
    s = scheduler(max_concurrency=1)
    g = await s.acquire(10, L2)
    s.release(g)
    assert s.running == 0 and s.ledger.reserved_blocks == 0


# --- priority for big requests ------------------------------------------------------------

async def test_a_request_lacking_blocks_that_lower_classes_hold_waits_for_them_and_goes_first():
    s = scheduler(max_concurrency=8, blocks=64)          # 10 kept free: 54 to admit into
    background = [await s.acquire(10, L3) for _ in range(5)]
    big = asyncio.create_task(s.acquire(30, L1))         # lacks 26 blocks; background holds 50
    await queued(s, 1)
    small = asyncio.create_task(s.acquire(2, L3))        # fits, but may not overtake the waiting request
    await queued(s, 2)
    for g in background[:2]:
        s.release(g)
    assert not big.done() and not small.done()           # 24 to admit into: the small one would fit, but waits
    s.release(background[2])
    assert (await big).queue_class is L1 and (await small).queue_class is L3


async def test_a_request_no_bigger_than_those_running_is_told_to_retry_instead_of_waiting():
    s = scheduler(max_concurrency=8, blocks=64)
    for _ in range(5):
        await s.acquire(10, L3)
    with pytest.raises(Rejection) as e:
        await s.acquire(12, L1)              # under twice the mean of 10: one completion lets it in
    assert e.value.reason == "kv_watermark" and len(s.queue) == 0


async def test_only_the_first_request_of_a_level_waits_for_blocks_the_others_are_told_to_retry():
    s = scheduler(max_concurrency=8, blocks=64)
    for _ in range(5):
        await s.acquire(10, L3)
    waiting = asyncio.create_task(s.acquire(30, L1))
    await queued(s, 1)
    with pytest.raises(Rejection) as e:
        await s.acquire(30, L1)
    assert e.value.reason == "kv_watermark" and len(s.queue) == 1
    waiting.cancel()


async def test_waiting_for_blocks_is_bounded_by_the_class_limit():
    s = scheduler(max_concurrency=8, blocks=64)
    for _ in range(5):
        await s.acquire(10, L3)
    quick = QueueClass("interactive", 1, 0.05)
    with pytest.raises(Rejection) as e:
        await s.acquire(30, quick)
    assert e.value.reason == "queue_timeout" and len(s.queue) == 0


class Ticks:
    """A fake clock that the test moves on in ticks, and clients that wait for the next tick the
    way real ones wait out a hold or a retry delay: no wall-clock time in the scheduler's decisions,
    and each tick ends when every client is parked again (waiting for a tick or queued)."""

    def __init__(self, step: float):
        self.now = 0.0
        self.step = step
        self.number = 0
        self._next = asyncio.Event()
        self.parked: dict[int, int] = {}   # client -> the tick it waits past
        self.finished = 0                  # clients that stopped

    async def wait(self, client: int) -> None:
        self.parked[client] = self.number
        await self._next.wait()
        self.parked.pop(client, None)

    def settled(self, s: Scheduler, clients: int) -> bool:
        parked = sum(1 for n in self.parked.values() if n == self.number)
        return parked + len(s.queue) + self.finished == clients

    async def advance(self, s: Scheduler, clients: int, others: Callable[[], int] = lambda: 0) -> None:
        """The next tick; returns once each of ``clients`` (and ``others``, done) is parked again."""
        event, self._next = self._next, asyncio.Event()
        self.now += self.step
        self.number += 1
        event.set()
        await wait_for(lambda: self.settled(s, clients - others()), timeout=5, interval=0,
                       what=f"tick {self.number}: every client parked again")


def ticking_scheduler(ticks: Ticks, aging: float = 5.0) -> Scheduler:
    ledger = KvLedger(15)
    ledger.observe(KvSnapshot(64, 0))
    return Scheduler(ledger, MultiLevelQueue((L1, L2, L3_PATIENT), aging, 64), 64, 1.0,
                     clock=lambda: ticks.now, aging_seconds=aging)


async def closed_loop_clients(s: Scheduler, ticks: Ticks, first: int, cls: QueueClass, cost: int, clients: int,
                              stop: asyncio.Event, admitted: list, waits: list | None = None) -> None:
    """``clients`` clients of one class asking again and again: a refused client retries at the
    next tick, an admitted one holds its blocks for one tick. ``waits``: (the wait its grant reports, the
    time the request itself was in acquire) of each admission."""
    async def client(i: int):
        try:
            while not stop.is_set():
                asked = ticks.now
                try:
                    grant = await s.acquire(cost, cls)
                except Rejection:
                    await ticks.wait(i)
                    continue
                admitted.append((cls.name, ticks.now))
                if waits is not None:
                    waits.append((grant.queued_seconds, ticks.now - asked))
                await ticks.wait(i)
                s.release(grant)
        finally:
            ticks.finished += 1
    await asyncio.gather(*(client(first + i) for i in range(clients)))


async def test_a_stream_of_small_background_requests_cannot_keep_a_big_interactive_one_out():
    ticks = Ticks(0.02)
    s = ticking_scheduler(ticks)
    stop = asyncio.Event()
    admitted: list = []
    stream = asyncio.create_task(closed_loop_clients(s, ticks, 0, L3_PATIENT, 5, 12, stop, admitted))
    await wait_for(lambda: ticks.settled(s, 12), timeout=5, interval=0, what="twelve background clients")
    assert s.ledger.reserved_blocks >= 45                # the pool full
    big = asyncio.create_task(s.acquire(40, L1))       # 40 of the 54 admissible blocks
    await queued(s, 1)
    asked_at = ticks.now
    while not big.done():
        # The background requests already running end at the next tick; their clients retry at once.
        await ticks.advance(s, 13, others=lambda: 1 if big.done() else 0)
        assert ticks.number <= 2, "the big request waited past the requests running when it came"
    grant = await big
    s.release(grant)
    stop.set()
    while ticks.finished < 12:
        await ticks.advance(s, 12)
    await stream
    # Bounded by the background requests already running (one tick each), not by luck.
    assert grant.queued_seconds <= 2 * ticks.step and ticks.now - asked_at <= 2 * ticks.step


async def test_no_class_starves_when_a_higher_one_keeps_the_pool_full():
    # Interactive clients ask again the moment they finish, so on their own
    # they would take every block that frees. A background class refused for
    # agingSeconds without an admission starts waiting, aged from its first
    # refusal, and gets in within (level - 1) x agingSeconds plus a request.
    aging = 0.05
    ticks = Ticks(0.01)
    s = ticking_scheduler(ticks, aging=aging)
    stop = asyncio.Event()
    admitted: list = []
    background_waits: list = []
    tasks = [asyncio.create_task(closed_loop_clients(s, ticks, 0, L1, 6, 12, stop, admitted)),
             asyncio.create_task(closed_loop_clients(s, ticks, 12, L3_PATIENT, 6, 2, stop, admitted,
                                                     background_waits))]
    await wait_for(lambda: ticks.settled(s, 14), timeout=5, interval=0, what="fourteen clients")
    for _ in range(100):                                # a second of the fake clock
        await ticks.advance(s, 14)
    stop.set()
    while ticks.finished < 14:
        await ticks.advance(s, 14)
    await asyncio.gather(*tasks)
    times = {name: [t for n, t in admitted if n == name] for name in ("interactive", "background")}
    assert len(times["interactive"]) > 50 and len(times["background"]) >= 5, {k: len(v) for k, v in times.items()}
    gaps = [b - a for a, b in zip([0.0, *times["background"]], times["background"], strict=False)]
    assert max(gaps) < 2 * aging + 0.1, gaps          # (3 - 1) x aging, plus one running request
    assert s.running == 0 and s.ledger.reserved_blocks == 0
    # An aged request's queue entry counts from its class's first refusal; the wait its grant reports (the
    # queue histogram, the admission span) is its own, no longer than it was in acquire.
    queued = [w for w in background_waits if w[1] > 0]
    assert queued and all(reported <= own + 1e-9 for reported, own in queued), background_waits


L3_PATIENT = QueueClass("background", 3, 60.0)


def test_a_grant_ahead_only_where_the_pool_has_room_for_two_bounds_and_nobody_waits():
    s = scheduler(max_concurrency=4, blocks=100)      # capacity 99, watermark 15
    assert s.grant_ahead(50, L2, 1000) is None          # 2 × 50 does not fit
    grant = s.grant_ahead(32, L2, 1000)
    assert grant is not None and s.running == 1 and s.ledger.expected_blocks == 32
    assert s.grant_ahead(32, L2, 1000) is None          # 32 held + 64 > 99 - 15 free in vLLM's view


async def test_no_grant_ahead_while_anyone_is_queued_or_every_slot_is_taken():
    s = scheduler(max_concurrency=1, blocks=200)
    first = await s.acquire(1, L2)
    assert s.grant_ahead(8, L2, 100) is None            # no slot
    waiting = asyncio.create_task(s.acquire(1, L2))
    await queued(s, 1)
    s.max_concurrency = 2
    assert s.grant_ahead(8, L2, 100) is None            # someone in line goes first
    s.release(first)
    s.release(await waiting)


def test_settle_shrinks_to_the_real_cost_and_counts_a_streamed_start():
    s = scheduler(max_concurrency=4, blocks=200)
    grant = s.grant_ahead(32, L2, 1000)
    assert grant is not None
    assert s.settle(grant, 6, 0.0, start_tokens=40)
    assert grant.cost == 6 and s.ledger.expected_blocks == 6 and s._held_by_level[L2.level] == 6
    assert s.starting == 1 and s.starting_tokens == 40 and grant.start_tokens == 40
    s.release(grant)
    assert s.running == 0 and s.starting == 0 and s.ledger.expected_blocks == 0 and s._held_by_level[L2.level] == 0


def test_settle_grows_where_the_pool_has_room_and_refuses_where_it_has_not():
    s = scheduler(max_concurrency=4, blocks=200)     # capacity 199, watermark 30
    grant = s.grant_ahead(32, L2, 1000)
    assert grant is not None
    assert s.settle(grant, 58, 0.0, start_tokens=0)
    assert grant.cost == 58 and s.ledger.expected_blocks == 58
    other = s.grant_ahead(32, L2, 1000)
    assert other is not None
    assert not s.settle(other, 150, 0.0, start_tokens=0)   # 58 + 150 > 199: left as it was
    assert other.cost == 32 and s.ledger.expected_blocks == 90
    s.release(other)
    s.release(grant)
    assert s.ledger.expected_blocks == 0 and s.running == 0
