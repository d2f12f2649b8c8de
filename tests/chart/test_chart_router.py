"""The chart's router: a Deployment of two replicas with a PDB, its own Service,
read-only RBAC (get, list, watch) on InferenceServices, InferenceAdapters, InferenceTenants, pods and
(unless told not to) Secrets for the tenants' key hashes, discovery
by watch unless told to list, the engines' NetworkPolicy admitting it, and an HTTPRoute only
when asked for and pointed at a Gateway."""
import yaml

from tests.chart.test_chart import helm, template  # noqa: F401  (the helm fixture)


def objects(helm, *args) -> dict[tuple[str, str], dict]:  # noqa: F811
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(template(helm, *args).stdout) if d}


def test_the_router_runs_two_replicas_behind_its_own_service_and_a_pdb(helm):  # noqa: F811
    docs = objects(helm)
    dep = docs[("Deployment", "gpufleet-router")]
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"][0] == "router" and "--port=8000" in container["args"]
    assert "--policy=kv_aware" in container["args"]
    assert "--policy=round_robin" in objects(helm, "--set", "router.policy=round_robin")[
        ("Deployment", "gpufleet-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--resume-streams" in container["args"] and "--max-resumptions=2" in container["args"]
    assert "--no-resume-streams" in objects(helm, "--set", "router.resumeStreams=false")[
        ("Deployment", "gpufleet-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
    labels = dep["spec"]["selector"]["matchLabels"]
    svc = docs[("Service", "gpufleet-router")]
    assert svc["spec"]["selector"] == labels and svc["spec"]["ports"][0]["targetPort"] == "http"
    assert docs[("PodDisruptionBudget", "gpufleet-router")]["spec"]["selector"]["matchLabels"] == labels
    # The operator's Service and monitor select the operator only, never the router.
    assert docs[("Service", "gpufleet-operator-metrics")]["spec"]["selector"]["app.kubernetes.io/name"] == \
        "gpufleet-operator"


def test_the_router_may_only_read_services_adapters_tenants_pods_and_key_secrets(helm):  # noqa: F811
    docs = objects(helm)
    rules = docs[("ClusterRole", "gpufleet-router")]["rules"]
    assert {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]} == {
        ("serving.gpufleet.dev", "inferenceservices"), ("serving.gpufleet.dev", "inferenceadapters"),
        ("serving.gpufleet.dev", "inferencetenants"), ("", "pods"), ("", "secrets")}
    # list and watch: the default discovery watches each of them (router.discovery=watch)
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in rules)
    binding = docs[("ClusterRoleBinding", "gpufleet-router")]
    assert binding["subjects"][0]["name"] == "gpufleet-router"
    assert docs[("Deployment", "gpufleet-router")]["spec"]["template"]["spec"]["serviceAccountName"] == \
        "gpufleet-router"


def test_without_key_secrets_the_router_reads_no_secret_but_still_the_tenants(helm):  # noqa: F811
    rules = objects(helm, "--set", "router.tenants.readKeySecrets=false")[("ClusterRole", "gpufleet-router")]["rules"]
    resources = {r for rule in rules for r in rule["resources"]}
    assert "secrets" not in resources and "inferencetenants" in resources


def test_a_misspelt_tenants_value_is_refused(helm):  # noqa: F811
    out = template(helm, "--set", "router.tenants.readKeySecret=false", check=False)
    assert out.returncode != 0 and "additional properties 'readKeySecret' not allowed" in out.stderr


def test_the_engines_policy_admits_the_routers_namespace(helm):  # noqa: F811
    args = objects(helm)[("Deployment", "gpufleet-operator")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.count("--network-policy-client-namespace=gpufleet-system") == 1
    args = objects(helm, "--set", "networkPolicy.clientNamespaces={gpufleet-system}")[
        ("Deployment", "gpufleet-operator")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.count("--network-policy-client-namespace=gpufleet-system") == 1


def test_the_router_routes_the_operators_namespaces_unless_told_otherwise(helm):  # noqa: F811
    def namespaces(*args):
        dep = objects(helm, *args)[("Deployment", "gpufleet-router")]
        return [a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--namespace")]
    assert namespaces() == []
    assert namespaces("--set", "watchNamespaces={ml,chat}") == ["--namespace=ml", "--namespace=chat"]
    assert namespaces("--set", "watchNamespaces={ml}", "--set", "router.namespaces={chat}") == ["--namespace=chat"]


def test_the_router_watches_unless_told_to_list(helm):  # noqa: F811
    def args(*values):
        return objects(helm, *values)[("Deployment", "gpufleet-router")]["spec"]["template"]["spec"][
            "containers"][0]["args"]
    assert "--discovery=watch" in args()
    listing = args("--set", "router.discovery=list", "--set", "router.discoveryIntervalSeconds=5")
    assert "--discovery=list" in listing and "--discovery-interval-seconds=5" in listing
    out = template(helm, "--set", "router.discovery=poll", check=False)
    assert out.returncode != 0 and "/router/discovery" in out.stderr and "watch" in out.stderr


def test_an_httproute_needs_a_gateway_and_points_at_the_routers_service(helm):  # noqa: F811
    assert not [k for k in objects(helm) if k[0] == "HTTPRoute"]
    out = template(helm, "--set", "router.httpRoute.enabled=true", check=False)
    assert out.returncode != 0 and "router.httpRoute.parentRefs must name the Gateway" in out.stderr
    route = objects(helm, "--set", "router.httpRoute.enabled=true", "--set", "router.httpRoute.parentRefs[0].name=gw",
                    "--set", "router.httpRoute.hostnames={llm.example.com}")[("HTTPRoute", "gpufleet-router")]
    assert route["spec"]["parentRefs"] == [{"name": "gw"}] and route["spec"]["hostnames"] == ["llm.example.com"]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "gpufleet-router", "port": 80}]


def test_router_off_renders_nothing_of_it(helm):  # noqa: F811
    docs = objects(helm, "--set", "router.enabled=false")
    assert not [k for k in docs if "router" in k[1]]
    args = docs[("Deployment", "gpufleet-operator")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--network-policy-client-namespace=gpufleet-system" not in args


def test_bad_router_values_are_refused_naming_the_value(helm):  # noqa: F811
    out = template(helm, "--set", "router.replicaCount=0", check=False)
    assert out.returncode != 0 and "at '/router/replicaCount': minimum: got 0, want 1" in out.stderr
    out = template(helm, "--set", "router.loadFactor=-1", check=False)
    assert out.returncode != 0 and "/router/loadFactor" in out.stderr


def test_prometheus_scrapes_the_routers_keeping_their_service_labels(helm):  # noqa: F811
    assert ("ServiceMonitor", "gpufleet-router") not in objects(helm)
    docs = objects(helm, "--set", "monitoring.serviceMonitor.enabled=true")
    monitor = docs[("ServiceMonitor", "gpufleet-router")]["spec"]
    assert monitor["selector"]["matchLabels"] == docs[("Service", "gpufleet-router")]["spec"]["selector"]
    assert monitor["endpoints"] == [{"port": "http", "interval": "15s", "honorLabels": True}]


def test_the_routers_policy_admits_clients_the_operator_and_prometheus_and_lets_it_reach_engines(helm):  # noqa: F811
    docs = objects(helm)
    policy = docs[("NetworkPolicy", "gpufleet-router")]["spec"]
    assert policy["podSelector"]["matchLabels"] == \
        docs[("Deployment", "gpufleet-router")]["spec"]["selector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    clients, own = policy["ingress"]
    assert clients == {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": 8000}]}
    operator_labels = docs[("Deployment", "gpufleet-operator")]["spec"]["selector"]["matchLabels"]
    assert own["from"][0] == {"podSelector": {"matchLabels": operator_labels}}
    assert own["from"][1]["namespaceSelector"]["matchExpressions"][0]["values"] == ["monitoring"]
    api, dns, engines = policy["egress"]
    assert {p["port"] for p in api["ports"]} == {443, 6443}
    assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    assert engines["to"] == [{"namespaceSelector": {},
                              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gpufleet-engine"}}}]
    assert engines["ports"] == [{"protocol": "TCP", "port": 8080}]


def test_the_routers_clients_narrow_to_what_the_values_name(helm):  # noqa: F811
    policy = objects(helm, "--set-json", 'networkPolicy.router.from=[{"namespaceSelector": {"matchLabels": '
                     '{"kubernetes.io/metadata.name": "gateway"}}}, {"ipBlock": {"cidr": "10.1.0.0/16"}}]')[
        ("NetworkPolicy", "gpufleet-router")]["spec"]
    assert policy["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}},
        {"ipBlock": {"cidr": "10.1.0.0/16"}}]
    closed = objects(helm, "--set-json", "networkPolicy.router.from=[]")[("NetworkPolicy", "gpufleet-router")]
    assert len(closed["spec"]["ingress"]) == 1  # the operator and Prometheus only
    assert ("NetworkPolicy", "gpufleet-router") not in objects(helm, "--set", "router.enabled=false")
    assert ("NetworkPolicy", "gpufleet-router") not in objects(helm, "--set", "networkPolicy.enabled=false")


def test_the_routers_trace_to_the_fleets_otlp_endpoint_when_it_has_one(helm):  # noqa: F811
    def args(*values: str) -> list[str]:
        return objects(helm, *values)[("Deployment", "gpufleet-router")]["spec"]["template"]["spec"][
            "containers"][0]["args"]
    assert not [a for a in args() if a.startswith(("--otlp", "--trace"))]
    traced = args("--set", "tracing.otlpEndpoint=http://jaeger-collector.observability:4318",
                  "--set", "router.tracing.sampledPerMille=50")
    assert "--otlp-endpoint=http://jaeger-collector.observability:4318" in traced
    assert "--trace-sampled-per-mille=50" in traced
    from click.testing import CliRunner

    from gpufleet_router.cli import router
    # The flags the chart renders are the router's own (a misspelt one would stop the pod).
    result = CliRunner().invoke(router, [a for a in traced[1:] if a.startswith(("--otlp", "--trace"))] + ["--help"])
    assert result.exit_code == 0, result.output
