"""Isolation is enforced by kube-scheduler on the simulated GPU nodes: two
Dedicated models never share a node, and a model whose pool is full stays
Pending while its InferenceService says why, instead of silently sharing."""
import uuid

import pytest
import yaml

from gpufleet.reconcile import conditions as c
from gpufleet_dev.devcluster.fleet import build_node
from tests.support.waiting import PODS_START_SECONDS, wait_for

API = "serving.gpufleet.dev/v1alpha1"


@pytest.fixture
async def pool(kube):
    """Three fresh 8-GPU nodes in a pool of their own, so other tests' pods don't interfere."""
    name = f"iso-{uuid.uuid4().hex[:6]}"
    nodes = [build_node(f"{name}-{i}", gpus=8, product="NVIDIA-H100-80GB-HBM3", memory_mib=81559, pool=name)
             for i in range(3)]
    for n in nodes:
        await kube.create(n)

    async def ready():
        for n in nodes:
            got = await kube.get("v1", "Node", n["metadata"]["name"])
            if not any(x["type"] == "Ready" and x["status"] == "True" for x in got["status"].get("conditions", [])):
                return False
        return True
    await wait_for(ready, timeout=30, what="pool nodes Ready")
    yield name
    for n in nodes:
        await kube.delete("v1", "Node", n["metadata"]["name"])


def service(name, model, pool, replicas, gpus, mode="Dedicated"):
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": name}, "spec": {
        "model": {"name": model}, "replicas": replicas,
        "autoscaling": {"mode": "Manual", "minReplicas": 1, "maxReplicas": 8},
        "resources": {"gpusPerReplica": gpus}, "isolation": {"mode": mode, "nodePool": pool}}}


def apply(control_plane, namespace, obj):
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


async def pods_by_node(kube, namespace, service_name):
    pods = await kube.list("v1", "Pod", namespace, label_selector=f"gpufleet.dev/service={service_name}")
    return pods


async def test_dedicated_models_never_share_a_node_and_a_full_pool_says_why(control_plane, operator, kube,
                                                                             namespace, pool):
    # Model A fills two whole nodes; model B fits only on the third.
    apply(control_plane, namespace, service("a", "org/model-a", pool, replicas=2, gpus=8))

    async def running(svc, n):
        pods = await pods_by_node(kube, namespace, svc)
        run = [p for p in pods if p["status"].get("phase") == "Running"]
        return run if len(run) == n else None
    a_pods = await wait_for(lambda: running("a", 2), timeout=PODS_START_SECONDS, what="2 replicas of model a Running")
    apply(control_plane, namespace, service("b", "org/model-b", pool, replicas=3, gpus=1))
    b_pods = await wait_for(lambda: running("b", 3), timeout=PODS_START_SECONDS, what="3 replicas of model b Running")
    a_nodes = {p["spec"]["nodeName"] for p in a_pods}
    b_nodes = {p["spec"]["nodeName"] for p in b_pods}
    assert not a_nodes & b_nodes, f"models share nodes: a={a_nodes} b={b_nodes}"
    assert len(b_nodes) == 1  # three replicas of b share the last node: same model may co-locate

    # Model C: 5 free GPUs remain on b's node, but Dedicated isolation forbids using them.
    apply(control_plane, namespace, service("c", "org/model-c", pool, replicas=1, gpus=1))

    async def says_why():
        obj = await kube.get(API, "InferenceService", "c", namespace)
        ready = c.get((obj.get("status") or {}).get("conditions"), "Ready") or {}
        return obj if ready.get("reason") == "Unschedulable" else None
    obj = await wait_for(says_why, timeout=60, what="InferenceService c to report Unschedulable")
    ready = c.get(obj["status"]["conditions"], "Ready")
    assert ready["status"] == "False"
    assert "didn't match pod anti-affinity rules" in ready["message"] or \
        "anti-affinity" in ready["message"], ready["message"]
    progressing = c.get(obj["status"]["conditions"], "Progressing")
    assert progressing["reason"] == "InsufficientCapacity"
    events = await kube.list("v1", "Event", namespace, field_selector="involvedObject.name=c")
    assert any(e["reason"] == "Unschedulable" and "Dedicated isolation" in e["message"] for e in events)
    c_pods = await pods_by_node(kube, namespace, "c")
    assert all(p["status"].get("phase") == "Pending" and not p["spec"].get("nodeName") for p in c_pods)


async def test_exclusive_takes_the_whole_node(control_plane, operator, kube, namespace, pool):
    apply(control_plane, namespace, service("svc-x", "org/model-x", pool, replicas=3, gpus=1, mode="Exclusive"))

    async def three_running():
        pods = await pods_by_node(kube, namespace, "svc-x")
        run = [p for p in pods if p["status"].get("phase") == "Running"]
        return run if len(run) == 3 else None
    pods = await wait_for(three_running, timeout=PODS_START_SECONDS, what="3 Exclusive replicas Running")
    assert len({p["spec"]["nodeName"] for p in pods}) == 3  # one replica per node
    # Any other managed model is kept off those nodes, even as Shared.
    apply(control_plane, namespace, service("svc-y", "org/model-y", pool, replicas=1, gpus=1, mode="Shared"))

    async def pending_y():
        obj = await kube.get(API, "InferenceService", "svc-y", namespace)
        ready = c.get((obj.get("status") or {}).get("conditions"), "Ready") or {}
        return ready.get("reason") == "Unschedulable"
    await wait_for(pending_y, timeout=60, what="model y to stay Unschedulable next to Exclusive x")


async def test_an_unmanaged_gpu_pod_on_a_dedicated_node_is_reported(control_plane, operator, kube, namespace,
                                                                     pool):
    apply(control_plane, namespace, service("guarded", "org/model-g", pool, replicas=1, gpus=2))

    async def placed():
        pods = await pods_by_node(kube, namespace, "guarded")
        return [p for p in pods if p["status"].get("phase") == "Running"]
    placed_pods = await wait_for(placed, timeout=PODS_START_SECONDS, what="the dedicated replica Running")
    node = placed_pods[0]["spec"]["nodeName"]

    async def verified():
        obj = await kube.get(API, "InferenceService", "guarded", namespace)
        return (c.get((obj.get("status") or {}).get("conditions"), "Isolated") or {}).get("reason") == "Verified"
    await wait_for(verified, timeout=30, what="Isolated=True Verified by the isolation audit")

    # Someone bypasses the scheduler and puts a GPU job straight onto the node.
    await kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rogue-job", "namespace": namespace},
                       "spec": {"nodeName": node, "containers": [{"name": "c", "image": "registry.invalid/cuda:12",
                                "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                                "tolerations": [{"operator": "Exists"}]}})

    async def violated():
        obj = await kube.get(API, "InferenceService", "guarded", namespace)
        iso = c.get((obj.get("status") or {}).get("conditions"), "Isolated") or {}
        return obj if iso.get("status") == "False" else None
    obj = await wait_for(violated, timeout=30, what="Isolated=False naming the rogue pod")
    iso = c.get(obj["status"]["conditions"], "Isolated")
    assert iso["reason"] == "ViolationFound"
    assert f"{namespace}/rogue-job on {node}: unmanaged GPU pod" in iso["message"]
    assert obj["status"]["isolationViolations"] == [f"{namespace}/rogue-job on {node}: unmanaged GPU pod"]
    # The audit writes the condition first and posts the Event after it (cluster_audit.py).
    async def violation_event():
        events = await kube.list("v1", "Event", namespace, field_selector="involvedObject.name=guarded")
        return any(e["reason"] == "IsolationViolated" and "rogue-job" in e["message"] for e in events)
    await wait_for(violation_event, timeout=30, what="an IsolationViolated Event naming the rogue pod")
    metrics = operator.metrics_text()
    assert f'gpufleet_isolation_violations{{namespace="{namespace}",service="guarded"}} 1.0' in metrics

    await kube.delete("v1", "Pod", "rogue-job", namespace, grace_period_seconds=0)
    await wait_for(verified, timeout=30, what="Isolated back to Verified after the rogue pod left")


async def test_stranded_gpus_are_counted_per_pool(control_plane, operator, kube, namespace, pool):
    # 6-GPU replicas on 8-GPU nodes: each node keeps 2 GPUs nobody can use.
    apply(control_plane, namespace, service("wide", "org/model-w", pool, replicas=3, gpus=6))

    async def strands():
        for line in operator.metrics_text().splitlines():
            if line.startswith(f'gpufleet_stranded_gpus{{gpu_product="NVIDIA-H100-80GB-HBM3",node_pool="{pool}"}}'):
                return float(line.split()[-1]) == 6.0
        return False
    await wait_for(strands, timeout=60, what=f"6 stranded GPUs reported for pool {pool}",
                   describe=lambda: [ln for ln in operator.metrics_text().splitlines() if "stranded" in ln])

    async def node_events():
        return [(e["reason"], e["message"]) for e in
                await kube.list("v1", "Event", "default", field_selector=f"involvedObject.name={pool}-0")]

    async def stranded_event():
        # The metric is set before the Event is posted, so wait for the Event too.
        return any(r == "StrandedGPUs" and "needs 6 GPUs, 2 free" in m for r, m in await node_events())
    await wait_for(stranded_event, timeout=30, what=f"a StrandedGPUs Event on {pool}-0 saying why",
                   describe=node_events)
