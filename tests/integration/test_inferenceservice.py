"""InferenceService against the real API server and the real operator process:
create, update with rollout, drift repair, delete, invalid input, isolation."""
import json

import pytest
import yaml

from gpufleet.reconcile import conditions as c
from tests.support.waiting import PODS_START_SECONDS, wait_for

API = "serving.gpufleet.dev/v1alpha1"


def manifest(name, **spec):
    base = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}}
    base.update(spec)
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": name}, "spec": base}


def apply(control_plane, namespace, obj, check=True):
    return control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=check)


async def isvc(kube, namespace, name):
    return await kube.get(API, "InferenceService", name, namespace)


def cond(obj, type_):
    return c.get((obj.get("status") or {}).get("conditions"), type_) or {}


async def brief(kube, namespace, name) -> str:
    """What a timeout needs to say, short enough to survive a truncated CI log: the service's
    conditions and counts, and where its pods are."""
    o = await isvc(kube, namespace, name)
    st = o.get("status") or {}
    conds = "; ".join(f"{x['type']}={x['status']} {x.get('reason')}: {x.get('message')}"
                      for x in st.get("conditions") or [])
    pods = ", ".join(f"{p['metadata']['name']} {p['status'].get('phase')} on {p['spec'].get('nodeName')}"
                     for p in await kube.list("v1", "Pod", namespace))
    return (f"generation {o['metadata']['generation']} observed {st.get('observedGeneration')}, "
            f"ready {st.get('readyReplicas')}/{st.get('desiredReplicas')}; {conds}; pods: {pods or 'none'}")


async def wait_ready(kube, namespace, name, replicas=1, timeout=PODS_START_SECONDS):
    async def ready():
        o = await isvc(kube, namespace, name)
        st = o.get("status") or {}
        return o if cond(o, "Ready").get("status") == "True" and st.get("readyReplicas") == replicas and \
            st.get("observedGeneration") == o["metadata"]["generation"] else None
    return await wait_for(ready, timeout=timeout, what=f"{name} Ready with {replicas} replicas",
                          describe=lambda: brief(kube, namespace, name))


async def test_create_update_drift_delete(control_plane, operator, kube, namespace):
    apply(control_plane, namespace, manifest("chat", autoscaling={"minReplicas": 2, "maxReplicas": 4}))
    obj = await wait_ready(kube, namespace, "chat", replicas=2)
    st = obj["status"]
    assert st["desiredReplicas"] == 2 and st["endpoint"] == f"http://chat.{namespace}.svc:80/v1"
    assert cond(obj, "Isolated")["reason"] in ("Enforced", "Verified")
    for kind, api, name in [("Deployment", "apps/v1", "chat-engine"), ("Service", "v1", "chat"),
                            ("ConfigMap", "v1", "chat-guard"), ("PodDisruptionBudget", "policy/v1", "chat-engine")]:
        child = await kube.get(api, kind, name, namespace)
        assert child["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]

    # kubectl get answers the on-call questions.
    table = control_plane.kubectl("get", "inferenceservice", "chat", "-n", namespace).stdout
    assert table.split("\n")[0].split()[:5] == ["NAME", "READY", "REASON", "REPLICAS", "DESIRED"]
    assert "AllReplicasReady" in table

    # Update: an admission setting changes the ConfigMap only; the running guards reload it,
    # and vLLM keeps running (the pod template, hence the pods, stay as they are).
    dep = await kube.get("apps/v1", "Deployment", "chat-engine", namespace)
    old_hash = dep["spec"]["template"]["metadata"]["annotations"]["gpufleet.dev/config-hash"]
    pods = sorted(p["metadata"]["uid"] for p in await kube.list("v1", "Pod", namespace))
    apply(control_plane, namespace, manifest("chat", autoscaling={"minReplicas": 2, "maxReplicas": 4},
                                             admission={"kvWatermarkPercent": 10}))

    async def configured():
        o = await isvc(kube, namespace, "chat")
        cm = await kube.get("v1", "ConfigMap", "chat-guard", namespace)
        return (o.get("status") or {}).get("observedGeneration") == 2 and \
            json.loads(cm["data"]["guard.json"])["kvWatermarkPercent"] == 10
    await wait_for(configured, timeout=30, what="the new guard config in the ConfigMap")
    d = await kube.get("apps/v1", "Deployment", "chat-engine", namespace)
    assert d["spec"]["template"] == dep["spec"]["template"]
    assert d["metadata"]["generation"] == dep["metadata"]["generation"]
    assert sorted(p["metadata"]["uid"] for p in await kube.list("v1", "Pod", namespace)) == pods

    # An engine setting rolls the pods: vLLM only takes it at start.
    apply(control_plane, namespace, manifest("chat", autoscaling={"minReplicas": 2, "maxReplicas": 4},
                                             admission={"kvWatermarkPercent": 10}, engine={"maxNumSeqs": 128}))

    async def rolled():
        d = await kube.get("apps/v1", "Deployment", "chat-engine", namespace)
        return d["spec"]["template"]["metadata"]["annotations"]["gpufleet.dev/config-hash"] != old_hash
    await wait_for(rolled, timeout=30, what="the new engine config to roll out")
    obj = await wait_ready(kube, namespace, "chat", replicas=2)
    assert obj["status"]["observedGeneration"] == 3

    # Ready holds as soon as the operator handled generation 3 (the old revision's pods are
    # still ready); the Deployment controller makes the new ReplicaSet in its own time.
    async def two_revisions():
        rs = await kube.list("apps/v1", "ReplicaSet", namespace)
        return rs if len(rs) == 2 else None
    await wait_for(two_revisions, timeout=30, what="the old and the new revision's ReplicaSets",
                   describe=lambda: kube.list("apps/v1", "ReplicaSet", namespace))

    # Drift: a hand edit of a managed field is put back.
    control_plane.kubectl("-n", namespace, "scale", "deployment/chat-engine", "--replicas=5")
    control_plane.kubectl("-n", namespace, "patch", "service", "chat", "--type=merge",
                          "-p", '{"spec":{"ports":[{"name":"http","port":80,"targetPort":9999}]}}')

    async def repaired():
        d = await kube.get("apps/v1", "Deployment", "chat-engine", namespace)
        s = await kube.get("v1", "Service", "chat", namespace)
        return d["spec"]["replicas"] == 2 and s["spec"]["ports"][0]["targetPort"] == "http"
    await wait_for(repaired, timeout=60, what="the operator to undo the hand edits",
                   describe=lambda: brief(kube, namespace, "chat"))

    # Delete: the garbage collector takes every child with the owner.
    control_plane.kubectl("-n", namespace, "delete", "inferenceservice", "chat", "--wait=true")

    async def gone():
        return not await kube.get_or_none("apps/v1", "Deployment", "chat-engine", namespace) and \
            not await kube.get_or_none("v1", "ConfigMap", "chat-guard", namespace)
    # The garbage collector re-discovers API resources every 30 s, so right after the CRD is
    # installed it may not know InferenceServices yet (the same holds on any cluster).
    await wait_for(gone, timeout=90, what="children to be garbage-collected")


async def test_manual_mode_scales_through_the_scale_subresource(control_plane, operator, kube, namespace):
    apply(control_plane, namespace, manifest("manual", autoscaling={"mode": "Manual", "maxReplicas": 3},
                                             replicas=1))
    await wait_ready(kube, namespace, "manual", replicas=1)
    control_plane.kubectl("-n", namespace, "scale", "inferenceservice/manual", "--replicas=3")
    obj = await wait_ready(kube, namespace, "manual", replicas=3)
    assert obj["status"]["desiredReplicas"] == 3


async def test_operator_side_invalid_spec_is_reported_not_retried(control_plane, operator, kube, namespace):
    apply(control_plane, namespace, manifest("bad", engine={"extraArgs": ["--port=9000"]}))

    async def invalid():
        o = await isvc(kube, namespace, "bad")
        return o if cond(o, "Ready").get("reason") == "InvalidSpec" else None
    obj = await wait_for(invalid, timeout=60, what="Ready=False InvalidSpec",
                         describe=lambda: brief(kube, namespace, "bad"))
    assert cond(obj, "Ready")["message"] == ("spec.engine.extraArgs[0]: --port is managed by gpufleet; remove it "
                                             "and leave it to the pod layout")
    assert await kube.get_or_none("apps/v1", "Deployment", "bad-engine", namespace) is None
    events = await kube.list("v1", "Event", namespace, field_selector="involvedObject.name=bad")
    assert [e["reason"] for e in events].count("InvalidSpec") == 1
    # Fixing the spec makes it converge.
    apply(control_plane, namespace, manifest("bad", engine={"extraArgs": ["--enable-chunked-prefill"]}))
    await wait_ready(kube, namespace, "bad", replicas=1)


INVALID = [
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
     "spec.autoscaling.minReplicas: Invalid value: \"object\": autoscaling.minReplicas must be less than or "
     "equal to autoscaling.maxReplicas"),
    ({"autoscaling": {"kvLowWatermarkPercent": 80, "kvHighWatermarkPercent": 70}},
     "autoscaling.kvLowWatermarkPercent must be below autoscaling.kvHighWatermarkPercent"),
    ({"engine": {"tensorParallelSize": 4}, "resources": {"gpusPerReplica": 2}},
     "engine.tensorParallelSize must divide resources.gpusPerReplica"),
    ({"admission": {"kvWatermarkPercent": 30}},
     "autoscaling.kvHighWatermarkPercent must be at most 100 - admission.kvWatermarkPercent"),
    ({"engine": {"runtime": "vllm-cpu"}},
     "engine.kvCache.blockSize must be a multiple of 32 when engine.runtime is vllm-cpu"),
    ({"isolation": {"mode": "Sometimes"}},
     'spec.isolation.mode: Unsupported value: "Sometimes": supported values: "Dedicated", "Exclusive", "Shared"'),
    ({"admission": {"kvWatermarkPercent": 0.15}},
     'spec.admission.kvWatermarkPercent: Invalid value: "number": spec.admission.kvWatermarkPercent in body '
     'must be of type integer: "number"'),
    ({"model": {"name": "m", "source": {"pvc": {"claimName": "w"}, "uri": "s3://b/m"}}},
     "set at most one of model.source.huggingFace, model.source.pvc, model.source.uri"),
    ({"resources": {"migProfile": "1g.10gb", "gpusPerReplica": 2}, "engine": {"tensorParallelSize": 1}},
     "resources.migProfile needs resources.gpusPerReplica: 1"),
    ({"model": {"name": "m", "maxModelLen": 4096}, "admission": {"maxContextTokens": 8192}},
     "admission.maxContextTokens must not exceed model.maxModelLen"),
    ({"model": {"name": ""}}, "spec.model.name: Invalid value: \"\": spec.model.name in body should be at least 1 "
                              "chars long"),
    ({"admission": {"queueClasses": [{"name": "a", "level": 1, "maxQueueSeconds": 1},
                                     {"name": "a", "level": 2, "maxQueueSeconds": 1}]}},
     "spec.admission.queueClasses[1]: Duplicate value: {\"name\":\"a\"}"),
    ({"admission": {"routeClasses": [{"route": "/v1/completions", "defaultClass": "vip"}]}},
     "every admission.routeClasses[].defaultClass must name a class in admission.queueClasses"),
    ({"pod": {"volumes": [{"name": "cache", "emptyDir": {}}]}}, "pod.volumes names guard-config, cache"),
    ({"pod": {"volumes": [{"secret": {"secretName": "s"}}]}}, "spec.pod.volumes[0].name: Required value"),
    ({"pod": {"volumeMounts": [{"name": "x", "mountPath": "/x"}]}},
     "every pod.volumeMounts[].name must name a volume in pod.volumes"),
    ({"pod": {"labels": {"gpufleet.dev/model": "x"}}}, "pod.labels keys under gpufleet.dev/ are gpufleet's"),
    ({"resources": {"memory": "lots"}}, "spec.resources.memory in body should match"),
    # What the Deployment would refuse is refused here first, naming the field of the spec.
    ({"resources": {"memory": "-1Gi"}}, "spec.resources.memory in body should match"),
    ({"resources": {"cpu": -2}}, "spec.resources.cpu in body should be greater than or equal to 0"),
    ({"resources": {"gpuProduct": "NVIDIA H100"}}, "spec.resources.gpuProduct in body should match"),
    ({"isolation": {"nodeSelector": {"zone": "a b"}}}, "spec.isolation.nodeSelector.zone in body should match"),
    ({"isolation": {"nodeSelector": {"no spaces/here": "a"}}}, "isolation.nodeSelector keys must be label keys"),
    ({"isolation": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
     "a toleration with operator Exists takes no value"),
    ({"isolation": {"tolerations": [{"key": "k", "value": "v", "tolerationSeconds": 5}]}},
     "tolerationSeconds applies only to effect NoExecute"),
    ({"isolation": {"tolerations": [{"value": "v"}]}}, "a toleration without a key must have operator Exists"),
    # An objective of 100% leaves no error budget for the burn-rate alerts to divide by.
    ({"slo": {"availabilityPercent": "100"}}, "spec.slo.availabilityPercent in body should match"),
    ({"model": {"name": "m", "source": {"uri": "s3://bucket/llama"}}},
     "model.source.uri must be an absolute path inside the engine image"),
    ({"model": {"name": "m", "cache": {"persistentVolumeClaim": {}}}},
     "model.cache.persistentVolumeClaim: set exactly one of claimName (an existing claim) and size"),
    ({"model": {"name": "m", "cache": {"persistentVolumeClaim": {"claimName": "w", "accessMode": "ReadWriteOnce"}}}},
     "storageClassName and accessMode are for the claim the operator creates"),
    ({"model": {"name": "m", "cache": {"persistentVolumeClaim": {"size": "1Gi"}, "hostPath": {"path": "/d"}}}},
     "set at most one of model.cache.persistentVolumeClaim and model.cache.hostPath"),
    ({"model": {"name": "m", "source": {"pvc": {"claimName": "w"}}, "cache": {"hostPath": {"path": "/d"}}}},
     "model.source.pvc and model.source.uri are read in place"),
    ({"model": {"name": "m", "cache": {"ephemeralStorage": "-5Gi"}}},
     "spec.model.cache.ephemeralStorage in body should match"),
    # Clients send servedName as `model` in OpenAI requests; none can send one with a space.
    ({"model": {"name": "m", "servedName": "my model"}},
     "spec.model.servedName: Invalid value: \"string\": spec.model.servedName must not contain whitespace or "
     "control characters"),
]


@pytest.mark.parametrize("spec, message", INVALID, ids=[m[:40] for _, m in INVALID])
def test_invalid_input_is_rejected_by_the_apiserver_naming_the_field(control_plane, crds_installed, namespace,
                                                                     spec, message):
    obj = manifest("invalid", **spec)
    if "model" in spec:
        obj["spec"]["model"] = spec["model"]
    result = apply(control_plane, namespace, obj, check=False)
    assert result.returncode != 0, "the apiserver accepted an invalid object"
    assert message in result.stderr, result.stderr


async def test_a_model_cache_claim_is_created_owned_and_mounted(control_plane, operator, kube, namespace):
    """The claim passes the real API server and every replica mounts it over HF_HOME. (No volume
    provisioner runs here: the claim stays Pending and so do the pods; a real cluster binds it.)"""
    apply(control_plane, namespace, manifest("cached", model={
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "cache": {"persistentVolumeClaim": {"size": "40Gi", "accessMode": "ReadWriteMany"}}}))
    claim = await wait_for(lambda: kube.get_or_none("v1", "PersistentVolumeClaim", "cached-model-cache", namespace),
                           timeout=60, what="the model cache claim", describe=lambda: brief(kube, namespace, "cached"))
    owner = await isvc(kube, namespace, "cached")
    assert claim["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "40Gi"
    dep = await wait_for(lambda: kube.get_or_none("apps/v1", "Deployment", "cached-engine", namespace),
                         timeout=60, what="the engine Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "cached-model-cache"}} in pod["volumes"]
    assert "ephemeral-storage" not in pod["containers"][0]["resources"]["requests"]


def test_kubectl_explain_teaches_the_fields(control_plane, crds_installed):
    explained = control_plane.kubectl("explain", "inferenceservice.spec.admission.kvWatermarkPercent")
    out = " ".join(explained.stdout.split())
    assert "Share of KV blocks kept free" in out
    out = " ".join(control_plane.kubectl("explain", "inferenceservice.spec.isolation").stdout.split())
    assert "Dedicated: no other model's pods on a node running this model" in out


def test_pod_settings_pass_the_crd_and_the_deployment_they_build_passes_the_apiserver(
        control_plane, crds_installed, namespace):
    from gpufleet.manifests import children
    from gpufleet_api import parse_spec
    from tests.unit.test_manifests import POD_SETTINGS
    obj = manifest("podded", pod=POD_SETTINGS)
    apply(control_plane, namespace, obj)
    stored = json.loads(control_plane.kubectl("get", "inferenceservice", "podded", "-n", namespace,
                                              "-o", "json").stdout)
    assert stored["spec"]["pod"]["volumes"] == POD_SETTINGS["volumes"]       # kept as written
    owner = {"metadata": {**stored["metadata"], "namespace": namespace}}
    spec = parse_spec(stored["spec"])
    _, config_hash = children.build_configmap(owner, spec)
    deployment = children.build_deployment(owner, spec, 1, config_hash["unified"])
    # Under a name of its own: the operator creates podded-engine meanwhile, and a dry run under that name
    # raced it (kubectl's GET found none, its dry-run create found the operator's: AlreadyExists).
    deployment["metadata"]["name"] = "podded-engine-dry-run"
    result = control_plane.kubectl("create", "-n", namespace, "--dry-run=server", "-f", "-",
                                   input=yaml.safe_dump(deployment), check=False)
    assert result.returncode == 0, result.stderr
