"""The chart's parts of the Gateway API Inference Extension (docs/gateway-api.md): GIE's InferencePool CRD only with
gateway.crds=true (and kept on uninstall), the routers' Endpoint Picker on a Service the operator's pools name (its
ports and selector read back by the operator's own parser), the router's flags for it as the router's CLI takes them,
the EPP port open to the router's clients, and the operator's rights on InferencePools and HTTPRoutes."""
import shutil
import subprocess

import yaml
from click.testing import CliRunner

from gpufleet.manifests import gateway as build
from gpufleet_api import gateway_api as gie
from gpufleet_router.cli import router as router_cli
from tests.chart.test_chart import CHART, KUBE_VERSION, helm, template  # noqa: F401  (the helm fixture)
from tests.support.gie import crd_path

EPP = ["--set", "router.epp.enabled=true"]


def objects(helm, *args) -> dict[tuple[str, str], dict]:  # noqa: F811
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(template(helm, *args).stdout) if d}


def router_container(docs: dict) -> dict:
    return docs[("Deployment", "gpufleet-router")]["spec"]["template"]["spec"]["containers"][0]


def test_by_default_no_gie_crd_no_epp_service_and_no_epp_flag(helm):  # noqa: F811
    docs = objects(helm)
    assert ("CustomResourceDefinition", gie.INFERENCE_POOL_CRD) not in docs
    assert ("Service", gie.EPP_SERVICE) not in docs
    assert not [a for a in router_container(docs)["args"] if a.startswith("--epp")]


def test_gateway_crds_installs_gies_inferencepool_crd_kept_on_uninstall(helm):  # noqa: F811
    upstream = yaml.safe_load(crd_path().read_text())   # fetched into the chart first when it is not there
    crd = objects(helm, "--set", "gateway.crds=true")[("CustomResourceDefinition", gie.INFERENCE_POOL_CRD)]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == gie.GIE_VERSION
    assert crd["spec"] == upstream["spec"]      # GIE's schema as published, nothing of it changed
    assert [v["name"] for v in crd["spec"]["versions"]] == [gie.INFERENCE_POOL_VERSION]
    assert "status" not in crd


def test_the_epp_service_is_what_the_operators_pools_name(helm):  # noqa: F811
    docs = objects(helm, *EPP)
    svc = docs[("Service", gie.EPP_SERVICE)]
    picker = build.endpoint_picker(svc)
    assert isinstance(picker, build.EndpointPicker)
    assert (picker.service, picker.port, picker.router_port) == (gie.EPP_SERVICE, gie.EPP_PORT, 8000)
    pod_labels = docs[("Deployment", "gpufleet-router")]["spec"]["template"]["metadata"]["labels"]
    assert picker.router_selector and picker.router_selector.items() <= pod_labels.items()
    container = router_container(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, gie.EPP_PORT_NAME: gie.EPP_PORT}
    moved = objects(helm, *EPP, "--set", "router.port=8100", "--set", "router.epp.port=9100")
    picker = build.endpoint_picker(moved[("Service", gie.EPP_SERVICE)])
    assert isinstance(picker, build.EndpointPicker) and (picker.port, picker.router_port) == (9100, 8100)


def test_the_routers_epp_flags_are_ones_its_cli_takes(helm):  # noqa: F811
    for extra, wanted in (((), ["--epp-port=9002"]),
                          (("--set", "router.epp.tls=false"), ["--epp-port=9002", "--no-epp-secure-serving"]),
                          (("--set", "router.epp.certSecret=epp-tls"),
                           ["--epp-port=9002", "--epp-cert-path=/etc/gpufleet/epp-tls"])):
        container = router_container(objects(helm, *EPP, *extra))
        flags = [a for a in container["args"] if a.startswith("--epp") or a.startswith("--no-epp")]
        assert flags == wanted
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
        # The router's own parser takes every argument the chart gives it (--help stops before it runs).
        result = CliRunner().invoke(router_cli, [*container["args"][1:], "--help"])
        assert result.exit_code == 0, result.output
    mounts = router_container(objects(helm, *EPP, "--set", "router.epp.certSecret=epp-tls"))["volumeMounts"]
    assert {"name": "epp-tls", "mountPath": "/etc/gpufleet/epp-tls", "readOnly": True} in mounts


def test_the_epp_port_is_open_to_the_routers_clients(helm):  # noqa: F811
    policy = objects(helm, *EPP)[("NetworkPolicy", "gpufleet-router")]
    clients = policy["spec"]["ingress"][0]
    assert {"protocol": "TCP", "port": gie.EPP_PORT} in clients["ports"]
    closed = objects(helm)[("NetworkPolicy", "gpufleet-router")]["spec"]["ingress"][0]["ports"]
    assert {"protocol": "TCP", "port": gie.EPP_PORT} not in closed


def test_the_operator_may_manage_pools_and_routes_and_read_their_status(helm):  # noqa: F811
    for docs, kind in ((objects(helm), ("ClusterRole", "gpufleet-operator")),
                       (objects(helm, "--set", "rbac.scope=Namespaced", "--set", "watchNamespaces={ml}"),
                        ("Role", "gpufleet-operator"))):
        rules = {(g, r): set(rule["verbs"]) for rule in docs[kind]["rules"] for g in rule["apiGroups"]
                 for r in rule["resources"]}
        for group, resource in ((gie.INFERENCE_POOL_GROUP, gie.INFERENCE_POOL_PLURAL),
                                (gie.GATEWAY_GROUP, "httproutes")):
            assert rules[(group, resource)] == {"get", "list", "watch", "create", "patch", "delete"}
            assert rules[(group, f"{resource}/status")] == {"get"}


def test_a_chart_without_gies_crd_refuses_gateway_crds_with_the_fix(helm, tmp_path):  # noqa: F811
    chart = tmp_path / "gpufleet"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns(crd_path().parent.name))
    out = subprocess.run([helm, "template", "gpufleet", str(chart), "--kube-version", KUBE_VERSION,
                          "--set", "gateway.crds=true"], capture_output=True, text=True)
    assert out.returncode != 0 and "run scripts/gie_crd.py" in out.stderr
