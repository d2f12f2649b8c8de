"""spec → the guard's guard.json (see docs/guard-config.md). Pure."""
from __future__ import annotations

import hashlib
import json

from ..api.v1alpha1 import InferenceServiceSpec
from . import names

MODEL_MOUNT = "/models"
CLASS_HEADER = "x-gpufleet-class"


def model_location(spec: InferenceServiceSpec) -> str:
    """What vLLM is told to load."""
    src = spec.model.source
    if src.pvc:
        return f"{MODEL_MOUNT}/{src.pvc.path.strip('/')}".rstrip("/") or MODEL_MOUNT
    if src.uri:
        return src.uri
    return spec.model.name


def served_name(spec: InferenceServiceSpec) -> str:
    return spec.model.served_name or spec.model.name


def _route_defaults(classes) -> dict[str, str]:
    by_level = sorted(classes, key=lambda c: (c.level, c.name))
    first, last = by_level[0].name, by_level[-1].name
    middle = next((c.name for c in by_level if c.level == 2), first)
    return {"/v1/chat/completions": first, "/v1/completions": middle, "/v1/embeddings": last}


def build_guard_config(service: str, namespace: str, spec: InferenceServiceSpec) -> dict:
    engine, adm = spec.engine, spec.admission
    max_context = adm.max_context_tokens or spec.model.max_model_len
    spec_dec = None
    if engine.speculative:
        spec_dec = {"model": engine.speculative.draft_model, "numTokens": engine.speculative.num_tokens}
    return {
        "service": service,
        "namespace": namespace,
        "listenPort": names.GUARD_PORT,
        "engineUrl": f"http://127.0.0.1:{names.ENGINE_PORT}",
        "servedModelName": served_name(spec),
        "tokenizer": model_location(spec),
        "blockSize": engine.kv_cache.block_size,
        "kvWatermarkPercent": adm.kv_watermark_percent,
        "maxContextTokens": max_context,
        "overLengthPolicy": adm.over_length_policy,
        "requestTimeoutSeconds": adm.request_timeout_seconds,
        "drainTimeoutSeconds": adm.request_timeout_seconds,
        "maxConcurrency": adm.max_concurrency,
        "maxQueueLength": 1024,
        "classHeader": CLASS_HEADER,
        "agingSeconds": 5,
        "queueClasses": [{"name": c.name, "level": c.level, "maxQueueSeconds": c.max_queue_seconds}
                         for c in adm.queue_classes],
        "defaultClassByRoute": _route_defaults(adm.queue_classes),
        "metricsPollSeconds": 0.5,
        "engine": {
            "runtime": engine.runtime,
            "model": model_location(spec),
            "servedModelName": served_name(spec),
            "port": names.ENGINE_PORT,
            "maxModelLen": spec.model.max_model_len,
            "tensorParallelSize": engine.tensor_parallel_size,
            "gpuMemoryUtilization": engine.gpu_memory_utilization_percent / 100,
            "blockSize": engine.kv_cache.block_size,
            "kvCacheDtype": engine.kv_cache.dtype,
            "dtype": engine.dtype,
            "enablePrefixCaching": engine.prefix_caching == "Enabled",
            "maxNumSeqs": engine.max_num_seqs,
            "maxNumBatchedTokens": engine.max_num_batched_tokens,
            "quantization": engine.quantization,
            "speculative": spec_dec,
            "numGpuBlocksOverride": engine.kv_cache.num_blocks_override,
            "cpuKvCacheSpaceGiB": engine.kv_cache.cpu_kv_cache_space_gib,
            "extraArgs": list(engine.extra_args),
        },
    }


def render(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True)


def config_hash(rendered: str) -> str:
    return hashlib.sha256(rendered.encode()).hexdigest()[:16]
