"""Dispatch: concurrency cap, queue order, queue timeouts, KV refusals."""
from __future__ import annotations

import asyncio

import pytest

from gpufleet_engine.admission import KvLedger, KvSnapshot
from gpufleet_engine.contract.guard_config import QueueClass
from gpufleet_engine.queues import MultiLevelQueue
from gpufleet_engine.scheduler import Rejection, Scheduler
from tests.support.waiting import wait_for

L1 = QueueClass("interactive", 1, 2.0)
L2 = QueueClass("standard", 2, 10.0)
L3 = QueueClass("background", 3, 0.3)


def scheduler(max_concurrency: int = 1, blocks: int = 64, max_length: int = 10) -> Scheduler:
    ledger = KvLedger(15)
    ledger.observe(KvSnapshot(blocks, 0))
    return Scheduler(ledger, MultiLevelQueue([L1, L2, L3], 5.0, max_length), max_concurrency, 1.0)


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
