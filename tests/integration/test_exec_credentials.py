"""A kubeconfig whose user logs in through an exec credential plugin, the way
EKS, GKE and AKS kubeconfigs do: `gpufleet audit` from an on-call laptop and
`gpufleet run` work with it, and the operator replaces the plugin's token
before it expires. The plugin prints a ServiceAccount token the local API
server issued through the TokenRequest API."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from gpufleet_dev.devcluster.guard_token import mint as mint_guard_token
from gpufleet_dev.devcluster.operator_process import OperatorProcess
from gpufleet_kit.kube.config import KubeConfig
from tests.support.kubeconfigs import exec_plugin, exec_user, plugin_runs, write_kubeconfig
from tests.support.waiting import wait_for

API = "serving.gpufleet.dev/v1alpha1"
# The renewal test's plugin says its tokens expire this soon: a client renews 10 s before the expiry and at
# most every 5 s (kit/gpufleet_kit/kube/config.py), so the operator asks again every 5 s (the plugin prints a
# ServiceAccount token valid far longer: what it says of the expiry decides only when the client asks again).
TOKEN_SECONDS = 15
# What the other tests' plugin says: no renewal falls inside a test however slow the machine, so it runs
# once per process (a client renews 10 s before the expiry: a 20 s token made a slow `gpufleet audit` run
# the plugin twice).
LONG_TOKEN_SECONDS = 3600


@pytest.fixture
def oncall(control_plane, namespace, tmp_path):
    """A kubeconfig with no certificate and no token of its own: only a plugin command."""
    control_plane.kubectl("create", "serviceaccount", "oncall", "-n", namespace)
    binding = f"gpufleet-test-{namespace}-oncall"
    control_plane.kubectl("create", "clusterrolebinding", binding, "--clusterrole=cluster-admin",
                          f"--serviceaccount={namespace}:oncall")
    token = control_plane.kubectl("create", "token", "oncall", "-n", namespace, "--duration=1h").stdout.strip()
    (tmp_path / "sa-token").write_text(token)
    plugin = exec_plugin(tmp_path, token_file=tmp_path / "sa-token", expires_in=LONG_TOKEN_SECONDS)
    path = write_kubeconfig(tmp_path / "kubeconfig", server=control_plane.server, namespace=namespace,
                            cluster={"certificate-authority": KubeConfig.from_file(control_plane.kubeconfig).ca_file},
                            user=exec_user(plugin))
    yield path
    control_plane.kubectl("delete", "clusterrolebinding", binding, "--ignore-not-found")


def gpufleet(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpufleet.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_audit_logs_in_through_the_plugin(crds_installed, oncall, tmp_path):
    result = gpufleet("audit", "--kubeconfig", str(oncall))
    assert result.returncode in (0, 1), result.stderr  # 1: the shared cluster may hold findings
    assert "Stranded GPUs" in result.stdout and "Isolation:" in result.stdout, result.stderr
    assert plugin_runs(tmp_path) == 1


async def test_audit_without_access_says_who_was_refused(control_plane, oncall, namespace):
    control_plane.kubectl("delete", "clusterrolebinding", f"gpufleet-test-{namespace}-oncall")
    # The API server's authorizer drops the binding from its cache shortly after the delete.
    await wait_for(lambda: control_plane.kubectl(
        "auth", "can-i", "list", "nodes", "--as", f"system:serviceaccount:{namespace}:oncall",
        check=False).stdout.strip() == "no", timeout=30, what="the oncall account's access revoked")
    result = gpufleet("audit", "--kubeconfig", str(oncall))
    assert result.returncode != 0
    assert f"system:serviceaccount:{namespace}:oncall" in result.stderr + result.stdout


async def test_audit_with_a_read_only_identity(control_plane, crds_installed, oncall, namespace):
    """The on-call set-up: view, plus read on InferenceServices, nodes and pods; Leases cannot be
    listed cluster-wide. Every section is printed, and the exit code is the fleet's health."""
    control_plane.kubectl("delete", "clusterrolebinding", f"gpufleet-test-{namespace}-oncall")
    role = f"gpufleet-test-{namespace}-fleet-reader"
    control_plane.kubectl("create", "clusterrole", role, "--verb=get,list,watch",
                          "--resource=inferenceservices.serving.gpufleet.dev,nodes,pods")
    for name, cluster_role in ((f"{role}-view", "view"), (role, role)):
        control_plane.kubectl("create", "clusterrolebinding", name, f"--clusterrole={cluster_role}",
                              f"--serviceaccount={namespace}:oncall")
    try:
        user = f"system:serviceaccount:{namespace}:oncall"
        await wait_for(lambda: control_plane.kubectl("auth", "can-i", "list", "nodes", "--as", user,
                                                     check=False).stdout.strip() == "yes",
                       timeout=30, what="the oncall account's read access granted")
        result = gpufleet("audit", "--kubeconfig", str(oncall), "--operator-namespace", namespace)
        assert result.returncode in (0, 1), result.stdout + result.stderr  # 1: the shared cluster's findings
        for section in ("Operator leader:", "Stranded GPUs", "Isolation:", "Fragmentation"):
            assert section in result.stdout, result.stdout
        assert f"not permitted: get leases.coordination.k8s.io in namespace {namespace}" in result.stdout
        assert "Traceback" not in result.stderr
    finally:
        for name in (role, f"{role}-view"):
            control_plane.kubectl("delete", "clusterrolebinding", name, "--ignore-not-found")
        control_plane.kubectl("delete", "clusterrole", role, "--ignore-not-found")


def test_failing_plugin_is_reported_with_its_message(tmp_path, control_plane):
    path = write_kubeconfig(tmp_path / "kubeconfig", server=control_plane.server, user=exec_user(
        exec_plugin(tmp_path, exit_code=1, stderr="error: the SSO session has expired")))
    result = gpufleet("audit", "--kubeconfig", str(path))
    assert result.returncode != 0
    assert f"kubeconfig {path}" in result.stderr and "the SSO session has expired" in result.stderr
    assert "Traceback" not in result.stderr


async def test_operator_reconciles_and_renews_the_plugin_token(control_plane, crds_installed, kube, namespace,
                                                               oncall, tmp_path):
    # Tokens that expire while the operator runs (the same script, rewritten: the kubeconfig names it).
    exec_plugin(tmp_path, token_file=tmp_path / "sa-token", expires_in=TOKEN_SECONDS)
    # Its guard token from the admin's credentials: the on-call user may not ask for tokens.
    guard_token = mint_guard_token(control_plane.kubeconfig, tmp_path / "guard-token")
    operator = OperatorProcess(str(oncall), tmp_path / "operator.log", ("--namespace", namespace),
                               guard_token_file=guard_token).start()
    try:
        control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
            "apiVersion": API, "kind": "InferenceService", "metadata": {"name": "chat"},
            "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}}}))

        # This operator (not another one on the shared cluster) reconciled it: its own metrics say so.
        series = re.compile(rf'gpufleet_service_desired_replicas\{{[^}}]*namespace="{namespace}"[^}}]*'
                            rf'service="chat"[^}}]*\}} 1\.0')
        await wait_for(lambda: series.search(operator.metrics_text()), timeout=60,
                       what="the operator's metrics for the service it reconciled",
                       describe=operator.log_tail)
        assert await kube.get("apps/v1", "Deployment", "chat-engine", namespace)

        # Past the first token's expiry the operator has asked the plugin again, and still works:
        # a change made now is reconciled with the renewed token.
        await wait_for(lambda: plugin_runs(tmp_path) >= 3, timeout=3 * TOKEN_SECONDS,
                       what="the plugin asked again for tokens as they expire", describe=operator.log_tail)
        await kube.delete("v1", "ConfigMap", "chat-guard", namespace)
        await wait_for(lambda: kube.get_or_none("v1", "ConfigMap", "chat-guard", namespace), timeout=60,
                       what="the deleted ConfigMap put back", describe=operator.log_tail)
        assert "Unauthorized" not in (tmp_path / "operator.log").read_text(), operator.log_tail()
    finally:
        operator.stop()
