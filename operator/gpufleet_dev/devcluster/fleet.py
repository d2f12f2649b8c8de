"""The simulated GPU nodes: kwok-managed Node objects shaped like GPU nodes
labelled by the NVIDIA GPU operator (product, count, memory) and tainted the
way GPU pools usually are."""
from __future__ import annotations

import asyncio

from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig
from gpufleet_kit.kube.errors import NotFound

POOL_LABEL = "gpufleet.dev/node-pool"
LOCAL_ENGINE_POOL = "local"
LOCAL_ENGINE_TAINT = {"key": "gpufleet.dev/local-engine", "value": "true", "effect": "NoSchedule"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def build_node(name: str, *, gpus: int, product: str, memory_mib: int, pool: str) -> dict:
    labels = {
        "type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64", POOL_LABEL: pool,
    }
    capacity = {"cpu": "96", "memory": "1024Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    taints = []
    if gpus:
        labels.update({
            "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": product,
            "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.memory": str(memory_mib),
            "nvidia.com/gpu.family": "hopper" if "H100" in product or "H200" in product else "ampere",
        })
        capacity["nvidia.com/gpu"] = str(gpus)
        taints.append(GPU_TAINT)
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels,
                     "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"taints": taints},
        "status": {"capacity": capacity, "allocatable": capacity,
                   "nodeInfo": {"kubeletVersion": "kwok", "operatingSystem": "linux", "architecture": "amd64"}},
    }


def fleet_nodes(fleet) -> list[dict]:
    nodes = [build_node(f"gpu-node-{i}", gpus=fleet.gpus_per_node, product=fleet.gpu_product,
                        memory_mib=fleet.gpu_memory_mib, pool=fleet.node_pool) for i in range(fleet.nodes)]
    for name in engine_node_names(fleet):
        node = build_node(name, gpus=fleet.gpus_per_node, product=fleet.gpu_product,
                          memory_mib=fleet.gpu_memory_mib, pool=LOCAL_ENGINE_POOL)
        # Only services that ask for real local engines land here (they tolerate this).
        node["spec"]["taints"].append(LOCAL_ENGINE_TAINT)
        nodes.append(node)
    nodes += [build_node(f"cpu-node-{i}", gpus=0, product="", memory_mib=0, pool="system")
              for i in range(fleet.cpu_nodes)]
    return nodes


def engine_node_names(fleet) -> list[str]:
    from .kwok_stages import ENGINE_NODE_PREFIX
    return [f"{ENGINE_NODE_PREFIX}{i}" for i in range(getattr(fleet, "engine_nodes", 0))]


async def _register_and_check(kubeconfig: str, fleet) -> bool:
    async with KubeClient(KubeConfig.from_file(kubeconfig)) as kube:
        wanted = fleet_nodes(fleet)
        for node in wanted:
            if await kube.get_or_none("v1", "Node", node["metadata"]["name"]) is None:
                await kube.create(node)
        for node in wanted:
            got = await kube.get("v1", "Node", node["metadata"]["name"])
            conds = {c["type"]: c["status"] for c in got.get("status", {}).get("conditions", [])}
            if conds.get("Ready") != "True":
                return False
        try:
            await kube.get("v1", "ServiceAccount", "default", "default")
        except NotFound:
            return False
        return True


def register_and_check(kubeconfig: str, fleet) -> bool:
    return asyncio.run(_register_and_check(kubeconfig, fleet))


async def describe_fleet(kube: KubeClient) -> list[dict]:
    """Nodes with GPU capacity and what is requested of it, for `dev status` and the demo."""
    nodes = await kube.list("v1", "Node")
    pods = await kube.list("v1", "Pod")
    used: dict[str, int] = {}
    for p in pods:
        if p.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        node = p.get("spec", {}).get("nodeName")
        for c in p.get("spec", {}).get("containers", []):
            req = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            if node and req:
                used[node] = used.get(node, 0) + int(req)
    out = []
    for n in nodes:
        labels = n["metadata"].get("labels", {})
        conds = {c["type"]: c["status"] for c in n.get("status", {}).get("conditions", [])}
        out.append({
            "name": n["metadata"]["name"], "ready": conds.get("Ready") == "True",
            "pool": labels.get(POOL_LABEL, ""), "product": labels.get("nvidia.com/gpu.product", "-"),
            "gpus": int(n.get("status", {}).get("allocatable", {}).get("nvidia.com/gpu", 0)),
            "gpus_used": used.get(n["metadata"]["name"], 0),
        })
    return out
