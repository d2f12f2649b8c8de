"""The policy applied per pool of a disaggregated service (pure): prefill on its queue, shedding and
TTFT; decode on KV, shedding, its queue and ITL; each inside its own bounds, never to zero; and the
band the measured prefill:decode ratio holds the decode pool to."""
import pytest

from gpufleet.autoscale.policy import Decision, Observation, PolicyState, decide
from gpufleet.autoscale.pools import RatioBand, bound_decode, pool_thresholds, ratio_band
from gpufleet.autoscale.signals import ReplicaSample
from gpufleet_api import SpecError, parse_spec

INF = float("inf")


def pd_spec(prefill=None, decode=None, **over):
    return parse_spec({"model": {"name": "m"}, "engine": {"kvTransfer": {"connector": "Nixl"}},
                       "disaggregation": {"prefill": prefill or {"minReplicas": 1, "maxReplicas": 4},
                                          "decode": decode or {"minReplicas": 2, "maxReplicas": 6}},
                       "slo": {"ttftP99Milliseconds": 500, "itlP99Milliseconds": 50}, **over})


def latency(fast, slow, objective):
    """Cumulative buckets of a guard latency histogram (the objective is one of its bounds, as the
    guard makes it): ``fast`` observations well under the objective, ``slow`` ones over it."""
    return ((objective / 4, fast), (objective, fast), (objective * 4, fast + slow), (INF, fast + slow))


def sample(pod, kv=0.5, ttft=(), itl=(), waiting=0.0, shed=0.0, ok=True):
    return ReplicaSample(pod=pod, ok=ok, kv_usage=kv, ttft_buckets=ttft, itl_buckets=itl, engine_waiting=waiting,
                         shed_total=shed, error=None if ok else "timeout")


def ticks(th, current, series, ready=None):
    """Run ``decide`` over (now, samples) reads; the last decision and observation."""
    state, decision, obs = PolicyState(), None, None
    for now, samples in series:
        decision, state, obs = decide(th, current=current, ready=current if ready is None else ready,
                                      samples=samples, state=state, now=now)
    return decision, obs


def test_each_pool_has_its_bounds_and_its_signals():
    spec = pd_spec(autoscaling={"kvHighWatermarkPercent": 70, "scaleDownStabilizationSeconds": 60})
    prefill, decode = pool_thresholds(spec, "prefill"), pool_thresholds(spec, "decode")
    assert (prefill.min_replicas, prefill.max_replicas, decode.min_replicas, decode.max_replicas) == (1, 4, 2, 6)
    assert not prefill.scale_on_kv and prefill.ttft_p99_s == 0.5 and prefill.itl_p99_s is None
    assert decode.scale_on_kv and decode.itl_p99_s == 0.05 and decode.ttft_p99_s is None
    assert prefill.kv_high == decode.kv_high == 0.7 and prefill.down_stabilization_s == 60
    assert prefill.scale_to_zero_s is None and decode.scale_to_zero_s is None


def test_a_pool_never_has_a_floor_of_zero_even_when_the_service_would():
    spec = pd_spec(autoscaling={"minReplicas": 0})
    assert pool_thresholds(spec, "prefill").scale_to_zero_s is None
    with pytest.raises(SpecError, match="minReplicas"):
        pd_spec(prefill={"minReplicas": 0, "maxReplicas": 2})


def test_prefill_scales_out_when_its_ttft_p99_passes_the_objective():
    th = pool_thresholds(pd_spec(), "prefill")
    d, obs = ticks(th, 1, [(100, [sample("p", ttft=latency(0, 0, 0.5))]),
                           (101, [sample("p", ttft=latency(90, 10, 0.5))])])
    assert d.target == 2 and d.reason == "TTFT" and "objective 500 ms" in d.message
    assert obs.ttft_p99_s > 0.5


def test_a_few_slow_prefills_are_no_p99():
    th = pool_thresholds(pd_spec(), "prefill")
    d, obs = ticks(th, 1, [(100, [sample("p", ttft=latency(0, 0, 0.5))]),
                           (101, [sample("p", ttft=latency(5, 5, 0.5))])])
    assert d is None and obs.ttft_p99_s is None


def test_prefill_is_not_scaled_on_its_kv_usage_but_on_its_queue():
    th = pool_thresholds(pd_spec(), "prefill")
    d, _ = ticks(th, 1, [(100, [sample("p", kv=0.99)])])
    assert d is None
    d, _ = ticks(th, 1, [(100, [sample("p", kv=0.1, waiting=12)])])
    assert d.target == 2 and d.reason == "QueueDepth"


def test_decode_scales_out_on_kv_sized_to_the_overload_and_on_itl():
    th = pool_thresholds(pd_spec(), "decode")
    d, _ = ticks(th, 2, [(100, [sample("d0", kv=1.0), sample("d1", kv=1.0)])])
    assert d.target == 3 and d.reason == "KVHighWatermark"
    d, _ = ticks(th, 2, [(100, [sample("d0", itl=latency(0, 0, 0.05)), sample("d1", itl=latency(0, 0, 0.05))]),
                         (101, [sample("d0", itl=latency(400, 20, 0.05)), sample("d1", itl=latency(400, 0, 0.05))])])
    assert d.target == 3 and d.reason == "ITL" and "objective 50 ms" in d.message


def test_decode_shedding_scales_it_out():
    th = pool_thresholds(pd_spec(), "decode")
    d, _ = ticks(th, 2, [(100, [sample("d0", shed=3), sample("d1")]), (101, [sample("d0", shed=5), sample("d1")])])
    assert d.reason == "Shedding"


def test_no_second_scale_out_of_a_pool_while_its_new_replicas_start():
    th = pool_thresholds(pd_spec(), "decode")
    d, _ = ticks(th, 3, [(100, [sample("d0", kv=0.95), sample("d1", kv=0.95)])], ready=2)
    assert d is None


def test_a_pool_scales_in_after_the_window_but_not_below_its_minimum():
    spec = pd_spec(autoscaling={"scaleDownStabilizationSeconds": 30})
    th = pool_thresholds(spec, "decode")
    idle = [sample("d0", kv=0.1), sample("d1", kv=0.1), sample("d2", kv=0.1)]
    d, _ = ticks(th, 3, [(100, idle), (131, idle)])
    assert d.target == 2 and d.reason == "KVLowWatermark"
    d, _ = ticks(th, 2, [(100, idle[:2]), (200, idle[:2])])
    assert d is None   # decode's minReplicas is 2
    prefill = pool_thresholds(spec, "prefill")
    d, _ = ticks(prefill, 1, [(100, [sample("p", kv=0.0)]), (200, [sample("p", kv=0.0)])])
    assert d is None   # never below one


def test_prefill_scales_in_only_with_its_ttft_well_under_the_objective():
    th = pool_thresholds(pd_spec(autoscaling={"scaleDownStabilizationSeconds": 30}), "prefill")
    # p99 between half the objective (the low:high watermark share) and the objective: hold.
    near = ((0.2, 0.0), (0.4, 0.0), (0.5, 100.0), (INF, 100.0))
    d, obs = ticks(th, 2, [(100, [sample("a", kv=0.1, ttft=()), sample("b", kv=0.1, ttft=())]),
                           (101, [sample("a", kv=0.1, ttft=near), sample("b", kv=0.1, ttft=near)]),
                           (140, [sample("a", kv=0.1, ttft=near), sample("b", kv=0.1, ttft=near)])])
    assert d is None and 0.25 < obs.ttft_p99_s <= 0.5
    fast = ((0.2, 100.0), (0.5, 100.0), (INF, 100.0))
    d, _ = ticks(th, 2, [(100, [sample("a", kv=0.1), sample("b", kv=0.1)]),
                         (101, [sample("a", kv=0.1, ttft=fast), sample("b", kv=0.1, ttft=fast)]),
                         (140, [sample("a", kv=0.1, ttft=fast), sample("b", kv=0.1, ttft=fast)])])
    assert d.target == 1


def test_an_unreadable_replica_of_a_pool_is_never_idle():
    th = pool_thresholds(pd_spec(autoscaling={"scaleDownStabilizationSeconds": 0}), "decode")
    d, obs = ticks(th, 3, [(100, [sample("d0", kv=0.1), sample("d1", kv=0.1), sample("d2", None, ok=False)]),
                           (200, [sample("d0", kv=0.1), sample("d1", kv=0.1), sample("d2", None, ok=False)])])
    assert d is None and obs.unreadable == ["d2"]


# --- the ratio bound ----------------------------------------------------------------------------


def test_the_band_is_the_ratio_times_the_prefill_replicas_within_the_tolerance():
    band = ratio_band(1, 3, 2, 0.25, 1, 10)    # 6 ± 25%: 4.5..7.5
    assert (band.low, band.high) == (5, 7)
    assert "ratio bound 1:3 (prefill:decode) x 2 prefill replica(s) ± 25%: decode 5..7" == band.text


def test_a_band_narrower_than_a_replica_is_the_nearest_count():
    band = ratio_band(2, 3, 1, 0.0, 1, 10)     # 1.5 exactly
    assert (band.low, band.high) == (2, 2)
    band = ratio_band(3, 1, 1, 0.1, 1, 10)     # 0.33: at least one
    assert (band.low, band.high) == (1, 1)


def test_the_band_is_clamped_into_the_decode_pools_bounds():
    band = ratio_band(1, 4, 3, 0.1, 2, 6)      # 12 ± 10%: 11..13, the pool allows 6
    assert (band.low, band.high) == (6, 6) and "6..6 within the pool's 2..6" in band.text


def decode_th(**autoscaling):
    return pool_thresholds(pd_spec(autoscaling=autoscaling), "decode")


def observed(kv=0.5, waiting=0.0, unreadable=()):
    return Observation(kv_usage=kv, waiting_per_replica=waiting, shed_delta=0, readable=3,
                       unreadable=list(unreadable))


def test_decode_below_the_band_is_raised_at_once():
    d, held = bound_decode(None, 2, RatioBand(4, 5, "band"), decode_th(), observed(), 2)
    assert (d.target, d.reason, held) == (4, "RatioBound", None) and "raised to 4" in d.message


def test_a_decision_within_the_band_stands_and_names_the_band():
    d, held = bound_decode(Decision(4, "KVHighWatermark", "KV usage 90% >= 80%"), 3, RatioBand(3, 5, "the band"),
                           decode_th(), observed(kv=0.9), 3)
    assert d.target == 4 and d.reason == "KVHighWatermark" and d.message.endswith("; the band") and held is None


def test_a_scale_out_past_the_band_is_capped_and_said():
    own = Decision(6, "KVHighWatermark", "KV usage 95% >= 80%")
    d, held = bound_decode(own, 4, RatioBand(3, 5, "the band"), decode_th(), observed(kv=0.95), 4)
    assert d.target == 5 and "capped at 5" in d.message
    assert held == "decode held at 5 replica(s), below the 6 its signals ask for (KVHighWatermark): the band"
    d, held = bound_decode(own, 5, RatioBand(3, 5, "the band"), decode_th(), observed(kv=0.95), 5)
    assert d is None and "held at 5" in held


def test_above_the_band_decode_scales_in_but_keeps_what_its_kv_needs():
    th = decode_th()
    d, _ = bound_decode(None, 6, RatioBand(2, 3, "band"), th, observed(kv=0.2), 6)
    assert (d.target, d.reason) == (3, "RatioBound")
    d, _ = bound_decode(None, 6, RatioBand(2, 3, "band"), th, observed(kv=0.6), 6)   # 6 x 0.6 / 0.8 = 4.5
    assert d.target == 5 and "KV usage 60% needs 5" in d.message
    d, held = bound_decode(None, 6, RatioBand(2, 3, "band"), th, observed(kv=0.75), 6)
    assert d is None and "fewer would put its mean KV usage over the 80% watermark" in held


def test_above_the_band_decode_is_not_scaled_in_under_pressure_or_blind():
    th = decode_th()
    d, held = bound_decode(None, 6, RatioBand(2, 3, "band"), th, observed(kv=0.85), 6)
    assert d is None and "above the band (KVHighWatermark)" in held
    d, held = bound_decode(None, 6, RatioBand(2, 3, "band"), th, observed(kv=0.1, unreadable=["d4"]), 6)
    assert d is None and "d4 cannot be read" in held
