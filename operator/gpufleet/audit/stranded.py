"""Stranded GPUs: free on nodes where no InferenceService could place a replica.

For each GPU node: free = allocatable - requested by running pods. A node's
free GPUs are stranded when no service fits there, judged as kube-scheduler
would: not enough free GPUs for its replica size; wrong pool or product; a
taint the service does not tolerate; its own isolation forbids the node
(another model's pods under Dedicated, any managed pod under Exclusive); or
the pods already there repel it (their required anti-affinity applies to
incoming pods too: an Exclusive pod keeps every other managed pod off its
node, a Dedicated pod every other model), whatever the candidate's own mode.
"""
from __future__ import annotations

import dataclasses

from gpufleet_api.v1alpha1 import InferenceServiceSpec

from ..manifests import names, placement
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
    neighbours: frozenset = frozenset()   # (model label, isolation mode) of managed pods on the node
    taints: tuple = ()                     # the node's NoSchedule/NoExecute taints

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
        labels = [p["metadata"].get("labels", {}) for p in here]
        neighbours = frozenset((lb[names.LABEL_MODEL], lb.get(names.LABEL_ISOLATION, ""))
                               for lb in labels if lb.get(names.LABEL_MODEL))
        models = frozenset(m for m, _ in neighbours)
        taints = tuple(t for t in n.get("spec", {}).get("taints") or []
                       if t.get("effect") in ("NoSchedule", "NoExecute"))
        out.append(NodeGPUs(n["metadata"]["name"], n["metadata"].get("labels", {}), alloc,
                            sum(pod_gpus(p) for p in here), models, bool(models),
                            bool(n.get("spec", {}).get("unschedulable")), neighbours, taints))
    return out


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Kubernetes' rule: a toleration matches a taint's key (an empty key with Exists matches
    every key), its value (Equal) and its effect (an empty effect matches every effect)."""
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        if tol.get("operator", "Equal") == "Exists":
            if not tol.get("key") or tol["key"] == taint.get("key"):
                return True
        elif tol.get("key") == taint.get("key") and (tol.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def repelled_by_neighbours(node: NodeGPUs, own_model: str) -> str | None:
    """Why the managed pods already on the node keep a pod of ``own_model`` off it, if they do."""
    for model, mode in sorted(node.neighbours):
        if mode == "Exclusive":
            return f"an Exclusive neighbour ({model}) keeps every other managed pod off the node"
        if mode == "Dedicated" and model != own_model:
            return f"a Dedicated neighbour ({model}) keeps other models off the node"
    return None


def fits(node: NodeGPUs, spec: InferenceServiceSpec) -> str | None:
    """None if a replica of ``spec`` could be placed on ``node``, else why not."""
    for k, v in node_selector(spec).items():
        if node.labels.get(k) != v:
            return f"needs {k}={v}"
    if spec.resources.mig_profile:
        return "MIG slices are not tracked as whole GPUs"
    if node.free < spec.resources.gpus_per_replica:
        return f"needs {spec.resources.gpus_per_replica} GPUs, {node.free} free"
    tolerations = placement.tolerations(spec)
    for taint in node.taints:
        if not tolerates(tolerations, taint):
            value = f"={taint['value']}" if taint.get("value") else ""
            return f"taint {taint.get('key')}{value}:{taint.get('effect')} not tolerated"
    own = names.model_label(spec.model.name)
    mode = spec.isolation.mode
    if mode == "Dedicated" and node.models - {own}:
        return "node runs another model (Dedicated)"
    if mode == "Exclusive" and node.has_managed:
        return "node runs other managed pods (Exclusive)"
    return repelled_by_neighbours(node, own)


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
