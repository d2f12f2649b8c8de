"""spec.engine.kvTransfer → what an engine pod needs for vLLM's KV connector. Pure.

The connector itself reaches vLLM through guard.json (``guard_config.kv_transfer``); the pod
needs, besides:

- SharedStorage: the volume of the KV files (``kv-store``), mounted at ``KV_STORE_MOUNT`` in the
  vLLM container of every pod of the service, so a file one pod writes another reads, and in the
  guard of each pod that writes them, which bounds the directory (vLLM's connector never deletes);
- Nixl: the address of vLLM's NIXL side channel, which the peer pods connect to (vLLM's default,
  localhost, is unreachable from another pod);
- any connector: no ``expandable_segments:True`` in PYTORCH_CUDA_ALLOC_CONF. vLLM 0.32 refuses to
  start a connector beside it (``VllmConfig._verify_kv_transfer_compat``: connectors register
  KV memory that expandable segments may remap); the spec's other allocator options are kept.
"""
from __future__ import annotations

from gpufleet_api.guard.guard_config import Role
from gpufleet_api.v1alpha1 import KV_STORE_MOUNT, InferenceServiceSpec

from . import claims, names, pools

VOLUME = "kv-store"
EXPANDABLE_SEGMENTS = "expandable_segments:True"
NIXL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"


def active(spec: InferenceServiceSpec, role: Role) -> bool:
    """Whether the pool's engines run a KV connector."""
    return pools.kv_role(spec, role) is not None


def moves_kv_over_network(spec: InferenceServiceSpec) -> bool:
    """Whether the connector has engine pods of the service connect to each other (NIXL's side
    channel and transfers, LMCache's peers) rather than share a volume."""
    kv = spec.engine.kv_transfer
    return kv is not None and kv.connector != "SharedStorage" and any(active(spec, p.role)
                                                                    for p in pools.pools(spec))


def allocator_config(spec: InferenceServiceSpec, role: Role) -> str:
    """PYTORCH_CUDA_ALLOC_CONF for the pool's vLLM: spec.engine.cudaAllocatorConfig, less expandable
    segments when it runs a connector."""
    conf = spec.engine.cuda_allocator_config
    if not active(spec, role):
        return conf
    return ",".join(o for o in conf.split(",") if o.strip() and o.replace(" ", "") != EXPANDABLE_SEGMENTS)


def _store(spec: InferenceServiceSpec, role: Role):
    kv = spec.engine.kv_transfer
    return kv.shared_storage if kv is not None and active(spec, role) else None


def volumes(service: str, spec: InferenceServiceSpec, role: Role) -> list[dict]:
    store = _store(spec, role)
    if store is None:
        return []
    if store.persistent_volume_claim:
        claim = store.persistent_volume_claim.claim_name or names.kv_store_claim_name(service)
        return [{"name": VOLUME, "persistentVolumeClaim": {"claimName": claim}}]
    assert store.host_path is not None  # the CRD asks for exactly one
    # Directory, not DirectoryOrCreate: one the kubelet creates belongs to root and vLLM (uid 65532)
    # could not write it; a missing one fails the pod start with its path.
    return [{"name": VOLUME, "hostPath": {"path": store.host_path.path, "type": "Directory"}}]


def mounts(spec: InferenceServiceSpec, role: Role) -> list[dict]:
    return [{"name": VOLUME, "mountPath": KV_STORE_MOUNT}] if _store(spec, role) is not None else []


def guard_mounts(spec: InferenceServiceSpec, role: Role) -> list[dict]:
    """The store in the guard of a pool that writes KV files (kv_producer, kv_both): the guard removes the
    oldest prompts' files past sharedStorage.sizeLimitGiB (vLLM's connector never does)."""
    writes = pools.kv_role(spec, role) in ("kv_producer", "kv_both")
    return mounts(spec, role) if writes else []


def env(spec: InferenceServiceSpec, role: Role) -> list[dict]:
    kv = spec.engine.kv_transfer
    if kv is None or kv.connector != "Nixl" or not active(spec, role):
        return []
    return [{"name": NIXL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def pod_security(spec: InferenceServiceSpec, role: Role, group: int) -> dict:
    """fsGroup for a claim, so the unprivileged engine can write the KV files."""
    store = _store(spec, role)
    if store is not None and store.persistent_volume_claim:
        return {"fsGroup": group, "fsGroupChangePolicy": "OnRootMismatch"}
    return {}


def build_claim(isvc: dict, spec: InferenceServiceSpec) -> dict | None:
    """The claim of the KV files the operator creates (``sharedStorage.persistentVolumeClaim.size`` set, and a
    pool runs the connector), else None."""
    kv = spec.engine.kv_transfer
    store = kv.shared_storage if kv is not None else None
    claim = store.persistent_volume_claim if store is not None else None
    if claim is None or claim.claim_name or not any(active(spec, p.role) for p in pools.pools(spec)):
        return None
    return claims.owned_claim(isvc, names.kv_store_claim_name(isvc["metadata"]["name"]), claim)
