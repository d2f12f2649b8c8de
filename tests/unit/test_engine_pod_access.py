"""Engine pods take work only through the guard: vLLM on the pod's loopback,
the guard's port the only one declared and scraped, a NetworkPolicy whose
selectors pick exactly the service's pods and the operator's, and containers
that meet the restricted Pod Security Standard."""
import json

import pytest
from click.testing import CliRunner

from gpufleet.cli import main
from gpufleet.manifests import children, guard_config, names
from gpufleet.manifests.network_policy import EngineIngress, build_network_policy
from gpufleet.reconcile.desired import desired_children
from gpufleet_api import parse_spec
from gpufleet_dev.devcluster.engines import pod_loopback

ISVC = {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1", "generation": 3}}
OTHER = {**ISVC, "metadata": {**ISVC["metadata"], "name": "chat-2", "uid": "u-2"}}
OPERATOR_LABELS = {"app.kubernetes.io/name": "gpufleet-operator", "app.kubernetes.io/instance": "gpufleet"}
INGRESS = EngineIngress("gpufleet-system", OPERATOR_LABELS, client_namespaces=("gateway",),
                        prometheus_namespaces=("monitoring",))


def spec(**over):
    return parse_spec({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, **over})


def pod_template(isvc=ISVC, s=None) -> dict:
    s = s or spec()
    _cm, h = children.build_configmap(isvc, s)
    return children.build_deployment(isvc, s, 1, h["unified"])["spec"]["template"]


def matches(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics for matchLabels and In/NotIn/Exists/DoesNotExist."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def namespace_labels(name: str) -> dict:
    return {"kubernetes.io/metadata.name": name}  # what the API server puts on every namespace


def admitted(policy: dict, source_namespace: str, source_labels: dict, port: int) -> bool:
    """Whether ``policy`` lets a pod with these labels in this namespace in on ``port`` (TCP)."""
    for rule in policy["spec"]["ingress"]:
        if not any(p["port"] == port and p["protocol"] == "TCP" for p in rule["ports"]):
            continue
        for peer in rule["from"]:
            ns_ok = matches(peer["namespaceSelector"], namespace_labels(source_namespace)) \
                if "namespaceSelector" in peer else source_namespace == policy["metadata"]["namespace"]
            pod_ok = matches(peer["podSelector"], source_labels) if "podSelector" in peer else True
            if ns_ok and pod_ok:
                return True
    return False


def test_vllm_is_told_to_listen_on_the_pods_loopback_and_the_guard_reaches_it_there():
    doc = json.loads(guard_config.render(guard_config.build_guard_config("chat", "ml", spec())))
    assert doc["engine"]["host"] == "127.0.0.1"
    assert doc["engineUrl"] == f"http://127.0.0.1:{doc['engine']['port']}"


def test_the_guard_port_is_the_only_port_the_pod_declares():
    pod = pod_template()["spec"]
    ports = [p for c in pod["containers"] for p in c.get("ports", [])]
    assert ports == [{"name": "http", "containerPort": names.GUARD_PORT}]


def test_prometheus_reads_both_metric_sets_on_the_guard_port_and_keeps_them_apart():
    pm = children.build_podmonitor(ISVC, spec())
    endpoints = pm["spec"]["podMetricsEndpoints"]
    assert [(e["port"], e["path"]) for e in endpoints] == [("http", "/metrics"), ("http", "/metrics/engine")]
    # endpoint="vllm": the series (and the up of the scrape) read as before, apart from the guard's.
    assert {"targetLabel": "endpoint", "replacement": "vllm"} in endpoints[1]["relabelings"]
    assert all(r.get("targetLabel") != "endpoint" for r in endpoints[0]["relabelings"])


def test_both_containers_meet_the_restricted_pod_security_standard():
    pod = pod_template()["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] != 0 and sc["runAsNonRoot"], c["name"]
    assert "hostNetwork" not in pod and "hostPID" not in pod
    assert not any("hostPath" in v for v in pod["volumes"])


def test_everything_vllm_writes_is_an_emptydir_and_its_caches_follow_home():
    pod = pod_template()["spec"]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    writable = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"] if not m.get("readOnly")}
    assert {"/tmp", "/cache", "/dev/shm"} <= writable.keys()
    assert all(name in empty_dirs for name in writable.values())
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["HOME"] == env["XDG_CACHE_HOME"] == "/cache" and env["HF_HOME"].startswith("/cache/")
    assert env["USER"]  # no passwd entry for the uid; torch asks getpass for a name


def test_no_network_policy_unless_the_operator_is_told_who_may_reach_the_engines():
    kinds = [o["kind"] for o in desired_children(ISVC, spec(), {"unified": 1}, with_podmonitor=False)]
    assert "NetworkPolicy" not in kinds
    objs = desired_children(ISVC, spec(), {"unified": 1}, with_podmonitor=False, engine_ingress=INGRESS)
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy")
    assert policy["metadata"]["name"] == "chat-engine" and policy["metadata"]["namespace"] == "ml"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress open: weights download from anywhere


def test_the_policy_selects_this_services_engine_pods_and_no_others():
    policy = build_network_policy(ISVC, INGRESS)
    assert matches(policy["spec"]["podSelector"], pod_template()["metadata"]["labels"])
    assert not matches(policy["spec"]["podSelector"], pod_template(OTHER)["metadata"]["labels"])
    # spec.pod.labels cannot take a pod out of (or into) the selection: gpufleet's labels win.
    labelled = pod_template(s=spec(pod={"labels": {"team": "a"}}))["metadata"]["labels"]
    assert matches(policy["spec"]["podSelector"], labelled)


@pytest.mark.parametrize("namespace, labels, port, allowed", [
    ("gpufleet-system", OPERATOR_LABELS, names.GUARD_PORT, True),
    ("gpufleet-system", {"app": "something-else"}, names.GUARD_PORT, False),
    ("elsewhere", OPERATOR_LABELS, names.GUARD_PORT, False),      # the labels alone are not enough
    ("gateway", {"app": "envoy"}, names.GUARD_PORT, True),
    ("monitoring", {"app": "prometheus"}, names.GUARD_PORT, True),
    ("ml", {"app": "notebook"}, names.GUARD_PORT, True),           # the service's own namespace
    ("other-team", {"app": "notebook"}, names.GUARD_PORT, False),
    ("gateway", {"app": "envoy"}, names.ENGINE_PORT, False),       # never vLLM's port
])
def test_who_reaches_the_guard_port(namespace, labels, port, allowed):
    assert admitted(build_network_policy(ISVC, INGRESS), namespace, labels, port) is allowed


def test_without_same_namespace_clients_only_the_named_namespaces_get_in():
    closed = EngineIngress("gpufleet-system", OPERATOR_LABELS, same_namespace=False)
    policy = build_network_policy(ISVC, closed)
    assert not admitted(policy, "ml", {"app": "notebook"}, names.GUARD_PORT)
    assert admitted(policy, "gpufleet-system", OPERATOR_LABELS, names.GUARD_PORT)


@pytest.mark.parametrize("args, message", [
    (["--network-policies", "--network-policy-operator-namespace", "x"], "--network-policy-operator-label"),
    (["--network-policies", "--network-policy-operator-label", "app"], "is not KEY=VALUE"),
])
def test_network_policies_without_the_operators_labels_are_refused_with_the_option_to_pass(args, message,
                                                                                            tmp_path):
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: "
                          "'https://127.0.0.1:1'}}]\nusers: [{name: u, user: {token: t}}]\ncontexts: "
                          "[{name: c, context: {cluster: c, user: u}}]\ncurrent-context: c\n")
    result = CliRunner().invoke(main, ["run", "--kubeconfig", str(kubeconfig), *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_each_backed_pod_gets_a_loopback_of_its_own_for_vllm():
    assert pod_loopback("127.64.0.5") == "127.65.0.5"
    assert pod_loopback("127.64.1.5") != pod_loopback("127.64.0.5")
    with pytest.raises(ValueError, match="127.64.0.0/16"):
        pod_loopback("10.244.0.5")


# --- least privilege (issue 44, part 5) ---------------------------------------------------------

def _disaggregated() -> list[dict]:
    s = spec(disaggregation={}, engine={"kvTransfer": {"connector": "Nixl"}})
    isvc_children = desired_children(ISVC, s, {"prefill": 1, "decode": 1}, with_podmonitor=False)
    return [c["spec"]["template"] for c in isvc_children if c["kind"] == "Deployment"]


def _every_engine_pod_template() -> list[dict]:
    hub = spec(model={"name": "org/gated", "source": {"huggingFace": {"credentialsSecretRef": {"name": "hf"}}}})
    pvc = spec(model={"name": "m", "source": {"pvc": {"claimName": "weights"}}})
    return [pod_template(), pod_template(s=hub), pod_template(s=pvc), *_disaggregated()]


def test_no_engine_pod_mounts_a_service_account_token():
    """No container of an engine pod calls the Kubernetes API (the engine image has no client for it),
    so none gets the ServiceAccount token that would let code in the pod act as the namespace's
    default account."""
    for template in _every_engine_pod_template():
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod
        for c in [*pod["containers"], *pod.get("initContainers", [])]:
            assert not any("serviceaccount" in m["mountPath"] for m in c.get("volumeMounts", []))


def _token_holders(template: dict) -> set[str]:
    pod = template["spec"]
    containers = [*pod["containers"], *pod.get("initContainers", [])]
    return {c["name"] for c in containers for e in c.get("env", [])
            if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "hf"}


def test_the_hub_token_reaches_only_the_container_that_downloads_never_the_guard():
    s = spec(model={"name": "org/gated", "source": {"huggingFace": {"credentialsSecretRef": {"name": "hf"}}}})
    template = pod_template(s=s)
    assert _token_holders(template) == {"model-fetch"}
    guard = next(c for c in template["spec"]["containers"] if c["name"] == "guard")
    assert not any(e["name"] == "HF_TOKEN" for e in guard["env"])
    # Nor through a Secret volume or envFrom: the guard's only way to a Secret would be these.
    assert "envFrom" not in guard
    secret_volumes = {v["name"] for v in template["spec"]["volumes"] if "secret" in v}
    assert not secret_volumes & {m["name"] for m in guard["volumeMounts"]}


def test_the_hub_token_reaches_no_container_that_listens_in_a_disaggregated_service():
    s = spec(model={"name": "org/gated", "source": {"huggingFace": {"credentialsSecretRef": {"name": "hf"}}}},
             disaggregation={}, engine={"kvTransfer": {"connector": "Nixl"}})
    for d in desired_children(ISVC, s, {"prefill": 1, "decode": 1}, with_podmonitor=False):
        if d["kind"] == "Deployment":
            assert _token_holders(d["spec"]["template"]) == {"model-fetch"}
