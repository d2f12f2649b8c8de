"""The chart's namespaced install (rbac.scope Namespaced): the operator's and the routers' rights on
workloads are Roles in the watched namespaces, bound to their ServiceAccounts; what stays cluster-wide
is one read-only ClusterRole of the operator's (nodes, listing pods for the audits, kopf's namespace
and CRD observation); the operator is told the same namespaces, by its own parser."""
import yaml

from gpufleet.cli.run import run
from gpufleet.settings import OperatorSettings
from tests.chart.test_chart import helm, template  # noqa: F401  (the helm fixture)

NAMESPACED = ["--set", "rbac.scope=Namespaced", "--set", "watchNamespaces={ml,ops}"]
WRITES = {"create", "update", "patch", "delete", "deletecollection"}
CLUSTER_READS = {("", "nodes"): {"get", "list", "watch"}, ("", "namespaces"): {"list", "watch"},
                 ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
                 ("", "pods"): {"list"}}


def docs(helm, *args) -> list[dict]:  # noqa: F811
    return [d for d in yaml.safe_load_all(template(helm, *args).stdout) if d]


def rbac(items, kind, name) -> dict[str | None, dict]:
    """The objects of ``kind`` named ``name``, by namespace (None: cluster-scoped)."""
    return {d["metadata"].get("namespace"): d for d in items if d["kind"] == kind and d["metadata"]["name"] == name}


def grants(rules) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_the_operator_writes_only_in_the_watched_namespaces(helm):  # noqa: F811
    items = docs(helm, *NAMESPACED)
    cluster = rbac(items, "ClusterRole", "gpufleet-operator")[None]
    assert grants(cluster["rules"]) == CLUSTER_READS
    roles = rbac(items, "Role", "gpufleet-operator")
    assert set(roles) == {"ml", "ops"}
    bindings = rbac(items, "RoleBinding", "gpufleet-operator")
    for ns in ("ml", "ops"):
        assert bindings[ns]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                           "name": "gpufleet-operator"}
        assert bindings[ns]["subjects"] == [{"kind": "ServiceAccount", "name": "gpufleet-operator",
                                             "namespace": "gpufleet-system"}]
    # No ClusterRole bound to the operator or the routers writes anything, or reads a workload's object.
    for role in (d for d in items if d["kind"] == "ClusterRole" and d["metadata"]["name"] in (
            "gpufleet-operator", "gpufleet-router")):
        assert not WRITES & set().union(*grants(role["rules"]).values()), role["metadata"]["name"]


def test_one_list_of_rules_serves_both_scopes(helm):  # noqa: F811
    """What a watched namespace's Role and the read-only ClusterRole grant together is what the
    cluster-scoped install grants (less pods' get, watch and writes across the cluster)."""
    cluster = grants(rbac(docs(helm), "ClusterRole", "gpufleet-operator")[None]["rules"])
    items = docs(helm, *NAMESPACED)
    role = grants(rbac(items, "Role", "gpufleet-operator")["ml"]["rules"])
    reads = grants(rbac(items, "ClusterRole", "gpufleet-operator")[None]["rules"])
    assert {**reads, **role} == cluster
    assert not set(role) & (set(reads) - {("", "pods")})


def test_the_routers_read_only_in_the_namespaces_they_route(helm):  # noqa: F811
    items = docs(helm, *NAMESPACED)
    assert not rbac(items, "ClusterRole", "gpufleet-router") and not rbac(items, "ClusterRoleBinding",
                                                                          "gpufleet-router")
    cluster = grants(rbac(docs(helm), "ClusterRole", "gpufleet-router")[None]["rules"])
    roles = rbac(items, "Role", "gpufleet-router")
    assert set(roles) == {"ml", "ops"} and all(grants(r["rules"]) == cluster for r in roles.values())
    assert rbac(items, "RoleBinding", "gpufleet-router")["ml"]["subjects"][0]["name"] == "gpufleet-router"
    # router.namespaces, when set, says where the routers route and so where their Roles are.
    only = docs(helm, *NAMESPACED, "--set", "router.namespaces={ml}")
    assert set(rbac(only, "Role", "gpufleet-router")) == {"ml"}
    # The tenants' key Secrets: readable in the routed namespaces only, and nowhere cluster-wide.
    assert grants(rbac(only, "Role", "gpufleet-router")["ml"]["rules"])[("", "secrets")] == {"get", "list", "watch"}
    assert not [r for d in only if d["kind"] == "ClusterRole" for r in d.get("rules") or []
                if "secrets" in r["resources"]]


def test_the_operator_is_told_the_namespaces_its_roles_are_in(helm):  # noqa: F811
    dep = next(d for d in docs(helm, *NAMESPACED) if d["kind"] == "Deployment"
               and d["metadata"]["name"] == "gpufleet-operator")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    params = run.make_context("run", list(args[1:])).params
    assert params["namespaces"] == ("ml", "ops")
    # and lists InferenceServices there, not across the cluster (the cluster audits)
    assert OperatorSettings(namespaces=params["namespaces"]).listed_namespaces == ("ml", "ops")


def test_a_namespaced_install_without_namespaces_is_refused_naming_the_value(helm):  # noqa: F811
    out = template(helm, "--set", "rbac.scope=Namespaced", check=False)
    assert out.returncode != 0
    assert "rbac.scope Namespaced needs the namespaces to serve: set watchNamespaces" in out.stderr


def test_an_unknown_scope_is_refused(helm):  # noqa: F811
    out = template(helm, "--set", "rbac.scope=Namespace", check=False)
    assert out.returncode != 0 and "at '/rbac/scope': value must be one of 'Cluster', 'Namespaced'" in out.stderr


def test_the_cluster_scope_stays_the_default(helm):  # noqa: F811
    items = docs(helm, "--set", "watchNamespaces={ml}")
    assert not rbac(items, "Role", "gpufleet-operator")
    assert ("apps", "deployments") in grants(rbac(items, "ClusterRole", "gpufleet-operator")[None]["rules"])


def test_events_are_recorded_on_the_lease_and_on_nodes_with_create_only(helm):  # noqa: F811
    """Found on the real API server (tests/integration/test_helm_namespaced.py): a namespaced operator was
    refused its LeaderElection events (in its own namespace) and its node events (StrandedGPUs, in default,
    where Kubernetes records node events)."""
    items = docs(helm, *NAMESPACED)
    lease_role = rbac(items, "Role", "gpufleet-operator-leader-election")["gpufleet-system"]
    assert grants(lease_role["rules"])[("", "events")] == {"create"}
    node_events = rbac(items, "Role", "gpufleet-operator-node-events")
    assert set(node_events) == {"default"} and grants(node_events["default"]["rules"]) == {("", "events"): {"create"}}
    assert rbac(items, "RoleBinding", "gpufleet-operator-node-events")["default"]["roleRef"]["name"] == \
        "gpufleet-operator-node-events"
    assert rbac(docs(helm), "Role", "gpufleet-operator-node-events") == {}  # the cluster scope's ClusterRole has it
