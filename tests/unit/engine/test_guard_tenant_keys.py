"""The tenant keys the guard's fair lanes use: names and weights from headers, and a bounded set of keys."""
from __future__ import annotations

import pytest

from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_api.tenants.declaration import MAX_TENANTS, UNKNOWN_TENANT
from gpufleet_engine.admission.queues import MultiLevelQueue
from gpufleet_engine.admission.tenant_keys import TenantKeys, tenant_name, tenant_weight

CLASSES = [QueueClass("interactive", 1, 2), QueueClass("standard", 2, 10), QueueClass("background", 3, 60)]


@pytest.mark.parametrize("header, name", [
    ("search", "search"), (" batch-eval ", "batch-eval"), (None, UNKNOWN_TENANT), ("", UNKNOWN_TENANT),
    ("Search", UNKNOWN_TENANT), ("a/b", UNKNOWN_TENANT), ("-x", UNKNOWN_TENANT), ("x" * 64, UNKNOWN_TENANT),
])
def test_a_tenant_is_named_by_a_dns_label_else_unknown(header, name):
    assert tenant_name(header) == name


@pytest.mark.parametrize("header, weight", [
    ("2", 2), (" 1000 ", 1000), ("007", 7), (None, 1), ("", 1), ("0", 1), ("-3", 1), ("1.5", 1), ("two", 1),
    ("1001", 1000), ("9" * 5000, 1000), ("٣", 1),
])
def test_a_weight_is_an_integer_clamped_to_1_to_1000_else_1(header, weight):
    assert tenant_weight(header) == weight


def keys(capacity: int = MAX_TENANTS) -> tuple[TenantKeys, MultiLevelQueue]:
    queue: MultiLevelQueue = MultiLevelQueue(CLASSES, 5, 100_000)
    return TenantKeys(queue.weigh, queue.forget, capacity=capacity), queue


def test_any_number_of_names_keeps_at_most_max_tenants_keys_plus_unknown():
    book, queue = keys()
    for i in range(10 * MAX_TENANTS):
        key = book.enter(f"t{i}", 1 + i % 1000)
        queue.push(object(), "standard", 0.0, key)
        queue.charge("standard", key, prompt_tokens=10)
    assert len(book) == MAX_TENANTS
    assert len(queue.tenants()) == MAX_TENANTS + 1


def test_an_idle_tenant_gives_its_place_and_counters_to_a_new_name_least_recently_seen_first():
    book, queue = keys(capacity=2)
    a, b = book.enter("a", 3), book.enter("b", 1)
    queue.charge("standard", a, prompt_tokens=30)
    book.leave(a)
    book.leave(b)
    book.enter("b", 1)                       # b seen again: a is now the least recently seen
    assert book.enter("c", 1) == "c" and book.tenants() == ["b", "c"]
    assert "a" not in queue.tenants()
    assert book.enter("d", 1) == UNKNOWN_TENANT   # b and c have requests in the guard


def test_unknown_is_never_named_and_always_weighs_one():
    book, queue = keys()
    assert book.enter(UNKNOWN_TENANT, 1000) == UNKNOWN_TENANT
    assert len(book) == 0 and queue.tenants() == set()


def test_a_changed_weight_reaches_every_class():
    book, queue = keys()
    book.enter("search", 2)
    book.enter("search", 5)
    for queue_class in CLASSES:
        queue.charge(queue_class.name, "search", prompt_tokens=10)
        assert queue.counter(queue_class.name, "search") == 2
