"""Sizing on hand-computed cases (the round profiles of conftest.py)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from gpufleet.planning.distribution import Concurrency, TokenStats, Traffic
from gpufleet.planning.errors import SizingError
from gpufleet.planning.planner import plan_from_log
from gpufleet.planning.profiles import ModelProfile, ProfileSet
from gpufleet.planning.requests import parse_request_log
from gpufleet.planning.sizing import replicas_for_ttft, size_fleet, size_replica, ttft_p99_seconds


def flat(tokens: float) -> TokenStats:
    return TokenStats(p50=tokens, p95=tokens, p99=tokens, mean=tokens, max=tokens)


PROMPT, OUTPUT = flat(900), flat(200)      # mean decode context = 900 + 200 / 2 = 1,000 tokens


def test_replica_capacity(round_gpu, round_model, round_settings):
    r = size_replica(round_gpu, round_model, round_settings, PROMPT, OUTPUT)
    assert r.kv_bytes_per_token == 20_000
    assert r.kv_pool_bytes == pytest.approx(100e9 * 0.8 - 20e9)            # 60 GB
    assert r.kv_usable_bytes == pytest.approx(60e9 * 0.75)                  # 45 GB after the 25 % watermark
    assert r.kv_usable_tokens == 2_250_000
    assert r.prefill_tokens_per_s == pytest.approx(1e15 * 0.5 / (2 * 10e9))  # 25,000
    assert r.decode_context_tokens == 1000
    assert r.batch_limits == {
        "KV cache": 2250,                                   # 2,250,000 ÷ 1,000
        "ITL p99 SLO": 1500,                                # (0.1 s × 5e11 B/s − 2e10) ÷ (1,000 × 20,000)
        "engine maxNumSeqs": 250,
        "guard maxConcurrency": 1000,
    }
    assert (r.decode_batch, r.decode_batch_bound) == (250, "engine maxNumSeqs")
    # (2e10 + 250 × 1,000 × 20,000) ÷ 5e11 = 0.05 s per step → 250 ÷ 0.05 = 5,000 tok/s.
    assert r.decode_step_seconds == pytest.approx(0.05)
    assert r.decode_tokens_per_s == pytest.approx(5000)
    assert r.decode_bound == "memory bandwidth"


def test_compute_caps_decode_at_large_batches(round_gpu, round_model, round_settings):
    # Short contexts (100 + 20 ÷ 2 = 110 tokens) and a lax ITL SLO: bandwidth would allow
    # 2,000 ÷ ((2e10 + 2,000 × 110 × 20,000) ÷ 5e11) = 40,984 tok/s, compute only 25,000.
    s = dataclasses.replace(round_settings, itl_p99_seconds=1.0, max_num_seqs=2000, max_concurrency=2000)
    r = size_replica(round_gpu, round_model, s, flat(100), flat(20))
    assert r.decode_batch == 2000
    assert r.decode_bound == "compute"
    assert r.decode_tokens_per_s == pytest.approx(r.prefill_tokens_per_s)


def peak_traffic(rps: float, prompt: float, output: float) -> Traffic:
    return Traffic(requests=int(rps * 10), span_seconds=10, window_seconds=10, windows=1, rps_peak=rps,
                   rps_trough=rps, rps_mean=rps, prompt_tokens_per_s_peak=rps * prompt,
                   output_tokens_per_s_peak=rps * output)


def test_fleet_and_prefill_decode_ratio(round_gpu, round_model, round_settings):
    replica = size_replica(round_gpu, round_model, round_settings, PROMPT, OUTPUT)
    traffic = peak_traffic(100, 900, 200)                 # 90,000 prompt tok/s, 20,000 output tok/s
    in_flight = Concurrency(requests_peak=200, tokens_peak=200 * 1100, method="test")
    fleet = size_fleet(traffic, in_flight, PROMPT, replica, round_settings)

    assert fleet.kv_demand_bytes == 220_000 * 20_000
    assert fleet.replicas_by_kv == 1                      # 4.4 GB of 45 GB
    # 90,000 ÷ 25,000 = 3.6 prefill replicas + 20,000 ÷ 5,000 = 4.0 decode replicas of work.
    assert fleet.prefill_replica_units == pytest.approx(3.6)
    assert fleet.decode_replica_units == pytest.approx(4.0)
    assert fleet.replicas_by_throughput == 8
    assert fleet.replicas_by_concurrency == 1             # 200 ÷ min(250, 1000)
    assert fleet.replicas_by_ttft == 9
    assert (fleet.replicas, fleet.binding, fleet.gpus) == (9, "TTFT p99 SLO", 9)
    assert fleet.problems == []

    # prefill:decode from token throughput: 3.6 : 4.0 = 1 : 10/9.
    assert fleet.decode_per_prefill == pytest.approx(10 / 9)
    # Not the time share of a request's latency (36 ms of prefill vs 200 × 50 ms of decode = 1 : 278).
    latency_share = (200 * replica.decode_step_seconds) / (900 / replica.prefill_tokens_per_s)
    assert latency_share == pytest.approx(277.78, abs=0.01)
    # Dedicated prefill replicas need ceil(3.6) = 4 (at 4 the M/M/1 TTFT is 1.66 s ≤ 2 s); decode ceil(4.0) = 4.
    assert (fleet.prefill_replicas_disaggregated, fleet.decode_replicas_disaggregated) == (4, 4)


def test_ttft_prediction_by_hand(round_gpu, round_model, round_settings):
    replica = size_replica(round_gpu, round_model, round_settings, PROMPT, OUTPUT)
    traffic = peak_traffic(100, 900, 200)
    # 8 replicas: λ = 12.5/s; decode takes 20,000 ÷ 8 ÷ 5,000 = 50 % of the GPU;
    # μ = (1 − 0.5) ÷ (900 ÷ 25,000 s) = 13.89/s; ρ = 0.9.
    mu = 0.5 / 0.036
    expected = math.log(100 * 12.5 / mu) / (mu - 12.5) + 0.036 / 0.5
    assert ttft_p99_seconds(8, traffic, PROMPT, replica) == pytest.approx(expected)
    assert expected > 2.0
    assert ttft_p99_seconds(9, traffic, PROMPT, replica) <= 2.0
    # Too few replicas: the queue never drains.
    assert ttft_p99_seconds(7, traffic, PROMPT, replica) == math.inf
    assert replicas_for_ttft(2.0, traffic, PROMPT, replica) == 9


def test_ttft_slo_that_no_replica_count_meets(round_gpu, round_model, round_settings):
    replica = size_replica(round_gpu, round_model, round_settings, PROMPT, OUTPUT)
    s = dataclasses.replace(round_settings, ttft_p99_seconds=0.03)     # the p99 prompt alone takes 36 ms
    fleet = size_fleet(peak_traffic(1, 900, 200), Concurrency(1, 1100, "test"), PROMPT, replica, s)
    assert fleet.replicas_by_ttft is None
    assert len(fleet.problems) == 1
    assert "cannot be met by adding replicas" in fleet.problems[0]
    assert "36 ms to prefill" in fleet.problems[0]


def test_itl_slo_unreachable_even_at_batch_one(round_gpu, round_model, round_settings):
    s = dataclasses.replace(round_settings, itl_p99_seconds=0.01)      # reading the weights takes 40 ms
    with pytest.raises(SizingError, match=r"one decode step takes 40.0 ms.*10 ms ITL p99 SLO; change --tensor"):
        size_replica(round_gpu, round_model, s, PROMPT, OUTPUT)


@pytest.mark.parametrize("gpu, tp", [("H100-80GB", 2), ("A100-80GB", 2), ("L4", 8)])
def test_auto_tensor_parallel_for_70b(gpu, tp, round_settings):
    profiles = ProfileSet()
    s = dataclasses.replace(round_settings, tensor_parallel=None, gpu_memory_utilization=0.9,
                            kv_watermark_percent=15, bandwidth_efficiency=0.7)
    replica = size_replica(profiles.gpu(gpu), profiles.model("Llama-3.1-70B"), s, flat(2000), flat(500))
    assert replica.tensor_parallel == tp


def test_given_tensor_parallel_too_small(round_settings):
    profiles = ProfileSet()
    s = dataclasses.replace(round_settings, tensor_parallel=1, gpu_memory_utilization=0.9)
    with pytest.raises(SizingError, match=r"131.4 GiB of weights leave 0.00 GiB.*change --tensor-parallel"):
        size_replica(profiles.gpu("H100-80GB"), profiles.model("Llama-3.1-70B"), s, PROMPT, OUTPUT)


def test_tensor_parallel_must_fit_kv_heads(round_settings):
    profiles = ProfileSet()
    s = dataclasses.replace(round_settings, tensor_parallel=2, gpu_memory_utilization=0.9)
    with pytest.raises(SizingError, match=r"does not divide the model's 3 KV heads"):
        size_replica(profiles.gpu("L4"), profiles.model("SmolLM2-135M"), s, PROMPT, OUTPUT)


def test_model_that_fits_nowhere(round_settings):
    huge = ModelProfile("Huge", 2_000_000_000_000, layers=100, kv_heads=8, head_dim=128, source="test")
    s = dataclasses.replace(round_settings, tensor_parallel=None)
    with pytest.raises(SizingError, match=r"Huge cannot be served on up to 8 × L4"):
        size_replica(ProfileSet().gpu("L4"), huge, s, PROMPT, OUTPUT)


def test_plan_of_a_constant_load(round_gpu, round_model, round_settings, constant_load, as_lines):
    # 10 RPS for 60 s, 500-token prompts, 100-token outputs, 2 s each.
    log = parse_request_log(as_lines(constant_load(10, 60, 500, 100, 2.0)), name="const.jsonl")
    plan = plan_from_log(log, round_gpu, round_model, round_settings, window_seconds=60)
    assert plan.concurrency.requests_peak == 20
    assert plan.concurrency.tokens_peak == 12_000
    assert plan.fleet.kv_demand_bytes == 12_000 * 20_000
    assert (plan.traffic.rps_peak, plan.traffic.rps_trough) == (10, 10)
    assert plan.fleet.replicas == 1
    assert plan.notes == []

    llama = ProfileSet().model("Llama-3.1-8B")
    on_llama = plan_from_log(log, round_gpu, llama, round_settings, window_seconds=60)
    assert on_llama.fleet.kv_demand_bytes == 12_000 * 131_072


def test_missing_durations_are_estimated_and_said_so(round_gpu, round_model, round_settings, constant_load,
                                                     as_lines):
    log = parse_request_log(as_lines(constant_load(10, 60, 900, 200, None)), name="nodur.jsonl")
    plan = plan_from_log(log, round_gpu, round_model, round_settings, window_seconds=60)
    # Each request: 900 ÷ 25,000 s of prefill + 200 × 50 ms of decode = 10.036 s; one arrives every 0.1 s.
    assert plan.concurrency.requests_peak == 101
    assert plan.concurrency.tokens_peak == 101 * 1100
    assert "600 of 600 durations estimated from the profile" in plan.concurrency.method
    assert any(n.startswith("600 of 600 requests had no duration") for n in plan.notes)
