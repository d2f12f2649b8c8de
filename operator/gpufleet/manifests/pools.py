"""The pools of an InferenceService: one unified pool, or a prefill and a decode pool
(``spec.disaggregation``). Pure.

Each pool is a Deployment of its own (``names.deployment_name``) whose pods carry its role
(``names.LABEL_ROLE``, absent on the unified pool) and its own resources; everything else about
the pods comes from the one spec.
"""
from __future__ import annotations

import dataclasses

import msgspec

from gpufleet_api.guard.guard_config import KVRole, Role
from gpufleet_api.v1alpha1 import InferenceServiceSpec, PoolSpec

POOL_ROLES: tuple[Role, ...] = ("prefill", "decode")
# What each role's vLLM does with the KV connector (--kv-transfer-config kv_role).
KV_ROLES: dict[Role, KVRole] = {"prefill": "kv_producer", "decode": "kv_consumer", "unified": "kv_both"}


@dataclasses.dataclass(frozen=True)
class Pool:
    role: Role
    spec: InferenceServiceSpec  # the service's spec with this pool's resources
    bounds: PoolSpec | None     # the pool's replicas and bounds; None for the unified pool (spec.autoscaling)


def disaggregated(spec: InferenceServiceSpec) -> bool:
    return spec.disaggregation is not None


def pools(spec: InferenceServiceSpec) -> tuple[Pool, ...]:
    """The unified pool, or the prefill and decode pools, in that order."""
    if spec.disaggregation is None:
        return (Pool("unified", spec, None),)
    out = []
    for role in POOL_ROLES:
        bounds: PoolSpec = getattr(spec.disaggregation, role)
        own = spec if bounds.resources is None else msgspec.structs.replace(spec, resources=bounds.resources)
        out.append(Pool(role, own, bounds))
    return tuple(out)


def kv_role(spec: InferenceServiceSpec, role: Role) -> KVRole | None:
    """The connector role of a pool's engines; None when they run without a connector (a unified
    service with kvTier Off: spec.engine.kvTransfer is then not rendered)."""
    if spec.engine.kv_transfer is None or (role == "unified" and spec.engine.kv_tier == "Off"):
        return None
    return KV_ROLES[role]


def replica_bounds(spec: InferenceServiceSpec) -> tuple[int, int]:
    """(fewest, most) replicas of the whole service: the sums over its pools."""
    if spec.disaggregation is None:
        return spec.autoscaling.min_replicas, spec.autoscaling.max_replicas
    bounds = [p.bounds for p in pools(spec) if p.bounds is not None]
    return sum(b.min_replicas for b in bounds), sum(b.max_replicas for b in bounds)
