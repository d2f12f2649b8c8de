"""`helm install --set rbac.scope=Namespaced` into the local control plane: the operator and the
routers may act in the watched namespace only (the API server's own authorizer says so), the
operator keeps its cluster-wide reads (nodes, listing pods), and under those rights alone it
reconciles a sample to Ready and audits it (Isolated) without one refusal."""
import subprocess
import uuid
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
ROUTER = f"system:serviceaccount:{RELEASE_NS}:gpufleet-router"


@pytest.fixture(scope="module")
def namespaces(control_plane):
    """(watched, outside): two fresh namespaces, the chart told of the first only."""
    suffix = uuid.uuid4().hex[:6]
    names = (f"tw-{suffix}", f"to-{suffix}")
    for ns in names:
        control_plane.kubectl("create", "namespace", ns)
        control_plane.kubectl("label", "namespace", ns, "gpufleet.dev/test=true")
    yield names
    for ns in names:
        control_plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def installed(control_plane, crds_installed, namespaces):
    helm = str(ensure_helm(progress=print))
    env = control_plane.env()
    subprocess.run([helm, "uninstall", "gpufleet", "-n", RELEASE_NS], env=env, capture_output=True)
    out = subprocess.run([helm, "install", "gpufleet", str(ROOT / "charts" / "gpufleet"), "-n", RELEASE_NS,
                          "--create-namespace", "--wait=false", "--set", "rbac.scope=Namespaced",
                          "--set", f"watchNamespaces={{{namespaces[0]}}}"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    yield out.stdout
    subprocess.run([helm, "uninstall", "gpufleet", "-n", RELEASE_NS], env=env, capture_output=True)


def can_i(control_plane, who, verb, resource, *where) -> str:
    return control_plane.kubectl("auth", "can-i", verb, resource, "--as", who, *where, check=False).stdout.strip()


@pytest.mark.parametrize("verb, resource", [
    ("patch", "deployments.apps"), ("create", "configmaps"), ("patch", "services"), ("delete", "pods"),
    ("patch", "inferenceservices.serving.gpufleet.dev"), ("create", "events"), ("get", "configmaps")])
def test_the_operator_acts_in_the_watched_namespace_only(control_plane, installed, namespaces, verb, resource):
    watched, outside = namespaces
    assert can_i(control_plane, SA, verb, resource, "-n", watched) == "yes"
    assert can_i(control_plane, SA, verb, resource, "-n", outside) == "no"
    assert can_i(control_plane, SA, verb, resource, "-A") == "no"


@pytest.mark.parametrize("verb, resource, allowed", [
    ("list", "nodes", "yes"), ("watch", "nodes", "yes"), ("list", "pods", "yes"),
    ("get", "pods", "no"), ("watch", "pods", "no"), ("delete", "pods", "no"),
    ("list", "inferenceservices.serving.gpufleet.dev", "no"), ("list", "secrets", "no"),
    ("update", "clusterroles.rbac.authorization.k8s.io", "no")])
def test_what_stays_cluster_wide_is_read_only(control_plane, installed, verb, resource, allowed):
    assert can_i(control_plane, SA, verb, resource, "-A") == allowed


def test_the_router_reads_in_the_watched_namespace_only(control_plane, installed, namespaces):
    watched, outside = namespaces
    for resource in ("inferenceservices.serving.gpufleet.dev", "pods"):
        assert can_i(control_plane, ROUTER, "watch", resource, "-n", watched) == "yes"
        assert can_i(control_plane, ROUTER, "list", resource, "-n", outside) == "no"
        assert can_i(control_plane, ROUTER, "list", resource, "-A") == "no"
    assert can_i(control_plane, ROUTER, "patch", "inferenceservices.serving.gpufleet.dev", "-n", watched) == "no"


async def test_the_operator_under_namespaced_rbac_reconciles_and_audits_a_sample(control_plane, installed, kube,
                                                                                 namespaces, tmp_path):
    watched, _ = namespaces
    kc = service_account_kubeconfig(control_plane, RELEASE_NS, "gpufleet-operator", tmp_path / "operator.kubeconfig")
    # The token the chart projects into the operator's pod: its ServiceAccount's, for the guards' audience.
    guard_token = tmp_path / "guard-token"
    guard_token.write_text(control_plane.kubectl("-n", RELEASE_NS, "create", "token", "gpufleet-operator",
                                                 "--audience=gpufleet-guard", "--duration=1h").stdout.strip())
    # As the chart runs it in this scope: told the watched namespace, electing a leader in its own.
    op = OperatorProcess(str(kc), tmp_path / "operator.log", guard_token_file=guard_token, extra_args=(
        "--namespace", watched, "--audit-interval-seconds", "2", "--leader-elect",
        "--leader-elect-resource-namespace", RELEASE_NS, "--leader-elect-identity", f"test-{watched}",
        "--network-policies", "--network-policy-operator-namespace", RELEASE_NS,
        "--network-policy-operator-label", "app.kubernetes.io/name=gpufleet-operator")).start()
    try:
        sample = yaml.safe_load((ROOT / "samples" / "chat.yaml").read_text())
        control_plane.kubectl("apply", "-n", watched, "-f", "-", input=yaml.safe_dump(sample))

        async def ready_and_audited():
            obj = await kube.get("serving.gpufleet.dev/v1alpha1", "InferenceService", "chat", watched)
            conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
            # Isolated=True Verified is the cluster audit's: it listed the service in its namespace
            # and every placed pod of the cluster, with the rights the chart gave.
            return conds.get("Ready", {}).get("status") == "True" and conds.get("Isolated", {}).get("reason") in (
                "Verified", "ViolationFound")
        await wait_for(ready_and_audited, timeout=PODS_START_SECONDS,
                       what="the sample Ready and audited under namespaced RBAC", describe=lambda: op.log_tail(20))
        log = (tmp_path / "operator.log").read_text()
        assert "403" not in log and "Forbidden" not in log and "forbidden" not in log, op.log_tail(40)
    finally:
        op.stop()
