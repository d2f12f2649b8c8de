"""`gpufleet router`: run the router (docs/router.md)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal

import click

from gpufleet_api.tracing import DEFAULT_SAMPLE_RATIO, OTLP_PROTOCOLS, TracingConfig

from .discovery import COALESCE_SECONDS, MODES, Discovery, connections_needed
from .policy.choice import POLICIES, Policy
from .server import RouterSettings


@click.command()
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None,
              help="Kubeconfig path; default $KUBECONFIG, then in-cluster, then ~/.kube/config.")
@click.option("--namespace", "namespaces", multiple=True,
              help="Route to InferenceServices in these namespaces only (repeatable); default: every namespace.")
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int, help="The OpenAI API, /metrics and probes.")
@click.option("--discovery", type=click.Choice(MODES), default=Discovery.WATCH, show_default=True,
              help=f"How InferenceServices, engine pods and InferenceAdapters are found: watch (the API server's "
                   f"watch streams; routes rebuilt within {COALESCE_SECONDS:g} s of a change) or list (every "
                   f"--discovery-interval-seconds, for clusters where the router may not watch).")
@click.option("--discovery-interval-seconds", default=2.0, show_default=True, type=click.FloatRange(0.1),
              help="With --discovery list: how often InferenceServices and engine pods are listed.")
@click.option("--reading-interval-seconds", default=1.0, show_default=True, type=click.FloatRange(0.1),
              help="How often each replica's guard /metrics is read (free KV blocks, readiness).")
@click.option("--prefix-blocks", default=4, show_default=True, type=click.IntRange(0),
              help="Leading KV blocks of a prompt hashed for prefix affinity; 0 turns affinity off.")
@click.option("--load-factor", default=0.25, show_default=True, type=click.FloatRange(0.0),
              help="Prefix affinity passes over a replica using more than (1 + this) x the mean KV blocks.")
@click.option("--tier-load-factor", default=0.0, show_default=True, type=click.FloatRange(0.0),
              help="--load-factor for a service with a shared KV tier (spec.engine.kvTier Shared): a request "
                   "spilled off its prefix's replica loads the prefix from the tier, so spilling is cheap.")
@click.option("--max-body-bytes", default=8 << 20, show_default=True, type=click.IntRange(1),
              help="Larger request bodies get 413.")
@click.option("--body-budget-bytes", default=128 << 20, show_default=True, type=click.IntRange(1),
              help="Request-body bytes held at once across all requests (counted before a body is read); "
                   "a body that does not fit gets 503 with Retry-After. At least --max-body-bytes.")
@click.option("--drain-grace-seconds", default=5.0, show_default=True, type=click.FloatRange(0.0),
              help="On SIGTERM, stay unready but serving this long (endpoint removal, pooled connections) "
                   "before closing the listener.")
@click.option("--hold-timeout-seconds", default=120.0, show_default=True, type=click.FloatRange(0.0),
              help="A request for a service with no ready replica waits this long for one (a cold start), "
                   "then gets 503 with Retry-After from the cold starts measured.")
@click.option("--hold-max-requests", default=256, show_default=True, type=click.IntRange(0),
              help="Most requests held per service; more get 503 at once.")
@click.option("--prefill-timeout-seconds", default=30.0, show_default=True, type=click.FloatRange(0.1),
              help="A disaggregated service's prefill step gets this long; then the request goes to decode, "
                   "which computes the prompt itself.")
@click.option("--policy", type=click.Choice(POLICIES), default=Policy.KV_AWARE, show_default=True,
              help="How a replica is chosen: kv_aware (prefix affinity, then free KV; docs/router.md) or "
                   "round_robin (each eligible replica in turn: a baseline for benchmarks).")
@click.option("--resume-streams/--no-resume-streams", default=True, show_default=True,
              help="A streamed completion whose replica breaks off mid-answer continues on another replica of "
                   "its revision (docs/resumption.md); off: the client's stream breaks with the replica's.")
@click.option("--max-resumptions", default=2, show_default=True, type=click.IntRange(0),
              help="Most times one streamed answer is continued on another replica.")
@click.option("--resume-timeout-seconds", default=30.0, show_default=True, type=click.FloatRange(0.0),
              help="A continuation that every replica of its revision refuses (429/503) waits for their "
                   "Retry-After, this long at most from the break; then the stream ends in an error event.")
@click.option("--epp-port", default=None, type=click.IntRange(0, 65535),
              help="Also serve the Gateway API Inference Extension's endpoint picker (Envoy ext_proc over gRPC, with "
                   "grpc.health.v1) on this port, with the same policy (docs/gateway-epp.md); default: off.")
@click.option("--epp-secure-serving/--no-epp-secure-serving", default=True, show_default=True,
              help="The endpoint picker speaks TLS (gateways expect it); --no-epp-secure-serving: plaintext.")
@click.option("--epp-cert-path", default=None, type=click.Path(file_okay=False),
              help="A folder with tls.crt and tls.key for the endpoint picker; default: a self-signed certificate "
                   "made at start.")
@click.option("--epp-fallbacks", default=1, show_default=True, type=click.IntRange(1, 16),
              help="Endpoints the picker names per request: its pick, then the fallbacks a gateway retrying goes to. "
                   "More than 1 only for gateways whose balancer reads a list (Envoy's override_host); an "
                   "ORIGINAL_DST cluster reads one address.")
@click.option("--epp-fairness-as-tenant/--no-epp-fairness-as-tenant", default=True, show_default=True,
              help="In a namespace without tenants, the gateway's x-gateway-inference-fairness-id keys the guard's "
                   "fair lane as a tenant would; off: ignored.")
@click.option("--router-endpoints", envvar="GPUFLEET_ROUTER_ENDPOINTS", default="",
              help="host:port of the router pods (comma-separated) the picker sends a service to whose gateway data "
                   "path is the router; default: this pod's $POD_IP and --port.")
@click.option("--otlp-endpoint", default="", metavar="URL",
              help="The fleet's OTLP trace receiver (e.g. http://jaeger-collector:4318): the router's spans of each "
                   "request go there, and its traceparent to the guards, whose spans join the trace "
                   "(docs/tracing.md). Empty: no tracing.")
@click.option("--otlp-protocol", type=click.Choice(OTLP_PROTOCOLS), default="http/protobuf", show_default=True,
              help="How spans go to --otlp-endpoint.")
@click.option("--trace-sampled-per-mille", default=round(DEFAULT_SAMPLE_RATIO * 1000), show_default=True,
              type=click.IntRange(0, 1000),
              help="With --otlp-endpoint: requests traced from their start, per thousand, besides those with a "
                   "sampled traceparent and those the tail rule keeps (refused, failed, resumed, fell back).")
@click.option("-v", "--verbose", is_flag=True)
def router(kubeconfig, namespaces, host, port, discovery, discovery_interval_seconds, reading_interval_seconds,
           prefix_blocks, load_factor, tier_load_factor, max_body_bytes, body_budget_bytes, drain_grace_seconds,
           hold_timeout_seconds, hold_max_requests, prefill_timeout_seconds, policy, resume_streams, max_resumptions,
           resume_timeout_seconds, epp_port, epp_secure_serving, epp_cert_path, epp_fallbacks,
           epp_fairness_as_tenant, router_endpoints, otlp_endpoint, otlp_protocol, trace_sampled_per_mille,
           verbose) -> None:
    """Run the router: one OpenAI endpoint for the fleet."""
    from gpufleet_kit.kube.client import KubeClient
    from gpufleet_kit.kube.config import KubeConfig, KubeConfigError

    from .server import serve

    if body_budget_bytes < max_body_bytes:
        raise click.BadParameter(f"{body_budget_bytes} is less than --max-body-bytes ({max_body_bytes}): a body "
                                 f"under the per-request limit could never fit; raise it or lower --max-body-bytes.",
                                 param_hint="--body-budget-bytes")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = KubeConfig.auto(kubeconfig)
    except KubeConfigError as e:
        raise click.ClickException(str(e)) from None
    settings = RouterSettings(namespaces=tuple(namespaces), discovery=discovery,
                              discovery_interval=discovery_interval_seconds,
                              reading_interval=reading_interval_seconds, prefix_blocks=prefix_blocks,
                              load_factor=load_factor, tier_load_factor=tier_load_factor,
                              max_body_bytes=max_body_bytes, body_budget_bytes=body_budget_bytes,
                              drain_grace=drain_grace_seconds, hold_timeout=hold_timeout_seconds,
                              hold_max_requests=hold_max_requests, prefill_timeout=prefill_timeout_seconds,
                              policy=policy, resume_streams=resume_streams, max_resumptions=max_resumptions,
                              resume_timeout=resume_timeout_seconds, epp_port=epp_port,
                              epp_secure=epp_secure_serving, epp_cert_path=epp_cert_path, epp_fallbacks=epp_fallbacks,
                              epp_fairness_as_tenant=epp_fairness_as_tenant,
                              router_endpoints=endpoints_of(router_endpoints, os.environ.get("POD_IP"), port),
                              tracing=tracing_of(otlp_endpoint, otlp_protocol, trace_sampled_per_mille))

    if epp_cert_path and not epp_secure_serving:
        raise click.BadParameter("a certificate is for TLS; drop --no-epp-secure-serving or the path",
                                 param_hint="--epp-cert-path")
    if epp_cert_path:
        from .epp.tls import CertificateError, from_folder
        try:
            from_folder(epp_cert_path)
        except CertificateError as e:
            raise click.BadParameter(str(e), param_hint="--epp-cert-path") from None

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with KubeClient(config, connection_limit=connections_needed(settings.namespaces)) as kube:
            await serve(kube, settings, host, port, stop)

    asyncio.run(main())


def tracing_of(endpoint: str, protocol: str, per_mille: int) -> TracingConfig | None:
    """The router's tracing from its flags; None without an endpoint. Refused where this build cannot export."""
    if not endpoint.strip():
        return None
    from gpufleet_kit.tracing import otlp_problem
    problem = otlp_problem()
    if problem is not None:
        raise click.BadParameter(f"this build cannot export spans: {problem}; install opentelemetry-sdk and "
                                 f"opentelemetry-exporter-otlp, or leave the flag out", param_hint="--otlp-endpoint")
    return TracingConfig(endpoint=endpoint.strip(), protocol=protocol,  # type: ignore[arg-type]
                         sample_ratio=per_mille / 1000)


def endpoints_of(listed: str, pod_ip: str | None, port: int) -> tuple[str, ...]:
    """The router endpoints named (comma-separated host:port), else this pod's own address where known."""
    named = tuple(e.strip() for e in listed.split(",") if e.strip())
    for endpoint in named:
        host, sep, number = endpoint.rpartition(":")
        if not sep or not host or not number.isdigit():
            raise click.BadParameter(f"{endpoint!r} is not host:port", param_hint="--router-endpoints")
    if named:
        return named
    return (f"{pod_ip}:{port}",) if pod_ip else ()
