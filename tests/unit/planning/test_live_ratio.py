"""The live prefill:decode ratio, pure: the decode pods' finished requests over a window, the
planner's sizing of each pool's replica, and what status.prefillDecodeRatio says (and when it is
rewritten)."""
from __future__ import annotations

import math

import pytest

from gpufleet.autoscale.signals import ReplicaSample, RequestTokens
from gpufleet.autoscale.token_window import RATIO_WINDOW_S, TokenWindow
from gpufleet.planning.distribution import Concurrency, TokenStats, Traffic
from gpufleet.planning.live_ratio import MIN_REQUESTS, LiveRatio, MeasuredDemand, live_ratio, settings_of
from gpufleet.planning.profiles import ProfileSet
from gpufleet.planning.sizing import size_fleet, size_replica
from gpufleet.reconcile.ratio import measured_ratio, ratio_status
from gpufleet_api import parse_spec

INF = float("inf")
STAMP = "2026-01-01T00:00:00Z"


@pytest.fixture
def profiles(round_gpu, round_model):
    return ProfileSet(gpus=(round_gpu,), models=(round_model,))


def pd_spec(prefill=None, decode=None, **over):
    return parse_spec({"model": {"name": "Round-10B"}, "resources": {"gpuProduct": "Round-GPU"},
                       "engine": {"kvTransfer": {"connector": "Nixl"}},
                       "disaggregation": {"prefill": prefill or {}, "decode": decode or {}}, **over})


def flat(tokens: float) -> TokenStats:
    return TokenStats(p50=tokens, p95=tokens, p99=tokens, mean=tokens, max=None)


def demand(rps=10.0, prompt=900, output=200, seconds=60.0):
    return MeasuredDemand(requests=rps * seconds, seconds=seconds, prompt=flat(prompt), output=flat(output))


def test_the_ratio_is_the_planners_for_the_same_traffic(profiles, round_gpu, round_model):
    spec = pd_spec()
    live = live_ratio(spec, demand(), profiles)
    # The planner on the same numbers: 10 requests/s of 900 prompt and 200 output tokens.
    settings = settings_of(spec, 1)
    replica = size_replica(round_gpu, round_model, settings, flat(900), flat(200))
    traffic = Traffic(requests=600, span_seconds=60, window_seconds=60, windows=1, rps_peak=10, rps_trough=10,
                      rps_mean=10, prompt_tokens_per_s_peak=9000, output_tokens_per_s_peak=2000)
    plan = size_fleet(traffic, Concurrency(1, 1, "test"), flat(900), replica, settings)
    assert live.reason == "Measured" and live.decode_per_prefill == pytest.approx(plan.decode_per_prefill)
    # 9,000 prompt tokens/s on a replica that prefills 1e15 x 0.4 / (2 x 1e10) = 20,000: one.
    assert replica.prefill_tokens_per_s == pytest.approx(20_000)
    assert live.prefill == 1 and live.decode == max(1, math.ceil(2000 / replica.decode_tokens_per_s))
    assert (live.requests, live.window_seconds) == (600, 60)
    assert "9000.0 prompt and 2000.0 output tokens/s (600 requests in 60s)" in live.message
    assert "one prefill replica (1 x Round-GPU) prefills 20,000 tokens/s" in live.message


def test_each_pool_is_sized_on_its_own_gpus(profiles):
    one = live_ratio(pd_spec(), demand(rps=100), profiles)
    two = live_ratio(pd_spec(prefill={"resources": {"gpuProduct": "Round-GPU", "gpusPerReplica": 2}}),
                     demand(rps=100), profiles)
    # 90,000 prompt tokens/s: 5 replicas of one GPU, 3 of two.
    assert (one.prefill, two.prefill) == (5, 3) and one.decode == two.decode
    assert two.decode_per_prefill == pytest.approx(2 * one.decode_per_prefill)


def test_more_output_per_prompt_asks_for_more_decode_per_prefill(profiles):
    chat = live_ratio(pd_spec(), demand(rps=100, prompt=900, output=200), profiles)
    summaries = live_ratio(pd_spec(), demand(rps=100, prompt=3000, output=50), profiles)
    assert chat.decode_per_prefill > summaries.decode_per_prefill


@pytest.mark.parametrize("over, fragment", [
    ({"model": {"name": "org/unknown"}}, "spec.model.name org/unknown has no planner profile (known: Round-10B)"),
    ({"resources": {}}, "the prefill pool's GPU is not known: set spec.resources.gpuProduct to a GPU the "
                        "planner knows (Round-GPU)"),
    ({"disaggregation": {"decode": {"resources": {"gpusPerReplica": 1}}}},
     "set spec.disaggregation.decode.resources.gpuProduct"),
    ({"resources": {"gpuProduct": "NVIDIA-B200"}}, "spec.resources.gpuProduct NVIDIA-B200 has no planner profile"),
    ({"resources": {"gpuProduct": "Round-GPU", "migProfile": "1g.10gb"}}, "the planner has no profile of a MIG"),
    ({"engine": {"runtime": "vllm-cpu", "kvCache": {"blockSize": 32}, "kvTransfer": {
        "connector": "SharedStorage", "sharedStorage": {"hostPath": {"path": "/kv"}}}}},
     "engine.runtime is vllm-cpu"),
])
def test_no_profile_says_which_field_to_set(profiles, over, fragment):
    base = {"model": {"name": "Round-10B"}, "resources": {"gpuProduct": "Round-GPU"},
            "engine": {"kvTransfer": {"connector": "Nixl"}}, "disaggregation": {}}
    live = live_ratio(parse_spec({**base, **over}), demand(), profiles)
    assert live.reason == "NoProfile" and fragment in live.message and live.prefill is None


def test_a_few_requests_are_no_distribution(profiles):
    assert live_ratio(pd_spec(), None, profiles).reason == "AwaitingTraffic"
    few = live_ratio(pd_spec(), demand(rps=0.1, seconds=60), profiles)
    assert few.reason == "AwaitingTraffic" and f"6 request(s) finished on the decode pods in the last 60s; " \
        f"the ratio needs {MIN_REQUESTS}" == few.message


def test_an_fp8_kv_cache_and_quantized_weights_are_taken_in(profiles):
    plain = live_ratio(pd_spec(), demand(rps=100, prompt=4000, output=1000), profiles)
    fp8 = live_ratio(pd_spec(engine={"kvTransfer": {"connector": "Nixl"}, "kvCache": {"dtype": "fp8"},
                                     "quantization": "fp8"}), demand(rps=100, prompt=4000, output=1000), profiles)
    assert fp8.decode <= plain.decode and fp8.decode_per_prefill < plain.decode_per_prefill


# --- the window of finished requests -------------------------------------------------------------


def finished(requests, prompt=100, output=10):
    return RequestTokens(requests, requests * prompt, requests * output, ((prompt, requests), (INF, requests)),
                         ((output, requests), (INF, requests)))


def read(pod, requests, ok=True, **lengths):
    return ReplicaSample(pod=pod, ok=ok, request_tokens=finished(requests, **lengths) if ok else RequestTokens())


def test_the_window_counts_what_each_pod_finished_since_its_previous_read():
    w = TokenWindow().advance([read("a", 1000)], 0.0)       # history before the operator looked: not counted
    assert w.demand(0.0) is None
    w = w.advance([read("a", 1010), read("b", 500)], 1.0)   # b's first read is its baseline
    w = w.advance([read("a", 1020), read("b", 505)], 2.0)
    d = w.demand(2.0)
    assert (d.requests, d.seconds, d.prompt.mean, d.output.mean) == (25, 2.0, 100, 10)
    assert d.prompt_tokens_per_s == 1250 and d.output_tokens_per_s == 125


def test_a_restarted_engine_counts_from_zero_and_an_unreadable_one_keeps_its_counts():
    w = TokenWindow().advance([read("a", 100)], 0.0)
    w = w.advance([read("a", 3)], 1.0)                       # restarted: 3 since
    w = w.advance([read("a", 0, ok=False)], 2.0)
    w = w.advance([read("a", 13)], 3.0)                      # 10 more, counted when read again
    assert w.demand(3.0).requests == 13


def test_reads_older_than_the_window_fall_out():
    w = TokenWindow().advance([read("a", 0)], 0.0)
    w = w.advance([read("a", 100)], 10.0)
    w = w.advance([read("a", 110)], RATIO_WINDOW_S + 20)
    d = w.demand(RATIO_WINDOW_S + 20)
    assert d.requests == 10 and d.seconds == RATIO_WINDOW_S


def test_the_window_gives_the_lengths_distribution():
    w = TokenWindow().advance([read("a", 0)], 0.0)
    mixed = RequestTokens(100, 90 * 100 + 10 * 4000, 100 * 10, ((100, 90), (5000, 100), (INF, 100)),
                          ((10, 100), (INF, 100)))
    w = w.advance([ReplicaSample(pod="a", ok=True, request_tokens=mixed)], 1.0)
    d = w.demand(1.0)
    assert d.prompt.p50 <= 100 < d.prompt.p99 and d.prompt.mean == 490


# --- status.prefillDecodeRatio ---------------------------------------------------------------------


def measured(prefill=1, decode=3, ratio=2.5, message="m"):
    return LiveRatio("Measured", message, prefill=prefill, decode=decode, decode_per_prefill=ratio, requests=100,
                     window_seconds=300)


def test_the_first_ratio_is_written_and_read_back_for_the_bound():
    written = ratio_status(measured(), None, STAMP)
    assert written == {"reason": "Measured", "message": "m", "time": STAMP, "prefill": 1, "decode": 3,
                       "requests": 100, "windowSeconds": 300, "decodePerPrefill": "2.50"}
    bound = measured_ratio(written)
    assert bound is not None and (bound.prefill, bound.decode) == (1, 3)


def test_new_figures_alone_are_not_rewritten_but_a_moved_ratio_or_new_counts_are():
    before = ratio_status(measured(), None, STAMP)
    assert ratio_status(measured(ratio=2.6, message="newer figures"), before, STAMP) is None
    assert ratio_status(measured(ratio=2.8), before, STAMP)["decodePerPrefill"] == "2.80"
    assert ratio_status(measured(decode=4, ratio=2.6), before, STAMP)["decode"] == 4


def test_a_measured_ratio_stays_while_traffic_is_too_thin_but_a_missing_profile_replaces_it():
    before = ratio_status(measured(), None, STAMP)
    assert ratio_status(LiveRatio("AwaitingTraffic", "3 requests"), before, STAMP) is None
    gone = ratio_status(LiveRatio("NoProfile", "set gpuProduct"), before, STAMP)
    assert gone == {"reason": "NoProfile", "message": "set gpuProduct", "time": STAMP}
    assert measured_ratio(gone) is None
    assert ratio_status(LiveRatio("NoProfile", "set gpuProduct"), gone, STAMP) is None
