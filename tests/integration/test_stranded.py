"""Stranded GPUs counted as kube-scheduler would place replicas, on simulated GPU
nodes: GPUs kept free by an Exclusive or a Dedicated neighbour, or behind a taint
no service tolerates, are stranded, and a Shared service does not hide them."""
import uuid

import pytest
import yaml

from gpufleet.reconcile.status import unschedulable_pods
from gpufleet_dev.devcluster.fleet import build_node
from tests.support.waiting import PODS_START_SECONDS, wait_for

pytestmark = pytest.mark.integration

API = "serving.gpufleet.dev/v1alpha1"
PRODUCT = "NVIDIA-H100-80GB-HBM3"


@pytest.fixture
async def make_pool(kube):
    """Fresh 8-GPU nodes in a pool of their own (other tests' services do not target it)."""
    created = []

    async def make(taint: dict | None = None, count: int = 3) -> str:
        name = f"st-{uuid.uuid4().hex[:6]}"
        for i in range(count):
            node = build_node(f"{name}-{i}", gpus=8, product=PRODUCT, memory_mib=81559, pool=name)
            if taint:
                node["spec"]["taints"].append(taint)
            await kube.create(node)
            created.append(node["metadata"]["name"])

        async def ready():
            for i in range(count):
                got = await kube.get("v1", "Node", f"{name}-{i}")
                if not any(x["type"] == "Ready" and x["status"] == "True"
                           for x in got["status"].get("conditions", [])):
                    return False
            return True
        await wait_for(ready, timeout=30, what="pool nodes Ready")
        return name
    yield make
    for n in created:
        await kube.delete("v1", "Node", n)


def service(name, model, pool, replicas, gpus, mode):
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": name}, "spec": {
        "model": {"name": model}, "replicas": replicas,
        "autoscaling": {"mode": "Manual", "minReplicas": 1, "maxReplicas": 8},
        "resources": {"gpusPerReplica": gpus}, "isolation": {"mode": mode, "nodePool": pool}}}


def apply(control_plane, namespace, obj):
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


async def running(kube, namespace, svc, n):
    pods = await kube.list("v1", "Pod", namespace, label_selector=f"gpufleet.dev/service={svc}")
    run = [p for p in pods if p["status"].get("phase") == "Running"]
    return run if len(run) == n else None


async def stranded_in(operator, pool: str) -> float | None:
    prefix = f'gpufleet_stranded_gpus{{gpu_product="{PRODUCT}",node_pool="{pool}"}}'
    for line in operator.metrics_text().splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return None


async def expect_stranded(kube, operator, pool: str, gpus: float, why: str) -> None:
    async def counted():
        return await stranded_in(operator, pool) == gpus
    await wait_for(counted, timeout=60, what=f"{gpus:g} stranded GPUs in pool {pool}",
                   describe=lambda: [ln for ln in operator.metrics_text().splitlines() if pool in ln])

    async def said_why():
        events = await kube.list("v1", "Event", "default", field_selector=f"involvedObject.name={pool}-0")
        return any(e["reason"] == "StrandedGPUs" and why in e["message"] for e in events)
    await wait_for(said_why, timeout=30, what=f"a StrandedGPUs Event on {pool}-0 saying '{why}'")


async def test_an_exclusive_neighbour_strands_the_rest_of_its_node_despite_a_shared_service(
        control_plane, operator, kube, namespace, make_pool):
    pool = await make_pool()
    apply(control_plane, namespace, service("ex", "org/model-x", pool, replicas=3, gpus=1, mode="Exclusive"))
    await wait_for(lambda: running(kube, namespace, "ex", 3), timeout=PODS_START_SECONDS,
                   what="3 Exclusive replicas Running")
    # A Shared service that wants 1 GPU in the pool: the scheduler keeps it off every node.
    apply(control_plane, namespace, service("sh", "org/model-s", pool, replicas=1, gpus=1, mode="Shared"))
    await expect_stranded(kube, operator, pool, 21, "Exclusive neighbour")

    # What the count says: it cannot land. The count does not wait for the Shared
    # replica's pod, so wait until kube-scheduler has tried it and said why not.
    async def unschedulable():
        pods = await kube.list("v1", "Pod", namespace, label_selector="gpufleet.dev/service=sh")
        return bool(pods) and len(unschedulable_pods(pods)) == len(pods) and \
            all(not p["spec"].get("nodeName") for p in pods)
    await wait_for(unschedulable, timeout=60, what="the Shared replica's pod refused by kube-scheduler")


async def test_a_dedicated_neighbour_strands_its_free_gpus_for_other_models(
        control_plane, operator, kube, namespace, make_pool):
    pool = await make_pool()
    apply(control_plane, namespace, service("ded", "org/model-a", pool, replicas=3, gpus=6, mode="Dedicated"))
    await wait_for(lambda: running(kube, namespace, "ded", 3), timeout=PODS_START_SECONDS,
                   what="3 Dedicated replicas Running")
    apply(control_plane, namespace, service("other", "org/model-b", pool, replicas=1, gpus=2, mode="Shared"))
    await expect_stranded(kube, operator, pool, 6, "Dedicated neighbour")


async def test_gpus_behind_a_taint_no_service_tolerates_are_stranded(
        control_plane, operator, kube, namespace, make_pool):
    pool = await make_pool(taint={"key": "team", "value": "research", "effect": "NoSchedule"}, count=2)
    apply(control_plane, namespace, service("plain", "org/model-p", pool, replicas=1, gpus=1, mode="Shared"))
    await expect_stranded(kube, operator, pool, 16, "taint team=research:NoSchedule not tolerated")
