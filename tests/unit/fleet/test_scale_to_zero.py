"""minReplicas 0: an idle service goes to zero, a router's held request brings it back to one,
and scaling in by KV usage never takes the last replica."""
import dataclasses

from gpufleet.autoscale.policy import PolicyState, Thresholds, decide
from gpufleet.autoscale.signals import ReplicaSample
from gpufleet_api import parse_spec

TH = Thresholds(min_replicas=0, max_replicas=3, kv_high=0.8, kv_low=0.4, queue_depth=8,
                up_stabilization_s=0, down_stabilization_s=30, max_step=2, scale_to_zero_s=60)


def s(pod, requests=10.0, in_flight=0.0, kv=0.0, ok=True):
    return ReplicaSample(pod=pod, ok=ok, kv_usage=kv, guard_in_flight=in_flight, requests_total=requests,
                         error=None if ok else "timeout")


def ticks(samples_at, current=1, demand_at=lambda t: 0, until=200, th=TH):
    """Tick once a second; the first decision and when it came."""
    state = PolicyState()
    for t in range(until):
        d, state, _ = decide(th, current=current, ready=current, samples=samples_at(t), state=state,
                             now=float(t), demand=demand_at(t))
        if d is not None:
            return d, t
    return None, None


def test_a_service_with_no_request_for_the_window_goes_to_zero():
    d, t = ticks(lambda t: [s("a")])
    assert d.target == 0 and d.reason == "Idle" and t == 61   # idle from the second read on


def test_any_arrival_restarts_the_window():
    d, t = ticks(lambda t: [s("a", requests=10.0 + (t >= 50))])
    assert d.target == 0 and t == 51 + 60


def test_a_request_in_flight_or_held_keeps_it_up():
    d, _ = ticks(lambda t: [s("a", in_flight=1.0)])
    assert d is None
    d, _ = ticks(lambda t: [s("a")], demand_at=lambda t: 1)
    assert d is None


def test_an_unreadable_replica_is_never_taken_for_an_idle_one():
    d, _ = ticks(lambda t: [s("a"), s("b", ok=False)], current=2)
    assert d is None


def test_at_zero_a_held_request_brings_one_replica():
    d, t = ticks(lambda t: [], current=0, demand_at=lambda t: 2 if t >= 5 else 0)
    assert (d.target, d.reason, t) == (1, "RouterDemand", 5)


def test_at_zero_without_demand_nothing_happens():
    assert ticks(lambda t: [], current=0) == (None, None)


def test_scaling_in_by_kv_usage_stops_at_one():
    busy = [0]

    def samples(t):
        busy[0] += 1
        return [s("a", requests=float(busy[0]), kv=0.1)]   # requests keep arriving at low usage
    d, _ = ticks(samples, current=1)
    assert d is None
    d, _ = ticks(lambda t: [s("a", requests=float(t), kv=0.1), s("b", requests=float(t), kv=0.1)], current=2)
    assert (d.target, d.reason) == (1, "KVLowWatermark")


def test_with_a_floor_of_one_the_service_never_goes_to_zero():
    th = dataclasses.replace(TH, min_replicas=1, scale_to_zero_s=None)
    d, _ = ticks(lambda t: [s("a")], th=th, until=400)
    assert d is None


def test_the_window_comes_from_the_spec_and_only_with_min_zero():
    zero = parse_spec({"model": {"name": "m"}, "autoscaling": {"minReplicas": 0, "scaleToZeroAfterSeconds": 90}})
    assert Thresholds.from_spec(zero.autoscaling).scale_to_zero_s == 90
    one = parse_spec({"model": {"name": "m"}, "autoscaling": {"minReplicas": 1, "scaleToZeroAfterSeconds": 90}})
    assert Thresholds.from_spec(one.autoscaling).scale_to_zero_s is None
