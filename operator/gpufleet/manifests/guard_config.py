"""spec → the guard's guard.json. Pure.

The document's shape, keys and defaults are the contract's
(``gpufleet_api.guard.guard_config``, documented in docs/guard-config.md);
this module only says which spec field fills which contract field.
"""
from __future__ import annotations

import hashlib
import json

from gpufleet_api.guard.control_auth import ADMIN_SOCKET, ControlAuthConfig
from gpufleet_api.guard.endpoints import ENGINE_HOST
from gpufleet_api.guard.guard_config import (
    AdapterFetchConfig,
    ConfigError,
    EngineConfig,
    GuardConfig,
    KVEventsConfig,
    KVTransferConfig,
    LoraConfig,
    QueueClass,
    Role,
    SLOConfig,
    SpeculativeConfig,
    default_routes,
    parse,
    render,
    restart_document,
    with_live_fields,
)
from gpufleet_api.route import served_name
from gpufleet_api.tracing import TracingConfig
from gpufleet_api.v1alpha1 import KV_CONNECTORS, KV_STORE_MOUNT, InferenceServiceSpec

from . import lora as lora_volumes
from . import names, pools

__all__ = ["MODEL_MOUNT", "build_guard_config", "config_hash", "keep_restart_fields", "kv_transfer", "lora",
           "model_location", "read_running", "render", "served_name"]

MODEL_MOUNT = "/models"


def model_location(spec: InferenceServiceSpec) -> str:
    """What vLLM is told to load."""
    src = spec.model.source
    if src.pvc:
        return f"{MODEL_MOUNT}/{src.pvc.path.strip('/')}".rstrip("/") or MODEL_MOUNT
    if src.uri:
        return src.uri
    return spec.model.name


def kv_transfer(spec: InferenceServiceSpec, role: Role) -> KVTransferConfig | None:
    """vLLM's KV connector for a pool's engines (``pools.kv_role``); the SharedStorage connector's
    directory is the volume every engine pod of the service mounts (``children.kv_store_volume``)."""
    kv, kv_role = spec.engine.kv_transfer, pools.kv_role(spec, role)
    if kv is None or kv_role is None:
        return None
    own = {"shared_storage_path": KV_STORE_MOUNT} if kv.connector == "SharedStorage" else {}
    return KVTransferConfig(connector=KV_CONNECTORS[kv.connector], role=kv_role,
                            extra_config={**kv.extra_config, **own},
                            load_failure_policy="recompute" if kv.load_failure_policy == "Recompute" else "fail",
                            **({"shared_storage_limit_bytes": kv.shared_storage.size_limit_gib << 30}
                               if kv.shared_storage else {}))


def lora(spec: InferenceServiceSpec) -> LoraConfig | None:
    """spec.engine.lora as guard.json's engine.lora, from which the guard renders vLLM's LoRA flags."""
    lo = spec.engine.lora
    if lo is None:
        return None
    return LoraConfig(max_loras=lo.max_adapters_per_batch, max_lora_rank=lo.max_rank,
                      max_cpu_loras=lo.cpu_cache_adapters, max_adapters=lo.max_adapters)


def adapter_fetch(spec: InferenceServiceSpec, allow_private_sources: bool = False) -> AdapterFetchConfig:
    """guard.json's ``adapters``: one adapter's share of engine.lora.adapterStorage caps its fetch;
    ``allow_private_sources`` is the platform admin's (``gpufleet run --adapter-private-sources``)."""
    share = lora_volumes.adapter_share_bytes(spec)
    return AdapterFetchConfig(allow_private_sources=allow_private_sources,
                              **({"max_bytes": share} if share is not None else {}))


def tracing(spec: InferenceServiceSpec, otlp_endpoint: str) -> TracingConfig | None:
    """spec.observability.tracing with the fleet's OTLP endpoint as guard.json's ``tracing``; None
    (no spans) where the fleet has no endpoint or the service turned tracing off."""
    t = spec.observability.tracing
    if not otlp_endpoint or t.mode == "Off":
        return None
    return TracingConfig(endpoint=otlp_endpoint, sample_ratio=t.sampled_per_mille / 1000,
                         engine_spans=t.engine_spans == "On")


def build_guard_config(service: str, namespace: str, spec: InferenceServiceSpec,
                       role: Role = "unified", *, allow_private_sources: bool = False,
                       control_auth: ControlAuthConfig | None = None, otlp_endpoint: str = "") -> GuardConfig:
    """``role``: the pool whose guards read it (``pools.pools``); ``spec`` has that pool's resources.
    ``allow_private_sources``: adapters may be fetched from private addresses (the operator's flag).
    ``control_auth``: the operator's identity and the issuer's keys its guards check its tokens with
    (``fleet.guard_identity``); None: the guards accept no caller on their control routes.
    ``otlp_endpoint``: the fleet's OTLP receiver (the operator's --otlp-endpoint); empty: no tracing."""
    engine, adm = spec.engine, spec.admission
    hf = spec.model.source.hugging_face
    classes = tuple(QueueClass(c.name, c.level, float(c.max_queue_seconds)) for c in adm.queue_classes)
    engine_config = EngineConfig(
        runtime=engine.runtime,
        model=model_location(spec),
        served_model_name=served_name(spec),
        # vLLM listens on the pod's loopback: only the guard, in the same pod, reaches it.
        host=ENGINE_HOST,
        port=names.ENGINE_PORT,
        # Unset: vLLM serves the model's own context and the guard reads it from vLLM.
        max_model_len=spec.model.max_model_len,
        revision=hf.revision if hf else None,
        tensor_parallel_size=engine.tensor_parallel_size,
        gpu_memory_utilization=engine.gpu_memory_utilization_percent / 100,
        block_size=engine.kv_cache.block_size,
        kv_cache_dtype=engine.kv_cache.dtype,
        dtype=engine.dtype,
        enable_prefix_caching=engine.prefix_caching == "Enabled",
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        quantization=engine.quantization,
        speculative=SpeculativeConfig(engine.speculative.draft_model, engine.speculative.num_tokens)
        if engine.speculative else None,
        num_gpu_blocks_override=engine.kv_cache.num_blocks_override,
        cpu_kv_cache_space_gib=engine.kv_cache.cpu_kv_cache_space_gib,
        kv_transfer=kv_transfer(spec, role),
        # On wherever the prefix cache is: the guard follows vLLM's block events on the pod's loopback and tells
        # the router what the cache holds (docs/gateway-epp.md); vLLM's publisher thread costs little.
        kv_events=KVEventsConfig() if engine.prefix_caching == "Enabled" else None,
        lora=lora(spec),
        extra_args=tuple(engine.extra_args),
    )
    return GuardConfig(
        service=service,
        namespace=namespace,
        role=role,
        listen_port=names.GUARD_PORT,
        admin_socket=ADMIN_SOCKET,
        control_auth=control_auth,
        engine_url=f"http://{ENGINE_HOST}:{names.ENGINE_PORT}",
        served_model_name=served_name(spec),
        tokenizer=model_location(spec),
        tokenizer_revision=hf.revision if hf else None,
        block_size=engine.kv_cache.block_size,
        kv_watermark_percent=adm.kv_watermark_percent,
        reservation=adm.reservation,
        reservation_quantile_percent=adm.reservation_quantile_percent,
        # Both unset: what vLLM serves, read by the guard from vLLM.
        max_context_tokens=adm.max_context_tokens or spec.model.max_model_len,
        over_length_policy=adm.over_length_policy,
        request_timeout_seconds=float(adm.request_timeout_seconds),
        drain_timeout_seconds=float(adm.request_timeout_seconds),
        max_concurrency=adm.max_concurrency,
        ttft_control=adm.ttft_control,
        queue_classes=classes,
        default_class_by_route={**default_routes(classes),
                                **{r.route: r.default_class for r in adm.route_classes}},
        class_header_policy=adm.class_header_policy,
        adapters=adapter_fetch(spec, allow_private_sources),
        tracing=tracing(spec, otlp_endpoint),
        slo=SLOConfig(ttft_p99_seconds=spec.slo.ttft_p99_milliseconds / 1000,
                      itl_p99_seconds=spec.slo.itl_p99_milliseconds / 1000,
                      request_p99_seconds=spec.slo.request_p99_milliseconds / 1000),
        engine=engine_config,
    )


def config_hash(config: GuardConfig) -> str:
    """The hash of what only a pod restart applies (vLLM's engine section, the guard's layout): the
    pod template carries it, so those changes roll the pods and the live ones (admission, queues,
    limits) reach the running guards through the ConfigMap alone (docs/guard-config.md)."""
    document = restart_document(config)
    if document.get("tracing") is None:
        # Hashed as before tracing existed: upgrading the operator rolls no pod that does not trace.
        document.pop("tracing", None)
    rendered = json.dumps(document, sort_keys=True)
    return hashlib.sha256(rendered.encode()).hexdigest()[:16]


def read_running(document: str | None) -> GuardConfig | None:
    """The guard.json a ConfigMap holds (what its pods were started with), None when absent or not
    one this operator can read."""
    if not document:
        return None
    try:
        return parse(json.loads(document))
    except (ConfigError, ValueError):
        return None


def keep_restart_fields(running: GuardConfig, new: GuardConfig) -> GuardConfig:
    """``running``'s restart fields with ``new``'s live ones: what the stable's guards read while a
    canary runs the new revision (an admission change still reaches them). ``running`` as it is
    when the two do not fit together as one file."""
    try:
        return with_live_fields(running, new)
    except ConfigError:
        return running
