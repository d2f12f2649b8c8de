"""`helm install` into the local control plane; the operator, running under the
chart's ServiceAccount and RBAC, reconciles a sample (RBAC is sufficient) and
is denied what it should not do (RBAC is narrow)."""
import subprocess
from pathlib import Path

import pytest
import yaml

from gpufleet_dev.devcluster.binaries import ensure_helm
from gpufleet_dev.devcluster.operator_process import OperatorProcess
from tests.support.kubeconfigs import service_account_kubeconfig
from tests.support.waiting import PODS_START_SECONDS, wait_for

ROOT = Path(__file__).resolve().parents[2]
RELEASE_NS = "gpufleet-system"
SA = f"system:serviceaccount:{RELEASE_NS}:gpufleet-operator"


@pytest.fixture(scope="module")
def installed(control_plane, crds_installed):
    helm = str(ensure_helm(progress=print))
    env = control_plane.env()
    subprocess.run([helm, "uninstall", "gpufleet", "-n", RELEASE_NS], env=env, capture_output=True)
    out = subprocess.run([helm, "install", "gpufleet", str(ROOT / "charts" / "gpufleet"), "-n", RELEASE_NS,
                          "--create-namespace", "--wait=false"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    yield out.stdout
    subprocess.run([helm, "uninstall", "gpufleet", "-n", RELEASE_NS], env=env, capture_output=True)


def test_install_prints_notes_and_creates_the_operator(control_plane, installed):
    assert "kubectl get inferenceservices -w" in installed
    # Alerts come with the operator's scrape, or GpufleetOperatorDown fires on a healthy install.
    assert "--set monitoring.serviceMonitor.enabled=true\n--set monitoring.prometheusRule.enabled=true" in installed
    dep = control_plane.kubectl("-n", RELEASE_NS, "get", "deployment", "gpufleet-operator", "-o", "yaml").stdout
    assert yaml.safe_load(dep)["spec"]["template"]["spec"]["serviceAccountName"] == "gpufleet-operator"


@pytest.mark.parametrize("verb, resource, allowed", [
    ("patch", "deployments.apps", "yes"), ("list", "nodes", "yes"), ("watch", "nodes", "yes"),
    # delete pods: fragmentation remediation (an eviction would be refused: the pool's budget keeps every
    # desired replica, docs/drains.md); delete budgets: those of a shape a service left.
    ("delete", "pods", "yes"), ("create", "pods/eviction", "no"), ("delete", "poddisruptionbudgets.policy", "yes"),
    ("patch", "inferenceservices.serving.gpufleet.dev/status", "yes"),
    # delete deployments: the pools of a shape a service left (unified <-> prefill/decode; docs/disaggregation.md).
    ("delete", "deployments.apps", "yes"), ("delete", "configmaps", "no"), ("delete", "services", "no"),
    ("list", "secrets", "no"), ("create", "pods", "no"),
    ("update", "inferenceservices.serving.gpufleet.dev", "no"), ("create", "pods/exec", "no"),
    ("update", "clusterroles.rbac.authorization.k8s.io", "no"), ("delete", "nodes", "no"),
])
def test_rbac_is_narrow(control_plane, installed, verb, resource, allowed):
    args = [verb, resource]
    if "/" in resource:
        res, sub = resource.split("/")
        args = [verb, res, f"--subresource={sub}"]
    out = control_plane.kubectl("auth", "can-i", *args, "--as", SA, "-A", check=False)
    assert out.stdout.strip() == allowed, f"{verb} {resource}: {out.stdout} {out.stderr}"


async def test_operator_under_the_chart_rbac_reconciles_a_sample(control_plane, installed, kube, namespace,
                                                                 tmp_path):
    kc = service_account_kubeconfig(control_plane, RELEASE_NS, "gpufleet-operator", tmp_path / "operator.kubeconfig")
    # As the chart runs it: electing a leader on the Lease in the release namespace (its Role suffices).
    # And giving the sample its NetworkPolicy, as the chart's defaults have it do.
    # The token the chart projects into the operator's pod: its ServiceAccount's, for the guards' audience.
    guard_token = tmp_path / "guard-token"
    guard_token.write_text(control_plane.kubectl("-n", RELEASE_NS, "create", "token", "gpufleet-operator",
                                                 "--audience=gpufleet-guard", "--duration=1h").stdout.strip())
    op = OperatorProcess(str(kc), tmp_path / "operator.log", guard_token_file=guard_token, extra_args=(
        "--namespace", namespace, "--leader-elect", "--leader-elect-resource-namespace", RELEASE_NS,
        "--leader-elect-identity", f"test-{namespace}", "--network-policies",
        "--network-policy-operator-namespace", RELEASE_NS,
        "--network-policy-operator-label", "app.kubernetes.io/name=gpufleet-operator")).start()
    try:
        sample = yaml.safe_load((ROOT / "samples" / "chat.yaml").read_text())
        control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(sample))

        async def ready():
            obj = await kube.get("serving.gpufleet.dev/v1alpha1", "InferenceService", "chat", namespace)
            conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
            return conds.get("Ready", {}).get("status") == "True"
        await wait_for(ready, timeout=PODS_START_SECONDS, what="the sample Ready under the chart's RBAC",
                       describe=lambda: op.log_tail(20))
        log = (tmp_path / "operator.log").read_text()
        assert "403" not in log and "Forbidden" not in log, op.log_tail(40)
        assert f"test-{namespace} became leader" in log, op.log_tail(40)
        policy = await kube.get("networking.k8s.io/v1", "NetworkPolicy", "chat-engine", namespace)
        selector = ",".join(f"{k}={v}" for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
        selected = await kube.list("v1", "Pod", namespace, label_selector=selector)
        assert selected and all(p["metadata"]["labels"]["gpufleet.dev/service"] == "chat" for p in selected)
    finally:
        op.stop()


async def test_the_operators_network_policy_selects_the_operators_pods(control_plane, installed, kube):
    policy = await kube.get("networking.k8s.io/v1", "NetworkPolicy", "gpufleet-operator", RELEASE_NS)
    selector = ",".join(f"{k}={v}" for k, v in policy["spec"]["podSelector"]["matchLabels"].items())

    async def operator_pods():
        pods = await kube.list("v1", "Pod", RELEASE_NS, label_selector="app.kubernetes.io/instance=gpufleet,"
                                                                         "app.kubernetes.io/name=gpufleet-operator")
        return pods if len(pods) == 2 else None
    pods = await wait_for(operator_pods, timeout=PODS_START_SECONDS, what="the chart's two operator pods")
    selected = await kube.list("v1", "Pod", RELEASE_NS, label_selector=selector)
    assert {p["metadata"]["name"] for p in selected} == {p["metadata"]["name"] for p in pods}


# Secrets: read for the tenants' key records (docs/tenants.md, "Who may read what"): the router watches only
# those labelled gpufleet.dev/tenant-keys=true, but RBAC cannot grant by label; router.tenants.readKeySecrets
# false takes it away (tests/chart). Never written.
@pytest.mark.parametrize("verb, resource, allowed", [
    ("list", "inferenceservices.serving.gpufleet.dev", "yes"),
    ("watch", "inferenceservices.serving.gpufleet.dev", "yes"),
    ("patch", "inferenceservices.serving.gpufleet.dev", "no"),
    ("watch", "inferencetenants.serving.gpufleet.dev", "yes"),
    ("update", "inferencetenants.serving.gpufleet.dev", "no"),
    ("list", "pods", "yes"), ("create", "pods", "no"),
    ("watch", "secrets", "yes"), ("create", "secrets", "no"), ("update", "secrets", "no"),
    ("delete", "secrets", "no")])
def test_the_router_may_read_what_it_routes_by_and_write_nothing(control_plane, installed, verb, resource, allowed):
    router = f"system:serviceaccount:{RELEASE_NS}:gpufleet-router"
    got = control_plane.kubectl("auth", "can-i", verb, resource, "--as", router, "-A", check=False).stdout.strip()
    assert got == allowed, (verb, resource, got)


@pytest.fixture
def people(control_plane, installed, namespace):
    """editor and viewer, bound in ``namespace`` to the built-in edit and view roles only."""
    for user, role in (("editor", "edit"), ("viewer", "view")):
        control_plane.kubectl("-n", namespace, "create", "rolebinding", user, f"--clusterrole={role}",
                              f"--user={user}")
    return namespace


def can_i(control_plane, namespace, user, verb, resource) -> str:
    args = [verb, resource]
    if "/" in resource:
        res, sub = resource.split("/")
        args = [verb, res, f"--subresource={sub}"]
    return control_plane.kubectl("auth", "can-i", *args, "--as", user, "-n", namespace, check=False).stdout.strip()


ISVC = "inferenceservices.serving.gpufleet.dev"


@pytest.mark.parametrize("user, verb, resource, allowed", [
    ("editor", "create", ISVC, "yes"), ("editor", "patch", ISVC, "yes"), ("editor", "delete", ISVC, "yes"),
    ("editor", "update", f"{ISVC}/scale", "yes"), ("editor", "patch", f"{ISVC}/status", "no"),
    ("viewer", "get", ISVC, "yes"), ("viewer", "list", ISVC, "yes"), ("viewer", "watch", ISVC, "yes"),
    ("viewer", "get", f"{ISVC}/scale", "yes"), ("viewer", "create", ISVC, "no"), ("viewer", "patch", ISVC, "no"),
    ("viewer", "delete", ISVC, "no"), ("viewer", "update", f"{ISVC}/scale", "no"),
])
async def test_the_built_in_roles_cover_inferenceservices(control_plane, people, user, verb, resource, allowed):
    # The aggregation controller folds the chart's roles into edit and view shortly after the install.
    await wait_for(lambda: can_i(control_plane, people, "editor", "create", ISVC) == "yes"
                   and can_i(control_plane, people, "viewer", "get", ISVC) == "yes",
                   timeout=30, what="the chart's roles aggregated into edit and view")
    assert can_i(control_plane, people, user, verb, resource) == allowed
    assert can_i(control_plane, "default", user, "get", ISVC) == "no"  # only where they are bound


async def test_an_editor_creates_and_scales_a_service_that_a_viewer_can_only_read(control_plane, people):
    await wait_for(lambda: can_i(control_plane, people, "editor", "update", f"{ISVC}/scale") == "yes"
                   and can_i(control_plane, people, "viewer", "get", ISVC) == "yes",
                   timeout=30, what="the chart's roles aggregated into edit and view")
    sample = yaml.safe_load((ROOT / "samples" / "chat.yaml").read_text())
    control_plane.kubectl("apply", "-n", people, "--as", "editor", "-f", "-", input=yaml.safe_dump(sample))
    control_plane.kubectl("scale", "-n", people, "--as", "editor", "inferenceservice/chat", "--replicas=2")
    got = control_plane.kubectl("get", "-n", people, "--as", "viewer", "inferenceservice/chat", "-o", "yaml")
    assert yaml.safe_load(got.stdout)["spec"]["replicas"] == 2
    refused = control_plane.kubectl("scale", "-n", people, "--as", "viewer", "inferenceservice/chat",
                                    "--replicas=1", check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr


def test_the_documented_upgrade_updates_the_crd_and_the_release(control_plane, installed):
    """docs/gpu-cluster.md: `helm upgrade` never touches crds/, so the CRD is applied first."""
    env = control_plane.env()
    crd = subprocess.run([str(ROOT / ".venv" / "bin" / "gpufleet"), "crd"], capture_output=True, text=True,
                         check=True).stdout
    applied = control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crd)
    assert "serverside-applied" in applied.stdout
    stored = yaml.safe_load(control_plane.kubectl("get", "crd", "inferenceservices.serving.gpufleet.dev",
                                                  "-o", "yaml").stdout)
    spec = stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "pod" in spec and "classHeaderPolicy" in spec["admission"]["properties"]
    out = subprocess.run([str(ensure_helm(progress=print)), "upgrade", "gpufleet", str(ROOT / "charts" / "gpufleet"),
                          "-n", RELEASE_NS, "--reuse-values", "--set", "imagePullSecrets[0].name=registry",
                          "--wait=false"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    dep = yaml.safe_load(control_plane.kubectl("-n", RELEASE_NS, "get", "deployment", "gpufleet-operator",
                                               "-o", "yaml").stdout)
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "registry"}]


def test_uninstall_removes_the_operator_and_keeps_the_crd_and_the_services(control_plane, installed):
    """Helm never deletes a chart's CRDs (deleting one deletes every InferenceService and, through
    owner references, every engine); docs/gpu-cluster.md says how to remove them on purpose."""
    out = subprocess.run([str(ensure_helm(progress=print)), "uninstall", "gpufleet", "-n", RELEASE_NS],
                         env=control_plane.env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    left = control_plane.kubectl("-n", RELEASE_NS, "get", "deployment,serviceaccount", "-l",
                                 "app.kubernetes.io/instance=gpufleet", "-o", "name").stdout
    assert left.strip() == ""
    assert control_plane.kubectl("get", "crd", "inferenceservices.serving.gpufleet.dev", check=False).returncode == 0
