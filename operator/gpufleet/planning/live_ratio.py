"""The prefill:decode ratio of a running disaggregated service, by the planner's model. Pure.

`gpufleet plan` sizes a fleet from a request log or Prometheus; the operator does the same for
each disaggregated service from what its decode pods' vLLM counted over the last minutes
(every request ends on a decode pod, its prompt and output token counts with it): the prompt
tokens per second divided by what one prefill replica prefills, and the output tokens per
second divided by what one decode replica decodes, each replica sized on its pool's GPUs with
the planner's roofline (``sizing.replica_at``, docs/planning.md). Each count is rounded up and at
least 1; their quotient is the ratio ``spec.disaggregation.ratioPolicy: Bound`` holds the pools
at.

The planner needs the model's and each pool's GPU profile; a service whose model, GPU product
(``resources.gpuProduct``) or runtime has none gets no ratio, and the reason names the field.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

from gpufleet_api.v1alpha1 import InferenceServiceSpec, ResourceSpec

from .distribution import TokenStats
from .errors import ProfileError
from .profiles import GpuProfile, ModelProfile, ProfileSet
from .sizing import DEFAULT_BANDWIDTH_EFFICIENCY, DEFAULT_MFU, Settings, kv_pool_bytes, replica_at

MIN_REQUESTS = 20  # fewer finished requests in the window are no distribution
# Bytes per weight of a quantized checkpoint (spec.engine.quantization); others: the profile's.
QUANTIZED_BYTES_PER_PARAM = {"fp8": 1.0, "awq": 0.5, "gptq": 0.5}

Reason = Literal["Measured", "NoProfile", "AwaitingTraffic"]


@dataclasses.dataclass(frozen=True)
class MeasuredDemand:
    """The requests that finished in a window: how many, over how long, their token lengths."""
    requests: float
    seconds: float
    prompt: TokenStats
    output: TokenStats

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.requests * self.prompt.mean / self.seconds if self.seconds > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.requests * self.output.mean / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class LiveRatio:
    reason: Reason
    message: str
    prefill: int | None = None                 # prefill replicas the measured traffic needs
    decode: int | None = None                  # decode replicas it needs
    decode_per_prefill: float | None = None    # decode ÷ prefill replica units, unrounded
    requests: int | None = None
    window_seconds: int | None = None


def settings_of(spec: InferenceServiceSpec, gpus: int) -> Settings:
    """The planner's settings for one replica of the service on ``gpus`` GPUs."""
    return Settings(gpu_memory_utilization=spec.engine.gpu_memory_utilization_percent / 100,
                    kv_watermark_percent=spec.admission.kv_watermark_percent,
                    ttft_p99_seconds=spec.slo.ttft_p99_milliseconds / 1000,
                    itl_p99_seconds=spec.slo.itl_p99_milliseconds / 1000, max_num_seqs=spec.engine.max_num_seqs,
                    max_concurrency=spec.admission.max_concurrency, mfu=DEFAULT_MFU,
                    bandwidth_efficiency=DEFAULT_BANDWIDTH_EFFICIENCY, tensor_parallel=gpus)


def model_profile(spec: InferenceServiceSpec, profiles: ProfileSet) -> ModelProfile:
    """The model's profile as the engine runs it: an fp8 KV cache and quantized weights taken in."""
    model = profiles.model(spec.model.name)
    if spec.engine.kv_cache.dtype != "auto":
        model = dataclasses.replace(model, kv_bytes_per_element=1.0)
    if spec.engine.quantization in QUANTIZED_BYTES_PER_PARAM:
        model = dataclasses.replace(model, bytes_per_param=QUANTIZED_BYTES_PER_PARAM[spec.engine.quantization])
    return model


def _pool_gpu(spec: InferenceServiceSpec, role: str, profiles: ProfileSet) -> tuple[GpuProfile, ResourceSpec]:
    """The GPU profile of a pool's replicas; ProfileError naming the field to set when there is none."""
    assert spec.disaggregation is not None
    own = getattr(spec.disaggregation, role).resources
    resources = own or spec.resources
    field = f"spec.disaggregation.{role}.resources" if own is not None else "spec.resources"
    known = ", ".join(g.name for g in profiles.gpus)
    if spec.engine.runtime == "vllm-cpu":
        raise ProfileError("engine.runtime is vllm-cpu: the planner's profiles are of GPUs")
    if resources.mig_profile:
        raise ProfileError(f"{field}.migProfile {resources.mig_profile}: the planner has no profile of a MIG "
                           f"slice")
    if not resources.gpu_product:
        raise ProfileError(f"the {role} pool's GPU is not known: set {field}.gpuProduct to a GPU the planner "
                           f"knows ({known})")
    try:
        return profiles.gpu(resources.gpu_product), resources
    except ProfileError:
        raise ProfileError(f"{field}.gpuProduct {resources.gpu_product} has no planner profile (known: "
                           f"{known})") from None


def live_ratio(spec: InferenceServiceSpec, demand: MeasuredDemand | None,
               profiles: ProfileSet | None = None) -> LiveRatio:
    """The service's ratio from ``demand`` (None: nothing measured yet)."""
    profiles = profiles or ProfileSet()
    try:
        model = model_profile(spec, profiles)
    except ProfileError:
        known = ", ".join(m.name for m in profiles.models)
        return LiveRatio("NoProfile", f"spec.model.name {spec.model.name} has no planner profile (known: {known}); "
                                      f"the ratio needs the model's parameters and KV layout")
    try:
        prefill_gpu, prefill_res = _pool_gpu(spec, "prefill", profiles)
        decode_gpu, decode_res = _pool_gpu(spec, "decode", profiles)
    except ProfileError as e:
        return LiveRatio("NoProfile", str(e))
    for role, gpu, res in (("prefill", prefill_gpu, prefill_res), ("decode", decode_gpu, decode_res)):
        memory = settings_of(spec, res.gpus_per_replica).gpu_memory_utilization
        if kv_pool_bytes(gpu, model, res.gpus_per_replica, memory) <= 0:
            return LiveRatio("NoProfile", f"by the profiles, {model.name}'s weights fill the {role} pool's "
                                          f"{res.gpus_per_replica} x {gpu.name}; check its gpuProduct and "
                                          f"gpusPerReplica")
    if demand is None or demand.requests < MIN_REQUESTS or demand.seconds <= 0:
        finished = 0 if demand is None else round(demand.requests)
        window = "" if demand is None else f" in the last {demand.seconds:.0f}s"
        return LiveRatio("AwaitingTraffic", f"{finished} request(s) finished on the decode pods{window}; the ratio "
                                            f"needs {MIN_REQUESTS}")
    prefill = replica_at(prefill_gpu, model, settings_of(spec, prefill_res.gpus_per_replica),
                         prefill_res.gpus_per_replica, demand.prompt, demand.output)
    decode = replica_at(decode_gpu, model, settings_of(spec, decode_res.gpus_per_replica),
                        decode_res.gpus_per_replica, demand.prompt, demand.output)
    prefill_units = demand.prompt_tokens_per_s / prefill.prefill_tokens_per_s
    decode_units = demand.output_tokens_per_s / decode.decode_tokens_per_s
    message = (f"{demand.prompt_tokens_per_s:.1f} prompt and {demand.output_tokens_per_s:.1f} output tokens/s "
               f"({demand.requests:.0f} requests in {demand.seconds:.0f}s); one prefill replica "
               f"({prefill_res.gpus_per_replica} x {prefill_gpu.name}) prefills "
               f"{prefill.prefill_tokens_per_s:,.0f} tokens/s, one decode replica ({decode_res.gpus_per_replica} x "
               f"{decode_gpu.name}) decodes {decode.decode_tokens_per_s:,.0f} tokens/s at batch "
               f"{decode.decode_batch} (capped by {decode.decode_batch_bound}); {model.name}")
    return LiveRatio("Measured", message, prefill=max(1, _ceil(prefill_units)), decode=max(1, _ceil(decode_units)),
                     decode_per_prefill=decode_units / prefill_units if prefill_units > 0 else None,
                     requests=round(demand.requests), window_seconds=round(demand.seconds))


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)
