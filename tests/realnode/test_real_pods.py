"""The product installed for real: `helm install` runs the operator as a pod on a
real kubelet, and the tiny sample's engine pods run the CPU engine image there,
with their real probes, preStop drain and grace period, behind a Service that
kube-proxy programs. Clients use the Service's ClusterIP with the openai SDK.

One install and one service for the session (conftest.py); the tests run in file order, each
leaving the service at one Ready replica.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import openai
import pytest
import yaml

from gpufleet.manifests import names
from gpufleet.manifests.children import RUN_AS_USER
from gpufleet.manifests.model_cache import FETCH_CONTAINER
from gpufleet_dev.devcluster import node
from gpufleet_engine.local.models import prepare
from tests.realnode.load import answered_after, model_listed, streaming
from tests.realnode.product import API, SERVICE, _pods, _ready, _sample, _service_ready, _wait_operator_ready
from tests.support.fake_hub import FakeHub
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
async def load(service):
    """Streaming clients through the Service's ClusterIP while the test acts."""
    client = openai.AsyncOpenAI(base_url=f"http://{service}/v1", api_key="none", max_retries=0, timeout=90)
    try:
        async with streaming(client) as result:
            yield result
    finally:
        await client.close()


# --- the tests ---------------------------------------------------------------------


async def test_operator_pod_ready_non_root_read_only_under_restricted(install, control_plane, kube):
    pod = await _wait_operator_ready(kube, install, control_plane)
    assert pod["spec"]["nodeName"] == node.NODE_NAME
    ns = await kube.get("v1", "Namespace", install.operator_ns)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    # In-cluster login worked: readiness means it reached the API server and its Lease through
    # the `kubernetes` Service, with the ServiceAccount token the kubelet mounted.
    logs = control_plane.kubectl("-n", install.operator_ns, "logs", pod["metadata"]["name"]).stdout
    assert "Forbidden" not in logs and "Unauthorized" not in logs, logs[-2000:]
    uid = control_plane.kubectl("-n", install.operator_ns, "exec", pod["metadata"]["name"], "--",
                                "python3", "-c", "import os; print(os.getuid())").stdout.strip()
    assert uid == "65532"
    touch = control_plane.kubectl("-n", install.operator_ns, "exec", pod["metadata"]["name"], "--",
                                  "python3", "-c", "open('/opt/x', 'w')", check=False)
    assert "Read-only file system" in touch.stderr
    # The namespace really enforces: a privileged pod is refused there.
    refused = control_plane.kubectl("-n", install.operator_ns, "run", "privileged", "--image=x", "--restart=Never",
                                    "--dry-run=server", "--privileged", check=False)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr


async def test_completions_through_the_service(service, install, kube, built_images):
    pods = await _pods(kube, install.work_ns, names.selector_string(SERVICE))
    assert [p["spec"]["nodeName"] for p in pods] == [node.NODE_NAME]
    statuses = {c["name"]: c for c in pods[0]["status"]["containerStatuses"]}
    assert set(statuses) == {"vllm", "guard"} and all(c["ready"] and c["started"] for c in statuses.values())
    assert {c["image"] for c in pods[0]["spec"]["containers"]} == {built_images["engine-cpu"]}
    # vLLM listens on the pod's loopback only: its port on the pod's address refuses, the guard's answers.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((pods[0]["status"]["podIP"], names.ENGINE_PORT), timeout=5).close()
    socket.create_connection((pods[0]["status"]["podIP"], names.GUARD_PORT), timeout=5).close()
    client = openai.AsyncOpenAI(base_url=f"http://{service}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        # A Ready pod is in the EndpointSlice first and in kube-proxy's rules a moment later;
        # until then the ClusterIP refuses connections.
        await wait_for(lambda: model_listed(client), timeout=30,
                       what="kube-proxy routing the Service to the Ready pod")
        out = await client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=8)
        assert out.choices[0].text and out.usage.completion_tokens > 0
        chat = await client.chat.completions.create(model="tiny-llama", max_tokens=8,
                                                    messages=[{"role": "user", "content": "Hi"}])
        assert chat.choices[0].message.content is not None
    finally:
        await client.close()


async def _set_spec(kube, ns: str, patch: dict) -> None:
    await kube.merge_patch(API, "InferenceService", SERVICE, {"spec": patch}, ns)


async def test_spec_change_rolls_the_deployment_without_failed_requests(service, install, kube, load, control_plane):
    dep = await kube.get("apps/v1", "Deployment", names.deployment_name(SERVICE), install.work_ns)
    old = {p["metadata"]["name"] for p in await _pods(kube, install.work_ns, names.selector_string(SERVICE))}
    # An engine setting (vLLM's flags): the pods roll. Admission settings reload in place instead.
    await _set_spec(kube, install.work_ns, {"engine": {"maxNumSeqs": 16}})

    async def rolled():
        d = await kube.get("apps/v1", "Deployment", names.deployment_name(SERVICE), install.work_ns)
        pods = await _pods(kube, install.work_ns, names.selector_string(SERVICE))
        current = {p["metadata"]["name"] for p in pods}
        return (d["metadata"]["generation"] > dep["metadata"]["generation"] and not (current & old)
                and await _service_ready(kube, install.work_ns, 1))
    await wait_for(rolled, timeout=720, what="the Deployment rolled to a new Ready pod",
                   describe=lambda: control_plane.kubectl("-n", install.work_ns, "get", "pods", "-o", "wide",
                                                          check=False).stdout)
    await answered_after(load, "the roll")
    assert load.ok > 0
    assert load.errors == [], f"{len(load.errors)} failed requests (ok {load.ok}, 429 {load.shed}): {load.errors[:5]}"


async def test_a_router_pod_deleted_under_streaming_load_loses_no_request(service, install, kube, control_plane):
    """Clients reach the model through the router's Service; one of its two pods is deleted (SIGTERM:
    unready, Connection: close, then the answers in progress finish) and the Deployment replaces it."""
    selector = "app.kubernetes.io/name=gpufleet-router"

    async def routers_ready() -> list[dict] | None:
        pods = [p for p in await _pods(kube, install.operator_ns, selector) if not p["metadata"].get(
            "deletionTimestamp")]
        return pods if len(pods) == 2 and all(_ready(p) for p in pods) else None
    describe = lambda: control_plane.kubectl("-n", install.operator_ns, "get", "pods", "-o", "wide",  # noqa: E731
                                             check=False).stdout
    pods = await wait_for(routers_ready, timeout=180, what="two router pods Ready", describe=describe)
    svc = await kube.get("v1", "Service", "gpufleet-router", install.operator_ns)
    client = openai.AsyncOpenAI(base_url=f"http://{svc['spec']['clusterIP']}/v1", api_key="none", max_retries=0,
                                timeout=90)
    await wait_for(lambda: model_listed(client), timeout=60, what="the router listing the model")
    try:
        async with streaming(client) as load:
            await wait_for(lambda: load.ok > 0, timeout=120, what="a first stream answered through the router")
            before = load.ok
            control_plane.kubectl("-n", install.operator_ns, "delete", "pod", pods[0]["metadata"]["name"],
                                  "--wait=false")
            await wait_for(routers_ready, timeout=180, what="the router Deployment back at two Ready pods",
                           describe=describe)
            await answered_after(load, "the router pod was replaced")
    finally:
        await client.close()
    assert load.ok > before > 0
    assert load.errors == [], f"{len(load.errors)} failed requests (ok {load.ok}, 429 {load.shed}): {load.errors[:5]}"


async def _children(kube, ns: str) -> dict[str, list[str]]:
    sel = f"{names.LABEL_SERVICE}={SERVICE}"
    out = {}
    for api, kind in (("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ConfigMap"),
                      ("policy/v1", "PodDisruptionBudget"), ("apps/v1", "ReplicaSet")):
        out[kind] = sorted(o["metadata"]["name"] for o in await kube.list(api, kind, ns, label_selector=sel)
                           if kind != "ReplicaSet" or o["spec"].get("replicas"))
    return out


async def test_operator_pod_deleted_a_new_one_converges_without_duplicates(service, install, kube, control_plane):
    before = await _children(kube, install.work_ns)
    old = await _wait_operator_ready(kube, install, control_plane)
    control_plane.kubectl("-n", install.operator_ns, "delete", "pod", old["metadata"]["name"], "--wait=false")
    new = await _wait_operator_ready(kube, install, control_plane, exclude={old["metadata"]["name"]})
    assert new["metadata"]["name"] != old["metadata"]["name"]
    # The new operator reconciles (a spec change reaches the ConfigMap) and creates nothing twice. A field the
    # guard reloads live: the change reaches the serving pod without rolling it (one that rolled the pods cost
    # an engine start here and proved nothing more about the operator).
    pods = {p["metadata"]["name"] for p in await _pods(kube, install.work_ns, names.selector_string(SERVICE))}
    await _set_spec(kube, install.work_ns, {"admission": {"kvWatermarkPercent": 7}})

    async def converged():
        isvc = await kube.get(API, "InferenceService", SERVICE, install.work_ns)
        conds = {c["type"]: c for c in (isvc.get("status") or {}).get("conditions", [])}
        cm = await kube.get("v1", "ConfigMap", names.configmap_name(SERVICE), install.work_ns)
        return (isvc["status"].get("observedGeneration") == isvc["metadata"]["generation"]
                and json.loads(cm["data"]["guard.json"])["kvWatermarkPercent"] == 7
                and conds.get("Ready", {}).get("status") == "True"
                and conds.get("Progressing", {}).get("reason") == "RolloutComplete"
                and await _service_ready(kube, install.work_ns, 1))
    await wait_for(converged, timeout=300, what="the new operator to converge the service",
                   describe=lambda: control_plane.kubectl("-n", install.work_ns, "get", "pods,rs", "-o", "wide",
                                                          check=False).stdout)
    after = await _children(kube, install.work_ns)
    assert after == before
    assert {p["metadata"]["name"] for p in await _pods(kube, install.work_ns, names.selector_string(SERVICE))} == pods


async def test_missing_secret_is_a_clear_condition(install, kube, control_plane, built_images):
    sample = _sample(built_images["engine-cpu"])
    sample["metadata"]["name"] = "gated"
    # The same model as `tiny`, so the one real node may hold both (Dedicated isolation keeps other
    # models off it) and the kubelet gets as far as the missing Secret.
    sample["spec"]["model"]["source"] = {"huggingFace": {"credentialsSecretRef": {"name": "no-such-secret"}}}
    # A Hub model downloads into the pod's emptyDir, requested as ephemeral-storage (default 50Gi, more
    # than this node's disk may have free): ask for little, so the pod is placed and the kubelet gets
    # as far as the Secret.
    sample["spec"]["model"]["cache"] = {"ephemeralStorage": "1Gi"}
    control_plane.kubectl("apply", "-n", install.work_ns, "-f", "-", input=yaml.safe_dump(sample))

    async def condition():
        isvc = await kube.get(API, "InferenceService", "gated", install.work_ns)
        conds = {c["type"]: c for c in (isvc.get("status") or {}).get("conditions", [])}
        ready = conds.get("Ready", {})
        return ready if ready.get("status") == "False" and "no-such-secret" in ready.get("message", "") else None
    ready = await wait_for(condition, timeout=180, what="Ready=False naming the missing Secret",
                           describe=lambda: control_plane.kubectl("-n", install.work_ns, "get", "inferenceservice",
                                                                  "gated", "-o", "yaml", check=False).stdout[-3000:])
    assert ready["reason"]


async def test_weights_download_once_into_a_node_cache(install, kube, control_plane, built_images):
    """A Hub model with a node-local cache: the first replica's model-fetch init container downloads
    (from a local Hub mirror, spec.model.source.huggingFace.endpoint) and its vLLM serves from the cache
    asking the Hub nothing more; the second replica's model-fetch finds it all on disk. The second replica
    is judged when its model-fetch has finished, not when it is Ready: its vLLM would load what the first
    one's did, from the same cache, and its start (about half a minute on two cores) would prove nothing
    the first one's did not."""
    # Dedicated isolation keeps other models off the one real node: the earlier services go first.
    control_plane.kubectl("-n", install.work_ns, "delete", "inferenceservice", "--all", "--wait=true", timeout=180)
    await wait_for(lambda: _no_engine_pods(kube, install.work_ns), timeout=180, what="the earlier engine pods gone")
    hub = FakeHub.from_folder(prepare("tiny").path)
    url = await hub.start(node.NODE_IP)  # the node's own address: pods reach it through the bridge
    cache = _node_cache_dir(f"/var/tmp/gpufleet-rn-cache-{install.work_ns}")
    sample = _sample(built_images["engine-cpu"])
    sample["metadata"]["name"] = "hub"
    sample["spec"]["model"].update(name="gpufleet/tiny-llama", source={"huggingFace": {"endpoint": url}},
                                   cache={"hostPath": {"path": str(cache)}})
    try:
        started = time.monotonic()
        control_plane.kubectl("apply", "-n", install.work_ns, "-f", "-", input=yaml.safe_dump(sample))
        describe = lambda: control_plane.kubectl("-n", install.work_ns, "describe", "pods", check=False).stdout[-4000:]  # noqa: E731
        (first,) = await wait_for(lambda: _fetched(kube, install.work_ns, set()), timeout=300,
                                  what="the first replica's model-fetch finished", describe=describe)
        first_bytes = hub.sent_bytes
        weights = sum(len(b) for f, b in hub.files.items() if f.endswith(".safetensors"))
        assert first_bytes >= weights > 0
        assert _cached_weights(cache)
        await wait_for(lambda: _service_ready(kube, install.work_ns, 1, "hub"), timeout=420,
                       what="the first replica Ready", describe=describe)
        first_ready = time.monotonic() - started
        assert hub.sent_bytes == first_bytes, "the first replica's vLLM asked the Hub after model-fetch"

        started = time.monotonic()
        await kube.merge_patch(API, "InferenceService", "hub", {"spec": {"autoscaling": {"minReplicas": 2}}},
                               install.work_ns)
        await wait_for(lambda: _fetched(kube, install.work_ns, {first}), timeout=300,
                       what="the second replica's model-fetch finished", describe=describe)
        second_fetched = time.monotonic() - started
        print(f"\n[weights] first replica: {first_bytes} bytes from the Hub, Ready in {first_ready:.0f}s; "
              f"second: {hub.sent_bytes - first_bytes} bytes, its model-fetch done in {second_fetched:.0f}s",
              flush=True)
        assert hub.sent_bytes == first_bytes, "the second replica downloaded again"
    finally:
        control_plane.kubectl("-n", install.work_ns, "delete", "inferenceservice", "hub", "--wait=true",
                              check=False, timeout=180)
        await hub.stop()
        shutil.rmtree(cache, ignore_errors=True)


async def _fetched(kube, ns: str, known: set[str]) -> list[str] | None:
    """The names of the service's pods not in ``known`` whose model-fetch init container exited 0 (one
    that failed fails the test with its exit code), or None while there are none."""
    done = []
    for pod in await _pods(kube, ns, names.selector_string("hub")):
        name = pod["metadata"]["name"]
        if name in known or pod["metadata"].get("deletionTimestamp"):
            continue
        for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
            ended = (status.get("state") or {}).get("terminated")
            if status["name"] == FETCH_CONTAINER and ended:
                assert ended.get("exitCode") == 0, f"{name}'s {FETCH_CONTAINER} failed: {ended}"
                done.append(name)
    return done or None


def _node_cache_dir(path: str) -> Path:
    """What an admin prepares on each node for a hostPath cache (docs/gpu-cluster.md)."""
    cache = Path(path)
    cache.mkdir(parents=True, exist_ok=True)
    os.chown(cache, RUN_AS_USER, RUN_AS_USER)
    return cache


def _cached_weights(cache: Path) -> list[Path]:
    return [p for p in (cache / "hub").rglob("*.safetensors") if p.is_file()]


async def _no_engine_pods(kube, ns: str) -> bool:
    return not await _pods(kube, ns, "app.kubernetes.io/name=gpufleet-engine")
