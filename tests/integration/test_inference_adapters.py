"""InferenceAdapter and spec.engine.lora against the real API server and the operator process: what
the API server takes and refuses (with messages naming the field and the fix), the LoRA flags in
the Deployment's guard config and the adapter folder in its pods, and the status of an adapter
whose service does not exist. No engine starts: the namespace allows no pods."""
import json

import pytest
import yaml

from gpufleet.reconcile import conditions as c
from tests.support.waiting import wait_for

API = "serving.gpufleet.dev/v1alpha1"


def apply(control_plane, namespace, obj, check=True):
    return control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=check)


def service(name, **engine):
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"name": "org/base"}, "engine": engine}}


def adapter(name, service_name="chat", **spec):
    return {"apiVersion": API, "kind": "InferenceAdapter", "metadata": {"name": name},
            "spec": {"service": service_name, "source": {"uri": "https://store.example/a.tar.gz"}, **spec}}


@pytest.fixture
async def podless(kube, namespace):
    await kube.create({"apiVersion": "v1", "kind": "ResourceQuota",
                       "metadata": {"name": "no-pods", "namespace": namespace}, "spec": {"hard": {"pods": "0"}}})
    return namespace


@pytest.mark.parametrize("obj, message", [
    (adapter("two-sources", source={"uri": "https://x.example/a.tar", "pvc": {"claimName": "c"}}),
     "set exactly one of source.huggingFace, source.pvc, source.uri"),
    (adapter("no-source", source={}), "set exactly one of source.huggingFace, source.pvc, source.uri"),
    (adapter("bounds", placement={"minReplicas": 3, "maxReplicas": 1}),
     "placement.minReplicas must be at most placement.maxReplicas"),
    (adapter("Not_A_Label"), "metadata.name"),
    (adapter("s3", source={"uri": "s3://bucket/a.tar"}), "source.uri must be an http:// or https://"),
    (service("pd", lora={}, kvTransfer={}), "engine.lora cannot be combined with engine.kvTransfer"),
    ({"apiVersion": API, "kind": "InferenceService", "metadata": {"name": "pd2"},
      "spec": {"model": {"name": "org/base"}, "engine": {"lora": {}, "kvTransfer": {}}, "disaggregation": {}}},
     "engine.lora cannot be combined with spec.disaggregation"),
    (service("rank", lora={"maxRank": 12}), "spec.engine.lora.maxRank"),
])
async def test_the_api_server_refuses_with_a_clear_message(control_plane, crds_installed, namespace, obj, message):
    out = apply(control_plane, namespace, obj, check=False)
    assert out.returncode != 0, f"{obj['metadata']['name']} was taken"
    assert message in out.stderr, out.stderr


async def test_lora_reaches_the_guard_config_and_the_pods_and_adapters_are_listed(control_plane, operator, kube,
                                                                                  podless):
    apply(control_plane, podless, service("chat", lora={"maxAdaptersPerBatch": 2, "maxRank": 32,
                                                        "cpuCacheAdapters": 4, "maxAdapters": 6}))
    apply(control_plane, podless, adapter("support"))

    async def configured():
        cm = await kube.get_or_none("v1", "ConfigMap", "chat-guard", podless)
        return json.loads(cm["data"]["guard.json"]) if cm else None
    guard = await wait_for(configured, timeout=60, what="chat-guard written")
    assert guard["engine"]["lora"] == {"maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 4, "maxAdapters": 6}
    dep = await kube.get("apps/v1", "Deployment", "chat-engine", podless)
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "adapters", "emptyDir": {"sizeLimit": "1536Mi"}} in pod["volumes"]
    for container in pod["containers"]:
        assert {"name": "GPUFLEET_ADAPTER_DIR", "value": "/var/lib/gpufleet/adapters"} in container["env"]

    table = control_plane.kubectl("get", "iad", "-n", podless).stdout
    assert table.split("\n")[0].split()[:5] == ["NAME", "SERVICE", "READY", "REASON", "LOADED"]
    assert "support" in table and "chat" in table


async def test_an_adapter_of_a_missing_service_says_service_not_found(control_plane, operator, kube, podless):
    apply(control_plane, podless, adapter("orphan", service_name="nowhere"))

    async def reported():
        o = await kube.get(API, "InferenceAdapter", "orphan", podless)
        ready = c.get((o.get("status") or {}).get("conditions"), c.READY)
        return ready if ready and ready["reason"] == "ServiceNotFound" else None
    ready = await wait_for(reported, timeout=60, what="orphan: ServiceNotFound")
    assert ready["status"] == "False" and "InferenceService nowhere not found" in ready["message"]
