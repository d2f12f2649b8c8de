"""The scaling policy on synthetic replica samples."""
from gpufleet.autoscale.policy import PolicyState, Thresholds, decide, least_loaded
from gpufleet.autoscale.signals import ReplicaSample

TH = Thresholds(min_replicas=1, max_replicas=4, kv_high=0.8, kv_low=0.4, queue_depth=8,
                up_stabilization_s=0, down_stabilization_s=30, max_step=2)


def s(pod, kv, waiting=0.0, shed=0.0, ok=True, queue=()):
    return ReplicaSample(pod=pod, ok=ok, kv_usage=kv, engine_waiting=waiting, shed_total=shed,
                         error=None if ok else "timeout", queue_buckets=queue)


def queued(fast, slow):
    """Cumulative queue-time buckets: ``fast`` requests waited under 0.5 s, ``slow`` ones 2.5-5 s."""
    return ((0.5, fast), (2.5, fast), (5.0, fast + slow), (float("inf"), fast + slow))


def run(samples, current=1, ready=None, state=None, now=100.0, th=TH):
    return decide(th, current=current, ready=current if ready is None else ready, samples=samples,
                  state=PolicyState() if state is None else state, now=now)


def test_kv_above_high_watermark_scales_out_at_once():
    d, _, _ = run([s("a", 0.85)])
    assert d.target == 2 and d.reason == "KVHighWatermark"


def test_step_is_sized_to_the_overload_but_bounded():
    d, _, _ = run([s("a", 1.0), s("b", 1.0)], current=2)
    assert d.target == 3  # ceil(2 * 1.0 / 0.8) = 3
    big = Thresholds(**{**TH.__dict__, "max_replicas": 20, "max_step": 2})
    d, _, _ = run([s(f"p{i}", 1.0) for i in range(8)], current=8, th=big)
    assert d.target == 10


def test_never_above_max():
    d, _, _ = run([s("a", 0.99)] * 4, current=4)
    assert d is None


def test_shedding_scales_out_even_with_moderate_kv():
    _, state, _ = run([s("a", 0.5, shed=10)])
    d, _, _ = run([s("a", 0.5, shed=14)], state=state, now=101)
    assert d.target == 2 and d.reason == "Shedding"


def test_queue_depth_scales_out():
    d, _, _ = run([s("a", 0.5, waiting=12)])
    assert d.reason == "QueueDepth"


def test_no_second_scale_out_while_new_replicas_start():
    d, _, _ = run([s("a", 0.95)], current=2, ready=1)
    assert d is None


def test_scale_in_only_after_the_stabilization_window():
    d, state, _ = run([s("a", 0.1), s("b", 0.1)], current=2, now=100)
    assert d is None
    d, state, _ = run([s("a", 0.1), s("b", 0.1)], current=2, state=state, now=120)
    assert d is None
    d, state, _ = run([s("a", 0.1), s("b", 0.1)], current=2, state=state, now=131)
    assert d.target == 1 and d.reason == "KVLowWatermark"


def test_a_blip_resets_the_scale_in_window():
    _, state, _ = run([s("a", 0.1), s("b", 0.1)], current=2, now=100)
    _, state, _ = run([s("a", 0.5), s("b", 0.5)], current=2, state=state, now=120)
    d, _, _ = run([s("a", 0.1), s("b", 0.1)], current=2, state=state, now=140)
    assert d is None


def test_unreadable_replica_is_never_taken_for_idle():
    _, state, obs = run([s("a", 0.1), s("b", None, ok=False)], current=2, now=100)
    d, _, obs = run([s("a", 0.1), s("b", None, ok=False)], current=2, state=state, now=200)
    assert d is None and obs.unreadable == ["b"]


def test_nothing_readable_means_no_decision():
    d, _, _ = run([s("a", None, ok=False)], current=2, now=100)
    assert d is None


def test_out_of_bounds_is_corrected():
    d, _, _ = run([s("a", 0.5)], current=6)
    assert d.target == 4 and d.reason == "OutOfBounds"


def test_least_loaded_replica_is_chosen_for_removal():
    assert least_loaded([s("a", 0.6), s("b", 0.2), s("c", None, ok=False)]) == "b"


def test_queue_time_above_the_threshold_scales_out():
    # 1 s threshold by default; of the requests dispatched since the last read, 20% waited 2.5-5 s.
    _, state, _ = run([s("a", 0.5, queue=queued(100, 0))])
    d, _, obs = run([s("a", 0.5, queue=queued(180, 20))], state=state, now=101)
    assert d.target == 2 and d.reason == "QueueTime" and obs.queue_p90_s > 2.5
    assert "p90 queue time" in d.message


def test_queue_time_is_measured_over_recent_requests_only():
    # A long history of slow requests before the first read does not count, nor a pod's own.
    d, state, obs = run([s("a", 0.5, queue=queued(0, 500))])
    assert d is None and obs.queue_p90_s is None
    d, state, obs = run([s("a", 0.5, queue=queued(100, 500))], state=state, now=101)
    assert d is None and obs.queue_p90_s < 0.5
    # Slow ones within the window still count a few ticks later; after the window they do not.
    d, state, obs = run([s("a", 0.5, queue=queued(100, 600))], state=state, now=102,
                        th=Thresholds(**{**TH.__dict__, "up_stabilization_s": 1000}))
    assert obs.queue_p90_s > 1.0
    d, state, obs = run([s("a", 0.5, queue=queued(100, 600))], state=state, now=140)
    assert obs.queue_p90_s is None and d is None


def test_queue_threshold_comes_from_the_spec():
    from gpufleet_api import parse_spec
    spec = parse_spec({"model": {"name": "m"}, "autoscaling": {"queueTimeThresholdMilliseconds": 250}})
    assert Thresholds.from_spec(spec.autoscaling).queue_time_s == 0.25


def test_a_replica_that_never_becomes_ready_stops_blocking_scale_out_after_the_grace():
    th = Thresholds(**{**TH.__dict__, "not_ready_grace_s": 600})
    d, state, obs = run([s("a", 0.95), s("b", 0.95)], current=3, ready=2, th=th, now=100)
    assert d is None and not obs.on_ready_only and obs.not_ready == 1
    d, state, obs = run([s("a", 0.95), s("b", 0.95)], current=3, ready=2, th=th, state=state, now=701)
    assert obs.on_ready_only and d.target == 4 and d.reason == "KVHighWatermark"


def test_scale_in_counts_the_ready_replicas_after_the_grace():
    th = Thresholds(**{**TH.__dict__, "not_ready_grace_s": 600, "down_stabilization_s": 0})
    d, state, _ = run([s("a", 0.1), s("b", 0.1)], current=3, ready=2, th=th, now=100)
    assert d is None      # two of three readable: might be a replica still loading
    d, state, _ = run([s("a", 0.1), s("b", 0.1)], current=3, ready=2, th=th, state=state, now=700)
    assert d.target == 2 and d.reason == "KVLowWatermark"


def test_the_not_ready_clock_restarts_once_every_replica_is_ready():
    th = Thresholds(**{**TH.__dict__, "not_ready_grace_s": 600})
    _, state, _ = run([s("a", 0.5)], current=2, ready=1, th=th, now=100)
    _, state, _ = run([s("a", 0.5), s("b", 0.5)], current=2, ready=2, th=th, state=state, now=500)
    _, _, obs = run([s("a", 0.5)], current=2, ready=1, th=th, state=state, now=800)
    assert not obs.on_ready_only and obs.not_ready_seconds == 0
