"""Dispatch: concurrency cap, queue order, queue timeouts, KV refusals."""
from __future__ import annotations

import asyncio

import pytest

from gpufleet_engine.admission.kv_ledger import KvLedger, KvSnapshot
from gpufleet_engine.admission.queues import MultiLevelQueue
from gpufleet_engine.admission.scheduler import Rejection, Scheduler
from gpufleet_engine.contract.guard_config import QueueClass
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


async def closed_loop_clients(s: Scheduler, cls: QueueClass, cost: int, hold: float, clients: int,
                              stop: asyncio.Event, admitted: list) -> None:
    """``clients`` clients of one class asking again and again, as refused clients retry."""
    async def client():
        while not stop.is_set():
            try:
                grant = await s.acquire(cost, cls)
            except Rejection:
                await asyncio.sleep(0.001)
                continue
            admitted.append((cls.name, asyncio.get_running_loop().time()))
            await asyncio.sleep(hold)
            s.release(grant)
    await asyncio.gather(*(client() for _ in range(clients)))


async def test_a_stream_of_small_background_requests_cannot_keep_a_big_interactive_one_out():
    s = scheduler(max_concurrency=64, blocks=64, classes=(L1, L2, L3_PATIENT))
    stop = asyncio.Event()
    admitted: list = []
    stream = asyncio.create_task(closed_loop_clients(s, L3_PATIENT, 5, 0.02, 12, stop, admitted))
    await wait_for(lambda: s.ledger.reserved_blocks >= 45, timeout=2, interval=0.001, what="the pool full")
    started = asyncio.get_running_loop().time()
    grant = await s.acquire(40, L1)                      # 40 of the 54 admissible blocks
    waited = asyncio.get_running_loop().time() - started
    s.release(grant)
    stop.set()
    await stream
    # Bounded by the background requests already running (20 ms each), not by luck.
    assert waited < 0.5 and grant.queued_seconds < 0.5


async def test_no_class_starves_when_a_higher_one_keeps_the_pool_full():
    # Interactive clients ask again the moment they finish, so on their own
    # they would take every block that frees. A background class refused for
    # agingSeconds without an admission starts waiting, aged from its first
    # refusal, and gets in within (level - 1) x agingSeconds plus a request.
    aging = 0.05
    s = scheduler(max_concurrency=64, blocks=64, aging=aging, classes=(L1, L2, L3_PATIENT))
    stop = asyncio.Event()
    admitted: list = []
    tasks = [asyncio.create_task(closed_loop_clients(s, L1, 6, 0.01, 12, stop, admitted)),
             asyncio.create_task(closed_loop_clients(s, L3_PATIENT, 6, 0.01, 2, stop, admitted))]
    started = asyncio.get_running_loop().time()
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*tasks)
    times = {name: [t - started for n, t in admitted if n == name] for name in ("interactive", "background")}
    assert len(times["interactive"]) > 50 and len(times["background"]) >= 5, {k: len(v) for k, v in times.items()}
    gaps = [b - a for a, b in zip([0.0, *times["background"]], times["background"], strict=False)]
    assert max(gaps) < 2 * aging + 0.1, gaps          # (3 - 1) x aging, plus one running request
    assert s.running == 0 and s.ledger.reserved_blocks == 0


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
