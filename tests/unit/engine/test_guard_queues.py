"""The multi-level queue: L1 before L2 before L3, FIFO inside a class, aging."""
from __future__ import annotations

import pytest

from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_engine.admission.queues import MultiLevelQueue, QueueFull

CLASSES = [QueueClass("interactive", 1, 2), QueueClass("standard", 2, 10), QueueClass("background", 3, 60)]


def q(aging: float = 5, max_length: int = 100) -> MultiLevelQueue:
    return MultiLevelQueue(CLASSES, aging, max_length)


def drain(queue: MultiLevelQueue, now: float) -> list:
    out = []
    while (e := queue.pop(now)) is not None:
        out.append(e.item)
    return out


def test_lower_levels_go_first_whatever_the_arrival_order():
    queue = q()
    queue.push("bg", "background", 0.0)
    queue.push("std", "standard", 0.1)
    queue.push("int", "interactive", 0.2)
    assert drain(queue, 0.3) == ["int", "std", "bg"]


def test_fifo_inside_a_class():
    queue = q()
    for i in range(4):
        queue.push(i, "standard", i * 0.01)
    assert drain(queue, 1.0) == [0, 1, 2, 3]


def test_waiting_promotes_one_level_per_aging_period():
    queue = q(aging=5)
    entry = queue.push("bg", "background", 0.0)
    assert [queue.effective_level(entry, t) for t in (0, 4.9, 5, 9.9, 10, 100)] == [3, 3, 2, 2, 1, 1]


def test_an_aged_background_request_overtakes_newer_interactive_ones():
    queue = q(aging=5)
    queue.push("old-bg", "background", 0.0)
    queue.push("new-int", "interactive", 10.5)
    # At t=11 the background entry has aged to level 1 and is older.
    assert drain(queue, 11.0) == ["old-bg", "new-int"]


def test_a_background_request_is_not_starved_by_a_steady_interactive_stream():
    queue = q(aging=1)
    queue.push("bg", "background", 0.0)
    served = []
    t = 0.0
    for i in range(10):  # one interactive arrival and one dispatch per 0.5 s
        queue.push(f"int{i}", "interactive", t)
        served.append(queue.pop(t).item)
        t += 0.5
    assert "bg" in served
    assert served.index("bg") <= 5  # served once it aged to level 1 (t = 2 s)


def test_before_aging_kicks_in_interactive_still_wins():
    queue = q(aging=5)
    queue.push("bg", "background", 0.0)
    queue.push("int", "interactive", 1.0)
    assert queue.pop(2.0).item == "int"


def test_the_queue_refuses_beyond_its_length():
    queue = q(max_length=2)
    queue.push(1, "standard", 0)
    queue.push(2, "standard", 0)
    with pytest.raises(QueueFull, match="maxQueueLength 2"):
        queue.push(3, "interactive", 0)


def test_removed_entries_are_never_served_and_free_their_place():
    queue = q(max_length=2)
    a = queue.push("a", "standard", 0)
    queue.push("b", "standard", 0)
    assert queue.remove(a) is True
    assert queue.remove(a) is False
    queue.push("c", "standard", 0)
    assert drain(queue, 1) == ["b", "c"]
    assert len(queue) == 0 and queue.depth("standard") == 0


def test_peek_does_not_take_the_entry():
    queue = q()
    queue.push("x", "standard", 0)
    assert queue.peek(0).item == "x" and len(queue) == 1
