"""`gpufleet run` builds one validated settings object; the runtime is wired from it alone."""
from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from gpufleet.cli import main
from gpufleet.cli.run import settings_from_flags
from gpufleet.leader_election.records import Timing
from gpufleet.settings import LeaderElection, NetworkPolicies, OperatorSettings, SettingsError
from gpufleet.wiring.runtime import OperatorRuntime
from gpufleet_kit.kube.config import KubeConfig

KUBECONFIG = ("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
              "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u, "
              "namespace: ops}}]\ncurrent-context: c\n")


@pytest.fixture
def kubeconfig(tmp_path):
    path = tmp_path / "config"
    path.write_text(KUBECONFIG)
    return path


@pytest.mark.parametrize("args, flag, fix", [
    (["--fleet-interval-seconds", "0"], "--fleet-interval-seconds", "e.g. --fleet-interval-seconds 1"),
    (["--follower-interval-seconds", "-1"], "--follower-interval-seconds",
     "0 turns that off (a cold takeover); e.g. --follower-interval-seconds 5"),
    (["--follower-interval-seconds", "nan"], "--follower-interval-seconds", "must be 0 or more (got nan)"),
    (["--resync-seconds", "-5"], "--resync-seconds", "e.g. --resync-seconds 300"),
    (["--audit-interval-seconds", "0"], "--audit-interval-seconds", "e.g. --audit-interval-seconds 30"),
    (["--metrics-port", "70000"], "--metrics-port", "0 turns the metrics server off"),
    (["--worker-limit", "0"], "--worker-limit", "e.g. --worker-limit 100"),
    (["--router-address", "10.0.0.7"], "--router-address", "e.g. --router-address 10.0.0.7:8000"),
    (["--leader-elect", "--leader-elect-renew-deadline", "20"], "--leader-elect-lease-duration",
     "must be longer than the renew deadline"),
    (["--leader-elect", "--leader-elect-identity", ""], "--leader-elect-identity", "leave it out"),
    (["--network-policies"], "--network-policy-operator-label", "KEY=VALUE"),
    (["--status-figures-interval-seconds", "-1"], "--status-figures-interval-seconds",
     "e.g. --status-figures-interval-seconds 20"),
    (["--status-figures-interval-seconds", "301"], "--status-figures-interval-seconds", "must be 0 to 300"),
    (["--status-figures-interval-seconds", "nan"], "--status-figures-interval-seconds", "0 for every change"),
])
def test_a_bad_flag_is_a_usage_error_that_names_the_flag_and_the_fix(args, flag, fix, kubeconfig):
    result = CliRunner().invoke(main, ["run", "--kubeconfig", str(kubeconfig), *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output and fix in " ".join(result.output.split()), result.output


FLAGS = dict(namespaces=(), metrics_port=9090, metrics_host="0.0.0.0", liveness_endpoint=None, worker_limit=100,
             leader_elect=False, leader_elect_resource_name="gpufleet-operator",
             leader_elect_resource_namespace=None, leader_elect_lease_duration=15.0,
             leader_elect_renew_deadline=10.0, leader_elect_retry_period=2.0, leader_elect_identity=None,
             fleet_loops=True, fleet_interval_seconds=1.0, follower_interval_seconds=5.0,
             status_figures_interval_seconds=20.0, resync_seconds=300.0, audit_interval_seconds=30.0,
             podmonitor_labels={}, network_policies=False, network_policy_operator_namespace=None,
             network_policy_operator_labels={}, network_policy_client_namespaces=(),
             network_policy_prometheus_namespaces=(), network_policy_same_namespace=True, router_addresses=())


def test_the_defaults_of_the_flags_are_the_defaults_of_the_settings():
    assert settings_from_flags(**FLAGS) == OperatorSettings()


@pytest.mark.parametrize("seconds", [0.0, 20.0, 300.0])
def test_the_status_figures_interval_takes_0_to_300_seconds(seconds):
    settings = settings_from_flags(**{**FLAGS, "status_figures_interval_seconds": seconds})
    assert settings.status_figures_interval == seconds
    for wrong in (-0.5, 300.5, float("inf")):
        with pytest.raises(SettingsError) as e:
            OperatorSettings(status_figures_interval=wrong)
        assert e.value.flag == "--status-figures-interval-seconds"


def test_settings_are_frozen_and_their_labels_cannot_change_under_the_runtime():
    labels = {"release": "prom"}
    settings = OperatorSettings(podmonitor_labels=labels)
    labels["release"] = "other"
    assert settings.podmonitor_labels == {"release": "prom"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.fleet_interval = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        settings.podmonitor_labels["x"] = "y"  # type: ignore[index]
    with pytest.raises(SettingsError) as e:
        OperatorSettings(fleet_interval=0)
    assert e.value.flag == "--fleet-interval-seconds"


def test_a_follower_interval_of_0_is_a_cold_follower_and_below_0_is_refused():
    assert OperatorSettings(follower_interval=0).follower_interval == 0
    assert settings_from_flags(**{**FLAGS, "follower_interval_seconds": 2.5}).follower_interval == 2.5
    with pytest.raises(SettingsError) as e:
        OperatorSettings(follower_interval=-0.5)
    assert e.value.flag == "--follower-interval-seconds" and "got -0.5" in str(e.value)


def test_leader_election_gets_a_unique_identity_unless_one_is_given():
    a = settings_from_flags(**{**FLAGS, "leader_elect": True}).leader_election
    b = settings_from_flags(**{**FLAGS, "leader_elect": True}).leader_election
    assert a is not None and b is not None and a.identity != b.identity
    given = settings_from_flags(**{**FLAGS, "leader_elect": True, "leader_elect_identity": "pod-0"})
    assert given.leader_election == LeaderElection(identity="pod-0", timing=Timing(15.0, 10.0, 2.0))


async def test_the_runtime_is_wired_from_the_settings_alone(kubeconfig):
    """Names left to the credentials (the Lease's, the operator's for its NetworkPolicy peer) come from them."""
    settings = OperatorSettings(
        resync_seconds=60.0, fleet_interval=0.5, follower_interval=3.0, status_figures_interval=7.0,
        podmonitor_labels={"release": "prom"},
        leader_election=LeaderElection(identity="pod-0"),
        network_policies=NetworkPolicies(operator_labels={"app": "op"}, client_namespaces=("gw",)))
    rt = OperatorRuntime(KubeConfig.from_file(str(kubeconfig)), settings)
    try:
        assert rt.elector is not None and rt.elector.lease == "ops/gpufleet-operator"
        assert rt.kube.write_fence == rt.elector.acting_for
        assert rt.controller.children.podmonitor_labels == {"release": "prom"}
        ingress = rt.controller.children.engine_ingress
        assert ingress is not None and ingress.operator_namespace == "ops" and ingress.client_namespaces == ("gw",)
        assert rt.fleet is not None and rt.fleet.interval == 0.5 and rt.fleet.leadership is rt
        assert rt.fleet.follow_interval == 3.0
        assert rt.fleet.figures_interval == 7.0
        ports = rt.fleet.ports
        assert ports.events is rt.kube and ports.objects is rt.kube and ports.replicas is rt.reader
        assert ports.status is rt.controller and ports.locks is rt.controller
        assert not rt.resync_due("ml", "a", 0.0) and rt.resync_due("ml", "a", 60.0)
    finally:
        await rt.kube.close()
        await rt.elector.kube.close()


async def test_without_fleet_loops_nothing_reads_replicas(kubeconfig):
    rt = OperatorRuntime(KubeConfig.from_file(str(kubeconfig)), OperatorSettings(fleet_loops=False))
    assert rt.fleet is None and rt.reader is None and rt.elector is None and rt.kube.write_fence is None
    await rt.kube.close()


async def test_an_engine_pod_event_refreshes_status_and_the_fleet_loops_view(kubeconfig):
    rt = OperatorRuntime(KubeConfig.from_file(str(kubeconfig)), OperatorSettings())
    view = {"ip": "10.0.0.1", "ready": True, "deleting": False, "marked": False}
    rt.pod_changed("ml", "chat", "chat-0", view)
    assert rt.drain_triggered() == {("ml", "chat"): False}
    assert rt.fleet is not None and rt.fleet.pods == {("ml", "chat"): {"chat-0": {"name": "chat-0", **view}}}
    rt.pod_changed("ml", "chat", "chat-0", None)
    assert rt.fleet.pods == {}
    await rt.kube.close()
