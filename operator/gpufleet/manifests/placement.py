"""Isolation as scheduling constraints that kube-scheduler enforces.

Dedicated: required pod anti-affinity, per node, against pods of any *other*
managed model (the scheduler applies existing pods' anti-affinity to incoming
pods too, so a later foreign model cannot land here either). Exclusive: one
replica per node and no other managed pod at all. Shared: no constraint.
Unmanaged GPU pods carry no gpufleet labels, so no selector can keep them out
without also blocking node daemons; the isolation verifier reports them.
"""
from __future__ import annotations

from gpufleet_api.v1alpha1 import InferenceServiceSpec

from . import names

HOSTNAME = "kubernetes.io/hostname"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def gpu_resources(spec: InferenceServiceSpec) -> dict[str, str]:
    if spec.resources.mig_profile:
        return {f"nvidia.com/mig-{spec.resources.mig_profile}": "1"}
    return {GPU_RESOURCE: str(spec.resources.gpus_per_replica)}


def node_selector(spec: InferenceServiceSpec) -> dict[str, str]:
    sel = dict(spec.isolation.node_selector)
    if spec.isolation.node_pool:
        sel[names.LABEL_POOL] = spec.isolation.node_pool
    if spec.resources.gpu_product:
        sel["nvidia.com/gpu.product"] = spec.resources.gpu_product
    return sel


def tolerations(spec: InferenceServiceSpec) -> list[dict]:
    out = [GPU_TOLERATION]
    for tol in spec.isolation.tolerations:
        t: dict[str, str] = {"operator": tol.operator}
        for attr, key in (("key", "key"), ("value", "value"), ("effect", "effect"),
                          ("toleration_seconds", "tolerationSeconds")):
            if getattr(tol, attr) is not None:
                t[key] = getattr(tol, attr)
        out.append(t)
    return out


def affinity(spec: InferenceServiceSpec, service: str) -> dict | None:
    mode = spec.isolation.mode
    if mode == "Shared":
        return None
    if mode == "Dedicated":
        selector = {"matchExpressions": [
            {"key": names.LABEL_MODEL, "operator": "Exists"},
            {"key": names.LABEL_MODEL, "operator": "NotIn", "values": [names.model_label(spec.model.name)]},
        ]}
    else:  # Exclusive: no other managed pod on the node, not even another replica of this service
        selector = {"matchExpressions": [{"key": names.LABEL_MODEL, "operator": "Exists"}]}
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": selector, "topologyKey": HOSTNAME, "namespaceSelector": {}},
    ]}}
