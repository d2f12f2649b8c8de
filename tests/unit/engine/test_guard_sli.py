"""SLIs counted at the source: each request judged good or bad against the service's objectives."""
from __future__ import annotations

import aiohttp

from gpufleet_api.guard.guard_config import SLOConfig, parse
from gpufleet_api.guard.guard_metrics import Reason
from gpufleet_engine.admission.sli import Request, judge, judge_refusal
from gpufleet_engine.serving.prometheus import GuardMetrics
from tests.unit.engine.test_guard_proxy import metrics, sample, until

SLO = SLOConfig(ttft_p99_seconds=2.0, itl_p99_seconds=0.1, request_p99_seconds=30.0)


def test_a_first_token_within_the_objective_is_good_and_one_past_it_bad():
    # 1.9 s and 2.1 s share the (1, 2.5] bucket a histogram would interpolate across.
    assert judge(SLO, Request(True, "ok", 5.0, ttft_seconds=1.9)) == [("availability", 1, 1), ("ttft", 1, 1)]
    assert judge(SLO, Request(True, "ok", 5.0, ttft_seconds=2.1)) == [("availability", 1, 1), ("ttft", 0, 1)]


def test_streamed_gaps_count_one_event_each():
    assert ("itl", 47, 50) in judge(SLO, Request(True, "ok", 5.0, ttft_seconds=0.5, gaps=50, late_gaps=3))


def test_a_stream_that_never_produced_a_token_is_bad_for_latency_and_availability():
    assert judge(SLO, Request(True, "timeout", 300.0)) == [("availability", 0, 1), ("ttft", 0, 1)]
    assert judge(SLO, Request(True, "error", 0.2)) == [("availability", 0, 1), ("ttft", 0, 1)]


def test_non_streaming_requests_have_a_latency_sli():
    assert judge(SLO, Request(False, "ok", 29.0)) == [("availability", 1, 1), ("latency", 1, 1)]
    assert judge(SLO, Request(False, "ok", 31.0)) == [("availability", 1, 1), ("latency", 0, 1)]
    assert judge(SLO, Request(False, "timeout", 300.0)) == [("availability", 0, 1), ("latency", 0, 1)]


def test_client_errors_count_nowhere_and_a_client_leaving_counts_only_after_the_objective():
    assert judge(SLO, Request(True, "invalid", 0.1)) == []
    assert judge(SLO, Request(True, "cancelled", 1.0)) == []
    assert judge(SLO, Request(True, "cancelled", 10.0)) == [("ttft", 0, 1)]
    assert judge(SLO, Request(False, "cancelled", 60.0)) == [("latency", 0, 1)]


def test_queue_timeouts_and_engine_down_are_bad_but_deliberate_sheds_are_not_counted():
    assert judge_refusal(Reason.QUEUE_TIMEOUT, True) == [("availability", 0, 1), ("ttft", 0, 1)]
    assert judge_refusal(Reason.QUEUE_TIMEOUT, False) == [("availability", 0, 1), ("latency", 0, 1)]
    assert judge_refusal(Reason.ENGINE_DOWN, None) == [("availability", 0, 1)]
    for reason in (Reason.KV_WATERMARK, Reason.QUEUE_FULL, Reason.CONTEXT_LENGTH, Reason.DRAINING,
                   Reason.INVALID_REQUEST):
        assert judge_refusal(reason, True) == []


def test_histograms_have_a_bucket_at_each_objective():
    text = GuardMetrics(["interactive"], slo=SLOConfig(ttft_p99_seconds=2.0, itl_p99_seconds=0.075,
                                                       request_p99_seconds=45.0)).render().decode()
    assert 'gpufleet_guard_ttft_seconds_bucket{class="interactive",le="2.0"}' in text
    assert 'gpufleet_guard_itl_seconds_bucket{class="interactive",le="0.075"}' in text
    assert 'gpufleet_guard_request_seconds_bucket{class="interactive",le="45.0"}' in text


def test_guard_json_carries_the_objectives():
    doc = {"servedModelName": "m", "tokenizer": "t",
           "slo": {"ttftP99Seconds": 0.5, "itlP99Seconds": 0.05, "requestP99Seconds": 20}}
    assert parse(doc).slo == SLOConfig(0.5, 0.05, 20.0)
    assert parse({"servedModelName": "m", "tokenizer": "t"}).slo == SLOConfig()


async def test_a_timed_out_stream_and_a_slow_answer_are_counted_bad(guard_factory, fake_vllm):
    fake_vllm.token_delay = 0.1                  # 50 tokens take 5 s: past the 0.3 s timeout
    guard = await guard_factory(requestTimeoutSeconds=0.3, slo={"requestP99Seconds": 0.05})
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 50, "stream": True}) as r:
            await r.read()
        await until(lambda: fake_vllm.disconnects == 1, "vLLM to see the timed-out request go")
        fake_vllm.token_delay = 0.02             # 5 tokens take 0.1 s: answered, past the 0.05 s objective
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}) as r:
            assert r.status == 200
        text = await metrics(s, guard)
    standard = {"class": "standard"}
    assert sample(text, "gpufleet_guard_sli_events_total", **standard, sli="availability") == 2
    assert sample(text, "gpufleet_guard_sli_good_events_total", **standard, sli="availability") == 1
    assert sample(text, "gpufleet_guard_sli_events_total", **standard, sli="latency") == 1
    assert sample(text, "gpufleet_guard_sli_good_events_total", **standard, sli="latency") == 0
    # The stream's first token came before the timeout, so its TTFT was good.
    assert sample(text, "gpufleet_guard_sli_events_total", **standard, sli="ttft") == 1
