"""`kubectl drain` of a node running an engine replica, against the real API server, scheduler,
disruption controller and the operator process (docs/drains.md): the replacement is Ready before
the old pod is evicted, the drain completes, and the Deployment goes back to its replicas. A replica
that is not Ready does not hold a drain up, even when no replacement can start."""
import asyncio
import contextlib
import os
import uuid

import pytest
import yaml

from gpufleet_dev.devcluster.fleet import build_node
from gpufleet_kit.kube.pods import is_ready
from tests.support.waiting import PODS_START_SECONDS, wait_for

API = "serving.gpufleet.dev/v1alpha1"
DRAIN_SECONDS = 120


async def make_pool(kube, nodes: int) -> tuple[str, list[str]]:
    """One-GPU nodes in a pool of their own, so other tests' pods neither take their room nor get drained."""
    pool = f"drain-{uuid.uuid4().hex[:6]}"
    names = [f"{pool}-{i}" for i in range(nodes)]
    for name in names:
        await kube.create(build_node(name, gpus=1, product="NVIDIA-H100-80GB-HBM3", memory_mib=81559, pool=pool))

    async def ready():
        got = [await kube.get("v1", "Node", n) for n in names]
        return all(is_ready(n["status"]) for n in got)
    await wait_for(ready, timeout=30, what="the pool's nodes Ready")
    return pool, names


@pytest.fixture
async def pool_of(kube):
    made: list[str] = []

    async def make(nodes: int) -> tuple[str, list[str]]:
        pool, names = await make_pool(kube, nodes)
        made.extend(names)
        return pool, names
    yield make
    for name in made:
        await kube.delete("v1", "Node", name)


def service(pool: str, **spec) -> dict:
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": "chat"}, "spec": {
        "model": {"name": "org/drained"}, "replicas": 1,
        "autoscaling": {"mode": "Manual", "minReplicas": 1, "maxReplicas": 2},
        "resources": {"gpusPerReplica": 1}, "isolation": {"nodePool": pool}, **spec}}


def apply(control_plane, namespace, obj):
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


async def engine_pods(kube, namespace):
    return await kube.list("v1", "Pod", namespace, label_selector="gpufleet.dev/service=chat")


async def one_ready_pod(kube, namespace) -> dict:
    async def ready():
        pods = [p for p in await engine_pods(kube, namespace) if is_ready(p.get("status") or {})]
        isvc = await kube.get(API, "InferenceService", "chat", namespace)
        return pods[0] if len(pods) == 1 and (isvc.get("status") or {}).get("readyReplicas") == 1 else None
    return await wait_for(ready, timeout=PODS_START_SECONDS, what="one ready engine pod",
                          describe=lambda: engine_pods(kube, namespace))


async def drain(control_plane, node: str) -> asyncio.subprocess.Process:
    """The real kubectl drain, in the background."""
    return await asyncio.create_subprocess_exec(
        "kubectl", "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", f"--timeout={DRAIN_SECONDS}s",
        env={**os.environ, "KUBECONFIG": control_plane.kubeconfig},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)


async def finished(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=DRAIN_SECONDS + 30)
    return proc.returncode or 0, out.decode(errors="replace")


class PodEvents:
    """Every watch event of the service's pods, in the API server's order."""

    def __init__(self, kube, namespace):
        self.kube, self.namespace = kube, namespace
        self.events: list[tuple[str, dict]] = []
        self.task: asyncio.Task | None = None

    async def __aenter__(self):
        async def run():
            while True:  # a watch ends after its timeout; the next one starts with the current state
                async for e in self.kube.watch("v1", "Pod", self.namespace, timeout_seconds=300,
                                               label_selector="gpufleet.dev/service=chat"):
                    self.events.append((e["type"], e["object"]))
        self.task = asyncio.create_task(run())
        await wait_for(lambda: self.events, timeout=30, what="the pod watch's first event")
        return self

    async def __aexit__(self, *_):
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    def first(self, pred) -> int | None:
        return next((i for i, (t, p) in enumerate(self.events) if pred(t, p)), None)


async def test_a_drain_starts_the_replacement_before_it_evicts_the_replica(control_plane, operator, kube,
                                                                           namespace, pool_of):
    pool, _ = await pool_of(2)
    apply(control_plane, namespace, service(pool))
    old = await one_ready_pod(kube, namespace)
    old_name, node = old["metadata"]["name"], old["spec"]["nodeName"]
    budget = await kube.get("policy/v1", "PodDisruptionBudget", "chat-engine", namespace)
    assert budget["spec"]["minAvailable"] == 1 and budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"

    try:
        async with PodEvents(kube, namespace) as watched:
            proc = await drain(control_plane, node)
            rc, out = await finished(proc)
            assert rc == 0, out

            def replacement_ready(_t, p):
                return (p["metadata"]["name"] != old_name and is_ready(p.get("status") or {})
                        and p["spec"].get("nodeName") not in (None, node))

            def old_leaving(t, p):
                return p["metadata"]["name"] == old_name and (t == "DELETED" or p["metadata"].get("deletionTimestamp"))
            await wait_for(lambda: watched.first(old_leaving) is not None, timeout=30,
                           what="the watch to show the old pod leaving")
            ready_at, leaving_at = watched.first(replacement_ready), watched.first(old_leaving)
            assert ready_at is not None and ready_at < leaving_at, [
                (t, p["metadata"]["name"], p["spec"].get("nodeName"), is_ready(p.get("status") or {}),
                 bool(p["metadata"].get("deletionTimestamp"))) for t, p in watched.events]

        async def settled():
            dep = await kube.get("apps/v1", "Deployment", "chat-engine", namespace)
            isvc = await kube.get(API, "InferenceService", "chat", namespace)
            pods = [p for p in await engine_pods(kube, namespace) if not p["metadata"].get("deletionTimestamp")]
            serving = [p["spec"].get("nodeName") for p in pods if is_ready(p.get("status") or {})]
            return dep["spec"]["replicas"] == 1 and "drain" not in (isvc.get("status") or {}) and \
                len(pods) == 1 and serving and node not in serving
        await wait_for(settled, timeout=60, what="the Deployment back to 1 replica, off the drained node",
                       describe=lambda: engine_pods(kube, namespace))
        events = await kube.list("v1", "Event", namespace)
        surge = [e for e in events if e.get("reason") == "DrainSurge"]
        assert surge and node in surge[0]["message"] and old_name in surge[0]["message"]
    finally:
        control_plane.kubectl("uncordon", node, check=False)


async def test_a_drain_surges_only_the_pool_of_the_pod_it_evicts(control_plane, operator, kube, namespace,
                                                                  pool_of):
    pool, _ = await pool_of(3)
    pd = service(pool, engine={"kvTransfer": {"connector": "Nixl"}}, disaggregation={
        "prefill": {"replicas": 1, "maxReplicas": 2}, "decode": {"replicas": 1, "maxReplicas": 2}})
    del pd["spec"]["replicas"]
    apply(control_plane, namespace, pd)

    async def both_ready():
        pods = [p for p in await engine_pods(kube, namespace) if is_ready(p.get("status") or {})]
        return {p["metadata"]["labels"]["gpufleet.dev/role"]: p for p in pods} if len(pods) == 2 else None
    pods = await wait_for(both_ready, timeout=PODS_START_SECONDS, what="a ready prefill and decode pod",
                          describe=lambda: engine_pods(kube, namespace))
    decode, node = pods["decode"]["metadata"]["name"], pods["decode"]["spec"]["nodeName"]
    try:
        rc, out = await finished(await drain(control_plane, node))
        assert rc == 0, out

        async def moved():
            live = [p for p in await engine_pods(kube, namespace) if not p["metadata"].get("deletionTimestamp")]
            roles = sorted(p["metadata"]["labels"]["gpufleet.dev/role"] for p in live if is_ready(p["status"]))
            deps = [(await kube.get("apps/v1", "Deployment", f"chat-{r}", namespace))["spec"]["replicas"]
                    for r in ("prefill", "decode")]
            return roles == ["decode", "prefill"] and deps == [1, 1] and decode not in {
                p["metadata"]["name"] for p in live}
        await wait_for(moved, timeout=60, what="the decode replica moved, both pools back to 1",
                       describe=lambda: engine_pods(kube, namespace))
        prefill = await kube.get("v1", "Pod", pods["prefill"]["metadata"]["name"], namespace)
        assert prefill["metadata"]["uid"] == pods["prefill"]["metadata"]["uid"]  # untouched
        surge = [e for e in await kube.list("v1", "Event", namespace) if e.get("reason") == "DrainSurge"]
        assert surge and decode in surge[0]["message"]
    finally:
        control_plane.kubectl("uncordon", node, check=False)


async def test_a_replica_that_is_not_ready_does_not_hold_a_drain_up(control_plane, operator, kube, namespace,
                                                                    pool_of):
    pool, (node,) = await pool_of(1)  # no other node: its replacement cannot start anywhere
    apply(control_plane, namespace, service(pool))
    old = await one_ready_pod(kube, namespace)
    name = old["metadata"]["name"]
    # A replica that fails its readiness probe (kwok leaves a Running pod's status alone).
    await kube.merge_patch("v1", "Pod", name, {"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "ProbeFailed"}]}}, namespace, subresource="status")

    async def unhealthy():
        pdb = await kube.get("policy/v1", "PodDisruptionBudget", "chat-engine", namespace)
        st = pdb.get("status") or {}
        return st.get("currentHealthy") == 0 and st.get("observedGeneration") == pdb["metadata"]["generation"]
    await wait_for(unhealthy, timeout=30, what="the budget to count the replica as not healthy")
    try:
        rc, out = await finished(await drain(control_plane, node))
        assert rc == 0, out
        assert f"pod/{name} evicted" in out
    finally:
        control_plane.kubectl("uncordon", node, check=False)
