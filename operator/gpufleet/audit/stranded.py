"""Stranded GPUs: free on nodes where no InferenceService could place a replica.

For each GPU node: free = allocatable - requested by running pods. A node's
free GPUs are stranded when no service fits there: not enough free GPUs for
its replica size, wrong pool or product, or its isolation forbids the node
(another model's pods under Dedicated, any managed pod under Exclusive).
"""
from __future__ import annotations

import dataclasses

from ..api.v1alpha1 import InferenceServiceSpec
from ..manifests import names
from ..manifests.placement import node_selector

GPU = "nvidia.com/gpu"


@dataclasses.dataclass(frozen=True)
class NodeGPUs:
    name: str
    labels: dict
    allocatable: int
    used: int
    models: frozenset          # model labels of managed pods on the node
    has_managed: bool
    unschedulable: bool = False

    @property
    def free(self) -> int:
        return max(0, self.allocatable - self.used)


@dataclasses.dataclass(frozen=True)
class StrandedNode:
    node: str
    pool: str
    product: str
    free: int
    why: str


def pod_gpus(pod: dict) -> int:
    total = 0
    for c in pod.get("spec", {}).get("containers", []):
        lim = (c.get("resources") or {}).get("limits") or {}
        req = (c.get("resources") or {}).get("requests") or {}
        total += int(lim.get(GPU, req.get(GPU, 0)))
    return total


def node_inventory(nodes: list[dict], pods: list[dict]) -> list[NodeGPUs]:
    by_node: dict[str, list[dict]] = {}
    for p in pods:
        if p.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        n = p.get("spec", {}).get("nodeName")
        if n:
            by_node.setdefault(n, []).append(p)
    out = []
    for n in nodes:
        alloc = int(n.get("status", {}).get("allocatable", {}).get(GPU, 0))
        if alloc == 0:
            continue
        here = by_node.get(n["metadata"]["name"], [])
        models = frozenset(p["metadata"].get("labels", {}).get(names.LABEL_MODEL) for p in here
                           if p["metadata"].get("labels", {}).get(names.LABEL_MODEL))
        out.append(NodeGPUs(n["metadata"]["name"], n["metadata"].get("labels", {}), alloc,
                            sum(pod_gpus(p) for p in here), models, bool(models),
                            bool(n.get("spec", {}).get("unschedulable"))))
    return out


def fits(node: NodeGPUs, spec: InferenceServiceSpec) -> str | None:
    """None if a replica of ``spec`` could be placed on ``node``, else why not."""
    for k, v in node_selector(spec).items():
        if node.labels.get(k) != v:
            return f"needs {k}={v}"
    if spec.resources.mig_profile:
        return "MIG slices are not tracked as whole GPUs"
    if node.free < spec.resources.gpus_per_replica:
        return f"needs {spec.resources.gpus_per_replica} GPUs, {node.free} free"
    own = names.model_label(spec.model.name)
    mode = spec.isolation.mode
    if mode == "Dedicated" and node.models - {own}:
        return "node runs another model (Dedicated)"
    if mode == "Exclusive" and node.has_managed:
        return "node runs other managed pods (Exclusive)"
    # Existing Dedicated/Exclusive neighbours repel us too; approximated by the model set.
    return None


def find_stranded(inventory: list[NodeGPUs], specs: list[InferenceServiceSpec]) -> list[StrandedNode]:
    out = []
    for node in inventory:
        if node.free == 0 or node.unschedulable:
            continue
        reasons = [fits(node, s) for s in specs]
        if specs and any(r is None for r in reasons):
            continue
        why = "no InferenceService exists" if not specs else "; ".join(sorted({r for r in reasons if r}))
        out.append(StrandedNode(node.name, node.labels.get(names.LABEL_POOL, ""),
                                node.labels.get("nvidia.com/gpu.product", ""), node.free, why))
    return out
