"""`gpufleet audit` says which operator replica leads, from the leader-election Lease."""
from datetime import datetime, timezone

from gpufleet.cli.audit import leader_lines

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def lease(holder, renewed="2025-01-01T11:59:58.500000Z", transitions=3):
    return {"metadata": {"name": "gpufleet-operator", "namespace": "gpufleet-system"},
            "spec": {"holderIdentity": holder, "renewTime": renewed, "leaseDurationSeconds": 15,
                     "leaseTransitions": transitions}}


def test_the_leader_is_named_with_its_last_renewal():
    assert leader_lines([lease("gpufleet-operator-7d9c_1a2b")], NOW) == [
        "  gpufleet-operator-7d9c_1a2b leads (Lease gpufleet-system/gpufleet-operator, renewed 1.5s ago, "
        "lease 15s, 3 transition(s))"]


def test_a_lapsed_or_released_lease_means_no_leader():
    [lapsed] = leader_lines([lease("op-a", renewed="2025-01-01T11:59:00Z")], NOW)
    assert lapsed.startswith("  none: op-a last renewed") and "60s ago" in lapsed
    [released] = leader_lines([lease("")], NOW)
    assert released.startswith("  none: the last leader released Lease gpufleet-system/gpufleet-operator")


def test_no_lease_means_no_leader_election():
    assert "without leader election" in leader_lines([], NOW)[0]


def test_a_cluster_without_the_crd_gets_a_message_not_a_traceback(monkeypatch):
    import contextlib

    from click.testing import CliRunner

    from gpufleet.cli import audit as audit_command
    from gpufleet_kit.kube.errors import NotFound

    @contextlib.asynccontextmanager
    async def client(_config):
        yield object()

    async def read(_kube, api_version, kind, resource):
        if kind == "InferenceService":
            raise NotFound(404, "NotFound", "API serving.gpufleet.dev/v1alpha1 is not served")
        return []

    monkeypatch.setattr(audit_command.KubeConfig, "auto", staticmethod(lambda _path: object()))
    monkeypatch.setattr(audit_command, "KubeClient", client)
    monkeypatch.setattr(audit_command, "_read", read)
    result = CliRunner().invoke(audit_command.audit, [])
    assert result.exit_code == audit_command.EXIT_UNKNOWN and "Traceback" not in result.output
    assert "does not serve serving.gpufleet.dev/v1alpha1 InferenceService: the CRD is not installed" in result.output
    assert "kubectl apply -f crds/" in result.output
