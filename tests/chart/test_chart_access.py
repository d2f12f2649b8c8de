"""The chart's access controls: the operator's NetworkPolicy and the flags that
give every InferenceService its own, the ClusterRoles that add InferenceServices
to the built-in view/edit/admin roles, and distinct operator probes."""
import subprocess
from pathlib import Path

import pytest
import yaml

from gpufleet.cli.run import run
from gpufleet.manifests import names
from gpufleet_api.guard.control_auth import GUARD_AUDIENCE
from gpufleet_dev.devcluster.binaries import KUBERNETES_VERSION, ensure_helm

CHART = Path(__file__).resolve().parents[2] / "charts" / "gpufleet"


@pytest.fixture(scope="module")
def helm():
    return str(ensure_helm(progress=lambda m: print(m)))


def render(helm, *args, check=True):
    out = subprocess.run([helm, "template", "gpufleet", str(CHART), "--namespace", "gpufleet-system",
                          "--kube-version", KUBERNETES_VERSION.lstrip("v"), *args],
                         capture_output=True, text=True, check=check)
    return out if not check else [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


def operator_args(docs) -> dict:
    """The Deployment's args as the operator's own command line parser reads them."""
    args = one(docs, "Deployment", "gpufleet-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "run"
    return run.make_context("run", list(args[1:])).params


def test_by_default_the_operator_gives_engines_a_policy_naming_its_own_pods_and_prometheus(helm):
    docs = render(helm)
    params = operator_args(docs)
    assert params["network_policies"] is True
    assert params["network_policy_operator_namespace"] == "gpufleet-system"
    pod_labels = one(docs, "Deployment", "gpufleet-operator")["spec"]["template"]["metadata"]["labels"]
    # The labels the engines' policy admits are the operator pods' own.
    assert params["network_policy_operator_labels"].items() <= pod_labels.items()
    assert params["network_policy_operator_labels"]
    assert params["network_policy_prometheus_namespaces"] == ("monitoring",)
    assert params["network_policy_same_namespace"] is True
    rules = one(docs, "ClusterRole", "gpufleet-operator")["rules"]
    assert {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
            "verbs": ["get", "create", "patch"]} in rules


def test_the_operators_policy_selects_its_pods_and_lets_it_reach_the_api_server_dns_and_engines(helm):
    docs = render(helm, "--set", "networkPolicy.clientNamespaces={gateway}")
    policy = one(docs, "NetworkPolicy", "gpufleet-operator")["spec"]
    pod_labels = one(docs, "Deployment", "gpufleet-operator")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    scrape, = policy["ingress"]
    assert scrape["ports"] == [{"protocol": "TCP", "port": 9090}]
    assert scrape["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["monitoring"]
    api, dns, engines, routers = policy["egress"]
    # The routers' metrics (held requests wake a service at zero), in the release namespace only.
    assert routers["to"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gpufleet-router",
                                                              "app.kubernetes.io/instance": "gpufleet"}}}]
    assert routers["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert {p["port"] for p in api["ports"]} == {443, 6443} and "to" not in api
    assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    # The chart names the engines as the operator builds them: a test, since YAML cannot import.
    assert engines["to"][0]["podSelector"]["matchLabels"] == {names.LABEL_NAME: names.ENGINE_APP}
    assert engines["ports"] == [{"protocol": "TCP", "port": names.GUARD_PORT}]
    # The router's namespace (the release's) joins the named ones while the router is on.
    assert operator_args(docs)["network_policy_client_namespaces"] == ("gateway", "gpufleet-system")


def test_api_server_addresses_narrow_the_operators_egress(helm):
    policy = one(render(helm, "--set", "networkPolicy.apiServer.cidrs={10.0.0.1/32}"), "NetworkPolicy",
                 "gpufleet-operator")["spec"]
    assert policy["egress"][0]["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]


def test_policies_off_means_no_policy_no_flag_and_no_rbac_for_them(helm):
    docs = render(helm, "--set", "networkPolicy.enabled=false")
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert operator_args(docs)["network_policies"] is False
    assert "networkpolicies" not in str(one(docs, "ClusterRole", "gpufleet-operator")["rules"])


def test_closing_the_services_own_namespace_reaches_the_operator(helm):
    assert operator_args(render(helm, "--set", "networkPolicy.sameNamespace=false"))[
        "network_policy_same_namespace"] is False


@pytest.mark.parametrize("args, message", [
    (["--set", "networkPolicy.clientNamespaces={Bad_NS}"], "at '/networkPolicy/clientNamespaces/0'"),
    (["--set-json", "networkPolicy.apiServer.ports=[]"], "at '/networkPolicy/apiServer/ports'"),
    (["--set", "networkPolicy.apiServer.cidrs={10.0.0.1}"], "at '/networkPolicy/apiServer/cidrs/0'"),
])
def test_bad_network_policy_values_are_refused_naming_the_value(helm, args, message):
    out = render(helm, *args, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def one_of(rules: list[dict], resource: str) -> dict:
    return next(r for r in rules if resource in r["resources"])


def test_inferenceservices_aggregate_into_the_built_in_roles(helm):
    docs = render(helm)
    view = one(docs, "ClusterRole", "gpufleet-inferenceservices-view")
    edit = one(docs, "ClusterRole", "gpufleet-inferenceservices-edit")
    aggregates = {k.rsplit("-", 1)[-1] for k, v in view["metadata"]["labels"].items()
                  if k.startswith("rbac.authorization.k8s.io/aggregate-to-") and v == "true"}
    assert aggregates == {"view", "edit", "admin"}
    assert {k for k, v in edit["metadata"]["labels"].items()
            if k.startswith("rbac.authorization.k8s.io/aggregate-to-")} == {
        "rbac.authorization.k8s.io/aggregate-to-edit", "rbac.authorization.k8s.io/aggregate-to-admin"}
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in view["rules"])
    # A namespace's tenants are read and written by whoever may read and write its services.
    assert all("inferencetenants" in one_of(role["rules"], "inferenceservices")["resources"] for role in (view, edit))
    # Status is the operator's: no user role writes it.
    assert not [r for r in edit["rules"] if "inferenceservices/status" in r["resources"]]
    assert not [d for d in render(helm, "--set", "rbac.aggregateToDefaultRoles=false")
                if d["metadata"]["name"].startswith("gpufleet-inferenceservices-")]


def test_operator_liveness_and_readiness_ask_different_questions(helm):
    container = one(render(helm), "Deployment", "gpufleet-operator")["spec"]["template"]["spec"]["containers"][0]
    live, ready = container["livenessProbe"]["httpGet"], container["readinessProbe"]["httpGet"]
    # Liveness: kopf's own endpoint (its loop answers); readiness: able to lead (reaches the Lease).
    assert (live["path"], live["port"]) == ("/healthz", "probes")
    assert (ready["path"], ready["port"]) == ("/readyz", "metrics")
    assert "--liveness=http://0.0.0.0:8081/healthz" in container["args"]


def _selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels and the In/NotIn/Exists/DoesNotExist expressions) against labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values) \
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def _uncovered(docs: list[dict]) -> list[tuple]:
    """Pod templates not selected for both directions by the NetworkPolicies of their namespace."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    out = []
    for w in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")):
        labels = w["spec"]["template"]["metadata"]["labels"]
        namespace = w["metadata"].get("namespace", "gpufleet-system")
        covering = [p for p in policies if p["metadata"].get("namespace", "gpufleet-system") == namespace
                    and _selects(p["spec"]["podSelector"], labels)]
        types = {t for p in covering for t in p["spec"].get("policyTypes", ["Ingress"])}
        if not types >= {"Ingress", "Egress"}:
            out.append((w["kind"], w["metadata"]["name"], sorted(types)))
    return out


@pytest.mark.parametrize("args", [[], ["--set", "router.enabled=false"]], ids=["default", "no-router"])
def test_every_pod_the_chart_runs_has_a_policy_for_its_ingress_and_egress(helm, args):
    """kube-score's pod-networkpolicy check: each pod template is selected by a NetworkPolicy of its
    namespace, and the policies selecting it cover both directions (an unselected direction is open)."""
    docs = render(helm, *args)
    assert any(d["kind"] == "Deployment" for d in docs)
    assert _uncovered(docs) == []
    # The check can fail: with the policies off every pod is open.
    off = render(helm, *args, "--set", "networkPolicy.enabled=false")
    assert {name for _kind, name, _types in _uncovered(off)} >= {"gpufleet-operator"}


def test_the_operator_reads_a_token_projected_for_the_guards_audience_only(helm):
    docs = render(helm)
    pod = one(docs, "Deployment", "gpufleet-operator")["spec"]["template"]["spec"]
    token_file = operator_args(docs)["guard_token_file"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    source = volume["projected"]["sources"][0]["serviceAccountToken"]
    assert source["audience"] == GUARD_AUDIENCE and token_file.endswith("/" + source["path"])
    assert mount["readOnly"] is True
    # The keys the guards check it with: Kubernetes' own issuer-discovery role, bound to the operator.
    binding = one(docs, "ClusterRoleBinding", "gpufleet-operator-issuer-discovery")
    assert binding["roleRef"]["name"] == "system:service-account-issuer-discovery"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": "gpufleet-system"}]
