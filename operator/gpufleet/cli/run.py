"""`gpufleet run` (the operator) and `gpufleet crd` (print the generated CRD)."""
from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from typing import Any

import click

from ..reconcile import figures
from ..settings import (
    LEASE_NAME,
    LeaderElection,
    NetworkPolicies,
    OperatorSettings,
    SettingsError,
    leader_timing,
)


def label_pairs(pairs: tuple[str, ...]) -> dict[str, str]:
    """``KEY=VALUE`` options as a dict (--podmonitor-label)."""
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE, e.g. release=kube-prometheus-stack")
        labels[key] = value
    return labels


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
@click.option("--leader-elect/--no-leader-elect", default=False, show_default=True,
              help="Elect one leader among the operator's replicas on a coordination.k8s.io Lease: only the "
                   "leader reconciles, autoscales and audits; the others keep their watches warm and take over "
                   "when its lease lapses. Needed for more than one replica.")
@click.option("--leader-elect-resource-name", default=LEASE_NAME, show_default=True, help="The Lease's name.")
@click.option("--leader-elect-resource-namespace", default=None,
              help="The Lease's namespace; default: the namespace of the operator's credentials (in a pod, "
                   "its own).")
@click.option("--leader-elect-lease-duration", default=15.0, show_default=True, type=float,
              help="Seconds a follower waits, after the last renewal it saw, before taking the Lease over.")
@click.option("--leader-elect-renew-deadline", default=10.0, show_default=True, type=float,
              help="Seconds after its last successful renewal at which a leader stops acting (shorter than the "
                   "lease duration: the difference is the margin against two leaders).")
@click.option("--leader-elect-retry-period", default=2.0, show_default=True, type=float,
              help="Seconds between renewals, and between a follower's attempts.")
@click.option("--leader-elect-identity", default=None,
              help="This replica's name in the Lease; default: <hostname>_<random> (the pod name in a pod).")
@click.option("--fleet-loops/--no-fleet-loops", default=True, show_default=True,
              help="Run the autoscaler and audits besides reconciliation.")
@click.option("--fleet-interval-seconds", default=1.0, show_default=True, type=float,
              help="How often each service's replicas are read for autoscaling.")
@click.option("--follower-interval-seconds", default=5.0, show_default=True, type=float,
              help="With --leader-elect: how often a replica that does not lead reads every replica's metrics "
                   "(writing nothing), so that when it takes the Lease over its first scaling decisions come at "
                   "once from warm state; 0: it reads nothing until it leads (a cold takeover). "
                   "docs/high-availability.md.")
@click.option("--status-figures-interval-seconds", default=figures.DEFAULT_INTERVAL_S, show_default=True,
              type=float,
              help="Write a busy service's fast-moving status figures (kvCacheUsagePercent, "
                   "ttftP99Milliseconds, kvWastePercent; an adapter's requestsPerSecond) at most this often, "
                   f"0 to {figures.MAX_INTERVAL_S:g}; 0 writes every change. Conditions, replica counts and "
                   "scaling decisions are written at once, with the figures; Prometheus has every figure every "
                   "second (docs/metrics.md).")
@click.option("--resync-seconds", default=300.0, show_default=True, type=float,
              help="Reconcile a service this long after anything last reconciled it (watch events "
                   "of its children and pods reconcile it at once).")
@click.option("--audit-interval-seconds", default=30.0, show_default=True, type=float,
              help="How often the cluster-wide stranded-GPU and isolation audits run.")
@click.option("--podmonitor-label", "podmonitor_labels", multiple=True, metavar="KEY=VALUE",
              callback=lambda ctx, param, pairs: label_pairs(pairs),
              help="A label for every engine PodMonitor, so the cluster's Prometheus selects them (repeat "
                   "for more; kube-prometheus-stack wants release=<its release name>).")
@click.option("--network-policies/--no-network-policies", default=False, show_default=True,
              help="Give every InferenceService a NetworkPolicy: its engines' guard port only for the "
                   "operator, the namespaces named below and (unless turned off) its own namespace "
                   "(docs/security.md).")
@click.option("--network-policy-operator-namespace", default=None,
              help="The operator pods' namespace; default: the namespace of the operator's credentials.")
@click.option("--network-policy-operator-label", "network_policy_operator_labels", multiple=True,
              metavar="KEY=VALUE", callback=lambda ctx, param, pairs: label_pairs(pairs),
              help="A label of the operator's pods (repeat for more): the engines accept its metrics reads.")
@click.option("--network-policy-client-namespace", "network_policy_client_namespaces", multiple=True,
              help="A namespace whose pods send requests to the engines: a router, a gateway (repeatable).")
@click.option("--network-policy-prometheus-namespace", "network_policy_prometheus_namespaces", multiple=True,
              help="A namespace whose Prometheus scrapes the engines (repeatable).")
@click.option("--network-policy-same-namespace/--no-network-policy-same-namespace", default=True,
              show_default=True, help="Let pods in an InferenceService's own namespace reach its engines.")
@click.option("--router-address", "router_addresses", multiple=True, metavar="HOST:PORT",
              help="Read held requests (scale from zero) from these routers instead of the gpufleet-router "
                   "pods found by label (repeatable): a router running outside the cluster.")
@click.option("--adapter-private-sources/--no-adapter-private-sources", default=False, show_default=True,
              help="Let the guards fetch adapters (InferenceAdapter spec.source.uri) from loopback, link-local, "
                   "private, unspecified and multicast addresses: an object store inside the cluster or the "
                   "company network. Off, only public addresses are fetched (guard.json "
                   "adapters.allowPrivateSources; docs/guard-config.md).")
@click.option("--otlp-endpoint", default="", metavar="URL",
              help="The fleet's OTLP/HTTP trace receiver (e.g. http://jaeger-collector:4318): the guards of "
                   "services with spec.observability.tracing On send their spans there, and vLLM its own with "
                   "engineSpans On (guard.json tracing; docs/tracing.md). Empty: no tracing.")
@click.option("--guard-token-file", envvar="GPUFLEET_GUARD_TOKEN_FILE", default=None,
              type=click.Path(dir_okay=False),
              help="The operator's ServiceAccount token for the audience gpufleet-guard (a projected token; the "
                   "chart mounts one). The guards' control routes (adapters, audits, demand) accept the "
                   "operator by it; without it they refuse the operator (docs/security.md).")
@click.option("-v", "--verbose", is_flag=True, help="Log everything at DEBUG (kopf logs every event).")
@click.option("--debug-log", "debug_loggers", multiple=True, metavar="LOGGER",
              help="Log this logger at DEBUG, the rest as usual (repeatable); e.g. kopf._cogs.clients.watching "
                   "says when each watch stream starts, stops and restarts.")
def run(kubeconfig: str | None, verbose: bool, debug_loggers: tuple[str, ...], worker_limit: int,
        **flags: Any) -> None:
    """Run the operator."""
    import kopf

    from gpufleet_kit.kube.config import KubeConfig, KubeConfigError

    from ..wiring import handlers  # noqa: F401  (registers the handlers)
    from ..wiring.runtime import OperatorRuntime

    try:
        settings = settings_from_flags(worker_limit=worker_limit, **flags)
    except SettingsError as e:
        raise click.BadParameter(str(e), param_hint=e.flag) from None
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if not verbose:  # kopf logs every handler success at INFO: one line per pod event
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    for name in debug_loggers:
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        config = KubeConfig.auto(kubeconfig)
    except KubeConfigError as e:
        raise click.ClickException(str(e)) from None
    runtime = OperatorRuntime(config, settings)
    # Standalone for kopf: its peering pauses lower-priority operators; one leader is elected on a Lease instead.
    asyncio.run(kopf.operator(
        clusterwide=not settings.namespaces, namespaces=list(settings.namespaces), standalone=True,
        liveness_endpoint=settings.liveness_endpoint, memo=kopf.Memo(runtime=runtime)))


def settings_from_flags(*, namespaces: tuple[str, ...], metrics_port: int, metrics_host: str,
                        liveness_endpoint: str | None, worker_limit: int, leader_elect: bool,
                        leader_elect_resource_name: str, leader_elect_resource_namespace: str | None,
                        leader_elect_lease_duration: float, leader_elect_renew_deadline: float,
                        leader_elect_retry_period: float, leader_elect_identity: str | None, fleet_loops: bool,
                        fleet_interval_seconds: float, follower_interval_seconds: float,
                        status_figures_interval_seconds: float, resync_seconds: float,
                        audit_interval_seconds: float,
                        podmonitor_labels: dict[str, str], network_policies: bool,
                        network_policy_operator_namespace: str | None,
                        network_policy_operator_labels: dict[str, str],
                        network_policy_client_namespaces: tuple[str, ...],
                        network_policy_prometheus_namespaces: tuple[str, ...],
                        network_policy_same_namespace: bool, router_addresses: tuple[str, ...],
                        adapter_private_sources: bool = False,
                        guard_token_file: str | None = None, otlp_endpoint: str = "") -> OperatorSettings:
    """`gpufleet run`'s flags as the one settings object; a SettingsError names a flag at fault."""
    # The timing is checked even without --leader-elect: a bad value is a mistake either way.
    timing = leader_timing(leader_elect_lease_duration, leader_elect_renew_deadline, leader_elect_retry_period)
    election = LeaderElection(
        identity=f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}" if leader_elect_identity is None
        else leader_elect_identity, timing=timing, name=leader_elect_resource_name,
        namespace=leader_elect_resource_namespace) if leader_elect else None
    policies = NetworkPolicies(
        operator_labels=network_policy_operator_labels, operator_namespace=network_policy_operator_namespace,
        client_namespaces=tuple(network_policy_client_namespaces),
        prometheus_namespaces=tuple(network_policy_prometheus_namespaces),
        same_namespace=network_policy_same_namespace) if network_policies else None
    return OperatorSettings(
        namespaces=tuple(namespaces), metrics_port=metrics_port or None, metrics_host=metrics_host,
        liveness_endpoint=liveness_endpoint, worker_limit=worker_limit, leader_election=election,
        fleet_loops=fleet_loops, fleet_interval=fleet_interval_seconds,
        follower_interval=follower_interval_seconds,
        status_figures_interval=status_figures_interval_seconds, resync_seconds=resync_seconds,
        audit_interval=audit_interval_seconds, podmonitor_labels=podmonitor_labels,
        network_policies=policies, router_addresses=tuple(router_addresses),
        adapter_private_sources=adapter_private_sources, guard_token_file=guard_token_file,
        otlp_endpoint=otlp_endpoint)


@click.command()
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None,
              help="Write to this file instead of stdout.")
@click.option("--markdown", is_flag=True, help="The field reference (docs/api.md) instead of the YAML.")
@click.option("--kind", type=click.Choice(["InferenceService", "InferenceAdapter", "InferenceTenants"]),
              default="InferenceService", show_default=True,
              help="Which CRD to print (the field reference covers every kind).")
def crd(output: str | None, markdown: bool, kind: str) -> None:
    """Print a CRD (InferenceService, InferenceAdapter or InferenceTenants) generated from the API types."""
    from gpufleet_api.crd import KINDS, render_markdown, render_yaml
    text = render_markdown() if markdown else render_yaml(KINDS[kind])
    if output:
        with open(output, "w") as fh:
            fh.write(text)
    else:
        click.echo(text, nl=False)
