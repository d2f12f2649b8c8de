"""From a request log or a Prometheus sample to a plan, with every assumption
named. Pure: the caller reads the file or queries Prometheus."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from . import distribution as dist
from .distribution import PrometheusSample
from .profiles import GpuProfile, ModelProfile
from .requests import RequestLog
from .sizing import (
    TENSOR_PARALLEL_CHOICES,
    FleetPlan,
    ReplicaModel,
    Settings,
    estimated_duration,
    size_fleet,
    size_replica,
)


@dataclasses.dataclass(frozen=True)
class Assumption:
    name: str
    value: str
    source: str


@dataclasses.dataclass(frozen=True)
class Plan:
    source: str
    gpu: GpuProfile
    model: ModelProfile
    settings: Settings
    prompt: dist.TokenStats
    output: dist.TokenStats
    traffic: dist.Traffic
    concurrency: dist.Concurrency
    replica: ReplicaModel
    fleet: FleetPlan
    assumptions: list[Assumption]
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite numbers become null."""
        out = _finite(dataclasses.asdict(self))
        out["fleet"]["decode_per_prefill"] = _finite(self.fleet.decode_per_prefill)
        return out


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def plan_from_log(log: RequestLog, gpu: GpuProfile, model: ModelProfile, settings: Settings, *,
                  window_seconds: float, sources: Mapping[str, str] | None = None) -> Plan:
    reqs = log.requests
    prompt = dist.token_stats([r.prompt_tokens for r in reqs])
    output = dist.token_stats([r.output_tokens for r in reqs])
    replica = size_replica(gpu, model, settings, prompt, output)
    estimated = sum(r.duration is None for r in reqs)
    # A request without a duration is assumed to run as fast as the planned replica would serve it.
    intervals = [(r.start, r.duration if r.duration is not None
                  else estimated_duration(replica, r.prompt_tokens, r.output_tokens),
                  r.prompt_tokens + r.output_tokens) for r in reqs]
    method = "sweep over each request's arrival + duration"
    if estimated:
        method += f" ({estimated} of {len(reqs)} durations estimated from the profile)"
    concurrency = dist.concurrency(intervals, method)
    traffic = dist.traffic([r.start for r in reqs], [r.prompt_tokens for r in reqs],
                           [r.output_tokens for r in reqs], window_seconds)
    fleet = size_fleet(traffic, concurrency, prompt, replica, settings)

    notes = [f"{n} line(s) skipped: {reason}" for reason, n in log.skipped.items()]
    notes += [f"skipped: {p}" for p in log.problems]
    if log.naive_timestamps:
        notes.append(f"{log.naive_timestamps} timestamp(s) had no UTC offset and were read as UTC")
    if estimated:
        notes.append(f"{estimated} of {len(reqs)} requests had no duration; estimated as prompt ÷ prefill "
                     f"tokens/s + output × decode step ({replica.decode_step_seconds * 1000:.1f} ms)")
    method_rows = [
        Assumption("percentiles", "nearest rank (an observed value)", "planner model"),
        Assumption("request timestamps", "arrival time; durations run from arrival to last token", "log format"),
    ]
    return _plan(f"request log {log.name} ({log.format}, {len(reqs)} requests)", gpu, model, settings,
                 prompt, output, traffic, concurrency, replica, fleet, sources or {}, method_rows, notes)


def plan_from_prometheus(sample: PrometheusSample, gpu: GpuProfile, model: ModelProfile, settings: Settings, *,
                         sources: Mapping[str, str] | None = None) -> Plan:
    prompt, output, traffic = sample.prompt, sample.output, sample.traffic
    replica = size_replica(gpu, model, settings, prompt, output)
    if sample.concurrent_requests_peak is not None:
        requests_peak = sample.concurrent_requests_peak
        method = "Prometheus: peak of vllm:num_requests_running + vllm:num_requests_waiting"
    elif sample.e2e_latency_mean_seconds is not None:
        requests_peak = traffic.rps_peak * sample.e2e_latency_mean_seconds
        method = "Little's law: peak RPS × mean vllm:e2e_request_latency_seconds"
    else:
        requests_peak = traffic.rps_peak * estimated_duration(replica, prompt.mean, output.mean)
        method = "Little's law: peak RPS × mean duration estimated from the profile"
    # Prometheus has no per-request pairs, so each request in flight holds the mean footprint.
    concurrency = dist.Concurrency(requests_peak=requests_peak,
                                   tokens_peak=requests_peak * (prompt.mean + output.mean),
                                   method=method + "; tokens = requests × mean (prompt + output)")
    fleet = size_fleet(traffic, concurrency, prompt, replica, settings)
    method_rows = [
        Assumption("percentiles", "histogram_quantile: linear within vLLM's token buckets", "Prometheus"),
        Assumption("Prometheus window", f"{sample.window_seconds:.0f} s, selector {sample.selector}", "--window"),
    ]
    return _plan(f"Prometheus {sample.url} {sample.selector}, last {sample.window_seconds:.0f} s "
                 f"({traffic.requests} requests)", gpu, model, settings, prompt, output, traffic, concurrency,
                 replica, fleet, sources or {}, method_rows, [])


def _plan(source, gpu, model, settings, prompt, output, traffic, concurrency, replica, fleet, sources,
          method_rows, notes) -> Plan:
    context = prompt.p99 + output.p99
    if model.max_context_tokens and context > model.max_context_tokens:
        notes = notes + [f"p99 prompt + p99 output = {context:.0f} tokens exceeds {model.name}'s "
                         f"{model.max_context_tokens}-token context; the guard rejects or truncates those"]
    room = min(replica.batch_limits["KV cache"], replica.batch_limits["ITL p99 SLO"],
               replica.batch_limits["engine maxNumSeqs"])
    if replica.decode_batch_bound == "guard maxConcurrency" and room > settings.max_concurrency:
        notes = notes + [f"the guard's maxConcurrency ({settings.max_concurrency}) caps the decode batch; KV, "
                         f"the ITL SLO and maxNumSeqs allow {room}, so raising spec.admission.maxConcurrency "
                         "raises each replica's decode tokens/s"]
    rows = (_profile_rows(gpu, model, sources) + _setting_rows(settings, replica, sources)
            + method_rows + _model_rows(traffic))
    return Plan(source=source, gpu=gpu, model=model, settings=settings, prompt=prompt, output=output,
                traffic=traffic, concurrency=concurrency, replica=replica, fleet=fleet, assumptions=rows,
                notes=notes + fleet.problems)


def _profile_rows(gpu: GpuProfile, model: ModelProfile, sources: Mapping[str, str]) -> list[Assumption]:
    gib = 1 << 30
    return [
        Assumption("GPU", gpu.name, sources.get("gpu", "given")),
        Assumption("GPU memory", f"{gpu.memory_bytes / gib:.1f} GiB", gpu.source),
        Assumption("HBM bandwidth", f"{gpu.hbm_bytes_per_s / 1e12:.3g} TB/s", gpu.source),
        Assumption("dense bf16 compute", f"{gpu.dense_flops / 1e12:.4g} TFLOP/s", gpu.source),
        Assumption("model", model.name, sources.get("model", "given")),
        Assumption("parameters", f"{model.params / 1e9:.3f} B", model.source),
        Assumption("layers / KV heads / head dim", f"{model.layers} / {model.kv_heads} / {model.head_dim}",
                   model.source),
        Assumption("bytes per parameter", f"{model.bytes_per_param:g}", model.source),
        Assumption("KV bytes per element", f"{model.kv_bytes_per_element:g}",
                   sources.get("kv_bytes_per_element", model.source)),
        Assumption("KV bytes per token",
                   f"{model.kv_bytes_per_token:.0f} B = 2 × {model.layers} × {model.kv_heads} × "
                   f"{model.head_dim} × {model.kv_bytes_per_element:g}", "derived: 2 (K,V) × layers × KV heads × "
                   "head dim × bytes"),
    ]


def _setting_rows(s: Settings, replica: ReplicaModel, sources: Mapping[str, str]) -> list[Assumption]:
    tp_source = sources.get("tensor_parallel", "given") if s.tensor_parallel is not None else (
        f"auto: smallest of {', '.join(map(str, TENSOR_PARALLEL_CHOICES))} that holds a p99 request "
        "within the ITL SLO")

    def row(name: str, value: str, key: str) -> Assumption:
        return Assumption(name, value, sources.get(key, "given"))

    return [
        Assumption("tensor parallel (GPUs per replica)", str(replica.tensor_parallel), tp_source),
        row("GPU memory utilization", f"{s.gpu_memory_utilization:g}", "gpu_memory_utilization"),
        row("KV watermark", f"{s.kv_watermark_percent} % of the pool kept free", "kv_watermark_percent"),
        row("TTFT p99 SLO", f"{s.ttft_p99_seconds * 1000:g} ms", "ttft_p99_seconds"),
        row("ITL p99 SLO", f"{s.itl_p99_seconds * 1000:g} ms", "itl_p99_seconds"),
        row("engine maxNumSeqs", str(s.max_num_seqs), "max_num_seqs"),
        row("guard maxConcurrency", str(s.max_concurrency), "max_concurrency"),
        row("MFU (prefill and decode compute)", f"{s.mfu:g}", "mfu"),
        row("HBM bandwidth efficiency (decode)", f"{s.bandwidth_efficiency:g}", "bandwidth_efficiency"),
    ]


def _model_rows(traffic: dist.Traffic) -> list[Assumption]:
    model = "planner model (docs/planning.md)"
    return [
        Assumption("rate window", f"{traffic.window_seconds:g} s; peaks and trough are per-window rates",
                   "--rps-window"),
        Assumption("tokens per window", "a request's prompt and output tokens count in its arrival window", model),
        Assumption("concurrent tokens", "every request in flight holds its full prompt + output KV", model),
        Assumption("peak token rates", "prompt and output peaks taken independently (conservative)", model),
        Assumption("KV pool", "TP × GPU memory × utilization − weights; activations and CUDA graphs not "
                   "subtracted; block rounding ignored", model),
        Assumption("prefill", "2 × params FLOPs per prompt token at MFU; attention FLOPs and prefix-cache "
                   "hits ignored", model),
        Assumption("decode step", "(weights + batch × mean context × KV bytes/token) ÷ (TP × HBM × efficiency)",
                   model),
        Assumption("TTFT", "M/M/1 per replica at peak RPS; prefill gets the time decode leaves free", model),
        Assumption("prefill:decode", "peak prompt tok/s ÷ prefill tok/s : peak output tok/s ÷ decode tok/s "
                   "(token throughput, not time share); KV transfer cost ignored", model),
    ]
