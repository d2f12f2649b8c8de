"""`gpufleet audit`: the cluster's stranded GPUs and isolation, computed now,
plus each service's last fragmentation audit; `--service` asks the operator
for a fresh fragmentation audit (annotation) and waits for it."""
from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from datetime import datetime, timezone

import click

from gpufleet.leader_election import lease_store as lease_api
from gpufleet_api import v1alpha1 as t
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig, KubeConfigError
from gpufleet_kit.kube.errors import ApiError, Forbidden, NotFound, Refusal

from ..fleet.cluster_audit import audit_report
from ..manifests import names

LEASE_NAME = "gpufleet-operator"  # the chart's leaderElection.leaseName, the operator's --leader-elect-resource-name
# The chart puts the Lease in its release namespace; the docs install the release here.
OPERATOR_NAMESPACE = "gpufleet-system"

EXIT_HEALTHY = 0  # nothing wrong in any section that could be read
EXIT_PROBLEMS = 1  # stranded GPUs, an isolation violation or fragmentation above threshold
EXIT_UNKNOWN = 3  # the fleet's health could not be told: no fleet section readable, or the audit failed

# A section's input: the objects read, or what the identity was not permitted to do.
Reading = list[dict] | Refusal


class AuditFailed(click.ClickException):
    """The audit could not be done at all (kubeconfig, CRD missing, an API error other than a refusal)."""
    exit_code = EXIT_UNKNOWN


@dataclass
class Readings:
    """What `gpufleet audit` read from the cluster, per input; no I/O past here."""
    leases: Reading | str  # str: the line saying why the Lease could not be read (not a refusal)
    nodes: Reading
    pods: Reading
    services: Reading
    operator_namespace: str = OPERATOR_NAMESPACE
    lease_name: str = LEASE_NAME


@dataclass
class Outcome:
    lines: list[str]
    problems: int = 0
    checked: bool = False  # at least one fleet section (stranded, isolation, fragmentation) was read


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def leader_lines(leases: list[dict], now: datetime, namespace: str = OPERATOR_NAMESPACE,
                 name: str = LEASE_NAME) -> list[str]:
    """Who leads the operator, from its leader-election Lease(s); pure."""
    if not leases:
        return [f"  no Lease {namespace}/{name}: the operator runs without leader election (one replica), "
                f"or is installed in another namespace (--operator-namespace), or is not installed"]
    out = []
    for obj in leases:
        meta, spec = obj["metadata"], obj.get("spec") or {}
        where = f"Lease {meta.get('namespace')}/{meta['name']}"
        renewed = _parse_time(spec.get("renewTime"))
        age = (now - renewed).total_seconds() if renewed else None
        duration = spec.get("leaseDurationSeconds") or 0
        transitions = spec.get("leaseTransitions", 0)
        holder = spec.get("holderIdentity")
        if not holder:
            out.append(f"  none: the last leader released {where} ({transitions} transition(s)); a replica "
                       f"takes it within its retry period")
        elif age is not None and age > duration:
            out.append(f"  none: {holder} last renewed {where} {age:.0f}s ago (lease {duration}s): it is "
                       f"gone or cut off, and no other replica has taken over")
        else:
            ago = f"{age:.1f}s ago" if age is not None else "at an unknown time"
            out.append(f"  {holder} leads ({where}, renewed {ago}, lease {duration}s, "
                       f"{transitions} transition(s))")
    return out


def _refused(*readings: object) -> list[str]:
    """The lines for a section some of whose inputs were refused (empty when all were read)."""
    out: list[str] = []
    for r in readings:
        if isinstance(r, Refusal) and f"  {r}" not in out:
            out.append(f"  {r}")
    return out


def render(readings: Readings, now: datetime) -> Outcome:
    """Every section's lines, the problems found and whether any fleet section was read; pure.
    A section the identity may not read says so and counts neither as healthy nor as a problem."""
    r = readings
    outcome = Outcome(lines=["Operator leader:"])
    lines = outcome.lines
    if isinstance(r.leases, str):
        lines.append(r.leases)
    elif isinstance(r.leases, Refusal):
        lines += _refused(r.leases)
    else:
        lines += leader_lines(r.leases, now, r.operator_namespace, r.lease_name)

    report = audit_report(*(x if isinstance(x, list) else [] for x in (r.nodes, r.pods, r.services)))
    lines.append("\nStranded GPUs (free, but no InferenceService can use them):")
    denied = _refused(r.nodes, r.pods, r.services)
    if denied:
        lines += denied
    else:
        outcome.checked = True
        if not report["stranded"]:
            lines.append("  none")
        for s in report["stranded"]:
            outcome.problems += 1
            lines.append(f"  {s.node:<20} pool={s.pool:<10} {s.product:<26} free={s.free}  {s.why}")

    lines.append("\nIsolation:")
    denied = _refused(r.services, r.pods)
    if denied:
        lines += denied
    else:
        outcome.checked = True
        for obj, spec in report["specs"]:
            meta = obj["metadata"]
            v = report["isolation"][(meta["namespace"], meta["name"])]
            verdict = "shared by request" if spec.isolation.mode == "Shared" else ("OK" if not v else "VIOLATED")
            lines.append(f"  {meta['namespace']}/{meta['name']:<24} {spec.isolation.mode:<10} {verdict}")
            for x in v:
                outcome.problems += 1
                lines.append(f"      {x.pod} on {x.node}: {x.why}")

    lines.append("\nFragmentation (last audit per service):")
    denied = _refused(r.services)
    if denied:
        lines += denied
    else:
        outcome.checked = True
        for obj, _spec in report["specs"]:
            f = (obj.get("status") or {}).get("fragmentation") or {}
            meta = obj["metadata"]
            lines.append(f"  {meta['namespace']}/{meta['name']:<24} {f.get('verdict', 'not yet audited'):<15} "
                         f"{f.get('recommendation', '')}")
            outcome.problems += f.get("verdict") == "AboveThreshold"
    return outcome


def exit_code(outcome: Outcome) -> int:
    """Whether the fleet is healthy, from what could be read; pure. A refused section alone
    does not fail the audit, but with no fleet section read there is nothing to call healthy."""
    if outcome.problems:
        return EXIT_PROBLEMS
    return EXIT_HEALTHY if outcome.checked else EXIT_UNKNOWN


async def _read_leases(kube: KubeClient, namespace: str, name: str) -> Reading | str:
    try:
        obj = await lease_api.get_lease(kube, namespace, name)
    except Forbidden as e:
        return e.refusal("get", "leases.coordination.k8s.io", namespace)
    except ApiError as e:
        return f"  unknown: cannot read Lease {namespace}/{name} ({e})"
    if obj:
        return [obj]
    # Not in that namespace: where this identity may list Leases cluster-wide, look for it elsewhere.
    try:
        return await kube.list(lease_api.API_VERSION, lease_api.KIND, field_selector=f"metadata.name={name}")
    except ApiError:
        return []


async def _read(kube: KubeClient, api_version: str, kind: str, resource: str) -> Reading:
    for attempt in range(10):
        try:
            return await kube.list(api_version, kind)
        except Forbidden as e:
            return e.refusal("list", resource)
        except ApiError as e:  # 429 "storage is (re)initializing" just after a CRD is installed, 5xx
            if not e.transient or attempt == 9:
                raise
            await asyncio.sleep(1.0)
    raise AssertionError("unreachable")


async def _request_fragmentation(kube: KubeClient, namespace: str, service: str, timeout: float) -> dict:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    await kube.merge_patch(t.API_VERSION, t.KIND, service, {"metadata": {"annotations": {
        names.ANNOTATION_AUDIT_REQUEST: stamp}}}, namespace)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        obj = await kube.get(t.API_VERSION, t.KIND, service, namespace)
        if names.ANNOTATION_AUDIT_REQUEST not in (obj["metadata"].get("annotations") or {}):
            return (obj.get("status") or {}).get("fragmentation") or {}
        await asyncio.sleep(0.5)
    raise AuditFailed(f"no audit result within {timeout:.0f}s: is the operator running?")


async def _audit(kubeconfig: str | None, namespace: str, service: str | None, timeout: float,
                 operator_namespace: str, lease_name: str) -> int:
    # Loading may run the kubeconfig's credential plugin: not on the event loop.
    async with KubeClient(await asyncio.to_thread(KubeConfig.auto, kubeconfig)) as kube:
        if service:
            frag = await _request_fragmentation(kube, namespace, service, timeout)
            click.echo(f"fragmentation of {namespace}/{service}: {frag.get('verdict')} "
                       f"(worst {frag.get('worstReplica') or '-'} {frag.get('percent', '-')}%) — "
                       f"{frag.get('recommendation', '')}")
        read: list[Reading | BaseException] = list(await asyncio.gather(
            _read(kube, "v1", "Node", "nodes"), _read(kube, "v1", "Pod", "pods"),
            _read(kube, t.API_VERSION, t.KIND, f"{t.PLURAL}.{t.GROUP}"), return_exceptions=True))
        nodes, pods, services = read
        for r in (nodes, pods, services):
            if isinstance(r, BaseException) and not (isinstance(r, NotFound) and "is not served" in str(r)):
                raise r
        if isinstance(services, NotFound):
            also = "".join(f"; {r}" for r in (nodes, pods) if isinstance(r, Refusal))
            raise AuditFailed(
                f"this cluster does not serve {t.API_VERSION} {t.KIND}: the CRD is not installed. Install "
                f"the chart (helm install gpufleet charts/gpufleet ...) or kubectl apply -f crds/{also}")
        assert not isinstance(nodes, BaseException) and not isinstance(pods, BaseException)
        assert not isinstance(services, BaseException)
        leases = await _read_leases(kube, operator_namespace, lease_name)
    outcome = render(Readings(leases, nodes, pods, services, operator_namespace, lease_name),
                     datetime.now(timezone.utc))
    for line in outcome.lines:
        click.echo(line)
    return exit_code(outcome)


@click.command()
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None)
@click.option("-n", "--namespace", default="default", show_default=True,
              help="The namespace of --service.")
@click.option("--service", default=None, help="Run a fresh fragmentation audit of this InferenceService first.")
@click.option("--timeout", default=30.0, show_default=True)
@click.option("--operator-namespace", envvar="GPUFLEET_OPERATOR_NAMESPACE", default=OPERATOR_NAMESPACE,
              show_default=True, help="Where the operator runs (the chart's release namespace): its "
              "leader-election Lease is read there.")
@click.option("--operator-lease", default=LEASE_NAME, show_default=True,
              help="The operator's Lease (the chart's leaderElection.leaseName).")
def audit(kubeconfig, namespace, service, timeout, operator_namespace, operator_lease) -> None:
    """Stranded GPUs, isolation and fragmentation across the cluster, and who leads the operator.

    A read-only identity is enough: a section it may not read says
    "not permitted: <verb> <resource>" and the others are still audited.

    \b
    Exit codes:
      0  healthy: nothing wrong in any section that could be read
      1  problems: stranded GPUs, an isolation violation or fragmentation
         above threshold
      2  usage error (a bad option)
      3  health unknown: no fleet section could be read, or the audit
         failed (kubeconfig, CRD not installed, API error)
    """
    try:
        code = asyncio.run(_audit(kubeconfig, namespace, service, timeout, operator_namespace, operator_lease))
    except KubeConfigError as e:
        raise AuditFailed(str(e)) from None
    except ApiError as e:
        raise AuditFailed(str(e)) from None
    sys.exit(code)
