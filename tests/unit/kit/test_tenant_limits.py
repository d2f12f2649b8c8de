"""Per-tenant limits: refusals carry the Retry-After of when the budget refills, and after it the tenant
is served; tokens are charged an estimate then corrected."""
from __future__ import annotations

import pytest

from gpufleet_api.tenants.declaration import TenantLimits
from gpufleet_kit.tenant_limits import Limiter, Refusal, Ticket, TokenBucket, retry_after


def limiter(now: float = 0.0, **limits: TenantLimits) -> Limiter:
    return Limiter(limits, now)


def test_requests_per_second_burst_then_refusal_with_retry_after_then_served():
    lim = limiter(a=TenantLimits(requests_per_second=2))
    assert isinstance(lim.admit("a", 0, 0.0), Ticket)
    assert isinstance(lim.admit("a", 0, 0.0), Ticket)
    r = lim.admit("a", 0, 0.0)
    assert r == Refusal("a", "requests_per_second", 1)  # one request refills in 0.5 s: rounded up
    assert isinstance(lim.admit("a", 0, 0.0 + r.retry_after_seconds), Ticket)


def test_tokens_per_minute_retry_after_is_when_the_tokens_refill():
    lim = limiter(a=TenantLimits(tokens_per_minute=600))  # 10 tokens/s
    assert isinstance(lim.admit("a", 600, 0.0), Ticket)
    r = lim.admit("a", 250, 0.0)
    assert isinstance(r, Refusal) and r.limit == "tokens_per_minute" and r.retry_after_seconds == 25
    assert isinstance(lim.admit("a", 250, 24.0), Refusal)
    assert isinstance(lim.admit("a", 250, 25.0), Ticket)


def test_an_answer_longer_than_its_estimate_leaves_a_debt_later_requests_wait_for():
    lim = limiter(a=TenantLimits(tokens_per_minute=600))
    t = lim.admit("a", 100, 0.0)
    assert isinstance(t, Ticket)
    lim.finish(t, 700, 0.0)  # 600 more than estimated: 600 - 100 - 600, the bucket is at -100
    r = lim.admit("a", 10, 0.0)
    assert isinstance(r, Refusal) and r.retry_after_seconds == 11  # (10 + 100) / 10 per s


def test_a_shorter_answer_gives_back_the_difference_never_above_a_full_bucket():
    lim = limiter(a=TenantLimits(tokens_per_minute=600))
    t = lim.admit("a", 600, 0.0)
    assert isinstance(t, Ticket)
    lim.finish(t, 100, 0.0)
    assert isinstance(lim.admit("a", 500, 0.0), Ticket)
    assert isinstance(lim.admit("a", 1, 0.0), Refusal)


def test_an_estimate_over_a_minutes_worth_is_admitted_from_a_full_bucket():
    lim = limiter(a=TenantLimits(tokens_per_minute=600))
    assert isinstance(lim.admit("a", 5000, 0.0), Ticket)
    r = lim.admit("a", 5000, 0.0)
    assert isinstance(r, Refusal) and r.retry_after_seconds == (5000 - 600 + 600) // 10


def test_concurrency_counts_requests_in_flight_and_finish_is_once_per_ticket():
    lim = limiter(a=TenantLimits(concurrent_requests=1))
    t = lim.admit("a", 0, 0.0)
    assert isinstance(t, Ticket)
    assert lim.admit("a", 0, 0.0) == Refusal("a", "concurrent_requests", 1)
    lim.finish(t, 0, 0.0)
    lim.finish(t, 0, 0.0)  # a second finish must not free a second place
    t2 = lim.admit("a", 0, 0.0)
    assert isinstance(t2, Ticket) and lim.in_flight("a") == 1
    assert isinstance(lim.admit("a", 0, 0.0), Refusal)


def test_a_refusal_charges_nothing_and_names_the_limit_refilling_last():
    lim = limiter(a=TenantLimits(requests_per_second=10, tokens_per_minute=60))
    assert isinstance(lim.admit("a", 60, 0.0), Ticket)
    r = lim.admit("a", 30, 0.0)
    assert isinstance(r, Refusal) and r.limit == "tokens_per_minute" and r.retry_after_seconds == 30
    for _ in range(9):  # the refused request took no request budget
        assert isinstance(lim.admit("a", 0, 0.0), Ticket)


def test_tenants_do_not_share_budgets():
    lim = limiter(a=TenantLimits(requests_per_second=1), b=TenantLimits(requests_per_second=1))
    assert isinstance(lim.admit("a", 0, 0.0), Ticket)
    assert isinstance(lim.admit("a", 0, 0.0), Refusal)
    assert isinstance(lim.admit("b", 0, 0.0), Ticket)


def test_no_limits_means_always_admitted():
    lim = limiter(a=TenantLimits())
    assert all(isinstance(lim.admit("a", 10**9, 0.0), Ticket) for _ in range(100))


def test_an_undeclared_tenant_is_a_caller_error_not_an_unlimited_one():
    with pytest.raises(LookupError, match="not declared"):
        limiter(a=TenantLimits()).admit("someone", 0, 0.0)


def test_a_reload_keeps_budgets_and_debts_and_forgets_removed_tenants():
    lim = limiter(a=TenantLimits(tokens_per_minute=600), b=TenantLimits(requests_per_second=1))
    t = lim.admit("a", 600, 0.0)
    assert isinstance(t, Ticket)
    lim.configure({"a": TenantLimits(tokens_per_minute=1200)}, 0.0)
    r = lim.admit("a", 100, 0.0)
    assert isinstance(r, Refusal) and r.retry_after_seconds == 5  # still empty, now refilling at 20/s
    assert lim.in_flight("a") == 1
    with pytest.raises(LookupError):
        lim.admit("b", 0, 0.0)
    lim.finish(t, 600, 0.0)  # its tenant's state survived the reload
    assert lim.in_flight("a") == 0


def test_a_lower_limit_cuts_the_saved_budget():
    lim = limiter(a=TenantLimits(tokens_per_minute=6000))
    lim.configure({"a": TenantLimits(tokens_per_minute=60)}, 0.0)
    assert isinstance(lim.admit("a", 60, 0.0), Ticket)
    assert isinstance(lim.admit("a", 1, 0.0), Refusal)


def test_retry_after_rounds_up_whole_seconds_at_least_one():
    assert [retry_after(s) for s in (0.0, 0.01, 1.0, 1.0000000001 - 1e-10, 1.2, 59.5)] == [1, 1, 1, 1, 2, 60]


def test_a_bucket_needs_positive_capacity_and_rate():
    with pytest.raises(ValueError):
        TokenBucket(0, 1, 0.0)
    b = TokenBucket(10, 1, 0.0)
    b.take(10, 0.0)
    assert b.level(-5.0) == 0.0  # a clock read before the last take refills nothing
    assert b.level(4.0) == 4.0 and b.level(100.0) == 10.0


def test_used_reads_each_declared_limits_share_in_use_over_one_in_debt():
    lim = Limiter({"a": TenantLimits(requests_per_second=4, tokens_per_minute=600, concurrent_requests=2),
                   "b": TenantLimits()}, now=0.0)
    ticket = lim.admit("a", 300, now=0.0)
    assert isinstance(ticket, Ticket)
    assert sorted(lim.used(0.0)) == [("a", "concurrent_requests", 0.5), ("a", "requests_per_second", 0.25),
                                     ("a", "tokens_per_minute", 0.5)]
    lim.finish(ticket, 900, now=0.0)           # 600 more than estimated: the bucket is in debt
    used = {limit: share for _, limit, share in lim.used(0.0)}
    assert used["tokens_per_minute"] == 1.5 and used["concurrent_requests"] == 0.0
