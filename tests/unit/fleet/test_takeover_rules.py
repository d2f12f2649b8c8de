"""The pure rules of following and taking over: what a follower keeps, which of its readings a
new leader acts on without reading again, and the order of a new leader's first pass."""
import dataclasses

from gpufleet.autoscale.policy import Decision, PolicyState, Thresholds, decide, follow
from gpufleet.autoscale.signals import ReplicaSample
from gpufleet.autoscale.takeover import Warm, first_pass_order, warm_decision

TH = Thresholds(min_replicas=1, max_replicas=4, kv_high=0.8, kv_low=0.4, queue_depth=8,
                up_stabilization_s=30, down_stabilization_s=30, max_step=2)


def s(pod, kv, queue=()):
    return ReplicaSample(pod=pod, ok=True, kv_usage=kv, queue_buckets=queue)


def queued(slow):
    return ((0.5, 0.0), (2.5, 0.0), (5.0, slow), (float("inf"), slow))


def test_a_follower_keeps_the_evidence_a_leader_would_have_answered():
    """Over the watermark for the stabilization window: the leader scales and starts over; the
    follower, which acts on nothing, keeps the high clock and the queue window running."""
    state = PolicyState()
    for now, slow in ((100.0, 0.0), (115.0, 50.0)):
        state = follow(TH, current=1, ready=1, samples=[s("a", 0.9, queued(slow))], state=state, now=now).watched
    leader, led_state, _ = decide(TH, current=1, ready=1, samples=[s("a", 0.9, queued(80.0))], state=state, now=130.0)
    j = follow(TH, current=1, ready=1, samples=[s("a", 0.9, queued(80.0))], state=state, now=130.0)
    assert leader == j.decision and leader is not None and leader.target == 2
    assert led_state == j.answered and led_state.high_since is None and led_state.queue_window == ()
    assert j.watched.high_since == 100.0 and len(j.watched.queue_window) == 2
    assert j.watched.shed_seen == j.answered.shed_seen and j.watched.queue_seen == j.answered.queue_seen


def test_a_follower_keeps_the_low_clock_running_past_a_scale_in_it_does_not_make():
    calm = [s("a", 0.1), s("b", 0.1)]
    j = follow(TH, current=2, ready=2, samples=calm, state=PolicyState(), now=100.0)
    j = follow(TH, current=2, ready=2, samples=calm, state=j.watched, now=131.0)
    assert j.decision is not None and j.decision.target == 1
    assert j.watched.low_since == 100.0 and j.answered.low_since is None


def test_without_a_decision_what_is_watched_is_what_is_kept():
    j = follow(TH, current=2, ready=2, samples=[s("a", 0.6), s("b", 0.6)], state=PolicyState(), now=100.0)
    assert j.decision is None and j.watched == j.answered


SCALE_OUT = Decision(2, "KVHighWatermark", "KV usage 95% >= 80%")


def warm(decision=SCALE_OUT, *, at=100.0, current=1, generation=3,
         kv=0.95, high_since=None):
    state = PolicyState(high_since=high_since)
    obs_j = follow(TH, current=current, ready=current, samples=[s("a", kv)], state=state, now=at)
    return Warm(at, current, generation, dataclasses.replace(obs_j, decision=decision))


def test_a_recent_scale_out_on_the_replicas_that_still_stand_is_carried_out_at_once():
    assert warm_decision(warm(), now=109.0, max_age=10.0, current=1, generation=3) == warm().judgement.decision


def test_anything_else_is_read_again_first():
    assert warm_decision(None, now=100.0, max_age=10.0, current=1, generation=3) is None
    assert warm_decision(warm(decision=None), now=100.0, max_age=10.0, current=1, generation=3) is None
    scale_in = warm(Decision(1, "KVLowWatermark", "calm"), current=2, kv=0.1)
    assert warm_decision(scale_in, now=100.0, max_age=10.0, current=2, generation=3) is None
    assert warm_decision(warm(), now=110.5, max_age=10.0, current=1, generation=3) is None   # too old
    assert warm_decision(warm(), now=101.0, max_age=10.0, current=2, generation=3) is None   # scaled meanwhile
    assert warm_decision(warm(), now=101.0, max_age=10.0, current=1, generation=4) is None   # spec changed


def test_the_first_pass_goes_to_the_services_under_pressure_first():
    readings = {
        "never-read": None,
        "calm": warm(None, kv=0.3),
        "warm-busy": warm(None, kv=0.7),
        "stabilizing": warm(None, kv=0.85, high_since=95.0),
        "due-a-bit": warm(kv=0.82),
        "due-most": warm(kv=0.99),
    }
    assert first_pass_order(readings, readings.get) == [
        "due-most", "due-a-bit", "stabilizing", "warm-busy", "calm", "never-read"]
