"""The multi-level queue with tenants: fair inside a class, levels and aging between classes."""
from __future__ import annotations

import random

from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_engine.admission.queues import MultiLevelQueue

CLASSES = [QueueClass("interactive", 1, 2), QueueClass("standard", 2, 10), QueueClass("background", 3, 60)]


def q(aging: float = 5) -> MultiLevelQueue:
    return MultiLevelQueue(CLASSES, aging, 1000)


def drain(queue: MultiLevelQueue, now: float, prompt_tokens: int = 10) -> list:
    out = []
    while (e := queue.pop(now)) is not None:
        out.append(e.item)
        tenant = e.item[0]
        queue.charge(e.queue_class.name, tenant, prompt_tokens=prompt_tokens)
    return out


def test_inside_a_class_tenants_take_turns_whatever_their_arrival_order():
    queue = q()
    for i in range(4):
        queue.push(f"a{i}", "standard", 0.0, "a")
    for i in range(2):
        queue.push(f"b{i}", "standard", 0.1, "b")
    assert drain(queue, 1.0) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_a_class_competes_with_its_oldest_entry_and_offers_its_fair_head():
    queue = q(aging=5)
    queue.push("a0", "background", 0.0, "a")
    queue.push("a1", "background", 0.0, "a")
    queue.push("b1", "background", 6.5, "b")
    assert drain_one(queue, 6.6) == "a0"          # a charged: b's entry is the background head now
    queue.push("int", "interactive", 10.5, "c")
    # At t=11, a1 (11 s waiting) has aged to level 1 and is older than the interactive entry: the
    # background class goes first, with its fair head b1 (4.5 s waiting, level 3 on its own).
    assert queue.peek(11.0).item == "b1"
    assert drain(queue, 11.0) == ["b1", "a1", "int"]


def drain_one(queue: MultiLevelQueue, now: float) -> str:
    e = queue.pop(now)
    queue.charge(e.queue_class.name, e.item[0], prompt_tokens=100)
    return e.item


def test_ordered_is_the_order_pop_takes_with_tenants_classes_and_aging():
    rng = random.Random(7)
    queue = q(aging=1)
    for i in range(200):
        tenant = rng.choice("abcd")
        queue.push(f"{tenant}{i}", rng.choice(CLASSES).name, rng.uniform(0, 5), tenant)
    predicted = [e.item for e in queue.ordered(6.0, lambda item: 10)]
    assert predicted == drain(queue, 6.0)


def test_without_tenants_ordered_is_by_level_then_arrival():
    rng = random.Random(3)
    queue = q(aging=1)
    for i in range(100):
        queue.push(str(i), rng.choice(CLASSES).name, i * 0.05)
    ordered = queue.ordered(6.0)
    assert ordered == sorted(ordered, key=lambda e: (queue.effective_level(e, 6.0), e.seq))


def test_a_newcomer_of_a_quiet_tenant_waits_behind_its_fair_share_not_the_whole_flood():
    queue = q()
    for i in range(50):
        queue.push(f"a{i}", "standard", 0.0, "flood")
    queue.push("int", "interactive", 0.0, "other")
    standard = CLASSES[1]
    assert queue.ahead(standard, "quiet") == 1 + 1          # the interactive one, and one of the flood's
    assert queue.ahead(standard, "flood") == 1 + 50
    queue.weigh("flood", 3)
    assert queue.ahead(standard, "quiet") == 1 + 3
    # Without tenants: every entry of its class and of better ones, as a single line.
    assert q().ahead(standard, "unknown") == 0


def test_service_received_while_nobody_waited_does_not_count_against_a_tenant_later():
    queue = q()
    for _ in range(100):                     # a tenant alone: straight to the engine, never queued
        queue.passed("standard", "early")
        queue.charge("standard", "early", prompt_tokens=256, answer_tokens=32)
    for i in range(4):
        queue.push(("late", i), "standard", 0.0, "late")
    for i in range(2):
        queue.push(("early", i), "standard", 0.0, "early")
    # The newcomer starts where the early tenant's last request left the lane, not at 0 (which would
    # give it the next 100 turns): it catches up that one request, then they take turns.
    order = [item[0] for item in drain(queue, 1.0, prompt_tokens=320)]
    assert order == ["late", "late", "early", "late", "early", "late"]
