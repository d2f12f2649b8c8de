"""A disaggregated service's children (spec.disaggregation, engine.kvTransfer, engine.kvTier): two
Deployments with their own role, replicas, resources and guard.json; the KV volume, the peers'
NetworkPolicy and the role on scraped series. Each guard.json is read back as the guard reads it
and turned into vLLM's command line as the pod runs it."""
import json

import pytest

from gpufleet.manifests import children, guard_config, names, pools
from gpufleet.manifests.network_policy import EngineIngress
from gpufleet.reconcile.desired import desired_children, stale_deployments
from gpufleet_api import parse_spec
from gpufleet_api.guard import guard_config as contract
from gpufleet_api.v1alpha1 import KV_STORE_MOUNT
from gpufleet_engine.launch.flags import vllm_launch

ISVC = {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1", "generation": 3}}
SHARED = {"connector": "SharedStorage", "sharedStorage": {"hostPath": {"path": "/var/lib/kv"}}}
CPU = {"runtime": "vllm-cpu", "kvCache": {"blockSize": 32}}
INGRESS = EngineIngress(operator_namespace="gpufleet", operator_pod_labels={"app": "gpufleet"})


def spec(**over):
    return parse_spec({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, **over})


def pd(engine=None, **over):
    return spec(disaggregation=over.pop("disaggregation", {}), engine={"kvTransfer": SHARED, **(engine or {})},
                **over)


def objects(s, replicas=None, **kw):
    replicas = replicas or {p.role: 1 for p in pools.pools(s)}
    return desired_children(ISVC, s, replicas, with_podmonitor=True, **kw)


def by_name(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def config_of(cm: dict, role: str) -> contract.GuardConfig:
    return contract.parse(json.loads(cm["data"][names.guard_config_key(role)]))


def engine_container(dep: dict) -> dict:
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")


def test_a_disaggregated_service_gets_a_prefill_and_a_decode_deployment_instead_of_the_engine():
    objs = objects(pd(), {"prefill": 2, "decode": 3})
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("ConfigMap", "chat-guard"), ("Deployment", "chat-prefill"), ("Deployment", "chat-decode"),
        ("Service", "chat"), ("PodDisruptionBudget", "chat-prefill"), ("PodDisruptionBudget", "chat-decode"),
        ("PodMonitor", "chat-engine")]
    deps = by_name(objs, "Deployment")
    for role, replicas in (("prefill", 2), ("decode", 3)):
        d = deps[f"chat-{role}"]
        assert d["spec"]["replicas"] == replicas
        assert d["spec"]["selector"]["matchLabels"] == {**names.selector_labels("chat"), names.LABEL_ROLE: role}
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert labels[names.LABEL_ROLE] == role and labels[names.LABEL_SERVICE] == "chat"


def test_the_service_and_the_monitor_select_the_pods_of_both_pools():
    objs = objects(pd(), engine_ingress=INGRESS)
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in by_name(objs, "Deployment").values()]
    selectors = [by_name(objs, "Service")["chat"]["spec"]["selector"],
                 by_name(objs, "PodMonitor")["chat-engine"]["spec"]["selector"]["matchLabels"],
                 by_name(objs, "NetworkPolicy")["chat-engine"]["spec"]["podSelector"]["matchLabels"]]
    for selector in selectors:
        assert names.LABEL_ROLE not in selector
        assert all(all(labels.get(k) == v for k, v in selector.items()) for labels in pod_labels)


def test_a_unified_service_keeps_its_engine_deployment_and_its_pods_carry_no_role():
    d = by_name(objects(spec()), "Deployment")
    assert list(d) == ["chat-engine"]
    assert names.LABEL_ROLE not in d["chat-engine"]["spec"]["template"]["metadata"]["labels"]
    assert d["chat-engine"]["spec"]["selector"]["matchLabels"] == names.selector_labels("chat")


def test_each_pool_has_its_own_resources_or_the_services():
    s = pd(resources={"cpu": "8", "memory": "64Gi"},
           disaggregation={"prefill": {"resources": {"gpusPerReplica": 2, "cpu": "16", "memory": "96Gi"}}})
    deps = by_name(objects(s), "Deployment")
    prefill, decode = engine_container(deps["chat-prefill"]), engine_container(deps["chat-decode"])
    assert prefill["resources"]["limits"] == {"memory": "96Gi", "nvidia.com/gpu": "2"}
    assert prefill["resources"]["requests"]["cpu"] == "16"
    assert decode["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "1"}


def test_one_configmap_holds_a_guard_json_per_pool_and_each_pod_reads_its_own():
    s = pd()
    cm, hashes = children.build_configmap(ISVC, s)
    assert set(cm["data"]) == {"guard-prefill.json", "guard-decode.json"}
    deps = by_name(objects(s), "Deployment")
    for role in ("prefill", "decode"):
        config = config_of(cm, role)
        assert config.role == role
        template = deps[f"chat-{role}"]["spec"]["template"]
        assert template["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH] == hashes[role]
        for c in template["spec"]["containers"]:
            assert f"/etc/gpufleet/guard-{role}.json" in c["command"]
    assert hashes["prefill"] != hashes["decode"]  # a restart field differs: the role


@pytest.mark.parametrize("connector, vllm_name", [("Nixl", "NixlConnector"), ("LMCache", "LMCacheConnectorV1"),
                                                  ("SharedStorage", "ExampleConnector")])
def test_each_pool_renders_the_connector_with_its_kv_role(connector, vllm_name):
    kv = SHARED if connector == "SharedStorage" else {"connector": connector}
    s = spec(disaggregation={}, engine={"kvTransfer": {**kv, "loadFailurePolicy": "Fail",
                                                        "extraConfig": {"backends": "UCX"}}})
    cm, _ = children.build_configmap(ISVC, s)
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        engine = config_of(cm, role).engine
        assert engine is not None and engine.kv_transfer is not None
        argv = list(vllm_launch(engine).argv)
        document = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert document["kv_connector"] == vllm_name and document["kv_role"] == kv_role
        assert document["kv_load_failure_policy"] == "fail"
        assert document["kv_connector_extra_config"]["backends"] == "UCX"
        if connector == "SharedStorage":
            assert document["kv_connector_extra_config"]["shared_storage_path"] == KV_STORE_MOUNT


def test_a_shared_kv_tier_gives_the_unified_pool_kv_both_and_without_it_no_connector():
    cm, _ = children.build_configmap(ISVC, spec(engine={"kvTier": "Shared", "kvTransfer": SHARED}))
    kv = config_of(cm, "unified").engine.kv_transfer
    assert list(cm["data"]) == ["guard.json"] and kv is not None and kv.role == "kv_both"
    # kvTransfer on a unified service with kvTier Off: not rendered, and no volume mounted.
    s = spec(engine={"kvTransfer": SHARED})
    cm, _ = children.build_configmap(ISVC, s)
    assert config_of(cm, "unified").engine.kv_transfer is None
    assert "kv-store" not in {v["name"] for v in
                              by_name(objects(s), "Deployment")["chat-engine"]["spec"]["template"]["spec"]["volumes"]}


def test_the_shared_storage_volume_is_mounted_in_the_engine_of_every_pod_and_the_guard_of_every_writer():
    """The guard of a pod that writes KV files (prefill's kv_producer, a tier's kv_both) bounds the
    directory; a decode pod's guard has nothing to remove and does not see it."""
    for s in (pd(engine=CPU), spec(engine={**CPU, "kvTier": "Shared", "kvTransfer": SHARED})):
        for name, dep in by_name(objects(s), "Deployment").items():
            pod = dep["spec"]["template"]["spec"]
            assert {"name": "kv-store", "hostPath": {"path": "/var/lib/kv", "type": "Directory"}} in pod["volumes"]
            assert {"name": "kv-store", "mountPath": KV_STORE_MOUNT} in engine_container(dep)["volumeMounts"]
            guard = next(c for c in pod["containers"] if c["name"] == "guard")
            in_guard = {"name": "kv-store", "mountPath": KV_STORE_MOUNT} in guard["volumeMounts"]
            assert in_guard == (name != "chat-decode"), name


def test_the_store_is_bounded_by_its_size_limit():
    cm, _ = children.build_configmap(ISVC, pd(engine={**CPU, "kvTransfer": {
        **SHARED, "sharedStorage": {**SHARED["sharedStorage"], "sizeLimitGiB": 20}}}))
    assert config_of(cm, "prefill").engine.kv_transfer.shared_storage_limit_bytes == 20 << 30
    cm, _ = children.build_configmap(ISVC, pd(engine=CPU))
    assert config_of(cm, "prefill").engine.kv_transfer.shared_storage_limit_bytes == 4 << 30


def test_a_claim_for_the_kv_files_is_writable_by_the_engine():
    s = pd(engine={"kvTransfer": {"connector": "SharedStorage",
                                  "sharedStorage": {"persistentVolumeClaim": {"claimName": "kv"}}}})
    pod = by_name(objects(s), "Deployment")["chat-decode"]["spec"]["template"]["spec"]
    assert {"name": "kv-store", "persistentVolumeClaim": {"claimName": "kv"}} in pod["volumes"]
    assert pod["securityContext"]["fsGroup"] == children.RUN_AS_USER


def test_the_operator_creates_the_claim_of_the_kv_files_when_given_a_size():
    s = pd(engine={"kvTransfer": {"connector": "SharedStorage",
                                  "sharedStorage": {"persistentVolumeClaim": {"size": "50Gi"}}}})
    objs = objects(s)
    claim = by_name(objs, "PersistentVolumeClaim")["chat-kv-store"]
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "50Gi"}}}
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    assert objs.index(claim) < min(objs.index(d) for d in by_name(objs, "Deployment").values())
    for dep in by_name(objs, "Deployment").values():
        assert {"name": "kv-store", "persistentVolumeClaim": {"claimName": "chat-kv-store"}} in \
            dep["spec"]["template"]["spec"]["volumes"]
    # An existing claim, or a unified service not running the connector (kvTier Off): nothing created.
    named = pd(engine={"kvTransfer": {"connector": "SharedStorage",
                                      "sharedStorage": {"persistentVolumeClaim": {"claimName": "kv"}}}})
    unified = spec(engine={"kvTransfer": {"connector": "SharedStorage",
                                          "sharedStorage": {"persistentVolumeClaim": {"size": "50Gi"}}}})
    assert not by_name(objects(named), "PersistentVolumeClaim") and not by_name(objects(unified),
                                                                                "PersistentVolumeClaim")


def test_pods_with_a_connector_run_without_expandable_segments_which_vllm_refuses_beside_one():
    def allocator(s, name):
        env = engine_container(by_name(objects(s), "Deployment")[name])["env"]
        return next((e["value"] for e in env if e["name"] == "PYTORCH_CUDA_ALLOC_CONF"), None)
    assert allocator(spec(), "chat-engine") == "expandable_segments:True"
    assert allocator(pd(), "chat-prefill") is None
    mixed = pd(engine={"cudaAllocatorConfig": "expandable_segments:True,max_split_size_mb:512"})
    assert allocator(mixed, "chat-decode") == "max_split_size_mb:512"
    assert allocator(spec(engine={"kvTransfer": SHARED}), "chat-engine") == "expandable_segments:True"


def test_nixl_pods_advertise_their_address_and_may_reach_each_other():
    s = pd(engine={"kvTransfer": {"connector": "Nixl"}})
    objs = objects(s, engine_ingress=INGRESS)
    for dep in by_name(objs, "Deployment").values():
        env = {e["name"]: e for e in engine_container(dep)["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    rules = by_name(objs, "NetworkPolicy")["chat-engine"]["spec"]["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": names.selector_labels("chat")}}]} in rules
    # Through a shared volume the pods need not reach each other: the guard's port only.
    shared = by_name(objects(pd(), engine_ingress=INGRESS), "NetworkPolicy")["chat-engine"]["spec"]["ingress"]
    assert len(shared) == 1 and shared[0]["ports"] == [{"protocol": "TCP", "port": names.GUARD_PORT}]


def test_scraped_series_carry_the_pods_role():
    monitor = by_name(objects(pd()), "PodMonitor")["chat-engine"]
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert {"sourceLabels": ["__meta_kubernetes_pod_label_gpufleet_dev_role"],
                "targetLabel": "role"} in endpoint["relabelings"]


def test_admission_changes_reach_both_pools_live_and_engine_changes_roll_both():
    before = children.build_configmap(ISVC, pd())
    live = children.build_configmap(ISVC, pd(admission={"maxConcurrency": 8}))
    rolled = children.build_configmap(ISVC, pd(engine={"maxNumSeqs": 8}))
    assert live[0]["data"] != before[0]["data"] and live[1] == before[1]
    assert all(rolled[1][role] != before[1][role] for role in ("prefill", "decode"))


def test_the_guard_config_of_a_pool_is_the_contracts():
    config = guard_config.build_guard_config("chat", "ml", pd(), "decode")
    assert contract.parse(json.loads(guard_config.render(config))) == config


def owned(name, uid="u-1"):
    return {"metadata": {"name": name, "ownerReferences": [{"uid": uid, "controller": True}]}}


def test_switching_shape_leaves_the_other_shapes_deployments_to_prune_and_only_ours():
    found = [owned("chat-engine"), owned("chat-prefill"), owned("chat-decode"), owned("chat-other"),
             owned("chat-engine", uid="someone-else")]
    assert [d["metadata"]["name"] for d in stale_deployments(ISVC, pd(), found)] == ["chat-engine"]
    assert [d["metadata"]["name"] for d in stale_deployments(ISVC, spec(), found)] == ["chat-prefill", "chat-decode"]
