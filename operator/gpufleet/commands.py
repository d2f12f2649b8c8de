"""`gpufleet run` (the operator) and `gpufleet crd` (print the generated CRD)."""
from __future__ import annotations

import asyncio
import logging

import click


@click.command()
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None,
              help="Kubeconfig path, or a list as in $KUBECONFIG; default $KUBECONFIG, then in-cluster, "
                   "then ~/.kube/config.")
@click.option("--namespace", "namespaces", multiple=True,
              help="Watch only these namespaces (repeatable); default: cluster-wide.")
@click.option("--metrics-port", default=9090, show_default=True, type=int,
              help="Port of the operator's /metrics and /healthz; 0 disables.")
@click.option("--metrics-host", default="0.0.0.0", show_default=True)
@click.option("--liveness", "liveness_endpoint", default=None,
              help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz.")
@click.option("--worker-limit", default=100, show_default=True, type=int,
              help="Most objects of one kind handled at once (a retrying object holds its worker while it waits).")
@click.option("--peering/--standalone", default=False, show_default=True,
              help="kopf peering so several operator replicas never reconcile at once "
                   "(needs the chart's KopfPeering resources).")
@click.option("--fleet-loops/--no-fleet-loops", default=True, show_default=True,
              help="Run the autoscaler and audits besides reconciliation.")
@click.option("--fleet-interval-seconds", default=1.0, show_default=True, type=float,
              help="How often each service's replicas are read for autoscaling.")
@click.option("--resync-seconds", default=300.0, show_default=True, type=float,
              help="Reconcile a service this long after anything last reconciled it (watch events "
                   "of its children and pods reconcile it at once).")
@click.option("--audit-interval-seconds", default=30.0, show_default=True, type=float,
              help="How often the cluster-wide stranded-GPU and isolation audits run.")
@click.option("-v", "--verbose", is_flag=True)
def run(kubeconfig, namespaces, metrics_port, metrics_host, liveness_endpoint, worker_limit, peering,
        fleet_loops, fleet_interval_seconds, resync_seconds, audit_interval_seconds, verbose) -> None:
    """Run the operator."""
    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)
    from .kube.config import KubeConfig, KubeConfigError
    from .runtime import OperatorRuntime

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if not verbose:  # kopf logs every handler success at INFO: one line per pod event
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    try:
        config = KubeConfig.auto(kubeconfig)
    except KubeConfigError as e:
        raise click.ClickException(str(e)) from None
    runtime = OperatorRuntime(config, metrics_port=metrics_port or None, metrics_host=metrics_host)
    runtime.fleet_interval = fleet_interval_seconds
    runtime.resync_seconds = resync_seconds
    if fleet_loops:
        from .fleet import register_loops
        register_loops(runtime, audit_interval=audit_interval_seconds)
    memo = kopf.Memo(runtime=runtime, worker_limit=worker_limit)
    asyncio.run(kopf.operator(
        clusterwide=not namespaces, namespaces=list(namespaces), standalone=not peering,
        peering_name="gpufleet" if peering else None, liveness_endpoint=liveness_endpoint, memo=memo))


@click.command()
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None,
              help="Write to this file instead of stdout.")
@click.option("--markdown", is_flag=True, help="The field reference (docs/api.md) instead of the YAML.")
def crd(output, markdown) -> None:
    """Print the InferenceService CRD generated from the API types."""
    from .api.crd import render_markdown, render_yaml
    text = render_markdown() if markdown else render_yaml()
    if output:
        with open(output, "w") as fh:
            fh.write(text)
    else:
        click.echo(text, nl=False)
