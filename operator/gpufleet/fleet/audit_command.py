"""`gpufleet audit`: the cluster's stranded GPUs and isolation, computed now,
plus each service's last fragmentation audit; `--service` asks the operator
for a fresh fragmentation audit (annotation) and waits for it."""
from __future__ import annotations

import asyncio
import sys
from datetime import datetime, timezone

import click

from ..api import v1alpha1 as t
from ..kube import lease as lease_api
from ..kube.client import KubeClient
from ..kube.config import KubeConfig, KubeConfigError
from ..kube.errors import ApiError, NotFound
from ..manifests import names
from .cluster_audit import audit_report, collect

LEASE_NAME = "gpufleet-operator"


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def leader_lines(leases: list[dict], now: datetime) -> list[str]:
    """Who leads the operator, from its leader-election Lease(s); pure."""
    if not leases:
        return [f"  no Lease named {LEASE_NAME}: the operator runs without leader election (one replica), "
                "or is not installed"]
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


async def _leases(kube: KubeClient) -> list[dict] | str:
    try:
        return await kube.list(lease_api.API_VERSION, lease_api.KIND, field_selector=f"metadata.name={LEASE_NAME}")
    except ApiError as e:
        return f"  unknown: cannot list Leases ({e})"


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
    raise click.ClickException(f"no audit result within {timeout:.0f}s: is the operator running?")


async def _audit(kubeconfig, namespace, service, timeout) -> int:
    # Loading may run the kubeconfig's credential plugin: not on the event loop.
    async with KubeClient(await asyncio.to_thread(KubeConfig.auto, kubeconfig)) as kube:
        if service:
            frag = await _request_fragmentation(kube, namespace, service, timeout)
            click.echo(f"fragmentation of {namespace}/{service}: {frag.get('verdict')} "
                       f"(worst {frag.get('worstReplica') or '-'} {frag.get('percent', '-')}%) — "
                       f"{frag.get('recommendation', '')}")
        try:
            nodes, pods, services = await collect(kube)
        except NotFound as e:
            if "is not served" not in str(e):
                raise
            raise click.ClickException(
                f"this cluster does not serve {t.API_VERSION} {t.KIND}: the CRD is not installed. Install "
                f"the chart (helm install gpufleet charts/gpufleet ...) or kubectl apply -f crds/") from None
        report = audit_report(nodes, pods, services)
        leases = await _leases(kube)
    problems = 0
    click.echo("Operator leader:")
    for line in [leases] if isinstance(leases, str) else leader_lines(leases, datetime.now(timezone.utc)):
        click.echo(line)
    click.echo("\nStranded GPUs (free, but no InferenceService can use them):")
    if not report["stranded"]:
        click.echo("  none")
    for s in report["stranded"]:
        problems += 1
        click.echo(f"  {s.node:<20} pool={s.pool:<10} {s.product:<26} free={s.free}  {s.why}")
    click.echo("\nIsolation:")
    for obj, spec in report["specs"]:
        meta = obj["metadata"]
        v = report["isolation"][(meta["namespace"], meta["name"])]
        verdict = "shared by request" if spec.isolation.mode == "Shared" else ("OK" if not v else "VIOLATED")
        click.echo(f"  {meta['namespace']}/{meta['name']:<24} {spec.isolation.mode:<10} {verdict}")
        for x in v:
            problems += 1
            click.echo(f"      {x.pod} on {x.node}: {x.why}")
    click.echo("\nFragmentation (last audit per service):")
    for obj, _spec in report["specs"]:
        f = (obj.get("status") or {}).get("fragmentation") or {}
        meta = obj["metadata"]
        click.echo(f"  {meta['namespace']}/{meta['name']:<24} {f.get('verdict', 'not yet audited'):<15} "
                   f"{f.get('recommendation', '')}")
        problems += f.get("verdict") == "AboveThreshold"
    return problems


@click.command()
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None)
@click.option("-n", "--namespace", default="default", show_default=True)
@click.option("--service", default=None, help="Run a fresh fragmentation audit of this InferenceService first.")
@click.option("--timeout", default=30.0, show_default=True)
def audit(kubeconfig, namespace, service, timeout) -> None:
    """Stranded GPUs, isolation and fragmentation across the cluster (exit 1 when something is wrong)."""
    try:
        problems = asyncio.run(_audit(kubeconfig, namespace, service, timeout))
    except KubeConfigError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(1 if problems else 0)
