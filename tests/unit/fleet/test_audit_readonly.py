"""`gpufleet audit` with a read-only identity (view, plus read on InferenceServices, nodes and pods):
a section it may not read says "not permitted: <verb> <resource>", and the exit code says whether
the fleet is healthy, not whether every section was readable."""
import contextlib
from datetime import datetime, timezone

from click.testing import CliRunner

import gpufleet.cli.audit as audit_command
from gpufleet.cli.audit import EXIT_HEALTHY, EXIT_PROBLEMS, EXIT_UNKNOWN, Readings, exit_code, render
from gpufleet_kit.kube.errors import Forbidden, Refusal, error_for

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
USER = "system:serviceaccount:oncall:reader"


def forbidden(message: str) -> Forbidden:
    e = error_for(403, {"kind": "Status", "reason": "Forbidden", "message": message}, "")
    assert isinstance(e, Forbidden)
    return e


LEASE_REFUSED = forbidden(f'leases.coordination.k8s.io "gpufleet-operator" is forbidden: User "{USER}" cannot get '
                          f'resource "leases" in API group "coordination.k8s.io" in the namespace "gpufleet-system"')
NODES_REFUSED = forbidden(f'nodes is forbidden: User "{USER}" cannot list resource "nodes" in API group "" at the '
                          f'cluster scope')


def service(name="chat", verdict=None):
    obj = {"metadata": {"name": name, "namespace": "team"},
           "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}}}
    if verdict:
        obj["status"] = {"fragmentation": {"verdict": verdict, "recommendation": "consolidate"}}
    return obj


def test_a_refusal_names_the_verb_and_resource_from_the_server_message():
    assert str(LEASE_REFUSED.refusal("get", "leases")) == (
        f"not permitted: get leases.coordination.k8s.io in namespace gpufleet-system (as {USER})")
    assert str(NODES_REFUSED.refusal("list", "nodes")) == f"not permitted: list nodes (as {USER})"
    # A message of another shape: what was asked.
    assert forbidden("denied by webhook").refusal("list", "pods", "team") == Refusal("list", "pods", "team")


def test_a_refused_lease_is_reported_and_a_healthy_fleet_still_exits_0():
    outcome = render(Readings(LEASE_REFUSED.refusal("get", "leases"), [], [], [service()]), NOW)
    assert outcome.lines[:2] == [
        "Operator leader:",
        f"  not permitted: get leases.coordination.k8s.io in namespace gpufleet-system (as {USER})"]
    text = "\n".join(outcome.lines)
    for section in ("Stranded GPUs", "Isolation:", "Fragmentation"):
        assert section in text
    assert "team/chat" in text
    assert exit_code(outcome) == EXIT_HEALTHY


def test_problems_in_the_readable_sections_exit_1_though_others_were_refused():
    outcome = render(Readings([], NODES_REFUSED.refusal("list", "nodes"), [], [service(verdict="AboveThreshold")]),
                     NOW)
    text = "\n".join(outcome.lines)
    assert f"Stranded GPUs (free, but no InferenceService can use them):\n  not permitted: list nodes (as {USER})" \
        in text
    assert "AboveThreshold" in text
    assert exit_code(outcome) == EXIT_PROBLEMS


def test_with_no_fleet_section_readable_the_health_is_unknown():
    refused = Refusal("list", "inferenceservices.serving.gpufleet.dev", user=USER)
    outcome = render(Readings([], [], [], refused), NOW)
    assert outcome.lines.count(f"  {refused}") == 3  # stranded, isolation, fragmentation
    assert exit_code(outcome) == EXIT_UNKNOWN


def test_a_missing_lease_names_the_namespace_looked_in():
    outcome = render(Readings([], [], [], [], operator_namespace="ops"), NOW)
    assert outcome.lines[1].startswith("  no Lease ops/gpufleet-operator:")
    assert "--operator-namespace" in outcome.lines[1]
    assert exit_code(outcome) == EXIT_HEALTHY


def test_the_command_reads_the_lease_in_the_operator_namespace_and_exits_on_health(monkeypatch):
    asked = []

    @contextlib.asynccontextmanager
    async def client(_config):
        yield object()

    async def read(_kube, api_version, kind, resource):
        return [service()] if kind == "InferenceService" else []

    async def get_lease(_kube, namespace, name):
        asked.append((namespace, name))
        raise LEASE_REFUSED

    monkeypatch.setattr(audit_command.KubeConfig, "auto", staticmethod(lambda _path: object()))
    monkeypatch.setattr(audit_command, "KubeClient", client)
    monkeypatch.setattr(audit_command, "_read", read)
    monkeypatch.setattr(audit_command.lease_api, "get_lease", get_lease)
    result = CliRunner().invoke(audit_command.audit, ["--operator-namespace", "gpufleet-system"])
    assert asked == [("gpufleet-system", "gpufleet-operator")]
    assert "not permitted: get leases.coordination.k8s.io in namespace gpufleet-system" in result.output
    assert "Traceback" not in result.output
    assert result.exit_code == EXIT_HEALTHY, result.output


def test_the_help_documents_the_exit_codes():
    text = CliRunner().invoke(audit_command.audit, ["--help"]).output
    assert "Exit codes:" in text and "--operator-namespace" in text
    for line in ("0  healthy", "1  problems", "3  health unknown"):
        assert line in text
