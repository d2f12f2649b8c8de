"""VTC fair shares inside a queue class: equal service under saturation whatever the rates, service in
proportion to weights, no burst for a tenant's idle time, bounded state."""
from __future__ import annotations

from collections import Counter

import pytest

from gpufleet_engine.admission.fair_share import FairLane


class Req:
    def __init__(self, tenant: str, prompt: int = 100, answer: int = 50):
        self.tenant, self.prompt, self.answer = tenant, prompt, answer


def serve(lane: FairLane, steps: int, refill: dict[str, int] | None = None) -> list[str]:
    """A saturated engine serving one request per step; ``refill``: each tenant keeps that many waiting
    (its sending rate far beyond what it is served)."""
    order = []
    for _ in range(steps):
        for tenant, depth in (refill or {}).items():
            while sum(1 for r in lane if r.tenant == tenant) < depth:
                lane.append(Req(tenant), tenant)
        r = lane.popleft()
        lane.charge(r.tenant, prompt_tokens=r.prompt)
        lane.charge(r.tenant, answer_tokens=r.answer)
        order.append(r.tenant)
    return order


def test_a_flooding_tenant_and_a_quiet_one_get_equal_service_under_saturation():
    lane: FairLane[Req] = FairLane()
    served = Counter(serve(lane, 1000, refill={"flood": 100, "quiet": 2}))
    assert abs(served["flood"] - served["quiet"]) <= 1


def test_first_come_first_served_would_have_given_the_flood_nearly_all():
    """The baseline the fair lane is measured against: a FIFO of the same arrivals."""
    from collections import deque
    fifo = deque([Req("flood")] * 100 + [Req("quiet")] * 2)
    first_hundred = [fifo.popleft().tenant for _ in range(100)]
    assert first_hundred.count("quiet") == 0
    lane: FairLane[Req] = FairLane()
    for r in [Req("flood") for _ in range(100)] + [Req("quiet"), Req("quiet")]:
        lane.append(r, r.tenant)
    assert serve(lane, 4)[:4].count("quiet") == 2


def test_weights_two_to_one_give_service_two_to_one():
    lane: FairLane[Req] = FairLane(weights={"big": 2, "small": 1})
    served = Counter(serve(lane, 900, refill={"big": 5, "small": 5}))
    assert served["big"] == pytest.approx(600, abs=2) and served["small"] == pytest.approx(300, abs=2)


def test_service_is_counted_in_tokens_not_requests():
    """A tenant sending requests twice as long is served half as many of them."""
    lane: FairLane[Req] = FairLane()
    served: Counter[str] = Counter()
    for _ in range(600):
        for tenant, size in (("long", 200), ("short", 100)):
            while sum(1 for r in lane if r.tenant == tenant) < 2:  # both stay backlogged
                lane.append(Req(tenant, prompt=size, answer=size), tenant)
        r = lane.popleft()
        lane.charge(r.tenant, r.prompt, r.answer)
        served[r.tenant] += 1
    assert served["short"] == pytest.approx(2 * served["long"], abs=2)


def test_a_newly_active_tenant_gets_no_burst_for_its_idle_time():
    lane: FairLane[Req] = FairLane()
    serve(lane, 500, refill={"busy": 3})  # "late" idle meanwhile: its counter is 0, busy's is high
    order = serve(lane, 40, refill={"busy": 3, "late": 3})
    # Without the lift "late" would be served 500 times in a row; with it, the two alternate at once.
    longest_run = max(len(run) for run in "".join("L" if t == "late" else "b" for t in order).split("b"))
    assert longest_run <= 2
    assert abs(order.count("late") - order.count("busy")) <= 2
    assert lane.counter("late") >= lane.counter("busy") - 2 * (100 + 2 * 50)


def test_the_lift_applies_when_the_lane_was_empty_too():
    lane: FairLane[Req] = FairLane()
    serve(lane, 200, refill={"a": 1})
    while len(lane):
        lane.popleft()
    lane.append(Req("b"), "b")
    assert lane.counter("b") >= lane.counter("a") - (100 + 2 * 50)


def test_a_counter_is_never_lowered_by_the_lift():
    lane: FairLane[Req] = FairLane()
    lane.charge("heavy", prompt_tokens=10_000)
    lane.append(Req("light"), "light")
    lane.append(Req("heavy"), "heavy")
    assert lane.counter("heavy") == 10_000
    assert lane.popleft().tenant == "light"


def test_fifo_within_a_tenant_and_ties_to_the_earliest_arrival():
    lane: FairLane[Req] = FairLane()
    first, second, other = Req("a"), Req("a"), Req("b")
    for r in (first, second, other):
        lane.append(r, r.tenant)
    assert lane.head() is first and lane.oldest() is first
    assert serve(lane, 3) == ["a", "b", "a"]
    assert lane.head() is None and lane.oldest() is None
    with pytest.raises(IndexError):
        lane.popleft()


def test_oldest_is_the_longest_waiting_even_when_the_fair_head_is_younger():
    lane: FairLane[Req] = FairLane()
    served, old, young = Req("a"), Req("a"), Req("b")
    for r in (served, old, young):
        lane.append(r, r.tenant)
    assert serve(lane, 1) == ["a"]
    assert lane.head() is young and lane.oldest() is old


def test_remove_takes_out_an_entry_that_gave_up():
    lane: FairLane[Req] = FairLane()
    a, b = Req("a"), Req("b")
    lane.append(a, "a")
    lane.append(b, "b")
    lane.remove(a)
    assert len(lane) == 1 and list(lane) == [b] and lane.popleft() is b
    with pytest.raises(ValueError):
        lane.remove(a)
    lane.append(b, "b")
    with pytest.raises(ValueError):
        lane.append(b, "b")


def test_bounded_state_one_counter_per_tenant_and_retain_forgets_the_undeclared():
    lane: FairLane[Req] = FairLane()
    serve(lane, 3000, refill={"a": 2, "b": 2, "c": 1})
    assert lane.tenants() == {"a", "b", "c"} and len(lane) <= 5
    lane.retain({"a"})
    assert lane.tenants() == {"a"} | {r.tenant for r in lane}  # backlogged tenants keep their counters
    while len(lane):
        lane.popleft()
    lane.retain({"a"})
    assert lane.tenants() == {"a"}


def test_negative_token_weights_are_refused():
    with pytest.raises(ValueError):
        FairLane(prompt_weight=-1)
