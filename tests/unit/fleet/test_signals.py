"""Parsing replica metrics the way vLLM and the guard expose them."""
from prometheus_client import CollectorRegistry, generate_latest

from gpufleet.autoscale.signals import bucket_delta, parse_replica, quantile_from_buckets
from gpufleet_api.guard.guard_metrics import ITL_SECONDS
from gpufleet_engine.serving.prometheus import CountedHistogram

VLLM = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.625
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 5.0
"""
OLD_VLLM = """# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""
GUARD = """# TYPE gpufleet_guard_rejections_total counter
gpufleet_guard_rejections_total{class="interactive",reason="kv_watermark"} 4.0
gpufleet_guard_rejections_total{class="standard",reason="context_length"} 9.0
gpufleet_guard_rejections_total{class="background",reason="queue_timeout"} 1.0
gpufleet_guard_rejections_total{class="interactive",reason="exceeds_kv_pool"} 7.0
gpufleet_guard_rejections_total{class="standard",reason="request_too_large"} 2.0
# TYPE gpufleet_guard_queue_depth gauge
gpufleet_guard_queue_depth{class="interactive"} 2.0
gpufleet_guard_queue_depth{class="background"} 1.0
# TYPE gpufleet_guard_ttft_seconds histogram
gpufleet_guard_ttft_seconds_bucket{class="interactive",le="0.1"} 50.0
gpufleet_guard_ttft_seconds_bucket{class="interactive",le="1.0"} 99.0
gpufleet_guard_ttft_seconds_bucket{class="interactive",le="+Inf"} 100.0
gpufleet_guard_ttft_seconds_count{class="interactive"} 100.0
gpufleet_guard_ttft_seconds_sum{class="interactive"} 12.0
# TYPE gpufleet_guard_queue_seconds histogram
gpufleet_guard_queue_seconds_bucket{class="interactive",le="0.1"} 8.0
gpufleet_guard_queue_seconds_bucket{class="interactive",le="+Inf"} 10.0
gpufleet_guard_queue_seconds_bucket{class="background",le="0.1"} 1.0
gpufleet_guard_queue_seconds_bucket{class="background",le="+Inf"} 5.0
"""


def test_parse_replica():
    r = parse_replica("p", VLLM, GUARD)
    assert r.kv_usage == 0.625 and r.engine_waiting == 3 and r.engine_running == 5
    assert r.guard_queued == 3
    # Context-length, can-never-fit and too-large refusals are the request's fault: another
    # replica would refuse them too, so they are not shedding (kv_watermark 4 + queue_timeout 1).
    assert r.shed_total == 5
    assert dict(r.ttft_buckets)[1.0] == 99
    assert r.queue_buckets == ((0.1, 9.0), (float("inf"), 15.0))   # every class together


def test_renamed_kv_metric_of_older_engines_is_understood():
    assert parse_replica("p", OLD_VLLM, "").kv_usage == 0.25


def test_quantiles_from_buckets():
    buckets = [(0.1, 50.0), (1.0, 99.0), (float("inf"), 100.0)]
    assert quantile_from_buckets(buckets, 0.5) == 0.1
    assert abs(quantile_from_buckets(buckets, 0.9) - (0.1 + 0.9 * 40 / 49)) < 1e-9
    assert quantile_from_buckets([(1.0, 0.0)], 0.99) is None


def test_bucket_delta_handles_counter_reset():
    assert bucket_delta(((1.0, 10.0),), ((1.0, 4.0),)) == [(1.0, 6.0)]
    assert bucket_delta(((1.0, 3.0),), ((1.0, 40.0),)) == [(1.0, 3.0)]


def test_only_capacity_refusals_are_shedding():
    from gpufleet_api.guard.guard_metrics import REASONS, SHED_REASONS, Reason

    assert SHED_REASONS == {Reason.KV_WATERMARK, Reason.QUEUE_TIMEOUT, Reason.QUEUE_FULL, Reason.TTFT_LIMIT}
    assert Reason.EXCEEDS_KV_POOL in REASONS and Reason.EXCEEDS_KV_POOL not in SHED_REASONS


# vLLM 0.32's per-request token histograms as its /metrics shows them (one engine): two requests
# finished, of 300 and 40 prompt tokens, with 20 and 120 output tokens.
VLLM_TOKENS = """# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_sum{engine="0",model_name="tiny"} 340.0
vllm:request_prompt_tokens_bucket{engine="0",le="50.0",model_name="tiny"} 1.0
vllm:request_prompt_tokens_bucket{engine="0",le="500.0",model_name="tiny"} 2.0
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="tiny"} 2.0
vllm:request_prompt_tokens_count{engine="0",model_name="tiny"} 2.0
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_sum{engine="0",model_name="tiny"} 140.0
vllm:request_generation_tokens_bucket{engine="0",le="50.0",model_name="tiny"} 1.0
vllm:request_generation_tokens_bucket{engine="0",le="500.0",model_name="tiny"} 2.0
vllm:request_generation_tokens_bucket{engine="0",le="+Inf",model_name="tiny"} 2.0
vllm:request_generation_tokens_count{engine="0",model_name="tiny"} 2.0
"""


def test_the_finished_requests_token_counts_are_read_from_vllm():
    tokens = parse_replica("p", VLLM + VLLM_TOKENS, "").request_tokens
    assert (tokens.requests, tokens.prompt_sum, tokens.output_sum) == (2, 340, 140)
    assert tokens.prompt_buckets == ((50.0, 1.0), (500.0, 2.0), (float("inf"), 2.0))
    assert parse_replica("p", VLLM, "").request_tokens.requests == 0   # an engine before any finished


def test_the_guards_itl_histogram_is_read_as_the_guard_exposes_it():
    registry = CollectorRegistry()
    itl = CountedHistogram(ITL_SECONDS, "gaps", "class", (0.05, 0.1), registry)
    itl.labels("interactive").add([3, 1, 1], 0.4)
    itl.labels("background").add([2, 0, 0], 0.02)
    r = parse_replica("p", VLLM, generate_latest(registry).decode())
    assert r.itl_buckets == ((0.05, 5.0), (0.1, 6.0), (float("inf"), 7.0))
