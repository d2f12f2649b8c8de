"""The Helm chart: lint, golden `helm template` output, values validation,
least-privilege RBAC, and the copies of generated assets it embeds."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpufleet_dev.devcluster.binaries import KUBERNETES_VERSION, ensure_helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gpufleet"
GOLDEN = Path(__file__).parent / "golden"
KUBE_VERSION = KUBERNETES_VERSION.lstrip("v")
ALL_ON = ["--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.prometheusRule.enabled=true",
          "--set", "dashboards.enabled=true", "--set", "monitoring.podMonitor.labels.release=kube-prometheus-stack"]


@pytest.fixture(scope="module")
def helm():
    return str(ensure_helm(progress=lambda m: print(m)))


def template(helm, *args, check=True):
    return subprocess.run([helm, "template", "gpufleet", str(CHART), "--namespace", "gpufleet-system",
                           "--kube-version", KUBE_VERSION, *args],
                          capture_output=True, text=True, check=check)


def test_lint_strict(helm):
    out = subprocess.run([helm, "lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART), *ALL_ON],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name, args", [("default", []), ("all-on", ALL_ON)])
def test_golden_template(helm, name, args):
    got = template(helm, *args).stdout
    golden = GOLDEN / f"{name}.yaml"
    if not golden.exists() or "--update-golden" in sys.argv:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(got)
    assert got == golden.read_text(), f"helm template drifted from {golden}; review and delete it to regenerate"


def test_chart_copies_of_generated_assets_are_current():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sync_chart.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("args, message", [
    (["--set", "replicaCount=0"], "at '/replicaCount': minimum: got 0, want 1"),
    (["--set", "operator.followerIntervalSeconds=-1"],
     "at '/operator/followerIntervalSeconds': minimum: got -1, want 0"),
    (["--set", "operator.logLevel=loud"], "at '/operator/logLevel': value must be one of 'info', 'debug'"),
    (["--set", "monitoring.runbookBaseURL=docs"], "at '/monitoring/runbookBaseURL': 'docs' does not match pattern"),
    (["--set", "leaderElection.renewDeadlineSeconds=15"],
     "leaderElection.leaseDurationSeconds must be longer than renewDeadlineSeconds"),
    (["--set", "leaderElection.retryPeriodSeconds=9"], "renewDeadlineSeconds must be longer than 1.2 x"),
    (["--set", "operator.statusFiguresIntervalSeconds=301"], "at '/operator/statusFiguresIntervalSeconds': "
                                                              "maximum: got 301, want 300"),
    (["--set", "operator.statusFiguresIntervalSeconds=-1"], "at '/operator/statusFiguresIntervalSeconds': "
                                                             "minimum: got -1, want 0"),
    (["--set", "peering.enabled=true"], "additional properties 'peering' not allowed"),
    (["--set", "podAntiAffinity=soft"], "at '/podAntiAffinity': value must be one of"),
    (["--set", "watchNamespace=ml"], "additional properties 'watchNamespace' not allowed"),
    (["--set", "operator.debugLoggers={kopf watching}"], "at '/operator/debugLoggers/0': 'kopf watching' does not "
                                                          "match pattern"),
])
def test_bad_values_are_rejected_with_a_clear_message(helm, args, message):
    out = template(helm, *args, check=False)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def test_the_status_figures_interval_reaches_the_operators_arguments(helm):
    def args(*values):
        docs = [d for d in yaml.safe_load_all(template(helm, *values).stdout) if d]
        dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gpufleet-operator")
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--status-figures-interval-seconds=20" in args()
    assert "--status-figures-interval-seconds=0" in args("--set", "operator.statusFiguresIntervalSeconds=0")


def test_debug_loggers_reach_the_operators_arguments(helm):
    docs = [d for d in yaml.safe_load_all(template(helm, "--set", "operator.debugLoggers={kopf._cogs.clients.watching,"
                                                                  "gpufleet.fleet}").stdout) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gpufleet-operator")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--debug-log=kopf._cogs.clients.watching" in args and "--debug-log=gpufleet.fleet" in args


def test_rbac_has_no_wildcards_and_cannot_read_secrets(helm):
    docs = [d for d in yaml.safe_load_all(template(helm).stdout) if d]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        assert "secrets" not in rule["resources"]


def test_operator_pod_is_hardened(helm):
    docs = [d for d in yaml.safe_load_all(template(helm).stdout) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["resources"]["requests"] and c["livenessProbe"] and c["readinessProbe"]


def test_monitoring_objects_when_enabled(helm):
    docs = [d for d in yaml.safe_load_all(template(helm, *ALL_ON).stdout) if d]
    kinds = {d["kind"] for d in docs}
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert alerts and all(r["annotations"]["runbook_url"].endswith(".md") for r in alerts)
    dashboards = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard")]
    assert len(dashboards) == len(list((ROOT / "dashboards").glob("*.json")))


def test_two_replicas_elect_a_leader_on_a_lease_by_default(helm):
    docs = [d for d in yaml.safe_load_all(template(helm).stdout) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert "--leader-elect" in args and "--leader-elect-resource-namespace=gpufleet-system" in args
    assert {"--leader-elect-lease-duration=15", "--leader-elect-renew-deadline=10",
            "--leader-elect-retry-period=2"} <= set(args)
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"
    spread = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": dep["spec"]["selector"]}
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "gpufleet-system"
    assert {(r["resources"][0], tuple(r.get("resourceNames", ())), tuple(r["verbs"])) for r in role["rules"]} == {
        ("leases", (), ("create",)), ("leases", ("gpufleet-operator",), ("get", "watch", "update")),
        ("events", (), ("create",))}  # the LeaderElection events, recorded on the Lease
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert "kopfpeering" not in template(helm).stdout  # kopf's peering is gone


def test_required_anti_affinity_and_a_users_own_affinity(helm):
    def pod(*args):
        docs = [d for d in yaml.safe_load_all(template(helm, *args).stdout) if d]
        return next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in pod(
        "--set", "podAntiAffinity=required")["affinity"]["podAntiAffinity"]
    assert "affinity" not in pod("--set", "podAntiAffinity=none")
    own = pod("--set", "affinity.nodeAffinity.x=y")["affinity"]
    assert own == {"nodeAffinity": {"x": "y"}}


def test_operator_pods_take_pull_secrets_labels_annotations_and_a_priority_class(helm):
    docs = [d for d in yaml.safe_load_all(template(
        helm, "--set", "imagePullSecrets[0].name=registry", "--set", "podLabels.team=platform",
        "--set", "podAnnotations.cost-center=ml", "--set", "priorityClassName=system-cluster-critical").stdout) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    template_ = dep["spec"]["template"]
    assert template_["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    assert template_["spec"]["priorityClassName"] == "system-cluster-critical"
    assert template_["metadata"]["labels"]["team"] == "platform"
    assert template_["metadata"]["labels"]["app.kubernetes.io/name"] == "gpufleet-operator"
    assert template_["metadata"]["annotations"] == {"cost-center": "ml"}

