"""Sizing: one replica's KV capacity and token throughput, then the replicas a
distribution needs and the prefill:decode ratio for disaggregated serving.

The throughput model is a roofline. Prefill is compute-bound: each prompt token
costs 2 × params FLOPs, done at an assumed model-FLOPs utilisation (MFU).
Decode is bandwidth-bound: each step reads the weights once for the whole batch
plus every running sequence's KV cache, so batching amortises the weights
until the batch is capped by the KV pool, the inter-token-latency SLO, or the
engine's and guard's sequence limits; compute caps it from above.
docs/planning.md derives every formula.
"""
from __future__ import annotations

import dataclasses
import math

from .distribution import Concurrency, TokenStats, Traffic
from .errors import SizingError
from .profiles import GIB, GpuProfile, ModelProfile

TENSOR_PARALLEL_CHOICES = (1, 2, 4, 8)
# What a forward pass achieves of the GPU's peak, when nobody says otherwise (`gpufleet plan`
# --mfu, --bandwidth-efficiency; the operator's live prefill:decode ratio).
DEFAULT_MFU = 0.4
DEFAULT_BANDWIDTH_EFFICIENCY = 0.7
_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class Settings:
    gpu_memory_utilization: float   # share of each GPU's memory vLLM may use (its flag of that name)
    kv_watermark_percent: int       # KV blocks the guard keeps free
    ttft_p99_seconds: float
    itl_p99_seconds: float
    max_num_seqs: int               # vLLM's batch limit
    max_concurrency: int            # requests the guard lets into the engine at once
    mfu: float                      # share of peak FLOP/s a forward pass achieves
    bandwidth_efficiency: float     # share of peak HBM bandwidth a decode step achieves
    tensor_parallel: int | None = None   # None: the smallest that serves the p99 request


@dataclasses.dataclass(frozen=True)
class ReplicaModel:
    tensor_parallel: int
    weights_bytes: float
    kv_bytes_per_token: float
    kv_pool_bytes: float            # TP × GPU memory × utilisation − weights
    kv_usable_bytes: float          # the pool less the guard's watermark
    kv_usable_tokens: int
    prefill_tokens_per_s: float
    decode_context_tokens: float    # mean context of a decoding sequence
    batch_limits: dict[str, int]    # each cap on the decode batch
    decode_batch: int
    decode_batch_bound: str         # the cap that set decode_batch
    decode_step_seconds: float
    decode_tokens_per_s: float
    decode_bound: str               # "memory bandwidth" or "compute"


@dataclasses.dataclass(frozen=True)
class FleetPlan:
    kv_demand_bytes: float
    replicas_by_kv: int
    replicas_by_throughput: int
    replicas_by_ttft: int | None    # None: no replica count meets the TTFT SLO
    replicas_by_concurrency: int
    replicas: int
    binding: str
    gpus: int
    ttft_p99_seconds: float         # predicted at `replicas`
    prefill_replica_units: float    # peak prompt tokens/s ÷ one replica's prefill tokens/s
    decode_replica_units: float     # peak output tokens/s ÷ one replica's decode tokens/s
    prefill_replicas_disaggregated: int
    decode_replicas_disaggregated: int
    problems: list[str]

    @property
    def decode_per_prefill(self) -> float:
        return self.decode_replica_units / self.prefill_replica_units if self.prefill_replica_units else math.inf


def _ceil(x: float) -> int:
    # 3.0000000001 replicas of demand is 3 replicas, not 4.
    return max(0, math.ceil(x - _EPS))


def kv_pool_bytes(gpu: GpuProfile, model: ModelProfile, tensor_parallel: int, utilization: float) -> float:
    return tensor_parallel * gpu.memory_bytes * utilization - model.weights_bytes


def prefill_tokens_per_s(gpu: GpuProfile, model: ModelProfile, tensor_parallel: int, mfu: float) -> float:
    return tensor_parallel * gpu.dense_flops * mfu / (2 * model.params)


def decode_step_seconds(batch: int, gpu: GpuProfile, model: ModelProfile, tensor_parallel: int,
                        context_tokens: float, bandwidth_efficiency: float) -> float:
    read = model.weights_bytes + batch * context_tokens * model.kv_bytes_per_token
    return read / (tensor_parallel * gpu.hbm_bytes_per_s * bandwidth_efficiency)


def size_replica(gpu: GpuProfile, model: ModelProfile, settings: Settings,
                 prompt: TokenStats, output: TokenStats) -> ReplicaModel:
    """One replica's capacity. Picks the tensor-parallel size when not given."""
    if settings.tensor_parallel is not None:
        problem = _replica_problem(gpu, model, settings, settings.tensor_parallel, prompt, output)
        if problem:
            raise SizingError(problem + "; change --tensor-parallel (leave it out to pick the smallest that "
                                        "works) or choose a larger GPU")
        return _replica(gpu, model, settings, settings.tensor_parallel, prompt, output)
    for tp in TENSOR_PARALLEL_CHOICES:
        problem = _replica_problem(gpu, model, settings, tp, prompt, output)
        if not problem:
            return _replica(gpu, model, settings, tp, prompt, output)
    raise SizingError(f"{model.name} cannot be served on up to {TENSOR_PARALLEL_CHOICES[-1]} × {gpu.name}: "
                      f"{problem}; choose a larger GPU, a quantized model (bytesPerParam), or looser SLOs")


def replica_at(gpu: GpuProfile, model: ModelProfile, settings: Settings, tensor_parallel: int,
               prompt: TokenStats, output: TokenStats) -> ReplicaModel:
    """One replica's capacity on ``tensor_parallel`` GPUs, without asking whether the planner would
    choose that size: for engines that already run there (the operator's live ratio)."""
    return _replica(gpu, model, settings, tensor_parallel, prompt, output)


def _replica_problem(gpu, model, settings, tp, prompt, output) -> str | None:
    """Why ``tp`` GPUs cannot serve the model at all, or None."""
    if model.kv_heads % tp and tp % model.kv_heads:
        return (f"tensor parallel {tp} does not divide the model's {model.kv_heads} KV heads "
                "(vLLM needs one to divide the other)")
    pool = kv_pool_bytes(gpu, model, tp, settings.gpu_memory_utilization)
    usable = pool * (1 - settings.kv_watermark_percent / 100)
    p99_tokens = prompt.p99 + output.p99
    if usable < p99_tokens * model.kv_bytes_per_token:
        return (f"on tensor parallel {tp}, {model.weights_bytes / GIB:.1f} GiB of weights leave "
                f"{max(0.0, usable) / GIB:.2f} GiB of KV cache after the watermark, less than the "
                f"{p99_tokens * model.kv_bytes_per_token / GIB:.2f} GiB a p99 request ({p99_tokens:.0f} tokens) needs")
    context = _decode_context(prompt, output)
    one = max(decode_step_seconds(1, gpu, model, tp, context, settings.bandwidth_efficiency),
              1 / prefill_tokens_per_s(gpu, model, tp, settings.mfu))
    if one > settings.itl_p99_seconds:
        return (f"on tensor parallel {tp}, one decode step takes {one * 1000:.1f} ms even for a single "
                f"sequence, above the {settings.itl_p99_seconds * 1000:.0f} ms ITL p99 SLO")
    return None


def _decode_context(prompt: TokenStats, output: TokenStats) -> float:
    # A sequence's KV grows from its prompt to prompt + output while it decodes.
    return max(1.0, prompt.mean + output.mean / 2)


def _replica(gpu, model, settings, tp, prompt, output) -> ReplicaModel:
    pool = kv_pool_bytes(gpu, model, tp, settings.gpu_memory_utilization)
    usable = pool * (1 - settings.kv_watermark_percent / 100)
    usable_tokens = math.floor(usable / model.kv_bytes_per_token)
    context = _decode_context(prompt, output)
    bandwidth = tp * gpu.hbm_bytes_per_s * settings.bandwidth_efficiency
    prefill = prefill_tokens_per_s(gpu, model, tp, settings.mfu)
    # The largest batch whose step still fits the ITL SLO, by bandwidth and by compute.
    itl_batch = min((settings.itl_p99_seconds * bandwidth - model.weights_bytes)
                    / (context * model.kv_bytes_per_token),
                    settings.itl_p99_seconds * prefill)
    limits = {
        "KV cache": math.floor(usable_tokens / context),
        "ITL p99 SLO": math.floor(itl_batch),
        "engine maxNumSeqs": settings.max_num_seqs,
        "guard maxConcurrency": settings.max_concurrency,
    }
    bound = min(limits, key=lambda k: limits[k])
    batch = max(1, limits[bound])
    step = decode_step_seconds(batch, gpu, model, tp, context, settings.bandwidth_efficiency)
    by_bandwidth = batch / step
    # Decode does 2 × params FLOPs per token too; at large batches compute caps it.
    decode = min(by_bandwidth, prefill)
    return ReplicaModel(
        tensor_parallel=tp, weights_bytes=model.weights_bytes, kv_bytes_per_token=model.kv_bytes_per_token,
        kv_pool_bytes=pool, kv_usable_bytes=usable, kv_usable_tokens=usable_tokens,
        prefill_tokens_per_s=prefill, decode_context_tokens=context, batch_limits=limits,
        decode_batch=batch, decode_batch_bound=bound, decode_step_seconds=batch / decode,
        decode_tokens_per_s=decode, decode_bound="memory bandwidth" if by_bandwidth <= prefill else "compute")


def estimated_duration(replica: ReplicaModel, prompt_tokens: float, output_tokens: float) -> float:
    """Arrival to last token on a replica decoding at its planned batch (no queueing)."""
    return prompt_tokens / replica.prefill_tokens_per_s + output_tokens * replica.decode_step_seconds


def ttft_p99_seconds(replicas: int, traffic: Traffic, prompt: TokenStats, replica: ReplicaModel,
                     *, colocated: bool = True) -> float:
    """Predicted p99 time to first token at the peak with ``replicas`` replicas.

    Each replica is an M/M/1 queue for prefill work: Poisson arrivals at
    peak RPS / replicas; prefill runs in the GPU time decode leaves free
    (colocated serving), so the service rate is (1 − decode share) ÷ mean
    prefill time. p99 wait = ln(100ρ) / (μ − λ); the p99 prompt's own prefill
    is added on top. Returns infinity when the queue is unstable.
    """
    decode_share = (traffic.output_tokens_per_s_peak / replicas / replica.decode_tokens_per_s
                    if colocated else 0.0)
    if decode_share >= 1:
        return math.inf
    mean_service = prompt.mean / replica.prefill_tokens_per_s
    p99_service = prompt.p99 / replica.prefill_tokens_per_s / (1 - decode_share)
    if mean_service == 0:
        return p99_service
    arrival = traffic.rps_peak / replicas
    service_rate = (1 - decode_share) / mean_service
    rho = arrival / service_rate
    if rho >= 1:
        return math.inf
    wait = math.log(100 * rho) / (service_rate - arrival) if rho > 0.01 else 0.0
    return wait + p99_service


def replicas_for_ttft(slo_seconds: float, traffic: Traffic, prompt: TokenStats, replica: ReplicaModel,
                      *, colocated: bool = True) -> int | None:
    """Fewest replicas whose predicted TTFT p99 meets the SLO; None if adding
    replicas cannot (the p99 prompt alone takes longer to prefill)."""
    if prompt.p99 / replica.prefill_tokens_per_s >= slo_seconds:
        return None

    def meets(n: int) -> bool:
        return ttft_p99_seconds(n, traffic, prompt, replica, colocated=colocated) <= slo_seconds

    # The prediction falls as replicas are added, so double then bisect.
    hi = 1
    while not meets(hi):
        hi *= 2
    lo = hi // 2 + 1 if hi > 1 else 1
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def size_fleet(traffic: Traffic, concurrency: Concurrency, prompt: TokenStats, replica: ReplicaModel,
               settings: Settings) -> FleetPlan:
    problems: list[str] = []
    kv_demand = concurrency.tokens_peak * replica.kv_bytes_per_token
    by_kv = max(1, _ceil(kv_demand / replica.kv_usable_bytes))
    prefill_units = traffic.prompt_tokens_per_s_peak / replica.prefill_tokens_per_s
    decode_units = traffic.output_tokens_per_s_peak / replica.decode_tokens_per_s
    # Colocated replicas split their time between prefill and decode.
    by_throughput = max(1, _ceil(prefill_units + decode_units))
    slots = min(settings.max_num_seqs, settings.max_concurrency)
    by_concurrency = max(1, _ceil(concurrency.requests_peak / slots))
    by_ttft = replicas_for_ttft(settings.ttft_p99_seconds, traffic, prompt, replica)
    if by_ttft is None:
        problems.append(
            f"TTFT p99 SLO {settings.ttft_p99_seconds * 1000:.0f} ms cannot be met by adding replicas: "
            f"the p99 prompt ({prompt.p99:.0f} tokens) alone takes "
            f"{prompt.p99 / replica.prefill_tokens_per_s * 1000:.0f} ms to prefill on one replica; "
            "raise --tensor-parallel, choose a faster GPU, or cap prompt length")
    candidates = {"KV cache capacity": by_kv, "token throughput": by_throughput,
                  "TTFT p99 SLO": by_ttft or 0, "concurrency slots": by_concurrency}
    binding = max(candidates, key=lambda k: candidates[k])
    replicas = candidates[binding]
    prefill_ttft = replicas_for_ttft(settings.ttft_p99_seconds, traffic, prompt, replica, colocated=False)
    return FleetPlan(
        kv_demand_bytes=kv_demand, replicas_by_kv=by_kv, replicas_by_throughput=by_throughput,
        replicas_by_ttft=by_ttft, replicas_by_concurrency=by_concurrency, replicas=replicas,
        binding=binding, gpus=replicas * replica.tensor_parallel,
        ttft_p99_seconds=ttft_p99_seconds(replicas, traffic, prompt, replica),
        prefill_replica_units=prefill_units, decode_replica_units=decode_units,
        prefill_replicas_disaggregated=max(1, _ceil(prefill_units), prefill_ttft or 0),
        decode_replicas_disaggregated=max(1, _ceil(decode_units), by_kv, by_concurrency),
        problems=problems)
