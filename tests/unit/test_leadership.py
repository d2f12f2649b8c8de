"""Leader election's state machine against an in-memory Lease with
resourceVersion preconditions: one leader at a time, takeover after the lease
duration on the candidate's own clock, a leader that cannot renew stops acting
before anyone may take over, a release hands over at once."""
import dataclasses
import random

import pytest

from gpufleet.leader_election.records import Leadership, LeaseRecord, Timing, TimingError

T = Timing()  # 15 s / 10 s / 2 s


class Lease:
    """The API server's side: a create fails when it exists, an update when its rv is stale."""

    def __init__(self):
        self.record: LeaseRecord | None = None
        self.rv = 0

    def read(self) -> LeaseRecord | None:
        return self.record

    def write(self, write) -> LeaseRecord | None:
        if write.create:
            if self.record is not None:
                return None
        elif self.record is None or write.record.resource_version != self.record.resource_version:
            return None
        self.rv += 1
        self.record = dataclasses.replace(write.record, resource_version=str(self.rv))
        return self.record


def attempt(machine: Leadership, lease: Lease, now: float) -> str | None:
    """One round of the elector's loop, all requests answered at ``now``."""
    write = machine.next_write(lease.read(), now, f"wall-{now}")
    if write is None:
        return machine.check(now)
    stored = lease.write(write)
    if stored is None:
        machine.observe(lease.read(), now)
        return machine.write_failed(now)
    return machine.written(write, stored, now)


def test_the_first_candidate_creates_the_lease_and_leads():
    lease, a = Lease(), Leadership("a", T)
    assert attempt(a, lease, 0.0) == "acquired"
    assert a.may_act(0.0) and lease.record.holder == "a" and lease.record.transitions == 0
    assert a.acting_for(3.0) == pytest.approx(7.0)


def test_a_second_candidate_waits_while_the_leader_renews():
    lease, a, b = Lease(), Leadership("a", T), Leadership("b", T)
    attempt(a, lease, 0.0)
    for t in range(1, 120):
        attempt(a, lease, float(t))
        assert attempt(b, lease, t + 0.5) is None
        assert a.may_act(t + 0.5) and not b.may_act(t + 0.5)


def test_takeover_after_the_lease_duration_on_the_candidates_clock():
    lease, a, b = Lease(), Leadership("a", T), Leadership("b", T)
    attempt(a, lease, 0.0)
    attempt(b, lease, 0.1)         # b sees a's record at 0.1 (its clock starts there)
    attempt(a, lease, 2.0)         # a's last renewal, then a dies
    attempt(b, lease, 2.1)         # seen at 2.1
    assert b.expires_at() == pytest.approx(17.1)
    assert attempt(b, lease, 17.0) is None
    assert attempt(b, lease, 17.1) == "acquired"
    assert lease.record.holder == "b" and lease.record.transitions == 1
    # The candidate wakes for the expiry rather than the next retry period.
    c = Leadership("c", T)
    c.observe(lease.read(), 20.0)
    assert c.next_attempt_in(34.5, jitter=0.0) == pytest.approx(0.5)


def test_a_leader_that_cannot_renew_stops_before_anyone_may_take_over():
    lease, a, b = Lease(), Leadership("a", T), Leadership("b", T)
    attempt(a, lease, 0.0)
    attempt(a, lease, 2.0)   # the last renewal that lands; then a is partitioned
    attempt(b, lease, 2.0)   # b saw it at once (a watch)
    stopped_at = next(t / 10 for t in range(20, 300) if a.check(t / 10) == "lost")
    took_over_at = next(t / 10 for t in range(20, 300) if attempt(b, lease, t / 10) == "acquired")
    assert stopped_at == pytest.approx(2.0 + T.renew_deadline)
    assert took_over_at == pytest.approx(2.0 + T.lease_duration)
    assert took_over_at - stopped_at == pytest.approx(T.lease_duration - T.renew_deadline)


def test_the_deadline_counts_from_when_the_renewal_was_sent_not_answered():
    lease, a = Lease(), Leadership("a", T)
    write = a.next_write(None, 0.0, "w")
    a.written(write, lease.write(write), sent_at=0.0)
    assert a.acting_for(9.0) == pytest.approx(1.0)   # answered late or not: 10 s from sending


def test_a_lost_race_is_not_leadership():
    lease, a, b = Lease(), Leadership("a", T), Leadership("b", T)
    wa, wb = a.next_write(None, 0.0, "w"), b.next_write(None, 0.0, "w")
    assert a.written(wa, lease.write(wa), 0.0) == "acquired"
    assert lease.write(wb) is None          # the second create finds the Lease there
    assert b.write_failed(0.0) is None and not b.may_act(0.0)


def test_a_leader_that_sees_another_holder_steps_down_at_once():
    lease, a = Lease(), Leadership("a", T)
    attempt(a, lease, 0.0)
    a.observe(dataclasses.replace(lease.record, holder="b", resource_version="99"), 1.0)
    assert a.check(1.0) == "lost" and not a.may_act(1.0)


def test_release_hands_over_at_once():
    lease, a, b = Lease(), Leadership("a", T), Leadership("b", T)
    attempt(a, lease, 0.0)
    attempt(b, lease, 1.0)
    released = a.release("wall")
    assert not a.may_act(1.5)
    assert released.holder is None and released.lease_duration_seconds == 1
    lease.write(type("W", (), {"record": released, "create": False})())
    assert attempt(b, lease, 1.6) == "acquired"
    assert lease.record.transitions == 1


def test_release_of_a_lease_held_by_another_writes_nothing():
    lease, a, b = Lease(), Leadership("a", T), Leadership("b", T)
    attempt(a, lease, 0.0)
    attempt(b, lease, 0.5)
    assert b.release("wall") is None


@pytest.mark.parametrize("seed", range(20))
def test_never_two_leaders_under_random_failures_and_partitions(seed):
    """Three candidates; each round each may be partitioned (no request gets through),
    crash and come back under a new name, or run late. At every instant at most one may act."""
    rng = random.Random(seed)
    lease = Lease()
    replicas = [Leadership(f"r{i}", T) for i in range(3)]
    next_at = [0.0, 0.3, 0.7]
    leaders_seen = set()
    now = 0.0
    while now < 600:
        now = round(now + 0.1, 1)
        for i, m in enumerate(replicas):
            m.check(now)
            if now < next_at[i]:
                continue
            roll = rng.random()
            if roll < 0.02:      # crash: a new process with a new identity, nothing remembered
                replicas[i] = Leadership(f"r{i}-{now}", T)
            elif roll < 0.25:    # partitioned this round: requests fail
                m.write_failed(now)
            else:
                attempt(m, lease, now)
            next_at[i] = now + replicas[i].next_attempt_in(now, rng.random()) + rng.choice([0, 0, 0.5, 3])
        acting = [m.identity for m in replicas if m.may_act(now)]
        assert len(acting) <= 1, f"two leaders at {now}: {acting}"
        leaders_seen.update(acting)
    assert len(leaders_seen) > 1, "the scenario never failed over"


@pytest.mark.parametrize("args, message", [
    ((10, 10, 2), "must be longer than the renew deadline"),
    ((15, 2, 2), "must be longer than 1.2 x the retry period"),
])
def test_inconsistent_timing_is_refused(args, message):
    with pytest.raises(TimingError, match=message):
        Timing(*args)
